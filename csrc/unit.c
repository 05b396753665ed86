/* unit.c - a unit's life: a sharded chunk in storage dtypes, an all-gather that rebuilds the
 * whole flat buffer, and the conversion of slots whose compute dtype (chosen by the caller's
 * framework) differs from their storage dtype. Collectives go through the backend table
 * only. The unsharded buffers are allocated by the caller so that their lifetime can follow
 * whoever holds views into them; the unit owns only its shard. A unit with a wire dtype
 * (hsdp_unit_set_wire) holds and sends its shard as block-scaled float8 and dequantizes
 * what it gathers, on the host, right after the collective. */
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

size_t hsdp_unit_shard_bytes(const hsdp_unit *u) {
    return u->wire_encoded ? u->wire_chunk_bytes : u->layout.chunk_bytes;
}

void hsdp_unit_free(hsdp_unit *u) {
    if (u->shard && u->stats) atomic_fetch_sub(&u->stats->sharded_bytes, hsdp_unit_shard_bytes(u));
    free(u->quant);
    u->quant = NULL;
    free(u->wire_blocks);
    u->wire_blocks = NULL;
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
    if (u->wire_encoded)
        return hsdp_fail(HSDP_ESTATE, "the unit's shard has been encoded as float8 for the wire, so it is fixed: "
                                      "write its parameters before it is encoded (the first gather encodes it)");
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
    if (u->share == hsdp_share_collective()) return st;
    if (hsdp_env_flag("HSDP_KEEP_HOST_SHARDS", 0)) return st;
    free(u->shard); /* the upload has read it: copies from host memory return once staged */
    u->shard = NULL;
    if (u->stats) atomic_fetch_sub(&u->stats->sharded_bytes, hsdp_unit_shard_bytes(u)); /* encoded or not */
    return st;
}

hsdp_status hsdp_unit_read_shard(hsdp_unit *u, void *out) {
    if (u->shard) {
        memcpy(out, u->shard, hsdp_unit_shard_bytes(u));
        return HSDP_OK;
    }
    return hsdp_share_read(u->group, u->share, out, hsdp_unit_shard_bytes(u));
}

/* ---------------------------------------------------------------- the wire encoding
 *
 * [Note: the wire] (docs/design.md and docs/user-guide.md, "Float8 on the wire", point here.)
 * wire_dtype=float8_e4m3fn holds and gathers a unit's floating parameters block-scaled: each
 * rank encodes its own shard once, when the unit is built (hsdp_quantize_blocks: blocks of
 * HSDP_WIRE_BLOCK consecutive weights of a parameter's piece, one float32 scale each, absmax /
 * 448, round to nearest even), and holds only the encoding. A gather moves the encodings and
 * decodes them into the storage dtype: on the host by dtype_float8.c's loops (on MPI chunk by
 * chunk as each lands, once its ticket agrees, [Note: agreement]), on a device by its own
 * decoder (NCCL: cuda_dequant.c's kernel; a device without one refuses the wire when the unit
 * is made). Everything that touches an encoded chunk (its size, the encoder, both decodes, the
 * CUDA segment plan) takes the one walk below, so none can disagree on where a piece's bytes
 * are. The error is bounded per weight (2^-4 of itself plus 2^-10 of its block's scale, then
 * one rounding); the documented bound on a model's output is a relative L2 error of 0.05
 * (docs/user-guide.md), the one `hsdp generate --verify` checks with a float8 wire.
 *
 * Rank s's encoded chunk: the float32 scales of all its blocks first, then its pieces of the
 * slots in layout order, a quantized piece as one float8 byte per element and any other as
 * its stored bytes; zeros after. The padding between slots is not sent (it is zero). Sizes
 * differ between ranks; every rank sends wire_chunk_bytes, the largest rounded up to
 * HSDP_ALIGN, so the all-gather keeps fixed-size blocks. */

int hsdp_wire_next(const hsdp_unit *u, int s, hsdp_wire_piece *p) {
    if (p->started) { /* past the piece it stands on */
        p->block += p->quant ? (p->n + HSDP_WIRE_BLOCK - 1) / HSDP_WIRE_BLOCK : 0;
        p->pay += p->quant ? p->n : p->bytes;
        p->slot++;
    }
    p->started = 1;
    for (; p->slot < u->layout.nslots; p->slot++) {
        size_t b, e, off;
        if (!hsdp_layout_owned(&u->layout, p->slot, s, &b, &e, &off)) continue;
        p->off = off;
        p->bytes = e - b;
        p->n = (e - b) / hsdp_dtype_size(u->layout.slots[p->slot].dtype);
        p->quant = u->quant[p->slot];
        return 1;
    }
    p->bytes = p->n = 0, p->quant = 0; /* nothing more to step past */
    return 0;
}

