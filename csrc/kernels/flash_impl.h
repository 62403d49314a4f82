/*
 * flash_impl.h - template of the fused attention pass (contract and passes
 * in flash.h). Included by flash_<isa>.c once per element type; it consumes
 * (#undefs) every parameter macro below, so the next inclusion starts
 * clean. No include guard on purpose.
 *
 * Parameters:
 *   FN(name)          prefixes a static name, e.g. flash_avx2_f32_##name
 *   FLASH_KERNEL      name of the mha_flash_kernel to define
 *   REAL, FLASH_F64   float / double, and 1 for double
 *   VEC, VLEN         vector type of VLEN REALs (VLEN 1: plain C)
 *   MR, NV            register block: MR rows x NR = NV * VLEN columns
 *   BQ, BK            query rows per tile (a multiple of MR) and keys per
 *                     block (a multiple of NR)
 *   VZERO(), VSET1(x), VLOAD(p) (64-byte aligned or within an aligned row
 *   at a multiple of VLEN), VLOADU(p), VSTORE(p, v), VSTOREU(p, v),
 *   VBCAST(p), VFMA(a, b, c) = a * b + c, VMUL, VADD, VSUB, VDIV
 *   VMAX(a, b)        b when either lane is NaN (x86 maxps semantics)
 *   VHMAX(v), VHSUM(v)  horizontal max / sum, in a fixed order
 *   VSELBOOL(v, p)    lane l of v where the byte p[l] != 0, else -inf
 *   VEXP(v)           lane-wise exp, or FLASH_POLY_EXP with VFNMA, VMIN
 *                     and VPOW2 to get the polynomial of flash_exp_impl.h
 *   TB, TPACK(dst, ldd, src, lds, cols)  optional: transposing copy of TB
 *                     rows, dst[c*ldd + r] = src[r*lds + c], r < TB,
 *                     c < cols
 *   FLASH_NO_PREFETCH optional: no software prefetch of the next key block
 *
 * Scratch of one thread (REAL counts, each part 64-byte aligned):
 *   kt  (dk_max, BK)      K_blk^T, zero past the block's keys
 *   vp  (BK, dvp_max)     V_blk, zero past dv   (dvp = dv rounded up to NR)
 *   o   (BQ, dvp_max)     unnormalised head outputs of the tile's rows
 *   qp  (BQ, dkq_max)     the tile's query rows, dkq = dk rounded up to a
 *                         cache line (rows of q lie Sq apart, which maps
 *                         them onto few cache sets)
 *   s   (MR, BK)          scores, then probabilities, of one row group
 *   m, l (BQ,)            running row max and row sum
 *   tmp (2 * APAD,)       alpha arguments and values; APAD = MR rounded up
 *                         to 16 lanes
 */
#if !defined(FN) || !defined(FLASH_KERNEL) || !defined(REAL) ||             \
    !defined(VEC) || !defined(VLEN) || !defined(MR) || !defined(NV) ||      \
    !defined(BQ) || !defined(BK)
#error "flash_impl.h: missing template parameters"
#endif

#define NR (NV * VLEN)
#define APAD 16
#define NINF ((REAL)-INFINITY)

#if BQ % MR != 0 || BK % NR != 0 || MR > APAD
#error "flash_impl.h: BQ must be a multiple of MR and BK of NR"
#endif

#ifdef FLASH_POLY_EXP
#define FLASH_VEXP FN(vexp)
#include "flash_exp_impl.h"
#undef FLASH_VEXP
#define VEXP(v) FN(vexp)(v)
#endif

/* Offsets (in REALs) of the scratch parts; returns 0 on overflow. */
static int FN(layout)(size_t off[9], size_t dk_max, size_t dv_max)
{
    const size_t align = 64 / sizeof(REAL);
    const size_t dvp = mha_flash_round_up(dv_max, NR);
    const size_t dkq = mha_flash_round_up(dk_max, align);
    if (dkq > SIZE_MAX / 4 / (BK + BQ) || dvp > SIZE_MAX / 4 / (BK + BQ))
        return 0;
    const size_t n[8] = {dk_max * BK, BK * dvp, BQ * dvp, BQ * dkq, MR * BK,
                         BQ, BQ, 2 * APAD};
    size_t at = 0;
    for (int p = 0; p < 8; p++) {
        off[p] = at;
        const size_t len = mha_flash_round_up(n[p], align);
        if (len > SIZE_MAX / sizeof(REAL) / 2 - at)
            return 0;
        at += len;
    }
    off[8] = at;
    return 1;
}

