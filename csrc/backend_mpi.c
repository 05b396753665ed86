/* backend_mpi.c - the MPI backend for CPU ranks on one host or many. Compiled only when an
 * MPI implementation was found at build time (HSDP_HAVE_MPI); otherwise the backend reports
 * itself unusable with what to install. hsdp initialises MPI only when nobody has (mpi4py
 * may have), at MPI_THREAD_SERIALIZED: every MPI call runs on one worker thread (exec.c), so
 * one thread calls MPI at a time. That worker is how this backend implements its
 * asynchronous slots. Every communicator returns errors instead of aborting, so a failed
 * collective becomes a Python exception. */
#if defined(HSDP_HAVE_MPI)
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"
#include "exec.h"

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

static MPI_Comm comm_of(hsdp_group *g) { return *(MPI_Comm *)g->impl; }

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

static hsdp_status raw_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    const void *s = send == (char *)recv + (size_t)g->rank * nbytes ? MPI_IN_PLACE : send;
    int rc = MPI_Allgather(s, count, type, recv, count, type, comm_of(g));
    if (owned) MPI_Type_free(&type);
    return rc == MPI_SUCCESS ? HSDP_OK : mpi_fail(rc, "MPI_Allgather");
}

static hsdp_status raw_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    REQUIRE_LIVE();
    if (root < 0 || root >= g->size)
        return hsdp_fail(HSDP_EINVAL, "broadcast root %d is outside a group of %d", root, g->size);
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    int rc = MPI_Bcast(buf, count, type, root, comm_of(g));
    if (owned) MPI_Type_free(&type);
    return rc == MPI_SUCCESS ? HSDP_OK : mpi_fail(rc, "MPI_Bcast");
}

static hsdp_status raw_barrier(hsdp_group *g) {
    REQUIRE_LIVE();
    int rc = MPI_Barrier(comm_of(g));
    return rc == MPI_SUCCESS ? HSDP_OK : mpi_fail(rc, "MPI_Barrier");
}

static hsdp_status raw_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    int rc = MPI_Alltoall(send, count, type, recv, count, type, comm_of(g));
    if (owned) MPI_Type_free(&type);
    return rc == MPI_SUCCESS ? HSDP_OK : mpi_fail(rc, "MPI_Alltoall");
}

static hsdp_status wrap(MPI_Comm c, hsdp_group **out);

static hsdp_status raw_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    REQUIRE_LIVE();
    MPI_Comm c;
    int rc = MPI_Comm_split(comm_of(g), color, key, &c);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_split");
    return wrap(c, out);
}

static void raw_free(hsdp_group *g) {
    /* After MPI_Finalize a communicator may no longer be freed; the process is ending. */
    if (!mpi_done()) MPI_Comm_free((MPI_Comm *)g->impl);
    free(g->impl);
    free(g);
}


/* Takes ownership of c. */
static hsdp_status wrap(MPI_Comm c, hsdp_group **out) {
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    hsdp_group *g = malloc(sizeof *g);      /* owned by the caller; hsdp_group_free */
    MPI_Comm *h = malloc(sizeof *h);        /* owned by g; mpi_free */
    if (!g || !h) {
        free(g);
        free(h);
        MPI_Comm_free(&c);
        return hsdp_fail(HSDP_ENOMEM, "could not allocate a process group");
    }
    *h = c;
    *g = (hsdp_group){.backend = &hsdp_backend_mpi, .impl = h};
    MPI_Comm_rank(c, &g->rank);
    MPI_Comm_size(c, &g->size);
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
} call_args;

static hsdp_status do_all_gather(void *p) {
    call_args *a = p;
    return raw_all_gather(a->g, a->send, a->recv, a->nbytes);
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
    hsdp_status st = raw_all_gather(t->r->g, t->send, t->recv, t->nbytes);
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

static void mpi_gather_wait(hsdp_req *r) {
    gather_task *t = (gather_task *)(void *)r->state;
    r->status = hsdp_task_wait(mpi_worker, &t->task);
    if (r->status != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", t->task.err);
    r->submit_ns = t->task.submit_ns;
    r->start_ns = t->task.start_ns;
    r->end_ns = t->task.end_ns;
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
    return hsdp_exec_run(mpi_worker, dup_world, out);
}

static hsdp_status mpi_finalize(void) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized || mpi_done()) return HSDP_OK;
    /* MPI_Finalize belongs on the thread that initialised MPI (this one); the worker must be
     * idle for good first. */
    hsdp_exec_stop(mpi_worker);
    int rc = MPI_Finalize();
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
    .split = mpi_split,
    .free = mpi_free,
    .gather_start = mpi_gather_start,
    .gather_wait = mpi_gather_wait,
    .overlaps = mpi_overlaps,
    .finalize = mpi_finalize,
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
