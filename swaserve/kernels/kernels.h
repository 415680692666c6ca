/* The one place for what the C kernels and their Python bindings share: the flags and
   limits (each a plain "#define NAME integer") and every exported function's prototype.
   Every .c includes this, so the compiler checks each definition against its prototype;
   kernels/build.py reads both (build.constants(), build.signature()), so the bindings never
   copy a number or an argument list by hand. Pointers are passed as addresses; the types
   used are int, int64_t, float and pointers. */
#ifndef SWASERVE_KERNELS_H
#define SWASERVE_KERNELS_H

#include <stdint.h>

/* q8.c: flags of the tile kernels (q8_amx, q8_vnni), or'ed together */
#define Q8_HALVES 1     /* a scale (and offset) per 16 inputs, not 32 */
#define Q8_F16_SCALES 2 /* scales stored as float16 (exact for Q8_0 and Q5_0: half the bytes) */
#define Q8_BF16_OUT 4   /* y is bf16, each float32 sum rounded once (what a cast after would do) */
#define Q8_ARGMAX_OUT 8 /* y is int64 [m], each row's first index of its largest float32 sum
                           (the argmax of the sums it would write); -3 if a sum is NaN */
#define Q8_PACK4 16     /* q8_vnni: pq holds the tiles' values as 4-bit u = q (0..15): per
                           block, 16 input pairs x 16 bytes, value 2b low and 2b + 1 high */
#define Q8_PACK5 32     /* q8_vnni: 5-bit u = q + 16 (q in -16..15): those nibbles, then per
                           pair a uint32 of the fifth bits */
/* q8.c: rows of activations one call takes (q8_vnni, q8_amx, q8_dpbf16: any) */
#define Q8_MAX_ROWS 8      /* q8_matvec */
#define Q8_VNNI_CHUNK 8    /* q8_vnni: rows whose sums one pass over a block keeps in registers */

/* attention.c: the per-head buffers */
#define ATTN_MAX_GROUP 16 /* query heads per key/value head */
#define ATTN_MAX_DIM 512  /* head dim */

/* norm.c, gelu.c: a call splits its rows over the threads from this many values on (a
   prompt chunk). Rows are independent: one row's arithmetic is the same whoever computes
   it. Decode steps stay on one thread: splitting a decode step's small calls makes those
   calls faster but not the step, whose time is in the products. */
#define ROWS_PARALLEL_MIN 65536

/* norm.c: the row buffers */
#define NORM_MAX_DIM 8192

/* q8.c: y [m, n] = x [m, k] @ int8 weights [n, k]^T, 0 on success, -1 for shapes not taken */
int q8_matvec(const float *x, const int8_t *q, const float *d, float *y, int64_t m,
              int64_t n, int64_t k, int threads);
int q8_vnni(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
            void *y, int64_t m, int64_t n, int64_t k, int threads);
int q8_amx(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
           void *y, int64_t m, int64_t n, int64_t k, int threads);
int q8_dpbf16(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
              void *y, int64_t m, int64_t n, int64_t k, int threads);
int q8_dpbusd(const uint16_t *x, const int8_t *pq, const void *ps, const float *po, int flags,
              void *y, int64_t m, int64_t n, int64_t k, int threads);

/* screen.c: each row's candidates for the argmax of x [m, k] bf16 @ W^T from W's int8 copy
   (kernels/screen.py), or with temp [m] > 0 (NULL: none) of its keyed Gumbel-max at that
   temperature (prefix [m]: murmur.py's row prefixes); cand [m, cap], count [m] (-1: more
   than cap). 0 on success, -1 for shapes not taken, -2 without AVX-512 VNNI and BF16, -3
   for a value of x that is not finite */
int head_screen(const uint16_t *x, const int32_t *perm, const int32_t *edges, int64_t ngroups,
                const uint8_t *wq, const float *stats, int64_t m, int64_t n, int64_t k,
                const float *temp, const int64_t *prefix, int64_t cap, int32_t *cand,
                int64_t *count, int threads);
/* screen.c: a keyed row's noise bounds, least[r] <= g(h) <= most[r] for the hashes h of
   range r (kernels/murmur.py's g; the ranges in screen.c); their number (32) */
int head_screen_noise_ranges(float *least, float *most);
/* screen.c: those bounds of n hashes as the screen reads them; -2 without its kernels */
int head_screen_noise(const int64_t *hashes, int64_t n, float *least, float *most);
/* screen.c: the head's int8 tiles (q8_dpbf16's arguments) as head_screen's wq [n/32, k/4,
   2, 16, 4] and stats [n/16, ngroups, 2, 16]; -3 for a weight that is not finite */
int head_screen_pack(const int8_t *pq, const void *ps, const float *po, int flags,
                     const int32_t *perm, const int32_t *edges, int64_t ngroups, int64_t n,
                     int64_t k, uint8_t *wq, float *stats, int threads);

