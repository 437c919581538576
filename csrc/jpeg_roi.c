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
 * Only YCbCr and greyscale JPEGs (colour-converted to RGB by libjpeg-turbo) are decoded; CMYK /
 * YCCK are refused (ValueError) and take Pillow's route in vision/decode.py, which first runs
 * check() on them (the same decoder, any colour space, pixels thrown away) because Pillow ignores
 * libjpeg's warnings and pads damaged data with grey.  The whole decode runs with the GIL
 * released.  Built only where jpeglib.h and libjpeg are found (setup.py).
 *
 * Hostile input (issue 24).  Every integer argument is range-checked as a Python int before any
 * C conversion, and the region test cannot overflow (w > W - x0).  Two limits, given by the
 * caller, raise LimitError (a ValueError): max_scans, counted by a progress monitor on
 * input_scan_number (libjpeg-turbo's recommended guard against scan-count bombs, which cost CPU
 * per scan), and max_memory: a progressive or multi-scan JPEG keeps all its coefficients
 * (2 bytes per sample at full size, whatever the DCT scale), computed from the frame header and
 * refused before libjpeg allocates them (2.1.5's jmemnobs ignores max_memory_to_use; it is set
 * too, for the versions that honour it).
 *
 * libjpeg-turbo 2.1.5 crops inexactly in two cases, so they are avoided: a crop whose chroma is
 * under 3 samples wide switches the upsampler to its plain (non-smooth) form, so a crop is at
 * least MIN_CROP columns; and sampling other than luma 1x1/2x1/1x2/2x2 over 1x1 chroma (4x2,
 * 2x4, 4x4 at 1/2 and 1/4 read unwritten memory) is decoded from row 0 at full width, without
 * skip or crop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h> /* jpeglib.h needs FILE */
#include <string.h>

#include <jerror.h>
#include <jpeglib.h>

#define MIN_CROP 16 /* output columns: keeps every component's crop >= 3 samples (h <= 4) */

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char msg[JMSG_LENGTH_MAX + 160];
    int limit; /* the error is a limit (scans, memory), not damaged data */
} error_mgr;

static void on_error(j_common_ptr c) {
    error_mgr *e = (error_mgr *)c->err;
    if (c->err->msg_code == JERR_NO_BACKING_STORE) {
        e->limit = 1;
        snprintf(e->msg, sizeof e->msg,
                 "a progressive or multi-scan JPEG of this size needs more than %ld bytes of "
                 "decoder memory (all its coefficients), the limit",
                 c->mem->max_memory_to_use);
    } else if (!e->limit) {
        (*c->err->format_message)(c, e->msg);
    }
    longjmp(e->jump, 1);
}

static void on_message(j_common_ptr c, int level) {
    if (level < 0) on_error(c); /* a warning: corrupt or truncated data */
}

/* Errors and warnings longjmp to err->jump (the caller's setjmp) with the message in err->msg. */
static void use_errors(struct jpeg_decompress_struct *ci, error_mgr *err) {
    ci->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->limit = 0;
}

typedef struct {
    struct jpeg_progress_mgr pub;
    int max_scans;
} progress_mgr;

/* Called once per iMCU row or marker while input is consumed: bounds the number of scans. */
static void on_progress(j_common_ptr c) {
    progress_mgr *p = (progress_mgr *)c->progress;
    int scan = ((j_decompress_ptr)c)->input_scan_number;
    if (p->max_scans > 0 && scan > p->max_scans) {
        error_mgr *e = (error_mgr *)c->err;
        e->limit = 1;
        snprintf(e->msg, sizeof e->msg,
                 "more than %d scans (the scan limit; a scan-count bomb costs CPU per scan)",
                 p->max_scans);
        longjmp(e->jump, 1);
    }
}

/* Bytes of the whole-image coefficient buffer libjpeg allocates for a progressive or multi-scan
 * JPEG (2 bytes per DCT coefficient at full size, whatever the scale), else 0. */
