/* test_cuda_abi.c - csrc/cuda_abi.h against the real nccl.h and cuda_runtime_api.h (and cuda.h
 * and nvrtc.h, for the float8 wire's kernel, where the installation has them).
 *
 * The backend is compiled against cuda_abi.h alone; this translation unit includes both it
 * and the real headers, and asserts at compile time that every value, struct layout and
 * function type the backend uses is the real one. It compiling is the test; running it
 * prints the header versions it was checked against. `make ctest` builds it when the
 * headers are found (csrc/cuda_headers.py: torch's nvidia wheels, HSDP_CUDA_HOME or
 * /usr/local/cuda) and says so when they are not. */
#include <stddef.h>
#include <stdio.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda_abi.h"

#define SAME(a, b) _Static_assert((long long)(a) == (long long)(b), #a " is " #b)
#define SAME_TYPE(a, b) _Static_assert(__builtin_types_compatible_p(a, b), #a " and " #b " are the same type")
#define SAME_FIELD(ours, real, field)                                                                \
    _Static_assert(offsetof(ours, field) == offsetof(real, field), #ours "." #field " is where " #real "'s is"); \
    _Static_assert(sizeof(((ours *)0)->field) == sizeof(((real *)0)->field),                                  \
                   #ours "." #field " is as wide as " #real "'s")
/* the real prototype has exactly our function-pointer type */
#define SAME_FN(name) SAME_TYPE(__typeof__(&name), hsdp_##name##_fn)

/* ---------------------------------------------------------------- CUDA runtime */
SAME_TYPE(cudaError_t, hsdp_cudaError_t);
SAME_TYPE(enum cudaMemcpyKind, hsdp_cudaMemcpyKind);
SAME_TYPE(enum cudaMemoryType, hsdp_cudaMemoryType);
SAME_TYPE(cudaStream_t, hsdp_cudaStream_t);
SAME_TYPE(cudaEvent_t, hsdp_cudaEvent_t);
SAME(cudaSuccess, hsdp_cudaSuccess);
SAME(cudaErrorInvalidValue, hsdp_cudaErrorInvalidValue);
SAME(cudaErrorMemoryAllocation, hsdp_cudaErrorMemoryAllocation);
SAME(cudaErrorInvalidDevice, hsdp_cudaErrorInvalidDevice);
SAME(cudaErrorNotReady, hsdp_cudaErrorNotReady);
SAME(cudaErrorStreamCaptureUnsupported, hsdp_cudaErrorStreamCaptureUnsupported);
SAME(cudaErrorStreamCaptureWrongThread, hsdp_cudaErrorStreamCaptureWrongThread);
SAME(cudaStreamCaptureStatusNone, hsdp_cudaStreamCaptureStatusNone);
SAME(cudaMemcpyDefault, hsdp_cudaMemcpyDefault);
SAME(cudaMemoryTypeUnregistered, hsdp_cudaMemoryTypeUnregistered);
SAME(cudaMemoryTypeHost, hsdp_cudaMemoryTypeHost);
SAME(cudaMemoryTypeDevice, hsdp_cudaMemoryTypeDevice);
SAME(cudaMemoryTypeManaged, hsdp_cudaMemoryTypeManaged);
SAME(cudaStreamNonBlocking, hsdp_cudaStreamNonBlocking);
SAME(cudaEventDisableTiming, hsdp_cudaEventDisableTiming);
SAME(cudaHostAllocDefault, hsdp_cudaHostAllocDefault);

/* the runtime writes its whole struct: ours holds it, with the fields where the runtime puts them */
SAME_FIELD(hsdp_cudaPointerAttributes, struct cudaPointerAttributes, type);
SAME_FIELD(hsdp_cudaPointerAttributes, struct cudaPointerAttributes, device);
SAME_FIELD(hsdp_cudaPointerAttributes, struct cudaPointerAttributes, devicePointer);
SAME_FIELD(hsdp_cudaPointerAttributes, struct cudaPointerAttributes, hostPointer);
_Static_assert(sizeof(hsdp_cudaPointerAttributes) >= sizeof(struct cudaPointerAttributes),
               "hsdp_cudaPointerAttributes holds all the runtime writes");
_Static_assert(_Alignof(hsdp_cudaPointerAttributes) >= _Alignof(struct cudaPointerAttributes),
               "hsdp_cudaPointerAttributes is aligned as the runtime's");

/* The runtime header renames some entry points to per-thread-stream variants when
 * CUDA_API_PER_THREAD_DEFAULT_STREAM is set; the backend resolves the plain names. */
#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
#error "check against the default-stream (plain) entry points: unset CUDA_API_PER_THREAD_DEFAULT_STREAM"
#endif
SAME_FN(cudaGetDeviceCount);
SAME_FN(cudaSetDevice);
SAME_FN(cudaMalloc);
SAME_FN(cudaFree);
SAME_FN(cudaMemcpyAsync);
SAME_FN(cudaStreamCreateWithPriority);
SAME_FN(cudaDeviceGetStreamPriorityRange);
SAME_FN(cudaStreamDestroy);
SAME_FN(cudaStreamWaitEvent);
SAME_FN(cudaStreamSynchronize);
SAME_FN(cudaEventCreateWithFlags);
SAME_FN(cudaEventDestroy);
SAME_FN(cudaEventRecord);
SAME_FN(cudaEventQuery);
SAME_FN(cudaGetErrorString);
SAME_FN(cudaGetLastError);
SAME_FN(cudaHostAlloc);
SAME_FN(cudaFreeHost);
SAME_FN(cudaStreamIsCapturing);
SAME_FN(cudaMemGetInfo);
/* with the real struct in place of ours, the prototype is the real one ... */
HSDP_CUDA_STRUCT_FNS(real_, struct cudaPointerAttributes)
SAME_TYPE(__typeof__(&cudaPointerGetAttributes), real_cudaPointerGetAttributes_fn);
/* ... and ours differs from it in that struct only */
_Static_assert(!__builtin_types_compatible_p(__typeof__(&cudaPointerGetAttributes), hsdp_cudaPointerGetAttributes_fn),
               "the check above tests something");

/* ---------------------------------------------------------------- NCCL */
SAME_TYPE(ncclResult_t, hsdp_ncclResult_t);
SAME_TYPE(ncclDataType_t, hsdp_ncclDataType_t);
SAME_TYPE(ncclRedOp_t, hsdp_ncclRedOp_t);
SAME_TYPE(ncclComm_t, hsdp_ncclComm_t);
SAME(ncclSuccess, hsdp_ncclSuccess);
SAME(ncclSystemError, hsdp_ncclSystemError);
SAME(ncclInvalidArgument, hsdp_ncclInvalidArgument);
SAME(ncclInvalidUsage, hsdp_ncclInvalidUsage);
SAME(ncclInProgress, hsdp_ncclInProgress);
SAME(ncclUint8, hsdp_ncclUint8);
SAME(ncclFloat32, hsdp_ncclFloat32);
SAME(ncclSum, hsdp_ncclSum);

SAME(NCCL_UNIQUE_ID_BYTES, HSDP_NCCL_UNIQUE_ID_BYTES);
SAME(sizeof(ncclUniqueId), sizeof(hsdp_ncclUniqueId));
SAME(_Alignof(ncclUniqueId), _Alignof(hsdp_ncclUniqueId));
SAME_FIELD(hsdp_ncclUniqueId, ncclUniqueId, internal);

/* our config is a prefix of the real one: each field where NCCL reads it */
#ifdef NCCL_API_MAGIC /* before 2.29 the initializer spells it out; main() compares the two */
SAME(NCCL_API_MAGIC, HSDP_NCCL_API_MAGIC);
#endif
SAME(NCCL_CONFIG_UNDEF_INT, HSDP_NCCL_CONFIG_UNDEF_INT);
SAME(NCCL_VERSION(2, 18, 0), HSDP_NCCL_CONFIG_VERSION);
_Static_assert(NCCL_VERSION_CODE >= HSDP_NCCL_CONFIG_VERSION, "the real header has every field we declare");
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, size);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, magic);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, version);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, blocking);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, cgaClusterSize);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, minCTAs);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, maxCTAs);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, netName);
SAME_FIELD(hsdp_ncclConfig_t, ncclConfig_t, splitShare);
_Static_assert(sizeof(hsdp_ncclConfig_t) <= sizeof(ncclConfig_t), "our config is a prefix of the real one");

