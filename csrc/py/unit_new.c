/* unit_new.c - Unit's constructor (unit_type.h): the arguments checked, each parameter's
 * dtypes and shape parsed, the C unit made over the group, and which parameters travel as
 * float8 (wire_dtype). */
#include "pyhsdp.h" /* first: Python.h must precede system headers */
#include <stdlib.h>
#include <string.h>

#include "unit_type.h"

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

/* device= of the constructor: which memory the unsharded buffers live in. A group's backend
 * allocates its device buffers, so they must be its device's (a backend with none refuses at
 * the first gather, saying so). */
static int unit_parse_device(const char *device, PyObject *group, hsdp_device *dev, const char **dev_label) {
    char choices[128];
    if (hsdp_device_parse(device, dev, dev_label) < 0) {
        PyErr_Format(PyExc_ValueError, "device must be one of %s, got '%s'", hsdp_device_choices(choices, sizeof choices),
                     device);
        return -1;
    }
    const hsdp_device_i *own = hsdp_backend_device(((GroupObject *)group)->g->backend);
    if (*dev != HSDP_DEVICE_HOST && own && strcmp(own->name, *dev_label) != 0) {
        PyErr_Format(PyExc_ValueError, "device='%s', but this group's backend '%s' has device '%s'", *dev_label,
                     ((GroupObject *)group)->g->backend->name, own->name);
        return -1;
    }
    return 0;
}

/* dtypes, compute_dtypes and shapes as tuples of one length (*n); params as a tuple of it too
 * (a new reference) or None (a new reference to it). On failure every tuple made is released. */
typedef struct {
    PyObject *dt, *sh, *ct, *params; /* strong (ct may be NULL) */
    Py_ssize_t n;
} unit_args;

static void unit_args_release(unit_args *a) {
    Py_XDECREF(a->dt);
    Py_XDECREF(a->sh);
    Py_XDECREF(a->ct);
    a->dt = a->sh = a->ct = NULL;
}

static int unit_parse_args(unit_args *a, PyObject *dtypes, PyObject *shapes, PyObject *compute, PyObject *params) {
    *a = (unit_args){0};
    a->dt = PySequence_Tuple(dtypes);
    if (!a->dt) return -1;
    a->sh = PySequence_Tuple(shapes);
    if (!a->sh) goto fail;
    a->n = PyTuple_GET_SIZE(a->dt);
    if (PyTuple_GET_SIZE(a->sh) != a->n) {
        PyErr_Format(PyExc_ValueError, "got %zd dtypes but %zd shapes", a->n, PyTuple_GET_SIZE(a->sh));
        goto fail;
    }
    if (compute != Py_None) {
        a->ct = PySequence_Tuple(compute);
        if (!a->ct) goto fail;
        if (PyTuple_GET_SIZE(a->ct) != a->n) {
            PyErr_Format(PyExc_ValueError, "got %zd compute_dtypes but %zd shapes", PyTuple_GET_SIZE(a->ct), a->n);
            goto fail;
        }
    }
    if (params != Py_None) {
        params = PySequence_Tuple(params);
        if (!params) goto fail;
        if (PyTuple_GET_SIZE(params) != a->n) {
            PyErr_Format(PyExc_ValueError, "got %zd params but %zd shapes", PyTuple_GET_SIZE(params), a->n);
            Py_DECREF(params);
            goto fail;
        }
    } else {
        Py_INCREF(params);
    }
    a->params = params;
    return 0;
fail:
    unit_args_release(a);
    return -1;
}

/* Each parameter's storage and compute dtype (codes, ccodes), its shape (self->ndims,
 * self->dim_off, self->dims, owned by self) and its element count (numels). */
