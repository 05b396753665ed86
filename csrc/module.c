/* module.c - the CPython extension hsdp._C: the only file that knows about Python. It turns
 * core statuses into exceptions, NumPy arrays into pointers, and releases the GIL around
 * every collective, copy and cast. Types are heap types bound to the module state (no
 * global mutable state): ProcessGroup, Unit, HSDPInferenceConfig, and the private buffer
 * and accounting-token types. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_20_API_VERSION
#include <numpy/arrayobject.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "exec.h"
#include "hsdp.h"

#define POOL_SLOTS 256

typedef struct {
    PyTypeObject *group_type;
    PyTypeObject *unit_type;
    PyTypeObject *buffer_type;
    PyTypeObject *config_type;
    PyTypeObject *token_type;
    PyObject *data_attr; /* interned "_data": the attribute a unit sets on its parameters */
    hsdp_stats stats;
    int mpi_we_init;
    /* Idle unsharded buffers kept for reuse, so that a steady-state forward allocates
     * nothing. Strong references; capacity set by the Python schedule from the recorded
     * order (0: no pooling). */
    struct BufferObject *pool[POOL_SLOTS];
    int pool_n, pool_cap;
    long live_buffers, peak_live_buffers;
    struct BufferObject *empty; /* strong: the one 0-byte buffer units with no bytes share */
} modstate;

static struct PyModuleDef hsdp_module;

static modstate *state_of_type(PyTypeObject *t) { return (modstate *)PyType_GetModuleState(t); }

/* Raises the Python exception that matches a core status, with the core's message. */
static PyObject *raise_status(hsdp_status st) {
    PyObject *exc;
    switch (st) {
    case HSDP_EINVAL: exc = PyExc_ValueError; break;
    case HSDP_ETYPE: exc = PyExc_TypeError; break;
    case HSDP_ENOMEM: exc = PyExc_MemoryError; break;
    case HSDP_EIO: exc = PyExc_OSError; break;
    case HSDP_EUNSUPPORTED: exc = PyExc_NotImplementedError; break;
    default: exc = PyExc_RuntimeError; break;
    }
    PyErr_SetString(exc, hsdp_last_error());
    return NULL;
}

/* ------------------------------------------------------------------ dtype helpers */

/* Any dtype spelling (name, NumPy dtype, torch dtype, hsdp DType) -> core dtype, through
 * hsdp.dtypes.as_dtype so that the aliases live in one place. */
static int parse_dtype(PyObject *obj, hsdp_dtype *out) {
    PyObject *mod = PyImport_ImportModule("hsdp.dtypes");
    if (!mod) return -1;
    PyObject *d = PyObject_CallMethod(mod, "as_dtype", "O", obj);
    Py_DECREF(mod);
    if (!d) return -1;
    const char *name = PyUnicode_AsUTF8(d);
    int rc = name && hsdp_dtype_from_name(name, out) == 0 ? 0 : -1;
    if (rc && !PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "unknown dtype %R", d);
    Py_DECREF(d);
    return rc;
}

static int npy_type_of(hsdp_dtype dt) {
    switch (dt) {
    case HSDP_F32: return NPY_FLOAT32;
    case HSDP_F16: return NPY_FLOAT16;
    case HSDP_F64: return NPY_FLOAT64;
    case HSDP_BOOL: return NPY_BOOL;
    case HSDP_U8: return NPY_UINT8;
    case HSDP_I8: return NPY_INT8;
    case HSDP_U16: return NPY_UINT16;
    case HSDP_I16: return NPY_INT16;
    case HSDP_U32: return NPY_UINT32;
    case HSDP_I32: return NPY_INT32;
    case HSDP_U64: return NPY_UINT64;
    case HSDP_I64: return NPY_INT64;
    default: return -1; /* bfloat16 / float8: NumPy has no such type */
    }
}

/* The core dtype of a NumPy array's elements; -1 with TypeError for anything else. */
static int dtype_of_array(PyArrayObject *a, hsdp_dtype *out) {
    int t = PyArray_TYPE(a);
    for (int d = 0; d < HSDP_DTYPE_COUNT; d++)
        if (npy_type_of((hsdp_dtype)d) == t) {
            *out = (hsdp_dtype)d;
            return 0;
        }
    PyErr_Format(PyExc_TypeError, "arrays of dtype %R are not supported", (PyObject *)PyArray_DESCR(a));
    return -1;
}

static PyObject *dtype_name_or_none(int code) {
    if (code < 0) Py_RETURN_NONE;
    return PyUnicode_FromString(hsdp_dtype_name((hsdp_dtype)code));
}

/* ------------------------------------------------------------------ accounting token */
/* Holds `n` bytes in the whole_bytes counter for as long as it lives, so the count follows
 * the objects that really hold the memory (ignored and unshardable parameters). */
typedef struct {
    PyObject_HEAD
    hsdp_stats *stats;
    PyObject *module; /* strong: keeps the stats alive */
    size_t n;
} TokenObject;

static PyObject *token_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nbytes", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n", kwlist, &n)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", n);
    TokenObject *self = (TokenObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->stats = &state_of_type(type)->stats;
    self->module = Py_NewRef(PyType_GetModule(type));
    self->n = (size_t)n;
    atomic_fetch_add(&self->stats->whole_bytes, self->n);
    return (PyObject *)self;
}

