/* kvfold_ext.c — the Python module kvfold._kvfold: kvf files in, vLLM KV blocks out.
 *
 *   read_header(path) -> dict                  opens and validates a kvf file, returns its header
 *   load(path, dtype, model_fingerprint=None, n_layers=-1, kv_heads=-1, head_dim=-1)
 *       -> (header, bytearray)                 every layer's K and V, checksums and layer digests verified, as one
 *                                              [2, n_layers, C, kv_heads, head_dim] array in dtype
 *   copy_blocks(src, src_dtype, n_layers, C, src_heads, head_dim, dst, dst_dtype, layout,
 *               block_ids, block_size, t0, t1, head_start=0, kv_heads=-1)
 *                                              src (a buffer as load returns) into per-layer tensors
 *                                              dst = [(data_ptr, shape, strides), ...] (blockcopy.h),
 *                                              kv_heads per tensor (-1: read from the shape)
 *   write(path, header, keys, values, keys_dtype="float32")   a kvf file (tests, benchmarks)
 *   document_digest(ids) -> str                kvf_document_digest of a list of token ids
 *   WITH_CUDA                                  False: this build copies into host tensors only
 *
 * Failures raise kvfold._kvfold.KvfError (a RuntimeError) whose message names the file and the
 * cause, with .status set to the kf_status name ("bad format", "mismatch", ...). Long reads and
 * copies release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "connector/ext/blockcopy.h"
#include "formats/kvf.h"

static PyObject *KvfError;

static PyObject *raise_kf(const kf_error *err, kf_status st) {
    PyObject *msg = PyUnicode_FromString(err->msg[0] ? err->msg : kf_status_name(st));
    if (!msg)
        return NULL;
    PyObject *exc = PyObject_CallOneArg(KvfError, msg);
    Py_DECREF(msg);
    if (!exc)
        return NULL;
    PyObject *name = PyUnicode_FromString(kf_status_name(st));
    if (name) {
        PyObject_SetAttrString(exc, "status", name);
        Py_DECREF(name);
    }
    PyErr_SetObject(KvfError, exc);
    Py_DECREF(exc);
    return NULL;
}

static int parse_dtype(const char *s, kvf_dtype *out) {
    if (kvf_dtype_parse(s, out) == 0)
        return 0;
    if (!strncmp(s, "float8", 6) || !strncmp(s, "fp8", 3))
        PyErr_Format(PyExc_ValueError, "dtype %s: fp8 KV caches are not supported (use bfloat16 or float16)", s);
    else
        PyErr_Format(PyExc_ValueError, "dtype %s is not supported (bfloat16, float16 or float32)", s);
    return -1;
}

static PyObject *header_dict(const kvf_header *h) {
    return Py_BuildValue(
        "{s:i,s:s,s:s,s:s,s:s,s:s,s:s,s:L,s:L,s:s,s:d,s:d,s:s,s:s,s:s,s:i,s:i,s:i,s:i}", "version", h->version,
        "creator", h->creator, "model_fingerprint", h->model_fingerprint, "tokenizer_digest", h->tokenizer_digest,
        "document_digest", h->document_digest, "recipe_digest", h->recipe_digest, "payload_digest",
        h->payload_digest, "n_doc_tokens", (long long)h->n_doc_tokens, "n_tokens",
        (long long)h->n_tokens, "method", kvf_method_name(h->method), "budget", h->budget, "lambda", h->lambda,
        "rope_frame", kvf_rope_frame_name(h->rope_frame), "placeholder", h->placeholder, "dtype",
        kvf_dtype_name(h->dtype), "n_layers", h->n_layers, "kv_heads", h->kv_heads, "head_dim", h->head_dim,
        "block_size", h->block_size);
}

static PyObject *py_read_header(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    kvf_file *f = NULL;
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvf_open(path, &f, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK)
        return raise_kf(&err, st);
    PyObject *d = header_dict(kvf_file_header(f));
    kvf_close(f);
    return d;
}

/* Reads every layer raw (each checked against its layer digest) and converts into out
 * ([2, L, C, H, D] in dtype). */
