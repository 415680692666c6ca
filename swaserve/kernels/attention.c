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

#define MAX_GROUP 16  /* query heads per key/value head */
#define MAX_DIM 512   /* head dim */

#define KB 8  /* keys converted to float32 together: each q and accumulator load serves 8 */

static void one(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *slots,
                const uint8_t *mask, const float *sinks, uint16_t *out, int64_t grp,
                int64_t d, int64_t l, int64_t slot_stride, float scale, float *s,
                int64_t *keys) {
    float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], blk[KB][MAX_DIM];
    float mx[MAX_GROUP], sum[MAX_GROUP];
    int64_t n = 0;  /* the attended keys' slots, in order */
    for (int64_t j = 0; j < l; j++)
        if (!mask || mask[j]) keys[n++] = slots[j];
    for (int64_t h = 0; h < grp; h++) {
        for (int64_t i = 0; i < d; i++) qf[h][i] = bf16_to_f32(q[h * d + i]);
        mx[h] = sinks ? sinks[h] : -INFINITY;
        sum[h] = 0.0f;
        for (int64_t i = 0; i < d; i++) acc[h][i] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
        const int64_t nb = n - j0 < KB ? n - j0 : KB;
        for (int64_t t = 0; t < nb; t++) {
            const uint16_t *kr = k + keys[j0 + t] * slot_stride;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) blk[t][i] = bf16_to_f32(kr[i]);
        }
        for (int64_t h = 0; h < grp; h++) {
            for (int64_t t = 0; t < nb; t++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += qf[h][i] * blk[t][i];
                s[h * n + j0 + t] = dot * scale;
                if (dot * scale > mx[h]) mx[h] = dot * scale;
            }
        }
    }
    for (int64_t h = 0; h < grp; h++)
        for (int64_t j = 0; j < n; j++) {
            s[h * n + j] = expf(s[h * n + j] - mx[h]);
            sum[h] += s[h * n + j];
        }
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
        const int64_t nb = n - j0 < KB ? n - j0 : KB;
        for (int64_t t = 0; t < nb; t++) {
            const uint16_t *vr = v + keys[j0 + t] * slot_stride;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) blk[t][i] = bf16_to_f32(vr[i]);
        }
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
    if (grp > MAX_GROUP || d > MAX_DIM || grp * kvh != h) return -1;
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
#pragma omp for schedule(static)
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
