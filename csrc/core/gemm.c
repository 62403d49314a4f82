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

/* Half weights packed into float32 panels (mha_pack_half): the panels of
   gemm_pack_all_f32 on the widened weight, each value widened as it is
   copied into its panel, so that no float32 copy of the weight is made
   (issue 36). A task is one K block of one column block of one weight;
   its panels are filled eight stored rows at a time, as gemm_pack_b_body
   fills them, each row's run of NR values widened by the ISA's row
   converter straight into the panel. Widening is exact, so the panels
   hold the very values gemm_pack_all_f32 packs from the widened weight. */
typedef struct {
    mha_packed *p;
    const uint16_t *const *w;
    const size_t *ldw;
    const mha_gemm_blocking *bk;
    void (*widen)(float *dst, const uint16_t *src, size_t n);
    size_t start[MHA_PACK_MAX + 1]; /* the first task of each weight */
} pack_half_job;

/* Tasks of one weight: (column blocks) x (K blocks). */
static size_t pack_half_tasks(const mha_gemm_blocking *bk, size_t K, size_t N)
{
    if (K == 0 || N == 0)
        return 0;
    size_t nkb;
    gemm_kc_balanced_f32(bk, K, &nkb);
    return (N + bk->nc - 1) / bk->nc * nkb;
}

static void pack_half_task(void *ctxp, size_t t, int ith)
{
    (void)ith;
    const pack_half_job *j = ctxp;
    size_t i = 0;
    while (t >= j->start[i + 1])
        i++;
    t -= j->start[i];
    const mha_gemm_blocking *bk = j->bk;
    const size_t K = j->p[i].K, N = j->p[i].N, NR = bk->nr, ldw = j->ldw[i];
    size_t nkb;
    const size_t kcb = gemm_kc_balanced_f32(bk, K, &nkb);
    const size_t jc = t / nkb * bk->nc, pc = t % nkb * kcb;
    const size_t nc = N - jc < bk->nc ? N - jc : bk->nc, np = (nc + NR - 1) / NR;
    const size_t kc = K - pc < kcb ? K - pc : kcb;
    // the block's np panels of (kc, NR), where gemm_pack_all_f32 puts them
    float *bp = (float *)j->p[i].data + jc * K + np * NR * pc;
    const uint16_t *w = j->w[i];
    for (size_t p0 = 0; p0 < kc; p0 += 8) {
        const size_t p1 = kc - p0 < 8 ? kc : p0 + 8;
        for (size_t jr = 0; jr < nc; jr += NR) {
            const size_t nr = nc - jr < NR ? nc - jr : NR;
            for (size_t p = p0; p < p1; p++) {
                float *dst = bp + jr * kc + p * NR;
                j->widen(dst, w + (pc + p) * ldw + jc + jr, nr);
                for (size_t c = nr; c < NR; c++)
                    dst[c] = 0.0f;
            }
        }
    }
}

mha_status mha_pack_half(mha_packed *p, const uint16_t *const *w, const size_t *ldw,
                         const size_t *K, const size_t *N, int n, mha_dtype dtype)
{
    const mha_isa isa = mha_get_isa();
    const mha_kernels *kern = mha_kernels_for(isa, 0);
    pack_half_job j = {p, w, ldw, &kern->gemm, NULL, {0}};
    j.widen = dtype == MHA_DTYPE_F16 ? kern->widen_f16 : kern->widen_bf16;
    mha_status st = MHA_OK;
    for (int i = 0; i < n; i++)
        p[i] = (mha_packed){.K = K[i], .N = N[i], .isa = (int)isa, .f64 = 0};
    if (n < 0 || n > MHA_PACK_MAX || (dtype != MHA_DTYPE_F16 && dtype != MHA_DTYPE_BF16))
        return MHA_ERR_ARG;
    for (int i = 0; i < n; i++) {
        j.start[i + 1] = j.start[i];
        if ((st = check_matrix(w[i], ldw[i], K[i], N[i], sizeof(uint16_t))) != MHA_OK)
            goto fail;
        if (K[i] == 0 || N[i] == 0)
            continue;
        const size_t elems = gemm_packed_elems_f32(j.bk, K[i], N[i]);
        if (elems == 0) {
            st = MHA_ERR_SIZE;
            goto fail;
        }
        void *panels = NULL;
        if ((st = mha_scratch(&panels, elems, sizeof(float))) != MHA_OK)
            goto fail;
        p[i].data = panels;
        p[i].elems = elems;
        j.start[i + 1] += pack_half_tasks(j.bk, K[i], N[i]);
    }
    if ((st = mha_parallel_for(j.start[n], pack_half_task, &j)) == MHA_OK)
        return MHA_OK;
fail:
    for (int i = 0; i < n; i++)
        mha_packed_free(&p[i]);
    return st;
}

mha_status mha_pack_weight(mha_packed *p, const void *w, size_t ldw, size_t K, size_t N,
                           mha_dtype dtype)
{
    if (p == NULL)
        return MHA_ERR_ARG;
    if (dtype == MHA_DTYPE_F16 || dtype == MHA_DTYPE_BF16) {
        const uint16_t *wh = w;
        return mha_pack_half(p, &wh, &ldw, &K, &N, 1, dtype);
    }
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