static kf_status load_all(kvf_file *f, kvf_dtype dtype, unsigned char *out, kf_error *err) {
    const kvf_header *h = kvf_file_header(f);
    const size_t n = (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim; /* per layer */
    const size_t fs = kvf_dtype_size(h->dtype), ds = kvf_dtype_size(dtype);
    unsigned char *scratch = NULL; /* [2, C, H, D] in the file's dtype */
    if (h->dtype != dtype && !(scratch = malloc(2 * n * fs)))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a layer", kvf_file_path(f));
    kf_status st = KF_OK;
    for (int l = 0; l < h->n_layers && st == KF_OK; l++) {
        unsigned char *dst[2] = {out + (size_t)l * n * ds, out + ((size_t)h->n_layers + (size_t)l) * n * ds};
        st = kvf_read_layer_all(f, l, scratch ? scratch : dst[0], scratch ? scratch + n * fs : dst[1], NULL, NULL,
                                NULL, NULL, err);
        for (int kv = 0; kv < 2 && st == KF_OK && scratch; kv++) {
            const unsigned char *src = scratch + (size_t)kv * n * fs;
            uint16_t *o16 = (uint16_t *)dst[kv];
            for (size_t i = 0; i < n; i++) {
                float x;
                if (h->dtype == KVF_F32) {
                    memcpy(&x, src + 4 * i, 4);
                } else {
                    uint16_t b;
                    memcpy(&b, src + 2 * i, 2);
                    x = h->dtype == KVF_BF16 ? kvf_bf16_to_f32(b) : kvf_f16_to_f32(b);
                }
                if (dtype == KVF_F32)
                    memcpy(dst[kv] + 4 * i, &x, 4);
                else
                    o16[i] = dtype == KVF_BF16 ? kvf_f32_to_bf16(x) : kvf_f32_to_f16(x);
            }
        }
    }
    free(scratch);
    return st;
}

static PyObject *py_load(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "dtype", "model_fingerprint", "n_layers", "kv_heads", "head_dim", NULL};
    const char *path, *dtname, *fp = NULL;
    int n_layers = -1, kv_heads = -1, head_dim = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|ziii", kwlist, &path, &dtname, &fp, &n_layers, &kv_heads,
                                     &head_dim))
        return NULL;
    kvf_dtype dtype;
    if (parse_dtype(dtname, &dtype) < 0)
        return NULL;
    kvf_file *f = NULL;
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvf_open(path, &f, &err);
    if (st == KF_OK)
        st = kvf_check_model(f, fp, n_layers, kv_heads, head_dim, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        kvf_close(f);
        return raise_kf(&err, st);
    }
    const kvf_header *h = kvf_file_header(f);
    const size_t bytes = 2 * (size_t)h->n_layers * (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim *
                         kvf_dtype_size(dtype);
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)bytes);
    if (!buf) {
        kvf_close(f);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyByteArray_AS_STRING(buf);
    Py_BEGIN_ALLOW_THREADS
    st = load_all(f, dtype, out, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        Py_DECREF(buf);
        kvf_close(f);
        return raise_kf(&err, st);
    }
    PyObject *hd = header_dict(h);
    kvf_close(f);
    if (!hd) {
        Py_DECREF(buf);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, hd, buf);
    Py_DECREF(hd);
    Py_DECREF(buf);
    return res;
}

static int int64_seq(PyObject *o, int64_t *out, int n, const char *what) {
    PyObject *s = PySequence_Fast(o, what);
    if (!s)
        return -1;
    if (PySequence_Fast_GET_SIZE(s) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d entries", what, n);
        Py_DECREF(s);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(s, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(s);
            return -1;
        }
    }
    Py_DECREF(s);
    return 0;
}