static double coef_bytes(const struct jpeg_decompress_struct *ci) {
    if (!ci->progressive_mode && ci->comps_in_scan >= ci->num_components) return 0;
    double n = 0;
    for (int i = 0; i < ci->num_components; i++) {
        const jpeg_component_info *c = &ci->comp_info[i];
        const double hs = c->h_samp_factor, vs = c->v_samp_factor; /* rows of whole iMCUs */
        n += ceil(c->width_in_blocks / hs) * hs * ceil(c->height_in_blocks / vs) * vs *
             DCTSIZE2 * sizeof(JCOEF);
    }
    return n;
}

/* Sampling whose crops and skips libjpeg-turbo 2.1.5 decodes exactly (tests/test_jpeg_roi.py,
 * tests/test_hostile_jpeg.py): grey, or luma 1x1/2x1/1x2/2x2 over 1x1 chroma. */
static int plain_sampling(const struct jpeg_decompress_struct *ci) {
    if (ci->num_components == 1) return 1;
    if (ci->comp_info[0].h_samp_factor > 2 || ci->comp_info[0].v_samp_factor > 2) return 0;
    for (int i = 1; i < ci->num_components; i++)
        if (ci->comp_info[i].h_samp_factor != 1 || ci->comp_info[i].v_samp_factor != 1) return 0;
    return 1;
}

typedef struct {
    /* in */
    const unsigned char *data;
    size_t len;
    unsigned char *out;
    size_t out_len;
    int factor, fast, check; /* check: any colour space, pixels thrown away (out unused) */
    int max_scans;           /* > 0: more scans is an error */
    long max_memory;         /* > 0: libjpeg's max_memory_to_use */
    long long x0, y0, w, h;  /* region; w == 0: the whole (scaled) image */
    /* out */
    JDIMENSION xoff, width, height, full_w, full_h;
    int status; /* 0 ok, 1 libjpeg error (msg), 2 usage error (msg), 3 a limit (msg) */
    char msg[JMSG_LENGTH_MAX + 192];
} job_t;

/* Reads every row into one scratch row from libjpeg's pool (freed with the decompressor). */
static void read_all(j_decompress_ptr ci) {
    JSAMPARRAY row = (*ci->mem->alloc_sarray)((j_common_ptr)ci, JPOOL_IMAGE,
                                              ci->output_width * ci->output_components, 1);
    while (ci->output_scanline < ci->output_height)
        if (jpeg_read_scanlines(ci, row, 1) == 0) ERREXIT(ci, JERR_INPUT_EOF); /* cannot happen */
}

