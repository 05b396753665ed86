/* unit.c - a unit's life: a sharded chunk in storage dtypes, an all-gather that rebuilds the
 * whole flat buffer, and the widening of dtypes NumPy cannot compute in. The unsharded
 * buffers themselves are allocated by the caller (hsdp_buffer_alloc) so that their lifetime
 * can follow whoever holds views into them; the unit owns only its shard. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "exec.h"
#include "hsdp.h"

static size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

hsdp_status hsdp_unit_init(hsdp_unit *u, const size_t *numels, const hsdp_dtype *dtypes,
                           size_t n, hsdp_group *group, hsdp_stats *stats) {
    memset(u, 0, sizeof *u);
    hsdp_status st = hsdp_layout_init(&u->layout, numels, dtypes, n, group->size);
    if (st != HSDP_OK) return st;
    u->group = group;
    u->s = group->rank;
    /* Owned by the unit until hsdp_unit_free. Zeroed so padding and not-yet-loaded
     * parameters gather as zeros, never as garbage. */
    u->shard = aligned_alloc(HSDP_ALIGN, u->layout.chunk_bytes ? u->layout.chunk_bytes : HSDP_ALIGN);
    u->widen_offset = malloc((n ? n : 1) * sizeof *u->widen_offset); /* owned by the unit */
    if (!u->shard || !u->widen_offset) {
        size_t chunk = u->layout.chunk_bytes;
        hsdp_unit_free(u);
        return hsdp_fail(HSDP_ENOMEM, "could not allocate a shard of %zu bytes", chunk);
    }
    memset(u->shard, 0, u->layout.chunk_bytes);
    u->stats = stats; /* set only now: hsdp_unit_free un-counts the shard of a unit that has one */
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        hsdp_dtype dt = u->layout.slots[i].dtype;
        hsdp_dtype ct = hsdp_dtype_compute(dt);
        if (ct == dt) {
            u->widen_offset[i] = SIZE_MAX;
            continue;
        }
        w = round_up(w, HSDP_ALIGN);
        u->widen_offset[i] = w;
        w += u->layout.slots[i].numel * hsdp_dtype_size(ct);
    }
    u->widened_bytes = w;
    atomic_fetch_add(&stats->sharded_bytes, u->layout.chunk_bytes);
    return HSDP_OK;
}

void hsdp_unit_free(hsdp_unit *u) {
    if (u->shard && u->stats) atomic_fetch_sub(&u->stats->sharded_bytes, u->layout.chunk_bytes);
    free(u->shard);
    free(u->widen_offset);
    hsdp_layout_free(&u->layout);
    u->shard = NULL;
    u->widen_offset = NULL;
}

hsdp_status hsdp_unit_write(hsdp_unit *u, size_t i, size_t first, size_t count, const void *src,
                            hsdp_dtype src_dt) {
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

hsdp_status hsdp_unit_gather(hsdp_unit *u, void *full) {
    atomic_fetch_add(&u->stats->gathers, 1);
    if (u->layout.total_bytes == 0) return HSDP_OK;
    return hsdp_all_gather(u->group, u->shard, full, u->layout.chunk_bytes);
}

hsdp_status hsdp_unit_widen(const hsdp_unit *u, const void *full, void *widened) {
    for (size_t i = 0; i < u->layout.nslots; i++) {
        if (u->widen_offset[i] == SIZE_MAX) continue;
        const hsdp_slot *p = &u->layout.slots[i];
        hsdp_status st = hsdp_cast((unsigned char *)widened + u->widen_offset[i], hsdp_dtype_compute(p->dtype),
                                   (const unsigned char *)full + p->offset, p->dtype, p->numel);
        if (st != HSDP_OK) return st;
    }
    return HSDP_OK;
}

static hsdp_status gather_job(void *arg) {
    hsdp_gather_req *r = arg;
    hsdp_status st = hsdp_unit_gather(r->u, r->full);
    if (st == HSDP_OK && r->u->widened_bytes) st = hsdp_unit_widen(r->u, r->full, r->widened);
    return st;
}

static void req_init(hsdp_gather_req *req, hsdp_unit *u, void *full, void *widened) {
    req->u = u;
    req->full = full;
    req->widened = widened;
    req->exec = u->group->exec;
    req->task.fn = gather_job;
    req->task.arg = req;
}

hsdp_status hsdp_unit_gather_start(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *req) {
    req_init(req, u, full, widened);
    hsdp_exec_submit(req->exec, &req->task);
    return HSDP_OK;
}

hsdp_status hsdp_unit_gather_now(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *req) {
    req_init(req, u, full, widened);
    return hsdp_exec_call(req->exec, &req->task);
}

hsdp_status hsdp_unit_gather_wait(hsdp_unit *u, hsdp_gather_req *req) {
    (void)u;
    return hsdp_task_wait(req->exec, &req->task);
}

int hsdp_unit_gather_done(const hsdp_gather_req *req) { return hsdp_task_done(&req->task); }

void hsdp_unit_gather_times(const hsdp_gather_req *req, uint64_t *submit_ns, uint64_t *start_ns,
                            uint64_t *end_ns) {
    *submit_ns = req->task.submit_ns;
    *start_ns = req->task.start_ns;
    *end_ns = req->task.end_ns;
}
