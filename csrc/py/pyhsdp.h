/* pyhsdp.h - what the files of the CPython wrapper hsdp._C share: the module state, the
 * object layouts that cross files, and one helper each for the bookkeeping they repeat. Only
 * csrc/py/ includes it; the core (the .c files in csrc/) never sees Python.
 *
 *   module.c       module state, init, accounting and mesh functions, the error mapper
 *   npy.c          the NumPy bridge: dtype <-> NumPy type, casts of arrays, pread into arrays
 *   token_type.c   WholeBytes: accounting of parameters kept whole
 *   buffer_type.c  _Buffer (an unsharded buffer) and the pool of idle ones
 *   dlpack.c       _Buffer.__dlpack__: the buffer exported zero-copy to torch and others
 *   dlpack_views.c dlpack_views: one export per parameter of a host buffer (torch binds)
 *   group_type.c   ProcessGroup over the backend registry
 *   backend_functions.c  the module functions over the registry (backends, finalize, settings)
 *   unit_type.c    Unit: one flat shard unit, its gathers and its parameter views (unit_type.h;
 *                  its constructor unit_new.c, its attributes unit_attrs.c)
 *   config_type.c  HSDPInferenceConfig
 * A backend's own module functions (its bootstrap) live beside this folder, in
 * csrc/py_<backend>/ (py_nccl/nccl_functions.c), and module.c adds each through one line of
 * its list of hsdp_py_backend_part. */
#ifndef HSDP_PYHSDP_H
#define HSDP_PYHSDP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_20_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL hsdp_py_ARRAY_API
#ifndef HSDP_PY_MAIN /* module.c imports the NumPy API; the other files share it */
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "../backend.h"
#include "../hsdp.h"

/* The pool keeps at most this many idle unsharded buffers (exported as _C.POOL_SLOTS, which
 * the Python schedule reads). */
#define HSDP_POOL_SLOTS 256
/* Idle buffers the pool keeps before any schedule sizes it (buffer_type.c). */
#define HSDP_DEFAULT_POOL_CAPACITY 2

struct BufferObject;

typedef struct {
    PyTypeObject *group_type;
    PyTypeObject *unit_type;
    PyTypeObject *buffer_type;
    PyTypeObject *config_type;
    PyTypeObject *token_type;
    hsdp_stats stats;
    unsigned we_init; /* bit i: hsdp started backend i's runtime, so may finalise it */
    /* Idle unsharded buffers kept for reuse, oldest first, so that a steady-state forward
     * allocates nothing. Strong references; capacity set by the Python schedule from the
     * recorded order (0: no pooling). */
    struct BufferObject *pool[HSDP_POOL_SLOTS];
    int pool_n, pool_cap;
    long live_buffers, peak_live_buffers;
    struct BufferObject *empty; /* strong: the one 0-byte buffer units with no bytes share */
    PyObject *oom_handler;      /* strong, or NULL: nccl_set_oom_handler's callable */
} modstate;

modstate *hsdp_py_state(PyTypeObject *t);
/* Raises the Python exception that matches a core status, with the core's message; NULL. */
PyObject *hsdp_py_raise(hsdp_status st);

/* ------------------------------------------------------------------ npy.c */
/* Any dtype spelling (name, NumPy dtype, torch dtype, hsdp DType) -> core dtype, through
 * hsdp.dtypes.as_dtype so that the aliases live in one place. */
int hsdp_py_parse_dtype(PyObject *obj, hsdp_dtype *out);
/* The NumPy type number of a core dtype, or -1 where NumPy has none (bfloat16, float8). */
int hsdp_py_npy_type(hsdp_dtype dt);
/* The dtype NumPy computes a value of dt in: itself, or float32 where NumPy has no type. */
hsdp_dtype hsdp_py_npy_compute(hsdp_dtype dt);
/* The core dtype of an array's elements; -1 with TypeError for anything else. */
int hsdp_py_array_dtype(PyArrayObject *a, hsdp_dtype *out);
PyObject *hsdp_py_dtype_name_or_none(int code);
/* A writable C-contiguous array, or NULL with an error naming the parameter `what`. */
PyArrayObject *hsdp_py_writable_array(PyObject *obj, const char *what);
extern PyMethodDef hsdp_py_npy_functions[];

