/* unit.c - a unit's life: a sharded chunk in storage dtypes, an all-gather that rebuilds the
 * whole flat buffer, and the conversion of slots whose compute dtype (chosen by the caller's
 * framework) differs from their storage dtype. Collectives go through the backend table
 * only. The unsharded buffers are allocated by the caller so that their lifetime can follow
 * whoever holds views into them; the unit owns only its shard. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

static size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

hsdp_status hsdp_unit_init(hsdp_unit *u, const size_t *numels, const hsdp_dtype *dtypes,
                           const hsdp_dtype *compute, size_t n, hsdp_group *group, hsdp_stats *stats) {
    memset(u, 0, sizeof *u);
    hsdp_status st = hsdp_layout_init(&u->layout, numels, dtypes, n, group->size);
    if (st != HSDP_OK) return st;
    u->group = group;
    u->s = group->rank;
    u->ident = ++group->units_made;
    /* Owned by the unit until hsdp_unit_free. Zeroed so padding and not-yet-loaded
     * parameters gather as zeros, never as garbage. */
    u->shard = aligned_alloc(HSDP_ALIGN, u->layout.chunk_bytes ? u->layout.chunk_bytes : HSDP_ALIGN);
    u->widen_offset = malloc((n ? n : 1) * sizeof *u->widen_offset); /* owned by the unit */
    u->compute = malloc((n ? n : 1) * sizeof *u->compute);            /* owned by the unit */
    if (!u->shard || !u->widen_offset || !u->compute) {
        size_t chunk = u->layout.chunk_bytes;
        hsdp_unit_free(u);
        return hsdp_fail(HSDP_ENOMEM, "could not allocate a shard of %zu bytes", chunk);
    }
    memset(u->shard, 0, u->layout.chunk_bytes);
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        hsdp_dtype dt = u->layout.slots[i].dtype;
        hsdp_dtype ct = compute ? compute[i] : dt;
        if (ct != dt && !(hsdp_dtype_is_float(ct) && hsdp_dtype_is_float(dt))) {
            hsdp_unit_free(u);
            return hsdp_fail(HSDP_ETYPE, "parameter %zu is stored as %s and cannot be computed in %s", i,
                             hsdp_dtype_name(dt), hsdp_dtype_name(ct) ? hsdp_dtype_name(ct) : "an unknown dtype");
        }
        u->compute[i] = ct;
        /* Nothing to convert in an empty slot: its (empty) view is the gathered buffer's. */
        if (ct == dt || u->layout.slots[i].numel == 0) {
            u->widen_offset[i] = SIZE_MAX;
            continue;
        }
        w = round_up(w, HSDP_ALIGN);
        size_t numel = u->layout.slots[i].numel, item = hsdp_dtype_size(ct);
        if (numel > (SIZE_MAX / 4) / item || numel * item > (SIZE_MAX / 4) - w) {
            hsdp_unit_free(u);
            return hsdp_fail(HSDP_EINVAL, "the unit's %s copy is too large at parameter %zu", hsdp_dtype_name(ct), i);
        }
        u->widen_offset[i] = w;
        w += numel * item;
    }
    u->widened_bytes = w;
    u->stats = stats; /* set only now: hsdp_unit_free un-counts the shard of a unit that has one */
    atomic_fetch_add(&stats->sharded_bytes, u->layout.chunk_bytes);
    return HSDP_OK;
}

void hsdp_unit_free(hsdp_unit *u) {
    if (u->shard && u->stats) atomic_fetch_sub(&u->stats->sharded_bytes, u->layout.chunk_bytes);
    /* A shard peers may read directly is freed by the backend once none can still be reading. */
    hsdp_share_free(u->group, u->share, u->shard);
    u->share = NULL;
    free(u->widen_offset);
    free(u->compute);
    hsdp_layout_free(&u->layout);
    u->shard = NULL;
    u->widen_offset = NULL;
    u->compute = NULL;
}

hsdp_status hsdp_unit_check_writable(const hsdp_unit *u) {
    if (u->share)
        return hsdp_fail(HSDP_ESTATE, "the unit has been gathered, so its shard is fixed: its peers may read it "
                                      "at any time, and a write now would reach some of their gathers and not others");
    return HSDP_OK;
}

