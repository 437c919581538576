/*
 * pooled_loader.vision._kernels -- fused crop -> resize -> flip -> HWC-to-CHW (-> normalize).
 *
 * Plain C against the CPython buffer protocol (no numpy or torch headers), so it builds with any
 * torch, or none.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    defined(__GLIBC__) && !defined(PL_NO_MULTIVERSION) /* target_clones needs ifunc (glibc) */
/* One build runs on any x86-64; AVX2 machines get an AVX2 clone of the hot loops (ifunc). */
#define PL_HOT __attribute__((target_clones("avx2", "default")))
#else
#define PL_HOT
#endif

/* ------------------------------------------------------------------------------------------ */
/* per-thread scratch                                                                          */

typedef struct {
    size_t cap;
    unsigned char *data;
} scratch_t;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok = 0;

static void scratch_free(void *p) {
    scratch_t *s = (scratch_t *)p;
    if (s) {
        free(s->data);
        free(s);
    }
}

static void scratch_init(void) { scratch_key_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

/* Returns a 64-byte aligned buffer of at least `size` bytes owned by the calling thread. */
static unsigned char *scratch_get(size_t size) {
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_key_ok) return NULL;
    scratch_t *s = (scratch_t *)pthread_getspecific(scratch_key);
    if (!s) {
        s = (scratch_t *)calloc(1, sizeof(scratch_t));
        if (!s) return NULL;
        if (pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    /* grow as needed; give back memory after an outsized call (> 16 MB, 4x what is needed) */
    if (s->cap < size || (s->cap > ((size_t)16 << 20) && s->cap / 4 > size)) {
        size_t cap = size + size / 4 + 4096;
        void *p = NULL;
        if (posix_memalign(&p, 64, cap) != 0) return NULL;
        free(s->data);
        s->data = (unsigned char *)p;
        s->cap = cap;
    }
    return s->data;
}

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

/* ------------------------------------------------------------------------------------------ */
/* pixel loops                                                                                 */

/* One source row (HWC, pixel stride 3, `width` pixels) -> 3 planes of ow floats in dst.
 * Integer arithmetic: Q14 int16 weights (expanded layout, see precompute), exact int32 sums
 * (<= 255 * 2^14), stored as float (exact; the vertical weights carry the 2^-14).
 * Three versions, picked once at import: AVX2 (4 taps per vpshufb/vpmaddwd), SSSE3 (2 taps per
 * pshufb/pmaddwd) and SSE2 (x86-64 baseline); a portable scalar one elsewhere.  All give the
 * same integers.  The wide loads of the SIMD versions read up to 16 bytes from the first pixel
 * of a group, so entries near the row's end take the SSE2 route, which never reads past the
 * row. */
typedef void (*hpass_fn)(const uint8_t *restrict, Py_ssize_t, Py_ssize_t, const int *restrict,
                         const int *restrict, const int16_t *restrict, int, float *restrict);

#if defined(__SSE2__)
#include <immintrin.h>
static inline __m128i load_px4(const uint8_t *p) { /* reads 4 bytes: RGB + next byte */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtsi32_si128(v);
}
static inline __m128i load_px3(const uint8_t *p) { /* reads exactly 3 bytes */
    return _mm_cvtsi32_si128((int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16));
}

/* one output pixel, SSE2; never reads beyond pixel x0+n-1 of the row */
static inline __m128i hpass_px_sse2(const uint8_t *p, int n, int last_safe, const int16_t *k) {
    const __m128i zero = _mm_setzero_si128();
    __m128i acc = zero;
    int t = 0;
    for (; t < n; t += 2) {
        const int16_t *g = k + (t / 4) * 16 + ((t % 4) / 2) * 8; /* (w_t, w_t+1) x4 */
        __m128i a, b;
        if (t + 2 < n || (t + 2 == n && last_safe)) {
            a = load_px4(p + 3 * t);
            b = load_px4(p + 3 * t + 3);
        } else if (t + 2 == n) {
            a = load_px4(p + 3 * t);
            b = load_px3(p + 3 * t + 3);
        } else {
            a = last_safe ? load_px4(p + 3 * t) : load_px3(p + 3 * t);
            b = zero;
        }
        a = _mm_unpacklo_epi8(a, zero);
        b = _mm_unpacklo_epi8(b, zero);
        acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_unpacklo_epi16(a, b),
                                                _mm_loadu_si128((const __m128i *)g)));
    }
    return acc;
}

