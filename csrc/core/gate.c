/*
 * gate.c - the output gate (contract in mha.h and gate.h): the gate's
 * GEMM, the sigmoid and the product before W^O, and the elementwise part
 * of their backward. The per-type code is gate_impl.h, included twice
 * below; what does not depend on the element type (the threads) is here.
 *
 * The elementwise passes go over the elements in blocks of GATE_BLOCK,
 * one task each, a task owning its elements, so the result does not
 * depend on the thread count.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "gate.h"
#include "gemm.h"
#include "kernels.h"
#include "mha.h"
#include "threads.h"

#define GATE_BLOCK ((size_t)16384) /* elements per task of a pass      */

/* The threads of a pass over n elements: the caller's alone for one
   block (waking a worker costs more), else up to one per block. */
static int gate_threads(size_t n)
{
    const size_t blocks = (n + GATE_BLOCK - 1) / GATE_BLOCK;
    const int nth = mha_get_num_threads();
    if (blocks <= 1 || nth <= 1)
        return 1;
    return (size_t)nth < blocks ? nth : (int)blocks;
}

#define MHA_TEMPLATE "gate_impl.h"
#include "each_type.h"
