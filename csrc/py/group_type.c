/* group_type.c - ProcessGroup over the backend registry (the module functions that ask the
 * registry what is built and end what hsdp started are backend_functions.c). Backends are
 * found by name in the registry; nothing here knows any backend in particular. */
#include "pyhsdp.h"  /* first: Python.h must precede system headers */

static PyObject *group_wrap(PyTypeObject *type, hsdp_group *g) {
    GroupObject *self = (GroupObject *)type->tp_alloc(type, 0);
    if (!self) {
        hsdp_group_free(g);
        return NULL;
    }
    self->g = g;
    self->module = Py_NewRef(PyType_GetModule(type));
    return (PyObject *)self;
}

static PyObject *group_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"backend", NULL};
    const char *backend = "single";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|s", kwlist, &backend)) return NULL;
    hsdp_group *g = NULL;
    hsdp_status st;
    int we_init = 0;
    Py_BEGIN_ALLOW_THREADS /* starting a runtime (MPI_Init) can take a while */
    st = hsdp_backend_world(backend, &g, &we_init);
    Py_END_ALLOW_THREADS
    if (we_init) {
        for (size_t i = 0; i < hsdp_backend_count(); i++)
            if (hsdp_backend_at(i) == hsdp_backend_find(backend)) hsdp_py_state(type)->we_init |= 1u << i;
    }
    if (st != HSDP_OK) return hsdp_py_raise(st);
    return group_wrap(type, g);
}

/* No tp_clear: the arrays of a sendrecv in flight must outlive it, and the module the group. */
static int group_traverse(GroupObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->p2p_send);
    Py_VISIT(self->p2p_recv);
    return 0;
}

static void group_dealloc(GroupObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->p2p) {
        /* a started sendrecv still writes into its recv: end it before the arrays go */
        if (self->p2p->pending) {
            Py_BEGIN_ALLOW_THREADS
            (void)hsdp_gather_wait(self->p2p);
            Py_END_ALLOW_THREADS
        }
        PyMem_Free(self->p2p);
    }
    Py_XDECREF(self->p2p_send);
    Py_XDECREF(self->p2p_recv);
    /* NCCL's free takes the backend's issue lock, which a thread in an out-of-memory retry holds
     * while it waits for the GIL (the handler is torch.cuda.empty_cache): not under the GIL */
    Py_BEGIN_ALLOW_THREADS
    hsdp_group_free(self->g);
    Py_END_ALLOW_THREADS
    Py_XDECREF(self->module);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *group_get_rank(GroupObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->g->rank);
}
static PyObject *group_get_size(GroupObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->g->size);
}
static PyObject *group_get_backend(GroupObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(self->g->backend->name);
}
static PyObject *group_get_device_info(GroupObject *self, void *c) {
    (void)c;
    return hsdp_py_device_info(self->g->backend);
}
static PyObject *group_get_overlaps(GroupObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(hsdp_group_overlaps(self->g));
}

static PyObject *group_barrier(GroupObject *self, PyObject *unused) {
    (void)unused;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_barrier(self->g);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *group_split(GroupObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"color", "key", NULL};
    int color, key;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ii", kwlist, &color, &key)) return NULL;
    if (color < 0) return PyErr_Format(PyExc_ValueError, "color must be >= 0, got %d", color);
    hsdp_group *out = NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_group_split(self->g, color, key, &out);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    return group_wrap(Py_TYPE(self), out);
}

static PyObject *group_broadcast(GroupObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"array", "root", NULL};
    PyObject *obj;
    int root = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|i", kwlist, &obj, &root)) return NULL;
    PyArrayObject *a = hsdp_py_writable_array(obj, "array");
    if (!a) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_broadcast(self->g, PyArray_DATA(a), (size_t)PyArray_NBYTES(a), root);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* send and recv of a collective that moves size blocks: send holds `send_blocks` of them. */
