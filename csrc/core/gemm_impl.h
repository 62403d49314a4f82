/*
 * gemm_impl.h - template of the packed GEMM driver (gemm.h). Included once
 * per type by gemm.c with MHA_F64 defined (0 float, 1 double). No include
 * guard on purpose.
 *
 * Letters: M, N, K sizes of op(A) (M, K), op(B) (K, N), C (M, N);
 *   MR x NR register tile, MC x KC packed A block, KC x NC packed B block;
 *   a "panel" is an MR-row sliver of A or an NR-column sliver of B.
 *
 * Passes of one call:
 *   1. checks; M or N == 0 returns, K == 0 writes init (gemm.h);
 *   2. M*N*K < MHA_GEMM_SMALL: a plain loop, one thread;
 *   3. otherwise, for each NC column block jc, for each KC block pc in order:
 *      a. pack op(B)[pc, jc] into panels (parallel over panel ranges);
 *      b. for each tile (row block, column part) of C (parallel): pack that
 *         row block of op(A)[., pc], write init at the first K block, and run
 *         the micro-kernel over its NR x MR grid, B panel outer.
 *      With prepacked panels, or B read in place (gemm_in_place), or B
 *      packed panel by panel by the task that reads it (A of at most two
 *      row blocks: gemm_whole_rows), there is no pass a. and each tile runs
 *      b. for every K block in order, in one parallel region per column
 *      block.
 *   Either way every C element gets its K blocks one after another, always
 *   in the same order, from the same micro-kernel.
 */
#include "dtype.h"

/* The names this template defines, bound to this type (dtype.h). */
#define gemm_pack_rows PICK(gemm_pack_rows_f32, gemm_pack_rows_f64)
#define gemm_pack_a_body PICK(gemm_pack_a_body_f32, gemm_pack_a_body_f64)
#define gemm_pack_a PICK(gemm_pack_a_f32, gemm_pack_a_f64)
#define gemm_pack_b_body PICK(gemm_pack_b_body_f32, gemm_pack_b_body_f64)
#define gemm_pack_b PICK(gemm_pack_b_f32, gemm_pack_b_f64)
#define gemm_write_init PICK(gemm_write_init_f32, gemm_write_init_f64)
#define gemm_small_cols PICK(gemm_small_cols_f32, gemm_small_cols_f64)
#define gemm_small_row PICK(gemm_small_row_f32, gemm_small_row_f64)
#define gemm_small PICK(gemm_small_f32, gemm_small_f64)
#define gemm_kc_balanced PICK(gemm_kc_balanced_f32, gemm_kc_balanced_f64)
#define gemm_packed_elems PICK(gemm_packed_elems_f32, gemm_packed_elems_f64)
#define gemm_pack_all PICK(gemm_pack_all_f32, gemm_pack_all_f64)
#define mha_pack_weight PICK(mha_pack_weight_f32, mha_pack_weight_f64)
#define GEMM_CTX PICK(gemm_ctx_f32, gemm_ctx_f64)
#define gemm_task_pack_b PICK(gemm_task_pack_b_f32, gemm_task_pack_b_f64)
#define gemm_put_corner PICK(gemm_put_corner_f32, gemm_put_corner_f64)
#define gemm_tile_run PICK(gemm_tile_run_f32, gemm_tile_run_f64)
#define gemm_tile_a PICK(gemm_tile_a_f32, gemm_tile_a_f64)
#define gemm_tile PICK(gemm_tile_f32, gemm_tile_f64)
#define gemm_task_compute PICK(gemm_task_compute_f32, gemm_task_compute_f64)
#define gemm_b_block PICK(gemm_b_block_f32, gemm_b_block_f64)
#define gemm_task_compute_all PICK(gemm_task_compute_all_f32, gemm_task_compute_all_f64)
#define gemm_usable PICK(gemm_usable_f32, gemm_usable_f64)
#define gemm_in_place PICK(gemm_in_place_f32, gemm_in_place_f64)
#define gemm_whole_rows PICK(gemm_whole_rows_f32, gemm_whole_rows_f64)
#define gemm_thread_scratch PICK(gemm_thread_scratch_f32, gemm_thread_scratch_f64)
#define gemm_split PICK(gemm_split_f32, gemm_split_f64)
#define mha_gemm_packed PICK(mha_gemm_packed_f32, mha_gemm_packed_f64)
#define mha_gemm PICK(mha_gemm_f32, mha_gemm_f64)
#define GEMM_MULTI_CTX PICK(gemm_multi_ctx_f32, gemm_multi_ctx_f64)
#define gemm_task_span PICK(gemm_task_span_f32, gemm_task_span_f64)
#define gemm_task_multi PICK(gemm_task_multi_f32, gemm_task_multi_f64)
#define mha_gemm_packed_multi PICK(mha_gemm_packed_multi_f32, mha_gemm_packed_multi_f64)

/* 2. Packing. transA / transB are handled here and nowhere else.
   Stored rows are always walked along their length: short pieces of many
   rows of a large power-of-two stride alias in L1 and starve the hardware
   prefetcher, hence also the explicit prefetches of the next rows. */

/* dst: panels of (kc, W), each W stored rows of S (row stride ld) copied
   transposed: rows r0 .. r0+n-1, columns k0 .. k0+kc-1 of S; the last,
   partial panel goes one by one, zero past n. op(A) without transA (W =
   MR) and op(B) with transB (W = NR) are both packed so; W is a constant
   at each call site. */
static MHA_INLINE void gemm_pack_rows(REAL *dst, const mha_gemm_blocking *bk, const REAL *S,
                                      size_t ld, size_t r0, size_t n, size_t k0, size_t kc,
                                      const size_t W)
{
    for (size_t ir = 0; ir < n; ir += W) {
        const size_t w = n - ir < W ? n - ir : W;
        REAL *d_i = dst + ir * kc; /* (kc, W) */
        const REAL *s_i = S + (r0 + ir) * ld + k0;
        /* prefetch the next panel if it is full, else this one */
        const REAL *s_next = ir + 2 * W <= n ? s_i + W * ld : s_i;
        if (w == W) {
            for (size_t r = 0; r < W; r += bk->tpr) {
                const size_t nr = W - r < bk->tpr ? W - r : bk->tpr;
                bk->tpack(d_i + r, W, s_i + r * ld, ld, nr, kc, s_next + r * ld);
            }
        } else {
            for (size_t p = 0; p < kc; p++)
                for (size_t r = 0; r < W; r++)
                    d_i[p * W + r] = r < w ? s_i[r * ld + p] : (REAL)0;
        }
    }
}

/* ap: panels of (kc, MR), rows i0 .. i0+mc-1 and columns k0 .. k0+kc-1 of
   op(A); rows past mc are zero. MR is a constant at each call site. */
