/* nccl_internal.h - what the files of the NCCL backend share. Each file uses only the ones
 * above it in this list, never one below (backend_nccl.c, the table, is the only one that
 * names them all):
 *   nccl_load.c        the two libraries, opened at run time, and their function table (api)
 *   nccl_flight.c      process state, the flight ring, its watchdog, failing and aborting,
 *                      host and stream waits, the device guard, staging, allocation
 *   nccl_device.c      the device tables (CUDA, and the test fake's host view), buffers, and
 *                      a unit's device copy of its shard (shares: made, read, freed)
 *   nccl_collectives.c the synchronous collectives (all-gather, broadcast, barrier, all-to-all)
 *   nccl_agreement.c   the agreement tickets beside a unit's data ([Note: tickets checked late])
 *   nccl_gather.c      unit gathers and requests (started, waited), the float8 wire, sendrecv
 *   nccl_world.c       communicators: the world from its bootstrap, splits, frees, finalize
 *   backend_nccl.c     the backend table (and the stand-ins of a build with HSDP_NO_NCCL=1)
 * Only compiled without HSDP_NO_NCCL. */
#ifndef HSDP_NCCL_INTERNAL_H
#define HSDP_NCCL_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "backend_nccl.h"
#include "cuda_abi.h"

/* ---------------------------------------------------------------- nccl_load.c */
#define NCCL_REQUIRED(X)                                                                                     \
    X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclAllGather) X(ncclBroadcast) X(ncclAllReduce) \
    X(ncclSend) X(ncclRecv) X(ncclGroupStart) X(ncclGroupEnd) X(ncclCommGetAsyncError) X(ncclCommAbort)         \
    X(ncclCommUserRank) X(ncclCommCount) X(ncclGetErrorString)
/* Resolved when present, gated on the version: init with a config (2.14: non-blocking, so
 * it can be timed out), ncclCommSplit (2.18), ncclAlltoAll (2.28.3), last-error text (2.13). */
#define NCCL_OPTIONAL(X) X(ncclCommInitRankConfig) X(ncclCommSplit) X(ncclAlltoAll) X(ncclGetLastError)
#define CUDA_REQUIRED(X)                                                                                     \
    X(cudaGetDeviceCount) X(cudaSetDevice) X(cudaMalloc) X(cudaFree) X(cudaMemcpyAsync)                      \
    X(cudaStreamCreateWithPriority) X(cudaDeviceGetStreamPriorityRange) X(cudaStreamDestroy)                 \
    X(cudaStreamWaitEvent) X(cudaStreamSynchronize) X(cudaEventCreateWithFlags) X(cudaEventDestroy)         \
    X(cudaEventRecord) X(cudaEventQuery) X(cudaPointerGetAttributes) X(cudaGetErrorString) X(cudaGetLastError) \
    X(cudaHostAlloc) X(cudaFreeHost)
/* Resolved when present: every CUDA runtime hsdp supports has them, but a missing one only
 * loses the refusal of graph capture (nccl_refuse_capture) or the device's free-memory query
 * (hsdp_device_i.mem_free: resident_bytes="auto" then says it cannot read it). */
#define CUDA_OPTIONAL(X) X(cudaStreamIsCapturing) X(cudaMemGetInfo)

#define NCCL_DECLARE(name) hsdp_##name##_fn name;
typedef struct {
    void *nccl, *cudart; /* dlopen handles, owned here (kept open for the process) */
    int loaded, version;
    int host_view; /* the runtime's device memory is host memory the host reads (the test fake):
                      nccl_device_now gives the host's view of it (nccl_device.c) */
    NCCL_REQUIRED(NCCL_DECLARE)
    NCCL_OPTIONAL(NCCL_DECLARE)
    CUDA_REQUIRED(NCCL_DECLARE)
    CUDA_OPTIONAL(NCCL_DECLARE)
} nccl_api;
#undef NCCL_DECLARE
extern nccl_api hsdp_nccl_api;
/* The short name every file of the backend reads the table by (api.ncclAllGather, CUDA()); the
 * symbol carries the project's prefix. Defined after every header a file includes. */
#define api hsdp_nccl_api

