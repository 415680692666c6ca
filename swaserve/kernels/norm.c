/* RMSNorm and what surrounds it in a decoder layer, on bf16 rows, in float32:
 *   rms_norm_bf16:     y = bf16(x * (1 / sqrt(mean(x^2) + eps)) * w)
 *   add_rms_norm_bf16: x' = bf16(x + n(d)) with n(d) = rms_norm(d, wd) or d itself, and
 *                      optionally h = rms_norm(x', wn): a residual add and the next norm
 *   qk_norm_rope_bf16: q and k heads of a q/k/v row, each RMS-normed (optionally) and
 *                      rotated by RoPE (rotate-half layout)
 * Each rounds to bf16 wherever torch's bf16 ops would (after the norm, after each product
 * and after the sum of the rotation), so the results are the torch path's bits. torch
 * spends ~8 ops on a norm and ~6 on a rotation, ~10-60 us each at decode sizes, and a
 * Gemma layer has six norms and two rotations: three calls here instead.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"


static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* row (float32 copy of a bf16 row) -> bf16(row * r * w) in y, and its values in out */
static inline void norm_row(const float *row, const float *w, int64_t d, float eps,
                            uint16_t *y, float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < d; k++) ss += row[k] * row[k];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t k = 0; k < d; k++) {
        const uint16_t b = f32_to_bf16(row[k] * r * w[k]);
        if (y) y[k] = b;
        if (out) out[k] = bf16_to_f32(b);
    }
}

/* Rows are independent: split over threads from ROWS_PARALLEL_MIN values on, one row's
 * arithmetic the same whoever computes it */
void rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *y, int64_t outer,
                   int64_t inner, int64_t stride_outer, int64_t stride_inner, int64_t d,
                   float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (outer * inner * d >= ROWS_PARALLEL_MIN) \
    schedule(static)
    for (int64_t o = 0; o < outer; o++) {
        float row[NORM_MAX_DIM];
        for (int64_t i = 0; i < inner; i++) {
            const uint16_t *xr = x + o * stride_outer + i * stride_inner;
#pragma omp simd
            for (int64_t k = 0; k < d; k++) row[k] = bf16_to_f32(xr[k]);
            norm_row(row, w, d, eps, y + (o * inner + i) * d, 0);
        }
    }
}

/* x, x_out, h [rows][d]; dl [rows] with row stride ld; wd, wn [d] or NULL */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *dl, int64_t ld, const float *wd,
                       const float *wn, uint16_t *x_out, uint16_t *h, int64_t rows,
                       int64_t d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * d >= ROWS_PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float row[NORM_MAX_DIM], nd[NORM_MAX_DIM];
        const uint16_t *dr = dl + r * ld;
        if (wd) {
#pragma omp simd
            for (int64_t k = 0; k < d; k++) row[k] = bf16_to_f32(dr[k]);
            norm_row(row, wd, d, eps, 0, nd);
        } else {
#pragma omp simd
            for (int64_t k = 0; k < d; k++) nd[k] = bf16_to_f32(dr[k]);
        }
        const uint16_t *xr = x + r * d;
        uint16_t *xo = x_out + r * d;
#pragma omp simd
        for (int64_t k = 0; k < d; k++) {
            xo[k] = f32_to_bf16(bf16_to_f32(xr[k]) + nd[k]);
            row[k] = bf16_to_f32(xo[k]);
        }
        if (wn) norm_row(row, wn, d, eps, h + r * d, 0);
    }
}

/* qkv [t] rows (stride ld) of h q heads then kvh k heads (then v, untouched), each of d;
 * qw, kw [d] or NULL (no norm); cos, sin [t][d] bf16 (row stride ld_cs);
 * q_out [t][h][d], k_out [t][kvh][d] */
void qk_norm_rope_bf16(const uint16_t *qkv, int64_t ld, const float *qw, const float *kw,
                       const uint16_t *cos, const uint16_t *sin, int64_t ld_cs,
                       uint16_t *q_out, uint16_t *k_out, int64_t t, int64_t h, int64_t kvh,
                       int64_t d, float eps, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) if (t * (h + kvh) * d >= ROWS_PARALLEL_MIN) \
    schedule(static)
    for (int64_t i = 0; i < t; i++) {
        float row[NORM_MAX_DIM], n[NORM_MAX_DIM];
        const uint16_t *c = cos + i * ld_cs, *s = sin + i * ld_cs;
        for (int64_t j = 0; j < h + kvh; j++) {
            const int is_q = j < h;
            const uint16_t *src = qkv + i * ld + j * d;
            uint16_t *dst = is_q ? q_out + (i * h + j) * d : k_out + (i * kvh + j - h) * d;
            const float *w = is_q ? qw : kw;
#pragma omp simd
            for (int64_t k = 0; k < d; k++) row[k] = bf16_to_f32(src[k]);
            if (w) norm_row(row, w, d, eps, 0, n);
            else
                for (int64_t k = 0; k < d; k++) n[k] = row[k];
#pragma omp simd
            for (int64_t k = 0; k < d; k++) {
                const float rot = k < half ? -n[k + half] : n[k - half];
                dst[k] = f32_to_bf16(bf16_round(n[k] * bf16_to_f32(c[k])) +
                                     bf16_round(rot * bf16_to_f32(s[k])));
            }
        }
    }
}
