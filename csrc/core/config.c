/*
 * config.c - the checks of a call's sizes and options, and the head
 * offsets (contract in mha.h). Every size the core allocates or indexes
 * with is checked here, once, before any driver runs. Each rejection says
 * which field is wrong and why (mha_error: a field id and a message with
 * the values seen), through mha_reject (check.h), also used by the entry
 * points' checks of their buffers.
 *
 * Letters (see mha.h): B batch, Tq queries, Tk keys, H query heads, G kv
 * heads, dk[g] / dv[g] head widths, Sq / Sk / Sv / Svq fused widths.
 * Element counts are bounded by MHA_MAX_ELEMS (mha.h), so that byte sizes
 * of float and double buffers fit in size_t and pointer differences, and
 * Tq, Tk can be used in signed ptrdiff_t arithmetic without overflow.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "dispatch.h"
#include "mha.h"

/* *r = a * b; returns 0 when the product exceeds MHA_MAX_ELEMS. */
static int mul_ok(size_t *r, size_t a, size_t b)
{
    if (a != 0 && b > MHA_MAX_ELEMS / a)
        return 0;
    *r = a * b;
    return 1;
}

/* *r = a + b; returns 0 when the sum exceeds MHA_MAX_ELEMS. */
static int add_ok(size_t *r, size_t a, size_t b)
{
    if (a > MHA_MAX_ELEMS || b > MHA_MAX_ELEMS - a)
        return 0;
    *r = a + b;
    return 1;
}

/* Returns 1 when a * b * c * d <= MHA_MAX_ELEMS. A zero factor makes the
   product 0 whatever the others are (an empty batch is valid). */
static int count_ok(size_t a, size_t b, size_t c, size_t d)
{
    size_t r;
    if (a == 0 || b == 0 || c == 0 || d == 0)
        return 1;
    return mul_ok(&r, a, b) && mul_ok(&r, r, c) && mul_ok(&r, r, d);
}

void mha_error_clear(mha_error *err)
{
    if (err != NULL) {
        err->field = MHA_FIELD_NONE;
        err->msg[0] = '\0';
    }
}

mha_status mha_reject(mha_error *err, mha_status st, mha_field field, const char *fmt, ...)
{
    if (err == NULL)
        return st;
    err->field = field;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return st;
}

/* A rejection of what the caller passed (MHA_ERR_ARG). */
#define REJECT(field, ...) mha_reject(err, MHA_ERR_ARG, field, __VA_ARGS__)

/* The storage of the weights (mha_params.w_storage, mha.h): plain, or,
   for an operation that reads half weights (`half_weights`: the forward),
   float16 or bfloat16 bits on a float32 call. */
static mha_status check_w_storage(const mha_params *prm, int half_weights, mha_error *err)
{
    static const char *const names[] = {"MHA_KV_PLAIN", "MHA_KV_F16", "MHA_KV_BF16",
                                        "MHA_KV_I8"};
    const unsigned kind = (unsigned)prm->w_storage;
    if (kind == MHA_KV_PLAIN)
        return MHA_OK;
    if (kind > MHA_KV_I8)
        return REJECT(MHA_FIELD_PARAMS, "w_storage = %u is none of MHA_KV_PLAIN, "
                      "MHA_KV_F16, MHA_KV_BF16", kind);
    if (kind == MHA_KV_I8)
        return REJECT(MHA_FIELD_PARAMS, "w_storage = MHA_KV_I8: weights are plain, float16 "
                      "or bfloat16 (int8 is a KV cache's storage alone)");
    if (!half_weights)
        return REJECT(MHA_FIELD_PARAMS, "w_storage = %s: only mha_forward reads half "
                      "weights; this operation needs MHA_KV_PLAIN", names[kind]);
    if (prm->dtype != MHA_DTYPE_F32)
        return REJECT(MHA_FIELD_PARAMS, "w_storage = %s needs dtype MHA_DTYPE_F32 (the "
                      "forward widens the weights to float32), not MHA_DTYPE_F64",
                      names[kind]);
    return MHA_OK;
}

/* The checks every entry point starts with: a config, params of a known
   dtype and weights' storage. Clears *err first. */
static mha_status check_call(const mha_config *cfg, const mha_params *prm, int half_weights,
                             mha_error *err)
{
    mha_error_clear(err);
    if (cfg == NULL || prm == NULL)
        return REJECT(MHA_FIELD_CALL, "the %s is NULL", cfg == NULL ? "config" : "params");
    if (prm->dtype != MHA_DTYPE_F32 && prm->dtype != MHA_DTYPE_F64)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_DTYPE,
                          "dtype = %d is not MHA_DTYPE_F32 (0) or MHA_DTYPE_F64 (1)",
                          (int)prm->dtype);
    return check_w_storage(prm, half_weights, err);
}

mha_status mha_call_typed(const mha_config *cfg, const mha_params *prm, mha_error *err,
                           mha_typed_fn f32, mha_typed_fn f64, unsigned reads)
{
    mha_status st = check_call(cfg, prm, (reads & MHA_READS_HALF_WEIGHTS) != 0, err);
    if (st != MHA_OK)
        return st;
    if (cfg->block_table != NULL && !(reads & MHA_READS_PAGES))
        return REJECT(MHA_FIELD_BLOCK_TABLE, "a block_table (a paged cache) is read by "
                      "mha_attend alone; this operation takes keys held contiguously");
    // One ISA for the whole call (dispatch.h): a forward's half weights are
    // packed for it, and its GEMMs must not see another one.
    const int previous = mha_isa_pin();
    st = prm->dtype == MHA_DTYPE_F64 ? f64(cfg, prm, err) : f32(cfg, prm, err);
    mha_isa_unpin(previous);
    return st;
}

