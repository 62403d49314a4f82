/*
 * backward_impl.h - template body of the backward pass; included by
 * backward.c, backward_avx2.c and backward_avx512.c with `real` (float /
 * double), `sfx` (f32 / f64), `isa` (ref / avx2 / avx512: the instruction
 * set the including file is compiled for) and `bwd_exp` (the exponential of
 * one real) defined. No include guard on purpose.
 *
 * Legend: see mha.h. BQ query rows times BK keys make one tile. Pointers
 * carry the indices they fix: q_bi is row (b, i) of q, dk_bj row (b, j) of
 * dk, s_r row r of a score tile.
 *
 * Every reduction below runs in one fixed order inside one task, so the
 * gradients are bitwise identical for any thread count:
 *   - dV[j], dK[j] sum over the query heads of j's group in head order, then
 *     over query rows i in increasing order (pass 4);
 *   - dQ[i] sums over keys j in increasing order (pass 5);
 *   - every GEMM reduces each element in one order (gemm.h).
 */
#if !defined(real) || !defined(sfx) || !defined(isa) || !defined(bwd_exp)
#error "backward_impl.h needs real, sfx, isa and bwd_exp defined"
#endif

#define BWD(name) MHA_CAT(MHA_CAT(name, sfx), isa)

/*
 * C (M, N) = A (M, K) @ B (K, N), or C += A @ B when add: the one tile
 * product of the backward.
 *
 * A's element (m, k) is A[m * sam + k * sak], so the same kernel reads A or
 * its transpose; B's rows are contiguous (row stride ldb), and so are C's
 * (ldc). Each C element is reduced in one order whatever path computes it:
 *   c = add ? C[m][n] : 0;  c += A[m][0] B[0][n];  c += A[m][1] B[1][n]; ...
 * The main body keeps a 4 x NR block of C in registers (NR reals = two
 * 256-bit vectors) so that the compiler vectorises the inner loop over n.
 * A file that defines BWD_HAVE_MM brings its own mm_<sfx>_<isa> with the
 * same contract (backward_avx2.c, backward_avx512.c: intrinsics with fused
 * multiply-adds).
 */
#ifndef BWD_HAVE_MM
enum { BWD(NR) = 64 / (int)sizeof(real) };

static void BWD(mm)(real *C, size_t ldc, const real *A, size_t sam,
                    size_t sak, const real *B, size_t ldb, size_t M,
                    size_t N, size_t K, int add)
{
    enum { NR = BWD(NR) };
    size_t m = 0;
    for (; m + 4 <= M; m += 4) {
        const real *a_m = A + m * sam;
        size_t n = 0;
        for (; n + NR <= N; n += NR) {
            real acc0[NR], acc1[NR], acc2[NR], acc3[NR];
            real *c_m = C + m * ldc + n;
            for (int u = 0; u < NR; u++) {
                acc0[u] = add ? c_m[u] : 0;
                acc1[u] = add ? c_m[ldc + u] : 0;
                acc2[u] = add ? c_m[2 * ldc + u] : 0;
                acc3[u] = add ? c_m[3 * ldc + u] : 0;
            }
            for (size_t p = 0; p < K; p++) {
                const real *b_p = B + p * ldb + n;
                const real a0 = a_m[p * sak], a1 = a_m[sam + p * sak];
                const real a2 = a_m[2 * sam + p * sak];
                const real a3 = a_m[3 * sam + p * sak];
                for (int u = 0; u < NR; u++) {
                    acc0[u] += a0 * b_p[u];
                    acc1[u] += a1 * b_p[u];
                    acc2[u] += a2 * b_p[u];
                    acc3[u] += a3 * b_p[u];
                }
            }
            for (int u = 0; u < NR; u++) {
                c_m[u] = acc0[u];
                c_m[ldc + u] = acc1[u];
                c_m[2 * ldc + u] = acc2[u];
                c_m[3 * ldc + u] = acc3[u];
            }
        }
        // leftover columns: one column of four rows at a time
        for (; n < N; n++) {
            real *c_mn = C + m * ldc + n;
            real c0 = 0, c1 = 0, c2 = 0, c3 = 0;
            if (add) {
                c0 = c_mn[0];
                c1 = c_mn[ldc];
                c2 = c_mn[2 * ldc];
                c3 = c_mn[3 * ldc];
            }
            for (size_t p = 0; p < K; p++) {
                const real b = B[p * ldb + n];
                c0 += a_m[p * sak] * b;
                c1 += a_m[sam + p * sak] * b;
                c2 += a_m[2 * sam + p * sak] * b;
                c3 += a_m[3 * sam + p * sak] * b;
            }
            c_mn[0] = c0;
            c_mn[ldc] = c1;
            c_mn[2 * ldc] = c2;
            c_mn[3 * ldc] = c3;
        }
    }
    // leftover rows: one row at a time, same order
    for (; m < M; m++) {
        const real *a_m = A + m * sam;
        real *c_m = C + m * ldc;
        size_t n = 0;
        for (; n + NR <= N; n += NR) {
            real acc[NR];
            for (int u = 0; u < NR; u++)
                acc[u] = add ? c_m[n + u] : 0;
            for (size_t p = 0; p < K; p++) {
                const real a = a_m[p * sak];
                const real *b_p = B + p * ldb + n;
                for (int u = 0; u < NR; u++)
                    acc[u] += a * b_p[u];
            }
            for (int u = 0; u < NR; u++)
                c_m[n + u] = acc[u];
        }
        for (; n < N; n++) {
            real c = add ? c_m[n] : 0;
            for (size_t p = 0; p < K; p++)
                c += a_m[p * sak] * B[p * ldb + n];
            c_m[n] = c;
        }
    }
}
#endif /* BWD_HAVE_MM */

