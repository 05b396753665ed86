/* cuda_abi.h - the part of NCCL's and the CUDA runtime's binary interface the NCCL backend
 * uses, declared here so that every build compiles the backend: no nccl.h or
 * cuda_runtime_api.h is needed (nor a CUDA toolkit), since both libraries are opened at run
 * time and called through the function pointers typed below. Both ABIs are stable and
 * versioned: these entry points and values keep their signatures and numbers across NCCL 2.x
 * and CUDA runtime 11-13, and the two structs that grow do so at their end, which the
 * declarations below allow for (vLLM's pynccl binds NCCL the same way, without headers).
 *
 * Every name is ours (hsdp_ prefixed), so this header can sit next to the real ones: that is
 * what csrc/tests/test_cuda_abi.c does, asserting at compile time that each value, layout
 * and function type here matches the real headers wherever they are installed (`make ctest`).
 *
 * Types. The real result and enum types are C enums whose values are all non-negative, which
 * GCC and Clang give the underlying type unsigned int; they are declared as unsigned int here
 * (the same type to the ABI and to the compiler's compatibility rules), their values as
 * constants. Opaque handles keep their real struct tags (a tag alone declares nothing that
 * could collide). */
#ifndef HSDP_CUDA_ABI_H
#define HSDP_CUDA_ABI_H

#include <limits.h>
#include <stddef.h>

/* ---------------------------------------------------------------- CUDA runtime */
typedef unsigned int hsdp_cudaError_t;       /* enum cudaError */
typedef unsigned int hsdp_cudaMemcpyKind;    /* enum cudaMemcpyKind */
typedef unsigned int hsdp_cudaMemoryType;    /* enum cudaMemoryType */
typedef struct CUstream_st *hsdp_cudaStream_t;
typedef struct CUevent_st *hsdp_cudaEvent_t;

enum {
    hsdp_cudaSuccess = 0,
    hsdp_cudaErrorInvalidValue = 1,
    hsdp_cudaErrorMemoryAllocation = 2,
    hsdp_cudaErrorInvalidDevice = 101,
    hsdp_cudaErrorNotReady = 600,
    hsdp_cudaErrorStreamCaptureUnsupported = 900, /* 900..908: the stream-capture errors */
    hsdp_cudaErrorStreamCaptureWrongThread = 908,
};
enum { hsdp_cudaStreamCaptureStatusNone = 0 }; /* enum cudaStreamCaptureStatus: 1 active, 2 invalidated */
enum { hsdp_cudaMemcpyDefault = 4 };
enum {
    hsdp_cudaMemoryTypeUnregistered = 0,
    hsdp_cudaMemoryTypeHost = 1,
    hsdp_cudaMemoryTypeDevice = 2,
    hsdp_cudaMemoryTypeManaged = 3,
};
enum { hsdp_cudaStreamNonBlocking = 0x01, hsdp_cudaEventDisableTiming = 0x02, hsdp_cudaHostAllocDefault = 0x00 };

/* What cudaPointerGetAttributes writes. CUDA 13 appended `long reserved[8]` to the CUDA 11/12
 * layout; the runtime writes the whole of its own struct, so ours carries the reserve (and
 * more) and is never smaller than any runtime's. Only `type` is read. */
typedef struct hsdp_cudaPointerAttributes {
    hsdp_cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8];
    long spare[8]; /* room for a later runtime's growth */
} hsdp_cudaPointerAttributes;

typedef hsdp_cudaError_t (*hsdp_cudaGetDeviceCount_fn)(int *count);
typedef hsdp_cudaError_t (*hsdp_cudaSetDevice_fn)(int device);
typedef hsdp_cudaError_t (*hsdp_cudaMalloc_fn)(void **ptr, size_t size);
typedef hsdp_cudaError_t (*hsdp_cudaFree_fn)(void *ptr);
typedef hsdp_cudaError_t (*hsdp_cudaMemcpyAsync_fn)(void *dst, const void *src, size_t count, hsdp_cudaMemcpyKind kind,
                                                    hsdp_cudaStream_t stream);
typedef hsdp_cudaError_t (*hsdp_cudaStreamCreateWithPriority_fn)(hsdp_cudaStream_t *stream, unsigned int flags,
                                                                 int priority);
