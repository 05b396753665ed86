/* backend.c - the one place backends are registered, and the collectives as the rest of the
 * core calls them. A backend's own file decides how a call runs (MPI: on its worker thread);
 * this file only dispatches, and runs a started gather inline for a backend that has no
 * asynchronous slots. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h> /* strcasecmp */
#include <time.h>

#include "backend.h"

uint64_t hsdp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---------------------------------------------------------------- the registry */
/* Built from backends.def; a test-only backend not linked is NULL there (backend.h), left out. */
static const hsdp_backend *const registry[] = {
#define HSDP_BACKEND(name) &hsdp_backend_##name,
#define HSDP_TEST_BACKEND(name) &hsdp_backend_##name,
#include "backends.def"
};
#define NSLOTS (sizeof registry / sizeof registry[0])

size_t hsdp_backend_count(void) {
    size_t n = 0;
    for (size_t i = 0; i < NSLOTS; i++) n += registry[i] != NULL;
    return n;
}

const hsdp_backend *hsdp_backend_at(size_t i) {
    for (size_t j = 0; j < NSLOTS; j++)
        if (registry[j] && i-- == 0) return registry[j];
    return NULL;
}

const hsdp_backend *hsdp_backend_find(const char *name) {
    for (size_t i = 0; name && i < NSLOTS; i++)
        if (registry[i] && strcmp(registry[i]->name, name) == 0) return registry[i];
    return NULL;
}

hsdp_status hsdp_backend_world(const char *name, hsdp_group **out, int *we_init) {
    *out = NULL;
    *we_init = 0;
    const hsdp_backend *b = hsdp_backend_find(name);
    if (!b) {
        char known[128] = "";
        size_t used = 0;
        for (size_t i = 0; i < hsdp_backend_count() && used < sizeof known; i++)
            used += (size_t)snprintf(known + used, sizeof known - used, "%s'%s'", i ? ", " : "", hsdp_backend_at(i)->name);
        return hsdp_fail(HSDP_EINVAL, "unknown backend '%s'; expected one of %s", name ? name : "(null)", known);
    }
    const char *why = NULL;
    if (!b->usable(&why)) return hsdp_fail(HSDP_EUNSUPPORTED, "%s", why);
    return b->world(out, we_init);
}

hsdp_status hsdp_backend_finalize(const char *name) {
    const hsdp_backend *b = hsdp_backend_find(name);
    if (!b) return hsdp_fail(HSDP_EINVAL, "unknown backend '%s'", name ? name : "(null)");
    return b->finalize ? b->finalize() : HSDP_OK;
}

/* ---------------------------------------------------------------- dispatch */
hsdp_status hsdp_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    return g->backend->all_gather(g, send, recv, nbytes);
}

hsdp_status hsdp_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    return g->backend->broadcast(g, buf, nbytes, root);
}

hsdp_status hsdp_barrier(hsdp_group *g) { return g->backend->barrier(g); }

hsdp_status hsdp_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    if (nbytes && (size_t)g->size > SIZE_MAX / nbytes)
        return hsdp_fail(HSDP_EINVAL, "an all-to-all of %zu bytes per rank over %d ranks overflows", nbytes, g->size);
    const char *s = send, *r = recv;
    size_t total = nbytes * (size_t)g->size;
    if (total && s < r + total && r < s + total)
        return hsdp_fail(HSDP_EINVAL, "all-to-all send and recv buffers overlap");
    return g->backend->all_to_all(g, send, recv, nbytes);
}

/* Checks a sendrecv's arguments; *self is set when the message goes to and from this rank. */
static hsdp_status sendrecv_check(hsdp_group *g, const void *send, size_t sbytes, int dest, const void *recv,
                                  size_t rbytes, int source, int *self) {
    if (dest < 0 || dest >= g->size)
        return hsdp_fail(HSDP_EINVAL, "sendrecv: dest=%d is outside a group of %d ranks", dest, g->size);
    if (source < 0 || source >= g->size)
        return hsdp_fail(HSDP_EINVAL, "sendrecv: source=%d is outside a group of %d ranks", source, g->size);
    const char *s = send, *r = recv;
    if (sbytes && rbytes && s < r + rbytes && r < s + sbytes)
        return hsdp_fail(HSDP_EINVAL, "sendrecv: the send and recv buffers overlap");
    int to_self = dest == g->rank && source == g->rank;
    if (to_self && sbytes != rbytes)
        return hsdp_fail(HSDP_EINVAL, "sendrecv to this rank itself: sends %zu bytes but receives %zu", sbytes, rbytes);
    if (!to_self && (dest == g->rank || source == g->rank))
        return hsdp_fail(HSDP_EINVAL, "sendrecv: rank %d sends to %d and receives from %d; either both are this "
                                      "rank or neither is", g->rank, dest, source);
    /* A backend with the slot sends to itself too (its buffers may be device memory); a
     * backend without one has host memory only, copied here. */
    *self = to_self && !g->backend->sendrecv;
    if (!*self && !g->backend->sendrecv)
        return hsdp_fail(HSDP_EUNSUPPORTED, "backend '%s' has no point-to-point sendrecv (ring attention needs it)",
                         g->backend->name);
    return HSDP_OK;
}

