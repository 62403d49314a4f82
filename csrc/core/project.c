/*
 * project.c - mha_project (contract in mha.h): the projections of
 * mha_forward alone (its pass 1), then the q/k transforms (its pass 1b),
 * with no attention. The per-type function is project_impl.h, included
 * twice below. It calls the forward's GEMM and core/qk.c's transform in
 * the forward's order, so q, k and v are bitwise those the forward's
 * attention reads.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "alloc.h"
#include "check.h"
#include "gemm.h"
#include "kernels.h"
#include "mha.h"
#include "qk.h"
#include "threads.h"

#define MHA_TEMPLATE "project_impl.h"
#include "each_type.h"

/* The entry point (mha.h): the call's checks, then the element type's. */
mha_status mha_project(const mha_config *cfg, const mha_params *prm, mha_error *err)
{
    return mha_call_typed(cfg, prm, err, mha_project_f32, mha_project_f64, 0);
}