static size_t FN(scratch_bytes)(size_t dk_max, size_t dv_max)
{
    size_t off[9];
    return FN(layout)(off, dk_max, dv_max) ? off[8] * sizeof(REAL) : 0;
}

/*
 * kt (dk, BK) = K_blk^T: kt[d*BK + j] = k0[j*ldk + d] for j < nk, and 0
 * for nk <= j < ncols, so the score kernel can run whole NR-wide columns.
 */
static void FN(pack_kt)(REAL *kt, const REAL *k0, size_t ldk, size_t nk,
                        size_t ncols, size_t dk)
{
    size_t j = 0;
#ifdef TPACK
    for (; j + TB <= nk; j += TB)
        TPACK(kt + j, BK, k0 + j * ldk, ldk, dk);
#endif
    for (size_t d = 0; d < dk; d++) {
        REAL *kt_d = kt + d * BK;
        for (size_t jj = j; jj < nk; jj++)
            kt_d[jj] = k0[jj * ldk + d];
        for (size_t jj = nk; jj < ncols; jj++)
            kt_d[jj] = 0;
    }
}

/* vp (nk, dvp) = V_blk, zero in the columns dv .. dvp - 1. Returns
   nonzero when the block holds an inf or NaN (see FN(pv_guarded)). */
static int FN(pack_v)(REAL *vp, const REAL *v0, size_t ldv, size_t nk,
                      size_t dv, size_t dvp)
{
    int nonfinite = 0;
    for (size_t j = 0; j < nk; j++) {
        REAL *vp_j = vp + j * dvp;
        const REAL *v_j = v0 + j * ldv;
        for (size_t c = 0; c < dv; c++) {
            vp_j[c] = v_j[c];
            nonfinite |= !(v_j[c] - v_j[c] == 0);   // inf - inf, NaN: NaN
        }
        for (size_t c = dv; c < dvp; c++)
            vp_j[c] = 0;
    }
    return nonfinite;
}

/*
 * Prefetch rows 0 .. n - 1 of k0 (row stride ldk, dk wide) and of v0 (ldv,
 * dv wide): the next key block, fetched while this one is computed. The
 * rows are a few cache lines each, far apart, which the hardware
 * prefetchers do not follow. Always inlined: GCC deems a function made of
 * prefetches alone free of effects and deletes its calls.
 */
static inline __attribute__((always_inline)) void
FN(prefetch)(const REAL *k0, size_t ldk, size_t dk, const REAL *v0,
             size_t ldv, size_t dv, size_t n)
{
#ifdef FLASH_NO_PREFETCH
    (void)k0, (void)ldk, (void)dk, (void)v0, (void)ldv, (void)dv, (void)n;
#else
    for (size_t j = 0; j < n; j++) {
        // every cache line of row j of k0, then of v0, into L2
        const uintptr_t k_a = (uintptr_t)(k0 + j * ldk);
        const uintptr_t v_a = (uintptr_t)(v0 + j * ldv);
        const uintptr_t k_end = k_a + dk * sizeof(REAL);
        const uintptr_t v_end = v_a + dv * sizeof(REAL);
        for (uintptr_t a = k_a & ~(uintptr_t)63; a < k_end; a += 64)
            __builtin_prefetch((const void *)a, 0, 2);
        for (uintptr_t a = v_a & ~(uintptr_t)63; a < v_end; a += 64)
            __builtin_prefetch((const void *)a, 0, 2);
    }
#endif
}

/*
 * s (MR, BK) = sc * q_rows (MR, dk) @ kt (dk, ncols), ncols a multiple of
 * NR. Row r of q is q0 + r*ldq for r < mr; the rows past mr repeat row 0
 * (their scores are never used). Each score is summed over d in order.
 */