hsdp_status hsdp_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                          int source) {
    int self = 0;
    hsdp_status st = sendrecv_check(g, send, sbytes, dest, recv, rbytes, source, &self);
    if (st != HSDP_OK) return st;
    if (self) {
        if (rbytes) memcpy(recv, send, rbytes);
        return HSDP_OK;
    }
    return g->backend->sendrecv(g, send, sbytes, dest, recv, rbytes, source);
}

size_t hsdp_blocks_bytes(const hsdp_blocks *b, int size, size_t *span) {
    if (b->ndims < 0 || b->ndims > HSDP_BLOCK_DIMS || size < 1) {
        hsdp_fail(HSDP_EINVAL, "a block layout has %d dimensions (at most %d)", b->ndims, HSDP_BLOCK_DIMS);
        return 0;
    }
    size_t n = b->inner, last = b->inner; /* bytes per block; end of a block's last byte */
    for (int k = 0; k < b->ndims; k++) {
        if (!b->count[k] || (n && b->count[k] > SIZE_MAX / n) ||
            (b->stride[k] && b->count[k] - 1 > (SIZE_MAX / 4) / b->stride[k])) {
            hsdp_fail(HSDP_EINVAL, "a block layout's dimension %d (count %zu, stride %zu) overflows", k, b->count[k],
                      b->stride[k]);
            return 0;
        }
        n *= b->count[k];
        last += (b->count[k] - 1) * b->stride[k];
    }
    if (b->step && (size_t)(size - 1) > (SIZE_MAX / 4) / b->step) {
        hsdp_fail(HSDP_EINVAL, "a block layout's step %zu overflows over %d blocks", b->step, size);
        return 0;
    }
    *span = (size_t)(size - 1) * b->step + last;
    return n;
}

/* Packs (dir 0) or unpacks (dir 1) one block between its layout and contiguous bytes. */
static void copy_block(char *base, const hsdp_blocks *b, char *flat, int dir) {
    size_t idx[HSDP_BLOCK_DIMS] = {0}, total = 1;
    for (int k = 0; k < b->ndims; k++) total *= b->count[k];
    for (size_t r = 0; r < total; r++) {
        size_t off = 0;
        for (int k = 0; k < b->ndims; k++) off += idx[k] * b->stride[k];
        if (dir == 0)
            memcpy(flat, base + off, b->inner);
        else
            memcpy(base + off, flat, b->inner);
        flat += b->inner;
        for (int k = b->ndims - 1; k >= 0; k--) { /* the innermost index moves fastest */
            if (++idx[k] < b->count[k]) break;
            idx[k] = 0;
        }
    }
}

hsdp_status hsdp_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
                                   const hsdp_blocks *r) {
    size_t sspan, rspan;
    size_t sn = hsdp_blocks_bytes(s, g->size, &sspan);
    if (!sn && s->inner) return HSDP_EINVAL;
    size_t rn = hsdp_blocks_bytes(r, g->size, &rspan);
    if (!rn && r->inner) return HSDP_EINVAL;
    if (sn != rn)
        return hsdp_fail(HSDP_EINVAL, "an all-to-all sends blocks of %zu bytes but receives blocks of %zu", sn, rn);
    if (!sn) return HSDP_OK;
    const char *sp = send, *rp = recv;
    if (sp < rp + rspan && rp < sp + sspan) return hsdp_fail(HSDP_EINVAL, "all-to-all send and recv buffers overlap");
    if (g->backend->all_to_all_blocks) return g->backend->all_to_all_blocks(g, send, s, recv, r);
    /* No packing in the backend: through two contiguous host buffers */
    size_t total = sn * (size_t)g->size;
    char *a = malloc(total), *b = malloc(total); /* owned here, freed below */
    hsdp_status st = a && b ? HSDP_OK : hsdp_fail(HSDP_ENOMEM, "could not allocate %zu bytes to pack an all-to-all", total);
    for (int j = 0; st == HSDP_OK && j < g->size; j++) copy_block((char *)send + (size_t)j * s->step, s, a + (size_t)j * sn, 0);
    if (st == HSDP_OK) st = g->backend->all_to_all(g, a, b, sn);
    for (int j = 0; st == HSDP_OK && j < g->size; j++) copy_block((char *)recv + (size_t)j * r->step, r, b + (size_t)j * sn, 1);
    free(a);
    free(b);
    return st;
}

