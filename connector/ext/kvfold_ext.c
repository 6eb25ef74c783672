/* kvfold_ext.c — the Python module kvfold._kvfold: kvf files in, vLLM KV blocks out.
 *
 *   read_header(path) -> dict                  opens and validates a kvf file, returns its header
 *   load(path, dtype, model_fingerprint=None, n_layers=-1, kv_heads=-1, head_dim=-1, out=None, layers=(0, -1),
 *        heads=(0, -1), head_major=False)
 *       -> (header, buffer)                    every layer's K and V, checksums and head digests verified, as one
 *                                              [2, n_layers, C, kv_heads, head_dim] array in dtype:
 *                                              a new bytearray, or the first bytes of out (a writable
 *                                              buffer the caller reuses, e.g. a pre-faulted staging area);
 *                                              layers=(l0, l1) reads only those layers into their place,
 *                                              heads=(h0, h1) only those KV heads (a tensor-parallel
 *                                              rank's): only their chunks are read, the other heads'
 *                                              places are left as they were; head_major: the
 *                                              array is [2, n_layers, kv_heads, C, head_dim], as the
 *                                              file's chunks hold it (read in place, no copy)
 *   kv_bytes_read() -> int                     bytes of K/V chunks every load of this process has read
 *   copy_blocks(src, src_dtype, n_layers, C, src_heads, head_dim, dst, layout,
 *               block_ids, block_size, t0, t1, head_start=0, kv_heads=-1, cp_size=1, cp_rank=0,
 *               cp_interleave=1, src_head_major=False)
 *                                              src (a buffer as load returns) into per-layer tensors
 *                                              dst = [(buffer, offset, shape, strides, dtype, layer)]
 *                                              (blockcopy.h): each tensor's memory as a writable
 *                                              buffer (read-only ones are refused, and every element
 *                                              written is checked to lie inside it), the element
 *                                              offset of its first element, its logical shape,
 *                                              strides in elements, dtype and the source layer
 *                                              written into it; layout "kv_first",
 *                                              "blocks_first", "cpu" or "packed"; kv_heads per
 *                                              tensor (-1: read from the shape); context
 *                                              parallelism as vLLM's block table spreads tokens
 *   load_blocks(path, dtype, out, dst, layout, block_ids, block_size, t0, t1, model_fingerprint=None,
 *               n_layers=-1, kv_heads=-1, head_dim=-1, heads=(0, -1), payload_digest=None, cp_size=1,
 *               cp_rank=0, cp_interleave=1, overlap=True) -> header
 *                                              a cold load in one pass, layer by layer: the layer's
 *                                              chunks of heads [h0, h1) are read and checked (sums,
 *                                              values, digests), then copied, while still in cache,
 *                                              into tokens [t0, t1) of every destination of that
 *                                              layer (copy_blocks' dst, each holding heads [h0, h1))
 *                                              and into out ([2, n_layers, C, kv_heads, head_dim] in
 *                                              dtype, what load() gives); payload_digest: refused
 *                                              unless the file's is this one;
 *                                              overlap: a helper thread reads the next layer
 *                                              while this one is copied (False: one thread)
 *   write(path, header, keys, values, keys_dtype="float32")   a kvf file (tests, benchmarks)
 *   document_digest(ids) -> str                kvf_document_digest of a list of token ids
 *   bytes_digest(data) -> str                  XXH3-128 of bytes (a tokenizer.json's tokenizer_digest)
 *   Tokenizer(path)                            kvfold's tokenizer: .encode(text, add_special=False) -> ids,
 *                                              .decode(ids, skip_special=False) -> str (tokenizer_ext.c)
 *   WITH_CUDA                                  False: this build copies into host tensors only
 *
 * Failures raise kvfold._kvfold.KvfError (a RuntimeError) whose message names the file and the
 * cause, with .status set to the kf_status name ("bad format", "mismatch", ...). Long reads and
 * copies release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "connector/ext/blockcopy.h"
#include "connector/ext/tokenizer_ext.h"
#include "formats/kvf.h"
#include "kernels/base/convert.h"
#include "formats/kvf_internal.h" /* kvf_h5_quiet: for the read-ahead thread */

#include <xxhash.h>

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

static int parse_dtype(const char *s, kf_dtype *out) {
    if (kvf_dtype_parse(s, out) == 0)
        return 0;
    if (!strncmp(s, "float8", 6) || !strncmp(s, "fp8", 3))
        PyErr_Format(PyExc_ValueError, "dtype %s: fp8 KV caches are not supported (use bfloat16 or float16)", s);
    else
        PyErr_Format(PyExc_ValueError, "dtype %s is not supported (bfloat16, float16 or float32)", s);
    return -1;
}