static MHA_INLINE void gemm_pack_a_body(REAL *ap, const mha_gemm_blocking *bk, const REAL *A,
                                        size_t lda, int transA, size_t i0, size_t mc, size_t k0,
                                        size_t kc, const size_t MR)
{
    if (!transA) {
        /* op(A)(i, k) = A[i*lda + k]: a panel is MR stored rows */
        gemm_pack_rows(ap, bk, A, lda, i0, mc, k0, kc, MR);
    } else {
        /* op(A)(i, k) = A[k*lda + i]: stored row k holds every i, so walk
           it once and deal MR values to each panel */
        for (size_t p = 0; p < kc; p++) {
            const REAL *src = A + (k0 + p) * lda + i0;
            if (p + 4 < kc) /* a few rows ahead, as rows are short */
                for (size_t l = 0; l < mc; l += 64 / sizeof(REAL))
                    MHA_PREFETCH(src + 4 * lda + l);
            for (size_t ir = 0; ir < mc; ir += MR) {
                const size_t mr = mc - ir < MR ? mc - ir : MR;
                REAL *dst = ap + ir * kc + p * MR;
                if (mr == MR)
                    for (size_t r = 0; r < MR; r++)
                        dst[r] = src[ir + r];
                else
                    for (size_t r = 0; r < MR; r++)
                        dst[r] = r < mr ? src[ir + r] : (REAL)0;
            }
        }
    }
}

static void gemm_pack_a(REAL *ap, const mha_gemm_blocking *bk, const REAL *A, size_t lda,
                        int transA, size_t i0, size_t mc, size_t k0, size_t kc)
{
    if (bk->mr == 6)
        gemm_pack_a_body(ap, bk, A, lda, transA, i0, mc, k0, kc, 6);
    else if (bk->mr == 4)
        gemm_pack_a_body(ap, bk, A, lda, transA, i0, mc, k0, kc, 4);
    else
        gemm_pack_a_body(ap, bk, A, lda, transA, i0, mc, k0, kc, bk->mr);
}

/* bp: panels of (kc, NR), columns j0 .. j0+nc-1 and rows k0 .. k0+kc-1 of
   op(B); columns past nc are zero. */
static MHA_INLINE void gemm_pack_b_body(REAL *bp, const mha_gemm_blocking *bk, const REAL *B,
                                        size_t ldb, int transB, size_t k0, size_t kc, size_t j0,
                                        size_t nc, const size_t NR)
{
    if (!transB) {
        /* op(B)(k, j) = B[k*ldb + j]: stored row k holds every j. Eight
           rows at a time, panel by panel: each panel gets its eight rows
           as one contiguous run, and the eight stored rows, each walked
           along its length, stay in L1 across the panels. (Row by row,
           each row's pieces went to every panel at once: nc / NR write
           streams kc NR elements apart, which alias in L1. Zen 3, 256 x
           512 float blocks of four 512 x 512 weights, best of 200: 81.7
           us per MiB row by row, 29.8 in groups of eight.) */
        for (size_t p0 = 0; p0 < kc; p0 += 8) {
            const size_t p1 = kc - p0 < 8 ? kc : p0 + 8;
            for (size_t jr = 0; jr < nc; jr += NR) {
                const size_t nr = nc - jr < NR ? nc - jr : NR;
                for (size_t p = p0; p < p1; p++) {
                    const REAL *src = B + (k0 + p) * ldb + j0 + jr;
                    REAL *dst = bp + jr * kc + p * NR;
                    if (nr == NR) /* NR is a constant: a few vector moves */
                        memcpy(dst, src, NR * sizeof(REAL));
                    else
                        for (size_t j = 0; j < NR; j++)
                            dst[j] = j < nr ? src[j] : (REAL)0;
                }
            }
        }
    } else {
        /* op(B)(k, j) = B[j*ldb + k]: a panel is NR stored rows */
        gemm_pack_rows(bp, bk, B, ldb, j0, nc, k0, kc, NR);
    }
}

static void gemm_pack_b(REAL *bp, const mha_gemm_blocking *bk, const REAL *B, size_t ldb,
                        int transB, size_t k0, size_t kc, size_t j0, size_t nc)
{
    switch (bk->nr) {
    case 4: gemm_pack_b_body(bp, bk, B, ldb, transB, k0, kc, j0, nc, 4); break;
    case 8: gemm_pack_b_body(bp, bk, B, ldb, transB, k0, kc, j0, nc, 8); break;
    case 16: gemm_pack_b_body(bp, bk, B, ldb, transB, k0, kc, j0, nc, 16); break;
    case 32: gemm_pack_b_body(bp, bk, B, ldb, transB, k0, kc, j0, nc, 32); break;
    default: gemm_pack_b_body(bp, bk, B, ldb, transB, k0, kc, j0, nc, bk->nr); break;
    }
}

/* 3. init = (accumulate ? C : 0) + bias over rows i0..i1-1, columns
   j0..j1-1 of C; only called with bias != NULL, or for K == 0. */
static void gemm_write_init(REAL *C, size_t ldc, const REAL *bias, int accumulate, size_t i0,
                            size_t i1, size_t j0, size_t j1)
{
    for (size_t i = i0; i < i1; i++) {
        REAL *c_i = C + i * ldc;
        for (size_t j = j0; j < j1; j++) {
            if (bias != NULL)
                c_i[j] = accumulate ? c_i[j] + bias[j] : bias[j];
            else if (!accumulate)
                c_i[j] = 0;
        }
    }
}

/* 4. Small problems: a plain loop, one thread. Each C element is still
   init + (sum over k in increasing order, from zero), unfused.

   W columns of one row of C at a time, W a constant at each call site, so
   the W running sums live in registers across k. (One loop over a row's
   columns at a time kept them in memory and spent ~210 instructions on a
   row of 4 columns and 4 k: 15% of a (8, 3, 4) layer call.) */
static MHA_INLINE void gemm_small_cols(REAL *c, const REAL *a_i, size_t sa_k, const REAL *b,
                                       size_t sb_k, size_t sb_j, const REAL *bias, int accumulate,
                                       size_t K, const size_t W)
{
    REAL acc[16]; /* W <= 16 */
    for (size_t u = 0; u < W; u++)
        acc[u] = 0;
    for (size_t k = 0; k < K; k++) {
        const REAL a_ik = a_i[k * sa_k];
        const REAL *b_k = b + k * sb_k;
        for (size_t u = 0; u < W; u++)
            acc[u] += a_ik * b_k[u * sb_j];
    }
    for (size_t u = 0; u < W; u++) {
        if (bias != NULL)
            c[u] = (accumulate ? c[u] + bias[u] : bias[u]) + acc[u];
        else
            c[u] = accumulate ? c[u] + acc[u] : acc[u];
    }
}

/* One row of C; sb_j is 1 (a literal, so the W columns are one vector
   load) or B's stride (transB). */
