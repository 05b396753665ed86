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


typedef struct {
    PyObject_HEAD
    hsdp_unit u;
    int initialised;
    int busy;              /* a gather runs with the GIL released: refuse re-entry */
    PyObject *group;       /* strong: the shard group the unit gathers over */
    PyObject *params;      /* strong tuple: the parameters the unit binds, or None */
    PyObject *bind_attr;   /* interned str: the attribute set to each view, or NULL (adapter binds) */
    PyObject *name;        /* str */
    hsdp_device device;    /* where the unsharded buffers live */
    const char *device_label; /* its name: "host" or a device table's (static) */
    int *ndims;            /* owned */
    npy_intp *dims;        /* owned: all shapes laid end to end */
    size_t *dim_off;       /* owned: where slot i's dims start */
    BufferObject *full;    /* strong while unsharded or pending */
    BufferObject *widened; /* strong while unsharded or pending, when anything widens */
    BufferObject *wirebuf; /* strong while a gather with a float8 wire is in flight: its encodings */
    int pending;           /* a gather is in flight into full/widened (req) */
    hsdp_gather_req req;   /* the in-flight gather; embedded so starting one allocates nothing */
} UnitObject;

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

/* wire_dtype / wire_params of the constructor: which parameters travel as float8. */
static int unit_set_wire(UnitObject *self, PyObject *wire_dtype, PyObject *wire_params, hsdp_device dev,
                         const char *label) {
    hsdp_dtype wire;
    if (hsdp_py_parse_dtype(wire_dtype, &wire) < 0) return -1;
    /* a device's buffers are decoded by the device (NCCL: a kernel that must be loaded first) */
    if (dev != HSDP_DEVICE_HOST) {
        const hsdp_device_i *di = hsdp_backend_device(hsdp_device_backend(label));
        const char *missing = !di ? "no device table" : di->wire_missing ? di->wire_missing() : "";
        if (missing) {
            PyErr_Format(PyExc_NotImplementedError, "unit %R: wire_dtype=%s on device '%s' %s", self->name,
                         hsdp_dtype_name(wire), label,
                         *missing ? missing
                                  : "is not built: its dequantization after the gather is a host loop here, and "
                                    "this device has no decoder of its own");
            return -1;
        }
    }
    size_t n = self->u.layout.nslots;
    unsigned char *quant = calloc(n ? n : 1, 1); /* owned here, freed below */
    if (!quant) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = -1;
    PyObject *seq = NULL;
    if (wire_params == Py_None) {
        for (size_t i = 0; i < n; i++) {
            hsdp_dtype dt = self->u.layout.slots[i].dtype;
            quant[i] = dt == HSDP_F32 || dt == HSDP_F16 || dt == HSDP_BF16;
        }
    } else {
        seq = PySequence_Tuple(wire_params);
        if (!seq) goto done;
        if ((size_t)PyTuple_GET_SIZE(seq) != n) {
            PyErr_Format(PyExc_ValueError, "got %zd wire_params but unit %R has %zu parameters",
                         PyTuple_GET_SIZE(seq), self->name, n);
            goto done;
        }
        for (size_t i = 0; i < n; i++) {
            int t = PyObject_IsTrue(PyTuple_GET_ITEM(seq, (Py_ssize_t)i));
            if (t < 0) goto done;
            quant[i] = (unsigned char)t;
        }
    }
    hsdp_status st = hsdp_unit_set_wire(&self->u, wire, quant);
    if (st != HSDP_OK) {
        hsdp_py_raise(st);
        goto done;
    }
    rc = 0;
done:
    Py_XDECREF(seq);
    free(quant);
    return rc;
}