hsdp_status hsdp_group_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    return g->backend->split(g, color, key, out);
}

void hsdp_group_free(hsdp_group *g) {
    if (g) g->backend->free(g);
}

int hsdp_group_overlaps(const hsdp_group *g) { return g->backend->overlaps ? g->backend->overlaps(g) : 0; }

/* ---------------------------------------------------------------- HSDP_* flags */
static int word_is(const char *v, const char *const *words) {
    for (; *words; words++)
        if (strcasecmp(v, *words) == 0) return 1;
    return 0;
}

int hsdp_env_flag(const char *name, int dflt) {
    static const char *const on[] = {"1", "on", "yes", "true", NULL};
    static const char *const off[] = {"0", "off", "no", "false", NULL};
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    if (word_is(v, on)) return 1;
    if (word_is(v, off)) return 0;
    fprintf(stderr, "hsdp: %s must be 1/on/yes/true or 0/off/no/false, got '%s'; using %d\n", name, v, dflt);
    return dflt;
}

/* ---------------------------------------------------------------- the collective timeout */
/* 0: no limit. Set from HSDP_TIMEOUT (seconds) on first use, or by hsdp_set_timeout. */
static _Atomic uint64_t timeout_ns;
static atomic_int timeout_read;

static uint64_t env_timeout_ns(void) {
    const char *v = getenv("HSDP_TIMEOUT");
    if (!v || !*v) return (uint64_t)HSDP_DEFAULT_TIMEOUT_S * 1000000000ull;
    char *end = NULL;
    double s = strtod(v, &end);
    if (end == v || *end || !(s >= 0) || s > 1e9) {
        fprintf(stderr, "hsdp: HSDP_TIMEOUT must be a number of seconds >= 0 (0: no limit), got '%s'; "
                        "using the default %d s\n", v, HSDP_DEFAULT_TIMEOUT_S);
        return (uint64_t)HSDP_DEFAULT_TIMEOUT_S * 1000000000ull;
    }
    return (uint64_t)(s * 1e9);
}

uint64_t hsdp_timeout_ns(void) {
    if (!atomic_load(&timeout_read)) {
        atomic_store(&timeout_ns, env_timeout_ns());
        atomic_store(&timeout_read, 1);
    }
    return atomic_load(&timeout_ns);
}

hsdp_status hsdp_set_timeout(double seconds) {
    if (!(seconds >= 0) || seconds > 1e9)
        return hsdp_fail(HSDP_EINVAL, "the collective timeout must be a number of seconds >= 0 (0: no limit), got %g",
                         seconds);
    atomic_store(&timeout_ns, (uint64_t)(seconds * 1e9));
    atomic_store(&timeout_read, 1);
    return HSDP_OK;
}

/* Stored as mode ^ 1 so that zero-initialised means the default, on (1). */
static atomic_int agreement_mode;
void hsdp_set_agreement_check(int mode) { atomic_store(&agreement_mode, mode ^ 1); }
int hsdp_agreement_check(void) { return atomic_load(&agreement_mode) ^ 1; }

static atomic_size_t wire_piece_bytes; /* 0: one message */
void hsdp_set_wire_piece_bytes(size_t bytes) { atomic_store(&wire_piece_bytes, bytes); }
size_t hsdp_wire_piece_bytes(void) { return atomic_load(&wire_piece_bytes); }

/* The share of a fixed chunk that is always gathered collectively (any backend). */
static char collective_share;
void *hsdp_share_collective(void) { return &collective_share; }

hsdp_status hsdp_gather_fixed(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                              const char *label, uint64_t ident) {
    if (g->backend->gather_unit) return g->backend->gather_unit(g, share, send, recv, nbytes, label, ident);
    if (g->backend->gather_fixed) return g->backend->gather_fixed(g, share, send, recv, nbytes, label);
    hsdp_status st = hsdp_all_gather(g, send, recv, nbytes);
    /* Fixed from now on whatever the backend, so that what a unit allows never depends on it. */
    if (st == HSDP_OK) *share = &collective_share;
    return st;
}

void hsdp_share_free(hsdp_group *g, void *share, void *memory) {
    if (!share || share == &collective_share || !g->backend->share_free)
        free(memory);
    else
        g->backend->share_free(g, share, memory);
}

const char *hsdp_share_kind(const hsdp_group *g, const void *share) {
    if (!share) return "unset";
    if (share == &collective_share) return "collective";
    /* anything else a backend keeps there is how it reaches the chunks without the peers */
    return g->backend->share_kind ? g->backend->share_kind(share) : "direct"; /* hsdp_share_is_direct */
}

