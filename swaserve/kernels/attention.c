/* Decode attention on bf16 caches: one query per sequence, keys read in place.
 *
 * For sequence b and key/value head g, the G = H / KVH query heads of g attend the keys at
 * cache slots slots[b, 0..L) (rows of the pool [S, KVH, D], wherever the ring or the pages
 * put them), skipping those whose mask entry is 0:
 *   s_j = scale * q . k_j,  p_j = exp(s_j - max) / (sum_j exp(s_j - max) [+ exp(sink - max)])
 *   out = bf16(sum_j p_j v_j)
 * all in float32 from the bf16 values. torch's SDPA first gathers the keys of every
 * sequence into a padded copy and runs a blocked kernel sized for long queries, several
 * times what reading the keys in place takes for one query a sequence. The softmax
 * here is exact (two passes over the scores, no online rescaling), so a row's result
 * depends on its own keys only: never on the batch, the padding or the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "decode_jobs.h"
#include "kernels.h"
#include "softmax.h"

#ifdef __AVX512F__
#include "simd.h"
#endif

#define KB 8  /* keys converted to float32 together: each q and accumulator load serves 8 */

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

typedef struct { /* a call's arguments, for its jobs */
    const uint16_t *q, *k, *v;
    const int64_t *slots;
    const uint8_t *mask;
    const float *sinks;
    uint16_t *out;
    int64_t q_stride, h, kvh, grp, d, l;
    float scale;
} dec_t;

/* sequence r's query heads of KV head g; scratch: the keys' slots [l], the scores [grp, l] */
static void one(const void *arg, int64_t r, int64_t g, void *scratch) {
    const dec_t *a = arg;
    const int64_t grp = a->grp, d = a->d, l = a->l, slot_stride = a->kvh * d;
    const uint16_t *q = a->q + r * a->q_stride + g * grp * d, *k = a->k + g * d,
                   *v = a->v + g * d;
    const uint8_t *mask = a->mask ? a->mask + r * l : NULL;
    const float *sinks = a->sinks ? a->sinks + g * grp : NULL;
    const int64_t *slots = a->slots + r * l;
    uint16_t *out = a->out + r * a->h * d + g * grp * d;
    int64_t *keys = scratch;
    float *s = (float *)(keys + (l > 0 ? l : 1));
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
    scores(q, qf, k, v, keys, n, grp, d, slot_stride, a->scale, s, blk);
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
    const int64_t grp = h / kvh;
    if (grp > ATTN_MAX_GROUP || d > ATTN_MAX_DIM || grp * kvh != h) return -1;
    const dec_t a = {q, k, v, slots, mask, sinks, out, q_stride, h, kvh, grp, d, l, scale};
    const int64_t keys = l > 0 ? l : 1;
    return decode_jobs(b, kvh, l, d, sizeof(float) * (size_t)(grp * keys)
                       + sizeof(int64_t) * (size_t)keys, threads, one, &a);
}

/* Prompt attention on bf16 (AVX-512 BF16): many queries of one sequence over its keys.
 *
 * Without AMX, torch's CPU flash kernel runs such a layer far below VDPBF16PS's rate
 * (it is built for AMX tiles or float32 FMAs). Here the keys and values are
 * first laid out in VDPBF16PS's pair order (a key block's 16 keys as the lanes and the
 * dims in pairs, for q . k; the values' 16 dims as the lanes and the keys in pairs, for
 * p . v), then a tile of up to PA_ROWS (query, head) rows of one key/value head runs over
 * the key blocks its mask leaves any key of: scores in registers, an online softmax in
 * float32 (p rounded once to bf16 for p . v, as torch's bf16 flash does), the output
 * sums in float32 beside it. A row's result depends on its own query and keys only. */
#if defined(__AVX512BF16__)
#define PA_ROWS 12 /* (query, head) rows a tile keeps in registers */
#define PA_KEYS 16 /* keys a block: one vector of scores */

typedef struct {
    const uint16_t *q, *kt, *v2; /* q [n, H, D]; kt, v2: one key/value head's packing */
    const uint8_t *mask;         /* [n, L] or NULL: causal, query i sees keys up to L - n + i */
    const float *sinks;          /* [H] or NULL: a logit per head in each denominator */
    uint16_t *out;               /* [n, H, D] */
    int64_t n, l, lpad, h, grp, d;
    float scale;
} pa_t;