/* Rank s's blocks and encoded bytes (scales included). */
static size_t wire_size(const hsdp_unit *u, int s, size_t *nblocks) {
    hsdp_wire_piece p = {0};
    while (hsdp_wire_next(u, s, &p)) {
    }
    *nblocks = p.block;
    return p.block * sizeof(float) + p.pay;
}

hsdp_status hsdp_unit_set_wire(hsdp_unit *u, hsdp_dtype wire, const unsigned char *quant) {
    if (u->quant || u->wire_encoded) return hsdp_fail(HSDP_ESTATE, "the unit already has a wire dtype");
    if (u->share) return hsdp_fail(HSDP_ESTATE, "the unit has been gathered already: set its wire dtype before");
    if (wire != HSDP_F8E4M3)
        return hsdp_fail(HSDP_ETYPE, "the wire dtype must be float8_e4m3fn, got %s",
                         hsdp_dtype_name(wire) ? hsdp_dtype_name(wire) : "an unknown dtype");
    size_t n = u->layout.nslots, marked = 0;
    for (size_t i = 0; i < n; i++) {
        if (!quant[i]) continue;
        hsdp_dtype dt = u->layout.slots[i].dtype;
        if (dt != HSDP_F32 && dt != HSDP_F16 && dt != HSDP_BF16)
            return hsdp_fail(HSDP_ETYPE, "parameter %zu is stored as %s: only float32, float16 and bfloat16 "
                             "parameters are quantized for the wire", i, hsdp_dtype_name(dt));
        marked++;
    }
    if (marked == 0) return HSDP_OK; /* nothing to gain: the unit travels as it is stored */
    u->quant = malloc(n); /* owned by the unit until hsdp_unit_free */
    u->wire_blocks = malloc(sizeof *u->wire_blocks * (size_t)u->layout.shard); /* the same */
    if (!u->quant || !u->wire_blocks) {
        free(u->quant);
        free(u->wire_blocks);
        u->quant = NULL;
        u->wire_blocks = NULL;
        return hsdp_fail(HSDP_ENOMEM, "could not allocate the wire flags of %zu parameters", n);
    }
    for (size_t i = 0; i < n; i++) u->quant[i] = quant[i] ? 1 : 0;
    size_t w = 0;
    for (int s = 0; s < u->layout.shard; s++) {
        size_t ws = wire_size(u, s, &u->wire_blocks[s]);
        if (ws > w) w = ws;
    }
    u->wire_chunk_bytes = round_up(w, HSDP_ALIGN);
    return HSDP_OK;
}

hsdp_status hsdp_unit_encode(hsdp_unit *u) {
    if (!u->quant || u->wire_encoded) return HSDP_OK;
    hsdp_status st = hsdp_unit_check_writable(u); /* not gathered yet: no peer reads the shard */
    if (st != HSDP_OK) return st;
    size_t W = u->wire_chunk_bytes, nb = u->wire_blocks[u->s];
    /* Owned by the unit in place of the old shard (hsdp_unit_free, or the backend's
     * share_free once gathered). Zeroed: the tail past this rank's encoding is sent too. */
    unsigned char *enc = aligned_alloc(HSDP_ALIGN, W ? W : HSDP_ALIGN);
    if (!enc) return hsdp_fail(HSDP_ENOMEM, "could not allocate an encoded shard of %zu bytes", W);
    memset(enc, 0, W);
    float *scales = (float *)(void *)enc; /* aligned: enc is */
    unsigned char *payload = enc + nb * sizeof(float);
    hsdp_wire_piece p = {0};
    while (hsdp_wire_next(u, u->s, &p)) {
        if (!p.quant) {
            memcpy(payload + p.pay, u->shard + p.off, p.bytes);
            continue;
        }
        st = hsdp_quantize_blocks(payload + p.pay, scales + p.block, u->shard + p.off,
                                  u->layout.slots[p.slot].dtype, p.n);
        if (st != HSDP_OK) {
            free(enc);
            return st;
        }
    }
    free(u->shard); /* never gathered (checked above), so no peer holds it */
    u->shard = enc;
    u->wire_encoded = 1;
    atomic_fetch_sub(&u->stats->sharded_bytes, u->layout.chunk_bytes);
    atomic_fetch_add(&u->stats->sharded_bytes, W);
    return HSDP_OK;
}

/* Weights decoded between two calls of a decode's poll: about 3-20 us of work (AVX512-BF16 or
 * not), so that a backend polling its transfers in them keeps them moving (bench/bench_dequant.c). */
