/*
 * relbias.h - T5's relative position bias by distance (mha.h, rel_table;
 * core/rules.h, mha_rel), internal to csrc/.
 *
 * The bias of (i, j) depends on the signed distance pos(j) - p_i alone, so
 * a call looks each distance's bucket up once and lays every head's biases
 * out by distance: a tile row then adds a contiguous slice of its head's
 * row (rules_score_row), and no (Tq, Tk) array, nor any bucket, is made per
 * score. The distances a visible key can have: p_i - pos(j) <= off, where
 * off + 1 = Tk (the longest held key count under lengths_aligned, whose
 * queries sit at their own item's last key), and pos(j) - p_i <= Tq - 1
 * (mha_rules_row_place); n = off + Tq of them.
 */
#ifndef MHA_RELBIAS_H
#define MHA_RELBIAS_H

#include <stddef.h>

#include "mha.h"
#include "rules.h"

/* Fills *rel for a checked config with rel_table (rel->bias NULL
   without): bias (H, n) of elements of real_size bytes (4: float, 8:
   double, the table's type), and with `buckets` the buckets too (else
   NULL). MHA_OK, MHA_ERR_SIZE or MHA_ERR_NOMEM; free with mha_rel_free
   whatever happens. */
mha_status mha_rel_prepare(mha_rel *rel, const mha_config *cfg, size_t real_size, int buckets);

/* Frees what mha_rel_prepare allocated; *rel is zeroed. */
void mha_rel_free(mha_rel *rel);

#endif /* MHA_RELBIAS_H */
