/*
 * gemm.c - the packed, threaded GEMM (contract in gemm.h).
 *
 * The driver is one template, gemm_impl.h, instantiated below for float32
 * and float64. Micro-kernels, transposing packers and blocking come from the
 * kernel table of the ISA in force (kernels.h, kernels/gemm_ukr.inc).
 *
 * Blocking (Zen3-sized: 32 KiB L1d, 512 KiB L2 per core, large shared L3):
 *   KC x NR   B panel, stays in L1 while it meets every A panel of a block
 *   MC x KC   A block, stays in L2 while it meets every B panel
 *   KC x NC   B block, stays in L3, shared by all threads
 * Only KC changes results (it sets where partial sums are rounded into C);
 * the others and the thread split are free to tune.
 */
#include "gemm.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <xmmintrin.h> /* _mm_prefetch, SSE: baseline on x86-64 */
#endif

#include "alloc.h"
#include "dispatch.h"
#include "kernels.h"
#include "sizes.h"
#include "threads.h"

/* The packers' bodies, inlined into each of their callers. */
#if defined(__GNUC__)
#define MHA_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define MHA_INLINE __forceinline
#else
#define MHA_INLINE inline
#endif
#define MHA_ALIGN64 _Alignas(64)
/* A hint only: prefetching past the end of a row cannot fault. */
#if defined(__GNUC__)
#define MHA_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#define MHA_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define MHA_PREFETCH(p) ((void)0)
#endif
#define MHA_MAX_MR 6
#define MHA_MAX_NR 32

/* The only setting of this file (see mha_gemm_set_grain). */
static atomic_size_t g_grain = MHA_GEMM_GRAIN;

size_t mha_gemm_set_grain(size_t grain)
{
    return atomic_exchange(&g_grain, grain > 0 ? grain : MHA_GEMM_GRAIN);
}

/* Start of part b when `total` items are cut into `nparts` near-equal
   contiguous parts (b == nparts gives total). No product can overflow. */
static size_t part_start(size_t total, size_t nparts, size_t b)
{
    const size_t q = total / nparts, r = total % nparts;
    return b * q + (b < r ? b : r);
}

/* A matrix stored as (rows, cols) with row stride ld, in elements of
   `elem` bytes: non-NULL, ld >= cols, and its last element addressable. */
/* Row panels of MR rows that M rows of C take, the last maybe partial. */
static size_t gemm_row_panels(const mha_gemm_blocking *bk, size_t M)
{
    return M / bk->mr + (M % bk->mr != 0);
}

static mha_status check_matrix(const void *p, size_t ld, size_t rows,
                               size_t cols, size_t elem)
{
    if (rows == 0 || cols == 0)
        return MHA_OK;
    if (p == NULL || ld < cols)
        return MHA_ERR_ARG;
    size_t span, n;
    if (!mha_mul_ok(&span, rows - 1, ld) || !mha_add_ok(&n, span, cols) ||
        !mha_mul_ok(&n, n, elem))
        return MHA_ERR_SIZE;
    return MHA_OK;
}

static mha_status gemm_check(size_t elem, const void *C, size_t ldc,
                             const void *A, size_t lda, int transA,
                             const void *B, size_t ldb, int transB,
                             size_t M, size_t N, size_t K)
{
    mha_status st = check_matrix(C, ldc, M, N, elem);
    if (st == MHA_OK)
        st = transA ? check_matrix(A, lda, K, M, elem)
                    : check_matrix(A, lda, M, K, elem);
    if (st == MHA_OK)
        st = transB ? check_matrix(B, ldb, N, K, elem)
                    : check_matrix(B, ldb, K, N, elem);
    return st;
}

#define MHA_TEMPLATE "gemm_impl.h"
#include "each_type.h"

mha_status mha_pack_weight(mha_packed *p, const void *w, size_t ldw, size_t K, size_t N,
                           mha_dtype dtype)
{
    if (p == NULL)
        return MHA_ERR_ARG;
    if (dtype != MHA_DTYPE_F32 && dtype != MHA_DTYPE_F64) {
        *p = (mha_packed){0};
        return MHA_ERR_ARG;
    }
    return dtype == MHA_DTYPE_F64 ? mha_pack_weight_f64(p, w, ldw, K, N)
                                  : mha_pack_weight_f32(p, w, ldw, K, N);
}

void mha_packed_free(mha_packed *p)
{
    if (p == NULL)
        return;
    mha_scratch_free((void *)p->data);
    *p = (mha_packed){0};
}
