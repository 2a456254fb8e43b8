/* Row passes of cs_runtime/numerics/ops.py as C loops, layer norm's and softmax's backward: optional.

Why: ops.py normalises a row in some dozen numpy passes (a mean, a centring, a square,
a second mean, a scaling, the gain and the bias; the backward as many), each over the
whole activation; a transformer's layer norms (rows of 192 to 1024) spent a tenth of
its step there. These loops do a row at a time the same float32 operations in the same
order (no fused multiply-adds: setup.py builds with -ffp-contract=off), and each row
mean sums as numpy's reduction over a contiguous last axis does (its pairwise sum,
from 0), so the results are the same bits as the numpy path. tests/test_norms.py
checks that.

    forward(x, gain, bias, xhat, rstd, y, (rows, width, has_gain, has_bias), eps)
        mean = sum(x) / width;  c = x - mean;  var = sum(c * c) / width
        rstd = 1 / sqrt(var + eps);  xhat = c * rstd
        y = xhat * gain (has_gain; else xhat) + bias (has_bias)      y may be xhat itself
    backward(g, xhat, rstd, gain, dx, (rows, width, has_gain, 0))
        d = g * gain (has_gain; else g);  p = sum(d * xhat) / width
        dx = ((d - sum(d) / width) - xhat * p) * rstd
    softmax_backward(g, p, out, (rows, width), scale, scaled)
        out = (g - sum(g * p)) * p, then * scale where `scaled` (attention's)   out may be g itself
    x, xhat, y, g, dx, p, out [rows, width]; rstd [rows]; gain, bias [width] (any float32 buffer
    when absent): float32, C-contiguous. The sums are numpy's row sums (pairwise, from 0). */
#include "_loops.h"
#include <math.h>
#include <stdlib.h>

typedef struct {
    Py_ssize_t rows, width, has_gain, has_bias;
} Dims;

/* numpy's pairwise sum of a contiguous float32 run (PW_BLOCKSIZE 128, eight partial sums),
   which its add.reduce over a row makes after the identity, 0. */
static float pairwise_sum(const float *a, Py_ssize_t n) {
    if (n < 8) {
        float res = 0.0f;
        for (Py_ssize_t i = 0; i < n; i++)
            res = res + a[i];
        return res;
    }
    if (n <= 128) {
        float r[8], res;
        Py_ssize_t i;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] = r[j] + a[i + j];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res = res + a[i];
        return res;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

static float row_mean(const float *a, Py_ssize_t n) {
    return (0.0f + pairwise_sum(a, n)) / (float)n;
}

VECTOR_CLONES
static void centre(const float *restrict x, float mean, float *restrict c, float *restrict square, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        c[j] = x[j] - mean;
        square[j] = c[j] * c[j];
    }
}

VECTOR_CLONES
static void scale_shift(float *xhat, float rstd, const float *restrict gain, const float *restrict bias,
                        float *y, Dims d) {
    for (Py_ssize_t j = 0; j < d.width; j++) {
        float h = xhat[j] * rstd;
        xhat[j] = h;
        float v = d.has_gain ? h * gain[j] : h;
        y[j] = d.has_bias ? v + bias[j] : v;
    }
}

static void forward_loop(const float *x, const float *gain, const float *bias, float *xhat, float *rstd,
                         float *y, float *square, Dims d, float eps) {
    for (Py_ssize_t r = 0; r < d.rows; r++) {
        const float *row = x + r * d.width;
        float *h = xhat + r * d.width;
        centre(row, row_mean(row, d.width), h, square, d.width);
        float var = row_mean(square, d.width);
        rstd[r] = 1.0f / sqrtf(var + eps);
        scale_shift(h, rstd[r], gain, bias, y + r * d.width, d);
    }
}

VECTOR_CLONES
static void gained(const float *restrict g, const float *restrict gain, const float *restrict xhat,
                   float *restrict dx, float *restrict scratch, Py_ssize_t n, int has_gain) {
    for (Py_ssize_t j = 0; j < n; j++) {
        dx[j] = has_gain ? g[j] * gain[j] : g[j];
        scratch[j] = dx[j] * xhat[j];
    }
}

VECTOR_CLONES
static void project_out(const float *restrict xhat, float mean, float projection, float rstd,
                        float *restrict dx, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++)
        dx[j] = ((dx[j] - mean) - xhat[j] * projection) * rstd;
}

static void backward_loop(const float *g, const float *xhat, const float *rstd, const float *gain, float *dx,
                          float *scratch, Dims d) {
    for (Py_ssize_t r = 0; r < d.rows; r++) {
        const Py_ssize_t at = r * d.width;
        gained(g + at, gain, xhat + at, dx + at, scratch, d.width, (int)d.has_gain);
        float projection = row_mean(scratch, d.width);
        project_out(xhat + at, row_mean(dx + at, d.width), projection, rstd[r], dx + at, d.width);
    }
}