/* attention.c: decode attention over the cache in place */
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                          const uint16_t *v, const int64_t *slots, const uint8_t *mask,
                          const float *sinks, uint16_t *out, int64_t b, int64_t h,
                          int64_t kvh, int64_t d, int64_t l, float scale, int threads);
/* attention_q8.c: the same over int8 caches, k and v [S, KVH, D] int8 and their scales
   k_scale, v_scale [S, KVH, nb] float (value i of a head is scale[i / (D / nb)] * int8) */
int decode_attention_q8(const uint16_t *q, int64_t q_stride, const int8_t *k, const int8_t *v,
                        const float *k_scale, const float *v_scale, const int64_t *slots,
                        const uint8_t *mask, const float *sinks, uint16_t *out, int64_t b,
                        int64_t h, int64_t kvh, int64_t d, int64_t nb, int64_t l, float scale,
                        int threads);
/* attention_q8.c: 1 when decode_attention_q8 takes heads of d dims in nb blocks with its
   int16 products (AVX-512 VNNI, blocks of 32, d a multiple of 64), else 0 (float32) */
int decode_attention_q8_int16(int64_t d, int64_t nb);
/* attention.c: prompt attention (AVX-512 BF16): q [n, H, D], k and v [L, KVH, D], mask
   [n, L] bytes (1 = attend) or NULL (causal: query i sees keys 0 .. L - n + i), sinks [H]
   float or NULL, out [n, H, D]; all bf16. 0 on success, -1 for shapes not taken, -2
   without AVX-512 BF16 */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const uint8_t *mask, const float *sinks, uint16_t *out, int64_t n,
                           int64_t l, int64_t h, int64_t kvh, int64_t d, float scale,
                           int threads);
/* attention.c: the same over the keys at slots[0..L) of int8 pools [S, KVH, D] and their
   scales [S, KVH, nb] float, each widened to bf16(scale * int8) as torch dequantizes */
int prefill_attention_q8(const uint16_t *q, const int8_t *k, const int8_t *v,
                         const float *k_scale, const float *v_scale, const int64_t *slots,
                         const uint8_t *mask, const float *sinks, uint16_t *out, int64_t n,
                         int64_t l, int64_t h, int64_t kvh, int64_t d, int64_t nb, float scale,
                         int threads);

/* norm.c */
void rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *y, int64_t outer,
                   int64_t inner, int64_t stride_outer, int64_t stride_inner, int64_t d,
                   float eps, int threads);
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *dl, int64_t ld, const float *wd,
                       const float *wn, uint16_t *x_out, uint16_t *h, int64_t rows,
                       int64_t d, float eps, int threads);
void qk_norm_rope_bf16(const uint16_t *qkv, int64_t ld, const float *qw, const float *kw,
                       const uint16_t *cos, const uint16_t *sin, int64_t ld_cs,
                       uint16_t *q_out, uint16_t *k_out, int64_t t, int64_t h, int64_t kvh,
                       int64_t d, float eps, int threads);

/* gelu.c */
void gelu_tanh_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t rows, int64_t d, int64_t ld,
                        int threads);

/* gumbel.c: the ids of keyed rows that could win their Gumbel-max (sampler.py); a noise
   past GUMBEL_LOW is one hash in ~3,000 */
#define GUMBEL_LOW 8
int gumbel_candidates(const float *logits, int64_t rows, int64_t vocab, const float *temp,
                      const double *best, const int64_t *prefix, int64_t cap, int64_t *out_tok,
                      int64_t *count, int threads);
/* gumbel.c: the same for filtering rows (top-k, top-p, min-p; top_k >= vocab: all) rows[r]
   of logits, from their kept sets; count[r] = -1 for a row left to the caller */
int nucleus_candidates(const float *logits, const int64_t *rows, int64_t nrows, int64_t vocab,
                       const float *temp, const int64_t *top_k, const float *top_p,
                       const float *min_p, const int64_t *prefix, int64_t cap, int64_t *out_tok,
                       int64_t *count, int threads);

/* decode.c: a decode step's layers in one call (its structs are defined there) */
struct decode_fns;
struct decode_layer;
struct decode_kind;
struct decode_bufs;
/* decode_layers' timers (seconds, when it is given them): the int8 products, attention,
 * and the norms, q/k norm + RoPE and GeGLU; the rest of the call is the cache writes */
#define DECODE_PRODUCTS 0
#define DECODE_ATTENTION 1
#define DECODE_NORMS 2
#define DECODE_PARTS 3
int decode_layers(const struct decode_fns *f, const struct decode_layer *layers,
                  int64_t num_layers, const struct decode_kind *kinds, uint16_t *x,
                  const struct decode_bufs *b, int64_t m, int64_t hidden, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, float eps, float scale, int threads,
                  double *seconds);

#endif
