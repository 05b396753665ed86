/* nccl_load.c - the NCCL backend's two libraries (nccl_internal.h). Nothing is linked against
 * CUDA or NCCL: both are opened at run time (hsdp_nccl_load), so one build serves CPU-only and
 * GPU machines, and a machine without a GPU gets a clear error instead of a failed import. */
#ifndef HSDP_NO_NCCL
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_internal.h" /* last: it defines the short names api and S */

/* The function table: filled by hsdp_nccl_load, zeroed again when a load fails. */
nccl_api api;

int hsdp_nccl_built(void) { return 1; }
int hsdp_nccl_loaded(void) { return api.loaded; }
int hsdp_nccl_version(void) { return api.version; }

int nccl_resolve(void *lib, const char *name, void *slot) {
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
    hsdp_status failed = HSDP_EUNSUPPORTED; /* not installed; HSDP_ENODEVICE: no GPU */
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
#define REQ_NCCL(name) if (!missing && !nccl_resolve(api.nccl, #name, &api.name)) missing = #name, in = nccl_path;
#define REQ_CUDA(name) if (!missing && !nccl_resolve(api.cudart, #name, &api.name)) missing = #name, in = cudart_path;
#define OPT_NCCL(name) (void)nccl_resolve(api.nccl, #name, &api.name);
    NCCL_REQUIRED(REQ_NCCL)
    CUDA_REQUIRED(REQ_CUDA)
    NCCL_OPTIONAL(OPT_NCCL)
#define OPT_CUDA(name) (void)nccl_resolve(api.cudart, #name, &api.name);
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
            failed = hsdp_fail(HSDP_ENODEVICE, "no usable GPU for the NCCL backend: cudaGetDeviceCount failed with "
                               "CUDA error %d (%s); use backend 'mpi' for CPU ranks", (int)ce,
                               api.cudaGetErrorString(ce));
        else
            failed = hsdp_fail(HSDP_ENODEVICE, "no usable GPU for the NCCL backend: no CUDA device is visible "
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
        int host_reads = nccl_resolve(api.cudart, "hsdp_cuda_device_memory_is_host", &host_memory) && host_memory() == 1;
        api.host_view = host_reads;
    }
    api.loaded = 1;
    return HSDP_OK;
fail:
    if (api.nccl) dlclose(api.nccl);
    if (api.cudart) dlclose(api.cudart);
    memset(&api, 0, sizeof api); /* nothing is left half loaded */
    return failed;
}
#endif
