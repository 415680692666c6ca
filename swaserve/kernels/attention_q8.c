/* Decode attention on int8 caches (kv_cache_dtype int8): one query per sequence, the keys
 * read in place as int8 values with a float32 scale per block of D / nb values of each
 * (slot, KV head).
 *
 * The computation of decode_attention_bf16 (attention.c) on the dequantized keys, the
 * softmax exact (two passes over the scores), so a row's result depends on its own keys
 * only: never on the batch, the padding or the other rows. With AVX-512 VNNI and blocks of
 * 32 (D a multiple of 64) both products are int16 dot products (VPDPWSSD, 32 values an
 * instruction, exact int32 sums):
 * - scores: each query head rounded once to int16 (a scale per head, 2^-16 of its largest
 *   value), an int8 key widened to int16, two blocks to a vector (alternate lanes), each
 *   vector's int32 sums times its blocks' scales into float32;
 * - values: each weight p_j * scale_jb rounded to int16 (a scale per query head, 2^-16 of
 *   its largest), two keys' values interleaved to a vector, int32 sums over up to CHUNK
 *   keys (they cannot overflow) added to the float32 output.
 * Otherwise each 16 int8 are widened to float32 times their block's scale (float32 FMAs).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "decode_jobs.h"
#include "kernels.h"
#include "softmax.h"

#ifdef __AVX512F__
#include "simd.h"
#endif

#define AHEAD 4   /* keys ahead whose rows are prefetched */
#define CHUNK 256 /* keys whose int32 value sums stay below 2^31: 256 * 32767 * 127 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FAST 1
#endif

typedef struct { /* a call's arguments, for its jobs */
    const uint16_t *q;
    const int8_t *k, *v;
    const float *ks, *vs;
    const int64_t *slots;
    const uint8_t *mask;
    const float *sinks;
    uint16_t *out;
    int64_t q_stride, h, kvh, grp, d, nb, l;
    float scale;
    int fast; /* the int16 products take these shapes */
} dec_t;

static inline void prefetch_row(const int8_t *row, int64_t d) {
    for (int64_t c = 0; c < d; c += 64) __builtin_prefetch(row + c, 0, 3);
}

static inline int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* a job's scratch: the keys' slots [l], scores [grp, l], each key's largest value scale
 * [l], the int16 weights of a chunk [CHUNK / 2, grp, nb], the int16 queries [grp, d] */
typedef struct {
    int64_t *keys;
    float *s, *vmax;
    int32_t *wq;
    int16_t *q16;
} scratch_t;

static int64_t scratch_bytes(int64_t l, int64_t grp, int64_t d, int64_t nb) {
    const int64_t n = l > 0 ? l : 1;
    return round64(8 * n) + round64(4 * grp * n) + round64(4 * n)
           + round64(4 * (CHUNK / 2) * grp * nb) + round64(2 * grp * d);
}

static scratch_t carve(void *p, int64_t l, int64_t grp, int64_t d, int64_t nb) {
    (void)d;
    const int64_t n = l > 0 ? l : 1;
    char *c = p;
    scratch_t s;
    s.keys = (int64_t *)c, c += round64(8 * n);
    s.s = (float *)c, c += round64(4 * grp * n);
    s.vmax = (float *)c, c += round64(4 * n);
    s.wq = (int32_t *)c, c += round64(4 * (CHUNK / 2) * grp * nb);
    s.q16 = (int16_t *)c;
    return s;
}

