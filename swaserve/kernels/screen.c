/* Each row's candidates for its greedy token: the few columns whose x @ W^T sum may be the
 * largest, found from an int8 copy of W with a bound on what int8 leaves out.
 *
 * The LM head is most of a large greedy decode step (262,144 x 640 for Gemma 3), and a
 * greedy row needs only its argmax. Here x and W are both int8 and multiplied with
 * VPDPBUSD (64 products an instruction, twice what VDPBF16PS gives from bf16). The input
 * channels are split into a few groups by magnitude (kernels/screen.py orders them), each
 * with its own scale in every row of x and in every column of W, so a row's few large
 * channels do not coarsen the rest. For column t of row r:
 *   screen = sum_g sx_g st_g sum_{i in g} xq_i wq_i
 *   |exact - screen| <= sum_g SLACK (sx_g l1_g + sx_g st_g |xq_g|_1) + ABS_SLACK = bound
 * where l1_g is the column's sum of |w| over the group, sx_g and st_g the two scales
 * (rounding x and w to int8 costs at most half of each, hence SLACK = 1/2 + 0.02: the
 * 0.02 covers the float32 sums of the kernel the caller checks against, < 0.01 for 640
 * products with any rounding). A column whose screen + bound is below some column's
 * screen - bound cannot be the argmax; every other one is a candidate, which the caller
 * computes exactly.
 *
 * A keyed sampling row (sampling/sampler.py: temperature T, noise g_t from the hash of its
 * prefix and id t, token = argmax of exact_t / T + g_t) is screened on its scores: a
 * column's upper value is (screen + bound) / T + the most its hash's noise can be, its
 * lower value (screen - bound) / T + the least. Bounds on g come from which of
 * NOISE_RANGES ranges the hash falls in, without a logarithm: the winner's upper value reaches
 * any column's lower value, so it is a candidate, and a column far under the best is kept
 * only for a hash that can carry it (past 8: one in ~3,000).
 *
 * Two passes: the first reads all of W once for all rows and keeps, per row, its best
 * lower value and each pair of column blocks' best upper value; the second screens again,
 * per row, only the pairs whose upper value reaches that row's best lower value (a few),
 * and lists their columns that do.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "murmur.h"

#define MAX_THREADS 64
#define JOBS_PER_THREAD 8 /* a thread that loses its core leaves its jobs to others */
#define SLACK 0.52f
#define ABS_SLACK 1e-30f  /* the kernels flush values under 2^-126 to zero */
/* |x| past this goes to the caller's kernel: below it no screen sum or bound overflows
 * float32 (a GGUF's weights are under 2^26, k under 2^16: 2^64 x 2^26 x 2^16 < 2^127) */
#define X_LIMIT 0x1p64f
#define SCREEN_ROWS 8     /* rows a pass takes: 8 x 2 int32 sums in registers */
/* a keyed row's noise bounds by where its hash h falls: NOISE_RANGES ranges, rising with h
 * (so with g = -log(-log(h / (2^32 - 1))), murmur.py): below 2^31 by the leading zeros of
 * h, from 2^31 by those of ~h = 2^32 - 1 - h (16 at most each: the last range of each
 * half holds 2^16 hashes), so a lane's range is a few integer operations, no logarithm.
 * The ranges are ~0.4-0.9 wide in g but the two ends: g < -2.4 (h < 2^16, and -inf at 0)
 * and g > 11 (~h < 2^16, up to NOISE_MAX) */
#define NOISE_RANGES 32
/* past the caller's float64 logs against these */
#define NOISE_SLACK 1e-4

static double noise_of(double h) { /* murmur.py's g of a hash */
    return h <= 0.0 ? -INFINITY : -log(fmax(-log(h / 4294967295.0), 0x1p-32));
}

int head_screen_noise_ranges(float *least, float *most) {
    const double top = 4294967295.0;
    for (int r = 0; r < NOISE_RANGES / 2; r++) { /* below 2^31: h in [lo, hi] */
        const int zeros = 16 - r; /* leading zeros of h, 16 for all of h < 2^16 */
        const double lo = r == 0 ? 0.0 : ldexp(1.0, 31 - zeros), hi = ldexp(1.0, 32 - zeros) - 1;
        least[r] = (float)(noise_of(lo) - NOISE_SLACK);
        most[r] = (float)(noise_of(hi) + NOISE_SLACK);
    }
    for (int r = NOISE_RANGES / 2; r < NOISE_RANGES; r++) { /* from 2^31: ~h in [lo, hi] */
        const int zeros = r - 15; /* leading zeros of ~h, 16 for all of ~h < 2^16 */
        const double lo = zeros == 16 ? 0.0 : ldexp(1.0, 31 - zeros);
        const double hi = ldexp(1.0, 32 - zeros) - 1;
        least[r] = (float)(noise_of(top - hi) - NOISE_SLACK);
        most[r] = (float)(noise_of(top - lo) + NOISE_SLACK);
    }
    return NOISE_RANGES;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512CD__)
