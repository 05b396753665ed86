/* buffer_type.c - _Buffer, one unsharded buffer, and the pool of idle ones. Every view of
 * its bytes is a lease (DLPack export, buffer-protocol export), taken when the view is made
 * and returned when its consumer lets go; the pool reuses a buffer only while no lease is
 * out ([Note: leases] in docs/design.md), so nobody's view sees its bytes change. The pool
 * keeps idle buffers (oldest first) so that a steady-state forward allocates nothing. */
#include "pyhsdp.h"  /* first: Python.h must precede system headers */
#include <stdatomic.h>
#include <string.h>

static BufferObject *buffer_new(modstate *ms, size_t n, const hsdp_backend *b, hsdp_device device) {
    void *p = hsdp_device_alloc(&ms->stats, b, device, n);
    if (!p) {
        /* hsdp_device_alloc recorded why; a missing slot is "not supported", else memory */
        int unsupported = device != HSDP_DEVICE_HOST && !hsdp_backend_device(b);
        return (BufferObject *)hsdp_py_raise(unsupported ? HSDP_EUNSUPPORTED : HSDP_ENOMEM);
    }
    BufferObject *buf = (BufferObject *)ms->buffer_type->tp_alloc(ms->buffer_type, 0); /* tracked by the GC */
    if (!buf) {
        hsdp_device_free(&ms->stats, b, device, p, n);
        return NULL;
    }
    buf->p = p;
    buf->n = n;
    buf->device = device;
    buf->backend = b;
    buf->stats = &ms->stats;
    buf->module = Py_NewRef(PyType_GetModule(ms->buffer_type));
    buf->leases = 0;
    return buf;
}

enum { INTO_POOL, OUT_TO_USE, OUT_TO_FREE };

/* Moves an idle buffer's bytes between the pooled and unsharded counters. A buffer leaving
 * the pool to be freed counts as unsharded only so that its dealloc balances: no peak. */
static void account_pooled(modstate *ms, size_t n, int how) {
    if (how == INTO_POOL) {
        atomic_fetch_sub(&ms->stats.unsharded_bytes, n);
        atomic_fetch_add(&ms->stats.pooled_bytes, n);
        return;
    }
    atomic_fetch_sub(&ms->stats.pooled_bytes, n);
    if (how == OUT_TO_USE)
        hsdp_stats_note_unsharded(&ms->stats, n);
    else
        atomic_fetch_add(&ms->stats.unsharded_bytes, n);
}

void hsdp_py_buffer_lease(BufferObject *b) {
    Py_INCREF(b);
    b->leases++;
}

void hsdp_py_buffer_return(BufferObject *b) {
    b->leases--;
    Py_DECREF(b);
}

/* Drops the pool's reference to a buffer leaving it to be freed. */
static void buffer_release(BufferObject *b) { Py_DECREF(b); }

/* Takes pool slot i out of the pool; `how` says whether it is to be used or freed. */
static BufferObject *pool_remove(modstate *ms, int i, int how) {
    BufferObject *b = ms->pool[i];
    memmove(ms->pool + i, ms->pool + i + 1, sizeof(ms->pool[0]) * (size_t)(ms->pool_n - i - 1));
    ms->pool_n--;
    account_pooled(ms, b->n, how);
    return b;
}

BufferObject *hsdp_py_buffer_take(modstate *ms, size_t n, const hsdp_backend *b, hsdp_device device) {
    if (n == 0) { /* a unit with no bytes (a root whose parameters all live in children) */
        if (!ms->empty && !(ms->empty = buffer_new(ms, 0, NULL, HSDP_DEVICE_HOST))) return NULL;
        return (BufferObject *)Py_NewRef((PyObject *)ms->empty);
    }
    /* The newest idle buffer of exactly this size first: units of one model repeat sizes. A
     * pooled buffer leased since (through a stale reference to it) is not reused under its view. */
    for (int i = ms->pool_n - 1; i >= 0; i--)
        if (ms->pool[i]->n == n && ms->pool[i]->device == device && ms->pool[i]->leases == 0 &&
            (device == HSDP_DEVICE_HOST || ms->pool[i]->backend == b))
            return pool_remove(ms, i, OUT_TO_USE);
    return buffer_new(ms, n, b, device);
}

void hsdp_py_buffer_give(modstate *ms, BufferObject *b) {
    if (!b) return;
    /* the compute stream may still read a device buffer: later gathers into it wait */
    hsdp_buffers_released(b->backend, b->device);
    /* idle: every view of it was returned (a Python reference to the object alone reads no
     * bytes: it must take a lease to) */
    if (b->leases == 0 && ms->pool_cap > 0 && b->n > 0) {
        if (ms->pool_n >= ms->pool_cap || ms->pool_n >= HSDP_POOL_SLOTS) {
            /* full: the oldest idle buffer goes, the newest (likeliest to be reused) stays */
            buffer_release(pool_remove(ms, 0, OUT_TO_FREE));
        }
        ms->pool[ms->pool_n++] = b;
        account_pooled(ms, b->n, INTO_POOL);
        return;
    }
    buffer_release(b); /* not pooled: a leased buffer lives on with its views, then is freed */
}

