/* y[m, n] = sum_g (scale[n, g] * sum_{k in g} q[n, k] * x[m, k] - offset[n, g] * ...)
 *
 * Products of activations with int8 weights that carry a float scale (and offset) per
 * group of inputs, the GGUF formats read exactly (kernels/q8_weight.py). Each weight is read
 * once, as 1 byte plus its share of the scales, for every activation row of the call:
 * - q8_matvec: rows layout, a scale per 32 (Q8_0, Q5_0), float32 FMAs, up to Q8_MAX_ROWS rows;
 * - q8_vnni: tile layout, any group format, int16 activations on AVX-512 VNNI, any
 *   number of rows, Q8_VNNI_CHUNK at a time (the exact weights);
 * - q8_amx: tile layout, any group format, bf16 tiles on AMX, any number of rows;
 * - q8_dpbf16: the same bf16 tiles on AVX-512 BF16 without the tile unit;
 * - q8_dpbusd: tile layout, any group format, int8 activations on AVX-512 VNNI.
 * Threads split the output features. Built at run time on the machine that runs it
 * (-O3 -march=native), so the loops vectorise with that machine's instructions.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#define BLOCK 32

/* flags of the tile kernels (q8_vnni, q8_amx) */

/* Threads: OpenMP, the runtime torch's CPU build uses, so the kernels run on torch's own
 * worker threads (compiled with -fopenmp, this library links the libgomp torch has
 * already loaded). A pool of our own threads, woken per call, fought those workers, which
 * spin for a while after each torch op, for the cores, and slowed the products in an
 * engine step well past their time alone. Without OpenMP the jobs run one after another. */
#define MAX_THREADS 64
#define JOBS_PER_THREAD 8 /* q8_amx: a thread that loses its core leaves its jobs to others */
typedef void *(*task_t)(void *);

static void parallel(task_t fn, void *jobs, size_t size, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int i = 0; i < n; i++) fn((char *)jobs + (size_t)i * size);
}

typedef struct {
    const float *x;      /* [m, k] */
    const int8_t *q;     /* [n, k] */
    const float *d;      /* [n, k / BLOCK] */
    float *y;            /* [m, n] */
    int64_t m, n, k, lo, hi;
} job_t;

#ifdef __AVX512F__
#include <immintrin.h>

/* 32 int8 weights times their block scale, as two vectors of 16 floats */
static inline void widen(const int8_t *qb, float db, __m512 *w0, __m512 *w1) {
    const __m512 d = _mm512_set1_ps(db);
    *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)qb))));
    *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(qb + 16)))));
}

static void rows(const job_t *j, int64_t r) {
    const int64_t nb = j->k / BLOCK;
    const int8_t *qr = j->q + r * j->k;
    const float *dr = j->d + r * nb;
    __m512 w0, w1;
    if (j->m == 1) {  /* the batch-1 decode: accumulators stay in registers */
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            widen(qr + b * BLOCK, dr[b], &w0, &w1);
            a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(j->x + b * BLOCK), a0);
            a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(j->x + b * BLOCK + 16), a1);
        }
        j->y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        return;
    }
    __m512 a0[Q8_MAX_ROWS], a1[Q8_MAX_ROWS];
    for (int64_t i = 0; i < j->m; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        widen(qr + b * BLOCK, dr[b], &w0, &w1);
        for (int64_t i = 0; i < j->m; i++) {
            const float *xb = j->x + i * j->k + b * BLOCK;
            a0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a1[i]);
        }
    }
    for (int64_t i = 0; i < j->m; i++)
        j->y[i * j->n + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
}
#else
static void rows(const job_t *j, int64_t r) {  /* portable: lane-wise, no cross-lane sums */
    const int64_t nb = j->k / BLOCK;
    const int8_t *qr = j->q + r * j->k;
    const float *dr = j->d + r * nb;
    float acc[Q8_MAX_ROWS][BLOCK] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        float w[BLOCK];
        for (int t = 0; t < BLOCK; t++) w[t] = dr[b] * (float)qr[b * BLOCK + t];
        for (int64_t i = 0; i < j->m; i++) {
            const float *xb = j->x + i * j->k + b * BLOCK;
            for (int t = 0; t < BLOCK; t++) acc[i][t] += w[t] * xb[t];
        }
    }
    for (int64_t i = 0; i < j->m; i++) {
        float s = 0.0f;
        for (int t = 0; t < BLOCK; t++) s += acc[i][t];
        j->y[i * j->n + r] = s;
    }
}
#endif

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (int64_t r = j->lo; r < j->hi; r++) rows(j, r);
    return 0;
}

/* 0 on success; -1 for shapes it does not take (m > Q8_MAX_ROWS, k not a multiple of 32) */
int q8_matvec(const float *x, const int8_t *q, const float *d, float *y, int64_t m,
              int64_t n, int64_t k, int threads) {
    if (m < 1 || m > Q8_MAX_ROWS || k % BLOCK != 0 || threads < 1) return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    job_t jobs[MAX_THREADS];
    int64_t per = (n + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        int64_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        jobs[t] = (job_t){x, q, d, y, m, n, k, lo, hi};
    }
    parallel(run, jobs, sizeof(job_t), threads, threads);
    return 0;
}

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX512BF16__)
/* Q8_ARGMAX_OUT, shared by the tile kernels: instead of writing its sums, each job folds
 * every 16 outputs of a row into that row's lane-wise largest sum so far and its column
 * ([m][16] each, from argmax_alloc). A job takes its columns in increasing order, so a
 * strictly greater sum keeps the first column of a tie; argmax_finish then takes the
 * largest over the jobs' lanes. A NaN sum is reported (the caller computes the logits
 * instead: NaN orders like nothing here). */
#include <math.h>
#include <stdlib.h>

static int argmax_alloc(int njobs, int64_t m, float **best, int32_t **at) {
    *best = aligned_alloc(64, (size_t)njobs * m * 16 * sizeof(float));
    *at = aligned_alloc(64, (size_t)njobs * m * 16 * sizeof(int32_t));
    if (!*best || !*at) { free(*best); free(*at); return -1; }
    for (int64_t i = 0; i < njobs * m * 16; i++) { (*best)[i] = -INFINITY; (*at)[i] = INT32_MAX; }
    return 0;
}

