/* backend_nccl.c - collectives over NCCL, on GPUs.
 *
 * Nothing here is linked against CUDA or NCCL: both libraries are opened at run time
 * (hsdp_nccl_load), so one build serves CPU-only and GPU machines, and a machine without a
 * GPU gets a clear error instead of a failed import. No CUDA or NCCL header is needed
 * either: the types, values and function types used are declared in cuda_abi.h (checked
 * against the real headers by csrc/tests/test_cuda_abi.c), so every build has this backend.
 *
 * Streams. Every collective runs on one side stream of high priority. A started gather
 * records an event there, and its wait makes the compute stream wait on that event: the
 * host never blocks. A gather into a pooled buffer must not overwrite bytes the compute
 * stream may still read: when buffers go back to the pool an event is recorded on the
 * compute stream (buffers_released), and every later collective waits on it first. That
 * one event covers every buffer released so far, since the compute stream runs in order.
 *
 * Shards. A unit's shard is written on the host while loading; its first gather copies it
 * to device memory (the share), and every gather from then on copies the device copy into
 * its slot of the buffer and gathers in place.
 *
 * Host memory. A collective whose buffers are host memory (checkpoint plans, agreement
 * checks, NumPy arrays) is staged through a device scratch buffer and waited for on the
 * host, so every slot accepts both kinds of pointer.
 *
 * Failures. Every call is checked. A watchdog thread retires finished collectives, polls
 * every communicator's asynchronous error, and aborts all communicators when one fails or
 * a collective outlives HSDP_TIMEOUT; from then on every call fails with what happened,
 * naming the collective (and its unit) and the ranks that were not in it (watchdog.h).
 *
 * Agreement. Every unit gather carries its ticket in the same NCCL group as its data, and
 * its wait compares them ("agreement" below, agreement.h). */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agreement.h"
#include "backend.h"
#include "backend_nccl.h"
#include "cuda_dequant.h"
#include "watchdog.h"

#ifdef HSDP_NO_NCCL
/* ---------------------------------------------------------------- built with HSDP_NO_NCCL=1 */
static const char not_built[] =
    "this hsdp was built without the NCCL backend (HSDP_NO_NCCL=1 at build time); reinstall hsdp without "
    "HSDP_NO_NCCL to have it";

int hsdp_nccl_built(void) { return 0; }
hsdp_status hsdp_nccl_load(const char *nccl_path, const char *cudart_path) {
    (void)nccl_path, (void)cudart_path;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s", not_built);
}
int hsdp_nccl_loaded(void) { return 0; }
int hsdp_nccl_version(void) { return 0; }
hsdp_status hsdp_nccl_unique_id(unsigned char out[HSDP_NCCL_ID_BYTES]) {
    (void)out;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s", not_built);
}
hsdp_status hsdp_nccl_set_bootstrap(const unsigned char id[HSDP_NCCL_ID_BYTES], int rank, int size, int device) {
    (void)id, (void)rank, (void)size, (void)device;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s", not_built);
}
void hsdp_nccl_set_compute_stream(void *stream) { (void)stream; }
void hsdp_nccl_set_oom_handler(hsdp_nccl_oom_fn fn, void *arg) { (void)fn, (void)arg; }
void *hsdp_nccl_comm_stream(void) { return NULL; }
hsdp_status hsdp_nccl_agreement_drain(void) { return HSDP_OK; }

static int nccl_usable(const char **why) {
    *why = not_built;
    return 0;
}
static hsdp_status nccl_world(hsdp_group **out, int *we_init) {
    *out = NULL;
    *we_init = 0;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s", not_built);
}
const hsdp_backend hsdp_backend_nccl = {.name = "nccl", .usable = nccl_usable, .world = nccl_world};

#else
#include "cuda_abi.h"

/* ---------------------------------------------------------------- the two libraries */
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
/* Resolved when present: every CUDA runtime hsdp supports has it, but a missing one only
 * loses the refusal of graph capture (refuse_capture). */
#define CUDA_OPTIONAL(X) X(cudaStreamIsCapturing)

#define DECLARE(name) hsdp_##name##_fn name;
static struct {
    void *nccl, *cudart; /* dlopen handles, owned here (kept open for the process) */
    int loaded, version;
    const hsdp_device_i *device; /* the device table in effect: CUDA, or the host's view of it (the test fake) */
    NCCL_REQUIRED(DECLARE)
    NCCL_OPTIONAL(DECLARE)
    CUDA_REQUIRED(DECLARE)
    CUDA_OPTIONAL(DECLARE)
} api;
#undef DECLARE
static const hsdp_device_i nccl_device, nccl_host_device; /* the device tables, defined below */

/* Every CUDA call goes through CUDA(): a failure, handled or not, is cleared from the calling
 * thread's last error at once. hsdp shares the libcudart torch has mapped, so an error left
 * there (an event's cudaErrorNotReady while polling, a failed cudaMalloc we fall back from)
 * would be raised by torch's next kernel-launch check (cudaGetLastError) on an unrelated
 * kernel. A sticky error (a fault in a kernel) cannot be cleared, and is meant to be seen. */
static hsdp_cudaError_t quiet(hsdp_cudaError_t e) {
    if (e != hsdp_cudaSuccess && api.cudaGetLastError) (void)api.cudaGetLastError();
    return e;
}
#define CUDA(fn, ...) quiet(api.fn(__VA_ARGS__))

int hsdp_nccl_built(void) { return 1; }
int hsdp_nccl_loaded(void) { return api.loaded; }
int hsdp_nccl_version(void) { return api.version; }

static int resolve(void *lib, const char *name, void *slot) {
    void *sym = dlsym(lib, name);
    memcpy(slot, &sym, sizeof sym); /* object to function pointer, the POSIX way */
    return sym != NULL;
}

hsdp_status hsdp_nccl_load(const char *nccl_path, const char *cudart_path) {
    if (api.loaded) return HSDP_OK;
    if (!nccl_path || !*nccl_path || !cudart_path || !*cudart_path)
        return hsdp_fail(HSDP_EINVAL, "the NCCL backend needs the paths of libnccl and libcudart");
    const char *missing = NULL, *in = NULL;
    int n = 0;
    hsdp_cudaError_t ce;
    api.nccl = dlopen(nccl_path, RTLD_NOW | RTLD_LOCAL);
    if (!api.nccl) {
        hsdp_fail(HSDP_EUNSUPPORTED, "could not open the NCCL library '%s': %s", nccl_path, dlerror());
        goto fail;
    }
    api.cudart = dlopen(cudart_path, RTLD_NOW | RTLD_LOCAL);
    if (!api.cudart) {
        hsdp_fail(HSDP_EUNSUPPORTED, "could not open the CUDA runtime '%s': %s", cudart_path, dlerror());
        goto fail;
    }
#define REQ_NCCL(name) if (!missing && !resolve(api.nccl, #name, &api.name)) missing = #name, in = nccl_path;
#define REQ_CUDA(name) if (!missing && !resolve(api.cudart, #name, &api.name)) missing = #name, in = cudart_path;
#define OPT_NCCL(name) (void)resolve(api.nccl, #name, &api.name);
    NCCL_REQUIRED(REQ_NCCL)
    CUDA_REQUIRED(REQ_CUDA)
    NCCL_OPTIONAL(OPT_NCCL)
#define OPT_CUDA(name) (void)resolve(api.cudart, #name, &api.name);
    CUDA_OPTIONAL(OPT_CUDA)
#undef OPT_CUDA
#undef REQ_NCCL
#undef REQ_CUDA
#undef OPT_NCCL
    if (missing) {
        hsdp_fail(HSDP_EUNSUPPORTED, "'%s' has no symbol %s: it is not a usable NCCL/CUDA library", in, missing);
        goto fail;
    }
    /* On a machine with no GPU the runtime says so here (35: the driver is missing or too old). */
    ce = CUDA(cudaGetDeviceCount, &n);
    if (ce != hsdp_cudaSuccess || n <= 0) {
        if (ce != hsdp_cudaSuccess)
            hsdp_fail(HSDP_EUNSUPPORTED, "no usable GPU for the NCCL backend: cudaGetDeviceCount failed with CUDA error "
                      "%d (%s); use backend 'mpi' for CPU ranks", (int)ce, api.cudaGetErrorString(ce));
        else
            hsdp_fail(HSDP_EUNSUPPORTED, "no usable GPU for the NCCL backend: no CUDA device is visible "
                      "(CUDA_VISIBLE_DEVICES='%s'); use backend 'mpi' for CPU ranks",
                      getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "(unset)");
        goto fail;
    }
    if (api.ncclGetVersion(&api.version) != hsdp_ncclSuccess) {
        hsdp_fail(HSDP_EUNSUPPORTED, "ncclGetVersion failed in '%s'", nccl_path);
        goto fail;
    }
    /* ncclAlltoAll exists from 2.28.3; before, all_to_all is grouped sends and receives */
    if (api.version < 22803) api.ncclAlltoAll = NULL;
    if (api.version < 21800) api.ncclCommSplit = NULL;
    if (api.version < 21400) api.ncclCommInitRankConfig = NULL;
    /* A CUDA runtime whose device memory is host memory the host reads may say so: by
     * exporting int hsdp_cuda_device_memory_is_host(void) and returning 1 from it (the test
     * fake, csrc/tests/fake_cuda_nccl.c, under FAKE_HOST_VIEW=1; no real runtime has it).
     * Its buffers are then viewed as the CPU (nccl_host_device), so a CPU-only torch runs
     * the real NCCL code paths against the fake. This is the one place that asks: the
     * collectives order their readers through the table chosen here (reader_after). */
    {
        int (*host_memory)(void) = NULL;
        int host_reads = resolve(api.cudart, "hsdp_cuda_device_memory_is_host", &host_memory) && host_memory() == 1;
        api.device = host_reads ? &nccl_host_device : &nccl_device;
    }
    api.loaded = 1;
    return HSDP_OK;
fail:
    if (api.nccl) dlclose(api.nccl);
    if (api.cudart) dlclose(api.cudart);
    memset(&api, 0, sizeof api); /* nothing is left half loaded */
    return HSDP_EUNSUPPORTED;
}

/* ---------------------------------------------------------------- process state */
typedef struct nccl_comm {
    hsdp_ncclComm_t comm;
    int aborted;
    int size;
    int *world_ranks;       /* owned: the world rank of each rank of the group (to name who is missing) */
    struct nccl_comm *next; /* the live list, under S.mu */
} nccl_comm;

/* A unit's shard once on the device (the share of hsdp_gather_fixed); owned by the unit,
 * released by share_free. */
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

static struct {
    pthread_mutex_t mu;    /* the ring, the live list, the scratch buffer */
    pthread_mutex_t issue; /* one thread at a time enqueues NCCL work, in program order */
    pthread_mutex_t calls; /* every NCCL call on a live communicator, and its abort; held only
                              around NCCL calls, never a CUDA call that may block; before S.mu */
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
} S = {.mu = PTHREAD_MUTEX_INITIALIZER, .issue = PTHREAD_MUTEX_INITIALIZER, .calls = PTHREAD_MUTEX_INITIALIZER};
static nccl_comm *issuing; /* S.issue held: the communicator of the collectives being tracked */

/* The device guard: every thread that enters the backend runs on its device. A thread's
 * first CUDA call without cudaSetDevice makes a context on device 0 (about 0.5 GiB): the
 * watchdog's first event query, or a framework's worker thread calling in, would do so on
 * every rank of an 8-GPU host. One GPU per process, so the thread's device is set and left
 * so (cached per thread; redone if the backend's device changes). */
static _Thread_local int thread_device = -1;
static void device_guard(void) {
    if (!S.world_up || thread_device == S.device) return;
    if (CUDA(cudaSetDevice, S.device) == hsdp_cudaSuccess) thread_device = S.device;
}