static void token_dealloc(TokenObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    atomic_fetch_sub(&self->stats->whole_bytes, self->n);
    Py_XDECREF(self->module);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef token_members[] = {
    {"nbytes", T_PYSSIZET, offsetof(TokenObject, n), READONLY, "bytes accounted"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot token_slots[] = {
    {Py_tp_new, token_new},
    {Py_tp_dealloc, token_dealloc},
    {Py_tp_members, token_members},
    {Py_tp_doc, "WholeBytes(nbytes): counts parameters kept whole while it lives."},
    {0, NULL},
};

static PyType_Spec token_spec = {"hsdp._C.WholeBytes", sizeof(TokenObject), 0, Py_TPFLAGS_DEFAULT,
                                 token_slots};

/* ------------------------------------------------------------------ buffer */
/* An unsharded buffer. NumPy views use it as their base, so the memory lives exactly as long
 * as the unit or any view needs it, and the accounting follows. */
typedef struct BufferObject {
    PyObject_HEAD
    void *p; /* owned: hsdp_buffer_free in dealloc */
    size_t n;
    hsdp_stats *stats;
    PyObject *module; /* strong */
} BufferObject;

/* A fresh buffer of n bytes from the core's allocator (accounted as unsharded). */
static BufferObject *buffer_new(modstate *ms, PyObject *module, size_t n) {
    void *p = hsdp_buffer_alloc(&ms->stats, n);
    if (!p) return (BufferObject *)raise_status(HSDP_ENOMEM);
    BufferObject *b = PyObject_New(BufferObject, ms->buffer_type);
    if (!b) {
        hsdp_buffer_free(&ms->stats, p, n);
        return NULL;
    }
    b->p = p;
    b->n = n;
    b->stats = &ms->stats;
    b->module = Py_NewRef(module);
    return b;
}

static BufferObject *buffer_create(modstate *ms, PyObject *module, size_t n) {
    if (n == 0) { /* a unit with no bytes (a root whose parameters all live in children) */
        if (!ms->empty && !(ms->empty = buffer_new(ms, module, 0))) return NULL;
        return (BufferObject *)Py_NewRef((PyObject *)ms->empty);
    }
    /* An idle pooled buffer of exactly this size first: units of one model repeat sizes. */
    for (int i = ms->pool_n - 1; i >= 0; i--) {
        BufferObject *b = ms->pool[i];
        if (b->n != n) continue;
        memmove(ms->pool + i, ms->pool + i + 1, sizeof(ms->pool[0]) * (size_t)(ms->pool_n - i - 1));
        ms->pool_n--;
        atomic_fetch_sub(&ms->stats.pooled_bytes, n);
        size_t now = atomic_fetch_add(&ms->stats.unsharded_bytes, n) + n;
        size_t peak = atomic_load(&ms->stats.peak_unsharded_bytes);
        while (now > peak && !atomic_compare_exchange_weak(&ms->stats.peak_unsharded_bytes, &peak, now)) {
        }
        return b;
    }
    return buffer_new(ms, module, n);
}

/* Gives a unit's buffer back: to the pool when nothing else (no NumPy view a user kept)
 * refers to it and the pool has room, else it is released. Steals the reference. */
static void buffer_release(modstate *ms, BufferObject *b) {
    if (!b) return;
    if (Py_REFCNT(b) == 1 && ms->pool_cap > 0 && b->n > 0) {
        if (ms->pool_n >= ms->pool_cap || ms->pool_n >= POOL_SLOTS) {
            /* full: the oldest idle buffer goes, the newest (likeliest to be reused) stays */
            BufferObject *old = ms->pool[0];
            memmove(ms->pool, ms->pool + 1, sizeof(ms->pool[0]) * (size_t)(ms->pool_n - 1));
            ms->pool_n--;
            atomic_fetch_sub(&ms->stats.pooled_bytes, old->n);
            atomic_fetch_add(&ms->stats.unsharded_bytes, old->n);
            Py_DECREF(old);
        }
        ms->pool[ms->pool_n++] = b;
        atomic_fetch_sub(&ms->stats.unsharded_bytes, b->n);
        atomic_fetch_add(&ms->stats.pooled_bytes, b->n);
        return;
    }
    Py_DECREF(b);
}

static void pool_trim(modstate *ms, int keep) {
    while (ms->pool_n > keep) {
        BufferObject *b = ms->pool[--ms->pool_n];
        /* back to "unsharded" so buffer_dealloc's accounting balances */
        atomic_fetch_sub(&ms->stats.pooled_bytes, b->n);
        atomic_fetch_add(&ms->stats.unsharded_bytes, b->n);
        Py_DECREF(b);
    }
}

static void buffer_dealloc(BufferObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    hsdp_buffer_free(self->stats, self->p, self->n);
    Py_XDECREF(self->module);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_doc, "An unsharded buffer (internal)."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {"hsdp._C._Buffer", sizeof(BufferObject), 0, Py_TPFLAGS_DEFAULT,
                                  buffer_slots};

/* ------------------------------------------------------------------ process group */
typedef struct {
    PyObject_HEAD
    hsdp_group *g; /* owned: hsdp_group_free in dealloc */
    PyObject *module;
} GroupObject;

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
    if (strcmp(backend, "single") == 0) {
        st = hsdp_world_single(&g);
    } else if (strcmp(backend, "mpi") == 0) {
        int we_init = 0;
        Py_BEGIN_ALLOW_THREADS
        st = hsdp_world_mpi(&g, &we_init);
        Py_END_ALLOW_THREADS
        if (we_init) state_of_type(type)->mpi_we_init = 1;
    } else if (strcmp(backend, "nccl") == 0) {
        PyErr_SetString(PyExc_NotImplementedError,
                        "the NCCL backend is not built yet; use backend='mpi' (CPU ranks) for now");
        return NULL;
    } else {
        return PyErr_Format(PyExc_ValueError, "unknown backend '%s'; expected 'single' or 'mpi'", backend);
    }
    if (st != HSDP_OK) return raise_status(st);
    return group_wrap(type, g);
}

static void group_dealloc(GroupObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    hsdp_group_free(self->g);
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
    return PyUnicode_FromString(self->g->ops->name);
}

static PyObject *group_barrier(GroupObject *self, PyObject *unused) {
    (void)unused;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_barrier(self->g);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return raise_status(st);
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
    if (st != HSDP_OK) return raise_status(st);
    return group_wrap(Py_TYPE(self), out);
}

/* A writable C-contiguous array, or NULL with an error naming the parameter. */
static PyArrayObject *contiguous_writable(PyObject *obj, const char *what) {
    if (!PyArray_Check(obj))
        return (PyArrayObject *)PyErr_Format(PyExc_TypeError, "%s must be a NumPy array, got %s", what,
                                             Py_TYPE(obj)->tp_name);
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISWRITEABLE(a))
        return (PyArrayObject *)PyErr_Format(PyExc_ValueError, "%s must be a writable C-contiguous array", what);
    return a;
}

static PyObject *group_broadcast(GroupObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"array", "root", NULL};
    PyObject *obj;
    int root = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|i", kwlist, &obj, &root)) return NULL;
    PyArrayObject *a = contiguous_writable(obj, "array");
    if (!a) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_broadcast(self->g, PyArray_DATA(a), (size_t)PyArray_NBYTES(a), root);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return raise_status(st);
    Py_RETURN_NONE;
}

/* The raw collective on caller-owned arrays: what benchmarks compare a unit gather with. */
static PyObject *group_all_gather(GroupObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"send", "recv", NULL};
    PyObject *so, *ro;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO", kwlist, &so, &ro)) return NULL;
    PyArrayObject *r = contiguous_writable(ro, "recv");
    if (!r) return NULL;
    if (!PyArray_Check(so) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)so))
        return PyErr_Format(PyExc_TypeError, "send must be a C-contiguous NumPy array");
    size_t n = (size_t)PyArray_NBYTES((PyArrayObject *)so);
    if ((size_t)PyArray_NBYTES(r) != n * (size_t)self->g->size)
        return PyErr_Format(PyExc_ValueError, "recv holds %zd bytes; a gather of %zu bytes over %d ranks needs %zu",
                            PyArray_NBYTES(r), n, self->g->size, n * (size_t)self->g->size);
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_all_gather_direct(self->g, PyArray_DATA((PyArrayObject *)so), PyArray_DATA(r), n);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *group_repr(GroupObject *self) {
    return PyUnicode_FromFormat("ProcessGroup(backend='%s', rank=%d, size=%d)", self->g->ops->name, self->g->rank,
                                self->g->size);
}