/* sums v of columns col .. col + 15 into a row's lanes (bv, bi); whether one is NaN */
static inline int argmax_fold(float *bv, int32_t *bi, __m512 v, int64_t col) {
    const __m512i cols = _mm512_add_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)col));
    const __m512 best = _mm512_load_ps(bv);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    _mm512_store_ps(bv, _mm512_mask_mov_ps(best, gt, v));
    _mm512_store_si512((void *)bi, _mm512_mask_mov_epi32(_mm512_load_si512((const void *)bi),
                                                         gt, cols));
    return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
}

/* the call's end: with no job failed (rc 0) and lanes allocated, tokens y [m] are the
 * largest of every job's lanes, a tie to the first column; frees the lanes, returns rc */
static int argmax_finish(int rc, float *best, int32_t *at, int njobs, int64_t m, void *y) {
    for (int64_t i = 0; rc == 0 && best && i < m; i++) {
        float v = -INFINITY;
        int64_t c = INT64_MAX;
        for (int64_t l = 0; l < (int64_t)njobs * 16; l++) {
            const int64_t e = (l / 16) * m * 16 + i * 16 + l % 16;
            if (at[e] != INT32_MAX && (best[e] > v || (best[e] == v && at[e] < c))) {
                v = best[e];
                c = at[e];
            }
        }
        ((int64_t *)y)[i] = c == INT64_MAX ? 0 : c;  /* every sum -inf: the first, as argmax */
    }
    free(best);
    free(at);
    return rc;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Few rows on the same tiles without the tile unit: each row of activations is written as
 * int16 with a power-of-two scale per 32 inputs (exact for every value within 2^7 of its
 * block's largest, the rest off by under 2^-15 of it), the int8 weights are multiplied
 * as they are (VPDPWSSD: 16 outputs x 2 inputs an instruction, exact int32 sums per
 * group), and each group's sum is scaled (and its offset taken off) in float32. The
 * weights are used exactly, not as their bf16 copy; nothing is widened beyond int16. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define VNNI_SPAN_BYTES (256 << 10) /* int16 activations a thread keeps in L2 */

/* 16 outputs (column block cb) of row `row`'s sums f into y [m, n] (float32, or bf16 with
 * Q8_BF16_OUT), or with Q8_ARGMAX_OUT folded into that row's lanes; whether one is NaN */
static inline int put_sums(int flags, void *y, int64_t n, float *best, int32_t *at,
                           int64_t row, int64_t cb, __m512 f) {
    if (flags & Q8_ARGMAX_OUT) return argmax_fold(best + row * 16, at + row * 16, f, cb * 16);
    if (flags & Q8_BF16_OUT)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + row * n + cb * 16), to_bf16(f));
    else
        _mm512_storeu_ps((float *)y + row * n + cb * 16, f);
    return 0;
}

typedef struct {
    const int32_t *xq;   /* chunks of Q8_VNNI_CHUNK rows (the last: what is left), each
                          * [k / 2][its rows]: an input pair a word, a chunk's rows side by
                          * side (rows k * 2 bytes apart would share L1 sets) */
    const float *xs;     /* [m, k / 32]: each block's scale, 2^-s */
    const float *xsum;   /* [m, k / group]: sums of x per weight group (offsets only) */
    const int8_t *pq;
    const void *ps;
    const float *po;
    void *y;
    int64_t m, n, k, lo, hi; /* [lo, hi): column blocks of 16 */
    int flags;
    int rc;              /* -3: a sum is NaN (Q8_ARGMAX_OUT) */
    float *best;         /* Q8_ARGMAX_OUT: [m][16] each lane's largest sum so far */
    int32_t *at;         /* [m][16] its column (INT32_MAX: none yet) */
} vnni_job_t;

static inline __m512 vnni_scales(const void *ps, int i, int f16) {
    if (f16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)ps + i)));
    return _mm512_loadu_ps((const float *)ps + i);
}

/* pair p of a block as 32 int16 weights: int8 tiles (BITS 8) or their 4- / 5-bit packing
 * (Q8_PACK4 / Q8_PACK5), which gives the very same values from half or 5/8 of the bytes */
static inline __attribute__((always_inline)) __m512i vnni_weights(const int8_t *blk, int p,
                                                                  const int BITS) {
    if (BITS == 8)
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + p * 32)));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + p * 16)), nib = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
    __m256i u = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    if (BITS == 5) {
        uint32_t top;
        memcpy(&top, blk + 256 + p * 4, 4);
        u = _mm256_or_si256(u, _mm256_maskz_set1_epi8((__mmask32)top, 16));
        return _mm512_sub_epi16(_mm512_cvtepu8_epi16(u), _mm512_set1_epi16(16));
    }
    return _mm512_cvtepu8_epi16(u);
}

