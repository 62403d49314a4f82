/*
 * backward.c - the backward pass of multi-head attention (contract in
 * mha.h): FlashAttention-2's backward, with the forward's log-sum-exp
 * instead of a stored T x T probability matrix. The driver is
 * backward_impl.h, once per element type; its passes are numbered there;
 * mha_backward and mha_attend_backward, at the end, dispatch on the
 * params' element type.
 * The tiles are the kernels of the ISA in force (kernels/bwd.inc).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#include "sizes.h"
#include "threads.h"

/*
 * Which plan passes 4 and 5 follow (both give bitwise the same gradients,
 * see bwd_fused_task in kernels/bwd.inc): fused, one task per (b, kv head),
 * does 5 tile products per tile; two-pass, one task per key block and then
 * per query block, does 7 but splits the work finer. Fused is chosen when
 * its ntasks (= B G) tasks keep nth threads at least 3/4 busy in whole
 * rounds, ntasks / (nth ceil(ntasks / nth)) >= 3/4, where it is cheaper.
 * The choice depends on the thread count, the gradients do not.
 */
static int mha_bwd_plan_fused(size_t ntasks, int nth)
{
    const size_t n = nth < 1 ? 1 : (size_t)nth;
    const size_t rounds = (ntasks + n - 1) / n;
    return ntasks > 0 && ntasks <= SIZE_MAX / 4 && 4 * ntasks >= 3 * rounds * n;
}

#define MHA_TEMPLATE "backward_impl.h"
#include "each_type.h"

/* The entry points (mha.h): the call's checks common to every operation,
   then the driver of its element type. */
mha_status mha_backward(const mha_config *cfg, const mha_params *prm, mha_error *err)
{
    return mha_call_typed(cfg, prm, err, mha_backward_f32, mha_backward_f64, 0);
}

mha_status mha_attend_backward(const mha_config *cfg, const mha_params *prm,
                               mha_error *err)
{
    return mha_call_typed(cfg, prm, err, mha_attend_backward_f32, mha_attend_backward_f64, 0);
}
