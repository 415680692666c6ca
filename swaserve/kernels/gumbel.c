/* The sampler's keyed Gumbel-max (sampling/sampler.py `_seeded_gumbel_max`, `_draw_nucleus`):
 * which ids of a row could still win, so that only those get their exact score in float64.
 *
 * A keyed row's noise for id t is g_t = -log(max(-log u, 2^-32)), u = h_t / (2^32 - 1),
 * h_t the MurmurHash3 x86_32 of (seed_lo, seed_hi, position, t) (kernels/murmur.py: the
 * row's state after the first three blocks is its `prefix`). Its token is the argmax of
 * x_t + g_t, x_t = float32(logits_t / temperature). Given a score the row already reaches
 * (`best`: its largest logit's x + g), id t can only reach it if g_t >= best - x_t =: d:
 * never past NOISE_MAX (22.18, the clamp), and past GUMBEL_LOW only if h_t is at least
 * GUMBEL_HIGH_HASH (u >= exp(-e^-LOW), less a margin). So an id is a candidate when d is
 * at most LOW, or at most NOISE_MAX with such a hash: a few dozen ids a row at
 * temperature 1 where the bound alone keeps tens of thousands, and every id that could
 * win. A logit far below the band is passed over
 * with one comparison. The exact scores stay with the caller (the same torch arithmetic
 * as hashing every id). Rows split over the threads, each its own slice of the output.
 *
 * A filtering row (top-k, top-p, min-p) draws the same way from its kept set, found here
 * without sorting the vocabulary: its ids in the order (x descending, id ascending), the
 * first top_k of them, p_t = e^(x_t - m) / Z over those (m the largest x, Z the sum in
 * float64 of float32 e^(x - m)), an id kept while the mass strictly before it is under
 * top_p (the first always) and p_t >= min_p p_max (x_t - m >= log min_p in float64). The
 * kept set is a prefix of that order: one pass sums each bucket of 1/16 in x below m (its
 * ids and their mass), the bucket holding the top_k-th id and the one where the mass
 * reaches top_p Z are sorted alone, and the last kept id is the floor the candidate pass
 * keeps ids above. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "murmur.h"
#include "simd.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BUCKETS_PER_UNIT 16 /* a nucleus row's mass by x in buckets of 1/16 below its max */
#define SPAN_BUCKETS (24 * BUCKETS_PER_UNIT) /* 24 below the max: past it, e^-24 an id */
#define NEAR_BUCKETS (12 * BUCKETS_PER_UNIT) /* the buckets summed first */

typedef struct {
    float x;    /* x_t at the floor: ids with a larger x are kept, */
    int64_t id; /* and those with this x up to this id */
    double dx;  /* x_t - m at least this (min-p; -inf for none) */
    float m;    /* the row's largest x */
} floor_t;

static const floor_t NO_FLOOR = {-INFINITY, INT64_MAX, -INFINITY, 0.0f};

/* the least hash whose noise can exceed GUMBEL_LOW, less a margin for the caller's float64
 * rounding of u and the logs */
static uint32_t high_hash(void) {
    return (uint32_t)(floor(exp(-exp(-(double)GUMBEL_LOW)) * 4294967295.0) - 64.0);
}

static inline int kept(const floor_t *f, float q, int64_t id) {
    return (q > f->x || (q == f->x && id <= f->id)) && (double)q - (double)f->m >= f->dx;
}

/* row x (logits, temperature t, hash prefix p): the kept ids (floor f) whose score can reach
 * b, into out; their count, or -1 past cap */