/* the keys of block kb query qi attends: bit j for key kb * 16 + j */
static inline __mmask16 pa_live(const pa_t *a, int64_t qi, int64_t kb) {
    const int64_t k0 = kb * PA_KEYS;
    if (!a->mask) {
        const int64_t last = a->l - a->n + qi; /* the last key this query sees */
        if (last < k0) return 0;
        return last - k0 >= PA_KEYS - 1 ? (__mmask16)0xffff : (__mmask16)((1u << (last - k0 + 1)) - 1);
    }
    const int64_t left = a->l - k0;
    const __mmask16 in = left >= PA_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __m128i m = _mm_maskz_loadu_epi8(in, a->mask + qi * a->l + k0);
    return _mm_test_epi8_mask(m, m);
}

static inline __attribute__((always_inline)) void pa_tile(const pa_t *a, int64_t g, int64_t t0,
                                                          const int R) {
    const int64_t d = a->d, pairs = d / 2, nkb = a->lpad / PA_KEYS;
    const int32_t *qr[PA_ROWS];
    int64_t qi[PA_ROWS];
    for (int r = 0; r < R; r++) { /* row t = query t / grp, head g * grp + t % grp */
        const int64_t t = t0 + r;
        qi[r] = t / a->grp;
        qr[r] = (const int32_t *)(a->q + (qi[r] * a->h + g * a->grp + t % a->grp) * d);
    }
    float o[PA_ROWS][ATTN_MAX_DIM] __attribute__((aligned(64)));
    float mx[PA_ROWS], sum[PA_ROWS], corr[PA_ROWS];
    int32_t pb[PA_ROWS][PA_KEYS / 2]; /* each row's p of the block, bf16 pairs of keys */
    for (int r = 0; r < R; r++) {
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
        for (int64_t c = 0; c < d; c += 16) _mm512_store_ps(o[r] + c, _mm512_setzero_ps());
    }
    for (int64_t kb = 0; kb < nkb; kb++) {
        __mmask16 live[PA_ROWS], any = 0;
        for (int r = 0; r < R; r++) any |= live[r] = pa_live(a, qi[r], kb);
        if (!any) continue;
        const uint16_t *kt = a->kt + kb * pairs * PA_KEYS * 2;
        __m512 s[PA_ROWS];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh kv = (__m512bh)_mm512_load_si512((const void *)(kt + p * PA_KEYS * 2));
            for (int r = 0; r < R; r++)
                s[r] = _mm512_dpbf16_ps(s[r], kv, (__m512bh)_mm512_set1_epi32(qr[r][p]));
        }
        for (int r = 0; r < R; r++) {
            if (!live[r]) { /* nothing of this block for this row: p = 0, no rescaling */
                corr[r] = 1.0f;
                for (int j = 0; j < PA_KEYS / 2; j++) pb[r][j] = 0;
                continue;
            }
            const __m512 sc = _mm512_mul_ps(s[r], _mm512_set1_ps(a->scale));
            const float bm = _mm512_mask_reduce_max_ps(live[r], sc);
            const float m = bm > mx[r] ? bm : mx[r];
            corr[r] = mx[r] == -INFINITY ? 0.0f : expf(mx[r] - m);
            mx[r] = m;
            const __m512 e = _mm512_maskz_mov_ps(live[r], exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
            sum[r] = sum[r] * corr[r] + _mm512_reduce_add_ps(e);
            _mm256_storeu_si256((__m256i *)pb[r], (__m256i)_mm512_cvtneps_pbh(e));
        }
        const uint16_t *v2 = a->v2 + kb * (PA_KEYS / 2) * d * 2;
        for (int64_t c = 0; c < d; c += 16) {
            __m512 acc[PA_ROWS];
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_mul_ps(_mm512_load_ps(o[r] + c), _mm512_set1_ps(corr[r]));
            for (int j = 0; j < PA_KEYS / 2; j++) {
                const __m512bh vv = (__m512bh)_mm512_load_si512((const void *)(v2 + (j * d + c) * 2));
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], vv, (__m512bh)_mm512_set1_epi32(pb[r][j]));
            }
            for (int r = 0; r < R; r++) _mm512_store_ps(o[r] + c, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t t = t0 + r, head = g * a->grp + t % a->grp;
        uint16_t *dst = a->out + (qi[r] * a->h + head) * d;
        float norm = sum[r];
        if (a->sinks) { /* the sink's mass joins the denominator only: o scaled, not added to */
            const float sk = a->sinks[head], m = sk > mx[r] ? sk : mx[r];
            const float c = mx[r] == -INFINITY ? 0.0f : expf(mx[r] - m);
            norm = sum[r] * c + expf(sk - m);
            norm = c > 0.0f ? norm / c : INFINITY; /* o / (norm / c) = o * c / norm */
        }
        const __m512 inv = _mm512_set1_ps(norm > 0.0f ? 1.0f / norm : 0.0f);
        for (int64_t c = 0; c < d; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c), to_bf16(_mm512_mul_ps(_mm512_load_ps(o[r] + c), inv)));
    }
}

