/* config_type.c - HSDPInferenceConfig: the runtime HSDP settings, keyword-constructible,
 * with repr and equality. Dtypes accept every spelling hsdp.dtypes knows; sizes are checked
 * by the core's one mesh-size rule (hsdp_mesh_check_sizes). */
#include "pyhsdp.h"  /* first: Python.h must precede system headers */

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
    int wire_dtype;              /* hsdp_dtype the shards travel in (float8_e4m3fn), or -1 for None */
    long long resident_bytes;      /* per-rank residency budget; RESIDENT_NONE, RESIDENT_AUTO or >= 0 */
} ConfigObject;

enum { RESIDENT_NONE = -1, RESIDENT_AUTO = -2 };

/* None -> -1; else a floating dtype code. `what` names the parameter in errors. The rule is
 * hsdp.engine.dtypes.optional_float_dtype's (MixedPrecisionPolicy's too), asked as npy.c asks
 * as_dtype: the TypeError for no dtype, the ValueError for one that is not floating. */
static int parse_optional_float_dtype(PyObject *obj, const char *what, int *out) {
    PyObject *mod = PyImport_ImportModule("hsdp.engine.dtypes");
    if (!mod) return -1;
    PyObject *d = PyObject_CallMethod(mod, "optional_float_dtype", "Os", obj, what);
    Py_DECREF(mod);
    if (!d) return -1;
    int rc = 0;
    hsdp_dtype dt;
    if (d == Py_None)
        *out = -1;
    else if ((rc = hsdp_py_parse_dtype(d, &dt)) == 0)
        *out = (int)dt;
    Py_DECREF(d);
    return rc;
}

/* Why float8_e5m2 is no wire format: said once, here, for every refusal of it (this type's,
 * and Python's through _C.WIRE_NOT_BUILT: hsdp.engine.built). */
static const char e5m2_not_built[] = "the block-scaled wire is float8_e4m3fn (more mantissa; the per-block scale "
                                     "makes e5m2's range unneeded)";

int hsdp_py_config_add_constants(PyObject *m) {
    PyObject *d = Py_BuildValue("{s:s}", "float8_e5m2", e5m2_not_built);
    int rc = d ? PyModule_AddObjectRef(m, "WIRE_NOT_BUILT", d) : -1;
    Py_XDECREF(d);
    return rc;
}

/* wire_dtype: None or float8_e4m3fn (the one block-scaled wire format built). */
static int parse_wire_dtype(PyObject *obj, int *out) {
    if (parse_optional_float_dtype(obj, "wire_dtype", out) < 0) return -1;
    if (*out == -1 || *out == (int)HSDP_F8E4M3) return 0;
    if (*out == (int)HSDP_F8E5M2) {
        PyErr_Format(PyExc_NotImplementedError, "wire_dtype='float8_e5m2' is not built: %s", e5m2_not_built);
        return -1;
    }
    PyErr_Format(PyExc_ValueError, "wire_dtype must be 'float8_e4m3fn' or None, got %s",
                 hsdp_dtype_name((hsdp_dtype)*out));
    return -1;
}

static int config_check_sizes(int replicate, int shard) {
    hsdp_status st = hsdp_mesh_check_sizes(replicate, shard);
    if (st != HSDP_OK) {
        hsdp_py_raise(st);
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

/* resident_bytes: None, an int >= 0, or "auto" (the free memory less a margin, resolved by
 * the schedule after the first forward). */
static int parse_resident_bytes(PyObject *v, long long *out) {
    if (v == Py_None) {
        *out = RESIDENT_NONE;
        return 0;
    }
    if (PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, "auto") == 0) {
        *out = RESIDENT_AUTO;
        return 0;
    }
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "resident_bytes must be an int >= 0, 'auto' or None, got %R", v);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0) {
        PyErr_Format(PyExc_ValueError, "resident_bytes must be >= 0, 'auto' or None, got %lld", x);
        return -1;
    }
    *out = x;
    return 0;
}

static PyObject *resident_bytes_value(long long v) {
    if (v == RESIDENT_NONE) Py_RETURN_NONE;
    if (v == RESIDENT_AUTO) return PyUnicode_FromString("auto");
    return PyLong_FromLongLong(v);
}

static int config_init(ConfigObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"enabled",      "hsdp_replicate_size",   "hsdp_shard_size", "param_dtype",
                             "reduce_dtype", "output_dtype",          "reshard_after_forward",
                             "prefetch_depth", "max_unsharded_bytes", "wire_dtype", "resident_bytes", NULL};
    int enabled = 0, replicate = 1, shard = -1, reshard = 1, depth = 1;
    PyObject *pd = NULL, *rd = NULL, *od = Py_None, *maxb = Py_None, *wd = Py_None, *resb = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|piiOOOp$iOOO", kwlist, &enabled, &replicate, &shard, &pd, &rd, &od,
                                     &reshard, &depth, &maxb, &wd, &resb))
        return -1;
    int w = -1;
    if (parse_wire_dtype(wd, &w) < 0) return -1;
    if (config_check_sizes(replicate, shard) < 0) return -1;
    if (depth < 0) {
        PyErr_Format(PyExc_ValueError, "prefetch_depth must be >= 0, got %d", depth);
        return -1;
    }
    long long mb = -1;
    if (maxb != Py_None && parse_max_bytes(maxb, &mb) < 0) return -1;
    long long resident = RESIDENT_NONE;
    if (parse_resident_bytes(resb, &resident) < 0) return -1;
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
    self->wire_dtype = w;
    self->resident_bytes = resident;
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
        self->wire_dtype = -1;
        self->resident_bytes = RESIDENT_NONE;
    }
    return (PyObject *)self;
}

