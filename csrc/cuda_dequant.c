/* cuda_dequant.c - the float8 wire's dequantization kernel on the GPU: NVRTC compiles
 * wire_kernel.h's text, the CUDA driver loads and launches it (see cuda_dequant.h). Neither
 * library is linked: both are opened at run time, typed by cuda_abi.h (checked against
 * nvrtc.h and cuda.h by csrc/tests/test_cuda_abi.c). UNTESTED ON A GPU. */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "cuda_dequant.h"
#include "wire_kernel.h"

/* The kernel: the shared text, then its entry point. --fmad=false: the scale multiply is not
 * fused with anything; no --use_fast_math, so denormals are kept (dtype.c keeps them too). */
#define HSDP_WK(...) #__VA_ARGS__
static const char kernel_source[] =
    "#define HSDP_WK_FN static __device__ __forceinline__\n"
    "#define HSDP_WK_U32(f) __float_as_uint(f)\n"
    "#define HSDP_WK_F32(u) __uint_as_float(u)\n" HSDP_WK_TEXT
    "\nextern \"C\" __global__ void __launch_bounds__(128) " HSDP_WK_NAME "(const hsdp_wk_args args) {\n"
    "    for (unsigned int it = blockIdx.x; it < args.items; it += gridDim.x) hsdp_wk_item(&args, it, threadIdx.x);\n"
    "}\n";
#undef HSDP_WK
_Static_assert(HSDP_WK_BLOCK == HSDP_WIRE_BLOCK, "one item of the kernel is one scale block of the wire");

#define NVRTC_FNS(X)                                                                                          \
    X(nvrtcCreateProgram) X(nvrtcCompileProgram) X(nvrtcGetPTXSize) X(nvrtcGetPTX) X(nvrtcGetProgramLogSize)  \
    X(nvrtcGetProgramLog) X(nvrtcDestroyProgram) X(nvrtcGetErrorString)
#define DRIVER_FNS(X) X(cuInit) X(cuModuleLoadData) X(cuModuleGetFunction) X(cuLaunchKernel) X(cuGetErrorString)

#define DECLARE(name) hsdp_##name##_fn name;
static struct {
    pthread_mutex_t mu; /* the module's loading */
    void *nvrtc, *driver; /* dlopen handles, kept open for the process */
    atomic_int loaded;    /* set (release) once everything below is in place */
    char *ptx;            /* owned here, for the process */
    hsdp_CUfunction fn;   /* the kernel, once loaded into the context */
    NVRTC_FNS(DECLARE)
    DRIVER_FNS(DECLARE)
} K = {.mu = PTHREAD_MUTEX_INITIALIZER};
#undef DECLARE
/* K.fn once loaded, published for the lock-free path (kernel): every gather after the first
 * asks for the kernel twice (its check, its decode) and takes no lock. */
static _Atomic(hsdp_CUfunction) ready_fn;

int hsdp_wire_cuda_loaded(void) { return atomic_load(&K.loaded); }
const char *hsdp_wire_cuda_ptx(void) { return K.ptx; }

static int resolve(void *lib, const char *name, void *slot) {
    void *sym = dlsym(lib, name);
    memcpy(slot, &sym, sizeof sym); /* object to function pointer, the POSIX way */
    return sym != NULL;
}