static int block_arrays(GroupObject *self, PyObject *so, PyObject *ro, int send_blocks, void **s, void **r,
                        size_t *block) {
    PyArrayObject *ra = hsdp_py_writable_array(ro, "recv");
    if (!ra) return -1;
    if (!PyArray_Check(so) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)so)) {
        PyErr_Format(PyExc_TypeError, "send must be a C-contiguous NumPy array");
        return -1;
    }
    size_t sn = (size_t)PyArray_NBYTES((PyArrayObject *)so), size = (size_t)self->g->size;
    if (send_blocks > 1 && sn % size) {
        PyErr_Format(PyExc_ValueError, "send holds %zu bytes, not a multiple of the group size %zu", sn, size);
        return -1;
    }
    size_t b = send_blocks > 1 ? sn / size : sn;
    if ((size_t)PyArray_NBYTES(ra) != b * size) {
        PyErr_Format(PyExc_ValueError, "recv holds %zd bytes; %zu blocks of %zu bytes need %zu", PyArray_NBYTES(ra),
                     size, b, b * size);
        return -1;
    }
    *s = PyArray_DATA((PyArrayObject *)so);
    *r = PyArray_DATA(ra);
    *block = b;
    return 0;
}

typedef hsdp_status (*block_collective)(hsdp_group *, const void *, void *, size_t);

/* A collective of size equal blocks on caller-owned arrays, with the GIL released. */
static PyObject *blocks_call(GroupObject *self, PyObject *args, PyObject *kw, int send_blocks, block_collective fn) {
    static char *kwlist[] = {"send", "recv", NULL};
    PyObject *so, *ro;
    void *s, *r;
    size_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO", kwlist, &so, &ro)) return NULL;
    if (block_arrays(self, so, ro, send_blocks, &s, &r, &n) < 0) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fn(self->g, s, r, n);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* The backend's collective, on this thread when its worker is idle: the raw collective
 * benchmarks compare a unit gather with. */
static PyObject *group_all_gather(GroupObject *self, PyObject *args, PyObject *kw) {
    return blocks_call(self, args, kw, 1, hsdp_all_gather);
}

static PyObject *group_all_to_all(GroupObject *self, PyObject *args, PyObject *kw) {
    return blocks_call(self, args, kw, self->g->size, hsdp_all_to_all);
}

/* The arrays and ranks of sendrecv(send, dest, recv, source); the ranks are checked by the
 * core (hsdp_sendrecv), which names the one outside the group. */
static int p2p_args(PyObject *args, PyObject *kw, PyObject **so, PyArrayObject **ra, int *dest, int *source) {
    static char *kwlist[] = {"send", "dest", "recv", "source", NULL};
    PyObject *ro;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiOi", kwlist, so, dest, &ro, source)) return -1;
    *ra = hsdp_py_writable_array(ro, "recv");
    if (!*ra) return -1;
    if (!PyArray_Check(*so) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)*so)) {
        PyErr_Format(PyExc_TypeError, "sendrecv: send must be a C-contiguous NumPy array");
        return -1;
    }
    return 0;
}

/* sendrecv(send, dest, recv, source): send to group rank dest while receiving exactly
 * recv.nbytes from group rank source, as one step, with the GIL released. */
