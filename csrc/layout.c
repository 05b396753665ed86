/* layout.c - one unit's parameters laid end to end in a single byte buffer. Each parameter
 * starts on a 64-byte boundary and the total is padded to a multiple of 64 * S, so every
 * rank's chunk is 64-aligned and a chunk boundary never splits an element (itemsizes divide
 * 64). Rank s owns bytes [s * chunk, (s + 1) * chunk): an all-gather of the chunks rebuilds
 * the buffer in place and every parameter is a plain view into it. */
#include <stdlib.h>

#include "hsdp.h"

static size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

size_t hsdp_slot_align(size_t nbytes) {
    size_t a = HSDP_SLOT_ALIGN;
    while (a > HSDP_ALIGN && a > nbytes) a /= 2;
    return a;
}

hsdp_status hsdp_layout_init(hsdp_layout *l, const size_t *numels, const hsdp_dtype *dtypes,
                             size_t n, int shard) {
    l->nslots = 0;
    l->slots = NULL;
    l->used_bytes = l->total_bytes = l->chunk_bytes = 0;
    l->shard = shard;
    if (shard <= 0) return hsdp_fail(HSDP_EINVAL, "shard size must be positive, got %d", shard);
    if (n > 0) {
        l->slots = calloc(n, sizeof *l->slots); /* owned by the layout; hsdp_layout_free */
        if (!l->slots) return hsdp_fail(HSDP_ENOMEM, "could not allocate a layout of %zu parameters", n);
    }
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        size_t item = hsdp_dtype_size(dtypes[i]);
        if (item == 0) {
            hsdp_layout_free(l);
            return hsdp_fail(HSDP_ETYPE, "parameter %zu has an unknown dtype code %d", i, (int)dtypes[i]);
        }
        if (numels[i] > (SIZE_MAX / 2) / item) {
            hsdp_layout_free(l);
            return hsdp_fail(HSDP_EINVAL, "parameter %zu has too many elements (%zu)", i, numels[i]);
        }
        off = round_up(off, hsdp_slot_align(numels[i] * item));
        if (numels[i] * item > (SIZE_MAX / 4) - off) { /* the running total must not wrap */
            hsdp_layout_free(l);
            return hsdp_fail(HSDP_EINVAL, "the unit is too large: parameter %zu ends past %zu bytes", i, SIZE_MAX / 4);
        }
        l->slots[i] = (hsdp_slot){.offset = off, .nbytes = numels[i] * item, .numel = numels[i], .dtype = dtypes[i]};
        off += l->slots[i].nbytes;
    }
    l->nslots = n;
    l->used_bytes = off;
    l->total_bytes = round_up(off, (size_t)HSDP_ALIGN * (size_t)shard);
    l->chunk_bytes = l->total_bytes / (size_t)shard;
    return HSDP_OK;
}

void hsdp_layout_free(hsdp_layout *l) {
    free(l->slots);
    l->slots = NULL;
    l->nslots = 0;
}

int hsdp_layout_owned(const hsdp_layout *l, size_t i, int s, size_t *begin, size_t *end,
                      size_t *chunk_off) {
    const hsdp_slot *p = &l->slots[i];
    size_t c0 = (size_t)s * l->chunk_bytes, c1 = c0 + l->chunk_bytes;
    size_t p0 = p->offset, p1 = p->offset + p->nbytes;
    size_t lo = p0 > c0 ? p0 : c0, hi = p1 < c1 ? p1 : c1;
    if (lo >= hi) return 0;
    *begin = lo - p0;
    *end = hi - p0;
    *chunk_off = lo - c0;
    return 1;
}
