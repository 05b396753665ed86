/* mpi_raw.c - the MPI backend's collectives themselves, on the calling thread: the worker's
 * (mpi_worker.c), or one holding its lock; and a group's communicator freed (mpi_internal.h).
 * Each is watched (mpi_watchdog.c), and a finished one frees the shards no peer can still
 * read (mpi_direct.c). */
#if defined(HSDP_HAVE_MPI)
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include "mpi_internal.h"
#include "watchdog.h"

hsdp_status hsdp_mpi_raw_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = hsdp_mpi_byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    const void *s = send == (char *)recv + (size_t)g->rank * nbytes ? MPI_IN_PLACE : send;
    hsdp_mpi_watch_begin("MPI_Allgather", g, nbytes * (size_t)g->size);
    int rc = MPI_Allgather(s, count, type, recv, count, type, comm_of(g));
    hsdp_watch_end();
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Allgather");
    hsdp_mpi_collective_done(g);
    return HSDP_OK;
}

hsdp_status hsdp_mpi_raw_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    REQUIRE_LIVE();
    if (root < 0 || root >= g->size)
        return hsdp_fail(HSDP_EINVAL, "broadcast root %d is outside a group of %d", root, g->size);
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = hsdp_mpi_byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    hsdp_mpi_watch_begin("MPI_Bcast", g, nbytes);
    int rc = MPI_Bcast(buf, count, type, root, comm_of(g));
    hsdp_watch_end();
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Bcast");
    /* no collective_done: a broadcast's root may finish before the others arrive */
    return HSDP_OK;
}

hsdp_status hsdp_mpi_raw_barrier(hsdp_group *g) {
    REQUIRE_LIVE();
    hsdp_mpi_watch_begin("MPI_Barrier", g, 0);
    int rc = MPI_Barrier(comm_of(g));
    hsdp_watch_end();
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Barrier");
    hsdp_mpi_collective_done(g);
    return HSDP_OK;
}

hsdp_status hsdp_mpi_raw_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    REQUIRE_LIVE();
    int count, owned;
    MPI_Datatype type;
    hsdp_status st = hsdp_mpi_byte_count(nbytes, &count, &type, &owned);
    if (st != HSDP_OK) return st;
    hsdp_mpi_watch_begin("MPI_Alltoall", g, nbytes * (size_t)g->size);
    int rc = MPI_Alltoall(send, count, type, recv, count, type, comm_of(g));
    hsdp_watch_end();
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Alltoall");
    hsdp_mpi_collective_done(g);
    return HSDP_OK;
}

/* The tag of ring attention's messages: collectives have a context of their own, and nothing
 * else here sends point to point on a group's communicator. */
enum { SENDRECV_TAG = 0x4853 };

hsdp_status hsdp_mpi_raw_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                int source) {
    REQUIRE_LIVE();
    int scount, rcount, sowned = 0, rowned = 0;
    MPI_Datatype stype, rtype;
    hsdp_status st = hsdp_mpi_byte_count(sbytes, &scount, &stype, &sowned);
    if (st == HSDP_OK) st = hsdp_mpi_byte_count(rbytes, &rcount, &rtype, &rowned);
    if (st != HSDP_OK) {
        if (sowned) MPI_Type_free(&stype);
        return st;
    }
    MPI_Status status;
    hsdp_mpi_watch_begin("MPI_Sendrecv", g, sbytes + rbytes);
    int rc = MPI_Sendrecv(send, scount, stype, dest, SENDRECV_TAG, recv, rcount, rtype, source, SENDRECV_TAG,
                          comm_of(g), &status);
    hsdp_watch_end();
    int got = rcount;
    if (rc == MPI_SUCCESS) MPI_Get_count(&status, rtype, &got);
    if (sowned) MPI_Type_free(&stype);
    if (rowned) MPI_Type_free(&rtype);
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Sendrecv");
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
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "building an all-to-all's datatype");
    *out = t;
    return HSDP_OK;
}

/* MPI packs the strided blocks itself, inside the transfer: no copy before or after it. */
hsdp_status hsdp_mpi_raw_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *s, void *recv,
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
    hsdp_mpi_watch_begin("MPI_Alltoall", g, hsdp_blocks_bytes(s, g->size, &span) * (size_t)g->size);
    int rc = MPI_Alltoall(send, 1, st_, recv, 1, rt, comm_of(g));
    hsdp_watch_end();
    MPI_Type_free(&st_);
    MPI_Type_free(&rt);
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Alltoall");
    hsdp_mpi_collective_done(g);
    return HSDP_OK;
}

hsdp_status hsdp_mpi_raw_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    REQUIRE_LIVE();
    MPI_Comm c;
    hsdp_mpi_watch_begin("MPI_Comm_split", g, 0);
    int rc = MPI_Comm_split(comm_of(g), color, key, &c);
    hsdp_watch_end();
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Comm_split");
    return hsdp_mpi_wrap(c, out);
}

void hsdp_mpi_raw_free(hsdp_group *g) {
    /* After MPI_Finalize a communicator may no longer be freed; the process is ending. */
    if (!hsdp_mpi_done()) MPI_Comm_free(&((mpi_group *)g->impl)->comm);
    free(((mpi_group *)g->impl)->world_ranks);
    free(g->impl);
    free(g);
}
#endif