/* 4 output pixels at a time: RGBX x4 transposed into R, G, B vectors, 3 stores; PX(j) is the
 * pixel's float4 */
#define HPASS_ROW_BODY(PX)                                                                       \
    float *d0 = dst, *d1 = dst + ow, *d2 = dst + 2 * ow;                                         \
    Py_ssize_t j = 0;                                                                            \
    for (; j + 4 <= ow; j += 4) {                                                                \
        __m128 f0 = PX(j), f1 = PX(j + 1), f2 = PX(j + 2), f3 = PX(j + 3);                       \
        _MM_TRANSPOSE4_PS(f0, f1, f2, f3);                                                       \
        _mm_storeu_ps(d0 + j, f0);                                                               \
        _mm_storeu_ps(d1 + j, f1);                                                               \
        _mm_storeu_ps(d2 + j, f2);                                                               \
    }                                                                                            \
    for (; j < ow; j++) {                                                                        \
        __m128 f = PX(j);                                                                        \
        _mm_store_ss(d0 + j, f);                                                                 \
        _mm_store_ss(d1 + j, _mm_shuffle_ps(f, f, 1));                                           \
        _mm_store_ss(d2 + j, _mm_shuffle_ps(f, f, 2));                                           \
    }

/* 4 taps from one 16-byte load with SSE2 only: byte shifts + unpacks build the int16 tap pairs
 * (lane 3 gets a garbage product that is never stored) */
static inline __m128i group_sse2(const uint8_t *p, const int16_t *k) {
    const __m128i zero = _mm_setzero_si128();
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m128i a0 = _mm_unpacklo_epi8(v, zero), a1 = _mm_unpacklo_epi8(_mm_srli_si128(v, 3), zero);
    const __m128i a2 = _mm_unpacklo_epi8(_mm_srli_si128(v, 6), zero);
    const __m128i a3 = _mm_unpacklo_epi8(_mm_srli_si128(v, 9), zero);
    return _mm_add_epi32(
        _mm_madd_epi16(_mm_unpacklo_epi16(a0, a1), _mm_loadu_si128((const __m128i *)k)),
        _mm_madd_epi16(_mm_unpacklo_epi16(a2, a3), _mm_loadu_si128((const __m128i *)k + 1)));
}

static inline __m128 hpass_px_sse2_at(const uint8_t *srow, Py_ssize_t width, const int *xb,
                                      const int *xm, const int16_t *xw, int wstride,
                                      Py_ssize_t j) {
    const int x0 = xb[2 * j], groups = xm[j];
    const uint8_t *p = srow + 3 * (Py_ssize_t)x0;
    const int16_t *k = xw + j * (Py_ssize_t)wstride;
    __m128i acc;
    if (__builtin_expect(groups == 1, 1)) {
        acc = group_sse2(p, k);
    } else if (groups > 1) {
        acc = group_sse2(p, k);
        for (int g = 1; g < groups; g++) acc = _mm_add_epi32(acc, group_sse2(p + 12 * g, k + 16 * g));
    } else {
        const int n = xb[2 * j + 1];
        acc = hpass_px_sse2(p, n, x0 + n < width, k);
    }
    return _mm_cvtepi32_ps(acc);
}

static void hpass_row_sse2(const uint8_t *restrict srow, Py_ssize_t width, Py_ssize_t ow,
                           const int *restrict xb, const int *restrict xm,
                           const int16_t *restrict xw, int wstride, float *restrict dst) {
#define PX(j) hpass_px_sse2_at(srow, width, xb, xm, xw, wstride, (j))
    HPASS_ROW_BODY(PX)
#undef PX
}

/* byte shuffles: pixels t..t+3 (12 bytes) -> int16 (r_t, r_t+1, g_t, g_t+1, b_t, b_t+1, 0, 0) */
#define Z -1

