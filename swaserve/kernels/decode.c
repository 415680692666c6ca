/* The decoder layers of a decode step in one call: for each layer, the kernels that the
 * Python layer would call one by one (norm.c, q8.c, attention.c, gelu.c), called here in
 * the same order with the same arguments, so the results are the same bits. What it saves
 * is Python's and torch's work between the kernels: ~12 kernel calls a layer, each with a
 * few tensor allocations, views and checks around it, a large share of a small model's
 * batch-1 step.
 *
 * The kernels are not linked in: their entry points come in a table (`fns_t`) from the
 * libraries Python has already loaded, so each kernel exists once.
 *
 * Layer shape (Gemma 3): h = norm(x); q, k, v = qkv(h), q/k normed and rotated; the new k
 * and v written into the cache slots (and a sliding layer's through to the prefix cache's
 * window pages); attention over the cache; x, h = x + norm(o(attn)),
 * norm(.); x = x + norm(down(gelu(gate) * up)).
 *
 * An int8 cache (kv_cache_dtype int8) takes the new k and v as memory/kv_quant.py's
 * `quantize` stores them (the same float32 arithmetic, so the same bytes and scales) and
 * attends with attention_q8.c, as the layer does.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "kernels.h"

#ifdef __AVX512F__
#include "simd.h"
#endif

/* the kernels it calls, typed by their prototypes in kernels.h */
typedef __typeof__(&q8_amx) q8_fn;
typedef __typeof__(&rms_norm_bf16) norm_fn;
typedef __typeof__(&add_rms_norm_bf16) add_norm_fn;
typedef __typeof__(&qk_norm_rope_bf16) rope_fn;
typedef __typeof__(&decode_attention_bf16) attn_fn;
typedef __typeof__(&decode_attention_q8) attn_q8_fn;
typedef __typeof__(&gelu_tanh_mul_bf16) gelu_fn;

typedef struct decode_fns {
    q8_fn q8;  /* the int8 kernel for this step's row count */
    norm_fn norm;
    add_norm_fn add_norm;
    rope_fn rope;
    attn_fn attn;
    gelu_fn gelu;
    attn_q8_fn attn_q8; /* for int8 caches, or NULL */
} fns_t;

typedef struct { /* an int8 weight in tile order (q8.py), [n, k] */
    const int8_t *pq;
    const void *ps;
    const float *po;
    int64_t flags, n, k;
} q8w_t;

typedef struct decode_layer {
    q8w_t qkv, o, gate_up, down;
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    void *k_pool, *v_pool;   /* [S, KVH, D]: bf16, or int8 with kv_blocks scales */
    void *kw_pool, *vw_pool; /* the prefix cache's window pages, or NULL */
    float *k_scale, *v_scale, *kw_scale, *vw_scale; /* int8: [S, KVH, kv_blocks] */
    int64_t kv_blocks;       /* scales a slot's KV head has; 0: a bf16 cache */
    int64_t kind;            /* which `kind_t` of the step: 0 sliding, 1 full */
} layer_t;

typedef struct decode_kind { /* per attention kind, for this step */
    const int64_t *write_slots; /* [m]: where each row's new k and v go */
    const int64_t *key_slots;   /* [m, keys] */
    const uint8_t *mask;        /* [m, keys] or NULL */
    int64_t keys;
    const uint16_t *cos, *sin;  /* [m, D] */
    const int64_t *page_rows, *page_slots; /* rows whose k, v also go to window pages */
    int64_t num_page_writes;
} kind_t;

typedef struct decode_bufs { /* scratch, each [m, its width] bf16 */
    uint16_t *h, *qkv, *q, *k, *attn, *o, *gu, *act, *down;
} bufs_t;


/* x [n] bf16 in nsc blocks as memory/kv_quant.py's int8 `quantize` stores them: a block's
 * scale max|x| / 127, its values round(x / scale) (half to even) in [-127, 127]; IEEE
 * float32 division and rounding either way, so the vectors give the scalar loop's bytes */