static int unit_parse_slots(UnitObject *self, const unit_args *a, hsdp_dtype *codes, hsdp_dtype *ccodes,
                            size_t *numels) {
    size_t total_dims = 0;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (hsdp_py_parse_dtype(PyTuple_GET_ITEM(a->dt, i), &codes[i]) < 0) return -1;
        ccodes[i] = codes[i];
        if (a->ct && hsdp_py_parse_dtype(PyTuple_GET_ITEM(a->ct, i), &ccodes[i]) < 0) return -1;
        if (self->bind_attr && hsdp_py_npy_type(ccodes[i]) < 0) {
            /* views made here are NumPy arrays: their dtype must be one NumPy has */
            PyErr_Format(PyExc_TypeError, "parameter %zd would be computed in %s, which has no NumPy type; pass a "
                         "compute dtype NumPy has (float32) or bind in the adapter (bind_attr=None)",
                         i, hsdp_dtype_name(ccodes[i]));
            return -1;
        }
        Py_ssize_t nd = PySequence_Length(PyTuple_GET_ITEM(a->sh, i));
        if (nd < 0 || nd > NPY_MAXDIMS) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "shape %zd has %zd dimensions", i, nd);
            return -1;
        }
        self->ndims[i] = (int)nd;
        self->dim_off[i] = total_dims;
        total_dims += (size_t)nd;
    }
    self->dims = calloc(total_dims ? total_dims : 1, sizeof *self->dims); /* owned by self */
    if (!self->dims) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        PyObject *shape = PyTuple_GET_ITEM(a->sh, i);
        size_t numel = 1;
        for (int d = 0; d < self->ndims[i]; d++) {
            PyObject *item = PySequence_GetItem(shape, d);
            Py_ssize_t v = item ? PyNumber_AsSsize_t(item, PyExc_OverflowError) : -1;
            Py_XDECREF(item);
            if (v < 0) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "shape %zd has a negative dimension", i);
                return -1;
            }
            self->dims[self->dim_off[i] + (size_t)d] = (npy_intp)v;
            numel *= (size_t)v;
        }
        numels[i] = numel;
    }
    return 0;
}

/* The C unit over the group, named for timeout messages. */
static int unit_init_core(UnitObject *self, PyObject *group, const unit_args *a, const size_t *numels,
                          const hsdp_dtype *codes, const hsdp_dtype *ccodes, modstate *ms) {
    hsdp_status st =
        hsdp_unit_init(&self->u, numels, codes, ccodes, (size_t)a->n, ((GroupObject *)group)->g, &ms->stats);
    if (st != HSDP_OK) {
        hsdp_py_raise(st);
        return -1;
    }
    self->initialised = 1;
    const char *label = PyUnicode_AsUTF8(self->name);
    if (label) snprintf(self->u.label, sizeof self->u.label, "%s", label);
    else PyErr_Clear();
    return 0;
}

PyObject *hsdp_py_unit_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
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
    if (unit_parse_device(device, group, &dev, &dev_label) < 0) return NULL;
    unit_args a;
    if (unit_parse_args(&a, dtypes, shapes, compute, params) < 0) return NULL;
    UnitObject *self = (UnitObject *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(a.params);
        unit_args_release(&a);
        return NULL;
    }
    self->params = a.params; /* the reference unit_parse_args made */
    self->group = Py_NewRef(group);
    self->name = name ? Py_NewRef(name) : PyUnicode_FromString("");
    self->device = dev;
    self->device_label = dev_label;
    size_t cap = (size_t)(a.n ? a.n : 1);
    size_t *numels = calloc(cap, sizeof *numels);     /* owned here, freed below */
    hsdp_dtype *codes = calloc(cap, sizeof *codes);   /* owned here, freed below */
    hsdp_dtype *ccodes = calloc(cap, sizeof *ccodes); /* owned here, freed below */
    self->ndims = calloc(cap, sizeof *self->ndims);     /* owned by the unit object; unit_dealloc */
    self->dim_off = calloc(cap, sizeof *self->dim_off); /* owned by the unit object; unit_dealloc */
    int ok = numels && codes && ccodes && self->ndims && self->dim_off && self->name;
    if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    if (ok && bind_attr) {
        if (a.params == Py_None) {
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
    if (ok && unit_parse_slots(self, &a, codes, ccodes, numels) < 0) ok = 0;
    if (ok && unit_init_core(self, group, &a, numels, codes, ccodes, ms) < 0) ok = 0;
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
    unit_args_release(&a);
    if (!ok) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}