/* rows r0 .. r0 + M of x times column block cb, into y */
static inline __attribute__((always_inline)) void vnni_block(vnni_job_t *j, int64_t cb,
                                                             int64_t r0, const int M,
                                                             const int A, const int BITS,
                                                             const int G) {
    /* G: weight groups a block (2: Q8_HALVES). M, A, BITS and G are constants in every
     * instance, so the pair loops unroll and the sums stay in registers (with G read from
     * the flags at run time, each VPDPWSSD came with two register moves and ran at half
     * the rate) */
    const int64_t nkb = j->k / 32, bsize = BITS == 8 ? 512 : BITS == 5 ? 320 : 256;
    const int f16 = j->flags & Q8_F16_SCALES;
    const int64_t per = G == 2 ? 32 : 16, ngroups = nkb * G;
    const int8_t *pq = j->pq + cb * nkb * bsize;
    const char *ps = (const char *)j->ps + cb * nkb * per * (f16 ? 2 : 4);
    const float *po = j->po ? j->po + cb * nkb * per : 0;
    const int32_t *xq = j->xq + r0 * (j->k / 2);
    const float *xs = j->xs + r0 * nkb, *xsum = j->xsum ? j->xsum + r0 * ngroups : 0;
    __m512 f[Q8_VNNI_CHUNK];
    for (int i = 0; i < M; i++) f[i] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nkb; kb++) {
        const int8_t *blk = pq + kb * bsize;
        /* the block 8 ahead: the hardware's own prefetch leaves a 1-row product waiting on
         * memory, where these keep the weights streaming near the read bandwidth */
        for (int l = 0; l < bsize / 64; l++)
            _mm_prefetch((const char *)blk + 8 * bsize + l * 64, _MM_HINT_T0);
        for (int h = 0; h < G; h++) {
            /* A sums a row, over alternate input pairs: independent chains of VPDPWSSD */
            __m512i acc[Q8_VNNI_CHUNK * A];
            for (int i = 0; i < M * A; i++) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int p = h * 16 / G; p < (h + 1) * 16 / G; p += A)
#pragma GCC unroll 4
                for (int a = 0; a < A; a++) {
                    const __m512i w = vnni_weights(blk, p + a, BITS);
#pragma GCC unroll 8
                    for (int i = 0; i < M; i++) {
                        const int32_t pair = xq[(kb * 16 + p + a) * M + i];
                        acc[i * A + a] = _mm512_dpwssd_epi32(acc[i * A + a], w,
                                                             _mm512_set1_epi32(pair));
                    }
                }
            for (int i = 0; i < M; i++)
                for (int a = 1; a < A; a++) acc[i * A] = _mm512_add_epi32(acc[i * A], acc[i * A + a]);
            const __m512 s = vnni_scales(ps + (kb * per + h * 16) * (f16 ? 2 : 4), 0, f16);
            for (int i = 0; i < M; i++)
                f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i * A]),
                                       _mm512_mul_ps(s, _mm512_set1_ps(xs[i * nkb + kb])), f[i]);
            if (po) {
                const __m512 o = _mm512_loadu_ps(po + kb * per + h * 16);
                for (int i = 0; i < M; i++)
                    f[i] = _mm512_fnmadd_ps(o, _mm512_set1_ps(xsum[i * ngroups + kb * G + h]),
                                            f[i]);
            }
        }
    }
    for (int i = 0; i < M; i++)
        if (put_sums(j->flags, j->y, j->n, j->best, j->at, r0 + i, cb, f[i])) j->rc = -3;
}

/* a column block's rows Q8_VNNI_CHUNK at a time: its weights, read from memory for the
 * first chunk, stay in L1 for the others */
#define VNNI_ROWS_CASES(BITS, G)                                                 \
    for (int64_t r0 = rs; r0 < re; r0 += Q8_VNNI_CHUNK) {                        \
        switch (re - r0 < Q8_VNNI_CHUNK ? re - r0 : Q8_VNNI_CHUNK) {             \
        case 1: vnni_block(j, cb, r0, 1, 4, BITS, G); break;                     \
        case 2: vnni_block(j, cb, r0, 2, 2, BITS, G); break;                     \
        case 3: vnni_block(j, cb, r0, 3, 1, BITS, G); break;                     \
        case 4: vnni_block(j, cb, r0, 4, 1, BITS, G); break;                     \
        case 5: vnni_block(j, cb, r0, 5, 1, BITS, G); break;                     \
        case 6: vnni_block(j, cb, r0, 6, 1, BITS, G); break;                     \
        case 7: vnni_block(j, cb, r0, 7, 1, BITS, G); break;                     \
        default: vnni_block(j, cb, r0, 8, 1, BITS, G); break;                    \
        }                                                                        \
    }
#define VNNI_GROUP_CASES(BITS)                                                   \
    if (j->flags & Q8_HALVES) {                                                  \
        VNNI_ROWS_CASES(BITS, 2)                                                 \
    } else {                                                                     \
        VNNI_ROWS_CASES(BITS, 1)                                                 \
    }

static void *vnni_run(void *arg) {
    vnni_job_t *j = (vnni_job_t *)arg;
    /* rows in spans whose int16 activations stay in L2 while every block takes them */
    const int64_t span = VNNI_SPAN_BYTES / (j->k * 2) > Q8_VNNI_CHUNK
                             ? VNNI_SPAN_BYTES / (j->k * 2) / Q8_VNNI_CHUNK * Q8_VNNI_CHUNK
                             : Q8_VNNI_CHUNK;
    for (int64_t rs = 0; rs < j->m; rs += span) {
        const int64_t re = rs + span < j->m ? rs + span : j->m;
        for (int64_t cb = j->lo; cb < j->hi; cb++) {
            if (j->flags & Q8_PACK5) {
                VNNI_GROUP_CASES(5)
            } else if (j->flags & Q8_PACK4) {
                VNNI_GROUP_CASES(4)
            } else {
                VNNI_GROUP_CASES(8)
            }
        }
    }
    return 0;
}
#undef VNNI_ROWS_CASES
#undef VNNI_GROUP_CASES

/* x [m, k] bf16 as int16 per block of 32 with the power of two that puts the block's
 * largest exponent just under 2^15 (into xq's chunked layout); the sums of x per weight
 * group for the offsets */
static void quantize_rows(const uint16_t *x, int64_t m, int64_t k, int group, int32_t *xq,
                          float *xs, float *xsum) {
    const int64_t nkb = k / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int64_t at = i * k + kb * 32;
            const __m512 a = load_bf16(x + at), b = load_bf16(x + at + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a),
                                                                  _mm512_abs_ps(b)));
            uint32_t bits;
            memcpy(&bits, &amax, 4);
            const int e = (int)(bits >> 23) > 0 ? (int)(bits >> 23) : 1;
            const int s = 141 - e; /* |x| < 2^(e - 126): times 2^s, under 2^15 */
            const __m512 sv = _mm512_set1_ps((float)s);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_scalef_ps(a, sv));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_scalef_ps(b, sv));
            int32_t pairs[16];
            _mm256_storeu_si256((__m256i *)pairs, _mm512_cvtsepi32_epi16(qa));
            _mm256_storeu_si256((__m256i *)(pairs + 8), _mm512_cvtsepi32_epi16(qb));
            const int64_t r0 = i / Q8_VNNI_CHUNK * Q8_VNNI_CHUNK;
            const int64_t width = m - r0 < Q8_VNNI_CHUNK ? m - r0 : Q8_VNNI_CHUNK;
            int32_t *to = xq + r0 * (k / 2) + kb * 16 * width + i - r0;
            for (int p = 0; p < 16; p++) to[p * width] = pairs[p];
            /* NaN and infinity (which max() passes over) make the row's sums NaN */
            const int bad = _mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99);
            xs[i * nkb + kb] = bad ? NAN : ldexpf(1.0f, -s);
            if (xsum) {
                const float sa = _mm512_reduce_add_ps(a), sb = _mm512_reduce_add_ps(b);
                if (group == 16) {
                    xsum[(i * nkb + kb) * 2] = sa;
                    xsum[(i * nkb + kb) * 2 + 1] = sb;
                } else {
                    xsum[i * nkb + kb] = sa + sb;
                }
            }
        }
}

