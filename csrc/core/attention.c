/*
 * attention.c - config checks and the forward pass of multi-head attention.
 *
 * Letters (see mha.h): B batch, Tq queries, Tk keys, H query heads, G kv
 * heads, dk[g] / dv[g] head widths, Sq / Sk / Sv / Svq fused widths.
 *
 * The forward pass itself lives in attention_impl.h, included twice below
 * (float32 and float64 from one source). This file holds what does not
 * depend on the element type: checked size arithmetic, the config check,
 * the head offsets and the driver of the fused attention pass (pass 2; its
 * kernels are in flash_*.c, see flash.h).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "dispatch.h"
#include "kernels.h"
#include "gemm.h"
#include "mha.h"
#include "threads.h"

/*
 * Largest element count any buffer may have. Bounding counts by
 * PTRDIFF_MAX / sizeof(double) means byte sizes of float and double buffers
 * fit in size_t and pointer differences, and Tq, Tk can be used in signed
 * ptrdiff_t arithmetic (the causal offset i + Tk - Tq) without overflow.
 */
#define MHA_MAX_ELEMS ((size_t)PTRDIFF_MAX / sizeof(double))

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

mha_status mha_check_config(mha_layout *lay, const mha_config *cfg)
{
    if (lay == NULL || cfg == NULL)
        return MHA_ERR_ARG;
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk;
    const size_t H = cfg->H, G = cfg->G;

    if (H == 0 || G == 0 || H % G != 0)
        return MHA_ERR_ARG;
    if (cfg->dk == NULL || cfg->dv == NULL || cfg->scale == NULL)
        return MHA_ERR_ARG;
    if (cfg->mask_kind != MHA_MASK_NONE && cfg->mask_kind != MHA_MASK_BOOL &&
        cfg->mask_kind != MHA_MASK_ADD)
        return MHA_ERR_ARG;
    if (cfg->mask_kind != MHA_MASK_NONE && cfg->mask == NULL)
        return MHA_ERR_ARG;

    // Fused widths. Each head is at least one column wide.
    size_t Sq = 0, Sk = 0, Sv = 0, Svq = 0;
    for (size_t g = 0; g < G; g++) {
        if (cfg->dk[g] == 0 || cfg->dv[g] == 0)
            return MHA_ERR_ARG;
        if (!add_ok(&Sk, Sk, cfg->dk[g]) || !add_ok(&Sv, Sv, cfg->dv[g]))
            return MHA_ERR_SIZE;
    }
    const size_t per_kv = H / G;
    for (size_t h = 0; h < H; h++) {
        const size_t g = h / per_kv;
        if (!add_ok(&Sq, Sq, cfg->dk[g]) || !add_ok(&Svq, Svq, cfg->dv[g]))
            return MHA_ERR_SIZE;
    }
    if (!cfg->has_wo && cfg->Dout != Svq)
        return MHA_ERR_ARG;

    // Every size used to allocate or index a buffer (element counts).
    const size_t one = 1;
    size_t tmp;
    if (Tq > MHA_MAX_ELEMS || Tk > MHA_MAX_ELEMS || B > MHA_MAX_ELEMS ||
        cfg->Din > MHA_MAX_ELEMS || cfg->Dkin > MHA_MAX_ELEMS ||
        cfg->Dvin > MHA_MAX_ELEMS || cfg->Dout > MHA_MAX_ELEMS ||
        !add_ok(&tmp, H, G) || !mul_ok(&tmp, tmp, 2) ||          // offsets
        !count_ok(B, Tq, cfg->Din, one) ||                        // x
        !count_ok(B, Tk, cfg->Dkin, one) ||                       // key
        !count_ok(B, Tk, cfg->Dvin, one) ||                       // value
        !count_ok(cfg->Din, Sq, one, one) ||                      // wq
        !count_ok(cfg->Dkin, Sk, one, one) ||                     // wk
        !count_ok(cfg->Dvin, Sv, one, one) ||                     // wv
        !count_ok(Svq, cfg->Dout, one, one) ||                    // wo
        !count_ok(B, Tq, Sq, one) ||                              // q
        !count_ok(B, Tk, Sk, one) ||                              // k
        !count_ok(B, Tk, Sv, one) ||                              // v
        !count_ok(B, Tq, Svq, one) ||                             // concat
        !count_ok(B, H, Tq, Tk) ||                                // weights
        !count_ok(B, H, Tq, one) ||                               // lse
        !count_ok(B, Tq, cfg->Dout, one))                         // out
        return MHA_ERR_SIZE;

    if (cfg->key_lengths != NULL) {
        for (size_t b = 0; b < B; b++) {
            const int64_t len = cfg->key_lengths[b];
            if (len < 0 || (uint64_t)len > (uint64_t)Tk)
                return MHA_ERR_ARG;
        }
    }

    lay->Sq = Sq;
    lay->Sk = Sk;
    lay->Sv = Sv;
    lay->Svq = Svq;
    return MHA_OK;
}

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