__attribute__((target("ssse3"))) static inline __m128 hpass_px_ssse3(
    const uint8_t *srow, Py_ssize_t width, const int *xb, const int *xm, const int16_t *xw,
    int wstride, Py_ssize_t j, __m128i m01, __m128i m23) {
    const int16_t *k = xw + j * (Py_ssize_t)wstride;
    const uint8_t *p = srow + 3 * (Py_ssize_t)xb[2 * j];
    const int groups = xm[j]; /* > 0: 16-byte loads stay in the row; 0: near the row's end */
    __m128i acc;
    if (__builtin_expect(groups == 1, 1)) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        acc = _mm_add_epi32(
            _mm_madd_epi16(_mm_shuffle_epi8(v, m01), _mm_loadu_si128((const __m128i *)k)),
            _mm_madd_epi16(_mm_shuffle_epi8(v, m23), _mm_loadu_si128((const __m128i *)k + 1)));
    } else if (groups > 1) {
        acc = _mm_setzero_si128();
        for (int g = 0; g < groups; g++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + 12 * g));
            const __m128i *w = (const __m128i *)(k + 16 * g);
            acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_shuffle_epi8(v, m01), _mm_loadu_si128(w)));
            acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_shuffle_epi8(v, m23), _mm_loadu_si128(w + 1)));
        }
    } else {
        const int x0 = xb[2 * j], n = xb[2 * j + 1];
        acc = hpass_px_sse2(p, n, x0 + n < width, k);
    }
    return _mm_cvtepi32_ps(acc);
}

__attribute__((target("ssse3"))) static void hpass_row_ssse3(
    const uint8_t *restrict srow, Py_ssize_t width, Py_ssize_t ow, const int *restrict xb,
    const int *restrict xm, const int16_t *restrict xw, int wstride, float *restrict dst) {
    const __m128i m01 = _mm_setr_epi8(0, Z, 3, Z, 1, Z, 4, Z, 2, Z, 5, Z, Z, Z, Z, Z);
    const __m128i m23 = _mm_setr_epi8(6, Z, 9, Z, 7, Z, 10, Z, 8, Z, 11, Z, Z, Z, Z, Z);
#define PX(j) hpass_px_ssse3(srow, width, xb, xm, xw, wstride, (j), m01, m23)
    HPASS_ROW_BODY(PX)
#undef PX
}

__attribute__((target("avx2"))) static inline __m128 hpass_px_avx2(
    const uint8_t *srow, Py_ssize_t width, const int *xb, const int *xm, const int16_t *xw,
    int wstride, Py_ssize_t j, __m256i m) {
    const int16_t *k = xw + j * (Py_ssize_t)wstride;
    const uint8_t *p = srow + 3 * (Py_ssize_t)xb[2 * j];
    const int groups = xm[j]; /* > 0: 16-byte loads stay in the row; 0: near the row's end */
    __m128i acc;
    if (__builtin_expect(groups == 1, 1)) {
        __m256i a = _mm256_madd_epi16(
            _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)), m),
            _mm256_loadu_si256((const __m256i *)k));
        acc = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    } else if (groups > 1) {
        __m256i a = _mm256_setzero_si256();
        for (int g = 0; g < groups; g++) {
            __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 12 * g)));
            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_shuffle_epi8(v, m),
                                                      _mm256_loadu_si256((const __m256i *)(k + 16 * g))));
        }
        acc = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    } else {
        const int x0 = xb[2 * j], n = xb[2 * j + 1];
        acc = hpass_px_sse2(p, n, x0 + n < width, k);
    }
    return _mm_cvtepi32_ps(acc);
}

__attribute__((target("avx2"))) static void hpass_row_avx2(
    const uint8_t *restrict srow, Py_ssize_t width, Py_ssize_t ow, const int *restrict xb,
    const int *restrict xm, const int16_t *restrict xw, int wstride, float *restrict dst) {
    const __m256i m = _mm256_setr_epi8(0, Z, 3, Z, 1, Z, 4, Z, 2, Z, 5, Z, Z, Z, Z, Z,
                                       6, Z, 9, Z, 7, Z, 10, Z, 8, Z, 11, Z, Z, Z, Z, Z);
#define PX(j) hpass_px_avx2(srow, width, xb, xm, xw, wstride, (j), m)
    HPASS_ROW_BODY(PX)
#undef PX
}

/* Two source rows at once (AVX2): row a in the low 128-bit lane, row b in the high one, so one
 * vpshufb/vpmaddwd pair serves both rows, the column's weights are loaded once for both, and
 * the lanes need no horizontal add.  The same int32 sums as hpass_px_avx2, so the same floats. */
