/*
 * The resize kernel of pooled_loader.vision._kernels: fused crop -> resize -> flip -> HWC-to-CHW
 * (-> normalize), the Python entry point crop_resize_flip_chw.  Part of the one translation unit
 * csrc/kernels.c (which #includes this file); the pixel loops are in resize_passes.c.
 *
 * Resampling follows Pillow's ImagingResample for BILINEAR in its geometry: a separable triangle
 * filter whose support grows with the downscale factor (antialiasing), window bounds and weights
 * per output column/row computed the way Pillow's precompute_coeffs does, taps clipped to the
 * *source image* (like Image.resize(..., box=...)), not to the box.  Arithmetic differs a little
 * (Pillow: 22-bit fixed point, intermediate rounded to uint8; here: Q14 horizontal weights with
 * exact int32 sums, float32 intermediate and vertical pass), so results differ from Pillow by at
 * most one level on uint8 in every case tested.
 *
 * Pipeline per call:
 *   1. bounds and weights for every output column (stored in output order, so the horizontal
 *      flip costs nothing) and every output row, once per call: O(ow*kx + oh*ky);
 *   2. horizontal pass over only the source rows the output needs, each into a ring of ky rows
 *      of 3 float planes (R, G, B; ow floats each).  x86-64: one 16-byte load holds 4 RGB
 *      pixels; pshufb (SSSE3; byte shifts + unpacks with SSE2 only) turns them into int16 tap
 *      pairs and pmaddwd multiplies them by Q14 weights (AVX2: all 4 taps in one
 *      vpshufb/vpmaddwd); columns with <= 4 taps (every scale < 1.5) take a loop-free path.  The
 *      variant is picked once at import (__builtin_cpu_supports); all give the same integers.
 *      AVX2 does two source rows per instruction (row a in the low lane, row b in the high one:
 *      the column's bounds and weights are loaded once for both rows, and the lanes need no
 *      horizontal add), which made the whole kernel ~1.25x faster (scripts/bench_kernels.py);
 *      a row is computed one step early when its ring slot is free, so rows pair up.  Runs of 4
 *      columns whose taps fit one (or two) 16-byte loads (every column of a downscale below
 *      ~1.5x (~2.5x)) take a loop with no per-column mode test and one weights pointer, and the 4x4 transpose to
 *      planes works on both rows' lanes at once: 1.26x fewer instructions in the kernel
 *      (callgrind, 100 RandomResizedCrop boxes of a 400x500 source), 1.11-1.15x in time.
 *      Typical RandomResizedCrop 224 (CPU time, busy machine): AVX2 ~125 us before the two-row
 *      pass, SSSE3 ~135 us, SSE2 ~190 us, portable C (non-x86) untimed.  4 output pixels are transposed
 *      (RGBX x4 -> R, G, B) so the planes are written with vector stores.  Very wide filters
 *      (downscale > ~30x, more than 64 taps) use a float path, Q14 being too coarse there;
 *   3. vertical pass fused with the store: per output row, the ring rows are combined
 *      (auto-vectorised; AVX2 clone via target_clones) and rounded/clamped to uint8, or
 *      rounded/clamped then normalized to float32, straight into the CHW planes of `out`.
 * Scratch (weights, ring) lives in a per-thread buffer that grows and is kept, so the steady
 * state allocates nothing.  The pixel work runs with the GIL released.
 *
 * -ffp-contract=off (setup.py) and a fixed summation order keep the results bit-identical
 * whichever ISA variant runs.  Tried and dropped: a vertical-first order for tall boxes (fewer
 * horizontal rows, but the u8 vertical pass over the wider rows cost more: 177 vs 137 us); a
 * Q7 int16 RGBX intermediate with a vpmaddwd vertical pass (no float convert or transpose in the
 * horizontal pass: -15% instructions there, but +48% in the vertical pass, which then works on
 * 4 interleaved lanes and must regroup them into planes: 1.27M vs 1.21M instructions per
 * cache-path image under callgrind); skipping taps 2-3 for upscaling columns (1.24M).
 */

/* ------------------------------------------------------------------------------------------ */
/* weights (Pillow's precompute_coeffs with the bilinear/triangle filter)                      */

static inline double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static int ksize_for(double in_len, Py_ssize_t out_size) {
    double scale = in_len / (double)out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    return (int)ceil(filterscale) * 2 + 1;
}

