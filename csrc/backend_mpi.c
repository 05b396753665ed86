/* backend_mpi.c - the MPI backend for CPU ranks on one host or many. Compiled only when an
 * MPI implementation was found at build time (HSDP_HAVE_MPI); otherwise the backend reports
 * itself unusable with what to install. hsdp initialises MPI only when nobody has (mpi4py
 * may have), at MPI_THREAD_SERIALIZED: every MPI call runs on one worker thread (exec.c), so
 * one thread calls MPI at a time. That worker is how this backend implements its
 * asynchronous slots. Every communicator returns errors instead of aborting, so a failed
 * collective becomes a Python exception. */
#if defined(HSDP_HAVE_MPI)
#define _GNU_SOURCE /* dladdr, process_vm_readv */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "exec.h"
#include "peer_status.h"

/* The worker thread every MPI call runs on. MPI is process-wide, so is its worker: created
 * with the first world group, stopped (not freed) before MPI_Finalize; the struct lives
 * until the process ends so that groups freed after finalisation still find it. */
static hsdp_exec *mpi_worker;

static int mpi_done(void) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    return finalized;
}

#define REQUIRE_LIVE()                                                                   \
    do {                                                                                 \
        if (mpi_done()) return hsdp_fail(HSDP_ESTATE, "MPI has already been finalised"); \
    } while (0)

static hsdp_status mpi_fail(int rc, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
    msg[len] = '\0';
    return hsdp_fail(HSDP_ECOMM, "%s failed: %s", what, len ? msg : "unknown MPI error");
}

/* A group's impl: its communicator (first, so the impl reads as an MPI_Comm) and an id no
 * other group of this process ever has, by which deferred frees find their group. */
typedef struct {
    MPI_Comm comm;
    uint64_t id;
    uint64_t unit_gathers; /* collective unit gathers issued on this group (the worker's) */
    int *world_ranks;      /* owned: the world rank of each rank of the group (for messages) */
} mpi_group;

static MPI_Comm comm_of(hsdp_group *g) { return ((mpi_group *)g->impl)->comm; }

static void collective_done(hsdp_group *g); /* below: frees the shards no peer can still read */

/* MPI counts are ints: past INT_MAX bytes send 64-byte blocks (chunks are multiples of 64). */
static hsdp_status byte_count(size_t nbytes, int *count, MPI_Datatype *type, int *owned) {
    *owned = 0;
    if (nbytes <= (size_t)INT_MAX) {
        *count = (int)nbytes;
        *type = MPI_BYTE;
        return HSDP_OK;
    }
    if (nbytes % HSDP_ALIGN || nbytes / HSDP_ALIGN > (size_t)INT_MAX)
        return hsdp_fail(HSDP_EINVAL, "a message of %zu bytes is too large for one MPI call", nbytes);
    int rc = MPI_Type_contiguous(HSDP_ALIGN, MPI_BYTE, type);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(type);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Type_contiguous");
    *owned = 1;
    *count = (int)(nbytes / HSDP_ALIGN);
    return HSDP_OK;
}

/* ---------------------------------------------------------------- the watchdog (HSDP_TIMEOUT) */
/* A collective waits for every rank of its group; a peer that stalls, hangs or is a step
 * behind would make it wait forever. Every collective below is bracketed by watch_begin /
 * watch_end (MPI calls are serialised, so one slot suffices), and a thread started with the
 * world ends the whole job (MPI_Abort) when one outlives the timeout, saying what waited.
 * Direct gathers need no peer and are not watched. */
static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static char watch_what[320];        /* under watch_mu: the collective in progress */
static char watch_next[96];         /* under watch_mu: what the next collective is for */
static _Atomic uint64_t watch_start; /* ns; 0 while no collective runs */
static int watch_rank = -1;          /* this process's world rank, for the message */
static pthread_t watch_thread;
static atomic_int watch_running, watch_stop;
/* What this rank waits in, published for its peers' watchdogs to read (same host). */
static struct {
    _Atomic uint64_t active;
    char what[320];
} watch_pub;
static const int *watch_group;  /* under watch_mu: world ranks of the collective's group */
static int watch_group_size;
static void who_is_missing(char *out, size_t n, const char *what); /* below, with the direct reads */

static void watch_label(const char *label, int first) {
    pthread_mutex_lock(&watch_mu);
    snprintf(watch_next, sizeof watch_next, "%s unit '%s'", first ? "the first gather of" : "gathering",
             label ? label : "");
    pthread_mutex_unlock(&watch_mu);
}

/* ranks: the world rank of each of the size ranks taking part (NULL: none can be named);
 * it must outlive the watchdog's use of it (a group's, or finalize's until the thread stops). */
static void watch_begin_ranks(const char *op, const int *ranks, int size, size_t nbytes) {
    pthread_mutex_lock(&watch_mu);
    int n = snprintf(watch_what, sizeof watch_what, "%s of %zu bytes over a group of %d ranks", op, nbytes, size);
    if (watch_next[0] && n > 0 && (size_t)n < sizeof watch_what)
        snprintf(watch_what + n, sizeof watch_what - (size_t)n, " (%s)", watch_next);
    watch_next[0] = '\0';
    watch_group = ranks;
    watch_group_size = size;
    /* published: inactive while being rewritten, so a peer never reads a torn description */
    atomic_store(&watch_pub.active, 0);
    memcpy(watch_pub.what, watch_what, sizeof watch_pub.what);
    atomic_store(&watch_pub.active, 1);
    pthread_mutex_unlock(&watch_mu);
    atomic_store(&watch_start, hsdp_now_ns());
}

static void watch_begin(const char *op, const hsdp_group *g, size_t nbytes) {
    watch_begin_ranks(op, ((const mpi_group *)g->impl)->world_ranks, g->size, nbytes);
}

static void watch_end(void) {
    atomic_store(&watch_start, 0);
    atomic_store(&watch_pub.active, 0);
}

