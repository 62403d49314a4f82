/*
 * forward.c - the forward pass of multi-head attention and mha_attend
 * (contract in mha.h). The driver is forward_impl.h, once per element
 * type; its passes are numbered there; mha_forward and mha_attend, at the
 * end, dispatch on the params' element type. Pass 2, the attention
 * itself, is the fused tile of the ISA in force (kernels/flash.inc), run
 * by attend() below, which does not depend on the element type.
 */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

#include "alloc.h"
#include "attend_fused.h"
#include "check.h"
#include "dispatch.h"
#include "gate.h"
#include "gemm.h"
#include "kernels.h"
#include "mha.h"
#include "qk.h"
#include "relbias.h"
#include "rules.h"
#include "sizes.h"
#include "threads.h"

/*
 * Split-K (mha_attend): a call with few query rows per (b, h) has too few
 * tiles to keep the threads busy, and a decode step (Tq = 1) reads K and V
 * once, so each (b, h)'s keys are cut into parts worked in parallel and
 * merged in a fixed order. The parts are chosen from the keys the call
 * holds alone: Tk, or with key lengths the longest item's (a KV cache's
 * decode, whose Tk is the cache's capacity), never from the thread count
 * or the capacity, so the bits depend on neither: about one part per
 * MHA_SPLIT_KEYS keys, at most MHA_SPLIT_MAX, each a whole number of
 * 64-key blocks. A decode thus gives the bits of the same call on its keys
 * held contiguously (Tk = the longest length). Weights are exactly
 * normalised by the tile's second sweep, which needs the final m, l: a call
 * that wants them is not split.
 */
static void attend_split_plan(mha_flash_ctx *ctx)
{
    const mha_config *cfg = ctx->cfg;
    size_t held = cfg->Tk;
    if (cfg->key_lengths != NULL) {
        held = 0;
        for (size_t b = 0; b < cfg->B; b++) {
            const size_t len = mha_rules_key_len(cfg, b);
            held = len > held ? len : held;
        }
    }
    ctx->nparts = 1;
    ctx->part_len = cfg->Tk;
    if (cfg->Tq > MHA_SPLIT_ROWS || ctx->weights != NULL || held < 2 * MHA_SPLIT_KEYS)
        return;
    size_t P = (held + MHA_SPLIT_KEYS - 1) / MHA_SPLIT_KEYS;
    P = P < MHA_SPLIT_MAX ? P : MHA_SPLIT_MAX;
    const size_t len = mha_round_up((held + P - 1) / P, 64);
    ctx->part_len = len;
    ctx->nparts = (held + len - 1) / len;
}

/*
 * Shared key blocks (mha_flash_ctx.kv). Each tile packs every key block it
 * reads, so the tiles of one (b, h), and the H / G heads of a kv head,
 * pack the same blocks again and again: at T = 4096 every block 21 times
 * per head, ~8% of the call in the tiles' packing (Zen 4). Packing each
 * block once, in one more pool phase, pays when at least SHARE_READERS
 * tiles read it and the blocks fit in SHARE_MAX_BYTES; not with split-K
 * (tiles of few rows), a decode step's one-row tiles (they read K and V in
 * place), a KV cache in half or int8 storage (its tiles widen their
 * blocks), or a window (its tiles' blocks start anywhere, not at multiples
 * of BK). Only the time depends on this: a tile uses a shared block only
 * where it would have packed the same one.
 */
#define SHARE_READERS 3
#define SHARE_MAX_BYTES ((size_t)1 << 30)
static atomic_int g_share = 1;

int mha_attend_set_share(int mode)
{
    return atomic_exchange(&g_share, mode < 0 ? 0 : mode > 2 ? 2 : mode);
}