static PyObject *header_dict_base(const kvf_header *h) {
    return Py_BuildValue(
        "{s:i,s:s,s:s,s:s,s:s,s:s,s:s,s:L,s:L,s:s,s:d,s:d,s:s,s:s,s:s,s:i,s:i,s:i,s:i}", "version", h->version,
        "creator", h->creator, "model_fingerprint", h->model_fingerprint, "tokenizer_digest", h->tokenizer_digest,
        "document_digest", h->document_digest, "recipe_digest", h->recipe_digest, "payload_digest",
        h->payload_digest, "n_doc_tokens", (long long)h->n_doc_tokens, "n_tokens",
        (long long)h->n_tokens, "method", kf_method_name(h->method), "budget", h->budget, "lambda", h->lambda,
        "rope_frame", kvf_rope_frame_name(h->rope_frame), "placeholder", h->placeholder, "dtype",
        kf_dtype_name(h->dtype), "n_layers", h->n_layers, "kv_heads", h->kv_heads, "head_dim", h->head_dim,
        "block_size", h->block_size);
}

/* The header with its chat record (all "" for a bare-text cache). */
static PyObject *header_dict(const kvf_header *h) {
    PyObject *d = header_dict_base(h);
    PyObject *chat = d ? Py_BuildValue("{s:s,s:s,s:s,s:s}", "chat_template_digest", h->chat_template_digest,
                                       "chat_prefix_ids", h->chat_prefix_ids, "chat_question_prefix_ids",
                                       h->chat_question_prefix_ids, "chat_question_suffix_ids",
                                       h->chat_question_suffix_ids)
                       : NULL;
    if (!chat || PyDict_Update(d, chat) < 0) {
        Py_XDECREF(chat);
        Py_XDECREF(d);
        return NULL;
    }
    Py_DECREF(chat);
    return d;
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
    if (st == KF_OK) /* a file under another's content-addressed name is never served */
        st = kvf_check_name(path, kvf_file_header(f), &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        kvf_close(f);
        return raise_kf(&err, st);
    }
    PyObject *d = header_dict(kvf_file_header(f));
    kvf_close(f);
    return d;
}

/* Elements [i0, i1) from src in the file's dtype to dst in dtype. */
static void convert_run(const kvf_header *h, kf_dtype dtype, const unsigned char *src, unsigned char *dst, size_t i0,
                        size_t i1) {
    const size_t ds = kf_dtype_size(dtype);
    for (size_t i = i0; i < i1; i++) {
            float x;
            if (h->dtype == KF_DTYPE_F32) {
                memcpy(&x, src + 4 * i, 4);
            } else {
                uint16_t b;
                memcpy(&b, src + 2 * i, 2);
                x = h->dtype == KF_DTYPE_BF16 ? kf_bf16_to_f32(b) : kf_f16_to_f32(b);
            }
            if (dtype == KF_DTYPE_F32) {
                memcpy(dst + 4 * i, &x, 4);
            } else {
                uint16_t o = dtype == KF_DTYPE_BF16 ? kf_f32_to_bf16(x) : kf_f32_to_f16(x);
                memcpy(dst + ds * i, &o, 2);
            }
    }
}

/* Heads [h0, h1) of a layer side ([C, H, D], or [H, C, D] when head_major) from src in the file's
 * dtype to dst in dtype. */
static void convert_heads(const kvf_header *h, kf_dtype dtype, const unsigned char *src, unsigned char *dst, int h0,
                          int h1, bool head_major) {
    const size_t H = (size_t)h->kv_heads, D = (size_t)h->head_dim, C = (size_t)h->n_tokens;
    if (head_major) {
        convert_run(h, dtype, src, dst, (size_t)h0 * C * D, (size_t)h1 * C * D);
        return;
    }
    for (size_t t = 0; t < C; t++)
        convert_run(h, dtype, src, dst, (t * H + (size_t)h0) * D, (t * H + (size_t)h1) * D);
}

static int64_t g_kv_bytes_read; /* every load's K/V chunk bytes (atomic: loads run without the GIL) */

/* Reads heads [h0, h1) of layers [l0, l1) raw (each head checked against its digest) and converts
 * into out ([2, L, C, H, D] in dtype). */
