/* A dense layer's dropout keep-mask (kernels.rows_keep_mask) as one C call: optional.

Why: the numpy path seeds a fresh PCG64 from a SeedSequence for every layer and step,
about 25 us before a single draw; a model of many small layers spends a fifth of its step
there. Here the same generator runs in C: numpy's SeedSequence (its entropy pool of four
words, hashmix and mix), PCG64's seeding (pcg_setseq_128_srandom_r) and its XSL-RR output,
then the mask of kernels.rows_keep_mask from the draws' 32-bit halves. The mask is the
same bits; tests/test_kernels.py checks it against the numpy path over many seeds, steps,
widths, row ranges and probabilities.

    rows_keep_mask(entropy, width, row_start, out, threshold, scale)
        entropy: the SeedSequence's uint32 words ([seed, step, layer, 104729] coerced as
        numpy coerces them); out: float32, (rows, width) of rows from row_start; an element
        is `scale` where its draw's 32 bits >= threshold (threshold * 2**8 of
        rows_keep_mask), else 0.                                                          */
#include "_loops.h"
#include <stdint.h>

#define POOL 4
#define INIT_A 0x43b0d7e5u
#define MULT_A 0x931e8875u
#define INIT_B 0x8b51f9ddu
#define MULT_B 0x58f38dedu
#define MIX_MULT_L 0xca01f9ddu
#define MIX_MULT_R 0x4973f715u
#define XSHIFT 16

static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= MULT_A;
    value *= *hash_const;
    value ^= value >> XSHIFT;
    return value;
}

static uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t result = MIX_MULT_L * x - MIX_MULT_R * y;
    result ^= result >> XSHIFT;
    return result;
}

/* SeedSequence(entropy).generate_state(4, uint64) */
static void seed_state(const uint32_t *entropy, Py_ssize_t n, uint64_t state[4]) {
    uint32_t pool[POOL], hash_const = INIT_A;
    for (int i = 0; i < POOL; i++)
        pool[i] = hashmix(i < n ? entropy[i] : 0u, &hash_const);
    for (int src = 0; src < POOL; src++)
        for (int dst = 0; dst < POOL; dst++)
            if (src != dst)
                pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
    for (Py_ssize_t src = POOL; src < n; src++)
        for (int dst = 0; dst < POOL; dst++)
            pool[dst] = mix(pool[dst], hashmix(entropy[src], &hash_const));
    uint32_t words[8], b = INIT_B;
    for (int i = 0; i < 8; i++) {
        uint32_t value = pool[i % POOL];
        value ^= b;
        b *= MULT_B;
        value *= b;
        value ^= value >> XSHIFT;
        words[i] = value;
    }
    for (int i = 0; i < 4; i++)   /* little-endian pairs */
        state[i] = (uint64_t)words[2 * i] | ((uint64_t)words[2 * i + 1] << 32);
}

typedef __uint128_t u128;
#define PCG_MULT (((u128)2549297995355413924ULL << 64) + 4865540595714422341ULL)

/* PCG64's XSL-RR output of a state */
static inline uint64_t output(u128 state) {
    uint64_t folded = (uint64_t)(state >> 64) ^ (uint64_t)state;
    unsigned rot = (unsigned)(state >> 122);
    return (folded >> rot) | (folded << ((64 - rot) & 63));
}

/* Draws are made LANES at a time, each lane LANES steps of the generator ahead of where
   it was (x -> x * M**LANES + c_LANES, exact mod 2**128): the same states in the same
   order as one step at a time, without one long chain of dependent 128-bit products. */
#define LANES 4

static inline void put(float *out, Py_ssize_t count, Py_ssize_t at, uint32_t draw, uint32_t threshold,
                       float scale) {
    if (at >= 0 && at < count)
        out[at] = draw >= threshold ? scale : 0.0f;
}

static void mask_loop(const uint32_t *entropy, Py_ssize_t n_entropy, Py_ssize_t width, Py_ssize_t row_start,
                      float *out, Py_ssize_t count, uint32_t threshold, float scale) {
    if (count == 0)
        return;
    uint64_t seed[4];
    seed_state(entropy, n_entropy, seed);
    u128 initstate = ((u128)seed[0] << 64) + seed[1], initseq = ((u128)seed[2] << 64) + seed[3];
    u128 inc = (initseq << 1) | 1, state = 0;
    state = state * PCG_MULT + inc;   /* pcg_setseq_128_srandom_r */
    state += initstate;
    state = state * PCG_MULT + inc;
    u128 lanes[LANES], mult = 1, add = 0;
    for (int j = 0; j < LANES; j++) {
        state = state * PCG_MULT + inc;   /* the state of draw j */
        lanes[j] = state;
        add = add * PCG_MULT + inc;
        mult = mult * PCG_MULT;
    }
    /* Draw d gives words 2d (its low half) and 2d + 1 (its high half) of the global
       batch's row-major words; the mask holds words first .. first + count - 1. */
    Py_ssize_t first = row_start * width, draws = (first + count + 1) / 2;
    for (Py_ssize_t d = 0; d < draws; d += LANES) {
        for (int j = 0; j < LANES; j++) {
            uint64_t draw = output(lanes[j]);
            Py_ssize_t at = 2 * (d + j) - first;
            put(out, count, at, (uint32_t)draw, threshold, scale);
            put(out, count, at + 1, (uint32_t)(draw >> 32), threshold, scale);
            lanes[j] = lanes[j] * mult + add;
        }
    }
}

static PyObject *rows_keep_mask(PyObject *self, PyObject *args) {
    Py_buffer entropy, out;
    Py_ssize_t width, row_start;
    unsigned long threshold;
    float scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnw*kf", &entropy, &width, &row_start, &out, &threshold, &scale))
        return NULL;
    if (entropy.len % sizeof(uint32_t) || out.len % sizeof(float) || width < 1 || row_start < 0
            || threshold > 0xFFFFFFFFul || (Py_ssize_t)(out.len / sizeof(float)) % width) {
        PyErr_SetString(PyExc_ValueError, "entropy of uint32 words, a float32 mask of whole rows of a positive "
                                          "width, a row start >= 0 and a 32-bit threshold expected");
        PyBuffer_Release(&entropy);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mask_loop(entropy.buf, entropy.len / sizeof(uint32_t), width, row_start, out.buf, out.len / sizeof(float),
              (uint32_t)threshold, scale);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&entropy);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rows_keep_mask", rows_keep_mask, METH_VARARGS,
     "rows_keep_mask(uint32 entropy words, width, row_start, float32 out, threshold, scale)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_masks", "A dense layer's dropout keep-mask (kernels.rows_keep_mask).", -1, methods,
};

PyMODINIT_FUNC PyInit__masks(void) { return module_with_api(&module, 1); }
