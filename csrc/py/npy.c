/* npy.c - the NumPy bridge: core dtypes <-> NumPy types, and the module functions that cast
 * or read NumPy arrays (encode, decode, round_to, pread_into, dtype_table). What NumPy can
 * compute in is decided here, and only here: it has float16 but no bfloat16 or float8, so
 * those are computed in float32 (the NumPy adapter asks the core to convert them). */
#include "pyhsdp.h"  /* first: Python.h must precede system headers */

int hsdp_py_parse_dtype(PyObject *obj, hsdp_dtype *out) {
    PyObject *mod = PyImport_ImportModule("hsdp.dtypes");
    if (!mod) return -1;
    PyObject *d = PyObject_CallMethod(mod, "as_dtype", "O", obj);
    Py_DECREF(mod);
    if (!d) return -1;
    const char *name = PyUnicode_AsUTF8(d);
    int rc = name && hsdp_dtype_from_name(name, out) == 0 ? 0 : -1;
    if (rc && !PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "unknown dtype %R", d);
    Py_DECREF(d);
    return rc;
}

/* Indexed by hsdp_dtype: the one table of NumPy equivalents (-1: NumPy has no such type). */
static const int npy_types[HSDP_DTYPE_COUNT] = {
    [HSDP_F32] = NPY_FLOAT32, [HSDP_F16] = NPY_FLOAT16, [HSDP_BF16] = -1,      [HSDP_F8E4M3] = -1,
    [HSDP_F8E5M2] = -1,       [HSDP_F64] = NPY_FLOAT64, [HSDP_BOOL] = NPY_BOOL, [HSDP_U8] = NPY_UINT8,
    [HSDP_I8] = NPY_INT8,     [HSDP_U16] = NPY_UINT16,  [HSDP_I16] = NPY_INT16, [HSDP_U32] = NPY_UINT32,
    [HSDP_I32] = NPY_INT32,   [HSDP_U64] = NPY_UINT64,  [HSDP_I64] = NPY_INT64,
};

int hsdp_py_npy_type(hsdp_dtype dt) { return (unsigned)dt < (unsigned)HSDP_DTYPE_COUNT ? npy_types[dt] : -1; }

hsdp_dtype hsdp_py_npy_compute(hsdp_dtype dt) { return hsdp_py_npy_type(dt) >= 0 ? dt : HSDP_F32; }

int hsdp_py_array_dtype(PyArrayObject *a, hsdp_dtype *out) {
    int t = PyArray_TYPE(a);
    for (int d = 0; d < HSDP_DTYPE_COUNT; d++)
        if (npy_types[d] == t) {
            *out = (hsdp_dtype)d;
            return 0;
        }
    PyErr_Format(PyExc_TypeError, "arrays of dtype %R are not supported", (PyObject *)PyArray_DESCR(a));
    return -1;
}

PyObject *hsdp_py_dtype_name_or_none(int code) {
    if (code < 0) Py_RETURN_NONE;
    return PyUnicode_FromString(hsdp_dtype_name((hsdp_dtype)code));
}

PyArrayObject *hsdp_py_writable_array(PyObject *obj, const char *what) {
    if (!PyArray_Check(obj))
        return (PyArrayObject *)PyErr_Format(PyExc_TypeError, "%s must be a NumPy array, got %s", what,
                                             Py_TYPE(obj)->tp_name);
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISWRITEABLE(a))
        return (PyArrayObject *)PyErr_Format(PyExc_ValueError, "%s must be a writable C-contiguous array", what);
    return a;
}

/* A new array shaped like src, of NumPy type npy, holding src's elements cast from st to dt
 * (the GIL released for the cast). Takes over the reference to src. */
static PyObject *cast_new(PyArrayObject *src, hsdp_dtype st, hsdp_dtype dt, int npy) {
    PyArrayObject *dst = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(src), PyArray_DIMS(src), npy);
    if (!dst) {
        Py_DECREF(src);
        return NULL;
    }
    hsdp_status s;
    Py_BEGIN_ALLOW_THREADS
    s = hsdp_cast(PyArray_DATA(dst), dt, PyArray_DATA(src), st, (size_t)PyArray_SIZE(src));
    Py_END_ALLOW_THREADS
    Py_DECREF(src);
    if (s != HSDP_OK) {
        Py_DECREF(dst);
        return hsdp_py_raise(s);
    }
    return (PyObject *)dst;
}

/* Encodes a floating array into `dtype`'s raw bits (uint16 for bfloat16, uint8 for float8,
 * the NumPy type otherwise). */