SAME_FN(ncclGetVersion);
SAME_FN(ncclAllGather);
SAME_FN(ncclBroadcast);
SAME_FN(ncclAllReduce);
SAME_FN(ncclAlltoAll);
SAME_FN(ncclSend);
SAME_FN(ncclRecv);
/* nccl.h declares these two with `()`, which C11 reads as "unspecified parameters": only the
 * return type is compared for them */
SAME_FN(ncclGroupStart);
SAME_FN(ncclGroupEnd);
SAME_FN(ncclCommGetAsyncError);
SAME_FN(ncclCommAbort);
SAME_FN(ncclCommUserRank);
SAME_FN(ncclCommCount);
SAME_FN(ncclGetErrorString);
SAME_FN(ncclGetLastError);
HSDP_NCCL_STRUCT_FNS(real_, ncclUniqueId, ncclConfig_t)
SAME_TYPE(__typeof__(&ncclGetUniqueId), real_ncclGetUniqueId_fn);
SAME_TYPE(__typeof__(&ncclCommInitRank), real_ncclCommInitRank_fn);
SAME_TYPE(__typeof__(&ncclCommInitRankConfig), real_ncclCommInitRankConfig_fn);
SAME_TYPE(__typeof__(&ncclCommSplit), real_ncclCommSplit_fn);
_Static_assert(!__builtin_types_compatible_p(__typeof__(&ncclCommSplit), hsdp_ncclCommSplit_fn),
               "the checks above test something");

