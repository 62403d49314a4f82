/*
 * mha.h - the public API of mhattn's C core.
 *
 * The core is plain C11: it knows nothing of Python or NumPy. The only files
 * that include Python.h are the glue's, in csrc/python/.
 *
 * Letters used in every shape comment of the core:
 *   B    batch size
 *   Tq   number of queries (rows of x)
 *   Tk   number of keys and values (rows of key / value)
 *   Din  width of x            (d_in)
 *   Dkin width of key          (rows of w_k)
 *   Dvin width of value        (rows of w_v)
 *   Dout width of the output   (columns of w_o, or Svq when w_o is absent)
 *   H    number of query heads
 *   G    number of key/value heads (H % G == 0; query head h uses kv head
 *        h / (H / G)). G == H is ordinary multi-head attention.
 *   dk[g], dv[g]  key (== query) width and value width of kv head g; heads
 *        may be ragged, so every width is per head.
 *   Sq   = sum over query heads h of dk[h / (H/G)]  (fused query width)
 *   Sk   = sum over kv heads g of dk[g]             (fused key width)
 *   Sv   = sum over kv heads g of dv[g]             (fused value width)
 *   Svq  = sum over query heads h of dv[h / (H/G)]  (concatenation width)
 *
 * Every buffer is row-major and contiguous unless a stride says otherwise.
 * Head h's block of a fused buffer starts at the sum of the widths of the
 * heads before it (see mha_layout).
 *
 * The API: a call is an mha_config (its sizes and options) and an
 * mha_params (its buffers and their element type), handed to one function
 * per operation (mha_forward, mha_backward, mha_attend,
 * mha_attend_backward, mha_project) that dispatches on the element type;
 * mha_check_config says which field of a rejected config is wrong and why
 * (mha_error). Every function returns an mha_status; none prints, exits or
 * asserts on anything a caller can pass.
 */
#ifndef MHA_H
#define MHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Limits of the core that callers may rely on (the glue does).
 *
 * MHA_MAX_ELEMS: the largest element count of any buffer, head width or
 * fused width the core accepts; mha_check_config returns MHA_ERR_SIZE past
 * it. Bounding counts by PTRDIFF_MAX / sizeof(double) keeps the byte sizes
 * of float and double buffers within size_t and pointer differences.
 *
 * MHA_SMALL_WORK: a forward call whose attention does fewer multiply-adds
 * than this runs on the calling thread alone, since waking a worker costs
 * more than the call (well under a millisecond on any machine).
 */
#define MHA_MAX_ELEMS ((size_t)PTRDIFF_MAX / sizeof(double))

/* A block mask's entries that are not a partial block's index
   (mha_config.bm_block). */
#define MHA_BM_EMPTY (-1)
#define MHA_BM_FULL (-2)
#define MHA_SMALL_WORK 262144.0

typedef enum {
    MHA_OK = 0,
    MHA_ERR_NOMEM,       /* an allocation failed */
    MHA_ERR_SIZE,        /* a size product overflows size_t */
    MHA_ERR_ARG,         /* inconsistent sizes or a NULL required buffer */
    MHA_ERR_INTERRUPTED, /* the caller's interrupt flag was raised */
} mha_status;

/* A static, human-readable name for a status ("MHA_OK", ...). */
const char *mha_status_name(mha_status s);

/* The element type of a call's buffers (mha_params.dtype: float or
   double). The half types are storage formats only (core/half.h), as
   uint16_t bit patterns: mha_convert widens them to float32 and rounds
   float32 results back, mha_pack_weight packs a half weight into float32
   panels, and a float32 forward reads half weights (mha_params.w_storage);
   the drivers compute in float or double. */
typedef enum {
    MHA_DTYPE_F32 = 0,  /* float                                  */
    MHA_DTYPE_F64 = 1,  /* double                                 */
    MHA_DTYPE_F16 = 2,  /* IEEE binary16, storage only            */
    MHA_DTYPE_BF16 = 3, /* bfloat16 (float32's top half), storage */
} mha_dtype;

