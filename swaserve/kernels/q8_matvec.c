/* y[m, n] = sum_b d[n, b] * sum_{k < 32} q[n, 32 b + k] * x[m, 32 b + k]
 *
 * Matrix-vector products over int8 weights with one float scale per block of 32 (the
 * layout of GGUF Q8_0): a row of weights is read once, as 1 byte a weight plus 4 bytes a
 * block, for up to MAX_ROWS activation rows. Threads split the output features. Built at
 * run time on the machine that runs it (-O3 -march=native), so the loops vectorise with
 * that machine's instructions.
 */
#include <pthread.h>
#include <stdint.h>

#define BLOCK 32
#define MAX_ROWS 8

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
    __m512 a0[MAX_ROWS], a1[MAX_ROWS];
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
    float acc[MAX_ROWS][BLOCK] = {{0}};
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

/* 0 on success; -1 for shapes it does not take (m > MAX_ROWS, k not a multiple of 32) */
int q8_matvec(const float *x, const int8_t *q, const float *d, float *y, int64_t m,
              int64_t n, int64_t k, int threads) {
    if (m < 1 || m > MAX_ROWS || k % BLOCK != 0 || threads < 1) return -1;
    if (threads > 64) threads = 64;
    pthread_t tid[64];
    int created[64] = {0};
    job_t jobs[64];
    int64_t per = (n + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        int64_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        jobs[t] = (job_t){x, q, d, y, m, n, k, lo, hi};
    }
    for (int t = 1; t < threads; t++)
        created[t] = pthread_create(&tid[t], 0, run, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (created[t]) pthread_join(tid[t], 0);
        else run(&jobs[t]);  /* no thread: do its share here */
    }
    return 0;
}