static MHA_INLINE void gemm_small_row(REAL *c_i, const REAL *a_i, size_t sa_k, const REAL *B,
                                      size_t sb_k, size_t sb_j, const REAL *bias, int accumulate,
                                      size_t N, size_t K)
{
    const size_t WIDE = MHA_F64 ? 8 : 16; /* a few vector registers of sums */
    size_t j = 0;
    for (; j + WIDE <= N; j += WIDE)
        gemm_small_cols(c_i + j, a_i, sa_k, B + j * sb_j, sb_k, sb_j,
                        bias != NULL ? bias + j : NULL, accumulate, K, WIDE);
    for (; j + 4 <= N; j += 4)
        gemm_small_cols(c_i + j, a_i, sa_k, B + j * sb_j, sb_k, sb_j,
                        bias != NULL ? bias + j : NULL, accumulate, K, 4);
    for (; j < N; j++)
        gemm_small_cols(c_i + j, a_i, sa_k, B + j * sb_j, sb_k, sb_j,
                        bias != NULL ? bias + j : NULL, accumulate, K, 1);
}

static void gemm_small(REAL *C, size_t ldc, const REAL *A, size_t lda, int transA, const REAL *B,
                       size_t ldb, int transB, const REAL *bias, size_t M, size_t N, size_t K,
                       int accumulate)
{
    /* op(A)(i, k) = A[i sa_i + k sa_k]; op(B)(k, j) = B[k sb_k + j sb_j] */
    const size_t sa_i = transA ? 1 : lda, sa_k = transA ? lda : 1;
    for (size_t i = 0; i < M; i++) {
        if (!transB)
            gemm_small_row(C + i * ldc, A + i * sa_i, sa_k, B, ldb, 1, bias, accumulate, N, K);
        else
            gemm_small_row(C + i * ldc, A + i * sa_i, sa_k, B, 1, ldb, bias, accumulate, N, K);
    }
}

/* 5. Prepacked B (mha_pack_weight, mha.h): op(B) (K, N) packed once, as
   the loop of section 7 packs it on every call. Column block jc (bk->nc
   wide, the last one narrower) holds, for each K block in order, its np
   panels of (kc, NR); as bk->nc is a multiple of NR, block jc starts at
   element jc K, and its K block starting at row pc at jc K + np NR pc.
   The K blocks are the GEMM's (they depend on K and the ISA only), so a
   packed call multiplies the very panels an unpacked one would. */
static size_t gemm_kc_balanced(const mha_gemm_blocking *bk, size_t K, size_t *nkb)
{
    *nkb = (K + bk->kc - 1) / bk->kc;
    return (K + *nkb - 1) / *nkb; /* balanced K blocks */
}

/* Elements of the packed form of a (K, N) op(B); 0 when that overflows. */
static size_t gemm_packed_elems(const mha_gemm_blocking *bk, size_t K, size_t N)
{
    const size_t NR = bk->nr, last = N % bk->nc;
    const size_t padded = N - last + (last + NR - 1) / NR * NR; /* sum of np NR */
    size_t n;
    if (padded < N || !mha_mul_ok(&n, padded, K))
        return 0;
    return n;
}

/* Fills dst (gemm_packed_elems) from B (K, N) of row stride ldb. */
static void gemm_pack_all(REAL *dst, const mha_gemm_blocking *bk, const REAL *B, size_t ldb,
                          size_t K, size_t N)
{
    size_t nkb;
    const size_t kcb = gemm_kc_balanced(bk, K, &nkb);
    for (size_t jc = 0; jc < N; jc += bk->nc) {
        const size_t nc = N - jc < bk->nc ? N - jc : bk->nc;
        const size_t np = (nc + bk->nr - 1) / bk->nr;
        for (size_t pc = 0; pc < K; pc += kcb) {
            const size_t kc = K - pc < kcb ? K - pc : kcb;
            gemm_pack_b(dst + jc * K + np * bk->nr * pc, bk, B, ldb, 0, pc, kc, jc, nc);
        }
    }
}

/* mha_pack_weight (gemm.c) for one element type. */
static mha_status mha_pack_weight(mha_packed *p, const REAL *w, size_t ldw, size_t K,
                                  size_t N)
{
    *p = (mha_packed){.K = K, .N = N, .isa = (int)mha_get_isa(), .f64 = MHA_F64};
    mha_status st = check_matrix(w, ldw, K, N, sizeof(REAL));
    if (st != MHA_OK || K == 0 || N == 0)
        return st;
    const mha_gemm_blocking *bk = &mha_kernels_for((mha_isa)p->isa, MHA_F64)->gemm;
    const size_t n = gemm_packed_elems(bk, K, N);
    if (n == 0)
        return MHA_ERR_SIZE;
    REAL *dst = NULL;
    if ((st = mha_scratch((void **)&dst, n, sizeof(REAL))) != MHA_OK)
        return st;
    gemm_pack_all(dst, bk, w, ldw, K, N);
    p->data = dst;
    p->elems = n;
    return MHA_OK;
}

/* 6. The parallel passes. */
typedef struct {
    REAL *C;
    size_t ldc;
    const REAL *A;
    size_t lda;
    int transA;
    const REAL *B;
    size_t ldb;
    int transB;
    const REAL *bias;
    int accumulate;
    size_t M;
    const mha_gemm_blocking *bk;
    REAL *bp;         /* (np panels of (kc, nr)) packed B block          */
    const REAL *bpr;  /* the block the compute tasks read: bp, or a
                         prepacked B's (section 5)                        */
    const REAL *packed; /* a prepacked B (section 5), or NULL             */
    int direct;       /* B read in place by the micro-kernel (no pack-B
                         pass): its row stride ldb, all of K in one task   */
    int own;          /* B packed by the task that reads it, own_np
                         panels at a time (gemm_whole_rows): all rows in
                         one task, the columns split, all of K in one task */
    size_t K, kcb;    /* all of K, and its (balanced) block               */
    REAL *ap;         /* (nth, ap_stride) per-thread packed A blocks      */
    size_t ap_stride; /* elements, a multiple of a cache line             */
    size_t be_off;    /* direct: the thread's (kc, NR) edge panel, at this
                         offset into its A slice; own: its own_np panels  */
    size_t own_np;    /* own: B panels packed at a time                   */
    size_t jc, nc;    /* column block: columns jc .. jc+nc-1               */
    size_t pc, kc;    /* K block: k = pc .. pc+kc-1                        */
    int first;        /* pc == 0                                           */
    size_t mp, nmb;   /* row panels of C; row blocks (tasks along M)      */
    size_t np, nnb;   /* column panels of the block; column parts         */
    size_t nbt;       /* pack-B tasks                                     */
} GEMM_CTX;

