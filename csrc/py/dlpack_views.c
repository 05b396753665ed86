/* dlpack_views.c - dlpack_views(buffer, spec, versioned): one DLPack export per parameter of a
 * host buffer, each with the parameter's dtype, shape and strides, so an adapter gets its
 * parameters' tensors from one import each (torch: no dtype view and no as_strided per
 * bind). Each export is a lease on the buffer, returned by its consumer's deleter
 * ([Note: leases] in docs/design.md). Device buffers export through __dlpack__ (its stream
 * contract), not here. dlpack_bind(buffer, spec, versioned, params, convert) makes the same
 * exports and sets each parameter's data to convert(its capsule): a torch bind in one call, with
 * no Python loop (the hook cost, docs/performance.md). */
#include "pyhsdp.h" /* first: Python.h must precede system headers */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack_abi.h"

/* One allocation per export (owned as in dlpack.c): the tensor first, then its dims. */
typedef struct {
    hsdp_dlpack_managed t;
    int64_t dims[]; /* shape[ndim], then strides[ndim] */
} view_block;

enum { SPEC_HEAD = 4, MAX_NDIM = 16 }; /* per view: byte offset, DLPack type code, bits, ndim */

/* The capsule of one view: spec points at its entry; NULL with an error on a bad entry. */
static PyObject *view_capsule(BufferObject *buf, const int64_t *e, int versioned) {
    int64_t offset = e[0], code = e[1], bits = e[2], ndim = e[3];
    const int64_t *shape = e + SPEC_HEAD, *strides = shape + ndim;
    /* the last byte the view reaches must lie in the buffer */
    int64_t last = 0, empty = 0;
    for (int64_t d = 0; d < ndim; d++) {
        if (shape[d] < 0 || strides[d] < 0) return PyErr_Format(PyExc_ValueError, "dlpack_views: negative extent");
        if (shape[d] == 0) empty = 1;
        last += (shape[d] - 1) * strides[d];
    }
    int64_t end = empty ? offset : offset + (last + 1) * (bits / 8);
    if (offset < 0 || code < 0 || code > 255 || (bits != 8 && bits != 16 && bits != 32 && bits != 64) ||
        end > (int64_t)buf->n)
        return PyErr_Format(PyExc_ValueError,
                            "dlpack_views: a view (offset %lld, %lld-bit, ending at byte %lld) outside the %zu-byte "
                            "buffer or of no DLPack type", (long long)offset, (long long)bits, (long long)end, buf->n);
    view_block *blk = calloc(1, sizeof *blk + 2 * (size_t)ndim * sizeof(int64_t)); /* owned as above */
    if (!blk) return PyErr_NoMemory();
    memcpy(blk->dims, shape, 2 * (size_t)ndim * sizeof(int64_t));
    DLTensor tensor = {.data = (char *)buf->p + offset,
                       .device = {1, 0}, /* kDLCPU: host buffers only */
                       .ndim = (int32_t)ndim,
                       .dtype = {.code = (uint8_t)code, .bits = (uint8_t)bits, .lanes = 1},
                       .shape = blk->dims,
                       .strides = blk->dims + ndim,
                       .byte_offset = 0};
    return hsdp_py_dlpack_capsule(&blk->t, buf, tensor, versioned);
}

/* Where each view's capsule goes (borrowed): a list, or a parameter's data. -1 with an error. */
typedef int (*view_sink)(void *ctx, Py_ssize_t i, PyObject *cap);

/* Exports every view of spec (native int64s, each view: byte offset, DLPack type code, bits,
 * ndim, shape..., strides in elements...) of the host _Buffer obj to sink, in order. When
 * expected >= 0 the spec must hold that many views, checked before any export. 0, or -1
 * with an error. */
