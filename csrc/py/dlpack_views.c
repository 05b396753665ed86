/* dlpack_views.c - dlpack_views(buffer, spec, versioned): one DLPack export per parameter of a
 * host buffer, each with the parameter's dtype, shape and strides, so an adapter gets its
 * parameters' tensors from one import each (torch: no dtype view and no as_strided per
 * bind). Each export is a lease on the buffer, returned by its consumer's deleter
 * ([Note: leases] in docs/design.md). Device buffers export through __dlpack__ (its stream
 * contract), not here. */
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

/* dlpack_views(buffer, spec, versioned) -> list of capsules. spec: native int64s, each view
 * (byte offset, DLPack type code, bits, ndim, shape..., strides in elements...). */
static PyObject *mod_dlpack_views(PyObject *m, PyObject *args) {
    PyObject *obj;
    Py_buffer spec;
    int versioned;
    if (!PyArg_ParseTuple(args, "Oy*p", &obj, &spec, &versioned)) return NULL;
    PyObject *out = NULL;
    int64_t *all = NULL;
    if (!PyObject_TypeCheck(obj, ((modstate *)PyModule_GetState(m))->buffer_type)) {
        PyErr_Format(PyExc_TypeError, "dlpack_views needs an hsdp _Buffer, got %R", (PyObject *)Py_TYPE(obj));
        goto done;
    }
    BufferObject *buf = (BufferObject *)obj;
    if (buf->device != HSDP_DEVICE_HOST) {
        PyErr_Format(PyExc_NotImplementedError, "dlpack_views exports host buffers; a %s buffer exports through "
                     "__dlpack__", hsdp_device_label(buf->backend, buf->device));
        goto done;
    }
    /* copied: a bytes object's data need not be aligned for int64 loads */
    Py_ssize_t count = spec.len / (Py_ssize_t)sizeof(int64_t);
    if (!(all = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(all, spec.buf, (size_t)count * sizeof(int64_t));
    const int64_t *e = all, *stop = all + count;
    if (!(out = PyList_New(0))) goto done;
    while (e < stop) {
        if (stop - e < SPEC_HEAD || e[3] < 0 || e[3] > MAX_NDIM || stop - e < SPEC_HEAD + 2 * e[3]) {
            PyErr_SetString(PyExc_ValueError, "dlpack_views: a truncated spec");
            Py_CLEAR(out);
            break;
        }
        PyObject *cap = view_capsule(buf, e, versioned);
        if (!cap || PyList_Append(out, cap) < 0) {
            Py_XDECREF(cap);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(cap);
        e += SPEC_HEAD + 2 * e[3];
    }
done:
    PyMem_Free(all);
    PyBuffer_Release(&spec);
    return out;
}

PyMethodDef hsdp_py_dlpack_view_functions[] = {
    {"dlpack_views", mod_dlpack_views, METH_VARARGS,
     "dlpack_views(buffer, spec, versioned): one DLPack capsule per view of a host _Buffer, each a lease on it; "
     "spec is native int64s, per view (byte offset, DLPack type code, bits, ndim, shape..., strides...)."},
    {NULL, NULL, 0, NULL},
};