/* dst (cols, ld_dst) = src (rows, cols)^T: rows are keys, so the transposed
   tile has contiguous keys, as mm's B operand wants. */
static void BWD(transpose)(real *dst, size_t ld_dst, const real *src,
                           size_t ld_src, size_t rows, size_t cols)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++)
            dst[c * ld_dst + r] = src[r * ld_src + c];
}

/* dst (cols,) = sum over rows of src (rows, cols), rows in increasing
   order. Overwrites dst. */
static void BWD(colsum)(real *dst, const real *src, size_t rows, size_t cols,
                        size_t ld)
{
    for (size_t c = 0; c < cols; c++)
        dst[c] = 0;
    for (size_t r = 0; r < rows; r++) {
        const real *src_r = src + r * ld;
        for (size_t c = 0; c < cols; c++)
            dst[c] += src_r[c];
    }
}

/*
 * Everything a task reads; shared by all tasks of a pass.
 *
 * The per-head slices of the fused buffers have rows Sq (or Sk, Svq) apart,
 * often a multiple of 4 KiB, where a tile's rows would all fall into the
 * same few cache sets. So pass 3 first packs what the tiles read:
 *   qh  (B, [h: Tq, dk_h])   q head by head, head h at b Tq Sq + qoff[h] Tq
 *   doh (B, [h: Tq, dv_h])   d(concat) likewise, at b Tq Svq + cvoff[h] Tq
 *   kh  (B, nkb, [g: BK, dk_g])    k by key block, head by head, at
 *                                  ((b nkb + kb) Sk + koff[g]) BK
 *   kT  (B, nkb, [g: dk_g, BK])    the same blocks transposed (keys
 *   vT  (B, nkb, [g: dv_g, BK])    contiguous), and v's
 * Rows of the last key block past Tk are left unset: no tile reads them.
 */
typedef struct {
    const mha_config *cfg;
    const mha_layout *lay;
    const size_t *qoff, *cvoff, *koff, *voff;
    const real *q;      // (B, Tq, Sq)
    const real *k;      // (B, Tk, Sk)
    const real *v;      // (B, Tk, Sv)
    const real *dcat;   // (B, Tq, Svq)  d(concat)
    const real *lse;    // (B, H, Tq)
    const real *D;      // (B, H, Tq)    rowsum(dO * O) per head
    real *qh, *doh, *kh, *kT, *vT;   // packed, see above
    real *dq;           // (B, Tq, Sq)   written by pass 5
    real *dk;           // (B, Tk, Sk)   written by pass 4
    real *dv;           // (B, Tk, Sv)   written by pass 4
    real *scratch;      // per thread: stride reals from scratch + ith * stride
    size_t stride;
    size_t nqb, nkb;    // query blocks, key blocks
} BWD(ctx_t);

/* Keys j < len_b exist in batch item b (key_lengths). */
static size_t BWD(key_len)(const mha_config *cfg, size_t b)
{
    if (cfg->key_lengths == NULL)
        return cfg->Tk;
    const int64_t len = cfg->key_lengths[b];
    return len < 0 ? 0 : ((uint64_t)len < (uint64_t)cfg->Tk ? (size_t)len : cfg->Tk);
}

/* Query i sees keys j < visible_end(i): key length, then causality (the
   forward's step 2a). */
static size_t BWD(visible_end)(const mha_config *cfg, size_t len_b, size_t i)
{
    size_t jend = len_b;
    if (cfg->causal) {
        const ptrdiff_t last = (ptrdiff_t)i + (ptrdiff_t)cfg->Tk - (ptrdiff_t)cfg->Tq;
        if (last < 0)
            jend = 0;
        else if ((size_t)last + 1 < jend)
            jend = (size_t)last + 1;
    }
    return jend;
}

