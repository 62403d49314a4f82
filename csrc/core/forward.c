/*
 * forward.c - the forward pass of multi-head attention (contract in
 * mha.h). The driver is forward_impl.h, once per element type; its passes
 * are numbered there. Pass 2, the attention itself, is the fused tile of
 * the ISA in force (kernels/flash.inc), run by attend() below, which does
 * not depend on the element type.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "alloc.h"
#include "attend_fused.h"
#include "dispatch.h"
#include "gemm.h"
#include "kernels.h"
#include "mha.h"
#include "qk.h"
#include "threads.h"

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
    if (work < MHA_SMALL_WORK)
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

#define MHA_F64 0
#include "forward_impl.h"
#undef MHA_F64

#define MHA_F64 1
#include "forward_impl.h"
#undef MHA_F64
