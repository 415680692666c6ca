/* Gemma's MLP activation on bf16 rows of [gate | up]: y = bf16(bf16(gelu_tanh(gate)) * up).
 *
 * torch spends a GELU (float32 tanh per element, ~1.8 ms for [512, 2048]) and a multiply
 * on this, over three bf16 tensors; one pass here. The same float32 formula as torch,
 * 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), so that 1 + tanh(u)
 * cancels to 0 where torch's does (x below about -4.5); tanh from exp to float32
 * round-off, so the bf16 result is torch's but at a rounding boundary. The GELU is
 * rounded to bf16 before the multiply, as torch's two ops do.
 */
#include <math.h>
#include <stdint.h>

#define K0 0.7978845608028654f /* sqrt(2 / pi) */
#define K1 0.044715f

#include "bf16.h"

static inline float gelu_scalar(float x) {
    const float u = K0 * (x + K1 * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for x in [-87, 88]: 2^n * 2^f, f in [-1/2, 1/2], Taylor to degree 7 (5e-9) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
    static const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6,
                              0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m256i to_bf16(__m512 v) { /* round to nearest even */
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(
        r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40))));
#endif
}

static void row(const uint16_t *g, const uint16_t *up, uint16_t *y, int64_t d) {
    int64_t k = 0;
    for (; k + 16 <= d; k += 16) {
        const __m512 x = load_bf16(g + k);
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 u = _mm512_mul_ps(_mm512_set1_ps(K0),
                                       _mm512_fmadd_ps(_mm512_set1_ps(K1), x3, x));
        /* tanh |u| = 1 - 2 / (e^2|u| + 1): near 1, where 1 + tanh(u) cancels, the small
         * term is exact to round-off and the difference rounds as torch's tanh does */
        const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
        const __m512 a = _mm512_andnot_ps(sign, u);
        const __m512 e = exp16(_mm512_add_ps(a, a));
        const __m512 ta = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                           _mm512_add_ps(e, one)));
        const __m512 t = _mm512_or_ps(ta, _mm512_and_ps(sign, u));
        const __m512 gl = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                                        _mm512_add_ps(one, t));
        const __m512 gq = _mm512_castsi512_ps(_mm512_slli_epi32(  /* gelu rounded to bf16 */
            _mm512_cvtepu16_epi32(to_bf16(gl)), 16));
        _mm256_storeu_si256((__m256i *)(y + k), to_bf16(_mm512_mul_ps(gq, load_bf16(up + k))));
    }
    for (; k < d; k++)
        y[k] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gelu_scalar(bf16_to_f32(g[k])))) *
                           bf16_to_f32(up[k]));
}
#else
static void row(const uint16_t *g, const uint16_t *up, uint16_t *y, int64_t d) {
    for (int64_t k = 0; k < d; k++)
        y[k] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gelu_scalar(bf16_to_f32(g[k])))) *
                           bf16_to_f32(up[k]));
}
#endif

/* gu [rows][ld] bf16 holding gate in columns [0, d) and up in [d, 2d); y [rows][d] */
void gelu_tanh_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t rows, int64_t d, int64_t ld,
                        int threads) {
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; r++) row(gu + r * ld, gu + r * ld + d, y + r * d, d);
}
