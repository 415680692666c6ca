/* Decode attention on bf16 caches: one query per sequence, keys read in place.
 *
 * For sequence b and key/value head g, the G = H / KVH query heads of g attend the keys at
 * cache slots slots[b, 0..L) (rows of the pool [S, KVH, D], wherever the ring or the pages
 * put them), skipping those whose mask entry is 0:
 *   s_j = scale * q . k_j,  p_j = exp(s_j - max) / (sum_j exp(s_j - max) [+ exp(sink - max)])
 *   out = bf16(sum_j p_j v_j)
 * all in float32 from the bf16 values. torch's SDPA first gathers the keys of every
 * sequence into a padded copy and runs a blocked kernel sized for long queries: ~1 ms a
 * layer at 32 sequences of 200 keys, against the ~0.2 ms it takes to read them. The softmax
 * here is exact (two passes over the scores, no online rescaling), so a row's result
 * depends on its own keys only: never on the batch, the padding or the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#ifdef __AVX512F__
#include "simd.h"
#endif


#define KB 8  /* keys converted to float32 together: each q and accumulator load serves 8 */

/* s[j] = e^(s[j] - m) for j < n; returns their sum */
static float exp_minus(float *s, int64_t n, float m) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), mv));
        _mm512_mask_storeu_ps(s + j, live, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(live, e));
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

#define AHEAD 4 /* keys ahead whose rows are prefetched */

static inline void prefetch_row(const uint16_t *row, int64_t d) {
    for (int64_t c = 0; c < d; c += 32) __builtin_prefetch(row + c, 0, 3);
}

/* blk[t] = the float32 values of pool row keys[t], t < nb */
static void widen_rows(const uint16_t *pool, const int64_t *keys, int64_t nb, int64_t d,
                       int64_t slot_stride, float blk[][ATTN_MAX_DIM]) {
    for (int64_t t = 0; t < nb; t++) {
        const uint16_t *r = pool + keys[t] * slot_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) blk[t][i] = bf16_to_f32(r[i]);
    }
}

/* s[h * n + j] = scale * q_h . k_j for the n keys at slots keys[]. The cache rows come
 * from memory (a step reads every layer's keys once): the key rows a few keys ahead and
 * the value rows of the same keys are prefetched, so their latency overlaps the sums. */
static void scores(const uint16_t *q, float qf[][ATTN_MAX_DIM], const uint16_t *k,
                   const uint16_t *v, const int64_t *keys, int64_t n, int64_t grp, int64_t d,
                   int64_t slot_stride, float scale, float *s, float blk[][ATTN_MAX_DIM]) {
#ifdef __AVX512BF16__
    if (d % 32 == 0) {  /* bf16 pairs straight into float32 sums: no widening of the keys */
        for (int64_t j = 0; j < n; j++) {
            const uint16_t *kr = k + keys[j] * slot_stride;
            if (j + AHEAD < n) prefetch_row(k + keys[j + AHEAD] * slot_stride, d);
            prefetch_row(v + keys[j] * slot_stride, d);
            for (int64_t h = 0; h < grp; h++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < d; c += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + h * d + c),
                                           (__m512bh)_mm512_loadu_si512(kr + c));
                s[h * n + j] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
        return;
    }
#else
    (void)q;
    (void)v;
#endif
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
        const int64_t nb = n - j0 < KB ? n - j0 : KB;
        widen_rows(k, keys + j0, nb, d, slot_stride, blk);
        for (int64_t h = 0; h < grp; h++)
            for (int64_t t = 0; t < nb; t++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += qf[h][i] * blk[t][i];
                s[h * n + j0 + t] = dot * scale;
            }
    }
}

