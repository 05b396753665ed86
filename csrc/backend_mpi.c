/* backend_mpi.c - the MPI backend for CPU ranks on one host or many. Compiled only when an
 * MPI implementation was found at build time (HSDP_HAVE_MPI); otherwise the backend reports
 * itself unusable with what to install. hsdp initialises MPI only when nobody has (mpi4py
 * may have), at MPI_THREAD_SERIALIZED: every MPI call runs on one worker thread (exec.c), so
 * one thread calls MPI at a time. That worker is how this backend implements its
 * asynchronous slots. Every communicator returns errors instead of aborting, so a failed
 * collective becomes a Python exception. */
#if defined(HSDP_HAVE_MPI)
#include "mpi_internal.h"

const hsdp_backend hsdp_backend_mpi = {
    .name = "mpi",
    .usable = hsdp_mpi_usable,
    .world = hsdp_mpi_world,
    .all_gather = hsdp_mpi_all_gather,
    .broadcast = hsdp_mpi_broadcast,
    .barrier = hsdp_mpi_barrier,
    .all_to_all = hsdp_mpi_all_to_all,
    .all_to_all_blocks = hsdp_mpi_all_to_all_blocks,
    .split = hsdp_mpi_split,
    .free = hsdp_mpi_free,
    .gather_start = hsdp_mpi_gather_start,
    .gather_wait = hsdp_mpi_gather_wait,
    .overlaps = hsdp_mpi_overlaps,
    .finalize = hsdp_mpi_finalize,
    .gather_unit = hsdp_mpi_gather_unit,
    .share_free = hsdp_mpi_share_free,
    .sendrecv = hsdp_mpi_sendrecv,
    .sendrecv_start = hsdp_mpi_sendrecv_start,
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
