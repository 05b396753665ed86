/* mpi_direct.c - the MPI backend's direct reads of fixed chunks (process_vm_readv) and the
 * deferred frees of shards a peer may still read (mpi_internal.h). */
#if defined(HSDP_HAVE_MPI)
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mpi_internal.h"
#include "watchdog.h"
#include "peer_read.h"

/* ---------------------------------------------------------------- fixed chunks, read directly */
/* A unit's shard never changes once gathered. Ranks on one host can then read each other's
 * shards with process_vm_readv, on the worker, with no peer taking part. An MPI all-gather
 * over shared memory needs both ranks' workers on a core at once to hand each fragment over,
 * so while the ranks compute it barely moves: a 16 MiB gather measured 4 ms idle and 100 ms
 * beside a busy thread on 2 cores, where a direct read took 4-9 ms either way. The first
 * gather of a chunk is a collective that exchanges the addresses and decides, the same on
 * every rank: direct only when every rank of the group can read every other one. */
struct direct_share {
    _Atomic uint64_t tag; /* read by the peers after each copy; zeroed before this is freed */
    int size;
    struct {
        uint64_t pid, addr, tag_addr, tag;
    } peer[]; /* per rank of the group */
};

enum { REC_PID, REC_ADDR, REC_TAG_ADDR, REC_TAG, REC_NBYTES, REC_HOST, REC_PIDNS, REC_WANTED, REC_WORDS };
enum { DIRECT_MAX_RANKS = 256 }; /* the exchange lives on the worker's stack */

/* A tag no freed-and-reused memory is likely to hold by chance (splitmix64 of pid, time, count). */
static uint64_t new_tag(void) {
    static _Atomic uint64_t counter;
    uint64_t x = ((uint64_t)getpid() << 32) ^ hsdp_now_ns() ^ (atomic_fetch_add(&counter, 1) + 1) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x ? x : 1;
}

/* HSDP_DIRECT_GATHER=0 keeps every gather collective (it must be the same on every rank;
 * where it is not, the ranks agree on collective). */
static int direct_wanted(void) {
    return hsdp_env_flag("HSDP_DIRECT_GATHER", 1);
}


/* After the first (collective) gather of a chunk: exchange, probe, agree. Collective over g. */
hsdp_status hsdp_mpi_direct_setup(hsdp_group *g, void **share, const void *send, size_t nbytes) {
    int n = g->size;
    if (n == 1 || n > DIRECT_MAX_RANKS) { /* the same on every rank: nothing to exchange */
        *share = hsdp_share_collective();
        return HSDP_OK;
    }
    direct_share *d = calloc(1, sizeof *d + (size_t)n * sizeof d->peer[0]); /* owned by the unit via *share */
    uint64_t tag = new_tag();
    if (d) atomic_store(&d->tag, tag);
    uint64_t mine[REC_WORDS] = {
        [REC_PID] = (uint64_t)getpid(),
        [REC_ADDR] = (uintptr_t)send,
        [REC_TAG_ADDR] = d ? (uintptr_t)&d->tag : 0,
        [REC_TAG] = tag,
        [REC_NBYTES] = nbytes,
        [REC_HOST] = hsdp_host_id(),
        [REC_PIDNS] = hsdp_pidns_id(),
        [REC_WANTED] = d && direct_wanted(),
    };
    uint64_t all[DIRECT_MAX_RANKS][REC_WORDS];
    hsdp_mpi_watch_begin("MPI_Allgather (exchanging shard addresses)", g, sizeof mine * (size_t)n);
    int rc = MPI_Allgather(mine, REC_WORDS, MPI_UINT64_T, all, REC_WORDS, MPI_UINT64_T, comm_of(g));
    hsdp_watch_end();
    if (rc != MPI_SUCCESS) {
        free(d);
        return hsdp_mpi_fail(rc, "MPI_Allgather (exchanging shard addresses)");
    }
    int ok = 1;
    for (int j = 0; j < n && ok; j++)
        ok = all[j][REC_WANTED] && all[j][REC_NBYTES] == nbytes && all[j][REC_HOST] == mine[REC_HOST] &&
             all[j][REC_PIDNS] == mine[REC_PIDNS];
    /* The probe: each peer's tag, read through its pid, must be the tag it sent. */
    for (int j = 0; j < n && ok; j++) {
        uint64_t seen = 0;
        if (j != g->rank)
            ok = hsdp_peer_read((pid_t)all[j][REC_PID], &seen, all[j][REC_TAG_ADDR], sizeof seen) == 0 &&
                 seen == all[j][REC_TAG];
    }
    int agreed = 0;
    hsdp_mpi_watch_begin("MPI_Allreduce (agreeing on direct gathers)", g, sizeof ok);
    rc = MPI_Allreduce(&ok, &agreed, 1, MPI_INT, MPI_MIN, comm_of(g));
    hsdp_watch_end();
    if (rc != MPI_SUCCESS) {
        free(d);
        return hsdp_mpi_fail(rc, "MPI_Allreduce (agreeing on direct gathers)");
    }
    hsdp_mpi_collective_done(g);
    if (!agreed) {
        free(d);
        *share = hsdp_share_collective();
        return HSDP_OK;
    }
    d->size = n;
    for (int j = 0; j < n; j++) {
        d->peer[j].pid = all[j][REC_PID];
        d->peer[j].addr = all[j][REC_ADDR];
        d->peer[j].tag_addr = all[j][REC_TAG_ADDR];
        d->peer[j].tag = all[j][REC_TAG];
    }
    *share = d;
    return HSDP_OK;
}