static kf_status load_all(kvf_file *f, kf_dtype dtype, unsigned char *out, int l0, int l1, int h0, int h1,
                          bool head_major, kf_error *err) {
    const kvf_header *h = kvf_file_header(f);
    const size_t n = (size_t)h->n_tokens * (size_t)h->kv_heads * (size_t)h->head_dim; /* per layer */
    const size_t fs = kf_dtype_size(h->dtype), ds = kf_dtype_size(dtype);
    const int64_t read_before = kvf_kv_bytes_read(f);
    unsigned char *scratch = NULL; /* [2, C, H, D] in the file's dtype */
    if (h->dtype != dtype && !(scratch = malloc(2 * n * fs)))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for a layer", kvf_file_path(f));
    kf_status st = KF_OK;
    for (int l = l0; l < l1 && st == KF_OK; l++) {
        unsigned char *dst[2] = {out + (size_t)l * n * ds, out + ((size_t)h->n_layers + (size_t)l) * n * ds};
        unsigned char *k = scratch ? scratch : dst[0], *v = scratch ? scratch + n * fs : dst[1];
        st = head_major ? kvf_read_heads_hm(f, l, h0, h1, k, v, err) : kvf_read_heads_raw(f, l, h0, h1, k, v, err);
        for (int kv = 0; kv < 2 && st == KF_OK && scratch; kv++)
            convert_heads(h, dtype, scratch + (size_t)kv * n * fs, dst[kv], h0, h1, head_major);
    }
    free(scratch);
    __atomic_fetch_add(&g_kv_bytes_read, kvf_kv_bytes_read(f) - read_before, __ATOMIC_RELAXED);
    return st;
}

static PyObject *py_kv_bytes_read(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLongLong((long long)__atomic_load_n(&g_kv_bytes_read, __ATOMIC_RELAXED));
}

/* 2 * n_layers * C * kv_heads * head_dim elements of dtype, without overflow. */
static int payload_size(const kvf_header *h, kf_dtype dtype, size_t *out) {
    const int64_t f[6] = {2, h->n_layers, h->n_tokens, h->kv_heads, h->head_dim, (int64_t)kf_dtype_size(dtype)};
    int64_t p = 1;
    for (int i = 0; i < 6; i++)
        if (f[i] < 1 || __builtin_mul_overflow(p, f[i], &p) || p > PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "a cache of %d layers x %lld tokens x %d heads x %d is too large",
                         h->n_layers, (long long)h->n_tokens, h->kv_heads, h->head_dim);
            return -1;
        }
    *out = (size_t)p;
    return 0;
}

/* load's span [*lo, *hi) of the file's n layers or heads (*hi < 0: up to n): non-empty and inside
 * [0, n), else -1 with a ValueError naming the file. */
static int load_span(const char *what, int *lo, int *hi, int n, const char *unit, const char *path) {
    if (*hi < 0)
        *hi = n;
    if (*lo < 0 || *lo >= *hi || *hi > n) {
        PyErr_Format(PyExc_ValueError, "load: %s [%d, %d) outside %s's %d%s", what, *lo, *hi, path, n, unit);
        return -1;
    }
    return 0;
}

static PyObject *py_load(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "dtype", "model_fingerprint", "n_layers", "kv_heads", "head_dim", "out", "layers",
                             "heads", "head_major", NULL};
    const char *path, *dtname, *fp = NULL;
    int n_layers = -1, kv_heads = -1, head_dim = -1, l0 = 0, l1 = -1, h0 = 0, h1 = -1, head_major = 0;
    PyObject *out_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|ziiiO(ii)(ii)p", kwlist, &path, &dtname, &fp, &n_layers, &kv_heads,
                                     &head_dim, &out_obj, &l0, &l1, &h0, &h1, &head_major))
        return NULL;
    kf_dtype dtype;
    if (parse_dtype(dtname, &dtype) < 0)
        return NULL;
    kvf_file *f = NULL;
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvf_open(path, &f, &err);
    if (st == KF_OK)
        st = kvf_check_name(path, kvf_file_header(f), &err);
    if (st == KF_OK)
        st = kvf_check_model(f, fp, n_layers, kv_heads, head_dim, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        kvf_close(f);
        return raise_kf(&err, st);
    }
    const kvf_header *h = kvf_file_header(f);
    size_t bytes;
    if (load_span("layers", &l0, &l1, h->n_layers, "", path) < 0 ||
        load_span("heads", &h0, &h1, h->kv_heads, " kv heads", path) < 0 || payload_size(h, dtype, &bytes) < 0) {
        kvf_close(f);
        return NULL;
    }
    PyObject *buf;
    Py_buffer ov = {0};
    if (out_obj && out_obj != Py_None) {
        if (PyObject_GetBuffer(out_obj, &ov, PyBUF_WRITABLE) < 0 || (size_t)ov.len < bytes) {
            if (ov.obj) {
                PyErr_Format(PyExc_ValueError, "load: %s needs %zu bytes, out holds %zd", path, bytes, ov.len);
                PyBuffer_Release(&ov);
            }
            kvf_close(f);
            return NULL;
        }
        buf = Py_NewRef(out_obj);
    } else if (!(buf = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)bytes))) {
        kvf_close(f);
        return NULL;
    }
    unsigned char *out = ov.obj ? (unsigned char *)ov.buf : (unsigned char *)PyByteArray_AS_STRING(buf);
    Py_BEGIN_ALLOW_THREADS
    st = load_all(f, dtype, out, l0, l1, h0, h1, head_major != 0, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ov); /* buf keeps out_obj alive */
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

