/* check.h - the smallest test harness: CHECK counts, prints failures with file:line, and
 * check_report() prints the closing "N passed, N failed" line and the exit status. */
#ifndef HSDP_CHECK_H
#define HSDP_CHECK_H
#include <stdio.h>

static int check_passed, check_failed;

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (cond) {                                                              \
            check_passed++;                                                      \
        } else {                                                                 \
            check_failed++;                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                        \
    } while (0)

static inline int check_report(void) {
    printf("%d passed, %d failed\n", check_passed, check_failed);
    return check_failed ? 1 : 0;
}
#endif