mha_status mha_check_no_qk(const mha_config *cfg, mha_error *err)
{
    if (cfg->q_norm == NULL && cfg->k_norm == NULL && cfg->rotary_dim == 0)
        return MHA_OK;
    return REJECT(cfg->q_norm != NULL   ? MHA_FIELD_Q_NORM
                  : cfg->k_norm != NULL ? MHA_FIELD_K_NORM
                                        : MHA_FIELD_ROTARY_DIM,
                  "q_norm, k_norm and RoPE (rotary_dim = %zu) belong to the projections "
                  "(mha_project), not to attention alone", cfg->rotary_dim);
}

mha_status mha_check_required(const mha_required *r, size_t n, mha_error *err)
{
    for (size_t i = 0; i < n; i++)
        if (r[i].p == NULL && r[i].needed)
            return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                              "%s is NULL, but this call needs it (its shape is not empty)",
                              r[i].name);
    return MHA_OK;
}

/* Packed offsets cu (nseq + 1,): cu[0] = 0, nondecreasing, cu[nseq] = n. */
static mha_status cu_check(const int64_t *cu, size_t nseq, size_t n, const char *name,
                           mha_field field, mha_error *err)
{
    if (cu == NULL)
        return mha_reject(err, MHA_ERR_ARG, field, "%s is NULL with nseq = %zu", name, nseq);
    if (cu[0] != 0)
        return mha_reject(err, MHA_ERR_ARG, field, "%s[0] = %lld is not 0", name,
                          (long long)cu[0]);
    for (size_t s = 0; s < nseq; s++)
        if (cu[s + 1] < cu[s])
            return mha_reject(err, MHA_ERR_ARG, field,
                              "%s decreases: %s[%zu] = %lld < %s[%zu] = %lld", name, name,
                              s + 1, (long long)cu[s + 1], name, s, (long long)cu[s]);
    if ((uint64_t)cu[nseq] != (uint64_t)n)
        return mha_reject(err, MHA_ERR_ARG, field, "%s[nseq = %zu] = %lld is not %s = %zu",
                          name, nseq, (long long)cu[nseq],
                          field == MHA_FIELD_CU_Q ? "Tq" : "Tk", n);
    return MHA_OK;
}

/* A block mask (mha.h, bm_block): its sizes and strides, and every entry
   empty, full or a partial block's index below bm_npartial, so that no
   entry reads past bm_bits. O(entries): one look per block. */
static mha_status block_mask_check(const mha_config *cfg, mha_error *err)
{
    if (cfg->bm_block == NULL) {
        if (cfg->bm_bits != NULL || cfg->bm_bq != 0 || cfg->bm_bk != 0 ||
            cfg->bm_bstride != 0 || cfg->bm_hstride != 0 || cfg->bm_npartial != 0)
            return REJECT(MHA_FIELD_BLOCK_MASK,
                          "bm_block is NULL with bm_bits = %p, bm_bq = %zu, bm_bk = %zu, "
                          "bm_bstride = %zu, bm_hstride = %zu, bm_npartial = %zu",
                          (const void *)cfg->bm_bits, cfg->bm_bq, cfg->bm_bk,
                          cfg->bm_bstride, cfg->bm_hstride, cfg->bm_npartial);
        return MHA_OK;
    }
    if (cfg->bm_bq == 0 || cfg->bm_bk == 0 || cfg->bm_bq > MHA_MAX_ELEMS ||
        cfg->bm_bk > MHA_MAX_ELEMS)
        return REJECT(MHA_FIELD_BLOCK_MASK, "bm_bq = %zu, bm_bk = %zu: each must be in "
                      "[1, MHA_MAX_ELEMS]", cfg->bm_bq, cfg->bm_bk);
    const size_t nqb = (cfg->Tq + cfg->bm_bq - 1) / cfg->bm_bq;
    const size_t nkb = (cfg->Tk + cfg->bm_bk - 1) / cfg->bm_bk;
    size_t per_head, per_item, n, bits;
    if (!mul_ok(&per_head, nqb, nkb))
        return REJECT(MHA_FIELD_BLOCK_MASK, "bm_block (%zu x %zu blocks) is past "
                      "MHA_MAX_ELEMS", nqb, nkb);
    if (cfg->bm_hstride != 0 && cfg->bm_hstride != per_head)
        return REJECT(MHA_FIELD_BLOCK_MASK, "bm_hstride = %zu is neither 0 nor nqb nkb = %zu",
                      cfg->bm_hstride, per_head);
    const size_t nh = cfg->bm_hstride != 0 ? cfg->H : 1;
    if (!mul_ok(&per_item, per_head, nh))
        return REJECT(MHA_FIELD_BLOCK_MASK, "bm_block (%zu heads of %zu blocks) is past "
                      "MHA_MAX_ELEMS", nh, per_head);
    if (cfg->bm_bstride != 0 && cfg->bm_bstride != per_item)
        return REJECT(MHA_FIELD_BLOCK_MASK,
                      "bm_bstride = %zu is neither 0 nor (bm_hstride ? H : 1) nqb nkb = %zu",
                      cfg->bm_bstride, per_item);
    if (!mul_ok(&n, per_item, cfg->bm_bstride != 0 ? cfg->B : 1))
        return REJECT(MHA_FIELD_BLOCK_MASK, "bm_block (%zu items of %zu blocks) is past "
                      "MHA_MAX_ELEMS", cfg->B, per_item);
    if (cfg->bm_npartial > 0 &&
        (cfg->bm_bits == NULL || !mul_ok(&bits, cfg->bm_npartial, cfg->bm_bq) ||
         !mul_ok(&bits, bits, (cfg->bm_bk + 7) / 8)))
        return REJECT(MHA_FIELD_BLOCK_MASK, "bm_bits = %p for bm_npartial = %zu blocks of "
                      "%zu x %zu bits", (const void *)cfg->bm_bits, cfg->bm_npartial,
                      cfg->bm_bq, cfg->bm_bk);
    for (size_t e = 0; e < n; e++) {
        const int32_t v = cfg->bm_block[e];
        if (v < MHA_BM_FULL || (v >= 0 && (uint64_t)v >= (uint64_t)cfg->bm_npartial))
            return REJECT(MHA_FIELD_BLOCK_MASK,
                          "bm_block[%zu] = %ld is neither MHA_BM_EMPTY (-1), MHA_BM_FULL "
                          "(-2) nor a partial block's index below bm_npartial = %zu",
                          e, (long)v, cfg->bm_npartial);
    }
    return MHA_OK;
}