/* acc[h] = sum_j p[h * n + j] v_j, float32, for the n value rows at slots keys[] */
static void weighted_values(const uint16_t *v, const int64_t *keys, int64_t n, int64_t grp,
                            int64_t d, int64_t slot_stride, const float *s,
                            float acc[][ATTN_MAX_DIM], float blk[][ATTN_MAX_DIM]) {
#ifdef __AVX512F__
    if (d % 32 == 0) {  /* 32 dims of 4 heads in registers across all keys */
        for (int64_t h0 = 0; h0 < grp; h0 += 4) {
            const int64_t hb = grp - h0 < 4 ? grp - h0 : 4;
            const float *p0 = s + h0 * n;
            for (int64_t c = 0; c < d; c += 32) {
                __m512 a[4][2];
                for (int h = 0; h < 4; h++) a[h][0] = a[h][1] = _mm512_setzero_ps();
                for (int64_t j = 0; j < n; j++) {
                    const __m512i raw = _mm512_loadu_si512(v + keys[j] * slot_stride + c);
                    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
                    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
                    for (int h = 0; h < 4; h++) {
                        if (h >= hb) break;
                        const __m512 p = _mm512_set1_ps(p0[h * n + j]);
                        a[h][0] = _mm512_fmadd_ps(p, lo, a[h][0]);
                        a[h][1] = _mm512_fmadd_ps(p, hi, a[h][1]);
                    }
                }
                for (int64_t h = 0; h < hb; h++) {
                    _mm512_storeu_ps(acc[h0 + h] + c, a[h][0]);
                    _mm512_storeu_ps(acc[h0 + h] + c + 16, a[h][1]);
                }
            }
        }
        return;
    }
#endif
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
        const int64_t nb = n - j0 < KB ? n - j0 : KB;
        widen_rows(v, keys + j0, nb, d, slot_stride, blk);
        for (int64_t t = nb; t < KB; t++)
            for (int64_t i = 0; i < d; i++) blk[t][i] = 0.0f;
        for (int64_t h = 0; h < grp; h++) {
            float p[KB] = {0};
            for (int64_t t = 0; t < nb; t++) p[t] = s[h * n + j0 + t];
#pragma omp simd
            for (int64_t i = 0; i < d; i++) {
                float a = acc[h][i];
                for (int t = 0; t < KB; t++) a += p[t] * blk[t][i];
                acc[h][i] = a;
            }
        }
    }
}

static void one(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *slots,
                const uint8_t *mask, const float *sinks, uint16_t *out, int64_t grp,
                int64_t d, int64_t l, int64_t slot_stride, float scale, float *s,
                int64_t *keys) {
    float qf[ATTN_MAX_GROUP][ATTN_MAX_DIM], acc[ATTN_MAX_GROUP][ATTN_MAX_DIM], blk[KB][ATTN_MAX_DIM];
    float mx[ATTN_MAX_GROUP], sum[ATTN_MAX_GROUP];
    int64_t n = 0;  /* the attended keys' slots, in order */
    for (int64_t j = 0; j < l; j++)
        if (!mask || mask[j]) keys[n++] = slots[j];
    for (int64_t h = 0; h < grp; h++) {
        for (int64_t i = 0; i < d; i++) qf[h][i] = bf16_to_f32(q[h * d + i]);
        mx[h] = sinks ? sinks[h] : -INFINITY;
        sum[h] = 0.0f;
        for (int64_t i = 0; i < d; i++) acc[h][i] = 0.0f;
    }
    scores(q, qf, k, v, keys, n, grp, d, slot_stride, scale, s, blk);
    for (int64_t h = 0; h < grp; h++)
        for (int64_t j = 0; j < n; j++)
            if (s[h * n + j] > mx[h]) mx[h] = s[h * n + j];
    for (int64_t h = 0; h < grp; h++) sum[h] = exp_minus(s + h * n, n, mx[h]);
    weighted_values(v, keys, n, grp, d, slot_stride, s, acc, blk);
    for (int64_t h = 0; h < grp; h++) {
        if (sinks) sum[h] += expf(sinks[h] - mx[h]);
        const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
        for (int64_t i = 0; i < d; i++) out[h * d + i] = f32_to_bf16(acc[h][i] * inv);
    }
}

/* q [B] rows of H * D (row stride q_stride), k and v pools [S, KVH, D], slots [B, L] int64,
 * mask [B, L] bytes or NULL (all keys), sinks [H] float or NULL, out [B, H * D].
 * Returns 0, or -1 when a buffer cannot be allocated (nothing written then). */
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                          const uint16_t *v, const int64_t *slots, const uint8_t *mask,
                          const float *sinks, uint16_t *out, int64_t b, int64_t h,
                          int64_t kvh, int64_t d, int64_t l, float scale, int threads) {
    const int64_t grp = h / kvh, jobs = b * kvh;
    if (grp > ATTN_MAX_GROUP || d > ATTN_MAX_DIM || grp * kvh != h) return -1;
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
                one(q + r * q_stride + g * grp * d, k + g * d, v + g * d, slots + r * l,
                    mask ? mask + r * l : NULL, sinks ? sinks + g * grp : NULL,
                    out + r * h * d + g * grp * d, grp, d, l, kvh * d, scale, s, keys);
            }
        }
        free(s);
        free(keys);
    }
    return failed ? -1 : 0;
}