#include <immintrin.h>

#include "tiles.h"

typedef struct {
    const int8_t *xq;     /* [m, k] the rows in int8, channels in screen order */
    const float *rs;      /* [m, ngroups, 3]: sx, SLACK * sx, SLACK * sx * |xq_g|_1 */
    const int32_t *corr;  /* [m, ngroups]: -128 * sum xq_g (the weights are stored + 128) */
    const int32_t *edges; /* [ngroups + 1]: the groups' first channels, then k */
    const uint8_t *wq;    /* [n / 32, k / 4, 2, 16, 4]: round(w / st) + 128, pairs of blocks */
    const float *stats;   /* [n / 16, ngroups, 2, 16]: st, l1 */
    int64_t m, n, k, ngroups, lo, hi; /* [lo, hi): pairs of column blocks of 16 */
    float *lower;         /* [m, 16] lane-wise the largest screen - bound the job has seen */
    float *upper;         /* [m, n / 32] each pair's largest screen + bound */
    const float *inv_t;   /* [m] 1 / T of a keyed row, 0 for a greedy one; NULL: all greedy */
    const uint32_t *prefix; /* [m] the keyed rows' hash prefixes */
    const float *least, *most; /* [NOISE_RANGES] noise bounds by the hash's range */
    float *seen;          /* [m] a keyed row's largest lower value in the job, less `margin` */
} screen_job_t;

/* what a keyed row's best lower value b is lowered by before it is compared with upper
 * values: past their two float32 roundings (/ T, + g) */
static inline float margin(float b) { return (fabsf(b) + 32.0f) * 0x1p-18f; }

/* each lane's range of hashes (head_screen_noise_ranges) */
static inline __m512i noise_range(__m512i h) {
    const __m512i most = _mm512_set1_epi32(16);
    const __m512i below = _mm512_sub_epi32(most, _mm512_min_epu32(_mm512_lzcnt_epi32(h), most));
    const __m512i above = _mm512_add_epi32(
        _mm512_set1_epi32(15),
        _mm512_min_epu32(_mm512_lzcnt_epi32(_mm512_ternarylogic_epi32(h, h, h, 0x55)), most));
    return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(h, _mm512_setzero_si512()), below,
                                   above);
}

/* a keyed row's values of column blocks 2p and 2p + 1 (screen_rows' out) as bounds on its
 * scores: the sums' bounds over T plus its noise's */
static inline void add_noise(const screen_job_t *j, int64_t row, int64_t p, __m512 v[4]) {
    const __m512 inv = _mm512_set1_ps(j->inv_t[row]);
    const __m512 least0 = _mm512_loadu_ps(j->least), least1 = _mm512_loadu_ps(j->least + 16);
    const __m512 most0 = _mm512_loadu_ps(j->most), most1 = _mm512_loadu_ps(j->most + 16);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int t = 0; t < 2; t++) {
        const __m512i r = noise_range(murmur_tokens16(
            j->prefix[row], _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(p * 32 + t * 16)))));
        v[t] = _mm512_fmadd_ps(v[t], inv, _mm512_permutex2var_ps(most0, r, most1));
        v[2 + t] = _mm512_fmadd_ps(v[2 + t], inv, _mm512_permutex2var_ps(least0, r, least1));
    }
}

/* the bounds of n hashes' noise as add_noise reads them (tests) */
int head_screen_noise(const int64_t *hashes, int64_t n, float *least, float *most) {
    float lo[NOISE_RANGES], hi[NOISE_RANGES];
    head_screen_noise_ranges(lo, hi);
    const __m512 least0 = _mm512_loadu_ps(lo), least1 = _mm512_loadu_ps(lo + 16);
    const __m512 most0 = _mm512_loadu_ps(hi), most1 = _mm512_loadu_ps(hi + 16);
    for (int64_t i = 0; i < n; i += 16) {
        uint32_t h[16] = {0};
        float a[16], b[16];
        for (int l = 0; l < 16 && i + l < n; l++) h[l] = (uint32_t)hashes[i + l];
        const __m512i r = noise_range(_mm512_loadu_si512(h));
        _mm512_storeu_ps(a, _mm512_permutex2var_ps(least0, r, least1));
        _mm512_storeu_ps(b, _mm512_permutex2var_ps(most0, r, most1));
        for (int l = 0; l < 16 && i + l < n; l++) least[i + l] = a[l], most[i + l] = b[l];
    }
    return 0;
}