/* One destination of copy_blocks: (buffer, offset, shape, strides, dtype, layer), the buffer writable. */
static int parse_dst(PyObject *item, int i, kvb_tensor *t, Py_buffer *view) {
    PyObject *buf, *shape, *strides;
    long long offset;
    const char *dt;
    if (!PyArg_ParseTuple(item, "OLOOsi", &buf, &offset, &shape, &strides, &dt, &t->layer))
        return -1;
    if (parse_dtype(dt, &t->dtype) < 0)
        return -1;
    Py_ssize_t nd = PySequence_Size(shape);
    if (nd < 0)
        return -1;
    if (nd != 4 && nd != 5) {
        PyErr_Format(PyExc_ValueError, "copy_blocks: a %zd-D destination (4 or 5 dimensions)", nd);
        return -1;
    }
    t->ndim = (int)nd;
    if (int64_seq(shape, t->shape, t->ndim, "shape") < 0 || int64_seq(strides, t->stride, t->ndim, "strides") < 0)
        return -1;
    if (PyObject_GetBuffer(buf, view, PyBUF_WRITABLE) < 0) { /* refuses read-only memory */
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "copy_blocks: destination %d is not writable memory (%s)", i,
                     Py_TYPE(buf)->tp_name);
        return -1;
    }
    t->base = view->buf;
    t->nbytes = view->len;
    t->offset = offset;
    return 0;
}

/* The destinations of copy_blocks and load_blocks: each tensor's memory held as a buffer, and the
 * request's block ids. */
typedef struct {
    PyObject *dseq, *iseq;
    kvb_tensor *tensors; /* [n_dst] */
    Py_buffer *views;    /* [n_views]: the buffers held so far */
    int n_dst, n_views;
    int32_t *block_ids;  /* [n_block_ids] */
    Py_ssize_t n_block_ids;
} targets;

static void targets_free(targets *t) {
    for (int i = 0; i < t->n_views; i++)
        PyBuffer_Release(&t->views[i]);
    free(t->views);
    free(t->tensors);
    free(t->block_ids);
    Py_XDECREF(t->dseq);
    Py_XDECREF(t->iseq);
    memset(t, 0, sizeof *t);
}

/* dst: [(buffer, offset, shape, strides, dtype, layer)], ids: block ids; -1 with an exception
 * (targets_free frees what was taken either way). */
static int targets_parse(PyObject *dst, PyObject *ids, targets *t) {
    memset(t, 0, sizeof *t);
    if (!(t->dseq = PySequence_Fast(dst, "dst must be a sequence of (buffer, offset, shape, strides, dtype, layer)")))
        return -1;
    const Py_ssize_t n_dst = PySequence_Fast_GET_SIZE(t->dseq);
    if (n_dst < 1 || n_dst > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "copy_blocks: %zd destination tensors", n_dst);
        return -1;
    }
    t->tensors = calloc((size_t)n_dst, sizeof *t->tensors);
    t->views = calloc((size_t)n_dst, sizeof *t->views);
    if (!t->tensors || !t->views) {
        PyErr_NoMemory();
        return -1;
    }
    t->n_dst = (int)n_dst;
    for (; t->n_views < n_dst; t->n_views++)
        if (parse_dst(PySequence_Fast_GET_ITEM(t->dseq, t->n_views), t->n_views, &t->tensors[t->n_views],
                      &t->views[t->n_views]) < 0)
            return -1;
    if (!(t->iseq = PySequence_Fast(ids, "block_ids must be a sequence of ints")))
        return -1;
    t->n_block_ids = PySequence_Fast_GET_SIZE(t->iseq);
    if (!(t->block_ids = malloc(sizeof(int32_t) * (size_t)(t->n_block_ids + 1)))) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < t->n_block_ids; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(t->iseq, i));
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < 0 || v > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "block id %lld out of range", v);
            return -1;
        }
        t->block_ids[i] = (int32_t)v;
    }
    return 0;
}

static int parse_layout(const char *lay, kvb_layout *out) {
    if (kvb_layout_parse(lay, out) == 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "KV cache layout '%s' is not supported (kv_first, blocks_first, cpu, packed)", lay);
    return -1;
}

/* The dimension of kv heads in each layout's logical shape. */
static const int kHeadDim[4] = {[KVB_KV_FIRST] = 3, [KVB_BLOCKS_FIRST] = 3, [KVB_CPU] = 2, [KVB_PACKED] = 1};

