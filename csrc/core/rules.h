/*
 * rules.h - THE attention rules: which keys a query sees, and how its
 * scores are formed. The forward tile (kernels/flash.inc), the backward
 * tiles (kernels/bwd.inc) and therefore every ISA path read them from here
 * and nowhere else, so a rule is written once and the forward and the
 * backward cannot drift apart.
 *
 * Letters (see mha.h): Tq queries, Tk keys. Rows of a query i are aligned
 * bottom-right: query i sits at position p_i = i + (Tk - Tq), key j at j.
 *
 * Part 1 (plain C, any compile unit): which keys a query sees.
 *   key j is visible from query i iff
 *       j < len_b                              (key_lengths[b], else Tk)
 *   and j <= p_i                               (when causal)
 *   The visible keys of a row are one interval [0, mha_rules_key_end);
 *   it grows with i, so a block of rows sees at most what its last row
 *   sees, and a key block is skipped when no row of a tile sees it.
 *
 * Part 2 (per element type, inside a kernel unit): how a score is formed,
 * in this order (the reference's order, mhattn/reference.py):
 *   1. s = scale * (q_i . k_j)          by the tile's product
 *   2. s += mask[b, h, i, j]            additive mask
 *   3. s = -inf where mask[b,h,i,j] is False, or where j is not visible
 *   4. p = exp(s - max) / sum           the softmax, by the tile
 *
 * Adding a rule: a visibility rule changes mha_rules_key_end (and, when it
 * makes the interval start later than 0, a mha_rules_key_begin beside it)
 * and mha_rules_first_query; a score rule is one step in
 * rules_score_row. Then its tests: the reference first, then every ISA.
 */
#ifndef MHA_RULES_H
#define MHA_RULES_H

#include <stddef.h>
#include <stdint.h>

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

/* Query i sees keys j < mha_rules_key_end(cfg, i, len_b): j < len_b and,
   when causal, j <= i + Tk - Tq (the first Tq - Tk rows see nothing when
   Tk < Tq). Nondecreasing in i. */
static inline size_t mha_rules_key_end(const mha_config *cfg, size_t i,
                                       size_t len_b)
{
    if (!cfg->causal)
        return len_b;
    if (i + cfg->Tk < cfg->Tq)
        return 0;
    const size_t e = i + cfg->Tk - cfg->Tq + 1; /* <= Tk, since i < Tq */
    return e < len_b ? e : len_b;
}

/* The first query that may see key j0 (and every key after it): the
   inverse of mha_rules_key_end. */
static inline size_t mha_rules_first_query(const mha_config *cfg, size_t j0)
{
    if (!cfg->causal || j0 + cfg->Tq <= cfg->Tk)
        return 0;
    return j0 + cfg->Tq - cfg->Tk;
}

/* How many of the n keys j0 .. j0 + n - 1 a row whose visible keys end at
   `end` sees. */
static inline size_t mha_rules_visible_in(size_t end, size_t j0, size_t n)
{
    return end <= j0 ? 0 : (end - j0 < n ? end - j0 : n);
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

/* The position of query i, p_i = i + (Tk - Tq), within its own sequence
   when packed: query r of a sequence of nq queries and nk keys sits at
   r + nk - nq. May be negative (more queries than keys). */
static inline int64_t mha_rules_query_pos(const mha_config *cfg, size_t i)
{
    if (cfg->nseq == 0)
        return (int64_t)i + ((int64_t)cfg->Tk - (int64_t)cfg->Tq);
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

#endif /* MHA_RULES_H */

/*
 * Part 2, once per element type: included by kernels/kernels.inc after
 * simd_dtype.h, with MHA_RULES_ROW defined. No guard on purpose.
 */
#ifdef MHA_RULES_ROW
/*
 * Steps 2 and 3 for one row: s (npad,) holds the scaled scores of query i
 * against keys j0 .. j0 + npad - 1 (npad a multiple of VLEN), of which the
 * first `vis` are visible (mha_rules_visible_in). The additive mask is
 * added to the visible scores, then keys the bool mask blocks, and every
 * key from vis on, become -inf. Vector body plus a leftovers tail; the
 * arithmetic is the same lane by lane, so the result does not depend on
 * where the vector body stops.
 */
static void PICK(rules_score_row_f32, rules_score_row_f64)(
    REAL *s, const mha_config *cfg, size_t b, size_t h, size_t i, size_t j0,
    size_t vis, size_t npad)
{
    const ptrdiff_t sj = cfg->mask_stride[3];
    const ptrdiff_t at = mha_rules_mask_at(cfg, b, h, i, j0);
    size_t j = 0;
    if (cfg->mask_kind == MHA_MASK_ADD && vis > 0) {
        const REAL *m = (const REAL *)cfg->mask + at;
        if (sj == 1) {
            for (; j + VLEN <= vis; j += VLEN)
                VSTORE(s + j, VADD(VLOAD(s + j), VLOADU(m + j)));
        } else if (sj == 0) {
            const VEC mv = VSET1(m[0]);
            for (; j + VLEN <= vis; j += VLEN)
                VSTORE(s + j, VADD(VLOAD(s + j), mv));
        }
        for (; j < vis; j++)
            s[j] += m[(ptrdiff_t)j * sj];
    } else if (cfg->mask_kind == MHA_MASK_BOOL && vis > 0) {
        const uint8_t *m = (const uint8_t *)cfg->mask + at;
        if (sj == 1) {
            for (; j + VLEN <= vis; j += VLEN)
                VSTORE(s + j, VSELBOOL(VLOAD(s + j), m + j));
        } else if (sj == 0 && m[0] == 0) {
            vis = 0; /* the whole row is blocked */
        } else if (sj == 0) {
            j = vis;
        }
        for (; j < vis; j++)
            if (m[(ptrdiff_t)j * sj] == 0)
                s[j] = NINF;
    }
    for (j = vis; j < npad; j++)
        s[j] = NINF;
}
#endif /* MHA_RULES_ROW */
