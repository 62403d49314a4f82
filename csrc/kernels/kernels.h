/*
 * kernels.h - the per-ISA kernels of the core, internal to csrc/: one table
 * of kernel pointers per (ISA, element type), filled by that ISA's compile
 * unit (isa_ref.c, isa_avx2.c, isa_avx512.c, isa_neon.c) and chosen by
 * mha_kernels_for(): the only ISA switch in the core.
 *
 * Legend (see mha.h): B batch, Tq queries, Tk keys, H query heads, G kv
 * heads, dk / dv a kv head's widths, Sq / Sk / Sv / Svq fused widths.
 *
 * Three kernels, each written once against the vector vocabulary
 * (simd_<isa>.h) and compiled per ISA and type by kernels.inc:
 *   flash.inc     the forward's fused attention tile (FlashAttention-2)
 *   bwd.inc       the backward's operand packing and tiles
 *   gemm_ukr.inc  the GEMM micro-kernel and transposing copy
 * The drivers that run them, and own every allocation, are in core/.
 */
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "dispatch.h"
#include "mha.h"
#include "rules.h"
#include "threads.h"

/* n rounded up to a multiple of m (m > 0); callers keep n far from
   SIZE_MAX. */
static inline size_t mha_round_up(size_t n, size_t m)
{
    return (n + m - 1) / m * m;
}

/*
 * The forward's pass 2 (core/forward.c): one task per tile (b, h, query
 * block), rows i0 .. i0 + BQ - 1 of query head h in batch item b. Its owner
 * computes everything those rows produce, with the online softmax:
 *
 *   for each key block j0 = klo, klo + BK, ... below kend, [klo, kend) the
 *   keys some row of the tile sees (core/rules.h), but those key_mask
 *   blocks wholly:
 *     1. pack K_blk^T (dk, BK) and V_blk (BK, dv) into the thread's scratch
 *        (or find them packed once for every tile: mha_flash_ctx.kv);
 *     for each group of MR rows that sees a key of the block:
 *       2. S = scale * Q_rows K_blk^T, then the rules (core/rules.h):
 *          masks, and -inf for every key a row does not see;
 *       3. m' = max(m, rowmax S); P = exp(S - m'); alpha = exp(m - m');
 *          l = alpha l + rowsum P;
 *       4. O = alpha O + P V_blk;
 *   5. head output = O / l, lse = m + log l (0 and -inf when l == 0);
 *      with a sink, m and l start at sink_h and 1 instead of -inf and 0;
 *   6. with weights wanted, a second sweep recomputes S and writes
 *      exp(S - m) / l with the final m and l, so the weights are exactly
 *      normalised and `out` does not depend on whether they were asked for.
 * Key blocks no row of the tile sees are never touched.
 * A tile is computed by one thread in one fixed order, with tile sizes
 * that depend on the ISA only: results do not depend on the thread count.
 *
 * Shared read-only by every task of one call, except `stop`. Element
 * pointers are float or double as the table's type says.
 */