/* dst[i] = src[i] for i < n, between float32 and a half type: widened
   exactly from MHA_DTYPE_F16 / MHA_DTYPE_BF16 to MHA_DTYPE_F32, or rounded
   from MHA_DTYPE_F32 to nearest even (overflow to infinity, subnormals
   kept, NaN stays NaN). The bits are core/half.h's scalar conversions on
   every ISA, and the same for any thread count (large n is split between
   the threads). Buffers need no alignment and must not overlap.
   MHA_ERR_ARG for a NULL buffer with n > 0 or any other pair of types. */
mha_status mha_convert(void *dst, mha_dtype to, const void *src, mha_dtype from, size_t n);

typedef enum {
    MHA_MASK_NONE = 0,
    MHA_MASK_BOOL, /* uint8: nonzero = may attend (SDPA / JAX / Keras) */
    MHA_MASK_ADD,  /* real, added to the scaled scores; -inf allowed   */
} mha_mask_kind;

/* The q/k norm's kind (mha_config.norm_type), for the weights q_norm and
   k_norm, over each head's d features x with mean m = mean(x) and the
   biased (population) variance v = mean((x - m)^2):
     MHA_NORM_RMS    y = x / sqrt(mean(x^2) + norm_eps) * w   (Qwen3, Gemma 3)
     MHA_NORM_LAYER  y = (x - m) / sqrt(v + norm_eps) * w     (ViT-22B; Flax's
                     MultiHeadAttention(normalize_qk=True): its LayerNorms
                     have no bias, use_bias=False)
   Zero-initialised, a config is MHA_NORM_RMS. Each value's name, as the
   glue takes it ("rms", "layer"), is mha_norm_type_name's. */
typedef enum {
    MHA_NORM_RMS = 0,
    MHA_NORM_LAYER = 1,
} mha_norm_type;

/*
 * A weight packed once for the GEMM's micro-kernels (issue 16): w (K, N)
 * cut into the column panels the GEMM would otherwise pack on every call,
 * for the ISA in force when it was packed and one element type. Made by
 * mha_pack_weight, freed by mha_packed_free; read-only after that.
 * A call whose ISA, type or sizes differ ignores it (and packs as usual),
 * so a packed weight never changes a result, only saves the packing.
 */
typedef struct {
    const void *data;     /* elems reals, 64-byte aligned, or NULL      */
    size_t elems;
    size_t K, N;          /* the weight's rows and columns              */
    int isa;              /* the mha_isa it was packed for (dispatch.h) */
    int f64;              /* 1: double elements, 0: float               */
} mha_packed;

/* Packs w (K, N) of element type dtype, row stride ldw >= N, for the ISA
   in force into *p (an aligned block of the core's allocator; K or N == 0
   gives data NULL). A half w (MHA_DTYPE_F16, _BF16: uint16_t bits) gives
   float32 panels (f64 0), each value widened exactly as it is packed: the
   panels of its widened float32 copy, which is never made. MHA_ERR_ARG
   for a NULL w, ldw < N or an unknown dtype, MHA_ERR_SIZE, MHA_ERR_NOMEM. */
mha_status mha_pack_weight(mha_packed *p, const void *w, size_t ldw, size_t K, size_t N,
                           mha_dtype dtype);
/* Frees what mha_pack_weight allocated (NULL data is fine); *p is zeroed. */
void mha_packed_free(mha_packed *p);

/*
 * Sizes and options of one call (its buffers are in mha_params). The arrays
 * are borrowed: they must outlive the call.
 *
 * Why the mask, sinks, norm weights, ALiBi slopes, key lengths and
 * positions stay here although they are data: each is read with the sizes,
 * strides and flags beside it (mask_kind and mask_stride, q_norm_hstride,
 * ...) by every layer, down to the attention rules (core/rules.h) and the
 * SIMD tiles (kernels/flash.inc), which see the config alone. Moving them
 * would thread mha_params through every kernel for no change in what a
 * caller passes; they describe the problem, where the buffers of mha_params
 * are what is computed on.
 */