#ifdef __AVX512F__
static inline __m512 load_i8(const int8_t *p) { /* 16 int8 as float32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#endif

/* The float32 path: s[h * n + j] = scale * (q_h . k_j) for the n keys at slots keys[], each
 * key's values times their block's scale (ks: the head's first, nb a slot) */
static void scores_f32(float qf[][ATTN_MAX_DIM], const int8_t *k, const int8_t *v,
                       const float *ks, const int64_t *keys, int64_t n, int64_t grp,
                       int64_t d, int64_t stride, int64_t kvh, int64_t nb, float scale,
                       float *s) {
    const int64_t bs = d / nb;
    for (int64_t j = 0; j < n; j++) {
        const int8_t *kr = k + keys[j] * stride;
        const float *ksr = ks + keys[j] * kvh * nb;
        if (j + AHEAD < n) prefetch_row(k + keys[j + AHEAD] * stride, d);
        prefetch_row(v + keys[j] * stride, d);
#ifdef __AVX512F__
        if (d % 16 == 0 && bs % 16 == 0) {
            __m512 a[ATTN_MAX_GROUP];
            for (int64_t h = 0; h < grp; h++) a[h] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                const __m512 kf = _mm512_mul_ps(load_i8(kr + c), _mm512_set1_ps(ksr[c / bs]));
                for (int64_t h = 0; h < grp; h++)
                    a[h] = _mm512_fmadd_ps(_mm512_load_ps(qf[h] + c), kf, a[h]);
            }
            for (int64_t h = 0; h < grp; h++) s[h * n + j] = _mm512_reduce_add_ps(a[h]) * scale;
            continue;
        }
#endif
        for (int64_t h = 0; h < grp; h++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++) dot += qf[h][i] * ((float)kr[i] * ksr[i / bs]);
            s[h * n + j] = dot * scale;
        }
    }
}

/* The float32 path: acc[h] = sum_j w[h * n + j] v_j for the n int8 value rows at slots
 * keys[] (times their blocks' scales vs, as the keys') */
static void values_f32(const int8_t *v, const float *vs, const int64_t *keys, int64_t n,
                       int64_t grp, int64_t d, int64_t stride, int64_t kvh, int64_t nb,
                       const float *w, float acc[][ATTN_MAX_DIM]) {
    const int64_t bs = d / nb;
    for (int64_t j = 0; j < n; j++) {
        const int8_t *vr = v + keys[j] * stride;
        const float *vsr = vs + keys[j] * kvh * nb;
        for (int64_t h = 0; h < grp; h++) {
            const float p = w[h * n + j];
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[h][i] += p * ((float)vr[i] * vsr[i / bs]);
        }
    }
}

#ifdef FAST
/* The int16 query heads q16 [grp, d] for scores_i16 (and each head's scale qs[h]): per 64
 * dims, the two vectors scores_i16 makes of a key's 64 int8, in their order (`lane_dim`). */
static inline int64_t lane_dim(int64_t t) {
    /* t < 32: the widened _mm256_unpacklo_epi16(A, B) of A = dims 0..31 and B = dims
     * 32..63, else of unpackhi: int16 t % 32 of 128-bit lane l holds word w's byte */
    const int64_t r = t % 32, l = r / 16, o = r % 16, w = o / 2;
    const int64_t k = w / 2 + (t >= 32 ? 4 : 0), from_b = w % 2;
    return from_b * 32 + 16 * l + 2 * k + o % 2;
}

static void queries_i16(const uint16_t *q, int64_t grp, int64_t d, int16_t *q16, float *qs) {
    int16_t order[64]; /* the int16 vectors' dims, as vpermt2w indices into 64 int16 */
    for (int t = 0; t < 64; t++) order[t] = (int16_t)lane_dim(t);
    const __m512i i0 = _mm512_loadu_si512(order), i1 = _mm512_loadu_si512(order + 32);
    for (int64_t h = 0; h < grp; h++) {
        const uint16_t *qh = q + h * d;
        __m512 m = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load_bf16(qh + c)));
        const float mx = _mm512_reduce_max_ps(m);
        const __m512 f = _mm512_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
        qs[h] = mx / 32767.0f;
        for (int64_t c = 0; c < d; c += 64) {
            __m256i x[4];
            for (int u = 0; u < 4; u++)
                x[u] = _mm512_cvtepi32_epi16(
                    _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(qh + c + 16 * u), f)));
            const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(x[0]), x[1], 1);
            const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(x[2]), x[3], 1);
            _mm512_storeu_si512(q16 + h * d + c, _mm512_permutex2var_epi16(a, i0, b));
            _mm512_storeu_si512(q16 + h * d + c + 32, _mm512_permutex2var_epi16(a, i1, b));
        }
    }
}