typedef hsdp_cudaError_t (*hsdp_cudaDeviceGetStreamPriorityRange_fn)(int *least, int *greatest);
typedef hsdp_cudaError_t (*hsdp_cudaStreamDestroy_fn)(hsdp_cudaStream_t stream);
typedef hsdp_cudaError_t (*hsdp_cudaStreamWaitEvent_fn)(hsdp_cudaStream_t stream, hsdp_cudaEvent_t event,
                                                        unsigned int flags);
typedef hsdp_cudaError_t (*hsdp_cudaStreamSynchronize_fn)(hsdp_cudaStream_t stream);
typedef hsdp_cudaError_t (*hsdp_cudaEventCreateWithFlags_fn)(hsdp_cudaEvent_t *event, unsigned int flags);
typedef hsdp_cudaError_t (*hsdp_cudaEventDestroy_fn)(hsdp_cudaEvent_t event);
typedef hsdp_cudaError_t (*hsdp_cudaEventRecord_fn)(hsdp_cudaEvent_t event, hsdp_cudaStream_t stream);
typedef hsdp_cudaError_t (*hsdp_cudaEventQuery_fn)(hsdp_cudaEvent_t event);
typedef const char *(*hsdp_cudaGetErrorString_fn)(hsdp_cudaError_t error);
typedef hsdp_cudaError_t (*hsdp_cudaGetLastError_fn)(void);
typedef hsdp_cudaError_t (*hsdp_cudaHostAlloc_fn)(void **ptr, size_t size, unsigned int flags);
typedef hsdp_cudaError_t (*hsdp_cudaFreeHost_fn)(void *ptr);
typedef hsdp_cudaError_t (*hsdp_cudaStreamIsCapturing_fn)(hsdp_cudaStream_t stream, unsigned int *status);
typedef hsdp_cudaError_t (*hsdp_cudaMemGetInfo_fn)(size_t *free, size_t *total);
/* The functions taking one of the structs above, written once over the struct's type so that
 * the check can instantiate them with the real struct and compare with the real prototypes. */
#define HSDP_CUDA_STRUCT_FNS(PREFIX, ATTRIBUTES) \
    typedef hsdp_cudaError_t (*PREFIX##cudaPointerGetAttributes_fn)(ATTRIBUTES * attributes, const void *ptr);
HSDP_CUDA_STRUCT_FNS(hsdp_, hsdp_cudaPointerAttributes)

/* ---------------------------------------------------------------- NCCL */
typedef unsigned int hsdp_ncclResult_t;   /* ncclResult_t */
typedef unsigned int hsdp_ncclDataType_t; /* ncclDataType_t */
typedef unsigned int hsdp_ncclRedOp_t;    /* ncclRedOp_t */
typedef struct ncclComm *hsdp_ncclComm_t;

enum {
    hsdp_ncclSuccess = 0,
    hsdp_ncclSystemError = 2,
    hsdp_ncclInvalidArgument = 4,
    hsdp_ncclInvalidUsage = 5,
    hsdp_ncclInProgress = 7,
};
enum { hsdp_ncclUint8 = 1, hsdp_ncclFloat32 = 7 };
enum { hsdp_ncclSum = 0 };

enum { HSDP_NCCL_UNIQUE_ID_BYTES = 128 };
typedef struct {
    char internal[HSDP_NCCL_UNIQUE_ID_BYTES];
} hsdp_ncclUniqueId;

/* ncclConfig_t as of NCCL 2.18 (the fields through splitShare). NCCL reads `size` bytes of
 * it (at most its own struct's), resets every field newer than `version` to its default, and
 * gives the fields left undefined its defaults: a config declared for an older NCCL is read
 * correctly by every later one, and an older NCCL reads the prefix it knows. */
#define HSDP_NCCL_API_MAGIC 0xcafebeefu
#define HSDP_NCCL_CONFIG_VERSION 21800 /* NCCL_VERSION(2, 18, 0): the layout below */
#define HSDP_NCCL_CONFIG_UNDEF_INT INT_MIN
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;
} hsdp_ncclConfig_t;
/* What NCCL_CONFIG_INITIALIZER makes for this layout: every field left to NCCL. `size` ends
 * at the last field, so NCCL copies none of our trailing padding. */
