/* Composite solves over the backend's solve operations (any backend: kernels/backend.h). */
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"

int kf_solve_spd(const kf_backend *be, const double *S, int d, double lambda, const double *rhs, double *x) {
    double *G = malloc(sizeof(double) * (size_t)(d > 0 ? d : 1) * (d > 0 ? d : 1)); /* [d, d] */
    if (!G)
        return -1;
    memcpy(G, S, sizeof(double) * (size_t)d * d);
    for (int i = 0; i < d; i++)
        G[(size_t)i * d + i] += lambda;
    memcpy(x, rhs, sizeof(double) * (size_t)d);
    const int rc = kf_solve_dpotrf(be, G, (size_t)d, d) != 0 || kf_solve_dpotrs(be, G, (size_t)d, d, x, 1, 1) != 0;
    free(G);
    return rc;
}