/* 4 vectors' sums, in one vector's first 4 lanes */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define HALVES(a)                                                                          \
    _mm256_add_ps(_mm512_castps512_ps256(a),                                               \
                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)))
    const __m256 x = _mm256_hadd_ps(HALVES(a0), HALVES(a1));
    const __m256 y = _mm256_hadd_ps(HALVES(a2), HALVES(a3));
#undef HALVES
    const __m256 z = _mm256_hadd_ps(x, y);
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

/* s[h * n + j] = scale * qs[h] * (q16_h . k_j), the int8 keys' blocks times their scales:
 * per 64 dims, blocks b and b + 1 interleaved a pair of dims at a time (even int32 lanes
 * b, odd b + 1), so one vector's sums take the two scales as one broadcast pair */
static void scores_i16(const int16_t *q16, const float *qs, const int8_t *k, const int8_t *v,
                       const float *ks, const int64_t *keys, int64_t n, int64_t grp,
                       int64_t d, int64_t stride, int64_t kvh, int64_t nb, float scale,
                       float *s) {
    for (int64_t h0 = 0; h0 < grp; h0 += 4) {
        const int64_t hb = grp - h0 < 4 ? grp - h0 : 4;
        const int16_t *qh = q16 + h0 * d;
        for (int64_t j = 0; j < n; j++) {
            const int8_t *kr = k + keys[j] * stride;
            const float *ksr = ks + keys[j] * kvh * nb;
            if (j + AHEAD < n) prefetch_row(k + keys[j + AHEAD] * stride, d);
            if (h0 == 0) prefetch_row(v + keys[j] * stride, d);
            __m512 a[4];
            for (int h = 0; h < 4; h++) a[h] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 64) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(kr + c));
                const __m256i hi = _mm256_loadu_si256((const __m256i *)(kr + c + 32));
                const __m512i x0 = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi16(lo, hi));
                const __m512i x1 = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi16(lo, hi));
                double two; /* the scales of blocks b and b + 1 */
                memcpy(&two, ksr + c / 32, sizeof two);
                const __m512 sc = _mm512_castpd_ps(_mm512_set1_pd(two));
                for (int h = 0; h < 4; h++) {
                    if (h >= hb) break;
                    const int16_t *qc = qh + h * d + c;
                    __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), x0,
                                                    _mm512_loadu_si512(qc));
                    p = _mm512_dpwssd_epi32(p, x1, _mm512_loadu_si512(qc + 32));
                    a[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, a[h]);
                }
            }
            if (hb == 4) {
                float t[4];
                _mm_storeu_ps(t, sum4(a[0], a[1], a[2], a[3]));
                for (int h = 0; h < 4; h++) s[(h0 + h) * n + j] = t[h] * qs[h0 + h] * scale;
            } else {
                for (int64_t h = 0; h < hb; h++)
                    s[(h0 + h) * n + j] = _mm512_reduce_add_ps(a[h]) * qs[h0 + h] * scale;
            }
        }
    }
}

/* acc[h] = sum_j p[h * n + j] v_j over the n int8 value rows at slots keys[] with their
 * scales vs: each weight p_hj * vs_jb rounded to int16 in units of u[h] (the largest of
 * them over 32767), two keys' weights in one int32, their rows' bytes interleaved
 * (vpunpck{l,h}bw: lanes of dims 0..7 and 16..23, 8..15 and 24..31 of a block) */
