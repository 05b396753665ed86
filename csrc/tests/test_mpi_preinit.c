/* test_mpi_preinit.c - hsdp beside another MPI user (mpi4py, say) that initialised MPI
 * first: hsdp must not initialise or finalise it, must use its worker thread only when the
 * thread level allows calls from it (SERIALIZED or more), and must still gather correctly
 * either way. Run under mpiexec with "funneled" or "serialized". */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "check.h"

int main(int argc, char **argv) {
    int want = argc > 1 && strcmp(argv[1], "funneled") == 0 ? MPI_THREAD_FUNNELED : MPI_THREAD_SERIALIZED;
    int provided = 0;
    MPI_Init_thread(&argc, &argv, want, &provided); /* the other library */
    hsdp_group *world = NULL;
    int we_init = 1;
    CHECK(hsdp_backend_world("mpi", &world, &we_init) == HSDP_OK);
    CHECK(we_init == 0); /* not ours: hsdp must not finalise it */
    CHECK(hsdp_group_overlaps(world) == (provided >= MPI_THREAD_SERIALIZED));

    hsdp_stats st;
    hsdp_stats_init(&st);
    size_t numels[] = {257, 3};
    hsdp_dtype dts[] = {HSDP_F32, HSDP_BF16}, cts[] = {HSDP_F32, HSDP_F32};
    hsdp_unit u;
    CHECK(hsdp_unit_init(&u, numels, dts, cts, 2, world, &st) == HSDP_OK);
    float src[257];
    for (int k = 0; k < 257; k++) src[k] = (float)k;
    for (size_t i = 0; i < 2; i++) CHECK(hsdp_unit_write(&u, i, 0, numels[i], src, HSDP_F32) == HSDP_OK);
    void *full = hsdp_buffer_alloc(&st, u.layout.total_bytes); /* owned here */
    void *wide = hsdp_buffer_alloc(&st, u.widened_bytes);       /* owned here */
    hsdp_gather_req req;
    CHECK(hsdp_unit_gather_start(&u, full, wide, &req) == HSDP_OK); /* inline without a worker */
    CHECK(hsdp_unit_gather_wait(&u, &req) == HSDP_OK);
    CHECK(memcmp((char *)full + u.layout.slots[0].offset, src, sizeof src) == 0);
    CHECK(memcmp((char *)wide + u.widen_offset[1], src, 3 * sizeof(float)) == 0);
    CHECK(hsdp_barrier(world) == HSDP_OK);
    hsdp_buffer_free(&st, full, u.layout.total_bytes);
    hsdp_buffer_free(&st, wide, u.widened_bytes);
    hsdp_unit_free(&u);
    hsdp_group_free(world);

    int finalized = 0;
    MPI_Finalized(&finalized);
    CHECK(finalized == 0); /* still the other library's to finalise */
    int rc = check_report();
    MPI_Finalize();
    return rc;
}