/* Runs without the GIL; every exit path destroys the decompressor. */
static void run(job_t *job) {
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    progress_mgr prog;
    use_errors(&cinfo, &err);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo); /* safe on a partly set-up decompressor */
        job->status = err.limit ? 3 : 1;
        snprintf(job->msg, sizeof job->msg, "%s", err.msg);
        return;
    }
    jpeg_create_decompress(&cinfo);
    if (job->max_memory > 0) cinfo.mem->max_memory_to_use = job->max_memory;
    memset(&prog, 0, sizeof prog);
    prog.pub.progress_monitor = on_progress;
    prog.max_scans = job->max_scans;
    cinfo.progress = &prog.pub;
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->len);
    jpeg_read_header(&cinfo, TRUE);
    const double need = coef_bytes(&cinfo);
    if (job->max_memory > 0 && need > (double)job->max_memory) { /* before allocating it */
        job->status = 3;
        snprintf(job->msg, sizeof job->msg,
                 "a %s JPEG of %ux%u pixels keeps all its coefficients in memory: %.4g MB, over "
                 "the %.4g MB limit",
                 cinfo.progressive_mode ? "progressive" : "multi-scan", cinfo.image_width,
                 cinfo.image_height, need / 1e6, job->max_memory / 1e6);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    if (job->check) {
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned int)job->factor;
        jpeg_start_decompress(&cinfo);
        read_all(&cinfo);
        jpeg_finish_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        job->status = 0;
        return;
    }
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
    long long x0 = job->x0, y0 = job->y0, w = job->w, h = job->h; /* each in [0, INT_MAX] */
    if (w == 0) {
        x0 = y0 = 0;
        w = W;
        h = H;
    }
    /* w > W - x0, not x0 + w > W: the sum of two huge values must not wrap */
    if (w < 1 || h < 1 || x0 >= (long long)W || y0 >= (long long)H || w > (long long)W - x0 ||
        h > (long long)H - y0) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg,
                 "region (x0=%lld, y0=%lld, w=%lld, h=%lld) outside the %ux%u image at scale 1/%d",
                 x0, y0, w, h, (unsigned)W, (unsigned)H, job->factor);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    const int plain = plain_sampling(&cinfo);
    jpeg_start_decompress(&cinfo);
    /* Fancy (smooth) chroma upsampling treats the edges of a cropped row as image edges, so
     * the outermost column of a crop can differ from the full decode: ask for one more column
     * on each side (inside the image), so those columns lie outside the region; and at least
     * MIN_CROP columns, so that libjpeg keeps the smooth upsampler. */
    long long cx0 = x0 > 0 ? x0 - 1 : 0;
    long long cx1 = x0 + w < (long long)W ? x0 + w + 1 : (long long)W;
    if (cx1 - cx0 < MIN_CROP) {
        cx1 = cx0 + MIN_CROP < (long long)W ? cx0 + MIN_CROP : (long long)W;
        cx0 = cx1 - MIN_CROP > 0 ? cx1 - MIN_CROP : 0;
    }
    if (!plain) cx0 = 0, cx1 = W; /* and no skip below */
    JDIMENSION xoff = (JDIMENSION)cx0, width = (JDIMENSION)(cx1 - cx0);
    if (width < W) jpeg_crop_scanline(&cinfo, &xoff, &width); /* widens to iMCU boundaries */
    const size_t stride = (size_t)width * 3;
    if ((size_t)h * stride > job->out_len) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg, "out buffer too small: %zu bytes for %lld rows of %u",
                 job->out_len, h, (unsigned)width);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    if (!plain) { /* decode the rows above the region into its first row, which comes later */
        JSAMPROW row = job->out;
        while (cinfo.output_scanline < (JDIMENSION)y0)
            if (jpeg_read_scanlines(&cinfo, &row, 1) == 0) ERREXIT(&cinfo, JERR_INPUT_EOF);
    } else if (y0 > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg, "could not skip to row %lld", y0);
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

static PyObject *LimitError; /* a ValueError: the JPEG exceeds a limit given by the caller */

/* *out = obj as an integer in [lo, hi], checked on the Python int (nothing is cut to 32 bits
 * first); a missing argument keeps *out. */
static int int_arg(PyObject *obj, const char *name, long long lo, long long hi, long long *out) {
    if (obj == NULL) return 0;
    PyObject *ix = PyNumber_Index(obj);
    if (ix == NULL) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(ix, &overflow);
    Py_DECREF(ix);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer in [%lld, %lld], got %R", name, lo,
                     hi, obj);
        return -1;
    }
    *out = v;
    return 0;
}

