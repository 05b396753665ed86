/* cuda_dequant.h - the float8 wire's dequantization on the GPU (issue 22), for the NCCL
 * backend: a unit's gathered encodings (device memory) are decoded into its unsharded buffer
 * (device memory) by a kernel enqueued on the gather's own stream, right after the gather, so
 * the event the consumer waits on covers both. The kernel's source (wire_kernel.h) is compiled
 * by NVRTC when loaded and launched through the CUDA driver API; both libraries are opened at
 * run time (nothing is linked, as with libnccl and libcudart). UNTESTED ON A GPU: the tests
 * run it against the fake CUDA library, which runs the same source as C. */
#ifndef HSDP_CUDA_DEQUANT_H
#define HSDP_CUDA_DEQUANT_H

#include "hsdp.h"

/* Opens libnvrtc and the CUDA driver (libcuda.so.1) and compiles the kernel to PTX (no GPU
 * needed for that). On failure nothing stays open and the message names what is missing.
 * Loading twice is a no-op. */
hsdp_status hsdp_wire_cuda_load(const char *nvrtc_path, const char *driver_path);
int hsdp_wire_cuda_loaded(void);
/* The PTX the kernel compiled to (NULL before loading), for tests. */
const char *hsdp_wire_cuda_ptx(void);
/* Loads the kernel into the calling thread's current context (once): a driver that cannot take
 * the PTX says so here, before the caller enqueues the gather the decode would follow. */
hsdp_status hsdp_wire_cuda_prepare(void);
/* Enqueues on `stream` the decode of u's gathered encodings `wire` (shard *
 * wire_chunk_bytes, device) into `full` (layout.total_bytes, device): the same bytes as
 * hsdp_unit_decode on the host. The module is loaded into the thread's current context at
 * first use. The caller orders the stream after the gather and tracks the kernel's end. */
hsdp_status hsdp_wire_cuda_decode(const hsdp_unit *u, const void *wire, void *full, void *stream);

#endif