static PyObject *py_copy_blocks(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"src",   "src_dtype", "n_layers",   "C",  "src_heads", "head_dim",   "dst",
                             "layout", "block_ids", "block_size", "t0", "t1",        "head_start", "kv_heads", "cp_size",
                             "cp_rank", "cp_interleave", "src_head_major", NULL};
    Py_buffer src = {0};
    const char *sdt, *lay;
    int n_layers, block_size, cp_size = 1, cp_rank = 0, cp_interleave = 1, src_head_major = 0;
    long long C, src_heads, head_dim, t0, t1, head_start = 0, kv_heads = -1;
    PyObject *dst, *ids;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*siLLLOsOiLL|LLiiip", kwlist, &src, &sdt, &n_layers, &C, &src_heads,
                                     &head_dim, &dst, &lay, &ids, &block_size, &t0, &t1, &head_start, &kv_heads,
                                     &cp_size, &cp_rank, &cp_interleave, &src_head_major))
        return NULL;
    PyObject *res = NULL;
    targets tg = {0};
    kvb_copy_args a = {.src = src.buf, .src_bytes = src.len, .n_layers = n_layers, .C = C, .src_heads = src_heads,
                       .head_dim = head_dim, .head_start = head_start, .block_size = block_size, .t0 = t0, .t1 = t1,
                       .cp_size = cp_size, .cp_rank = cp_rank, .cp_interleave = cp_interleave,
                       .src_head_major = src_head_major != 0};
    if (parse_dtype(sdt, &a.src_dtype) < 0 || parse_layout(lay, &a.layout) < 0 || targets_parse(dst, ids, &tg) < 0)
        goto out;
    a.dst = tg.tensors;
    a.n_dst = tg.n_dst;
    a.block_ids = tg.block_ids;
    a.n_block_ids = tg.n_block_ids;
    a.kv_heads = kv_heads > 0 ? kv_heads : tg.tensors[0].shape[kHeadDim[a.layout]];
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
    targets_free(&tg);
    PyBuffer_Release(&src);
    return res;
}

/* n bytes to dst past the cache where it is aligned (dst is the pool's copy: not read again soon). */
static void stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
#if defined(__SSE2__)
    if ((uintptr_t)dst % 16 == 0 && n % 16 == 0) {
        for (size_t i = 0; i < n; i += 16)
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Heads [h0, h1) of one layer side, head-major in the file's dtype (src: [kv_heads, C, head_dim]),
 * into token-major dst ([C, kv_heads, head_dim] in dtype), slot by slot. */
static void heads_to_tokens(const kvf_header *h, kf_dtype dtype, const unsigned char *src, unsigned char *dst, int h0,
                            int h1) {
    const size_t C = (size_t)h->n_tokens, H = (size_t)h->kv_heads, D = (size_t)h->head_dim;
    const size_t fs = kf_dtype_size(h->dtype), ds = kf_dtype_size(dtype);
    for (size_t t = 0; t < C; t++)
        for (size_t hd = (size_t)h0; hd < (size_t)h1; hd++) {
            const unsigned char *s = src + (hd * C + t) * D * fs;
            unsigned char *o = dst + (t * H + hd) * D * ds;
            if (h->dtype == dtype)
                stream_copy(o, s, D * fs);
            else
                convert_run(h, dtype, s, o, 0, D);
        }
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* A cold load in one pass, layer by layer: heads [h0, h1) of a layer are read head-major into a
 * scratch of one layer and checked there (sums, values, head digests), then, while the layer is in
 * cache, copied into the blocks of the layer's tensors and into out ([2, n_layers, C, kv_heads,
 * head_dim] in dtype, token-major: what load() gives, which the retention pool keeps). */
typedef struct {
    const kvf_header *h;
    kf_dtype dtype;        /* of out */
    unsigned char *out;
    int h0, h1;
    unsigned char *scratch; /* [2, kv_heads, C, head_dim] in the file's dtype: one layer, head-major */
    unsigned char *scratch2; /* the same, for the layer read ahead; NULL: no overlap */
    const targets *tg;
    kvb_copy_args a;        /* the copy of one tensor from the scratch */
} one_pass;

/* The one-pass scratches, kept between loads so that a load writes into pages already mapped
 * (a fresh malloc of this size is a fresh mmap: every page faulted in again). One set is kept;
 * a load that finds it taken, or too small, allocates its own. */
static pthread_mutex_t g_scratch_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *g_scratch;
static size_t g_scratch_bytes;

static unsigned char *scratch_take(size_t n) {
    unsigned char *s = NULL;
    pthread_mutex_lock(&g_scratch_lock);
    if (g_scratch && g_scratch_bytes >= n) {
        s = g_scratch;
        g_scratch = NULL;
    }
    pthread_mutex_unlock(&g_scratch_lock);
    return s ? s : malloc(n);
}