/* A paged cache (mha.h, block_table): the page sizes, every entry of the
   table a page of the pool (the kernels index the pools with them, so no
   entry is trusted), and room in each sequence's pages for Tk keys. */
static mha_status paged_check(const mha_config *cfg, mha_error *err)
{
    if (cfg->block_table == NULL) {
        if (cfg->pages_per_seq != 0 || cfg->page_size != 0 || cfg->num_pages != 0)
            return REJECT(MHA_FIELD_BLOCK_TABLE,
                          "block_table is NULL with pages_per_seq = %zu, page_size = %zu, "
                          "num_pages = %zu", cfg->pages_per_seq, cfg->page_size,
                          cfg->num_pages);
        return MHA_OK;
    }
    if (cfg->page_size == 0 || cfg->page_size > MHA_MAX_ELEMS)
        return REJECT(MHA_FIELD_PAGE_SIZE, "page_size = %zu is not in [1, MHA_MAX_ELEMS]",
                      cfg->page_size);
    if (cfg->num_pages == 0 || cfg->num_pages > (size_t)INT32_MAX)
        return REJECT(MHA_FIELD_BLOCK_TABLE, "num_pages = %zu is not in [1, %ld]",
                      cfg->num_pages, (long)INT32_MAX);
    size_t rows, entries;
    if (!mul_ok(&rows, cfg->pages_per_seq, cfg->page_size) ||
        !mul_ok(&entries, cfg->B, cfg->pages_per_seq))
        return REJECT(MHA_FIELD_BLOCK_TABLE,
                      "pages_per_seq = %zu (page_size = %zu, B = %zu) is past MHA_MAX_ELEMS",
                      cfg->pages_per_seq, cfg->page_size, cfg->B);
    if (rows < cfg->Tk)
        return REJECT(MHA_FIELD_BLOCK_TABLE,
                      "pages_per_seq = %zu pages of page_size = %zu hold %zu keys, fewer "
                      "than Tk = %zu", cfg->pages_per_seq, cfg->page_size, rows, cfg->Tk);
    if (cfg->nseq > 0)
        return REJECT(MHA_FIELD_BLOCK_TABLE,
                      "a block_table is not allowed with packed sequences (nseq = %zu)",
                      cfg->nseq);
    for (size_t e = 0; e < entries; e++) {
        const int32_t p = cfg->block_table[e];
        if (p < 0 || (size_t)p >= cfg->num_pages)
            return REJECT(MHA_FIELD_BLOCK_TABLE,
                          "block_table[%zu, %zu] = %ld is not a page in [0, num_pages = %zu)",
                          e / cfg->pages_per_seq, e % cfg->pages_per_seq, (long)p,
                          cfg->num_pages);
    }
    return MHA_OK;
}

/* The variants (mha.h): window, softcap, dropout, ALiBi, T5's bias, packed
   sequences, lengths_aligned. */