static PyObject *group_sendrecv(GroupObject *self, PyObject *args, PyObject *kw) {
    PyObject *so;
    PyArrayObject *ra;
    int dest, source;
    if (p2p_args(args, kw, &so, &ra, &dest, &source) < 0) return NULL;
    if (self->p2p && self->p2p->pending)
        return PyErr_Format(PyExc_RuntimeError, "sendrecv: a started sendrecv on this group is not waited yet");
    const void *s = PyArray_DATA((PyArrayObject *)so);
    size_t sn = (size_t)PyArray_NBYTES((PyArrayObject *)so), rn = (size_t)PyArray_NBYTES(ra);
    void *r = PyArray_DATA(ra);
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_sendrecv(self->g, s, sn, dest, r, rn, source);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* sendrecv_start(...): the same, progressing while Python computes (MPI: on its worker
 * thread); the group keeps both arrays until sendrecv_wait(). One at a time per group. */
static PyObject *group_sendrecv_start(GroupObject *self, PyObject *args, PyObject *kw) {
    PyObject *so;
    PyArrayObject *ra;
    int dest, source;
    if (p2p_args(args, kw, &so, &ra, &dest, &source) < 0) return NULL;
    if (self->p2p && self->p2p->pending)
        return PyErr_Format(PyExc_RuntimeError, "sendrecv_start: the sendrecv started before is not waited yet "
                                                "(call sendrecv_wait() first)");
    if (!self->p2p) {
        self->p2p = PyMem_Calloc(1, sizeof *self->p2p);
        if (!self->p2p) return PyErr_NoMemory();
    }
    const void *s = PyArray_DATA((PyArrayObject *)so);
    size_t sn = (size_t)PyArray_NBYTES((PyArrayObject *)so), rn = (size_t)PyArray_NBYTES(ra);
    void *r = PyArray_DATA(ra);
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_sendrecv_start(self->p2p, self->g, s, sn, dest, r, rn, source);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_XSETREF(self->p2p_send, Py_NewRef(so));
    Py_XSETREF(self->p2p_recv, Py_NewRef((PyObject *)ra));
    Py_RETURN_NONE;
}

/* Device addresses are only meaningful to a backend with a device (device.h). */
static PyObject *no_device(GroupObject *self) {
    return PyErr_Format(PyExc_ValueError, "device addresses need a GPU backend (a backend with a device, such as "
                        "nccl); this group runs on '%s', which has host memory only", self->g->backend->name);
}

/* sendrecv_device / sendrecv_start_device(send_addr, dest, recv_addr, source, nbytes): the
 * same on device memory given as addresses (torch's data_ptr(); nccl), ordered after the
 * compute stream's work so far; the caller keeps both alive until the wait (started form:
 * sendrecv_wait() makes the compute stream wait for it). */
static PyObject *p2p_device(GroupObject *self, PyObject *args, int start) {
    unsigned long long s, r;
    int dest, source;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KiKin", &s, &dest, &r, &source, &n)) return NULL;
    if (!hsdp_backend_device(self->g->backend)) return no_device(self);
    if (n < 0) return PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", n);
    if (!s || !r) return PyErr_Format(PyExc_ValueError, "send and recv must be device addresses, not 0");
    if (self->p2p && self->p2p->pending)
        return PyErr_Format(PyExc_RuntimeError, "sendrecv: a started sendrecv on this group is not waited yet");
    if (start && !self->p2p) {
        self->p2p = PyMem_Calloc(1, sizeof *self->p2p);
        if (!self->p2p) return PyErr_NoMemory();
    }
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    if (start)
        st = hsdp_sendrecv_start(self->p2p, self->g, (const void *)(uintptr_t)s, (size_t)n, dest, (void *)(uintptr_t)r,
                                 (size_t)n, source);
    else
        st = hsdp_sendrecv(self->g, (const void *)(uintptr_t)s, (size_t)n, dest, (void *)(uintptr_t)r, (size_t)n,
                           source);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    if (start) {
        Py_CLEAR(self->p2p_send);
        Py_CLEAR(self->p2p_recv);
    }
    Py_RETURN_NONE;
}

static PyObject *group_sendrecv_device(GroupObject *self, PyObject *args) { return p2p_device(self, args, 0); }
static PyObject *group_sendrecv_start_device(GroupObject *self, PyObject *args) { return p2p_device(self, args, 1); }

/* sendrecv_wait(): ends the started sendrecv; its error, if any, is raised here. */
static PyObject *group_sendrecv_wait(GroupObject *self, PyObject *unused) {
    (void)unused;
    if (!self->p2p || !self->p2p->pending)
        return PyErr_Format(PyExc_RuntimeError, "sendrecv_wait: no sendrecv was started on this group");
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_gather_wait(self->p2p);
    Py_END_ALLOW_THREADS
    Py_CLEAR(self->p2p_send);
    Py_CLEAR(self->p2p_recv);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* A block layout from Python: (inner, step, ((count, stride), ...)), all in bytes. */
static int parse_blocks(PyObject *o, const char *what, hsdp_blocks *b) {
    PyObject *dims;
    memset(b, 0, sizeof *b);
    if (!PyArg_ParseTuple(o, "nnO", (Py_ssize_t *)&b->inner, (Py_ssize_t *)&b->step, &dims)) {
        PyErr_Format(PyExc_TypeError, "%s must be (inner, step, ((count, stride), ...)) in bytes", what);
        return -1;
    }
    PyObject *seq = PySequence_Fast(dims, "the dimensions must be a sequence of (count, stride)");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int rc = 0;
    if (n > HSDP_BLOCK_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s has %zd dimensions; at most %d", what, n, HSDP_BLOCK_DIMS);
        rc = -1;
    }
    for (Py_ssize_t k = 0; !rc && k < n; k++) {
        Py_ssize_t c, s;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "nn", &c, &s)) rc = -1;
        else if (c < 1 || s < 0) {
            PyErr_Format(PyExc_ValueError, "%s dimension %zd: count %zd must be >= 1 and stride %zd >= 0", what, k, c, s);
            rc = -1;
        } else {
            b->count[k] = (size_t)c;
            b->stride[k] = (size_t)s;
        }
    }
    b->ndims = (int)n;
    Py_DECREF(seq);
    if (!rc && ((Py_ssize_t)b->inner < 0 || (Py_ssize_t)b->step < 0)) {
        PyErr_Format(PyExc_ValueError, "%s: inner and step must be >= 0", what);
        rc = -1;
    }
    return rc;
}