/* 0 on success; -1 for shapes it does not take (n % 16, k % 32) */
int q8_vnni(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
            void *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % BLOCK || threads < 1) return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t nkb = k / 32, group = flags & Q8_HALVES ? 16 : 32;
    int32_t *xq = aligned_alloc(64, (size_t)(m * k * 2 + 63) / 64 * 64);
    float *xs = malloc((size_t)(m * nkb * 3 + 1) * sizeof(float));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    float *xsum = po ? xs + m * nkb : 0;
    quantize_rows(x, m, k, (int)group, xq, xs, xsum);
    const int64_t blocks = n / 16;
    int njobs = threads * JOBS_PER_THREAD < blocks ? threads * JOBS_PER_THREAD : (int)blocks;
    vnni_job_t jobs[MAX_THREADS * JOBS_PER_THREAD];
    const int64_t per = (blocks + njobs - 1) / njobs;
    const int argmax = flags & Q8_ARGMAX_OUT;
    float *best = 0;
    int32_t *at = 0;
    if (argmax && argmax_alloc(njobs, m, &best, &at)) { free(xq); free(xs); return -1; }
    for (int t = 0; t < njobs; t++) {
        int64_t lo = t * per < blocks ? t * per : blocks, hi = lo + per < blocks ? lo + per : blocks;
        jobs[t] = (vnni_job_t){xq, xs, xsum, pq, ps, po, y, m, n, k, lo, hi, flags, 0,
                               argmax ? best + t * m * 16 : 0, argmax ? at + t * m * 16 : 0};
    }
    parallel(vnni_run, jobs, sizeof(vnni_job_t), njobs, threads);
    free(xq);
    free(xs);
    int rc = 0;
    for (int t = 0; t < njobs; t++)
        if (jobs[t].rc) rc = jobs[t].rc;
    return argmax_finish(rc, best, at, njobs, m, y);
}

/* Many rows on int8 activations: each row of x is written as int8 with a float scale per
 * 32 inputs (its largest |x| / 127, round to nearest), and multiplied with the tiles'
 * int8 weights by VPDPBUSD, 16 outputs x 4 inputs an instruction where VPDPWSSD and
 * VDPBF16PS take 2: exact int32 sums per weight group, each scaled (and its offset taken
 * off, with the exact sum of x) in float32. VPDPBUSD multiplies unsigned by signed bytes:
 * the weights are taken as u = q + 128 and each group's sum starts at -128 times the
 * group's sum of int8 x. A thread rewrites a column block over all of K into that order
 * (16 outputs x 4 inputs a 64-byte row) once and runs every row of the call over it,
 * DB_ROWS at a time. A row's sums depend on that row alone, not on the others of the call. */
#define DB_ROWS 12

/* The activations in chunks of DB_ROWS rows, each row's value for a position of the
 * chunk's rows side by side ([chunk][position][DB_ROWS]), so that a chunk's row values
 * sit at fixed offsets from one pointer (a pointer a row spilled to the stack) */
typedef struct {
    const int32_t *xq;   /* [chunk][k / 4][DB_ROWS]: 4 int8 values a word */
    const float *xs;     /* [chunk][k / 32][DB_ROWS]: each block's scale */
    const int32_t *xc;   /* [chunk][k / group][DB_ROWS]: -128 x the group's sum of xq */
    const float *xsum;   /* [chunk][k / group][DB_ROWS]: sums of x per group (offsets only) */
    const int8_t *pq;
    const void *ps;
    const float *po;
    void *y;
    int64_t m, n, k, lo, hi; /* [lo, hi): column blocks of 16 */
    int flags;
    int rc;              /* -1: no buffer; -3: a sum is NaN (Q8_ARGMAX_OUT) */
    float *best;         /* Q8_ARGMAX_OUT: [m][16] each lane's largest sum so far */
    int32_t *at;         /* [m][16] its column (INT32_MAX: none yet) */
} db_job_t;

/* a column block's int8 tiles (16 pairs x 16 outputs x 2 a block) as u = q + 128 in
 * quads: 8 rows of 16 outputs x 4 inputs a block */
static void quad_block(const int8_t *pq, int64_t nkb, uint8_t *out) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int64_t r = 0; r < nkb * 8; r++)
        _mm512_store_si512((void *)(out + r * 64), _mm512_xor_si512(bias, _mm512_permutexvar_epi16(
            idx, _mm512_loadu_si512((const void *)(pq + r * 64)))));
}

/* the M rows of chunk c times the quads of column block cb, into y */
static inline __attribute__((always_inline)) void db_rows(db_job_t *j, const uint8_t *wq,
                                                          int64_t cb, int64_t c, const int M,
                                                          const int G) {
    const int64_t nkb = j->k / 32, ngroups = nkb * G, per = G == 2 ? 32 : 16;
    const int f16 = j->flags & Q8_F16_SCALES;
    const char *ps = (const char *)j->ps + cb * nkb * per * (f16 ? 2 : 4);
    const float *po = j->po ? j->po + cb * nkb * per : 0;
    const int32_t *xq = j->xq + c * (j->k / 4) * DB_ROWS;
    const float *xs = j->xs + c * nkb * DB_ROWS;
    const int32_t *xc = j->xc + c * ngroups * DB_ROWS;
    const float *xsum = j->xsum ? j->xsum + c * ngroups * DB_ROWS : 0;
    __m512 f[DB_ROWS];
    for (int i = 0; i < M; i++) f[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        const int32_t *xg = xq + g * (8 / G) * DB_ROWS;
        const uint8_t *wg = wq + g * (8 / G) * 64;
        __m512i acc[DB_ROWS];
        for (int i = 0; i < M; i++) acc[i] = _mm512_set1_epi32(xc[g * DB_ROWS + i]);
#pragma GCC unroll 8
        for (int qd = 0; qd < 8 / G; qd++) {
            const __m512i w = _mm512_load_si512((const void *)(wg + qd * 64));
#pragma GCC unroll 12
            for (int i = 0; i < M; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], w, _mm512_set1_epi32(xg[qd * DB_ROWS + i]));
        }
        const __m512 s = vnni_scales(ps + g * 16 * (f16 ? 2 : 4), 0, f16);
        const float *sx = xs + (g / G) * DB_ROWS;
        for (int i = 0; i < M; i++)
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]),
                                   _mm512_mul_ps(s, _mm512_set1_ps(sx[i])), f[i]);
        if (po) {
            const __m512 o = _mm512_loadu_ps(po + g * 16);
            for (int i = 0; i < M; i++)
                f[i] = _mm512_fnmadd_ps(o, _mm512_set1_ps(xsum[g * DB_ROWS + i]), f[i]);
        }
    }
    const int64_t r0 = c * DB_ROWS;
    for (int i = 0; i < M; i++)
        if (put_sums(j->flags, j->y, j->n, j->best, j->at, r0 + i, cb, f[i])) j->rc = -3;
}