static PyGetSetDef group_getset[] = {
    {"rank", (getter)group_get_rank, NULL, "this process's rank in the group", NULL},
    {"size", (getter)group_get_size, NULL, "number of ranks in the group", NULL},
    {"backend", (getter)group_get_backend, NULL, "'single' or 'mpi'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef group_methods[] = {
    {"barrier", (PyCFunction)group_barrier, METH_NOARGS, "Wait for every rank of the group."},
    {"split", (PyCFunction)(void (*)(void))group_split, METH_VARARGS | METH_KEYWORDS,
     "split(color, key): collective; ranks with equal color form a new group ordered by key."},
    {"broadcast", (PyCFunction)(void (*)(void))group_broadcast, METH_VARARGS | METH_KEYWORDS,
     "broadcast(array, root=0): in place, from the group rank `root`."},
    {"all_gather", (PyCFunction)(void (*)(void))group_all_gather, METH_VARARGS | METH_KEYWORDS,
     "all_gather(send, recv): the backend's raw collective on this thread (the worker held idle); recv "
     "receives size * send.nbytes bytes."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot group_slots[] = {
    {Py_tp_new, group_new},
    {Py_tp_dealloc, group_dealloc},
    {Py_tp_getset, group_getset},
    {Py_tp_methods, group_methods},
    {Py_tp_repr, group_repr},
    {Py_tp_doc, "ProcessGroup(backend='single'|'mpi'): the world group of a collective backend."},
    {0, NULL},
};

static PyType_Spec group_spec = {"hsdp._C.ProcessGroup", sizeof(GroupObject), 0, Py_TPFLAGS_DEFAULT,
                                 group_slots};

/* ------------------------------------------------------------------ unit */
typedef struct {
    PyObject_HEAD
    hsdp_unit u;
    int initialised;
    int busy;              /* a gather runs with the GIL released: refuse re-entry */
    PyObject *group;       /* strong: the shard group the unit gathers over */
    PyObject *params;      /* strong tuple: the objects whose `_data` the unit sets, or None */
    PyObject *name;        /* str */
    int *ndims;            /* owned */
    npy_intp *dims;        /* owned: all shapes laid end to end */
    size_t *dim_off;       /* owned: where slot i's dims start */
    BufferObject *full;    /* strong while unsharded or pending */
    BufferObject *widened; /* strong while unsharded or pending, when anything widens */
    int pending;           /* a gather is in flight into full/widened (req) */
    hsdp_gather_req req;   /* the in-flight gather; embedded so starting one allocates nothing */
} UnitObject;

/* Waits out an in-flight gather whose result is not wanted (GIL released, the unit busy
 * meanwhile), so the worker lets go of the buffers before they are dropped. */
static void unit_drain(UnitObject *self) {
    if (!self->pending) return;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    (void)hsdp_unit_gather_wait(&self->u, &self->req);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    self->pending = 0;
}

static void unit_dealloc(UnitObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    unit_drain(self); /* the worker may still write into our buffers */
    Py_CLEAR(self->full);
    Py_CLEAR(self->widened);
    if (self->initialised) hsdp_unit_free(&self->u);
    free(self->ndims);
    free(self->dims);
    free(self->dim_off);
    Py_XDECREF(self->group);
    Py_XDECREF(self->params);
    Py_XDECREF(self->name);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *unit_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"group", "dtypes", "shapes", "params", "name", NULL};
    PyObject *group, *dtypes, *shapes, *params = Py_None, *name = NULL;
    modstate *ms = state_of_type(type);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!OO|OU", kwlist, ms->group_type, &group, &dtypes, &shapes, &params,
                                     &name))
        return NULL;
    PyObject *dt_seq = PySequence_Tuple(dtypes), *sh_seq = NULL;
    if (!dt_seq) return NULL;
    sh_seq = PySequence_Tuple(shapes);
    if (!sh_seq) goto fail_seq;
    Py_ssize_t n = PyTuple_GET_SIZE(dt_seq);
    if (PyTuple_GET_SIZE(sh_seq) != n) {
        PyErr_Format(PyExc_ValueError, "got %zd dtypes but %zd shapes", n, PyTuple_GET_SIZE(sh_seq));
        goto fail_seq;
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
    size_t cap = (size_t)(n ? n : 1);
    size_t *numels = calloc(cap, sizeof *numels);       /* owned here, freed below */
    hsdp_dtype *codes = calloc(cap, sizeof *codes);     /* owned here, freed below */
    self->ndims = calloc(cap, sizeof *self->ndims);
    self->dim_off = calloc(cap, sizeof *self->dim_off);
    size_t total_dims = 0;
    int ok = numels && codes && self->ndims && self->dim_off && self->name;
    if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        if (parse_dtype(PyTuple_GET_ITEM(dt_seq, i), &codes[i]) < 0) ok = 0;
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
        hsdp_status st = hsdp_unit_init(&self->u, numels, codes, (size_t)n, ((GroupObject *)group)->g, &ms->stats);
        if (st != HSDP_OK) {
            raise_status(st);
            ok = 0;
        } else {
            self->initialised = 1;
        }
    }
    free(numels);
    free(codes);
    Py_DECREF(dt_seq);
    Py_DECREF(sh_seq);
    if (!ok) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;

fail_seq:
    Py_DECREF(dt_seq);
    Py_XDECREF(sh_seq);
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
        if (parse_dtype(src_dtype, &src) < 0) goto fail;
        if ((size_t)PyArray_ITEMSIZE(a) != hsdp_dtype_size(src)) {
            PyErr_Format(PyExc_ValueError, "src_dtype %s has %zu-byte elements but the array's are %zd bytes",
                         hsdp_dtype_name(src), hsdp_dtype_size(src), (Py_ssize_t)PyArray_ITEMSIZE(a));
            goto fail;
        }
    } else if (dtype_of_array(a, &src) < 0) {
        goto fail;
    }
    size_t count = (size_t)PyArray_SIZE(a);
    hsdp_status st;
    self->busy = 1; /* no gather may read the shard while it is written */
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_unit_write(&self->u, (size_t)index, (size_t)first, count, PyArray_DATA(a), src);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(a);
    if (st != HSDP_OK) return raise_status(st);
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
    if (parse_dtype(src_dtype, &src) < 0) return NULL;
    size_t nread = 0;
    hsdp_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_unit_read(&self->u, (size_t)index, fd, (uint64_t)off, src, &nread);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (st != HSDP_OK) return raise_status(st);
    return PyLong_FromSize_t(nread);
}

