/* Decode attention on int8 caches (kv_cache_dtype int8): one query per sequence, the keys
 * read in place as int8 values with a float32 scale per block of D / nb values of each
 * (slot, KV head).
 *
 * The computation of decode_attention_bf16 (attention.c) on the dequantized keys: each
 * 16 int8 widened to float32 and multiplied by their block's scale as they are loaded,
 * sums in float32. A step reads about half the bytes a bf16 cache takes. The
 * softmax is exact (two passes over the scores), so a row's result depends on its own
 * keys only: never on the batch, the padding or the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"
#include "softmax.h"

#ifdef __AVX512F__
#include "simd.h"
#endif

#define AHEAD 4 /* keys ahead whose rows are prefetched */

static inline void prefetch_row(const int8_t *row, int64_t d) {
    for (int64_t c = 0; c < d; c += 64) __builtin_prefetch(row + c, 0, 3);
}

#ifdef __AVX512F__
static inline __m512 load_i8(const int8_t *p) { /* 16 int8 as float32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#endif

/* s[h * n + j] = scale * (q_h . k_j) for the n keys at slots keys[], each key's values
 * times their block's scale (ks: the head's first, nb a slot) */
static void scores_q8(float qf[][ATTN_MAX_DIM], const int8_t *k, const int8_t *v,
                      const float *ks, const int64_t *keys, int64_t n, int64_t grp, int64_t d,
                      int64_t stride, int64_t kvh, int64_t nb, float scale, float *s) {
    const int64_t bs = d / nb;
    for (int64_t j = 0; j < n; j++) {
        const int8_t *kr = k + keys[j] * stride;
        const float *ksr = ks + keys[j] * kvh * nb;
        if (j + AHEAD < n) prefetch_row(k + keys[j + AHEAD] * stride, d);
        prefetch_row(v + keys[j] * stride, d);
        const float f = scale;
#ifdef __AVX512F__
        if (d % 16 == 0 && bs % 16 == 0) {
            __m512 a[ATTN_MAX_GROUP];
            for (int64_t h = 0; h < grp; h++) a[h] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                const __m512 kf = _mm512_mul_ps(load_i8(kr + c), _mm512_set1_ps(ksr[c / bs]));
                for (int64_t h = 0; h < grp; h++)
                    a[h] = _mm512_fmadd_ps(_mm512_load_ps(qf[h] + c), kf, a[h]);
            }
            for (int64_t h = 0; h < grp; h++) s[h * n + j] = _mm512_reduce_add_ps(a[h]) * f;
            continue;
        }
#endif
        for (int64_t h = 0; h < grp; h++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++) dot += qf[h][i] * ((float)kr[i] * ksr[i / bs]);
            s[h * n + j] = dot * f;
        }
    }
}

/* acc[h] = sum_j w[h * n + j] v_j for the n int8 value rows at slots keys[] (times their
 * blocks' scales vs, as the keys') */
static void values_q8(const int8_t *v, const float *vs, const int64_t *keys, int64_t n,
                      int64_t grp, int64_t d, int64_t stride, int64_t kvh, int64_t nb,
                      const float *w, float acc[][ATTN_MAX_DIM]) {
    const int64_t bs = d / nb;
#ifdef __AVX512F__
    if (d % 64 == 0 && bs % 16 == 0) { /* a cache line of a value row, 4 heads, in registers */
        for (int64_t h0 = 0; h0 < grp; h0 += 4) {
            const int64_t hb = grp - h0 < 4 ? grp - h0 : 4;
            for (int64_t c = 0; c < d; c += 64) {
                __m512 a[4][4];
                for (int h = 0; h < 4; h++)
                    for (int u = 0; u < 4; u++) a[h][u] = _mm512_setzero_ps();
                for (int64_t j = 0; j < n; j++) {
                    const int8_t *vr = v + keys[j] * stride + c;
                    const float *vsr = vs + keys[j] * kvh * nb;
                    const __m512 x0 = _mm512_mul_ps(load_i8(vr), _mm512_set1_ps(vsr[c / bs]));
                    const __m512 x1 = _mm512_mul_ps(load_i8(vr + 16),
                                                    _mm512_set1_ps(vsr[(c + 16) / bs]));
                    const __m512 x2 = _mm512_mul_ps(load_i8(vr + 32),
                                                    _mm512_set1_ps(vsr[(c + 32) / bs]));
                    const __m512 x3 = _mm512_mul_ps(load_i8(vr + 48),
                                                    _mm512_set1_ps(vsr[(c + 48) / bs]));
                    for (int h = 0; h < 4; h++) {
                        if (h >= hb) break;
                        const __m512 p = _mm512_set1_ps(w[(h0 + h) * n + j]);
                        a[h][0] = _mm512_fmadd_ps(p, x0, a[h][0]);
                        a[h][1] = _mm512_fmadd_ps(p, x1, a[h][1]);
                        a[h][2] = _mm512_fmadd_ps(p, x2, a[h][2]);
                        a[h][3] = _mm512_fmadd_ps(p, x3, a[h][3]);
                    }
                }
                for (int64_t h = 0; h < hb; h++)
                    for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc[h0 + h] + c + 16 * u, a[h][u]);
            }
        }
        return;
    }
