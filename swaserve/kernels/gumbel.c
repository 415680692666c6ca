/* The sampler's keyed Gumbel-max (sampling/sampler.py `_seeded_gumbel_max`): which ids of a
 * row could still win, so that only those get their exact score in float64.
 *
 * A keyed row's noise for id t is g_t = -log(max(-log u, 2^-32)), u = h_t / (2^32 - 1),
 * h_t the MurmurHash3 x86_32 of (seed_lo, seed_hi, position, t) (sampling/murmur.py: the
 * row's state after the first three blocks is its `prefix`). Its token is the argmax of
 * x_t + g_t, x_t = float32(logits_t / temperature). Given a score the row already reaches
 * (`best`: its largest logit's x + g), id t can only reach it if g_t >= best - x_t =: d:
 * never past NOISE_MAX (22.18, the clamp), and past GUMBEL_LOW only if h_t is at least
 * GUMBEL_HIGH_HASH (u >= exp(-e^-LOW), less a margin). So an id is a candidate when d is
 * at most LOW, or at most NOISE_MAX with such a hash: on the real model's logits at
 * temperature 1 a row keeps ~30 of the ~25,000 ids the bound alone keeps (hashed in torch,
 * ~1.8 ms a row), and every id that could win. A logit far below the band is passed over
 * with one comparison. The exact scores stay with the caller (the same torch arithmetic
 * as hashing every id). Rows split over the threads, each its own slice of the output. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "murmur.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* 0, or -1 when a row has more than `cap` candidates (then nothing is to be read) */
int gumbel_candidates(const float *logits, int64_t rows, int64_t vocab, const float *temp,
                      const double *best, const int64_t *prefix, int64_t cap, int64_t *out_tok,
                      int64_t *count, int threads) {
    /* the least hash whose noise can exceed GUMBEL_LOW, less a margin for the caller's
     * float64 rounding of u and the logs */
    const double u_low = exp(-exp(-(double)GUMBEL_LOW));
    const uint32_t high = (uint32_t)(floor(u_low * 4294967295.0) - 64.0);
    int over = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        const float t = temp[r];
        const double b = best[r];
        const uint32_t p = (uint32_t)prefix[r];
        /* below this a logit's x is past NOISE_MAX under the best for certain (a margin of
         * 2^-20 past float32's rounding of x): one comparison for most ids, no division */
        const float skip = (float)((b - NOISE_MAX - (fabs(b) + NOISE_MAX + 1.0) * 0x1p-20) * t);
        int64_t n = 0, i = 0;
#ifdef __AVX512F__
        /* 16 ids at a time: the same tests as the loop below, lane by lane */
        const __m512 skipv = _mm512_set1_ps(skip), tv = _mm512_set1_ps(t);
        const __m512d bv = _mm512_set1_pd(b), lowv = _mm512_set1_pd(GUMBEL_LOW),
                      maxv = _mm512_set1_pd(NOISE_MAX + 1e-9);
        const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (; i + 16 <= vocab && !over; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i);
            const __mmask16 live = _mm512_cmp_ps_mask(xv, skipv, _CMP_GE_OQ);
            if (!live) continue;
            const __m512 q = _mm512_div_ps(xv, tv);
            const __m512d dlo = _mm512_sub_pd(bv, _mm512_cvtps_pd(_mm512_castps512_ps256(q)));
            const __m512d dhi = _mm512_sub_pd(bv, _mm512_cvtps_pd(_mm256_castpd_ps(
                _mm512_extractf64x4_pd(_mm512_castps_pd(q), 1))));
            const __mmask16 near = (__mmask16)(_mm512_cmp_pd_mask(dlo, lowv, _CMP_LE_OQ) |
                                               (_mm512_cmp_pd_mask(dhi, lowv, _CMP_LE_OQ) << 8));
            const __mmask16 band = (__mmask16)(_mm512_cmp_pd_mask(dlo, maxv, _CMP_LE_OQ) |
                                               (_mm512_cmp_pd_mask(dhi, maxv, _CMP_LE_OQ) << 8));
            const __m512i ids = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i));
            const __m512i h = murmur_tokens16(p, ids);
            const __mmask16 loud = _mm512_cmp_epu32_mask(h, _mm512_set1_epi32((int)high), _MM_CMPINT_NLT);
            const __mmask16 keep = live & (near | (band & loud));
            if (!keep) continue;
            const int c = __builtin_popcount(keep);
            if (n + c > cap) {
#pragma omp atomic write
                over = 1;
                break;
            }
            _mm512_mask_compressstoreu_epi64(out_tok + r * cap + n, (__mmask8)keep,
                                             _mm512_cvtepi32_epi64(_mm512_castsi512_si256(ids)));
            n += __builtin_popcount(keep & 0xff);
            _mm512_mask_compressstoreu_epi64(out_tok + r * cap + n, (__mmask8)(keep >> 8),
                                             _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(ids, 1)));
            n += __builtin_popcount(keep >> 8);
        }
#endif
        for (; i < vocab && !over; i++) {
            if (!(x[i] >= skip)) continue; /* NaN too: the caller's argmax sees it */
            const double d = b - (double)(x[i] / t);
            if (!(d <= NOISE_MAX + 1e-9)) continue;
            if (d > GUMBEL_LOW && murmur_token(p, (uint32_t)i) < high) continue;
            if (n == cap) {
#pragma omp atomic write
                over = 1;
                break;
            }
            out_tok[r * cap + n++] = i;
        }
        count[r] = n;
    }
    return over ? -1 : 0;
}