typedef struct {
    size_t B, Tq, Tk;
    size_t Din, Dkin, Dvin, Dout;
    size_t H, G;
    const size_t *dk;     /* (G,) */
    const size_t *dv;     /* (G,) */
    const double *scale;  /* (H,) multiplier of q.k for each query head:
                             finite, and within the call's type (|scale|
                             <= FLT_MAX for float32) */
    int causal;           /* query i sees keys j <= i + (Tk - Tq)       */
    mha_mask_kind mask_kind;
    const void *mask;     /* uint8 or real, see mask_stride              */
    ptrdiff_t mask_stride[4]; /* element strides over (B, H, Tq, Tk); 0 broadcasts */
    const int64_t *key_lengths; /* (B,) or NULL: keys j >= len[b] ignored */
    int has_wo;           /* 0: out is the concatenation (Dout == Svq)  */

    /* ---- Variants of today's models. Each is off when zero / NULL (a
       zero-initialised config is plain attention). Which keys a query sees
       and the order of a score's life: core/rules.h. Positions: query i
       sits at p_i = i + (Tk - Tq), key j at j (within its own sequence when
       packed, see cu_q). ---- */
    /* Sliding window (windowed != 0): key j is visible from query i iff
       p_i - window_left <= j <= p_i + window_right; a side < 0 is
       unbounded. causal caps the right side at 0. */
    int windowed;
    int64_t window_left, window_right;
    /* Chunked attention (issue 39; Llama 4's chunked layers, FlashAttention
       3's attention_chunk): chunk > 0 keeps key j for query i iff
       floor(p_i / chunk) == floor(pos(j) / chunk) (floor division: p_i may
       be negative), ANDed with causal, the window and the rest; 0: off. A
       row's keys stay one interval, so blocks outside are skipped. At most
       MHA_MAX_ELEMS. */
    size_t chunk;
    /* Query placement (issue 40; one block of a larger call, as
       mhattn.dask computes it): has_q_offset != 0 places query i at
       p_i = i + q_offset (key 0 at 0) instead of bottom-right at
       i + (Tk - Tq), so that a block of queries q0.. against a block of
       keys k0.. passes q_offset = (q0 + Tk_all - Tq_all) - k0 and causal,
       the window, chunk and ALiBi see the whole call's positions. Any sign,
       |q_offset| <= MHA_MAX_ELEMS. 0: bottom-right. Not with packed
       sequences, lengths_aligned (each places queries its own way) or
       rel_table (whose distances are laid out for bottom-right rows). */
    int has_q_offset;
    int64_t q_offset;
    /* A block mask (issue 39; mhattn.BlockMask, FlexAttention's
       BlockMask): the keys are cut into blocks of bm_bk, the queries into
       blocks of bm_bq (nqb = ceil(Tq / bm_bq), nkb = ceil(Tk / bm_bk); the
       last ones may be short), and entry
           bm_block[b bm_bstride + h bm_hstride + qb nkb + kb]
       of query block qb and key block kb is MHA_BM_EMPTY (no key of the
       block is visible from any query of it), MHA_BM_FULL (every one is)
       or p in [0, bm_npartial): partial, with the bits of block p of
       bm_bits, (bm_npartial, bm_bq, ceil(bm_bk / 8)) bytes: bit c % 8 of
       byte c / 8 of row r is 1 iff key kb bm_bk + c is visible from query
       qb bm_bq + r (numpy.packbits(..., bitorder="little")). bm_hstride is
       0 (one pattern for every head) or nqb nkb, bm_bstride 0 or (bm_
       hstride ? H : 1) nqb nkb. ANDed with every other rule (causal,
       window, chunk, key_lengths, key_mask, packed sequences, mask): empty
       blocks are skipped, forward and backward, and full ones cost no
       per-element test. NULL: off (then every bm_ field is 0). Indices
       are call indices (packed rows and keys with nseq > 0). */
    const int32_t *bm_block;
    const uint8_t *bm_bits;
    size_t bm_bq, bm_bk, bm_bstride, bm_hstride, bm_npartial;
    /* softcap > 0: each scaled score s becomes softcap * tanh(s / softcap),
       before ALiBi and the masks (Gemma 2). 0: off. Finite, and, when > 0,
       softcap and 1 / softcap representable in the call's type:
       1/FLT_MAX <= softcap <= FLT_MAX for float32 (1/DBL_MAX .. DBL_MAX
       for float64). */
    double softcap;
    /* ALiBi: adds -alibi[b * alibi_bstride + h] * |p_i - j| to the score
       (after softcap, with the additive mask). (B, H) slopes with
       alibi_bstride = H, or (H,) with 0; with packed sequences (nseq > 0)
       and alibi_bstride = H, (nseq, H): row s is sequence s's slopes, for
       the queries of sequence s (FlashAttention's varlen alibi_slopes,
       issue 39). No gradient. Each bias must be
       representable in the call's type: |slope| * max(max(Tq, Tk) - 1, 1)
       <= FLT_MAX for float32 (DBL_MAX for float64; NaN and inf never). */
    const double *alibi;
    size_t alibi_bstride;
    /* Attention sinks: (H,) of the call's element type (float / double), one
       logit per query head, counted in each row's softmax denominator as an
       extra key of value zero (gpt-oss): lse includes it, weights exclude it.
       Gradient dsinks. */
    const void *sinks;
    /* Key padding: (B, Tk), nonzero = a real key; combined by AND with every
       other rule. Key blocks with no real key are skipped. */
    const uint8_t *key_mask;
    /* Dropout on the attention weights (issue 38): 0 <= dropout < 1 (0:
       off). Weight (b, h, i, j) is kept, and scaled by 1 / (1 - dropout),
       iff mha_dropout_bits(mha_dropout_key(dropout_seed, b, h, i, j >>
       32), (uint32_t)j) >= mha_dropout_threshold(dropout) (core/rules.h),
       else zeroed: a counter-based hash of (seed, b, h, i, j), so the mask
       is the same for any thread count, tiling or ISA, and the backward
       regenerates it instead of storing it. The softmax's normaliser (and
       lse) are those of the weights before dropout; i and j index the
       call's own (packed) rows and keys. */
    double dropout;
    uint64_t dropout_seed;
    /* T5's relative position bias (issue 38; transformers' T5Attention):
       rel_table (rel_buckets, H) of the call's element type, rows H apart,
       or NULL (off). Adds rel_table[bucket(pos(j) - p_i), h] to the score,
       after ALiBi and before the additive mask. bucket is T5's
       _relative_position_bucket of the signed distance, in float32 as
       transformers computes it (mha_rel_bucket, core/rules.h):
       rel_bidirectional != 0 gives each direction rel_buckets / 2 buckets,
       else only keys before the query are told apart (later ones share
       bucket 0); half of a direction's buckets are exact distances, the
       rest logarithmic up to rel_max_distance, beyond which all share the
       last. A direction needs at least 2 buckets and rel_max_distance at
       least its bucket count (fewer makes buckets empty). The bias depends
       on the distance alone: each call looks up one value per distance and
       head (O(H (Tq + Tk)), never a (Tq, Tk) array; core/relbias.h).
       Gradient drel_table. */
    const void *rel_table;
    size_t rel_buckets, rel_max_distance;
    int rel_bidirectional;
    /* Packed sequences (nseq > 0, B == 1): sequence s holds queries
       cu_q[s] .. cu_q[s+1]-1 and keys cu_k[s] .. cu_k[s+1]-1; a query sees
       keys of its own sequence only, and causal, window and the default
       positions apply within each sequence (query r of a sequence of nq
       queries and nk keys sits at r + nk - nq). cu_q[0] = cu_k[0] = 0,
       nondecreasing, cu_q[nseq] = Tq, cu_k[nseq] = Tk (mha_check_config). */
    size_t nseq;
    const int64_t *cu_q, *cu_k;   /* (nseq + 1,) each */

    /* ---- q/k transforms (core/qk.c), applied to the projections, per head,
       after the biases and before the attention: the norm (RMSNorm or
       LayerNorm, norm_type), then RoPE. The
       kept q and k (mha_forward's q, k outputs, the backward's q, k inputs)
       are the projections *before* them. ---- */
    /* Norm weights of the call's element type: q_norm (H, d) with
       q_norm_hstride = d, or (d,) shared by every head with 0; k_norm (G, d)
       or (d,) likewise. d = dk, which must then be the same for every head.
       norm_type says which norm (mha_norm_type: RMSNorm by default, or
       LayerNorm, mean-centred); it is read only where a weight is given.
       Gradients dq_norm, dk_norm. */
    const void *q_norm, *k_norm;
    size_t q_norm_hstride, k_norm_hstride;
    double norm_eps;
    mha_norm_type norm_type;
    /* RoPE on the first rotary_dim features of each head's q and k (0: off;
       even, <= every dk). rope_interleaved = 0 pairs feature c with
       c + rotary_dim / 2 (GPT-NeoX, Llama), 1 pairs (2c, 2c+1) (GPT-J).
       Pair c turns by the angle pos * inv_freq[c], inv_freq (rotary_dim/2,). */
    size_t rotary_dim;
    int rope_interleaved;
    const double *inv_freq;
    /* Positions used by RoPE only: positions (B, Tq) with positions_bstride
       = Tq or (Tq,) with 0; key_positions (B, Tk) / (Tk,) likewise. NULL:
       the default positions above. */
    const int64_t *positions, *key_positions;
    size_t positions_bstride, key_positions_bstride;

    /* A KV cache (issue 17): lengths_aligned != 0 aligns each batch item's
       queries bottom-right to its own key length instead of Tk: query i of
       batch item b sits at p_i = i + key_len(b) - Tq (key_len(b) =
       key_lengths[b], Tk without them). Causal, window, ALiBi and RoPE's
       default positions all use it. Not with packed sequences. */
    int lengths_aligned;

    /* A paged KV cache (issue 39, vLLM's PagedAttention, FlashAttention's
       block_table): block_table (B, pages_per_seq) int32, or NULL. With it,
       mha_attend's k and v (and an int8 cache's k_scale, v_scale) are pools
       of num_pages pages of page_size keys, read in place: the strides' sb
       step from one page to the next, and key j of batch item b is row
       j % page_size of page block_table[b * pages_per_seq + j / page_size].
       Every entry lies in [0, num_pages) (even those past a sequence's
       keys, which are never read: one rule, checked before any is used),
       and Tk <= pages_per_seq * page_size. Only the addresses of the rows
       change: the key blocks, their order and the sums are those of the
       same keys held contiguously, so the bits are too. mha_attend only;
       not with packed sequences. */
    const int32_t *block_table;
    size_t pages_per_seq, page_size, num_pages;

    /* Prepacked weights (mha_packed above), each NULL or the packed form of
       wq (Din, Sq), wk (Dkin, Sk), wv (Dvin, Sv), wo (Svq, Dout): the
       forward's and mha_project's projections multiply them instead of
       packing their weights; the plain weights are still passed and read
       (small problems, the backward). Borrowed, like the arrays above.
       Ignored by a forward whose weights are half (mha_params.w_storage),
       which packs them itself. */
    const mha_packed *packed[4];

    /* Optional flag polled between work items; when it becomes nonzero the
       call stops early with MHA_ERR_INTERRUPTED. May be NULL. */
    volatile const int *interrupt;
} mha_config;

