/* The frequency sketch's per-key loop, compiled: what count_python in tests/sidecar/oracles.py does,
 * bit for bit (tests/sidecar/test_adaptive.py compares the two on the same keys and cells).
 *
 * Why in C: the loop runs for every page of every admitted prompt, and in Python its 64-bit mixing
 * is arbitrary-precision arithmetic: about 1.4 us a key, the largest single cost of a chat replay
 * with the default policy. Here it is a few nanoseconds plus the key's own hash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MIX 0x9E3779B97F4A7C15ULL
#define MIX2 0xBF58476D1CE4E5B9ULL

/* count(cells, line_mask, keys, cap, drop) -> (before, sampled); see _count_python. */
static PyObject *
sketch_count(PyObject *self, PyObject *args)
{
    PyObject *cells_obj, *keys_obj;
    unsigned long long line_mask;
    int cap, drop;
    if (!PyArg_ParseTuple(args, "OKOii:count", &cells_obj, &line_mask, &keys_obj, &cap, &drop))
        return NULL;
    if (!PyByteArray_Check(cells_obj)) {
        PyErr_SetString(PyExc_TypeError, "cells must be a bytearray");
        return NULL;
    }
    if (cap < 0 || cap > 255) {
        PyErr_SetString(PyExc_ValueError, "cap must be within 0-255 (a cell is a byte)");
        return NULL;
    }
    Py_ssize_t ncells = PyByteArray_GET_SIZE(cells_obj);
    /* Every line index the mask allows must lie inside the cells (64 cells a line). */
    if (line_mask >= (unsigned long long)PY_SSIZE_T_MAX / 64 || (Py_ssize_t)((line_mask + 1) * 64) > ncells) {
        PyErr_SetString(PyExc_ValueError, "line_mask reaches past the cells");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(keys_obj, "keys must be a sequence");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    PyObject *before = PyList_New(n);
    PyObject *sampled = PyList_New(0);
    if (before == NULL || sampled == NULL)
        goto fail;
    for (Py_ssize_t depth = 0; depth < n; depth++) {
        Py_hash_t hashed = PyObject_Hash(items[depth]);
        if (hashed == -1 && PyErr_Occurred())
            goto fail;
        /* A key's __hash__ may run Python code: read the cells' place after it. */
        if (PyByteArray_GET_SIZE(cells_obj) != ncells) {
            PyErr_SetString(PyExc_RuntimeError, "cells resized while counting");
            goto fail;
        }
        unsigned char *c = (unsigned char *)PyByteArray_AS_STRING(cells_obj);
        uint64_t h = (uint64_t)hashed * MIX;
        h = (h ^ (h >> 31)) * MIX2;
        uint64_t line = ((h >> 12) & line_mask) << 6;
        Py_ssize_t i = (Py_ssize_t)(line | (h & 63)), j = (Py_ssize_t)(line | ((h >> 6) & 63));
        int a = c[i], b = c[j];
        int count = a < b ? a : b;
        PyObject *value = PyLong_FromLong(count);
        if (value == NULL)
            goto fail;
        PyList_SET_ITEM(before, depth, value);
        if (count < cap) {
            count += 1;
            if (a < count)
                c[i] = (unsigned char)count;
            if (b < count)
                c[j] = (unsigned char)count;
        }
        if (drop >= 0 && (drop >= 64 || (h >> drop) == 0)) {
            PyObject *index = PyLong_FromSsize_t(depth);
            if (index == NULL)
                goto fail;
            int failed = PyList_Append(sampled, index);
            Py_DECREF(index);
            if (failed)
                goto fail;
        }
    }
    Py_DECREF(keys);
    PyObject *result = PyTuple_Pack(2, before, sampled);
    Py_DECREF(before);
    Py_DECREF(sampled);
    return result;
fail:
    Py_DECREF(keys);
    Py_XDECREF(before);
    Py_XDECREF(sampled);
    return NULL;
}

static PyMethodDef sketch_methods[] = {
    {"count", sketch_count, METH_VARARGS,
     "count(cells, line_mask, keys, cap, drop) -> (counts before, sampled indexes); see frequency._count_python"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sketch_module = {
    PyModuleDef_HEAD_INIT, "_sketch", "The frequency sketch's per-key loop, compiled.", -1, sketch_methods,
};

PyMODINIT_FUNC
PyInit__sketch(void)
{
    return PyModule_Create(&sketch_module);
}
