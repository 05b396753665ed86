/* unit_type.c - Unit: one flat shard unit over a shard group. It owns the C unit (its shard),
 * holds the unsharded buffers while gathered or in flight, and binds its parameters: with
 * bind_attr (the NumPy adapter) it sets that attribute of every parameter to a zero-copy,
 * read-only NumPy view in one pass, so the hot path has no Python loop; without it the
 * Python adapter binds from buffers() and view_specs. Each hook makes a constant number of
 * calls here. */
#include "pyhsdp.h"  /* first: Python.h must precede system headers */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "unit_type.h"

static void unit_drop_buffers(UnitObject *self);

/* Waits out an in-flight gather whose result is not wanted (GIL released, the unit busy
 * meanwhile), so the worker lets go of the buffers before they are dropped. */
static void unit_drain(UnitObject *self) {
    if (!self->pending) return;
    HSDP_PY_BUSY_NOGIL(self->busy, (void)hsdp_unit_gather_wait(&self->u, &self->req));
    self->pending = 0;
}

static int unit_traverse(UnitObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->group);
    Py_VISIT(self->params);
    Py_VISIT(self->full);
    Py_VISIT(self->widened);
    Py_VISIT(self->wirebuf);
    return 0;
}

/* Breaks a cycle through the parameters (parameter -> module -> its unit -> parameters): the
 * only references that can close one. The group and the buffers stay until dealloc, which
 * needs them (the C unit's group, a gather in flight); a unit cleared this way binds nothing. */
static int unit_clear(UnitObject *self) {
    Py_CLEAR(self->params);
    return 0;
}

static void unit_dealloc(UnitObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    unit_drain(self); /* the worker may still write into our buffers */
    unit_drop_buffers(self);
    if (self->initialised) {
        /* a device share's free drains the side stream and calls cudaFree: not under the GIL */
        Py_BEGIN_ALLOW_THREADS
        hsdp_unit_free(&self->u);
        Py_END_ALLOW_THREADS
    }
    free(self->ndims);
    free(self->dims);
    free(self->dim_off);
    Py_XDECREF(self->group);
    Py_XDECREF(self->params);
    Py_XDECREF(self->bind_attr);
    Py_XDECREF(self->name);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int unit_check_idle(UnitObject *self) {
    if (self->busy || self->pending) {
        PyErr_Format(PyExc_RuntimeError, "unit %R has a gather in flight; wait for it first", self->name);
        return -1;
    }
    return 0;
}

static PyObject *unit_write(UnitObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"index", "array", "first", "src_dtype", NULL};
    Py_ssize_t index, first = 0;
    PyObject *obj, *src_dtype = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO|nO", kwlist, &index, &obj, &first, &src_dtype)) return NULL;
    if (unit_check_idle(self) < 0) return NULL;
    if (index < 0 || (size_t)index >= self->u.layout.nslots)
        return PyErr_Format(PyExc_IndexError, "parameter index %zd is out of range for unit %R of %zu parameters",
                            index, self->name, self->u.layout.nslots);
    if (first < 0) return PyErr_Format(PyExc_ValueError, "first must be >= 0, got %zd", first);
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OF(obj, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!a) return NULL;
    hsdp_dtype src;
    if (src_dtype != Py_None) {
        /* Raw bytes of a dtype NumPy lacks (bfloat16 as uint16, say): reinterpret. */
        if (hsdp_py_parse_dtype(src_dtype, &src) < 0) goto fail;
        if ((size_t)PyArray_ITEMSIZE(a) != hsdp_dtype_size(src)) {
            PyErr_Format(PyExc_ValueError, "src_dtype %s has %zu-byte elements but the array's are %zd bytes",
                         hsdp_dtype_name(src), hsdp_dtype_size(src), (Py_ssize_t)PyArray_ITEMSIZE(a));
            goto fail;
        }
    } else if (hsdp_py_array_dtype(a, &src) < 0) {
        goto fail;
    }
    size_t count = (size_t)PyArray_SIZE(a);
    hsdp_status st;
    /* busy: no gather may read the shard while it is written */
    HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_write(&self->u, (size_t)index, (size_t)first, count,
                                                         PyArray_DATA(a), src));
    Py_DECREF(a);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
fail:
    Py_DECREF(a);
    return NULL;
}