/* Derived sizes of a config, checked for overflow. */
typedef struct {
    size_t Sq, Sk, Sv, Svq;
} mha_layout;

/*
 * Which field a rejected call got wrong (mha_error.field): one id per field
 * of mha_config, named after it, plus MHA_FIELD_PARAMS (a buffer or the
 * strides of mha_params; the message names which), MHA_FIELD_DTYPE and
 * MHA_FIELD_CALL (a NULL config, layout or params). A rule that ties two
 * fields names the one it constrains: "H % G == 0" is G's. A size product
 * past MHA_MAX_ELEMS names the field of the buffer's last axis (Sq, Sk
 * count as DK, Sv, Svq as DV). Generated from the schema's MHA_FIELDS.
 */
#include "mha_field_gen.h"   /* mha_field: tools/gen_schema.py */

/*
 * Why a call was rejected: the field and a message that names the rule and
 * the values seen, e.g. "H = 6 is not a multiple of G = 4" (field
 * MHA_FIELD_G). Every function below that takes an mha_error *err fills it
 * when it returns MHA_ERR_ARG or MHA_ERR_SIZE for what the caller passed,
 * and sets field MHA_FIELD_NONE and an empty msg when the call passes its
 * checks; err may be NULL. (NOMEM and INTERRUPTED leave field NONE.)
 */