typedef struct {
    const mha_config *cfg;
    /* Where each operand lies: element (b, h, t, c) of q at
       b q_bs + qoff[h] + t Sq + c, and likewise k, v (kv head g: koff,
       voff) and cat (cvoff). mha_forward's fused buffers have q_bs = Tq Sq
       and so on; mha_attend's strided ones any strides (mha_strides). */
    size_t Sq, Sk, Sv, Svq;       /* row strides of q, k, v and cat    */
    size_t q_bs, k_bs, v_bs, c_bs; /* batch strides                   */
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
    /* Split-K (flash_part_task, mha_attend): the keys of each (b, h) in
       nparts parts of part_len keys (the last may be shorter); part p of
       tile (b, h, block) leaves its rows' unnormalised o and running m, l,
       without the sink, at slot s = ((b H + h) nqb + block) nparts + p:
         part_o (slots, Tq, dv_max), part_m, part_l (slots, Tq)
       (a split call has Tq <= MHA_SPLIT_ROWS <= BQ: one block per (b, h)).
       1 part: the tiles above, no partials. */
    size_t nparts, part_len;
    void *part_o, *part_m, *part_l;
    size_t bq;                    /* the kernel's BQ                   */
    /* mha_attend without weights: one-row tiles use the decode kernels
       (flash_tile_row1), whose sums differ in rounding from the register
       blocks' (the weights' second sweep recomputes with the latter). */
    int decode;
    /* Split-K of a decode step (Tq = 1, decode, H / G <= BQ): one task per
       (b, g, part) works every query head of kv head g (flash.inc). */
    int group;
    /* Shared key blocks: kv != NULL when step 1 was done once for the
       call (flash_share_task, before the tiles), not once per tile. Key
       block kb (keys kb BK ..) of kv head (b, g) is at kv + ((b G + g) nkb
       + kb) kv_stride elements: K_blk^T (dk_max, BK), zero past the keys,
       then at kv_vp_off V_blk (BK, dvp_max), zero past dv; kv_bad[(b G +
       g) nkb + kb] != 0 when that V block holds an inf or NaN. A tile uses
       a block only at the offset it would pack (its key blocks start at a
       multiple of BK), so its bits are the same either way. */
    void *kv;
    unsigned char *kv_bad;
    size_t nkb, kv_stride, kv_vp_off;
    /* A KV cache's storage (mha_params.kv_storage, mha_attend, float
       tables only): k and v hold float16 or bfloat16 bits, or int8 with
       one float scale per (b, g, key) at k_scale + b sks.sb + g sks.sh +
       j sks.st (v_scale, svs likewise); the offsets and strides above
       count their elements. The packed tiles widen a key block's rows
       into their scratch (flash.inc, flash_widen_rows); the decode
       kernels widen each row in the loads that read it (flash_rows).
       Both compute on them as on float32 rows: the same bits as float32
       k, v holding the widened values. MHA_KV_PLAIN: k, v of the table's
       type, read in place. */
    mha_kv_storage kv_storage;
    const float *k_scale, *v_scale;
    mha_strides sks, svs;
    /* T5's bias by distance (core/relbias.h), made by attend() for a
       config with rel_table; NULL without. */
    const mha_rel *rel;
    atomic_int stop;              /* set once cfg->interrupt was seen  */
} mha_flash_ctx;

/* Split-K (core/forward.c, attend_split_plan): calls of at most
   MHA_SPLIT_ROWS query rows split each (b, h)'s keys into about one part
   per MHA_SPLIT_KEYS keys, at most MHA_SPLIT_MAX parts. */
#define MHA_SPLIT_ROWS ((size_t)16)
#define MHA_SPLIT_KEYS ((size_t)512)
#define MHA_SPLIT_MAX ((size_t)64)

/* The caller's interrupt flag (cfg->interrupt, may be NULL) is raised: the
   one poll of the core. Drivers poll it between stages (a GEMM is not
   split), tiles before their work; a call that sees it returns
   MHA_ERR_INTERRUPTED, its outputs undefined. */
static inline int mha_interrupted(const mha_config *cfg)
{
    return cfg->interrupt != NULL && *cfg->interrupt != 0;
}

/* The backward's tile sizes: a tile is BWD_BQ query rows x BWD_BK keys,
   its S and dP (BQ x BK each) stay in L1/L2 while it is worked. Every ISA
   uses the same, so the backward's plan does not depend on the ISA. */
#define MHA_BWD_BQ ((size_t)64)
#define MHA_BWD_BK ((size_t)64)
/* Reals of one thread's tile scratch, S (BQ, BK), dP (BQ, BK), the
   softcap's derivative of one row (BK,) and dropout's mask of one row (BK
   integers of a real's width), rounded up to a whole number of 64-byte
   cache lines for either element size. */
#define MHA_BWD_TILE_STRIDE ((2 * MHA_BWD_BQ * MHA_BWD_BK + 2 * MHA_BWD_BK + 15) / 16 * 16)

/*
 * What the backward's tasks read (core/backward.c fills it; the passes are
 * numbered there), per element type. The per-head slices of the fused
 * buffers have rows Sq (or Sk, Svq) apart, often a multiple of 4 KiB,
 * where a tile's rows would all fall into the same few cache sets. So
 * pass 3 first packs what the tiles read:
 *   qh  (B, [h: Tq, dk_h])   q head by head, head h at b Tq Sq + qoff[h] Tq
 *   doh (B, [h: Tq, dv_h])   d(concat) likewise, at b Tq Svq + cvoff[h] Tq
 *   kh  (B, nkb, [g: BK, dk_g])    k by key block, head by head, at
 *                                  ((b nkb + kb) Sk + koff[g]) BK
 *   kT  (B, nkb, [g: dk_g, BK])    the same blocks transposed (keys
 *   vT  (B, nkb, [g: dv_g, BK])    contiguous), and v's
 * Rows of the last key block past Tk are left unset: no tile reads them.
 * Pass 3 also flags what holds an inf or NaN, so that a tile can keep it
 * from the keys and rows that never see it (bwd.inc, bwd_mm_guarded):
 *   qbad  (B, H, nqb)  nonzero when a row of the query block has a
 *                      non-finite q, d(concat) or D, or a NaN lse
 *   kvbad (B, nkb, G)  MHA_BWD_BAD_K when the key block's k holds one,
 *                      MHA_BWD_BAD_V when its v does
 */
