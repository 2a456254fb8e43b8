/* SGD with momentum's update of one parameter as one C loop: optional.

Why: optim.py's numpy path makes four passes over a parameter (buf *= m, buf += g,
tmp = buf * lr, w -= tmp); a small model's step spends a tenth of its time there.
Here the same float32 operations run in the same order, one element at a time, each
rounded as numpy rounds it (no fused multiply-adds: setup.py builds with
-ffp-contract=off), so the results are the same bits. tests/test_optim.py checks
the loop against the numpy passes bit for bit.

    sgd_momentum(w, g, buf, momentum, lr)     w, buf written; every buffer float32
        buf = buf * momentum + g;  w = w - buf * lr

A gradient's sum of squares in float64 (optim.squared_norms), in one pass:
    sum_squares(g)     g float32; element i's square (exact in float64) goes to lane i % LANES,
        each lane a sum in element order, then the lanes added in lane order: the bits of
        optim.py's numpy path, which sums the same lanes the same way.                  */
#include "_loops.h"

VECTOR_CLONES
static void sgd_momentum_loop(float *restrict w, const float *restrict g, float *restrict buf, float momentum,
                              float lr, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float b = buf[i] * momentum;
        b = b + g[i];
        buf[i] = b;
        float step = b * lr;
        w[i] = w[i] - step;
    }
}

static PyObject *sgd_momentum(PyObject *self, PyObject *args) {
    Py_buffer b[3];
    static const Py_ssize_t sizes[3] = {sizeof(float), sizeof(float), sizeof(float)};
    float momentum, lr;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*w*ff", &b[0], &b[1], &b[2], &momentum, &lr))
        return NULL;
    if (same_count(b, sizes, 3, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sgd_momentum_loop(b[0].buf, b[1].buf, b[2].buf, momentum, lr, n);
    Py_END_ALLOW_THREADS
    release_buffers(b, 3);
    Py_RETURN_NONE;
}

#define LANES 64   /* optim.SQUARE_LANES */

VECTOR_CLONES
static double sum_squares_loop(const float *restrict g, Py_ssize_t n) {
    double lanes[LANES] = {0.0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            double v = g[i + j];
            lanes[j] += v * v;
        }
    for (int j = 0; i + j < n; j++) {
        double v = g[i + j];
        lanes[j] += v * v;
    }
    double total = lanes[0];
    for (int j = 1; j < LANES; j++)
        total += lanes[j];
    return total;
}

static PyObject *sum_squares(PyObject *self, PyObject *args) {
    Py_buffer g;
    double total;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &g))
        return NULL;
    if (g.len % sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a float32 buffer expected");
        PyBuffer_Release(&g);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    total = sum_squares_loop(g.buf, g.len / (Py_ssize_t)sizeof(float));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&g);
    return PyFloat_FromDouble(total);
}

static PyMethodDef methods[] = {
    {"sum_squares", sum_squares, METH_VARARGS,
     "sum_squares(float32 g): sum of g's squares in float64, in LANES lanes (optim.squared_norms)"},
    {"sgd_momentum", sgd_momentum, METH_VARARGS,
     "sgd_momentum(float32 w, float32 g, float32 buf, momentum, lr): buf = buf * momentum + g; w -= buf * lr"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_optim", "SGD with momentum's update, and a gradient's sum of squares, as one loop each (optim.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__optim(void) { return module_with_api(&module, 2); }
