/* dlpack.c - _Buffer.__dlpack__ / __dlpack_device__: a gathered buffer exported zero-copy as
 * a 1-D uint8 tensor, so torch (torch.from_dlpack) and any other DLPack consumer views the
 * very bytes the gather wrote, in the public DLPack ABI (dlpack_abi.h: 1.x, and the legacy
 * unversioned form for consumers that ask for no version). Each export is a lease
 * on the buffer, returned when the consumer's deleter runs, so the pool never reuses a
 * buffer something still views ([Note: leases] in docs/design.md). */
#include "pyhsdp.h" /* first: Python.h must precede system headers */
#include <stdint.h>
#include <stdlib.h>

#include "dlpack_abi.h"

/* One allocation per export, owned by the capsule until a consumer takes it, then by the
 * consumer until it calls the deleter. */
typedef struct {
    hsdp_dlpack_managed t;
    int64_t shape[1], strides[1];
} export_block;

static void release_owner(void *ctx) {
    /* The consumer may free its tensor on any thread, and after the interpreter is gone. */
    if (!ctx || !Py_IsInitialized()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    hsdp_py_buffer_return((BufferObject *)ctx);
    PyGILState_Release(g);
}

void hsdp_py_dlpack_delete_versioned(DLManagedTensorVersioned *self) {
    release_owner(self->manager_ctx);
    free(self); /* the export_block: t is its first member */
}

void hsdp_py_dlpack_delete_legacy(DLManagedTensor *self) {
    release_owner(self->manager_ctx);
    free(self);
}

void hsdp_py_dlpack_capsule_versioned(PyObject *cap) {
    /* Still named "dltensor_versioned": nobody consumed it, so the export is ours to free. */
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *t = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (t && t->deleter) t->deleter(t);
    }
}

void hsdp_py_dlpack_capsule_legacy(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *t = PyCapsule_GetPointer(cap, "dltensor");
        if (t && t->deleter) t->deleter(t);
    }
}

/* The buffer's device table, or NULL for host memory. */
static const hsdp_device_i *device_i(const BufferObject *b) {
    return b->device == HSDP_DEVICE_HOST ? NULL : hsdp_backend_device(b->backend);
}

static DLDevice device_of(const BufferObject *b) {
    const hsdp_device_i *d = device_i(b);
    DLDevice out = {d ? d->dlpack_type : 1 /* kDLCPU */, d && d->dlpack_id ? d->dlpack_id() : 0};
    return out;
}

/* __dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) */
static PyObject *buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO", kwlist, &stream, &max_version, &dl_device, &copy))
        return NULL;
    if (copy == Py_True)
        return PyErr_Format(PyExc_BufferError, "an hsdp buffer is exported without a copy (copy=True refused)");
    if (dl_device != Py_None) { /* the consumer names a device: it must be this buffer's own */
        DLDevice own = device_of(self);
        int type = -1, id = -1;
        if (!PyArg_ParseTuple(dl_device, "ii;dl_device must be a (device_type, device_id) tuple", &type, &id))
            return NULL;
        if (type != own.device_type || id != own.device_id)
            return PyErr_Format(PyExc_BufferError, "an hsdp %s buffer lives on DLPack device (%d, %d), not (%d, %d); "
                                "it is exported without a copy", hsdp_device_label(self->backend, self->device),
                                own.device_type,
                                own.device_id, type, id);
    }
    const hsdp_device_i *dev = device_i(self);
    if (dev && dev->consumer_wait) {
        /* The consumer's stream waits for the gather writing this buffer (the host does not);
         * the device reads its own DLPack stream conventions. A device without streams, and
         * host memory, has landed once the gather's wait returned: stream is not needed. */
        long long v = 0;
        if (stream != Py_None) {
            v = PyLong_AsLongLong(stream);
            if (v == -1 && PyErr_Occurred()) return NULL;
        }
        hsdp_status st;
        Py_BEGIN_ALLOW_THREADS
        st = dev->consumer_wait(stream != Py_None, v, self->p, self->n);
        Py_END_ALLOW_THREADS
        if (st == HSDP_EINVAL) return PyErr_Format(PyExc_BufferError, "%s", hsdp_last_error());
        if (st != HSDP_OK) return hsdp_py_raise(st);
    }
    long major = 0;
    if (max_version != Py_None) {
        if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) < 1)
            return PyErr_Format(PyExc_TypeError, "max_version must be a (major, minor) tuple, got %R", max_version);
        major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
        if (major == -1 && PyErr_Occurred()) return NULL;
    }
    export_block *blk = calloc(1, sizeof *blk); /* owned as described above */
    if (!blk) return PyErr_NoMemory();
    blk->shape[0] = (int64_t)self->n;
    blk->strides[0] = 1;
    DLTensor tensor = {.data = self->p,
                       .device = device_of(self),
                       .ndim = 1,
                       .dtype = {.code = 1, .bits = 8, .lanes = 1},
                       .shape = blk->shape,
                       .strides = blk->strides,
                       .byte_offset = 0};
    return hsdp_py_dlpack_capsule(&blk->t, self, tensor, major >= 1);
}

PyObject *hsdp_py_dlpack_capsule(hsdp_dlpack_managed *t, BufferObject *buf, DLTensor tensor, int versioned) {
    PyObject *cap;
    hsdp_py_buffer_lease(buf); /* returned by the deleter */
    if (versioned) {
        t->v = (DLManagedTensorVersioned){.version = {1, 0},
                                          .manager_ctx = buf,
                                          .deleter = hsdp_py_dlpack_delete_versioned,
                                          .flags = DLPACK_FLAG_READ_ONLY,
                                          .dl_tensor = tensor};
        cap = PyCapsule_New(&t->v, "dltensor_versioned", hsdp_py_dlpack_capsule_versioned);
    } else {
        t->legacy = (DLManagedTensor){.dl_tensor = tensor, .manager_ctx = buf, .deleter = hsdp_py_dlpack_delete_legacy};
        cap = PyCapsule_New(&t->legacy, "dltensor", hsdp_py_dlpack_capsule_legacy);
    }
    if (!cap) {
        hsdp_py_buffer_return(buf);
        free(t);
    }
    return cap;
}

static PyObject *buffer_dlpack_device(BufferObject *self, PyObject *unused) {
    (void)unused;
    DLDevice d = device_of(self);
    return Py_BuildValue("(ii)", d.device_type, d.device_id);
}

PyMethodDef hsdp_py_dlpack_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None): the buffer as a 1-D uint8 "
     "DLPack tensor, zero-copy; it keeps the buffer alive until the consumer lets go. A buffer on a device with "
     "streams (CUDA) makes the consumer's stream wait for the gather writing it (stream=-1: no ordering). The read-only flag is set, "
     "but torch ignores it: a write through the tensor changes the gathered weights until the next reshard."},
    {"__dlpack_device__", (PyCFunction)buffer_dlpack_device, METH_NOARGS, "(device type, device id) for DLPack."},
    {NULL, NULL, 0, NULL},
};