/*
 * Steps 3b and 3c of one tile: from the raw dot products S = q k^T and
 * dP = dO v^T of query rows i0 .. i0+nq-1 against keys j0 .. j0+nk-1 of
 * head h, make P (in place of S) and sc * dS (in place of dP).
 *
 * Recomputes the forward's probabilities from its log-sum-exp. The forward
 * computed, for a visible key,
 *     s = sc * dot;  s += mask;          p = exp(s - mx) / sum
 * and lse = mx + log(sum), so p = exp(s - lse) up to rounding. Then, with
 * D_i = rowsum(dO * O) = sum_j P_ij dP_ij,
 *     dS_ij = P_ij (dP_ij - D_i)         (softmax backward)
 *     d(dot)_ij = sc * dS_ij             (differentiates `s = sc * dot`)
 * An additive mask gets no gradient. A fully masked row (lse = -inf) and an
 * invisible key give P = 0 and dS = 0, never NaN.
 */
static void BWD(tile_probs)(real *S, real *dP, size_t ld,
                            const BWD(ctx_t) *c, size_t b, size_t h,
                            size_t i0, size_t nq, size_t j0, size_t nk)
{
    const mha_config *cfg = c->cfg;
    const size_t Tq = cfg->Tq, H = cfg->H;
    const real sc = (real)cfg->scale[h];
    const real ninf = (real)-INFINITY;
    const size_t len_b = BWD(key_len)(cfg, b);
    const ptrdiff_t mj = cfg->mask_stride[3];

    for (size_t r = 0; r < nq; r++) {
        const size_t i = i0 + r;
        real *s_r = S + r * ld, *dp_r = dP + r * ld;
        const real lse_i = c->lse[(b * H + h) * Tq + i];
        const size_t jend = BWD(visible_end)(cfg, len_b, i);
        const size_t nv = jend <= j0 ? 0 : (jend - j0 < nk ? jend - j0 : nk);
        if (nv == 0 || lse_i == ninf) {
            for (size_t jj = 0; jj < nk; jj++) {
                s_r[jj] = 0;
                dp_r[jj] = 0;
            }
            continue;
        }

        // 3b. s - lse, with blocked keys at -inf; then P = exp(s - lse).
        if (cfg->mask_kind == MHA_MASK_NONE) {
            for (size_t jj = 0; jj < nv; jj++)
                s_r[jj] = bwd_exp(sc * s_r[jj] - lse_i);
        } else {
            for (size_t jj = 0; jj < nv; jj++)
                s_r[jj] = sc * s_r[jj];
            const ptrdiff_t m_bhi = (ptrdiff_t)b * cfg->mask_stride[0] +
                                    (ptrdiff_t)h * cfg->mask_stride[1] +
                                    (ptrdiff_t)i * cfg->mask_stride[2] +
                                    (ptrdiff_t)j0 * mj;
            if (cfg->mask_kind == MHA_MASK_BOOL) {
                const uint8_t *mask_u8 = (const uint8_t *)cfg->mask + m_bhi;
                for (size_t jj = 0; jj < nv; jj++)
                    if (mask_u8[(ptrdiff_t)jj * mj] == 0)
                        s_r[jj] = ninf;
            } else {
                const real *mask_r = (const real *)cfg->mask + m_bhi;
                for (size_t jj = 0; jj < nv; jj++)
                    s_r[jj] += mask_r[(ptrdiff_t)jj * mj];
            }
            for (size_t jj = 0; jj < nv; jj++)
                s_r[jj] = bwd_exp(s_r[jj] - lse_i);
        }

        // 3c. sc * dS = sc * P * (dP - D); keys the row does not see get 0.
        const real D_i = c->D[(b * H + h) * Tq + i];
        for (size_t jj = 0; jj < nv; jj++)
            dp_r[jj] = sc * (s_r[jj] * (dp_r[jj] - D_i));
        for (size_t jj = nv; jj < nk; jj++) {
            s_r[jj] = 0;
            dp_r[jj] = 0;
        }
    }
}

/* Pass 3 (operands), one task = (b, query head h): qh and doh. */
static void BWD(pack_q_task)(void *ctxp, size_t task, int ith)
{
    (void)ith;
    const BWD(ctx_t) *c = ctxp;
    const mha_config *cfg = c->cfg;
    const size_t Tq = cfg->Tq, H = cfg->H;
    const size_t Sq = c->lay->Sq, Svq = c->lay->Svq;
    const size_t b = task / H, h = task % H, g = h / (H / cfg->G);
    const size_t dkg = cfg->dk[g], dvg = cfg->dv[g];
    real *qh_b = c->qh + b * Tq * Sq + c->qoff[h] * Tq;         // (Tq, dkg)
    real *doh_b = c->doh + b * Tq * Svq + c->cvoff[h] * Tq;     // (Tq, dvg)
    for (size_t i = 0; i < Tq; i++) {
        const real *q_bi = c->q + (b * Tq + i) * Sq + c->qoff[h];
        const real *do_bi = c->dcat + (b * Tq + i) * Svq + c->cvoff[h];
        for (size_t d = 0; d < dkg; d++)
            qh_b[i * dkg + d] = q_bi[d];
        for (size_t d = 0; d < dvg; d++)
            doh_b[i * dvg + d] = do_bi[d];
    }
}

