#include "kernels/base/dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} kDtypes[KF_DTYPE_COUNT] = {
    [KF_DTYPE_F32] = {"float32", 4}, [KF_DTYPE_BF16] = {"bfloat16", 2}, [KF_DTYPE_F16] = {"float16", 2},
    [KF_DTYPE_F64] = {"float64", 8}, [KF_DTYPE_I8] = {"int8", 1},       [KF_DTYPE_U8] = {"uint8", 1},
    [KF_DTYPE_I16] = {"int16", 2},   [KF_DTYPE_U16] = {"uint16", 2},    [KF_DTYPE_I32] = {"int32", 4},
    [KF_DTYPE_U32] = {"uint32", 4},  [KF_DTYPE_I64] = {"int64", 8},     [KF_DTYPE_U64] = {"uint64", 8},
    [KF_DTYPE_BOOL] = {"bool", 1},
};

/* the short spellings of the command line and of earlier releases */
static const struct {
    const char *name;
    kf_dtype dt;
} kShort[] = {{"bf16", KF_DTYPE_BF16}, {"f16", KF_DTYPE_F16}, {"fp16", KF_DTYPE_F16},
              {"f32", KF_DTYPE_F32},   {"fp32", KF_DTYPE_F32}, {"f64", KF_DTYPE_F64}};

size_t kf_dtype_size(kf_dtype dt) {
    return (unsigned)dt < KF_DTYPE_COUNT ? kDtypes[dt].size : 0;
}

const char *kf_dtype_name(kf_dtype dt) {
    return (unsigned)dt < KF_DTYPE_COUNT ? kDtypes[dt].name : "?";
}

int kf_dtype_parse(const char *s, kf_dtype *out) {
    for (int i = 0; i < KF_DTYPE_COUNT; i++)
        if (strcmp(s, kDtypes[i].name) == 0) {
            *out = (kf_dtype)i;
            return 0;
        }
    for (size_t i = 0; i < sizeof kShort / sizeof kShort[0]; i++)
        if (strcmp(s, kShort[i].name) == 0) {
            *out = kShort[i].dt;
            return 0;
        }
    return -1;
}