/* Every CUDA call goes through CUDA(): a failure, handled or not, is cleared from the calling
 * thread's last error at once. hsdp shares the libcudart torch has mapped, so an error left
 * there (an event's cudaErrorNotReady while polling, a failed cudaMalloc we fall back from)
 * would be raised by torch's next kernel-launch check (cudaGetLastError) on an unrelated
 * kernel. A sticky error (a fault in a kernel) cannot be cleared, and is meant to be seen. */
static inline hsdp_cudaError_t nccl_quiet(hsdp_cudaError_t e) {
    if (e != hsdp_cudaSuccess && api.cudaGetLastError) (void)api.cudaGetLastError();
    return e;
}
#define CUDA(fn, ...) nccl_quiet(api.fn(__VA_ARGS__))
/* dlsym into a function pointer slot, the POSIX way; 1 when found. */
int nccl_resolve(void *lib, const char *name, void *slot);

/* ---------------------------------------------------------------- nccl_flight.c */
typedef struct nccl_comm {
    hsdp_ncclComm_t comm;
    int aborted;
    int size;
    int *world_ranks;       /* owned: the world rank of each rank of the group (to name who is missing) */
    struct nccl_comm *next; /* the live list, under S.mu */
} nccl_comm;

/* A unit's shard once on the device (the share of hsdp_gather_fixed); owned by the unit,
 * released by nccl_share_free. */
typedef struct {
    void *dev;
} nccl_share;

enum { RING = 256 }; /* collectives in flight that the watchdog watches */
typedef struct {
    hsdp_cudaEvent_t ev; /* created once, reused once retired */
    uint64_t t0;
    const char *dst; /* the device memory it writes (NULL: none a consumer sees) */
    size_t dst_n;
    const nccl_comm *comm; /* whose collective, to name who is missing (NULL: not known) */
    char what[160];
} flight;

typedef struct {
    pthread_mutex_t mu;    /* the ring, the live list, the scratch buffer */
    pthread_mutex_t issue; /* one thread at a time enqueues NCCL work, in program order */
    pthread_mutex_t calls; /* every NCCL call on a live communicator, and its abort; held only
                              around NCCL calls, never a CUDA call that may block; before S.mu */
    nccl_comm *issuing;    /* S.issue held: the communicator of the collectives being tracked */
    int world_up, device;
    hsdp_cudaStream_t comm, compute;
    hsdp_cudaEvent_t released, ready;
    int have_released;
    /* [Note: readers on other streams] A DLPack consumer on a stream other than the compute
     * stream reads pooled buffers too: the release must cover its reads, or the next gather
     * into that buffer overwrites bytes it still reads. Each such stream seen since the last
     * release (read) gets an event recorded at the release (pending), which the next
     * collective waits on. A stream given to DLPack must outlive the buffers it read until
     * their release (torch's pool streams live for the process). Under S.mu. */
    struct {
        hsdp_cudaStream_t stream;
        hsdp_cudaEvent_t ev; /* created on first use, destroyed at finalize */
        int read, pending;
    } readers[16];
    int nreaders;
    atomic_int readers_pending;
    void *scratch; /* device staging for host buffers; owned here, freed at finalize */
    size_t scratch_n;
    void *pinned;              /* PIN_SLOTS pinned host slots for uploads (cudaHostAlloc); freed at finalize */
    hsdp_cudaEvent_t pin_ev[2]; /* each slot's last copy; the slot is reused once it has happened */
    int pin_used[2];
    flight ring[RING];
    unsigned head, count;
    nccl_comm *live;
    pthread_t watchdog;
    int watchdog_on;
    atomic_int stop;
    atomic_int failed;
    char why[1024];
    struct {
        unsigned char id[HSDP_NCCL_ID_BYTES];
        int rank, size, device, set;
    } boot;
} nccl_state;
extern nccl_state hsdp_nccl_state;
/* The short name every file of the backend reads the process state by (S.mu, S.comm). */
#define S hsdp_nccl_state

void nccl_device_guard(void);
hsdp_cudaError_t nccl_dev_malloc(void **p, size_t n);
/* The stream a collective's consumer reads on: the thread's call stream when set, else the
 * compute stream. */
hsdp_cudaStream_t nccl_consumer_stream(void);
void nccl_call_stream(void *stream, int set);
const char *nccl_text(hsdp_ncclResult_t rc, nccl_comm *c);
hsdp_status nccl_cuda_fail(hsdp_cudaError_t e, const char *what);
#define CUDA_TRY(call, what)                                                                                  \
    do {                                                                                                      \
        hsdp_cudaError_t e_ = (call);                                                                         \
        if (e_ != hsdp_cudaSuccess) return nccl_cuda_fail(e_, what);                                          \
    } while (0)