/* where a call's keys and values are: bf16 rows [L, KVH, D] (k8 NULL), or int8 pool rows
 * [S, KVH, D] at slots[0..L) with their scales [S, KVH, nb], packed as bf16(scale * int8): the
 * values torch's dequantization gives (memory/kv_quant.py), so both reads agree bit for bit */
typedef struct {
    const uint16_t *k, *v;
    const int8_t *k8, *v8;
    const float *ks, *vs;
    const int64_t *slots;
    int64_t nb;
} pa_src_t;

/* row `key` of head g as bf16 into dst[0..d) (zeros past L) */
static inline void pa_row(const pa_src_t *src, int kind, int64_t key, int64_t l, int64_t kvh,
                          int64_t d, int64_t g, uint16_t *dst) {
    if (key >= l) {
        for (int64_t c = 0; c < d; c++) dst[c] = 0;
    } else if (!src->k8) {
        const uint16_t *r = (kind ? src->v : src->k) + (key * kvh + g) * d;
        for (int64_t c = 0; c < d; c++) dst[c] = r[c];
    } else {
        const int64_t at = src->slots[key] * kvh + g, bs = d / src->nb;
        const int8_t *r = (kind ? src->v8 : src->k8) + at * d;
        const float *f = (kind ? src->vs : src->ks) + at * src->nb;
        for (int64_t c = 0; c < d; c++) dst[c] = f32_to_bf16((float)r[c] * f[c / bs]);
    }
}

/* key block kb of head g: kt [pairs][16 keys][2 dims], v2 [8 key pairs][D][2 keys] (keys
 * past L as zeros) */
static void pa_pack(const pa_src_t *src, int64_t l, int64_t kvh, int64_t d, int64_t g,
                    int64_t kb, uint16_t *kt, uint16_t *v2) {
    const int64_t pairs = d / 2;
    uint16_t kr[ATTN_MAX_DIM], vr[ATTN_MAX_DIM];
    for (int j = 0; j < PA_KEYS; j++) {
        const int64_t key = kb * PA_KEYS + j;
        pa_row(src, 0, key, l, kvh, d, g, kr);
        pa_row(src, 1, key, l, kvh, d, g, vr);
        for (int64_t p = 0; p < pairs; p++) {
            kt[(p * PA_KEYS + j) * 2] = kr[2 * p];
            kt[(p * PA_KEYS + j) * 2 + 1] = kr[2 * p + 1];
        }
        for (int64_t c = 0; c < d; c++) v2[((j / 2) * d + c) * 2 + j % 2] = vr[c];
    }
}

#define PA_TILE_CASES(R)                                                     \
    switch (R) {                                                             \
    case 1: pa_tile(a, g, t0, 1); break;   case 2: pa_tile(a, g, t0, 2); break;   \
    case 3: pa_tile(a, g, t0, 3); break;   case 4: pa_tile(a, g, t0, 4); break;   \
    case 5: pa_tile(a, g, t0, 5); break;   case 6: pa_tile(a, g, t0, 6); break;   \
    case 7: pa_tile(a, g, t0, 7); break;   case 8: pa_tile(a, g, t0, 8); break;   \
    case 9: pa_tile(a, g, t0, 9); break;   case 10: pa_tile(a, g, t0, 10); break; \
    case 11: pa_tile(a, g, t0, 11); break; default: pa_tile(a, g, t0, 12); break; \
    }

