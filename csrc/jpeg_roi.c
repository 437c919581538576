/*
 * pooled_loader.vision._jpeg -- decode only a region of a JPEG, at a DCT scale, with libjpeg-turbo.
 *
 * RandomResizedCrop keeps on average about half of the image, so decoding the whole JPEG throws
 * away much of the work.  libjpeg-turbo (the libjpeg API, jpeglib.h; no TurboJPEG 3 needed) can
 * skip most of it:
 *   - scale_num/scale_denom: IDCT straight to 1/2, 1/4 or 1/8 of the size (DCT-domain scaling);
 *   - jpeg_crop_scanline: IDCT, upsampling and colour conversion only for the iMCU columns that
 *     hold the region (the left edge moves down to an iMCU boundary, the width grows to match);
 *   - jpeg_skip_scanlines: rows above the region are entropy-decoded only (no IDCT, no colour
 *     conversion); rows below it are not read at all (jpeg_abort_decompress).
 * The region's pixels equal those of a full decode with the same settings, cropped
 * (tests/test_jpeg_roi.py checks it for 4:2:0, 4:2:2, 4:4:4, grey, progressive, restart
 * markers, every scale, accurate and fast modes).  Columns decoded beyond the region (the
 * iMCU alignment) are not: smooth upsampling treats a cropped row's ends as image edges, so the
 * outermost decoded columns may differ; the region is widened by one column internally so that
 * this never reaches it.
 *
 * Warnings (corrupt or truncated data) are errors, as in simplejpeg/TurboJPEG's default: a
 * damaged image is reported, not silently filled with grey.  Data after the region's last row
 * is not read, so damage there goes unnoticed (and costs nothing).
 *
 * Only YCbCr and greyscale JPEGs (colour-converted to RGB by libjpeg-turbo) are handled; CMYK /
 * YCCK are refused (ValueError) and take Pillow's route in vision/decode.py.  The whole decode
 * runs with the GIL released.  Built only where jpeglib.h and libjpeg are found (setup.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h> /* jpeglib.h needs FILE */
#include <string.h>

#include <jerror.h>
#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char msg[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr c) {
    error_mgr *e = (error_mgr *)c->err;
    (*c->err->format_message)(c, e->msg);
    longjmp(e->jump, 1);
}

static void on_message(j_common_ptr c, int level) {
    if (level < 0) on_error(c); /* a warning: corrupt or truncated data */
}

typedef struct {
    /* in */
    const unsigned char *data;
    size_t len;
    unsigned char *out;
    size_t out_len;
    int factor, fast;
    Py_ssize_t x0, y0, w, h; /* region; w == 0: the whole (scaled) image */
    /* out */
    JDIMENSION xoff, width, height, full_w, full_h;
    int status; /* 0 ok, 1 libjpeg error (msg), 2 usage error (msg) */
    char msg[JMSG_LENGTH_MAX + 64];
} job_t;

