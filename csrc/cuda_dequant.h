/* cuda_dequant.h - the float8 wire's dequantization on the GPU (issue 22), for the NCCL
 * backend: a unit's gathered encodings (device memory) are decoded into its unsharded buffer
 * (device memory) by a kernel enqueued on the gather's own stream, right after the gather, so
 * the event the consumer waits on covers both. The kernel's source (wire_kernel.h) is compiled
 * by NVRTC for the device at first use and launched through the CUDA driver API; both
 * libraries are opened at run time (nothing is linked, as with libnccl and libcudart).
 * Run on one H200 (bench/gpu_check.py wire_fp8: byte for byte the host decode); the tests run
 * it against the fake CUDA library, which runs the same source as C, and compile it with the
 * real NVRTC. */
#ifndef HSDP_CUDA_DEQUANT_H
#define HSDP_CUDA_DEQUANT_H

#include "hsdp.h"

/* Opens libnvrtc and the CUDA driver (libcuda.so.1), finds the functions used and reads the
 * architectures this NVRTC compiles for (no GPU needed). Nothing is compiled yet: the kernel
 * is compiled for the device at its first use in a context (hsdp_wire_cuda_prepare). On
 * failure nothing stays open and the message names what is missing. Loading twice is a no-op. */
hsdp_status hsdp_wire_cuda_load(const char *nvrtc_path, const char *driver_path);
int hsdp_wire_cuda_loaded(void);
/* The kernel compiled for a device of compute capability `cc` (major * 10 + minor, as
 * nvrtcGetSupportedArchs numbers them), as the first use compiles it: a CUBIN for sm_<cc>, or
 * for the newest sm_<major><m> with m <= minor (a cubin runs on later minors of its major);
 * where this NVRTC knows neither (a device newer than it), PTX for the newest compute_XY below
 * cc, which the driver compiles (JIT) for the device. No GPU is needed; the tests use it. */
typedef struct {
    char *data;  /* the image: CUBIN bytes, or PTX text (NUL-terminated); malloc'd, owned by the caller */
    size_t size; /* its bytes (the PTX's terminating NUL included) */
    int cubin;   /* 1: a CUBIN for sm_<arch>; 0: PTX for compute_<arch> */
    int arch;    /* e.g. 90 */
} hsdp_wire_cuda_blob;
hsdp_status hsdp_wire_cuda_compile(int cc, hsdp_wire_cuda_blob *out);
/* What the kernel was loaded as, once loaded into a context: "cubin sm_90" or "ptx compute_90"
 * (NULL before), for tests and reports. */
const char *hsdp_wire_cuda_image(void);
/* Loads the kernel into the calling thread's current context (once per process: the module,
 * compiled for that context's device, serves the process's one device): the device's compute
 * capability chooses the image (hsdp_wire_cuda_compile), and a driver that cannot take it says
 * so here, before the caller enqueues the gather the decode would follow. */
hsdp_status hsdp_wire_cuda_prepare(void);
/* Enqueues on `stream` the decode of u's gathered encodings `wire` (shard *
 * wire_chunk_bytes, device) into `full` (layout.total_bytes, device): the same bytes as
 * hsdp_unit_decode on the host. The module is loaded into the thread's current context at
 * first use. The caller orders the stream after the gather and tracks the kernel's end. */
hsdp_status hsdp_wire_cuda_decode(const hsdp_unit *u, const void *wire, void *full, void *stream);

#endif
