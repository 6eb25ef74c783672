/* backend_cuda.h — the CUDA backend (built when KVFOLD_HAVE_CUDA is defined).
 *
 * Device memory; bf16 weights (upload_weight converts f32/f16/bf16 on the device); fp32
 * activations and an fp32 KV pool, so that every kf_backend operation keeps its float* contract.
 * GEMMs run on the tensor cores (bf16 operands, fp32 accumulation); the row kernels, attention and
 * QUOKA run in fp32. All work is queued on one stream; download and take_error synchronize it.
 */
#ifndef KF_BACKEND_CUDA_H
#define KF_BACKEND_CUDA_H

#include "kernels/base/error.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend on CUDA device `device`. NULL on failure: err->code is KF_ERR_NOTFOUND when there is
 * no usable CUDA device (no driver, no GPU), otherwise another code with the CUDA message. */
kf_backend *kf_backend_cuda_create(int device, kf_error *err);

/* Number of usable CUDA devices (0 when there is no driver or GPU). */
int kf_cuda_device_count(void);

/* The first failure's message since the last take_error ("" when none); valid until the next call. */
const char *kf_backend_cuda_message(kf_backend *b);

#ifdef __cplusplus
}
#endif
#endif