enum { DECODE_SLICE = 512 * HSDP_WIRE_BLOCK };

/* A gathered unit from this size on is decoded with streaming stores: larger than a core's
 * caches, so its first lines are gone from them by the time it is read, and streaming spares
 * the reads of the destination's lines (over TCP a 16 MiB unit's float8 gather was 0.12-0.45
 * ms faster with them in 11 rank-runs of a temporary A/B in the same processes). */
enum { DECODE_STREAM_BYTES = 8 << 20 };

/* Rank s's encoded chunk `w` into its chunk of `full`, as far as its first `landed` bytes allow,
 * resuming where *c stands (zeroed at the start) and calling poll(poll_arg) (when not NULL) after
 * every DECODE_SLICE weights. Nothing is decoded before every scale has landed (they come
 * first); a quantized run is decoded up to its last whole block landed (or its end), so every
 * call of hsdp_dequantize_blocks starts on its own scale, and each weight's value depends only
 * on its byte and its block's scale: the bytes come out the same however the chunk landed. */
static hsdp_status decode_prefix(const hsdp_unit *u, const unsigned char *w, void *full, int s, size_t landed,
                                 hsdp_wire_cursor *c, void (*poll)(void *), void *poll_arg) {
    size_t head = u->wire_blocks[s] * sizeof(float);
    if (c->done || landed < head) return HSDP_OK;
    const float *scales = (const float *)(const void *)w; /* memcpy'd inside: alignment not needed */
    const unsigned char *payload = w + head;
    unsigned char *out = (unsigned char *)full + (size_t)s * u->layout.chunk_bytes;
    int stream = u->layout.total_bytes >= DECODE_STREAM_BYTES;
    for (;;) {
        if (!c->have) {
            if (!hsdp_wire_next(u, s, &c->p)) break;
            c->have = 1, c->k = 0;
            if (c->p.off > c->at) { /* the padding between slots */
                memset(out + c->at, 0, c->p.off - c->at);
                c->at = c->p.off;
            }
        }
        const hsdp_wire_piece *p = &c->p;
        hsdp_dtype dt = u->layout.slots[p->slot].dtype;
        size_t avail = landed - head > p->pay ? landed - head - p->pay : 0; /* this piece's bytes landed */
        const unsigned char *pay = payload + p->pay;
        if (p->quant) {
            size_t item = hsdp_dtype_size(dt), upto = avail < p->n ? avail / HSDP_WIRE_BLOCK * HSDP_WIRE_BLOCK : p->n;
            /* in slices of whole blocks, so each slice starts on its own scale */
            for (size_t k = c->k; k < upto; k += DECODE_SLICE) {
                size_t m = upto - k < DECODE_SLICE ? upto - k : DECODE_SLICE;
                hsdp_status st = (stream ? hsdp_dequantize_blocks_streaming : hsdp_dequantize_blocks)(
                    out + p->off + k * item, dt, pay + k, scales + p->block + k / HSDP_WIRE_BLOCK, m);
                if (st != HSDP_OK) return st;
                c->k = k + m;
                if (poll) poll(poll_arg);
            }
            if (c->k < p->n) return HSDP_OK; /* the rest has not landed */
        } else {
            size_t upto = avail < p->bytes ? avail : p->bytes;
            if (upto > c->k) memcpy(out + p->off + c->k, pay + c->k, upto - c->k);
            c->k = upto > c->k ? upto : c->k;
            if (c->k < p->bytes) return HSDP_OK;
        }
        c->at = p->off + p->bytes;
        c->have = 0;
    }
    if (u->layout.chunk_bytes > c->at) memset(out + c->at, 0, u->layout.chunk_bytes - c->at);
    c->done = 1;
    return HSDP_OK;
}

/* The whole of rank s's encoded chunk `w` into its chunk of `full`. */
static hsdp_status decode_chunk(const hsdp_unit *u, const unsigned char *w, void *full, int s,
                                void (*poll)(void *), void *poll_arg) {
    hsdp_wire_cursor c = {0};
    return decode_prefix(u, w, full, s, u->wire_chunk_bytes, &c, poll, poll_arg);
}

hsdp_status hsdp_unit_decode(const hsdp_unit *u, const void *wire, void *full) {
    for (int s = 0; s < u->layout.shard; s++) {
        hsdp_status st = decode_chunk(u, (const unsigned char *)wire + (size_t)s * u->wire_chunk_bytes, full, s,
                                      NULL, NULL);
        if (st != HSDP_OK) return st;
    }
    return HSDP_OK;
}

