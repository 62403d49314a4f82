/*
 * rules.h - THE attention rules: which keys a query sees, and how its
 * scores are formed. The forward tile (kernels/flash.inc), the backward
 * tiles (kernels/bwd.inc) and therefore every ISA path read them from here
 * and nowhere else, so a rule is written once and the forward and the
 * backward cannot drift apart.
 *
 * Letters (see mha.h): Tq queries, Tk keys. Rows of a query i are aligned
 * bottom-right: query i sits at position p_i = i + (Tk - Tq), key j at j;
 * with cfg->lengths_aligned (a KV cache) at p_i = i + (len_b - Tq) instead,
 * len_b = mha_rules_key_len(cfg, b), so each batch item's queries end at its
 * own last key (causal, window, ALiBi and RoPE's default positions alike);
 * with cfg->has_q_offset at p_i = i + cfg->q_offset (a block of a larger
 * call placed at the whole call's positions).
 *
 * Part 1 (plain C, any compile unit): which keys a query sees.
 *   key j is visible from query i (at p_i; key j at pos(j), see below) iff
 *       j < len_b                       (key_lengths[b], else Tk)
 *   and j is in i's own sequence        (packed: cu_q, cu_k)
 *   and pos(j) <= p_i                   (when causal)
 *   and p_i - left <= pos(j) <= p_i + right   (windowed; a side < 0: none)
 *   and floor(p_i / N) == floor(pos(j) / N)   (chunk = N > 0)
 *   and key_mask[b, j] != 0             (pointwise)
 *   and mask[b, h, i, j]                (the bool mask, pointwise)
 *   and block_mask's bit (b, h, i, j)   (pointwise, with a summary per
 *                                        block: mha_bm_kinds)
 *   The rules but the pointwise ones leave each row one interval
 *   [lo(i), hi(i)) (mha_rules_key_range), both ends nondecreasing in i. So
 *   a block of rows sees keys in [lo(first), hi(last)) only: the forward
 *   tile iterates its key blocks over that range and skips a block no row
 *   of a row group sees, the backward finds a key block's query rows by
 *   binary search (mha_rules_query_range), and a key block key_mask
 *   blocks wholly is skipped too (mha_rules_keys_masked). Skipped blocks
 *   are never computed.
 *
 * Part 2 (per element type, inside a kernel unit): how a score is formed,
 * in this order (the reference's order, mhattn/reference.py):
 *   1. s = scale * (q_i . k_j)          by the tile's product
 *   2. s = c tanh(s / c)                softcap (c > 0)
 *   3. s += -slope_bh |p_i - pos(j)|    ALiBi
 *      s += table[bucket(pos(j) - p_i), h]   T5's relative bias (mha_rel)
 *      s += mask[b, h, i, j]            additive mask
 *   4. s = -inf where j is not visible (part 1)
 *   5. p = exp(s - max) / (exp(sink_h - max) + sum)   the softmax, by the
 *      tile; the sink (when given) is a key of value zero: weights
 *      exclude it, lse includes it.
 *   6. p = keep(b, h, i, j) ? p / (1 - dropout) : 0   dropout
 *      (rules_dropout_row; lse is step 5's)
 *
 * Adding a rule: a visibility rule that keeps rows intervals changes
 * mha_rules_key_range; a pointwise one goes in rules_score_row (and, to
 * skip blocks, beside mha_rules_keys_masked); a score rule is one step in
 * rules_score_row, with its derivative in bwd_tile_probs. Then its tests:
 * the reference first, then every ISA.
 */
#ifndef MHA_RULES_H
#define MHA_RULES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "mha.h"

/* Keys j < mha_rules_key_len(cfg, b) exist in batch item b. The lengths
   were checked to lie in [0, Tk], and are clamped here all the same. */
static inline size_t mha_rules_key_len(const mha_config *cfg, size_t b)
{
    if (cfg->key_lengths == NULL)
        return cfg->Tk;
    const int64_t len = cfg->key_lengths[b];
    if (len <= 0)
        return 0;
    return (uint64_t)len < (uint64_t)cfg->Tk ? (size_t)len : cfg->Tk;
}

/* Packed sequences (cfg->nseq > 0): the sequence holding row r of a
   packed axis with offsets cu (nseq + 1,), i.e. the s with
   cu[s] <= r < cu[s+1] (the last such s when sequences are empty). The
   offsets were checked by mha_check_config; a binary search. */
