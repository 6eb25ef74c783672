/* fold.h — folding AM's per-key biases into the keys (docs/design.md, "The fold").
 *
 * With the pooled reference queries' mean mu and covariance Sigma (fp64):
 *   a = (Sigma + lambda I)^-1 mu,  lambda = lambda_rel * tr(Sigma) / d,   u = a / (mu^T a)
 * so mu^T u = 1 and u is the minimum-variance direction with that property. The folded key is
 *   k'_j = k_j + beta_j * u / s        (s the softmax scale, 1/s = sqrt(d))
 * and the folded logit s q.k'_j = s q.k_j + beta_j (q.u): AM's bias times the gain g(q) = q.u,
 * exact for the mean query (g(mu) = 1), with var(g) = u^T Sigma u over the reference queries.
 * When mu^T a <= 0 there is no such direction; the caller falls back to `drop` for that head.
 */
#ifndef KF_FOLD_H
#define KF_FOLD_H

#include "kernels/base/error.h"
#include "kernels/backend.h"

typedef struct {
    double mu_dot_a;  /* mu^T a before normalisation (<= 0: no fold) */
    double var_gain;  /* u^T Sigma u = var(q.u) over the queries */
    double u_norm;
    int ok;           /* 1 when u was fitted */
} kf_fold_info;

/* u[d] from the rows of q [R, d]; be runs the math (kf_solve_backend: NULL = the CPU's). Scratch:
 * ws (kf_fold_direction_bytes; as compactor/am.h says: NULL, a block of its own). */
kf_status kf_fold_direction(const kf_backend *be, const float *q, int R, int d, double lambda_rel, float *u,
                            kf_fold_info *info, kf_ws *ws, kf_error *err);
int64_t kf_fold_direction_bytes(int d);

/* The queries' mean and covariance, computed once for several lambdas (the per-head choice's
 * grid): kf_fold_direction(q, ...) == kf_fold_cov_compute(q, ...) then kf_fold_direction_cov. */
typedef struct {
    double *mu; /* [d] */
    double *S;  /* [d, d] Sigma, full */
    int R, d;
    const kf_backend *be; /* kf_fold_cov_compute's: kf_fold_direction_cov's solve runs on it */
    int in_ws;            /* 1: mu and S are a workspace's (kf_fold_cov_free only forgets them) */
} kf_fold_cov;

/* ws: the results mu and S stay in it (kf_fold_cov_bytes), the row tiles are scratch. */
kf_status kf_fold_cov_compute(const kf_backend *be, const float *q, int R, int d, kf_fold_cov *out, kf_ws *ws,
                              kf_error *err);
int64_t kf_fold_cov_bytes(int d);
int64_t kf_fold_cov_compute_bytes(int d);
kf_status kf_fold_direction_cov(const kf_fold_cov *c, double lambda_rel, float *u, kf_fold_info *info, kf_ws *ws,
                                kf_error *err);
int64_t kf_fold_direction_cov_bytes(int d);
void kf_fold_cov_free(kf_fold_cov *c);

/* out[j] = keys[j] + beta[j] * u / scale for t keys of width d (row strides in elements). */
void kf_fold_keys(const float *keys, size_t key_stride, const float *beta, int t, int d, float scale, const float *u,
                  float *out, size_t out_stride);

#endif