typedef struct {
    mha_field field;
    char msg[256];
} mha_error;

/* Fills *lay and checks that every size product the core allocates fits in
   size_t and that the config is self-consistent: MHA_OK, MHA_ERR_ARG or
   MHA_ERR_SIZE, with the reason in *err (may be NULL). Each rule on a
   config is checked here and nowhere else, but for those that need the
   call's element type (scale, softcap and alibi above), which the entry
   points check with their mha_params.dtype, after these. */
mha_status mha_check_config(mha_layout *lay, const mha_config *cfg, mha_error *err);

/* mha_check_config, then the rules that need the call's element type
   (scale, softcap and ALiBi slopes representable in it). Every operation
   checks its config with it; a caller that checks a config before an
   operation (the glue's check_config) does too. */
mha_status mha_check_config_typed(mha_layout *lay, const mha_config *cfg, mha_dtype dtype,
                                  mha_error *err);

/* The name of a norm type ("rms", "layer"), or NULL for a value that is
   none of mha_norm_type's. */
const char *mha_norm_type_name(mha_norm_type t);

/* *t = the norm type called `name` (len bytes, not NUL-terminated; one of
   mha_norm_type_name's): MHA_OK, or MHA_ERR_ARG (field MHA_FIELD_NORM_TYPE,
   the message naming what was seen and every accepted name) for any other
   name, *t untouched. For a caller that takes the type by name (the glue):
   the names, like every rule on a config, are said once, here. */