static PyObject *unit_view(UnitObject *self, size_t i) {
    const hsdp_slot *p = &self->u.layout.slots[i];
    hsdp_dtype ct = hsdp_dtype_compute(p->dtype);
    BufferObject *base;
    char *ptr;
    if (self->u.widen_offset[i] != SIZE_MAX) {
        base = self->widened;
        ptr = (char *)base->p + self->u.widen_offset[i];
    } else {
        base = self->full;
        ptr = (char *)base->p + p->offset;
    }
    PyArray_Descr *descr = PyArray_DescrFromType(npy_type_of(ct));
    if (!descr) return NULL;
    /* Read-only: a write into an unsharded view would be lost at reshard, so it fails
     * loudly instead. */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, self->ndims[i], self->dims + self->dim_off[i], NULL,
                                         ptr, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (!arr) return NULL;
    if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef((PyObject *)base)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* Sets every bound parameter's `_data` (to a view, or to None). */
static int unit_bind(UnitObject *self, int unsharded) {
    if (self->params == Py_None) return 0;
    PyObject *data_attr = state_of_type(Py_TYPE(self))->data_attr;
    for (size_t i = 0; i < self->u.layout.nslots; i++) {
        PyObject *v = unsharded ? unit_view(self, i) : Py_NewRef(Py_None);
        if (!v) return -1;
        int rc = PyObject_SetAttr(PyTuple_GET_ITEM(self->params, (Py_ssize_t)i), data_attr, v);
        Py_DECREF(v);
        if (rc < 0) return -1;
    }
    return 0;
}

static void unit_drop_buffers(UnitObject *self) {
    modstate *ms = state_of_type(Py_TYPE(self));
    BufferObject *f = self->full, *w = self->widened;
    self->full = self->widened = NULL;
    buffer_release(ms, f);
    buffer_release(ms, w);
}

static int unit_start_impl(UnitObject *self, int sync);

/* Starts the gather into (pooled) buffers; the parameters stay unset until unit_finish. */
static int unit_start(UnitObject *self) { return unit_start_impl(self, 0); }

/* Gathers now (on this thread when the worker is idle); unit_finish then only binds. */
static int unit_start_sync(UnitObject *self) { return unit_start_impl(self, 1); }

static int unit_start_impl(UnitObject *self, int sync) {
    modstate *ms = state_of_type(Py_TYPE(self));
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    BufferObject *full = buffer_create(ms, module, self->u.layout.total_bytes);
    if (!full) return -1;
    BufferObject *wide = NULL;
    if (self->u.widened_bytes) {
        wide = buffer_create(ms, module, self->u.widened_bytes);
        if (!wide) {
            buffer_release(ms, full);
            return -1;
        }
    }
    self->full = full;
    self->widened = wide;
    ms->live_buffers += wide ? 2 : 1;
    if (ms->live_buffers > ms->peak_live_buffers) ms->peak_live_buffers = ms->live_buffers;
    self->pending = 1;
    hsdp_status st;
    if (sync) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        st = hsdp_unit_gather_now(&self->u, full->p, wide ? wide->p : NULL, &self->req);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        /* the request is complete and waited: mark it done so unit_finish's wait returns at once */
        if (st == HSDP_OK) atomic_store(&self->req.task.state, HSDP_TASK_DONE);
    } else {
        /* With a worker this only queues; without one it gathers and widens inline. */
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        st = hsdp_unit_gather_start(&self->u, full->p, wide ? wide->p : NULL, &self->req);
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    if (st != HSDP_OK) { /* nothing in flight */
        self->pending = 0;
        ms->live_buffers -= wide ? 2 : 1;
        unit_drop_buffers(self);
        raise_status(st);
        return -1;
    }
    return 0;
}

/* Waits for the in-flight gather (GIL released) and binds the parameter views. */
static int unit_finish(UnitObject *self) {
    hsdp_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_unit_gather_wait(&self->u, &self->req);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    self->pending = 0;
    if (st != HSDP_OK) {
        modstate *ms = state_of_type(Py_TYPE(self));
        ms->live_buffers -= self->widened ? 2 : 1;
        unit_drop_buffers(self);
        raise_status(st);
        return -1;
    }
    if (unit_bind(self, 1) < 0) {
        /* Leave the unit sharded and every parameter unset rather than half-bound. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        (void)unit_bind(self, 0);
        modstate *ms = state_of_type(Py_TYPE(self));
        ms->live_buffers -= self->widened ? 2 : 1;
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
    modstate *ms = state_of_type(Py_TYPE(self));
    ms->live_buffers -= self->widened ? 2 : 1;
    unit_drop_buffers(self);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *unit_gather_times(UnitObject *self, PyObject *unused) {
    (void)unused;
    uint64_t a, b, c;
    hsdp_unit_gather_times(&self->req, &a, &b, &c);
    return Py_BuildValue("(KKK)", (unsigned long long)a, (unsigned long long)b, (unsigned long long)c);
}

static PyObject *unit_broadcast_shard(UnitObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"group", "root", NULL};
    PyObject *group;
    int root = 0;
    modstate *ms = state_of_type(Py_TYPE(self));
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|i", kwlist, ms->group_type, &group, &root)) return NULL;
    if (unit_check_idle(self) < 0) return NULL;
    hsdp_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_broadcast(((GroupObject *)group)->g, self->u.shard, self->u.layout.chunk_bytes, root);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (st != HSDP_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *unit_shard_bytes_view(UnitObject *self, PyObject *unused) {
    (void)unused;
    npy_intp dim = (npy_intp)self->u.layout.chunk_bytes;
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
        PyObject *o = dtype_name_or_none((int)self->u.layout.slots[i].dtype);
        if (!o) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, o);
    }
    return t;
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
static PyObject *unit_get_pending(UnitObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->pending);
}
static PyObject *unit_get_held(UnitObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->full != NULL);
}
static PyObject *unit_get_nparams(UnitObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(self->u.layout.nslots);
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
    {"widened_bytes", (getter)unit_get_widened, NULL, "float32 bytes for bfloat16/float8 while unsharded", NULL},
    {"is_unsharded", (getter)unit_get_unsharded, NULL, "whether the full weights are ready and bound", NULL},
    {"is_pending", (getter)unit_get_pending, NULL, "whether a gather is in flight", NULL},
    {"holds_buffers", (getter)unit_get_held, NULL, "unsharded or pending: the unit holds full buffers", NULL},
    {"nparams", (getter)unit_get_nparams, NULL, "number of parameters", NULL},
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
    {"shard_bytes", (PyCFunction)unit_shard_bytes_view, METH_NOARGS, "A read-only uint8 view of this rank's chunk."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot unit_slots[] = {
    {Py_tp_new, unit_new},
    {Py_tp_dealloc, unit_dealloc},
    {Py_tp_getset, unit_getset},
    {Py_tp_methods, unit_methods},
    {Py_tp_repr, unit_repr},
    {Py_tp_doc, "Unit(group, dtypes, shapes, params=None, name=''): one flat shard unit over a shard group."},
    {0, NULL},
};

static PyType_Spec unit_spec = {"hsdp._C.Unit", sizeof(UnitObject), 0, Py_TPFLAGS_DEFAULT, unit_slots};

/* ------------------------------------------------------------------ HSDPInferenceConfig */
typedef struct {
    PyObject_HEAD
    int enabled;
    int replicate;
    int shard;
    int param_dtype; /* hsdp_dtype, or -1 for None */
    int reduce_dtype;
    int output_dtype;
    int reshard_after_forward;
    int prefetch_depth;          /* units gathered ahead of the one computing (0: none) */
    long long max_unsharded_bytes; /* cap on bytes in flight + unsharded; -1 = None */
} ConfigObject;

/* None -> -1; else a floating dtype code. `what` names the parameter in errors. */
static int parse_optional_float_dtype(PyObject *obj, const char *what, int *out) {
    if (obj == Py_None) {
        *out = -1;
        return 0;
    }
    hsdp_dtype dt;
    if (parse_dtype(obj, &dt) < 0) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_Format(PyExc_TypeError, "%s: %S", what, ev ? ev : Py_None);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return -1;
    }
    if (!hsdp_dtype_is_float(dt)) {
        PyErr_Format(PyExc_ValueError, "%s must be a floating-point dtype or None, got %s", what, hsdp_dtype_name(dt));
        return -1;
    }
    *out = (int)dt;
    return 0;
}

static int config_check_sizes(int replicate, int shard) {
    if (replicate <= 0) {
        PyErr_Format(PyExc_ValueError, "hsdp_replicate_size must be positive, got %d", replicate);
        return -1;
    }
    if (shard <= 0 && shard != -1) {
        PyErr_Format(PyExc_ValueError, "hsdp_shard_size must be positive or -1 (auto), got %d", shard);
        return -1;
    }
    return 0;
}

static int parse_max_bytes(PyObject *v, long long *out) {
    if (v == Py_None) {
        *out = -1;
        return 0;
    }
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "max_unsharded_bytes must be an int or None, got %R", v);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x <= 0) {
        PyErr_Format(PyExc_ValueError, "max_unsharded_bytes must be positive or None, got %lld", x);
        return -1;
    }
    *out = x;
    return 0;
}