#define HSDP_NCCL_CONFIG_INITIALIZER                                                                         \
    {                                                                                                        \
        .size = offsetof(hsdp_ncclConfig_t, splitShare) + sizeof(int), .magic = HSDP_NCCL_API_MAGIC,         \
        .version = HSDP_NCCL_CONFIG_VERSION, .blocking = HSDP_NCCL_CONFIG_UNDEF_INT,                        \
        .cgaClusterSize = HSDP_NCCL_CONFIG_UNDEF_INT, .minCTAs = HSDP_NCCL_CONFIG_UNDEF_INT,                 \
        .maxCTAs = HSDP_NCCL_CONFIG_UNDEF_INT, .netName = NULL, .splitShare = HSDP_NCCL_CONFIG_UNDEF_INT     \
    }

typedef hsdp_ncclResult_t (*hsdp_ncclGetVersion_fn)(int *version);
typedef hsdp_ncclResult_t (*hsdp_ncclAllGather_fn)(const void *sendbuff, void *recvbuff, size_t sendcount,
                                                   hsdp_ncclDataType_t datatype, hsdp_ncclComm_t comm,
                                                   hsdp_cudaStream_t stream);
typedef hsdp_ncclResult_t (*hsdp_ncclBroadcast_fn)(const void *sendbuff, void *recvbuff, size_t count,
                                                   hsdp_ncclDataType_t datatype, int root, hsdp_ncclComm_t comm,
                                                   hsdp_cudaStream_t stream);
typedef hsdp_ncclResult_t (*hsdp_ncclAllReduce_fn)(const void *sendbuff, void *recvbuff, size_t count,
                                                   hsdp_ncclDataType_t datatype, hsdp_ncclRedOp_t op,
                                                   hsdp_ncclComm_t comm, hsdp_cudaStream_t stream);
typedef hsdp_ncclResult_t (*hsdp_ncclAlltoAll_fn)(const void *sendbuff, void *recvbuff, size_t count,
                                                  hsdp_ncclDataType_t datatype, hsdp_ncclComm_t comm,
                                                  hsdp_cudaStream_t stream);
typedef hsdp_ncclResult_t (*hsdp_ncclSend_fn)(const void *sendbuff, size_t count, hsdp_ncclDataType_t datatype,
                                              int peer, hsdp_ncclComm_t comm, hsdp_cudaStream_t stream);
typedef hsdp_ncclResult_t (*hsdp_ncclRecv_fn)(void *recvbuff, size_t count, hsdp_ncclDataType_t datatype, int peer,
                                              hsdp_ncclComm_t comm, hsdp_cudaStream_t stream);