void hsdp_nccl_set_compute_stream(void *stream) { S.compute = (hsdp_cudaStream_t)stream; }

/* Device memory comes from cudaMalloc, beside the framework's caching allocator, not from
 * it: the backend has no framework of its own (NumPy callers, the C tests), and its buffers
 * live for a unit's life, not a kernel's. What that costs is memory torch caches and we
 * cannot use: on cudaErrorMemoryAllocation the handler (torch.cuda.empty_cache) gives its
 * cached blocks back, and the allocation is retried once. */
static struct {
    hsdp_nccl_oom_fn fn;
    void *arg;
} oom;
void hsdp_nccl_set_oom_handler(hsdp_nccl_oom_fn fn, void *arg) {
    oom.fn = fn;
    oom.arg = arg;
}
static hsdp_cudaError_t dev_malloc(void **p, size_t n) {
    hsdp_cudaError_t e = CUDA(cudaMalloc, p, n); /* a failure is cleared from the last error */
    if (e == hsdp_cudaErrorMemoryAllocation && oom.fn && oom.fn(oom.arg)) e = CUDA(cudaMalloc, p, n);
    return e;
}

static _Thread_local hsdp_cudaStream_t call_stream;
static _Thread_local int call_stream_set;
static void nccl_call_stream(void *stream, int set) {
    call_stream = (hsdp_cudaStream_t)stream;
    call_stream_set = set;
}
void *hsdp_nccl_comm_stream(void) { return (void *)S.comm; }
static int nccl_device_id(void) { return S.device; } /* one GPU per process */
/* The device table in effect (hsdp_nccl_load chose it): every collective path orders its
 * readers through it and never asks which one it is. */
static const hsdp_device_i *device_now(void) { return api.device ? api.device : &nccl_device; }

static const char *nccl_text(hsdp_ncclResult_t rc, nccl_comm *c) {
    const char *last = c && api.ncclGetLastError ? api.ncclGetLastError(c->comm) : NULL;
    return last && *last ? last : api.ncclGetErrorString(rc);
}

static hsdp_status cuda_fail(hsdp_cudaError_t e, const char *what) {
    return hsdp_fail(HSDP_ECOMM, "%s failed: CUDA error %d (%s)", what, (int)e, api.cudaGetErrorString(e));
}
#define CUDA_TRY(call, what)                                                                                  \
    do {                                                                                                      \
        hsdp_cudaError_t e_ = (call);                                                                              \
        if (e_ != hsdp_cudaSuccess) return cuda_fail(e_, what);                                                    \
    } while (0)

static hsdp_status failed_status(void) {
    return hsdp_fail(HSDP_ECOMM, "the NCCL communicators were aborted: %s", S.why);
}
static hsdp_status failed_status_if_failed(void) { return atomic_load(&S.failed) ? failed_status() : HSDP_OK; }

/* Failing: the first failure is recorded once, saying why on stderr, and every call from
 * then on fails with it; peers blocked in a collective with this rank are released by their
 * own watchdogs within the same timeout. The communicators are then aborted under S.calls,
 * the lock every NCCL call on a live communicator is made under (but the watchdog's polls of
 * ncclCommGetAsyncError, which NCCL allows beside them): ncclCommAbort frees the
 * communicator, so no thread is inside a call on it then. S.calls is held only around NCCL
 * calls, which return at once (non-blocking communicators) or poll S.failed, never around a
 * CUDA call that may wait on the side stream (a copy into pageable memory, cudaFree): so the
 * watchdog takes it within a poll even while the issuing thread is stuck behind a hung
 * collective, and the abort is what releases that thread. The watchdog aborts (watch_once),
 * and so does an issuing thread on its way out (issue_unlock), whichever comes first. S.mu held. */
__attribute__((format(printf, 1, 2))) static void abort_all_locked(const char *fmt, ...) {
    /* every writer holds S.mu; readers see S.failed set only once S.why is whole */
    if (atomic_load(&S.failed)) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(S.why, sizeof S.why, fmt, ap);
    va_end(ap);
    atomic_store(&S.failed, 1);
    fprintf(stderr, "hsdp: rank %d (NCCL): %s; aborting the NCCL communicators\n", S.boot.rank, S.why);
}

static void abort_one_locked(nccl_comm *c) {
    if (c->aborted) return;
    api.ncclCommAbort(c->comm);
    c->aborted = 1;
}

/* After a failure: aborts every live communicator not yet aborted (S.calls and S.mu held).
 * [Note: abort order] ncclCommAbort frees the communicator's device memory, and cudaFree waits
 * for every kernel on the device: aborting a communicator while another one's collective is
 * stuck waiting for a peer hangs (NVIDIA/nccl issue #829). The side stream runs in order, so
 * the collective that can be stuck is the oldest in flight, and each one behind it starts
 * once the one before is aborted: the communicators of the collectives in flight are aborted
 * oldest first, then the rest. */
static void abort_comms_locked(void) {
    for (unsigned i = 0; i < S.count; i++) {
        const nccl_comm *of = S.ring[(S.head + i) % RING].comm;
        for (nccl_comm *c = S.live; of && c; c = c->next) /* still live: not freed since */
            if (c == of) abort_one_locked(c);
    }
    for (nccl_comm *c = S.live; c; c = c->next) abort_one_locked(c);
}

/* Every section that issues NCCL calls ends here: after a failure, its thread aborts. */
static void abort_comms(void) {
    pthread_mutex_lock(&S.calls);
    pthread_mutex_lock(&S.mu);
    abort_comms_locked();
    pthread_mutex_unlock(&S.mu);
    pthread_mutex_unlock(&S.calls);
}
static void issue_unlock(void) {
    if (atomic_load(&S.failed)) abort_comms();
    issuing = NULL;
    pthread_mutex_unlock(&S.issue);
}

/* The same from a caller that does not hold S.mu; returns the failure every call now gets. */
#define ABORT_ALL(...)                                                                                        \
    (pthread_mutex_lock(&S.mu), abort_all_locked(__VA_ARGS__), pthread_mutex_unlock(&S.mu), failed_status())

static double timeout_s(void) { return (double)hsdp_timeout_ns() / 1e9; }

/* One pause of a wait that began at `since`: what it waits for (a collective's launch, a
 * gather's event) mostly ends within tens of microseconds on a GPU, and a sleep costs the
 * timer's slack (about 50 us) on top of its length, so the first 100 us only yield the CPU;
 * then 20 us sleeps, and after 10 ms, 1 ms ones (a long wait costs no CPU to speak of). */
static void nap(uint64_t since) {
    uint64_t waited = hsdp_now_ns() - since;
    if (waited < 100000) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, waited < 10000000 ? 20000 : 1000000};
    nanosleep(&ts, NULL);
}

/* S.calls and S.mu held: the live communicators' asynchronous errors (but skip's, polled by its
 * caller); one fails them all. */
static void poll_errors_locked(const nccl_comm *skip) {
    for (nccl_comm *c = S.live; c && !atomic_load(&S.failed); c = c->next) {
        hsdp_ncclResult_t state = hsdp_ncclInProgress;
        if (c == skip || c->aborted || api.ncclCommGetAsyncError(c->comm, &state) != hsdp_ncclSuccess) continue;
        if (state != hsdp_ncclSuccess && state != hsdp_ncclInProgress)
            abort_all_locked("NCCL reported an asynchronous error: %s", nccl_text(state, c));
    }
}
/* S.calls held: the other communicators' errors, which the watchdog polls only when S.calls
 * is free ([Note: who polls a communicator]). */
static void poll_others(const nccl_comm *self) {
    pthread_mutex_lock(&S.mu);
    poll_errors_locked(self);
    pthread_mutex_unlock(&S.mu);
}

/* An NCCL call's result on a non-blocking communicator: hsdp_ncclInProgress is polled until the
 * call is done, within the timeout. S.calls held: the only thread that polls c now (see
 * [Note: who polls a communicator]). A poll that itself fails leaves `state` untouched (NCCL's
 * CommCheck returns first), so it starts as "in progress" and the poll's own result is read:
 * a failed poll is never taken for a finished call. */
static hsdp_status nccl_done(nccl_comm *c, hsdp_ncclResult_t rc, const char *what) {
    uint64_t t0 = hsdp_now_ns(), limit = hsdp_timeout_ns();
    while (rc == hsdp_ncclInProgress) {
        hsdp_ncclResult_t state = hsdp_ncclInProgress;
        hsdp_ncclResult_t qrc = api.ncclCommGetAsyncError(c->comm, &state);
        if (qrc != hsdp_ncclSuccess)
            return ABORT_ALL("%s: ncclCommGetAsyncError failed with NCCL error %d (%s)", what, (int)qrc,
                             api.ncclGetErrorString(qrc));
        rc = state;
        if (rc != hsdp_ncclInProgress) break;
        if (hsdp_now_ns() - t0 > 2000000) /* a while in progress: the watchdog cannot poll now, this thread does */
            poll_others(c);
        if (atomic_load(&S.failed)) return failed_status(); /* aborted on the way out (issue_unlock) */
        if (limit && hsdp_now_ns() - t0 > limit)
            return ABORT_ALL("%s did not complete within %g s (HSDP_TIMEOUT)", what, timeout_s());
        nap(t0);
    }
    if (rc != hsdp_ncclSuccess)
        return hsdp_fail(HSDP_ECOMM, "%s failed: NCCL error %d (%s)", what, (int)rc, nccl_text(rc, c));
    return HSDP_OK;
}

/* What this rank waits in, for the peers' watchdogs (watchdog.h): the oldest collective in
 * flight, which is the one a missing peer holds up (the side stream runs in order). S.mu held. */
static void publish_locked(void) {
    if (hsdp_peers_known()) hsdp_watch_publish(S.count ? S.ring[S.head].what : NULL);
}

/* "; not in it: rank R (...)": who of the oldest collective's group does not wait in it
 * (watchdog.h), for a timeout's message. Takes S.mu briefly; asks the peers without it. */
static void name_missing(char *out, size_t n) {
    out[0] = '\0';
    char what[sizeof S.ring[0].what];
    int *ranks = NULL, size = 0;
    pthread_mutex_lock(&S.mu);
    const flight *f = S.count ? &S.ring[S.head] : NULL;
    for (nccl_comm *c = S.live; f && f->comm && c; c = c->next)
        if (c == f->comm && c->world_ranks) { /* still live: its ranks may be read */
            ranks = malloc(sizeof *ranks * (size_t)c->size); /* freed below */
            if (ranks) memcpy(ranks, c->world_ranks, sizeof *ranks * (size_t)c->size);
            size = c->size;
            memcpy(what, f->what, sizeof what);
        }
    pthread_mutex_unlock(&S.mu);
    if (ranks) hsdp_who_is_missing(out, n, what, ranks, size);
    free(ranks);
}

/* CUDA's errors for a query made while a stream is being captured into a graph (900-908,
 * cudaErrorStreamCaptureUnsupported ... cudaErrorStreamCaptureWrongThread): the event is not
 * known to be done, nothing failed on the GPU. */
static int capture_error(hsdp_cudaError_t e) { return e >= 900 && e <= 908; }

/* A stream being captured into a CUDA graph (torch.cuda.graph, torch.compile with
 * mode="reduce-overhead") cannot be ordered after hsdp's gathers: they run on the side stream,
 * outside the graph, and a replay would read whatever the pooled buffer holds then. Refused,
 * saying so, before anything is enqueued on it. */