static int config_init(ConfigObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"enabled",      "hsdp_replicate_size",   "hsdp_shard_size", "param_dtype",
                             "reduce_dtype", "output_dtype",          "reshard_after_forward",
                             "prefetch_depth", "max_unsharded_bytes", NULL};
    int enabled = 0, replicate = 1, shard = -1, reshard = 1, depth = 1;
    PyObject *pd = NULL, *rd = NULL, *od = Py_None, *maxb = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|piiOOOp$iO", kwlist, &enabled, &replicate, &shard, &pd, &rd, &od,
                                     &reshard, &depth, &maxb))
        return -1;
    if (config_check_sizes(replicate, shard) < 0) return -1;
    if (depth < 0) {
        PyErr_Format(PyExc_ValueError, "prefetch_depth must be >= 0, got %d", depth);
        return -1;
    }
    long long mb = -1;
    if (maxb != Py_None && parse_max_bytes(maxb, &mb) < 0) return -1;
    int p = (int)HSDP_BF16, r = (int)HSDP_F32, o = -1;
    if (pd && parse_optional_float_dtype(pd, "param_dtype", &p) < 0) return -1;
    if (rd && parse_optional_float_dtype(rd, "reduce_dtype", &r) < 0) return -1;
    if (parse_optional_float_dtype(od, "output_dtype", &o) < 0) return -1;
    self->enabled = enabled;
    self->replicate = replicate;
    self->shard = shard;
    self->param_dtype = p;
    self->reduce_dtype = r;
    self->output_dtype = o;
    self->reshard_after_forward = reshard;
    self->prefetch_depth = depth;
    self->max_unsharded_bytes = mb;
    return 0;
}

static PyObject *config_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args, (void)kw;
    ConfigObject *self = (ConfigObject *)type->tp_alloc(type, 0);
    if (self) {
        self->replicate = 1;
        self->shard = -1;
        self->param_dtype = (int)HSDP_BF16;
        self->reduce_dtype = (int)HSDP_F32;
        self->output_dtype = -1;
        self->reshard_after_forward = 1;
        self->prefetch_depth = 1;
        self->max_unsharded_bytes = -1;
    }
    return (PyObject *)self;
}

