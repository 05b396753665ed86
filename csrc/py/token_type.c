/* token_type.c - WholeBytes(nbytes): holds `nbytes` in the whole_bytes counter for as long as
 * it lives, so the count follows the objects that really hold the memory (ignored and
 * unshardable parameters, kept whole on every rank). */
#include "pyhsdp.h"  /* first: Python.h must precede system headers */
#include <stdatomic.h>
#include <structmember.h>

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
    self->stats = &hsdp_py_state(type)->stats;
    self->module = Py_NewRef(PyType_GetModule(type));
    self->n = (size_t)n;
    atomic_fetch_add(&self->stats->whole_bytes, self->n);
    return (PyObject *)self;
}

static int token_traverse(TokenObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    return 0;
}

static void token_dealloc(TokenObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
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
    {Py_tp_traverse, token_traverse},
    {Py_tp_members, token_members},
    {Py_tp_doc, "WholeBytes(nbytes): counts parameters kept whole while it lives."},
    {0, NULL},
};

PyType_Spec hsdp_py_token_spec = {"hsdp._C.WholeBytes", sizeof(TokenObject), 0, HSDP_PY_TYPE_FLAGS, token_slots};