static hsdp_status refuse_capture(hsdp_cudaStream_t stream, const char *what) {
    unsigned status = hsdp_cudaStreamCaptureStatusNone;
    hsdp_cudaError_t e = api.cudaStreamIsCapturing ? CUDA(cudaStreamIsCapturing, stream, &status) : hsdp_cudaSuccess;
    if (!capture_error(e) && (e != hsdp_cudaSuccess || status == hsdp_cudaStreamCaptureStatusNone)) return HSDP_OK;
    return hsdp_fail(HSDP_EUNSUPPORTED, "%s: the stream it orders is being captured into a CUDA graph "
                     "(torch.cuda.graph, or torch.compile with mode=\"reduce-overhead\"); hsdp's gathers run on a side "
                     "stream outside the graph and cannot be captured: capture a model that is not sharded, or run the "
                     "sharded one outside the capture", what);
}

/* Retires finished collectives from the front of the ring (S.mu held). A collective's clock
 * (t0, for the timeout) starts no earlier than the one before it retired: the side stream
 * runs in order, so one queued behind others has not begun while they run (a deep prefetch
 * behind a long forward would otherwise age while it waits its turn). */
static void retire_locked(void) {
    unsigned before = S.count;
    while (S.count) {
        flight *f = &S.ring[S.head];
        hsdp_cudaError_t e = CUDA(cudaEventQuery, f->ev);
        if (e == hsdp_cudaErrorNotReady || capture_error(e)) break;
        if (e != hsdp_cudaSuccess)
            abort_all_locked("%s failed on the GPU: CUDA error %d (%s)", f->what, (int)e, api.cudaGetErrorString(e));
        S.head = (S.head + 1) % RING;
        S.count--;
    }
    if (S.count != before) {
        uint64_t now = hsdp_now_ns();
        if (S.count && S.ring[S.head].t0 < now) S.ring[S.head].t0 = now;
        publish_locked();
    }
}

static void watch_once(void) {
    pthread_mutex_lock(&S.mu);
    retire_locked();
    uint64_t limit = hsdp_timeout_ns();
    if (S.count && limit && !atomic_load(&S.failed)) {
        flight *f = &S.ring[S.head];
        uint64_t age = hsdp_now_ns() - f->t0, t0 = f->t0;
        if (age > limit) {
            char what[sizeof f->what], missing[640];
            memcpy(what, f->what, sizeof what);
            pthread_mutex_unlock(&S.mu); /* asking the peers takes a while */
            name_missing(missing, sizeof missing);
            pthread_mutex_lock(&S.mu);
            retire_locked();
            if (S.count && S.ring[S.head].t0 == t0) /* still waiting */
                abort_all_locked("%s has waited %.1f s for its peers (HSDP_TIMEOUT=%g s)%s", what, (double)age / 1e9,
                                 timeout_s(), missing);
        }
    }
    /* [Note: who polls a communicator] NCCL's ncclCommGetAsyncError is not safe from two
     * threads on one communicator: every call on a non-blocking communicator leaves a "group
     * job" linked to it, and the poll that sees it done completes it (init.cc
     * ncclCommGetAsyncError -> group.cc ncclGroupJobComplete), dropping its reference without
     * a lock: two pollers at that moment free it twice. Every call and its polls run under
     * S.calls, so the watchdog polls only when it can take S.calls without waiting: while a
     * thread is in a call, that thread polls (nccl_done) and sees what the watchdog would. */
    if (!atomic_load(&S.failed) && pthread_mutex_trylock(&S.calls) == 0) {
        poll_errors_locked(NULL);
        pthread_mutex_unlock(&S.calls);
    }
    int abort_now = 0;
    for (nccl_comm *c = S.live; c && atomic_load(&S.failed); c = c->next) abort_now |= !c->aborted;
    pthread_mutex_unlock(&S.mu);
    if (abort_now) abort_comms(); /* S.calls before S.mu: within a poll of the thread in a call */
}

static void *watchdog(void *arg) {
    (void)arg;
    if (CUDA(cudaSetDevice, S.device) == hsdp_cudaSuccess) thread_device = S.device; /* before any CUDA call */
    while (!atomic_load(&S.stop)) {
        watch_once();
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Records the end of the collective just enqueued on the side stream, in the ring the
 * watchdog watches; *ev gets its event. A full ring waits for the oldest to finish. */
static hsdp_status track(const char *what, const void *dst, size_t dst_n, hsdp_cudaEvent_t *ev) {
    pthread_mutex_lock(&S.mu);
    uint64_t since = hsdp_now_ns();
    for (;;) {
        retire_locked();
        if (atomic_load(&S.failed)) {
            pthread_mutex_unlock(&S.mu);
            return failed_status();
        }
        if (S.count < RING) break;
        pthread_mutex_unlock(&S.mu);
        nap(since);
        pthread_mutex_lock(&S.mu);
    }
    flight *f = &S.ring[(S.head + S.count) % RING];
    hsdp_cudaError_t e = hsdp_cudaSuccess;
    if (!f->ev) e = CUDA(cudaEventCreateWithFlags, &f->ev, hsdp_cudaEventDisableTiming);
    if (e == hsdp_cudaSuccess) e = CUDA(cudaEventRecord, f->ev, S.comm);
    if (e != hsdp_cudaSuccess) {
        pthread_mutex_unlock(&S.mu);
        return cuda_fail(e, "recording a collective's event");
    }
    f->t0 = hsdp_now_ns();
    f->dst = dst;
    f->dst_n = dst_n;
    f->comm = issuing;
    snprintf(f->what, sizeof f->what, "%s", what);
    if (++S.count == 1) publish_locked();
    *ev = f->ev;
    pthread_mutex_unlock(&S.mu);
    return HSDP_OK;
}

/* Blocks the host until ev has happened, within the timeout (host buffers need it). */
static hsdp_status host_wait(hsdp_cudaEvent_t ev, const char *what) {
    uint64_t t0 = hsdp_now_ns(), limit = hsdp_timeout_ns();
    for (;;) {
        hsdp_cudaError_t e = CUDA(cudaEventQuery, ev);
        if (e == hsdp_cudaSuccess) return HSDP_OK;
        if (e != hsdp_cudaErrorNotReady && !capture_error(e)) return cuda_fail(e, what);
        if (atomic_load(&S.failed)) return failed_status();
        if (limit && hsdp_now_ns() - t0 > limit) {
            char missing[640];
            name_missing(missing, sizeof missing);
            return ABORT_ALL("%s has waited %g s for its peers (HSDP_TIMEOUT)%s", what, timeout_s(), missing);
        }
        nap(t0);
    }
}

/* Makes `stream` (a consumer's: NULL, the legacy default stream) wait for every collective
 * still in flight that writes into [p, p + n); the host never blocks. */
static hsdp_status stream_wait(void *stream, const void *p, size_t n) {
    if (!S.world_up || !p) return HSDP_OK;
    device_guard();
    const char *lo = p, *hi = lo + n;
    pthread_mutex_lock(&S.mu);
    retire_locked();
    /* the side stream runs in order: the latest overlapping collective covers the earlier */
    hsdp_cudaEvent_t last = NULL;
    for (unsigned i = 0; i < S.count; i++) {
        const flight *f = &S.ring[(S.head + i) % RING];
        if (f->dst && f->dst < hi && lo < f->dst + f->dst_n) last = f->ev;
    }
    hsdp_cudaError_t e = last ? CUDA(cudaStreamWaitEvent, (hsdp_cudaStream_t)stream, last, 0) : hsdp_cudaSuccess;
    pthread_mutex_unlock(&S.mu);
    return e == hsdp_cudaSuccess ? HSDP_OK : cuda_fail(e, "ordering a consumer's stream after a gather");
}

/* Before enqueuing: no collective after a failure, and none may overwrite a pooled buffer
 * the compute stream may still read. */
static hsdp_status begin(void) {
    if (atomic_load(&S.failed)) return failed_status();
    if (S.have_released) CUDA_TRY(CUDA(cudaStreamWaitEvent, S.comm, S.released, 0), "waiting for released buffers");
    if (!atomic_load(&S.readers_pending)) return HSDP_OK;
    hsdp_cudaError_t e = hsdp_cudaSuccess;
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.nreaders && e == hsdp_cudaSuccess; i++)
        if (S.readers[i].pending) {
            e = CUDA(cudaStreamWaitEvent, S.comm, S.readers[i].ev, 0);
            S.readers[i].pending = 0; /* the side stream runs in order: once is enough */
        }
    atomic_store(&S.readers_pending, 0);
    pthread_mutex_unlock(&S.mu);
    return e == hsdp_cudaSuccess ? HSDP_OK : cuda_fail(e, "waiting for buffers released by another stream");
}

/* A consumer's stream other than the compute stream read a buffer (S.mu taken here). */
static hsdp_status note_reader(hsdp_cudaStream_t stream) {
    if (stream == S.compute) return HSDP_OK;
    hsdp_status st = HSDP_OK;
    pthread_mutex_lock(&S.mu);
    int i = 0;
    while (i < S.nreaders && S.readers[i].stream != stream) i++;
    if (i == S.nreaders) {
        if (i == (int)(sizeof S.readers / sizeof *S.readers)) {
            st = hsdp_fail(HSDP_EUNSUPPORTED, "more than %d CUDA streams read hsdp's gathered buffers: hsdp orders the "
                           "release of its buffers after each of them, and keeps that many", i);
        } else {
            hsdp_cudaError_t e = CUDA(cudaEventCreateWithFlags, &S.readers[i].ev, hsdp_cudaEventDisableTiming);
            if (e != hsdp_cudaSuccess) st = cuda_fail(e, "creating a reader stream's release event");
            else S.readers[i].stream = stream, S.nreaders++;
        }
    }
    if (st == HSDP_OK) S.readers[i].read = 1;
    pthread_mutex_unlock(&S.mu);
    return st;
}

static int on_device(const void *p) {
    if (!p) return 1; /* nothing to stage */
    hsdp_cudaPointerAttributes a;
    if (CUDA(cudaPointerGetAttributes, &a, p) != hsdp_cudaSuccess) return 0;
    return a.type == hsdp_cudaMemoryTypeDevice || a.type == hsdp_cudaMemoryTypeManaged;
}

/* A device buffer of at least n bytes for staging host memory (S.issue held). */
static hsdp_status scratch(size_t n, void **out) {
    if (n > S.scratch_n) {
        if (S.scratch) {
            hsdp_cudaEvent_t ev = NULL;
            hsdp_status st = track("the collectives using the staging buffer", NULL, 0, &ev);
            if (st == HSDP_OK) st = host_wait(ev, "the collectives using the staging buffer");
            if (st != HSDP_OK) return st;
            CUDA(cudaFree, S.scratch);
            S.scratch = NULL;
            S.scratch_n = 0;
        }
        CUDA_TRY(dev_malloc(&S.scratch, n), "allocating a device staging buffer");
        S.scratch_n = n;
    }
    *out = S.scratch;
    return HSDP_OK;
}

/* ---------------------------------------------------------------- the collectives */
typedef enum { OP_GATHER, OP_BCAST, OP_ALLTOALL, OP_BARRIER } op_kind;

static hsdp_status enqueue_calls(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes,
                                 int root);
/* Enqueues one collective on device buffers (S.issue held), under S.calls. */
static hsdp_status enqueue(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes,
                           int root) {
    pthread_mutex_lock(&S.calls);
    hsdp_status st = atomic_load(&S.failed) ? failed_status() : enqueue_calls(c, op, size, send, recv, nbytes, root);
    pthread_mutex_unlock(&S.calls);
    return st;
}
static hsdp_status enqueue_calls(nccl_comm *c, op_kind op, int size, const void *send, void *recv, size_t nbytes,
                                 int root) {
    hsdp_ncclResult_t rc = hsdp_ncclSuccess;
    switch (op) {
    case OP_GATHER:
        rc = api.ncclAllGather(send, recv, nbytes, hsdp_ncclUint8, c->comm, S.comm);
        return nccl_done(c, rc, "ncclAllGather");
    case OP_BCAST:
        rc = api.ncclBroadcast(recv, recv, nbytes, hsdp_ncclUint8, root, c->comm, S.comm);
        return nccl_done(c, rc, "ncclBroadcast");
    case OP_BARRIER:
        rc = api.ncclAllReduce(recv, recv, 1, hsdp_ncclFloat32, hsdp_ncclSum, c->comm, S.comm);
        return nccl_done(c, rc, "the barrier's ncclAllReduce");
    case OP_ALLTOALL:
        if (api.ncclAlltoAll) {
            rc = api.ncclAlltoAll(send, recv, nbytes, hsdp_ncclUint8, c->comm, S.comm);
            return nccl_done(c, rc, "ncclAlltoAll");
        }
        rc = api.ncclGroupStart();
        for (int p = 0; rc == hsdp_ncclSuccess && p < size; p++) {
            rc = api.ncclSend((const char *)send + (size_t)p * nbytes, nbytes, hsdp_ncclUint8, p, c->comm, S.comm);
            if (rc == hsdp_ncclSuccess)
                rc = api.ncclRecv((char *)recv + (size_t)p * nbytes, nbytes, hsdp_ncclUint8, p, c->comm, S.comm);
        }
        hsdp_ncclResult_t end = api.ncclGroupEnd();
        return nccl_done(c, rc != hsdp_ncclSuccess ? rc : end, "the all-to-all's grouped ncclSend/ncclRecv");
    }
    return hsdp_fail(HSDP_EINVAL, "unknown collective");
}

/* A synchronous collective. On device buffers it returns once enqueued, with the compute
 * stream made to wait for it; on host buffers, through the staging buffer, once done. */
static hsdp_status run_sync(hsdp_group *g, op_kind op, const void *send, void *recv, size_t nbytes, int root,
                            const char *what) {
    device_guard();
    nccl_comm *c = g->impl;
    size_t n = (size_t)g->size;
    size_t send_n = op == OP_GATHER ? nbytes : op == OP_ALLTOALL ? nbytes * n : 0;
    size_t recv_n = op == OP_GATHER || op == OP_ALLTOALL ? nbytes * n : op == OP_BCAST ? nbytes : sizeof(float);
    int direct = op != OP_BARRIER && on_device(send) && on_device(recv);
    hsdp_cudaStream_t order = call_stream_set ? call_stream : S.compute; /* the consumer's stream */
    hsdp_status st = direct ? refuse_capture(order, what) : HSDP_OK;
    if (st != HSDP_OK) return st;
    pthread_mutex_lock(&S.issue);
    issuing = c;
    st = begin();
    void *base = NULL;
    const void *s = send;
    void *r = recv;
    if (st == HSDP_OK && direct) {
        /* the caller's device buffers were written on the compute stream: read them after */
        hsdp_cudaError_t e = CUDA(cudaEventRecord, S.ready, order);
        if (e == hsdp_cudaSuccess) e = CUDA(cudaStreamWaitEvent, S.comm, S.ready, 0);
        if (e != hsdp_cudaSuccess) st = cuda_fail(e, "ordering a collective after the compute stream");
    }
    if (st == HSDP_OK && !direct) {
        /* recv first, then (all-to-all) send, each 64-byte aligned */
        size_t off = (recv_n + 63) / 64 * 64;
        st = scratch(off + send_n + 64, &base);
        if (st == HSDP_OK) {
            r = base;
            if (op == OP_GATHER) s = (char *)base + (size_t)g->rank * nbytes; /* in place */
            if (op == OP_ALLTOALL) s = (char *)base + off;
            hsdp_cudaError_t e = hsdp_cudaSuccess;
            if (op == OP_BCAST && nbytes)
                e = CUDA(cudaMemcpyAsync, r, recv, nbytes, hsdp_cudaMemcpyDefault, S.comm);
            else if (send_n && send)
                e = CUDA(cudaMemcpyAsync, (void *)s, send, send_n, hsdp_cudaMemcpyDefault, S.comm);
            if (e != hsdp_cudaSuccess) st = cuda_fail(e, "staging host memory on the device");
        }
    }
    if (st == HSDP_OK) st = enqueue(c, op, g->size, s, r, nbytes, root);
    hsdp_cudaEvent_t ev = NULL;
    if (st == HSDP_OK) st = track(what, direct ? recv : NULL, recv_n, &ev);
    if (st == HSDP_OK && direct) st = device_now()->reader_after(ev, order, what);
    /* staged: the collective is waited for (within the timeout) before the copy back, which
     * into pageable memory blocks the host until the side stream reaches it: behind a
     * collective a peer never joins, it would block beyond any timeout */
    if (st == HSDP_OK && !direct) st = host_wait(ev, what);
    if (st == HSDP_OK && !direct && op != OP_BARRIER && recv_n) {
        hsdp_cudaError_t e = CUDA(cudaMemcpyAsync, recv, r, recv_n, hsdp_cudaMemcpyDefault, S.comm);
        if (e != hsdp_cudaSuccess) st = cuda_fail(e, "copying a collective's result to host memory");
        if (st == HSDP_OK) st = track(what, NULL, 0, &ev); /* pinned host memory: the copy is asynchronous */
        if (st == HSDP_OK) st = host_wait(ev, what);
    }
    issue_unlock();
    return st;
}

static void describe(char *out, size_t n, const char *op, const char *label, size_t nbytes, int size) {
    if (label && *label)
        snprintf(out, n, "the %s of unit '%s' (%zu bytes per rank over %d ranks)", op, label, nbytes, size);
    else
        snprintf(out, n, "an %s of %zu bytes per rank over %d ranks", op, nbytes, size);
}

static hsdp_status nccl_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    char what[160];
    describe(what, sizeof what, "all-gather", NULL, nbytes, g->size);
    return run_sync(g, OP_GATHER, send, recv, nbytes, 0, what);
}