#define MHA_BWD_BAD_K 1
#define MHA_BWD_BAD_V 2
#define MHA_DEFINE_BWD_CTX(real, name)                                        \
    typedef struct {                                                          \
        const mha_config *cfg;                                                \
        const mha_layout *lay;                                                \
        const size_t *qoff, *cvoff, *koff, *voff;                             \
        const real *q;      /* (B, Tq, Sq)                      */            \
        const real *k;      /* (B, Tk, Sk)                      */            \
        const real *v;      /* (B, Tk, Sv)                      */            \
        const real *dcat;   /* (B, Tq, Svq)  d(concat)          */            \
        const real *lse;    /* (B, H, Tq)                       */            \
        const real *D;      /* (B, H, Tq)    rowsum(dO * O)     */            \
        real *qh, *doh, *kh, *kT, *vT; /* packed, see above     */            \
        unsigned char *qbad, *kvbad;   /* flags, see above      */            \
        real *dq;           /* (B, Tq, Sq)   written by pass 5  */            \
        real *dk;           /* (B, Tk, Sk)   written by pass 4  */            \
        real *dv;           /* (B, Tk, Sv)   written by pass 4  */            \
        real *dmask;        /* (B, H, Tq, Tk) dS, pass 4; NULL: not wanted */ \
        const mha_rel *rel; /* T5's bias by distance, or NULL   */            \
        /* With drel_table wanted: pass 4's partial sums of dS by bucket,   */ \
        /* (B, G, nkb, H / G, rel_buckets), one slot per task (b, g, kb),  */ \
        /* summed by distance first in rel_acc (nth, rel->n), 0 between    */ \
        /* uses. NULL: not wanted.                                          */ \
        real *drel_part, *rel_acc;                                            \
        real *scratch;      /* per thread: MHA_BWD_TILE_STRIDE reals */       \
        size_t nqb, nkb;    /* query blocks, key blocks         */            \
    } name;
MHA_DEFINE_BWD_CTX(float, mha_bwd_ctx_f32)
MHA_DEFINE_BWD_CTX(double, mha_bwd_ctx_f64)

/*
 * The GEMM micro-kernel: c (MR, NR), row stride ldc, = [c +] a^T b, where
 *   a: (kc, MR) packed: a[p*MR + r] = op(A)(i0 + r, k0 + p), 64-byte aligned
 *   b: (kc, NR) of row stride ldb: b[p*ldb + j] = op(B)(k0 + p, j0 + j),
 *      either a packed panel (ldb = NR, aligned) or B itself, read in place
 *      (any alignment of the element type)
 * Each element is summed over p = 0, 1, ..., kc-1 in that order into an
 * accumulator that starts at zero, and only then added to c (add != 0) or
 * stored over it (add == 0): the same bits whichever form b takes. Element
 * pointers as the table's type says.
 */
typedef void (*mha_gemm_ukr_fn)(size_t kc, const void *a, const void *b,
                                size_t ldb, void *c, size_t ldc, int add);
/* One row of the micro-kernel's product over np (<= 4) adjacent panels:
   c (1, np NR) = [c +] a^T b with a[p*MR] = op(A)(i, k0 + p) (one row's
   column of a packed A panel) and b as for the micro-kernel (np NR
   columns of row stride ldb); the bits gemm_ukr gives that row. */
typedef void (*mha_gemm_row_fn)(size_t kc, const void *a, const void *b, size_t ldb,
                                size_t np, void *c, int add);
/* Four rows of the micro-kernel's product, each read from its own packed
   A column: c (4, NR), row stride ldc, = [c +] a^T b with a[r][p*MR] =
   op(A)(i0 + r, k0 + p) (a row of any packed panel) and b as for the
   micro-kernel; the bits gemm_ukr gives those rows. For a last row panel
   of few rows: M = 128 is 21 panels of 6 and one of 2, whose 8 last rows
   two of these compute where two micro-kernel tiles compute 12. */
typedef void (*mha_gemm_ukr4_fn)(size_t kc, const void *const a[4], const void *b,
                                 size_t ldb, void *c, size_t ldc, int add);