static mha_status variants_check(const mha_config *cfg, mha_error *err)
{
    mha_status st;
    if (!cfg->windowed && (cfg->window_left != 0 || cfg->window_right != 0))
        return REJECT(MHA_FIELD_WINDOW,
                      "window_left = %lld, window_right = %lld need windowed != 0",
                      (long long)cfg->window_left, (long long)cfg->window_right);
    if (cfg->chunk > MHA_MAX_ELEMS)
        return REJECT(MHA_FIELD_CHUNK, "chunk = %zu is past MHA_MAX_ELEMS", cfg->chunk);
    st = block_mask_check(cfg, err);
    if (st != MHA_OK)
        return st;
    if (!(cfg->softcap >= 0) || !isfinite(cfg->softcap))
        return REJECT(MHA_FIELD_SOFTCAP,
                      "softcap = %g is not a finite number >= 0", cfg->softcap);
    if (!(cfg->dropout >= 0 && cfg->dropout < 1))
        return REJECT(MHA_FIELD_DROPOUT, "dropout = %g is not in [0, 1)", cfg->dropout);
    if (cfg->alibi_bstride != 0 && cfg->alibi == NULL)
        return REJECT(MHA_FIELD_ALIBI,
                      "alibi is NULL with alibi_bstride = %zu", cfg->alibi_bstride);
    if (cfg->alibi_bstride != 0 && cfg->alibi_bstride != cfg->H)
        return REJECT(MHA_FIELD_ALIBI_BSTRIDE, "alibi_bstride = %zu is neither 0 nor H = %zu",
                      cfg->alibi_bstride, cfg->H);
    if (cfg->rel_table == NULL &&
        (cfg->rel_buckets != 0 || cfg->rel_max_distance != 0 || cfg->rel_bidirectional))
        return REJECT(MHA_FIELD_REL_TABLE,
                      "rel_table is NULL with rel_buckets = %zu, rel_max_distance = %zu, "
                      "rel_bidirectional = %d", cfg->rel_buckets, cfg->rel_max_distance,
                      cfg->rel_bidirectional);
    if (cfg->rel_table != NULL) {
        // Per direction: n buckets, half exact distances, half logarithmic
        // from n / 2 up to rel_max_distance (mha_rel_bucket).
        const size_t n = cfg->rel_bidirectional ? cfg->rel_buckets / 2 : cfg->rel_buckets;
        const char *per = cfg->rel_bidirectional ? "rel_buckets / 2 (a direction's)"
                                                 : "rel_buckets";
        size_t elems;
        if (n < 2)
            return REJECT(MHA_FIELD_REL_BUCKETS,
                          "rel_buckets = %zu (rel_bidirectional = %d): %s = %zu, but a "
                          "direction needs at least 2 buckets", cfg->rel_buckets,
                          cfg->rel_bidirectional, per, n);
        if (!mul_ok(&elems, cfg->rel_buckets, cfg->H))
            return REJECT(MHA_FIELD_REL_BUCKETS,
                          "rel_table (rel_buckets = %zu, H = %zu) is past MHA_MAX_ELEMS",
                          cfg->rel_buckets, cfg->H);
        if (cfg->rel_max_distance < n || cfg->rel_max_distance > MHA_MAX_ELEMS)
            return REJECT(MHA_FIELD_REL_MAX_DISTANCE,
                          "rel_max_distance = %zu is not in [%s = %zu, MHA_MAX_ELEMS]: "
                          "fewer distances than buckets leave buckets empty",
                          cfg->rel_max_distance, per, n);
    }
    if (cfg->nseq > 0) {
        if (cfg->B != 1)
            return REJECT(MHA_FIELD_NSEQ,
                          "packed sequences (nseq = %zu) need B = 1, not B = %zu",
                          cfg->nseq, cfg->B);
        if (cfg->nseq > MHA_MAX_ELEMS)
            return REJECT(MHA_FIELD_NSEQ, "nseq = %zu is past MHA_MAX_ELEMS", cfg->nseq);
        mha_status st = cu_check(cfg->cu_q, cfg->nseq, cfg->Tq, "cu_q", MHA_FIELD_CU_Q, err);
        if (st == MHA_OK)
            st = cu_check(cfg->cu_k, cfg->nseq, cfg->Tk, "cu_k", MHA_FIELD_CU_K, err);
        if (st != MHA_OK)
            return st;
    }
    // Packed sequences place their queries by their own sequence's keys:
    // lengths_aligned (a KV cache's batch items) has no meaning with them.
    if (cfg->lengths_aligned && cfg->nseq > 0)
        return REJECT(MHA_FIELD_LENGTHS_ALIGNED,
                      "lengths_aligned = %d is not allowed with packed sequences (nseq = %zu)",
                      cfg->lengths_aligned, cfg->nseq);
    // q_offset replaces the bottom-right placement, which packed sequences
    // and lengths_aligned make per sequence or per item, and T5's bias is
    // laid out by the distances bottom-right rows can have (relbias.h).
    if (cfg->has_q_offset) {
        const uint64_t mag = cfg->q_offset < 0 ? (uint64_t)0 - (uint64_t)cfg->q_offset
                                               : (uint64_t)cfg->q_offset;
        if (mag > (uint64_t)MHA_MAX_ELEMS)
            return REJECT(MHA_FIELD_Q_OFFSET, "q_offset = %lld is past MHA_MAX_ELEMS",
                          (long long)cfg->q_offset);
        if (cfg->nseq > 0)
            return REJECT(MHA_FIELD_Q_OFFSET,
                          "q_offset = %lld is not allowed with packed sequences (nseq = %zu)",
                          (long long)cfg->q_offset, cfg->nseq);
        if (cfg->lengths_aligned)
            return REJECT(MHA_FIELD_Q_OFFSET,
                          "q_offset = %lld is not allowed with lengths_aligned = %d",
                          (long long)cfg->q_offset, cfg->lengths_aligned);
        if (cfg->rel_table != NULL)
            return REJECT(MHA_FIELD_Q_OFFSET,
                          "q_offset = %lld is not allowed with a relative bias (rel_table)",
                          (long long)cfg->q_offset);
    } else if (cfg->q_offset != 0)
        return REJECT(MHA_FIELD_Q_OFFSET, "q_offset = %lld needs has_q_offset != 0",
                      (long long)cfg->q_offset);
    return paged_check(cfg, err);
}