static int attend_share(mha_flash_ctx *ctx, const mha_kernels *kern, size_t real_size,
                        void **raw)
{
    const mha_config *cfg = ctx->cfg;
    ctx->kv = NULL;
    *raw = NULL;
    const size_t readers = cfg->H / cfg->G * ctx->nqb;
    const int mode = atomic_load(&g_share);
    // A half or int8 cache's blocks are widened by the tiles (flash.inc);
    // a paged cache's are copied from their pages by the tiles that read
    // them (the same bits as shared blocks).
    if (mode == 0 || ctx->nparts > 1 || cfg->windowed || cfg->Tk == 0 || ctx->kv_storage ||
        cfg->block_table != NULL ||
        (ctx->decode && cfg->Tq == 1) || (mode == 1 && readers < SHARE_READERS))
        return 0;
    const size_t nkb = (cfg->Tk + kern->flash_bk - 1) / kern->flash_bk;
    size_t vp_off, blocks, n, bytes;
    const size_t per = kern->flash_share_layout(ctx->dk_max, ctx->dv_max, &vp_off);
    if (per == 0 || !mha_mul_ok(&blocks, cfg->B, cfg->G) || !mha_mul_ok(&blocks, blocks, nkb) ||
        !mha_mul_ok(&n, blocks, per) || !mha_mul_ok(&bytes, n, real_size) ||
        bytes > SHARE_MAX_BYTES)
        return 0;
    unsigned char *at;
    if (mha_scratch((void **)&at, bytes + blocks, 1) != MHA_OK)
        return 0; /* packed per tile instead */
    *raw = at;
    ctx->kv = at;
    ctx->kv_bad = at + bytes;
    ctx->nkb = nkb;
    ctx->kv_stride = per;
    ctx->kv_vp_off = vp_off;
    return 1;
}

/* The tasks, on nth threads with their scratch: tasks of one tile each,
   or (split-K) of one part each, then the merge of each tile's parts. */
static mha_status attend_run(mha_flash_ctx *ctx, const mha_kernels *kern,
                             size_t ntiles, int nth, size_t real_size,
                             mha_task_fn merge)
{
    const mha_config *cfg = ctx->cfg;
    const size_t P = ctx->nparts;
    const size_t per = kern->flash_scratch_bytes(ctx->dk_max, ctx->dv_max);
    if (per == 0 || per > (SIZE_MAX - 64) / (size_t)nth)
        return MHA_ERR_SIZE;
    void *raw, *parts = NULL;
    mha_status st = mha_scratch(&raw, (size_t)nth, per);
    if (st != MHA_OK)
        return st;
    ctx->scratch = raw;
    ctx->scratch_stride = per;
    if (P > 1 || ctx->group) {
        // Partials (mha_flash_ctx): slots x Tq x (dv_max + 2) reals, Tq
        // <= MHA_SPLIT_ROWS: small, so not on fresh huge pages either.
        const size_t rows = ctx->cfg->Tq;
        size_t slots, n;
        if (!mha_mul_ok(&slots, ntiles, P) || !mha_mul_ok(&n, slots, rows) ||
            !mha_mul_ok(&n, n, ctx->dv_max + 2))
            st = MHA_ERR_SIZE;
        else
            st = mha_scratch_small(&parts, n, real_size);
        if (st == MHA_OK) {
            unsigned char *at = parts;
            ctx->part_o = at;
            ctx->part_m = at + slots * rows * ctx->dv_max * real_size;
            ctx->part_l = at + slots * rows * (ctx->dv_max + 1) * real_size;
            // Grouped: one task per (b, g, part) instead of (b, h, part).
            const size_t ntask = ctx->group ? ntiles * P / (cfg->H / cfg->G) : ntiles * P;
            st = mha_parallel_for_n(ntask, nth, kern->flash_part_task, ctx);
        }
        if (st == MHA_OK && !atomic_load(&ctx->stop))
            st = mha_parallel_for_n(ntiles, nth, merge, ctx);
    } else {
        void *kv = NULL;
        if (attend_share(ctx, kern, real_size, &kv))
            st = mha_parallel_for_n(cfg->B * cfg->G * ctx->nkb, nth, kern->flash_share_task,
                                    ctx);
        if (st == MHA_OK && !atomic_load(&ctx->stop))
            st = mha_parallel_for_n(ntiles, nth, kern->flash_task, ctx);
        mha_scratch_free(kv);
        ctx->kv = NULL;
    }
    mha_scratch_free(parts);
    mha_scratch_free(raw);
    if (st == MHA_OK && atomic_load(&ctx->stop))
        st = MHA_ERR_INTERRUPTED;
    return st;
}