/* bounds[2*j] = first source index, bounds[2*j+1] = tap count; weights at [j*wstride + t], as
 * float times fscale (wf) or as Q14 int16 summing to exactly 2^14 (wi).
 * Entry j holds output index (reverse ? out_size-1-j : j).  Zero-weight taps at either end are
 * trimmed (same result, fewer multiplies).  k: scratch of ksize doubles. */
#define QBITS 14
static void precompute(double in0, double in1, Py_ssize_t in_size, Py_ssize_t out_size, int ksize,
                       int wstride, int reverse, int *bounds, float *wf, float fscale, int16_t *wi,
                       double *k) {
    double scale = (in1 - in0) / (double)out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;
    double ss = 1.0 / filterscale;
    for (Py_ssize_t xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale;
        Py_ssize_t xmin = (Py_ssize_t)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        Py_ssize_t xmax = (Py_ssize_t)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        Py_ssize_t n = xmax - xmin;
        if (n > ksize) n = ksize; /* cannot happen; belt and braces */
        double ww = 0.0;
        for (Py_ssize_t x = 0; x < n; x++) {
            double w = triangle((x + xmin - center + 0.5) * ss);
            k[x] = w;
            ww += w;
        }
        Py_ssize_t lo = 0, hi = n;
        while (hi > lo + 1 && k[hi - 1] == 0.0) hi--;
        while (hi > lo + 1 && k[lo] == 0.0) lo++;
        if (n <= 0 || ww == 0.0) { /* degenerate: nearest valid pixel, weight 1 */
            xmin = (Py_ssize_t)center;
            if (xmin >= in_size) xmin = in_size - 1;
            if (xmin < 0) xmin = 0;
            lo = 0;
            hi = 1;
            k[0] = 1.0;
            ww = 1.0;
        }
        Py_ssize_t j = reverse ? out_size - 1 - xx : xx;
        bounds[2 * j] = (int)(xmin + lo);
        bounds[2 * j + 1] = (int)(hi - lo);
        if (wi) {
            /* expanded layout for pmaddwd: per group of 4 taps 16 int16,
             * (w0,w1)x4 then (w2,w3)x4; wstride = 4 * (taps rounded up to 4) */
            int16_t *wj = wi + j * (Py_ssize_t)wstride;
            int32_t sum = 0;
            Py_ssize_t big = 0;
            int32_t *q = (int32_t *)(k + ksize); /* k has room for 2*ksize doubles */
            const double qs = (double)(1 << QBITS) / ww;
            for (Py_ssize_t x = lo; x < hi; x++) {
                q[x - lo] = (int32_t)(k[x] * qs + 0.5); /* >= 0: truncation rounds */
                sum += q[x - lo];
                if (k[x] > k[big + lo]) big = x - lo;
            }
            q[big] += (1 << QBITS) - sum; /* weights sum to exactly 1.0 */
            memset(wj, 0, sizeof(int16_t) * (size_t)wstride); /* taps past hi - lo weigh 0 */
            for (Py_ssize_t t = 0; t < hi - lo; t++) {
                int16_t *g = wj + (t / 4) * 16 + ((t % 4) / 2) * 8 + (t % 2);
                g[0] = g[2] = g[4] = g[6] = (int16_t)q[t];
            }
        } else {
            float *wj = wf + j * (Py_ssize_t)wstride;
            const double inv = 1.0 / ww;
            for (Py_ssize_t x = lo; x < hi; x++) wj[x - lo] = (float)(k[x] * inv) * fscale;
            for (Py_ssize_t x = hi - lo; x < wstride; x++) wj[x] = 0.0f;
        }
    }
}

#include "resize_passes.c"

/* ------------------------------------------------------------------------------------------ */
/* Python entry point                                                                          */

