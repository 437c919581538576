/*
 * The resize kernel's pixel loops (see resize.c for the design and its measurements): the
 * horizontal pass per ISA (SSE2, SSSE3, AVX2 one and two rows at a time, portable C, float for
 * very wide filters) and the vertical pass fused with the CHW store.  #included by resize.c.
 */

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
