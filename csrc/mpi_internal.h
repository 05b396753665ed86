/* mpi_internal.h - what the files of the MPI backend share. Each file calls only the ones
 * above it in this list (backend_mpi.c, the table, is the only one that names them all):
 *   mpi_common.c    whether MPI has ended, its errors, byte counts, communicators as groups
 *   mpi_watchdog.c  its use of watchdog.h, the timeout that names who is missing
 *   mpi_direct.c    direct reads of fixed chunks and their deferred frees
 *   mpi_raw.c       the collectives themselves, on the calling thread
 *   mpi_agreement.c the tickets beside a unit's data
 *   mpi_worker.c    the calls on the worker thread and the asynchronous slots
 *   mpi_world.c     world start and finalize
 *   backend_mpi.c   the backend table
 * Only compiled with HSDP_HAVE_MPI. */
#ifndef HSDP_MPI_INTERNAL_H
#define HSDP_MPI_INTERNAL_H

#include <mpi.h>
#include <stdint.h>

#include "backend.h"
#include "exec.h"

/* The worker thread every MPI call runs on (mpi_worker.c). MPI is process-wide, so is its
 * worker: created with the first world group, stopped (not freed) before MPI_Finalize; the
 * struct lives until the process ends so that groups freed after finalisation still find it. */
extern hsdp_exec *hsdp_mpi_worker;

/* ---------------------------------------------------------------- mpi_common.c */
int hsdp_mpi_done(void);
#define REQUIRE_LIVE()                                                                        \
    do {                                                                                      \
        if (hsdp_mpi_done()) return hsdp_fail(HSDP_ESTATE, "MPI has already been finalised"); \
    } while (0)
hsdp_status hsdp_mpi_fail(int rc, const char *what);

/* A group's impl: its communicator (first, so the impl reads as an MPI_Comm) and an id no
 * other group of this process ever has, by which deferred frees find their group. */
typedef struct {
    MPI_Comm comm;
    uint64_t id;
    int *world_ranks;      /* owned: the world rank of each rank of the group (for messages) */
} mpi_group;

static inline MPI_Comm comm_of(hsdp_group *g) { return ((mpi_group *)g->impl)->comm; }

/* MPI counts are ints: past INT_MAX bytes send 64-byte blocks (chunks are multiples of 64). */
hsdp_status hsdp_mpi_byte_count(size_t nbytes, int *count, MPI_Datatype *type, int *owned);
/* Wraps a communicator as a group (takes ownership of c). */
hsdp_status hsdp_mpi_wrap(MPI_Comm c, hsdp_group **out);

/* ---------------------------------------------------------------- mpi_raw.c */
/* The collectives themselves, on the calling thread (the worker's, or one holding its lock). */
hsdp_status hsdp_mpi_raw_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_mpi_raw_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root);
hsdp_status hsdp_mpi_raw_barrier(hsdp_group *g);
hsdp_status hsdp_mpi_raw_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_mpi_raw_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                  int source);
hsdp_status hsdp_mpi_raw_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
                                           const hsdp_blocks *r);
hsdp_status hsdp_mpi_raw_split(hsdp_group *g, int color, int key, hsdp_group **out);
void hsdp_mpi_raw_free(hsdp_group *g);

/* ---------------------------------------------------------------- mpi_world.c */
int hsdp_mpi_usable(const char **why);
hsdp_status hsdp_mpi_world(hsdp_group **out, int *we_init);
hsdp_status hsdp_mpi_finalize(void);

/* ---------------------------------------------------------------- mpi_watchdog.c */
/* The MPI side of watchdog.h: a collective over g is watched as hsdp_watch_begin over its
 * world ranks; the thread's expiry is MPI_Abort. */
void hsdp_mpi_watch_begin(const char *op, const hsdp_group *g, size_t nbytes);
void hsdp_mpi_watch_start_thread(void);
/* Collective over the world at its start: where each peer publishes what it waits in. */
void hsdp_mpi_learn_world_peers(void);

/* ---------------------------------------------------------------- mpi_direct.c */
typedef struct direct_share direct_share;
/* After the first (collective) gather of a chunk: exchange, probe, agree. Collective over g. */
hsdp_status hsdp_mpi_direct_setup(hsdp_group *g, void **share, const void *send, size_t nbytes);
hsdp_status hsdp_mpi_direct_gather(hsdp_group *g, const direct_share *d, const void *send, void *recv, size_t nbytes,
                                   hsdp_gather_req *landing);
/* The same for a unit gather whose one conversion is a widening (hsdp_unit_widen_request):
 * every chunk widened as it is read (this rank's straight from `send`, the peers' through a
 * small buffer), so the gathered buffer's bytes of the widened slots are never written. */
hsdp_status hsdp_mpi_direct_widen(hsdp_group *g, const direct_share *d, const void *send, size_t nbytes,
                                  hsdp_gather_req *wr);
/* After a collective over g completed: frees the shards no peer can still read. */
void hsdp_mpi_collective_done(hsdp_group *g);
/* all: every deferred free (a collective over every rank, or the end of MPI); else g's. */
void hsdp_mpi_flush_graves(uint64_t group_id, int all);
void hsdp_mpi_share_free(hsdp_group *g, void *share, void *memory);

/* ---------------------------------------------------------------- mpi_agreement.c */
/* On the worker: a fixed chunk's gather, with its ticket. The first is collective and sets *share.
 * landing (may be NULL): a float8 wire gather whose chunks are decoded as they land
 * (hsdp_unit_landing_request), each once its rank's ticket agrees with this rank's. */
hsdp_status hsdp_mpi_fixed_gather(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                  const char *label, uint64_t ident, hsdp_gather_req *landing);

/* ---------------------------------------------------------------- mpi_worker.c */
hsdp_status hsdp_mpi_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_mpi_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                 const char *label, uint64_t ident);
hsdp_status hsdp_mpi_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root);
hsdp_status hsdp_mpi_barrier(hsdp_group *g);
hsdp_status hsdp_mpi_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_mpi_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *sb, void *recv,
                                       const hsdp_blocks *rb);
hsdp_status hsdp_mpi_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                              int source);
hsdp_status hsdp_mpi_split(hsdp_group *g, int color, int key, hsdp_group **out);
void hsdp_mpi_free(hsdp_group *g);
hsdp_status hsdp_mpi_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_mpi_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                    size_t rbytes, int source);
void hsdp_mpi_gather_wait(hsdp_req *r);
int hsdp_mpi_overlaps(const hsdp_group *g);

#endif
