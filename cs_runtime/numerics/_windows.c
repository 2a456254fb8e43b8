/* The depthwise convolution's loops of cs_runtime/numerics/windows.py as C: optional.

Why: a depthwise convolution (groups == channels: mobilenet's) is a few multiply-adds
a pixel, which numpy runs as a pass over the whole map for each of the kh x kw window
offsets; on small maps its rows are a few elements long and the passes cost far more
than the arithmetic. Where output rows are long these loops run along them (planes
first, as the arrays come); where they are short (mobilenet's late 3 x 3 and 6 x 6 maps,
whose rows give a vector loop nothing) they work a sample at a time on its planes turned
channels last, so that the innermost loop runs over the channels, contiguous and as long
as the layer is wide (windows.py picks: dims' channels_last). Either way they do the
same float32 operations in the same order (per
output pixel the offsets (i, j) in row-major order; per weight (n, p, q) in order from 0;
each product rounded before it is added; no fused multiply-adds: setup.py builds with
-ffp-contract=off), so the results are the same bits as the numpy path.
tests/test_windows.py checks that.

    forward(xp, w, y, dims)        y[n, c, p, q] = sum over (i, j) of
                                   xp[n, c, p * sh + i * dh, q * sw + j * dw] * w[c, i, j]
    input_grad(g, w, dxp, dims)    dxp[n, c, p * sh + i * dh, q * sw + j * dw] += g[n, c, p, q] * w[c, i, j]
    weight_grad(g, xp, dw, dims)   dw[c, i, j] = sum over (n, p, q), in that order from 0, of
                                   g[n, c, p, q] * xp[n, c, p * sh + i * dh, q * sw + j * dw]
    dims = (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw, channels_last); xp, dxp [n, c, hp, wp] (padded),
    w, dw [c, kh, kw], y, g [n, c, oh, ow]: float32, C-contiguous. dxp must hold zeros. */
#include "_loops.h"
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_ssize_t n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw, channels_last;
} Dims;

/* Planes first (NCHW, as the arrays come): the innermost loop runs along an output row.
   Where rows are long (large maps, few channels) these are the faster loops. */
