/*
 * flash.h - the fused attention pass (pass 2 of the forward), internal to
 * csrc/.
 *
 * Legend (see mha.h): B batch, Tq queries, Tk keys, H query heads, G kv
 * heads, dk / dv the widths of the tile's kv head, Sq / Sk / Sv / Svq the
 * fused widths. Tile sizes: BQ query rows per tile, BK keys per key block,
 * MR x NR the register block of the micro-kernels.
 *
 * One tile is (b, h, query block): rows i0 .. i0 + BQ - 1 of query head h
 * in batch b. Its owner computes everything those rows produce, as in
 * FlashAttention-2 with the online softmax:
 *
 *   for each key block j0 = 0, BK, ... below the tile's last visible key:
 *     1. pack K_blk^T (dk, BK) and V_blk (BK, dv) into the thread's scratch;
 *     for each group of MR rows:
 *       2. S = scale * Q_rows K_blk^T, then the masks (-inf = blocked);
 *       3. m' = max(m, rowmax S); P = exp(S - m'); alpha = exp(m - m');
 *          l = alpha l + rowsum P;
 *       4. O = alpha O + P V_blk;
 *   5. head output = O / l, lse = m + log l (0 and -inf when l == 0);
 *   6. with weights wanted, a second sweep recomputes S and writes
 *      exp(S - m) / l with the final m and l, so the weights are exactly
 *      normalised and `out` does not depend on whether they were asked for.
 *
 * Key blocks beyond the last visible key of the tile (causal diagonal,
 * key_lengths[b]) are never touched. No (Tq, Tk) buffer is built.
 *
 * Determinism: a tile is computed by one thread, in one fixed order, with
 * tile sizes that depend on the ISA only, so results do not depend on the
 * thread count (or on which thread runs which tile).
 *
 * Variants: _ref (portable C, libm exp), _avx2 (AVX2 + FMA) and _avx512
 * (AVX-512F), all from one template, flash_impl.h, compiled per ISA in
 * flash_<isa>.c; each file compiles float32 and float64.
 */
#ifndef MHA_FLASH_H
#define MHA_FLASH_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "mha.h"
#include "threads.h"

#if defined(__x86_64__) || defined(__i386__)
#define MHA_FLASH_X86 1
#endif

/* What a tile needs; shared read-only by every task of one call, except
   `stop`. Element pointers are float or double as the kernel says. */
typedef struct {
    const mha_config *cfg;
    size_t Sq, Sk, Sv, Svq;
    const size_t *qoff, *cvoff;   /* (H,): head offsets in q and cat   */
    const size_t *koff, *voff;    /* (G,): head offsets in k and v     */
    const void *q;                /* (B, Tq, Sq)                       */
    const void *k;                /* (B, Tk, Sk)                       */
    const void *v;                /* (B, Tk, Sv)                       */
    void *cat;                    /* (B, Tq, Svq): heads side by side  */
    void *weights;                /* (B, H, Tq, Tk) or NULL            */
    void *lse;                    /* (B, H, Tq) or NULL                */
    size_t nqb;                   /* query blocks per (b, h)           */
    size_t dk_max, dv_max;        /* the scratch is laid out for these */
    unsigned char *scratch;       /* nth * scratch_stride bytes, 64-aligned */
    size_t scratch_stride;        /* bytes per thread, a multiple of 64 */
    atomic_int stop;              /* set once cfg->interrupt was seen  */
} mha_flash_ctx;

/* One (ISA, element type) variant of the pass. */
typedef struct {
    /* task(ctx, t, ith): tile t = (b * H + h) * nqb + block, in the
       scratch of thread ith */
    mha_task_fn task;
    size_t bq; /* BQ, query rows per tile */
    /* Scratch bytes one thread needs for kv heads up to dk_max x dv_max
       wide (a multiple of 64), or 0 when that overflows size_t. */
    size_t (*scratch_bytes)(size_t dk_max, size_t dv_max);
} mha_flash_kernel;

extern const mha_flash_kernel mha_flash_ref_f32, mha_flash_ref_f64;
#ifdef MHA_FLASH_X86
extern const mha_flash_kernel mha_flash_avx2_f32, mha_flash_avx2_f64;
extern const mha_flash_kernel mha_flash_avx512_f32, mha_flash_avx512_f64;
#endif

/* n rounded up to a multiple of m (m > 0); callers keep n far from
   SIZE_MAX. */
static inline size_t mha_flash_round_up(size_t n, size_t m)
{
    return (n + m - 1) / m * m;
}

/*
 * Keys j < mha_flash_key_limit(...) are visible to query i before the
 * mask: j < key_lengths[b] and, when causal, j <= i + Tk - Tq (the
 * triangle aligned bottom-right; the first Tq - Tk rows see nothing when
 * Tk < Tq). Nondecreasing in i.
 */
static inline size_t mha_flash_key_limit(size_t i, size_t Tq, size_t Tk,
                                         int causal, size_t len_b)
{
    if (!causal)
        return len_b;
    if (i + Tk < Tq)
        return 0;
    const size_t e = i + Tk - Tq + 1; /* <= Tk, since i < Tq */
    return e < len_b ? e : len_b;
}

#endif /* MHA_FLASH_H */