/* ------------------------------------------------------------------ buffer_type.c */
/* [Note: leases] (docs/design.md, "Buffers owned by Python objects", points here.)
 * Who owns a gathered buffer, and how the pool knows it may reuse one, without reading a
 * reference count:
 * - The owner. While a unit is unsharded (or its gather is in flight) the Unit holds the
 *   _Buffer; the pool holds the idle ones. Neither reads the bytes.
 * - A lease per view. Every view of the bytes handed out is a lease on the buffer, counted
 *   here (leases): a DLPack export (__dlpack__, dlpack.c) until the consumer calls its
 *   deleter (torch: when the last tensor on that storage dies), and a buffer-protocol export
 *   until it is released. The NumPy views a unit binds in C share one such export (a
 *   memoryview) per buffer. A bare reference to the _Buffer reads nothing and holds no lease.
 * - When it returns. The torch adapter imports each parameter's view of a host buffer from
 *   its own DLPack export (_C.dlpack_views, dlpack_views.c: one lease each; a device buffer:
 *   one __dlpack__ import cut by as_strided) and lets the parameters be their only holders;
 *   unbind (at reshard) swaps placeholders in, the tensors die and torch returns the lease
 *   before the unit gives the buffer back. The NumPy views go when the unit sets _data =
 *   None. Ulysses' exchange buffers are leased the same way in Python (parallel._Lease).
 * - The pool (buffer_type.c) takes back a buffer only at 0 leases and does not hand out a
 *   pooled buffer leased since; one given back while leased stays out of the pool and is
 *   freed when its last lease returns.
 * - A user who keeps a view past reshard holds the lease: the buffer stays out of the pool
 *   with its numbers and the next forward gathers into another buffer; nothing changes
 *   under the user, the cost is one more allocation while the view lives.
 * - Why views are not kept across forwards: torch views of one storage are
 *   indistinguishable, so kept views could only be told from a user's alias by the storage's
 *   use count (the design this replaced, with a reference cycle the GC could not see). A
 *   fresh storage per bind makes the lease exact, for one DLPack import per parameter per
 *   bind (docs/performance.md, "Hook overhead"). */
typedef struct BufferObject {
    PyObject_HEAD
    void *p; /* owned: hsdp_device_free in dealloc */
    size_t n;
    hsdp_device device;
    const hsdp_backend *backend; /* allocates device buffers; static tables, never freed */
    hsdp_stats *stats;
    PyObject *module; /* strong: keeps the stats alive */
    /* Views of the bytes handed out and not yet returned (DLPack exports until their
     * deleter runs, buffer-protocol exports until released): see [Note: leases] above.
     * The pool reuses a buffer only while this is 0. GIL held. */
    Py_ssize_t leases;
} BufferObject;

extern PyType_Spec hsdp_py_buffer_spec;
extern PyMethodDef hsdp_py_dlpack_methods[]; /* dlpack.c: __dlpack__, __dlpack_device__ */
extern PyMethodDef hsdp_py_dlpack_view_functions[]; /* dlpack_views.c: one export per parameter */
extern PyMethodDef hsdp_py_pool_functions[];
/* A buffer of n bytes on device: an idle pooled one of that size and device first, else a
 * fresh one. New reference. */
BufferObject *hsdp_py_buffer_take(modstate *ms, size_t n, const hsdp_backend *b, hsdp_device device);
/* Gives a buffer back: to the pool when no lease on it is out and the pool has room, else it
 * is released (a leased one lives on with its leases). Steals the reference; NULL is fine. */
void hsdp_py_buffer_give(modstate *ms, BufferObject *b);
void hsdp_py_pool_trim(modstate *ms, int keep);
/* A lease on b's bytes: b stays alive and out of reuse until hsdp_py_buffer_return. */
void hsdp_py_buffer_lease(BufferObject *b);
/* Returns a lease taken by hsdp_py_buffer_lease (drops its reference: b may be freed). */
void hsdp_py_buffer_return(BufferObject *b);

/* ------------------------------------------------------------------ group_type.c */
typedef struct {
    PyObject_HEAD
    hsdp_group *g; /* owned: hsdp_group_free in dealloc */
    PyObject *module;
    /* A started sendrecv (sendrecv_start .. sendrecv_wait), one at a time: the request
     * (owned, PyMem) and strong references to its arrays, released by the wait. */
    hsdp_req *p2p;
    PyObject *p2p_send, *p2p_recv;
} GroupObject;

extern PyType_Spec hsdp_py_group_spec;
extern PyMethodDef hsdp_py_backend_functions[]; /* backend_functions.c */
/* What a backend's unsharded buffers live on, as a dict (backend_functions.c). */
PyObject *hsdp_py_device_info(const hsdp_backend *b);
/* A backend's own part of hsdp._C (csrc/py_<backend>/): its module functions, and what it
 * drops at module teardown (NULL: nothing). */
typedef struct {
    PyMethodDef *functions;
    void (*clear)(modstate *ms);
} hsdp_py_backend_part;

/* ------------------------------------------------------------------ the rest */
extern PyType_Spec hsdp_py_unit_spec;
extern PyType_Spec hsdp_py_config_spec;
/* _C.WIRE_NOT_BUILT: {wire format not built: why} (config_type.c). 0, or -1 with an error. */
int hsdp_py_config_add_constants(PyObject *m);
extern PyType_Spec hsdp_py_token_spec;

/* The flags of every type hsdp._C defines whose objects hold Python references: immutable
 * (no attribute of the type can be set) and tracked by the GC (tp_traverse, Py_TYPE too). */
#define HSDP_PY_TYPE_FLAGS (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC)

/* Runs `stmt` with the GIL released while `flag` (an object's busy field) is set, so the
 * object refuses re-entry from another Python thread meanwhile. */
#define HSDP_PY_BUSY_NOGIL(flag, stmt) \
    do {                               \
        (flag) = 1;                    \
        Py_BEGIN_ALLOW_THREADS         \
        stmt;                          \
        Py_END_ALLOW_THREADS           \
        (flag) = 0;                    \
    } while (0)

#endif
