/* module.c - the CPython extension hsdp._C: module state, initialisation, the one mapper from
 * core statuses to exceptions, and the accounting and mesh functions. It follows CPython's
 * conventions for extensions (as Modules/_bz2module.c): multi-phase initialisation (PEP 489),
 * immutable heap types made from specs and bound to the module state, GC support wherever
 * an object holds Python references, and no global mutable Python state. The types live one
 * per file (see pyhsdp.h). */
#define HSDP_PY_MAIN
#include "pyhsdp.h"  /* first: Python.h must precede system headers */
#include <stdatomic.h>
#include <string.h>

modstate *hsdp_py_state(PyTypeObject *t) { return (modstate *)PyType_GetModuleState(t); }

PyObject *hsdp_py_raise(hsdp_status st) {
    PyObject *exc;
    switch (st) {
    case HSDP_EINVAL: exc = PyExc_ValueError; break;
    case HSDP_ETYPE: exc = PyExc_TypeError; break;
    case HSDP_ENOMEM: exc = PyExc_MemoryError; break;
    case HSDP_EIO: exc = PyExc_OSError; break;
    case HSDP_EUNSUPPORTED: exc = PyExc_NotImplementedError; break;
    case HSDP_ENODEVICE: exc = PyExc_RuntimeError; break; /* no GPU: what torch raises for one */
    default: exc = PyExc_RuntimeError; break;
    }
    PyErr_SetString(exc, hsdp_last_error());
    return NULL;
}

static PyObject *mod_memory_stats(PyObject *m, PyObject *unused) {
    (void)unused;
    modstate *ms = PyModule_GetState(m);
    hsdp_stats *s = &ms->stats;
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:l,s:l,s:i}", "sharded_bytes",
                         (Py_ssize_t)atomic_load(&s->sharded_bytes), "pooled_bytes",
                         (Py_ssize_t)atomic_load(&s->pooled_bytes), "unsharded_bytes",
                         (Py_ssize_t)atomic_load(&s->unsharded_bytes), "peak_unsharded_bytes",
                         (Py_ssize_t)atomic_load(&s->peak_unsharded_bytes), "whole_bytes",
                         (Py_ssize_t)atomic_load(&s->whole_bytes), "buffer_allocs",
                         (unsigned long long)atomic_load(&s->buffer_allocs), "gathers",
                         (unsigned long long)atomic_load(&s->gathers), "live_buffers", ms->live_buffers,
                         "peak_live_buffers", ms->peak_live_buffers, "pool_capacity", ms->pool_cap);
}

static PyObject *mod_reset_peak(PyObject *m, PyObject *unused) {
    (void)unused;
    modstate *ms = PyModule_GetState(m);
    atomic_store(&ms->stats.peak_unsharded_bytes, atomic_load(&ms->stats.unsharded_bytes));
    ms->peak_live_buffers = ms->live_buffers;
    Py_RETURN_NONE;
}

static PyObject *mod_trim_memory(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    int released;
    Py_BEGIN_ALLOW_THREADS
    released = hsdp_trim_memory();
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(released);
}

static PyObject *mod_now_ns(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyLong_FromUnsignedLongLong((unsigned long long)hsdp_now_ns());
}

/* mesh_coords(world_size, rank, replicate, shard): the core's one validation of mesh sizes
 * (-1 resolved), this rank's coordinates and its two groups' world ranks. */
static PyObject *mod_mesh_coords(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"world_size", "rank", "replicate", "shard", NULL};
    int world, rank, replicate, shard;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiii", kwlist, &world, &rank, &replicate, &shard)) return NULL;
    hsdp_mesh mesh;
    hsdp_status st = hsdp_mesh_init(&mesh, world, rank, replicate, shard);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    PyObject *sg = PyTuple_New(mesh.shard), *rg = PyTuple_New(mesh.replicate);
    if (!sg || !rg) goto fail;
    for (int i = 0; i < mesh.shard; i++) PyTuple_SET_ITEM(sg, i, PyLong_FromLong(hsdp_mesh_rank_of(&mesh, mesh.r, i)));
    for (int i = 0; i < mesh.replicate; i++)
        PyTuple_SET_ITEM(rg, i, PyLong_FromLong(hsdp_mesh_rank_of(&mesh, i, mesh.s)));
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:N,s:N}", "replicate", mesh.replicate, "shard", mesh.shard, "r", mesh.r,
                         "s", mesh.s, "shard_group", sg, "replicate_group", rg);
fail:
    Py_XDECREF(sg);
    Py_XDECREF(rg);
    return NULL;
}

/* mesh_sizes(world_size, replicate, shard): the same rule over a world of world_size ranks
 * without a rank: (replicate, shard) with -1 resolved, or the ValueError naming the values.
 * The parallel config asks it, so the mesh-size rule is written once (mesh.c). */
static PyObject *mod_mesh_sizes(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"world_size", "replicate", "shard", NULL};
    int world, replicate, shard;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iii", kwlist, &world, &replicate, &shard)) return NULL;
    hsdp_mesh mesh;
    hsdp_status st = hsdp_mesh_init(&mesh, world, 0, replicate, shard);
    if (st != HSDP_OK) return hsdp_py_raise(st);
    return Py_BuildValue("(ii)", mesh.replicate, mesh.shard);
}