static void config_dealloc(ConfigObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Field access by offset keeps the getters and setters to one function each. */
enum { F_ENABLED, F_REPLICATE, F_SHARD, F_PARAM, F_REDUCE, F_OUTPUT, F_RESHARD, F_DEPTH, F_MAXBYTES };
static const char *const field_names[] = {"enabled",         "hsdp_replicate_size", "hsdp_shard_size",
                                          "param_dtype",     "reduce_dtype",        "output_dtype",
                                          "reshard_after_forward", "prefetch_depth", "max_unsharded_bytes"};

static int *config_field(ConfigObject *self, intptr_t f) {
    switch (f) {
    case F_ENABLED: return &self->enabled;
    case F_REPLICATE: return &self->replicate;
    case F_SHARD: return &self->shard;
    case F_PARAM: return &self->param_dtype;
    case F_REDUCE: return &self->reduce_dtype;
    case F_OUTPUT: return &self->output_dtype;
    case F_DEPTH: return &self->prefetch_depth;
    default: return &self->reshard_after_forward;
    }
}

static PyObject *config_get(ConfigObject *self, void *closure) {
    intptr_t f = (intptr_t)closure;
    if (f == F_MAXBYTES) {
        if (self->max_unsharded_bytes < 0) Py_RETURN_NONE;
        return PyLong_FromLongLong(self->max_unsharded_bytes);
    }
    int v = *config_field(self, f);
    if (f == F_ENABLED || f == F_RESHARD) return PyBool_FromLong(v);
    if (f == F_REPLICATE || f == F_SHARD || f == F_DEPTH) return PyLong_FromLong(v);
    return dtype_name_or_none(v);
}

static int config_set(ConfigObject *self, PyObject *value, void *closure) {
    intptr_t f = (intptr_t)closure;
    if (!value) {
        PyErr_Format(PyExc_AttributeError, "cannot delete %s", field_names[f]);
        return -1;
    }
    if (f == F_MAXBYTES) return parse_max_bytes(value, &self->max_unsharded_bytes);
    int v;
    if (f == F_ENABLED || f == F_RESHARD) {
        v = PyObject_IsTrue(value);
        if (v < 0) return -1;
    } else if (f == F_REPLICATE || f == F_SHARD || f == F_DEPTH) {
        if (!PyLong_Check(value) || PyBool_Check(value)) {
            PyErr_Format(PyExc_TypeError, "%s must be an int, got %R", field_names[f], value);
            return -1;
        }
        long lv = PyLong_AsLong(value);
        if (lv == -1 && PyErr_Occurred()) return -1;
        if (lv < -1 || lv > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s=%ld is out of range", field_names[f], lv);
            return -1;
        }
        v = (int)lv;
        if (f == F_DEPTH && v < 0) {
            PyErr_Format(PyExc_ValueError, "prefetch_depth must be >= 0, got %d", v);
            return -1;
        }
        if (f != F_DEPTH && config_check_sizes(f == F_REPLICATE ? v : 1, f == F_SHARD ? v : 1) < 0) return -1;
    } else if (parse_optional_float_dtype(value, field_names[f], &v) < 0) {
        return -1;
    }
    *config_field(self, f) = v;
    return 0;
}

static PyObject *config_repr(ConfigObject *self) {
    PyObject *p = dtype_name_or_none(self->param_dtype), *r = dtype_name_or_none(self->reduce_dtype),
             *o = dtype_name_or_none(self->output_dtype);
    PyObject *s = NULL;
    PyObject *mb = config_get(self, (void *)(intptr_t)F_MAXBYTES);
    if (p && r && o && mb)
        s = PyUnicode_FromFormat("HSDPInferenceConfig(enabled=%s, hsdp_replicate_size=%d, hsdp_shard_size=%d, "
                                 "param_dtype=%R, reduce_dtype=%R, output_dtype=%R, reshard_after_forward=%s, "
                                 "prefetch_depth=%d, max_unsharded_bytes=%R)",
                                 self->enabled ? "True" : "False", self->replicate, self->shard, p, r, o,
                                 self->reshard_after_forward ? "True" : "False", self->prefetch_depth, mb);
    Py_XDECREF(mb);
    Py_XDECREF(p);
    Py_XDECREF(r);
    Py_XDECREF(o);
    return s;
}

static PyObject *config_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != Py_TYPE(b)) Py_RETURN_NOTIMPLEMENTED;
    ConfigObject *x = (ConfigObject *)a, *y = (ConfigObject *)b;
    int eq = x->enabled == y->enabled && x->replicate == y->replicate && x->shard == y->shard &&
             x->param_dtype == y->param_dtype && x->reduce_dtype == y->reduce_dtype &&
             x->output_dtype == y->output_dtype && x->reshard_after_forward == y->reshard_after_forward &&
             x->prefetch_depth == y->prefetch_depth && x->max_unsharded_bytes == y->max_unsharded_bytes;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

#define CONFIG_FIELD(F, name, doc) {name, (getter)config_get, (setter)config_set, doc, (void *)(intptr_t)F}
static PyGetSetDef config_getset[] = {
    CONFIG_FIELD(F_ENABLED, "enabled", "whether HSDP is on (default False)"),
    CONFIG_FIELD(F_REPLICATE, "hsdp_replicate_size", "number of replica groups (default 1)"),
    CONFIG_FIELD(F_SHARD, "hsdp_shard_size", "ranks each replica is sharded over; -1 = world // replicate (default -1)"),
    CONFIG_FIELD(F_PARAM, "param_dtype", "dtype shards are stored and gathered in (default 'bfloat16'; None keeps each "
                          "parameter's own)"),
    CONFIG_FIELD(F_REDUCE, "reduce_dtype", "dtype for reductions (default 'float32'; inference does none)"),
    CONFIG_FIELD(F_OUTPUT, "output_dtype", "dtype the root's floating outputs are cast to (default None)"),
    CONFIG_FIELD(F_RESHARD, "reshard_after_forward", "free each unit's full weights after its forward (default True)"),
    CONFIG_FIELD(F_DEPTH, "prefetch_depth", "units whose gather starts ahead of the one computing (default 1; 0 = off)"),
    CONFIG_FIELD(F_MAXBYTES, "max_unsharded_bytes",
                 "cap on full-weight bytes held or in flight that prefetch respects (default None: no cap)"),
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot config_slots[] = {
    {Py_tp_new, config_new},
    {Py_tp_init, config_init},
    {Py_tp_dealloc, config_dealloc},
    {Py_tp_getset, config_getset},
    {Py_tp_repr, config_repr},
    {Py_tp_richcompare, config_richcompare},
    {Py_tp_hash, PyObject_HashNotImplemented},
    {Py_tp_doc, "HSDPInferenceConfig(enabled=False, hsdp_replicate_size=1, hsdp_shard_size=-1, "
                "param_dtype='bfloat16', reduce_dtype='float32', output_dtype=None, reshard_after_forward=True, *, "
                "prefetch_depth=1, max_unsharded_bytes=None)\n\n"
                "The runtime HSDP settings. Dtypes accept names, NumPy dtypes and torch dtypes."},
    {0, NULL},
};

static PyType_Spec config_spec = {"hsdp._C.HSDPInferenceConfig", sizeof(ConfigObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, config_slots};

/* ------------------------------------------------------------------ module functions */

/* A new array shaped like src, of NumPy type npy, holding src's elements cast from st to dt
 * (the GIL released for the cast). Takes over the reference to src. */
static PyObject *cast_new(PyArrayObject *src, hsdp_dtype st, hsdp_dtype dt, int npy) {
    PyArrayObject *dst = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(src), PyArray_DIMS(src), npy);
    if (!dst) {
        Py_DECREF(src);
        return NULL;
    }
    hsdp_status s;
    Py_BEGIN_ALLOW_THREADS
    s = hsdp_cast(PyArray_DATA(dst), dt, PyArray_DATA(src), st, (size_t)PyArray_SIZE(src));
    Py_END_ALLOW_THREADS
    Py_DECREF(src);
    if (s != HSDP_OK) {
        Py_DECREF(dst);
        return raise_status(s);
    }
    return (PyObject *)dst;
}

/* Encodes a floating array into `dtype`'s raw bits (uint16 for bfloat16, uint8 for float8,
 * the NumPy type otherwise). The GIL is released for the cast. */
static PyObject *encode_impl(PyObject *obj, hsdp_dtype dt) {
    PyArrayObject *src = (PyArrayObject *)PyArray_FROM_OF(obj, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!src) return NULL;
    hsdp_dtype st;
    if (dtype_of_array(src, &st) < 0) {
        Py_DECREF(src);
        return NULL;
    }
    int npy = npy_type_of(dt);
    if (npy < 0) npy = hsdp_dtype_size(dt) == 2 ? NPY_UINT16 : NPY_UINT8;
    return cast_new(src, st, dt, npy);
}

static PyObject *decode_impl(PyObject *obj, hsdp_dtype dt) {
    PyArrayObject *src = (PyArrayObject *)PyArray_FROM_OF(obj, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!src) return NULL;
    if ((size_t)PyArray_ITEMSIZE(src) != hsdp_dtype_size(dt)) {
        PyErr_Format(PyExc_ValueError, "raw %s data needs %zu-byte elements, the array has %zd-byte ones",
                     hsdp_dtype_name(dt), hsdp_dtype_size(dt), (Py_ssize_t)PyArray_ITEMSIZE(src));
        Py_DECREF(src);
        return NULL;
    }
    hsdp_dtype ct = hsdp_dtype_compute(dt);
    return cast_new(src, dt, ct, npy_type_of(ct));
}

static PyObject *mod_encode(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *obj, *d;
    hsdp_dtype dt;
    if (!PyArg_ParseTuple(args, "OO", &obj, &d) || parse_dtype(d, &dt) < 0) return NULL;
    return encode_impl(obj, dt);
}

static PyObject *mod_decode(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *obj, *d;
    hsdp_dtype dt;
    if (!PyArg_ParseTuple(args, "OO", &obj, &d) || parse_dtype(d, &dt) < 0) return NULL;
    return decode_impl(obj, dt);
}

/* round_to(array, dtype): values rounded to `dtype` and returned in its compute dtype. */
static PyObject *mod_round_to(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *obj, *d;
    hsdp_dtype dt;
    if (!PyArg_ParseTuple(args, "OO", &obj, &d) || parse_dtype(d, &dt) < 0) return NULL;
    if (!hsdp_dtype_is_float(dt)) return PyErr_Format(PyExc_ValueError, "round_to needs a floating dtype, got %s",
                                                      hsdp_dtype_name(dt));
    PyObject *raw = encode_impl(obj, dt);
    if (!raw) return NULL;
    PyObject *out = decode_impl(raw, dt);
    Py_DECREF(raw);
    return out;
}

/* pread_into(fd, offset, array): fills a writable C-contiguous array from the file. */
static PyObject *mod_pread_into(PyObject *m, PyObject *args) {
    (void)m;
    int fd;
    unsigned long long off;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "iKO", &fd, &off, &obj)) return NULL;
    PyArrayObject *a = contiguous_writable(obj, "array");
    if (!a) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_pread_exact(fd, PyArray_DATA(a), (size_t)PyArray_NBYTES(a), (uint64_t)off);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *mod_memory_stats(PyObject *m, PyObject *unused) {
    (void)unused;
    hsdp_stats *s = &((modstate *)PyModule_GetState(m))->stats;
    modstate *ms = PyModule_GetState(m);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:l,s:l,s:i}", "sharded_bytes",
                         (Py_ssize_t)atomic_load(&s->sharded_bytes), "pooled_bytes",
                         (Py_ssize_t)atomic_load(&s->pooled_bytes),
                         "unsharded_bytes", (Py_ssize_t)atomic_load(&s->unsharded_bytes), "peak_unsharded_bytes",
                         (Py_ssize_t)atomic_load(&s->peak_unsharded_bytes), "whole_bytes",
                         (Py_ssize_t)atomic_load(&s->whole_bytes), "buffer_allocs",
                         (unsigned long long)atomic_load(&s->buffer_allocs), "gathers",
                         (unsigned long long)atomic_load(&s->gathers), "live_buffers", ms->live_buffers,
                         "peak_live_buffers", ms->peak_live_buffers, "pool_capacity", ms->pool_cap);
}