hsdp_status hsdp_unit_write(hsdp_unit *u, size_t i, size_t first, size_t count, const void *src,
                            hsdp_dtype src_dt) {
    hsdp_status st = hsdp_unit_check_writable(u);
    if (st != HSDP_OK) return st;
    if (i >= u->layout.nslots)
        return hsdp_fail(HSDP_EINVAL, "parameter index %zu is out of range (unit has %zu)", i, u->layout.nslots);
    const hsdp_slot *p = &u->layout.slots[i];
    if (first > p->numel || count > p->numel - first)
        return hsdp_fail(HSDP_EINVAL, "elements [%zu, %zu) are outside a parameter of %zu elements",
                         first, first + count, p->numel);
    size_t item = hsdp_dtype_size(p->dtype), src_item = hsdp_dtype_size(src_dt);
    if (src_item == 0) return hsdp_fail(HSDP_ETYPE, "unknown source dtype code %d", (int)src_dt);
    size_t b, e, chunk_off;
    if (!hsdp_layout_owned(&u->layout, i, u->s, &b, &e, &chunk_off)) return HSDP_OK;
    /* Intersect the owned elements with the written ones. */
    size_t ob = b / item, oe = e / item;
    size_t lo = first > ob ? first : ob, hi = first + count < oe ? first + count : oe;
    if (lo >= hi) return HSDP_OK;
    unsigned char *dst = u->shard + chunk_off + (lo - ob) * item;
    const unsigned char *s = (const unsigned char *)src + (lo - first) * src_item;
    return hsdp_cast(dst, p->dtype, s, src_dt, hi - lo);
}

/* After a gather: once the backend holds its own copy of the chunk (NCCL: on the device), the
 * host chunk is dropped, unless HSDP_KEEP_HOST_SHARDS=1. It can no longer be written (the
 * share fixes it), gathers read the backend's copy, and readers of the chunk itself
 * (Unit.shard_bytes) read it back from there (hsdp_share_read). */
static hsdp_status drop_host(hsdp_unit *u, hsdp_status st) {
    if (st != HSDP_OK || !u->shard || !u->share || !u->group->backend->share_read) return st;
    if (strcmp(hsdp_share_kind(u->group, u->share), "collective") == 0) return st;
    const char *keep = getenv("HSDP_KEEP_HOST_SHARDS");
    if (keep && strcmp(keep, "1") == 0) return st;
    free(u->shard); /* the upload has read it: copies from host memory return once staged */
    u->shard = NULL;
    if (u->stats) atomic_fetch_sub(&u->stats->sharded_bytes, u->layout.chunk_bytes);
    return st;
}

hsdp_status hsdp_unit_read_shard(hsdp_unit *u, void *out) {
    if (u->shard) {
        memcpy(out, u->shard, u->layout.chunk_bytes);
        return HSDP_OK;
    }
    return hsdp_share_read(u->group, u->share, out, u->layout.chunk_bytes);
}

hsdp_status hsdp_unit_gather(hsdp_unit *u, void *full) {
    atomic_fetch_add(&u->stats->gathers, 1);
    if (u->layout.total_bytes == 0) return HSDP_OK;
    return drop_host(u, hsdp_gather_fixed(u->group, &u->share, u->shard, full, u->layout.chunk_bytes, u->label, u->ident));
}

hsdp_status hsdp_unit_widen(const hsdp_unit *u, const void *full, void *widened) {
    for (size_t i = 0; i < u->layout.nslots; i++) {
        if (u->widen_offset[i] == SIZE_MAX) continue;
        const hsdp_slot *p = &u->layout.slots[i];
        hsdp_status st = hsdp_cast((unsigned char *)widened + u->widen_offset[i], u->compute[i],
                                   (const unsigned char *)full + p->offset, p->dtype, p->numel);
        if (st != HSDP_OK) return st;
    }
    return HSDP_OK;
}

/* `then` of a unit's gather: the conversion, on the backend's completion context. */
static hsdp_status convert_job(void *arg) {
    hsdp_gather_req *r = arg;
    return hsdp_unit_widen(r->u, r->full, r->widened);
}

static void req_init(hsdp_gather_req *r, hsdp_unit *u, void *full, void *widened) {
    r->req.label = u->label;
    r->req.ident = u->ident;
    r->u = u;
    r->full = full;
    r->widened = widened;
    atomic_fetch_add(&u->stats->gathers, 1);
}

hsdp_status hsdp_unit_gather_start(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *r) {
    req_init(r, u, full, widened);
    return drop_host(u, hsdp_gather_start(&r->req, u->group, &u->share, u->shard, full, u->layout.chunk_bytes,
                                          u->widened_bytes ? convert_job : NULL, r));
}

hsdp_status hsdp_unit_gather_now(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *r) {
    req_init(r, u, full, widened);
    return drop_host(u, hsdp_gather_now(&r->req, u->group, &u->share, u->shard, full, u->layout.chunk_bytes,
                                        u->widened_bytes ? convert_job : NULL, r));
}

hsdp_status hsdp_unit_gather_wait(hsdp_unit *u, hsdp_gather_req *r) {
    (void)u;
    return hsdp_gather_wait(&r->req);
}
