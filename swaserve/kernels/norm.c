/* RMSNorm and what surrounds it in a decoder layer, on bf16 rows, in float32:
 *   rms_norm_bf16:     y = bf16(x * (1 / sqrt(mean(x^2) + eps)) * w)
 *   add_rms_norm_bf16: x' = bf16(x + n(d)) with n(d) = rms_norm(d, wd) or d itself, and
 *                      optionally h = rms_norm(x', wn): a residual add and the next norm
 *   qk_norm_rope_bf16: q and k heads of a q/k/v row, each RMS-normed (optionally) and
 *                      rotated by RoPE (rotate-half layout)
 * Each rounds to bf16 wherever torch's bf16 ops would (after the norm, after each product
 * and after the sum of the rotation), so the results are the torch path's bits. torch
 * spends several ops on a norm and on a rotation, each a pass over memory and a dispatch,
 * and a Gemma layer has six norms and two rotations: three calls here instead.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"


static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NORM_SIMD 1
/* The loops below, 16 values at a time (the compiler's own vectorizing keeps 8 a vector
 * and narrows to bf16 in several integer operations; here it is one instruction with
 * AVX-512 BF16, which like the other kernels' flushes denormals to zero: prompt steps
 * spend a large share of their time in these kernels). Each value goes through the same operations in the
 * same order as in the portable loops, so the same bits, but for the sum of squares,
 * which adds in 16 lanes. */
#include "simd.h"

static inline __mmask16 live(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 widen(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static inline __m512 load_bf16_live(const uint16_t *p, __mmask16 m) {
    return widen(_mm256_maskz_loadu_epi16(m, p));
}

static inline __m512 round_bf16(__m512 v) { return widen(to_bf16(v)); }
#endif

/* row[k] = the float32 value of bf16 src[k] */
static inline void widen_row(const uint16_t *src, int64_t d, float *row) {
#ifdef NORM_SIMD
    for (int64_t k = 0; k < d; k += 16) {
        const __mmask16 m = live(d - k);
        _mm512_mask_storeu_ps(row + k, m, load_bf16_live(src + k, m));
    }
#else
    for (int64_t k = 0; k < d; k++) row[k] = bf16_to_f32(src[k]);
#endif
}

/* row (float32 copy of a bf16 row) -> bf16(row * r * w) in y, and its values in out */
static inline void norm_row(const float *row, const float *w, int64_t d, float eps,
                            uint16_t *y, float *out) {
#ifdef NORM_SIMD
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < d; k += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(live(d - k), row + k);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps));
    for (int64_t k = 0; k < d; k += 16) {
        const __mmask16 m = live(d - k);
        const __m256i b = to_bf16(_mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + k),
                                                              r), _mm512_maskz_loadu_ps(m, w + k)));
        if (y) _mm256_mask_storeu_epi16(y + k, m, b);
        if (out) _mm512_mask_storeu_ps(out + k, m, widen(b));
    }
#else
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < d; k++) ss += row[k] * row[k];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t k = 0; k < d; k++) {
        const uint16_t b = f32_to_bf16(row[k] * r * w[k]);
        if (y) y[k] = b;
        if (out) out[k] = bf16_to_f32(b);
    }
#endif
}

/* xo = bf16(x + nd), and its values in row */
static inline void add_row(const uint16_t *x, const float *nd, int64_t d, uint16_t *xo,
                           float *row) {
#ifdef NORM_SIMD
    for (int64_t k = 0; k < d; k += 16) {
        const __mmask16 m = live(d - k);
        const __m256i b = to_bf16(_mm512_add_ps(load_bf16_live(x + k, m),
                                                _mm512_maskz_loadu_ps(m, nd + k)));
        _mm256_mask_storeu_epi16(xo + k, m, b);
        _mm512_mask_storeu_ps(row + k, m, widen(b));
    }
#else
#pragma omp simd
    for (int64_t k = 0; k < d; k++) {
        xo[k] = f32_to_bf16(bf16_to_f32(x[k]) + nd[k]);
        row[k] = bf16_to_f32(xo[k]);
    }
#endif
}

/* dst = bf16(bf16(n * c) + bf16(rot(n) * s)), rot(n) = (-n[half..d), n[0..half)) */
static inline void rope_row(const float *n, const uint16_t *c, const uint16_t *s, int64_t d,
                            uint16_t *dst) {
    const int64_t half = d / 2;
#ifdef NORM_SIMD
    for (int64_t part = 0; part < 2; part++) {  /* the first half, then the second */
        const int64_t at = part * half, from = part ? 0 : half;
        const __m512 sign = _mm512_set1_ps(part ? 0.0f : -0.0f);
        for (int64_t k = 0; k < half; k += 16) {
            const __mmask16 m = live(half - k);
            const __m512 v = _mm512_maskz_loadu_ps(m, n + at + k);
            const __m512 rot = _mm512_xor_ps(_mm512_maskz_loadu_ps(m, n + from + k), sign);
            const __m512 a = round_bf16(_mm512_mul_ps(v, load_bf16_live(c + at + k, m)));
            const __m512 b = round_bf16(_mm512_mul_ps(rot, load_bf16_live(s + at + k, m)));
            _mm256_mask_storeu_epi16(dst + at + k, m, to_bf16(_mm512_add_ps(a, b)));
        }
    }
#else
#pragma omp simd
    for (int64_t k = 0; k < d; k++) {
        const float rot = k < half ? -n[k + half] : n[k - half];
        dst[k] = f32_to_bf16(bf16_round(n[k] * bf16_to_f32(c[k])) +
                             bf16_round(rot * bf16_to_f32(s[k])));
    }
#endif
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
            widen_row(x + o * stride_outer + i * stride_inner, d, row);
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
            widen_row(dr, d, row);
            norm_row(row, wd, d, eps, 0, nd);
        } else {
            widen_row(dr, d, nd);
        }
        add_row(x + r * d, nd, d, x_out + r * d, row);
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
            widen_row(src, d, w ? row : n);
            if (w) norm_row(row, w, d, eps, 0, n);
            rope_row(n, c, s, d, dst);
        }
    }
}
