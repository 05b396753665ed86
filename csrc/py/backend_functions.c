/* backend_functions.c - the module functions over the backend registry: what is built
 * (backends, device_info), the settings every backend reads (timeout, agreement check, wire
 * piece size), and the end of what hsdp started (finalize_backends). No backend is named here. */
#include "pyhsdp.h" /* first: Python.h must precede system headers */

/* ------------------------------------------------------------------ registry functions */

/* backends(): ((name, usable, reason or None), ...) in registry order. */
static PyObject *mod_backends(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    size_t n = hsdp_backend_count();
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t && i < n; i++) {
        const hsdp_backend *b = hsdp_backend_at(i);
        const char *why = NULL;
        int ok = b->usable(&why);
        PyObject *row = Py_BuildValue("(sOz)", b->name, ok ? Py_True : Py_False, ok ? NULL : why);
        if (!row) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, row);
    }
    return t;
}

/* What a backend's unsharded buffers live on, as Python asks it (no backend is named here):
 * {"backend", "kind": "host" or "device", "device": "host" or the device's name, "framework":
 * the framework device type views have ("cpu" for host memory), "dlpack": (type, id),
 * "live_bytes": the device's own count, or None}. */
PyObject *hsdp_py_device_info(const hsdp_backend *b) {
    const hsdp_device_i *d = hsdp_backend_device(b);
    if (!d)
        return Py_BuildValue("{s:s,s:s,s:s,s:s,s:(ii),s:O}", "backend", b->name, "kind", "host", "device", "host",
                             "framework", "cpu", "dlpack", 1, 0, "live_bytes", Py_None);
    PyObject *live = d->live_bytes ? PyLong_FromSize_t(d->live_bytes()) : Py_NewRef(Py_None);
    if (!live) return NULL;
    PyObject *r = Py_BuildValue("{s:s,s:s,s:s,s:s,s:(ii),s:N}", "backend", b->name, "kind", "device", "device",
                                d->name, "framework", d->framework, "dlpack", d->dlpack_type,
                                d->dlpack_id ? d->dlpack_id() : 0, "live_bytes", live);
    return r;
}

/* device_info(backend): the registered backend's device_info (see ProcessGroup.device_info). */
static PyObject *mod_device_info(PyObject *m, PyObject *arg) {
    (void)m;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    const hsdp_backend *b = hsdp_backend_find(name);
    if (!b) return PyErr_Format(PyExc_ValueError, "unknown backend '%s'", name);
    return hsdp_py_device_info(b);
}

/* device_free_bytes(device): the free bytes of the named device now, by its own query (the
 * device table's mem_free: NCCL, cudaMemGetInfo), or None when its memory is the host's
 * ('host', or a device without the query): the caller then reads the host's. */
static PyObject *mod_device_free_bytes(PyObject *m, PyObject *arg) {
    (void)m;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    hsdp_device dev;
    const char *label = NULL;
    if (hsdp_device_parse(name, &dev, &label) < 0) {
        char choices[256];
        return PyErr_Format(PyExc_ValueError, "device must be one of %s, got '%s'",
                            hsdp_device_choices(choices, sizeof choices), name);
    }
    const hsdp_device_i *d = dev == HSDP_DEVICE_HOST ? NULL : hsdp_backend_device(hsdp_device_backend(label));
    if (!d || !d->mem_free) Py_RETURN_NONE;
    size_t free_bytes = 0;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = d->mem_free(&free_bytes);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    return PyLong_FromSize_t(free_bytes);
}

/* finalize_backends(): ends every backend runtime hsdp started (only those: whoever else
 * started one owns its end). Returns the names it finalised. */