static hsdp_status nccl_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    if (root < 0 || root >= g->size)
        return hsdp_fail(HSDP_EINVAL, "broadcast root %d is outside a group of %d", root, g->size);
    char what[160];
    describe(what, sizeof what, "broadcast", NULL, nbytes, g->size);
    return run_sync(g, OP_BCAST, buf, buf, nbytes, root, what);
}

static hsdp_status nccl_barrier(hsdp_group *g) {
    char what[160];
    snprintf(what, sizeof what, "a barrier over %d ranks", g->size);
    return run_sync(g, OP_BARRIER, NULL, NULL, 0, 0, what);
}

static hsdp_status nccl_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    char what[160];
    describe(what, sizeof what, "all-to-all", NULL, nbytes, g->size);
    return run_sync(g, OP_ALLTOALL, send, recv, nbytes, 0, what);
}

/* The device copy a fixed chunk is gathered from: made (and filled from the host chunk) by
 * the first gather. */
static hsdp_status in_place(const void *src, void *recv, size_t nbytes, int rank, const void **send) {
    /* NCCL's in-place form (send = recv + rank * chunk) skips its own copy of this rank's
     * chunk; the one copy is ours, on the side stream, device to device */
    char *mine = (char *)recv + (size_t)rank * nbytes;
    hsdp_cudaError_t e = CUDA(cudaMemcpyAsync, mine, src, nbytes, hsdp_cudaMemcpyDefault, S.comm);
    if (e != hsdp_cudaSuccess) return cuda_fail(e, "copying a shard into its gather buffer");
    *send = mine;
    return HSDP_OK;
}

/* Uploads n bytes of pageable host memory to dev on the side stream through two pinned slots
 * (memcpy into one while the other's copy runs): a copy from pageable memory is staged by
 * the driver through its own small pinned buffer, synchronously and at a fraction of the
 * bandwidth. Without pinned memory (cudaHostAlloc failed) the copy is a plain one. S.issue held. */
#ifndef HSDP_PIN_SLOT_BYTES
#define HSDP_PIN_SLOT_BYTES (8u << 20) /* test_nccl builds with 16, so that a unit spans slots */
#endif
enum { PIN_SLOT_BYTES = HSDP_PIN_SLOT_BYTES };
static hsdp_status upload(void *dev, const void *host, size_t n) {
    if (!S.pinned) {
        void *p = NULL;
        if (CUDA(cudaHostAlloc, &p, 2 * (size_t)PIN_SLOT_BYTES, hsdp_cudaHostAllocDefault) != hsdp_cudaSuccess ||
            CUDA(cudaEventCreateWithFlags, &S.pin_ev[0], hsdp_cudaEventDisableTiming) != hsdp_cudaSuccess ||
            CUDA(cudaEventCreateWithFlags, &S.pin_ev[1], hsdp_cudaEventDisableTiming) != hsdp_cudaSuccess) {
            if (p) CUDA(cudaFreeHost, p);
            for (int i = 0; i < 2; i++)
                if (S.pin_ev[i]) CUDA(cudaEventDestroy, S.pin_ev[i]);
            S.pin_ev[0] = S.pin_ev[1] = NULL;
            CUDA_TRY(CUDA(cudaMemcpyAsync, dev, host, n, hsdp_cudaMemcpyDefault, S.comm), "copying a shard to the GPU");
            return HSDP_OK;
        }
        S.pinned = p;
    }
    for (size_t off = 0, i = 0; off < n; off += PIN_SLOT_BYTES, i ^= 1) {
        size_t len = n - off < PIN_SLOT_BYTES ? n - off : PIN_SLOT_BYTES;
        if (S.pin_used[i]) { /* the slot's previous copy must have read it */
            hsdp_status st = host_wait(S.pin_ev[i], "an upload of a shard through pinned memory");
            if (st != HSDP_OK) return st;
        }
        char *slot = (char *)S.pinned + i * (size_t)PIN_SLOT_BYTES;
        memcpy(slot, (const char *)host + off, len);
        CUDA_TRY(CUDA(cudaMemcpyAsync, (char *)dev + off, slot, len, hsdp_cudaMemcpyDefault, S.comm),
                 "copying a shard to the GPU");
        CUDA_TRY(CUDA(cudaEventRecord, S.pin_ev[i], S.comm), "recording an upload's event");
        S.pin_used[i] = 1;
    }
    return HSDP_OK;
}

static hsdp_status fixed_source(void **share, const void *send, size_t nbytes, const void **src) {
    nccl_share *s = *share;
    if (!s) {
        s = calloc(1, sizeof *s); /* owned by the unit through *share; freed by share_free */
        if (!s) return hsdp_fail(HSDP_ENOMEM, "could not allocate a shard's device record");
        hsdp_cudaError_t e = dev_malloc(&s->dev, nbytes);
        hsdp_status st = e == hsdp_cudaSuccess ? upload(s->dev, send, nbytes) : cuda_fail(e, "allocating a shard on the GPU");
        if (st != HSDP_OK) {
            if (s->dev) CUDA(cudaFree, s->dev);
            free(s);
            return st;
        }
        *share = s;
    }
    *src = s->dev;
    return HSDP_OK;
}

/* ---------------------------------------------------------------- agreement */
/* Every unit gather carries its ticket (agreement.h) in the same NCCL group as its data: a
 * second ncclAllGather, of 64 bytes per rank, in place in a slot of device memory, filled
 * from pinned host memory before and copied back after, on the side stream.
 * [Note: tickets checked late] A synchronous gather waits on the host for that copy (within
 * the timeout) and compares before it returns: a mismatch fails on every rank and the buffer
 * is not handed out. A started gather's wait does not: it orders the compute stream after the
 * gather and returns, and its tickets join a queue, compared in order once they have landed:
 * at every later wait (those already landed, without waiting), when the slots run out, and
 * in full at hsdp_nccl_agreement_drain, which the end of every sharded forward calls (and a
 * synchronous gather, a group's free and finalize). So the host runs ahead of the GPU by as
 * many units as it likes, and a mismatch found late cannot be taken back: the compute stream
 * may have read the buffer, so it aborts every communicator, and the forward raises at its
 * end on every rank instead of returning numbers. A mismatch of sizes also aborts the
 * communicators: NCCL does not check that the ranks' counts match, and an all-gather of
 * unequal counts may leave a communicator out of step, so no later collective may trust it
 * (or it hangs, and the watchdog ends it). Host units, and HSDP_AGREE_SEPARATE, exchange the
 * tickets in their own staged all-gather first (hsdp_agree). Slots are taken at the start
 * and given back at the wait, so at most TICKET_SLOTS unit gathers are in flight at once. */