static void quantize(const uint16_t *x, int64_t n, int64_t nsc, int8_t *q, float *scales) {
    const int64_t bs = n / nsc;
    for (int64_t blk = 0; blk < nsc; blk++) {
        const uint16_t *xb = x + blk * bs;
        int8_t *qb = q + blk * bs;
#ifdef __AVX512F__
        if (bs % 16 == 0) {
            __m512 mv = _mm512_setzero_ps();
            for (int64_t i = 0; i < bs; i += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(load_bf16(xb + i)));
            const float s = _mm512_reduce_max_ps(mv) / 127.0f;
            const __m512 div = _mm512_set1_ps(s > FLT_MIN ? s : FLT_MIN);
            for (int64_t i = 0; i < bs; i += 16) {
                __m512 y = _mm512_roundscale_ps(_mm512_div_ps(load_bf16(xb + i), div),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
                _mm_storeu_si128((__m128i *)(qb + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y)));
            }
            scales[blk] = s;
            continue;
        }
#endif
        float m = 0.0f, f[ATTN_MAX_DIM];
        for (int64_t i = 0; i < bs; i++) {
            f[i] = bf16_to_f32(xb[i]);
            m = fmaxf(m, fabsf(f[i]));
        }
        const float s = m / 127.0f, div = s > FLT_MIN ? s : FLT_MIN;
        for (int64_t i = 0; i < bs; i++) {
            const float y = rintf(f[i] / div);
            qb[i] = (int8_t)(y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y);
        }
        scales[blk] = s;
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* x [m, hidden] bf16, updated in place. With `seconds` (DECODE_PARTS of them, or NULL),
 * each kernel's time is added to its part. 0 on success, else the failing kernel's code. */
int decode_layers(const struct decode_fns *f, const struct decode_layer *layers,
                  int64_t num_layers, const struct decode_kind *kinds, uint16_t *x,
                  const struct decode_bufs *b, int64_t m, int64_t hidden, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, float eps, float scale, int threads,
                  double *seconds) {
    const int64_t qs = heads * head_dim, kvs = kv_heads * head_dim, qkv_n = qs + 2 * kvs;
    int rc;
    double t0 = 0.0;
#define START() (t0 = seconds ? now() : 0.0)
#define STOP(part) (seconds ? (void)(seconds[part] += now() - t0) : (void)0)
#define Q8(w, in, out)                                                                    \
    START();                                                                              \
    if ((rc = f->q8((in), (w).pq, (w).ps, (w).po, (int)(w).flags | Q8_BF16_OUT, (out), m,     \
                    (w).n, (w).k, threads)))                                              \
        return rc;                                                                        \
    STOP(DECODE_PRODUCTS);
    for (int64_t i = 0; i < num_layers; i++) {
        const layer_t *L = layers + i;
        const kind_t *kd = kinds + L->kind;
        START();
        f->norm(x, L->attn_norm, b->h, m, 1, hidden, 0, hidden, eps, threads);
        STOP(DECODE_NORMS);
        Q8(L->qkv, b->h, b->qkv);
        START();
        f->rope(b->qkv, qkv_n, L->q_norm, L->k_norm, kd->cos, kd->sin, head_dim, b->q, b->k,
                m, heads, kv_heads, head_dim, eps, threads);
        STOP(DECODE_NORMS);
        for (int64_t r = 0; r < m; r++) { /* the cache write: index_copy_ of k and v */
            const uint16_t *kr = b->k + r * kvs, *vr = b->qkv + r * qkv_n + qs + kvs;
            const int64_t s = kd->write_slots[r];
            if (L->kv_blocks) {
                const int64_t nsc = kv_heads * L->kv_blocks;
                quantize(kr, kvs, nsc, (int8_t *)L->k_pool + s * kvs, L->k_scale + s * nsc);
                quantize(vr, kvs, nsc, (int8_t *)L->v_pool + s * kvs, L->v_scale + s * nsc);
            } else {
                memcpy((uint16_t *)L->k_pool + s * kvs, kr, (size_t)kvs * 2);
                memcpy((uint16_t *)L->v_pool + s * kvs, vr, (size_t)kvs * 2);
            }
        }
        for (int64_t j = 0; L->kw_pool && j < kd->num_page_writes; j++) { /* write-through */
            const int64_t r = kd->page_rows[j], s = kd->page_slots[j];
            if (L->kv_blocks) { /* the bytes and scales just stored at the row's slot */
                const int64_t from = kd->write_slots[r], nsc = kv_heads * L->kv_blocks;
                memcpy((int8_t *)L->kw_pool + s * kvs, (int8_t *)L->k_pool + from * kvs, (size_t)kvs);
                memcpy((int8_t *)L->vw_pool + s * kvs, (int8_t *)L->v_pool + from * kvs, (size_t)kvs);
                memcpy(L->kw_scale + s * nsc, L->k_scale + from * nsc, sizeof(float) * (size_t)nsc);
                memcpy(L->vw_scale + s * nsc, L->v_scale + from * nsc, sizeof(float) * (size_t)nsc);
            } else {
                memcpy((uint16_t *)L->kw_pool + s * kvs, b->k + r * kvs, (size_t)kvs * 2);
                memcpy((uint16_t *)L->vw_pool + s * kvs, b->qkv + r * qkv_n + qs + kvs,
                       (size_t)kvs * 2);
            }
        }
        START();
        if (L->kv_blocks)
            rc = f->attn_q8(b->q, qs, L->k_pool, L->v_pool, L->k_scale, L->v_scale,
                            kd->key_slots, kd->mask, NULL, b->attn, m, heads, kv_heads, head_dim,
                            L->kv_blocks, kd->keys, scale, threads);
        else
            rc = f->attn(b->q, qs, L->k_pool, L->v_pool, kd->key_slots, kd->mask, NULL, b->attn,
                         m, heads, kv_heads, head_dim, kd->keys, scale, threads);
        if (rc) return rc;
        STOP(DECODE_ATTENTION);
        Q8(L->o, b->attn, b->o);
        START();
        f->add_norm(x, b->o, hidden, L->post_attn_norm, L->ffn_norm, x, b->h, m, hidden, eps,
                    threads);
        STOP(DECODE_NORMS);
        Q8(L->gate_up, b->h, b->gu);
        START();
        f->gelu(b->gu, b->act, m, L->gate_up.n / 2, L->gate_up.n, threads);
        STOP(DECODE_NORMS);
        Q8(L->down, b->act, b->down);
        START();
        f->add_norm(x, b->down, hidden, L->post_ffn_norm, NULL, x, NULL, m, hidden, eps,
                    threads);
        STOP(DECODE_NORMS);
    }
#undef Q8
#undef START
#undef STOP
    return 0;
}
