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

#define NOISE_MAX 22.18070977791825 /* 32 log 2 */

static inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

static inline uint32_t hash(uint32_t prefix, uint32_t token) {
    uint32_t k = token * 0xCC9E2D51u;
    k = rotl(k, 15) * 0x1B873593u;
    uint32_t h = rotl(prefix ^ k, 13) * 5u + 0xE6546B64u;
    h ^= 16u; /* four blocks of 4 bytes */
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

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
        int64_t n = 0;
        for (int64_t i = 0; i < vocab; i++) {
            if (!(x[i] >= skip)) continue; /* NaN too: the caller's argmax sees it */
            const double d = b - (double)(x[i] / t);
            if (!(d <= NOISE_MAX + 1e-9)) continue;
            if (d > GUMBEL_LOW && hash(p, (uint32_t)i) < high) continue;
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