/* The norm types (mha.h, mha_norm_type) by value: the name a caller may
   give (mha_norm_type_parse) and the C name the messages add. */
static const struct {
    const char *name, *cname;
} norm_types[] = {
    [MHA_NORM_RMS] = {"rms", "MHA_NORM_RMS"},
    [MHA_NORM_LAYER] = {"layer", "MHA_NORM_LAYER"},
};
#define N_NORM_TYPES (sizeof norm_types / sizeof norm_types[0])

const char *mha_norm_type_name(mha_norm_type t)
{
    return (unsigned)t < N_NORM_TYPES ? norm_types[t].name : NULL;
}

/* buf (n bytes) = the accepted values, for a rejection's message: every
   norm type's name ("\"rms\", \"layer\""), or with `values` its value too
   ("MHA_NORM_RMS (0, \"rms\"), ..."). */
static const char *norm_type_list(char *buf, size_t n, int values)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < N_NORM_TYPES && used < n; i++) {
        const char *sep = i ? ", " : "";
        const int w = values ? snprintf(buf + used, n - used, "%s%s (%zu, \"%s\")", sep,
                                        norm_types[i].cname, i, norm_types[i].name)
                             : snprintf(buf + used, n - used, "%s\"%s\"", sep,
                                        norm_types[i].name);
        used += w > 0 ? (size_t)w : 0;
    }
    return buf;
}

mha_status mha_norm_type_parse(mha_norm_type *t, const char *name, size_t len,
                               mha_error *err)
{
    mha_error_clear(err);
    for (size_t i = 0; i < N_NORM_TYPES; i++)
        if (name != NULL && strlen(norm_types[i].name) == len &&
            memcmp(name, norm_types[i].name, len) == 0) {
            *t = (mha_norm_type)i;
            return MHA_OK;
        }
    // What was seen, as printable ASCII (any other byte, a NUL among them,
    // as '?'), cut at 32 bytes: the message stays within mha_error.msg.
    char seen[40], list[128];
    size_t n = 0;
    for (; name != NULL && n < len && n < 32; n++)
        seen[n] = name[n] >= 0x20 && name[n] < 0x7f ? name[n] : '?';
    snprintf(seen + n, sizeof seen - n, "%s", n < len ? "..." : "");
    return REJECT(MHA_FIELD_NORM_TYPE, "norm_type = \"%s\" is not one of %s", seen,
                  norm_type_list(list, sizeof list, 0));
}

/* The q/k transforms (mha.h): the q/k norm and RoPE, their positions. */
static mha_status transforms_check(const mha_config *cfg, mha_error *err)
{
    const size_t G = cfg->G, d = cfg->dk[0];
    if (cfg->rotary_dim % 2 != 0)
        return REJECT(MHA_FIELD_ROTARY_DIM, "rotary_dim = %zu is odd", cfg->rotary_dim);
    if (cfg->rotary_dim > 0 && cfg->inv_freq == NULL)
        return REJECT(MHA_FIELD_INV_FREQ,
                      "inv_freq is NULL with rotary_dim = %zu", cfg->rotary_dim);
    if (cfg->rope_interleaved != 0 && cfg->rope_interleaved != 1)
        return REJECT(MHA_FIELD_ROPE_INTERLEAVED, "rope_interleaved = %d is neither 0 nor 1",
                      cfg->rope_interleaved);
    for (size_t g = 0; g < G; g++) {
        if (cfg->rotary_dim > cfg->dk[g])
            return REJECT(MHA_FIELD_ROTARY_DIM, "rotary_dim = %zu is wider than dk[%zu] = %zu",
                          cfg->rotary_dim, g, cfg->dk[g]);
        if ((cfg->q_norm != NULL || cfg->k_norm != NULL) && cfg->dk[g] != d)
            return REJECT(MHA_FIELD_DK,
                          "q_norm / k_norm need one dk for every head: dk[%zu] = %zu, "
                          "dk[0] = %zu", g, cfg->dk[g], d);
    }
    // The norm weights of each side: (d,) with hstride 0, or one row per head.
    const struct {
        const void *w;
        size_t hstride;
        mha_field fw, fh;
        const char *name;
    } side[2] = {
        {cfg->q_norm, cfg->q_norm_hstride, MHA_FIELD_Q_NORM, MHA_FIELD_Q_NORM_HSTRIDE, "q"},
        {cfg->k_norm, cfg->k_norm_hstride, MHA_FIELD_K_NORM, MHA_FIELD_K_NORM_HSTRIDE, "k"},
    };
    for (int i = 0; i < 2; i++) {
        if (side[i].hstride != 0 && side[i].w == NULL)
            return REJECT(side[i].fw, "%s_norm is NULL with %s_norm_hstride = %zu",
                          side[i].name, side[i].name, side[i].hstride);
        if (side[i].hstride != 0 && side[i].hstride != d)
            return REJECT(side[i].fh, "%s_norm_hstride = %zu is neither 0 nor dk = %zu",
                          side[i].name, side[i].hstride, d);
    }
    if (!(cfg->norm_eps >= 0) || !isfinite(cfg->norm_eps))
        return REJECT(MHA_FIELD_NORM_EPS,
                      "norm_eps = %g is not a finite number >= 0", cfg->norm_eps);
    // Checked with or without a norm weight: a caller's wrong value is
    // never ignored (it only matters where q_norm or k_norm is given).
    if (mha_norm_type_name(cfg->norm_type) == NULL) {
        char list[128];
        return REJECT(MHA_FIELD_NORM_TYPE, "norm_type = %d is not one of %s",
                      (int)cfg->norm_type, norm_type_list(list, sizeof list, 1));
    }
    if (cfg->positions_bstride != 0 && cfg->positions_bstride != cfg->Tq)
        return REJECT(MHA_FIELD_POSITIONS_BSTRIDE,
                      "positions_bstride = %zu is neither 0 nor Tq = %zu",
                      cfg->positions_bstride, cfg->Tq);
    if (cfg->key_positions_bstride != 0 && cfg->key_positions_bstride != cfg->Tk)
        return REJECT(MHA_FIELD_KEY_POSITIONS_BSTRIDE,
                      "key_positions_bstride = %zu is neither 0 nor Tk = %zu",
                      cfg->key_positions_bstride, cfg->Tk);
    return MHA_OK;
}

