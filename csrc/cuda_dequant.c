/* cuda_dequant.c - the float8 wire's dequantization kernel on the GPU: NVRTC compiles
 * wire_kernel.h's text for the device, the CUDA driver loads and launches it (see
 * cuda_dequant.h). Neither library is linked: both are opened at run time, typed by
 * cuda_abi.h (checked against nvrtc.h and cuda.h by csrc/tests/test_cuda_abi.c). UNTESTED ON
 * A GPU.
 *
 * The image (issue 30, L1). NVRTC's default is PTX for an old virtual architecture at NVRTC's
 * own PTX ISA version, which a driver older than the NVRTC refuses to JIT
 * (CUDA_ERROR_UNSUPPORTED_PTX_VERSION) while cudart and NCCL still run on it (CUDA's
 * minor-version compatibility). So the kernel is compiled at its first use in a context, for
 * that context's device: a CUBIN for sm_XY (machine code, which the same minor-version
 * compatibility covers: no JIT); PTX only for a device newer than every architecture this
 * NVRTC knows, for the newest one below it (a driver that knows such a device is newer than
 * the NVRTC, so it takes the PTX's version). A process drives one GPU (the NCCL backend's
 * device), so one image and one module serve it. */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "cuda_dequant.h"
#include "wire_kernel.h"

/* The kernel: the shared text, then its entry point. --fmad=false: the scale multiply is not
 * fused with anything; no --use_fast_math, so denormals are kept (dtype.c keeps them too).
 * The parameters (3.2 KB of segments) are __grid_constant__ (CUDA 11.7+, compute_70+), so the
 * item's pointer to them reads the parameter space in place: without it a compiler that does
 * not inline the item copies all of them to each thread's local memory (issue 30, D7: a
 * 3208-byte stack frame with the item __noinline__, or under -G; 0 bytes with it). */
#define HSDP_WK(...) #__VA_ARGS__
static const char kernel_source[] =
    "#define HSDP_WK_FN static __device__ __forceinline__\n"
    "#define HSDP_WK_U32(f) __float_as_uint(f)\n"
    "#define HSDP_WK_F32(u) __uint_as_float(u)\n"
    "#if __CUDA_ARCH__ >= 700 && "
    "(__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))\n"
    "#define HSDP_WK_PARAMS __grid_constant__ const\n"
    "#else\n"
    "#define HSDP_WK_PARAMS const\n"
    "#endif\n" HSDP_WK_TEXT
    "\nextern \"C\" __global__ void __launch_bounds__(128) " HSDP_WK_NAME "(HSDP_WK_PARAMS hsdp_wk_args args) {\n"
    "    for (unsigned int it = blockIdx.x; it < args.items; it += gridDim.x) hsdp_wk_item(&args, it, threadIdx.x);\n"
    "}\n";
#undef HSDP_WK
_Static_assert(HSDP_WK_BLOCK == HSDP_WIRE_BLOCK, "one item of the kernel is one scale block of the wire");

#define NVRTC_FNS(X)                                                                                          \
    X(nvrtcCreateProgram) X(nvrtcCompileProgram) X(nvrtcGetPTXSize) X(nvrtcGetPTX) X(nvrtcGetCUBINSize)       \
    X(nvrtcGetCUBIN) X(nvrtcGetNumSupportedArchs) X(nvrtcGetSupportedArchs) X(nvrtcGetProgramLogSize)         \
    X(nvrtcGetProgramLog) X(nvrtcDestroyProgram) X(nvrtcGetErrorString)
#define DRIVER_FNS(X)                                                                                         \
    X(cuInit) X(cuCtxGetDevice) X(cuDeviceGetAttribute) X(cuModuleLoadData) X(cuModuleGetFunction)           \
    X(cuLaunchKernel) X(cuGetErrorString)

#define DECLARE(name) hsdp_##name##_fn name;
static struct {
    pthread_mutex_t mu;    /* the loading, and the module's */
    void *nvrtc, *driver;  /* dlopen handles, kept open for the process */
    atomic_int loaded;     /* set (release) once the libraries, functions and archs are in place */
    char *nvrtc_path;      /* for messages; strdup'd, owned here for the process */
    int *archs, narchs;    /* what this NVRTC compiles for (nvrtcGetSupportedArchs), ascending; owned here */
    hsdp_wire_cuda_blob image; /* the image for the process's device, once compiled; its data owned here */
    int image_cc;          /* the compute capability it was compiled for */
    char image_name[32];   /* "cubin sm_90": published with ready_fn */
    hsdp_CUfunction fn;    /* the kernel, once loaded into the context */
    NVRTC_FNS(DECLARE)
    DRIVER_FNS(DECLARE)
} K = {.mu = PTHREAD_MUTEX_INITIALIZER};
#undef DECLARE
/* K.fn once loaded, published for the lock-free path (kernel): every gather after the first
 * asks for the kernel twice (its check, its decode) and takes no lock. */