static PyObject *unit_read(UnitObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"index", "fd", "offset", "src_dtype", NULL};
    Py_ssize_t index;
    int fd;
    unsigned long long off;
    PyObject *src_dtype;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "niKO", kwlist, &index, &fd, &off, &src_dtype)) return NULL;
    if (unit_check_idle(self) < 0) return NULL;
    if (index < 0 || (size_t)index >= self->u.layout.nslots)
        return PyErr_Format(PyExc_IndexError, "parameter index %zd is out of range for unit %R of %zu parameters",
                            index, self->name, self->u.layout.nslots);
    hsdp_dtype src;
    if (hsdp_py_parse_dtype(src_dtype, &src) < 0) return NULL;
    size_t nread = 0;
    hsdp_status st;
    HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_read(&self->u, (size_t)index, fd, (uint64_t)off, src, &nread));
    if (st != HSDP_OK) return hsdp_py_raise(st);
    return PyLong_FromSize_t(nread);
}

/* Parameter i's view; its base is leases[0] (the gathered buffer's export) or leases[1] (the
 * converted one's). */
static PyObject *unit_view(UnitObject *self, size_t i, PyObject *const *leases) {
    const hsdp_slot *p = &self->u.layout.slots[i];
    hsdp_dtype ct = self->u.compute[i];
    PyObject *base;
    char *ptr;
    if (self->u.widen_offset[i] != SIZE_MAX) {
        base = leases[1];
        ptr = (char *)self->widened->p + self->u.widen_offset[i];
    } else {
        base = leases[0];
        ptr = (char *)self->full->p + p->offset;
    }
    PyArray_Descr *descr = PyArray_DescrFromType(hsdp_py_npy_type(ct));
    if (!descr) return NULL;
    /* Read-only: a write into an unsharded view would be lost at reshard, so it fails
     * loudly instead. */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, self->ndims[i], self->dims + self->dim_off[i], NULL,
                                         ptr, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (!arr) return NULL;
    if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(base)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* Sets every parameter's bind_attr (to a view, or to None); nothing when the adapter binds.
 * The views of one buffer share one leased export of it (a memoryview), returned when the
 * last of them dies: a view a user keeps past reshard keeps its buffer out of the pool. */
static int unit_bind(UnitObject *self, int unsharded) {
    if (!self->bind_attr || !self->params) return 0; /* no params once the GC cleared them */
    PyObject *leases[2] = {NULL, NULL};
    if (unsharded) {
        leases[0] = PyMemoryView_FromObject((PyObject *)self->full);
        if (!leases[0]) return -1;
        if (self->widened && !(leases[1] = PyMemoryView_FromObject((PyObject *)self->widened))) {
            Py_DECREF(leases[0]);
            return -1;
        }
    }
    int rc = 0;
    for (size_t i = 0; i < self->u.layout.nslots && rc == 0; i++) {
        PyObject *v = unsharded ? unit_view(self, i, leases) : Py_NewRef(Py_None);
        if (!v) {
            rc = -1;
            break;
        }
        rc = PyObject_SetAttr(PyTuple_GET_ITEM(self->params, (Py_ssize_t)i), self->bind_attr, v);
        Py_DECREF(v);
    }
    Py_XDECREF(leases[0]);
    Py_XDECREF(leases[1]);
    return rc;
}

/* The one place a unit takes and gives back its buffers, with the live-buffer counts. */
static int unit_take_buffers(UnitObject *self) {
    modstate *ms = hsdp_py_state(Py_TYPE(self));
    const hsdp_backend *b = self->u.group->backend;
    BufferObject *full = hsdp_py_buffer_take(ms, self->u.layout.total_bytes, b, self->device);
    if (!full) return -1;
    BufferObject *wide = NULL;
    if (self->u.widened_bytes) {
        wide = hsdp_py_buffer_take(ms, self->u.widened_bytes, b, self->device);
        if (!wide) {
            hsdp_py_buffer_give(ms, full);
            return -1;
        }
    }
    BufferObject *wire = NULL;
    size_t wire_bytes = hsdp_unit_wire_bytes(&self->u);
    if (wire_bytes) { /* from the pool too: a steady-state forward allocates nothing */
        wire = hsdp_py_buffer_take(ms, wire_bytes, b, self->device); /* NCCL: gathered on the device */
        if (!wire) {
            hsdp_py_buffer_give(ms, full);
            hsdp_py_buffer_give(ms, wide);
            return -1;
        }
    }
    self->full = full;
    self->widened = wide;
    self->wirebuf = wire;
    ms->live_buffers += (wide ? 2 : 1) + (wire ? 1 : 0);
    if (ms->live_buffers > ms->peak_live_buffers) ms->peak_live_buffers = ms->live_buffers;
    return 0;
}

/* The encodings are dequantized by the time the gather is waited: their buffer goes back. */
static void unit_drop_wire(UnitObject *self) {
    if (!self->wirebuf) return;
    modstate *ms = hsdp_py_state(Py_TYPE(self));
    BufferObject *w = self->wirebuf;
    self->wirebuf = NULL;
    ms->live_buffers -= 1;
    hsdp_py_buffer_give(ms, w);
}

static void unit_drop_buffers(UnitObject *self) {
    unit_drop_wire(self);
    if (!self->full) return;
    modstate *ms = hsdp_py_state(Py_TYPE(self));
    BufferObject *f = self->full, *w = self->widened;
    ms->live_buffers -= w ? 2 : 1;
    self->full = self->widened = NULL;
    hsdp_py_buffer_give(ms, f);
    hsdp_py_buffer_give(ms, w);
}

static int unit_start_impl(UnitObject *self, int sync);

/* Starts the gather into (pooled) buffers; the parameters stay unset until unit_finish. */
static int unit_start(UnitObject *self) { return unit_start_impl(self, 0); }

/* Gathers now (on this thread when the worker is idle); unit_finish then only binds. */
static int unit_start_sync(UnitObject *self) { return unit_start_impl(self, 1); }

static int unit_start_impl(UnitObject *self, int sync) {
    if (unit_take_buffers(self) < 0) return -1;
    void *full = self->full->p, *wide = self->widened ? self->widened->p : NULL;
    void *wire = self->wirebuf ? self->wirebuf->p : NULL;
    self->pending = 1;
    hsdp_status st;
    if (sync) /* complete when it returns: unit_finish's wait then returns at once */
        HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_gather_now_wire(&self->u, full, wide, wire, &self->req));
    else /* through the backend's asynchronous slots: only queued when it has them */
        HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_gather_start_wire(&self->u, full, wide, wire, &self->req));
    if (st != HSDP_OK) { /* nothing in flight */
        self->pending = 0;
        unit_drop_buffers(self);
        hsdp_py_raise(st);
        return -1;
    }
    return 0;
}

