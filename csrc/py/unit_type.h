/* unit_type.h - the Unit object, shared by its methods (unit_type.c) and its constructor
 * (unit_new.c). */
#ifndef HSDP_PY_UNIT_TYPE_H
#define HSDP_PY_UNIT_TYPE_H

#include "pyhsdp.h"

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

/* Unit(group, dtypes, shapes, params=None, name="", compute_dtypes=None, *, bind_attr=None,
 * device="host", wire_dtype=None, wire_params=None): the type's tp_new (unit_new.c). */
PyObject *hsdp_py_unit_new(PyTypeObject *type, PyObject *args, PyObject *kw);
/* Its attributes (unit_attrs.c). */
extern PyGetSetDef hsdp_py_unit_getset[];

#endif