static int64_t row_candidates(const float *x, int64_t vocab, float t, double b, uint32_t p,
                              const floor_t *f, uint32_t high, int64_t cap, int64_t *out) {
    /* below this a logit's x is past NOISE_MAX under the best for certain (a margin of
     * 2^-20 past float32's rounding of x): one comparison for most ids, no division */
    const float skip = (float)((b - NOISE_MAX - (fabs(b) + NOISE_MAX + 1.0) * 0x1p-20) * t);
    const int floored = f != &NO_FLOOR;
    int64_t n = 0, i = 0;
#ifdef __AVX512F__
    /* 16 ids at a time: the same tests as the loop below, lane by lane */
    const __m512 skipv = _mm512_set1_ps(skip), tv = _mm512_set1_ps(t);
    const __m512d bv = _mm512_set1_pd(b), lowv = _mm512_set1_pd(GUMBEL_LOW),
                  maxv = _mm512_set1_pd(NOISE_MAX + 1e-9);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 fx = _mm512_set1_ps(f->x);
    const __m512i fid = _mm512_set1_epi32(f->id < INT32_MAX ? (int)f->id : INT32_MAX);
    const __m512d fm = _mm512_set1_pd((double)f->m), fdx = _mm512_set1_pd(f->dx);
    for (; i + 16 <= vocab; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        __mmask16 live = _mm512_cmp_ps_mask(xv, skipv, _CMP_GE_OQ);
        if (!live) continue;
        const __m512 q = _mm512_div_ps(xv, tv);
        const __m512i ids = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i));
        const __m512d qlo = _mm512_cvtps_pd(_mm512_castps512_ps256(q));
        const __m512d qhi = _mm512_cvtps_pd(_mm256_castpd_ps(
            _mm512_extractf64x4_pd(_mm512_castps_pd(q), 1)));
        if (floored) { /* the lanes `kept` keeps */
            live &= _mm512_cmp_ps_mask(q, fx, _CMP_GT_OQ) |
                    (_mm512_cmp_ps_mask(q, fx, _CMP_EQ_OQ) &
                     _mm512_cmp_epi32_mask(ids, fid, _MM_CMPINT_LE));
            live &= (__mmask16)(_mm512_cmp_pd_mask(_mm512_sub_pd(qlo, fm), fdx, _CMP_GE_OQ) |
                                (_mm512_cmp_pd_mask(_mm512_sub_pd(qhi, fm), fdx, _CMP_GE_OQ) << 8));
            if (!live) continue;
        }
        const __m512d dlo = _mm512_sub_pd(bv, qlo), dhi = _mm512_sub_pd(bv, qhi);
        const __mmask16 near = (__mmask16)(_mm512_cmp_pd_mask(dlo, lowv, _CMP_LE_OQ) |
                                           (_mm512_cmp_pd_mask(dhi, lowv, _CMP_LE_OQ) << 8));
        const __mmask16 band = (__mmask16)(_mm512_cmp_pd_mask(dlo, maxv, _CMP_LE_OQ) |
                                           (_mm512_cmp_pd_mask(dhi, maxv, _CMP_LE_OQ) << 8));
        const __m512i h = murmur_tokens16(p, ids);
        const __mmask16 loud = _mm512_cmp_epu32_mask(h, _mm512_set1_epi32((int)high), _MM_CMPINT_NLT);
        const __mmask16 keep = live & (near | (band & loud));
        if (!keep) continue;
        if (n + __builtin_popcount(keep) > cap) return -1;
        _mm512_mask_compressstoreu_epi64(out + n, (__mmask8)keep,
                                         _mm512_cvtepi32_epi64(_mm512_castsi512_si256(ids)));
        n += __builtin_popcount(keep & 0xff);
        _mm512_mask_compressstoreu_epi64(out + n, (__mmask8)(keep >> 8),
                                         _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(ids, 1)));
        n += __builtin_popcount(keep >> 8);
    }
#endif
    for (; i < vocab; i++) {
        if (!(x[i] >= skip)) continue; /* NaN too: the caller's argmax sees it */
        const float q = x[i] / t;
        if (floored && !kept(f, q, i)) continue;
        const double d = b - (double)q;
        if (!(d <= NOISE_MAX + 1e-9)) continue;
        if (d > GUMBEL_LOW && murmur_token(p, (uint32_t)i) < high) continue;
        if (n == cap) return -1;
        out[n++] = i;
    }
    return n;
}

/* 0, or -1 when a row has more than `cap` candidates (then nothing is to be read) */
int gumbel_candidates(const float *logits, int64_t rows, int64_t vocab, const float *temp,
                      const double *best, const int64_t *prefix, int64_t cap, int64_t *out_tok,
                      int64_t *count, int threads) {
    const uint32_t high = high_hash();
    int over = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        count[r] = row_candidates(logits + r * vocab, vocab, temp[r], best[r],
                                  (uint32_t)prefix[r], &NO_FLOOR, high, cap, out_tok + r * cap);
        if (count[r] < 0) {
#pragma omp atomic write
            over = 1;
        }
    }
    return over ? -1 : 0;
}

typedef struct {
    float q;
    int64_t id;
    double e;
} entry_t;

static int by_order(const void *a, const void *b) { /* x descending, then id ascending */
    const entry_t *u = a, *v = b;
    if (u->q != v->q) return u->q > v->q ? -1 : 1;
    return (u->id > v->id) - (u->id < v->id);
}

static inline int bucket(float m, float q) { return (int)((m - q) * (float)BUCKETS_PER_UNIT); }

#ifdef __AVX512F__
static inline float exp1(float v) { return _mm512_cvtss_f32(exp16(_mm512_set1_ps(v))); }

/* mass[b] += e^(x - m) (float32, exp16) and ids[b] += 1 for row x's ids in buckets
 * [b0, b1); with `with_z` the sum of every id's e, else 0 */