#define DB_ROWS_CASES(G)                                                         \
    for (int64_t c = 0; c * DB_ROWS < j->m; c++) {                               \
        switch (j->m - c * DB_ROWS < DB_ROWS ? j->m - c * DB_ROWS : DB_ROWS) {   \
        case 1: db_rows(j, wq, cb, c, 1, G); break;                              \
        case 2: db_rows(j, wq, cb, c, 2, G); break;                              \
        case 3: db_rows(j, wq, cb, c, 3, G); break;                              \
        case 4: db_rows(j, wq, cb, c, 4, G); break;                              \
        case 5: db_rows(j, wq, cb, c, 5, G); break;                              \
        case 6: db_rows(j, wq, cb, c, 6, G); break;                              \
        case 7: db_rows(j, wq, cb, c, 7, G); break;                              \
        case 8: db_rows(j, wq, cb, c, 8, G); break;                              \
        case 9: db_rows(j, wq, cb, c, 9, G); break;                              \
        case 10: db_rows(j, wq, cb, c, 10, G); break;                            \
        case 11: db_rows(j, wq, cb, c, 11, G); break;                            \
        default: db_rows(j, wq, cb, c, 12, G); break;                            \
        }                                                                        \
    }

static void *db_run(void *arg) {
    db_job_t *j = (db_job_t *)arg;
    const int64_t nkb = j->k / 32;
    uint8_t *wq = aligned_alloc(64, (size_t)nkb * 512);
    if (!wq) { j->rc = -1; return 0; }
    for (int64_t cb = j->lo; cb < j->hi; cb++) {
        quad_block(j->pq + cb * nkb * 512, nkb, wq);
        if (j->flags & Q8_HALVES) {
            DB_ROWS_CASES(2)
        } else {
            DB_ROWS_CASES(1)
        }
    }
    free(wq);
    return 0;
}
#undef DB_ROWS_CASES

/* x [m, k] bf16 as int8 per block of 32 (scale: the block's largest |x| / 127; a NaN or
 * infinity makes the block's scale NaN, so the row's sums are NaN), -128 x the sums of
 * the int8 values per weight group, and the sums of x per group for the offsets, each in
 * db_job_t's chunked order */
static void quantize_rows8(const uint16_t *x, int64_t m, int64_t k, int group, int threads,
                           int32_t *xq, float *xs, int32_t *xc, float *xsum) {
    const int64_t nkb = k / 32, G = 32 / group;
#pragma omp parallel for num_threads(m * k >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const int64_t c = r / DB_ROWS, i = r % DB_ROWS;
        for (int64_t kb = 0; kb < nkb; kb++) {
            const __m512 a = load_bf16(x + r * k + kb * 32), b = load_bf16(x + r * k + kb * 32 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a),
                                                                  _mm512_abs_ps(b)));
            const int bad = _mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99);
            /* a block under 2^-100 is scaled up first: 127 / amax would overflow */
            const float up = amax < 0x1p-100f ? 100.0f : 0.0f;
            const __m512 inv = _mm512_set1_ps(amax > 0 && !bad ? 127.0f / ldexpf(amax, (int)up) : 0.0f);
            const __m512 e = _mm512_set1_ps(up);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_scalef_ps(a, e), inv));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_scalef_ps(b, e), inv));
            int32_t words[8];
            _mm_storeu_si128((__m128i *)words, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(words + 4), _mm512_cvtsepi32_epi8(qb));
            for (int w = 0; w < 8; w++) xq[(c * (k / 4) + kb * 8 + w) * DB_ROWS + i] = words[w];
            xs[(c * nkb + kb) * DB_ROWS + i] = bad ? NAN : amax / 127.0f;
            const int32_t ca = -128 * _mm512_reduce_add_epi32(qa), cb = -128 * _mm512_reduce_add_epi32(qb);
            const float sa = xsum ? _mm512_reduce_add_ps(a) : 0, sb = xsum ? _mm512_reduce_add_ps(b) : 0;
            const int64_t g = (c * nkb * G + kb * G) * DB_ROWS + i;
            xc[g] = G == 2 ? ca : ca + cb;
            if (G == 2) xc[g + DB_ROWS] = cb;
            if (xsum) {
                xsum[g] = G == 2 ? sa : sa + sb;
                if (G == 2) xsum[g + DB_ROWS] = sb;
            }
        }
    }
}