static int each_view(PyObject *m, PyObject *obj, Py_buffer *spec, int versioned, Py_ssize_t expected,
                     view_sink sink, void *ctx) {
    if (!PyObject_TypeCheck(obj, ((modstate *)PyModule_GetState(m))->buffer_type)) {
        PyErr_Format(PyExc_TypeError, "dlpack_views needs an hsdp _Buffer, got %R", (PyObject *)Py_TYPE(obj));
        return -1;
    }
    BufferObject *buf = (BufferObject *)obj;
    if (buf->device != HSDP_DEVICE_HOST) {
        PyErr_Format(PyExc_NotImplementedError, "dlpack_views exports host buffers; a %s buffer exports through "
                     "__dlpack__", hsdp_device_label(buf->backend, buf->device));
        return -1;
    }
    /* copied: a bytes object's data need not be aligned for int64 loads */
    Py_ssize_t count = spec->len / (Py_ssize_t)sizeof(int64_t);
    int64_t *all = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(int64_t)); /* freed below */
    if (!all) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(all, spec->buf, (size_t)count * sizeof(int64_t));
    const int64_t *stop = all + count;
    Py_ssize_t views = 0; /* first the spec's shape, so nothing is exported from a bad one */
    for (const int64_t *e = all; e < stop; e += SPEC_HEAD + 2 * e[3], views++)
        if (stop - e < SPEC_HEAD || e[3] < 0 || e[3] > MAX_NDIM || stop - e < SPEC_HEAD + 2 * e[3]) {
            PyErr_SetString(PyExc_ValueError, "dlpack_views: a truncated spec");
            PyMem_Free(all);
            return -1;
        }
    if (expected >= 0 && views != expected) {
        PyErr_Format(PyExc_ValueError, "dlpack_bind: the spec has %zd views for %zd parameters", views, expected);
        PyMem_Free(all);
        return -1;
    }
    int rc = 0;
    Py_ssize_t i = 0;
    for (const int64_t *e = all; e < stop && rc == 0; e += SPEC_HEAD + 2 * e[3], i++) {
        PyObject *cap = view_capsule(buf, e, versioned);
        rc = cap && sink(ctx, i, cap) == 0 ? 0 : -1;
        Py_XDECREF(cap); /* an unconsumed capsule returns its lease */
    }
    PyMem_Free(all);
    return rc;
}

static int to_list(void *ctx, Py_ssize_t i, PyObject *cap) {
    (void)i;
    return PyList_Append((PyObject *)ctx, cap);
}

/* dlpack_views(buffer, spec, versioned) -> list of capsules. */
static PyObject *mod_dlpack_views(PyObject *m, PyObject *args) {
    PyObject *obj;
    Py_buffer spec;
    int versioned;
    if (!PyArg_ParseTuple(args, "Oy*p", &obj, &spec, &versioned)) return NULL;
    PyObject *out = PyList_New(0);
    if (out && each_view(m, obj, &spec, versioned, -1, to_list, out) < 0) Py_CLEAR(out);
    PyBuffer_Release(&spec);
    return out;
}

typedef struct {
    PyObject *params; /* the caller's list, held by the call */
    PyObject *convert;
    PyObject *data; /* the attribute name */
} bind_ctx;

static int to_param(void *ctx, Py_ssize_t i, PyObject *cap) {
    bind_ctx *b = ctx;
    if (i >= PyList_GET_SIZE(b->params)) { /* a setter that shrank the list */
        PyErr_SetString(PyExc_RuntimeError, "dlpack_bind: the parameter list changed during the bind");
        return -1;
    }
    PyObject *t = PyObject_CallOneArg(b->convert, cap);
    if (!t) return -1;
    PyObject *p = PyList_GET_ITEM(b->params, i);
    Py_INCREF(p);
    int rc = PyObject_SetAttr(p, b->data, t);
    Py_DECREF(p);
    Py_DECREF(t);
    return rc;
}

/* dlpack_bind(buffer, spec, versioned, params, convert): params[i].data = convert(capsule i),
 * the per-parameter loop of a bind in one call. On an error the parameters before it are
 * bound: the caller unbinds them all. */
static PyObject *mod_dlpack_bind(PyObject *m, PyObject *args) {
    PyObject *obj, *params, *convert;
    Py_buffer spec;
    int versioned;
    if (!PyArg_ParseTuple(args, "Oy*pO!O", &obj, &spec, &versioned, &PyList_Type, &params, &convert)) return NULL;
    bind_ctx b = {.params = params, .convert = convert, .data = PyUnicode_FromString("data")};
    Py_INCREF(params);
    int rc = b.data ? each_view(m, obj, &spec, versioned, PyList_GET_SIZE(params), to_param, &b) : -1;
    Py_DECREF(params);
    Py_XDECREF(b.data);
    PyBuffer_Release(&spec);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef hsdp_py_dlpack_view_functions[] = {
    {"dlpack_views", mod_dlpack_views, METH_VARARGS,
     "dlpack_views(buffer, spec, versioned): one DLPack capsule per view of a host _Buffer, each a lease on it; "
     "spec is native int64s, per view (byte offset, DLPack type code, bits, ndim, shape..., strides...)."},
    {"dlpack_bind", mod_dlpack_bind, METH_VARARGS,
     "dlpack_bind(buffer, spec, versioned, params, convert): params[i].data = convert(the capsule of view i), "
     "as dlpack_views would export them; params is a list with one parameter per view."},
    {NULL, NULL, 0, NULL},
};