/* The gathered encodings' buffer: accounted as unsharded while a gather holds it. */
static size_t wire_total(const hsdp_unit *u) { return u->wire_chunk_bytes * (size_t)u->layout.shard; }

size_t hsdp_unit_wire_bytes(const hsdp_unit *u) {
    return u->quant && u->layout.total_bytes ? wire_total(u) : 0;
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
    /* the dequantization, straight out of the gathered encodings, unless the backend
     * decoded every chunk as it landed (hsdp_unit_decode_landed) */
    if (r->wire && r->decoded != r->u->layout.shard) {
        hsdp_status st = hsdp_unit_decode(r->u, r->wire, r->full);
        if (st != HSDP_OK) return st;
    }
    return r->widened && !r->widened_landed ? hsdp_unit_widen(r->u, r->full, r->widened) : HSDP_OK;
}

/* Sets up the request; with a wire encoding, encodes the shard (first gather) and takes the
 * buffer the encodings arrive in: the caller's `wire`, or one allocated here. */
static hsdp_status req_init(hsdp_gather_req *r, hsdp_unit *u, void *full, void *widened, void *wire) {
    r->req.label = u->label;
    r->req.ident = u->ident;
    r->u = u;
    r->full = full;
    r->widened = u->widened_bytes ? widened : NULL; /* NULL: nothing to convert */
    r->wire = NULL;
    r->wire_owned = 0;
    r->decoded = 0;
    r->widened_landed = 0;
    atomic_fetch_add(&u->stats->gathers, 1);
    if (!u->quant || u->layout.total_bytes == 0) return HSDP_OK;
    hsdp_status st = hsdp_unit_encode(u);
    if (st != HSDP_OK) return st;
    if (wire) {
        r->wire = wire;
        return HSDP_OK;
    }
    r->wire = hsdp_buffer_alloc(u->stats, wire_total(u));
    r->wire_owned = r->wire != NULL;
    return r->wire ? HSDP_OK : HSDP_ENOMEM;
}

static void req_release(hsdp_gather_req *r) {
    if (r->wire && r->wire_owned) hsdp_buffer_free(r->u->stats, r->wire, wire_total(r->u));
    r->wire = NULL;
    r->wire_owned = 0;
}

/* ---- the float8 wire's gather, asked for by a backend that decodes it itself ----
 * The wire gather behind r (its `then` decodes), else NULL; the one place that knows a
 * request's `then` is a unit's conversion. A device backend (NCCL; the GPU side is
 * cuda_dequant.c) cannot run convert_job on the host: when the decode is the request's only
 * conversion (widened NULL) it enqueues that decode on its own stream after the gather. A
 * host backend that sees chunks land one by one (MPI) may decode each rank's chunk with
 * hsdp_unit_decode_landed as soon as it is in host memory, while the others are still in
 * flight; convert_job skips the decode once every chunk has been. */
hsdp_gather_req *hsdp_unit_landing_request(hsdp_req *r) {
    if (r->then != convert_job) return NULL;
    hsdp_gather_req *g = r->then_arg;
    return g->wire ? g : NULL;
}

hsdp_status hsdp_unit_decode_landed(hsdp_gather_req *r, int s, const void *chunk, void (*poll)(void *),
                                    void *poll_arg) {
    hsdp_status st = decode_chunk(r->u, chunk, r->full, s, poll, poll_arg);
    if (st == HSDP_OK) r->decoded++;
    return st;
}

hsdp_status hsdp_unit_decode_prefix(hsdp_gather_req *r, int s, const void *chunk, size_t landed, hsdp_wire_cursor *c,
                                    void (*poll)(void *), void *poll_arg) {
    int was = c->done;
    hsdp_status st = decode_prefix(r->u, chunk, r->full, s, landed, c, poll, poll_arg);
    if (st == HSDP_OK && c->done && !was) r->decoded++;
    return st;
}
/* ---- end of the float8 wire on a device backend ---- */

/* ---- widening as the chunks are read (hsdp.h: hsdp_unit_widen_request) ---- */
hsdp_gather_req *hsdp_unit_widen_request(hsdp_req *r) {
    if (r->then != convert_job) return NULL;
    hsdp_gather_req *g = r->then_arg;
    return g->widened && !g->wire ? g : NULL;
}