mha_status mha_norm_type_parse(mha_norm_type *t, const char *name, size_t len,
                               mha_error *err);

/* The first of mha_check_config's rules alone: H query heads and G
   key/value heads that a call can pair (H, G >= 1, G divides H). For a
   caller that lays out per-head data before its config is complete (the
   glue); mha_check_config applies the same function. */
mha_status mha_check_heads(size_t H, size_t G, mha_error *err);

/* Column offsets of every head in the fused buffers of a checked config:
     qoff[h]  (H,) in q (B, Tq, Sq)     cvoff[h] (H,) in concat (B, Tq, Svq)
     koff[g]  (G,) in k (B, Tk, Sk)     voff[g]  (G,) in v (B, Tk, Sv) */
void mha_head_offsets(size_t *qoff, size_t *cvoff, size_t *koff, size_t *voff,
                      const mha_config *cfg);

/*
 * What a KV cache's storage holds (mha_params.kv_storage, mha_attend only,
 * issue 36): k and v may be kept in a half type or in int8 while the call
 * computes in float32 (dtype MHA_DTYPE_F32). The kernels widen each key
 * block as they read it (kernels/flash.inc: the kernel table's widen_f16 /
 * widen_bf16 rows; int8 x scale in plain C), never the whole cache, and
 * accumulate in float32: a half storage gives the bits of a float32 k, v
 * holding the same (widened) values. int8 (symmetric, per row, as
 * llama.cpp's q8_0 rows): key j of kv head (b, g) is k_scale[b sks.sb +
 * g sks.sh + j sks.st] * k[j][c] in float32, and v likewise; a NaN or inf
 * scale makes that key's scores (or its values) NaN, as a NaN in a float32
 * cache would, and keys no rule lets a query see are never read.
 */