/* Pass 3 (operands), one task = (b, key block kb): kh, kT and vT. */
static void BWD(pack_k_task)(void *ctxp, size_t task, int ith)
{
    (void)ith;
    const BWD(ctx_t) *c = ctxp;
    const mha_config *cfg = c->cfg;
    const size_t Tk = cfg->Tk, G = cfg->G;
    const size_t Sk = c->lay->Sk, Sv = c->lay->Sv;
    const size_t b = task / c->nkb, j0 = (task % c->nkb) * BWD_BK;
    const size_t nj = Tk - j0 < BWD_BK ? Tk - j0 : BWD_BK;
    for (size_t g = 0; g < G; g++) {
        const size_t dkg = cfg->dk[g], dvg = cfg->dv[g];
        const real *k_bj = c->k + (b * Tk + j0) * Sk + c->koff[g];
        const real *v_bj = c->v + (b * Tk + j0) * Sv + c->voff[g];
        real *kh_bj = c->kh + (task * Sk + c->koff[g]) * BWD_BK;   // (nj, dkg)
        for (size_t jj = 0; jj < nj; jj++)
            for (size_t d = 0; d < dkg; d++)
                kh_bj[jj * dkg + d] = k_bj[jj * Sk + d];
        BWD(transpose)(c->kT + (task * Sk + c->koff[g]) * BWD_BK, BWD_BK,
                       k_bj, Sk, nj, dkg);
        BWD(transpose)(c->vT + (task * Sv + c->voff[g]) * BWD_BK, BWD_BK,
                       v_bj, Sv, nj, dvg);
    }
}

/*
 * Pass 4 for one key block: dK and dV of keys j0 .. j0+nk-1 of kv head g in
 * batch item b, whose rows of dk and dv the caller owns. Sums over every
 * query head of g's group and every query row that may see the block, in
 * that order:
 *   dV_j = sum_{h, i} P_ij dO_i          (differentiates o_bi += w * v_bj)
 *   dK_j = sum_{h, i} sc dS_ij q_i       (differentiates dot += q_bi[d] * k_bj[d])
 * With with_dq, also adds this block's part of dQ (pass 5's sum) into dq,
 * whose rows of g's heads in b the caller owns too:
 *   dQ_i += sum_{j in block} sc dS_ij k_j
 */
static void BWD(kv_block)(const BWD(ctx_t) *c, size_t b, size_t g, size_t kb,
                          int ith, int with_dq)
{
    const mha_config *cfg = c->cfg;
    const size_t Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H;
    const size_t Sq = c->lay->Sq, Sk = c->lay->Sk, Sv = c->lay->Sv;
    const size_t Svq = c->lay->Svq;
    const size_t dkg = cfg->dk[g], dvg = cfg->dv[g], per_kv = H / cfg->G;
    const size_t j0 = kb * BWD_BK;
    const size_t nk = Tk - j0 < BWD_BK ? Tk - j0 : BWD_BK;

    // dk_b (nk, dkg) row stride Sk, dv_b (nk, dvg) row stride Sv.
    real *dk_b = c->dk + (b * Tk + j0) * Sk + c->koff[g];
    real *dv_b = c->dv + (b * Tk + j0) * Sv + c->voff[g];
    for (size_t jj = 0; jj < nk; jj++) {
        for (size_t d = 0; d < dkg; d++)
            dk_b[jj * Sk + d] = 0;
        for (size_t d = 0; d < dvg; d++)
            dv_b[jj * Sv + d] = 0;
    }
    // Padding keys (j >= len_b) are never seen: their gradient stays 0.
    const size_t len_b = BWD(key_len)(cfg, b);
    if (j0 >= len_b)
        return;
    const size_t nke = len_b - j0 < nk ? len_b - j0 : nk;

    // kT_bj (dkg, BK), vT_bj (dvg, BK): the block's keys transposed; kh_bj
    // (nke, dkg) its keys. Scratch: S (BQ, BK), dP (BQ, BK).
    const size_t blk = b * c->nkb + kb;
    const real *kT_bj = c->kT + (blk * Sk + c->koff[g]) * BWD_BK;
    const real *vT_bj = c->vT + (blk * Sv + c->voff[g]) * BWD_BK;
    const real *kh_bj = c->kh + (blk * Sk + c->koff[g]) * BWD_BK;
    real *S = c->scratch + (size_t)ith * c->stride;
    real *dP = S + BWD_BQ * BWD_BK;

    // Causal: query i sees key j0 iff i >= j0 - (Tk - Tq).
    size_t i_first = 0;
    if (cfg->causal) {
        const ptrdiff_t f = (ptrdiff_t)j0 - ((ptrdiff_t)Tk - (ptrdiff_t)Tq);
        i_first = f <= 0 ? 0 : (size_t)f;
    }
    for (size_t h = g * per_kv; h < (g + 1) * per_kv; h++) {
        for (size_t i0 = i_first; i0 < Tq; i0 += BWD_BQ) {
            if (bwd_interrupted(cfg))
                return;
            const size_t nq = Tq - i0 < BWD_BQ ? Tq - i0 : BWD_BQ;
            // qh_bi (nq, dkg), doh_bi (nq, dvg): packed, rows contiguous.
            const real *qh_bi = c->qh + b * Tq * Sq + c->qoff[h] * Tq + i0 * dkg;
            const real *doh_bi = c->doh + b * Tq * Svq + c->cvoff[h] * Tq + i0 * dvg;

            // 3a. S = q k^T and dP = dO v^T over the tile.
            BWD(mm)(S, BWD_BK, qh_bi, dkg, 1, kT_bj, BWD_BK, nq, nke, dkg, 0);
            BWD(mm)(dP, BWD_BK, doh_bi, dvg, 1, vT_bj, BWD_BK, nq, nke, dvg, 0);
            BWD(tile_probs)(S, dP, BWD_BK, c, b, h, i0, nq, j0, nke);

            // 4. dV += P^T dO and dK += (sc dS)^T q, rows i in order.
            BWD(mm)(dv_b, Sv, S, 1, BWD_BK, doh_bi, dvg, nke, dvg, nq, 1);
            BWD(mm)(dk_b, Sk, dP, 1, BWD_BK, qh_bi, dkg, nke, dkg, nq, 1);
            // 5. (fused) dQ += (sc dS) k, keys in order.
            if (with_dq)
                BWD(mm)(c->dq + (b * Tq + i0) * Sq + c->qoff[h], Sq, dP, BWD_BK,
                        1, kh_bj, dkg, nq, dkg, nke, 1);
        }
    }
}