static void values_i16(const int8_t *v, const float *vs, const int64_t *keys, int64_t n,
                       int64_t grp, int64_t d, int64_t stride, int64_t kvh, int64_t nb,
                       const float *p, float *vmax, int32_t *wq, float acc[][ATTN_MAX_DIM]) {
    float u[ATTN_MAX_GROUP], inv[ATTN_MAX_GROUP];
    const __mmask16 nbm = (__mmask16)((1u << nb) - 1);
    for (int64_t j = 0; j < n; j++)
        vmax[j] = _mm512_mask_reduce_max_ps(nbm, _mm512_maskz_loadu_ps(nbm, vs + keys[j] * kvh * nb));
    for (int64_t h = 0; h < grp; h++) {
        float m = 0.0f;
        for (int64_t j = 0; j < n; j++) m = fmaxf(m, p[h * n + j] * vmax[j]);
        u[h] = m / 32767.0f;
        inv[h] = m > 0.0f ? 32767.0f / m : 0.0f;
    }
    for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
        const int64_t pairs = ((n - j0 < CHUNK ? n - j0 : CHUNK) + 1) / 2;
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t ja = j0 + 2 * i, jb = ja + 1 < n ? ja + 1 : ja;
            const __m512 sa = _mm512_maskz_loadu_ps(nbm, vs + keys[ja] * kvh * nb);
            const __m512 sb = _mm512_maskz_loadu_ps(nbm, vs + keys[jb] * kvh * nb);
            for (int64_t h = 0; h < grp; h++) {
                const float wa = p[h * n + ja] * inv[h], wb = jb > ja ? p[h * n + jb] * inv[h] : 0.0f;
                const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(sa, _mm512_set1_ps(wa)));
                const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(sb, _mm512_set1_ps(wb)));
                const __m512i w = _mm512_mask_blend_epi16(0xAAAAAAAAu, qa, _mm512_slli_epi32(qb, 16));
                _mm512_mask_storeu_epi32(wq + (i * grp + h) * nb, nbm, w);
            }
        }
        for (int64_t h0 = 0; h0 < grp; h0 += 4) {
            const int64_t hb = grp - h0 < 4 ? grp - h0 : 4;
            for (int64_t c = 0; c < d; c += 32) {
                const int64_t b = c / 32;
                __m512i lo[4], hi[4];
                for (int h = 0; h < 4; h++) lo[h] = hi[h] = _mm512_setzero_si512();
                for (int64_t i = 0; i < pairs; i++) {
                    const int64_t ja = j0 + 2 * i, jb = ja + 1 < n ? ja + 1 : ja;
                    const __m256i ra = _mm256_loadu_si256((const __m256i *)(v + keys[ja] * stride + c));
                    const __m256i rb = _mm256_loadu_si256((const __m256i *)(v + keys[jb] * stride + c));
                    const __m512i xl = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(ra, rb));
                    const __m512i xh = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(ra, rb));
                    const int32_t *wi = wq + (i * grp + h0) * nb + b;
                    for (int h = 0; h < 4; h++) {
                        if (h >= hb) break;
                        const __m512i w = _mm512_set1_epi32(wi[h * nb]);
                        lo[h] = _mm512_dpwssd_epi32(lo[h], xl, w);
                        hi[h] = _mm512_dpwssd_epi32(hi[h], xh, w);
                    }
                }
                for (int64_t h = 0; h < hb; h++) { /* back to dim order: 0..15, 16..31 */
                    const __m512 f = _mm512_set1_ps(u[h0 + h]);
                    float *o = acc[h0 + h] + c;
                    const __m512i d0 = _mm512_shuffle_i64x2(lo[h], hi[h], 0x44);
                    const __m512i d1 = _mm512_shuffle_i64x2(lo[h], hi[h], 0xEE);
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), f, _mm512_loadu_ps(o)));
                    _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), f,
                                                             _mm512_loadu_ps(o + 16)));
                }
            }
        }
    }
}
#endif

