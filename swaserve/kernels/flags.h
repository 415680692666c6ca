/* The flags and limits that the C kernels and their Python bindings share: the one place
   they are written. kernels/build.py reads the #defines below (build.constants()), so the
   bindings never copy a number by hand. Keep each a plain "#define NAME integer". */
#ifndef SWASERVE_FLAGS_H
#define SWASERVE_FLAGS_H

/* q8.c: flags of the tile kernels (q8_amx, q8_vnni), or'ed together */
#define Q8_HALVES 1     /* a scale (and offset) per 16 inputs, not 32 */
#define Q8_F16_SCALES 2 /* scales stored as float16 (exact for Q8_0 and Q5_0: half the bytes) */
#define Q8_BF16_OUT 4   /* y is bf16, each float32 sum rounded once (what a cast after would do) */
/* q8.c: rows of activations one call takes */
#define Q8_MAX_ROWS 8      /* q8_matvec */
#define Q8_VNNI_MAX_ROWS 8 /* q8_vnni */

/* attention.c: the per-head buffers */
#define ATTN_MAX_GROUP 16 /* query heads per key/value head */
#define ATTN_MAX_DIM 512  /* head dim */

/* norm.c: the row buffers */
#define NORM_MAX_DIM 8192

#endif