enum { TICKET_SLOTS = 64 };
typedef struct {
    int slot;
    hsdp_group *g;  /* a group is freed only after the queue is drained (nccl_free) */
    char what[160]; /* the gather, for the message */
} ticket_due;
static struct {
    pthread_mutex_t mu;             /* the queue below; taken before S.mu, never with it held */
    ticket_due due[TICKET_SLOTS];   /* waited gathers whose tickets are not compared yet, oldest first */
    unsigned due_head, due_count;
    hsdp_ticket *host; /* pinned (cudaHostAlloc): TICKET_SLOTS slots of `ranks` tickets; freed at finalize */
    char *dev;         /* the same on the device (dev_malloc); freed at finalize */
    int ranks;         /* tickets per slot: the world's size */
    hsdp_cudaEvent_t ev[TICKET_SLOTS]; /* each slot's copy back to the host */
    atomic_int used[TICKET_SLOTS];     /* taken at a gather's start (S.issue), given back once compared */
} T = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void tickets_free(void) {
    for (int i = 0; i < TICKET_SLOTS; i++) {
        if (T.ev[i]) CUDA(cudaEventDestroy, T.ev[i]);
        T.ev[i] = NULL;
        atomic_store(&T.used[i], 0);
    }
    if (T.host) CUDA(cudaFreeHost, T.host);
    if (T.dev) CUDA(cudaFree, T.dev);
    T.host = NULL;
    T.dev = NULL;
    T.ranks = 0;
}

/* S.issue held: the slots, made on first use. */
static hsdp_status tickets_ready(int size) {
    if (!T.host) {
        int ranks = S.boot.size > size ? S.boot.size : size;
        size_t n = (size_t)TICKET_SLOTS * (size_t)ranks * sizeof(hsdp_ticket);
        void *h = NULL, *d = NULL;
        hsdp_cudaError_t e = CUDA(cudaHostAlloc, &h, n, hsdp_cudaHostAllocDefault);
        if (e != hsdp_cudaSuccess) return cuda_fail(e, "allocating pinned memory for the agreement tickets");
        T.host = h;
        e = dev_malloc(&d, n);
        T.dev = d;
        for (int i = 0; e == hsdp_cudaSuccess && i < TICKET_SLOTS; i++)
            e = CUDA(cudaEventCreateWithFlags, &T.ev[i], hsdp_cudaEventDisableTiming);
        if (e != hsdp_cudaSuccess) {
            tickets_free();
            return cuda_fail(e, "allocating the agreement tickets on the GPU");
        }
        T.ranks = ranks;
    }
    if (size > T.ranks)
        return hsdp_fail(HSDP_EINVAL, "a group of %d ranks is larger than the NCCL world of %d", size, T.ranks);
    return HSDP_OK;
}

static hsdp_status tickets_settle(int block, int oldest_only);

/* S.issue held: this rank's ticket for a unit gather on g, in a free slot (*slot), copied to
 * the device on the side stream. */
static hsdp_status ticket_begin(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes, int *slot) {
    *slot = -1;
    hsdp_status st = tickets_ready(g->size);
    if (st != HSDP_OK) return st;
    int i = 0;
    while (i < TICKET_SLOTS && atomic_load(&T.used[i])) i++;
    if (i == TICKET_SLOTS && T.due_count) { /* slots wait in the queue: compare the oldest */
        st = tickets_settle(1, 1);
        if (st != HSDP_OK) return st;
        for (i = 0; i < TICKET_SLOTS && atomic_load(&T.used[i]);) i++;
    }
    if (i == TICKET_SLOTS)
        return hsdp_fail(HSDP_ESTATE, "more than %d unit gathers are in flight on the NCCL backend: wait some before "
                         "starting more", TICKET_SLOTS);
    hsdp_ticket *mine = T.host + (size_t)i * (size_t)T.ranks + (size_t)g->rank;
    *mine = hsdp_ticket_make(g, label, ident, nbytes);
    char *dev = T.dev + ((size_t)i * (size_t)T.ranks + (size_t)g->rank) * sizeof *mine;
    CUDA_TRY(CUDA(cudaMemcpyAsync, dev, mine, sizeof *mine, hsdp_cudaMemcpyDefault, S.comm), "copying a ticket to the GPU");
    atomic_store(&T.used[i], 1);
    *slot = i;
    return HSDP_OK;
}

/* S.issue held: the data's all-gather (slot < 0: alone), or it and the tickets' in one NCCL
 * group, then the tickets copied back to the host. */
static hsdp_status enqueue_unit(hsdp_group *g, int slot, const void *send, void *recv, size_t nbytes) {
    nccl_comm *c = g->impl;
    if (slot < 0) return enqueue(c, OP_GATHER, g->size, send, recv, nbytes, 0);
    size_t tb = sizeof(hsdp_ticket);
    char *tk = T.dev + (size_t)slot * (size_t)T.ranks * tb;
    pthread_mutex_lock(&S.calls);
    hsdp_status st = failed_status_if_failed();
    if (st == HSDP_OK) {
        hsdp_ncclResult_t rc = api.ncclGroupStart();
        if (rc == hsdp_ncclSuccess)
            rc = api.ncclAllGather(tk + (size_t)g->rank * tb, tk, tb, hsdp_ncclUint8, c->comm, S.comm);
        if (rc == hsdp_ncclSuccess) rc = api.ncclAllGather(send, recv, nbytes, hsdp_ncclUint8, c->comm, S.comm);
        hsdp_ncclResult_t end = api.ncclGroupEnd();
        st = nccl_done(c, rc != hsdp_ncclSuccess ? rc : end, "ncclAllGather (a unit and its tickets)");
    }
    pthread_mutex_unlock(&S.calls);
    if (st != HSDP_OK) return st;
    hsdp_ticket *host = T.host + (size_t)slot * (size_t)T.ranks;
    CUDA_TRY(CUDA(cudaMemcpyAsync, host, tk, tb * (size_t)g->size, hsdp_cudaMemcpyDefault, S.comm),
             "copying the tickets back from the GPU");
    CUDA_TRY(CUDA(cudaEventRecord, T.ev[slot], S.comm), "recording the tickets' event");
    return HSDP_OK;
}

/* Waits on the host (within the timeout) for slot's tickets, compares them, and gives the
 * slot back. A slot of a gather that failed before is given back as is (st). late: the
 * gather's buffer was handed out already, so a mismatch aborts every communicator. */
static hsdp_status ticket_check(hsdp_group *g, int slot, hsdp_status st, const char *what, int late) {
    if (slot < 0) return st;
    if (st == HSDP_OK) st = host_wait(T.ev[slot], what);
    if (st == HSDP_OK) {
        const hsdp_ticket *all = T.host + (size_t)slot * (size_t)T.ranks;
        st = hsdp_tickets_check_late(g, all, late);
        int sizes_differ = 0;
        for (int j = 1; st != HSDP_OK && j < g->size; j++) sizes_differ |= all[j].nbytes != all[0].nbytes;
        if (st != HSDP_OK && (sizes_differ || late)) {
            char msg[sizeof S.why];
            snprintf(msg, sizeof msg, "%s", hsdp_last_error());
            st = ABORT_ALL("%s", msg);
        }
    }
    atomic_store(&T.used[slot], 0);
    return st;
}

/* Compares the queued tickets in order (T.mu taken here): those landed, or (block) every one,
 * waiting for each; oldest_only: just the oldest (a slot is needed). The first failure stops
 * it; the rest are given back as they are (the communicators are aborted by then). */
static hsdp_status tickets_settle(int block, int oldest_only) {
    hsdp_status st = HSDP_OK;
    pthread_mutex_lock(&T.mu);
    while (T.due_count) {
        ticket_due *d = &T.due[T.due_head];
        if (st == HSDP_OK && !block) {
            hsdp_cudaError_t e = CUDA(cudaEventQuery, T.ev[d->slot]);
            if (e == hsdp_cudaErrorNotReady || capture_error(e)) break;
        }
        st = ticket_check(d->g, d->slot, st, d->what, 1);
        T.due_head = (T.due_head + 1) % TICKET_SLOTS;
        T.due_count--;
        if (oldest_only) break;
    }
    pthread_mutex_unlock(&T.mu);
    return st;
}

/* The tickets of a waited gather join the queue (its slot stays taken until compared). */
static void tickets_due(hsdp_group *g, int slot, const char *what) {
    pthread_mutex_lock(&T.mu);
    ticket_due *d = &T.due[(T.due_head + T.due_count) % TICKET_SLOTS];
    d->slot = slot;
    d->g = g;
    snprintf(d->what, sizeof d->what, "%s", what);
    T.due_count++; /* at most one entry per slot: never more than TICKET_SLOTS */
    pthread_mutex_unlock(&T.mu);
}

hsdp_status hsdp_nccl_agreement_drain(void) {
    if (!S.world_up) return HSDP_OK;
    device_guard();
    hsdp_status st = tickets_settle(1, 0);
    return st == HSDP_OK ? failed_status_if_failed() : st;
}

/* A gather's own state (a request's, or a synchronous gather's on the stack): the event its
 * reader is ordered after (reader_after), and its tickets. */
typedef struct {
    hsdp_cudaEvent_t ev;
    hsdp_cudaStream_t stream; /* the reader's: the thread's call stream when set, else the compute stream */
    int slot;       /* a unit gather's tickets (agreement), or -1 */
    char what[160]; /* what it gathers, for the tickets' wait */
} nccl_task;
_Static_assert(sizeof(nccl_task) <= HSDP_REQ_STATE_BYTES, "nccl_task must fit in hsdp_req.state");

/* ---- the float8 wire (issue 22): decoded on the side stream (cuda_dequant.c) ----
 * A unit's gathered encodings are dequantized by a kernel enqueued right after the gather,
 * on the same stream, and tracked as a collective writing the unsharded buffer: the event the
 * compute stream (or a DLPack consumer) waits on is the kernel's. S.issue held. */
static hsdp_status wire_check(const hsdp_gather_req *wr, const char *label) { /* before anything is enqueued */
    if (!on_device(wr->full))
        return hsdp_fail(HSDP_EUNSUPPORTED, "unit '%s': the float8 wire gathers into device memory here, so its "
                         "unsharded buffer must be device memory too", label ? label : "");
    if (!hsdp_wire_cuda_loaded())
        return hsdp_fail(HSDP_EUNSUPPORTED, "unit '%s': the float8 wire on NCCL dequantizes with a kernel that NVRTC "
                         "compiles and the CUDA driver launches, and neither is loaded (hsdp_wire_cuda_load)",
                         label ? label : "");
    return hsdp_wire_cuda_prepare(); /* the module in this context: a driver refusing the PTX says so now */
}
static hsdp_status wire_decode(const hsdp_gather_req *wr, const char *label, hsdp_cudaEvent_t *ev) {
    hsdp_status st = hsdp_wire_cuda_decode(wr->u, wr->wire, wr->full, S.comm);
    char what[160];
    snprintf(what, sizeof what, "the float8 dequantization of unit '%s' (%zu bytes)", label ? label : "",
             wr->u->layout.total_bytes);
    return st == HSDP_OK ? track(what, wr->full, wr->u->layout.total_bytes, ev) : st;
}
/* ---- end of the float8 wire ---- */