/*
 * Pass 2 of the forward, for either element type. ctx comes filled in but
 * for nqb, the head-width bounds, the scratch and stop. The work is split
 * into tiles (b, h, query block) of a size fixed by the kernel, each owned
 * by one thread, so the result does not depend on the thread count. Every
 * thread gets its own scratch, allocated here for the thread count handed
 * to the pool and padded to cache lines by the kernel's size. merge != NULL
 * (mha_attend) allows split-K (attend_split_plan), its tasks merging the
 * parts of one tile; elements of real_size bytes.
 */
static mha_status attend(mha_flash_ctx *ctx, const mha_kernels *kern,
                         size_t real_size, mha_task_fn merge)
{
    const mha_config *cfg = ctx->cfg;
    atomic_init(&ctx->stop, 0);
    ctx->nparts = 1;
    ctx->bq = kern->flash_bq;
    if (cfg->B == 0 || cfg->Tq == 0)
        return MHA_OK;
    ctx->nqb = (cfg->Tq + kern->flash_bq - 1) / kern->flash_bq;
    const size_t ntasks = cfg->B * cfg->H * ctx->nqb; /* <= B * H * Tq */
    if (merge != NULL)
        attend_split_plan(ctx);
    // The query heads of a kv head in one task's rows (flash.inc,
    // flash_part_group): K and V read once for the H / G heads. Grouped
    // tasks leave partials for the merge, even as one part: a GQA step
    // whose keys are not split (fewer than 2 MHA_SPLIT_KEYS) ran one head
    // per tile, and each head read the kv head's rows again. Depends on the
    // shapes alone, so the bits do not depend on the thread count.
    ctx->group = ctx->decode && cfg->Tq == 1 && cfg->H / cfg->G <= kern->flash_bq &&
                 (ctx->nparts > 1 || (merge != NULL && cfg->H > cfg->G));

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
    const size_t nwork = ctx->group ? ntasks * ctx->nparts / (cfg->H / cfg->G)
                                    : ntasks * ctx->nparts;
    if ((size_t)nth > nwork)
        nth = (int)nwork;
    // Waking a sleeping worker costs tens of microseconds: a small call
    // (the document's example does ~100 multiply-adds) runs on the caller
    // alone. Only speed depends on this; tiles, and so results, do not.
    const double work = (double)cfg->B * (double)cfg->H * (double)cfg->Tq *
                        (double)cfg->Tk * (double)(dk_max + dv_max);
    if (work < MHA_SMALL_WORK)
        nth = 1;
    // T5's bias, by distance, for every tile (core/relbias.h).
    mha_rel rel;
    mha_status st = mha_rel_prepare(&rel, cfg, real_size, 0);
    ctx->rel = rel.bias != NULL ? &rel : NULL;
    if (st == MHA_OK)
        st = attend_run(ctx, kern, ntasks, nth, real_size, merge);
    mha_rel_free(&rel);
    ctx->rel = NULL;
    return st;
}

/*
 * Half weights (mha.h, mha_params.w_storage): the float32 forms of a
 * forward's wq, wk, wv, wo and wgate that its GEMMs read. A weight whose GEMM
 * multiplies panels (mha_gemm_reads_panels) is packed into float32 panels,
 * widened as it is packed, all of them in one pool phase (mha_pack_half),
 * and handed to the GEMM as the call's prepacked weight: the GEMM then
 * never reads the weight itself, whose half bits stay in w[]. A weight of
 * a problem small enough for the GEMM's plain loop is widened whole
 * instead (at most MHA_GEMM_SMALL elements), and that loop reads the copy.
 * The panels and the copy hold the widened values exactly, and a GEMM's
 * bits are the same from prepacked panels as from its own (gemm.h): so the
 * bits of the float32 forward on the widened weights. (The ISA is read
 * when packing and again by each GEMM: the call's pin (dispatch.h,
 * mha_isa_pin) keeps it one, so that no GEMM rejects the panels and reads
 * the half bits as float32.)
 */