static int keyed(const screen_job_t *j, int64_t row) { return j->inv_t && j->inv_t[row] > 0.0f; }

/* rows r0 .. r0 + R of x against column blocks cb and cb + 1: out[r] = their upper values
 * (screen + bound) of both blocks, then their lower values */
static inline __attribute__((always_inline)) void screen_rows(const screen_job_t *j,
                                                              int64_t cb, int64_t r0,
                                                              const int R, __m512 out[][4]) {
    const int64_t kq = j->k / 4, G = j->ngroups;
    /* a pair of column blocks is one stream (for each 4 inputs, block cb's 64 bytes, then
     * cb + 1's): two streams a block long each are read from memory far slower */
    const uint8_t *w0 = j->wq + cb * kq * 64, *w1 = w0 + 64;
    const float *s0 = j->stats + cb * G * 32, *s1 = s0 + G * 32;
    __m512 f0[SCREEN_ROWS], f1[SCREEN_ROWS];
    for (int r = 0; r < R; r++) f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i acc0[SCREEN_ROWS], acc1[SCREEN_ROWS];
        for (int r = 0; r < R; r++)
            acc0[r] = acc1[r] = _mm512_set1_epi32(j->corr[(r0 + r) * G + g]);
        const int8_t *xg = j->xq + r0 * j->k;
        for (int64_t q = j->edges[g] / 4; q < j->edges[g + 1] / 4; q += 4) {
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                const __m512i a = _mm512_load_si512((const void *)(w0 + (q + u) * 128));
                const __m512i c = _mm512_load_si512((const void *)(w1 + (q + u) * 128));
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const __m512i xv =
                        _mm512_set1_epi32(*(const int32_t *)(xg + r * j->k + (q + u) * 4));
                    acc0[r] = _mm512_dpbusd_epi32(acc0[r], a, xv);
                    acc1[r] = _mm512_dpbusd_epi32(acc1[r], c, xv);
                }
            }
        }
        const __m512 st0 = _mm512_load_ps(s0 + g * 32), st1 = _mm512_load_ps(s1 + g * 32);
        for (int r = 0; r < R; r++) {
            const __m512 sx = _mm512_set1_ps(j->rs[((r0 + r) * G + g) * 3]);
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc0[r]), _mm512_mul_ps(st0, sx), f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc1[r]), _mm512_mul_ps(st1, sx), f1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 b0 = _mm512_set1_ps(ABS_SLACK), b1 = b0;
        for (int64_t g = 0; g < G; g++) {
            const float *rs = j->rs + ((r0 + r) * G + g) * 3;
            const __m512 a = _mm512_set1_ps(rs[1]), c = _mm512_set1_ps(rs[2]);
            b0 = _mm512_fmadd_ps(_mm512_load_ps(s0 + g * 32 + 16), a,
                                 _mm512_fmadd_ps(_mm512_load_ps(s0 + g * 32), c, b0));
            b1 = _mm512_fmadd_ps(_mm512_load_ps(s1 + g * 32 + 16), a,
                                 _mm512_fmadd_ps(_mm512_load_ps(s1 + g * 32), c, b1));
        }
        out[r][0] = _mm512_add_ps(f0[r], b0);
        out[r][1] = _mm512_add_ps(f1[r], b1);
        out[r][2] = _mm512_sub_ps(f0[r], b0);
        out[r][3] = _mm512_sub_ps(f1[r], b1);
    }
}

/* pass 1 over the job's pairs: each row's best upper value a pair, and its lane-wise best
 * lower values */