/* Issues a gather into device memory (S.issue taken here): with share, a unit's fixed chunk
 * from its device copy (made by the first gather), else send as given; the tickets in the
 * same NCCL group when mode is HSDP_AGREE_ON; with wr, the float8 wire's decode after it.
 * t gets the event its reader waits on and the tickets' slot, for task_wait. On failure
 * nothing is left to wait for: the slot is given back. */
static hsdp_status issue_device(nccl_task *t, hsdp_group *g, void **share, const void *send, void *recv,
                                size_t nbytes, const char *label, uint64_t ident, int mode,
                                const hsdp_gather_req *wr) {
    describe(t->what, sizeof t->what, "gather", label, nbytes, g->size);
    pthread_mutex_lock(&S.issue);
    issuing = g->impl;
    const void *src = send;
    hsdp_status st = begin();
    if (st == HSDP_OK && share) st = fixed_source(share, send, nbytes, &src);
    if (st == HSDP_OK && src != (const char *)recv + (size_t)g->rank * nbytes)
        st = in_place(src, recv, nbytes, g->rank, &src);
    if (st == HSDP_OK && mode == HSDP_AGREE_ON) st = ticket_begin(g, label, ident, nbytes, &t->slot);
    int enqueued = 0;
    if (st == HSDP_OK) enqueued = (st = enqueue_unit(g, t->slot, src, recv, nbytes)) == HSDP_OK;
    if (st == HSDP_OK) st = track(t->what, recv, nbytes * (size_t)g->size, &t->ev);
    if (st == HSDP_OK && wr) st = wire_decode(wr, label, &t->ev); /* the float8 wire */
    issue_unlock();
    if (st != HSDP_OK && enqueued && t->slot >= 0) {
        /* the tickets' copy-back is queued: the slot is taken again only once it has landed,
         * or it would overwrite the next gather's ticket (the error stays this one's) */
        char why[sizeof S.why];
        snprintf(why, sizeof why, "%s", hsdp_last_error());
        (void)host_wait(T.ev[t->slot], t->what);
        st = hsdp_fail(st, "%s", why);
    }
    if (st != HSDP_OK) (void)ticket_check(g, t->slot, st, t->what, 0); /* no wait follows: the slot goes back now */
    if (st != HSDP_OK) t->slot = -1;
    return st;
}

/* Ends what a gather began: its reader ordered after it (the device's reader_after: the
 * compute stream waits, the host does not; over a host view the host waits), then its
 * tickets: now, waited for on the host (now: a synchronous gather), or queued, compared once
 * landed ([Note: tickets checked late]). */
static hsdp_status task_wait(hsdp_group *g, nccl_task *t, int now) {
    hsdp_status st = atomic_load(&S.failed) ? failed_status() : HSDP_OK;
    if (st == HSDP_OK && t->ev) st = refuse_capture(t->stream, t->what);
    if (st == HSDP_OK && t->ev) st = device_now()->reader_after(t->ev, t->stream, t->what);
    if (t->slot < 0) return st;
    if (st != HSDP_OK || now) {
        hsdp_status before = st == HSDP_OK ? tickets_settle(1, 0) : st; /* in order: the queue first */
        st = ticket_check(g, t->slot, before, t->what, 0);
    } else {
        /* the earlier gathers' tickets that have landed, without waiting; this one's is compared
         * by a later call, so a wait returns the same on every rank however fast its copy is */
        st = tickets_settle(0, 0);
        if (st == HSDP_OK)
            tickets_due(g, t->slot, t->what);
        else
            (void)ticket_check(g, t->slot, st, t->what, 0);
    }
    t->slot = -1;
    return st;
}

/* Begins a gather into recv: of a unit's fixed chunk (share; check: whether it checks that
 * every rank gathers the same unit, told ident) or, share NULL, of send as given. dev says
 * whether recv is device memory (on_device, asked once by the caller). Into device memory
 * it is issued into t, for task_wait; into host memory it is staged and done before this
 * returns, and t holds nothing to wait for. Agreement travels with a device gather's data
 * (HSDP_AGREE_ON); into host memory, or under HSDP_AGREE_SEPARATE, it is its own staged
 * all-gather first (hsdp_agree). */
static hsdp_status gather_begin(nccl_task *t, hsdp_group *g, void **share, const void *send, void *recv,
                                size_t nbytes, const char *label, uint64_t ident, int check, int dev,
                                const hsdp_gather_req *wr) {
    t->ev = NULL;
    t->stream = call_stream_set ? call_stream : S.compute;
    t->slot = -1;
    t->what[0] = '\0';
    int mode = share && check && g->size > 1 ? hsdp_agreement_check() : HSDP_AGREE_OFF;
    if (mode == HSDP_AGREE_SEPARATE || (mode != HSDP_AGREE_OFF && !dev)) {
        hsdp_status st = hsdp_agree(g, label, ident, nbytes, nccl_all_gather);
        if (st != HSDP_OK) return st;
        mode = HSDP_AGREE_OFF;
    }
    if (dev) return issue_device(t, g, share, send, recv, nbytes, label, ident, mode, wr);
    /* a host buffer: staged each time; a unit's chunk is fixed from now on like any other,
     * and once on the device it is gathered from its device copy (its host chunk may be gone) */
    if (share && *share && *share != hsdp_share_collective()) send = ((nccl_share *)*share)->dev;
    hsdp_status st = nccl_all_gather(g, send, recv, nbytes);
    if (st == HSDP_OK && share && !*share) *share = hsdp_share_collective();
    return st;
}

/* A synchronous gather of a fixed chunk: begun, then waited for (a unit's returns once its
 * tickets are checked). */
static hsdp_status gather_fixed_as(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                   const char *label, uint64_t ident, int check) {
    device_guard();
    int dev = on_device(recv);
    nccl_task t;
    hsdp_status st = gather_begin(&t, g, share, send, recv, nbytes, label, ident, check, dev, NULL);
    return st == HSDP_OK && dev ? task_wait(g, &t, 1) : st;
}

static hsdp_status nccl_gather_fixed(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                     const char *label) {
    return gather_fixed_as(g, share, send, recv, nbytes, label, 0, 0);
}

static hsdp_status nccl_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                    const char *label, uint64_t ident) {
    return gather_fixed_as(g, share, send, recv, nbytes, label, ident, 1);
}

static void nccl_share_free(hsdp_group *g, void *share, void *memory) {
    device_guard();
    (void)g;
    nccl_share *s = share;
    free(memory);
    if (!s) return;
    /* a gather may still read the device copy: drain the side stream first (unless aborted) */
    if (!atomic_load(&S.failed)) (void)CUDA(cudaStreamSynchronize, S.comm);
    CUDA(cudaFree, s->dev);
    free(s);
}

static hsdp_status nccl_share_read(hsdp_group *g, const void *share, void *out, size_t nbytes) {
    (void)g;
    device_guard();
    const nccl_share *s = share;
    pthread_mutex_lock(&S.issue);
    hsdp_status st = begin();
    if (st == HSDP_OK && nbytes) {
        /* on the side stream, after the upload and what is queued there, waited for first
         * (within the timeout: a copy into pageable memory would block behind a hung
         * collective); then the copy, waited for on the host */
        const char *what = "reading a shard back from the GPU";
        hsdp_cudaEvent_t ev = NULL;
        st = track(what, NULL, 0, &ev);
        if (st == HSDP_OK) st = host_wait(ev, what);
        hsdp_cudaError_t e = st == HSDP_OK ? CUDA(cudaMemcpyAsync, out, s->dev, nbytes, hsdp_cudaMemcpyDefault, S.comm)
                                           : hsdp_cudaSuccess;
        if (e != hsdp_cudaSuccess) st = cuda_fail(e, what);
        if (st == HSDP_OK) st = track(what, NULL, 0, &ev);
        if (st == HSDP_OK) st = host_wait(ev, what);
    }
    issue_unlock();
    return st;
}

static const char *nccl_share_kind(const void *share) {
    (void)share;
    return "device";
}

static hsdp_status nccl_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes) {
    device_guard();
    nccl_task *t = (nccl_task *)r->state;
    t->ev = NULL;
    t->slot = -1;
    r->start_ns = hsdp_now_ns();
    const hsdp_gather_req *wr = hsdp_unit_landing_request(r); /* float8 wire: decoded here, see wire_decode */
    if (r->then && (!wr || wr->widened)) /* a conversion is host work: a device unit computes in its storage dtypes */
        return hsdp_fail(HSDP_EUNSUPPORTED, "a GPU gather cannot convert dtypes on the host; compute in the storage dtype");
    int dev = on_device(recv); /* asked once for the whole gather */
    hsdp_status st = wr && dev ? wire_check(wr, r->label) : HSDP_OK;
    if (st == HSDP_OK)
        st = gather_begin(t, r->g, r->share, send, recv, nbytes, r->label, r->ident, 1, dev, dev ? wr : NULL);
    if (!dev) { /* a host gather: staged and complete before returning */
        if (st == HSDP_OK && wr) st = r->then(r->then_arg); /* the float8 wire's decode, on the host */
        r->end_ns = hsdp_now_ns();
    }
    return st;
}

static void nccl_gather_wait(hsdp_req *r) {
    device_guard();
    hsdp_status st = task_wait(r->g, (nccl_task *)r->state, 0);
    r->end_ns = hsdp_now_ns();
    r->status = st;
    if (st != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", hsdp_last_error());
}

/* Ring attention's point to point on device buffers (UNTESTED ON A GPU; the fake library's
 * world of one runs it): ncclSend to dest and ncclRecv from source inside one NCCL group, on
 * the side stream after the compute stream's work so far (which wrote the send buffer);
 * gather_wait makes the compute stream wait for it, the host never does. NCCL does not check
 * that the sizes of a pair match: every rank of the ring must pass the same shapes. Host
 * buffers are refused: ring attention on the GPU keeps its blocks on the device. */
static hsdp_status nccl_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                       size_t rbytes, int source) {
    device_guard();
    nccl_task *t = (nccl_task *)r->state;
    t->ev = NULL;
    t->slot = -1;
    r->start_ns = hsdp_now_ns();
    if ((sbytes && !on_device(send)) || (rbytes && !on_device(recv)))
        return hsdp_fail(HSDP_EUNSUPPORTED, "the NCCL backend's sendrecv takes device buffers only");
    nccl_comm *c = r->g->impl;
    char what[160];
    snprintf(what, sizeof what, "a sendrecv of %zu bytes to rank %d and %zu from rank %d over %d ranks", sbytes, dest,
             rbytes, source, r->g->size);
    memcpy(t->what, what, sizeof t->what); /* for its wait */
    hsdp_cudaStream_t order = call_stream_set ? call_stream : S.compute; /* the consumer's stream */
    t->stream = order; /* its wait orders the same stream */
    hsdp_status st = refuse_capture(order, what);
    if (st != HSDP_OK) return st;
    pthread_mutex_lock(&S.issue);
    issuing = c;
    st = begin();
    if (st == HSDP_OK) {
        /* the send buffer was written on the consumer's stream: read it after */
        hsdp_cudaError_t e = CUDA(cudaEventRecord, S.ready, order);
        if (e == hsdp_cudaSuccess) e = CUDA(cudaStreamWaitEvent, S.comm, S.ready, 0);
        if (e != hsdp_cudaSuccess) st = cuda_fail(e, "ordering a sendrecv after the compute stream");
    }
    if (st == HSDP_OK) {
        hsdp_ncclResult_t rc = api.ncclGroupStart();
        if (rc == hsdp_ncclSuccess && sbytes) rc = api.ncclSend(send, sbytes, hsdp_ncclUint8, dest, c->comm, S.comm);
        if (rc == hsdp_ncclSuccess && rbytes) rc = api.ncclRecv(recv, rbytes, hsdp_ncclUint8, source, c->comm, S.comm);
        hsdp_ncclResult_t end = api.ncclGroupEnd();
        st = nccl_done(c, rc != hsdp_ncclSuccess ? rc : end, "ring attention's grouped ncclSend/ncclRecv");
    }
    if (st == HSDP_OK) st = track(what, recv, rbytes, &t->ev);
    issue_unlock();
    return st;
}