static inline size_t mha_rules_seq_of(const int64_t *cu, size_t nseq, size_t r)
{
    size_t lo = 0, hi = nseq; /* cu[lo] <= r < cu[hi] */
    while (hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        if ((uint64_t)cu[mid] <= (uint64_t)r)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The position of query i of batch item b, p_i = i + (Tk - Tq) (or
   i + (len_b - Tq) with lengths_aligned, i + q_offset with has_q_offset),
   within its own sequence when packed: query r of a sequence of nq queries and nk keys sits at
   r + nk - nq. May be negative (more queries than keys). */
static inline int64_t mha_rules_query_pos(const mha_config *cfg, size_t b, size_t i)
{
    if (cfg->has_q_offset) /* never packed nor lengths_aligned: mha_check_config */
        return (int64_t)i + cfg->q_offset;
    if (cfg->nseq == 0) {
        const size_t tk = cfg->lengths_aligned ? mha_rules_key_len(cfg, b) : cfg->Tk;
        return (int64_t)i + ((int64_t)tk - (int64_t)cfg->Tq);
    }
    const size_t s = mha_rules_seq_of(cfg->cu_q, cfg->nseq, i);
    return ((int64_t)i - cfg->cu_q[s]) +
           ((cfg->cu_k[s + 1] - cfg->cu_k[s]) - (cfg->cu_q[s + 1] - cfg->cu_q[s]));
}

/* The position of key j: j, or j's offset within its sequence when
   packed. */
static inline int64_t mha_rules_key_pos(const mha_config *cfg, size_t j)
{
    if (cfg->nseq == 0)
        return (int64_t)j;
    return (int64_t)j - cfg->cu_k[mha_rules_seq_of(cfg->cu_k, cfg->nseq, j)];
}

/* Element offset of mask[b, h, i, j0] (strides over (B, H, Tq, Tk), 0 where
   the mask broadcasts). */
static inline ptrdiff_t mha_rules_mask_at(const mha_config *cfg, size_t b,
                                          size_t h, size_t i, size_t j0)
{
    const ptrdiff_t *st = cfg->mask_stride;
    return (ptrdiff_t)b * st[0] + (ptrdiff_t)h * st[1] +
           (ptrdiff_t)i * st[2] + (ptrdiff_t)j0 * st[3];
}

/* Where query i sits, and where its keys start: query i of a packed
   sequence s sees keys cu_k[s] .. cu_k[s+1] - 1, key j at position
   j - cu_k[s]. *base = cu_k[s] (0 unpacked), *nk = the sequence's key
   count (Tk unpacked); returns p_i (mha_rules_query_pos). len_b is the
   row's batch item's key count (mha_rules_key_len), which places the row
   under lengths_aligned (never packed: mha_check_config). */
static inline int64_t mha_rules_row_place(const mha_config *cfg, size_t i,
                                          size_t len_b, int64_t *base,
                                          int64_t *nk)
{
    if (cfg->nseq == 0) {
        const size_t tk = cfg->lengths_aligned ? len_b : cfg->Tk;
        *base = 0;
        *nk = (int64_t)cfg->Tk;
        if (cfg->has_q_offset)
            return (int64_t)i + cfg->q_offset;
        return (int64_t)i + ((int64_t)tk - (int64_t)cfg->Tq);
    }
    const size_t s = mha_rules_seq_of(cfg->cu_q, cfg->nseq, i);
    *base = cfg->cu_k[s];
    *nk = cfg->cu_k[s + 1] - cfg->cu_k[s];
    return ((int64_t)i - cfg->cu_q[s]) + (*nk - (cfg->cu_q[s + 1] - cfg->cu_q[s]));
}

/*
 * The keys query i sees before the pointwise rules (key_mask, bool mask):
 * the interval [*lo, *hi) of
 *     its own sequence's keys (packed),  j < len_b (key_lengths),
 *     pos(j) <= p_i (causal),  p_i - left <= pos(j) <= p_i + right
 *     (windowed; a side < 0 is unbounded), p_i's chunk (chunk: the
 *     positions c <= pos(j) < c + chunk, c = p_i - (p_i mod chunk), mod
 *     of floor division, nondecreasing in p_i),
 * clamped so that lo <= hi. len_b = mha_rules_key_len(cfg, b) of the
 * row's batch item (it also places the row under lengths_aligned). Both
 * ends are nondecreasing in i (per batch item), across
 * packed sequences too (each sequence's interval lies within its keys,
 * and later sequences hold later keys): a block of rows i0 .. i1 sees
 * keys in [lo(i0), hi(i1)) only.
 */
static inline void mha_rules_key_range(const mha_config *cfg, size_t i,
                                       size_t len_b, size_t *lo, size_t *hi)
{
    int64_t base, nk;
    const int64_t p = mha_rules_row_place(cfg, i, len_b, &base, &nk);
    int64_t a = 0, e = nk; /* within the sequence: 0 <= a, e <= nk */
    if (cfg->causal && p + 1 < e)
        e = p + 1;
    // -Tq <= p < nk (|p| <= MHA_MAX_ELEMS + Tq with has_q_offset), both
    // within MHA_MAX_ELEMS: e - p - 1 and p - a fit
    // in int64_t, and comparing a side with them first keeps p + right
    // and p - left from overflowing.
    const int64_t right = cfg->window_right, left = cfg->window_left;
    if (cfg->windowed && right >= 0 && right < e - p - 1)
        e = p + right + 1;
    if (cfg->windowed && left >= 0 && left < p - a)
        a = p - left;
    if (cfg->chunk > 0) {
        // |p| <= 2 MHA_MAX_ELEMS and chunk <= MHA_MAX_ELEMS: c + chunk fits.
        const int64_t n = (int64_t)cfg->chunk, r = p % n;
        const int64_t c = p - (r < 0 ? r + n : r);
        a = c > a ? c : a;
        e = c + n < e ? c + n : e;
    }
    e = e < 0 ? 0 : e;
    size_t h = (size_t)(base + e), l = (size_t)(base + a);
    h = h < len_b ? h : len_b;
    *lo = l < h ? l : h;
    *hi = h;
}

/* Within the keys j0 .. j0 + n - 1: the visible ones of [lo, hi) are
   j0 + *a .. j0 + *e - 1 (*a == *e when none). */
static inline void mha_rules_clip(size_t lo, size_t hi, size_t j0, size_t n,
                                  size_t *a, size_t *e)
{
    const size_t j1 = j0 + n;
    const size_t l = lo > j0 ? lo : j0, h = hi < j1 ? hi : j1;
    *a = l < h ? l - j0 : 0;
    *e = l < h ? h - j0 : 0;
}

/* The query rows [*ib, *ie) whose intervals meet the keys [j0, j1): since
   lo and hi are nondecreasing, the first row with hi > j0 and the first
   with lo >= j1, by binary search. Rows between them with an empty
   interval see nothing and cost a masked tile row. */
static inline void mha_rules_query_range(const mha_config *cfg, size_t len_b,
                                         size_t j0, size_t j1, size_t *ib,
                                         size_t *ie)
{
    size_t lo, hi, a = 0, b = cfg->Tq;
    while (a < b) { /* first i with hi(i) > j0 */
        const size_t mid = a + (b - a) / 2;
        mha_rules_key_range(cfg, mid, len_b, &lo, &hi);
        if (hi > j0)
            b = mid;
        else
            a = mid + 1;
    }
    *ib = a;
    b = cfg->Tq;
    while (a < b) { /* first i >= *ib with lo(i) >= j1 */
        const size_t mid = a + (b - a) / 2;
        mha_rules_key_range(cfg, mid, len_b, &lo, &hi);
        if (lo >= j1)
            b = mid;
        else
            a = mid + 1;
    }
    *ie = a;
}

/* 1 when some query row of i0 .. i1 - 1 may see a key of j0 .. j1 - 1: a
   tile spanning packed sequences has blocks between them that none of its
   rows sees (the off-diagonal blocks), skipped like the rest. */
static inline int mha_rules_block_seen(const mha_config *cfg, size_t len_b,
                                       size_t i0, size_t i1, size_t j0,
                                       size_t j1)
{
    size_t ib, ie;
    mha_rules_query_range(cfg, len_b, j0, j1, &ib, &ie);
    return (ib > i0 ? ib : i0) < (ie < i1 ? ie : i1);
}

/* 1 when every query row of i0 .. i1 - 1 (i0 < i1) sees every key of
   j0 .. j1 - 1 by the intervals: as lo and hi are nondecreasing, when the
   last row's lo and the first row's hi allow it: two interval look-ups
   for the whole range. */
static inline int mha_rules_rows_see_all(const mha_config *cfg, size_t len_b,
                                         size_t i0, size_t i1, size_t j0,
                                         size_t j1)
{
    size_t lo, hi;
    mha_rules_key_range(cfg, i1 - 1, len_b, &lo, &hi);
    if (lo > j0)
        return 0;
    mha_rules_key_range(cfg, i0, len_b, &lo, &hi);
    return hi >= j1;
}

/*
 * The block mask (mha.h, bm_block): a pointwise rule with a summary per
 * block. A region of queries and keys whose blocks are all empty is
 * skipped like the blocks the intervals rule out; one whose blocks are all
 * full needs no per-element test (rules_score_row's last step tests the
 * partial blocks' bits).
 */
static inline int32_t mha_bm_entry(const mha_config *cfg, size_t b, size_t h, size_t qb,
                                   size_t kb)
{
    const size_t nkb = (cfg->Tk + cfg->bm_bk - 1) / cfg->bm_bk;
    return cfg->bm_block[b * cfg->bm_bstride + h * cfg->bm_hstride + qb * nkb + kb];
}

/* What the blocks over queries [i0, i1) and keys [j0, j1) (both nonempty)
   of heads h0 .. h0 + nh - 1 in batch item b are: an OR of the MHA_BM_HAS_
   flags; MHA_BM_HAS_FULL with no block mask, MHA_BM_HAS_EMPTY for an empty
   range. One look per block (heads that share a pattern, once). */
enum { MHA_BM_HAS_EMPTY = 1, MHA_BM_HAS_FULL = 2, MHA_BM_HAS_PARTIAL = 4 };

static inline unsigned mha_bm_kinds(const mha_config *cfg, size_t b, size_t h0, size_t nh,
                                    size_t i0, size_t i1, size_t j0, size_t j1)
{
    if (cfg->bm_block == NULL)
        return MHA_BM_HAS_FULL;
    if (i0 >= i1 || j0 >= j1)   /* nothing to see */
        return MHA_BM_HAS_EMPTY;
    unsigned k = 0;
    const size_t he = cfg->bm_hstride != 0 ? h0 + nh : h0 + 1;
    for (size_t h = h0; h < he; h++)
        for (size_t qb = i0 / cfg->bm_bq; qb <= (i1 - 1) / cfg->bm_bq; qb++)
            for (size_t kb = j0 / cfg->bm_bk; kb <= (j1 - 1) / cfg->bm_bk; kb++) {
                const int32_t v = mha_bm_entry(cfg, b, h, qb, kb);
                k |= v == MHA_BM_EMPTY ? MHA_BM_HAS_EMPTY
                                       : v == MHA_BM_FULL ? MHA_BM_HAS_FULL : MHA_BM_HAS_PARTIAL;
            }
    return k;
}

/* 1 when the block mask hides every key of [j0, j1) from every query of
   [i0, i1) (heads h0 .. h0 + nh - 1): such a region is skipped. */
static inline int mha_bm_empty(const mha_config *cfg, size_t b, size_t h0, size_t nh,
                               size_t i0, size_t i1, size_t j0, size_t j1)
{
    return cfg->bm_block != NULL &&
           mha_bm_kinds(cfg, b, h0, nh, i0, i1, j0, j1) == MHA_BM_HAS_EMPTY;
}

/* Row r of partial block v's bits. */
static inline const uint8_t *mha_bm_row(const mha_config *cfg, int32_t v, size_t r)
{
    return cfg->bm_bits + ((size_t)v * cfg->bm_bq + r) * ((cfg->bm_bk + 7) / 8);
}

/* The first (last != 0: the last) column c of [c0, c1) within key block kb
   that some query of [i0, i1) of heads h0 .. h0 + nh - 1 sees by the block
   mask, or SIZE_MAX when none does. A partial block's rows are read a
   byte at a time, skipping zero bytes. */
static inline size_t mha_bm_edge(const mha_config *cfg, size_t b, size_t h0, size_t nh,
                                 size_t i0, size_t i1, size_t kb, size_t c0, size_t c1,
                                 int last)
{
    const size_t bq = cfg->bm_bq, he = cfg->bm_hstride != 0 ? h0 + nh : h0 + 1;
    size_t best = SIZE_MAX;
    for (size_t h = h0; h < he; h++)
        for (size_t qb = i0 / bq; qb <= (i1 - 1) / bq; qb++) {
            const int32_t v = mha_bm_entry(cfg, b, h, qb, kb);
            if (v == MHA_BM_EMPTY)
                continue;
            if (v == MHA_BM_FULL)
                return last ? c1 - 1 : c0;   /* the widest there is */
            const size_t r0 = i0 > qb * bq ? i0 - qb * bq : 0;
            const size_t r1 = i1 - qb * bq < bq ? i1 - qb * bq : bq;
            for (size_t r = r0; r < r1; r++) {
                const uint8_t *bits = mha_bm_row(cfg, v, r);
                // Columns still worth a look: past the best so far.
                size_t lo = c0, hi = c1;
                if (best != SIZE_MAX) {
                    if (last)
                        lo = best + 1;
                    else
                        hi = best;
                }
                for (size_t t = lo; t < hi;) {
                    const size_t c = last ? hi - 1 - (t - lo) : t;
                    if (bits[c >> 3] == 0) {   /* the rest of this byte */
                        const size_t step = last ? (c & 7) + 1 : 8 - (c & 7);
                        t += step;
                        continue;
                    }
                    if ((bits[c >> 3] >> (c & 7)) & 1) {
                        best = c;
                        break;
                    }
                    t++;
                }
            }
        }
    return best;
}

/* Within the keys [j0, j1): [*a, *e), from the first to the last key some
   query of [i0, i1) (heads h0 .. h0 + nh - 1) sees by the block mask (exact
   to the key: the blocks, then the edge blocks' bits); returns 0 when none
   is seen. With no block mask, [j0, j1). */
static inline int mha_bm_hull(const mha_config *cfg, size_t b, size_t h0, size_t nh,
                              size_t i0, size_t i1, size_t j0, size_t j1, size_t *a,
                              size_t *e)
{
    *a = j0, *e = j1;
    if (cfg->bm_block == NULL)
        return 1;
    if (i0 >= i1 || j0 >= j1)
        return 0;
    const size_t bk = cfg->bm_bk, kb0 = j0 / bk, kb1 = (j1 - 1) / bk;
    size_t kb, c = SIZE_MAX;
    for (kb = kb0; kb <= kb1 && c == SIZE_MAX; kb++) {
        const size_t lo = kb == kb0 ? j0 - kb * bk : 0;
        const size_t hi = kb == kb1 ? j1 - kb * bk : bk;
        c = mha_bm_edge(cfg, b, h0, nh, i0, i1, kb, lo, hi, 0);
        if (c != SIZE_MAX)
            *a = kb * bk + c;
    }
    if (c == SIZE_MAX)
        return 0;
    c = SIZE_MAX;
    for (kb = kb1 + 1; kb-- > kb0 && c == SIZE_MAX;) {
        const size_t lo = kb == kb0 ? j0 - kb * bk : 0;
        const size_t hi = kb == kb1 ? j1 - kb * bk : bk;
        c = mha_bm_edge(cfg, b, h0, nh, i0, i1, kb, lo, hi, 1);
        if (c != SIZE_MAX)
            *e = kb * bk + c + 1;
    }
    return 1;
}

/* Within the queries [i0, i1): [*ib, *ie), from the first to the last query
   of head h that sees a key of [j0, j1) by the block mask (the blocks, then
   the bits of the first and last query blocks' rows); *ib == *ie when none
   does. With no block mask, [i0, i1). */
static inline void mha_bm_rows(const mha_config *cfg, size_t b, size_t h, size_t i0,
                               size_t i1, size_t j0, size_t j1, size_t *ib, size_t *ie)
{
    *ib = i0, *ie = i1;
    if (cfg->bm_block == NULL || i0 >= i1 || j0 >= j1)
        return;
    const size_t bq = cfg->bm_bq, qb0 = i0 / bq, qb1 = (i1 - 1) / bq;
    size_t first = SIZE_MAX, last = 0, a, e;
    for (size_t qb = qb0; qb <= qb1; qb++) {
        const size_t r0 = qb == qb0 ? i0 : qb * bq, r1 = qb == qb1 ? i1 : (qb + 1) * bq;
        // Rows of this query block that see some key: all or none of them
        // unless a partial block is met, whose rows are then read (only
        // in the first and the last query block with any).
        if (mha_bm_empty(cfg, b, h, 1, r0, r1, j0, j1))
            continue;
        if (first == SIZE_MAX)
            for (size_t r = r0; r < r1 && first == SIZE_MAX; r++)
                if (mha_bm_hull(cfg, b, h, 1, r, r + 1, j0, j1, &a, &e))
                    first = r;
        last = qb;
    }
    if (first == SIZE_MAX) {
        *ie = *ib;
        return;
    }
    const size_t r0 = last == qb0 ? i0 : last * bq, r1 = last == qb1 ? i1 : (last + 1) * bq;
    size_t end = r1;
    while (end > r0 && end - 1 > first &&
           !mha_bm_hull(cfg, b, h, 1, end - 1, end, j0, j1, &a, &e))
        end--;
    *ib = first, *ie = end;
}

/* 1 when a score rule of part 2 or a pointwise visibility rule applies
   (softcap, ALiBi, T5's bias, a mask, key_mask): else rules_score_row only
   writes -inf outside [a, e) and where the block mask hides a key, and a
   row that sees all of its block's keys, unpadded, in blocks the block
   mask keeps whole (mha_bm_kinds), is left as it is. */
static inline int mha_rules_pointwise(const mha_config *cfg)
{
    return cfg->softcap > 0 || cfg->alibi != NULL || cfg->rel_table != NULL ||
           cfg->mask_kind != MHA_MASK_NONE || cfg->key_mask != NULL;
}

/*
 * T5's relative position bias (mha.h, rel_table). bucket(d) of a signed
 * distance d = pos(j) - p_i is transformers' _relative_position_bucket,
 * operation by operation in float32 as torch does it there:
 *     bidirectional: n = buckets / 2, at = n if d > 0, r = |d|;
 *     else:          n = buckets, at = 0, r = max(-d, 0);
 *     exact = n / 2;  r < exact: at + r;  else at + min(n - 1,
 *       exact + trunc(log(f(r) / f(exact)) / f(log(max / exact)) * f(n - exact)))
 * f() rounding to float32 and log(max / exact) in double (Python's math.log
 * of a true division). The float32 log is the double log rounded: the
 * correctly rounded float32 log but for ties far below any bucket's edge,
 * the same on every platform; tests/test_relative_bias.py holds it to
 * transformers' buckets for every distance of its configurations.
 */
static inline size_t mha_rel_bucket(const mha_config *cfg, int64_t d)
{
    size_t n = cfg->rel_buckets, at = 0;
    uint64_t r;
    if (cfg->rel_bidirectional) {
        n /= 2;
        at = d > 0 ? n : 0;
        r = d < 0 ? (uint64_t)0 - (uint64_t)d : (uint64_t)d;
    } else {
        r = d < 0 ? (uint64_t)0 - (uint64_t)d : 0;
    }
    const size_t exact = n / 2; /* >= 1: mha_check_config */
    if (r < exact)
        return at + (size_t)r;
    // From max on the quotient below is >= 1 but for float32's rounding, t
    // >= (n - exact) (1 - a few ulps) > n - exact - 1 while n - exact <
    // 2^20, and the bucket is the last: no log for the far keys (most of a
    // long decode step's).
    if (r >= cfg->rel_max_distance && n - exact < ((size_t)1 << 20))
        return at + n - 1;
    const float q = (float)r / (float)exact;
    const float lq = (float)log((double)q);
    const float lmax = (float)log((double)cfg->rel_max_distance / (double)exact);
    const float t = lq / lmax * (float)(n - exact);
    // t >= 0; past n it is clamped below, so the cut keeps it finite.
    const size_t over = t < (float)n ? (size_t)t : n;
    const size_t v = exact + over;
    return at + (v < n - 1 ? v : n - 1);
}

/*
 * A call's T5 bias by distance (core/relbias.c makes it): head h's bias
 * at distance d (pos(j) - p_i) is bias[h n + off + d], of the call's
 * element type, for every d a visible key can have, -off <= d < n - off;
 * bucket[off + d] is that distance's bucket (the backward's, to fold the
 * gradient by distance into the table's rows).
 */
typedef struct {
    void *bias;           /* (H, n) */
    uint32_t *bucket;     /* (n,) */
    size_t n, off;
} mha_rel;

/* Where row i's key j0 lies in a head's row of an mha_rel: key j0 + j
   (j >= 0, visible) is at index return + j of bias[h n ..]. */
static inline int64_t mha_rel_index0(const mha_config *cfg, const mha_rel *rel, size_t b,
                                     size_t i, size_t j0)
{
    int64_t base, nk;
    const int64_t p = mha_rules_row_place(cfg, i, mha_rules_key_len(cfg, b), &base, &nk);
    return (int64_t)j0 - base - p + (int64_t)rel->off;
}

/* 1 when key_mask (B, Tk) blocks every key j0 .. j0 + n - 1 of batch item
   b: such a block is skipped, never computed. */
static inline int mha_rules_keys_masked(const mha_config *cfg, size_t b,
                                        size_t j0, size_t n)
{
    if (cfg->key_mask == NULL)
        return 0;
    const uint8_t *km = cfg->key_mask + b * cfg->Tk + j0;
    unsigned char any = 0;
    for (size_t j = 0; j < n; j++)
        any |= km[j];
    return any == 0;
}

/*
 * Dropout (cfg->dropout > 0; mha.h): the keep mask, a counter-based hash
 * of (seed, b, h, i, j) as FlashAttention's and PyTorch's GPU kernels use
 * (theirs is Philox), so any tile, thread or ISA that needs weight
 * (b, h, i, j) regenerates the same bit, and the backward stores nothing.
 * One row's key is a SplitMix64 chain over (seed, b, h, i, j >> 32); each
 * key j then costs two rounds of MurmurHash3's 32-bit finaliser on
 * (uint32_t)j, which the compilers vectorise (32-bit multiplies; a 64-bit
 * mix per key would need AVX-512DQ). The reference
 * (mhattn/reference, dropout_keep) computes the same integers in NumPy.
 */
static inline uint64_t mha_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static inline uint32_t mha_mix32(uint32_t x)
{
    x = (x ^ (x >> 16)) * UINT32_C(0x85ebca6b);
    x = (x ^ (x >> 13)) * UINT32_C(0xc2b2ae35);
    return x ^ (x >> 16);
}

#define MHA_DROPOUT_GOLD UINT64_C(0x9e3779b97f4a7c15)

/* A dropout mask's lanes (rules_dropout_mask): unsigned integers of the
   element type's width, all ones where the hash keeps the weight. */
typedef uint32_t mha_dmask_f32;
typedef uint64_t mha_dmask_f64;

/* The chain's first three links, (seed, b, h): the same for every row of
   a head, so each thread remembers the last head's (a tile asks for one
   head's rows, block after block; three of a row's five mixes saved). */
static inline uint64_t mha_dropout_head_key(uint64_t seed, uint64_t b, uint64_t h)
{
    static _Thread_local struct {
        uint64_t seed, b, h, k;
        int valid;
    } memo;
    if (memo.valid && memo.seed == seed && memo.b == b && memo.h == h)
        return memo.k;
    uint64_t k = mha_mix64(seed + MHA_DROPOUT_GOLD);
    k = mha_mix64(k + b + MHA_DROPOUT_GOLD);
    k = mha_mix64(k + h + MHA_DROPOUT_GOLD);
    memo.seed = seed, memo.b = b, memo.h = h, memo.k = k, memo.valid = 1;
    return k;
}

/* The key of row (b, h, i) for the keys j with j >> 32 == jhi:
   mix64(mix64(head_key + i + G) + jhi + G). */
static inline uint64_t mha_dropout_key(uint64_t seed, uint64_t b, uint64_t h,
                                       uint64_t i, uint64_t jhi)
{
    const uint64_t k = mha_mix64(mha_dropout_head_key(seed, b, h) + i + MHA_DROPOUT_GOLD);
    return mha_mix64(k + jhi + MHA_DROPOUT_GOLD);
}

/* 32 uniform bits of key j (its low 32 bits jlo) under a row's key. */
static inline uint32_t mha_dropout_bits(uint64_t key, uint32_t jlo)
{
    return mha_mix32(mha_mix32(jlo ^ (uint32_t)key) ^ (uint32_t)(key >> 32));
}

/* A weight is kept iff its bits >= floor(p 2^32): with probability
   1 - floor(p 2^32) / 2^32, within 2^-32 of 1 - p. 0 <= p < 1. */
static inline uint32_t mha_dropout_threshold(double p)
{
    return (uint32_t)(p * 4294967296.0);
}

#endif /* MHA_RULES_H */

/*
 * Part 2, once per element type: included by kernels/kernels.inc after
 * simd_dtype.h, with MHA_RULES_ROW defined. No guard on purpose.
 */
#ifdef MHA_RULES_ROW
/*
 * Steps 2 and 3 for one row, query i of head h in batch item b: s (npad,)
 * holds the scaled scores of keys j0 .. j0 + npad - 1 (npad a multiple of
 * VLEN, s aligned), of which j0 + a .. j0 + e - 1 are visible by part 1
 * (mha_rules_clip) and those from a rounded down to VLEN up to e were
 * computed. In the header's order:
 *   softcap   s = c tanh(s / c)                  (dcap[j] = 1 - tanh^2 when
 *                                                 dcap is not NULL: the
 *                                                 backward's derivative)
 *   ALiBi     s += -slope |p_i - pos(j)|
 *   T5        s += its bias at distance pos(j) - p_i (rel, NULL: none)
 *   additive  s += mask[b, h, i, j]
 *   then -inf where the bool mask, key_mask or the block mask blocks, and
 *   outside [a, e).
 * Vector body plus a leftovers tail; the arithmetic is the same lane by
 * lane (softcap's tanh and ALiBi's distances included: vexp.inc, the
 * vocabulary's exact iota and abs), so the result depends neither on
 * where the vector body stops nor on the ISA.
 */
static void PICK(rules_score_row_f32, rules_score_row_f64)(
    REAL *s, REAL *dcap, const mha_config *cfg, const mha_rel *rel, size_t b, size_t h,
    size_t i, size_t j0, size_t a, size_t e, size_t npad)
{
    const ptrdiff_t sj = cfg->mask_stride[3];
    const size_t a0 = a / VLEN * VLEN;
    size_t j;
    // Softcap and ALiBi read no memory, so they run whole vectors up to e
    // rounded up (<= npad); the lanes past e become -inf below.
    if (cfg->softcap > 0 && a < e) {
        // s / c as s * (1 / c): within an ulp, and no division per lane.
        const VEC c = VSET1((REAL)cfg->softcap), one = VSET1(1);
        const VEC inv_c = VSET1((REAL)(1.0 / cfg->softcap));
        for (j = a0; j < e; j += VLEN) {
            const VEC t = VTANH(VMUL(VLOAD(s + j), inv_c));
            VSTORE(s + j, VMUL(c, t));
            if (dcap != NULL)
                VSTORE(dcap + j, VFNMA(t, t, one));
        }
    }
    if (cfg->alibi != NULL && a < e) {
        // Key j0 + j of i's own sequence is at distance |d0 - j|, exact in
        // REAL for any distance below 2^24.
        int64_t base, nk;
        const int64_t d0 = mha_rules_row_place(cfg, i, mha_rules_key_len(cfg, b),
                                               &base, &nk) + base - (int64_t)j0;
        // The slopes' row: the batch item's, or with packed sequences the
        // query's sequence's (its own row when there is one per sequence).
        const size_t row = cfg->nseq > 0 && cfg->alibi_bstride != 0
                               ? mha_rules_seq_of(cfg->cu_q, cfg->nseq, i)
                               : b;
        const VEC ns = VSET1((REAL)-cfg->alibi[row * cfg->alibi_bstride + h]);
        const VEC d0v = VSET1((REAL)d0), iota = VIOTA();
        for (j = a0; j < e; j += VLEN) {
            const VEC dist = VABS(VSUB(d0v, VADD(VSET1((REAL)j), iota)));
            VSTORE(s + j, VADD(VLOAD(s + j), VMUL(ns, dist)));
        }
    }
    if (rel != NULL && a < e) {
        // The head's biases of keys j0 + a .. j0 + e - 1 lie side by side.
        const REAL *rb = (const REAL *)rel->bias + h * rel->n +
                         (size_t)(mha_rel_index0(cfg, rel, b, i, j0) + (int64_t)a);
        REAL *sa = s + a;
        for (j = 0; j < e - a; j++)
            sa[j] += rb[j];
    }
    const ptrdiff_t at = mha_rules_mask_at(cfg, b, h, i, j0);
    if (cfg->mask_kind == MHA_MASK_ADD && a < e) {
        const REAL *m = (const REAL *)cfg->mask + at;
        j = a0;
        if (sj == 1) {
            for (; j + VLEN <= e; j += VLEN)
                VSTORE(s + j, VADD(VLOAD(s + j), VLOADU(m + j)));
        } else if (sj == 0) {
            const VEC mv = VSET1(m[0]);
            for (; j + VLEN <= e; j += VLEN)
                VSTORE(s + j, VADD(VLOAD(s + j), mv));
        }
        for (; j < e; j++)
            s[j] += m[(ptrdiff_t)j * sj];
    } else if (cfg->mask_kind == MHA_MASK_BOOL && a < e) {
        const uint8_t *m = (const uint8_t *)cfg->mask + at;
        j = a0;
        if (sj == 1) {
            for (; j + VLEN <= e; j += VLEN)
                VSTORE(s + j, VSELBOOL(VLOAD(s + j), m + j));
        } else if (sj == 0 && m[0] == 0) {
            e = a; /* the whole row is blocked */
        } else if (sj == 0) {
            j = e;
        }
        for (; j < e; j++)
            if (m[(ptrdiff_t)j * sj] == 0)
                s[j] = NINF;
    }
    if (cfg->key_mask != NULL && a < e) {
        const uint8_t *km = cfg->key_mask + b * cfg->Tk + j0;
        for (j = a0; j + VLEN <= e; j += VLEN)
            VSTORE(s + j, VSELBOOL(VLOAD(s + j), km + j));
        for (; j < e; j++)
            if (km[j] == 0)
                s[j] = NINF;
    }
    if (cfg->bm_block != NULL && a < e) {
        // Block by block: an empty one hides its keys, a full one keeps
        // them, a partial one reads row i's bits.
        const size_t bq = cfg->bm_bq, bk = cfg->bm_bk, qb = i / bq, r = i % bq;
        for (j = a; j < e;) {
            const size_t kb = (j0 + j) / bk, c0 = (j0 + j) % bk;
            const size_t n = bk - c0 < e - j ? bk - c0 : e - j;
            const int32_t v = mha_bm_entry(cfg, b, h, qb, kb);
            if (v == MHA_BM_EMPTY) {
                for (size_t t = 0; t < n; t++)
                    s[j + t] = NINF;
            } else if (v != MHA_BM_FULL) {
                // A byte at a time where the bits are whole bytes: all 1
                // keeps 8 keys, all 0 hides them (a document's or a
                // window's edge block is mostly such bytes).
                const uint8_t *bits = mha_bm_row(cfg, v, r);
                size_t t = 0;
                while (t < n) {
                    const size_t c = c0 + t;
                    const uint8_t byte = bits[c >> 3];
                    if ((c & 7) == 0 && t + 8 <= n && (byte == 0 || byte == 0xff)) {
                        if (byte == 0)
                            for (size_t u = 0; u < 8; u++)
                                s[j + t + u] = NINF;
                        t += 8;
                        continue;
                    }
                    if (((byte >> (c & 7)) & 1) == 0)
                        s[j + t] = NINF;
                    t++;
                }
            }
            j += n;
        }
    }
    for (j = 0; j < a; j++)
        s[j] = NINF;
    for (j = e; j < npad; j++)
        s[j] = NINF;
}

#define DMASK PICK(mha_dmask_f32, mha_dmask_f64)

/*
 * Dropout's mask of one row: km (n,) for row i of head h in batch item b
 * at keys j0 .. j0 + n - 1 (mha_dropout_bits >= mha_dropout_threshold).
 */
static void PICK(rules_dropout_mask_f32, rules_dropout_mask_f64)(
    DMASK *km, const mha_config *cfg, size_t b, size_t h, size_t i, size_t j0, size_t n)
{
    const uint32_t thr = mha_dropout_threshold(cfg->dropout);
    size_t j = 0;
    while (j < n) {
        // Keys up to the next multiple of 2^32 share a row key (always
        // all of them, but for rows past 4 billion keys).
        const uint64_t jg = (uint64_t)(j0 + j), jhi = jg >> 32;
        const uint64_t left = (UINT64_C(1) << 32) - (jg & UINT64_C(0xffffffff));
        const size_t m = (uint64_t)(n - j) < left ? n - j : (size_t)left;
        const uint64_t key = mha_dropout_key(cfg->dropout_seed, b, h, i, jhi);
        const uint32_t jlo = (uint32_t)jg;
        DMASK *kj = km + j;
        for (size_t t = 0; t < m; t++)   /* vectorised: integers only */
            kj[t] = -(DMASK)(mha_dropout_bits(key, jlo + (uint32_t)t) >= thr);
        j += m;
    }
}

/*
 * p (n,) becomes p * inv where km keeps it, else 0, inv = 1 / (1 - dropout)
 * in REAL: selected, not multiplied, so a NaN at a dropped key stays out.
 * The select is an AND of the bits: GCC does not if-convert a float
 * select under -ftrapping-math, and the branchy loop ran unvectorised on
 * AVX2. Exact, elementwise: the same bits on every ISA.
 */
static void PICK(rules_dropout_scale_f32, rules_dropout_scale_f64)(
    REAL *p, const DMASK *km, REAL inv, size_t n)
{
    for (size_t t = 0; t < n; t++) {
        const REAL v = p[t] * inv;
        DMASK u;
        memcpy(&u, &v, sizeof u);
        u &= km[t];
        memcpy(p + t, &u, sizeof u);
    }
}

/* 1 / (1 - dropout) in REAL: the kept weights' factor. */
static inline REAL PICK(rules_dropout_inv_f32, rules_dropout_inv_f64)(const mha_config *cfg)
{
    return (REAL)(1.0 / (1.0 - cfg->dropout));
}

/*
 * Dropout of one row (step 6, after the softmax): p (n,) holds row i's
 * values at keys j0 .. j0 + n - 1 of head h in batch item b; rules_dropout_
 * mask's mask applied by rules_dropout_scale, a chunk at a time. The
 * forward applies it to the probabilities before they meet V and to the
 * weights it returns; the backward makes the mask once per row and tile
 * and applies it to dZ = dO V^T (giving dP) and to P (giving the weights
 * dV sums).
 */
static void PICK(rules_dropout_row_f32, rules_dropout_row_f64)(
    REAL *p, const mha_config *cfg, size_t b, size_t h, size_t i, size_t j0, size_t n)
{
    enum { CHUNK = 256 };
    DMASK km[CHUNK];
    const REAL inv = PICK(rules_dropout_inv_f32, rules_dropout_inv_f64)(cfg);
    for (size_t c = 0; c < n; c += CHUNK) {
        const size_t m = n - c < CHUNK ? n - c : CHUNK;
        PICK(rules_dropout_mask_f32, rules_dropout_mask_f64)(km, cfg, b, h, i, j0 + c, m);
        PICK(rules_dropout_scale_f32, rules_dropout_scale_f64)(p + c, km, inv, m);
    }
}
#undef DMASK
#endif /* MHA_RULES_ROW */