static PyMethodDef mod_methods[] = {
    {"memory_stats", mod_memory_stats, METH_NOARGS, "Bytes this process holds for hsdp, from the core's counters."},
    {"reset_peak", mod_reset_peak, METH_NOARGS, "Reset the peak counters to the current values."},
    {"now_ns", mod_now_ns, METH_NOARGS, "CLOCK_MONOTONIC in ns (the clock of gather_times)."},
    {"trim_memory", mod_trim_memory, METH_NOARGS,
     "Give freed heap memory back to the system (glibc malloc_trim); whether any was released."},
    {"mesh_coords", (PyCFunction)(void (*)(void))mod_mesh_coords, METH_VARARGS | METH_KEYWORDS,
     "mesh_coords(world_size, rank, replicate, shard): validated sizes, coordinates and group ranks."},
    {"mesh_sizes", (PyCFunction)(void (*)(void))mod_mesh_sizes, METH_VARARGS | METH_KEYWORDS,
     "mesh_sizes(world_size, replicate, shard): the validated (replicate, shard), -1 resolved."},
    {NULL, NULL, 0, NULL},
};

static int mod_traverse(PyObject *m, visitproc visit, void *arg) {
    modstate *ms = PyModule_GetState(m);
    if (!ms) return 0;
    Py_VISIT(ms->group_type);
    Py_VISIT(ms->unit_type);
    Py_VISIT(ms->buffer_type);
    Py_VISIT(ms->config_type);
    Py_VISIT(ms->token_type);
    Py_VISIT(ms->oom_handler);
    for (int i = 0; i < ms->pool_n; i++) Py_VISIT(ms->pool[i]);
    Py_VISIT(ms->empty);
    return 0;
}

/* The backends' own parts of the module (their bootstrap functions), from backends.def. */
#define HSDP_PY_PART(name) extern const hsdp_py_backend_part hsdp_py_##name##_part;
#include "backends.def"
static const hsdp_py_backend_part *const backend_parts[] = {
#define HSDP_PY_PART(name) &hsdp_py_##name##_part,
#include "backends.def"
};
#define NPARTS (sizeof backend_parts / sizeof backend_parts[0])

static int mod_clear(PyObject *m) {
    modstate *ms = PyModule_GetState(m);
    if (!ms) return 0;
    ms->pool_cap = 0;
    hsdp_py_pool_trim(ms, 0);
    for (size_t i = 0; i < NPARTS; i++)
        if (backend_parts[i]->clear) backend_parts[i]->clear(ms);
    Py_CLEAR(ms->empty);
    Py_CLEAR(ms->group_type);
    Py_CLEAR(ms->unit_type);
    Py_CLEAR(ms->buffer_type);
    Py_CLEAR(ms->config_type);
    Py_CLEAR(ms->token_type);
    return 0;
}

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot, const char *public_name) {
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (!*slot) return -1;
    return public_name ? PyModule_AddObjectRef(m, public_name, (PyObject *)*slot) : 0;
}

static void mod_free(void *m) { (void)mod_clear((PyObject *)m); }

/* Py_mod_exec: fills a new module object (its state is zeroed by CPython). */
static int mod_exec(PyObject *m) {
    if (_import_array() < 0) return -1; /* the NumPy C API (import_array without its return) */
    modstate *ms = PyModule_GetState(m);
    /* Idle buffers kept by default, so that explicit unshard/reshard (and resident) reuse
     * their memory instead of allocating and faulting it in every time; a forward's schedule
     * sizes the pool itself. hsdp.set_pool_capacity and hsdp.empty_pool trade it back. */
    ms->pool_cap = HSDP_DEFAULT_POOL_CAPACITY;
    hsdp_stats_init(&ms->stats);
    if (add_type(m, &hsdp_py_group_spec, &ms->group_type, "ProcessGroup") < 0 ||
        add_type(m, &hsdp_py_unit_spec, &ms->unit_type, "Unit") < 0 ||
        add_type(m, &hsdp_py_buffer_spec, &ms->buffer_type, NULL) < 0 ||
        add_type(m, &hsdp_py_config_spec, &ms->config_type, "HSDPInferenceConfig") < 0 ||
        add_type(m, &hsdp_py_token_spec, &ms->token_type, "WholeBytes") < 0 ||
        PyModule_AddFunctions(m, hsdp_py_npy_functions) < 0 || PyModule_AddFunctions(m, hsdp_py_pool_functions) < 0 ||
        PyModule_AddFunctions(m, hsdp_py_dlpack_view_functions) < 0 ||
        PyModule_AddFunctions(m, hsdp_py_backend_functions) < 0 ||
        PyModule_AddIntConstant(m, "ALIGN", HSDP_ALIGN) < 0 ||
        PyModule_AddIntConstant(m, "POOL_SLOTS", HSDP_POOL_SLOTS) < 0 || hsdp_py_config_add_constants(m) < 0)
        return -1;
    for (size_t i = 0; i < NPARTS; i++)
        if (PyModule_AddFunctions(m, backend_parts[i]->functions) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot mod_slots[] = {
    {Py_mod_exec, mod_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* the core's state is per process (the backends' runtimes, the collective worker, the
     * last error), and NumPy supports no subinterpreters: one interpreter only */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_USED}, /* the pool and the leases rely on the GIL */
#endif
    {0, NULL},
};

static struct PyModuleDef hsdp_module = {
    PyModuleDef_HEAD_INIT, "hsdp._C", "The hsdp C core: process groups, units, dtype casts, accounting.",
    sizeof(modstate), mod_methods, mod_slots, mod_traverse, mod_clear, mod_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&hsdp_module); }