/*
 * Pass 2 of the forward, for either element type. ctx comes filled in but
 * for nqb, the head-width bounds, the scratch and stop. The work is split
 * into tiles (b, h, query block) of a size fixed by the kernel, each owned
 * by one thread, so the result does not depend on the thread count. Every
 * thread gets its own scratch, allocated here for the thread count handed
 * to the pool and padded to cache lines by the kernel's size.
 */
static mha_status attend(mha_flash_ctx *ctx, const mha_kernels *kern)
{
    const mha_config *cfg = ctx->cfg;
    atomic_init(&ctx->stop, 0);
    if (cfg->B == 0 || cfg->Tq == 0)
        return MHA_OK;
    ctx->nqb = (cfg->Tq + kern->flash_bq - 1) / kern->flash_bq;
    const size_t ntasks = cfg->B * cfg->H * ctx->nqb; /* <= B * H * Tq */

    // Widest kv head. Without keys no tile touches the K / V scratch, so
    // absurd head widths need not be allocated for.
    size_t dk_max = 1, dv_max = 1;
    for (size_t g = 0; cfg->Tk > 0 && g < cfg->G; g++) {
        dk_max = cfg->dk[g] > dk_max ? cfg->dk[g] : dk_max;
        dv_max = cfg->dv[g] > dv_max ? cfg->dv[g] : dv_max;
    }
    ctx->dk_max = dk_max;
    ctx->dv_max = dv_max;

    int nth = mha_get_num_threads();
    if (nth < 1)
        nth = 1;
    if ((size_t)nth > ntasks)
        nth = (int)ntasks;
    // Waking a sleeping worker costs tens of microseconds: a small call
    // (the document's example does ~100 multiply-adds) runs on the caller
    // alone. Only speed depends on this; tiles, and so results, do not.
    const double work = (double)cfg->B * (double)cfg->H * (double)cfg->Tq *
                        (double)cfg->Tk * (double)(dk_max + dv_max);
    if (work < 262144.0)
        nth = 1;
    const size_t per = kern->flash_scratch_bytes(dk_max, dv_max);
    if (per == 0 || per > (SIZE_MAX - 64) / (size_t)nth)
        return MHA_ERR_SIZE;
    void *raw;
    const mha_status st_alloc = mha_scratch(&raw, (size_t)nth, per);
    if (st_alloc != MHA_OK)
        return st_alloc;
    ctx->scratch = raw;
    ctx->scratch_stride = per;

    mha_status st = mha_parallel_for_n(ntasks, nth, kern->flash_task, ctx);
    free(raw);
    if (st == MHA_OK && atomic_load(&ctx->stop))
        st = MHA_ERR_INTERRUPTED;
    return st;
}

#define MHA_CAT_(a, b) a##_##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)

#define real float
#define sfx f32
#include "attention_impl.h"
#undef real
#undef sfx

#define real double
#define sfx f64
#include "attention_impl.h"
#undef real
#undef sfx
