/*
 * What both kernels of pooled_loader.vision._kernels share: headers, the PL_HOT clone attribute
 * and the per-thread scratch buffer.  Included once, by csrc/kernels.c (one translation unit:
 * every function stays static and the build is the one it was when this was one file).
 */
#ifndef POOLED_LOADER_KERNELS_COMMON_H
#define POOLED_LOADER_KERNELS_COMMON_H
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

#endif /* POOLED_LOADER_KERNELS_COMMON_H */