/* Pack-B task t: panels [q0, q1) of the current B block. */
static void gemm_task_pack_b(void *ctxp, size_t t, int ith)
{
    const GEMM_CTX *x = ctxp;
    (void)ith;
    const size_t nr = x->bk->nr;
    const size_t q0 = part_start(x->np, x->nbt, t);
    const size_t q1 = part_start(x->np, x->nbt, t + 1);
    if (q0 >= q1)
        return;
    const size_t j0 = q0 * nr;
    const size_t j1 = q1 * nr < x->nc ? q1 * nr : x->nc;
    gemm_pack_b(x->bp + j0 * x->kc, x->bk, x->B, x->ldb, x->transB, x->pc, x->kc, x->jc + j0,
                j1 - j0);
}

/* The valid corner (mr, nr) of an edge tile computed whole into tmp (row
   stride NR): added to C (row stride ldc) or stored over it. */
static void gemm_put_corner(REAL *c, size_t ldc, const REAL *tmp, size_t NR, size_t mr, size_t nr,
                            int add)
{
    for (size_t r = 0; r < mr; r++)
        for (size_t j = 0; j < nr; j++)
            c[r * ldc + j] = add ? c[r * ldc + j] + tmp[r * NR + j] : tmp[r * NR + j];
}

/* The tile of row panels p0 .. p1-1 and column panels q0 .. q1-1 over K
   block pc .. pc+kc-1, with that K block of A's rows packed at ap (this
   thread's, see gemm_tile). B panel q is the (kc, NR) at bpr + q bq, row
   stride bld: packed (bld = NR), or B in place (x->direct), whose last,
   partial panel is packed here into the thread's edge panel, or packed
   there whole (x->own), own_np panels at a time. */
static void gemm_tile_run(const GEMM_CTX *x, REAL *ap, size_t p0, size_t p1, size_t q0, size_t q1,
                          size_t pc, size_t kc, int first, const REAL *bpr, size_t bq, size_t bld)
{
    const mha_gemm_blocking *bk = x->bk;
    const size_t MR = bk->mr, NR = bk->nr;
    const size_t i0 = p0 * MR, i1 = p1 * MR < x->M ? p1 * MR : x->M;
    const size_t jj0 = q0 * NR, jj1 = q1 * NR < x->nc ? q1 * NR : x->nc;
    if (first && x->bias != NULL)
        gemm_write_init(x->C, x->ldc, x->bias, x->accumulate, i0, i1, x->jc + jj0, x->jc + jj1);
    const int add = !first || x->bias != NULL || x->accumulate;

    /* A last row panel of at most two rows (a decode step's one row) goes
       row by row through bk->row when B is read in place: the micro-kernel
       would compute all MR rows of it. */
    const size_t m_last = x->M - (p1 - 1) * MR < MR ? x->M - (p1 - 1) * MR : MR;
    const int by_row = x->direct && m_last < MR && m_last <= 2;
    size_t pu1 = by_row ? p1 - 1 : p1; /* the row panels ukr takes */
    /* Otherwise a last panel of at most four rows goes through bk->ukr4,
       four rows a tile, and with one or two rows, so does the full panel
       before it (6 + 2 rows as 4 + 4): 4 and 8 rows computed where ukr
       would compute 6 and 12. Rows tail0 .. M - 1. */
    size_t tail0 = x->M;
    if (!by_row && bk->ukr4 != NULL && m_last <= 4 && m_last < MR) {
        pu1 = m_last <= 2 && p1 - 1 > p0 ? p1 - 2 : p1 - 1;
        tail0 = pu1 * MR;
    }

    MHA_ALIGN64 REAL tmp[MHA_MAX_MR * MHA_MAX_NR]; /* (MR, NR) edge tile */
    for (size_t q = q0; q < q1; q++) {
        const REAL *bp_q = bpr + q * bq;                       /* (kc, NR) */
        size_t ld_q = bld;
        const size_t nr = x->nc - q * NR < NR ? x->nc - q * NR : NR;
        if (x->own) {
            /* own_np panels packed at once: each stored row of B gives a
               run of own_np NR elements, where a panel alone took one
               cache line from each row, ldb apart. Zen 3, AVX2, 128 x 512
               @ 512 x 512 float, B as is, one thread (`test_gemm time`,
               median of 5 alternating rounds' medians): 1124 -> 1024 us
               with B in L3, 1227 -> 1011 us with B evicted (prepacked:
               ~930 us). In the layer at T = 128 unpacked, 2 threads, the
               packing's share of perf samples: 14.1-14.7% -> 10.8-13.0%. */
            const size_t qc = (q - q0) % x->own_np;
            if (qc == 0) {
                const size_t np = q1 - q < x->own_np ? q1 - q : x->own_np;
                const size_t cols = x->nc - q * NR < np * NR ? x->nc - q * NR : np * NR;
                gemm_pack_b(ap + x->be_off, bk, x->B, x->ldb, x->transB, pc, kc, x->jc + q * NR,
                            cols);
            }
            bp_q = ap + x->be_off + qc * NR * kc;
            ld_q = NR;
        } else if (x->direct && nr < NR) {
            REAL *be = ap + x->be_off;
            gemm_pack_b(be, bk, x->B, x->ldb, x->transB, pc, kc, x->jc + q * NR, nr);
            bp_q = be;
            ld_q = NR;
        }
        for (size_t p = p0; p < pu1; p++) {
            const REAL *ap_p = ap + (p - p0) * MR * kc;        /* (kc, MR) */
            const size_t mr = x->M - p * MR < MR ? x->M - p * MR : MR;
            REAL *c_pq = x->C + p * MR * x->ldc + x->jc + q * NR;
            if (mr == MR && nr == NR) {
                bk->ukr(kc, ap_p, bp_q, ld_q, c_pq, x->ldc, add);
            } else {
                /* leftovers: full tile into tmp, then the valid corner */
                bk->ukr(kc, ap_p, bp_q, ld_q, tmp, NR, 0);
                gemm_put_corner(c_pq, x->ldc, tmp, NR, mr, nr, add);
            }
        }
        for (size_t i = tail0; i < x->M; i += 4) {
            /* row i + r of A is row (i + r) % MR of its packed panel; the
               rows past M repeat row i, into tmp and not read out */
            const void *a4[4];
            for (size_t r = 0; r < 4; r++) {
                const size_t ir = i + r < x->M ? i + r : i;
                a4[r] = ap + (ir / MR - p0) * MR * kc + ir % MR;
            }
            const size_t mr = x->M - i < 4 ? x->M - i : 4;
            REAL *c_iq = x->C + i * x->ldc + x->jc + q * NR;
            if (mr == 4 && nr == NR) {
                bk->ukr4(kc, a4, bp_q, ld_q, c_iq, x->ldc, add);
            } else {
                bk->ukr4(kc, a4, bp_q, ld_q, tmp, NR, 0);
                gemm_put_corner(c_iq, x->ldc, tmp, NR, mr, nr, add);
            }
        }
    }
    if (!by_row)
        return;
    const REAL *ap_l = ap + (pu1 - p0) * MR * kc;              /* (kc, MR) */
    const size_t qf = x->nc / NR < q1 ? x->nc / NR : q1;       /* full panels */
    for (size_t r = 0; r < m_last; r++) {
        REAL *c_r = x->C + (pu1 * MR + r) * x->ldc + x->jc;
        for (size_t q = q0; q < qf; q += 4)
            bk->row(kc, ap_l + r, bpr + q * bq, bld, qf - q < 4 ? qf - q : 4, c_r + q * NR,
                    add);
        if (qf < q1) {
            /* the partial last panel, packed into the edge panel above */
            const size_t nr = x->nc - qf * NR;
            bk->row(kc, ap_l + r, ap + x->be_off, NR, 1, tmp, 0);
            gemm_put_corner(c_r + qf * NR, x->ldc, tmp, NR, 1, nr, add);
        }
    }
}