static void *watchdog(void *arg) {
    (void)arg;
    while (!atomic_load(&watch_stop)) {
        struct timespec tick = {0, 100 * 1000 * 1000};
        nanosleep(&tick, NULL);
        uint64_t t0 = atomic_load(&watch_start), limit = hsdp_timeout_ns();
        if (!t0 || !limit || hsdp_now_ns() - t0 <= limit) continue;
        char what[sizeof watch_what];
        pthread_mutex_lock(&watch_mu);
        memcpy(what, watch_what, sizeof what);
        pthread_mutex_unlock(&watch_mu);
        if (atomic_load(&watch_start) != t0) continue; /* it completed meanwhile */
        char missing[640];
        who_is_missing(missing, sizeof missing, what);
        fprintf(stderr,
                "hsdp: rank %d: %s has waited more than %.3g s (HSDP_TIMEOUT): some rank of the group has not "
                "reached it (stalled, hung, or at a different step)%s; ending the job\n",
                watch_rank, what, (double)limit / 1e9, missing);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 124); /* the launcher ends every rank */
        _exit(124);
    }
    return NULL;
}

static void watch_start_thread(void) {
    if (atomic_load(&watch_running)) return;
    MPI_Comm_rank(MPI_COMM_WORLD, &watch_rank);
    atomic_store(&watch_stop, 0);
    if (pthread_create(&watch_thread, NULL, watchdog, NULL) == 0) atomic_store(&watch_running, 1);
}

static void watch_stop_thread(void) {
    if (!atomic_load(&watch_running)) return;
    atomic_store(&watch_stop, 1);
    pthread_join(watch_thread, NULL);
    atomic_store(&watch_running, 0);
}

static hsdp_status raw_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    const void *s = send == (char *)recv + (size_t)g->rank * nbytes ? MPI_IN_PLACE : send;
    watch_begin("MPI_Allgather", g, nbytes * (size_t)g->size);
    int rc = MPI_Allgather(s, count, type, recv, count, type, comm_of(g));
    watch_end();
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Allgather");
    collective_done(g);
    return HSDP_OK;
}

static hsdp_status raw_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    REQUIRE_LIVE();
    if (root < 0 || root >= g->size)
        return hsdp_fail(HSDP_EINVAL, "broadcast root %d is outside a group of %d", root, g->size);
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    watch_begin("MPI_Bcast", g, nbytes);
    int rc = MPI_Bcast(buf, count, type, root, comm_of(g));
    watch_end();
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Bcast");
    /* no collective_done: a broadcast's root may finish before the others arrive */
    return HSDP_OK;
}

static hsdp_status raw_barrier(hsdp_group *g) {
    REQUIRE_LIVE();
    watch_begin("MPI_Barrier", g, 0);
    int rc = MPI_Barrier(comm_of(g));
    watch_end();
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Barrier");
    collective_done(g);
    return HSDP_OK;
}

static hsdp_status raw_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    watch_begin("MPI_Alltoall", g, nbytes * (size_t)g->size);
    int rc = MPI_Alltoall(send, count, type, recv, count, type, comm_of(g));
    watch_end();
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Alltoall");
    collective_done(g);
    return HSDP_OK;
}

/* The tag of ring attention's messages: collectives have a context of their own, and nothing
 * else here sends point to point on a group's communicator. */
enum { SENDRECV_TAG = 0x4853 };

static hsdp_status raw_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                int source) {
    REQUIRE_LIVE();
    int scount, rcount, sowned = 0, rowned = 0;
    MPI_Datatype stype, rtype;
    hsdp_status st = byte_count(sbytes, &scount, &stype, &sowned);
    if (st == HSDP_OK) st = byte_count(rbytes, &rcount, &rtype, &rowned);
    if (st != HSDP_OK) {
        if (sowned) MPI_Type_free(&stype);
        return st;
    }
    MPI_Status status;
    watch_begin("MPI_Sendrecv", g, sbytes + rbytes);
    int rc = MPI_Sendrecv(send, scount, stype, dest, SENDRECV_TAG, recv, rcount, rtype, source, SENDRECV_TAG,
                          comm_of(g), &status);
    watch_end();
    int got = rcount;
    if (rc == MPI_SUCCESS) MPI_Get_count(&status, rtype, &got);
    if (sowned) MPI_Type_free(&stype);
    if (rowned) MPI_Type_free(&rtype);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Sendrecv");
    if (got != rcount)
        return hsdp_fail(HSDP_EINVAL, "sendrecv: rank %d expected %zu bytes from rank %d but it sent fewer", g->rank,
                         rbytes, source);
    return HSDP_OK;
}

/* The MPI datatype of one block of a layout (its extent: the layout's step). */
static hsdp_status blocks_type(const hsdp_blocks *b, MPI_Datatype *out) {
    if (b->inner > (size_t)INT_MAX || b->step > (size_t)INT_MAX * (size_t)HSDP_ALIGN)
        return hsdp_fail(HSDP_EINVAL, "a block of %zu contiguous bytes is too large for one MPI datatype", b->inner);
    MPI_Datatype t, next;
    int rc = MPI_Type_contiguous((int)b->inner, MPI_BYTE, &t);
    for (int k = b->ndims - 1; rc == MPI_SUCCESS && k >= 0; k--) {
        if (b->count[k] > (size_t)INT_MAX) {
            MPI_Type_free(&t);
            return hsdp_fail(HSDP_EINVAL, "a block layout's count %zu is too large for MPI", b->count[k]);
        }
        rc = MPI_Type_create_hvector((int)b->count[k], 1, (MPI_Aint)b->stride[k], t, &next);
        MPI_Type_free(&t);
        t = next;
    }
    if (rc == MPI_SUCCESS) {
        rc = MPI_Type_create_resized(t, 0, (MPI_Aint)b->step, &next);
        MPI_Type_free(&t);
        t = next;
    }
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&t);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "building an all-to-all's datatype");
    *out = t;
    return HSDP_OK;
}