/* ---------------------------------------------------------------- CUDA driver and NVRTC
 * (the float8 wire's kernel, cuda_dequant.c); checked where the installation has the headers */
#if __has_include(<cuda.h>)
#include <cuda.h>
#define HAVE_CUDA_H 1
SAME_TYPE(CUresult, hsdp_CUresult);
SAME_TYPE(CUmodule, hsdp_CUmodule);
SAME_TYPE(CUfunction, hsdp_CUfunction);
SAME_TYPE(CUstream, hsdp_cudaStream_t);
SAME_TYPE(CUdevice, hsdp_CUdevice);
SAME_TYPE(CUdevice_attribute, hsdp_CUdevice_attribute);
SAME(CUDA_SUCCESS, hsdp_CUDA_SUCCESS);
SAME(CUDA_ERROR_NO_BINARY_FOR_GPU, hsdp_CUDA_ERROR_NO_BINARY_FOR_GPU);
SAME(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, hsdp_CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
SAME(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
SAME(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
SAME_FN(cuInit);
SAME_FN(cuCtxGetDevice);
SAME_FN(cuDeviceGetAttribute);
SAME_FN(cuModuleLoadData);
SAME_FN(cuModuleGetFunction);
SAME_FN(cuLaunchKernel);
SAME_FN(cuGetErrorString);
#else
#define HAVE_CUDA_H 0
#endif
#if __has_include(<nvrtc.h>)
#include <nvrtc.h>
#define HAVE_NVRTC_H 1
SAME_TYPE(nvrtcResult, hsdp_nvrtcResult);
SAME_TYPE(nvrtcProgram, hsdp_nvrtcProgram);
SAME(NVRTC_SUCCESS, hsdp_NVRTC_SUCCESS);
SAME_FN(nvrtcCreateProgram);
SAME_FN(nvrtcCompileProgram);
SAME_FN(nvrtcGetPTXSize);
SAME_FN(nvrtcGetPTX);
SAME_FN(nvrtcGetCUBINSize);
SAME_FN(nvrtcGetCUBIN);
SAME_FN(nvrtcGetNumSupportedArchs);
SAME_FN(nvrtcGetSupportedArchs);
SAME_FN(nvrtcGetProgramLogSize);
SAME_FN(nvrtcGetProgramLog);
SAME_FN(nvrtcDestroyProgram);
SAME_FN(nvrtcGetErrorString);
#else
#define HAVE_NVRTC_H 0
#endif

int main(void) {
    /* what NCCL_CONFIG_INITIALIZER gives the fields we declare, ours gives too */
    ncclConfig_t real = NCCL_CONFIG_INITIALIZER;
    hsdp_ncclConfig_t ours = HSDP_NCCL_CONFIG_INITIALIZER;
    int ok = ours.magic == real.magic && ours.blocking == real.blocking && ours.cgaClusterSize == real.cgaClusterSize &&
             ours.minCTAs == real.minCTAs && ours.maxCTAs == real.maxCTAs && ours.netName == real.netName &&
             ours.splitShare == real.splitShare && ours.size == offsetof(ncclConfig_t, splitShare) + sizeof(int);
    printf("test_cuda_abi: cuda_abi.h matches nccl.h %d.%d.%d and cuda_runtime_api.h %d: %s\n", NCCL_MAJOR, NCCL_MINOR,
           NCCL_PATCH, CUDART_VERSION, ok ? "ok" : "the config initializers differ");
    printf("test_cuda_abi: the CUDA driver and NVRTC declarations: %s, %s\n",
           HAVE_CUDA_H ? "checked against cuda.h" : "SKIPPED (no cuda.h here)",
           HAVE_NVRTC_H ? "checked against nvrtc.h" : "SKIPPED (no nvrtc.h here)");
    return ok ? 0 : 1;
}