/* all_to_all_blocks(send, send_layout, recv, recv_layout): the all-to-all between strided
 * layouts of two C-contiguous arrays, packed by the backend inside the transfer. */
static PyObject *group_all_to_all_blocks(GroupObject *self, PyObject *args) {
    PyObject *so, *sl, *ro, *rl;
    if (!PyArg_ParseTuple(args, "OOOO", &so, &sl, &ro, &rl)) return NULL;
    PyArrayObject *ra = hsdp_py_writable_array(ro, "recv");
    if (!ra) return NULL;
    if (!PyArray_Check(so) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)so))
        return PyErr_Format(PyExc_TypeError, "send must be a C-contiguous NumPy array");
    hsdp_blocks s, r;
    if (parse_blocks(sl, "send_layout", &s) < 0 || parse_blocks(rl, "recv_layout", &r) < 0) return NULL;
    size_t sspan = 0, rspan = 0;
    size_t sn = hsdp_blocks_bytes(&s, self->g->size, &sspan), rn = hsdp_blocks_bytes(&r, self->g->size, &rspan);
    if ((!sn && s.inner) || (!rn && r.inner)) return hsdp_py_raise(HSDP_EINVAL);
    if (sspan > (size_t)PyArray_NBYTES((PyArrayObject *)so) || rspan > (size_t)PyArray_NBYTES(ra))
        return PyErr_Format(PyExc_ValueError, "the layouts reach %zu bytes of send (%zd held) and %zu of recv (%zd held)",
                            sspan, PyArray_NBYTES((PyArrayObject *)so), rspan, PyArray_NBYTES(ra));
    hsdp_status st;
    const void *sp = PyArray_DATA((PyArrayObject *)so);
    void *rp = PyArray_DATA(ra);
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_all_to_all_blocks(self->g, sp, &s, rp, &r);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* The same collectives on device memory given as addresses (torch's data_ptr()), for a
 * backend whose buffers live on a device: the caller keeps the memory alive. The collective
 * runs after the work already on `stream` (the caller's current stream, an int handle; None:
 * the compute stream) and before its later work. */
static PyObject *device_call(GroupObject *self, PyObject *args, int send_blocks, block_collective fn) {
    unsigned long long s, r;
    Py_ssize_t block;
    PyObject *stream = Py_None;
    if (!PyArg_ParseTuple(args, "KKn|O", &s, &r, &block, &stream)) return NULL;
    void *handle = NULL;
    if (stream != Py_None) {
        handle = PyLong_AsVoidPtr(stream);
        if (!handle && PyErr_Occurred()) return NULL;
    }
    const hsdp_device_i *dev = hsdp_backend_device(self->g->backend);
    if (!dev) return no_device(self);
    if (block < 0) return PyErr_Format(PyExc_ValueError, "block_bytes must be >= 0, got %zd", block);
    if (!s || !r) return PyErr_Format(PyExc_ValueError, "send and recv must be device addresses, not 0");
    (void)send_blocks;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    if (dev->call_stream) dev->call_stream(handle, stream != Py_None);
    st = fn(self->g, (const void *)(uintptr_t)s, (void *)(uintptr_t)r, (size_t)block);
    if (dev->call_stream) dev->call_stream(NULL, 0);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *group_all_gather_device(GroupObject *self, PyObject *args) {
    return device_call(self, args, 1, hsdp_all_gather);
}

static PyObject *group_all_to_all_device(GroupObject *self, PyObject *args) {
    return device_call(self, args, self->g->size, hsdp_all_to_all);
}

static PyObject *group_repr(GroupObject *self) {
    return PyUnicode_FromFormat("ProcessGroup(backend='%s', rank=%d, size=%d)", self->g->backend->name,
                                self->g->rank, self->g->size);
}

static PyGetSetDef group_getset[] = {
    {"rank", (getter)group_get_rank, NULL, "this process's rank in the group", NULL},
    {"size", (getter)group_get_size, NULL, "number of ranks in the group", NULL},
    {"backend", (getter)group_get_backend, NULL, "the backend's registered name", NULL},
    {"device_info", (getter)group_get_device_info, NULL,
     "where this group's unsharded buffers live (see hsdp._C.device_info)", NULL},
    {"overlaps", (getter)group_get_overlaps, NULL,
     "whether started gathers progress while Python computes (MPI: its worker thread runs)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef group_methods[] = {
    {"barrier", (PyCFunction)group_barrier, METH_NOARGS, "Wait for every rank of the group."},
    {"split", (PyCFunction)(void (*)(void))group_split, METH_VARARGS | METH_KEYWORDS,
     "split(color, key): collective; ranks with equal color form a new group ordered by key."},
    {"broadcast", (PyCFunction)(void (*)(void))group_broadcast, METH_VARARGS | METH_KEYWORDS,
     "broadcast(array, root=0): in place, from the group rank `root`."},
    {"all_gather", (PyCFunction)(void (*)(void))group_all_gather, METH_VARARGS | METH_KEYWORDS,
     "all_gather(send, recv): the backend's collective on this thread (queued behind the worker when it is "
     "busy); recv receives size * send.nbytes bytes."},
    {"all_to_all", (PyCFunction)(void (*)(void))group_all_to_all, METH_VARARGS | METH_KEYWORDS,
     "all_to_all(send, recv): block j of send goes to rank j; block i of recv comes from rank i (send and recv "
     "hold size equal blocks and must not overlap)."},
    {"all_to_all_blocks", (PyCFunction)group_all_to_all_blocks, METH_VARARGS,
     "all_to_all_blocks(send, send_layout, recv, recv_layout): all_to_all between strided layouts, each "
     "(inner, step, ((count, stride), ...)) in bytes: block j is `inner` bytes at j * step plus the strides."},
    {"sendrecv", (PyCFunction)(void (*)(void))group_sendrecv, METH_VARARGS | METH_KEYWORDS,
     "sendrecv(send, dest, recv, source): send to group rank dest while receiving exactly recv.nbytes from "
     "group rank source (ring attention's step; peers pair up in program order)."},
    {"sendrecv_start", (PyCFunction)(void (*)(void))group_sendrecv_start, METH_VARARGS | METH_KEYWORDS,
     "sendrecv_start(send, dest, recv, source): sendrecv progressing while Python computes (MPI: its worker "
     "thread); the group holds both arrays until sendrecv_wait(). One at a time per group."},
    {"sendrecv_wait", (PyCFunction)group_sendrecv_wait, METH_NOARGS,
     "sendrecv_wait(): wait for the sendrecv started on this group; raises its error."},
    {"sendrecv_device", (PyCFunction)group_sendrecv_device, METH_VARARGS,
     "sendrecv_device(send_addr, dest, recv_addr, source, nbytes): sendrecv on device memory (nccl; untested on "
     "a GPU)."},
    {"sendrecv_start_device", (PyCFunction)group_sendrecv_start_device, METH_VARARGS,
     "sendrecv_start_device(send_addr, dest, recv_addr, source, nbytes): started on the side stream; "
     "sendrecv_wait() makes the compute stream wait for it (nccl; untested on a GPU)."},
    {"all_gather_device", (PyCFunction)group_all_gather_device, METH_VARARGS,
     "all_gather_device(send_addr, recv_addr, block_bytes, stream=None): all_gather on device memory (nccl), "
     "ordered on `stream` (a CUDA stream handle; None: the compute stream)."},
    {"all_to_all_device", (PyCFunction)group_all_to_all_device, METH_VARARGS,
     "all_to_all_device(send_addr, recv_addr, block_bytes, stream=None): all_to_all on device memory (nccl), "
     "ordered on `stream` (a CUDA stream handle; None: the compute stream)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot group_slots[] = {
    {Py_tp_new, group_new},
    {Py_tp_dealloc, group_dealloc},
    {Py_tp_traverse, group_traverse},
    {Py_tp_getset, group_getset},
    {Py_tp_methods, group_methods},
    {Py_tp_repr, group_repr},
    {Py_tp_doc, "ProcessGroup(backend='single'): the world group of a registered collective backend (see "
                "backends())."},
    {0, NULL},
};

PyType_Spec hsdp_py_group_spec = {"hsdp._C.ProcessGroup", sizeof(GroupObject), 0, HSDP_PY_TYPE_FLAGS, group_slots};
