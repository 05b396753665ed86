/* backend.h - the collective backend table. Each backend is an existing engine (MPI, NCCL) or
 * the dependency-free world of one; every collective goes through one of them (the only
 * socket hsdp's own code opens is the watchdog's status port, peer_status.h).
 * A backend is one const table of functions, registered in backend.c and found by name.
 * A group is a set of ranks with a backend-specific handle; every collective takes one.
 *
 * Required slots: world, all_gather, broadcast, barrier, all_to_all, split, free.
 * Optional slots (NULL when absent):
 *   gather_start / gather_wait  an all-gather that progresses while the caller computes
 *                               (MPI: its worker thread; NCCL: a side stream and events).
 *                               Without them a started gather runs before start returns.
 *   overlaps                    whether started gathers really progress in the background
 *   device                      the device its unsharded buffers live on (device.h; NCCL:
 *                               CUDA); NULL: host memory only
 *   device_now                  the device table in effect, when the loaded runtime decides
 *                               it (NCCL over the test fake's host-readable memory: the CPU)
 *   gather_fixed / gather_unit / share_free
 *                               an all-gather of a chunk that never changes after its first
 *                               gather (a unit's shard): from the second gather on the
 *                               backend may read the peers' chunks itself, with no peer
 *                               taking part (MPI on one host: process_vm_readv; NCCL: the
 *                               chunk is copied to the device once, and gathered from there);
 *                               gather_unit is told the unit's identity too (MPI: to check
 *                               that every rank gathers the same unit)
 *   share_kind                  what a share set by gather_fixed is, for Unit.gather_path
 *   all_to_all_blocks           an all-to-all between strided layouts (hsdp_blocks), packed
 *                               by the backend itself (MPI: derived datatypes); without it
 *                               backend.c packs host memory around all_to_all
 *   finalize                    ends the backend's runtime, when world() started it
 *   sendrecv                    point to point, for ring attention: one message to a group
 *                               rank and one from another, as one step (MPI: MPI_Sendrecv;
 *                               NCCL: ncclSend + ncclRecv in a group, device buffers only,
 *                               untested on a GPU). Without it hsdp_sendrecv is
 *                               HSDP_EUNSUPPORTED
 *   sendrecv_start              the same, progressing while the caller computes (MPI: on its
 *                               worker thread); waited by gather_wait, which waits any request
 *                               the backend's start slots began */
#ifndef HSDP_BACKEND_H
#define HSDP_BACKEND_H

#include "device.h"
#include "hsdp.h"

/* Where the size blocks of an all-to-all lie in a buffer, so that a strided tensor is sent or
 * received in place: block j is `inner` contiguous bytes at base + j * step + sum over k of
 * i_k * stride[k], for every i_k < count[k] (k = 0 outermost), in that order. A contiguous
 * block is ndims = 0 with inner = its bytes. */
enum { HSDP_BLOCK_DIMS = 3 };
typedef struct {
    size_t inner, step;
    int ndims;
    size_t count[HSDP_BLOCK_DIMS], stride[HSDP_BLOCK_DIMS];
} hsdp_blocks;

struct hsdp_backend {
    const char *name;
    /* 1 when the backend is compiled in and can run in this process; else 0 with *why set to
     * a static sentence that says what is missing and what to do. */
    int (*usable)(const char **why);
    /* The world group (caller owns *out). *we_init is set to 1 when this call started the
     * backend's runtime, so that only then finalize ends it. */
    hsdp_status (*world)(hsdp_group **out, int *we_init);

    /* Every rank sends `nbytes` from send; recv (size * nbytes) receives rank i's block at
     * i * nbytes. send may equal recv + rank * nbytes (in place). */
    hsdp_status (*all_gather)(hsdp_group *g, const void *send, void *recv, size_t nbytes);
    hsdp_status (*broadcast)(hsdp_group *g, void *buf, size_t nbytes, int root);
    hsdp_status (*barrier)(hsdp_group *g);
    /* send and recv hold size blocks of `nbytes`: block j of send goes to rank j and arrives
     * as block (this rank) of its recv. send and recv must not overlap. */
    hsdp_status (*all_to_all)(hsdp_group *g, const void *send, void *recv, size_t nbytes);
    /* Collective over g: ranks with the same color form a new group, ordered by key. */
    hsdp_status (*split)(hsdp_group *g, int color, int key, hsdp_group **out);
    void (*free)(hsdp_group *g);

    /* r->g, r->then and r->then_arg are set; the backend starts the all-gather and runs
     * r->then after it. gather_wait blocks until both are done and fills r->status,
     * r->err and the times. */
    hsdp_status (*gather_start)(hsdp_req *r, const void *send, void *recv, size_t nbytes);
    void (*gather_wait)(hsdp_req *r);
    int (*overlaps)(const hsdp_group *g);
    const hsdp_device_i *device;
    /* The device table in effect now, when it depends on the runtime the backend loaded (NCCL
     * over a CUDA runtime whose device memory the host reads: the test fake's, viewed as the
     * CPU); NULL: `device` always. Read through hsdp_backend_device. */
    const hsdp_device_i *(*device_now)(void);
    hsdp_status (*finalize)(void);