/* Transposing copy used to pack: dst[p*ldd + r] = src[r*lds + p] for
   r < rows (<= tpack_rows), p < kc. `next` points at the rows the caller
   will copy next (same lds), to be prefetched; it may equal src. */
typedef void (*mha_tpack_fn)(void *dst, size_t ldd, const void *src,
                             size_t lds, size_t rows, size_t kc,
                             const void *next);

/* The GEMM's blocking for one (ISA, type): only kc changes results (it
   sets where partial sums are rounded into C). */
typedef struct {
    size_t mr, nr;       /* register tile of the micro-kernel          */
    size_t kc;           /* largest K block                            */
    size_t mcp;          /* largest A block, in panels of mr           */
    size_t nc;           /* largest B block, a multiple of nr          */
    mha_gemm_ukr_fn ukr;
    mha_tpack_fn tpack;  /* transposing copy of up to tpr rows         */
    size_t tpr;
    mha_gemm_row_fn row; /* one row of ukr's product                   */
    mha_gemm_ukr4_fn ukr4; /* four rows of it; NULL when mr <= 4       */
} mha_gemm_blocking;

/* One (ISA, element type): every kernel the drivers call. */
typedef struct {
    const char *name;    /* "avx2_f32", ...                            */
    /* Forward pass 2: task(ctx, t, ith), tile t = (b H + h) nqb + block,
       ctx an mha_flash_ctx, in the scratch of thread ith. */
    mha_task_fn flash_task;
    size_t flash_bq;     /* BQ, query rows per tile                    */
    /* Split-K: task(ctx, t, ith), one per (tile, part) (the order in
       flash.inc): the part's keys only, its partials into ctx->part_* at
       slot tile nparts + part (see mha_flash_ctx). */
    mha_task_fn flash_part_task;
    /* Scratch bytes one thread needs for kv heads up to dk_max x dv_max
       wide (a multiple of 64), or 0 when that overflows size_t. */
    size_t (*flash_scratch_bytes)(size_t dk_max, size_t dv_max);
    /* Shared key blocks (mha_flash_ctx.kv): task(ctx, t, ith) packs block
       t = (b G + g) nkb + kb; flash_bk is BK; flash_share_layout gives a
       block's elements and its V part's offset (0 on overflow). */
    mha_task_fn flash_share_task;
    size_t flash_bk;
    size_t (*flash_share_layout)(size_t dk_max, size_t dv_max, size_t *vp_off);
    /* Backward passes 3-5, ctx an mha_bwd_ctx_<type> (core/backward.c). */
    mha_task_fn bwd_pack_q;   /* task (b, h)                           */
    mha_task_fn bwd_pack_k;   /* task (b, key block)                   */
    mha_task_fn bwd_dkv;      /* task (b, g, key block)                */
    mha_task_fn bwd_dq;       /* task (b, h, query block)              */
    mha_task_fn bwd_fused;    /* task (b, g): dkv and dq together      */
    mha_gemm_blocking gemm;
    /* Half precision rows (issue 36; core/half.h): dst[i] = src[i]
       widened to float32, or rounded from it to nearest even, for
       i < n; half values are uint16_t bit patterns, any alignment. The
       bits of half.h's scalar conversions on every ISA. The same
       functions in the float and the double table: half values are
       widened to float32 whatever a driver computes in. */
    void (*widen_f16)(float *dst, const uint16_t *src, size_t n);
    void (*narrow_f16)(uint16_t *dst, const float *src, size_t n);
    void (*widen_bf16)(float *dst, const uint16_t *src, size_t n);
    void (*narrow_bf16)(uint16_t *dst, const float *src, size_t n);
} mha_kernels;

extern const mha_kernels mha_kernels_ref_f32, mha_kernels_ref_f64;
#if defined(__x86_64__) || defined(__i386__)
#define MHA_HAVE_X86_KERNELS 1
extern const mha_kernels mha_kernels_avx2_f32, mha_kernels_avx2_f64;
extern const mha_kernels mha_kernels_avx512_f32, mha_kernels_avx512_f64;
#endif
#if defined(__aarch64__)
#define MHA_HAVE_NEON_KERNELS 1
extern const mha_kernels mha_kernels_neon_f32, mha_kernels_neon_f64;
#endif

/* The kernels of `isa` for float (f64 == 0) or double elements. */
const mha_kernels *mha_kernels_for(mha_isa isa, int f64);

#endif /* MHA_KERNELS_H */
