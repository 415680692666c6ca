/* What the bf16 tile kernels share (q8.c: q8_amx and q8_dpbf16; screen.c packs the same
 * values): int8 blocks widened to bf16 tiles. */
#ifndef SWASERVE_TILES_H
#define SWASERVE_TILES_H
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define TILE_BYTES 1024 /* 16 rows x 64 bytes */

/* one 16 x 32 block as a bf16 tile: row r holds, for each output, inputs 2r and 2r + 1,
 * each value = q * scale - offset with the scale (and offset) of its output and of its
 * 16 (halves) or 32 inputs; q * scale is exact in float32 for every GGUF format taken */
static inline __m512 load_scales(const void *ps, int i, int flags) {
    if (flags & Q8_F16_SCALES)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)ps + i)));
    return _mm512_loadu_ps((const float *)ps + i);
}

static void widen_tile(const int8_t *pq, const void *ps, const float *po, int flags,
                       uint16_t *out) {
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10,
                                            9, 9, 8, 8);
    for (int l = 0; l < 8; l++)  /* the block 4 ahead: keeps the loads in flight */
        _mm_prefetch((const char *)pq + 2048 + l * 64, _MM_HINT_T0);
    for (int h = 0; h < 2; h++) {
        const int g = flags & Q8_HALVES ? h * 16 : 0;
        const __m512 s = load_scales(ps, g, flags);
        const __m512 slo = _mm512_permutexvar_ps(lo_idx, s), shi = _mm512_permutexvar_ps(hi_idx, s);
        const __m512 o = po ? _mm512_loadu_ps(po + g) : _mm512_setzero_ps();
        const __m512 olo = _mm512_permutexvar_ps(lo_idx, o), ohi = _mm512_permutexvar_ps(hi_idx, o);
        for (int r = h * 8; r < h * 8 + 8; r++) {
            const int8_t *p = pq + r * 32;
            __m512 lo = _mm512_sub_ps(_mm512_mul_ps(slo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)p)))), olo);
            __m512 hi = _mm512_sub_ps(_mm512_mul_ps(shi, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(p + 16))))), ohi);
            _mm512_store_si512((void *)(out + r * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

#endif
#endif