typedef struct {
    mha_config cfg;      /* the call's, packed[] replaced by ours      */
    const void *w[5];    /* wq, wk, wv, wo, wgate as the GEMMs are handed
                            them                                        */
    mha_packed pk[5];    /* panels, or data NULL                       */
    float *wide[5];      /* widened copies, or NULL                    */
    const mha_packed *pk_gate; /* &pk[4] when wgate's GEMM reads them;
                            the config's packed[] has no slot for it   */
} fwd_half_weights;

static void fwd_half_free(fwd_half_weights *h)
{
    for (int i = 0; i < 5; i++) {
        mha_packed_free(&h->pk[i]);
        mha_scratch_free(h->wide[i]);
    }
}

/* Fills *h for a checked call (lay its layout); freed by fwd_half_free
   whatever happens. */
static mha_status fwd_half_prepare(fwd_half_weights *h, const mha_config *cfg,
                                   const mha_layout *lay, const mha_params *prm)
{
    *h = (fwd_half_weights){.cfg = *cfg,
                            .w = {prm->wq, prm->wk, prm->wv, prm->wo, prm->wgate}};
    const mha_dtype dt = prm->w_storage == MHA_KV_F16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
    // Weight i: (K, N), multiplied by M rows (the projections, the output,
    // the output gate).
    const size_t nq = cfg->B * cfg->Tq, nk = cfg->B * cfg->Tk;
    const size_t K[5] = {cfg->Din, cfg->Dkin, cfg->Dvin, lay->Svq, cfg->Din};
    const size_t N[5] = {lay->Sq, lay->Sk, lay->Sv, cfg->Dout, lay->Svq};
    const size_t M[5] = {nq, nk, nk, nq, nq};
    const uint16_t *pw[5];
    size_t pK[5], pN[5];
    int which[5], n = 0;
    mha_status st = MHA_OK;
    for (int i = 0; i < 5; i++) {
        if (i < 4)
            h->cfg.packed[i] = NULL;
        if (h->w[i] == NULL || (i == 3 && !cfg->has_wo))
            continue; /* no W^O, no gate */
        if (M[i] == 0 || N[i] == 0 || K[i] == 0)
            continue; /* its GEMM reads no weight */
        if (mha_gemm_reads_panels(M[i], N[i], K[i])) {
            pw[n] = h->w[i], pK[n] = K[i], pN[n] = N[i], which[n++] = i;
            continue;
        }
        if ((st = mha_scratch((void **)&h->wide[i], K[i] * N[i], sizeof(float))) != MHA_OK ||
            (st = mha_convert(h->wide[i], MHA_DTYPE_F32, h->w[i], dt, K[i] * N[i])) != MHA_OK)
            return st;
        h->w[i] = h->wide[i];
    }
    mha_packed pk[5];
    if ((st = mha_pack_half(pk, pw, pN, pK, pN, n, dt)) != MHA_OK)
        return st;
    for (int j = 0; j < n; j++) {
        h->pk[which[j]] = pk[j];
        if (which[j] < 4)
            h->cfg.packed[which[j]] = &h->pk[which[j]];
        else
            h->pk_gate = &h->pk[4];
    }
    return MHA_OK;
}

#define MHA_TEMPLATE "forward_impl.h"
#include "each_type.h"

/* The entry points (mha.h): the call's checks common to every operation,
   then the driver of its element type. */
mha_status mha_forward(const mha_config *cfg, const mha_params *prm, mha_error *err)
{
    return mha_call_typed(cfg, prm, err, mha_forward_f32, mha_forward_f64,
                          MHA_READS_HALF_WEIGHTS);
}

mha_status mha_attend(const mha_config *cfg, const mha_params *prm, mha_error *err)
{
    return mha_call_typed(cfg, prm, err, mha_attend_f32, mha_attend_f64, MHA_READS_PAGES);
}