/*
 * Half weights (mha_params.w_storage, mha_forward only, issue 36): with
 * dtype MHA_DTYPE_F32, wq, wk, wv, wo and wgate may hold float16 or bfloat16 bits
 * (MHA_KV_F16, MHA_KV_BF16; the biases stay float32). The forward packs
 * them into float32 panels, widening each value as it packs it (as
 * mha_pack_weight does), in one pool phase, and its projections multiply
 * those panels; a projection small enough for the GEMM's plain loop reads
 * a widened copy of its (small) weight instead. No float32 copy of a large
 * weight is made, and the result has the bits of the float32 forward on
 * the widened weights, for any thread count. MHA_KV_I8 is a cache's alone;
 * every other operation refuses anything but MHA_KV_PLAIN (MHA_ERR_ARG,
 * field MHA_FIELD_PARAMS).
 */
/*
 * mha_strides: element strides of a (B, heads, T, d) tensor whose d axis is
 * contiguous: element (b, h, t, c) lies at b * sb + h * sh + t * st + c.
 * So mha_attend reads (B, H, T, d) ("bhtd"), (B, T, H, d) ("bthd") and a
 * KV cache's (B, G, capacity, d) storage without copies.
 */
typedef struct {
    size_t sb, sh, st;
} mha_strides;

/*
 * The buffers of one call, for every entry point (as FlashAttention's
 * Flash_fwd_params): each operation reads the fields its comment names and
 * ignores the others, so one zero-initialised struct, filled in, serves any
 * of them, and the backward reads q, k, v, concat, lse where the forward
 * wrote them. Every buffer holds elements of type dtype (float or double),
 * is row-major and contiguous unless strides say otherwise; NULL where
 * optional and not wanted. The config's own arrays (head widths, scales,
 * masks, sinks, norms, positions) stay in mha_config: see there.
 *
 * The struct is generated from the schema (python/mhattn/_internal/
 * schema.py, PARAMS) into mha_params_gen.h, each field with what each
 * operation (F mha_forward, B mha_backward, A mha_attend, AB
 * mha_attend_backward, P mha_project) reads or writes there.
 */
typedef enum {
    MHA_KV_PLAIN = 0, /* elements of mha_params.dtype                    */
    MHA_KV_F16 = 1,   /* IEEE binary16 bits (uint16_t)                   */
    MHA_KV_BF16 = 2,  /* bfloat16 bits (uint16_t)                        */
    MHA_KV_I8 = 3,    /* int8_t, times a float scale per (b, g, key)     */
} mha_kv_storage;

#include "mha_params_gen.h"   /* mha_params: tools/gen_schema.py */

/*
 * Forward pass (one templated source, core/forward_impl.h).
 * Writes out and whichever of weights, q, k, v, concat, lse are given;
 * reads x, key, value, wq, wk, wv, wo (NULL iff !cfg->has_wo) and the
 * biases bq, bk, bv, bo (each may be NULL: zero).
 *
 * The output gate (issue 38; Keras's MultiHeadAttention(use_gate=True),
 * Qwen3-Next's gated attention): with wgate (Din, Svq) and bgate (Svq,)
 * (NULL: zero; bgate without wgate is MHA_ERR_ARG), W^O (or, without
 * it, out) reads sigmoid(x wgate + bgate) * concat, elementwise, in place
 * of concat: one gate per query row and concatenation column (core/gate.h).
 * The kept concat is still the heads side by side, before the gate: the
 * backward reads it, and recomputes the gate from x, wgate and bgate.
 *
 * A query row whose keys are all masked gets zero attention: its head
 * output is 0, its weights are 0 and its lse is -inf. No NaN is made; a
 * NaN score (from NaN inputs, or +inf in an additive mask) makes its row's
 * head output and lse NaN, and its weights NaN at the keys it sees.
 *
 * Runs on mha_get_num_threads() threads (core/threads.h) with the kernels
 * of mha_get_isa() (core/dispatch.h); the result does not depend on the thread
 * count, nor `out` on whether weights are wanted.
 */
mha_status mha_forward(const mha_config *cfg, const mha_params *prm, mha_error *err);