/* 8 int16 weights (one tap pair for 4 channels) in both 128-bit lanes */
__attribute__((target("avx2"))) static inline __m256i weights2(const int16_t *k) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k));
}

/* taps t..t+3 of rows a and b (12 bytes each, from a + off and b + off) times their weights */
__attribute__((target("avx2"))) static inline __m256i group2_avx2(
    const uint8_t *rowa, const uint8_t *rowb, Py_ssize_t off, const int16_t *k, __m256i m01,
    __m256i m23) {
    const __m256i v = _mm256_loadu2_m128i((const __m128i *)(rowb + off),
                                          (const __m128i *)(rowa + off));
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_shuffle_epi8(v, m01), weights2(k)),
                            _mm256_madd_epi16(_mm256_shuffle_epi8(v, m23), weights2(k + 8)));
}

/* an output pixel whose `groups` 16-byte loads (at byte `off`) all stay in the row */
__attribute__((target("avx2"))) static inline __m256 px2_groups_avx2(
    const uint8_t *rowa, const uint8_t *rowb, Py_ssize_t off, const int16_t *k, int groups,
    __m256i m01, __m256i m23) {
    __m256i acc = group2_avx2(rowa, rowb, off, k, m01, m23);
    for (int g = 1; g < groups; g++)
        acc = _mm256_add_epi32(acc, group2_avx2(rowa, rowb, off + 12 * g, k + 16 * g, m01, m23));
    return _mm256_cvtepi32_ps(acc);
}

/* output pixel j of rows a and b, whatever its mode (xm[j] loads, or 0: near the row's end) */
__attribute__((target("avx2"))) static inline __m256 hpass_px2_avx2(
    const uint8_t *rowa, const uint8_t *rowb, Py_ssize_t width, const int *xb, const int *xm,
    const int16_t *xw, int wstride, Py_ssize_t j, __m256i m01, __m256i m23) {
    const int16_t *k = xw + j * (Py_ssize_t)wstride;
    const Py_ssize_t off = 3 * (Py_ssize_t)xb[2 * j];
    const int groups = xm[j];
    if (__builtin_expect(groups > 0, 1)) return px2_groups_avx2(rowa, rowb, off, k, groups, m01, m23);
    const int x0 = xb[2 * j], n = xb[2 * j + 1];
    return _mm256_cvtepi32_ps(_mm256_set_m128i(hpass_px_sse2(rowb + off, n, x0 + n < width, k),
                                               hpass_px_sse2(rowa + off, n, x0 + n < width, k)));
}

