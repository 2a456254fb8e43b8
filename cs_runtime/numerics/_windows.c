/* The depthwise convolution's loops of cs_runtime/numerics/windows.py as C: optional.

Why: a depthwise convolution (groups == channels: mobilenet's) is a few multiply-adds
a pixel, which numpy runs as a pass over the whole map for each of the kh x kw window
offsets; on small maps its rows are a few elements long and the passes cost far more
than the arithmetic. These loops do the same float32 operations in the same order (per
output pixel the offsets (i, j) in row-major order, each product rounded before it is
added; no fused multiply-adds: setup.py builds with -ffp-contract=off), so the results are
the same bits as the numpy path. tests/test_windows.py checks that.

    forward(xp, w, y, dims)        y[n, c, p, q] = sum over (i, j) of
                                   xp[n, c, p * sh + i * dh, q * sw + j * dw] * w[c, i, j]
    input_grad(g, w, dxp, dims)    dxp[n, c, p * sh + i * dh, q * sw + j * dw] += g[n, c, p, q] * w[c, i, j]
    weight_grad(g, xp, dw, dims)   dw[c, i, j] = sum over (n, p, q), in that order from 0, of
                                   g[n, c, p, q] * xp[n, c, p * sh + i * dh, q * sw + j * dw]
    dims = (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw); xp, dxp [n, c, hp, wp] (padded),
    w, dw [c, kh, kw], y, g [n, c, oh, ow]: float32, C-contiguous. dxp must hold zeros. */
#include "_loops.h"

typedef struct {
    Py_ssize_t n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw;
} Dims;

VECTOR_CLONES
static void forward_loop(const float *restrict xp, const float *restrict w, float *restrict y, Dims d) {
    for (Py_ssize_t plane = 0; plane < d.n * d.c; plane++) {
        const float *x = xp + plane * d.hp * d.wp;
        const float *k = w + (plane % d.c) * d.kh * d.kw;
        float *out = y + plane * d.oh * d.ow;
        for (Py_ssize_t p = 0; p < d.oh; p++) {
            float *row = out + p * d.ow;
            for (Py_ssize_t q = 0; q < d.ow; q++)
                row[q] = 0.0f;
            for (Py_ssize_t i = 0; i < d.kh; i++) {
                const float *in = x + (p * d.sh + i * d.dh) * d.wp;
                for (Py_ssize_t j = 0; j < d.kw; j++) {
                    const float weight = k[i * d.kw + j];
                    const float *from = in + j * d.dw;
                    for (Py_ssize_t q = 0; q < d.ow; q++)
                        row[q] = row[q] + from[q * d.sw] * weight;
                }
            }
        }
    }
}

VECTOR_CLONES
static void input_grad_loop(const float *restrict g, const float *restrict w, float *restrict dxp, Dims d) {
    for (Py_ssize_t plane = 0; plane < d.n * d.c; plane++) {
        const float *grad = g + plane * d.oh * d.ow;
        const float *k = w + (plane % d.c) * d.kh * d.kw;
        float *dx = dxp + plane * d.hp * d.wp;
        for (Py_ssize_t i = 0; i < d.kh; i++) {
            for (Py_ssize_t j = 0; j < d.kw; j++) {
                const float weight = k[i * d.kw + j];
                for (Py_ssize_t p = 0; p < d.oh; p++) {
                    float *to = dx + (p * d.sh + i * d.dh) * d.wp + j * d.dw;
                    const float *row = grad + p * d.ow;
                    for (Py_ssize_t q = 0; q < d.ow; q++)
                        to[q * d.sw] = to[q * d.sw] + row[q] * weight;
                }
            }
        }
    }
}

/* Each (i, j) has its own sum, added to in (n, p, q) order: the sums of a channel run side by
   side (independent additions, where one sum would wait for each), the order of each unchanged. */
