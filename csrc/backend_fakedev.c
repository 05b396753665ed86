/* backend_fakedev.c - a test-only backend whose device is host memory that claims to be a
 * device: it shows that a backend is one file plus one registry line, and runs the device
 * paths (the pool's device buffers, DLPack export, device addresses) on machines with no GPU.
 *
 * Collectives are the MPI backend's (each slot calls MPI's, and every group made here is
 * marked as this backend's), so it runs multi-rank under mpiexec or hsdp.launch. Its device
 * allocates its own buffers, counted apart from the host's, poisoned when new and freed, so a
 * read before a gather or after a free shows in the numbers; they are exported over DLPack as
 * kDLCPU (NumPy and torch read them on the CPU) and have no streams: a buffer's bytes have
 * landed when its gather's wait returns.
 *
 * It is never chosen by accident: usable only with HSDP_FAKE_DEVICE=1 in the environment. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

/* ---------------------------------------------------------------- the device */
static atomic_size_t live_bytes; /* this device's buffers, apart from the host's accounting */

enum { POISON_NEW = 0xA5, POISON_FREED = 0x5A };

static void *fakedev_alloc(size_t nbytes) {
    size_t rounded = (nbytes + 63) / 64 * 64; /* aligned_alloc wants a multiple of the alignment */
    void *p = aligned_alloc(64, rounded);     /* owned by the caller until fakedev_free */
    if (!p) return NULL;
    memset(p, POISON_NEW, rounded);
    atomic_fetch_add(&live_bytes, nbytes);
    return p;
}

static void fakedev_free(void *p, size_t nbytes) {
    if (!p) return;
    memset(p, POISON_FREED, nbytes);
    atomic_fetch_sub(&live_bytes, nbytes);
    free(p);
}

static size_t fakedev_live_bytes(void) { return atomic_load(&live_bytes); }

static const hsdp_device_i fakedev_device = {
    .name = "fakedev",
    .framework = "cpu", /* host memory: frameworks view it as CPU tensors */
    .dlpack_type = 1,   /* kDLCPU */
    .alloc = fakedev_alloc,
    .free = fakedev_free,
    .live_bytes = fakedev_live_bytes,
};

/* ---------------------------------------------------------------- collectives: MPI's */
#define MPI hsdp_backend_mpi

static int fakedev_usable(const char **why) {
    if (!hsdp_env_flag("HSDP_FAKE_DEVICE", 0)) {
        *why = "the 'fakedev' backend is for hsdp's own tests (host memory that claims to be a device, over MPI); "
               "set HSDP_FAKE_DEVICE=1 to use it";
        return 0;
    }
    return MPI.usable(why);
}

/* A group MPI made becomes this backend's, so that every later call dispatches here (read
 * *out only after MPI's call returned: a call's arguments have no order). */
static hsdp_status mine(hsdp_status st, hsdp_group **out) {
    if (st == HSDP_OK && *out) (*out)->backend = &hsdp_backend_fakedev;
    return st;
}

static hsdp_status fakedev_world(hsdp_group **out, int *we_init) { return mine(MPI.world(out, we_init), out); }
static hsdp_status fakedev_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    return mine(MPI.split(g, color, key, out), out);
}
static hsdp_status fakedev_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    return MPI.all_gather(g, send, recv, nbytes);
}
static hsdp_status fakedev_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    return MPI.broadcast(g, buf, nbytes, root);
}
static hsdp_status fakedev_barrier(hsdp_group *g) { return MPI.barrier(g); }
static hsdp_status fakedev_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    return MPI.all_to_all(g, send, recv, nbytes);
}
static hsdp_status fakedev_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
                                             const hsdp_blocks *r) {
    return MPI.all_to_all_blocks(g, send, s, recv, r);
}
static void fakedev_free_group(hsdp_group *g) { MPI.free(g); }
static hsdp_status fakedev_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes) {
    return MPI.gather_start(r, send, recv, nbytes);
}
static void fakedev_gather_wait(hsdp_req *r) { MPI.gather_wait(r); }
static int fakedev_overlaps(const hsdp_group *g) { return MPI.overlaps(g); }
static hsdp_status fakedev_finalize(void) { return MPI.finalize(); }
static hsdp_status fakedev_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                       const char *label, uint64_t ident) {
    return MPI.gather_unit(g, share, send, recv, nbytes, label, ident);
}
static void fakedev_share_free(hsdp_group *g, void *share, void *memory) { MPI.share_free(g, share, memory); }
static hsdp_status fakedev_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv,
                                    size_t rbytes, int source) {
    return MPI.sendrecv(g, send, sbytes, dest, recv, rbytes, source);
}
static hsdp_status fakedev_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                          size_t rbytes, int source) {
    return MPI.sendrecv_start(r, send, sbytes, dest, recv, rbytes, source);
}

const hsdp_backend hsdp_backend_fakedev = {
    .name = "fakedev",
    .usable = fakedev_usable,
    .world = fakedev_world,
    .all_gather = fakedev_all_gather,
    .broadcast = fakedev_broadcast,
    .barrier = fakedev_barrier,
    .all_to_all = fakedev_all_to_all,
    .all_to_all_blocks = fakedev_all_to_all_blocks,
    .split = fakedev_split,
    .free = fakedev_free_group,
    .gather_start = fakedev_gather_start,
    .gather_wait = fakedev_gather_wait,
    .overlaps = fakedev_overlaps,
    .device = &fakedev_device,
    .finalize = fakedev_finalize,
    .gather_unit = fakedev_gather_unit,
    .share_free = fakedev_share_free,
    .sendrecv = fakedev_sendrecv,
    .sendrecv_start = fakedev_sendrecv_start,
};
