/* The OpenMP driver both decode attention kernels share (attention.c over bf16 caches,
 * attention_q8.c over int8 ones): one job per (sequence, KV head), each thread with its
 * own scratch, so a job's result never depends on which thread ran it or beside what. */
#ifndef SWASERVE_DECODE_JOBS_H
#define SWASERVE_DECODE_JOBS_H
#include <stdint.h>
#include <stdlib.h>

/* job (sequence r, KV head g) with `scratch` (scratch_bytes, 64-byte aligned) */
typedef void (*decode_job_fn)(const void *arg, int64_t r, int64_t g, void *scratch);

/* runs every job of b sequences x kvh heads; 0, or -1 when scratch cannot be allocated
 * (nothing written then). Small calls (l keys of d dims) stay on the calling thread. */
static inline int decode_jobs(int64_t b, int64_t kvh, int64_t l, int64_t d,
                              size_t scratch_bytes, int threads, decode_job_fn job,
                              const void *arg) {
    const int64_t jobs = b * kvh;
    const size_t bytes = (scratch_bytes + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (jobs > 1 && jobs * l * d >= 16384)
    {
        void *scratch = aligned_alloc(64, bytes ? bytes : 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < jobs; i++) job(arg, i / kvh, i % kvh, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
#endif