/* MPI packs the strided blocks itself, inside the transfer: no copy before or after it. */
static hsdp_status raw_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
                                         const hsdp_blocks *r) {
    REQUIRE_LIVE();
    MPI_Datatype st_, rt;
    hsdp_status st = blocks_type(s, &st_);
    if (st != HSDP_OK) return st;
    st = blocks_type(r, &rt);
    if (st != HSDP_OK) {
        MPI_Type_free(&st_);
        return st;
    }
    size_t span;
    watch_begin("MPI_Alltoall", g, hsdp_blocks_bytes(s, g->size, &span) * (size_t)g->size);
    int rc = MPI_Alltoall(send, 1, st_, recv, 1, rt, comm_of(g));
    watch_end();
    MPI_Type_free(&st_);
    MPI_Type_free(&rt);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Alltoall");
    collective_done(g);
    return HSDP_OK;
}

static hsdp_status wrap(MPI_Comm c, hsdp_group **out);

static hsdp_status raw_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    REQUIRE_LIVE();
    MPI_Comm c;
    watch_begin("MPI_Comm_split", g, 0);
    int rc = MPI_Comm_split(comm_of(g), color, key, &c);
    watch_end();
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_split");
    return wrap(c, out);
}

static void raw_free(hsdp_group *g) {
    /* After MPI_Finalize a communicator may no longer be freed; the process is ending. */
    if (!mpi_done()) MPI_Comm_free(&((mpi_group *)g->impl)->comm);
    free(((mpi_group *)g->impl)->world_ranks);
    free(g->impl);
    free(g);
}


/* Takes ownership of c. */
static hsdp_status wrap(MPI_Comm c, hsdp_group **out) {
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    hsdp_group *g = malloc(sizeof *g);      /* owned by the caller; hsdp_group_free */
    mpi_group *h = malloc(sizeof *h);       /* owned by g; mpi_free */
    if (!g || !h) {
        free(g);
        free(h);
        MPI_Comm_free(&c);
        return hsdp_fail(HSDP_ENOMEM, "could not allocate a process group");
    }
    static uint64_t next_id; /* only the worker (or the caller holding its lock) wraps */
    *h = (mpi_group){.comm = c, .id = ++next_id};
    *g = (hsdp_group){.backend = &hsdp_backend_mpi, .impl = h};
    MPI_Comm_rank(c, &g->rank);
    MPI_Comm_size(c, &g->size);
    /* which world ranks these are, so a timeout can name them (NULL: it cannot) */
    h->world_ranks = malloc(sizeof *h->world_ranks * (size_t)g->size); /* owned by h; raw_free */
    int *mine = malloc(sizeof *mine * (size_t)g->size);                /* freed below */
    MPI_Group grp, world;
    if (h->world_ranks && mine && MPI_Comm_group(c, &grp) == MPI_SUCCESS) {
        if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
            for (int i = 0; i < g->size; i++) mine[i] = i;
            if (MPI_Group_translate_ranks(grp, g->size, mine, world, h->world_ranks) != MPI_SUCCESS) {
                free(h->world_ranks);
                h->world_ranks = NULL;
            }
            MPI_Group_free(&world);
        }
        MPI_Group_free(&grp);
    } else {
        free(h->world_ranks);
        h->world_ranks = NULL;
    }
    free(mine);
    *out = g;
    return HSDP_OK;
}

/* Open MPI loads its components with dlopen and expects libmpi's symbols to be global; a
 * Python extension is loaded RTLD_LOCAL, so promote the library before MPI_Init. */
