/* watchdog.c - bounded waits that name who is missing, for every backend (watchdog.h). */
#define _GNU_SOURCE /* process_vm_readv, through peer_read.h */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "peer_read.h"
#include "watchdog.h"

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static char watch_what[320];        /* under watch_mu: the collective in progress */
static char watch_next[96];         /* under watch_mu: what the next collective is for */
static _Atomic uint64_t watch_start; /* ns; 0 while no collective runs */
static int watch_rank = -1;          /* this process's world rank, for the message */
static void (*watch_expire)(void);
static pthread_t watch_thread;
static atomic_int watch_running, watch_stop;
/* What this rank waits in, published for its peers' watchdogs, which read it from their own
 * process (process_vm_readv, same host) while this one may be rewriting it: a seqlock. seq
 * is odd while active and what are written (under watch_mu, the writers' lock); a peer takes
 * them only between two equal, even reads of seq (read_published). Readers in this process
 * (describe_wait) hold watch_mu. */
static struct {
    _Atomic uint64_t seq;
    _Atomic uint64_t active;
    char what[320];
} watch_pub;
static const int *watch_group;  /* under watch_mu: world ranks of the collective's group */
static int watch_group_size;

void hsdp_watch_next(const char *what) {
    pthread_mutex_lock(&watch_mu);
    snprintf(watch_next, sizeof watch_next, "%s", what);
    pthread_mutex_unlock(&watch_mu);
}

void hsdp_watch_label(const char *label, int first) {
    pthread_mutex_lock(&watch_mu);
    snprintf(watch_next, sizeof watch_next, "%s unit '%s'", first ? "the first gather of" : "gathering",
             label ? label : "");
    pthread_mutex_unlock(&watch_mu);
}

/* watch_mu held. NULL or "": inactive (what keeps its old text, unread). */
static void publish_locked(const char *what) {
    uint64_t seq = atomic_load_explicit(&watch_pub.seq, memory_order_relaxed);
    atomic_store_explicit(&watch_pub.seq, seq + 1, memory_order_relaxed); /* odd: being written */
    atomic_thread_fence(memory_order_release);
    int on = what && *what;
    if (on) snprintf(watch_pub.what, sizeof watch_pub.what, "%s", what);
    atomic_store_explicit(&watch_pub.active, (uint64_t)on, memory_order_relaxed);
    atomic_store_explicit(&watch_pub.seq, seq + 2, memory_order_release); /* even: whole again */
}

void hsdp_watch_publish(const char *what) {
    pthread_mutex_lock(&watch_mu);
    publish_locked(what);
    pthread_mutex_unlock(&watch_mu);
}

void hsdp_watch_begin(const char *op, const int *ranks, int size, size_t nbytes) {
    pthread_mutex_lock(&watch_mu);
    int n = snprintf(watch_what, sizeof watch_what, "%s of %zu bytes over a group of %d ranks", op, nbytes, size);
    if (watch_next[0] && n > 0 && (size_t)n < sizeof watch_what)
        snprintf(watch_what + n, sizeof watch_what - (size_t)n, " (%s)", watch_next);
    watch_next[0] = '\0';
    watch_group = ranks;
    watch_group_size = size;
    publish_locked(watch_what);
    pthread_mutex_unlock(&watch_mu);
    atomic_store(&watch_start, hsdp_now_ns());
}

void hsdp_watch_end(void) {
    atomic_store(&watch_start, 0);
    pthread_mutex_lock(&watch_mu); /* the publication's writers take turns (seqlock) */
    publish_locked(NULL);
    pthread_mutex_unlock(&watch_mu);
}

static void *watchdog(void *arg) {
    (void)arg;
    while (!atomic_load(&watch_stop)) {
        struct timespec tick = {0, 100 * 1000 * 1000};
        nanosleep(&tick, NULL);
        uint64_t t0 = atomic_load(&watch_start), limit = hsdp_timeout_ns();
        if (!t0 || !limit || hsdp_now_ns() - t0 <= limit) continue;
        char what[sizeof watch_what];
        /* The group's ranks are copied under the lock: the group (and its rank array) may be
         * freed once the collective completes, while the peers are asked (up to 4 s). Owner:
         * this loop iteration. */
        pthread_mutex_lock(&watch_mu);
        memcpy(what, watch_what, sizeof what);
        int size = watch_group ? watch_group_size : 0;
        int *ranks = size > 0 ? malloc(sizeof *ranks * (size_t)size) : NULL;
        if (ranks) memcpy(ranks, watch_group, sizeof *ranks * (size_t)size);
        pthread_mutex_unlock(&watch_mu);
        if (atomic_load(&watch_start) != t0) { /* it completed meanwhile */
            free(ranks);
            continue;
        }
        char missing[640];
        hsdp_who_is_missing(missing, sizeof missing, what, ranks, ranks ? size : 0);
        free(ranks);
        if (atomic_load(&watch_start) != t0) continue; /* it completed while the peers were asked */
        fprintf(stderr,
                "hsdp: rank %d: %s has waited more than %.3g s (HSDP_TIMEOUT): some rank of the group has not "
                "reached it (stalled, hung, or at a different step)%s; ending the job\n",
                watch_rank, what, (double)limit / 1e9, missing);
        fflush(stderr);
        watch_expire(); /* MPI_Abort: the launcher ends every rank */
        _exit(124);
    }
    return NULL;
}