static PyObject *unit_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"group", "dtypes", "shapes", "params", "name", "compute_dtypes", "bind_attr", "device",
                             "wire_dtype", "wire_params", NULL};
    PyObject *group, *dtypes, *shapes, *params = Py_None, *name = NULL, *compute = Py_None;
    PyObject *wire_dtype = Py_None, *wire_params = Py_None;
    const char *bind_attr = NULL, *device = "host";
    modstate *ms = hsdp_py_state(type);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!OO|OU$OzsOO", kwlist, ms->group_type, &group, &dtypes, &shapes,
                                     &params, &name, &compute, &bind_attr, &device, &wire_dtype, &wire_params))
        return NULL;
    hsdp_device dev;
    const char *dev_label = NULL;
    char choices[128];
    if (hsdp_device_parse(device, &dev, &dev_label) < 0)
        return PyErr_Format(PyExc_ValueError, "device must be one of %s, got '%s'",
                            hsdp_device_choices(choices, sizeof choices), device);
    /* a group's backend allocates its device buffers: they must be its device's (a backend
     * with none refuses at the first gather, saying so) */
    const hsdp_device_i *own = hsdp_backend_device(((GroupObject *)group)->g->backend);
    if (dev != HSDP_DEVICE_HOST && own && strcmp(own->name, dev_label) != 0)
        return PyErr_Format(PyExc_ValueError, "device='%s', but this group's backend '%s' has device '%s'", dev_label,
                            ((GroupObject *)group)->g->backend->name, own->name);
    PyObject *dt_seq = PySequence_Tuple(dtypes), *sh_seq = NULL, *ct_seq = NULL;
    if (!dt_seq) return NULL;
    sh_seq = PySequence_Tuple(shapes);
    if (!sh_seq) goto fail_seq;
    Py_ssize_t n = PyTuple_GET_SIZE(dt_seq);
    if (PyTuple_GET_SIZE(sh_seq) != n) {
        PyErr_Format(PyExc_ValueError, "got %zd dtypes but %zd shapes", n, PyTuple_GET_SIZE(sh_seq));
        goto fail_seq;
    }
    if (compute != Py_None) {
        ct_seq = PySequence_Tuple(compute);
        if (!ct_seq) goto fail_seq;
        if (PyTuple_GET_SIZE(ct_seq) != n) {
            PyErr_Format(PyExc_ValueError, "got %zd compute_dtypes but %zd shapes", PyTuple_GET_SIZE(ct_seq), n);
            goto fail_seq;
        }
    }
    if (params != Py_None) {
        params = PySequence_Tuple(params);
        if (!params) goto fail_seq;
        if (PyTuple_GET_SIZE(params) != n) {
            PyErr_Format(PyExc_ValueError, "got %zd params but %zd shapes", PyTuple_GET_SIZE(params), n);
            Py_DECREF(params);
            goto fail_seq;
        }
    } else {
        Py_INCREF(params);
    }
    UnitObject *self = (UnitObject *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(params);
        goto fail_seq;
    }
    self->params = params;
    self->group = Py_NewRef(group);
    self->name = name ? Py_NewRef(name) : PyUnicode_FromString("");
    self->device = dev;
    self->device_label = dev_label;
    size_t cap = (size_t)(n ? n : 1);
    size_t *numels = calloc(cap, sizeof *numels);       /* owned here, freed below */
    hsdp_dtype *codes = calloc(cap, sizeof *codes);     /* owned here, freed below */
    hsdp_dtype *ccodes = calloc(cap, sizeof *ccodes);   /* owned here, freed below */
    self->ndims = calloc(cap, sizeof *self->ndims);
    self->dim_off = calloc(cap, sizeof *self->dim_off);
    size_t total_dims = 0;
    int ok = numels && codes && ccodes && self->ndims && self->dim_off && self->name;
    if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    if (ok && bind_attr) {
        if (params == Py_None) {
            PyErr_SetString(PyExc_ValueError, "bind_attr needs params: the objects whose attribute is set");
            ok = 0;
        } else if (!(self->bind_attr = PyUnicode_InternFromString(bind_attr))) {
            ok = 0;
        }
    }
    if (ok && dev != HSDP_DEVICE_HOST && self->bind_attr) {
        PyErr_Format(PyExc_ValueError, "bind_attr makes NumPy views, which need host memory; device='%s' needs an "
                     "adapter that binds itself (bind_attr=None)", device);
        ok = 0;
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        if (hsdp_py_parse_dtype(PyTuple_GET_ITEM(dt_seq, i), &codes[i]) < 0) ok = 0;
        ccodes[i] = codes[i];
        if (ok && ct_seq && hsdp_py_parse_dtype(PyTuple_GET_ITEM(ct_seq, i), &ccodes[i]) < 0) ok = 0;
        if (ok && self->bind_attr && hsdp_py_npy_type(ccodes[i]) < 0) {
            /* views made here are NumPy arrays: their dtype must be one NumPy has */
            PyErr_Format(PyExc_TypeError, "parameter %zd would be computed in %s, which has no NumPy type; pass a "
                         "compute dtype NumPy has (float32) or bind in the adapter (bind_attr=None)",
                         i, hsdp_dtype_name(ccodes[i]));
            ok = 0;
        }
        PyObject *shape = PyTuple_GET_ITEM(sh_seq, i);
        Py_ssize_t nd = ok ? PySequence_Length(shape) : -1;
        if (ok && (nd < 0 || nd > NPY_MAXDIMS)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "shape %zd has %zd dimensions", i, nd);
            ok = 0;
        }
        if (ok) {
            self->ndims[i] = (int)nd;
            self->dim_off[i] = total_dims;
            total_dims += (size_t)nd;
        }
    }
    if (ok) {
        self->dims = calloc(total_dims ? total_dims : 1, sizeof *self->dims);
        if (!self->dims) {
            PyErr_NoMemory();
            ok = 0;
        }
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *shape = PyTuple_GET_ITEM(sh_seq, i);
        size_t numel = 1;
        for (int d = 0; ok && d < self->ndims[i]; d++) {
            PyObject *item = PySequence_GetItem(shape, d);
            Py_ssize_t v = item ? PyNumber_AsSsize_t(item, PyExc_OverflowError) : -1;
            Py_XDECREF(item);
            if (v < 0) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "shape %zd has a negative dimension", i);
                ok = 0;
                break;
            }
            self->dims[self->dim_off[i] + (size_t)d] = (npy_intp)v;
            numel *= (size_t)v;
        }
        numels[i] = numel;
    }
    if (ok) {
        hsdp_status st =
            hsdp_unit_init(&self->u, numels, codes, ccodes, (size_t)n, ((GroupObject *)group)->g, &ms->stats);
        if (st != HSDP_OK) {
            hsdp_py_raise(st);
            ok = 0;
        } else {
            self->initialised = 1;
            const char *label = PyUnicode_AsUTF8(self->name); /* for timeout messages */
            if (label) snprintf(self->u.label, sizeof self->u.label, "%s", label);
            else PyErr_Clear();
        }
    }
    if (ok && wire_dtype != Py_None && unit_set_wire(self, wire_dtype, wire_params, dev, dev_label) < 0) ok = 0;
    if (ok && dev != HSDP_DEVICE_HOST && self->u.widened_bytes) {
        /* the conversion is a host cast: it cannot read device memory */
        PyErr_Format(PyExc_ValueError, "device='%s' needs every compute dtype equal to its storage dtype (the "
                     "conversion runs on the host)", device);
        ok = 0;
    }
    free(numels);
    free(codes);
    free(ccodes);
    Py_DECREF(dt_seq);
    Py_DECREF(sh_seq);
    Py_XDECREF(ct_seq);
    if (!ok) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;