/* 0 on success; -1 for shapes it does not take (n % 16, k % 32) or no memory */
int q8_dpbusd(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
              void *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % BLOCK || threads < 1) return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t nkb = k / 32, group = flags & Q8_HALVES ? 16 : 32, ngroups = k / group;
    const int64_t rows = (m + DB_ROWS - 1) / DB_ROWS * DB_ROWS;  /* whole chunks */
    int32_t *xq = aligned_alloc(64, (size_t)(rows * k + 63) / 64 * 64);
    float *xs = malloc((size_t)rows * (nkb + ngroups) * sizeof(float));
    int32_t *xc = malloc((size_t)rows * ngroups * sizeof(int32_t));
    if (!xq || !xs || !xc) { free(xq); free(xs); free(xc); return -1; }
    float *xsum = po ? xs + rows * nkb : 0;
    quantize_rows8(x, m, k, (int)group, threads, xq, xs, xc, xsum);
    const int64_t blocks = n / 16;
    int njobs = threads * JOBS_PER_THREAD < blocks ? threads * JOBS_PER_THREAD : (int)blocks;
    db_job_t jobs[MAX_THREADS * JOBS_PER_THREAD];
    const int64_t per = (blocks + njobs - 1) / njobs;
    const int argmax = flags & Q8_ARGMAX_OUT;
    float *best = 0;
    int32_t *at = 0;
    int rc = argmax && argmax_alloc(njobs, m, &best, &at) ? -1 : 0;
    for (int t = 0; rc == 0 && t < njobs; t++) {
        int64_t lo = t * per < blocks ? t * per : blocks, hi = lo + per < blocks ? lo + per : blocks;
        jobs[t] = (db_job_t){xq, xs, xc, xsum, pq, ps, po, y, m, n, k, lo, hi, flags, 0,
                             argmax ? best + t * m * 16 : 0, argmax ? at + t * m * 16 : 0};
    }
    if (rc == 0) parallel(db_run, jobs, sizeof(db_job_t), njobs, threads);
    free(xq);
    free(xs);
    free(xc);
    for (int t = 0; rc == 0 && t < njobs; t++)
        if (jobs[t].rc) rc = jobs[t].rc;
    if (!best) return rc;
    return argmax_finish(rc, best, at, njobs, m, y);
}
#else
int q8_vnni(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
            void *y, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x; (void)pq; (void)ps; (void)po; (void)flags; (void)y; (void)m; (void)n; (void)k;
    (void)threads;
    return -2; /* no AVX-512 VNNI on this machine */
}
int q8_dpbusd(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
              void *y, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x; (void)pq; (void)ps; (void)po; (void)flags; (void)y; (void)m; (void)n; (void)k;
    (void)threads;
    return -2; /* no AVX-512 VNNI on this machine */
}
#endif

#include "tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* The same int8 blocks widened to bf16 tiles (each weight times its scale, minus its
 * offset, rounded once to bf16: the very values of the bf16 copy) and multiplied on AMX
 * with float32 sums; a row's result does not depend on the other rows of the call.
 * Weights are packed so that a block of 16 outputs x 32 inputs is one tile in AMX's
 * pair-interleaved order: pq [N/16][K/32][16 pairs][16][2] int8, scales (and offsets)
 * [N/16][K/32][(2,) 16]. A thread takes pairs of column blocks; up to 32 rows it widens
 * each block as it uses it, with more rows it widens a pair over all of K once and reuses
 * it for every 32 rows. */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define STREAM_OUTPUTS (1 << 20) /* outputs from which y is written around the cache */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

typedef struct {
    const uint16_t *x;   /* bf16 [m, k] */
    const int8_t *pq;
    const void *ps;      /* scales: float, or float16 with Q8_F16_SCALES */
    const float *po;     /* offsets (or NULL) */
    void *y;             /* [m, n] float32, or bf16 with Q8_BF16_OUT */
    int64_t m, n, k, lo, hi; /* [lo, hi): column blocks of 16 */
    int flags;           /* Q8_HALVES, Q8_F16_SCALES, Q8_BF16_OUT, Q8_ARGMAX_OUT */
    int rc;
    float *best;         /* Q8_ARGMAX_OUT: [m][16] each lane's largest sum so far */
    int32_t *at;         /* [m][16] its column (INT32_MAX: none yet) */
} amx_job_t;

static void config(int rows0, int rows1) {
    /* tiles 0-3: C[i][j] (rows of i, 16 floats); 4, 5: A[i] (32 bf16); 6, 7: B[j] */
    tilecfg_t cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = rows0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = rows1 > 0 ? rows1 : 1;
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
}

/* C tiles 0-3 to y: through a staging buffer, with streaming stores for a large y. A tile
 * stored straight into y writes 16 rows n floats apart, which for a wide y (the LM head:
 * 1 MB) all fall into one cache set and evict each other; a small y (a layer's output) is
 * read right after, so it stays in cache. */
static void store_c(void *yv, int64_t ldy, int rows0, int rows1, int two, float *stage,
                    int bf16, int stream) {
    _tile_stored(0, stage, 64);
    if (two) _tile_stored(1, stage + 256, 64);
    if (rows1 > 0) {
        _tile_stored(2, stage + 512, 64);
        if (two) _tile_stored(3, stage + 768, 64);
    }
    const int aligned = stream && ((uintptr_t)yv & 63) == 0 && (ldy & (bf16 ? 31 : 15)) == 0;
    for (int i = 0; i < 2; i++) {
        const int rows = i == 0 ? rows0 : rows1;
        const float *st = stage + i * 512;
        for (int r = 0; r < rows; r++) {
            const __m512 lo = _mm512_load_ps(st + r * 16), hi = _mm512_load_ps(st + 256 + r * 16);
            if (bf16) {  /* both column blocks as one 64-byte line: no half-line stream */
                uint16_t *dst = (uint16_t *)yv + (i * 16 + r) * ldy;
                if (two && aligned)
                    _mm512_stream_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                else if (two)
                    _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                else
                    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(lo));
            } else {
                float *dst = (float *)yv + (i * 16 + r) * ldy;
                if (aligned) {
                    _mm512_stream_ps(dst, lo);
                    if (two) _mm512_stream_ps(dst + 16, hi);
                } else {
                    _mm512_storeu_ps(dst, lo);
                    if (two) _mm512_storeu_ps(dst + 16, hi);
                }
            }
        }
    }
}

/* Q8_ARGMAX_OUT: C tiles 0-3 folded into each row's lane-wise maxima (argmax_fold).
 * Columns come in increasing order in a lane (a job's blocks, then its two column blocks),
 * so a strictly greater sum keeps the first column of a tie. Returns whether a sum is NaN
 * (the caller then computes the logits instead: NaN orders like nothing here). */
static int argmax_c(const amx_job_t *j, int64_t m0, int rows0, int rows1, int two,
                    int64_t cb, float *stage) {
    _tile_stored(0, stage, 64);
    if (two) _tile_stored(1, stage + 256, 64);
    if (rows1 > 0) {
        _tile_stored(2, stage + 512, 64);
        if (two) _tile_stored(3, stage + 768, 64);
    }
    int nan = 0;
    for (int i = 0; i < 2; i++) {
        const int rows = i == 0 ? rows0 : rows1;
        for (int r = 0; r < rows; r++)
            for (int t = 0; t <= two; t++)
                nan |= argmax_fold(j->best + (m0 + i * 16 + r) * 16, j->at + (m0 + i * 16 + r) * 16,
                                   _mm512_load_ps(stage + i * 512 + t * 256 + r * 16),
                                   (cb + t) * 16);
    }
    return nan;
}