void hsdp_py_pool_trim(modstate *ms, int keep) {
    /* the oldest go first, as when a full pool takes a new buffer */
    while (ms->pool_n > keep) buffer_release(pool_remove(ms, 0, OUT_TO_FREE));
}

static int buffer_traverse(BufferObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    return 0;
}

static void buffer_dealloc(BufferObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->device != HSDP_DEVICE_HOST) {
        /* cudaFree synchronizes the device: not under the GIL, so other Python threads run */
        Py_BEGIN_ALLOW_THREADS
        hsdp_device_free(self->stats, self->backend, self->device, self->p, self->n);
        Py_END_ALLOW_THREADS
    } else {
        hsdp_device_free(self->stats, self->backend, self->device, self->p, self->n);
    }
    Py_XDECREF(self->module);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Read-only bytes of a host buffer, for adapters that build their own views (memoryview,
 * numpy.frombuffer), leased until the export is released. A write would be lost at
 * reshard, so none is allowed. */
static int buffer_getbuffer(BufferObject *self, Py_buffer *view, int flags) {
    if (self->device != HSDP_DEVICE_HOST) {
        PyErr_Format(PyExc_BufferError, "a %s buffer has no host bytes to export",
                     hsdp_device_label(self->backend, self->device));
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->p, (Py_ssize_t)self->n, 1, flags) < 0) return -1;
    self->leases++; /* the export holds the object itself (view->obj) */
    return 0;
}

static void buffer_releasebuffer(BufferObject *self, Py_buffer *view) {
    (void)view;
    self->leases--;
}

static PyObject *buffer_get_nbytes(BufferObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->n);
}
static PyObject *buffer_get_device(BufferObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(hsdp_device_label(self->backend, self->device));
}
static PyObject *buffer_get_address(BufferObject *self, void *c) {
    (void)c;
    return PyLong_FromVoidPtr(self->p);
}

static PyObject *buffer_get_leases(BufferObject *self, void *c) {
    (void)c;
    return PyLong_FromSsize_t(self->leases);
}

static PyGetSetDef buffer_getset[] = {
    {"leases", (getter)buffer_get_leases, NULL,
     "views of the bytes handed out and not yet returned (DLPack, buffer protocol): the pool reuses the buffer "
     "only at 0", NULL},
    {"nbytes", (getter)buffer_get_nbytes, NULL, "size in bytes", NULL},
    {"device", (getter)buffer_get_device, NULL, "'host', or the name of its backend's device ('cuda')", NULL},
    {"address", (getter)buffer_get_address, NULL, "the address of the first byte (64-byte aligned)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_traverse, buffer_traverse},
    {Py_bf_getbuffer, buffer_getbuffer},
    {Py_bf_releasebuffer, buffer_releasebuffer},
    {Py_tp_getset, buffer_getset},
    {Py_tp_methods, hsdp_py_dlpack_methods},
    {Py_tp_doc, "An unsharded buffer (internal): read-only bytes through the buffer protocol and DLPack."},
    {0, NULL},
};

PyType_Spec hsdp_py_buffer_spec = {"hsdp._C._Buffer", sizeof(BufferObject), 0, HSDP_PY_TYPE_FLAGS, buffer_slots};

/* ------------------------------------------------------------------ pool functions */

/* set_pool_capacity(n): keep up to n idle buffers for reuse; shrinking releases extras. */
static PyObject *mod_set_pool_capacity(PyObject *m, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 0 || n > HSDP_POOL_SLOTS)
        return PyErr_Format(PyExc_ValueError, "pool capacity must be in [0, %d], got %d", HSDP_POOL_SLOTS, n);
    modstate *ms = PyModule_GetState(m);
    ms->pool_cap = n;
    hsdp_py_pool_trim(ms, n);
    Py_RETURN_NONE;
}

/* One entry of pool_reserve's sizes: an int (host bytes) or (bytes, device name); *b is the
 * backend whose device that is (NULL for host memory). */