static PyObject *encode_impl(PyObject *obj, hsdp_dtype dt) {
    PyArrayObject *src = (PyArrayObject *)PyArray_FROM_OF(obj, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!src) return NULL;
    hsdp_dtype st;
    if (hsdp_py_array_dtype(src, &st) < 0) {
        Py_DECREF(src);
        return NULL;
    }
    int npy = hsdp_py_npy_type(dt);
    if (npy < 0) npy = hsdp_dtype_size(dt) == 2 ? NPY_UINT16 : NPY_UINT8;
    return cast_new(src, st, dt, npy);
}

static PyObject *decode_impl(PyObject *obj, hsdp_dtype dt) {
    PyArrayObject *src = (PyArrayObject *)PyArray_FROM_OF(obj, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!src) return NULL;
    if ((size_t)PyArray_ITEMSIZE(src) != hsdp_dtype_size(dt)) {
        PyErr_Format(PyExc_ValueError, "raw %s data needs %zu-byte elements, the array has %zd-byte ones",
                     hsdp_dtype_name(dt), hsdp_dtype_size(dt), (Py_ssize_t)PyArray_ITEMSIZE(src));
        Py_DECREF(src);
        return NULL;
    }
    hsdp_dtype ct = hsdp_py_npy_compute(dt);
    return cast_new(src, dt, ct, hsdp_py_npy_type(ct));
}

static PyObject *mod_encode(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *obj, *d;
    hsdp_dtype dt;
    if (!PyArg_ParseTuple(args, "OO", &obj, &d) || hsdp_py_parse_dtype(d, &dt) < 0) return NULL;
    return encode_impl(obj, dt);
}

static PyObject *mod_decode(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *obj, *d;
    hsdp_dtype dt;
    if (!PyArg_ParseTuple(args, "OO", &obj, &d) || hsdp_py_parse_dtype(d, &dt) < 0) return NULL;
    return decode_impl(obj, dt);
}

/* round_to(array, dtype): values rounded to `dtype` and returned in its NumPy compute dtype. */
static PyObject *mod_round_to(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *obj, *d;
    hsdp_dtype dt;
    if (!PyArg_ParseTuple(args, "OO", &obj, &d) || hsdp_py_parse_dtype(d, &dt) < 0) return NULL;
    if (!hsdp_dtype_is_float(dt))
        return PyErr_Format(PyExc_ValueError, "round_to needs a floating dtype, got %s", hsdp_dtype_name(dt));
    PyObject *raw = encode_impl(obj, dt);
    if (!raw) return NULL;
    PyObject *out = decode_impl(raw, dt);
    Py_DECREF(raw);
    return out;
}

/* pread_into(fd, offset, array): fills a writable C-contiguous array from the file. */
static PyObject *mod_pread_into(PyObject *m, PyObject *args) {
    (void)m;
    int fd;
    unsigned long long off;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "iKO", &fd, &off, &obj)) return NULL;
    PyArrayObject *a = hsdp_py_writable_array(obj, "array");
    if (!a) return NULL;
    hsdp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = hsdp_pread_exact(fd, PyArray_DATA(a), (size_t)PyArray_NBYTES(a), (uint64_t)off);
    Py_END_ALLOW_THREADS
    if (st != HSDP_OK) return hsdp_py_raise(st);
    Py_RETURN_NONE;
}

/* dtype_table(): the core's dtypes in enum order, each (name, itemsize, is_float, the NumPy
 * dtype name values of it are computed in). hsdp.dtypes builds its table from this. */
static PyObject *mod_dtype_table(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    PyObject *t = PyTuple_New(HSDP_DTYPE_COUNT);
    for (int i = 0; t && i < HSDP_DTYPE_COUNT; i++) {
        hsdp_dtype d = (hsdp_dtype)i;
        PyObject *row = Py_BuildValue("(snOs)", hsdp_dtype_name(d), (Py_ssize_t)hsdp_dtype_size(d),
                                      hsdp_dtype_is_float(d) ? Py_True : Py_False,
                                      hsdp_dtype_name(hsdp_py_npy_compute(d)));
        if (!row) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, row);
    }
    return t;
}

PyMethodDef hsdp_py_npy_functions[] = {
    {"encode", mod_encode, METH_VARARGS, "encode(array, dtype): raw bits of the values cast to dtype."},
    {"decode", mod_decode, METH_VARARGS, "decode(raw, dtype): raw bits of dtype -> its NumPy compute dtype."},
    {"round_to", mod_round_to, METH_VARARGS,
     "round_to(array, dtype): values rounded to dtype, in its NumPy compute dtype."},
    {"pread_into", mod_pread_into, METH_VARARGS, "pread_into(fd, offset, array): fill array with file bytes."},
    {"dtype_table", mod_dtype_table, METH_NOARGS,
     "The core's dtypes: (name, itemsize, is_float, NumPy compute dtype name) each."},
    {NULL, NULL, 0, NULL},
};