static void FN(scores)(REAL *s, const REAL *q0, size_t ldq, size_t mr,
                       const REAL *kt, size_t dk, size_t ncols, REAL sc)
{
    const REAL *q_r[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
        q_r[r] = q0 + ((size_t)r < mr ? (size_t)r : 0) * ldq;
    const VEC scv = VSET1(sc);
    for (size_t jb = 0; jb < ncols; jb += NR) {
        VEC acc[MR][NV];
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                acc[r][v] = VZERO();
        const REAL *kt_j = kt + jb;
#pragma GCC unroll 4
        for (size_t d = 0; d < dk; d++) {
            VEC kv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                kv[v] = VLOAD(kt_j + d * BK + v * VLEN);
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const VEC qb = VBCAST(q_r[r] + d);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++)
                    acc[r][v] = VFMA(qb, kv[v], acc[r][v]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                VSTORE(s + r * BK + jb + v * VLEN, VMUL(acc[r][v], scv));
    }
}

/*
 * Masks of the rows i = i_first .. i_first + mr - 1 on the key block j0 ..
 * j0 + nk - 1, in s (MR, BK): an additive mask is added to the scaled
 * scores, then keys blocked by a bool mask, by causality or key_lengths
 * (j >= lim[r]), and the padding lanes nk .. nkv - 1 become -inf, as in
 * the reference (scores + additive, then where(allowed, scores, -inf)).
 */
static void FN(mask)(REAL *s, const mha_config *cfg, size_t b, size_t h,
                     size_t i_first, size_t mr, size_t j0, size_t nk,
                     size_t nkv, size_t len_b)
{
    const ptrdiff_t *st = cfg->mask_stride;
    const ptrdiff_t sj = st[3];
    for (size_t r = 0; r < mr; r++) {
        const size_t i = i_first + r;
        REAL *s_r = s + r * BK;
        size_t lim = mha_flash_key_limit(i, cfg->Tq, cfg->Tk, cfg->causal,
                                         len_b);
        lim = lim <= j0 ? 0 : (lim - j0 < nk ? lim - j0 : nk);
        const ptrdiff_t at = (ptrdiff_t)b * st[0] + (ptrdiff_t)h * st[1] +
                             (ptrdiff_t)i * st[2] + (ptrdiff_t)j0 * sj;
        size_t j = 0;
        if (cfg->mask_kind == MHA_MASK_ADD && lim > 0) {
            const REAL *m_r = (const REAL *)cfg->mask + at;
            if (sj == 1) {
                for (; j + VLEN <= lim; j += VLEN)
                    VSTORE(s_r + j, VADD(VLOAD(s_r + j), VLOADU(m_r + j)));
            } else if (sj == 0) {
                const VEC mv = VSET1(m_r[0]);
                for (; j + VLEN <= lim; j += VLEN)
                    VSTORE(s_r + j, VADD(VLOAD(s_r + j), mv));
            }
            for (; j < lim; j++)
                s_r[j] += m_r[(ptrdiff_t)j * sj];
        } else if (cfg->mask_kind == MHA_MASK_BOOL && lim > 0) {
            const uint8_t *m_r = (const uint8_t *)cfg->mask + at;
            if (sj == 1) {
                for (; j + VLEN <= lim; j += VLEN)
                    VSTORE(s_r + j, VSELBOOL(VLOAD(s_r + j), m_r + j));
            } else if (sj == 0 && m_r[0] == 0) {
                lim = 0; /* the whole row is blocked */
            } else if (sj == 0) {
                j = lim;
            }
            for (; j < lim; j++)
                if (m_r[(ptrdiff_t)j * sj] == 0)
                    s_r[j] = NINF;
        }
        for (j = lim; j < nkv; j++)
            s_r[j] = NINF;
    }
}

/*
 * Step 3 for one row group: scores s (MR, BK) of rows r < mr become
 * probabilities exp(s - m') in place; m, l (mr,) are updated and
 * alpha (MR,) = exp(m - m') is returned for the rows (0 past mr). A row
 * with no visible key so far has m' = -inf and subtracts 0 instead, so
 * exp(-inf - -inf) never makes a NaN; a NaN score is ignored by the max
 * and propagates through exp and the sums.
 *
 * The rows are interleaved (row loop innermost, over all MR rows): their
 * max, exp and sum chains are independent, and one row at a time left the
 * core waiting on each row's horizontal reductions. Rows past mr repeat
 * row 0's scores (FN(scores)); they are computed and never used, so each
 * lane's arithmetic, and every result bit, is what a row-by-row loop
 * gives.
 */
static void FN(softmax)(REAL *s, REAL *m, REAL *l, REAL *tmp, size_t mr,
                        size_t nkv)
{
    REAL *arg = tmp, *alpha = tmp + APAD;
    VEC mx[MR], mu[MR], sum[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
        mx[r] = VSET1(NINF);
    for (size_t j = 0; j < nkv; j += VLEN)
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++)
            mx[r] = VMAX(VLOAD(s + r * BK + j), mx[r]);
    for (size_t r = 0; r < APAD; r++)
        arg[r] = NINF;
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
        REAL m_use = 0;
        if ((size_t)r < mr) {
            const REAL mb = VHMAX(mx[r]);
            const REAL m_new = mb > m[r] ? mb : m[r];
            m_use = m_new == NINF ? 0 : m_new;
            arg[r] = m[r] - m_use; /* 0 when the max did not move */
            m[r] = m_new;
        }
        mu[r] = VSET1(m_use);
        sum[r] = VZERO();
    }
    for (size_t r = 0; r < APAD; r += VLEN)
        VSTORE(alpha + r, VEXP(VLOAD(arg + r)));
    for (size_t j = 0; j < nkv; j += VLEN)
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const VEC p = VEXP(VSUB(VLOAD(s + r * BK + j), mu[r]));
            VSTORE(s + r * BK + j, p);
            sum[r] = VADD(sum[r], p);
        }
    for (size_t r = 0; r < mr; r++)
        l[r] = l[r] * alpha[r] + VHSUM(sum[r]);
}

