/*
 * The colour jitter kernel of pooled_loader.vision._kernels: Pillow's ImageEnhance arithmetic on
 * uint8 CHW planes (see vision/ops/jitter.py), the Python entry point enhance_chain.  #included
 * by csrc/kernels.c.
 */

/* Pillow's convert("L"): ITU-R 601-2 luma in 16-bit fixed point */
static inline int grey_px(int r, int g, int b) { return (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16; }

/* a chain of ImageEnhance ops in one pass over the image plus one read pass per contrast op (for
 * its grey mean): the pixels go through the chain a block at a time, as int32 planes in L1, each
 * op a loop the compiler vectorises (Pillow's byte tables would be gathers); the last pass writes
 * the bytes back or, with `out`, float32 x * mul[c] + add[c] (no fused multiply-add: the build
 * has -ffp-contract=off, so these are numpy's two float32 roundings) */
#define CHAIN_BLOCK 512
#define MAX_CHAIN 16

/* Image.blend(degenerate, image, alpha) for one value 0..255 (Blend.c): float32, clipped,
 * truncated; kept in 32-bit lanes (Pillow's cast to a byte is a no-op after the clip) */
static inline int32_t blend_i32(int32_t d, float alpha, int32_t x) {
    float t = (float)d + alpha * (float)(x - d);
    t = t < 0.0f ? 0.0f : t;
    t = t > 255.0f ? 255.0f : t;
    return (int32_t)t;
}

static PL_HOT void blend_block(int32_t *restrict x, Py_ssize_t n, int d, float alpha) {
    for (Py_ssize_t i = 0; i < n; i++) x[i] = blend_i32(d, alpha, x[i]);
}

static PL_HOT void saturation_block(int32_t *restrict r, int32_t *restrict g, int32_t *restrict bl,
                                    Py_ssize_t n, float alpha) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const int32_t l = grey_px(r[i], g[i], bl[i]);
        r[i] = blend_i32(l, alpha, r[i]);
        g[i] = blend_i32(l, alpha, g[i]);
        bl[i] = blend_i32(l, alpha, bl[i]);
    }
}

static PL_HOT void load_block(const uint8_t *restrict src, int32_t *restrict x, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) x[i] = src[i];
}

static PL_HOT int64_t grey_sum_block(const int32_t *restrict r, const int32_t *restrict g,
                                     const int32_t *restrict bl, Py_ssize_t n) {
    int64_t sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) sum += grey_px(r[i], g[i], bl[i]);
    return sum;
}

static PL_HOT void store_u8(const int32_t *restrict x, uint8_t *restrict dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = (uint8_t)x[i];
}

static PL_HOT void store_f32(const int32_t *restrict x, float *restrict dst, Py_ssize_t n, float mul,
                             float add) {
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = (float)x[i] * mul + add;
}

/* ops [0, upto) on every block; with `out`/`img` given (upto == nops) the result is stored,
 * else the grey sum of the result is returned (contrast's mean) */
static int64_t chain_pass(uint8_t *img, Py_ssize_t n, const int *kinds, const float *alphas,
                          const int *degen, int upto, int store, float *fout, const float *mul,
                          const float *add) {
    int32_t x[3][CHAIN_BLOCK];
    int64_t sum = 0;
    for (Py_ssize_t at = 0; at < n; at += CHAIN_BLOCK) {
        const Py_ssize_t m = n - at < CHAIN_BLOCK ? n - at : CHAIN_BLOCK;
        for (int c = 0; c < 3; c++) load_block(img + c * n + at, x[c], m);
        for (int k = 0; k < upto; k++) {
            if (kinds[k] == 2) {
                saturation_block(x[0], x[1], x[2], m, alphas[k]);
            } else {
                for (int c = 0; c < 3; c++) blend_block(x[c], m, degen[k], alphas[k]);
            }
        }
        if (!store) {
            sum += grey_sum_block(x[0], x[1], x[2], m);
        } else if (fout) {
            for (int c = 0; c < 3; c++) store_f32(x[c], fout + c * n + at, m, mul[c], add[c]);
        } else {
            for (int c = 0; c < 3; c++) store_u8(x[c], img + c * n + at, m);
        }
    }
    return sum;
}