static hsdp_status nccl_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                 int source) {
    hsdp_req r = {.g = g};
    hsdp_status st = nccl_sendrecv_start(&r, send, sbytes, dest, recv, rbytes, source);
    if (st != HSDP_OK) return st;
    nccl_gather_wait(&r); /* the compute stream waits for it */
    if (r.status != HSDP_OK) return hsdp_fail(r.status, "%s", r.err);
    return HSDP_OK;
}

static int nccl_overlaps(const hsdp_group *g) {
    (void)g;
    return 1;
}

/* ---------------------------------------------------------------- the device: CUDA */
static void *nccl_buffer_alloc(size_t nbytes) {
    void *p = NULL;
    if (!api.loaded) return NULL;
    device_guard();
    return dev_malloc(&p, nbytes) == hsdp_cudaSuccess ? p : NULL;
}

static void nccl_buffer_free(void *p, size_t nbytes) {
    device_guard();
    (void)nbytes;
    if (p) CUDA(cudaFree, p);
}

static void nccl_buffers_released(void) {
    if (!S.world_up) return;
    device_guard();
    if (CUDA(cudaEventRecord, S.released, S.compute) == hsdp_cudaSuccess) S.have_released = 1;
    if (!S.nreaders) return; /* read unlocked: only a reader's first import adds one */
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.nreaders; i++)
        if (S.readers[i].read && CUDA(cudaEventRecord, S.readers[i].ev, S.readers[i].stream) == hsdp_cudaSuccess) {
            S.readers[i].read = 0;
            S.readers[i].pending = 1;
            atomic_store(&S.readers_pending, 1);
        }
    pthread_mutex_unlock(&S.mu);
}

/* DLPack's CUDA streams: None or 1 (the legacy default stream), 2 (per-thread default), -1
 * (the consumer orders itself) or a stream handle; 0 is ambiguous and refused. */
static hsdp_status nccl_consumer_wait(int given, long long stream, const void *p, size_t n) {
    if (given && (stream == 0 || stream < -1))
        return hsdp_fail(HSDP_EINVAL, "__dlpack__(stream=%lld): a CUDA consumer's stream is None, -1, 1, 2 or a "
                                      "stream handle (DLPack forbids 0)", stream);
    if (given && stream == -1) return HSDP_OK;
    hsdp_cudaStream_t s = !given || stream == 1 ? NULL : (hsdp_cudaStream_t)(uintptr_t)stream;
    hsdp_status st = stream_wait(s, p, n);
    return st == HSDP_OK && S.world_up ? note_reader(s) : st;
}

static const char *nccl_wire_missing(void) {
    return hsdp_wire_cuda_loaded() ? NULL
                                   : "dequantizes with a GPU kernel that is not loaded: call hsdp.nccl.load_wire_kernel() "
                                     "first (it needs NVRTC and the CUDA driver)";
}

/* A stream reads next: it waits on the collective's event; the host does not. */
static hsdp_status stream_after(void *done, void *stream, const char *what) {
    hsdp_cudaError_t e = CUDA(cudaStreamWaitEvent, (hsdp_cudaStream_t)stream, (hsdp_cudaEvent_t)done, 0);
    if (e == hsdp_cudaSuccess) return HSDP_OK;
    char msg[200];
    snprintf(msg, sizeof msg, "ordering the consumer's stream after %s", what);
    return cuda_fail(e, msg);
}

/* What both tables below share: they are two views of the same device memory, named
 * 'cuda', allocated, released and decoded into alike. */
#define NCCL_DEVICE_MEMORY                                                                                    \
    .name = "cuda", .alloc = nccl_buffer_alloc, .free = nccl_buffer_free, .released = nccl_buffers_released,  \
    .wire_missing = nccl_wire_missing

static const hsdp_device_i nccl_device = {
    NCCL_DEVICE_MEMORY,
    .framework = "cuda",
    .dlpack_type = 2, /* kDLCUDA */
    .dlpack_id = nccl_device_id,
    .consumer_wait = nccl_consumer_wait,
    .call_stream = nccl_call_stream,
    .reader_after = stream_after,
};

/* The same device memory over a runtime whose device memory the host reads (the test fake,
 * chosen by hsdp_nccl_load): views of it are CPU tensors (kDLCPU), so a CPU-only torch
 * computes on them. The reader is the host, which has no stream: every wait on a collective
 * writing device memory blocks the host (host_after), so a buffer's bytes have landed when
 * its gather's wait returns, as device.h says of a device without consumer_wait. */
static int nccl_host_id(void) { return 0; } /* kDLCPU has one device */
static hsdp_status host_after(void *done, void *stream, const char *what) {
    (void)stream;
    return host_wait((hsdp_cudaEvent_t)done, what);
}
static const hsdp_device_i nccl_host_device = {
    NCCL_DEVICE_MEMORY,
    .framework = "cpu",
    .dlpack_type = 1, /* kDLCPU */
    .dlpack_id = nccl_host_id,
    .reader_after = host_after,
};
#undef NCCL_DEVICE_MEMORY

/* ---------------------------------------------------------------- communicators */
static hsdp_status comm_wrap(hsdp_ncclComm_t comm, int rank, int size, hsdp_group **out) {
    nccl_comm *c = calloc(1, sizeof *c); /* owned by the group; freed by nccl_free */
    hsdp_group *g = malloc(sizeof *g);   /* owned by the caller; hsdp_group_free */
    if (!c || !g) {
        free(c);
        free(g);
        api.ncclCommAbort(comm);
        return hsdp_fail(HSDP_ENOMEM, "could not allocate an NCCL group");
    }
    c->comm = comm;
    c->size = size;
    pthread_mutex_lock(&S.mu);
    c->next = S.live;
    S.live = c;
    pthread_mutex_unlock(&S.mu);
    *g = (hsdp_group){.backend = &hsdp_backend_nccl, .rank = rank, .size = size, .impl = c};
    *out = g;
    return HSDP_OK;
}

static void nccl_free(hsdp_group *g);

/* Which world rank each rank of g is, so that a timeout can name them (watchdog.h): the
 * world's own, or learned over a split group by an all-gather. Collective over g. */
static hsdp_status learn_world_ranks(hsdp_group *g, int world) {
    nccl_comm *c = g->impl;
    int *ranks = malloc(sizeof *ranks * (size_t)g->size); /* owned by c; freed by nccl_free */
    if (!ranks) return hsdp_fail(HSDP_ENOMEM, "could not allocate the world ranks of a group of %d", g->size);
    hsdp_status st = HSDP_OK;
    if (world)
        for (int i = 0; i < g->size; i++) ranks[i] = i;
    else
        st = nccl_all_gather(g, &S.boot.rank, ranks, sizeof *ranks);
    pthread_mutex_lock(&S.mu);
    if (st == HSDP_OK) c->world_ranks = ranks;
    pthread_mutex_unlock(&S.mu);
    if (st != HSDP_OK) free(ranks);
    return st;
}

/* Every rank's peer record (watchdog.h), all-gathered over the world once: a timeout can then
 * name who did not arrive. Collective over the world (the first world learned wins, as with
 * MPI's: one world per process). */
static hsdp_status learn_peers(hsdp_group *world) {
    if (world->size < 2) return HSDP_OK;
    uint64_t mine[HSDP_PEER_WORDS];
    hsdp_peers_mine(mine);
    uint64_t *all = malloc(sizeof mine * (size_t)world->size); /* freed below (hsdp_peers_learn copies) */
    if (!all) return hsdp_fail(HSDP_ENOMEM, "could not allocate the %d ranks' watchdog records", world->size);
    hsdp_status st = nccl_all_gather(world, mine, all, sizeof mine);
    if (st == HSDP_OK && hsdp_peers_learn(all, world->size, world->rank) != 0)
        st = hsdp_fail(HSDP_ENOMEM, "could not keep the %d ranks' watchdog records", world->size);
    free(all);
    return st;
}

/* Non-blocking communicators, so that joining can be timed out. */
static hsdp_ncclConfig_t comm_config(void) {
    hsdp_ncclConfig_t cfg = HSDP_NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    return cfg;
}

static hsdp_status join_done(hsdp_ncclComm_t comm, hsdp_ncclResult_t rc, const char *what) {
    nccl_comm tmp = {.comm = comm};
    if (rc != hsdp_ncclSuccess && rc != hsdp_ncclInProgress)
        return hsdp_fail(HSDP_ECOMM, "%s failed: NCCL error %d (%s)", what, (int)rc, api.ncclGetErrorString(rc));
    uint64_t t0 = hsdp_now_ns(), limit = hsdp_timeout_ns();
    for (;;) {
        hsdp_ncclResult_t state = hsdp_ncclInProgress;
        hsdp_ncclResult_t qrc = api.ncclCommGetAsyncError(comm, &state);
        if (qrc != hsdp_ncclSuccess) {
            if (comm) api.ncclCommAbort(comm);
            return hsdp_fail(HSDP_ECOMM, "%s failed: ncclCommGetAsyncError on the new communicator said NCCL error "
                             "%d (%s)", what, (int)qrc, api.ncclGetErrorString(qrc));
        }
        if (state == hsdp_ncclSuccess) return HSDP_OK;
        if (atomic_load(&S.failed)) { /* another communicator failed: this one is not live yet */
            api.ncclCommAbort(comm);
            return failed_status();
        }
        if (state != hsdp_ncclInProgress) {
            hsdp_status st = hsdp_fail(HSDP_ECOMM, "%s failed: NCCL error %d (%s)", what, (int)state,
                                       nccl_text(state, &tmp));
            api.ncclCommAbort(comm);
            return st;
        }
        if (limit && hsdp_now_ns() - t0 > limit) {
            api.ncclCommAbort(comm);
            return hsdp_fail(HSDP_ECOMM, "%s did not finish within %g s (HSDP_TIMEOUT): a rank did not arrive, or "
                             "the ranks were not given the same unique id", what, timeout_s());
        }
        nap(t0);
    }
}

hsdp_status hsdp_nccl_unique_id(unsigned char out[HSDP_NCCL_ID_BYTES]) {
    if (!api.loaded) return hsdp_fail(HSDP_ESTATE, "the NCCL library is not loaded yet");
    hsdp_ncclUniqueId id;
    _Static_assert(sizeof id == HSDP_NCCL_ID_BYTES, "ncclUniqueId is 128 bytes");
    hsdp_ncclResult_t rc = api.ncclGetUniqueId(&id);
    if (rc != hsdp_ncclSuccess)
        return hsdp_fail(HSDP_ECOMM, "ncclGetUniqueId failed: NCCL error %d (%s)", (int)rc, api.ncclGetErrorString(rc));
    memcpy(out, &id, sizeof id);
    return HSDP_OK;
}

hsdp_status hsdp_nccl_set_bootstrap(const unsigned char id[HSDP_NCCL_ID_BYTES], int rank, int size, int device) {
    if (size < 1 || rank < 0 || rank >= size)
        return hsdp_fail(HSDP_EINVAL, "rank %d is outside a world of %d", rank, size);
    if (device < 0) return hsdp_fail(HSDP_EINVAL, "the CUDA device must be >= 0, got %d", device);
    memcpy(S.boot.id, id, HSDP_NCCL_ID_BYTES);
    S.boot.rank = rank;
    S.boot.size = size;
    S.boot.device = device;
    S.boot.set = 1;
    return HSDP_OK;
}