/* n bytes at offset off of rank j's shard into dst. */
static hsdp_status read_peer(const direct_share *d, int j, void *dst, size_t off, size_t n) {
    pid_t pid = (pid_t)d->peer[j].pid;
    int err = hsdp_peer_read(pid, dst, d->peer[j].addr + off, n);
    if (err)
        return hsdp_fail(HSDP_ECOMM, "reading rank %d's shard (pid %d) failed: %s%s", j, (int)pid, strerror(err),
                         err == ESRCH ? " (that rank has exited)" : "");
    return HSDP_OK;
}

/* Read after the data: a tag still in place means rank j's shard was live all along. */
static hsdp_status check_live(const direct_share *d, int j) {
    pid_t pid = (pid_t)d->peer[j].pid;
    uint64_t seen = 0;
    int err = hsdp_peer_read(pid, &seen, d->peer[j].tag_addr, sizeof seen);
    if (err || seen != d->peer[j].tag)
        return hsdp_fail(HSDP_ECOMM,
                         "rank %d (pid %d) no longer holds the unit this gather reads (it freed it): the ranks "
                         "are out of step", j, (int)pid);
    return HSDP_OK;
}

/* With `landing` (a float8 wire gather) each chunk is decoded right after it is read, while it
 * is still in cache; this rank's straight from its shard. */
hsdp_status hsdp_mpi_direct_gather(hsdp_group *g, const direct_share *d, const void *send, void *recv, size_t nbytes,
                                   hsdp_gather_req *landing) {
    for (int j = 0; j < d->size; j++) {
        unsigned char *dst = (unsigned char *)recv + (size_t)j * nbytes;
        if (j == g->rank) {
            if (landing) {
                hsdp_status st = hsdp_unit_decode_landed(landing, j, send, NULL, NULL);
                if (st != HSDP_OK) return st;
            } else if (dst != (const unsigned char *)send) {
                memcpy(dst, send, nbytes);
            }
            continue;
        }
        hsdp_status st = read_peer(d, j, dst, 0, nbytes);
        if (st == HSDP_OK) st = check_live(d, j);
        if (st == HSDP_OK && landing) st = hsdp_unit_decode_landed(landing, j, dst, NULL, NULL);
        if (st != HSDP_OK) return st;
    }
    return HSDP_OK;
}