    /* All-gathers a chunk that stays the same from this call on. *share starts NULL and is
     * the caller's; the first call is a collective that also decides, the same way on every
     * rank, whether later calls read the peers' chunks directly (what that needs is kept in
     * *share, released by share_free). Later calls need no peer to take part, so a busy or
     * desynchronised peer cannot stall them. Every rank's first call for a chunk must be
     * the same collective, as with all_gather. */
    hsdp_status (*gather_fixed)(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                const char *label);
    /* gather_fixed, told the unit's identity (hsdp_unit.ident, the same on every rank for
     * one unit) as well: for a backend that checks that the ranks gather the same unit
     * (agreement.h: MPI, NCCL).
     * Preferred to gather_fixed when set. */
    hsdp_status (*gather_unit)(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                               const char *label, uint64_t ident);
    /* Releases share and frees memory (the chunk, from aligned_alloc; ownership passes here)
     * once no peer can still be reading it. */
    void (*share_free)(hsdp_group *g, void *share, void *memory);
    /* "direct" when NULL */
    const char *(*share_kind)(const void *share);
    /* Copies the chunk a share holds a copy of (NCCL: on the device) into host memory `out`,
     * once every write to that copy has landed. A backend with this slot sets its share in
     * gather_start itself (no other thread writes it), and the unit may then drop its host
     * chunk after the first gather (hsdp_unit_drop_host). NULL: shares hold no copy. */
    hsdp_status (*share_read)(hsdp_group *g, const void *share, void *out, size_t nbytes);
    hsdp_status (*all_to_all_blocks)(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
                                     const hsdp_blocks *r);
    /* Sends sbytes from send to group rank dest and receives exactly rbytes into recv from
     * group rank source (both this rank, or neither: backend.c checks). */
    hsdp_status (*sendrecv)(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                            int source);
    /* r->g is set; the backend starts the sendrecv and gather_wait ends it. */
    hsdp_status (*sendrecv_start)(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                  size_t rbytes, int source);
};

struct hsdp_group {
    const hsdp_backend *backend;
    int rank, size;
    void *impl; /* owned by the backend; released by backend->free */
    /* Units made over this group so far (hsdp_unit_init, under the caller's lock: Python's
     * GIL). Every rank makes a group's units in the same order, so a unit's count is its
     * identity across ranks: two models of one architecture have units alike in name and
     * size, and this tells them apart. Zero in a new group. */
    uint64_t units_made;
    /* Collective unit gathers issued on this group so far: the sequence number of the next
     * one's ticket (agreement.h; the backend's issuing thread). Zero in a new group. */
    uint64_t unit_gathers;
};

/* ---------------------------------------------------------------- the registry (backend.c) */
size_t hsdp_backend_count(void);
const hsdp_backend *hsdp_backend_at(size_t i);
/* NULL when no backend has that name. */
const hsdp_backend *hsdp_backend_find(const char *name);
/* The world group of the named backend. An unknown name is HSDP_EINVAL naming the known
 * ones; a known backend that is not usable here is HSDP_EUNSUPPORTED with its reason. */
hsdp_status hsdp_backend_world(const char *name, hsdp_group **out, int *we_init);
/* Ends the named backend's runtime (only call when its world() reported *we_init). */
hsdp_status hsdp_backend_finalize(const char *name);

/* ---------------------------------------------------------------- collectives as callers use them */
hsdp_status hsdp_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root);
hsdp_status hsdp_barrier(hsdp_group *g);
hsdp_status hsdp_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes);
/* The all-to-all between two block layouts (both describe g->size blocks of the same bytes).
 * Host memory unless the backend's slot says otherwise. */
hsdp_status hsdp_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
                                   const hsdp_blocks *r);
/* Bytes in one block; 0 with an error recorded when the layout is malformed or overflows.
 * *span gets the bytes from the buffer's start to the end of its last block (size blocks). */
size_t hsdp_blocks_bytes(const hsdp_blocks *b, int size, size_t *span);
hsdp_status hsdp_group_split(hsdp_group *g, int color, int key, hsdp_group **out);
/* Frees the group (NULL is fine). The caller owned it. */
void hsdp_group_free(hsdp_group *g);
/* Whether gathers started on g progress while the caller computes. */
int hsdp_group_overlaps(const hsdp_group *g);

/* An all-gather followed by `then` (may be NULL), started through the backend's asynchronous
 * slots, or run here before returning when it has none. r is owned by the caller and stays
 * alive until hsdp_gather_wait returns. With share non-NULL the chunk is fixed and the
 * gather goes through gather_fixed (see the slot); share must outlive the request. */
