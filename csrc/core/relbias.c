/*
 * relbias.c - T5's relative position bias by distance (relbias.h).
 */
#include <stddef.h>
#include <stdint.h>

#include "alloc.h"
#include "relbias.h"
#include "rules.h"
#include "sizes.h"

mha_status mha_rel_prepare(mha_rel *rel, const mha_config *cfg, size_t real_size, int buckets)
{
    *rel = (mha_rel){0};
    if (cfg->rel_table == NULL)
        return MHA_OK;
    size_t keys = cfg->Tk;
    if (cfg->lengths_aligned) {
        keys = 0;
        for (size_t b = 0; b < cfg->B; b++) {
            const size_t len = mha_rules_key_len(cfg, b);
            keys = len > keys ? len : keys;
        }
    }
    const size_t H = cfg->H;
    rel->off = keys > 0 ? keys - 1 : 0;
    rel->n = rel->off + (cfg->Tq > 0 ? cfg->Tq : 1);
    size_t nb;
    if (!mha_mul_ok(&nb, H, rel->n))
        return MHA_ERR_SIZE;
    uint32_t *bk;
    mha_status st = mha_scratch((void **)&bk, rel->n, sizeof *bk);
    if (st != MHA_OK)
        return st;
    if ((st = mha_scratch(&rel->bias, nb, real_size)) != MHA_OK) {
        mha_scratch_free(bk);
        return st;
    }
    for (size_t k = 0; k < rel->n; k++)
        bk[k] = (uint32_t)mha_rel_bucket(cfg, (int64_t)k - (int64_t)rel->off);
    // Head h's row: table[bucket, h], rows H apart.
    for (size_t h = 0; h < H; h++) {
        if (real_size == sizeof(float)) {
            const float *t = (const float *)cfg->rel_table + h;
            float *row = (float *)rel->bias + h * rel->n;
            for (size_t k = 0; k < rel->n; k++)
                row[k] = t[(size_t)bk[k] * H];
        } else {
            const double *t = (const double *)cfg->rel_table + h;
            double *row = (double *)rel->bias + h * rel->n;
            for (size_t k = 0; k < rel->n; k++)
                row[k] = t[(size_t)bk[k] * H];
        }
    }
    if (buckets)
        rel->bucket = bk;
    else
        mha_scratch_free(bk);
    return MHA_OK;
}

void mha_rel_free(mha_rel *rel)
{
    mha_scratch_free(rel->bias);
    mha_scratch_free(rel->bucket);
    *rel = (mha_rel){0};
}