static int nccl_usable(const char **why) {
    if (!api.loaded) {
        *why = "the NCCL backend is built but its libraries are not loaded: hsdp.distributed.init_process_group"
               "('nccl') loads them after importing torch";
        return 0;
    }
    *why = NULL;
    return 1;
}

static hsdp_status start_process_state(int device) {
    int n = 0;
    CUDA_TRY(CUDA(cudaGetDeviceCount, &n), "cudaGetDeviceCount");
    if (device >= n)
        return hsdp_fail(HSDP_EINVAL, "CUDA device %d does not exist: this machine shows %d (LOCAL_RANK must be below "
                         "the number of visible GPUs)", device, n);
    CUDA_TRY(CUDA(cudaSetDevice, device), "cudaSetDevice");
    S.device = device;
    thread_device = device;
    if (!S.comm) {
        int least = 0, greatest = 0;
        CUDA_TRY(CUDA(cudaDeviceGetStreamPriorityRange, &least, &greatest), "cudaDeviceGetStreamPriorityRange");
        CUDA_TRY(CUDA(cudaStreamCreateWithPriority, &S.comm, hsdp_cudaStreamNonBlocking, greatest),
                 "creating the gather stream");
        CUDA_TRY(CUDA(cudaEventCreateWithFlags, &S.released, hsdp_cudaEventDisableTiming), "creating the release event");
        CUDA_TRY(CUDA(cudaEventCreateWithFlags, &S.ready, hsdp_cudaEventDisableTiming), "creating the ordering event");
    }
    if (!S.watchdog_on) {
        atomic_store(&S.stop, 0);
        int rc = pthread_create(&S.watchdog, NULL, watchdog, NULL);
        if (rc != 0) return hsdp_fail(HSDP_ECOMM, "could not start the NCCL watchdog thread: %s", strerror(rc));
        S.watchdog_on = 1;
    }
    S.world_up = 1;
    return HSDP_OK;
}

static hsdp_status nccl_world(hsdp_group **out, int *we_init) {
    *out = NULL;
    *we_init = 0;
    if (!S.boot.set)
        return hsdp_fail(HSDP_ESTATE, "the NCCL world needs its bootstrap first: use hsdp.distributed."
                         "init_process_group('nccl'), which exchanges the unique id over MPI or torch's TCPStore");
    S.boot.set = 0; /* an id joins one world */
    hsdp_status st = start_process_state(S.boot.device);
    if (st != HSDP_OK) return st;
    hsdp_ncclUniqueId id;
    memcpy(&id, S.boot.id, sizeof id);
    hsdp_ncclComm_t comm = NULL;
    char what[128];
    snprintf(what, sizeof what, "joining the NCCL world of %d ranks as rank %d", S.boot.size, S.boot.rank);
    if (api.ncclCommInitRankConfig) {
        hsdp_ncclConfig_t cfg = comm_config();
        /* two statements: the call writes comm, join_done reads it (one call's arguments
         * would leave the order unspecified, and clang passes the NULL from before) */
        hsdp_ncclResult_t rc = api.ncclCommInitRankConfig(&comm, S.boot.size, id, S.boot.rank, &cfg);
        st = join_done(comm, rc, what);
    } else { /* before 2.14: blocking, so not bounded by the timeout */
        hsdp_ncclResult_t rc = api.ncclCommInitRank(&comm, S.boot.size, id, S.boot.rank);
        st = rc == hsdp_ncclSuccess ? HSDP_OK
                                    : hsdp_fail(HSDP_ECOMM, "%s failed: %s", what, api.ncclGetErrorString(rc));
    }
    if (st != HSDP_OK) return st;
    st = comm_wrap(comm, S.boot.rank, S.boot.size, out);
    if (st == HSDP_OK) *we_init = 1;
    if (st == HSDP_OK) st = learn_world_ranks(*out, 1);
    if (st == HSDP_OK) st = learn_peers(*out);
    if (st != HSDP_OK && *out) { /* the world is not usable: the caller gets none */
        nccl_free(*out);
        *out = NULL;
        *we_init = 0;
    }
    return st;
}

static hsdp_status nccl_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    device_guard();
    *out = NULL;
    if (!api.ncclCommSplit)
        return hsdp_fail(HSDP_EUNSUPPORTED, "subgroups need ncclCommSplit (NCCL 2.18 or later); the loaded NCCL is %d",
                         api.version);
    if (atomic_load(&S.failed)) return failed_status();
    nccl_comm *c = g->impl;
    hsdp_ncclComm_t comm = NULL;
    hsdp_ncclConfig_t cfg = comm_config();
    char what[96];
    snprintf(what, sizeof what, "ncclCommSplit (color %d, key %d)", color, key);
    /* [Note: a split's handle] Under a non-blocking parent, ncclCommSplit sets *newcomm to NULL,
     * returns, and makes the child on a thread of its own, which stores the child's handle into
     * *newcomm when done (init.cc ncclCommInitChildComm, ncclCommInitRankFunc); the parent says
     * ncclInProgress until then. So the handle goes to a slot on the heap that outlives this
     * frame, the PARENT is polled to its end (under S.calls, as every call on it), and only then
     * is the slot read, and the child polled. A parent that fails or times out is aborted with
     * the rest (issue_unlock), which joins the split's thread: the slot is freed after that. */
    hsdp_ncclComm_t *slot = calloc(1, sizeof *slot); /* owned here; freed once NCCL can no longer write it */
    if (!slot) return hsdp_fail(HSDP_ENOMEM, "could not allocate the handle of a split NCCL communicator");
    pthread_mutex_lock(&S.issue);
    issuing = c;
    pthread_mutex_lock(&S.calls);
    hsdp_status st = failed_status_if_failed();
    if (st == HSDP_OK) {
        hsdp_ncclResult_t rc = api.ncclCommSplit(c->comm, color, key, slot, &cfg);
        if (rc == hsdp_ncclSuccess) rc = hsdp_ncclInProgress; /* the parent says when it is done */
        st = nccl_done(c, rc, what);
        if (st != HSDP_OK && !atomic_load(&S.failed)) /* the split's thread may still write the slot */
            (void)ABORT_ALL("%s", hsdp_last_error());
    }
    pthread_mutex_unlock(&S.calls);
    issue_unlock(); /* after a failure: every communicator aborted, the parent's split thread joined */
    comm = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    free(slot);
    if (st == HSDP_OK && !comm && color >= 0)
        st = hsdp_fail(HSDP_ECOMM, "%s finished without a communicator", what);
    if (st == HSDP_OK && comm) st = join_done(comm, hsdp_ncclInProgress, what); /* the child, polled to its end */
    if (st != HSDP_OK || !comm) return st;
    int rank = -1, size = -1;
    if (api.ncclCommUserRank(comm, &rank) != hsdp_ncclSuccess || api.ncclCommCount(comm, &size) != hsdp_ncclSuccess) {
        api.ncclCommAbort(comm);
        return hsdp_fail(HSDP_ECOMM, "could not read the rank and size of a split NCCL communicator");
    }
    st = comm_wrap(comm, rank, size, out);
    if (st == HSDP_OK) st = learn_world_ranks(*out, 0);
    if (st != HSDP_OK && *out) {
        nccl_free(*out);
        *out = NULL;
    }
    return st;
}

/* Frees a communicator without a collective: a group may be dropped on its ranks in any
 * order (Python's garbage collector decides), and ncclCommAbort tears down locally once
 * this rank's collectives on it are done. */
static void nccl_free(hsdp_group *g) {
    device_guard();
    nccl_comm *c = g->impl;
    (void)tickets_settle(1, 0); /* the queue may name this group */
    if (c) {
        if (!atomic_load(&S.failed) && S.comm) {
            hsdp_cudaEvent_t ev = NULL;
            pthread_mutex_lock(&S.issue);
            if (track("the last collectives of a group being freed", NULL, 0, &ev) == HSDP_OK)
                (void)host_wait(ev, "the last collectives of a group being freed");
            issue_unlock();
        }
        pthread_mutex_lock(&S.mu);
        for (nccl_comm **p = &S.live; *p; p = &(*p)->next)
            if (*p == c) {
                *p = c->next;
                break;
            }
        if (!c->aborted) api.ncclCommAbort(c->comm);
        pthread_mutex_unlock(&S.mu);
        free(c->world_ranks);
        free(c);
    }
    free(g);
}

static hsdp_status nccl_finalize(void) {
    device_guard();
    if (S.watchdog_on) {
        atomic_store(&S.stop, 1);
        pthread_join(S.watchdog, NULL);
        S.watchdog_on = 0;
    }
    (void)tickets_settle(1, 0); /* the slots go below */
    if (S.comm && !atomic_load(&S.failed)) (void)CUDA(cudaStreamSynchronize, S.comm);
    /* Every communicator still live is torn down now, while CUDA and NCCL are whole: the groups
     * that hold them (a DeviceMesh, a model's context) may be freed only at interpreter exit,
     * when the CUDA runtime may be unloading, and NCCL's proxy threads would outlive the job.
     * The side stream is drained, so each abort (ncclCommAbort, which also needs no peer) has
     * nothing in flight; the groups' own frees later release only memory (nccl_free). */
    pthread_mutex_lock(&S.calls);
    pthread_mutex_lock(&S.mu);
    abort_comms_locked();
    pthread_mutex_unlock(&S.mu);
    pthread_mutex_unlock(&S.calls);
    if (S.scratch) CUDA(cudaFree, S.scratch);
    S.scratch = NULL;
    tickets_free();
    if (S.pinned) CUDA(cudaFreeHost, S.pinned);
    S.pinned = NULL;
    for (int i = 0; i < 2; i++) {
        if (S.pin_ev[i]) CUDA(cudaEventDestroy, S.pin_ev[i]);
        S.pin_ev[i] = NULL;
        S.pin_used[i] = 0;
    }
    S.scratch_n = 0;
    for (unsigned i = 0; i < RING; i++)
        if (S.ring[i].ev) {
            CUDA(cudaEventDestroy, S.ring[i].ev);
            S.ring[i].ev = NULL;
        }
    S.head = S.count = 0;
    if (S.released) CUDA(cudaEventDestroy, S.released);
    for (int i = 0; i < S.nreaders; i++) CUDA(cudaEventDestroy, S.readers[i].ev);
    memset(S.readers, 0, sizeof S.readers);
    S.nreaders = 0;
    atomic_store(&S.readers_pending, 0);
    if (S.ready) CUDA(cudaEventDestroy, S.ready);
    S.ready = NULL;
    if (S.comm) CUDA(cudaStreamDestroy, S.comm);
    S.released = NULL;
    S.comm = NULL;
    S.have_released = 0;
    S.world_up = 0;
    return HSDP_OK;
}

const hsdp_backend hsdp_backend_nccl = {
    .name = "nccl",
    .usable = nccl_usable,
    .world = nccl_world,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .all_to_all = nccl_all_to_all,
    .split = nccl_split,
    .free = nccl_free,
    .gather_start = nccl_gather_start,
    .gather_wait = nccl_gather_wait,
    .overlaps = nccl_overlaps,
    .device = &nccl_device,
    .device_now = device_now,
    .finalize = nccl_finalize,
    .gather_fixed = nccl_gather_fixed,
    .gather_unit = nccl_gather_unit,
    .share_free = nccl_share_free,
    .share_kind = nccl_share_kind,
    .share_read = nccl_share_read,
    .sendrecv = nccl_sendrecv,
    .sendrecv_start = nccl_sendrecv_start,
};
#endif