static void scratch_give(unsigned char *s, size_t n) {
    if (!s)
        return;
    pthread_mutex_lock(&g_scratch_lock);
    if (!g_scratch && n <= ((size_t)1 << 30)) { /* keep it (up to 1 GiB) */
        g_scratch = s;
        g_scratch_bytes = n;
        s = NULL;
    }
    pthread_mutex_unlock(&g_scratch_lock);
    free(s);
}

/* Reads and checks heads [h0, h1) of layer l into scratch ([2, kv_heads, C, head_dim], head-major). */
static kf_status read_layer(kvf_file *f, const one_pass *p, int l, unsigned char *scratch, kf_error *err) {
    const size_t side = (size_t)p->h->kv_heads * (size_t)p->h->n_tokens * (size_t)p->h->head_dim; /* elements */
    return kvf_read_heads_hm(f, l, p->h0, p->h1, scratch, scratch + side * kf_dtype_size(p->h->dtype), err);
}

/* Layer l, read into scratch, into the blocks of its tensors and into out, while in cache. */
static kf_status copy_layer_out(const one_pass *p, int l, const unsigned char *scratch, kf_error *err) {
    const kvf_header *h = p->h;
    const size_t side = (size_t)h->kv_heads * (size_t)h->n_tokens * (size_t)h->head_dim; /* elements */
    const unsigned char *k = scratch, *v = scratch + side * kf_dtype_size(h->dtype);
    for (int i = 0; i < p->tg->n_dst; i++)
        if (p->tg->tensors[i].layer == l) {
            kvb_tensor t = p->tg->tensors[i];
            t.layer = 0; /* the scratch holds one layer */
            kvb_copy_args a = p->a;
            a.src = scratch;
            a.dst = &t;
            a.n_dst = 1;
            KF_TRY(kvb_copy(&a, err));
        }
    const size_t ds = kf_dtype_size(p->dtype);
    heads_to_tokens(h, p->dtype, k, p->out + (size_t)l * side * ds, p->h0, p->h1);
    heads_to_tokens(h, p->dtype, v, p->out + ((size_t)h->n_layers + (size_t)l) * side * ds, p->h0, p->h1);
    return KF_OK;
}

/* The next layer's read, on its own thread while the caller copies the current one. */
typedef struct {
    kvf_file *f;
    const one_pass *p;
    int l;
    unsigned char *scratch;
    kf_status st;
    kf_error err;
} layer_read;

static void *read_layer_thread(void *arg) {
    layer_read *r = arg;
    kvf_h5_quiet(); /* HDF5's error printing is per thread */
    r->st = read_layer(r->f, r->p, r->l, r->scratch, &r->err);
    return NULL;
}

/* Layer by layer; with two scratches (p->scratch2) layer l + 1 is read by a helper thread while
 * layer l is copied (the file is only ever touched by one thread at a time). */
static kf_status load_one_pass(kvf_file *f, one_pass *p, kf_error *err) {
    const int L = p->h->n_layers;
    unsigned char *s[2] = {p->scratch, p->scratch2 ? p->scratch2 : p->scratch};
    kf_status st = read_layer(f, p, 0, s[0], err);
    for (int l = 0; l < L && st == KF_OK; l++) {
        layer_read r = {.f = f, .p = p, .l = l + 1, .scratch = s[(l + 1) % 2], .st = KF_OK};
        pthread_t th;
        const bool ahead = l + 1 < L && p->scratch2 && pthread_create(&th, NULL, read_layer_thread, &r) == 0;
        st = copy_layer_out(p, l, s[l % 2], err);
        if (ahead)
            pthread_join(th, NULL);
        else if (st == KF_OK && l + 1 < L)
            r.st = read_layer(f, p, l + 1, s[(l + 1) % 2], &r.err); /* serial (or no thread to be had) */
        if (st == KF_OK && r.st != KF_OK) {
            if (err)
                *err = r.err;
            st = r.st;
        }
    }
    __atomic_fetch_add(&g_kv_bytes_read, kvf_kv_bytes_read(f), __ATOMIC_RELAXED);
    return st;
}

/* Each destination holds exactly heads [h0, h1) of its layer. */
static int check_head_counts(const targets *tg, kvb_layout layout, int h0, int h1, int n_layers) {
    for (int i = 0; i < tg->n_dst; i++) {
        const kvb_tensor *t = &tg->tensors[i];
        if (t->ndim != (layout == KVB_PACKED ? 4 : 5) || t->shape[kHeadDim[layout]] != h1 - h0 || t->layer < 0 ||
            t->layer >= n_layers) {
            PyErr_Format(PyExc_ValueError, "load_blocks: destination %d (layer %d) is not a %s cache of %d kv heads of "
                         "the file's %d layers", i, t->layer, kvb_layout_name(layout), h1 - h0, n_layers);
            return -1;
        }
    }
    return 0;
}