/* Pieces of a peer's chunk widened from a bounce buffer: small enough to stay in cache
 * between the read and the widening, large enough that the reads' calls cost little (64 KiB
 * to 1 MiB measured alike, bench/bench_direct_widen.c). */
enum { WIDEN_PIECE = 128 << 10 };

hsdp_status hsdp_mpi_direct_widen(hsdp_group *g, const direct_share *d, const void *send, size_t nbytes,
                                  hsdp_gather_req *wr) {
    hsdp_status st = hsdp_unit_widen_piece(wr, g->rank, 0, send, nbytes); /* straight from the shard */
    if (st != HSDP_OK) return st;
    size_t piece = nbytes < WIDEN_PIECE ? nbytes : WIDEN_PIECE;
    unsigned char *bounce = malloc(piece ? piece : 1); /* owned here, freed below */
    if (!bounce) return hsdp_fail(HSDP_ENOMEM, "could not allocate the %zu-byte buffer a gather reads through", piece);
    for (int j = 0; j < d->size && st == HSDP_OK; j++) {
        if (j == g->rank) continue;
        for (size_t at = 0; at < nbytes && st == HSDP_OK; at += piece) {
            size_t n = nbytes - at < piece ? nbytes - at : piece;
            st = read_peer(d, j, bounce, at, n);
            if (st == HSDP_OK) st = hsdp_unit_widen_piece(wr, j, at, bounce, n);
        }
        if (st == HSDP_OK) st = check_live(d, j);
    }
    free(bounce);
    if (st == HSDP_OK) wr->widened_landed = 1;
    return st;
}

/* Freed shards a peer may still be reading. Ranks no longer move in lockstep once gathers are
 * direct: a rank may delete its model (or end its program) while a slower peer is still
 * reading its last unit. So a direct shard outlives its unit until a collective over its
 * group (or one over every rank) completes: every peer has then entered that collective, and
 * its worker finished every read queued before it. Guarded by grave_mu: units are freed on
 * Python's thread while the worker flushes. */
typedef struct grave {
    struct grave *next;
    direct_share *share;
    void *memory;
    uint64_t group_id;
} grave;
static pthread_mutex_t grave_mu = PTHREAD_MUTEX_INITIALIZER;
static grave *graves;        /* under grave_mu */
static atomic_int ngraves;   /* how many: read without the lock by every collective */

static void bury(direct_share *d, void *memory) {
    atomic_store(&d->tag, 0); /* a peer reading after this would be out of step: it says so */
    free(memory);
    free(d);
}

/* all: every grave (a collective over every rank, or the end of MPI); else those of g. */
void hsdp_mpi_flush_graves(uint64_t group_id, int all) {
    grave *ready = NULL;
    pthread_mutex_lock(&grave_mu);
    for (grave **p = &graves; *p;) {
        grave *e = *p;
        if (all || e->group_id == group_id) {
            *p = e->next;
            e->next = ready;
            ready = e;
            atomic_fetch_sub(&ngraves, 1);
        } else {
            p = &e->next;
        }
    }
    pthread_mutex_unlock(&grave_mu);
    while (ready) {
        grave *e = ready;
        ready = e->next;
        bury(e->share, e->memory);
        free(e);
    }
}

void hsdp_mpi_collective_done(hsdp_group *g) {
    if (atomic_load(&ngraves) == 0) return;
    int world = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    hsdp_mpi_flush_graves(((mpi_group *)g->impl)->id, g->size >= world);
}

void hsdp_mpi_share_free(hsdp_group *g, void *share, void *memory) {
    grave *e = malloc(sizeof *e); /* owned by the grave list until flushed */
    if (!e || hsdp_mpi_done()) {         /* no peer reads after MPI has ended; nowhere to keep it */
        free(e);
        bury(share, memory);
        return;
    }
    *e = (grave){.share = share, .memory = memory, .group_id = ((mpi_group *)g->impl)->id};
    pthread_mutex_lock(&grave_mu);
    e->next = graves;
    graves = e;
    atomic_fetch_add(&ngraves, 1);
    pthread_mutex_unlock(&grave_mu);
}
#endif