static double add_masses(const float *x, int64_t vocab, float t, float m, int b0, int b1,
                         double *mass, int64_t *ids, int with_z) {
    const __m512 tv = _mm512_set1_ps(t), mv = _mm512_set1_ps(m);
    /* lanes whose bucket may be in range (each then checked one by one) */
    const __m512 above = _mm512_set1_ps(-(float)(b1 + 1) / BUCKETS_PER_UNIT);
    const __m512 below = _mm512_set1_ps(-(float)(b0 - 1) / BUCKETS_PER_UNIT);
    __m512d z0 = _mm512_setzero_pd(), z1 = z0;
    float e16[16];
    int64_t i = 0;
    for (; i + 16 <= vocab; i += 16) {
        const __m512 d = _mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), tv), mv);
        __mmask16 in = _mm512_cmp_ps_mask(d, above, _CMP_GT_OQ) &
                       _mm512_cmp_ps_mask(d, below, _CMP_LT_OQ);
        if (!in && !with_z) continue;
        const __m512 e = exp16(d);
        if (with_z) {
            z0 = _mm512_add_pd(z0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            z1 = _mm512_add_pd(z1, _mm512_cvtps_pd(_mm256_castpd_ps(
                _mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        }
        if (!in) continue;
        _mm512_storeu_ps(e16, e);
        for (; in; in &= in - 1) {
            const int lane = __builtin_ctz(in);
            const int b = bucket(m, x[i + lane] / t);
            if (b >= b0 && b < b1) mass[b] += e16[lane], ids[b]++;
        }
    }
    double z = _mm512_reduce_add_pd(_mm512_add_pd(z0, z1));
    for (; i < vocab; i++) {
        const float q = x[i] / t, e = exp1(q - m);
        const int b = bucket(m, q);
        z += e;
        if (q - m > -(float)SPAN_BUCKETS / BUCKETS_PER_UNIT && b >= b0 && b < b1)
            mass[b] += e, ids[b]++;
    }
    return with_z ? z : 0.0;
}

/* row x's ids in bucket `edge` (below its max m) in order, malloc'd, their count in *n;
 * NULL without memory */
static entry_t *bucket_entries(const float *x, int64_t vocab, float t, float m, int edge,
                               int64_t *n) {
    const __m512 tv = _mm512_set1_ps(t), mv = _mm512_set1_ps(m);
    const float low = -(float)SPAN_BUCKETS / BUCKETS_PER_UNIT;
    int64_t size = 256;
    entry_t *in = malloc((size_t)size * sizeof(entry_t));
    *n = 0;
    for (int64_t i = 0; in && i < vocab; i += 16) {
        /* the lanes in the bucket, 16 ids at a time (the last few one at a time) */
        __mmask16 at = 0;
        if (i + 16 <= vocab) {
            const __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + i), tv);
            const __m512i b = _mm512_cvttps_epi32(_mm512_mul_ps(
                _mm512_sub_ps(mv, q), _mm512_set1_ps((float)BUCKETS_PER_UNIT)));
            at = _mm512_cmp_ps_mask(_mm512_sub_ps(q, mv), _mm512_set1_ps(low), _CMP_GT_OQ) &
                 _mm512_cmp_epi32_mask(b, _mm512_set1_epi32(edge), _MM_CMPINT_EQ);
        } else {
            for (int64_t j = i; j < vocab; j++) {
                const float q = x[j] / t;
                at |= (__mmask16)((q - m > low && bucket(m, q) == edge) << (j - i));
            }
        }
        for (; at && in; at &= at - 1) {
            const int64_t j = i + __builtin_ctz(at);
            if (*n == size) {
                entry_t *more = realloc(in, (size_t)(size *= 2) * sizeof(entry_t));
                if (!more) free(in);
                in = more;
                if (!in) break;
            }
            const float q = x[j] / t;
            in[(*n)++] = (entry_t){q, j, exp1(q - m)};
        }
    }
    if (in) qsort(in, (size_t)*n, sizeof(entry_t), by_order);
    return in;
}

/* row x's floor (see the top) and its largest x's first id; 0, or -1 for a NaN, an infinite
 * largest x, a kept set past the buckets or no memory (the caller's path then) */
