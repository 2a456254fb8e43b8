/* The 16-bit conversions of cs_runtime/numerics/precision.py as C loops: optional.

Why: numpy has no fast float32 <-> float16 conversion (its cast runs element by
element, about 2.5 ns each here), so precision.py converts by a dozen numpy
passes over each chunk, about 1.8 ns an element; a step of the `large` preset
converts some 130M elements. The same arithmetic in one loop, which the compiler
vectorises, takes about 0.25 ns (one core, AVX-512).

What: the numpy path's arithmetic, on the float32 bit patterns, with no branch:
  encode  float32 -> the format's patterns: rebias the exponent, add the
          round-to-nearest-even increment, clamp to inf; magnitudes below the
          smallest normal are rounded onto the subnormal grid by one float32
          addition (precision._encode_small);
  round   float32 -> float32 rounded onto the format's values (precision._round);
  decode  patterns -> float32, exactly: sign-extend, shift, one exact
          multiplication (precision._decode).
A format is its exponent and mantissa widths (1 + exp_bits + man_bits == 16).
Each function returns True when its input held inf or nan (patterns of them,
for decode); then its output is not to be used and the caller converts that
input by the numpy path, which alone decides those values (numpy's nan
payloads for float16). tests/test_precision.py and test_precision_chunks.py
run every conversion test on both paths.

Built by setup.py as an optional extension: without a C compiler the install
goes on and precision.py uses its numpy path, which gives the same bits.
Buffers come through the buffer protocol, so this file needs no numpy headers;
the GIL is let go during the loops, so pieces run on threads side by side. */
#include "_loops.h"
#include <stdint.h>
#include <string.h>

#define F32_ABS 0x7FFFFFFFu
#define F32_INF 0x7F800000u

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

/* All ones where `condition`, else zero: a select without a branch the vectoriser refuses. */
static inline uint32_t mask_of(int condition) { return -(uint32_t)(condition != 0); }
static inline uint32_t choose(uint32_t mask, uint32_t if_set, uint32_t if_clear) {
    return (if_set & mask) | (if_clear & ~mask);
}

typedef struct {
    uint32_t drop;              /* float32 mantissa bits the format drops */
    uint32_t increment;         /* half the dropped bits' unit, less one: ties go by the kept lsb */
    uint32_t rebias;            /* float32 exponent bits of the format's exponent field 0 */
    uint32_t smallest_normal;   /* float32 bits of the format's smallest normal */
    uint32_t inf_pattern;       /* the format's inf, as a pattern */
    uint32_t overflow;          /* float32 bits of 2**(emax + 1): a rounded value from here is inf */
    float carrier;              /* 2**23 units of the least subnormal: one float32 ulp is one unit */
    float scale;                /* 2**(127 - bias): a pattern shifted into place, times this, is its value */
    uint32_t keep;              /* the sign and the fields, after the sign-extended shift */
} Format;

static int format_of(int exp_bits, int man_bits, Format *f) {
    if (exp_bits < 2 || exp_bits > 8 || man_bits < 1 || 1 + exp_bits + man_bits != 16) {
        PyErr_Format(PyExc_ValueError, "no 16-bit format with %d exponent and %d mantissa bits",
                     exp_bits, man_bits);
        return -1;
    }
    int bias = (1 << (exp_bits - 1)) - 1;
    f->drop = 23 - man_bits;
    f->increment = (1u << (f->drop - 1)) - 1;
    f->rebias = (uint32_t)(127 - bias) << 23;
    f->smallest_normal = (uint32_t)(127 - bias + 1) << 23;
    f->inf_pattern = ((1u << exp_bits) - 1) << man_bits;
    f->overflow = exp_bits == 8 ? F32_INF : (uint32_t)((1 << exp_bits) - 1 - bias + 127) << 23;
    f->carrier = as_float((uint32_t)(1 - bias - man_bits + 23 + 127) << 23);
    f->scale = as_float((uint32_t)(127 - bias + 127) << 23);
    f->keep = 0x80000000u | ((1u << (15 + f->drop)) - 1);
    return 0;
}

/* float32 bits plus half a unit of the bits the format drops, less one unless the kept
   lsb is set: cut off, the dropped bits leave the nearest value, ties to even (a carry
   runs into the exponent, as it should). */
static inline uint32_t plus_half_to_even(uint32_t bits, const Format *f) {
    return bits + f->increment + ((bits >> f->drop) & 1u);
}

/* The magnitude `mag` (float32 bits, < inf) below the smallest normal, rounded onto the
   subnormal grid by the addition: as a pattern (encode) or as float32 bits (round). */