hsdp_status hsdp_unit_widen_piece(hsdp_gather_req *r, int s, size_t at, const void *src, size_t n) {
    const hsdp_unit *u = r->u;
    const unsigned char *in = src;
    unsigned char *full = r->full;
    /* In `full`'s offsets: [lo, hi) is the piece, [lo, done) what is already in place. */
    size_t lo = (size_t)s * u->layout.chunk_bytes + at, hi = lo + n, done = lo;
    for (size_t i = 0; i < u->layout.nslots && done < hi; i++) { /* slots lie in offset order */
        const hsdp_slot *p = &u->layout.slots[i];
        size_t b = p->offset > lo ? p->offset : lo, e = p->offset + p->nbytes < hi ? p->offset + p->nbytes : hi;
        if (u->widen_offset[i] == SIZE_MAX || b >= e) continue;
        if (b > done) memcpy(full + done, in + (done - lo), b - done);
        /* 64-aligned piece and slot starts: b - offset and e - b are whole elements */
        size_t item = hsdp_dtype_size(p->dtype), into = u->widen_offset[i] + (b - p->offset) / item *
                                                                                 hsdp_dtype_size(u->compute[i]);
        hsdp_status st = hsdp_cast((unsigned char *)r->widened + into, u->compute[i], in + (b - lo), p->dtype,
                                   (e - b) / item);
        if (st != HSDP_OK) return st;
        done = e;
    }
    if (hi > done) memcpy(full + done, in + (done - lo), hi - done);
    return HSDP_OK;
}

typedef hsdp_status (*gather_fn)(hsdp_req *, hsdp_group *, void **, const void *, void *, size_t,
                                 hsdp_status (*)(void *), void *);

/* How a unit's gather runs: started (its wait ends it); synchronous, a wire gather through
 * the backend's asynchronous slots where it has them; or synchronous on this thread, the
 * decode after the whole gather (hsdp_unit_gather: what the tests compare the others with). */
typedef enum { VIA_START, VIA_NOW, VIA_HERE } gather_via;

static hsdp_status unit_gather_via(gather_via via, hsdp_unit *u, void *full, void *widened, void *wire,
                                   hsdp_gather_req *r) {
    hsdp_status st = req_init(r, u, full, widened, wire);
    if (st != HSDP_OK) {
        req_release(r);
        return st;
    }
    void *recv = r->wire ? r->wire : full;
    size_t nbytes = r->wire ? u->wire_chunk_bytes : u->layout.chunk_bytes;
    /* A synchronous wire gather on a backend with asynchronous slots goes through them too
     * (hsdp_gather_through_slot): on NCCL the device decodes, and the wait orders the compute
     * stream after it (the host does not block); on MPI each chunk is decoded as it lands
     * (hsdp_unit_landing_request), on this thread while the worker is idle. So does a
     * widening gather on a direct path: each chunk is widened as it is read
     * (hsdp_unit_widen_request; a device backend's slots cannot convert on the host). */
    int direct = r->widened && hsdp_share_is_direct(u->group, u->share);
    int through_slot = via == VIA_NOW && (r->wire || direct) && u->group->backend->gather_start;
    gather_fn run = via == VIA_START ? hsdp_gather_start : through_slot ? hsdp_gather_through_slot : hsdp_gather_now;
    st = drop_host(u, run(&r->req, u->group, &u->share, u->shard, recv, nbytes,
                         (r->widened || r->wire) ? convert_job : NULL, r));
    /* nothing in flight after an error, nor after a synchronous gather */
    if (st != HSDP_OK || via != VIA_START) req_release(r);
    return st;
}

hsdp_status hsdp_unit_gather_start(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *r) {
    return unit_gather_via(VIA_START, u, full, widened, NULL, r);
}

hsdp_status hsdp_unit_gather_now(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *r) {
    return unit_gather_via(VIA_NOW, u, full, widened, NULL, r);
}

hsdp_status hsdp_unit_gather_start_wire(hsdp_unit *u, void *full, void *widened, void *wire, hsdp_gather_req *r) {
    return unit_gather_via(VIA_START, u, full, widened, wire, r);
}

hsdp_status hsdp_unit_gather_now_wire(hsdp_unit *u, void *full, void *widened, void *wire, hsdp_gather_req *r) {
    return unit_gather_via(VIA_NOW, u, full, widened, wire, r);
}

/* The synchronous gather without a conversion (widened NULL), through the same path as the
 * others, on this thread: a wire encoding is decoded on the host after the whole gather. */
hsdp_status hsdp_unit_gather(hsdp_unit *u, void *full) {
    hsdp_gather_req r;
    return unit_gather_via(VIA_HERE, u, full, NULL, NULL, &r);
}

hsdp_status hsdp_unit_gather_wait(hsdp_unit *u, hsdp_gather_req *r) {
    (void)u;
    hsdp_status st = hsdp_gather_wait(&r->req);
    req_release(r); /* done with it, whatever the status: the collective no longer runs */
    return st;
}