static PyObject *mod_reset_peak(PyObject *m, PyObject *unused) {
    (void)unused;
    modstate *ms = PyModule_GetState(m);
    atomic_store(&ms->stats.peak_unsharded_bytes, atomic_load(&ms->stats.unsharded_bytes));
    ms->peak_live_buffers = ms->live_buffers;
    Py_RETURN_NONE;
}

/* set_pool_capacity(n): keep up to n idle buffers for reuse; shrinking releases extras. */
static PyObject *mod_set_pool_capacity(PyObject *m, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 0 || n > POOL_SLOTS) return PyErr_Format(PyExc_ValueError, "pool capacity must be in [0, %d], got %d",
                                                     POOL_SLOTS, n);
    modstate *ms = PyModule_GetState(m);
    ms->pool_cap = n;
    pool_trim(ms, n);
    Py_RETURN_NONE;
}

/* pool_reserve(sizes): make the pool hold (at least) one idle buffer per entry of sizes,
 * allocating what is missing, and keep that many. The schedule calls it with the buffers a
 * steady-state forward of the recorded order needs, so no later forward allocates. */
static PyObject *mod_pool_reserve(PyObject *m, PyObject *args) {
    modstate *ms = PyModule_GetState(m);
    PyObject *arg;
    int cap;
    if (!PyArg_ParseTuple(args, "Oi", &arg, &cap)) return NULL;
    PyObject *seq = PySequence_Fast(arg, "pool_reserve needs a sequence of sizes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (cap < n || cap > POOL_SLOTS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "pool capacity must be in [%zd, %d], got %d", n, POOL_SLOTS, cap);
    }
    ms->pool_cap = cap;
    /* Take every idle buffer out, then put back one per wanted size (reusing when it fits). */
    BufferObject *idle[POOL_SLOTS];
    int nidle = ms->pool_n;
    memcpy(idle, ms->pool, sizeof(idle[0]) * (size_t)nidle);
    ms->pool_n = 0;
    PyObject *module = PyType_GetModule(ms->buffer_type);
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        size_t want = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (want == (size_t)-1 && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        BufferObject *b = NULL;
        for (int k = 0; k < nidle; k++)
            if (idle[k] && idle[k]->n == want) {
                b = idle[k];
                idle[k] = NULL;
                break;
            }
        if (!b) {
            b = buffer_new(ms, module, want);
            if (!b) {
                rc = -1;
                break;
            }
            /* fresh buffers are accounted unsharded; move them to pooled */
            atomic_fetch_sub(&ms->stats.unsharded_bytes, want);
            atomic_fetch_add(&ms->stats.pooled_bytes, want);
        }
        ms->pool[ms->pool_n++] = b;
    }
    for (int k = 0; k < nidle; k++)
        if (idle[k]) {
            atomic_fetch_sub(&ms->stats.pooled_bytes, idle[k]->n);
            atomic_fetch_add(&ms->stats.unsharded_bytes, idle[k]->n);
            Py_DECREF(idle[k]);
        }
    Py_DECREF(seq);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *mod_empty_pool(PyObject *m, PyObject *unused) {
    (void)unused;
    pool_trim(PyModule_GetState(m), 0);
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
    BufferObject *b = buffer_new(PyModule_GetState(m), m, (size_t)n);
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

static PyObject *mod_mpi_async(PyObject *m, PyObject *unused) {  /* false again once MPI is finalised */
    (void)m, (void)unused;
    return PyBool_FromLong(hsdp_mpi_async());
}

static PyObject *mod_now_ns(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyLong_FromUnsignedLongLong((unsigned long long)hsdp_now_ns());
}

static PyObject *mod_mesh_coords(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"world_size", "rank", "replicate", "shard", NULL};
    int world, rank, replicate, shard;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiii", kwlist, &world, &rank, &replicate, &shard)) return NULL;
    hsdp_mesh mesh;
    hsdp_status st = hsdp_mesh_init(&mesh, world, rank, replicate, shard);
    if (st != HSDP_OK) return raise_status(st);
    PyObject *sg = PyTuple_New(mesh.shard), *rg = PyTuple_New(mesh.replicate);
    if (!sg || !rg) goto fail;
    for (int i = 0; i < mesh.shard; i++) PyTuple_SET_ITEM(sg, i, PyLong_FromLong(hsdp_mesh_rank_of(&mesh, mesh.r, i)));
    for (int i = 0; i < mesh.replicate; i++)
        PyTuple_SET_ITEM(rg, i, PyLong_FromLong(hsdp_mesh_rank_of(&mesh, i, mesh.s)));
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:N,s:N}", "replicate", mesh.replicate, "shard", mesh.shard, "r", mesh.r,
                         "s", mesh.s, "shard_group", sg, "replicate_group", rg);