static int parse_triple(PyObject *obj, const char *name, double v[3]) {
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a sequence of 3 floats", name);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != 3) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s must have 3 values (one per channel)", name);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        v[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (v[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be a sequence of 3 floats", name);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static int is_format(const Py_buffer *b, char code) {
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<' || *f == '|') f++;
    return f[0] == code && f[1] == '\0';
}

PyDoc_STRVAR(crop_resize_flip_chw_doc,
             "crop_resize_flip_chw(src, x0, y0, w, h, out, flip=False, mean=None, std=None) -> out\n"
             "\n"
             "src: HWC uint8 buffer (3 channels, pixel stride 3, any row stride);\n"
             "out: C-contiguous CHW buffer, uint8 ('B') or float32 ('f', needs mean and std).\n"
             "Bilinear resize (antialiased when downscaling, Pillow geometry) of the box\n"
             "(x0, y0, w, h) of src into out, horizontally flipped when flip is true;\n"
             "float32 output is (round(v)/255 - mean)/std per channel.");

static PyObject *crop_resize_flip_chw(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"src", "x0", "y0", "w", "h", "out", "flip", "mean", "std", NULL};
    PyObject *src_obj, *out_obj, *mean_obj = Py_None, *std_obj = Py_None;
    Py_ssize_t bx, by, bw, bh;
    int flip = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnnO|pOO", kwlist, &src_obj, &bx, &by, &bw,
                                     &bh, &out_obj, &flip, &mean_obj, &std_obj))
        return NULL;

    Py_buffer sb, ob;
    if (PyObject_GetBuffer(src_obj, &sb, PyBUF_STRIDES | PyBUF_FORMAT) != 0) return NULL;
    if (PyObject_GetBuffer(out_obj, &ob, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&sb);
        PyErr_SetString(PyExc_ValueError,
                        "out must be a writable C-contiguous buffer (CHW uint8 or float32)");
        return NULL;
    }
    PyObject *ret = NULL;
    double mean[3] = {0, 0, 0}, stdv[3] = {1, 1, 1};
    int is_float = 0;

    /* ---- validation ---- */
    if (sb.ndim != 3 || !is_format(&sb, 'B') || sb.itemsize != 1) {
        PyErr_SetString(PyExc_ValueError, "src must be a 3-D (H, W, 3) uint8 buffer");
        goto done;
    }
    const Py_ssize_t H = sb.shape[0], W = sb.shape[1];
    if (sb.shape[2] != 3) {
        PyErr_SetString(PyExc_ValueError, "src must have 3 channels (H, W, 3)");
        goto done;
    }
    if (sb.strides[2] != 1 || sb.strides[1] != 3 || sb.strides[0] < 3 * W) {
        PyErr_SetString(PyExc_ValueError,
                        "src rows must be contiguous HWC (channel stride 1, pixel stride 3, "
                        "row stride >= 3*W); crops/views with a larger row stride are fine");
        goto done;
    }
    if (ob.ndim != 3 || ob.shape[0] != 3 || ob.shape[1] < 1 || ob.shape[2] < 1) {
        PyErr_SetString(PyExc_ValueError, "out must be a (3, oh, ow) buffer with oh, ow >= 1");
        goto done;
    }
    if (is_format(&ob, 'B') && ob.itemsize == 1) {
        is_float = 0;
    } else if (is_format(&ob, 'f') && ob.itemsize == 4) {
        is_float = 1;
        if (((uintptr_t)ob.buf) % sizeof(float)) {
            PyErr_SetString(PyExc_ValueError, "float32 out must be aligned (4-byte address)");
            goto done;
        }
    } else {
        PyErr_SetString(PyExc_TypeError, "out must be uint8 or float32");
        goto done;
    }
    if (bw < 1 || bh < 1 || bx < 0 || by < 0 || bx > W - bw || by > H - bh) {
        PyErr_Format(PyExc_ValueError,
                     "box (x0=%zd, y0=%zd, w=%zd, h=%zd) must have w, h >= 1 and lie inside src "
                     "(W=%zd, H=%zd)",
                     bx, by, bw, bh, W, H);
        goto done;
    }
    if (is_float) {
        if (mean_obj == Py_None || std_obj == Py_None) {
            PyErr_SetString(PyExc_ValueError, "float32 out requires mean and std");
            goto done;
        }
        if (parse_triple(mean_obj, "mean", mean) || parse_triple(std_obj, "std", stdv)) goto done;
        for (int c = 0; c < 3; c++)
            if (!(stdv[c] != 0.0) || !isfinite(stdv[c]) || !isfinite(mean[c])) {
                PyErr_SetString(PyExc_ValueError, "mean and std must be finite, std non-zero");
                goto done;
            }
    } else if (mean_obj != Py_None || std_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "mean/std apply only to float32 out");
        goto done;
    }
    const Py_ssize_t oh = ob.shape[1], ow = ob.shape[2];
    if (ow > INT32_MAX / 8 || oh > INT32_MAX / 8 || W > INT32_MAX / 8 || H > INT32_MAX / 8) {
        PyErr_SetString(PyExc_ValueError, "image too large");
        goto done;
    }
    {
        /* overlapping src/out would read what was just written */
        const char *s_lo = (const char *)sb.buf, *s_hi = s_lo + (H - 1) * sb.strides[0] + 3 * W;
        const char *o_lo = (const char *)ob.buf, *o_hi = o_lo + ob.len;
        if (s_lo < o_hi && o_lo < s_hi) {
            PyErr_SetString(PyExc_ValueError, "src and out must not overlap in memory");
            goto done;
        }
    }

    /* ---- scratch layout ---- */
    const int kx = ksize_for((double)bw, ow), ky = ksize_for((double)bh, oh);
    const int kx2 = (kx + 1) & ~1;
    const int kx4 = (kx + 3) & ~3; /* int16 weights: groups of 4 taps, 16 int16 per group */
    /* Q14 int16 weights: per-weight error <= 2^-15, so <= 0.5 level over 64 taps; wider filters
     * (downscale beyond ~30x) take the float path */
    const int use_int = kx2 <= 64;
    /* rows needed at once never exceed ky, so a ring of ky rows holds every live row */
    const Py_ssize_t rowlen = 3 * ow;