__attribute__((target("avx2"))) static void hpass_rows2_avx2(
    const uint8_t *restrict rowa, const uint8_t *restrict rowb, Py_ssize_t width, Py_ssize_t ow,
    const int *restrict xb, const int *restrict xm, const int16_t *restrict xw, int wstride,
    float *restrict dsta, float *restrict dstb) {
    const __m256i m01 = _mm256_setr_epi8(0, Z, 3, Z, 1, Z, 4, Z, 2, Z, 5, Z, Z, Z, Z, Z,
                                         0, Z, 3, Z, 1, Z, 4, Z, 2, Z, 5, Z, Z, Z, Z, Z);
    const __m256i m23 = _mm256_setr_epi8(6, Z, 9, Z, 7, Z, 10, Z, 8, Z, 11, Z, Z, Z, Z, Z,
                                         6, Z, 9, Z, 7, Z, 10, Z, 8, Z, 11, Z, Z, Z, Z, Z);
    float *a0 = dsta, *a1 = dsta + ow, *a2 = dsta + 2 * ow;
    float *b0 = dstb, *b1 = dstb + ow, *b2 = dstb + 2 * ow;
    Py_ssize_t j = 0;
    const int *restrict quads = xm + ow, *restrict xoff = quads + (ow + 3) / 4; /* see QUADS */
#define PX2(jj) hpass_px2_avx2(rowa, rowb, width, xb, xm, xw, wstride, (jj), m01, m23)
/* f_k: pixel j+k as (R, G, B, -) of row a in the low lane and of row b in the high one; the
 * 256-bit unpacks/shuffles work per lane, so one transpose serves both rows */
#define STORE4(pa, pb)                                                                           \
    do {                                                                                         \
        const __m256 rg01 = _mm256_unpacklo_ps(f0, f1), b01 = _mm256_unpackhi_ps(f0, f1);        \
        const __m256 rg23 = _mm256_unpacklo_ps(f2, f3), b23 = _mm256_unpackhi_ps(f2, f3);        \
        const __m256 r = _mm256_shuffle_ps(rg01, rg23, 0x44); /* R0 R1 R2 R3 per lane */         \
        const __m256 g = _mm256_shuffle_ps(rg01, rg23, 0xEE); /* G0 G1 G2 G3 */                  \
        const __m256 b = _mm256_shuffle_ps(b01, b23, 0x44);   /* B0 B1 B2 B3 */                  \
        _mm_storeu_ps((pa), _mm256_castps256_ps128(r));                                          \
        _mm_storeu_ps((pa) + ow, _mm256_castps256_ps128(g));                                     \
        _mm_storeu_ps((pa) + 2 * ow, _mm256_castps256_ps128(b));                                 \
        _mm_storeu_ps((pb), _mm256_extractf128_ps(r, 1));                                        \
        _mm_storeu_ps((pb) + ow, _mm256_extractf128_ps(g, 1));                                   \
        _mm_storeu_ps((pb) + 2 * ow, _mm256_extractf128_ps(b, 1));                               \
    } while (0)
    while (j + 4 <= ow) {
        __m256 f0, f1, f2, f3;
        const int mode = quads[j >> 2];
/* a run of quads whose columns all take G loads: no per-column mode test, one weights pointer */
#define RUN(G)                                                                                   \
    do {                                                                                         \
        const Py_ssize_t ws = wstride;                                                           \
        const int16_t *k = xw + j * ws;                                                          \
        do {                                                                                     \
            f0 = px2_groups_avx2(rowa, rowb, xoff[j], k, (G), m01, m23);                         \
            f1 = px2_groups_avx2(rowa, rowb, xoff[j + 1], k + ws, (G), m01, m23);                \
            f2 = px2_groups_avx2(rowa, rowb, xoff[j + 2], k + 2 * ws, (G), m01, m23);            \
            f3 = px2_groups_avx2(rowa, rowb, xoff[j + 3], k + 3 * ws, (G), m01, m23);            \
            STORE4(dsta + j, dstb + j);                                                          \
            j += 4;                                                                              \
            k += 4 * ws;                                                                         \
        } while (j + 4 <= ow && quads[j >> 2] == (G));                                          \
    } while (0)
        if (mode == 1) { /* downscales below ~1.5x */
            RUN(1);
            continue;
        }
        if (mode == 2) { /* ~1.5x to ~2.5x */
            RUN(2);
            continue;
        }
        f0 = PX2(j), f1 = PX2(j + 1), f2 = PX2(j + 2), f3 = PX2(j + 3);
        STORE4(dsta + j, dstb + j);
        j += 4;
    }
#undef RUN
#undef STORE4
    for (; j < ow; j++) {
        const __m256 f = PX2(j);
        const __m128 p = _mm256_castps256_ps128(f), q = _mm256_extractf128_ps(f, 1);
        _mm_store_ss(a0 + j, p);
        _mm_store_ss(a1 + j, _mm_shuffle_ps(p, p, 1));
        _mm_store_ss(a2 + j, _mm_shuffle_ps(p, p, 2));
        _mm_store_ss(b0 + j, q);
        _mm_store_ss(b1 + j, _mm_shuffle_ps(q, q, 1));
        _mm_store_ss(b2 + j, _mm_shuffle_ps(q, q, 2));
    }
#undef PX2
}
#undef Z

