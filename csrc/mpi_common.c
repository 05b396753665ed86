/* mpi_common.c - what every file of the MPI backend uses (mpi_internal.h): whether MPI has
 * ended, an MPI error as hsdp's, byte counts past INT_MAX, and a communicator wrapped as a
 * group. It calls no other file of the backend. */
#if defined(HSDP_HAVE_MPI)
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include "mpi_internal.h"

int hsdp_mpi_done(void) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    return finalized;
}

hsdp_status hsdp_mpi_fail(int rc, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
    msg[len] = '\0';
    return hsdp_fail(HSDP_ECOMM, "%s failed: %s", what, len ? msg : "unknown MPI error");
}

/* MPI counts are ints: past INT_MAX bytes send 64-byte blocks (chunks are multiples of 64). */
hsdp_status hsdp_mpi_byte_count(size_t nbytes, int *count, MPI_Datatype *type, int *owned) {
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
    if (rc != MPI_SUCCESS) return hsdp_mpi_fail(rc, "MPI_Type_contiguous");
    *owned = 1;
    *count = (int)(nbytes / HSDP_ALIGN);
    return HSDP_OK;
}

/* Takes ownership of c. */
hsdp_status hsdp_mpi_wrap(MPI_Comm c, hsdp_group **out) {
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
        } else { /* never filled: no ranks rather than garbage in a timeout's message */
            free(h->world_ranks);
            h->world_ranks = NULL;
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
#endif
