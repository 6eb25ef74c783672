/* RoPE inverse frequencies for the default, linear and llama3 rope types (as transformers). */
#include <math.h>

#include "kernels/backend.h"

void kf_rope_inv_freq(const kf_rope_spec *spec, int head_dim, double *inv_freq) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = 1.0 / pow(spec->theta, (2.0 * i) / head_dim);
        switch (spec->kind) {
        case KF_ROPE_DEFAULT:
            break;
        case KF_ROPE_LINEAR:
            f /= spec->factor;
            break;
        case KF_ROPE_LLAMA3: {
            const double low_wavelen = spec->original_max_pos / spec->low_freq_factor;
            const double high_wavelen = spec->original_max_pos / spec->high_freq_factor;
            const double wavelen = 2.0 * M_PI / f;
            if (wavelen > low_wavelen) {
                f /= spec->factor; /* long wavelengths: fully interpolated */
            } else if (wavelen >= high_wavelen) {
                /* medium: blend between interpolated and original */
                double smooth = (spec->original_max_pos / wavelen - spec->low_freq_factor) /
                                (spec->high_freq_factor - spec->low_freq_factor);
                f = (1.0 - smooth) * f / spec->factor + smooth * f;
            } /* short wavelengths: unchanged */
            break;
        }
        }
        inv_freq[i] = f;
    }
}