/* Packs row panels p0 .. p1-1 of A's K block pc .. pc+kc-1 into this
   thread's slice; returns it. */
static REAL *gemm_tile_a(const GEMM_CTX *x, int ith, size_t p0, size_t p1, size_t pc, size_t kc)
{
    const size_t MR = x->bk->mr, i0 = p0 * MR, i1 = p1 * MR < x->M ? p1 * MR : x->M;
    REAL *ap = x->ap + (size_t)ith * x->ap_stride; /* (p1 - p0) panels of (kc, MR) */
    gemm_pack_a(ap, x->bk, x->A, x->lda, x->transA, i0, i1 - i0, pc, kc);
    return ap;
}

/* Task t's tile, row block t / nnb and column part t % nnb, over one K
   block. It alone writes that tile of C during this K block. */
static void gemm_tile(const GEMM_CTX *x, size_t t, int ith, size_t pc, size_t kc, int first,
                      const REAL *bpr, size_t bq, size_t bld)
{
    const size_t mb = t / x->nnb, nb = t % x->nnb;
    const size_t p0 = part_start(x->mp, x->nmb, mb);
    const size_t p1 = part_start(x->mp, x->nmb, mb + 1);
    const size_t q0 = part_start(x->np, x->nnb, nb);
    const size_t q1 = part_start(x->np, x->nnb, nb + 1);
    if (p0 >= p1 || q0 >= q1)
        return;
    REAL *ap = gemm_tile_a(x, ith, p0, p1, pc, kc);
    gemm_tile_run(x, ap, p0, p1, q0, q1, pc, kc, first, bpr, bq, bld);
}

/* Compute task t of one K block: the tile over the packed B block bpr. */
static void gemm_task_compute(void *ctxp, size_t t, int ith)
{
    const GEMM_CTX *x = ctxp;
    gemm_tile(x, t, ith, x->pc, x->kc, x->first, x->bpr, x->bk->nr * x->kc, x->bk->nr);
}

/* K block pc .. pc+kc-1 of B for gemm_tile_run, when it is not packed by
   blocks: prepacked panels, or B's own rows (read in place, or packed
   panel by panel). */
static const REAL *gemm_b_block(const GEMM_CTX *x, size_t pc, size_t kc, size_t *bq, size_t *bld)
{
    const size_t NR = x->bk->nr;
    if (x->packed != NULL) {
        *bq = NR * kc;
        *bld = NR;
        return x->packed + x->jc * x->K + x->np * NR * pc;
    }
    *bq = NR;
    *bld = x->ldb;
    return x->B + pc * x->ldb + x->jc;
}

/* Compute task t over a prepacked B, or B in place, or B packed panel by
   panel (x->own): every K block in order, in one task, so the whole column
   block is one pool phase (nothing is shared between the K blocks to wait
   for). Each element still gets its K blocks one after another, as gemm.h
   says. */
static void gemm_task_compute_all(void *ctxp, size_t t, int ith)
{
    const GEMM_CTX *x = ctxp;
    for (size_t pc = 0; pc < x->K; pc += x->kcb) {
        const size_t kc = x->K - pc < x->kcb ? x->K - pc : x->kcb;
        size_t bq, bld;
        const REAL *bpr = gemm_b_block(x, pc, kc, &bq, &bld);
        gemm_tile(x, t, ith, pc, kc, pc == 0, bpr, bq, bld);
    }
}

/* The panels of pb when it was packed from this (K, N) op(B) for the ISA
   in force and this type; NULL for any other, which is ignored (B is then
   used as if none had been given: the same bits). */
static const REAL *gemm_usable(const mha_gemm_blocking *bk, const mha_packed *pb, int transB,
                               size_t K, size_t N)
{
    if (pb != NULL && pb->data != NULL && !transB && pb->K == K && pb->N == N &&
        pb->f64 == MHA_F64 && pb->isa == (int)mha_get_isa() &&
        pb->elems == gemm_packed_elems(bk, K, N))
        return pb->data;
    return NULL;
}

/* Whether B, without usable panels, is read in place by the micro-kernel
   (the same multiply-adds as from packed panels, so the same bits), rather
   than packed per K block. Never when it is transposed. In place there is
   no pack-B pass and each column block is one pool phase, as with
   prepacked panels, but each B panel is read again for every row panel of
   a tile, from rows ldb apart: when that stride has a large power-of-two
   factor those rows alias in L1 and, with a small L2, in L2 too, so the
   panel is fetched from further out each time. Hence the rule depends on
   the stride and on the L2 (mha_l2_bytes); only speed depends on it.
   - L2 of 1 MiB or more, or not known: at most two row blocks of A (one
     for double). Measured, one thread of a Zen 4 (1 MiB L2), median of 7:
     M = 128, N = K = 512 at 75-78% of the FMA peak in place against 66-71%
     packed; M = N = K = 1024 at 71-73% against 83-90%. Double, two threads,
     K = 512, best of 9 x 2000 calls, GFLOP/s packed per call / in place:
     AVX-512, N = 1536, M = 48 61.6 / 75.5, M = 72 69.6 / 73.5, M = 96
     78.1 / 73.9, M = 128 71.9 / 60.5 (N = 512: 78.8 / 74.7); AVX2, N =
     1536, M = 96 64.2 / 46.7, M = 128 70.9 / 46.4. (Float, M = 128: 141 /
     190 on AVX-512, N = 512, and 130 / 125-136 on AVX2.)
   - a smaller L2 (Zen 3: 512 KiB): a stride whose power-of-two factor is
     4 KiB or more puts every row of a panel in one L1 set; then at most
     one row panel (two for float). Otherwise at most M rows with M times
     the stride in bytes within L2 / 3 for float and L2 / 9 for double
     (Zen 3: 170 KiB and 57 KiB, that is float N = 512 up to M = 85, N =
     1536 up to 28). Fitted to the crossovers measured on a Zen 3, AVX2,
     two threads, K = 512, best of 60 calls each way, M from 6 to 288
     (the first M where packing per call won; noisy, as L2 sets follow
     physical pages): float N = 256 ~192, 512 ~72, 768 ~60, 1024 12-24,
     1536 ~36, 2048 24; double N = 256 ~36, 512 24, 768 12, 1024 and up
     12. (Float M = 12 at N = 768 and 1536, two row panels whose columns
     the threads split, ran 0.74-0.87x as fast in place as packed; the
     rule leaves them in place.) Layers of d_model 512, h 8, B = 1, float,
     median of 5-7 alternating rounds, against reading B in place: T = 128
     5% faster, causal 8%, T = 256 11%; double T = 64 1.8x. */