static void *amx_run(void *arg) {
    amx_job_t *j = (amx_job_t *)arg;
    const int64_t nkb = j->k / BLOCK;
    /* up to 32 rows, x stays in L1 and blocks are widened as they are used; more rows
     * reuse a pair of column blocks widened over all of K */
    const int whole = j->m > 32;
    uint16_t *buf = aligned_alloc(64, (size_t)(whole ? nkb : 1) * 2 * TILE_BYTES + 4096);
    if (!buf) { j->rc = -1; return 0; }
    float *stage = (float *)(buf + (whole ? nkb : 1) * 2 * 512);
    int cur0 = -1, cur1 = -1;
    for (int64_t cb = j->lo; cb < j->hi; cb += 2) {
        const int two = cb + 1 < j->hi;
        const int8_t *pq = j->pq + cb * nkb * 512;
        const int64_t per = j->flags & Q8_HALVES ? 32 : 16;  /* scales a block */
        const int64_t ssize = j->flags & Q8_F16_SCALES ? 2 : 4;
        const char *ps = (const char *)j->ps + cb * nkb * per * ssize;
        const float *po = j->po ? j->po + cb * nkb * per : 0;
        if (whole)
            for (int64_t kb = 0; kb < nkb; kb++)
                for (int t = 0; t <= two; t++)
                    widen_tile(pq + (t * nkb + kb) * 512, ps + (t * nkb + kb) * per * ssize,
                               po ? po + (t * nkb + kb) * per : 0, j->flags,
                               buf + (kb * 2 + t) * 512);
        for (int64_t m0 = 0; m0 < j->m; m0 += 32) {
            const int64_t left = j->m - m0;
            const int rows0 = left < 16 ? (int)left : 16, rows1 = left > 32 ? 16 : (int)left - 16;
            if (rows0 != cur0 || rows1 != cur1) {
                config(rows0, rows1);
                cur0 = rows0;
                cur1 = rows1;
            }
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            /* x repacked by chunks of 32 rows: [K / 32][rows][32], so a tile is in a row */
            const uint16_t *x0 = j->x + m0 * j->k, *x1 = x0 + 512;
            const int64_t ldk = (int64_t)(rows0 + (rows1 > 0 ? rows1 : 0)) * 32;
            for (int64_t kb = 0; kb < nkb; kb++) {
                const uint16_t *b = buf + (whole ? kb * 2 * 512 : 0);
                if (!whole)
                    for (int t = 0; t <= two; t++)
                        widen_tile(pq + (t * nkb + kb) * 512, ps + (t * nkb + kb) * per * ssize,
                                   po ? po + (t * nkb + kb) * per : 0, j->flags,
                                   buf + t * 512);
                /* with more than 32 rows x streams by from L2 once a pair: loaded past L1,
                 * it leaves the pair's widened blocks there */
                if (whole) _tile_stream_loadd(4, x0 + kb * ldk, 64);
                else _tile_loadd(4, x0 + kb * ldk, 64);
                _tile_loadd(6, b, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) { _tile_loadd(7, b + 512, 64); _tile_dpbf16ps(1, 4, 7); }
                if (rows1 > 0) {
                    if (whole) _tile_stream_loadd(5, x1 + kb * ldk, 64);
                    else _tile_loadd(5, x1 + kb * ldk, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            if (j->flags & Q8_ARGMAX_OUT) {
                if (argmax_c(j, m0, rows0, rows1, two, cb, stage)) j->rc = -3;
                continue;
            }
            const int64_t at = m0 * j->n + cb * 16;
            const int bf16 = j->flags & Q8_BF16_OUT;
            store_c(bf16 ? (void *)((uint16_t *)j->y + at) : (void *)((float *)j->y + at), j->n,
                    rows0, rows1, two, stage, bf16, j->m * j->n >= STREAM_OUTPUTS);
        }
    }
    _mm_sfence();
    _tile_release();
    free(buf);
    return 0;
}

static int amx_permitted = 0; /* 1 granted, -1 refused by the kernel */

/* 0 on success; -1 for shapes it does not take, -2 when the OS does not grant AMX */
int q8_amx(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
           void *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % BLOCK || threads < 1) return -1;
    if (!amx_permitted)
        amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 1;
    if (amx_permitted < 0) return -2;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t blocks = n / 16, pairs = (blocks + 1) / 2;
    /* several jobs a thread, taken as threads free up: on a machine with other work (an
     * HTTP server, its clients) one preempted thread does not hold up the whole call */
    int njobs = threads * JOBS_PER_THREAD < pairs ? threads * JOBS_PER_THREAD : (int)pairs;
    amx_job_t jobs[MAX_THREADS * JOBS_PER_THREAD];
    const int64_t per = (pairs + njobs - 1) / njobs, nkb = k / BLOCK;
    uint16_t *xp = aligned_alloc(64, (size_t)m * k * 2);
    if (!xp) return -1;
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const int64_t rows = m - m0 < 32 ? m - m0 : 32;
        for (int64_t kb = 0; kb < nkb; kb++)
            for (int64_t r = 0; r < rows; r++)
                memcpy(xp + m0 * k + (kb * rows + r) * 32, x + (m0 + r) * k + kb * 32, 64);
    }
    x = xp;
    const int argmax = flags & Q8_ARGMAX_OUT;
    float *best = 0;
    int32_t *at = 0;
    if (argmax && argmax_alloc(njobs, m, &best, &at)) { free(xp); return -1; }
    for (int t = 0; t < njobs; t++) {
        int64_t lo = t * per * 2 < blocks ? t * per * 2 : blocks;
        int64_t hi = lo + per * 2 < blocks ? lo + per * 2 : blocks;
        jobs[t] = (amx_job_t){x, pq, ps, po, y, m, n, k, lo, hi, flags, 0,
                              argmax ? best + t * m * 16 : 0, argmax ? at + t * m * 16 : 0};
    }
    parallel(amx_run, jobs, sizeof(amx_job_t), njobs, threads);
    int rc = 0;
    for (int t = 0; t < njobs; t++)
        if (jobs[t].rc) rc = jobs[t].rc;
    free(xp);
    return argmax_finish(rc, best, at, njobs, m, y);
}
#else
int q8_amx(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
           void *y, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x; (void)pq; (void)ps; (void)po; (void)flags; (void)y; (void)m; (void)n; (void)k;
    (void)threads;
    return -2; /* no AMX on this machine */
}
#endif

#if defined(__AVX512BF16__)
/* The tiles of q8_amx without the tile unit (AVX-512 BF16: AMD Zen 4 and 5, Intel before
 * Sapphire Rapids): the same int8 blocks widened to the same bf16 values, multiplied with
 * VDPBF16PS, float32 sums in the order of the inputs. Each 32-bit lane of a widened tile
 * row holds one output's pair of inputs, so a row of x, its pair broadcast, takes 16
 * outputs x 2 inputs in one instruction. A thread takes pairs of column blocks, widens
 * them over all of K once and runs the rows DP_ROWS at a time (2 x DP_ROWS sums in
 * registers); a row's result does not depend on the other rows of the call. */
#define DP_ROWS 12

typedef struct {
    const uint16_t *x;   /* bf16 [m, k] */
    const int8_t *pq;
    const void *ps;
    const float *po;
    void *y;             /* [m, n] float32, or bf16 with Q8_BF16_OUT */
    int64_t m, n, k, lo, hi;
    int flags;
    int rc;
    float *best;         /* Q8_ARGMAX_OUT: [m][16] each lane's largest sum so far */
    int32_t *at;         /* [m][16] its column (INT32_MAX: none yet) */
} dp_job_t;

/* rows of x (from row m0) x two widened column blocks b0, b1 over all of K, into y */
static inline __attribute__((always_inline)) void dp_rows(dp_job_t *j, const uint16_t *b0,
                                                          const uint16_t *b1, int64_t m0,
                                                          int64_t cb, int two, const int rows) {
    const int64_t nkb = j->k / BLOCK, ldx = j->k / 2;
    const int32_t *x = (const int32_t *)(j->x + m0 * j->k);
    __m512 acc0[DP_ROWS], acc1[DP_ROWS];
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nkb; kb++) {
        for (int p = 0; p < 16; p++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(b0 + kb * 512 + p * 32));
            const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(b1 + kb * 512 + p * 32));
            for (int r = 0; r < rows; r++) {
                const __m512bh xp = (__m512bh)_mm512_set1_epi32(x[r * ldx + kb * 16 + p]);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, xp);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, xp);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t at = (m0 + r) * j->n + cb * 16;
        if (j->flags & Q8_ARGMAX_OUT) {
            float *bv = j->best + (m0 + r) * 16;
            int32_t *bi = j->at + (m0 + r) * 16;
            if (argmax_fold(bv, bi, acc0[r], cb * 16) |
                (two && argmax_fold(bv, bi, acc1[r], (cb + 1) * 16)))
                j->rc = -3;
        } else if (j->flags & Q8_BF16_OUT) {
            uint16_t *dst = (uint16_t *)j->y + at;
            if (two)
                _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(acc1[r], acc0[r]));
            else
                _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(acc0[r]));
        } else {
            float *dst = (float *)j->y + at;
            _mm512_storeu_ps(dst, acc0[r]);
            if (two) _mm512_storeu_ps(dst + 16, acc1[r]);
        }
    }
}