/*
 * Step 4: o (MR, dvp) row stride ldo = alpha * o + p (MR, nk) @ vp (nk,
 * dvp), each element summed over the keys in order. Every MR row is
 * computed (rows past the group's mr are scratch and never read out).
 */
static void FN(pv)(REAL *o, size_t ldo, const REAL *p, const REAL *vp,
                   size_t nk, size_t dvp, const REAL *alpha)
{
    for (size_t cb = 0; cb < dvp; cb += NR) {
        VEC acc[MR][NV];
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const VEC a = VSET1(alpha[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                acc[r][v] = VMUL(VLOAD(o + r * ldo + cb + v * VLEN), a);
        }
        const REAL *vp_c = vp + cb;
#pragma GCC unroll 4
        for (size_t j = 0; j < nk; j++) {
            VEC vv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                vv[v] = VLOAD(vp_c + j * dvp + v * VLEN);
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const VEC pb = VBCAST(p + r * BK + j);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++)
                    acc[r][v] = VFMA(pb, vv[v], acc[r][v]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                VSTORE(o + r * ldo + cb + v * VLEN, acc[r][v]);
    }
}

/*
 * Step 4 for a V block that holds an inf or NaN: FN(pv) element by element,
 * in the same key order and with the same (fused or not) multiply-add, so
 * finite values give the same bits; but a key of weight exactly 0 (blocked
 * by a mask or the causal diagonal inside the block) is skipped, so its inf
 * or NaN never reaches the row, as 0 * inf = NaN would. Rare, so scalar.
 */
static void FN(pv_guarded)(REAL *o, size_t ldo, const REAL *p, const REAL *vp,
                           size_t nk, size_t dvp, const REAL *alpha)
{
    for (int r = 0; r < MR; r++)
        for (size_t c = 0; c < dvp; c++) {
            REAL acc = o[r * ldo + c] * alpha[r];
            for (size_t j = 0; j < nk; j++) {
                const REAL p_rj = p[r * BK + j];
                if (p_rj != 0)
                    acc = SFMA(p_rj, vp[j * dvp + c], acc);
            }
            o[r * ldo + c] = acc;
        }
}

/* One tile: see flash.h for the passes. */
static void FN(task)(void *ctxp, size_t t, int ith)
{
    mha_flash_ctx *ctx = ctxp;
    const mha_config *cfg = ctx->cfg;
    if (atomic_load_explicit(&ctx->stop, memory_order_relaxed))
        return;
    if (cfg->interrupt != NULL && *cfg->interrupt) {
        atomic_store_explicit(&ctx->stop, 1, memory_order_relaxed);
        return;
    }
    const size_t Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H, nqb = ctx->nqb;
    const size_t Sq = ctx->Sq, Sk = ctx->Sk, Sv = ctx->Sv, Svq = ctx->Svq;
    const size_t b = t / (H * nqb), h = t / nqb % H;
    // Heavy tiles first: under causal masking the last block sees most keys.
    const size_t i0 = (nqb - 1 - t % nqb) * BQ;
    const size_t nq = Tq - i0 < BQ ? Tq - i0 : BQ;
    const size_t g = h / (H / cfg->G);
    const size_t dk = cfg->dk[g], dv = cfg->dv[g];
    const size_t dvp = mha_flash_round_up(dv, NR);
    const REAL sc = (REAL)cfg->scale[h];
    size_t len_b = Tk;
    if (cfg->key_lengths != NULL)
        len_b = (size_t)cfg->key_lengths[b]; /* in [0, Tk], checked */
    // Keys past kend are invisible to every row of the tile.
    const size_t kend = mha_flash_key_limit(i0 + nq - 1, Tq, Tk, cfg->causal,
                                            len_b);

    // q_b (Tq, dk) row stride Sq; k_b (Tk, dk) stride Sk; v_b (Tk, dv)
    // stride Sv; cat_b (Tq, dv) stride Svq; w_bh (Tq, Tk); lse_bh (Tq,)
    const REAL *q_b = (const REAL *)ctx->q + b * Tq * Sq + ctx->qoff[h];
    const REAL *k_b = (const REAL *)ctx->k + b * Tk * Sk + ctx->koff[g];
    const REAL *v_b = (const REAL *)ctx->v + b * Tk * Sv + ctx->voff[g];
    REAL *cat_b = (REAL *)ctx->cat + b * Tq * Svq + ctx->cvoff[h];
    REAL *w_bh = ctx->weights ? (REAL *)ctx->weights + (b * H + h) * Tq * Tk
                              : NULL;
    REAL *lse_bh = ctx->lse ? (REAL *)ctx->lse + (b * H + h) * Tq : NULL;

    size_t off[9];
    FN(layout)(off, ctx->dk_max, ctx->dv_max); /* checked by scratch_bytes */
    REAL *base = (REAL *)(ctx->scratch + (size_t)ith * ctx->scratch_stride);
    REAL *kt = base + off[0], *vp = base + off[1], *o = base + off[2];
    REAL *qp = base + off[3], *s = base + off[4], *m = base + off[5];
    REAL *l = base + off[6], *tmp = base + off[7];
    const size_t dkq = mha_flash_round_up(dk, 64 / sizeof(REAL));

    // Only the row groups the tile has: a tile of 3 queries (the small
    // calls) would spend most of its time clearing 192 rows.
    const size_t nqr = mha_flash_round_up(nq, MR);
    for (size_t r = 0; r < nqr; r++) {
        m[r] = NINF;
        l[r] = 0;
    }
    if (kend > 0) {
        // The first key block is fetched while the tile is set up.
        FN(prefetch)(k_b, Sk, dk, v_b, Sv, dv, kend < BK ? kend : BK);
        for (size_t e = 0; e < nqr * dvp; e++)
            o[e] = 0;
        for (size_t r = 0; r < nq; r++)
            for (size_t d = 0; d < dk; d++)
                qp[r * dkq + d] = q_b[(i0 + r) * Sq + d];
    }

    // Steps 1-4 over the key blocks.
    for (size_t j0 = 0; j0 < kend; j0 += BK) {
        const size_t nk = kend - j0 < BK ? kend - j0 : BK;
        FN(pack_kt)(kt, k_b + j0 * Sk, Sk, nk, mha_flash_round_up(nk, NR),
                    dk);
        const int v_nonfinite = FN(pack_v)(vp, v_b + j0 * Sv, Sv, nk, dv, dvp);
        // The next block's nn rows from jn on, a slice per row group.
        const size_t jn = j0 + BK;
        const size_t nn = jn >= kend ? 0 : (kend - jn < BK ? kend - jn : BK);
        const size_t groups = (nq + MR - 1) / MR;
        const size_t slice = (nn + groups - 1) / groups;
        for (size_t r0 = 0; r0 < nq; r0 += MR) {
            const size_t mr = nq - r0 < MR ? nq - r0 : MR;
            const size_t p0 = r0 / MR * slice;
            if (p0 < nn)
                FN(prefetch)(k_b + (jn + p0) * Sk, Sk, dk, v_b + (jn + p0) * Sv,
                             Sv, dv, nn - p0 < slice ? nn - p0 : slice);
            // Keys of this block visible to some row of the group.
            size_t ng = mha_flash_key_limit(i0 + r0 + mr - 1, Tq, Tk,
                                            cfg->causal, len_b);
            if (ng <= j0)
                continue; /* nothing to see: m, l and o stay as they are */
            ng = ng - j0 < nk ? ng - j0 : nk;
            FN(scores)(s, qp + r0 * dkq, dkq, mr, kt, dk,
                       mha_flash_round_up(ng, NR), sc);
            FN(mask)(s, cfg, b, h, i0 + r0, mr, j0, ng,
                     mha_flash_round_up(ng, VLEN), len_b);
            FN(softmax)(s, m + r0, l + r0, tmp, mr,
                        mha_flash_round_up(ng, VLEN));
            if (v_nonfinite)
                FN(pv_guarded)(o + r0 * dvp, dvp, s, vp, ng, dvp, tmp + APAD);
            else
                FN(pv)(o + r0 * dvp, dvp, s, vp, ng, dvp, tmp + APAD);
        }
    }

    // Step 5: normalise into the concatenation; lse.
    for (size_t r = 0; r < nq; r++) {
        const size_t i = i0 + r;
        REAL *cat_i = cat_b + i * Svq;
        if (kend == 0 || l[r] == 0) {
            for (size_t c = 0; c < dv; c++)
                cat_i[c] = 0;
            if (lse_bh)
                lse_bh[i] = NINF;
            continue;
        }
        const REAL *o_r = o + r * dvp;
        for (size_t c = 0; c < dv; c++)
            cat_i[c] = o_r[c] / l[r];
        if (lse_bh) {
            const double mu = m[r] == NINF ? 0.0 : (double)m[r];
            lse_bh[i] = (REAL)(mu + log((double)l[r]));
        }
    }

    // Step 6: the weights, exp(S - m) / l with the final m and l.
    if (w_bh == NULL)
        return;
    for (size_t j0 = 0; j0 < kend; j0 += BK) {
        const size_t nk = kend - j0 < BK ? kend - j0 : BK;
        const size_t nkv = mha_flash_round_up(nk, VLEN);
        FN(pack_kt)(kt, k_b + j0 * Sk, Sk, nk, mha_flash_round_up(nk, NR),
                    dk);
        for (size_t r0 = 0; r0 < nq; r0 += MR) {
            const size_t mr = nq - r0 < MR ? nq - r0 : MR;
            FN(scores)(s, qp + r0 * dkq, dkq, mr, kt, dk,
                       mha_flash_round_up(nk, NR), sc);
            FN(mask)(s, cfg, b, h, i0 + r0, mr, j0, nk, nkv, len_b);
            for (size_t r = 0; r < mr; r++) {
                REAL *s_r = s + r * BK;
                REAL *w_i = w_bh + (i0 + r0 + r) * Tk + j0;
                const REAL l_r = l[r0 + r], m_r = m[r0 + r];
                if (l_r == 0) {
                    for (size_t j = 0; j < nk; j++)
                        w_i[j] = 0;
                    continue;
                }
                const VEC mu = VSET1(m_r == NINF ? 0 : m_r);
                const VEC lv = VSET1(l_r);
                for (size_t j = 0; j < nkv; j += VLEN)
                    VSTORE(s_r + j, VDIV(VEXP(VSUB(VLOAD(s_r + j), mu)), lv));
                for (size_t j = 0; j < nk; j++)
                    w_i[j] = s_r[j];
            }
        }
    }
    for (size_t r = 0; r < nq; r++) {
        REAL *w_i = w_bh + (i0 + r) * Tk;
        for (size_t j = kend; j < Tk; j++)
            w_i[j] = 0;
    }
}

const mha_flash_kernel FLASH_KERNEL = {
    .task = FN(task),
    .bq = BQ,
    .scratch_bytes = FN(scratch_bytes),
};

#undef NR
#undef APAD
#undef NINF
#undef FN
#undef FLASH_KERNEL
#undef REAL
#undef FLASH_F64
#undef VEC
#undef VLEN
#undef MR
#undef NV
#undef BQ
#undef BK
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VLOADU
#undef VSTORE
#undef VSTOREU
#undef VBCAST
#undef VFMA
#undef SFMA
#undef VFNMA
#undef VMUL
#undef VADD
#undef VSUB
#undef VDIV
#undef VMAX
#undef VMIN
#undef VHMAX
#undef VHSUM
#undef VSELBOOL
#undef VEXP
#undef VPOW2
#undef FLASH_POLY_EXP
#undef FLASH_NO_PREFETCH
#undef TB
#undef TPACK