#define ALIGN64(n) ((((size_t)(n)) + 63) & ~(size_t)63)
    /* bounds (2 per column), then QUADS: modes (1 per column), quad modes (1 per 4 columns),
     * byte offsets (1 per column) */
    const size_t sz_xb = ALIGN64(sizeof(int) * (4 * (size_t)ow + ((size_t)ow + 3) / 4));
    const size_t sz_xw = ALIGN64(use_int ? sizeof(int16_t) * (size_t)ow * (size_t)(4 * kx4)
                                         : sizeof(float) * (size_t)ow * (size_t)kx2);
    const size_t sz_yb = ALIGN64(sizeof(int) * 2 * (size_t)oh);
    const size_t sz_yw = ALIGN64(sizeof(float) * (size_t)oh * (size_t)ky);
    const size_t sz_ring = ALIGN64(sizeof(float) * (size_t)rowlen * (size_t)ky);
    const size_t sz_acc = ALIGN64(sizeof(float) * (size_t)rowlen);
    const size_t sz_ptrs = ALIGN64(sizeof(float *) * (size_t)ky);
    const size_t sz_k = ALIGN64(sizeof(double) * 2 * (size_t)(kx > ky ? kx : ky));
    const size_t total = sz_xb + sz_xw + sz_yb + sz_yw + sz_ring + sz_acc + sz_ptrs + sz_k;
    unsigned char *base = scratch_get(total);
    if (!base) {
        PyErr_NoMemory();
        goto done;
    }
    int *xb = (int *)base;
    int *xm = xb + 2 * ow;
    int16_t *xw = (int16_t *)(base + sz_xb);
    float *xwf = (float *)(base + sz_xb);
    int *yb = (int *)(base + sz_xb + sz_xw);
    float *yw = (float *)(base + sz_xb + sz_xw + sz_yb);
    float *ring = (float *)(base + sz_xb + sz_xw + sz_yb + sz_yw);
    float *acc = (float *)(base + sz_xb + sz_xw + sz_yb + sz_yw + sz_ring);
    const float **rows = (const float **)(base + sz_xb + sz_xw + sz_yb + sz_yw + sz_ring + sz_acc);
    double *ktmp = (double *)((unsigned char *)rows + sz_ptrs);

    float scale[3], bias[3];
    for (int c = 0; c < 3; c++) {
        scale[c] = (float)(1.0 / (255.0 * stdv[c]));
        bias[c] = (float)(-mean[c] / stdv[c]);
    }
    const uint8_t *sbase = (const uint8_t *)sb.buf;
    const Py_ssize_t sstride = sb.strides[0];

    Py_BEGIN_ALLOW_THREADS;
    { /* the first rows the horizontal pass reads (about), loading while the weights are made */
        const Py_ssize_t c0 = 3 * (bx > kx ? bx - kx : 0), c1 = 3 * (bx + bw + kx < W ? bx + bw + kx : W);
        const Py_ssize_t r0 = by > ky ? by - ky : 0;
        for (Py_ssize_t r = r0; r < r0 + 4 + ky && r < H; r++)
            for (Py_ssize_t b = c0; b < c1; b += 64) __builtin_prefetch(sbase + r * sstride + b, 0, 3);
    }
    if (use_int)
        precompute((double)bx, (double)(bx + bw), W, ow, kx, 4 * kx4, flip, xb, NULL, 0.f, xw, ktmp);
    else
        precompute((double)bx, (double)(bx + bw), W, ow, kx, kx2, flip, xb, xwf, 1.0f, NULL, ktmp);
    /* per output column, row-independent: groups of 4 taps, or 0 when a 16-byte load from
     * the group's first pixel would pass the end of the row (those take the SSE2 route) */
    for (Py_ssize_t j = 0; j < ow; j++) {
        const int groups = (xb[2 * j + 1] + 3) >> 2;
        xm[j] = xb[2 * j] + 4 * (groups - 1) + 6 <= W ? groups : 0;
    }
    { /* QUADS, for the two-row pass: per 4 columns their common mode (0 if they differ), and
       * each column's first byte in the row */
        int *quads = xm + ow, *xoff = quads + (ow + 3) / 4;
        for (Py_ssize_t q = 0; q < ow / 4; q++) {
            const int *m = xm + 4 * q;
            quads[q] = m[0] == m[1] && m[0] == m[2] && m[0] == m[3] ? m[0] : 0;
        }
        if (ow % 4) quads[ow / 4] = 0;
        for (Py_ssize_t j = 0; j < ow; j++) xoff[j] = 3 * xb[2 * j];
    }
    precompute((double)by, (double)(by + bh), H, oh, ky, ky, 0, yb, yw,
               use_int ? 1.0f / (float)(1 << QBITS) : 1.0f, NULL, ktmp);
    Py_ssize_t next_row = yb[0]; /* first source row not yet in the ring */
    Py_ssize_t next_slot = next_row % ky; /* its ring slot, next_row % ky (kept without divides) */
    const hpass2_fn hpass2 = use_int ? hpass_rows2_for(hpass_row) : NULL;
    /* the bytes of a source row the horizontal pass reads, for prefetching the next rows */
    Py_ssize_t span_lo = W, span_hi = 0;
    for (Py_ssize_t j = 0; j < ow; j++) {
        if (xb[2 * j] < span_lo) span_lo = xb[2 * j];
        if (xb[2 * j] + xb[2 * j + 1] > span_hi) span_hi = xb[2 * j] + xb[2 * j + 1];
    }
    span_lo *= 3;
    span_hi *= 3;
    const Py_ssize_t plane = oh * ow;
    for (Py_ssize_t y = 0; y < oh; y++) {
        const Py_ssize_t r0 = yb[2 * y];
        const int n = yb[2 * y + 1];
        if (next_row < r0) {
            next_row = r0;
            next_slot = r0 % ky;
        }
        while (next_row < r0 + n) {
            float *dst = ring + next_slot * rowlen;
            const Py_ssize_t slot2 = next_slot + 1 == ky ? 0 : next_slot + 1; /* next_row + 1's */
            /* the source is often not in cache (a memory-mapped cache file): ask for the rows
             * of the pair after next while this pair is computed (1.2-1.4x on the cache path's
             * 512-px sources, scripts/bench_kernels.py) */
            for (Py_ssize_t r = next_row + 4; r < next_row + 6 && r < H; r++)
                for (Py_ssize_t b = span_lo; b < span_hi; b += 64)
                    __builtin_prefetch(sbase + r * sstride + b, 0, 3);
            /* two rows at once when the second one is in the image and its ring slot is free
             * (holds no row of this output row's window): it is needed now or at a later row */
            if (hpass2 && next_row + 1 < H && (next_row + 1 < r0 + n || n < ky)) {
                hpass2(sbase + next_row * sstride, sbase + (next_row + 1) * sstride, W, ow, xb,
                       xm, xw, 4 * kx4, dst, ring + slot2 * rowlen);
                next_row += 2;
                next_slot = slot2 + 1 == ky ? 0 : slot2 + 1;
                continue;
            }
            if (use_int)
                hpass_row(sbase + next_row * sstride, W, ow, xb, xm, xw, 4 * kx4, dst);
            else
                hpass_row_f32(sbase + next_row * sstride, ow, xb, xwf, kx2, dst);
            next_row++;
            next_slot = slot2;
        }
        for (Py_ssize_t t = 0, slot = r0 % ky; t < n; t++, slot = slot + 1 == ky ? 0 : slot + 1)
            rows[t] = ring + slot * rowlen; /* ring slot of row r0 + t: (r0 + t) % ky */
        vpass_store(rows, yw + y * (Py_ssize_t)ky, n, ow, acc,
                    is_float ? NULL : (uint8_t *)ob.buf + y * ow,
                    is_float ? (float *)ob.buf + y * ow : NULL, plane, scale, bias);
    }
    Py_END_ALLOW_THREADS;

    Py_INCREF(out_obj);
    ret = out_obj;
done:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&sb);
    return ret;
}