PyDoc_STRVAR(enhance_chain_doc,
             "enhance_chain(img, ops, out=None, mul=None, add=None) -> None\n"
             "\n"
             "ops: a sequence of up to 16 (kind, factor) pairs applied in order to the\n"
             "C-contiguous (3, h, w) uint8 buffer img, bit for bit as Pillow's ImageEnhance\n"
             "(0 Brightness, 1 Contrast, 2 Color). Without out the result is left in img; with out (a C-contiguous float32\n"
             "buffer of img's shape) and mul, add (3 floats each), out[c] = float32(result[c]) *\n"
             "mul[c] + add[c] in float32, and img is left as it was.");

static PyObject *enhance_chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"img", "ops", "out", "mul", "add", NULL};
    PyObject *img_obj, *ops_obj, *out_obj = Py_None, *mul_obj = Py_None, *add_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOO", kwlist, &img_obj, &ops_obj, &out_obj,
                                     &mul_obj, &add_obj))
        return NULL;
    int kinds[MAX_CHAIN], degen[MAX_CHAIN];
    float alphas[MAX_CHAIN];
    PyObject *seq = PySequence_Fast(ops_obj, "ops must be a sequence of (kind, factor) pairs");
    if (!seq) return NULL;
    const Py_ssize_t nops = PySequence_Fast_GET_SIZE(seq);
    if (nops > MAX_CHAIN) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "enhance_chain: at most 16 ops");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nops; k++) {
        double factor;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "id", &kinds[k], &factor) ||
            kinds[k] < 0 || kinds[k] > 2) {
            Py_DECREF(seq);
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "enhance_chain: each op is (kind 0, 1 or 2, factor)");
            return NULL;
        }
        alphas[k] = (float)factor;
        degen[k] = 0;
    }
    Py_DECREF(seq);
    const int to_float = out_obj != Py_None;
    double mul_d[3] = {1, 1, 1}, add_d[3] = {0, 0, 0};
    if (to_float && (parse_triple(mul_obj, "mul", mul_d) || parse_triple(add_obj, "add", add_d)))
        return NULL;
    Py_buffer b, ob;
    if (PyObject_GetBuffer(img_obj, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0)
        return NULL;
    if (b.ndim != 3 || b.shape[0] != 3 || !is_format(&b, 'B') || b.itemsize != 1) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "enhance_chain: img must be a (3, h, w) uint8 buffer");
        return NULL;
    }
    const Py_ssize_t n = b.shape[1] * b.shape[2];
    float *fout = NULL;
    if (to_float) {
        if (PyObject_GetBuffer(out_obj, &ob, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
            PyBuffer_Release(&b);
            return NULL;
        }
        if (ob.ndim != 3 || ob.shape[0] != 3 || ob.shape[1] != b.shape[1] ||
            ob.shape[2] != b.shape[2] || !is_format(&ob, 'f') || ob.itemsize != 4 ||
            ((uintptr_t)ob.buf) % sizeof(float)) {
            PyBuffer_Release(&ob);
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError,
                            "enhance_chain: out must be an aligned float32 buffer of img's shape");
            return NULL;
        }
        fout = (float *)ob.buf;
    }
    const float mul[3] = {(float)mul_d[0], (float)mul_d[1], (float)mul_d[2]};
    const float add[3] = {(float)add_d[0], (float)add_d[1], (float)add_d[2]};
    uint8_t *img = (uint8_t *)b.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (int k = 0; k < (int)nops; k++) /* ImageStat's mean of the grey image, rounded */
        if (kinds[k] == 1 && n > 0)
            degen[k] = (int)((double)chain_pass(img, n, kinds, alphas, degen, k, 0, NULL, mul, add) /
                                 (double)n + 0.5);
    if (nops > 0 || fout) chain_pass(img, n, kinds, alphas, degen, (int)nops, 1, fout, mul, add);
    Py_END_ALLOW_THREADS;
    if (to_float) PyBuffer_Release(&ob);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}