fail_seq:
    Py_DECREF(dt_seq);
    Py_XDECREF(sh_seq);
    Py_XDECREF(ct_seq);
    return NULL;
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

static PyObject *size_tuple(const hsdp_unit *u, int which) {
    PyObject *t = PyTuple_New((Py_ssize_t)u->layout.nslots);
    if (!t) return NULL;
    for (size_t i = 0; i < u->layout.nslots; i++) {
        const hsdp_slot *p = &u->layout.slots[i];
        size_t v = which == 0 ? p->offset : p->nbytes;
        PyObject *o = PyLong_FromSize_t(v);
        if (!o) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, o);
    }
    return t;
}

static PyObject *unit_get_offsets(UnitObject *self, void *c) {
    (void)c;
    return size_tuple(&self->u, 0);
}
static PyObject *unit_get_nbytes(UnitObject *self, void *c) {
    (void)c;
    return size_tuple(&self->u, 1);
}
static PyObject *unit_get_dtypes(UnitObject *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New((Py_ssize_t)self->u.layout.nslots);
    for (size_t i = 0; t && i < self->u.layout.nslots; i++) {
        PyObject *o = hsdp_py_dtype_name_or_none((int)self->u.layout.slots[i].dtype);
        if (!o) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, o);
    }
    return t;
}
static PyObject *unit_get_compute(UnitObject *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New((Py_ssize_t)self->u.layout.nslots);
    for (size_t i = 0; t && i < self->u.layout.nslots; i++) {
        PyObject *o = hsdp_py_dtype_name_or_none((int)self->u.compute[i]);
        if (!o) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, o);
    }
    return t;
}
/* Per slot (buffer, byte offset): where its compute-dtype values are while unsharded;
 * buffer 0 is the gathered buffer, 1 the converted one. */
static PyObject *unit_get_view_specs(UnitObject *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New((Py_ssize_t)self->u.layout.nslots);
    for (size_t i = 0; t && i < self->u.layout.nslots; i++) {
        int conv = self->u.widen_offset[i] != SIZE_MAX;
        size_t off = conv ? self->u.widen_offset[i] : self->u.layout.slots[i].offset;
        PyObject *o = Py_BuildValue("(in)", conv, (Py_ssize_t)off);
        if (!o) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, o);
    }
    return t;
}
static PyObject *unit_get_device(UnitObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(self->device_label);
}
static PyObject *unit_get_total(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.layout.total_bytes);
}
static PyObject *unit_get_used(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.layout.used_bytes);
}
static PyObject *unit_get_chunk(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.layout.chunk_bytes);
}
static PyObject *unit_get_widened(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.widened_bytes);
}
static PyObject *unit_get_unsharded(UnitObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->full != NULL && !self->pending);
}
static PyObject *unit_get_gather_path(UnitObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(hsdp_share_kind(self->u.group, self->u.share));
}

