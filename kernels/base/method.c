#include "kernels/base/method.h"

#include <string.h>

static const char *const kMethodNames[KF_METHOD_COUNT] = {"keep", "drop", "am", "fold"};

const char *kf_method_name(kf_method m) {
    return (unsigned)m < KF_METHOD_COUNT ? kMethodNames[m] : "?";
}

int kf_method_parse(const char *name, kf_method *out) {
    for (int i = 0; i < KF_METHOD_COUNT; i++)
        if (strcmp(name, kMethodNames[i]) == 0) {
            *out = (kf_method)i;
            return 0;
        }
    return -1;
}