/* sequence r's query heads of KV head g */
static void one_q8(const void *arg, int64_t r, int64_t g, void *scratch) {
    const dec_t *a = arg;
    const int64_t grp = a->grp, d = a->d, l = a->l, nb = a->nb, kvh = a->kvh, stride = kvh * d;
    const uint16_t *q = a->q + r * a->q_stride + g * grp * d;
    const int8_t *k = a->k + g * d, *v = a->v + g * d;
    const float *ks = a->ks + g * nb, *vs = a->vs + g * nb;
    const uint8_t *mask = a->mask ? a->mask + r * l : NULL;
    const float *sinks = a->sinks ? a->sinks + g * grp : NULL;
    const int64_t *slots = a->slots + r * l;
    uint16_t *out = a->out + r * a->h * d + g * grp * d;
    const scratch_t sc = carve(scratch, l, grp, d, nb);
    float *s = sc.s;
    float acc[ATTN_MAX_GROUP][ATTN_MAX_DIM];
    float mx[ATTN_MAX_GROUP], sum[ATTN_MAX_GROUP];
    int64_t n = 0; /* the attended keys' slots, in order */
    for (int64_t j = 0; j < l; j++)
        if (!mask || mask[j]) sc.keys[n++] = slots[j];
    for (int64_t h = 0; h < grp; h++) {
        mx[h] = sinks ? sinks[h] : -INFINITY;
        for (int64_t i = 0; i < d; i++) acc[h][i] = 0.0f;
    }
#ifdef FAST
    float qs[ATTN_MAX_GROUP];
    if (a->fast) {
        queries_i16(q, grp, d, sc.q16, qs);
        scores_i16(sc.q16, qs, k, v, ks, sc.keys, n, grp, d, stride, kvh, nb, a->scale, s);
    } else
#endif
    {
        float qf[ATTN_MAX_GROUP][ATTN_MAX_DIM] __attribute__((aligned(64)));
        for (int64_t h = 0; h < grp; h++)
            for (int64_t i = 0; i < d; i++) qf[h][i] = bf16_to_f32(q[h * d + i]);
        scores_f32(qf, k, v, ks, sc.keys, n, grp, d, stride, kvh, nb, a->scale, s);
    }
    for (int64_t h = 0; h < grp; h++) {
        for (int64_t j = 0; j < n; j++)
            if (s[h * n + j] > mx[h]) mx[h] = s[h * n + j];
        sum[h] = exp_minus(s + h * n, n, mx[h]);
    }
#ifdef FAST
    if (a->fast)
        values_i16(v, vs, sc.keys, n, grp, d, stride, kvh, nb, s, sc.vmax, sc.wq, acc);
    else
#endif
        values_f32(v, vs, sc.keys, n, grp, d, stride, kvh, nb, s, acc);
    for (int64_t h = 0; h < grp; h++) {
        if (sinks) sum[h] += expf(sinks[h] - mx[h]);
        const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
        for (int64_t i = 0; i < d; i++) out[h * d + i] = f32_to_bf16(acc[h][i] * inv);
    }
}

int decode_attention_q8_int16(int64_t d, int64_t nb) {
#ifdef FAST
    return d % 64 == 0 && nb * 32 == d;
#else
    (void)d;
    (void)nb;
    return 0;
#endif
}

int decode_attention_q8(const uint16_t *q, int64_t q_stride, const int8_t *k, const int8_t *v,
                        const float *k_scale, const float *v_scale, const int64_t *slots,
                        const uint8_t *mask, const float *sinks, uint16_t *out, int64_t b,
                        int64_t h, int64_t kvh, int64_t d, int64_t nb, int64_t l, float scale,
                        int threads) {
    const int64_t grp = h / kvh;
    if (grp > ATTN_MAX_GROUP || d > ATTN_MAX_DIM || grp * kvh != h || nb < 1 || d % nb)
        return -1;
    const int fast = decode_attention_q8_int16(d, nb);
    const dec_t a = {q, k, v, k_scale, v_scale, slots, mask, sinks, out, q_stride, h, kvh,
                     grp, d, nb, l, scale, fast};
    return decode_jobs(b, kvh, l, d, (size_t)scratch_bytes(l, grp, d, nb), threads, one_q8, &a);
}