static int nucleus_floor(const float *x, int64_t vocab, float t, int64_t top_k, float top_p,
                         float min_p, floor_t *f, int64_t *top) {
    const __m512 tv = _mm512_set1_ps(t);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= vocab; i += 16) {
        const __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + i), tv);
        nan |= _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, q);
    }
    float m = _mm512_reduce_max_ps(mv);
    for (int64_t j = i; j < vocab; j++) {
        const float q = x[j] / t;
        nan |= q != q;
        m = q > m ? q : m;
    }
    if (nan || !isfinite(m)) return -1;
    for (i = 0, *top = -1; i + 16 <= vocab && *top < 0; i += 16) {
        const __mmask16 at = _mm512_cmp_ps_mask(_mm512_div_ps(_mm512_loadu_ps(x + i), tv),
                                                _mm512_set1_ps(m), _CMP_EQ_OQ);
        if (at) *top = i + __builtin_ctz(at);
    }
    for (i = *top < 0 ? i : vocab; i < vocab && *top < 0; i++)
        if (x[i] / t == m) *top = i;
    *f = (floor_t){-INFINITY, INT64_MAX, min_p > 0.0f ? log((double)min_p) : -INFINITY, m};
    const int by_k = top_k < vocab, by_p = top_p < 1.0f;
    if (!by_k && !by_p) return 0;
    /* z: every id's e; the buckets' masses and ids down to NEAR_BUCKETS first (at
     * temperature 1 a real model's nucleus at top-p .95 ends within them, a small part of
     * the span's ids), the rest when a walk gets there */
    double mass[SPAN_BUCKETS] = {0};
    int64_t ids[SPAN_BUCKETS] = {0};
    double z = add_masses(x, vocab, t, m, 0, NEAR_BUCKETS, mass, ids, !by_k);
    int far = 0;
    /* top-k: the k-th id's bucket, sorted; the set's mass z (its first `left` ids) */
    entry_t *edge = 0;
    int64_t n = 0, left = 0;
    int at = -1;
    if (by_k) {
        double before = 0.0;
        int64_t seen = 0;
        for (int b = 0; b < SPAN_BUCKETS && at < 0; b++) {
            if (b == NEAR_BUCKETS && !far++)
                add_masses(x, vocab, t, m, NEAR_BUCKETS, SPAN_BUCKETS, mass, ids, 0);
            if (seen + ids[b] >= top_k) at = b;
            else seen += ids[b], before += mass[b];
        }
        if (at < 0 || !(edge = bucket_entries(x, vocab, t, m, at, &n))) return -1;
        left = top_k - seen;
        if (left > n) { /* the two passes disagree on the bucket: never, but not past it */
            free(edge);
            return -1;
        }
        for (int64_t j = 0; j < left; j++) before += edge[j].e;
        z = before;
        f->x = edge[left - 1].q;
        f->id = edge[left - 1].id;
    }
    if (by_p) { /* the last id whose mass before is under top_p z, within the top-k set */
        const double target = (double)top_p * z;
        double before = 0.0;
        int b = 0;
        for (; b < SPAN_BUCKETS && b != at; b++) {
            if (b == NEAR_BUCKETS && !far++)
                add_masses(x, vocab, t, m, NEAR_BUCKETS, SPAN_BUCKETS, mass, ids, 0);
            if (before + mass[b] >= target) break;
            before += mass[b];
        }
        if (b == SPAN_BUCKETS) { /* mass past the buckets counts: the caller sorts */
            free(edge);
            return -1;
        }
        if (b != at) { /* an earlier bucket than the k-th id's (or no top-k) */
            free(edge);
            edge = bucket_entries(x, vocab, t, m, b, &n);
            if (!edge) return -1;
            left = n;
        }
        for (int64_t j = 0; j < left && before < target; j++) { /* the first always */
            f->x = edge[j].q;
            f->id = edge[j].id;
            before += edge[j].e;
        }
    }
    free(edge);
    return 0;
}
#else
static int nucleus_floor(const float *x, int64_t vocab, float t, int64_t top_k, float top_p,
                         float min_p, floor_t *f, int64_t *top) {
    (void)x; (void)vocab; (void)t; (void)top_k; (void)top_p; (void)min_p; (void)f; (void)top;
    return -1; /* the exponential is exp16's: AVX-512 only */
}
#endif

/* per row: count[r] candidates in out_tok[r * cap ...], or -1 where the row is left to the
 * caller (see nucleus_floor, or past cap) */
int nucleus_candidates(const float *logits, const int64_t *rows, int64_t nrows, int64_t vocab,
                       const float *temp, const int64_t *top_k, const float *top_p,
                       const float *min_p, const int64_t *prefix, int64_t cap, int64_t *out_tok,
                       int64_t *count, int threads) {
    const uint32_t high = high_hash();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (nrows > 1)
    for (int64_t r = 0; r < nrows; r++) {
        const float *x = logits + rows[r] * vocab;
        floor_t f;
        int64_t top;
        count[r] = -1;
        if (nucleus_floor(x, vocab, temp[r], top_k[r], top_p[r], min_p[r], &f, &top) != 0)
            continue;
        const uint32_t p = (uint32_t)prefix[r];
        /* a score the row reaches (its largest x is kept), less a margin for libm's logs
         * against the caller's */
        const double u = (double)murmur_token(p, (uint32_t)top) / 4294967295.0;
        const double g = -log(fmax(-log(u), 0x1p-32));
        const double b = (double)f.m + g;
        count[r] = row_candidates(x, vocab, temp[r], b - (fabs(b) + 1.0) * 0x1p-30, p, &f, high,
                                  cap, out_tok + r * cap);
    }
    return 0;
}
