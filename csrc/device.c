/* device.c - unsharded buffers on host memory or on a backend's device, asked of the device
 * table (device.h); and device names, looked up in the registry's backends. */
#include <stdio.h>
#include <string.h>

#include "backend.h"

const hsdp_device_i *hsdp_backend_device(const hsdp_backend *b) {
    if (!b) return NULL;
    return b->device_now ? b->device_now() : b->device;
}

const hsdp_backend *hsdp_device_backend(const char *name) {
    for (size_t i = 0; name && i < hsdp_backend_count(); i++) {
        const hsdp_device_i *d = hsdp_backend_device(hsdp_backend_at(i));
        if (d && strcmp(d->name, name) == 0) return hsdp_backend_at(i);
    }
    return NULL;
}

int hsdp_device_parse(const char *name, hsdp_device *out, const char **label) {
    if (!name) return -1;
    const char *found = NULL;
    if (strcmp(name, "host") == 0) {
        *out = HSDP_DEVICE_HOST;
        found = "host";
    } else {
        const hsdp_backend *b = hsdp_device_backend(name);
        if (!b) return -1;
        *out = HSDP_DEVICE_BACKEND;
        found = hsdp_backend_device(b)->name;
    }
    if (label) *label = found;
    return 0;
}

const char *hsdp_device_choices(char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "'host'");
    for (size_t i = 0; i < hsdp_backend_count() && used < size; i++) {
        const hsdp_device_i *d = hsdp_backend_device(hsdp_backend_at(i));
        if (d) used += (size_t)snprintf(buf + used, size - used, ", '%s'", d->name);
    }
    return buf;
}

const char *hsdp_device_label(const hsdp_backend *b, hsdp_device device) {
    if (device == HSDP_DEVICE_HOST) return "host";
    const hsdp_device_i *d = hsdp_backend_device(b);
    return d ? d->name : "device";
}

void *hsdp_device_alloc(hsdp_stats *st, const hsdp_backend *b, hsdp_device device, size_t nbytes) {
    if (device == HSDP_DEVICE_HOST) return hsdp_buffer_alloc(st, nbytes);
    const hsdp_device_i *d = hsdp_backend_device(b);
    if (!d) {
        hsdp_fail(HSDP_EUNSUPPORTED, "backend '%s' has no device: it cannot allocate device buffers",
                  b ? b->name : "(none)");
        return NULL;
    }
    void *p = d->alloc(nbytes ? nbytes : 1);
    if (!p) {
        hsdp_fail(HSDP_ENOMEM, "backend '%s' could not allocate %zu bytes of %s memory", b->name, nbytes, d->name);
        return NULL;
    }
    hsdp_stats_count_alloc(st, nbytes);
    return p;
}

void hsdp_device_free(hsdp_stats *st, const hsdp_backend *b, hsdp_device device, void *p, size_t nbytes) {
    if (device == HSDP_DEVICE_HOST) {
        hsdp_buffer_free(st, p, nbytes);
    } else if (p) {
        hsdp_stats_count_free(st, nbytes);
        /* only a backend with a device allocated it (hsdp_device_alloc) */
        const hsdp_device_i *d = hsdp_backend_device(b);
        if (d) d->free(p, nbytes ? nbytes : 1);
    }
}

void hsdp_buffers_released(const hsdp_backend *b, hsdp_device device) {
    const hsdp_device_i *d = device != HSDP_DEVICE_HOST ? hsdp_backend_device(b) : NULL;
    if (d && d->released) d->released();
}
