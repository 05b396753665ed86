/* backend_nccl.c - collectives over NCCL, on GPUs: the backend's table. Its files, each using
 * only the ones above it, are listed in nccl_internal.h: the libraries (nccl_load.c), process
 * state and the collectives in flight (nccl_flight.c), the device (nccl_device.c), the
 * collectives (nccl_collectives.c), agreement (nccl_agreement.c), gathers and requests
 * (nccl_gather.c), communicators (nccl_world.c).
 *
 * Nothing here is linked against CUDA or NCCL: both libraries are opened at run time
 * (hsdp_nccl_load), so one build serves CPU-only and GPU machines, and a machine without a
 * GPU gets a clear error instead of a failed import. No CUDA or NCCL header is needed
 * either: the types, values and function types used are declared in cuda_abi.h (checked
 * against the real headers by csrc/tests/test_cuda_abi.c), so every build has this backend. */
#include "backend.h"
#include "backend_nccl.h"

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
#include "nccl_internal.h"

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
    .device_now = nccl_device_now,
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
