/* tokenizer_ext.c — kvfold._kvfold.Tokenizer: kvfold's own tokenizer (formats/tokenizer.h) for Python.
 *
 *   Tokenizer(path)                            a model directory holding tokenizer.json, or the file
 *   .encode(text, add_special=False) -> [int]  the ids of a str (add_special: the post-processor's
 *                                              template, e.g. Llama 3's BOS)
 *   .decode(ids, skip_special=False) -> str    the text of a sequence of ids
 *   .n_ids                                     one past the largest id
 *
 * The same code as `kvfold tokenize`, so a client needs no other tokenizer package to turn a
 * question into the ids a cache was made with. Failures raise KvfError naming the file or the id.
 * Encoding and decoding release the GIL; one Tokenizer is not for two threads at once (its encoder
 * keeps a cache), so each call holds the object's lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#include <stdlib.h>

#include "connector/ext/tokenizer_ext.h"
#include "formats/tokenizer.h"

typedef struct {
    PyObject_HEAD
    kf_tokenizer *tok;
    PyThread_type_lock lock; /* the encoder's cache is not shared between threads */
} TokenizerObject;

static PyObject *(*raise_error)(const kf_error *err, kf_status st);

static int tok_init(TokenizerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", NULL};
    PyObject *path_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&", kwlist, PyUnicode_FSConverter, &path_obj))
        return -1;
    if (self->tok) { /* __init__ called twice */
        kf_tokenizer_close(self->tok);
        self->tok = NULL;
    }
    if (!self->lock && !(self->lock = PyThread_allocate_lock())) {
        Py_DECREF(path_obj);
        PyErr_NoMemory();
        return -1;
    }
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kf_tokenizer_open(&self->tok, PyBytes_AS_STRING(path_obj), &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_obj);
    if (st != KF_OK) {
        self->tok = NULL;
        raise_error(&err, st);
        return -1;
    }
    return 0;
}

static void tok_dealloc(TokenizerObject *self) {
    if (self->tok)
        kf_tokenizer_close(self->tok);
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int tok_ready(TokenizerObject *self) {
    if (self->tok)
        return 1;
    PyErr_SetString(PyExc_ValueError, "Tokenizer: not opened (__init__ failed or was not called)");
    return 0;
}

static PyObject *ids_to_list(const kf_token_ids *ids) {
    PyObject *list = PyList_New((Py_ssize_t)ids->n);
    for (size_t i = 0; list && i < ids->n; i++) {
        PyObject *v = PyLong_FromLong(ids->ids[i]);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return list;
}

static PyObject *tok_encode(TokenizerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"text", "add_special", NULL};
    const char *text;
    Py_ssize_t len;
    int add_special = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s#|p", kwlist, &text, &len, &add_special) || !tok_ready(self))
        return NULL;
    kf_token_ids ids = {0};
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = kf_tokenizer_encode(self->tok, text, (size_t)len, add_special ? KF_TOK_ADD_SPECIAL : 0, &ids, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    PyObject *out = st == KF_OK ? ids_to_list(&ids) : raise_error(&err, st);
    kf_token_ids_free(&ids);
    return out;
}

/* ids (any sequence of ints) into a malloc'ed int32 array of *n; NULL with an exception set. */
static int32_t *ids_from_sequence(PyObject *seq_obj, size_t *n) {
    PyObject *seq = PySequence_Fast(seq_obj, "Tokenizer.decode: ids must be a sequence of ints");
    if (!seq)
        return NULL;
    *n = (size_t)PySequence_Fast_GET_SIZE(seq);
    int32_t *ids = malloc((*n ? *n : 1) * sizeof *ids); /* [n] */
    if (!ids) {
        Py_DECREF(seq);
        return (int32_t *)PyErr_NoMemory();
    }
    for (size_t i = 0; i < *n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)i);
        long long x = PyBool_Check(o) ? -1 : PyLong_AsLongLong(o);
        if ((x == -1 && PyErr_Occurred()) || PyBool_Check(o) || x < 0 || x > INT32_MAX) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "Tokenizer.decode: id %zu is %.40R, not a token id", i, o);
            free(ids);
            Py_DECREF(seq);
            return NULL;
        }
        ids[i] = (int32_t)x;
    }
    Py_DECREF(seq);
    return ids;
}

static PyObject *tok_decode(TokenizerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ids", "skip_special", NULL};
    PyObject *seq;
    int skip_special = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &seq, &skip_special) || !tok_ready(self))
        return NULL;
    size_t n;
    int32_t *ids = ids_from_sequence(seq, &n);
    if (!ids)
        return NULL;
    char *text = NULL;
    size_t len = 0;
    kf_error err = {0};
    kf_status st;
    Py_BEGIN_ALLOW_THREADS /* decoding reads the vocabulary only: no lock */
    st = kf_tokenizer_decode(self->tok, ids, n, skip_special ? KF_TOK_SKIP_SPECIAL : 0, &text, &len, &err);
    Py_END_ALLOW_THREADS
    free(ids);
    PyObject *out = st == KF_OK ? PyUnicode_DecodeUTF8(text, (Py_ssize_t)len, "strict") : raise_error(&err, st);
    free(text);
    return out;
}

static PyObject *tok_n_ids(TokenizerObject *self, void *closure) {
    (void)closure;
    return tok_ready(self) ? PyLong_FromLong(kf_tokenizer_n_ids(self->tok)) : NULL;
}

static PyMethodDef tok_methods[] = {
    {"encode", (PyCFunction)(void (*)(void))tok_encode, METH_VARARGS | METH_KEYWORDS,
     "encode(text, add_special=False) -> list of ids"},
    {"decode", (PyCFunction)(void (*)(void))tok_decode, METH_VARARGS | METH_KEYWORDS,
     "decode(ids, skip_special=False) -> str"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tok_getset[] = {
    {"n_ids", (getter)tok_n_ids, NULL, "one past the largest id (vocabulary and added tokens)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TokenizerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfold._kvfold.Tokenizer",
    .tp_basicsize = sizeof(TokenizerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Tokenizer(path): kvfold's tokenizer of a model directory's tokenizer.json (or the file itself)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tok_init,
    .tp_dealloc = (destructor)tok_dealloc,
    .tp_methods = tok_methods,
    .tp_getset = tok_getset,
};

int kf_ext_add_tokenizer(PyObject *module, PyObject *(*raise)(const kf_error *, kf_status)) {
    raise_error = raise;
    if (PyType_Ready(&TokenizerType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Tokenizer", (PyObject *)&TokenizerType);
}