/*
 * Backward pass of mha_forward (one templated source, core/backward_impl.h):
 * the gradient of a scalar loss with respect to every input, given dout =
 * dL/dout. FlashAttention-2 style: the forward's probabilities are
 * recomputed tile by tile from its lse, never stored.
 *
 * Overwrites (never adds into) every gradient it is given: dx, dkey,
 * dvalue, dwq, dwk, dwv, dwo, dbq, dbk, dbv, dbo, dsinks (with cfg->sinks),
 * dq_norm, dk_norm (with cfg->q_norm / k_norm), dwgate, dbgate (with
 * wgate); NULL for a gradient that is not wanted (work that no wanted
 * gradient needs is skipped). dwo is ignored without W^O (cfg->has_wo ==
 * 0), dwgate and dbgate without wgate; biases need not have been given
 * to the forward for their gradient to be computed.
 * Reads dout; x, key, value, wq, wk, wv, wo, wgate as given to the
 * forward (the biases are not needed, but for bgate: the gate is
 * recomputed, by the forward's function, so bitwise the forward's); q, k,
 * v, concat, lse as kept by the forward, same cfg.
 *
 * One input feeding several roles: when key is x (self-attention), pass
 * dkey == dx; the keys' gradient is then added into dx, which holds the
 * full gradient of x. Likewise dvalue == dx (value is x) or dvalue == dkey
 * (value is key). The shapes of the shared roles must agree.
 *
 * Fully masked query rows (lse -inf) contribute nothing: zero gradients,
 * never NaN. An additive mask's gradient is dmask (B, H, Tq, Tk), when
 * given (and ignored without an additive mask): dL/d(mask) at every (b, h,
 * i, j) before the mask's broadcast, 0 where row i does not see key j (the
 * caller sums it over the broadcast axes; pass 4 writes it, so a call
 * wanting dmask alone runs the dK, dV tiles). The result is bitwise the
 * same for any thread count.
 */
mha_status mha_backward(const mha_config *cfg, const mha_params *prm, mha_error *err);

/*
 * Attention on tensors already projected (issue 17): the attention of
 * mha_forward without its projections and W^O. Writes out (at strides so),
 * and weights, lse (contiguous) when given; reads q, k, v at strides sq,
 * sk, sv.
 *
 * cfg: B, Tq, Tk, H, G, dk, dv (every kv head the same widths), scale,
 * masks, causal, key_lengths, lengths_aligned and the score variants
 * (window, softcap, ALiBi, sinks, key_mask, packed sequences); Din, Dkin,
 * Dvin, Dout and has_wo are ignored; the q/k transforms (q_norm, k_norm,
 * rotary_dim) must be off (MHA_ERR_ARG): they belong to the projections
 * (mha_project). prm->kv_storage: k and v may be a KV cache's half or
 * int8 storage (above), with dtype MHA_DTYPE_F32. Bitwise the same for
 * any thread count: a call with few query rows splits its keys into a
 * number of parts that depends on Tk alone, merged in a fixed order
 * (split-K, as flash-decoding).
 */
mha_status mha_attend(const mha_config *cfg, const mha_params *prm, mha_error *err);

/*
 * Backward of mha_attend, on contiguous fused tensors (the layout of
 * mha_forward's q, k, v, concat): reads q (B, Tq, Sq), k (B, Tk, Sk), v
 * (B, Tk, Sv), out and dout (B, Tq, Svq), lse (B, H, Tq) as mha_attend
 * made it, or NULL to have it recomputed. Writes dq, dk, dv, with
 * cfg->sinks dsinks (H,), and with an additive mask dmask (B, H, Tq, Tk)
 * as mha_backward does; any may be NULL when not wanted. Bitwise the
 * same for any thread count.
 */
mha_status mha_attend_backward(const mha_config *cfg, const mha_params *prm,
                               mha_error *err);

/*
 * The projections of mha_forward alone, with the q/k transforms (the q/k
 * norm, RoPE at cfg's positions): writes q, k, v (each when given) as the
 * attention would use them (after the transforms), from x, key, value and
 * wq, wk, wv, bq, bk, bv as mha_forward reads them. For a KV cache: the new
 * rows' projections, their keys turned at their positions in the cache.
 */
mha_status mha_project(const mha_config *cfg, const mha_params *prm, mha_error *err);

#ifdef __cplusplus
}
#endif

#endif /* MHA_H */