/* kvf_open, then the model's shape and fingerprint and, when given, the payload digest the request
 * was scheduled with; without the GIL. */
static kf_status open_checked(const char *path, const char *fp, int n_layers, int kv_heads, int head_dim,
                              const char *payload, kvf_file **f, kf_error *err) {
    KF_TRY(kvf_open(path, f, err));
    KF_TRY(kvf_check_model(*f, fp, n_layers, kv_heads, head_dim, err));
    if (payload && strcmp(kvf_file_header(*f)->payload_digest, payload) != 0)
        return kf_fail(err, KF_ERR_MISMATCH, "%s: changed since the request was scheduled (payload %s, expected %s)",
                       path, kvf_file_header(*f)->payload_digest, payload);
    return KF_OK;
}

/* The copy's shape for one layer at a time: heads [h0, h1) of the file's p->h into tg's blocks;
 * side: one layer's keys (or values) in elements. */
static void one_pass_shape(one_pass *p, void *out, const targets *tg, int h0, int h1, size_t side) {
    p->out = out;
    p->h0 = h0;
    p->h1 = h1;
    p->tg = tg;
    p->a.src_bytes = (int64_t)(2 * side * kf_dtype_size(p->h->dtype));
    p->a.src_dtype = p->h->dtype;
    p->a.n_layers = 1;
    p->a.C = p->h->n_tokens;
    p->a.src_heads = p->h->kv_heads;
    p->a.head_dim = p->h->head_dim;
    p->a.head_start = h0;
    p->a.kv_heads = h1 - h0;
    p->a.block_ids = tg->block_ids;
    p->a.n_block_ids = tg->n_block_ids;
}

static PyObject *py_load_blocks(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "dtype", "out", "dst", "layout", "block_ids", "block_size", "t0", "t1",
                             "model_fingerprint", "n_layers", "kv_heads", "head_dim", "heads", "payload_digest",
                             "cp_size", "cp_rank", "cp_interleave", "overlap", NULL};
    const char *path, *dtname, *lay, *fp = NULL, *payload = NULL;
    PyObject *out_obj, *dst, *ids;
    int block_size, n_layers = -1, kv_heads = -1, head_dim = -1, h0 = 0, h1 = -1;
    int cp_size = 1, cp_rank = 0, cp_inter = 1, overlap = 1;
    long long t0, t1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ssOOsOiLL|ziii(ii)ziiip", kwlist, &path, &dtname, &out_obj, &dst, &lay,
                                     &ids, &block_size, &t0, &t1, &fp, &n_layers, &kv_heads, &head_dim, &h0, &h1,
                                     &payload, &cp_size, &cp_rank, &cp_inter, &overlap))
        return NULL;
    one_pass p = {.a = {.src_head_major = true, .block_size = block_size, .t0 = t0, .t1 = t1, .cp_size = cp_size,
                        .cp_rank = cp_rank, .cp_interleave = cp_inter}};
    targets tg = {0};
    Py_buffer ov = {0};
    kvf_file *f = NULL;
    PyObject *res = NULL;
    kf_error err = {0};
    kf_status st = KF_OK;
    size_t scratch_bytes = 0; /* one layer's; p.scratch holds two */
    if (parse_dtype(dtname, &p.dtype) < 0 || parse_layout(lay, &p.a.layout) < 0 || targets_parse(dst, ids, &tg) < 0 ||
        PyObject_GetBuffer(out_obj, &ov, PyBUF_WRITABLE) < 0)
        goto out;
    Py_BEGIN_ALLOW_THREADS
    st = open_checked(path, fp, n_layers, kv_heads, head_dim, payload, &f, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK) {
        raise_kf(&err, st);
        goto out;
    }
    p.h = kvf_file_header(f);
    size_t bytes;
    if (load_span("heads", &h0, &h1, p.h->kv_heads, " kv heads", path) < 0 || payload_size(p.h, p.dtype, &bytes) < 0 ||
        check_head_counts(&tg, p.a.layout, h0, h1, p.h->n_layers) < 0)
        goto out;
    if ((size_t)ov.len < bytes) {
        PyErr_Format(PyExc_ValueError, "load_blocks: %s needs %zu bytes, out holds %zd", path, bytes, ov.len);
        goto out;
    }
    const size_t side = (size_t)p.h->kv_heads * (size_t)p.h->n_tokens * (size_t)p.h->head_dim;
    scratch_bytes = 2 * side * kf_dtype_size(p.h->dtype);
    if (!(p.scratch = scratch_take(2 * scratch_bytes))) { /* two layers: the second one read ahead */
        PyErr_NoMemory();
        goto out;
    }
    if (overlap && p.h->n_layers > 1)
        p.scratch2 = p.scratch + scratch_bytes;
    one_pass_shape(&p, ov.buf, &tg, h0, h1, side);
    Py_BEGIN_ALLOW_THREADS
    st = load_one_pass(f, &p, &err);
    Py_END_ALLOW_THREADS
    if (st != KF_OK)
        raise_kf(&err, st);
    else
        res = header_dict(p.h);