static int gemm_in_place(const mha_gemm_blocking *bk, size_t M, int transB, size_t ldb)
{
    if (transB)
        return 0;
    const size_t big = (MHA_F64 ? 1 : 2) * bk->mcp * bk->mr, l2 = mha_l2_bytes();
    if (l2 == 0 || l2 >= ((size_t)1 << 20))
        return M <= big;
    const size_t stride = ldb * sizeof(REAL);
    if ((stride & (~stride + 1)) >= 4096)
        return M <= (MHA_F64 ? 1 : 2) * bk->mr;
    size_t span;
    return M <= big && mha_mul_ok(&span, M, stride) && span <= l2 / (MHA_F64 ? 9 : 3);
}

/* Whether each task takes every row of C and a part of its columns (one
   row block): when A has at most two row blocks and B is not read in
   place. A task then packs all of A's K block, once, and reads only its
   own B panels, where with two row blocks every thread read all of B.
   - With prepacked panels: half of B's traffic per thread on two threads.
   - Without: B is packed by the task that reads it (x->own), a few
     panels at a time (gemm_thread_scratch), just before the micro-kernel
     reads them from L2: every B panel packed once, and the call one pool
     phase per column block where packing B by blocks took two per K
     block, each thread waiting for the other's packing. The panels are
     the ones the block pass packs, so the bits are the same.
   Zen 3, AVX2, 2 threads, layers of d_model 512, h 8, B = 1, median of 5
   alternating rounds against two row blocks: float T = 128 1.960 -> 1.857
   ms unpacked, 1.777 -> 1.738 packed; T = 64 packed 0.858 -> 0.816;
   double T = 128 packed 3.740 -> 3.654, unpacked 4.030 -> 4.109 (noisy);
   the backward of x (1, 128, 512), float, 8.77 -> 5.97 ms (of x (128,
   512) unchanged), double (1, 64, 512) 6.90 -> 6.62. B = 8 and T = 1024
   (more rows) are unchanged. All with warm caches: with the caches
   evicted before each call, the packed T = 128 call measured 0-9% slower
   in most rounds (noisy; each thread now streams its own half of B from
   DRAM). */
static int gemm_whole_rows(const mha_gemm_blocking *bk, size_t M)
{
    return gemm_row_panels(bk, M) <= 2 * bk->mcp;
}

/* Sizes each thread's slice of a call's scratch: a packed A block of
   mcp_max panels of (kcb, MR), then, when `own`, the x->own_np panels of
   (kcb, NR) that a task packs B into (about GEMM_OWN_BYTES: with the A
   block of two row blocks, 288 x 256 float, within a 512 KiB L2), or,
   when `edge`, the one panel that B read in place packs for its partial
   last panel, each starting on a cache line. Sets x->own_np,
   x->ap_stride and x->be_off and *all = nth slices; returns 0 when a size
   overflows. */
#define GEMM_OWN_BYTES ((size_t)128 << 10)
static int gemm_thread_scratch(GEMM_CTX *x, size_t mcp_max, size_t kcb, int own, int edge, int nth,
                               size_t *all)
{
    const size_t line = 64 / sizeof(REAL);
    const size_t panel = kcb * x->bk->nr * sizeof(REAL); /* kcb <= KC: no overflow */
    x->own_np = own && panel > 0 && panel < GEMM_OWN_BYTES ? GEMM_OWN_BYTES / panel : 1;
    size_t ap_elems, be_elems = 0;
    if (!mha_mul_ok(&ap_elems, mcp_max * x->bk->mr, kcb) ||
        ((own || edge) && !mha_mul_ok(&be_elems, kcb, x->own_np * x->bk->nr)))
        return 0;
    x->be_off = (ap_elems + line - 1) / line * line;
    x->ap_stride = x->be_off + (be_elems + line - 1) / line * line;
    return x->ap_stride >= x->be_off && mha_mul_ok(all, x->ap_stride, (size_t)nth);
}

#define ROWS_BOUND 32
/* The thread count and row blocks of `work` multiply-adds over M rows.
   Threads: none inside another parallel task (it would run inline anyway),
   and none beyond one per `grain` multiply-adds: waking a sleeping worker
   costs tens of microseconds. Only speed depends on this, never bits. */
static void gemm_split(const mha_gemm_blocking *bk, size_t M, size_t work, int *nth_out,
                       size_t *mp_out, size_t *nmb_out)
{
    int nth = mha_in_parallel() ? 1 : mha_get_num_threads();
    const size_t grain = atomic_load_explicit(&g_grain, memory_order_relaxed);
    /* With few rows the time is reading B, not multiply-adding: count each
       B element as ROWS_BOUND rows' work, so that a decode step's B of a
       few MiB is read with both threads' share of the bandwidth (its Q, K
       and V projections, one row, d_model 512, Zen 4: 135-170 us a call on
       one thread, 115-130 on two). */
    if (M != 0 && M < ROWS_BOUND)
        work = work / M * ROWS_BOUND;
    if ((size_t)nth > work / grain)
        nth = work / grain > 1 ? (int)(work / grain) : 1;
    const size_t mp = gemm_row_panels(bk, M);
    size_t nmb = (mp + bk->mcp - 1) / bk->mcp;
    if (nth > 1 && (nmb >= (size_t)nth || mp >= 4 * (size_t)nth)) {
        /* a multiple of nth row blocks of near-equal size */
        nmb = (nmb + (size_t)nth - 1) / (size_t)nth * (size_t)nth;
        if (nmb > mp)
            nmb = mp;
    }
    *nth_out = nth;
    *mp_out = mp;
    *nmb_out = nmb;
}