void hsdp_watch_start_thread(int world_rank, void (*expire)(void)) {
    if (atomic_load(&watch_running)) return;
    watch_rank = world_rank;
    watch_expire = expire;
    atomic_store(&watch_stop, 0);
    if (pthread_create(&watch_thread, NULL, watchdog, NULL) == 0) atomic_store(&watch_running, 1);
}

void hsdp_watch_stop_thread(void) {
    if (!atomic_load(&watch_running)) return;
    atomic_store(&watch_stop, 1);
    pthread_join(watch_thread, NULL);
    atomic_store(&watch_running, 0);
}

/* ---------------------------------------------------------------- naming who did not arrive */
typedef struct {
    uint64_t pid, addr, host, pidns;
    hsdp_status_card card;
} peer;
_Static_assert(sizeof(peer) == HSDP_PEER_WORDS * sizeof(uint64_t), "a peer record is plain words");
static peer *world_peers; /* owned: one per world rank; set once, before peers_set */
static int world_n, world_me = -1;
static atomic_int peers_set; /* read by other threads (a backend's watchdog) */

/* What this rank waits in, for a peer's watchdog asking over TCP (on the answering thread). */
static int describe_wait(char *what, size_t n) {
    pthread_mutex_lock(&watch_mu);
    int active = (int)atomic_load(&watch_pub.active);
    snprintf(what, n, "%s", active ? watch_pub.what : "");
    pthread_mutex_unlock(&watch_mu);
    return active;
}

void hsdp_peers_mine(uint64_t mine[HSDP_PEER_WORDS]) {
    peer p = {(uint64_t)getpid(), (uintptr_t)&watch_pub, hsdp_host_id(), hsdp_pidns_id(), {0, 0, {0}}};
    hsdp_status_serve(describe_wait, &p.card);
    memcpy(mine, &p, sizeof p);
}

int hsdp_peers_learn(const uint64_t *all, int n, int me) {
    if (world_peers || n < 2) return 0;
    peer *copy = malloc(sizeof *copy * (size_t)n); /* owned by world_peers, for the process's life */
    if (!copy) return -1;
    memcpy(copy, all, sizeof *copy * (size_t)n);
    world_peers = copy;
    world_n = n;
    world_me = me;
    atomic_store(&peers_set, 1);
    return 0;
}

int hsdp_peers_known(void) { return atomic_load(&peers_set); }

/* A peer's publication (watch_pub, at addr in process pid on this host), read consistently:
 * its seq, what it holds, its seq again, taken when both are the same even number (no write
 * in between); retried a few times while the peer writes. what gets n - 1 bytes (the caller
 * terminates them). 0 when read; else the caller asks the peer over TCP instead. */
static int read_published(pid_t pid, uint64_t addr, uint64_t *active, char *what, size_t n) {
    typedef __typeof__(watch_pub) pub;
    for (int tries = 0; tries < 8; tries++) {
        uint64_t before = 1, after = 0;
        if (hsdp_peer_read(pid, &before, addr + offsetof(pub, seq), sizeof before) != 0) return -1;
        if (!(before & 1) &&
            (hsdp_peer_read(pid, active, addr + offsetof(pub, active), sizeof *active) != 0 ||
             hsdp_peer_read(pid, what, addr + offsetof(pub, what), n - 1) != 0 ||
             hsdp_peer_read(pid, &after, addr + offsetof(pub, seq), sizeof after) != 0))
            return -1;
        if (!(before & 1) && before == after) return 0;
        struct timespec pause = {0, 100 * 1000}; /* a write is a snprintf: over within this */
        nanosleep(&pause, NULL);
    }
    return -1;
}

void hsdp_who_is_missing(char *out, size_t n, const char *what, const int *ranks, int size) {
    out[0] = '\0';
    if (!ranks || !atomic_load(&peers_set)) return;
    uint64_t host = hsdp_host_id(), pidns = hsdp_pidns_id();
    size_t used = (size_t)snprintf(out, n, "; not in it:");
    int absent = 0, unknown = 0, asked = 0;
    enum { ASK_MAX = 16, ASK_MS = 1000 }; /* peers asked over TCP, and how long each may take */
    uint64_t ask_until = hsdp_now_ns() + 4000000000ull; /* the job ends soon after: 4 s for all */
    char unknowns[128] = "";
    size_t uused = 0;
    for (int i = 0; i < size && used < n; i++) {
        int r = ranks[i];
        if (r == world_me || r < 0 || r >= world_n) continue;
        peer *p = &world_peers[r];
        uint64_t active = 0;
        char theirs[sizeof watch_pub.what] = "";
        int readable = p->host == host && p->pidns == pidns &&
                       read_published((pid_t)p->pid, p->addr, &active, theirs, sizeof theirs) == 0;
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
