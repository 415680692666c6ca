/* RMSNorm of bf16 rows: y = bf16(x * (1 / sqrt(mean(x^2) + eps)) * w), computed in float32.
 *
 * torch spends ~8 ops on this (casts, pow, mean, add, rsqrt, two multiplies), ~60 us a row
 * batch at decode sizes, and a Gemma layer has six norms: one call here instead. Rows are
 * (outer, inner) with strides, so a [T, H, D] view of q or k needs no copy.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

void rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *y, int64_t outer,
                   int64_t inner, int64_t stride_outer, int64_t stride_inner, int64_t d,
                   float eps) {
    float row[8192];
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t i = 0; i < inner; i++) {
            const uint16_t *xr = x + o * stride_outer + i * stride_inner;
            uint16_t *yr = y + (o * inner + i) * d;
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t k = 0; k < d; k++) {
                row[k] = bf16_to_f32(xr[k]);
                ss += row[k] * row[k];
            }
            const float r = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
            for (int64_t k = 0; k < d; k++) yr[k] = f32_to_bf16(row[k] * r * w[k]);
        }
    }
}
