/* tokenizer_ext.h — adds kvfold._kvfold.Tokenizer (tokenizer_ext.c) to the module. */
#ifndef KF_TOKENIZER_EXT_H
#define KF_TOKENIZER_EXT_H

#include <Python.h>

#include "kernels/base/error.h"

/* Registers the type on module; raise turns a kf_error into the module's KvfError. -1 on failure. */
int kf_ext_add_tokenizer(PyObject *module, PyObject *(*raise)(const kf_error *, kf_status));

#endif
