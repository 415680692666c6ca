/* Gemma's MLP activation on bf16 rows of [gate | up]: y = bf16(bf16(gelu_tanh(gate)) * up).
 *
 * torch spends a GELU (float32 tanh per element) and a multiply on this, over three bf16
 * tensors; one pass here. The same float32 formula as torch,
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
#include "kernels.h"

static inline float gelu_scalar(float x) {
    const float u = K0 * (x + K1 * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

#ifdef __AVX512F__
#include "simd.h"

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
#pragma omp parallel for num_threads(threads) if (rows * d >= ROWS_PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) row(gu + r * ld, gu + r * ld + d, y + r * d, d);
}