out:
    scratch_give(p.scratch, 2 * scratch_bytes);
    kvf_close(f);
    PyBuffer_Release(&ov);
    targets_free(&tg);
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
                {"placeholder", h->placeholder, sizeof h->placeholder},
                {"chat_template_digest", h->chat_template_digest, sizeof h->chat_template_digest},
                {"chat_prefix_ids", h->chat_prefix_ids, sizeof h->chat_prefix_ids},
                {"chat_question_prefix_ids", h->chat_question_prefix_ids, sizeof h->chat_question_prefix_ids},
                {"chat_question_suffix_ids", h->chat_question_suffix_ids, sizeof h->chat_question_suffix_ids}};
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
        if (kf_method_parse(s, &h->method) < 0) {
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
    kf_dtype kd;
    if (header_from_dict(hd, &c.hdr) < 0 || parse_dtype(kdt, &kd) < 0)
        goto out;
    if (kd != KF_DTYPE_F32 && kd != c.hdr.dtype) {
        PyErr_Format(PyExc_ValueError, "write: keys in %s must be float32 or the header's dtype %s", kdt,
                     kf_dtype_name(c.hdr.dtype));
        goto out;
    }
    const size_t n = (size_t)c.hdr.n_layers * (size_t)c.hdr.n_tokens * (size_t)c.hdr.kv_heads * (size_t)c.hdr.head_dim;
    if (c.hdr.n_layers < 1 || c.hdr.n_tokens < 1 || (size_t)k.len != n * kf_dtype_size(kd) ||
        (size_t)v.len != n * kf_dtype_size(kd)) {
        PyErr_Format(PyExc_ValueError, "write: keys/values hold %zd/%zd bytes, the header needs %zu", k.len, v.len,
                     n * kf_dtype_size(kd));
        goto out;
    }
    if (kd == KF_DTYPE_F32) {
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

/* XXH3-128 of bytes, as kvfold writes a tokenizer.json's digest (tokenizer_digest). */
static PyObject *py_bytes_digest(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    XXH128_hash_t h = XXH3_128bits(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    char out[KVF_DIGEST_LEN + 1];
    snprintf(out, sizeof out, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
    return PyUnicode_FromString(out);
}

static PyMethodDef methods[] = {
    {"read_header", py_read_header, METH_VARARGS, "read_header(path) -> dict: open and validate a kvf file"},
    {"load", (PyCFunction)(void (*)(void))py_load, METH_VARARGS | METH_KEYWORDS,
     "load(path, dtype, model_fingerprint=None, n_layers=-1, kv_heads=-1, head_dim=-1, out=None, layers=(0, -1), "
     "heads=(0, -1), head_major=False) -> (header, buffer)"},
    {"kv_bytes_read", py_kv_bytes_read, METH_NOARGS, "kv_bytes_read() -> bytes of K/V chunks read by every load"},
    {"copy_blocks", (PyCFunction)(void (*)(void))py_copy_blocks, METH_VARARGS | METH_KEYWORDS,
     "copy_blocks(src, src_dtype, n_layers, C, src_heads, head_dim, dst, layout, block_ids, block_size, "
     "t0, t1, head_start=0, kv_heads=-1, cp_size=1, cp_rank=0, cp_interleave=1, src_head_major=False)"},
    {"load_blocks", (PyCFunction)(void (*)(void))py_load_blocks, METH_VARARGS | METH_KEYWORDS,
     "load_blocks(path, dtype, out, dst, layout, block_ids, block_size, t0, t1, model_fingerprint=None, n_layers=-1, "
     "kv_heads=-1, head_dim=-1, heads=(0, -1), payload_digest=None, cp_size=1, cp_rank=0, cp_interleave=1, overlap=True) -> header"},
    {"write", (PyCFunction)(void (*)(void))py_write, METH_VARARGS | METH_KEYWORDS,
     "write(path, header, keys, values, keys_dtype='float32')"},
    {"document_digest", py_document_digest, METH_O, "document_digest(ids) -> 32 hex digits"},
    {"bytes_digest", py_bytes_digest, METH_O, "bytes_digest(data) -> 32 hex digits: XXH3-128 (tokenizer_digest)"},
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
        PyModule_AddObjectRef(m, "WITH_CUDA", Py_False) < 0 || kf_ext_add_tokenizer(m, raise_kf) < 0 ||
        PyModule_AddStringConstant(m, "VERSION", KVFOLD_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
