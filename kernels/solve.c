/* Composite solves over the backend's solve operations (any backend: kernels/backend.h). */
#include "kernels/backend.h"

#include <string.h>

int64_t kf_solve_spd_bytes(int d) {
    return kf_ws_bytes((int64_t)d * d, sizeof(double));
}

int kf_solve_spd(const kf_backend *be, const double *S, int d, double lambda, const double *rhs, double *x, kf_ws *ws) {
    kf_ws own, *w = kf_ws_or_own(ws, &own, kf_solve_spd_bytes(d));
    if (!w)
        return -1;
    const size_t mark = kf_ws_mark(w);
    double *G = kf_ws_alloc(w, (int64_t)d * d, sizeof *G); /* [d, d] */
    int rc = -1;
    if (G) {
        memcpy(G, S, sizeof(double) * (size_t)d * d);
        for (int i = 0; i < d; i++)
            G[(size_t)i * d + i] += lambda;
        memcpy(x, rhs, sizeof(double) * (size_t)d);
        rc = kf_solve_dpotrf(be, G, (size_t)d, d) != 0 || kf_solve_dpotrs(be, G, (size_t)d, d, x, 1, 1) != 0;
    }
    kf_ws_reset(w, mark);
    kf_ws_free(&own);
    return rc;
}