static void config_dealloc(ConfigObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Field access by offset keeps the getters and setters to one function each. */
enum { F_ENABLED, F_REPLICATE, F_SHARD, F_PARAM, F_REDUCE, F_OUTPUT, F_RESHARD, F_DEPTH, F_MAXBYTES, F_WIRE,
       F_RESIDENT };
static const char *const field_names[] = {"enabled",         "hsdp_replicate_size", "hsdp_shard_size",
                                          "param_dtype",     "reduce_dtype",        "output_dtype",
                                          "reshard_after_forward", "prefetch_depth", "max_unsharded_bytes",
                                          "wire_dtype",      "resident_bytes"};

static int *config_field(ConfigObject *self, intptr_t f) {
    switch (f) {
    case F_ENABLED: return &self->enabled;
    case F_REPLICATE: return &self->replicate;
    case F_SHARD: return &self->shard;
    case F_PARAM: return &self->param_dtype;
    case F_REDUCE: return &self->reduce_dtype;
    case F_OUTPUT: return &self->output_dtype;
    case F_DEPTH: return &self->prefetch_depth;
    case F_WIRE: return &self->wire_dtype;
    default: return &self->reshard_after_forward;
    }
}

static PyObject *config_get(ConfigObject *self, void *closure) {
    intptr_t f = (intptr_t)closure;
    if (f == F_RESIDENT) return resident_bytes_value(self->resident_bytes);
    if (f == F_MAXBYTES) {
        if (self->max_unsharded_bytes < 0) Py_RETURN_NONE;
        return PyLong_FromLongLong(self->max_unsharded_bytes);
    }
    int v = *config_field(self, f);
    if (f == F_ENABLED || f == F_RESHARD) return PyBool_FromLong(v);
    if (f == F_REPLICATE || f == F_SHARD || f == F_DEPTH) return PyLong_FromLong(v);
    return hsdp_py_dtype_name_or_none(v);
}

static int config_set(ConfigObject *self, PyObject *value, void *closure) {
    intptr_t f = (intptr_t)closure;
    if (!value) {
        PyErr_Format(PyExc_AttributeError, "cannot delete %s", field_names[f]);
        return -1;
    }
    if (f == F_MAXBYTES) return parse_max_bytes(value, &self->max_unsharded_bytes);
    if (f == F_WIRE) return parse_wire_dtype(value, &self->wire_dtype);
    if (f == F_RESIDENT) return parse_resident_bytes(value, &self->resident_bytes);
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
    PyObject *p = hsdp_py_dtype_name_or_none(self->param_dtype), *r = hsdp_py_dtype_name_or_none(self->reduce_dtype),
             *o = hsdp_py_dtype_name_or_none(self->output_dtype);
    PyObject *s = NULL;
    PyObject *mb = config_get(self, (void *)(intptr_t)F_MAXBYTES);
    PyObject *w = hsdp_py_dtype_name_or_none(self->wire_dtype);
    PyObject *rb = resident_bytes_value(self->resident_bytes);
    if (p && r && o && mb && w && rb)
        s = PyUnicode_FromFormat("HSDPInferenceConfig(enabled=%s, hsdp_replicate_size=%d, hsdp_shard_size=%d, "
                                 "param_dtype=%R, reduce_dtype=%R, output_dtype=%R, reshard_after_forward=%s, "
                                 "prefetch_depth=%d, max_unsharded_bytes=%R, wire_dtype=%R, resident_bytes=%R)",
                                 self->enabled ? "True" : "False", self->replicate, self->shard, p, r, o,
                                 self->reshard_after_forward ? "True" : "False", self->prefetch_depth, mb, w, rb);
    Py_XDECREF(w);
    Py_XDECREF(rb);
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
             x->prefetch_depth == y->prefetch_depth && x->max_unsharded_bytes == y->max_unsharded_bytes &&
             x->wire_dtype == y->wire_dtype && x->resident_bytes == y->resident_bytes;
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
    CONFIG_FIELD(F_WIRE, "wire_dtype",
                 "'float8_e4m3fn': shards are held and gathered block-scaled in float8, dequantized to param_dtype "
                 "after each gather (MPI and single-process only; default None)"),
    CONFIG_FIELD(F_RESIDENT, "resident_bytes",
                 "per-rank bytes of units kept gathered across forwards after the first (int, 'auto' or None; "
                 "default None: none)"),
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
                "prefetch_depth=1, max_unsharded_bytes=None, wire_dtype=None, resident_bytes=None)\n\n"
                "The runtime HSDP settings. Dtypes accept names, NumPy dtypes and torch dtypes."},
    {0, NULL},
};

PyType_Spec hsdp_py_config_spec = {"hsdp._C.HSDPInferenceConfig", sizeof(ConfigObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_BASETYPE,
                                  config_slots};