static void *screen_run(void *arg) {
    screen_job_t *j = (screen_job_t *)arg;
    __m512 out[SCREEN_ROWS][4];
    for (int64_t p = j->lo; p < j->hi; p++)
        for (int64_t r0 = 0; r0 < j->m; r0 += SCREEN_ROWS) {
            const int rows = j->m - r0 < SCREEN_ROWS ? (int)(j->m - r0) : SCREEN_ROWS;
            switch (rows) {
#define SCREEN_CASE(R) case R: screen_rows(j, p * 2, r0, R, out); break;
                SCREEN_CASE(1) SCREEN_CASE(2) SCREEN_CASE(3) SCREEN_CASE(4) SCREEN_CASE(5)
                SCREEN_CASE(6) SCREEN_CASE(7) SCREEN_CASE(8)
#undef SCREEN_CASE
            }
            for (int r = 0; r < rows; r++) {
                const int64_t i = r0 + r;
                float *up = j->upper + i * (j->n / 32) + p;
                if (keyed(j, i)) {
                    /* a pair whose columns cannot reach what the row already reaches even
                     * with the largest noise: no hashes, that bound for pass 2 */
                    const float u = _mm512_reduce_max_ps(_mm512_max_ps(out[r][0], out[r][1])) *
                                        j->inv_t[i] + j->most[NOISE_RANGES - 1];
                    if (u + (fabsf(u) + 32.0f) * 0x1p-20f < j->seen[i]) {
                        *up = u;
                        continue;
                    }
                    add_noise(j, i, p, out[r]);
                }
                float *lo = j->lower + i * 16;
                const __m512 low = _mm512_max_ps(_mm512_load_ps(lo),
                                                 _mm512_max_ps(out[r][2], out[r][3]));
                _mm512_store_ps(lo, low);
                *up = _mm512_reduce_max_ps(_mm512_max_ps(out[r][0], out[r][1]));
                if (keyed(j, i)) {
                    const float b = _mm512_reduce_max_ps(low);
                    j->seen[i] = b - margin(b);
                }
            }
        }
    return 0;
}

/* pass 2 for row i: the columns whose upper value reaches `best`, from the pairs whose best
 * upper value does; their count, or -1 past cap */
static int64_t candidates(const screen_job_t *j, int64_t i, float best, int64_t cap,
                          int32_t *cand) {
    const int64_t pairs = j->n / 32;
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 out[1][4];
    int64_t c = 0;
    for (int64_t p = 0; p < pairs; p++) {
        if (!(j->upper[i * pairs + p] >= best)) continue;
        screen_rows(j, p * 2, i, 1, out);
        if (keyed(j, i)) add_noise(j, i, p, out[0]);
        for (int t = 0; t < 2; t++) {
            const __mmask16 keep = _mm512_cmp_ps_mask(out[0][t], _mm512_set1_ps(best), _CMP_GE_OQ);
            if (c + __builtin_popcount(keep) > cap) return -1;
            _mm512_mask_compressstoreu_epi32(
                cand + c, keep, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(p * 32 + t * 16))));
            c += __builtin_popcount(keep);
        }
    }
    return c;
}

/* the groups' first channels, then k: from 0 to k, rising, each a multiple of 16 */
static int edges_ok(const int32_t *edges, int64_t ngroups, int64_t k) {
    if (ngroups < 1 || edges[0] != 0 || edges[ngroups] != k) return 0;
    for (int64_t g = 0; g < ngroups; g++)
        if (edges[g] % 16 || edges[g + 1] <= edges[g]) return 0;
    return 1;
}

/* x's rows in screen order as int8 with a scale per group; 0, or -3 for a value that is
 * not finite or past X_LIMIT (the caller's kernel decides what such a row gets) */
static int quantize(const uint16_t *x, const int32_t *perm, const int32_t *edges, int64_t G,
                    int64_t m, int64_t k, int8_t *xq, float *rs, int32_t *corr) {
    float *row = malloc((size_t)k * sizeof(float));
    if (!row) return -1;
    int rc = 0;
    for (int64_t i = 0; i < m && rc == 0; i++) {
        for (int64_t c = 0; c < k; c++) {
            const uint32_t bits = (uint32_t)x[i * k + perm[c]] << 16;
            memcpy(row + c, &bits, 4);
            if (!(fabsf(row[c]) <= X_LIMIT)) rc = -3;
        }
        for (int64_t g = 0; g < G; g++) {
            float amax = 0.0f;
            for (int32_t c = edges[g]; c < edges[g + 1]; c++) amax = fmaxf(amax, fabsf(row[c]));
            const float sx = amax / 127.0f;
            int32_t sum = 0, l1 = 0;
            for (int32_t c = edges[g]; c < edges[g + 1]; c++) {
                const int32_t v = sx > 0.0f ? (int32_t)fminf(fmaxf(nearbyintf(row[c] / sx),
                                                                  -127.0f), 127.0f) : 0;
                xq[i * k + c] = (int8_t)v;
                sum += v;
                l1 += abs(v);
            }
            float *r = rs + (i * G + g) * 3;
            r[0] = sx;
            r[1] = SLACK * sx;
            r[2] = SLACK * sx * (float)l1;
            corr[i * G + g] = -128 * sum;
        }
    }
    free(row);
    return rc;
}