static _Atomic(hsdp_CUfunction) ready_fn;

int hsdp_wire_cuda_loaded(void) { return atomic_load(&K.loaded); }
const char *hsdp_wire_cuda_image(void) {
    return atomic_load_explicit(&ready_fn, memory_order_acquire) ? K.image_name : NULL;
}

static int resolve(void *lib, const char *name, void *slot) {
    void *sym = dlsym(lib, name);
    memcpy(slot, &sym, sizeof sym); /* object to function pointer, the POSIX way */
    return sym != NULL;
}

/* The target for a device of compute capability cc (see cuda_dequant.h): sets *arch and
 * *cubin, or fails naming the device's and NVRTC's architectures. K.archs is ascending. */
static hsdp_status target(int cc, int *arch, int *cubin) {
    int same_major = 0, below = 0;
    for (int i = 0; i < K.narchs; i++) {
        int a = K.archs[i];
        if (a <= cc && a / 10 == cc / 10) same_major = a; /* a cubin for X.y runs on X.z, z >= y */
        if (a <= cc) below = a;
    }
    *arch = same_major ? same_major : below;
    *cubin = same_major != 0;
    if (*arch) return HSDP_OK;
    return hsdp_fail(HSDP_EUNSUPPORTED, "the float8 wire's kernel: the device's compute capability %d.%d is older "
                     "than any NVRTC ('%s') compiles for (sm_%d to sm_%d)", cc / 10, cc % 10, K.nvrtc_path,
                     K.narchs ? K.archs[0] : 0, K.narchs ? K.archs[K.narchs - 1] : 0);
}

hsdp_status hsdp_wire_cuda_compile(int cc, hsdp_wire_cuda_blob *out) {
    memset(out, 0, sizeof *out);
    if (!atomic_load(&K.loaded))
        return hsdp_fail(HSDP_EUNSUPPORTED, "the float8 wire's GPU kernel cannot be compiled: NVRTC is not loaded "
                         "(hsdp_wire_cuda_load)");
    int arch = 0, cubin = 0;
    hsdp_status st = target(cc, &arch, &cubin);
    if (st != HSDP_OK) return st;
    char gpu[24], opt_arch[48], name[32]; /* sm_90; --gpu-architecture=sm_90; cubin sm_90 */
    snprintf(gpu, sizeof gpu, "%s_%d", cubin ? "sm" : "compute", arch);
    snprintf(opt_arch, sizeof opt_arch, "--gpu-architecture=%s", gpu);
    snprintf(name, sizeof name, "%s %s", cubin ? "cubin" : "ptx", gpu);
    hsdp_nvrtcProgram prog = NULL;
    hsdp_nvrtcResult rc = K.nvrtcCreateProgram(&prog, kernel_source, "hsdp_wire_dequant.cu", 0, NULL, NULL);
    if (rc != hsdp_NVRTC_SUCCESS)
        return hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC ('%s') could not create the float8 wire's kernel program: %s",
                         K.nvrtc_path, K.nvrtcGetErrorString(rc));
    const char *opts[] = {opt_arch, "--fmad=false", "--ftz=false", "--prec-div=true", "--std=c++17"};
    rc = K.nvrtcCompileProgram(prog, (int)(sizeof opts / sizeof *opts), opts);
    if (rc != hsdp_NVRTC_SUCCESS) {
        size_t n = 0;
        char *log = NULL; /* owned here, freed below */
        if (K.nvrtcGetProgramLogSize(prog, &n) == hsdp_NVRTC_SUCCESS && n > 0 && (log = calloc(1, n + 1)) &&
            K.nvrtcGetProgramLog(prog, log) != hsdp_NVRTC_SUCCESS)
            log[0] = '\0';
        st = hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC ('%s') could not compile the float8 wire's kernel for %s (device %d.%d): "
                       "%s; log: %.600s", K.nvrtc_path, gpu, cc / 10, cc % 10, K.nvrtcGetErrorString(rc),
                       log ? log : "");
        free(log);
    }
    size_t n = 0;
    if (st == HSDP_OK) rc = cubin ? K.nvrtcGetCUBINSize(prog, &n) : K.nvrtcGetPTXSize(prog, &n);
    if (st == HSDP_OK && rc == hsdp_NVRTC_SUCCESS && n > 0) {
        out->data = malloc(n); /* owned by the caller (hsdp_wire_cuda_blob) */
        if (!out->data) st = hsdp_fail(HSDP_ENOMEM, "could not allocate %zu bytes for the float8 wire's kernel", n);
        else if ((rc = cubin ? K.nvrtcGetCUBIN(prog, out->data) : K.nvrtcGetPTX(prog, out->data)) != hsdp_NVRTC_SUCCESS)
            n = 0;
    }
    if (st == HSDP_OK && (rc != hsdp_NVRTC_SUCCESS || n == 0))
        st = hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC ('%s') gave no %s for the float8 wire's kernel: %s", K.nvrtc_path,
                       name, K.nvrtcGetErrorString(rc));
    (void)K.nvrtcDestroyProgram(&prog);
    if (st != HSDP_OK) {
        free(out->data);
        memset(out, 0, sizeof *out);
        return st;
    }
    out->size = n;
    out->cubin = cubin;
    out->arch = arch;
    return HSDP_OK;
}