mha_status mha_gemm_packed(REAL *C, size_t ldc, const REAL *A, size_t lda, int transA,
                           const REAL *B, size_t ldb, int transB, const mha_packed *pb,
                           const REAL *bias, size_t M, size_t N, size_t K, int accumulate)
{
    /* C: (M, N) row stride ldc; op(A): (M, K); op(B): (K, N); bias: (N,) */
    mha_status st = MHA_OK;
    REAL *buf = NULL;

    /* 1. checks */
    st = gemm_check(sizeof(REAL), C, ldc, A, lda, transA, B, ldb, transB, M,
                    N, K);
    if (st != MHA_OK)
        return st;
    if (M == 0 || N == 0)
        return MHA_OK;
    if (K == 0) {
        gemm_write_init(C, ldc, bias, accumulate, 0, M, 0, N);
        return MHA_OK;
    }

    /* 2. small problems */
    size_t mn, mnk;
    if (!mha_mul_ok(&mn, M, N) || !mha_mul_ok(&mnk, mn, K))
        mnk = SIZE_MAX;
    if (!mha_gemm_reads_panels(M, N, K)) {
        gemm_small(C, ldc, A, lda, transA, B, ldb, transB, bias, M, N, K, accumulate);
        return MHA_OK;
    }

    /* 3. blocking: K blocks depend on K and the ISA only (determinism);
       everything else may depend on the thread count. */
    const mha_gemm_blocking *bk =
        &mha_kernels_for(mha_get_isa(), sizeof(REAL) == sizeof(double))->gemm;
    const size_t NR = bk->nr;
    int nth;
    size_t mp, nmb;
    gemm_split(bk, M, mnk, &nth, &mp, &nmb);
    size_t nkb;
    const size_t kcb = gemm_kc_balanced(bk, K, &nkb);
    const REAL *packed = gemm_usable(bk, pb, transB, K, N);
    const int direct = packed == NULL && gemm_in_place(bk, M, transB, ldb);
    const int whole = !direct && gemm_whole_rows(bk, M);
    const int own = packed == NULL && whole;
    if (whole)
        nmb = 1;

    const size_t mcp_max = (mp + nmb - 1) / nmb; /* panels per row block */

    GEMM_CTX x;
    x.C = C; x.ldc = ldc; x.A = A; x.lda = lda; x.transA = transA;
    x.B = B; x.ldb = ldb; x.transB = transB; x.bias = bias;
    x.accumulate = accumulate; x.M = M; x.bk = bk;
    x.mp = mp; x.nmb = nmb;

    /* scratch: one packed B block (when B is packed here), then each
       thread's slice, each starting on a cache line */
    const size_t line = 64 / sizeof(REAL);
    const size_t nc_max = N < bk->nc ? (N + NR - 1) / NR * NR : bk->nc;
    size_t bp_elems, ap_all, total;
    if (!mha_mul_ok(&bp_elems, kcb, nc_max) ||
        !gemm_thread_scratch(&x, mcp_max, kcb, own, direct && N % NR != 0, nth, &ap_all))
        return MHA_ERR_SIZE;
    bp_elems = packed != NULL || direct || own ? 0 : (bp_elems + line - 1) / line * line;
    if (!mha_add_ok(&total, bp_elems, ap_all))
        return MHA_ERR_SIZE;
    /* mha_scratch: from 1 MiB (a B block of double) a kept huge block,
       not one glibc may map afresh on every call: in a backward pass it
       did (float64, T = 64, d_model 512: ~2300 page faults a call, and
       10.8 ms against 6.8 from the kept block) */
    st = mha_scratch((void **)&buf, total, sizeof(REAL));
    if (st != MHA_OK)
        goto fail;
    x.bp = buf;
    x.ap = buf + bp_elems;

    x.packed = packed;
    x.direct = direct;
    x.own = own;
    x.K = K;
    x.kcb = kcb;
    for (size_t jc = 0; jc < N; jc += bk->nc) {
        x.jc = jc;
        x.nc = N - jc < bk->nc ? N - jc : bk->nc;
        x.np = (x.nc + NR - 1) / NR;
        /* too few row blocks to share out: split the columns as well */
        x.nnb = nmb < (size_t)nth ? (x.np < (size_t)nth ? x.np : (size_t)nth)
                                  : 1;
        x.nbt = x.np < (size_t)nth ? x.np : (size_t)nth;
        if (packed != NULL || direct || own) {
            st = mha_parallel_for_n(nmb * x.nnb, nth, gemm_task_compute_all, &x);
            if (st != MHA_OK)
                goto fail;
            continue;
        }
        for (size_t kb = 0; kb < nkb; kb++) {
            x.pc = kb * kcb;
            if (x.pc >= K)
                break;
            x.kc = K - x.pc < kcb ? K - x.pc : kcb;
            x.first = kb == 0;
            x.bpr = x.bp;
            st = mha_parallel_for_n(x.nbt, nth, gemm_task_pack_b, &x);
            if (st != MHA_OK)
                goto fail;
            st = mha_parallel_for_n(nmb * x.nnb, nth, gemm_task_compute, &x);
            if (st != MHA_OK)
                goto fail;
        }
    }

fail:
    mha_scratch_free(buf);
    return st;
}

mha_status mha_gemm(REAL *C, size_t ldc, const REAL *A, size_t lda, int transA, const REAL *B,
                    size_t ldb, int transB, const REAL *bias, size_t M, size_t N, size_t K,
                    int accumulate)
{
    return mha_gemm_packed(C, ldc, A, lda, transA, B, ldb, transB, NULL, bias, M, N, K, accumulate);
}


/* 7. GEMMs that share A (the Q, K and V projections of self-attention):
   C_s (M, N_s) = A (M, K) @ B_s (K, N_s) [+ bias_s], each from its
   prepacked B_s or from B_s in place, as one pool phase over all their
   tiles. Each C_s gets the bits mha_gemm_packed gives it; when a segment
   cannot join (a small problem, more than one column block, B packed by
   blocks), every segment is computed by its own mha_gemm_packed instead.
   When every segment has the same row blocks and none reads B in place, a
   task is a row block and a range of all the segments' panels, and packs
   each K block of A once for them (gemm_task_span). */
typedef struct {
    GEMM_CTX seg[MHA_GEMM_MAX_SEG];
    size_t start[MHA_GEMM_MAX_SEG + 1]; /* the first task of each segment */
    /* When every segment has the same row blocks, a task is a row block
       and a range of the segments' column panels end to end instead: */
    int nseg, span;
    size_t ngp;                         /* ranges of panels per row block  */
    size_t base[MHA_GEMM_MAX_SEG + 1];  /* the first panel of each segment */
} GEMM_MULTI_CTX;

/* Spanning task t: row block t / ngp, panel range t % ngp, which packs
   each K block of its rows of A once for all the segments it meets. Each
   element still gets its K blocks in order, from the same panels. */
static void gemm_task_span(void *ctxp, size_t t, int ith)
{
    const GEMM_MULTI_CTX *m = ctxp;
    const GEMM_CTX *x0 = &m->seg[0];
    const size_t mb = t / m->ngp, g = t % m->ngp;
    const size_t p0 = part_start(x0->mp, x0->nmb, mb);
    const size_t p1 = part_start(x0->mp, x0->nmb, mb + 1);
    const size_t g0 = part_start(m->base[m->nseg], m->ngp, g);
    const size_t g1 = part_start(m->base[m->nseg], m->ngp, g + 1);
    if (p0 >= p1 || g0 >= g1)
        return;
    for (size_t pc = 0; pc < x0->K; pc += x0->kcb) {
        const size_t kc = x0->K - pc < x0->kcb ? x0->K - pc : x0->kcb;
        REAL *ap = gemm_tile_a(x0, ith, p0, p1, pc, kc);
        for (int s = 0; s < m->nseg; s++) {
            const size_t lo = g0 > m->base[s] ? g0 : m->base[s];
            const size_t hi = g1 < m->base[s + 1] ? g1 : m->base[s + 1];
            if (lo >= hi)
                continue;
            size_t bq, bld;
            const REAL *bpr = gemm_b_block(&m->seg[s], pc, kc, &bq, &bld);
            gemm_tile_run(&m->seg[s], ap, p0, p1, lo - m->base[s], hi - m->base[s], pc, kc, pc == 0,
                          bpr, bq, bld);
        }
    }
}