int head_screen(const uint16_t *x, const int32_t *perm, const int32_t *edges, int64_t ngroups,
                const uint8_t *wq, const float *stats, int64_t m, int64_t n, int64_t k,
                const float *temp, const int64_t *prefix, int64_t cap, int32_t *cand,
                int64_t *count, int threads) {
    if (m < 1 || n % 32 || k % 16 || cap < 1 || threads < 1 || !edges_ok(edges, ngroups, k))
        return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t pairs = n / 32;
    const int njobs = threads * JOBS_PER_THREAD < pairs ? threads * JOBS_PER_THREAD : (int)pairs;
    int8_t *xq = aligned_alloc(64, (size_t)(m * k + 63) / 64 * 64);
    float *rs = malloc((size_t)m * ngroups * 3 * sizeof(float));
    int32_t *corr = malloc((size_t)m * ngroups * sizeof(int32_t));
    float *lower = aligned_alloc(64, (size_t)njobs * m * 16 * sizeof(float));
    float *upper = malloc((size_t)m * pairs * sizeof(float));
    float *inv_t = temp ? malloc((size_t)m * sizeof(float)) : 0;
    uint32_t *pre = temp ? malloc((size_t)m * sizeof(uint32_t)) : 0;
    float *seen = temp ? malloc((size_t)njobs * m * sizeof(float)) : 0;
    int rc = !xq || !rs || !corr || !lower || !upper || (temp && (!inv_t || !pre || !seen))
                 ? -1 : 0;
    if (rc == 0) rc = quantize(x, perm, edges, ngroups, m, k, xq, rs, corr);
    float least[NOISE_RANGES], most[NOISE_RANGES];
    head_screen_noise_ranges(least, most);
    for (int64_t i = 0; temp && rc == 0 && i < m; i++) {
        inv_t[i] = temp[i] > 0.0f ? 1.0f / temp[i] : 0.0f;
        pre[i] = (uint32_t)prefix[i];
    }
    if (rc == 0) {
        screen_job_t jobs[MAX_THREADS * JOBS_PER_THREAD];
        const int64_t per = (pairs + njobs - 1) / njobs;
        for (int t = 0; t < njobs; t++) {
            const int64_t lo = t * per < pairs ? t * per : pairs;
            const int64_t hi = lo + per < pairs ? lo + per : pairs;
            jobs[t] = (screen_job_t){xq, rs, corr, edges, wq, stats, m, n, k, ngroups, lo, hi,
                                     lower + t * m * 16, upper, inv_t, pre, least, most,
                                     seen ? seen + t * m : 0};
            for (int64_t i = 0; i < m * 16; i++) jobs[t].lower[i] = -INFINITY;
            for (int64_t i = 0; seen && i < m; i++) jobs[t].seen[i] = -INFINITY;
        }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int t = 0; t < njobs; t++) screen_run(&jobs[t]);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t i = 0; i < m; i++) {
            float best = -INFINITY;
            for (int64_t l = 0; l < (int64_t)njobs * 16; l++)
                best = fmaxf(best, lower[(l / 16) * m * 16 + i * 16 + l % 16]);
            if (keyed(&jobs[0], i)) best -= margin(best);
            /* none kept can only come of a sum that is not finite: the caller's kernel */
            const int64_t c = isfinite(best) ? candidates(&jobs[0], i, best, cap, cand + i * cap) : -1;
            count[i] = c == 0 ? -1 : c;
        }
    }
    free(xq);
    free(rs);
    free(corr);
    free(lower);
    free(upper);
    free(inv_t);
    free(pre);
    free(seen);
    return rc;
}

/* One block of 16 columns of the head's int8 tiles as the screen's: widened as q8_dpbf16
 * widens them (the values it multiplies), then per column and group st = the largest
 * |w| / 127, wq = round(w / st) + 128 and l1 = the sum of |w|. -3 for a value that is
 * not finite. */