static PyObject *py_copy_blocks(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"src",   "src_dtype",  "n_layers",   "C",  "src_heads", "head_dim", "dst", "dst_dtype",
                             "layout", "block_ids", "block_size", "t0", "t1",        "head_start", "kv_heads", NULL};
    Py_buffer src = {0};
    const char *sdt, *ddt, *lay;
    int n_layers, src_heads, head_dim, block_size, head_start = 0, kv_heads = -1;
    long long C, t0, t1;
    PyObject *dst, *ids;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*siLiiOssOiLL|ii", kwlist, &src, &sdt, &n_layers, &C, &src_heads,
                                     &head_dim, &dst, &ddt, &lay, &ids, &block_size, &t0, &t1, &head_start,
                                     &kv_heads))
        return NULL;
    PyObject *res = NULL, *dseq = NULL, *iseq = NULL;
    kvb_tensor *tensors = NULL;
    int32_t *block_ids = NULL;
    kvb_copy_args a = {.src = src.buf, .n_layers = n_layers, .C = C, .src_heads = src_heads,
                       .head_dim = head_dim, .head_start = head_start, .block_size = block_size, .t0 = t0, .t1 = t1};
    if (parse_dtype(sdt, &a.src_dtype) < 0 || parse_dtype(ddt, &a.dst_dtype) < 0)
        goto out;
    if (kvb_layout_parse(lay, &a.layout) < 0) {
        PyErr_Format(PyExc_ValueError, "KV cache layout '%s' is not supported (flash_attn, flashinfer, triton, cpu)",
                     lay);
        goto out;
    }
    if (n_layers < 1 || C < 1 || src_heads < 1 || head_dim < 1 ||
        (size_t)src.len < 2 * (size_t)n_layers * (size_t)C * (size_t)src_heads * (size_t)head_dim *
                              kvf_dtype_size(a.src_dtype)) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks: the source buffer is smaller than its shape");
        goto out;
    }
    if (!(dseq = PySequence_Fast(dst, "dst must be a sequence of (data_ptr, shape, strides)")))
        goto out;
    if (PySequence_Fast_GET_SIZE(dseq) != n_layers) {
        PyErr_Format(PyExc_ValueError, "copy_blocks: %zd destination tensors for %d layers",
                     PySequence_Fast_GET_SIZE(dseq), n_layers);
        goto out;
    }
    if (!(tensors = calloc((size_t)n_layers, sizeof *tensors))) {
        PyErr_NoMemory();
        goto out;
    }
    for (int l = 0; l < n_layers; l++) {
        PyObject *ptr, *shape, *strides;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(dseq, l), "OOO", &ptr, &shape, &strides))
            goto out;
        tensors[l].data = PyLong_AsVoidPtr(ptr);
        if (PyErr_Occurred() || int64_seq(shape, tensors[l].shape, 5, "shape") < 0 ||
            int64_seq(strides, tensors[l].stride, 5, "strides") < 0)
            goto out;
    }
    if (!(iseq = PySequence_Fast(ids, "block_ids must be a sequence of ints")))
        goto out;
    a.n_block_ids = PySequence_Fast_GET_SIZE(iseq);
    if (!(block_ids = malloc(sizeof(int32_t) * (size_t)(a.n_block_ids + 1)))) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < a.n_block_ids; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(iseq, i));
        if (v == -1 && PyErr_Occurred())
            goto out;
        if (v < 0 || v > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "block id %ld out of range", v);
            goto out;
        }
        block_ids[i] = (int32_t)v;
    }
    a.dst = tensors;
    a.block_ids = block_ids;
    a.kv_heads = kv_heads > 0 ? kv_heads : (int)tensors[0].shape[a.layout == KVB_CPU ? 2 : 3];
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvb_copy(&a, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        raise_kf(&err, st);
        goto out;
    }
    res = Py_NewRef(Py_None);
out:
    free(tensors);
    free(block_ids);
    Py_XDECREF(dseq);
    Py_XDECREF(iseq);
    PyBuffer_Release(&src);
    return res;
}

/* Header fields from a dict (missing ones keep kvf_header_init's defaults). */
static int header_from_dict(PyObject *d, kvf_header *h) {
    kvf_header_init(h);
    struct {
        const char *key;
        char *dst;
        size_t n;
    } strs[] = {{"model_fingerprint", h->model_fingerprint, sizeof h->model_fingerprint},
                {"tokenizer_digest", h->tokenizer_digest, sizeof h->tokenizer_digest},
                {"document_digest", h->document_digest, sizeof h->document_digest},
                {"recipe_digest", h->recipe_digest, sizeof h->recipe_digest},
                {"placeholder", h->placeholder, sizeof h->placeholder}};
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        PyObject *v = PyDict_GetItemString(d, strs[i].key);
        if (!v)
            continue;
        const char *s = PyUnicode_AsUTF8(v);
        if (!s)
            return -1;
        snprintf(strs[i].dst, strs[i].n, "%s", s);
    }
    static const char *const ikeys[5] = {"n_doc_tokens", "n_tokens", "n_layers", "kv_heads", "head_dim"};
    long long iv[5] = {h->n_doc_tokens, h->n_tokens, h->n_layers, h->kv_heads, h->head_dim};
    for (int i = 0; i < 5; i++) {
        PyObject *v = PyDict_GetItemString(d, ikeys[i]);
        if (v && ((iv[i] = PyLong_AsLongLong(v)) == -1 && PyErr_Occurred()))
            return -1;
    }
    h->n_doc_tokens = iv[0];
    h->n_tokens = iv[1];
    h->n_layers = (int)iv[2];
    h->kv_heads = (int)iv[3];
    h->head_dim = (int)iv[4];
    PyObject *v;
    if ((v = PyDict_GetItemString(d, "budget")) && ((h->budget = PyFloat_AsDouble(v)) == -1.0 && PyErr_Occurred()))
        return -1;
    if ((v = PyDict_GetItemString(d, "lambda")) && ((h->lambda = PyFloat_AsDouble(v)) == -1.0 && PyErr_Occurred()))
        return -1;
    if ((v = PyDict_GetItemString(d, "method"))) {
        const char *s = PyUnicode_AsUTF8(v);
        if (!s)
            return -1;
        if (kvf_method_parse(s, &h->method) < 0) {
            PyErr_Format(PyExc_ValueError, "unknown method '%s'", s);
            return -1;
        }
    }
    if ((v = PyDict_GetItemString(d, "dtype"))) {
        const char *s = PyUnicode_AsUTF8(v);
        if (!s || parse_dtype(s, &h->dtype) < 0)
            return -1;
    }
    if ((v = PyDict_GetItemString(d, "rope_frame"))) {
        const char *s = PyUnicode_AsUTF8(v);
        if (!s)
            return -1;
        h->rope_frame = !strcmp(s, "original") ? KVF_FRAME_ORIGINAL : KVF_FRAME_COMPACTED;
    }
    return 0;
}