/* Runs without the GIL; every exit path destroys the decompressor. */
static void run(job_t *job) {
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo); /* safe on a partly set-up decompressor */
        job->status = 1;
        snprintf(job->msg, sizeof job->msg, "%s", err.msg);
        return;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->len);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg,
                 "unsupported JPEG colour space %d (only YCbCr and greyscale)",
                 (int)cinfo.jpeg_color_space);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->factor;
    cinfo.dct_method = job->fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = job->fast ? FALSE : TRUE;
    jpeg_calc_output_dimensions(&cinfo);
    const JDIMENSION W = cinfo.output_width, H = cinfo.output_height;
    job->full_w = W;
    job->full_h = H;
    Py_ssize_t x0 = job->x0, y0 = job->y0, w = job->w, h = job->h;
    if (w == 0) {
        x0 = y0 = 0;
        w = W;
        h = H;
    }
    if (x0 < 0 || y0 < 0 || w < 1 || h < 1 || x0 + w > (Py_ssize_t)W || y0 + h > (Py_ssize_t)H) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg,
                 "region (x0=%zd, y0=%zd, w=%zd, h=%zd) outside the %ux%u image at scale 1/%d",
                 x0, y0, w, h, (unsigned)W, (unsigned)H, job->factor);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    jpeg_start_decompress(&cinfo);
    /* Fancy (smooth) chroma upsampling treats the edges of a cropped row as image edges, so
     * the outermost column of a crop can differ from the full decode: ask for one more column
     * on each side (inside the image), so those columns lie outside the region. */
    const Py_ssize_t cx0 = x0 > 0 ? x0 - 1 : 0;
    const Py_ssize_t cx1 = x0 + w < (Py_ssize_t)W ? x0 + w + 1 : (Py_ssize_t)W;
    JDIMENSION xoff = (JDIMENSION)cx0, width = (JDIMENSION)(cx1 - cx0);
    if (width < W) jpeg_crop_scanline(&cinfo, &xoff, &width); /* widens to iMCU boundaries */
    const size_t stride = (size_t)width * 3;
    if ((size_t)h * stride > job->out_len) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg, "out buffer too small: %zu bytes for %zd rows of %u",
                 job->out_len, h, (unsigned)width);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    if (y0 > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg, "could not skip to row %zd", y0);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    const JDIMENSION end = (JDIMENSION)(y0 + h);
    while (cinfo.output_scanline < end) {
        JSAMPROW rows[16];
        JDIMENSION n = end - cinfo.output_scanline;
        if (n > 16) n = 16;
        for (JDIMENSION i = 0; i < n; i++)
            rows[i] = job->out + (size_t)(cinfo.output_scanline - (JDIMENSION)y0 + i) * stride;
        if (jpeg_read_scanlines(&cinfo, rows, n) == 0) { /* suspension: cannot happen in memory */
            job->status = 2;
            snprintf(job->msg, sizeof job->msg, "decoder stopped at row %u",
                     (unsigned)cinfo.output_scanline);
            jpeg_destroy_decompress(&cinfo);
            return;
        }
    }
    if (cinfo.output_scanline == H)
        jpeg_finish_decompress(&cinfo); /* the whole height: check the end, as a full decode does */
    else
        jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    job->xoff = xoff;
    job->width = width;
    job->height = (JDIMENSION)h;
    job->status = 0;
}

PyDoc_STRVAR(decode_doc,
             "decode(data, out, factor=1, x0=0, y0=0, w=0, h=0, fast=False) -> (xoff, width)\n"
             "\n"
             "Decode rows y0..y0+h-1 of the JPEG `data` scaled by 1/factor (1, 2, 4 or 8) into\n"
             "the writable buffer `out` as packed RGB rows of `width` pixels starting at column\n"
             "`xoff` (xoff <= x0 and xoff + width >= x0 + w: the region widened to iMCU\n"
             "boundaries).  w == 0 decodes the whole image.  fast: fast integer IDCT and\n"
             "merged/plain upsampling.  Raises ValueError for corrupt, truncated or unsupported\n"
             "(CMYK/YCCK) data, or a region outside the image.  The GIL is released.");

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "out", "factor", "x0", "y0", "w", "h", "fast", NULL};
    PyObject *data_obj, *out_obj;
    job_t job;
    memset(&job, 0, sizeof job);
    job.factor = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|innnnp", kwlist, &data_obj, &out_obj,
                                     &job.factor, &job.x0, &job.y0, &job.w, &job.h, &job.fast))
        return NULL;
    if (job.factor != 1 && job.factor != 2 && job.factor != 4 && job.factor != 8) {
        PyErr_Format(PyExc_ValueError, "factor must be 1, 2, 4 or 8, got %d", job.factor);
        return NULL;
    }
    Py_buffer db, ob;
    if (PyObject_GetBuffer(data_obj, &db, PyBUF_SIMPLE) != 0) return NULL;
    if (PyObject_GetBuffer(out_obj, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&db);
        return NULL;
    }
    job.data = (const unsigned char *)db.buf;
    job.len = (size_t)db.len;
    job.out = (unsigned char *)ob.buf;
    job.out_len = (size_t)ob.len;
    if (job.len == 0) {
        job.status = 2;
        snprintf(job.msg, sizeof job.msg, "empty data");
    } else {
        Py_BEGIN_ALLOW_THREADS;
        run(&job);
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&db);
    if (job.status) {
        PyErr_SetString(PyExc_ValueError, job.msg);
        return NULL;
    }
    return Py_BuildValue("(II)", (unsigned)job.xoff, (unsigned)job.width);
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_jpeg",
    "Region-of-interest JPEG decoding with libjpeg-turbo (see pooled_loader.vision.decode).", -1,
    methods,
};

#define PL_STR2(x) #x
#define PL_STR(x) PL_STR2(x)

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
#ifdef LIBJPEG_TURBO_VERSION
    const char *version = PL_STR(LIBJPEG_TURBO_VERSION);
#else
    const char *version = "libjpeg " PL_STR(JPEG_LIB_VERSION);
#endif
    if (PyModule_AddStringConstant(m, "LIBJPEG_VERSION", version) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