/* Pass 4, one task = (b, kv head g, key block kb): see kv_block. */
static void BWD(dkv_task)(void *ctxp, size_t task, int ith)
{
    const BWD(ctx_t) *c = ctxp;
    if (bwd_interrupted(c->cfg))
        return;
    const size_t G = c->cfg->G;
    BWD(kv_block)(c, task / c->nkb / G, (task / c->nkb) % G, task % c->nkb,
                  ith, 0);
}

/*
 * Passes 4 and 5 fused, one task = (b, kv head g): every key block of g in
 * increasing order, each adding its part of dQ for the heads of g's group.
 * Each dQ element then sums over key blocks in increasing order, and within
 * a block over keys in increasing order: the very order of pass 5 (which
 * differs only by adding exact zeros for keys no row of a tile sees), so
 * the gradients are bitwise those of the two-pass plan. It saves pass 5's
 * recomputation of S and dP (5 tile products per tile instead of 7, and
 * one exp), at the price of coarser tasks: see plan_fused.
 */
static void BWD(fused_task)(void *ctxp, size_t task, int ith)
{
    const BWD(ctx_t) *c = ctxp;
    const mha_config *cfg = c->cfg;
    const size_t Tq = cfg->Tq, H = cfg->H, G = cfg->G, Sq = c->lay->Sq;
    const size_t b = task / G, g = task % G, per_kv = H / G;
    // This task's dq: rows (b, i) of the heads of g's group.
    for (size_t h = g * per_kv; h < (g + 1) * per_kv; h++) {
        const size_t dkh = cfg->dk[g];
        for (size_t i = 0; i < Tq; i++)
            for (size_t d = 0; d < dkh; d++)
                c->dq[(b * Tq + i) * Sq + c->qoff[h] + d] = 0;
    }
    for (size_t kb = 0; kb < c->nkb; kb++) {
        if (bwd_interrupted(cfg))
            return;
        BWD(kv_block)(c, b, g, kb, ith, 1);
    }
}

/*
 * Pass 5, one task = (b, query head h, query block qb): dQ of query rows
 * i0 .. i0+nq-1 of head h, summed over key blocks in increasing order.
 *   dQ_i = sum_j sc dS_ij k_j            (differentiates dot += q_bi[d] * k_bj[d])
 * P and dS are recomputed (FlashAttention-2's trade: no T x T buffer and no
 * reduction shared between threads).
 */
