/* The softmax's exponentials over a row of scores, shared by the attention kernels. */
#ifndef SWASERVE_SOFTMAX_H
#define SWASERVE_SOFTMAX_H
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include "simd.h"
#endif

/* s[j] = e^(s[j] - m) for j < n; returns their sum */
static inline float exp_minus(float *s, int64_t n, float m) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), mv));
        _mm512_mask_storeu_ps(s + j, live, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(live, e));
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

#endif