/* Compiles kernel_source to PTX into K.ptx. */
static hsdp_status compile(const char *nvrtc_path) {
    hsdp_nvrtcProgram prog = NULL;
    hsdp_nvrtcResult rc = K.nvrtcCreateProgram(&prog, kernel_source, "hsdp_wire_dequant.cu", 0, NULL, NULL);
    if (rc != hsdp_NVRTC_SUCCESS)
        return hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC ('%s') could not create the float8 wire's kernel program: %s",
                         nvrtc_path, K.nvrtcGetErrorString(rc));
    const char *opts[] = {"--fmad=false", "--ftz=false", "--prec-div=true", "--std=c++17"};
    rc = K.nvrtcCompileProgram(prog, (int)(sizeof opts / sizeof *opts), opts);
    hsdp_status st = HSDP_OK;
    if (rc != hsdp_NVRTC_SUCCESS) {
        size_t n = 0;
        char log[1024] = "";
        if (K.nvrtcGetProgramLogSize(prog, &n) == hsdp_NVRTC_SUCCESS && n > 0 && n <= sizeof log)
            (void)K.nvrtcGetProgramLog(prog, log);
        st = hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC ('%s') could not compile the float8 wire's kernel: %s; log: %.600s",
                       nvrtc_path, K.nvrtcGetErrorString(rc), log);
    }
    size_t n = 0;
    if (st == HSDP_OK && (rc = K.nvrtcGetPTXSize(prog, &n)) == hsdp_NVRTC_SUCCESS && n > 0) {
        K.ptx = malloc(n); /* owned by K for the process */
        if (!K.ptx) st = hsdp_fail(HSDP_ENOMEM, "could not allocate %zu bytes of PTX", n);
        else if ((rc = K.nvrtcGetPTX(prog, K.ptx)) != hsdp_NVRTC_SUCCESS) K.ptx[0] = '\0';
    }
    if (st == HSDP_OK && (!K.ptx || !K.ptx[0]))
        st = hsdp_fail(HSDP_EUNSUPPORTED, "NVRTC ('%s') gave no PTX for the float8 wire's kernel: %s", nvrtc_path,
                       K.nvrtcGetErrorString(rc));
    (void)K.nvrtcDestroyProgram(&prog);
    return st;
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
    st = compile(nvrtc_path);
    if (st != HSDP_OK) goto fail;
    atomic_store(&K.loaded, 1);
    return HSDP_OK;
fail: /* nothing is left half loaded: the handles and the PTX go, and `loaded` stays 0, so
       * the function pointers (never called before it is set) are filled again next time */
    if (K.nvrtc) dlclose(K.nvrtc);
    if (K.driver) dlclose(K.driver);
    free(K.ptx);
    K.nvrtc = K.driver = NULL;
    K.ptx = NULL;
    return st;
}

static hsdp_status cu_fail(hsdp_CUresult rc, const char *what) {
    const char *text = NULL;
    if (K.cuGetErrorString(rc, &text) != hsdp_CUDA_SUCCESS || !text) text = "unknown error";
    return hsdp_fail(HSDP_ECOMM, "%s failed: CUDA driver error %u (%s)", what, rc, text);
}

/* The kernel in the current context, loaded at first use (any thread; once, under K.mu). */
static hsdp_status kernel(hsdp_CUfunction *out) {
    if (!atomic_load(&K.loaded))
        return hsdp_fail(HSDP_EUNSUPPORTED, "the float8 wire's GPU kernel is not loaded (hsdp_wire_cuda_load): NVRTC "
                         "and the CUDA driver are needed to dequantize on the GPU");
    *out = atomic_load_explicit(&ready_fn, memory_order_acquire);
    if (*out) return HSDP_OK;
    pthread_mutex_lock(&K.mu);
    hsdp_status st = HSDP_OK;
    if (!K.fn) {
        hsdp_CUmodule mod = NULL;
        hsdp_CUresult rc = K.cuInit(0);
        if (rc == hsdp_CUDA_SUCCESS) rc = K.cuModuleLoadData(&mod, K.ptx);
        if (rc != hsdp_CUDA_SUCCESS) st = cu_fail(rc, "loading the float8 wire's kernel (cuModuleLoadData)");
        else if ((rc = K.cuModuleGetFunction(&K.fn, mod, HSDP_WK_NAME)) != hsdp_CUDA_SUCCESS)
            st = cu_fail(rc, "finding the float8 wire's kernel (cuModuleGetFunction)");
        /* the module stays loaded for the process, like the libraries */
    }
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