fail:
    Py_XDECREF(sg);
    Py_XDECREF(rg);
    return NULL;
}

static PyObject *mod_mpi_compiled(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyBool_FromLong(hsdp_mpi_compiled());
}

/* Finalises MPI only when hsdp initialised it; whoever else did owns its finalisation. */
static PyObject *mod_finalize_mpi(PyObject *m, PyObject *unused) {
    (void)unused;
    modstate *ms = PyModule_GetState(m);
    if (!ms->mpi_we_init) Py_RETURN_FALSE;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_mpi_finalize();
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return raise_status(st);
    ms->mpi_we_init = 0;
    Py_RETURN_TRUE;
}

static PyObject *mod_dtype_names(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    PyObject *t = PyTuple_New(HSDP_DTYPE_COUNT);
    for (int i = 0; t && i < HSDP_DTYPE_COUNT; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(hsdp_dtype_name((hsdp_dtype)i)));
    return t;
}

static PyMethodDef mod_methods[] = {
    {"encode", mod_encode, METH_VARARGS, "encode(array, dtype): raw bits of the values cast to dtype."},
    {"decode", mod_decode, METH_VARARGS, "decode(raw, dtype): raw bits of dtype -> its compute dtype."},
    {"round_to", mod_round_to, METH_VARARGS, "round_to(array, dtype): values rounded to dtype, in its compute dtype."},
    {"pread_into", mod_pread_into, METH_VARARGS, "pread_into(fd, offset, array): fill array with file bytes."},
    {"memory_stats", mod_memory_stats, METH_NOARGS, "Bytes this process holds for hsdp, from the core's counters."},
    {"reset_peak", mod_reset_peak, METH_NOARGS, "Reset the peak counters to the current values."},
    {"set_pool_capacity", mod_set_pool_capacity, METH_VARARGS, "Keep up to n idle unsharded buffers for reuse."},
    {"empty_pool", mod_empty_pool, METH_NOARGS, "Release every idle pooled buffer."},
    {"pool_reserve", mod_pool_reserve, METH_VARARGS,
     "pool_reserve(sizes, capacity): hold one idle buffer per entry of sizes, allocating what is missing, and keep "
     "up to capacity idle buffers."},
    {"empty_aligned", mod_empty_aligned, METH_O, "empty_aligned(nbytes): a writable uint8 array from hsdp's "
                                                 "64-byte-aligned allocator (counted as unsharded bytes)."},
    {"mpi_async", mod_mpi_async, METH_NOARGS, "Whether MPI calls run on the collective worker thread."},
    {"now_ns", mod_now_ns, METH_NOARGS, "CLOCK_MONOTONIC in ns (the clock of gather_times)."},
    {"mesh_coords", (PyCFunction)(void (*)(void))mod_mesh_coords, METH_VARARGS | METH_KEYWORDS,
     "mesh_coords(world_size, rank, replicate, shard): validated sizes, coordinates and group ranks."},
    {"mpi_compiled", mod_mpi_compiled, METH_NOARGS, "Whether the MPI backend was compiled in."},
    {"finalize_mpi", mod_finalize_mpi, METH_NOARGS, "Finalise MPI if hsdp initialised it; returns whether it did."},
    {"dtype_names", mod_dtype_names, METH_NOARGS, "The canonical dtype names the core knows."},
    {NULL, NULL, 0, NULL},
};

static int mod_traverse(PyObject *m, visitproc visit, void *arg) {
    modstate *ms = PyModule_GetState(m);
    if (!ms) return 0;
    Py_VISIT(ms->group_type);
    Py_VISIT(ms->unit_type);
    Py_VISIT(ms->buffer_type);
    Py_VISIT(ms->config_type);
    Py_VISIT(ms->token_type);
    Py_VISIT(ms->data_attr);
    for (int i = 0; i < ms->pool_n; i++) Py_VISIT(ms->pool[i]);
    Py_VISIT(ms->empty);
    return 0;
}

static int mod_clear(PyObject *m) {
    modstate *ms = PyModule_GetState(m);
    if (!ms) return 0;
    ms->pool_cap = 0;
    pool_trim(ms, 0);
    Py_CLEAR(ms->empty);
    Py_CLEAR(ms->group_type);
    Py_CLEAR(ms->unit_type);
    Py_CLEAR(ms->buffer_type);
    Py_CLEAR(ms->config_type);
    Py_CLEAR(ms->token_type);
    Py_CLEAR(ms->data_attr);
    return 0;
}

static struct PyModuleDef hsdp_module = {
    PyModuleDef_HEAD_INIT, "hsdp._C", "The hsdp C core: process groups, units, dtype casts, accounting.",
    sizeof(modstate), mod_methods, NULL, mod_traverse, mod_clear, NULL,
};

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot, const char *public_name) {
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (!*slot) return -1;
    return public_name ? PyModule_AddObjectRef(m, public_name, (PyObject *)*slot) : 0;
}

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    PyObject *m = PyModule_Create(&hsdp_module);
    if (!m) return NULL;
    modstate *ms = PyModule_GetState(m);
    memset(ms, 0, sizeof *ms);
    hsdp_stats_init(&ms->stats);
    ms->data_attr = PyUnicode_InternFromString("_data");
    if (!ms->data_attr || add_type(m, &group_spec, &ms->group_type, "ProcessGroup") < 0 ||
        add_type(m, &unit_spec, &ms->unit_type, "Unit") < 0 || add_type(m, &buffer_spec, &ms->buffer_type, NULL) < 0 ||
        add_type(m, &config_spec, &ms->config_type, "HSDPInferenceConfig") < 0 ||
        add_type(m, &token_spec, &ms->token_type, "WholeBytes") < 0 ||
        PyModule_AddIntConstant(m, "ALIGN", HSDP_ALIGN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