static hpass_fn pick_hpass(void) {
    __builtin_cpu_init();
    if (getenv("POOLED_LOADER_KERNEL_ISA")) { /* testing: force "sse2" / "ssse3" */
        const char *isa = getenv("POOLED_LOADER_KERNEL_ISA");
        if (!strcmp(isa, "sse2")) return hpass_row_sse2;
        if (!strcmp(isa, "ssse3") && __builtin_cpu_supports("ssse3")) return hpass_row_ssse3;
    }
    if (__builtin_cpu_supports("avx2")) return hpass_row_avx2;
    if (__builtin_cpu_supports("ssse3")) return hpass_row_ssse3;
    return hpass_row_sse2;
}
static const char *hpass_name(hpass_fn f) {
    return f == hpass_row_avx2 ? "avx2" : f == hpass_row_ssse3 ? "ssse3" : "sse2";
}
#else
static void hpass_row_c(const uint8_t *restrict srow, Py_ssize_t width, Py_ssize_t ow,
                        const int *restrict xb, const int *restrict xm,
                        const int16_t *restrict xw, int wstride, float *restrict dst) {
    (void)xm;
    float *restrict d0 = dst, *restrict d1 = dst + ow, *restrict d2 = dst + 2 * ow;
    (void)width;
    for (Py_ssize_t j = 0; j < ow; j++) {
        const int x0 = xb[2 * j], n = xb[2 * j + 1];
        const int16_t *restrict k = xw + j * (Py_ssize_t)wstride;
        const uint8_t *p = srow + 3 * (Py_ssize_t)x0;
        int32_t a0 = 0, a1 = 0, a2 = 0;
        for (int t = 0; t < n; t++) {
            const int32_t w = k[(t / 4) * 16 + ((t % 4) / 2) * 8 + (t % 2)];
            a0 += (int32_t)p[3 * t] * w;
            a1 += (int32_t)p[3 * t + 1] * w;
            a2 += (int32_t)p[3 * t + 2] * w;
        }
        d0[j] = (float)a0;
        d1[j] = (float)a1;
        d2[j] = (float)a2;
    }
}
static hpass_fn pick_hpass(void) { return hpass_row_c; }
static const char *hpass_name(hpass_fn f) { (void)f; return "c"; }
#endif

static hpass_fn hpass_row = NULL; /* set at module init */

/* Two rows at once where the ISA has a version for it (AVX2), else NULL: two hpass_row calls. */
typedef void (*hpass2_fn)(const uint8_t *restrict, const uint8_t *restrict, Py_ssize_t,
                          Py_ssize_t, const int *restrict, const int *restrict,
                          const int16_t *restrict, int, float *restrict, float *restrict);
static hpass2_fn hpass_rows2_for(hpass_fn f) {
#if defined(__SSE2__)
    if (f == hpass_row_avx2) return hpass_rows2_avx2;
#endif
    (void)f;
    return NULL;
}

/* Float variant for very wide filters (downscale > ~30x), where Q14 weights lose precision. */
static void hpass_row_f32(const uint8_t *restrict srow, Py_ssize_t ow, const int *restrict xb,
                          const float *restrict xw, int kx, float *restrict dst) {
    float *restrict d0 = dst, *restrict d1 = dst + ow, *restrict d2 = dst + 2 * ow;
    for (Py_ssize_t j = 0; j < ow; j++) {
        const int x0 = xb[2 * j], n = xb[2 * j + 1];
        const float *restrict k = xw + j * (Py_ssize_t)kx;
        const uint8_t *p = srow + 3 * (Py_ssize_t)x0;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f;
        for (int t = 0; t < n; t++) {
            a0 += (float)p[3 * t] * k[t];
            a1 += (float)p[3 * t + 1] * k[t];
            a2 += (float)p[3 * t + 2] * k[t];
        }
        d0[j] = a0;
        d1[j] = a1;
        d2[j] = a2;
    }
}

/* Vertical pass for one output row, fused with the final store into the three CHW planes.
 * Element i of a ring row is channel i / ow, column i % ow.  The sum over taps is always
 * ((r0*w0 + r1*w1) + r2*w2) + ... in that order, so every path/ISA gives the same floats.
 * uint8: round half up and clamp (the int clamp lets the compiler use saturating packs);
 * float32: the same uint8 value, then * scale + bias (so float == normalize(uint8)). */
#define TAP_SUM_1(i) (r0[i] * w0)
#define TAP_SUM_2(i) (r0[i] * w0 + r1[i] * w1)
#define TAP_SUM_3(i) (r0[i] * w0 + r1[i] * w1 + r2[i] * w2)
#define TAP_SUM_4(i) (r0[i] * w0 + r1[i] * w1 + r2[i] * w2 + r3[i] * w3)
#define TAP_SUM_ACC(i) (acc[i])
#define ROUND_U8(v, q)                                                                           \
    int32_t q = (int32_t)((v) + 0.5f);                                                           \
    q = q < 0 ? 0 : q;                                                                           \
    q = q > 255 ? 255 : q;

