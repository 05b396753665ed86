/* unit_attrs.c - Unit's read-only attributes (unit_type.h): its layout, dtypes, device, state
 * and wire, as the adapters and tests read them. */
#include "pyhsdp.h" /* first: Python.h must precede system headers */
#include <stdlib.h>
#include <string.h>

#include "unit_type.h"

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
PyGetSetDef hsdp_py_unit_getset[] = {
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