static int pack_block(const int8_t *pq, const char *ps, const float *po, int flags,
                      const int32_t *perm, const int32_t *edges, int64_t G, int64_t k,
                      float *w, uint8_t *wq, float *stats) {
    const int64_t nkb = k / 32, per = flags & Q8_HALVES ? 32 : 16;
    const int64_t ssize = flags & Q8_F16_SCALES ? 2 : 4;
    uint16_t tile[512] __attribute__((aligned(64)));
    for (int64_t kb = 0; kb < nkb; kb++) {
        widen_tile(pq + kb * 512, ps + kb * per * ssize, po ? po + kb * per : 0, flags, tile);
        for (int r = 0; r < 16; r++)       /* tile row r: inputs 2r, 2r + 1 of every column */
            for (int c = 0; c < 16; c++)
                for (int e = 0; e < 2; e++) {
                    const uint32_t bits = (uint32_t)tile[r * 32 + c * 2 + e] << 16;
                    memcpy(w + c * k + kb * 32 + r * 2 + e, &bits, 4);
                }
    }
    for (int c = 0; c < 16; c++) {
        const float *wc = w + c * k;
        for (int64_t g = 0; g < G; g++) {
            float amax = 0.0f;
            double l1 = 0.0;
            for (int32_t i = edges[g]; i < edges[g + 1]; i++) {
                const float v = wc[perm[i]];
                if (!isfinite(v)) return -3;
                amax = fmaxf(amax, fabsf(v));
                l1 += fabs((double)v);
            }
            const float st = amax / 127.0f;
            for (int32_t i = edges[g]; i < edges[g + 1]; i++) {
                const float q = st > 0.0f ? nearbyintf(wc[perm[i]] / st) : 0.0f;
                wq[(i / 4) * 128 + c * 4 + i % 4] = (uint8_t)(fminf(fmaxf(q, -127.0f), 127.0f) + 128.0f);
            }
            stats[g * 32 + c] = st;
            stats[g * 32 + 16 + c] = (float)l1;
        }
    }
    return 0;
}

int head_screen_pack(const int8_t *pq, const void *ps, const float *po, int flags,
                     const int32_t *perm, const int32_t *edges, int64_t ngroups, int64_t n,
                     int64_t k, uint8_t *wq, float *stats, int threads) {
    if (n % 32 || k % 32 || threads < 1 || !edges_ok(edges, ngroups, k)) return -1;
    const int64_t nkb = k / 32, per = flags & Q8_HALVES ? 32 : 16;
    const int64_t ssize = flags & Q8_F16_SCALES ? 2 : 4;
    int rc = 0; /* the most negative of the blocks' codes */
#pragma omp parallel num_threads(threads)
    {
        float *w = malloc((size_t)16 * k * sizeof(float));
#pragma omp for schedule(static) reduction(min : rc)
        for (int64_t b = 0; b < n / 16; b++) {
            const int r = !w ? -1 : pack_block(pq + b * nkb * 512,
                                               (const char *)ps + b * nkb * per * ssize,
                                               po ? po + b * nkb * per : 0, flags, perm, edges,
                                               ngroups, k, w, wq + (b / 2) * k * 32 + (b % 2) * 64,
                                               stats + b * ngroups * 32);
            if (r < rc) rc = r;
        }
        free(w);
    }
    return rc;
}
#else
int head_screen(const uint16_t *x, const int32_t *perm, const int32_t *edges, int64_t ngroups,
                const uint8_t *wq, const float *stats, int64_t m, int64_t n, int64_t k,
                const float *temp, const int64_t *prefix, int64_t cap, int32_t *cand,
                int64_t *count, int threads) {
    (void)x; (void)perm; (void)edges; (void)ngroups; (void)wq; (void)stats; (void)m; (void)n;
    (void)k; (void)temp; (void)prefix; (void)cap; (void)cand; (void)count; (void)threads;
    return -2; /* no AVX-512 VNNI and BF16 on this machine */
}

int head_screen_pack(const int8_t *pq, const void *ps, const float *po, int flags,
                     const int32_t *perm, const int32_t *edges, int64_t ngroups, int64_t n,
                     int64_t k, uint8_t *wq, float *stats, int threads) {
    (void)pq; (void)ps; (void)po; (void)flags; (void)perm; (void)edges; (void)ngroups; (void)n;
    (void)k; (void)wq; (void)stats; (void)threads;
    return -2;
}

int head_screen_noise(const int64_t *hashes, int64_t n, float *least, float *most) {
    (void)hashes; (void)n; (void)least; (void)most;
    return -2;
}
#endif
