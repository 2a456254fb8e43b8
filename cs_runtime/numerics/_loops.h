/* What the optional C loops (_convert.c, _gelu.c) share: which instruction sets each
   loop is built for, how a function takes its buffers, and how a module says the version
   of its interface (numerics/compiled.py). */
#ifndef CS_NUMERICS_LOOPS_H
#define CS_NUMERICS_LOOPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* One copy of each loop per instruction set, picked at load time (GCC/Clang on x86-64
   glibc): x86-64-v4 (AVX-512) runs the conversions at about 0.25 ns an element here, v3
   (AVX2) 0.4, the SSE2 baseline 0.85. A compiler that refuses the attribute fails the
   build, and the install goes on with the numpy paths. */
#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__GNUC__) || defined(__clang__))
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

static void release_buffers(Py_buffer *buffers, int count) {
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&buffers[i]);
}

/* n, the element count of `count` buffers whose elements are `sizes` bytes: every buffer
   must hold the same. Else a ValueError, the buffers released, and -1. */
static inline int same_count(Py_buffer *buffers, const Py_ssize_t *sizes, int count, Py_ssize_t *n) {
    *n = buffers[0].len / sizes[0];
    for (int i = 0; i < count; i++) {
        if (buffers[i].len % sizes[i] || buffers[i].len / sizes[i] != *n) {
            PyErr_SetString(PyExc_ValueError, "every buffer must hold the same number of elements");
            release_buffers(buffers, count);
            return -1;
        }
    }
    return 0;
}

/* The module, with its interface's version as API: one more whenever a function, its
   arguments or its results change (compiled.py leaves a build of another version alone). */
static PyObject *module_with_api(PyModuleDef *definition, int api) {
    PyObject *m = PyModule_Create(definition);
    if (m != NULL && PyModule_AddIntConstant(m, "API", api) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#endif