mha_status mha_check_heads(size_t H, size_t G, mha_error *err)
{
    mha_error_clear(err);
    if (H == 0)
        return REJECT(MHA_FIELD_H, "H = 0: a call needs at least one query head");
    if (G == 0)
        return REJECT(MHA_FIELD_G, "G = 0: a call needs at least one key/value head");
    if (H % G != 0)
        return REJECT(MHA_FIELD_G, "H = %zu is not a multiple of G = %zu", H, G);
    return MHA_OK;
}

/* The head counts, head widths and the arrays every call reads; *lay gets
   the fused widths. */
static mha_status heads_check(mha_layout *lay, const mha_config *cfg, mha_error *err)
{
    const size_t H = cfg->H, G = cfg->G;
    mha_status st = mha_check_heads(H, G, err);
    if (st != MHA_OK)
        return st;
    if (cfg->dk == NULL)
        return REJECT(MHA_FIELD_DK, "dk is NULL");
    if (cfg->dv == NULL)
        return REJECT(MHA_FIELD_DV, "dv is NULL");
    if (cfg->scale == NULL)
        return REJECT(MHA_FIELD_SCALE, "scale is NULL");
    if (cfg->mask_kind != MHA_MASK_NONE && cfg->mask_kind != MHA_MASK_BOOL &&
        cfg->mask_kind != MHA_MASK_ADD)
        return REJECT(MHA_FIELD_MASK_KIND,
                      "mask_kind = %d is not an mha_mask_kind", (int)cfg->mask_kind);
    if (cfg->mask_kind != MHA_MASK_NONE && cfg->mask == NULL)
        return REJECT(MHA_FIELD_MASK, "mask is NULL with mask_kind = %d", (int)cfg->mask_kind);

    // Fused widths. Each head is at least one column wide.
    size_t Sq = 0, Sk = 0, Sv = 0, Svq = 0;
    for (size_t g = 0; g < G; g++) {
        if (cfg->dk[g] == 0)
            return REJECT(MHA_FIELD_DK,
                          "dk[%zu] = 0: every head is at least one column wide", g);
        if (cfg->dv[g] == 0)
            return REJECT(MHA_FIELD_DV,
                          "dv[%zu] = 0: every head is at least one column wide", g);
        if (!add_ok(&Sk, Sk, cfg->dk[g]))
            return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_DK,
                              "the key widths dk[0..%zu] sum past MHA_MAX_ELEMS", g);
        if (!add_ok(&Sv, Sv, cfg->dv[g]))
            return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_DV,
                              "the value widths dv[0..%zu] sum past MHA_MAX_ELEMS", g);
    }
    const size_t per_kv = H / G;
    for (size_t h = 0; h < H; h++) {
        const size_t g = h / per_kv;
        if (!add_ok(&Sq, Sq, cfg->dk[g]))
            return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_DK,
                              "the query width Sq of H = %zu heads is past MHA_MAX_ELEMS", H);
        if (!add_ok(&Svq, Svq, cfg->dv[g]))
            return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_DV,
                              "the concat width Svq of H = %zu heads is past "
                              "MHA_MAX_ELEMS", H);
    }
    if (!cfg->has_wo && cfg->Dout != Svq)
        return REJECT(MHA_FIELD_DOUT, "Dout = %zu is not Svq = %zu, the concat width (no W^O)",
                      cfg->Dout, Svq);
    *lay = (mha_layout){.Sq = Sq, .Sk = Sk, .Sv = Sv, .Svq = Svq};
    return MHA_OK;
}

/* A size below which any product of four sizes, and 2 (H + G), stays below
   MHA_MAX_ELEMS (2^60 - 1 with a 64-bit size_t, 2^28 - 1 with a 32-bit
   one): (2^15 - 1)^4 < 2^60 - 1 and (2^7 - 1)^4 < 2^28 - 1. A power of two,
   so that an OR of sizes below it is below it. */
