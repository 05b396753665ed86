/* py_nccl/nccl_functions.c - the module functions the Python side of the NCCL backend calls
 * (hsdp/world/nccl.py): load the libraries it found, make and hand in the unique id, and tell
 * the backend which stream torch computes on. Everything else goes through ProcessGroup. The
 * backend's own part of hsdp._C, beside the generic wrapper (csrc/py/) rather than in it:
 * module.c adds it through one line of its list (hsdp_py_backend_part). */
#include "../py/pyhsdp.h" /* first: Python.h must precede system headers */

#include "../backend_nccl.h"
#include "../cuda_dequant.h"

static PyObject *mod_nccl_built(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyBool_FromLong(hsdp_nccl_built());
}

static PyObject *mod_nccl_load(PyObject *m, PyObject *args) {
    (void)m;
    const char *nccl, *cudart;
    if (!PyArg_ParseTuple(args, "ss", &nccl, &cudart)) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS /* the first CUDA call can take a while */
    st = hsdp_nccl_load(nccl, cudart);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *mod_nccl_version(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyLong_FromLong(hsdp_nccl_version());
}

static PyObject *mod_nccl_unique_id(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    unsigned char id[HSDP_NCCL_ID_BYTES];
    hsdp_status st = hsdp_nccl_unique_id(id);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    return PyBytes_FromStringAndSize((const char *)id, sizeof id);
}

static PyObject *mod_nccl_bootstrap(PyObject *m, PyObject *args) {
    (void)m;
    Py_buffer id;
    int rank, size, device;
    if (!PyArg_ParseTuple(args, "y*iii", &id, &rank, &size, &device)) return NULL;
    if (id.len != HSDP_NCCL_ID_BYTES) {
        Py_ssize_t n = id.len;
        PyBuffer_Release(&id);
        return PyErr_Format(PyExc_ValueError, "an NCCL unique id is %d bytes, got %zd", HSDP_NCCL_ID_BYTES, n);
    }
    hsdp_status st = hsdp_nccl_set_bootstrap(id.buf, rank, size, device);
    PyBuffer_Release(&id);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *mod_nccl_set_stream(PyObject *m, PyObject *arg) {
    (void)m;
    void *p = PyLong_AsVoidPtr(arg);
    if (!p && PyErr_Occurred()) return NULL;
    hsdp_nccl_set_compute_stream(p);
    Py_RETURN_NONE;
}

/* nccl_agreement_drain(): the queued agreement tickets compared (GIL released: it may wait). */
static PyObject *mod_nccl_agreement_drain(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_nccl_agreement_drain();
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *mod_nccl_comm_stream(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyLong_FromVoidPtr(hsdp_nccl_comm_stream());
}

/* The Python callable the backend calls when a cudaMalloc runs out of memory (torch's
 * empty_cache): the module state's oom_handler (one strong reference) until replaced; arg is
 * that state. */
static int call_oom_handler(void *arg) {
    if (!Py_IsInitialized()) return 0;
    PyGILState_STATE g = PyGILState_Ensure(); /* the caller may hold the GIL or have let it go */
    int retry = 0;
    PyObject *oom_handler = ((modstate *)arg)->oom_handler;
    if (oom_handler) {
        Py_INCREF(oom_handler); /* the call may replace it */
        PyObject *r = PyObject_CallNoArgs(oom_handler);
        if (r) {
            retry = 1;
            Py_DECREF(r);
        } else {
            PyErr_WriteUnraisable(oom_handler); /* the allocation then fails as it would have */
        }
        Py_DECREF(oom_handler);
    }
    PyGILState_Release(g);
    return retry;
}

static void nccl_clear(modstate *ms) {
    if (!ms->oom_handler) return;
    hsdp_nccl_set_oom_handler(NULL, NULL);
    Py_CLEAR(ms->oom_handler);
}

static PyObject *mod_nccl_set_oom_handler(PyObject *m, PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "the out-of-memory handler must be callable or None, got %R", fn);
    modstate *ms = PyModule_GetState(m);
    nccl_clear(ms);
    if (fn != Py_None) {
        ms->oom_handler = Py_NewRef(fn);
        hsdp_nccl_set_oom_handler(call_oom_handler, ms);
    }
    Py_RETURN_NONE;
}

/* The float8 wire's GPU kernel (cuda_dequant.h): NVRTC and the driver opened here, no GPU
 * needed; the kernel is compiled for the device at the first float8 gather. */
static PyObject *mod_wire_cuda_load(PyObject *m, PyObject *args) {
    (void)m;
    const char *nvrtc, *driver;
    if (!PyArg_ParseTuple(args, "ss", &nvrtc, &driver)) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS /* opening NVRTC takes a moment */
    st = hsdp_wire_cuda_load(nvrtc, driver);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *mod_wire_cuda_loaded(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyBool_FromLong(hsdp_wire_cuda_loaded());
}

static PyObject *mod_wire_cuda_image(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    const char *image = hsdp_wire_cuda_image();
    if (!image) Py_RETURN_NONE;
    return PyUnicode_FromString(image);
}

static PyMethodDef nccl_functions[] = {
    {"wire_cuda_load", mod_wire_cuda_load, METH_VARARGS,
     "wire_cuda_load(libnvrtc_path, libcuda_path): open both for the float8 wire's dequantization kernel, which "
     "is compiled for the GPU at the first float8 gather."},
    {"wire_cuda_loaded", mod_wire_cuda_loaded, METH_NOARGS, "Whether NVRTC and the CUDA driver are loaded."},
    {"wire_cuda_image", mod_wire_cuda_image, METH_NOARGS,
     "What the float8 wire's kernel was loaded as ('cubin sm_90', or 'ptx compute_90' for a GPU newer than "
     "NVRTC), or None before its first gather."},
    {"nccl_set_oom_handler", mod_nccl_set_oom_handler, METH_O,
     "nccl_set_oom_handler(fn or None): called (no arguments) when a device allocation of the NCCL backend runs "
     "out of memory, before one retry; torch's is torch.cuda.empty_cache."},
    {"nccl_built", mod_nccl_built, METH_NOARGS, "Whether this build has the NCCL backend."},
    {"nccl_load", mod_nccl_load, METH_VARARGS, "nccl_load(libnccl_path, libcudart_path): open both and find a GPU."},
    {"nccl_version", mod_nccl_version, METH_NOARGS, "ncclGetVersion of the loaded NCCL (0 before loading)."},
    {"nccl_unique_id", mod_nccl_unique_id, METH_NOARGS, "ncclGetUniqueId as 128 bytes (rank 0 makes it)."},
    {"nccl_bootstrap", mod_nccl_bootstrap, METH_VARARGS,
     "nccl_bootstrap(unique_id, rank, size, device): what the next ProcessGroup('nccl') joins."},
    {"nccl_set_stream", mod_nccl_set_stream, METH_O,
     "The CUDA stream (an int handle; 0: the legacy default) the gathers' consumers run on."},
    {"nccl_comm_stream", mod_nccl_comm_stream, METH_NOARGS, "The side stream gathers run on, as an int handle."},
    {"nccl_agreement_drain", mod_nccl_agreement_drain, METH_NOARGS,
     "Compares the unit gathers' agreement tickets still queued (NCCL checks them late); raises when ranks "
     "gathered different units. A no-op without an NCCL world."},
    {NULL, NULL, 0, NULL},
};

const hsdp_py_backend_part hsdp_py_nccl_part = {nccl_functions, nccl_clear};