VECTOR_CLONES
static void products(const float *restrict a, const float *restrict b, float *restrict out, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++)
        out[j] = a[j] * b[j];
}

VECTOR_CLONES
static void softmax_row(const float *g, const float *restrict p, float *out, float total, float scale, int scaled,
                        Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        float v = (g[j] - total) * p[j];
        out[j] = scaled ? v * scale : v;
    }
}

static void softmax_backward_loop(const float *g, const float *p, float *out, float *scratch, Dims d, float scale,
                                  int scaled) {
    for (Py_ssize_t r = 0; r < d.rows; r++) {
        const Py_ssize_t at = r * d.width;
        products(g + at, p + at, scratch, d.width);
        softmax_row(g + at, p + at, out + at, 0.0f + pairwise_sum(scratch, d.width), scale, scaled, d.width);
    }
}

/* Each buffer's length in floats against what dims make of it (-1: any, an absent operand). */
static int lengths_agree(Py_buffer *b, const Py_ssize_t *wanted, int count) {
    for (int i = 0; i < count; i++) {
        if (wanted[i] >= 0 && b[i].len != wanted[i] * (Py_ssize_t)sizeof(float)) {
            PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the layer norm's dimensions");
            release_buffers(b, count);
            return 0;
        }
    }
    return 1;
}

static PyObject *forward(PyObject *self, PyObject *args) {
    Py_buffer b[6];
    Dims d;
    float eps;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*(nnnn)f", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &d.rows,
                          &d.width, &d.has_gain, &d.has_bias, &eps))
        return NULL;
    Py_ssize_t all = d.rows * d.width;
    Py_ssize_t wanted[6] = {all, d.has_gain ? d.width : -1, d.has_bias ? d.width : -1, all, d.rows, all};
    if (d.width < 1 || !lengths_agree(b, wanted, 6))
        return d.width < 1 ? (release_buffers(b, 6), PyErr_Format(PyExc_ValueError, "rows of no width")) : NULL;
    float *square = malloc((size_t)d.width * sizeof(float));
    if (square == NULL) {
        release_buffers(b, 6);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    forward_loop(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, square, d, eps);
    Py_END_ALLOW_THREADS
    free(square);
    release_buffers(b, 6);
    Py_RETURN_NONE;
}

static PyObject *backward(PyObject *self, PyObject *args) {
    Py_buffer b[5];
    Dims d;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*(nnnn)", &b[0], &b[1], &b[2], &b[3], &b[4], &d.rows, &d.width,
                          &d.has_gain, &d.has_bias))
        return NULL;
    Py_ssize_t all = d.rows * d.width;
    Py_ssize_t wanted[5] = {all, all, d.rows, d.has_gain ? d.width : -1, all};
    if (d.width < 1 || !lengths_agree(b, wanted, 5))
        return d.width < 1 ? (release_buffers(b, 5), PyErr_Format(PyExc_ValueError, "rows of no width")) : NULL;
    float *scratch = malloc((size_t)d.width * sizeof(float));
    if (scratch == NULL) {
        release_buffers(b, 5);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    backward_loop(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, scratch, d);
    Py_END_ALLOW_THREADS
    free(scratch);
    release_buffers(b, 5);
    Py_RETURN_NONE;
}

static PyObject *softmax_backward(PyObject *self, PyObject *args) {
    Py_buffer b[3];
    Dims d = {0, 0, 0, 0};
    float scale;
    int scaled;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*(nn)fp", &b[0], &b[1], &b[2], &d.rows, &d.width, &scale, &scaled))
        return NULL;
    Py_ssize_t all = d.rows * d.width;
    Py_ssize_t wanted[3] = {all, all, all};
    if (d.width < 1 || !lengths_agree(b, wanted, 3))
        return d.width < 1 ? (release_buffers(b, 3), PyErr_Format(PyExc_ValueError, "rows of no width")) : NULL;
    float *scratch = malloc((size_t)d.width * sizeof(float));
    if (scratch == NULL) {
        release_buffers(b, 3);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    softmax_backward_loop(b[0].buf, b[1].buf, b[2].buf, scratch, d, scale, scaled);
    Py_END_ALLOW_THREADS
    free(scratch);
    release_buffers(b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS,
     "forward(float32 x, gain, bias, xhat, rstd, y, (rows, width, has_gain, has_bias), eps)"},
    {"backward", backward, METH_VARARGS, "backward(float32 g, xhat, rstd, gain, dx, (rows, width, has_gain, 0))"},
    {"softmax_backward", softmax_backward, METH_VARARGS,
     "softmax_backward(float32 g, p, out, (rows, width), scale, scaled)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_norms", "Row passes of ops.py: layer norm's, softmax's backward.", -1, methods,
};

PyMODINIT_FUNC PyInit__norms(void) { return module_with_api(&module, 1); }