static void BWD(dq_task)(void *ctxp, size_t task, int ith)
{
    const BWD(ctx_t) *c = ctxp;
    const mha_config *cfg = c->cfg;
    if (bwd_interrupted(cfg))
        return;
    const size_t Tq = cfg->Tq, H = cfg->H;
    const size_t Sq = c->lay->Sq, Sk = c->lay->Sk, Sv = c->lay->Sv;
    const size_t Svq = c->lay->Svq;
    const size_t qb = task % c->nqb, h = (task / c->nqb) % H;
    const size_t b = task / c->nqb / H;
    const size_t g = h / (H / cfg->G);
    const size_t dkg = cfg->dk[g], dvg = cfg->dv[g];
    const size_t i0 = qb * BWD_BQ;
    const size_t nq = Tq - i0 < BWD_BQ ? Tq - i0 : BWD_BQ;

    // dq_bi (nq, dkg) row stride Sq: this task's.
    real *dq_bi = c->dq + (b * Tq + i0) * Sq + c->qoff[h];
    for (size_t r = 0; r < nq; r++)
        for (size_t d = 0; d < dkg; d++)
            dq_bi[r * Sq + d] = 0;
    // The block's last row sees the most keys.
    const size_t kend = BWD(visible_end)(cfg, BWD(key_len)(cfg, b), i0 + nq - 1);

    // Scratch: S (BQ, BK), dP (BQ, BK).
    real *S = c->scratch + (size_t)ith * c->stride;
    real *dP = S + BWD_BQ * BWD_BK;
    const real *qh_bi = c->qh + b * Tq * Sq + c->qoff[h] * Tq + i0 * dkg;
    const real *doh_bi = c->doh + b * Tq * Svq + c->cvoff[h] * Tq + i0 * dvg;
    for (size_t j0 = 0; j0 < kend; j0 += BWD_BK) {
        if (bwd_interrupted(cfg))
            return;
        const size_t nk = kend - j0 < BWD_BK ? kend - j0 : BWD_BK;
        const size_t blk = b * c->nkb + j0 / BWD_BK;
        const real *kh_bj = c->kh + (blk * Sk + c->koff[g]) * BWD_BK;   // (nk, dkg)
        const real *kT_bj = c->kT + (blk * Sk + c->koff[g]) * BWD_BK;   // (dkg, BK)
        const real *vT_bj = c->vT + (blk * Sv + c->voff[g]) * BWD_BK;   // (dvg, BK)
        BWD(mm)(S, BWD_BK, qh_bi, dkg, 1, kT_bj, BWD_BK, nq, nk, dkg, 0);
        BWD(mm)(dP, BWD_BK, doh_bi, dvg, 1, vT_bj, BWD_BK, nq, nk, dvg, 0);
        BWD(tile_probs)(S, dP, BWD_BK, c, b, h, i0, nq, j0, nk);
        // 5. dQ += (sc dS) k, keys in order.
        BWD(mm)(dq_bi, Sq, dP, BWD_BK, 1, kh_bj, dkg, nq, dkg, nk, 1);
    }
}