static PyObject *py_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "header", "keys", "values", "keys_dtype", NULL};
    const char *path, *kdt = "float32";
    PyObject *hd;
    Py_buffer k = {0}, v = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO!y*y*|s", kwlist, &path, &PyDict_Type, &hd, &k, &v, &kdt))
        return NULL;
    PyObject *res = NULL;
    kvf_cache c = {0};
    kvf_dtype kd;
    if (header_from_dict(hd, &c.hdr) < 0 || parse_dtype(kdt, &kd) < 0)
        goto out;
    if (kd != KVF_F32 && kd != c.hdr.dtype) {
        PyErr_Format(PyExc_ValueError, "write: keys in %s must be float32 or the header's dtype %s", kdt,
                     kvf_dtype_name(c.hdr.dtype));
        goto out;
    }
    const size_t n = (size_t)c.hdr.n_layers * (size_t)c.hdr.n_tokens * (size_t)c.hdr.kv_heads * (size_t)c.hdr.head_dim;
    if (c.hdr.n_layers < 1 || c.hdr.n_tokens < 1 || (size_t)k.len != n * kvf_dtype_size(kd) ||
        (size_t)v.len != n * kvf_dtype_size(kd)) {
        PyErr_Format(PyExc_ValueError, "write: keys/values hold %zd/%zd bytes, the header needs %zu", k.len, v.len,
                     n * kvf_dtype_size(kd));
        goto out;
    }
    if (kd == KVF_F32) {
        c.keys = k.buf;
        c.values = v.buf;
    } else {
        c.keys_raw = k.buf;
        c.values_raw = v.buf;
    }
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvf_write(path, &c, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        raise_kf(&err, st);
        goto out;
    }
    res = Py_NewRef(Py_None);
out:
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    return res;
}

static PyObject *py_document_digest(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *s = PySequence_Fast(arg, "ids must be a sequence of ints");
    if (!s)
        return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(s);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!ids) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long x = PyLong_AsLong(PySequence_Fast_GET_ITEM(s, i));
        if (x == -1 && PyErr_Occurred()) {
            free(ids);
            Py_DECREF(s);
            return NULL;
        }
        ids[i] = (int32_t)x;
    }
    char out[KVF_DIGEST_LEN + 1];
    kvf_document_digest(ids, n, out);
    free(ids);
    Py_DECREF(s);
    return PyUnicode_FromString(out);
}

static PyMethodDef methods[] = {
    {"read_header", py_read_header, METH_VARARGS, "read_header(path) -> dict: open and validate a kvf file"},
    {"load", (PyCFunction)(void (*)(void))py_load, METH_VARARGS | METH_KEYWORDS,
     "load(path, dtype, model_fingerprint=None, n_layers=-1, kv_heads=-1, head_dim=-1) -> (header, bytearray)"},
    {"copy_blocks", (PyCFunction)(void (*)(void))py_copy_blocks, METH_VARARGS | METH_KEYWORDS,
     "copy_blocks(src, src_dtype, n_layers, C, src_heads, head_dim, dst, dst_dtype, layout, block_ids, block_size, "
     "t0, t1, head_start=0, kv_heads=-1)"},
    {"write", (PyCFunction)(void (*)(void))py_write, METH_VARARGS | METH_KEYWORDS,
     "write(path, header, keys, values, keys_dtype='float32')"},
    {"document_digest", py_document_digest, METH_O, "document_digest(ids) -> 32 hex digits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfold._kvfold", "kvf cache files into paged KV blocks (C extension)", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvfold(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    KvfError = PyErr_NewExceptionWithDoc("kvfold._kvfold.KvfError",
                                         "A kvf file could not be read or copied; .status names the kind of failure",
                                         PyExc_RuntimeError, NULL);
    if (!KvfError || PyModule_AddObjectRef(m, "KvfError", KvfError) < 0 ||
        PyModule_AddObjectRef(m, "WITH_CUDA", Py_False) < 0 ||
        PyModule_AddStringConstant(m, "VERSION", KVFOLD_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