/* Parses the arguments shared by decode() and check() into job and the two buffers. */
static int parse(PyObject *args, PyObject *kwargs, char **kwlist, const char *fmt,
                 long long factor, job_t *job, Py_buffer *db, Py_buffer *ob) {
    PyObject *data_obj, *out_obj = NULL, *o_factor = NULL, *o_x0 = NULL, *o_y0 = NULL,
                        *o_w = NULL, *o_h = NULL, *o_scans = NULL, *o_mem = NULL;
    int fast = 0;
    memset(job, 0, sizeof *job);
    if (ob != NULL) {
        if (!PyArg_ParseTupleAndKeywords(args, kwargs, fmt, kwlist, &data_obj, &out_obj,
                                         &o_factor, &o_x0, &o_y0, &o_w, &o_h, &fast, &o_scans,
                                         &o_mem))
            return -1;
    } else if (!PyArg_ParseTupleAndKeywords(args, kwargs, fmt, kwlist, &data_obj, &o_factor,
                                            &o_scans, &o_mem)) {
        return -1;
    }
    long long scans = 0, mem = 0;
    if (int_arg(o_factor, "factor", 1, 8, &factor) < 0 ||
        int_arg(o_x0, "x0", 0, INT_MAX, &job->x0) < 0 ||
        int_arg(o_y0, "y0", 0, INT_MAX, &job->y0) < 0 ||
        int_arg(o_w, "w", 0, INT_MAX, &job->w) < 0 || int_arg(o_h, "h", 0, INT_MAX, &job->h) < 0 ||
        int_arg(o_scans, "max_scans", 0, INT_MAX, &scans) < 0 ||
        int_arg(o_mem, "max_memory", 0, LONG_MAX, &mem) < 0)
        return -1;
    if (factor != 1 && factor != 2 && factor != 4 && factor != 8) {
        PyErr_Format(PyExc_ValueError, "factor must be 1, 2, 4 or 8, got %lld", factor);
        return -1;
    }
    if (job->w == 0 && (job->x0 || job->y0 || job->h)) {
        PyErr_SetString(PyExc_ValueError, "w == 0 (the whole image) takes x0 = y0 = h = 0");
        return -1;
    }
    if ((job->w == 0) != (job->h == 0)) {
        PyErr_SetString(PyExc_ValueError, "a region needs w >= 1 and h >= 1");
        return -1;
    }
    job->factor = (int)factor;
    job->fast = fast;
    job->max_scans = (int)scans;
    job->max_memory = (long)mem;
    if (PyObject_GetBuffer(data_obj, db, PyBUF_SIMPLE) != 0) return -1;
    if (ob != NULL && PyObject_GetBuffer(out_obj, ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(db);
        return -1;
    }
    job->data = (const unsigned char *)db->buf;
    job->len = (size_t)db->len;
    if (ob != NULL) {
        job->out = (unsigned char *)ob->buf;
        job->out_len = (size_t)ob->len;
    }
    return 0;
}

/* Runs the job without the GIL; releases the buffers; sets the exception on failure. */
static int execute(job_t *job, Py_buffer *db, Py_buffer *ob) {
    if (job->len == 0) {
        job->status = 2;
        snprintf(job->msg, sizeof job->msg, "empty data");
    } else {
        Py_BEGIN_ALLOW_THREADS;
        run(job);
        Py_END_ALLOW_THREADS;
    }
    if (ob != NULL) PyBuffer_Release(ob);
    PyBuffer_Release(db);
    if (job->status) {
        PyErr_SetString(job->status == 3 ? LimitError : PyExc_ValueError, job->msg);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(decode_doc,
             "decode(data, out, factor=1, x0=0, y0=0, w=0, h=0, fast=False, max_scans=0,\n"
             "       max_memory=0) -> (xoff, width)\n"
             "\n"
             "Decode rows y0..y0+h-1 of the JPEG `data` scaled by 1/factor (1, 2, 4 or 8) into\n"
             "the writable buffer `out` as packed RGB rows of `width` pixels starting at column\n"
             "`xoff` (xoff <= x0 and xoff + width >= x0 + w: the region widened to iMCU\n"
             "boundaries).  w == 0 decodes the whole image.  fast: fast integer IDCT and\n"
             "merged/plain upsampling.  max_scans > 0: more scans raise LimitError; max_memory\n"
             "> 0: libjpeg's memory limit in bytes (LimitError).  Raises ValueError for corrupt,\n"
             "truncated or unsupported (CMYK/YCCK) data, a bad argument or a region outside the\n"
             "image.  The GIL is released.");

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "out",       "factor",     "x0", "y0", "w",
                             "h",    "fast",      "max_scans", "max_memory", NULL};
    job_t job;
    Py_buffer db, ob;
    if (parse(args, kwargs, kwlist, "OO|OOOOOpOO", 1, &job, &db, &ob) < 0) return NULL;
    if (execute(&job, &db, &ob) < 0) return NULL;
    return Py_BuildValue("(II)", (unsigned)job.xoff, (unsigned)job.width);
}

PyDoc_STRVAR(check_doc,
             "check(data, factor=8, max_scans=0, max_memory=0) -> None\n"
             "\n"
             "Decode the whole JPEG `data` (any colour space, CMYK included) at scale\n"
             "1/factor and throw the pixels away: raises ValueError where decode() would\n"
             "(corrupt or truncated data; LimitError for the limits).  For JPEGs that another\n"
             "decoder will decode.");

static PyObject *check(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "factor", "max_scans", "max_memory", NULL};
    job_t job;
    Py_buffer db;
    if (parse(args, kwargs, kwlist, "O|OOO", 8, &job, &db, NULL) < 0) return NULL;
    job.check = 1;
    if (execute(&job, &db, NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(header_doc,
             "header(data) -> (height, width, sampling, colorspace, progressive, multi_scan,\n"
             "                 huffman_8bit)\n"
             "\n"
             "The frame header as libjpeg reads it (jpeg_read_header: the markers up to the\n"
             "first scan, warnings as errors), as the fields of\n"
             "pooled_loader.vision.jpeg_markers.Frame: sampling ((h, v), ...) per component;\n"
             "colorspace Gray, YCbCr, RGB, CMYK, YCCK or unknown; multi_scan: libjpeg keeps\n"
             "every coefficient (progressive, or a first scan without every component);\n"
             "huffman_8bit: Huffman-coded 8-bit data.  Raises ValueError for a damaged header.");

static PyObject *header(PyObject *self, PyObject *arg) {
    Py_buffer db;
    if (PyObject_GetBuffer(arg, &db, PyBUF_SIMPLE) != 0) return NULL;
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    use_errors(&cinfo, &err);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&db);
        PyErr_SetString(PyExc_ValueError, err.msg);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)db.buf, (unsigned long)db.len);
    jpeg_read_header(&cinfo, TRUE);
    static const char *names[] = {"unknown", "Gray", "RGB", "YCbCr", "CMYK", "YCCK"};
    const int cs = (int)cinfo.jpeg_color_space;
    PyObject *sampling = PyTuple_New(cinfo.num_components);
    for (int i = 0; sampling != NULL && i < cinfo.num_components; i++)
        PyTuple_SET_ITEM(sampling, i, Py_BuildValue("(ii)", cinfo.comp_info[i].h_samp_factor,
                                                    cinfo.comp_info[i].v_samp_factor));
    PyObject *res = sampling == NULL ? NULL : Py_BuildValue(
        "(IINsNNN)", (unsigned)cinfo.image_height, (unsigned)cinfo.image_width, sampling,
        cs >= 0 && cs <= JCS_YCCK ? names[cs] : "unknown", PyBool_FromLong(cinfo.progressive_mode),
        PyBool_FromLong(cinfo.progressive_mode || cinfo.comps_in_scan < cinfo.num_components),
        PyBool_FromLong(!cinfo.arith_code && cinfo.data_precision == 8));
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&db);
    return res;
}

static PyMethodDef methods[] = {
    {"header", header, METH_O, header_doc},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS, decode_doc},
    {"check", (PyCFunction)(void (*)(void))check, METH_VARARGS | METH_KEYWORDS, check_doc},
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
    LimitError = PyErr_NewExceptionWithDoc(
        "pooled_loader.vision._jpeg.LimitError",
        "The JPEG exceeds a limit the caller gave (max_scans, max_memory).", PyExc_ValueError,
        NULL);
    if (LimitError == NULL || PyModule_AddObjectRef(m, "LimitError", LimitError) < 0 ||
        PyModule_AddStringConstant(m, "LIBJPEG_VERSION", version) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