#endif
    for (int64_t h = 0; h < grp; h++)
        for (int64_t i = 0; i < d; i++) acc[h][i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const int8_t *vr = v + keys[j] * stride;
        const float *vsr = vs + keys[j] * kvh * nb;
        for (int64_t h = 0; h < grp; h++) {
            const float p = w[h * n + j];
            for (int64_t i = 0; i < d; i++) acc[h][i] += p * ((float)vr[i] * vsr[i / bs]);
        }
    }
}

static void one_q8(const uint16_t *q, const int8_t *k, const int8_t *v, const float *ks,
                   const float *vs, const int64_t *slots, const uint8_t *mask,
                   const float *sinks, uint16_t *out, int64_t grp, int64_t d, int64_t l,
                   int64_t kvh, int64_t nb, float scale, float *s, int64_t *keys) {
    float qf[ATTN_MAX_GROUP][ATTN_MAX_DIM] __attribute__((aligned(64)));
    float acc[ATTN_MAX_GROUP][ATTN_MAX_DIM];
    float mx[ATTN_MAX_GROUP], sum[ATTN_MAX_GROUP];
    const int64_t stride = kvh * d;
    int64_t n = 0; /* the attended keys' slots, in order */
    for (int64_t j = 0; j < l; j++)
        if (!mask || mask[j]) keys[n++] = slots[j];
    for (int64_t h = 0; h < grp; h++) {
        for (int64_t i = 0; i < d; i++) qf[h][i] = bf16_to_f32(q[h * d + i]);
        mx[h] = sinks ? sinks[h] : -INFINITY;
    }
    scores_q8(qf, k, v, ks, keys, n, grp, d, stride, kvh, nb, scale, s);
    for (int64_t h = 0; h < grp; h++) {
        for (int64_t j = 0; j < n; j++)
            if (s[h * n + j] > mx[h]) mx[h] = s[h * n + j];
        sum[h] = exp_minus(s + h * n, n, mx[h]);
    }
    values_q8(v, vs, keys, n, grp, d, stride, kvh, nb, s, acc);
    for (int64_t h = 0; h < grp; h++) {
        if (sinks) sum[h] += expf(sinks[h] - mx[h]);
        const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
        for (int64_t i = 0; i < d; i++) out[h * d + i] = f32_to_bf16(acc[h][i] * inv);
    }
}

int decode_attention_q8(const uint16_t *q, int64_t q_stride, const int8_t *k, const int8_t *v,
                        const float *k_scale, const float *v_scale, const int64_t *slots,
                        const uint8_t *mask, const float *sinks, uint16_t *out, int64_t b,
                        int64_t h, int64_t kvh, int64_t d, int64_t nb, int64_t l, float scale,
                        int threads) {
    const int64_t grp = h / kvh, jobs = b * kvh;
    if (grp > ATTN_MAX_GROUP || d > ATTN_MAX_DIM || grp * kvh != h || nb < 1 || d % nb)
        return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (jobs > 1 && jobs * l * d >= 16384)
    {
        float *s = malloc(sizeof(float) * (size_t)(grp * (l > 0 ? l : 1)));
        int64_t *keys = malloc(sizeof(int64_t) * (size_t)(l > 0 ? l : 1));
        if (!s || !keys) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t job = 0; job < jobs; job++) {
                const int64_t r = job / kvh, g = job % kvh;
                one_q8(q + r * q_stride + g * grp * d, k + g * d, v + g * d, k_scale + g * nb,
                       v_scale + g * nb, slots + r * l, mask ? mask + r * l : NULL,
                       sinks ? sinks + g * grp : NULL, out + r * h * d + g * grp * d, grp, d, l,
                       kvh, nb, scale, s, keys);
            }
        }
        free(s);
        free(keys);
    }
    return failed ? -1 : 0;
}