static void *dp_run(void *arg) {
    dp_job_t *j = (dp_job_t *)arg;
    const int64_t nkb = j->k / BLOCK;
    const int64_t per = j->flags & Q8_HALVES ? 32 : 16;  /* scales a block */
    const int64_t ssize = j->flags & Q8_F16_SCALES ? 2 : 4;
    uint16_t *buf = aligned_alloc(64, (size_t)nkb * 2 * TILE_BYTES);
    if (!buf) { j->rc = -1; return 0; }
    for (int64_t cb = j->lo; cb < j->hi; cb += 2) {
        const int two = cb + 1 < j->hi;
        for (int t = 0; t < 2; t++)  /* a lone last block is widened twice, one sum kept */
            for (int64_t kb = 0; kb < nkb; kb++) {
                const int64_t blk = (cb + (two ? t : 0)) * nkb + kb;
                widen_tile(j->pq + blk * 512, (const char *)j->ps + blk * per * ssize,
                           j->po ? j->po + blk * per : 0, j->flags, buf + (t * nkb + kb) * 512);
            }
        const uint16_t *b0 = buf, *b1 = buf + nkb * 512;
        for (int64_t m0 = 0; m0 < j->m; m0 += DP_ROWS) {
            const int64_t left = j->m - m0;
            switch (left < DP_ROWS ? left : DP_ROWS) {
#define DP_CASE(R) case R: dp_rows(j, b0, b1, m0, cb, two, R); break;
                DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4) DP_CASE(5) DP_CASE(6)
                DP_CASE(7) DP_CASE(8) DP_CASE(9) DP_CASE(10) DP_CASE(11) DP_CASE(12)
#undef DP_CASE
            }
        }
    }
    free(buf);
    return 0;
}

/* 0 on success; -1 for shapes it does not take, -3 for a NaN sum with Q8_ARGMAX_OUT */
int q8_dpbf16(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
              void *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % BLOCK || threads < 1) return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t blocks = n / 16, pairs = (blocks + 1) / 2;
    int njobs = threads * JOBS_PER_THREAD < pairs ? threads * JOBS_PER_THREAD : (int)pairs;
    dp_job_t jobs[MAX_THREADS * JOBS_PER_THREAD];
    const int64_t per = (pairs + njobs - 1) / njobs;
    const int argmax = flags & Q8_ARGMAX_OUT;
    float *best = 0;
    int32_t *at = 0;
    if (argmax && argmax_alloc(njobs, m, &best, &at)) return -1;
    for (int t = 0; t < njobs; t++) {
        int64_t lo = t * per * 2 < blocks ? t * per * 2 : blocks;
        int64_t hi = lo + per * 2 < blocks ? lo + per * 2 : blocks;
        jobs[t] = (dp_job_t){x, pq, ps, po, y, m, n, k, lo, hi, flags, 0,
                             argmax ? best + t * m * 16 : 0, argmax ? at + t * m * 16 : 0};
    }
    parallel(dp_run, jobs, sizeof(dp_job_t), njobs, threads);
    int rc = 0;
    for (int t = 0; t < njobs; t++)
        if (jobs[t].rc) rc = jobs[t].rc;
    return argmax_finish(rc, best, at, njobs, m, y);
}
#else
int q8_dpbf16(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
              void *y, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x; (void)pq; (void)ps; (void)po; (void)flags; (void)y; (void)m; (void)n; (void)k;
    (void)threads;
    return -2; /* no AVX-512 BF16 on this machine */
}
#endif