mha_status BWD(mha_backward)(
    real *dx, real *dkey, real *dvalue,
    real *dwq, real *dwk, real *dwv, real *dwo,
    real *dbq, real *dbk, real *dbv, real *dbo,
    const real *dout,
    const real *x, const real *key, const real *value,
    const real *wq, const real *wk, const real *wv, const real *wo,
    const real *q, const real *k, const real *v, const real *concat,
    const real *lse, const mha_config *cfg)
{
    // Gradients (each overwritten; NULL when not wanted):
    // dx (B, Tq, Din)   dkey (B, Tk, Dkin)   dvalue (B, Tk, Dvin)
    // dwq (Din, Sq)     dwk (Dkin, Sk)       dwv (Dvin, Sv)     dwo (Svq, Dout)
    // dbq (Sq,)         dbk (Sk,)            dbv (Sv,)          dbo (Dout,)
    // Inputs:
    // dout (B, Tq, Dout)
    // x (B, Tq, Din), key (B, Tk, Dkin), value (B, Tk, Dvin)
    // wq (Din, Sq), wk (Dkin, Sk), wv (Dvin, Sv), wo (Svq, Dout)
    // q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv), concat (B, Tq, Svq),
    // lse (B, H, Tq): kept by the forward
    mha_layout lay;
    mha_status st = mha_check_config(&lay, cfg);
    if (st != MHA_OK)
        return st;
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H;
    const size_t G = cfg->G, Dout = cfg->Dout;
    const size_t Din = cfg->Din, Dkin = cfg->Dkin, Dvin = cfg->Dvin;
    const size_t Sq = lay.Sq, Sk = lay.Sk, Sv = lay.Sv, Svq = lay.Svq;
    const size_t nq = B * Tq, nk = B * Tk;

    // Required buffers may only be NULL when they hold no element.
    if ((dout == NULL && nq * Dout != 0) ||
        (x == NULL && nq * Din != 0) || (key == NULL && nk * Dkin != 0) ||
        (value == NULL && nk * Dvin != 0) ||
        (wq == NULL && Din != 0) || (wk == NULL && Dkin != 0) ||
        (wv == NULL && Dvin != 0) || (cfg->has_wo && wo == NULL) ||
        (q == NULL && nq != 0) || (k == NULL && nk != 0) ||
        (v == NULL && nk != 0) || (concat == NULL && nq != 0) ||
        (lse == NULL && nq != 0))
        return MHA_ERR_ARG;
    // A shared gradient buffer means a shared input: its shapes must agree.
    if (dx != NULL && dkey == dx && (Tk != Tq || Dkin != Din))
        return MHA_ERR_ARG;
    if (dx != NULL && dvalue == dx && (Tk != Tq || Dvin != Din))
        return MHA_ERR_ARG;
    if (dkey != NULL && dvalue == dkey && Dvin != Dkin)
        return MHA_ERR_ARG;
    if (!cfg->has_wo)
        dwo = NULL;

    const int need_dq = dx != NULL || dwq != NULL || dbq != NULL;
    const int need_dkv = dkey != NULL || dvalue != NULL || dwk != NULL ||
                         dbk != NULL || dwv != NULL || dbv != NULL;

    // All scratch, allocated here and freed at fail:.
    size_t *off = NULL;   // (2H + 2G,): qoff, cvoff, koff, voff
    real *dcat_s = NULL, *D = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    real *scratch = NULL;
    BWD(ctx_t) c = {0};   // its packed buffers are scratch too
    if ((st = mha_scratch((void **)&off, 2 * (H + G), sizeof *off)) != MHA_OK)
        goto fail;
    size_t *qoff = off, *cvoff = off + H, *koff = off + 2 * H;
    size_t *voff = off + 2 * H + G;
    mha_head_offsets(qoff, cvoff, koff, voff, cfg);

    // 1. through the output projection, `out = concat @ wo + bo`:
    //    d(concat) = dout wo^T, dwo = concat^T dout, dbo = colsum(dout).
    //    Without W^O, `out = concat (+ bo)`: d(concat) = dout.
    const real *dcat = dout;   // dcat: (B, Tq, Svq)
    if (cfg->has_wo && (need_dq || need_dkv)) {
        if ((st = mha_scratch((void **)&dcat_s, nq * Svq, sizeof(real))) != MHA_OK)
            goto fail;
        if ((st = MHA_CAT(mha_gemm, sfx)(dcat_s, Svq, dout, Dout, 0, wo, Dout, 1,
                                         NULL, nq, Svq, Dout, 0)) != MHA_OK)
            goto fail;
        dcat = dcat_s;
    }
    if (dwo != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dwo, Dout, concat, Svq, 1, dout, Dout, 0,
                                     NULL, Svq, Dout, nq, 0)) != MHA_OK)
        goto fail;
    if (dbo != NULL)
        BWD(colsum)(dbo, dout, nq, Dout, Dout);
    if (bwd_interrupted(cfg))
        goto interrupt;

    if (need_dq || need_dkv) {
        // 2. D = rowsum(dO * O) per (b, h, i): O is head h's slice of
        //    concat, dO the same slice of d(concat).
        if ((st = mha_scratch((void **)&D, B * H * Tq, sizeof(real))) != MHA_OK)
            goto fail;
        for (size_t b = 0; b < B; b++)
            for (size_t h = 0; h < H; h++) {
                const size_t dvh = cfg->dv[h / (H / G)];
                for (size_t i = 0; i < Tq; i++) {
                    const real *o_bi = concat + (b * Tq + i) * Svq + cvoff[h];
                    const real *do_bi = dcat + (b * Tq + i) * Svq + cvoff[h];
                    real acc = 0;
                    for (size_t d = 0; d < dvh; d++)
                        acc += do_bi[d] * o_bi[d];
                    D[(b * H + h) * Tq + i] = acc;
                }
            }
    }

    // Per-thread tile scratch, S (BQ, BK) and dP (BQ, BK), each thread's
    // share a whole number of cache lines.
    int nth = mha_get_num_threads();
    nth = nth < 1 ? 1 : nth;
    const size_t stride = BWD_TILE_STRIDE;
    c = (BWD(ctx_t)){
        .cfg = cfg, .lay = &lay, .qoff = qoff, .cvoff = cvoff, .koff = koff,
        .voff = voff, .q = q, .k = k, .v = v, .dcat = dcat, .lse = lse,
        .D = D, .nqb = (Tq + BWD_BQ - 1) / BWD_BQ,
        .nkb = (Tk + BWD_BK - 1) / BWD_BK, .stride = stride,
    };
    if (need_dq || need_dkv) {
        // kh, kT (B nkb BK Sk reals) and vT (B nkb BK Sv), with
        // B nkb BK < B Tk + B BK; qh (B Tq Sq) and doh (B Tq Svq).
        size_t nkT, nvT;
        if (!bwd_mul_ok(&nkT, B * c.nkb, BWD_BK) || !bwd_mul_ok(&nvT, nkT, Sv) ||
            !bwd_mul_ok(&nkT, nkT, Sk)) {
            st = MHA_ERR_SIZE;
            goto fail;
        }
        if ((st = mha_scratch((void **)&scratch, (size_t)nth * stride,
                            sizeof(real))) != MHA_OK ||
            (st = mha_scratch((void **)&c.kh, nkT, sizeof(real))) != MHA_OK ||
            (st = mha_scratch((void **)&c.kT, nkT, sizeof(real))) != MHA_OK ||
            (st = mha_scratch((void **)&c.vT, nvT, sizeof(real))) != MHA_OK ||
            (st = mha_scratch((void **)&c.qh, nq * Sq, sizeof(real))) != MHA_OK ||
            (st = mha_scratch((void **)&c.doh, nq * Svq, sizeof(real))) != MHA_OK)
            goto fail;
        c.scratch = scratch;
        // 3. (operands) pack q, d(concat) per (b, h) and k, v per (b, kb).
        if ((st = mha_parallel_for_n(B * H, nth, BWD(pack_q_task), &c)) != MHA_OK ||
            (st = mha_parallel_for_n(B * c.nkb, nth, BWD(pack_k_task), &c)) != MHA_OK)
            goto fail;
        if (bwd_interrupted(cfg))
            goto interrupt;
    }

    // 4. and 5.: dk (B, Tk, Sk), dv (B, Tk, Sv) and dq (B, Tq, Sq).
    if (need_dkv && (st = mha_scratch((void **)&dk, nk * Sk, sizeof(real))) != MHA_OK)
        goto fail;
    if (need_dkv && (st = mha_scratch((void **)&dv, nk * Sv, sizeof(real))) != MHA_OK)
        goto fail;
    if (need_dq && (st = mha_scratch((void **)&dq, nq * Sq, sizeof(real))) != MHA_OK)
        goto fail;
    c.dk = dk;
    c.dv = dv;
    c.dq = dq;
    if (need_dq && need_dkv && bwd_plan_fused(B * G, nth)) {
        // One task per (b, g) does both passes.
        if ((st = mha_parallel_for_n(B * G, nth, BWD(fused_task), &c)) != MHA_OK)
            goto fail;
    } else {
        // One task per (b, g, key block), then one per (b, h, query block).
        if (need_dkv &&
            (st = mha_parallel_for_n(B * G * c.nkb, nth, BWD(dkv_task), &c)) != MHA_OK)
            goto fail;
        if (need_dq &&
            (st = mha_parallel_for_n(B * H * c.nqb, nth, BWD(dq_task), &c)) != MHA_OK)
            goto fail;
    }
    if (bwd_interrupted(cfg))
        goto interrupt;

    // 6. through the input projections, `q = x @ wq + bq` and likewise k, v:
    //    dwq = x^T dq, dbq = colsum(dq), dx = dq wq^T. A gradient buffer
    //    that is also an earlier one (key is x, value is key or x) adds.
    //    The interrupt flag is polled after each GEMM (a GEMM is not split).
    if (dwq != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dwq, Sq, x, Din, 1, dq, Sq, 0, NULL, Din,
                                     Sq, nq, 0)) != MHA_OK)
        goto fail;
    if (bwd_interrupted(cfg))
        goto interrupt;
    if (dbq != NULL)
        BWD(colsum)(dbq, dq, nq, Sq, Sq);
    if (dx != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dx, Din, dq, Sq, 0, wq, Sq, 1, NULL, nq,
                                     Din, Sq, 0)) != MHA_OK)
        goto fail;
    if (bwd_interrupted(cfg))
        goto interrupt;
    if (dwk != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dwk, Sk, key, Dkin, 1, dk, Sk, 0, NULL,
                                     Dkin, Sk, nk, 0)) != MHA_OK)
        goto fail;
    if (bwd_interrupted(cfg))
        goto interrupt;
    if (dbk != NULL)
        BWD(colsum)(dbk, dk, nk, Sk, Sk);
    if (dkey != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dkey, Dkin, dk, Sk, 0, wk, Sk, 1, NULL, nk,
                                     Dkin, Sk, dkey == dx)) != MHA_OK)
        goto fail;
    if (bwd_interrupted(cfg))
        goto interrupt;
    if (dwv != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dwv, Sv, value, Dvin, 1, dv, Sv, 0, NULL,
                                     Dvin, Sv, nk, 0)) != MHA_OK)
        goto fail;
    if (bwd_interrupted(cfg))
        goto interrupt;
    if (dbv != NULL)
        BWD(colsum)(dbv, dv, nk, Sv, Sv);
    if (dvalue != NULL &&
        (st = MHA_CAT(mha_gemm, sfx)(dvalue, Dvin, dv, Sv, 0, wv, Sv, 1, NULL,
                                     nk, Dvin, Sv,
                                     dvalue == dx || dvalue == dkey)) != MHA_OK)
        goto fail;
    st = MHA_OK;
    goto fail;   // success shares the cleanup

interrupt:
    st = MHA_ERR_INTERRUPTED;
fail:
    free(off);
    free(dcat_s);
    free(D);
    free(dq);
    free(dk);
    free(dv);
    free(scratch);
    free(c.qh);
    free(c.doh);
    free(c.kh);
    free(c.kT);
    free(c.vT);
    return st;
}

#undef BWD
