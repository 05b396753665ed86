/* checkpoint.c - the safetensors data path: each rank preads only the bytes of its own
 * chunk (validated offsets come from the Python index; see python/hsdp/checkpoint/) and
 * casts them to the storage dtype on the way in. The header is parsed in Python with json. */
#define _XOPEN_SOURCE 700 /* pread */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hsdp.h"

#ifndef HSDP_BOUNCE_BYTES /* the fuzz build makes it tiny, so the loop below runs many rounds */
#define HSDP_BOUNCE_BYTES ((size_t)4 << 20) /* bounded extra memory when a cast is needed */
#endif

hsdp_status hsdp_pread_exact(int fd, void *dst, size_t n, uint64_t off) {
    unsigned char *p = dst;
    while (n) {
        size_t want = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t got = pread(fd, p, want, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return hsdp_fail(HSDP_EIO, "read of %zu bytes at offset %llu failed: %s", n, (unsigned long long)off,
                             strerror(errno));
        }
        if (got == 0)
            return hsdp_fail(HSDP_EIO, "file ends before offset %llu (%zu bytes short)", (unsigned long long)off, n);
        p += got;
        n -= (size_t)got;
        off += (uint64_t)got;
    }
    return HSDP_OK;
}

hsdp_status hsdp_unit_read(hsdp_unit *u, size_t i, int fd, uint64_t tensor_off, hsdp_dtype src_dt,
                           size_t *nread) {
    *nread = 0;
    hsdp_status wst = hsdp_unit_check_writable(u);
    if (wst != HSDP_OK) return wst;
    if (i >= u->layout.nslots)
        return hsdp_fail(HSDP_EINVAL, "parameter index %zu is out of range (unit has %zu)", i, u->layout.nslots);
    const hsdp_slot *p = &u->layout.slots[i];
    size_t item = hsdp_dtype_size(p->dtype), src_item = hsdp_dtype_size(src_dt);
    if (src_item == 0) return hsdp_fail(HSDP_ETYPE, "unknown source dtype code %d", (int)src_dt);
    if (src_dt != p->dtype && !(hsdp_dtype_is_float(src_dt) && hsdp_dtype_is_float(p->dtype)))
        return hsdp_fail(HSDP_ETYPE, "cannot load %s data into a %s parameter", hsdp_dtype_name(src_dt),
                         hsdp_dtype_name(p->dtype));
    size_t b, e, chunk_off;
    if (!hsdp_layout_owned(&u->layout, i, u->s, &b, &e, &chunk_off)) return HSDP_OK;
    size_t first = b / item, count = (e - b) / item;
    /* Python validates offsets against the file, but this range must not wrap or pass
     * off_t's range on its own (a wrapped offset would read the wrong bytes). */
    uint64_t span = (uint64_t)(first + count) * src_item;
    if (tensor_off > (uint64_t)INT64_MAX - span)
        return hsdp_fail(HSDP_EINVAL, "tensor offset %llu plus its %llu bytes is past any file's end",
                         (unsigned long long)tensor_off, (unsigned long long)span);
    uint64_t off = tensor_off + (uint64_t)first * src_item;
    unsigned char *dst = u->shard + chunk_off;
    if (src_dt == p->dtype) { /* straight into the shard */
        hsdp_status st = hsdp_pread_exact(fd, dst, count * item, off);
        if (st == HSDP_OK) *nread = count * item;
        return st;
    }
    size_t per = HSDP_BOUNCE_BYTES / src_item;
    if (per > count) per = count;
    unsigned char *bounce = malloc(per * src_item); /* owned here, freed below */
    if (!bounce) return hsdp_fail(HSDP_ENOMEM, "could not allocate a %zu-byte read buffer", per * src_item);
    hsdp_status st = HSDP_OK;
    for (size_t done = 0; done < count && st == HSDP_OK; done += per) {
        size_t n = count - done < per ? count - done : per;
        st = hsdp_pread_exact(fd, bounce, n * src_item, off + (uint64_t)done * src_item);
        if (st == HSDP_OK) st = hsdp_cast(dst + done * item, p->dtype, bounce, src_dt, n);
        if (st == HSDP_OK) *nread += n * src_item;
    }
    free(bounce);
    return st;
}
