/* The keyed sampling noise's hash (kernels/murmur.py): MurmurHash3 x86_32 of (seed_lo,
 * seed_hi, position, token id); a row's state after its first three blocks is its
 * `prefix`, so a token's hash is the last block and the finish. gumbel.c and screen.c. */
#ifndef SWASERVE_MURMUR_H
#define SWASERVE_MURMUR_H
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NOISE_MAX 22.18070977791825 /* 32 log 2: no noise is larger (murmur.py) */

static inline uint32_t murmur_rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

static inline uint32_t murmur_token(uint32_t prefix, uint32_t token) {
    uint32_t k = token * 0xCC9E2D51u;
    k = murmur_rotl(k, 15) * 0x1B873593u;
    uint32_t h = murmur_rotl(prefix ^ k, 13) * 5u + 0xE6546B64u;
    h ^= 16u; /* four blocks of 4 bytes */
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

#ifdef __AVX512F__
/* murmur_token of 16 ids at once */
static inline __m512i murmur_tokens16(uint32_t prefix, __m512i ids) {
    __m512i k = _mm512_mullo_epi32(ids, _mm512_set1_epi32((int)0xCC9E2D51u));
    k = _mm512_mullo_epi32(_mm512_rol_epi32(k, 15), _mm512_set1_epi32(0x1B873593));
    __m512i h = _mm512_rol_epi32(_mm512_xor_si512(_mm512_set1_epi32((int)prefix), k), 13);
    h = _mm512_add_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32(5)),
                         _mm512_set1_epi32((int)0xE6546B64u));
    h = _mm512_xor_si512(h, _mm512_set1_epi32(16));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85EBCA6Bu));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xC2B2AE35u));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}
#endif
#endif