hsdp_status hsdp_gather_start(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                              size_t nbytes, hsdp_status (*then)(void *), void *then_arg);
/* Waits for r and returns its status (its message becomes this thread's last error). */
hsdp_status hsdp_gather_wait(hsdp_req *r);
/* The same work, synchronously, through the backend's asynchronous slot (start, then wait),
 * where `then` runs as a started gather's does (NCCL: on the device; MPI: on its worker's
 * context, the float8 wire decoded as it lands). Told it is waited at once (r->now), MPI runs it
 * on this thread while its worker is idle, as a synchronous call: no handoff. */
hsdp_status hsdp_gather_through_slot(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                                     size_t nbytes, hsdp_status (*then)(void *), void *then_arg);
/* The same work, synchronously, through the backend's synchronous all_gather. */
hsdp_status hsdp_gather_now(hsdp_req *r, hsdp_group *g, void **share, const void *send, void *recv,
                            size_t nbytes, hsdp_status (*then)(void *), void *then_arg);
/* The all-gather of a fixed chunk (gather_unit, gather_fixed, or all_gather when the backend
 * has neither); ident: the unit's (hsdp_unit.ident). */
hsdp_status hsdp_gather_fixed(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                              const char *label, uint64_t ident);
/* The share a backend sets for a chunk it will always gather collectively. */
void *hsdp_share_collective(void);
/* Releases a share set by hsdp_gather_fixed (NULL is fine) and frees memory, the fixed chunk
 * (from aligned_alloc; the call owns it): at once, or once no peer can still be reading it. */
void hsdp_share_free(hsdp_group *g, void *share, void *memory);
/* "unset" before the first gather; then "collective", or what the backend's share is
 * ("direct" for MPI peers read in place, "device" for NCCL's device copy). */
const char *hsdp_share_kind(const hsdp_group *g, const void *share);
/* Whether a unit's gathers read the peers' chunks directly ("direct" above). */
int hsdp_share_is_direct(const hsdp_group *g, const void *share);
/* The chunk a share holds a copy of, into host memory (see the share_read slot). */
hsdp_status hsdp_share_read(hsdp_group *g, const void *share, void *out, size_t nbytes);

/* How long a collective may wait for its peers before the job is ended (MPI) or the
 * communicators aborted (NCCL); the timeout names who did not arrive (watchdog.h). From HSDP_TIMEOUT (seconds; 0: no limit) on first use, else the default. */
enum { HSDP_DEFAULT_TIMEOUT_S = 600 };
uint64_t hsdp_timeout_ns(void);

/* An on/off HSDP_* variable, by the one rule every flag of hsdp follows (hsdp.world.flags.env_flag
 * in Python, the build's in setup.py): unset or empty is `dflt`; 1/on/yes/true is 1 and
 * 0/off/no/false is 0 (any case); anything else is `dflt`, said on stderr. */
int hsdp_env_flag(const char *name, int dflt);
hsdp_status hsdp_set_timeout(double seconds);

/* Whether unit gathers that are collectives check that every rank gathers the same unit
 * (agreement.h; MPI and NCCL). HSDP_AGREE_ON, the default, carries the check with the gather
 * (MPI: where the group is small); HSDP_AGREE_SEPARATE always spends its own round trip first (tests of that
 * path); HSDP_AGREE_OFF only measures what the check costs. Every rank of a group must have
 * the same mode, or their messages no longer pair up. */
enum { HSDP_AGREE_OFF = 0, HSDP_AGREE_ON = 1, HSDP_AGREE_SEPARATE = 2 };
void hsdp_set_agreement_check(int mode);
int hsdp_agreement_check(void);

/* The float8 wire's pieces on MPI (mpi_agreement.c): a wire gather's chunk of more than this
 * many bytes travels in pieces of at least this many (at most HSDP_WIRE_MAX_PIECES), each
 * decoded as it lands. 0, the default: one message (over TCP on the 2-core test machine the
 * pieces were slower, docs/performance.md). Each rank's ticket says how it splits, so ranks
 * need not agree on it. */
enum { HSDP_WIRE_MAX_PIECES = 32 };
void hsdp_set_wire_piece_bytes(size_t bytes);
size_t hsdp_wire_piece_bytes(void);

/* Point to point (ring attention): sbytes from send to group rank dest, and exactly rbytes
 * into recv from group rank source; the peers' calls pair up in program order. dest ==
 * source == this rank is a copy. send and recv must not overlap. HSDP_EUNSUPPORTED when the
 * backend has no sendrecv slot, HSDP_EINVAL for a rank outside the group. */
hsdp_status hsdp_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                          int source);
/* The same, started: it progresses while the caller computes where the backend has
 * sendrecv_start (else it runs before this returns). r is the caller's and stays alive
 * until hsdp_gather_wait(r) returns, which ends it and gives its status. */
hsdp_status hsdp_sendrecv_start(hsdp_req *r, hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv,
                                size_t rbytes, int source);

/* The backends, each defined in its own file (backend_<name>.c), from the registry's list. */
#define HSDP_BACKEND(name) extern const hsdp_backend hsdp_backend_##name;
#define HSDP_TEST_BACKEND(name) extern const hsdp_backend hsdp_backend_##name __attribute__((weak));
#include "backends.def"

#endif