typedef hsdp_ncclResult_t (*hsdp_ncclGroupStart_fn)(void);
typedef hsdp_ncclResult_t (*hsdp_ncclGroupEnd_fn)(void);
typedef hsdp_ncclResult_t (*hsdp_ncclCommGetAsyncError_fn)(hsdp_ncclComm_t comm, hsdp_ncclResult_t *asyncError);
typedef hsdp_ncclResult_t (*hsdp_ncclCommAbort_fn)(hsdp_ncclComm_t comm);
typedef hsdp_ncclResult_t (*hsdp_ncclCommUserRank_fn)(const hsdp_ncclComm_t comm, int *rank);
typedef hsdp_ncclResult_t (*hsdp_ncclCommCount_fn)(const hsdp_ncclComm_t comm, int *count);
typedef const char *(*hsdp_ncclGetErrorString_fn)(hsdp_ncclResult_t result);
typedef const char *(*hsdp_ncclGetLastError_fn)(hsdp_ncclComm_t comm);
/* The functions taking the unique id or the config, over their types (see HSDP_CUDA_STRUCT_FNS). */
#define HSDP_NCCL_STRUCT_FNS(PREFIX, UNIQUE_ID, CONFIG)                                                       \
    typedef hsdp_ncclResult_t (*PREFIX##ncclGetUniqueId_fn)(UNIQUE_ID * uniqueId);                            \
    typedef hsdp_ncclResult_t (*PREFIX##ncclCommInitRank_fn)(hsdp_ncclComm_t * comm, int nranks,              \
                                                             UNIQUE_ID commId, int rank);                     \
    typedef hsdp_ncclResult_t (*PREFIX##ncclCommInitRankConfig_fn)(hsdp_ncclComm_t * comm, int nranks,        \
                                                                   UNIQUE_ID commId, int rank, CONFIG *config); \
    typedef hsdp_ncclResult_t (*PREFIX##ncclCommSplit_fn)(hsdp_ncclComm_t comm, int color, int key,           \
                                                          hsdp_ncclComm_t *newcomm, CONFIG *config);
HSDP_NCCL_STRUCT_FNS(hsdp_, hsdp_ncclUniqueId, hsdp_ncclConfig_t)

/* ---------------------------------------------------------------- CUDA driver and NVRTC
 * What the float8 wire's dequantization kernel needs (cuda_dequant.c): NVRTC compiles its
 * source for the device's architecture (a CUBIN, or PTX when NVRTC does not know the device),
 * the driver reads the device's compute capability, loads and launches it. Both are opened at
 * run time like the two libraries above. A CUstream is the runtime's cudaStream_t (the same
 * struct tag). */
typedef unsigned int hsdp_CUresult; /* enum cudaError_enum */
typedef int hsdp_CUdevice;          /* CUdevice: a device ordinal */
typedef unsigned int hsdp_CUdevice_attribute; /* enum CUdevice_attribute */
typedef struct CUmod_st *hsdp_CUmodule;
typedef struct CUfunc_st *hsdp_CUfunction;
enum {
    hsdp_CUDA_SUCCESS = 0,
    hsdp_CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    hsdp_CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
};
enum {
    hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};
typedef hsdp_CUresult (*hsdp_cuInit_fn)(unsigned int flags);
typedef hsdp_CUresult (*hsdp_cuCtxGetDevice_fn)(hsdp_CUdevice *device);
typedef hsdp_CUresult (*hsdp_cuDeviceGetAttribute_fn)(int *pi, hsdp_CUdevice_attribute attrib, hsdp_CUdevice dev);
typedef hsdp_CUresult (*hsdp_cuModuleLoadData_fn)(hsdp_CUmodule *module, const void *image);
typedef hsdp_CUresult (*hsdp_cuModuleGetFunction_fn)(hsdp_CUfunction *hfunc, hsdp_CUmodule hmod, const char *name);
typedef hsdp_CUresult (*hsdp_cuLaunchKernel_fn)(hsdp_CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes,
                                               hsdp_cudaStream_t hStream, void **kernelParams, void **extra);
typedef hsdp_CUresult (*hsdp_cuGetErrorString_fn)(hsdp_CUresult error, const char **pStr);

typedef unsigned int hsdp_nvrtcResult; /* enum nvrtcResult */
typedef struct _nvrtcProgram *hsdp_nvrtcProgram;
enum { hsdp_NVRTC_SUCCESS = 0 };
typedef hsdp_nvrtcResult (*hsdp_nvrtcCreateProgram_fn)(hsdp_nvrtcProgram *prog, const char *src, const char *name,
                                                       int numHeaders, const char *const *headers,
                                                       const char *const *includeNames);
typedef hsdp_nvrtcResult (*hsdp_nvrtcCompileProgram_fn)(hsdp_nvrtcProgram prog, int numOptions,
                                                        const char *const *options);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetPTXSize_fn)(hsdp_nvrtcProgram prog, size_t *ptxSizeRet);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetPTX_fn)(hsdp_nvrtcProgram prog, char *ptx);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetCUBINSize_fn)(hsdp_nvrtcProgram prog, size_t *cubinSizeRet);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetCUBIN_fn)(hsdp_nvrtcProgram prog, char *cubin);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetNumSupportedArchs_fn)(int *numArchs);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetSupportedArchs_fn)(int *supportedArchs);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetProgramLogSize_fn)(hsdp_nvrtcProgram prog, size_t *logSizeRet);
typedef hsdp_nvrtcResult (*hsdp_nvrtcGetProgramLog_fn)(hsdp_nvrtcProgram prog, char *log);
typedef hsdp_nvrtcResult (*hsdp_nvrtcDestroyProgram_fn)(hsdp_nvrtcProgram *prog);
typedef const char *(*hsdp_nvrtcGetErrorString_fn)(hsdp_nvrtcResult result);

#endif