static int pa_run(const uint16_t *q, const pa_src_t *src, const uint8_t *mask,
                  const float *sinks, uint16_t *out, int64_t n, int64_t l, int64_t h,
                  int64_t kvh, int64_t d, float scale, int threads) {
    const int64_t grp = h / kvh;
    if (n < 1 || l < 1 || grp * kvh != h || d % 16 || d > ATTN_MAX_DIM || (!mask && l < n))
        return -1;
    const int64_t lpad = (l + PA_KEYS - 1) / PA_KEYS * PA_KEYS, nkb = lpad / PA_KEYS;
    uint16_t *kt = aligned_alloc(64, (size_t)(kvh * lpad * d * 2) * 2);
    if (!kt) return -1;
    uint16_t *v2 = kt + kvh * lpad * d;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t job = 0; job < kvh * nkb; job++) {
        const int64_t g = job / nkb, kb = job % nkb;
        pa_pack(src, l, kvh, d, g, kb, kt + (g * lpad + kb * PA_KEYS) * d,
                v2 + (g * lpad + kb * PA_KEYS) * d);
    }
    const int64_t rows = n * grp, tiles = (rows + PA_ROWS - 1) / PA_ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < kvh * tiles; job++) {
        /* the last tiles first: causal rows near the end see the most keys */
        const int64_t g = job % kvh, t0 = (tiles - 1 - job / kvh) * PA_ROWS;
        const pa_t a0 = {q, kt + g * lpad * d, v2 + g * lpad * d, mask, sinks, out, n, l,
                         lpad, h, grp, d, scale};
        const pa_t *a = &a0;
        const int64_t left = rows - t0;
        PA_TILE_CASES(left < PA_ROWS ? left : PA_ROWS)
    }
    free(kt);
    return 0;
}

int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const uint8_t *mask, const float *sinks, uint16_t *out, int64_t n,
                           int64_t l, int64_t h, int64_t kvh, int64_t d, float scale,
                           int threads) {
    const pa_src_t src = {k, v, NULL, NULL, NULL, NULL, NULL, 1};
    return pa_run(q, &src, mask, sinks, out, n, l, h, kvh, d, scale, threads);
}

int prefill_attention_q8(const uint16_t *q, const int8_t *k, const int8_t *v,
                         const float *k_scale, const float *v_scale, const int64_t *slots,
                         const uint8_t *mask, const float *sinks, uint16_t *out, int64_t n,
                         int64_t l, int64_t h, int64_t kvh, int64_t d, int64_t nb, float scale,
                         int threads) {
    if (nb < 1 || d % nb) return -1;
    const pa_src_t src = {NULL, NULL, k, v, k_scale, v_scale, slots, nb};
    return pa_run(q, &src, mask, sinks, out, n, l, h, kvh, d, scale, threads);
}
#undef PA_TILE_CASES
#else
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const uint8_t *mask, const float *sinks, uint16_t *out, int64_t n,
                           int64_t l, int64_t h, int64_t kvh, int64_t d, float scale,
                           int threads) {
    (void)q; (void)k; (void)v; (void)mask; (void)sinks; (void)out; (void)n; (void)l; (void)h; (void)kvh;
    (void)d; (void)scale; (void)threads;
    return -2; /* no AVX-512 BF16 on this machine */
}

int prefill_attention_q8(const uint16_t *q, const int8_t *k, const int8_t *v,
                         const float *k_scale, const float *v_scale, const int64_t *slots,
                         const uint8_t *mask, const float *sinks, uint16_t *out, int64_t n,
                         int64_t l, int64_t h, int64_t kvh, int64_t d, int64_t nb, float scale,
                         int threads) {
    (void)q; (void)k; (void)v; (void)k_scale; (void)v_scale; (void)slots; (void)mask;
    (void)sinks; (void)out; (void)n; (void)l; (void)h; (void)kvh; (void)d; (void)nb; (void)scale;
    (void)threads;
    return -2;
}
#endif