#define VROW_STORE(SUM)                                                                          \
    if (out_f32) {                                                                               \
        for (int c = 0; c < 3; c++) {                                                            \
            float *restrict o = out_f32 + c * plane;                                             \
            const float sc = scale[c], bi = bias[c];                                             \
            const Py_ssize_t off = c * ow;                                                       \
            for (Py_ssize_t x = 0; x < ow; x++) {                                                \
                ROUND_U8(SUM(off + x), q)                                                        \
                o[x] = (float)q * sc + bi;                                                       \
            }                                                                                    \
        }                                                                                        \
    } else {                                                                                     \
        for (int c = 0; c < 3; c++) {                                                            \
            uint8_t *restrict o = out_u8 + c * plane;                                            \
            const Py_ssize_t off = c * ow;                                                       \
            for (Py_ssize_t x = 0; x < ow; x++) {                                                \
                ROUND_U8(SUM(off + x), q)                                                        \
                o[x] = (uint8_t)q;                                                               \
            }                                                                                    \
        }                                                                                        \
    }

PL_HOT static void vpass_store(const float *const *rows, const float *w, int n, Py_ssize_t ow,
                               float *restrict acc, uint8_t *restrict out_u8,
                               float *restrict out_f32, Py_ssize_t plane, const float *scale,
                               const float *bias) {
    const Py_ssize_t len = 3 * ow;
    const float *restrict r0 = rows[0];
    const float *restrict r1 = n > 1 ? rows[1] : r0;
    const float *restrict r2 = n > 2 ? rows[2] : r0;
    const float *restrict r3 = n > 3 ? rows[3] : r0;
    const float w0 = w[0], w1 = n > 1 ? w[1] : 0.f, w2 = n > 2 ? w[2] : 0.f, w3 = n > 3 ? w[3] : 0.f;
    switch (n) {
    case 1: VROW_STORE(TAP_SUM_1) return;
    case 2: VROW_STORE(TAP_SUM_2) return;
    case 3: VROW_STORE(TAP_SUM_3) return;
    case 4: VROW_STORE(TAP_SUM_4) return;
    default: break;
    }
    for (Py_ssize_t i = 0; i < len; i++) acc[i] = TAP_SUM_4(i);
    for (int t = 4; t < n; t++) {
        const float *restrict r = rows[t];
        const float wt = w[t];
        for (Py_ssize_t i = 0; i < len; i++) acc[i] += r[i] * wt;
    }
    VROW_STORE(TAP_SUM_ACC)
}

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

/* ------------------------------------------------------------------------------------------ */
/* colour jitter: Pillow's ImageEnhance arithmetic on uint8 CHW planes (see vision/jitter.py)  */

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

static PyObject *set_isa(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    hpass_fn f = NULL;
#if defined(__SSE2__)
    if (!strcmp(name, "sse2")) f = hpass_row_sse2;
    else if (!strcmp(name, "ssse3") && __builtin_cpu_supports("ssse3")) f = hpass_row_ssse3;
    else if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2")) f = hpass_row_avx2;
#else
    if (!strcmp(name, "c")) f = hpass_row_c;
#endif
    else if (!strcmp(name, "auto")) f = pick_hpass();
    if (!f) {
        PyErr_Format(PyExc_ValueError, "ISA %R not available on this machine/build", arg);
        return NULL;
    }
    const char *prev = hpass_name(hpass_row);
    hpass_row = f;
    return PyUnicode_FromString(prev);
}

static PyMethodDef methods[] = {
    {"_set_isa", (PyCFunction)set_isa, METH_O,
     "_set_isa(name) -> previous name: testing/benchmarking only, not thread-safe; name is "
     "'avx2', 'ssse3', 'sse2' (x86-64) or 'auto'."},
    {"crop_resize_flip_chw", (PyCFunction)(void (*)(void))crop_resize_flip_chw,
     METH_VARARGS | METH_KEYWORDS, crop_resize_flip_chw_doc},
    {"enhance_chain", (PyCFunction)(void (*)(void))enhance_chain, METH_VARARGS | METH_KEYWORDS,
     enhance_chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Compiled kernels of pooled_loader.vision (see pooled_loader.vision.kernels).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    hpass_row = pick_hpass();
    PyObject *m = PyModule_Create(&moduledef);
    if (m && PyModule_AddStringConstant(m, "ISA", hpass_name(hpass_row)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