static PyObject *unit_get_pending(UnitObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->pending);
}
static PyObject *unit_get_held(UnitObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->full != NULL);
}
static PyObject *unit_get_wire_dtype(UnitObject *self, void *c) {
    (void)c;
    if (!self->u.quant) Py_RETURN_NONE;
    return PyUnicode_FromString(hsdp_dtype_name(HSDP_F8E4M3));
}
static PyObject *unit_get_wire_bytes(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(hsdp_unit_wire_bytes(&self->u));
}
static PyObject *unit_get_wire_chunk(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.quant ? self->u.wire_chunk_bytes : self->u.layout.chunk_bytes);
}
static PyObject *unit_get_wire_params(UnitObject *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New((Py_ssize_t)self->u.layout.nslots);
    for (size_t i = 0; t && i < self->u.layout.nslots; i++)
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, PyBool_FromLong(self->u.quant && self->u.quant[i]));
    return t;
}
static PyObject *unit_get_encoded(UnitObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->u.wire_encoded);
}
static PyObject *unit_get_nparams(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.layout.nslots);
}

/* (gathered, converted or None) while unsharded; None otherwise. */
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

static PyGetSetDef unit_getset[] = {
    {"offsets", (getter)unit_get_offsets, NULL, "byte offset of each parameter in the flat buffer", NULL},
    {"nbytes", (getter)unit_get_nbytes, NULL, "storage bytes of each parameter", NULL},
    {"dtypes", (getter)unit_get_dtypes, NULL, "storage dtype of each parameter", NULL},
    {"total_bytes", (getter)unit_get_total, NULL, "flat buffer size, padded to a multiple of 64 * shard", NULL},
    {"used_bytes", (getter)unit_get_used, NULL, "end of the last parameter in the flat buffer", NULL},
    {"chunk_bytes", (getter)unit_get_chunk, NULL, "bytes this rank holds: total_bytes / shard", NULL},
    {"widened_bytes", (getter)unit_get_widened, NULL,
     "bytes of the converted buffer (slots whose compute dtype differs from their storage dtype)", NULL},
    {"compute_dtypes", (getter)unit_get_compute, NULL, "the dtype each parameter is computed in", NULL},
    {"view_specs", (getter)unit_get_view_specs, NULL,
     "per parameter (buffer, offset): 0 = gathered buffer, 1 = converted buffer", NULL},
    {"device", (getter)unit_get_device, NULL, "where the unsharded buffers live ('host' or 'cuda')", NULL},
    {"is_unsharded", (getter)unit_get_unsharded, NULL, "whether the full weights are ready and bound", NULL},
    {"is_pending", (getter)unit_get_pending, NULL, "whether a gather is in flight", NULL},
    {"gather_path", (getter)unit_get_gather_path, NULL,
     "'unset' before the first gather; then 'direct' (peers' shards read in place), 'device' (NCCL: gathered from "
     "the shard's device copy) or 'collective'", NULL},
    {"holds_buffers", (getter)unit_get_held, NULL, "unsharded or pending: the unit holds full buffers", NULL},
    {"nparams", (getter)unit_get_nparams, NULL, "number of parameters", NULL},
    {"wire_dtype", (getter)unit_get_wire_dtype, NULL,
     "'float8_e4m3fn' when some parameters travel block-scaled, else None", NULL},
    {"wire_params", (getter)unit_get_wire_params, NULL, "per parameter: whether it travels as float8", NULL},
    {"wire_chunk_bytes", (getter)unit_get_wire_chunk, NULL,
     "bytes each rank sends per gather (chunk_bytes without a wire dtype)", NULL},
    {"is_encoded", (getter)unit_get_encoded, NULL, "whether the shard is held as its float8 encoding", NULL},
    {"wire_bytes", (getter)unit_get_wire_bytes, NULL,
     "bytes of the buffer a gather receives the float8 encodings in (0 without a wire dtype)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

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
    {Py_tp_new, unit_new},
    {Py_tp_dealloc, unit_dealloc},
    {Py_tp_traverse, unit_traverse},
    {Py_tp_clear, unit_clear},
    {Py_tp_getset, unit_getset},
    {Py_tp_methods, unit_methods},
    {Py_tp_repr, unit_repr},
    {Py_tp_doc, "Unit(group, dtypes, shapes, params=None, name='', *, compute_dtypes=None, bind_attr=None, "
                "device='host', wire_dtype=None, wire_params=None): one flat shard unit over a shard group. "
                "wire_dtype='float8_e4m3fn' sends the parameters wire_params marks (default: every float32, "
                "float16 and bfloat16 one) block-scaled."},
    {0, NULL},
};

PyType_Spec hsdp_py_unit_spec = {"hsdp._C.Unit", sizeof(UnitObject), 0, HSDP_PY_TYPE_FLAGS, unit_slots};