#define SMALL_SIZE ((size_t)1 << (SIZE_MAX > 0xFFFFFFFFu ? 15 : 7))
_Static_assert(SIZE_MAX <= 0xFFFFFFFFu || (uint64_t)MHA_MAX_ELEMS >= ((uint64_t)1 << 60) - 1,
               "SMALL_SIZE bounds the products of four sizes");
_Static_assert(SIZE_MAX > 0xFFFFFFFFu || (uint64_t)MHA_MAX_ELEMS >= ((uint64_t)1 << 28) - 1,
               "SMALL_SIZE bounds the products of four sizes");

/* Every size used to allocate or index a buffer (element counts). */
static mha_status sizes_check(const mha_layout *lay, const mha_config *cfg, mha_error *err)
{
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H, G = cfg->G;
    const size_t Sq = lay->Sq, Sk = lay->Sk, Sv = lay->Sv, Svq = lay->Svq;
    // Every size below SMALL_SIZE: no product of four of them, nor 2 (H + G),
    // reaches MHA_MAX_ELEMS, so none of the checks below can fail (the small
    // call's path: each call checks its config twice, in the glue and here).
    if ((B | Tq | Tk | H | G | Sq | Sk | Sv | Svq | cfg->Din | cfg->Dkin | cfg->Dvin |
         cfg->Dout) < SMALL_SIZE)
        return MHA_OK;
    const struct {
        size_t n;
        mha_field field;
        const char *name;
    } one[] = {
        {Tq, MHA_FIELD_TQ, "Tq"}, {Tk, MHA_FIELD_TK, "Tk"}, {B, MHA_FIELD_B, "B"},
        {cfg->Din, MHA_FIELD_DIN, "Din"}, {cfg->Dkin, MHA_FIELD_DKIN, "Dkin"},
        {cfg->Dvin, MHA_FIELD_DVIN, "Dvin"}, {cfg->Dout, MHA_FIELD_DOUT, "Dout"},
    };
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++)
        if (one[i].n > MHA_MAX_ELEMS)
            return mha_reject(err, MHA_ERR_SIZE, one[i].field,
                              "%s = %zu is past MHA_MAX_ELEMS", one[i].name, one[i].n);
    size_t tmp;
    if (!add_ok(&tmp, H, G) || !mul_ok(&tmp, tmp, 2)) // the head offsets
        return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_H,
                          "2 (H + G) = 2 (%zu + %zu) is past MHA_MAX_ELEMS", H, G);
    // Each buffer's shape; its field is that of its last axis (mha_field).
    const struct {
        size_t d[4];
        mha_field field;
        const char *shape;
    } buf[] = {
        {{B, Tq, cfg->Din, 1}, MHA_FIELD_DIN, "x (B, Tq, Din)"},
        {{B, Tk, cfg->Dkin, 1}, MHA_FIELD_DKIN, "key (B, Tk, Dkin)"},
        {{B, Tk, cfg->Dvin, 1}, MHA_FIELD_DVIN, "value (B, Tk, Dvin)"},
        {{cfg->Din, Sq, 1, 1}, MHA_FIELD_DK, "wq (Din, Sq)"},
        {{cfg->Dkin, Sk, 1, 1}, MHA_FIELD_DK, "wk (Dkin, Sk)"},
        {{cfg->Dvin, Sv, 1, 1}, MHA_FIELD_DV, "wv (Dvin, Sv)"},
        {{Svq, cfg->Dout, 1, 1}, MHA_FIELD_DOUT, "wo (Svq, Dout)"},
        {{B, Tq, Sq, 1}, MHA_FIELD_DK, "q (B, Tq, Sq)"},
        {{B, Tk, Sk, 1}, MHA_FIELD_DK, "k (B, Tk, Sk)"},
        {{B, Tk, Sv, 1}, MHA_FIELD_DV, "v (B, Tk, Sv)"},
        {{B, Tq, Svq, 1}, MHA_FIELD_DV, "concat (B, Tq, Svq)"},
        {{B, H, Tq, Tk}, MHA_FIELD_TK, "weights (B, H, Tq, Tk)"},
        {{B, H, Tq, 1}, MHA_FIELD_TQ, "lse (B, H, Tq)"},
        {{B, Tq, cfg->Dout, 1}, MHA_FIELD_DOUT, "out (B, Tq, Dout)"},
    };
    for (size_t i = 0; i < sizeof buf / sizeof buf[0]; i++) {
        const size_t *d = buf[i].d;
        if (!count_ok(d[0], d[1], d[2], d[3]))
            return mha_reject(err, MHA_ERR_SIZE, buf[i].field,
                              "%s = (%zu, %zu, %zu, %zu) holds more than MHA_MAX_ELEMS "
                              "elements", buf[i].shape, d[0], d[1], d[2], d[3]);
    }
    return MHA_OK;
}

mha_status mha_check_config(mha_layout *lay, const mha_config *cfg, mha_error *err)
{
    mha_error_clear(err);
    if (lay == NULL || cfg == NULL)
        return REJECT(MHA_FIELD_CALL, "the %s is NULL", cfg == NULL ? "config" : "layout");
    mha_layout l;
    mha_status st = heads_check(&l, cfg, err);
    if (st == MHA_OK)
        st = sizes_check(&l, cfg, err);
    if (st == MHA_OK)
        st = variants_check(cfg, err);
    if (st == MHA_OK)
        st = transforms_check(cfg, err);
    if (st != MHA_OK)
        return st;
    if (cfg->key_lengths != NULL) {
        for (size_t b = 0; b < cfg->B; b++) {
            const int64_t len = cfg->key_lengths[b];
            if (len < 0 || (uint64_t)len > (uint64_t)cfg->Tk)
                return REJECT(MHA_FIELD_KEY_LENGTHS,
                              "key_lengths[%zu] = %lld is not in [0, Tk = %zu]",
                              b, (long long)len, cfg->Tk);
        }
    }
    *lay = l;
    return MHA_OK;
}