VECTOR_CLONES
static void forward_planes(const float *restrict xp, const float *restrict w, float *restrict y, Dims d) {
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
static void input_grad_planes(const float *restrict g, const float *restrict w, float *restrict dxp, Dims d) {
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

/* Planes first: each (i, j) has its own sum, added to in (n, p, q) order: the sums of a channel run side by
   side (independent additions, where one sum would wait for each), the order of each unchanged. */
VECTOR_CLONES
static void weight_grad_planes(const float *restrict g, const float *restrict xp, float *restrict dw, Dims d) {
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

/* Channels last: [c, pixels] -> [pixels, c] and back */
static void to_channels_last(const float *restrict x, float *restrict out, Py_ssize_t c, Py_ssize_t pixels) {
    for (Py_ssize_t ch = 0; ch < c; ch++)
        for (Py_ssize_t p = 0; p < pixels; p++)
            out[p * c + ch] = x[ch * pixels + p];
}

static void to_channels_first(const float *restrict x, float *restrict out, Py_ssize_t c, Py_ssize_t pixels) {
    for (Py_ssize_t p = 0; p < pixels; p++)
        for (Py_ssize_t ch = 0; ch < c; ch++)
            out[ch * pixels + p] = x[p * c + ch];
}

/* Where a sample's channels-last planes start: the input pixel (r, s), the output pixel (p, q). */
#define AT_IN(d, r, s) (((r) * (d).wp + (s)) * (d).c)
#define AT_OUT(d, p, q) (((p) * (d).ow + (q)) * (d).c)

VECTOR_CLONES
static void forward_sample(const float *restrict x, const float *restrict k, float *restrict y, Dims d) {
    for (Py_ssize_t p = 0; p < d.oh; p++)
        for (Py_ssize_t q = 0; q < d.ow; q++) {
            float *out = y + AT_OUT(d, p, q);
            for (Py_ssize_t ch = 0; ch < d.c; ch++)
                out[ch] = 0.0f;
            for (Py_ssize_t i = 0; i < d.kh; i++)
                for (Py_ssize_t j = 0; j < d.kw; j++) {
                    const float *in = x + AT_IN(d, p * d.sh + i * d.dh, q * d.sw + j * d.dw);
                    const float *weight = k + (i * d.kw + j) * d.c;
                    for (Py_ssize_t ch = 0; ch < d.c; ch++)
                        out[ch] = out[ch] + in[ch] * weight[ch];
                }
        }
}

VECTOR_CLONES
static void input_grad_sample(const float *restrict g, const float *restrict k, float *restrict dx, Dims d) {
    for (Py_ssize_t i = 0; i < d.kh; i++)
        for (Py_ssize_t j = 0; j < d.kw; j++) {
            const float *weight = k + (i * d.kw + j) * d.c;
            for (Py_ssize_t p = 0; p < d.oh; p++)
                for (Py_ssize_t q = 0; q < d.ow; q++) {
                    float *to = dx + AT_IN(d, p * d.sh + i * d.dh, q * d.sw + j * d.dw);
                    const float *from = g + AT_OUT(d, p, q);
                    for (Py_ssize_t ch = 0; ch < d.c; ch++)
                        to[ch] = to[ch] + from[ch] * weight[ch];
                }
        }
}

VECTOR_CLONES
static void weight_grad_sample(const float *restrict g, const float *restrict x, float *restrict sums, Dims d) {
    for (Py_ssize_t p = 0; p < d.oh; p++)
        for (Py_ssize_t q = 0; q < d.ow; q++) {
            const float *grad = g + AT_OUT(d, p, q);
            for (Py_ssize_t i = 0; i < d.kh; i++)
                for (Py_ssize_t j = 0; j < d.kw; j++) {
                    const float *in = x + AT_IN(d, p * d.sh + i * d.dh, q * d.sw + j * d.dw);
                    float *sum = sums + (i * d.kw + j) * d.c;
                    for (Py_ssize_t ch = 0; ch < d.c; ch++)
                        sum[ch] = sum[ch] + grad[ch] * in[ch];
                }
        }
}

/* scratch: kernel [kh * kw, c], then a sample's padded planes [hp * wp, c], then its output's [oh * ow, c] */
static Py_ssize_t scratch_floats(const Dims *d) {
    return d->channels_last ? d->c * (d->kh * d->kw + d->hp * d->wp + d->oh * d->ow) : 1;
}

static void forward_loop(const float *xp, const float *w, float *y, float *scratch, Dims d) {
    if (!d.channels_last) {
        forward_planes(xp, w, y, d);
        return;
    }
    float *k = scratch, *x = k + d.kh * d.kw * d.c, *out = x + d.hp * d.wp * d.c;
    to_channels_last(w, k, d.c, d.kh * d.kw);
    for (Py_ssize_t n = 0; n < d.n; n++) {
        to_channels_last(xp + n * d.c * d.hp * d.wp, x, d.c, d.hp * d.wp);
        forward_sample(x, k, out, d);
        to_channels_first(out, y + n * d.c * d.oh * d.ow, d.c, d.oh * d.ow);
    }
}

static void input_grad_loop(const float *g, const float *w, float *dxp, float *scratch, Dims d) {
    if (!d.channels_last) {
        input_grad_planes(g, w, dxp, d);
        return;
    }
    float *k = scratch, *dx = k + d.kh * d.kw * d.c, *grad = dx + d.hp * d.wp * d.c;
    to_channels_last(w, k, d.c, d.kh * d.kw);
    for (Py_ssize_t n = 0; n < d.n; n++) {
        to_channels_last(g + n * d.c * d.oh * d.ow, grad, d.c, d.oh * d.ow);
        to_channels_last(dxp + n * d.c * d.hp * d.wp, dx, d.c, d.hp * d.wp);   /* the zeros it adds to */
        input_grad_sample(grad, k, dx, d);
        to_channels_first(dx, dxp + n * d.c * d.hp * d.wp, d.c, d.hp * d.wp);
    }
}

static void weight_grad_loop(const float *g, const float *xp, float *dw, float *scratch, Dims d) {
    if (!d.channels_last) {
        weight_grad_planes(g, xp, dw, d);
        return;
    }
    float *sums = scratch, *x = sums + d.kh * d.kw * d.c, *grad = x + d.hp * d.wp * d.c;
    memset(sums, 0, (size_t)(d.kh * d.kw * d.c) * sizeof(float));
    for (Py_ssize_t n = 0; n < d.n; n++) {
        to_channels_last(g + n * d.c * d.oh * d.ow, grad, d.c, d.oh * d.ow);
        to_channels_last(xp + n * d.c * d.hp * d.wp, x, d.c, d.hp * d.wp);
        weight_grad_sample(grad, x, sums, d);
    }
    to_channels_first(sums, dw, d.c, d.kh * d.kw);
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

#define DIMS_FORMAT "(nnnnnnnnnnnnn)"
#define DIMS_FIELDS(d) &d.n, &d.c, &d.hp, &d.wp, &d.kh, &d.kw, &d.oh, &d.ow, &d.sh, &d.sw, &d.dh, &d.dw, \
    &d.channels_last

typedef void (*Loop)(const float *, const float *, float *, float *, Dims);

/* Parse (a, b, out, dims), check the buffers' sizes (`padded`, `kernel`, `output`: which of the
   three is xp-like, w-like, y-like), and run `loop` with the GIL released, on scratch of its own. */
static PyObject *run_loop(PyObject *args, Loop loop, int padded, int kernel, int output) {
    Py_buffer b[3], ordered[3];
    Dims d;
    if (!PyArg_ParseTuple(args, "y*y*w*" DIMS_FORMAT, &b[0], &b[1], &b[2], DIMS_FIELDS(d)))
        return NULL;
    ordered[0] = b[padded];
    ordered[1] = b[kernel];
    ordered[2] = b[output];
    if (!sizes_agree(ordered, &d))
        return NULL;
    float *scratch = malloc((size_t)scratch_floats(&d) * sizeof(float));
    if (scratch == NULL) {
        release_buffers(b, 3);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    loop(b[0].buf, b[1].buf, b[2].buf, scratch, d);
    Py_END_ALLOW_THREADS
    free(scratch);
    release_buffers(b, 3);
    Py_RETURN_NONE;
}

static PyObject *forward(PyObject *self, PyObject *args) {
    (void)self;
    return run_loop(args, forward_loop, 0, 1, 2);
}

static PyObject *input_grad(PyObject *self, PyObject *args) {
    (void)self;
    return run_loop(args, input_grad_loop, 2, 1, 0);     /* dxp is the padded one */
}

static PyObject *weight_grad(PyObject *self, PyObject *args) {
    (void)self;
    return run_loop(args, weight_grad_loop, 1, 2, 0);    /* xp, then dw, then g */
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS, "forward(float32 xp, w, y, (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw, channels_last))"},
    {"input_grad", input_grad, METH_VARARGS,
     "input_grad(float32 g, w, dxp (zeros), (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw, channels_last))"},
    {"weight_grad", weight_grad, METH_VARARGS,
     "weight_grad(float32 g, xp, dw, (n, c, hp, wp, kh, kw, oh, ow, sh, sw, dh, dw, channels_last))"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_windows", "The depthwise convolution's loops (windows.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__windows(void) { return module_with_api(&module, 3); }