VECTOR_CLONES
static void weight_grad_loop(const float *restrict g, const float *restrict xp, float *restrict dw, Dims d) {
    for (Py_ssize_t c = 0; c < d.c; c++) {
        float *sums = dw + c * d.kh * d.kw;
        for (Py_ssize_t k = 0; k < d.kh * d.kw; k++)
            sums[k] = 0.0f;
        for (Py_ssize_t n = 0; n < d.n; n++) {
            const float *grad = g + (n * d.c + c) * d.oh * d.ow;
            const float *x = xp + (n * d.c + c) * d.hp * d.wp;
            for (Py_ssize_t p = 0; p < d.oh; p++) {
                for (Py_ssize_t q = 0; q < d.ow; q++) {
                    const float gv = grad[p * d.ow + q];
                    for (Py_ssize_t i = 0; i < d.kh; i++) {
                        const float *from = x + (p * d.sh + i * d.dh) * d.wp + q * d.sw;
                        float *row = sums + i * d.kw;
                        for (Py_ssize_t j = 0; j < d.kw; j++)
                            row[j] = row[j] + gv * from[j * d.dw];
                    }
                }
            }
        }
    }
}

/* The buffers' sizes against dims: xp-like, w, y-like (in elements). */
static int sizes_agree(Py_buffer *b, const Dims *d) {
    const Py_ssize_t f = (Py_ssize_t)sizeof(float);
    Py_ssize_t padded = d->n * d->c * d->hp * d->wp, kernel = d->c * d->kh * d->kw, out = d->n * d->c * d->oh * d->ow;
    int reach = d->oh >= 1 && d->ow >= 1 && (d->oh - 1) * d->sh + (d->kh - 1) * d->dh < d->hp &&
                (d->ow - 1) * d->sw + (d->kw - 1) * d->dw < d->wp;
    if (b[0].len != padded * f || b[1].len != kernel * f || b[2].len != out * f || !reach) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the convolution's dimensions");
        release_buffers(b, 3);
        return 0;
    }
    return 1;
}

#define DIMS_FORMAT "(nnnnnnnnnnnn)"
#define DIMS_FIELDS(d) &d.n, &d.c, &d.hp, &d.wp, &d.kh, &d.kw, &d.oh, &d.ow, &d.sh, &d.sw, &d.dh, &d.dw

static PyObject *forward(PyObject *self, PyObject *args) {
    Py_buffer b[3];
    Dims d;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*" DIMS_FORMAT, &b[0], &b[1], &b[2], DIMS_FIELDS(d)))
        return NULL;
    if (!sizes_agree(b, &d))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    forward_loop(b[0].buf, b[1].buf, b[2].buf, d);
    Py_END_ALLOW_THREADS
    release_buffers(b, 3);
    Py_RETURN_NONE;
}

static PyObject *input_grad(PyObject *self, PyObject *args) {
    Py_buffer b[3], ordered[3];
    Dims d;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*" DIMS_FORMAT, &b[0], &b[1], &b[2], DIMS_FIELDS(d)))
        return NULL;
    ordered[0] = b[2];      /* dxp is the padded one */
    ordered[1] = b[1];
    ordered[2] = b[0];
    if (!sizes_agree(ordered, &d))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    input_grad_loop(b[0].buf, b[1].buf, b[2].buf, d);
    Py_END_ALLOW_THREADS
    release_buffers(b, 3);
    Py_RETURN_NONE;
}

static PyObject *weight_grad(PyObject *self, PyObject *args) {
    Py_buffer b[3], ordered[3];
    Dims d;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*" DIMS_FORMAT, &b[0], &b[1], &b[2], DIMS_FIELDS(d)))
        return NULL;
    ordered[0] = b[1];      /* xp, w-like dw, y-like g */
    ordered[1] = b[2];
    ordered[2] = b[0];
    if (!sizes_agree(ordered, &d))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    weight_grad_loop(b[0].buf, b[1].buf, b[2].buf, d);
    Py_END_ALLOW_THREADS
    release_buffers(b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS, "forward(float32 xp, w, y, (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw))"},
    {"input_grad", input_grad, METH_VARARGS,
     "input_grad(float32 g, w, dxp (zeros), (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw))"},
    {"weight_grad", weight_grad, METH_VARARGS,
     "weight_grad(float32 g, xp, dw, (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw))"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_windows", "The depthwise convolution's loops (windows.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__windows(void) { return module_with_api(&module, 2); }