/*
 * The rules that need the call's element type (mha_config is the same for
 * float and double; mha_params.dtype says which): a value the kernels
 * round to that type must be representable there, or float32 would turn
 * it into inf (or 0) silently, where the reference, and the same call in
 * float64, keep it. With M the type's largest finite value (FLT_MAX,
 * DBL_MAX):
 *   scale[h]   finite, and |scale| <= M: an inf or NaN scale makes every
 *              score inf or NaN (no output of the call could mean anything)
 *   softcap    0, or 1/M <= softcap <= M: the kernels use softcap and
 *              1/softcap (rules.h), both finite then
 *   alibi      |slope| max(Tq, Tk) <= M (|slope| <= M when Tq = Tk = 1):
 *              the bias -slope |p_i - j| of the largest distance a call
 *              can have, max(Tq, Tk) - 1, does not overflow
 * Called after mha_check_config, so the sizes and arrays are sound.
 */
static mha_status precision_check(const mha_config *cfg, mha_dtype dtype, mha_error *err)
{
    const double M = dtype == MHA_DTYPE_F32 ? (double)FLT_MAX : DBL_MAX;
    const char *type = dtype == MHA_DTYPE_F32 ? "float32" : "float64";
    for (size_t h = 0; h < cfg->H; h++) {
        if (!isfinite(cfg->scale[h]))
            return REJECT(MHA_FIELD_SCALE,
                          "scale[%zu] = %g: expected a finite number (an inf or NaN "
                          "scale makes the scores inf or NaN)", h, cfg->scale[h]);
        if (fabs(cfg->scale[h]) > M)
            return REJECT(MHA_FIELD_SCALE,
                          "scale[%zu] = %g is past %s's largest value %g: it would round "
                          "to inf", h, cfg->scale[h], type, M);
    }
    if (cfg->softcap > 0 && !(cfg->softcap >= 1.0 / M && cfg->softcap <= M))
        return REJECT(MHA_FIELD_SOFTCAP,
                      "softcap = %g is not representable in %s: softcap and 1 / softcap "
                      "must lie in [%g, %g]", cfg->softcap, type, 1.0 / M, M);
    if (cfg->alibi != NULL) {
        const size_t rows = cfg->nseq > 0 ? cfg->nseq : cfg->B;
        const size_t n = cfg->alibi_bstride != 0 ? rows * cfg->H : cfg->H;
        const size_t far = cfg->Tq > cfg->Tk ? cfg->Tq : cfg->Tk;
        const double dist = far > 1 ? (double)(far - 1) : 1.0;
        for (size_t i = 0; i < n; i++) {
            const double slope = cfg->alibi[i];
            if (!isfinite(slope))   /* at any distance: no size in the message */
                return REJECT(MHA_FIELD_ALIBI, "alibi[%zu] = %g: expected a finite slope",
                              i, slope);
            if (!(fabs(slope) * dist <= M))
                return REJECT(MHA_FIELD_ALIBI,
                              "alibi[%zu] = %g: its bias -slope |p_i - j| at the largest "
                              "distance, %.0f (max(Tq, Tk) - 1, or 1), is past %s's largest "
                              "value %g", i, slope, dist, type, M);
        }
    }
    return MHA_OK;
}

mha_status mha_check_config_typed(mha_layout *lay, const mha_config *cfg, mha_dtype dtype,
                                  mha_error *err)
{
    const mha_status st = mha_check_config(lay, cfg, err);
    return st == MHA_OK ? precision_check(cfg, dtype, err) : st;
}

#undef REJECT

/*
 * Column offsets of every head in the fused buffers:
 *   qoff[h]  = sum_{h' < h} dk[h' / (H/G)]   in q      (B, Tq, Sq)
 *   cvoff[h] = sum_{h' < h} dv[h' / (H/G)]   in concat (B, Tq, Svq)
 *   koff[g]  = sum_{g' < g} dk[g']           in k      (B, Tk, Sk)
 *   voff[g]  = sum_{g' < g} dv[g']           in v      (B, Tk, Sv)
 * The sums were checked by mha_check_config.
 */
void mha_head_offsets(size_t *qoff, size_t *cvoff, size_t *koff,
                      size_t *voff, const mha_config *cfg)
{
    const size_t per_kv = cfg->H / cfg->G;
    size_t a = 0, c = 0;
    for (size_t h = 0; h < cfg->H; h++) {
        qoff[h] = a;
        cvoff[h] = c;
        a += cfg->dk[h / per_kv];
        c += cfg->dv[h / per_kv];
    }
    a = 0;
    c = 0;
    for (size_t g = 0; g < cfg->G; g++) {
        koff[g] = a;
        voff[g] = c;
        a += cfg->dk[g];
        c += cfg->dv[g];
    }
}