static hsdp_status load_locked(const char *nvrtc_path, const char *driver_path);

/* Loads once, under K.mu: threads that load at once (the GIL is released) wait for the first. */
hsdp_status hsdp_wire_cuda_load(const char *nvrtc_path, const char *driver_path) {
    if (atomic_load(&K.loaded)) return HSDP_OK;
    pthread_mutex_lock(&K.mu);
    hsdp_status st = atomic_load(&K.loaded) ? HSDP_OK : load_locked(nvrtc_path, driver_path);
    pthread_mutex_unlock(&K.mu);
    return st;
}

static int ascending(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static hsdp_status load_locked(const char *nvrtc_path, const char *driver_path) {
    if (!nvrtc_path || !*nvrtc_path || !driver_path || !*driver_path)
        return hsdp_fail(HSDP_EINVAL, "the float8 wire on the GPU needs the paths of libnvrtc and the CUDA driver");
    const char *missing = NULL, *in = NULL;
    hsdp_status st = HSDP_OK;
    K.nvrtc = dlopen(nvrtc_path, RTLD_NOW | RTLD_LOCAL);
    if (!K.nvrtc) {
        st = hsdp_fail(HSDP_EUNSUPPORTED, "could not open NVRTC '%s': %s; the float8 wire on NCCL compiles its "
                       "dequantization kernel with it (the nvidia-cuda-nvrtc wheel, or set HSDP_NVRTC_LIBRARY)",
                       nvrtc_path, dlerror());
        goto fail;
    }
    K.driver = dlopen(driver_path, RTLD_NOW | RTLD_LOCAL);
    if (!K.driver) {
        st = hsdp_fail(HSDP_EUNSUPPORTED, "could not open the CUDA driver '%s': %s; the float8 wire on NCCL launches "
                       "its dequantization kernel through it (it comes with the NVIDIA driver; or set "
                       "HSDP_CUDA_DRIVER_LIBRARY)", driver_path, dlerror());
        goto fail;
    }
#define REQ_NVRTC(name) if (!missing && !resolve(K.nvrtc, #name, &K.name)) missing = #name, in = nvrtc_path;
#define REQ_DRIVER(name) if (!missing && !resolve(K.driver, #name, &K.name)) missing = #name, in = driver_path;
    NVRTC_FNS(REQ_NVRTC)
    DRIVER_FNS(REQ_DRIVER)
#undef REQ_NVRTC
#undef REQ_DRIVER
    if (missing) {
        st = hsdp_fail(HSDP_EUNSUPPORTED, "'%s' has no symbol %s: it is not a usable NVRTC / CUDA driver library", in,
                       missing);
        goto fail;
    }
    K.nvrtc_path = strdup(nvrtc_path); /* owned by K for the process */
    if (!K.nvrtc_path) {
        st = hsdp_fail(HSDP_ENOMEM, "could not copy the path of NVRTC");
        goto fail;
    }
    int n = 0;
    hsdp_nvrtcResult rc = K.nvrtcGetNumSupportedArchs(&n);
    if (rc == hsdp_NVRTC_SUCCESS && n > 0 && n < 4096 && (K.archs = malloc((size_t)n * sizeof *K.archs)) &&
        (rc = K.nvrtcGetSupportedArchs(K.archs)) == hsdp_NVRTC_SUCCESS) {
        K.narchs = n; /* K.archs owned by K for the process */
        qsort(K.archs, (size_t)n, sizeof *K.archs, ascending);
    } else {
        st = hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC '%s' lists no architecture it compiles for (nvrtcGetSupportedArchs: "
                       "%s, %d)", nvrtc_path, K.nvrtcGetErrorString(rc), n);
        goto fail;
    }
    atomic_store(&K.loaded, 1);
    return HSDP_OK;
fail: /* nothing is left half loaded: the handles, the path and the archs go, and `loaded` stays
       * 0, so the function pointers (never called before it is set) are filled again next time */
    if (K.nvrtc) dlclose(K.nvrtc);
    if (K.driver) dlclose(K.driver);
    free(K.nvrtc_path);
    free(K.archs);
    K.nvrtc = K.driver = NULL;
    K.nvrtc_path = NULL;
    K.archs = NULL;
    K.narchs = 0;
    return st;
}

static hsdp_status cu_fail(hsdp_CUresult rc, const char *what) {
    const char *text = NULL;
    if (K.cuGetErrorString(rc, &text) != hsdp_CUDA_SUCCESS || !text) text = "unknown error";
    return hsdp_fail(HSDP_ECOMM, "%s failed: CUDA driver error %u (%s)", what, rc, text);
}

/* The module in the calling thread's current context, compiled for its device. K.mu held. */
static hsdp_status load_module(void) {
    char what[512];
    hsdp_CUresult rc = K.cuInit(0);
    if (rc != hsdp_CUDA_SUCCESS) return cu_fail(rc, "initializing the CUDA driver for the float8 wire's kernel (cuInit)");
    hsdp_CUdevice dev = -1;
    if ((rc = K.cuCtxGetDevice(&dev)) != hsdp_CUDA_SUCCESS)
        return cu_fail(rc, "finding the device of this thread's CUDA context, which the float8 wire's kernel is loaded "
                           "into (cuCtxGetDevice)");
    int major = 0, minor = 0;
    if ((rc = K.cuDeviceGetAttribute(&major, hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) !=
            hsdp_CUDA_SUCCESS ||
        (rc = K.cuDeviceGetAttribute(&minor, hsdp_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)) !=
            hsdp_CUDA_SUCCESS) {
        snprintf(what, sizeof what, "reading the compute capability of CUDA device %d (cuDeviceGetAttribute)", dev);
        return cu_fail(rc, what);
    }
    if (major < 1 || major > 99 || minor < 0 || minor > 9)
        return hsdp_fail(HSDP_EUNSUPPORTED, "CUDA device %d reports compute capability %d.%d, which the float8 wire's "
                         "kernel cannot be compiled for", dev, major, minor);
    int cc = major * 10 + minor;
    if (!K.image.data || K.image_cc != cc) { /* kept after a refused load: a retry does not compile again */
        free(K.image.data);
        memset(&K.image, 0, sizeof K.image);
        hsdp_status st = hsdp_wire_cuda_compile(cc, &K.image); /* K.image.data owned by K for the process */
        if (st != HSDP_OK) return st;
        K.image_cc = cc;
    }
    char name[32];
    snprintf(name, sizeof name, "%s %s_%d", K.image.cubin ? "cubin" : "ptx", K.image.cubin ? "sm" : "compute",
             K.image.arch);
    hsdp_CUmodule mod = NULL;
    if ((rc = K.cuModuleLoadData(&mod, K.image.data)) != hsdp_CUDA_SUCCESS) {
        snprintf(what, sizeof what, "loading the float8 wire's kernel (%s, compiled by NVRTC '%s') into the context of "
                 "CUDA device %d, compute capability %d.%d (cuModuleLoadData)%s", name, K.nvrtc_path, dev, major,
                 minor, rc == hsdp_CUDA_ERROR_UNSUPPORTED_PTX_VERSION
                                ? " [the driver is older than that NVRTC: update the driver, or use an NVRTC no "
                                  "newer than it (HSDP_NVRTC_LIBRARY)]"
                                : "");
        return cu_fail(rc, what);
    }
    hsdp_CUfunction fn = NULL;
    if ((rc = K.cuModuleGetFunction(&fn, mod, HSDP_WK_NAME)) != hsdp_CUDA_SUCCESS)
        return cu_fail(rc, "finding the float8 wire's kernel (cuModuleGetFunction)");
    /* the module stays loaded for the process, like the libraries */
    memcpy(K.image_name, name, sizeof name);
    K.fn = fn;
    return HSDP_OK;
}

/* The kernel in the current context, loaded at first use (any thread; once, under K.mu). */
static hsdp_status kernel(hsdp_CUfunction *out) {
    if (!atomic_load(&K.loaded))
        return hsdp_fail(HSDP_EUNSUPPORTED, "the float8 wire's GPU kernel is not loaded (hsdp_wire_cuda_load): NVRTC "
                         "and the CUDA driver are needed to dequantize on the GPU");
    *out = atomic_load_explicit(&ready_fn, memory_order_acquire);
    if (*out) return HSDP_OK;
    pthread_mutex_lock(&K.mu);
    hsdp_status st = K.fn ? HSDP_OK : load_module();
    if (st == HSDP_OK) atomic_store_explicit(&ready_fn, K.fn, memory_order_release);
    *out = K.fn;
    pthread_mutex_unlock(&K.mu);
    return st;
}

/* Segments collected into one launch's parameters. */
typedef struct {
    hsdp_wk_args a;
    hsdp_CUfunction fn;
    hsdp_cudaStream_t stream;
} batch;

static hsdp_status flush(batch *b) {
    if (!b->a.nseg) return HSDP_OK;
    unsigned grid = b->a.items < (1u << 20) ? b->a.items : (1u << 20); /* the kernel strides over the rest */
    void *params[] = {&b->a};
    hsdp_CUresult rc = K.cuLaunchKernel(b->fn, grid, 1, 1, HSDP_WK_BLOCK, 1, 1, 0, b->stream, params, NULL);
    b->a.nseg = b->a.items = 0;
    return rc == hsdp_CUDA_SUCCESS ? HSDP_OK : cu_fail(rc, "launching the float8 wire's kernel (cuLaunchKernel)");
}

static hsdp_status add(batch *b, unsigned char *dst, const unsigned char *src, const unsigned char *scales, size_t n,
                       unsigned kind) {
    if (n == 0) return HSDP_OK;
    size_t per = kind == HSDP_WK_ZERO || kind == HSDP_WK_COPY ? HSDP_WK_BYTES : HSDP_WK_BLOCK;
    size_t items = (n + per - 1) / per;
    if (items > UINT_MAX / 2) return hsdp_fail(HSDP_EINVAL, "a parameter piece of %zu elements is too large for the "
                                               "float8 wire's kernel", n);
    if (b->a.nseg == HSDP_WK_SEGS || items > UINT_MAX - b->a.items) {
        hsdp_status st = flush(b);
        if (st != HSDP_OK) return st;
    }
    b->a.seg[b->a.nseg++] = (hsdp_wk_seg){.dst = (unsigned long long)(uintptr_t)dst,
                                          .src = (unsigned long long)(uintptr_t)src,
                                          .scales = (unsigned long long)(uintptr_t)scales,
                                          .n = n, .first = b->a.items, .kind = kind};
    b->a.items += (unsigned)items;
    return HSDP_OK;
}

static unsigned kind_of(hsdp_dtype dt) {
    return dt == HSDP_BF16 ? HSDP_WK_BF16 : dt == HSDP_F16 ? HSDP_WK_F16 : HSDP_WK_F32;
}

hsdp_status hsdp_wire_cuda_prepare(void) {
    hsdp_CUfunction fn;
    return kernel(&fn);
}

hsdp_status hsdp_wire_cuda_decode(const hsdp_unit *u, const void *wire, void *full, void *stream) {
    if (!u->quant) return hsdp_fail(HSDP_EINVAL, "the unit has no wire encoding to decode");
    batch b = {.stream = (hsdp_cudaStream_t)stream};
    hsdp_status st = kernel(&b.fn);
    /* Rank s's chunk, as hsdp_unit_decode walks it: its pieces in layout order (dequantized
     * or copied), zeros in the padding between them and after the last. */
    for (int s = 0; st == HSDP_OK && s < u->layout.shard; s++) {
        const unsigned char *w = (const unsigned char *)wire + (size_t)s * u->wire_chunk_bytes;
        const unsigned char *scales = w, *payload = w + u->wire_blocks[s] * sizeof(float);
        unsigned char *out = (unsigned char *)full + (size_t)s * u->layout.chunk_bytes;
        size_t at = 0;
        hsdp_wire_piece p = {0};
        while (st == HSDP_OK && hsdp_wire_next(u, s, &p)) {
            if (p.off > at) st = add(&b, out + at, NULL, NULL, p.off - at, HSDP_WK_ZERO);
            if (st == HSDP_OK && p.quant)
                st = add(&b, out + p.off, payload + p.pay, scales + p.block * sizeof(float), p.n,
                         kind_of(u->layout.slots[p.slot].dtype));
            else if (st == HSDP_OK)
                st = add(&b, out + p.off, payload + p.pay, NULL, p.bytes, HSDP_WK_COPY);
            at = p.off + p.bytes;
        }
        if (st == HSDP_OK && u->layout.chunk_bytes > at)
            st = add(&b, out + at, NULL, NULL, u->layout.chunk_bytes - at, HSDP_WK_ZERO);
    }
    return st == HSDP_OK ? flush(&b) : st;
}