static PyObject *mod_finalize_backends(PyObject *m, PyObject *unused) {
    (void)unused;
    modstate *ms = PyModule_GetState(m);
    PyObject *done = PyList_New(0);
    if (!done) return NULL;
    for (size_t i = 0; i < hsdp_backend_count(); i++) {
        if (!(ms->we_init & (1u << i))) continue;
        const char *name = hsdp_backend_at(i)->name;
        hsdp_status st;
        Py_BEGIN_ALLOW_THREADS
        st = hsdp_backend_finalize(name);
        Py_END_ALLOW_THREADS
        if (st != HSDP_OK) {
            Py_DECREF(done);
            return hsdp_py_raise(st);
        }
        ms->we_init &= ~(1u << i);
        PyObject *s = PyUnicode_FromString(name);
        if (!s || PyList_Append(done, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(done);
            return NULL;
        }
        Py_DECREF(s);
    }
    return done;
}

/* set_timeout(seconds): how long a collective may wait for its peers (0: no limit). */
static PyObject *mod_set_timeout(PyObject *m, PyObject *arg) {
    (void)m;
    double s = PyFloat_AsDouble(arg);
    if (s == -1.0 && PyErr_Occurred()) return NULL;
    hsdp_status st = hsdp_set_timeout(s);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* _set_agreement_check(on): for the benchmark that measures the check and the tests of its
 * separate round trip (every rank alike). */
static PyObject *mod_set_agreement_check(PyObject *m, PyObject *arg) {
    (void)m;
    if (PyUnicode_Check(arg)) {
        if (PyUnicode_CompareWithASCIIString(arg, "separate") != 0) {
            PyErr_Format(PyExc_ValueError, "_set_agreement_check: on is True, False or 'separate', not %R", arg);
            return NULL;
        }
        hsdp_set_agreement_check(HSDP_AGREE_SEPARATE);
        Py_RETURN_NONE;
    }
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    hsdp_set_agreement_check(on ? HSDP_AGREE_ON : HSDP_AGREE_OFF);
    Py_RETURN_NONE;
}

/* _set_wire_piece_bytes(n): the float8 wire's piece on MPI (backend.h), for the benchmark and
 * the tests of small pieces; returns the previous value. */
static PyObject *mod_set_wire_piece_bytes(PyObject *m, PyObject *arg) {
    (void)m;
    Py_ssize_t n = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "_set_wire_piece_bytes: bytes must be >= 0 (0: one message), got %zd", n);
        return NULL;
    }
    size_t was = hsdp_wire_piece_bytes();
    hsdp_set_wire_piece_bytes((size_t)n);
    return PyLong_FromSize_t(was);
}

static PyObject *mod_get_timeout(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    return PyFloat_FromDouble((double)hsdp_timeout_ns() / 1e9);
}

PyMethodDef hsdp_py_backend_functions[] = {
    {"set_timeout", mod_set_timeout, METH_O,
     "set_timeout(seconds): how long a collective may wait for its peers before the job is ended (0: no limit)."},
    {"get_timeout", mod_get_timeout, METH_NOARGS, "The collective timeout in seconds (0: no limit)."},
    {"_set_agreement_check", mod_set_agreement_check, METH_O,
     "_set_agreement_check(on): whether collective unit gathers check that every rank gathers the same unit "
     "(default True; False only to measure the check, 'separate' to give it its own round trip; every rank "
     "alike)."},
    {"_set_wire_piece_bytes", mod_set_wire_piece_bytes, METH_O,
     "_set_wire_piece_bytes(n): a float8 wire chunk of more than n bytes crosses MPI in pieces of at least n, "
     "each decoded as it lands (0: one message); returns the previous value."},
    {"backends", mod_backends, METH_NOARGS,
     "The registered backends: (name, usable, reason it is not usable or None) each."},
    {"device_info", mod_device_info, METH_O,
     "device_info(backend): where the named backend's unsharded buffers live: a dict with backend, kind ('host' "
     "or 'device'), device ('host' or the device's name), framework (the device type of views: 'cpu', 'cuda'), "
     "dlpack ((type, id)) and live_bytes (the device's own count of its live buffers, or None)."},
    {"device_free_bytes", mod_device_free_bytes, METH_O,
     "device_free_bytes(device): the named device's free bytes now, by its own query (the NCCL backend: "
     "cudaMemGetInfo), or None when its memory is the host's ('host', or a device without the query)."},
    {"finalize_backends", mod_finalize_backends, METH_NOARGS,
     "End every backend runtime hsdp started itself (MPI_Finalize, say); returns their names."},
    {NULL, NULL, 0, NULL},
};