hsdp_status nccl_failed_status(void);
hsdp_status nccl_failed_status_if_failed(void);
__attribute__((format(printf, 1, 2))) void nccl_abort_all_locked(const char *fmt, ...);
void nccl_abort_comms_locked(void);
void nccl_issue_unlock(void);
/* The same from a caller that does not hold S.mu; returns the failure every call now gets. */
#define ABORT_ALL(...)                                                                                        \
    (pthread_mutex_lock(&S.mu), nccl_abort_all_locked(__VA_ARGS__), pthread_mutex_unlock(&S.mu),              \
     nccl_failed_status())
double nccl_timeout_s(void);
void nccl_nap(uint64_t since);
hsdp_status nccl_done(nccl_comm *c, hsdp_ncclResult_t rc, const char *what);
int nccl_capture_error(hsdp_cudaError_t e);
hsdp_status nccl_refuse_capture(hsdp_cudaStream_t stream, const char *what);
hsdp_status nccl_track(const char *what, const void *dst, size_t dst_n, hsdp_cudaEvent_t *ev);
hsdp_status nccl_host_wait(hsdp_cudaEvent_t ev, const char *what);
hsdp_status nccl_stream_wait(void *stream, const void *p, size_t n);
hsdp_status nccl_begin(void);
hsdp_status nccl_note_reader(hsdp_cudaStream_t stream);
int nccl_on_device(const void *p);
hsdp_status nccl_scratch(size_t n, void **out);
/* The side stream, its events and the watchdog thread, on `device` (nccl_world). */
hsdp_status nccl_start_process_state(int device);

/* ---------------------------------------------------------------- nccl_device.c */
extern const hsdp_device_i nccl_device;
const hsdp_device_i *nccl_device_now(void);
hsdp_status nccl_in_place(const void *src, void *recv, size_t nbytes, int rank, const void **send);
hsdp_status nccl_fixed_source(void **share, const void *send, size_t nbytes, const void **src);
void nccl_share_free(hsdp_group *g, void *share, void *memory);
hsdp_status nccl_share_read(hsdp_group *g, const void *share, void *out, size_t nbytes);
const char *nccl_share_kind(const void *share);

/* ---------------------------------------------------------------- nccl_collectives.c */
typedef enum { OP_GATHER, OP_BCAST, OP_ALLTOALL, OP_BARRIER } op_kind;
hsdp_status nccl_enqueue(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes, int root);
void nccl_describe(char *out, size_t n, const char *op, const char *label, size_t nbytes, int size);
hsdp_status nccl_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status nccl_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root);
hsdp_status nccl_barrier(hsdp_group *g);
hsdp_status nccl_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes);

/* ---------------------------------------------------------------- nccl_agreement.c */
hsdp_status nccl_ticket_begin(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes, int *slot);
hsdp_status nccl_enqueue_unit(hsdp_group *g, int slot, const void *send, void *recv, size_t nbytes);
/* Waits on the host (within the timeout) for slot's tickets to land, without comparing them. */
hsdp_status nccl_ticket_landed(int slot, const char *what);
hsdp_status nccl_ticket_check(hsdp_group *g, int slot, hsdp_status st, const char *what, int late);
hsdp_status nccl_tickets_settle(int block, int oldest_only);
void nccl_tickets_due(hsdp_group *g, int slot, const char *what);
void nccl_tickets_free(void);

/* ---------------------------------------------------------------- nccl_gather.c */
hsdp_status nccl_gather_fixed(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                              const char *label);
hsdp_status nccl_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                             const char *label, uint64_t ident);
hsdp_status nccl_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes);
void nccl_gather_wait(hsdp_req *r);
hsdp_status nccl_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                int source);
hsdp_status nccl_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                          int source);
int nccl_overlaps(const hsdp_group *g);

/* ---------------------------------------------------------------- nccl_world.c */
int nccl_usable(const char **why);
hsdp_status nccl_world(hsdp_group **out, int *we_init);
hsdp_status nccl_split(hsdp_group *g, int color, int key, hsdp_group **out);
void nccl_free(hsdp_group *g);
hsdp_status nccl_finalize(void);

#endif
