/*
 * pooled_loader.vision._kernels: the compiled kernels of pooled_loader.vision, as one
 * translation unit (every function static, so the compiler sees them together as before the
 * split); each kernel keeps its notes and measurements in its own file:
 *
 *   kernels_common.h   headers, PL_HOT (AVX2 clones), the per-thread scratch buffer
 *   resize.c           fused crop -> resize -> flip -> HWC-to-CHW (-> normalize):
 *                      crop_resize_flip_chw; its pixel loops in resize_passes.c
 *   jitter.c           Pillow's ImageEnhance chain on CHW planes: enhance_chain
 *   kernels.c          this file: the module, its methods and the ISA switch
 *
 * Plain C against the CPython buffer protocol (no numpy or torch headers), so it builds with any
 * torch, or none.
 */
#include "kernels_common.h"

#include "resize.c"

#include "jitter.c"

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