static void gemm_task_multi(void *ctxp, size_t t, int ith)
{
    const GEMM_MULTI_CTX *m = ctxp;
    int s = 0;
    while (t >= m->start[s + 1])
        s++;
    gemm_task_compute_all((void *)&m->seg[s], t - m->start[s], ith);
}

mha_status mha_gemm_packed_multi(int nseg, REAL *const *C, const REAL *A, size_t lda,
                                 const REAL *const *B, const mha_packed *const *pb,
                                 const REAL *const *bias, size_t M, const size_t *N, size_t K)
{
    /* C[s]: (M, N[s]) row stride N[s]; A: (M, K); B[s]: (K, N[s]) */
    const mha_gemm_blocking *bk =
        &mha_kernels_for(mha_get_isa(), sizeof(REAL) == sizeof(double))->gemm;
    int joint = nseg > 1 && nseg <= MHA_GEMM_MAX_SEG && M > 0 && K > 0, edge = 0, any_own = 0;
    size_t work = 0;
    const REAL *packed[MHA_GEMM_MAX_SEG] = {NULL};
    int direct[MHA_GEMM_MAX_SEG] = {0}, own[MHA_GEMM_MAX_SEG] = {0}, any_whole = 0;
    const int whole = gemm_whole_rows(bk, M);
    for (int s = 0; s < nseg && joint; s++) {
        size_t mnk;
        packed[s] = gemm_usable(bk, pb[s], 0, K, N[s]);
        direct[s] = packed[s] == NULL && gemm_in_place(bk, M, 0, N[s]);
        own[s] = packed[s] == NULL && !direct[s] && whole;
        joint = N[s] > 0 && N[s] <= bk->nc && mha_mul_ok(&mnk, M, N[s]) &&
                (packed[s] != NULL || direct[s] || own[s]) &&
                mha_mul_ok(&mnk, mnk, K) && mnk >= MHA_GEMM_SMALL &&
                gemm_check(sizeof(REAL), C[s], N[s], A, lda, 0, B[s], N[s], 0, M, N[s],
                           K) == MHA_OK &&
                mha_add_ok(&work, work, mnk);
        edge |= direct[s] && N[s] % bk->nr != 0;
        any_own |= own[s];
        any_whole |= whole && !direct[s];
    }
    if (!joint) {
        for (int s = 0; s < nseg; s++) {
            const mha_status st = mha_gemm_packed(C[s], N[s], A, lda, 0, B[s], N[s], 0, pb[s],
                                                  bias[s], M, N[s], K, 0);
            if (st != MHA_OK)
                return st;
        }
        return MHA_OK;
    }

    /* The blocking and thread split of mha_gemm_packed, over the total work. */
    const size_t NR = bk->nr;
    int nth;
    size_t mp, nmb, nkb;
    gemm_split(bk, M, work, &nth, &mp, &nmb);
    const size_t kcb = gemm_kc_balanced(bk, K, &nkb);
    const size_t mcp_max = any_whole ? mp : (mp + nmb - 1) / nmb;
    GEMM_CTX sized = {.bk = bk};
    size_t ap_all;
    if (!gemm_thread_scratch(&sized, mcp_max, kcb, any_own, edge, nth, &ap_all))
        return MHA_ERR_SIZE;
    REAL *ap = NULL;
    mha_status st = mha_scratch_small((void **)&ap, ap_all, sizeof(REAL));
    if (st != MHA_OK)
        return st;

    GEMM_MULTI_CTX m;
    m.start[0] = 0;
    for (int s = 0; s < nseg; s++) {
        GEMM_CTX *x = &m.seg[s];
        *x = (GEMM_CTX){
            .C = C[s], .ldc = N[s], .A = A, .lda = lda, .transA = 0, .B = B[s],
            .ldb = N[s], .transB = 0, .bias = bias[s], .accumulate = 0, .M = M,
            .bk = bk, .ap = ap, .ap_stride = sized.ap_stride, .be_off = sized.be_off,
            .own_np = sized.own_np,
            .jc = 0, .nc = N[s], .mp = mp, .nmb = whole && !direct[s] ? 1 : nmb,
            .np = (N[s] + NR - 1) / NR, .packed = packed[s], .direct = direct[s],
            .own = own[s], .K = K, .kcb = kcb};
        x->nnb = x->nmb < (size_t)nth ? (x->np < (size_t)nth ? x->np : (size_t)nth) : 1;
        m.start[s + 1] = m.start[s] + x->nmb * x->nnb;
    }
    for (int s = nseg; s < MHA_GEMM_MAX_SEG; s++)
        m.start[s + 1] = m.start[s];
    m.nseg = nseg;
    m.span = 1;
    m.base[0] = 0;
    for (int s = 0; s < nseg; s++) {
        m.span &= m.seg[s].nmb == m.seg[0].nmb && !m.seg[s].direct;
        m.base[s + 1] = m.base[s] + m.seg[s].np;
    }
    m.ngp = m.seg[0].nmb < (size_t)nth ? (size_t)nth : 1;
    if (m.span)
        st = mha_parallel_for_n(m.seg[0].nmb * m.ngp, nth, gemm_task_span, &m);
    else
        st = mha_parallel_for_n(m.start[nseg], nth, gemm_task_multi, &m);
    mha_scratch_free(ap);
    return st;
}

#undef gemm_pack_rows
#undef gemm_pack_a_body
#undef gemm_pack_a
#undef gemm_pack_b_body
#undef gemm_pack_b
#undef gemm_write_init
#undef gemm_small_cols
#undef gemm_small_row
#undef gemm_small
#undef gemm_kc_balanced
#undef gemm_packed_elems
#undef gemm_pack_all
#undef mha_pack_weight
#undef GEMM_CTX
#undef gemm_task_pack_b
#undef gemm_put_corner
#undef gemm_tile_run
#undef gemm_tile_a
#undef gemm_tile
#undef gemm_task_compute
#undef gemm_b_block
#undef gemm_task_compute_all
#undef gemm_usable
#undef gemm_in_place
#undef gemm_whole_rows
#undef gemm_thread_scratch
#undef gemm_split
#undef mha_gemm_packed
#undef mha_gemm
#undef GEMM_MULTI_CTX
#undef gemm_task_span
#undef gemm_task_multi
#undef mha_gemm_packed_multi