int hsdp_share_is_direct(const hsdp_group *g, const void *share) {
    /* a backend with no kind of its own reaches the peers' chunks directly (MPI's reads) */
    return share && share != &collective_share && !g->backend->share_kind;
}

hsdp_status hsdp_share_read(hsdp_group *g, const void *share, void *out, size_t nbytes) {
    if (!share || share == &collective_share || !g->backend->share_read)
        return hsdp_fail(HSDP_ESTATE, "backend '%s' keeps no copy of this chunk to read back", g->backend->name);
    return g->backend->share_read(g, share, out, nbytes);
}

static void req_reset(hsdp_req *r, hsdp_group *g, void **share, hsdp_status (*then)(void *), void *then_arg) {
    r->g = g;
    r->share = share;
    r->then = then;
    r->then_arg = then_arg;
    r->status = HSDP_OK;
    r->err[0] = '\0';
    r->submit_ns = hsdp_now_ns();
    r->start_ns = r->end_ns = 0;
    r->backend_owned = 0;
    r->now = 0;
}

/* The gather and `then` on this thread, recorded in r. */
static void run_here(hsdp_req *r, const void *send, void *recv, size_t nbytes) {
    r->start_ns = hsdp_now_ns();
    /* Zero bytes on every rank of the group (one layout): no collective at all. */
    hsdp_status st = HSDP_OK;
    if (nbytes)
        st = r->share ? hsdp_gather_fixed(r->g, r->share, send, recv, nbytes, r->label, r->ident)
                      : hsdp_all_gather(r->g, send, recv, nbytes);
    if (st == HSDP_OK && r->then) st = r->then(r->then_arg);
    r->end_ns = hsdp_now_ns();
    r->status = st;
    if (st != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", hsdp_last_error());
}

/* The started gather; `now`: its wait follows at once, so the backend may run it on the
 * caller's thread (hsdp_gather_through_slot). */
static hsdp_status gather_begin(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                                size_t nbytes, hsdp_status (*then)(void *), void *then_arg, int now) {
    req_reset(r, g, share, then, then_arg);
    r->now = now;
    r->pending = 1;
    if (g->backend->gather_start && nbytes) {
        r->backend_owned = 1;
        hsdp_status st = g->backend->gather_start(r, send, recv, nbytes);
        if (st != HSDP_OK) r->pending = 0;
        return st;
    }
    run_here(r, send, recv, nbytes);
    return HSDP_OK; /* its status is the wait's */
}

hsdp_status hsdp_gather_start(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                              size_t nbytes, hsdp_status (*then)(void *), void *then_arg) {
    return gather_begin(r, g, share, send, recv, nbytes, then, then_arg, 0);
}

hsdp_status hsdp_gather_wait(hsdp_req *r) {
    if (r->pending && r->backend_owned) r->g->backend->gather_wait(r);
    r->pending = 0;
    if (r->status != HSDP_OK) return hsdp_fail(r->status, "%s", r->err);
    return HSDP_OK;
}

hsdp_status hsdp_sendrecv_start(hsdp_req *r, hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv,
                                size_t rbytes, int source) {
    req_reset(r, g, NULL, NULL, NULL);
    r->label = "a ring attention sendrecv";
    r->pending = 0;
    int self = 0;
    hsdp_status st = sendrecv_check(g, send, sbytes, dest, recv, rbytes, source, &self);
    if (st != HSDP_OK) return st;
    r->pending = 1;
    if (!self && g->backend->sendrecv_start) {
        r->backend_owned = 1;
        st = g->backend->sendrecv_start(r, send, sbytes, dest, recv, rbytes, source);
        if (st != HSDP_OK) r->pending = 0;
        return st;
    }
    r->start_ns = hsdp_now_ns();
    st = hsdp_sendrecv(g, send, sbytes, dest, recv, rbytes, source);
    r->end_ns = hsdp_now_ns();
    r->status = st;
    if (st != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", hsdp_last_error());
    return HSDP_OK; /* its status is the wait's */
}

hsdp_status hsdp_gather_through_slot(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                                     size_t nbytes, hsdp_status (*then)(void *), void *then_arg) {
    hsdp_status st = gather_begin(r, g, share, send, recv, nbytes, then, then_arg, 1);
    return st != HSDP_OK ? st : hsdp_gather_wait(r);
}

hsdp_status hsdp_gather_now(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                            size_t nbytes, hsdp_status (*then)(void *), void *then_arg) {
    req_reset(r, g, share, then, then_arg);
    r->pending = 0;
    run_here(r, send, recv, nbytes);
    if (r->status != HSDP_OK) return hsdp_fail(r->status, "%s", r->err);
    return HSDP_OK;
}