static void promote_libmpi(void) {
    Dl_info info;
    if (dladdr((void *)&MPI_Init, &info) && info.dli_fname)
        (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
}

/* ---------------------------------------------------------------- fixed chunks, read directly */
/* A unit's shard never changes once gathered. Ranks on one host can then read each other's
 * shards with process_vm_readv, on the worker, with no peer taking part. An MPI all-gather
 * over shared memory needs both ranks' workers on a core at once to hand each fragment over,
 * so while the ranks compute it barely moves: a 16 MiB gather measured 4 ms idle and 100 ms
 * beside a busy thread on 2 cores, where a direct read took 4-9 ms either way. The first
 * gather of a chunk is a collective that exchanges the addresses and decides, the same on
 * every rank: direct only when every rank of the group can read every other one. */
typedef struct {
    _Atomic uint64_t tag; /* read by the peers after each copy; zeroed before this is freed */
    int size;
    struct {
        uint64_t pid, addr, tag_addr, tag;
    } peer[]; /* per rank of the group */
} direct_share;

enum { REC_PID, REC_ADDR, REC_TAG_ADDR, REC_TAG, REC_NBYTES, REC_HOST, REC_PIDNS, REC_WANTED, REC_WORDS };
enum { DIRECT_MAX_RANKS = 256 }; /* the exchange lives on the worker's stack */

static uint64_t fnv1a(uint64_t h, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* Which host: ranks on different hosts cannot read each other by pid. */
static uint64_t host_id(void) {
    char buf[256] = {0};
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    size_t n = f ? fread(buf, 1, 64, f) : 0;
    if (f) fclose(f);
    uint64_t h = fnv1a(1469598103934665603ull, buf, n);
    memset(buf, 0, sizeof buf);
    if (gethostname(buf, sizeof buf - 1) != 0) buf[0] = '\0';
    return fnv1a(h, buf, strlen(buf));
}

/* Which pid namespace: containers on one host see different pids. */
static uint64_t pidns_id(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

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
    const char *v = getenv("HSDP_DIRECT_GATHER");
    return !(v && strcmp(v, "0") == 0);
}

/* Reads exactly n bytes at the peer's address (process_vm_readv may stop short): 0 or errno. */
static int peer_read(pid_t pid, void *dst, uint64_t addr, size_t n) {
    size_t done = 0;
    while (done < n) {
        struct iovec l = {(char *)dst + done, n - done}, r = {(void *)(uintptr_t)(addr + done), n - done};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return got == 0 ? EIO : errno;
        done += (size_t)got;
    }
    return 0;
}

/* ---------------------------------------------------------------- naming who did not arrive */
/* At world start every rank learns where each world peer publishes what it waits in: its
 * watch_pub, read by pid on the same host, and its status card (peer_status.h), asked over
 * TCP from other hosts. When a collective times out, the watchdog learns that of every peer
 * of the group: a peer not waiting in the same collective did not arrive, and what it waits
 * in instead (if anything) is named. Peers that neither can be read nor answer are listed
 * as unknown. Best effort: it runs just before the job ends. */
static struct {
    uint64_t pid, addr, host, pidns;
    hsdp_status_card card;
} *world_peers; /* owned: one per world rank; set once */
static int world_n;
enum { PEER_WORDS = 4 + sizeof(hsdp_status_card) / sizeof(uint64_t) };
_Static_assert(sizeof world_peers[0] == PEER_WORDS * sizeof(uint64_t), "a peer record is plain words");

/* What this rank waits in, for a peer's watchdog asking over TCP (on the answering thread). */
static int describe_wait(char *what, size_t n) {
    pthread_mutex_lock(&watch_mu);
    int active = (int)atomic_load(&watch_pub.active);
    snprintf(what, n, "%s", active ? watch_pub.what : "");
    pthread_mutex_unlock(&watch_mu);
    return active;
}

static void learn_world_peers(void) {
    int n = 0;
    if (world_peers || MPI_Comm_size(MPI_COMM_WORLD, &n) != MPI_SUCCESS || n < 2) return;
    __typeof__(world_peers[0]) mine = {(uint64_t)getpid(), (uintptr_t)&watch_pub, host_id(), pidns_id(), {0, 0, {0}}};
    hsdp_status_serve(describe_wait, &mine.card);
    void *all = malloc(sizeof mine * (size_t)n); /* owned by world_peers */
    if (!all) { /* the others are in the all-gather below: leaving would hang them */
        fprintf(stderr, "hsdp: rank %d: out of memory for the %d ranks' watchdog records; ending the job\n",
                watch_rank, n);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (MPI_Allgather(&mine, PEER_WORDS, MPI_UINT64_T, all, PEER_WORDS, MPI_UINT64_T, MPI_COMM_WORLD) != MPI_SUCCESS) {
        free(all);
        return;
    }
    world_peers = all;
    world_n = n;
}

static void who_is_missing(char *out, size_t n, const char *what) {
    out[0] = '\0';
    pthread_mutex_lock(&watch_mu);
    const int *ranks = watch_group;
    int size = watch_group_size;
    pthread_mutex_unlock(&watch_mu);
    if (!ranks || !world_peers) return;
    uint64_t host = host_id(), pidns = pidns_id();
    size_t used = (size_t)snprintf(out, n, "; not in it:");
    int absent = 0, unknown = 0, asked = 0;
    enum { ASK_MAX = 16, ASK_MS = 1000 }; /* peers asked over TCP, and how long each may take */
    uint64_t ask_until = hsdp_now_ns() + 4000000000ull; /* the job ends soon after: 4 s for all */
    char unknowns[128] = "";
    size_t uused = 0;
    for (int i = 0; i < size && used < n; i++) {
        int r = ranks[i];
        if (r == watch_rank || r < 0 || r >= world_n) continue;
        __typeof__(world_peers[0]) *p = &world_peers[r];
        uint64_t active = 0;
        char theirs[sizeof watch_pub.what] = "";
        int readable = p->host == host && p->pidns == pidns &&
                       peer_read((pid_t)p->pid, &active, p->addr, sizeof active) == 0 &&
                       peer_read((pid_t)p->pid, theirs, p->addr + offsetof(__typeof__(watch_pub), what),
                                 sizeof theirs - 1) == 0;
        if (!readable && asked < ASK_MAX && hsdp_now_ns() < ask_until) { /* another host: ask it */
            int on = 0;
            asked++;
            readable = hsdp_status_ask(&p->card, ASK_MS, &on, theirs, sizeof theirs);
            active = (uint64_t)on;
        }
        if (!readable) {
            if (uused < sizeof unknowns)
                uused += (size_t)snprintf(unknowns + uused, sizeof unknowns - uused, "%s%d", unknown ? ", " : "", r);
            unknown++;
            continue;
        }
        theirs[sizeof theirs - 1] = '\0';
        if (active && strcmp(theirs, what) == 0) continue; /* waiting in the same collective: it arrived */
        used += (size_t)snprintf(out + used, n - used, "%s rank %d (%s%.200s)", absent ? "," : "", r,
                                 active ? "waiting in " : "in no collective", active ? theirs : "");
        absent++;
    }
    if (!absent && used < n) used += (size_t)snprintf(out + used, n - used, " none of the ranks read or asked");
    if (unknown && used < n) snprintf(out + used, n - used, "; unknown (did not answer, or not asked): %s", unknowns);
}

/* After the first (collective) gather of a chunk: exchange, probe, agree. Collective over g. */
static hsdp_status direct_setup(hsdp_group *g, void **share, const void *send, size_t nbytes) {
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
        [REC_HOST] = host_id(),
        [REC_PIDNS] = pidns_id(),
        [REC_WANTED] = d && direct_wanted(),
    };
    uint64_t all[DIRECT_MAX_RANKS][REC_WORDS];
    watch_begin("MPI_Allgather (exchanging shard addresses)", g, sizeof mine * (size_t)n);
    int rc = MPI_Allgather(mine, REC_WORDS, MPI_UINT64_T, all, REC_WORDS, MPI_UINT64_T, comm_of(g));
    watch_end();
    if (rc != MPI_SUCCESS) {
        free(d);
        return mpi_fail(rc, "MPI_Allgather (exchanging shard addresses)");
    }
    int ok = 1;
    for (int j = 0; j < n && ok; j++)
        ok = all[j][REC_WANTED] && all[j][REC_NBYTES] == nbytes && all[j][REC_HOST] == mine[REC_HOST] &&
             all[j][REC_PIDNS] == mine[REC_PIDNS];
    /* The probe: each peer's tag, read through its pid, must be the tag it sent. */
    for (int j = 0; j < n && ok; j++) {
        uint64_t seen = 0;
        if (j != g->rank)
            ok = peer_read((pid_t)all[j][REC_PID], &seen, all[j][REC_TAG_ADDR], sizeof seen) == 0 &&
                 seen == all[j][REC_TAG];
    }
    int agreed = 0;
    watch_begin("MPI_Allreduce (agreeing on direct gathers)", g, sizeof ok);
    rc = MPI_Allreduce(&ok, &agreed, 1, MPI_INT, MPI_MIN, comm_of(g));
    watch_end();
    if (rc != MPI_SUCCESS) {
        free(d);
        return mpi_fail(rc, "MPI_Allreduce (agreeing on direct gathers)");
    }
    collective_done(g);
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

static hsdp_status direct_gather(hsdp_group *g, const direct_share *d, const void *send, void *recv, size_t nbytes) {
    for (int j = 0; j < d->size; j++) {
        unsigned char *dst = (unsigned char *)recv + (size_t)j * nbytes;
        if (j == g->rank) {
            if (dst != (const unsigned char *)send) memcpy(dst, send, nbytes);
            continue;
        }
        pid_t pid = (pid_t)d->peer[j].pid;
        int err = peer_read(pid, dst, d->peer[j].addr, nbytes);
        if (err)
            return hsdp_fail(HSDP_ECOMM, "reading rank %d's shard (pid %d) failed: %s%s", j, (int)pid, strerror(err),
                             err == ESRCH ? " (that rank has exited)" : "");
        /* Read after the data: a tag still in place means the shard was live all along. */
        uint64_t seen = 0;
        err = peer_read(pid, &seen, d->peer[j].tag_addr, sizeof seen);
        if (err || seen != d->peer[j].tag)
            return hsdp_fail(HSDP_ECOMM,
                             "rank %d (pid %d) no longer holds the unit this gather reads (it freed it): the ranks "
                             "are out of step", j, (int)pid);
    }
    return HSDP_OK;
}

/* ---------------------------------------------------------------- agreement */
/* Every collective unit gather carries a ticket: the unit's name, its identity (which unit of
 * the group it is, counted as made: two models of one architecture have units of the same
 * names and sizes), the group's count of unit gathers so far and the bytes per rank. Ranks
 * that disagree (one unsharding blocks.0 while another unshards blocks.1, one the first
 * model's blocks.0 while another the second's, or a rank that skipped a gather after
 * catching an exception)
 * all see every ticket, so every one of them fails, naming what each asked for, and none
 * returns: no rank returns weights mixed from two units, and a size mismatch never surfaces
 * as a truncation. In a group of up to FUSED_RANKS ranks the tickets travel with the data:
 * each rank posts, to every peer, a ticket message and a data message at once, so the check
 * costs no extra round trip (an MPI_Allgather cannot carry them without copying every chunk).
 * Each receive has a matching send whatever the peers asked for, so a mismatch, even of
 * sizes, completes on every rank and is reported from the tickets. Larger groups exchange the
 * tickets in their own 64-byte all-gather first, then gather with MPI_Allgather, whose ring
 * and doubling algorithms scale where a rank posting to every peer may not. Direct gathers
 * need no check: each rank reads its peers' shards of its own unit. */
enum { TICKET_LABEL = 32, FUSED_RANKS = 8, TAG_TICKET = 0x4854, TAG_CHUNK = 0x4855 };
typedef struct {
    uint64_t seq, nbytes, label_hash, ident;
    char label[TICKET_LABEL];
} ticket;
_Static_assert(sizeof(ticket) == 64, "a ticket is 64 bytes");
enum { TICKETS_ON_STACK = 16 };
_Static_assert((int)FUSED_RANKS <= (int)TICKETS_ON_STACK, "a fused gather's tickets fit on the stack");

static ticket make_ticket(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes) {
    mpi_group *h = g->impl;
    ticket mine;
    memset(&mine, 0, sizeof mine);
    mine.seq = ++h->unit_gathers;
    mine.nbytes = nbytes;
    mine.ident = ident;
    label = label ? label : "";
    mine.label_hash = fnv1a(1469598103934665603ull, label, strlen(label)); /* names longer than the copy */
    snprintf(mine.label, sizeof mine.label, "%s", label);
    return mine;
}

/* HSDP_OK when every ticket equals rank 0's; else the error naming what each rank asked for. */
static hsdp_status check_tickets(const hsdp_group *g, const ticket *all) {
    int differ = 0;
    for (int j = 1; j < g->size; j++) differ |= memcmp(&all[j], &all[0], sizeof *all) != 0;
    if (!differ) return HSDP_OK;
    char msg[900];
    size_t used = (size_t)snprintf(msg, sizeof msg, "the %d ranks of a group do not gather the same unit, so none of "
                                   "them gathers:", g->size);
    for (int j = 0, shown = 0; j < g->size && used < sizeof msg; j++) {
        /* every rank that differs from rank 0, and rank 0, at most 6 in all */
        if (j && !memcmp(&all[j], &all[0], sizeof *all)) continue;
        if (shown++ == 6) {
            used += (size_t)snprintf(msg + used, sizeof msg - used, " ...");
            break;
        }
        used += (size_t)snprintf(msg + used, sizeof msg - used, "%s rank %d asks for unit '%.*s' (the group's unit "
                                 "#%llu as made, %llu bytes per rank, its gather #%llu on this group)", j ? ";" : "",
                                 j, TICKET_LABEL - 1, all[j].label, (unsigned long long)all[j].ident,
                                 (unsigned long long)all[j].nbytes, (unsigned long long)all[j].seq);
    }
    return hsdp_fail(HSDP_ECOMM, "%s", msg);
}

/* The tickets in their own all-gather, before the data (groups of more than FUSED_RANKS). */
static hsdp_status agree(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes) {
    ticket mine = make_ticket(g, label, ident, nbytes);
    ticket stack[TICKETS_ON_STACK];
    ticket *all = g->size <= TICKETS_ON_STACK ? stack : malloc(sizeof *all * (size_t)g->size); /* freed below */
    if (!all) return hsdp_fail(HSDP_ENOMEM, "could not allocate the agreement of %d ranks", g->size);
    watch_begin("MPI_Allgather (agreeing on the unit to gather)", g, sizeof mine * (size_t)g->size);
    int rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, comm_of(g));
    watch_end();
    hsdp_status st = rc == MPI_SUCCESS ? check_tickets(g, all)
                                       : mpi_fail(rc, "MPI_Allgather (agreeing on the unit to gather)");
    if (all != stack) free(all);
    return st;
}

static int error_class(int rc) {
    int cls = rc;
    return MPI_Error_class(rc, &cls) == MPI_SUCCESS ? cls : rc;
}

/* The gather with the tickets beside the data, in one exchange (groups of up to FUSED_RANKS). */
static hsdp_status agreed_gather(hsdp_group *g, const char *label, uint64_t ident, const void *send, void *recv,
                                 size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned, n = g->size, me = g->rank;
    MPI_Datatype type;
    ticket all[FUSED_RANKS];
    all[me] = make_ticket(g, label, ident, nbytes);
    /* A size MPI cannot carry still takes part, with no data: were it a mismatch, the peers
     * must still see this rank's ticket, not wait for it until the watchdog fires. */
    char size_error[256] = "";
    if (byte_count(nbytes, &count, &type, &owned) != HSDP_OK) {
        snprintf(size_error, sizeof size_error, "%s", hsdp_last_error());
        count = 0, type = MPI_BYTE, owned = 0;
    }
    MPI_Request req[4 * (FUSED_RANKS - 1)];
    MPI_Comm comm = comm_of(g);
    unsigned char *out = recv;
    int m = 0, rc = MPI_SUCCESS; /* req[0..m) were posted: ticket receives at the even k < 2 (n - 1) */
    watch_begin("MPI_Isend/MPI_Irecv (a gather, tickets beside the data)", g, nbytes * (size_t)n);
    for (int j = 0; j < n && rc == MPI_SUCCESS; j++) {
        if (j == me) continue;
        if ((rc = MPI_Irecv(&all[j], (int)sizeof *all, MPI_BYTE, j, TAG_TICKET, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
        if ((rc = MPI_Irecv(out + (size_t)j * nbytes, count, type, j, TAG_CHUNK, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
    }
    for (int d = 1; d < n && rc == MPI_SUCCESS; d++) { /* peers in ring order spread the load */
        int j = (me + d) % n;
        if ((rc = MPI_Isend(&all[me], (int)sizeof *all, MPI_BYTE, j, TAG_TICKET, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
        if ((rc = MPI_Isend(send, count, type, j, TAG_CHUNK, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
    }
    /* After an error Open MPI's MPI_Waitall returns with the rest still pending (the standard
     * allows it: MPI_ERR_PENDING); every request must end before its buffer can, so those
     * are waited for one by one. (Should posting fail, out of resources, the peers wait for
     * what was never sent until the watchdog ends the job.) */
    MPI_Status stat[4 * (FUSED_RANKS - 1)];
    int failed = rc, tickets_ok = rc == MPI_SUCCESS;
    int wrc = MPI_Waitall(m, req, stat);
    int in_status = wrc != MPI_SUCCESS && error_class(wrc) == MPI_ERR_IN_STATUS;
    for (int k = 0; wrc != MPI_SUCCESS && k < m; k++) {
        int e = in_status ? stat[k].MPI_ERROR : wrc;
        if (!in_status || error_class(e) == MPI_ERR_PENDING) e = MPI_Wait(&req[k], MPI_STATUS_IGNORE);
        if (e == MPI_SUCCESS) continue;
        if (failed == MPI_SUCCESS) failed = e;
        if (k < 2 * (n - 1) && k % 2 == 0) tickets_ok = 0; /* a ticket's receive */
    }
    watch_end();
    if (owned) MPI_Type_free(&type);
    /* A ticket cannot truncate (every one is 64 bytes), so after any other error the tickets
     * still say whether the ranks asked for different units, which is the error to report. */
    if (tickets_ok) {
        hsdp_status st = check_tickets(g, all);
        if (st != HSDP_OK) return st;
    }
    if (size_error[0]) return hsdp_fail(HSDP_EINVAL, "%s", size_error);
    if (failed != MPI_SUCCESS) return mpi_fail(failed, "MPI_Isend/MPI_Irecv (gathering)");
    /* The rank's own chunk last: MPI progresses (over TCP, say) only inside MPI calls, and a
     * copy while the messages are in flight would stall them. */
    if (out + (size_t)me * nbytes != (const unsigned char *)send) memcpy(out + (size_t)me * nbytes, send, nbytes);
    collective_done(g); /* every peer sent to this rank, so every one entered the gather */
    return HSDP_OK;
}

/* On the worker. The first gather of a fixed chunk is collective and sets *share. */
static hsdp_status fixed_gather(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                const char *label, uint64_t ident) {
    if (*share && *share != hsdp_share_collective()) return direct_gather(g, *share, send, recv, nbytes);
    hsdp_status st = HSDP_OK;
    int mode = g->size > 1 ? hsdp_agreement_check() : HSDP_AGREE_OFF;
    watch_label(label, !*share); /* a stalled peer is first seen here: name the unit */
    if (mode == HSDP_AGREE_ON && g->size <= FUSED_RANKS) {
        st = agreed_gather(g, label, ident, send, recv, nbytes);
    } else {
        if (mode != HSDP_AGREE_OFF) {
            st = agree(g, label, ident, nbytes);
            watch_label(label, !*share);
        }
        if (st == HSDP_OK) st = raw_all_gather(g, send, recv, nbytes);
    }
    if (st == HSDP_OK && !*share) st = direct_setup(g, share, send, nbytes);
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
static void flush_graves(uint64_t group_id, int all) {
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

static void collective_done(hsdp_group *g) {
    if (atomic_load(&ngraves) == 0) return;
    int world = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    flush_graves(((mpi_group *)g->impl)->id, g->size >= world);
}

static void mpi_share_free(hsdp_group *g, void *share, void *memory) {
    grave *e = malloc(sizeof *e); /* owned by the grave list until flushed */
    if (!e || mpi_done()) {         /* no peer reads after MPI has ended; nowhere to keep it */
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

/* ---------------------------------------------------------------- on the worker */
/* Every call is queued on the worker (or run on this thread while the worker is idle with an
 * empty queue, holding its lock: see hsdp_exec_call), so MPI sees one calling thread at a
 * time and calls keep program order, which collectives across ranks require. */
typedef struct {
    hsdp_group *g;
    const void *send;
    void *recv;
    size_t nbytes;
    int root, color, key;
    hsdp_group **out;
    void **share;
    const char *label;
    uint64_t ident;
    const hsdp_blocks *sblocks, *rblocks;
    size_t rbytes;
    int dest, source;
} call_args;

static hsdp_status do_all_gather(void *p) {
    call_args *a = p;
    return raw_all_gather(a->g, a->send, a->recv, a->nbytes);
}
static hsdp_status do_gather_fixed(void *p) {
    call_args *a = p;
    return fixed_gather(a->g, a->share, a->send, a->recv, a->nbytes, a->label, a->ident);
}
static hsdp_status do_broadcast(void *p) {
    call_args *a = p;
    return raw_broadcast(a->g, a->recv, a->nbytes, a->root);
}
static hsdp_status do_barrier(void *p) {
    call_args *a = p;
    return raw_barrier(a->g);
}
static hsdp_status do_all_to_all(void *p) {
    call_args *a = p;
    return raw_all_to_all(a->g, a->send, a->recv, a->nbytes);
}

static hsdp_status do_all_to_all_blocks(void *p) {
    call_args *a = p;
    return raw_all_to_all_blocks(a->g, a->send, a->sblocks, a->recv, a->rblocks);
}
static hsdp_status do_sendrecv(void *p) {
    call_args *a = p;
    return raw_sendrecv(a->g, a->send, a->nbytes, a->dest, a->recv, a->rbytes, a->source);
}
static hsdp_status do_split(void *p) {
    call_args *a = p;
    return raw_split(a->g, a->color, a->key, a->out);
}
static hsdp_status do_free(void *p) {
    raw_free(p);
    return HSDP_OK;
}

static hsdp_status mpi_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes};
    return hsdp_exec_run(mpi_worker, do_all_gather, &a);
}
static hsdp_status mpi_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                   const char *label, uint64_t ident) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes, .share = share, .label = label,
                   .ident = ident};
    return hsdp_exec_run(mpi_worker, do_gather_fixed, &a);
}
static hsdp_status mpi_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    call_args a = {.g = g, .recv = buf, .nbytes = nbytes, .root = root};
    return hsdp_exec_run(mpi_worker, do_broadcast, &a);
}
static hsdp_status mpi_barrier(hsdp_group *g) {
    call_args a = {.g = g};
    return hsdp_exec_run(mpi_worker, do_barrier, &a);
}
static hsdp_status mpi_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes};
    return hsdp_exec_run(mpi_worker, do_all_to_all, &a);
}

static hsdp_status mpi_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *sb, void *recv,
                                         const hsdp_blocks *rb) {
    call_args a = {.g = g, .send = send, .recv = recv, .sblocks = sb, .rblocks = rb};
    return hsdp_exec_run(mpi_worker, do_all_to_all_blocks, &a);
}
static hsdp_status mpi_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                int source) {
    call_args a = {.g = g, .send = send, .nbytes = sbytes, .dest = dest, .recv = recv, .rbytes = rbytes,
                   .source = source};
    return hsdp_exec_run(mpi_worker, do_sendrecv, &a);
}
static hsdp_status mpi_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    call_args a = {.g = g, .color = color, .key = key, .out = out};
    return hsdp_exec_run(mpi_worker, do_split, &a);
}
static void mpi_free(hsdp_group *g) { (void)hsdp_exec_run(mpi_worker, do_free, g); }

/* ---------------------------------------------------------------- asynchronous slots */
/* A started gather: a worker task, kept in the request's backend state. */
typedef struct {
    hsdp_task task;
    hsdp_req *r;
    const void *send;
    void *recv;
    size_t nbytes;
} gather_task;
_Static_assert(sizeof(gather_task) <= HSDP_REQ_STATE_BYTES, "HSDP_REQ_STATE_BYTES must hold an MPI gather task");

static hsdp_status gather_job(void *p) {
    gather_task *t = p;
    hsdp_group *g = t->r->g;
    hsdp_status st = t->r->share
                         ? fixed_gather(g, t->r->share, t->send, t->recv, t->nbytes, t->r->label, t->r->ident)
                         : raw_all_gather(g, t->send, t->recv, t->nbytes);
    if (st == HSDP_OK && t->r->then) st = t->r->then(t->r->then_arg);
    return st;
}

static hsdp_status mpi_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes) {
    gather_task *t = (gather_task *)(void *)r->state;
    *t = (gather_task){.task = {.fn = gather_job, .arg = t}, .r = r, .send = send, .recv = recv, .nbytes = nbytes};
    /* With a worker this only queues; without one (thread level below SERIALIZED) it runs
     * here before returning. */
    hsdp_exec_submit(mpi_worker, &t->task);
    return HSDP_OK;
}

/* A started sendrecv: a worker task too, waited by mpi_gather_wait (its task comes first). */
typedef struct {
    hsdp_task task;
    hsdp_req *r;
    call_args a;
} sendrecv_task;
_Static_assert(sizeof(sendrecv_task) <= HSDP_REQ_STATE_BYTES, "HSDP_REQ_STATE_BYTES must hold an MPI sendrecv task");
_Static_assert(offsetof(sendrecv_task, task) == 0 && offsetof(gather_task, task) == 0,
               "mpi_gather_wait finds either request's task at the start of its state");

static hsdp_status mpi_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                      size_t rbytes, int source) {
    sendrecv_task *t = (sendrecv_task *)(void *)r->state;
    *t = (sendrecv_task){.r = r,
                         .a = {.g = r->g, .send = send, .nbytes = sbytes, .dest = dest, .recv = recv,
                               .rbytes = rbytes, .source = source}};
    t->task = (hsdp_task){.fn = do_sendrecv, .arg = &t->a};
    hsdp_exec_submit(mpi_worker, &t->task); /* without a worker: runs here */
    return HSDP_OK;
}

/* Waits a started gather or sendrecv: either keeps its worker task first in r->state. */
static void mpi_gather_wait(hsdp_req *r) {
    hsdp_task *task = (hsdp_task *)(void *)r->state;
    r->status = hsdp_task_wait(mpi_worker, task);
    if (r->status != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", task->err);
    r->submit_ns = task->submit_ns;
    r->start_ns = task->start_ns;
    r->end_ns = task->end_ns;
}

/* False again once MPI is finalised (the worker is stopped). */
static int mpi_overlaps(const hsdp_group *g) {
    (void)g;
    return hsdp_exec_running(mpi_worker);
}

/* ---------------------------------------------------------------- world and finalisation */
static int mpi_usable(const char **why) {
    *why = NULL;
    return 1;
}

static hsdp_status dup_world(void *out) {
    MPI_Comm c;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_dup");
    learn_world_peers(); /* collective over the world, like the dup itself */
    return wrap(c, out);
}

static hsdp_status mpi_world(hsdp_group **out, int *we_init) {
    int initialized = 0;
    *we_init = 0;
    if (mpi_done()) return hsdp_fail(HSDP_ESTATE, "MPI has already been finalised in this process");
    MPI_Initialized(&initialized);
    if (!initialized) {
        promote_libmpi();
        int provided = 0;
        /* One thread makes MPI calls at a time (the worker), so SERIALIZED is enough. */
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Init_thread");
        *we_init = 1;
    }
    if (!mpi_worker) {
        int provided = MPI_THREAD_SINGLE;
        MPI_Query_thread(&provided);
        /* Whoever initialised MPI with less than SERIALIZED forbids calls from our thread:
         * then every call runs on the caller's thread and gathers do not overlap. */
        if (provided >= MPI_THREAD_SERIALIZED) {
            hsdp_status st = hsdp_exec_start(&mpi_worker);
            if (st != HSDP_OK) return st;
        }
    }
    watch_start_thread();
    return hsdp_exec_run(mpi_worker, dup_world, out);
}

/* Every rank of the world meets here before MPI_Finalize, watched like any collective.
 * MPI_Finalize is collective too, but unwatched: once gathers are direct a rank may finish
 * alone (correctly: the weights do not change), and a peer stalled after warm-up would hold
 * it in MPI_Finalize forever, silently. Past HSDP_TIMEOUT the watchdog names that peer and
 * ends the job, as in any collective. On the calling thread: the worker has stopped. */
static hsdp_status finalize_barrier(void) {
    int n = 0;
    if (MPI_Comm_size(MPI_COMM_WORLD, &n) != MPI_SUCCESS || n < 2) return HSDP_OK;
    int *ranks = malloc(sizeof *ranks * (size_t)n); /* freed below, after the watchdog stops */
    if (ranks)
        for (int i = 0; i < n; i++) ranks[i] = i;
    pthread_mutex_lock(&watch_mu);
    snprintf(watch_next, sizeof watch_next, "finalising: every rank ends MPI together");
    pthread_mutex_unlock(&watch_mu);
    watch_begin_ranks("MPI_Barrier", ranks, n, 0);
    int rc = MPI_Barrier(MPI_COMM_WORLD);
    watch_end();
    watch_stop_thread(); /* no longer reads ranks */
    free(ranks);
    return rc == MPI_SUCCESS ? HSDP_OK : mpi_fail(rc, "MPI_Barrier (finalising)");
}

static hsdp_status mpi_finalize(void) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized || mpi_done()) return HSDP_OK;
    /* MPI_Finalize belongs on the thread that initialised MPI (this one); the worker must be
     * idle for good first. */
    hsdp_exec_stop(mpi_worker);
    hsdp_status met = finalize_barrier(); /* peers' status asks are still answered meanwhile */
    watch_stop_thread();
    hsdp_status_stop();
    int rc = MPI_Finalize();
    flush_graves(0, 1); /* MPI_Finalize is collective: no peer reads any more */
    if (met != HSDP_OK) return met;
    return rc == MPI_SUCCESS ? HSDP_OK : mpi_fail(rc, "MPI_Finalize");
}

const hsdp_backend hsdp_backend_mpi = {
    .name = "mpi",
    .usable = mpi_usable,
    .world = mpi_world,
    .all_gather = mpi_all_gather,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .all_to_all = mpi_all_to_all,
    .all_to_all_blocks = mpi_all_to_all_blocks,
    .split = mpi_split,
    .free = mpi_free,
    .gather_start = mpi_gather_start,
    .gather_wait = mpi_gather_wait,
    .overlaps = mpi_overlaps,
    .finalize = mpi_finalize,
    .gather_unit = mpi_gather_unit,
    .share_free = mpi_share_free,
    .sendrecv = mpi_sendrecv,
    .sendrecv_start = mpi_sendrecv_start,
};

#else /* no MPI at build time */
#include "backend.h"

static const char no_mpi[] =
    "hsdp was built without MPI, so it cannot run across processes. Install an MPI "
    "implementation with its headers (Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin), "
    "then reinstall hsdp (pip install --force-reinstall --no-binary hsdp hsdp, or pip install . "
    "from a checkout)";

static int mpi_usable(const char **why) {
    *why = no_mpi;
    return 0;
}

static hsdp_status mpi_world(hsdp_group **out, int *we_init) {
    *out = NULL;
    *we_init = 0;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s", no_mpi);
}

/* Known by name so that asking for it says what to install; never yields a group. */
const hsdp_backend hsdp_backend_mpi = {.name = "mpi", .usable = mpi_usable, .world = mpi_world};
#endif
