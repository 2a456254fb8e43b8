/* The exact GELU's float64 passes of cs_runtime/numerics/kernels.py as C loops: optional.

Why: kernels._gelu_and_grad64 evaluates Phi(x) in float64 (its value defines the
exact GELU's numbers) in some thirty numpy passes a chunk; BERT's feed-forward
layers spend most of their elementwise time there. Everything but the two
exponentials runs here as two loops, the same float64 operations in the same
order (no fused multiply-adds: setup.py builds with -ffp-contract=off), and
the exponentials stay numpy's, so the results are the same bits.

    prepare(x, t, tail_arg, density_arg)     x float32; the rest float64 scratch
        z = |x| / sqrt(2);  t = 1 / (1 + z / 2)
        tail_arg    = P(t) - z * z          (erfc(z) = t * exp(tail_arg), kernels._ERFC)
        density_arg = x * x * -0.5
    numpy:  tail_arg = exp(tail_arg);  density_arg = exp(density_arg)
    finish(x, t, tail_exp, density_exp, gelu, slope)      gelu, slope float32
        tail  = tail_exp * t * 0.5                        (erfc(z) / 2)
        cdf   = x < 0 (its sign bit) ? tail : 1 - tail    (Phi(x), as normal_cdf's copysign)
        slope = density_exp / sqrt(2 pi) * x + cdf        (d/dx x Phi(x))
        gelu  = cdf * x

The coefficients come from kernels.py (`coefficients`, called once at import),
so there is one copy of them. tests/test_kernels.py checks these loops
against the numpy passes bit for bit. */
#include "_loops.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TERMS 10
static double erfc_terms[TERMS];       /* kernels._ERFC: c0 + c1 t + ... + c9 t**9 */
static double sqrt_half, inv_sqrt_2pi;
static int have_coefficients = 0;

VECTOR_CLONES
static void prepare_loop(const float *restrict x, double *restrict t, double *restrict tail_arg,
                         double *restrict density_arg, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double value = (double)x[i];
        double z = fabs(value) * sqrt_half;
        double u = 1.0 / (z * 0.5 + 1.0);
        double poly = erfc_terms[TERMS - 1];
        for (int k = TERMS - 2; k >= 1; k--)
            poly = poly * u + erfc_terms[k];
        poly = poly * u + erfc_terms[0];
        t[i] = u;
        tail_arg[i] = poly - z * z;
        density_arg[i] = value * value * -0.5;
    }
}

VECTOR_CLONES
static void finish_loop(const float *restrict x, const double *restrict t, const double *restrict tail_exp,
                        const double *restrict density_exp, float *restrict gelu, float *restrict slope,
                        Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double value = (double)x[i];
        double tail = tail_exp[i] * t[i] * 0.5;
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        double cdf = (bits >> 31) ? tail : -tail + 1.0;  /* -0.0 too: normal_cdf's copysign(tail, -x) */
        slope[i] = (float)(density_exp[i] * inv_sqrt_2pi * value + cdf);
        gelu[i] = (float)(cdf * value);
    }
}

static int coefficients_given(void) {
    if (!have_coefficients)
        PyErr_SetString(PyExc_RuntimeError, "coefficients() was not called");
    return have_coefficients;
}

static PyObject *prepare(PyObject *self, PyObject *args) {
    Py_buffer b[4];
    static const Py_ssize_t sizes[4] = {sizeof(float), sizeof(double), sizeof(double), sizeof(double)};
    Py_ssize_t n;
    (void)self;
    if (!coefficients_given() || !PyArg_ParseTuple(args, "y*w*w*w*", &b[0], &b[1], &b[2], &b[3]))
        return NULL;
    if (same_count(b, sizes, 4, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    prepare_loop(b[0].buf, b[1].buf, b[2].buf, b[3].buf, n);
    Py_END_ALLOW_THREADS
    release_buffers(b, 4);
    Py_RETURN_NONE;
}

static PyObject *finish(PyObject *self, PyObject *args) {
    Py_buffer b[6];
    static const Py_ssize_t sizes[6] = {sizeof(float), sizeof(double), sizeof(double), sizeof(double),
                                        sizeof(float), sizeof(float)};
    Py_ssize_t n;
    (void)self;
    if (!coefficients_given() || !PyArg_ParseTuple(args, "y*y*y*y*w*w*", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5]))
        return NULL;
    if (same_count(b, sizes, 6, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    finish_loop(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, n);
    Py_END_ALLOW_THREADS
    release_buffers(b, 6);
    Py_RETURN_NONE;
}

static PyObject *coefficients(PyObject *self, PyObject *args) {
    PyObject *terms;
    double half, inv;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!dd", &PyTuple_Type, &terms, &half, &inv))
        return NULL;
    if (PyTuple_GET_SIZE(terms) != TERMS) {
        PyErr_Format(PyExc_ValueError, "expected %d erfc coefficients", TERMS);
        return NULL;
    }
    for (int k = 0; k < TERMS; k++) {
        double c = PyFloat_AsDouble(PyTuple_GET_ITEM(terms, k));
        if (c == -1.0 && PyErr_Occurred())
            return NULL;
        erfc_terms[k] = c;
    }
    sqrt_half = half;
    inv_sqrt_2pi = inv;
    have_coefficients = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"coefficients", coefficients, METH_VARARGS,
     "coefficients(erfc terms c0..c9, sqrt(1/2), 1/sqrt(2 pi)): kernels.py's, once"},
    {"prepare", prepare, METH_VARARGS,
     "prepare(float32 x, float64 t, float64 tail_arg, float64 density_arg)"},
    {"finish", finish, METH_VARARGS,
     "finish(float32 x, float64 t, float64 tail_exp, float64 density_exp, float32 gelu, float32 slope)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gelu", "The exact GELU's float64 loops (kernels.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__gelu(void) { return module_with_api(&module, 1); }