/* Waits for the in-flight gather (GIL released) and binds the parameter views. */
static int unit_finish(UnitObject *self) {
    hsdp_status st;
    HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_gather_wait(&self->u, &self->req));
    self->pending = 0;
    unit_drop_wire(self);
    if (st != HSDP_OK) {
        unit_drop_buffers(self);
        hsdp_py_raise(st);
        return -1;
    }
    if (unit_bind(self, 1) < 0) {
        /* Leave the unit sharded and every parameter unset rather than half-bound. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        (void)unit_bind(self, 0);
        unit_drop_buffers(self);
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return 0;
}

static PyObject *unit_start_unshard(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (self->busy) return PyErr_Format(PyExc_RuntimeError, "unit %R is busy on another thread", self->name);
    if (self->full) Py_RETURN_FALSE; /* already unsharded or in flight */
    if (unit_start(self) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *unit_wait(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (self->busy) return PyErr_Format(PyExc_RuntimeError, "unit %R is busy on another thread", self->name);
    if (!self->pending) Py_RETURN_NONE;
    if (unit_finish(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *unit_unshard(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (self->busy) return PyErr_Format(PyExc_RuntimeError, "unit %R is busy on another thread", self->name);
    if (!self->full && unit_start_sync(self) < 0) return NULL;
    if (self->pending && unit_finish(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *unit_reshard(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (self->busy) return PyErr_Format(PyExc_RuntimeError, "unit %R is busy on another thread", self->name);
    if (!self->full) Py_RETURN_NONE;
    int rc = 0;
    if (self->pending)
        unit_drain(self); /* a prefetch that was never used: its views were never bound */
    else
        rc = unit_bind(self, 0);
    unit_drop_buffers(self);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *unit_encode(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (unit_check_idle(self) < 0) return NULL;
    hsdp_status st;
    HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_encode(&self->u));
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* (max |error|, max |source|) over the quantized parameters: the source's values against
 * what the wire gives back, both read as float32 from a copy of this rank's unencoded shard
 * (None when nothing is quantized or the shard is already encoded). */
static PyObject *unit_wire_error(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (unit_check_idle(self) < 0) return NULL;
    hsdp_unit *u = &self->u;
    if (!u->quant || u->wire_encoded) Py_RETURN_NONE;
    double max_err = 0.0, max_abs = 0.0, sq_err = 0.0, sq_ref = 0.0;
    int ok = 1;
    for (size_t i = 0; ok && i < u->layout.nslots; i++) {
        size_t b, e, off;
        if (!u->quant[i] || !hsdp_layout_owned(&u->layout, i, u->s, &b, &e, &off)) continue;
        const hsdp_slot *p = &u->layout.slots[i];
        size_t n = (e - b) / hsdp_dtype_size(p->dtype), nb = (n + HSDP_WIRE_BLOCK - 1) / HSDP_WIRE_BLOCK;
        /* owned here, freed below */
        uint8_t *q = malloc(n ? n : 1);
        float *sc = malloc((nb ? nb : 1) * sizeof *sc), *ref = malloc((n ? n : 1) * sizeof *ref),
              *back = malloc((n ? n : 1) * sizeof *back);
        hsdp_status st = (q && sc && ref && back) ? HSDP_OK : HSDP_ENOMEM;
        if (st == HSDP_OK) st = hsdp_quantize_blocks(q, sc, u->shard + off, p->dtype, n);
        if (st == HSDP_OK) st = hsdp_cast(ref, HSDP_F32, u->shard + off, p->dtype, n);
        if (st == HSDP_OK) st = hsdp_dequantize_blocks(back, p->dtype, q, sc, n); /* in the storage dtype */
        if (st == HSDP_OK && p->dtype != HSDP_F32) {
            /* widen in place from the front half: back holds n storage-dtype elements */
            void *tmp = malloc(n * hsdp_dtype_size(p->dtype) + 1); /* owned here */
            if (!tmp) st = HSDP_ENOMEM;
            else {
                memcpy(tmp, back, n * hsdp_dtype_size(p->dtype));
                st = hsdp_cast(back, HSDP_F32, tmp, p->dtype, n);
                free(tmp);
            }
        }
        if (st == HSDP_OK) {
            for (size_t k = 0; k < n; k++) {
                double r = ref[k], d = (double)back[k] - r;
                if (r != r || d != d) continue; /* NaN stays NaN: not an error of the encoding */
                if (fabs(d) > max_err) max_err = fabs(d);
                if (fabs(r) > max_abs) max_abs = fabs(r);
                sq_err += d * d;
                sq_ref += r * r;
            }
        } else {
            if (st == HSDP_ENOMEM) PyErr_NoMemory();
            else hsdp_py_raise(st);
            ok = 0;
        }
        free(q);
        free(sc);
        free(ref);
        free(back);
    }
    if (!ok) return NULL;
    return Py_BuildValue("{sdsdsdsd}", "max_abs_error", max_err, "max_abs_value", max_abs, "sq_error", sq_err,
                         "sq_value", sq_ref);
}

static PyObject *unit_gather_times(UnitObject *self, PyObject *unused) {
    (void)unused;
    const hsdp_req *r = &self->req.req;
    return Py_BuildValue("(KKK)", (unsigned long long)r->submit_ns, (unsigned long long)r->start_ns,
                         (unsigned long long)r->end_ns);
}

static PyObject *unit_broadcast_shard(UnitObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"group", "root", NULL};
    PyObject *group;
    int root = 0;
    modstate *ms = hsdp_py_state(Py_TYPE(self));
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|i", kwlist, ms->group_type, &group, &root)) return NULL;
    if (unit_check_idle(self) < 0) return NULL;
    hsdp_status st = hsdp_unit_check_writable(&self->u);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    HSDP_PY_BUSY_NOGIL(self->busy,
                       st = hsdp_broadcast(((GroupObject *)group)->g, self->u.shard, self->u.layout.chunk_bytes, root));
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *unit_shard_bytes_view(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (!self->u.shard) { /* dropped once on the device: a copy read back from there */
        if (unit_check_idle(self) < 0) return NULL;
        npy_intp dim = (npy_intp)hsdp_unit_shard_bytes(&self->u); /* encoded, with a wire dtype */
        PyObject *copy = PyArray_SimpleNew(1, &dim, NPY_UINT8);
        if (!copy) return NULL;
        hsdp_status st;
        void *out = PyArray_DATA((PyArrayObject *)copy);
        HSDP_PY_BUSY_NOGIL(self->busy, st = hsdp_unit_read_shard(&self->u, out));
        if (st != HSDP_OK) {
            Py_DECREF(copy);
            return hsdp_py_raise(st);
        }
        PyArray_CLEARFLAGS((PyArrayObject *)copy, NPY_ARRAY_WRITEABLE);
        return copy;
    }
    npy_intp dim = (npy_intp)hsdp_unit_shard_bytes(&self->u);
    PyObject *arr = PyArray_New(&PyArray_Type, 1, &dim, NPY_UINT8, NULL, self->u.shard, 0,
                                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (!arr) return NULL;
    if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef((PyObject *)self)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

static PyObject *unit_buffers(UnitObject *self, PyObject *unused) {
    (void)unused;
    if (!self->full || self->pending) Py_RETURN_NONE;
    return Py_BuildValue("(OO)", (PyObject *)self->full, self->widened ? (PyObject *)self->widened : Py_None);
}

static PyObject *unit_repr(UnitObject *self) {
    return PyUnicode_FromFormat("Unit(%R, params=%zu, bytes=%zu, chunk=%zu, %s)", self->name, self->u.layout.nslots,
                                self->u.layout.total_bytes, self->u.layout.chunk_bytes,
                                self->full ? "unsharded" : "sharded");
}


static PyMethodDef unit_methods[] = {
    {"write", (PyCFunction)(void (*)(void))unit_write, METH_VARARGS | METH_KEYWORDS,
     "write(index, array, first=0, src_dtype=None): store this rank's part of elements [first, first+size) of a "
     "parameter, cast to its storage dtype."},
    {"read", (PyCFunction)(void (*)(void))unit_read, METH_VARARGS | METH_KEYWORDS,
     "read(index, fd, offset, src_dtype) -> bytes read: pread this rank's part of a parameter stored "
     "contiguously at `offset` in `src_dtype`, cast to its storage dtype."},
    {"unshard", (PyCFunction)unit_unshard, METH_NOARGS,
     "Gather the full buffer and point every bound parameter's _data at its view (waits for an in-flight "
     "gather)."},
    {"start_unshard", (PyCFunction)unit_start_unshard, METH_NOARGS,
     "Start the gather on the collective worker and return at once (True if one was started); wait() binds."},
    {"wait", (PyCFunction)unit_wait, METH_NOARGS, "Wait for an in-flight gather and bind the views."},
    {"gather_times", (PyCFunction)unit_gather_times, METH_NOARGS,
     "(submit, start, end) CLOCK_MONOTONIC ns of the last gather, for traces."},
    {"reshard", (PyCFunction)unit_reshard, METH_NOARGS,
     "Drop the full buffer (to the pool when no view holds it) and unset every parameter's _data."},
    {"broadcast_shard", (PyCFunction)(void (*)(void))unit_broadcast_shard, METH_VARARGS | METH_KEYWORDS,
     "broadcast_shard(group, root=0): copy the shard of group rank `root` to the group (replicas)."},
    {"shard_bytes", (PyCFunction)unit_shard_bytes_view, METH_NOARGS,
     "A read-only uint8 view of this rank's chunk (its float8 encoding once encoded; a copy read back from the "
     "GPU once the NCCL backend has dropped the host chunk after its first gather)."},
    {"encode", (PyCFunction)unit_encode, METH_NOARGS,
     "Encode the shard for the wire now (no-op without a wire dtype or when done); the first gather does it "
     "otherwise. The shard is fixed from then on."},
    {"wire_error", (PyCFunction)unit_wire_error, METH_NOARGS,
     "Before encode: {max_abs_error, max_abs_value, sq_error, sq_value} of this rank's quantized parameters "
     "against their stored values; None when nothing is quantized or the shard is encoded."},
    {"buffers", (PyCFunction)unit_buffers, METH_NOARGS,
     "(gathered, converted or None) while unsharded, else None: what an adapter that binds itself views."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot unit_slots[] = {
    {Py_tp_new, hsdp_py_unit_new},
    {Py_tp_dealloc, unit_dealloc},
    {Py_tp_traverse, unit_traverse},
    {Py_tp_clear, unit_clear},
    {Py_tp_getset, hsdp_py_unit_getset},
    {Py_tp_methods, unit_methods},
    {Py_tp_repr, unit_repr},
    {Py_tp_doc, "Unit(group, dtypes, shapes, params=None, name='', *, compute_dtypes=None, bind_attr=None, "
                "device='host', wire_dtype=None, wire_params=None): one flat shard unit over a shard group. "
                "wire_dtype='float8_e4m3fn' sends the parameters wire_params marks (default: every float32, "
                "float16 and bfloat16 one) block-scaled."},
    {0, NULL},
};

PyType_Spec hsdp_py_unit_spec = {"hsdp._C.Unit", sizeof(UnitObject), 0, HSDP_PY_TYPE_FLAGS, unit_slots};