static int reserve_entry(PyObject *item, size_t *n, hsdp_device *dev, const hsdp_backend **b) {
    *dev = HSDP_DEVICE_HOST;
    *b = NULL;
    PyObject *size = item;
    if (PyTuple_Check(item)) {
        const char *name = NULL, *label = NULL;
        if (!PyArg_ParseTuple(item, "Os;pool_reserve entries are sizes or (size, device)", &size, &name)) return -1;
        if (hsdp_device_parse(name, dev, &label) < 0) {
            char choices[128];
            PyErr_Format(PyExc_ValueError, "device must be one of %s, got '%s'",
                         hsdp_device_choices(choices, sizeof choices), name);
            return -1;
        }
        if (*dev != HSDP_DEVICE_HOST) *b = hsdp_device_backend(label);
    }
    *n = PyLong_AsSize_t(size);
    return *n == (size_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* pool_reserve(sizes, capacity): make the pool hold (at least) one idle buffer per entry of
 * sizes (host bytes, or (bytes, device)), allocating what is missing, and keep up to capacity. The schedule calls it with
 * the buffers a steady-state forward of the recorded order needs, so no later forward
 * allocates. */
static PyObject *mod_pool_reserve(PyObject *m, PyObject *args) {
    modstate *ms = PyModule_GetState(m);
    PyObject *arg;
    int cap;
    if (!PyArg_ParseTuple(args, "Oi", &arg, &cap)) return NULL;
    PyObject *seq = PySequence_Fast(arg, "pool_reserve needs a sequence of sizes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (cap < n || cap > HSDP_POOL_SLOTS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "pool capacity must be in [%zd, %d], got %d", n, HSDP_POOL_SLOTS, cap);
    }
    ms->pool_cap = cap;
    /* Take every idle buffer out, then put back one per wanted size (reusing when it fits). */
    BufferObject *idle[HSDP_POOL_SLOTS];
    int nidle = ms->pool_n;
    memcpy(idle, ms->pool, sizeof(idle[0]) * (size_t)nidle);
    ms->pool_n = 0;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t want;
        hsdp_device dev;
        const hsdp_backend *owner;
        if (reserve_entry(PySequence_Fast_GET_ITEM(seq, i), &want, &dev, &owner) < 0) {
            rc = -1;
            break;
        }
        BufferObject *b = NULL;
        for (int k = 0; k < nidle; k++)
            if (idle[k] && idle[k]->n == want && idle[k]->device == dev && idle[k]->leases == 0 &&
                (dev == HSDP_DEVICE_HOST || idle[k]->backend == owner)) {
                b = idle[k];
                idle[k] = NULL;
                break;
            }
        if (!b) {
            /* device buffers come from the backend whose device that is (one per process) */
            b = buffer_new(ms, want, owner, dev);
            if (!b) {
                rc = -1;
                break;
            }
            account_pooled(ms, want, INTO_POOL); /* fresh buffers are accounted unsharded */
        }
        ms->pool[ms->pool_n++] = b;
    }
    for (int k = 0; k < nidle; k++)
        if (idle[k]) {
            account_pooled(ms, idle[k]->n, OUT_TO_FREE);
            buffer_release(idle[k]);
        }
    Py_DECREF(seq);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *mod_empty_pool(PyObject *m, PyObject *unused) {
    (void)unused;
    hsdp_py_pool_trim(PyModule_GetState(m), 0);
    Py_RETURN_NONE;
}

/* empty_aligned(nbytes): a uint8 array in memory from the same allocator as unsharded
 * buffers (64-byte aligned), so a benchmark's raw collective uses the same kind of memory. */
static PyObject *mod_empty_aligned(PyObject *m, PyObject *arg) {
    Py_ssize_t n = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (n < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", n);
        return NULL;
    }
    BufferObject *b = buffer_new(PyModule_GetState(m), (size_t)n, NULL, HSDP_DEVICE_HOST);
    if (!b) return NULL;
    npy_intp dim = (npy_intp)n;
    PyObject *arr = PyArray_New(&PyArray_Type, 1, &dim, NPY_UINT8, NULL, b->p, 0,
                                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE, NULL);
    if (!arr || PyArray_SetBaseObject((PyArrayObject *)arr, (PyObject *)b) < 0) {
        Py_XDECREF(arr);
        if (!arr) Py_DECREF(b);
        return NULL;
    }
    return arr;
}

PyMethodDef hsdp_py_pool_functions[] = {
    {"set_pool_capacity", mod_set_pool_capacity, METH_VARARGS, "Keep up to n idle unsharded buffers for reuse."},
    {"empty_pool", mod_empty_pool, METH_NOARGS, "Release every idle pooled buffer."},
    {"pool_reserve", mod_pool_reserve, METH_VARARGS,
     "pool_reserve(sizes, capacity): hold one idle buffer per entry of sizes, allocating what is missing, and keep "
     "up to capacity idle buffers."},
    {"empty_aligned", mod_empty_aligned, METH_O,
     "empty_aligned(nbytes): a writable uint8 array from hsdp's 64-byte-aligned allocator (counted as unsharded "
     "bytes)."},
    {NULL, NULL, 0, NULL},
};