static inline uint32_t subnormal_pattern(uint32_t mag, const Format *f) {
    return as_bits(as_float(mag) + f->carrier) - as_bits(f->carrier);
}

static inline uint32_t subnormal_value(uint32_t mag, const Format *f) {
    return as_bits((as_float(mag) + f->carrier) - f->carrier);
}

VECTOR_CLONES
static uint32_t encode_loop(const uint32_t *restrict src, uint16_t *restrict dst, Py_ssize_t n,
                            const Format *format) {
    const Format f = *format;
    uint32_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits = src[i], mag = bits & F32_ABS;
        uint32_t shifted = mag - f.rebias;   /* wraps below the normal range: replaced below */
        uint32_t pattern = plus_half_to_even(shifted, &f) >> f.drop;
        pattern = choose(mask_of(pattern > f.inf_pattern), f.inf_pattern, pattern);
        pattern = choose(mask_of(mag < f.smallest_normal), subnormal_pattern(mag, &f), pattern);
        special |= (uint32_t)(mag >= F32_INF);
        dst[i] = (uint16_t)(pattern | ((bits >> 16) & 0x8000u));
    }
    return special;
}

VECTOR_CLONES
static uint32_t round_loop(const uint32_t *restrict src, uint32_t *restrict dst, Py_ssize_t n,
                           const Format *format) {
    const Format f = *format;
    const uint32_t keep = ~((1u << f.drop) - 1);
    uint32_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits = src[i], mag = bits & F32_ABS;
        uint32_t rounded = plus_half_to_even(mag, &f) & keep;
        rounded = choose(mask_of(rounded >= f.overflow), F32_INF, rounded);
        rounded = choose(mask_of(mag < f.smallest_normal), subnormal_value(mag, &f), rounded);
        special |= (uint32_t)(mag >= F32_INF);
        dst[i] = rounded | (bits & 0x80000000u);
    }
    return special;
}

VECTOR_CLONES
static uint32_t decode_loop(const uint16_t *restrict src, uint32_t *restrict dst, Py_ssize_t n,
                            const Format *format) {
    const Format f = *format;
    uint32_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t widened = (uint32_t)(int32_t)(int16_t)src[i];     /* the sign in bit 31 and above the fields */
        uint32_t placed = (widened << f.drop) & f.keep;
        dst[i] = as_bits(as_float(placed) * f.scale);              /* exact, subnormals too */
        special |= (uint32_t)((src[i] & 0x7FFFu) >= f.inf_pattern);
    }
    return special;
}

/* (source, target, exp_bits, man_bits): both buffers contiguous, of one element count. */
static int take_buffers(PyObject *args, Py_buffer *buffers, const Py_ssize_t *sizes, Format *format,
                        Py_ssize_t *n) {
    int exp_bits, man_bits;
    if (!PyArg_ParseTuple(args, "y*w*ii", &buffers[0], &buffers[1], &exp_bits, &man_bits))
        return -1;
    if (format_of(exp_bits, man_bits, format) < 0) {
        release_buffers(buffers, 2);
        return -1;
    }
    return same_count(buffers, sizes, 2, n);
}

#define CONVERSION(name, loop, source_type, target_type)                                     \
    static PyObject *name(PyObject *self, PyObject *args) {                                  \
        static const Py_ssize_t sizes[2] = {sizeof(source_type), sizeof(target_type)};      \
        Py_buffer b[2];                                                                       \
        Format format;                                                                        \
        Py_ssize_t n;                                                                         \
        uint32_t special;                                                                     \
        (void)self;                                                                           \
        if (take_buffers(args, b, sizes, &format, &n) < 0)                                    \
            return NULL;                                                                      \
        Py_BEGIN_ALLOW_THREADS                                                                \
        special = loop((const source_type *)b[0].buf, (target_type *)b[1].buf, n, &format);  \
        Py_END_ALLOW_THREADS                                                                  \
        release_buffers(b, 2);                                                                \
        return PyBool_FromLong(special != 0);                                                 \
    }

CONVERSION(encode, encode_loop, uint32_t, uint16_t)
CONVERSION(round_values, round_loop, uint32_t, uint32_t)
CONVERSION(decode, decode_loop, uint16_t, uint32_t)

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(float32 source, uint16 target, exp_bits, man_bits) -> True if the source held inf or nan"},
    {"round", round_values, METH_VARARGS,
     "round(float32 source, float32 target, exp_bits, man_bits) -> True if the source held inf or nan"},
    {"decode", decode, METH_VARARGS,
     "decode(uint16 source, float32 target, exp_bits, man_bits) -> True if the source held inf or nan"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_convert", "The 16-bit conversions' loops (precision.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__convert(void) { return module_with_api(&module, 1); }
