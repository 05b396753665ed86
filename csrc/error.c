/* error.c - the thread-local last-error message behind hsdp_fail / hsdp_last_error. */
#include <stdarg.h>
#include <stdio.h>

#include "hsdp.h"

static _Thread_local char last_error[1024];

const char *hsdp_last_error(void) { return last_error[0] ? last_error : "unknown hsdp error"; }

hsdp_status hsdp_fail(hsdp_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return st;
}
