/*
 * test_paged.c - mha_attend on a paged KV cache (mha_config.block_table,
 * issue 39): k and v (and an int8 cache's scales) are pools of pages read
 * in place through a block table, and a call gives the bits of the same
 * call on the keys held contiguously.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   ./test_paged [quick]       quick: the shorter caches only
 *
 * What is checked, on every ISA this machine runs and at 1 and 3 threads:
 *   - a contiguous cache (B, G, C, d) and the same keys in a pool of pages
 *     (num_pages, G, page_size, d) in a shuffled order or in order (a
 *     block then lies in one run of memory), the table's unused
 *     entries pointing at page 0, page sizes 1, 7, 16 and 128: out, lse
 *     and the weights equal bit for bit, for a decode step (Tq = 1, split-K
 *     past 1024 keys), a causal prefill chunk and weights wanted or not
 *     (the one-row decode kernels and the packed tiles), in float32 of
 *     every storage kind (plain, float16, bfloat16, int8) and float64;
 *   - the refusals, each MHA_ERR_ARG with field MHA_FIELD_BLOCK_TABLE or
 *     MHA_FIELD_PAGE_SIZE and a message naming the values: an entry out of
 *     [0, num_pages), page_size 0, too few pages for Tk, sizes without a
 *     table, and a table given to mha_forward.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "threads.h"

#include "harness.h"

static int g_quick;
static const int k_isas[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512, MHA_ISA_NEON};

typedef struct {
    const char *name;
    size_t B, H, G, Tq, Tk, d;
    int causal, weights;
} pcase;

/* One case, one storage kind (es bytes per element; f64: double), one page
   size: the contiguous call against the paged call, bit for bit. shuffle:
   the pages in a random order (each block's rows read through their
   addresses, flash_page_ptrs), else in order (a block in pages that follow
   one another is read as one run, flash_page_run). */
static void check_paged(const pcase *K, mha_kv_storage kind, int f64, size_t ps, int shuffle)
{
    const size_t B = K->B, H = K->H, G = K->G, Tq = K->Tq, Tk = K->Tk, d = K->d;
    const size_t es = f64 ? 8 : kind == MHA_KV_PLAIN ? 4 : kind == MHA_KV_I8 ? 1 : 2;
    const size_t rs = f64 ? 8 : 4;   // the call's real
    const size_t pps = (Tk + ps - 1) / ps, P = B * pps + 2;
    const size_t nq = B * H * Tq * d, nkv = B * G * Tk * d, npool = P * G * ps * d;
    const size_t no = B * H * Tq * d, nw = B * H * Tq * Tk, nwp = B * H * Tq * pps * ps;
    const size_t nl = B * H * Tq;
    unsigned char *q = xcalloc(nq, rs), *k = xcalloc(nkv, es), *v = xcalloc(nkv, es);
    unsigned char *kp = xcalloc(npool, es), *vp = xcalloc(npool, es);
    float *ksc = xcalloc(B * G * Tk, 4), *vsc = xcalloc(B * G * Tk, 4);
    float *kpsc = xcalloc(P * G * ps, 4), *vpsc = xcalloc(P * G * ps, 4);
    for (size_t i = 0; i < nq; i++) {
        if (f64)
            ((double *)q)[i] = rng_unit();
        else
            ((float *)q)[i] = (float)rng_unit();
    }
    // Any bits of the element's width: a half's are finite below 0x7c00
    // (float16) or 0x7f80 (bfloat16) in magnitude, which these stay under.
    for (size_t i = 0; i < nkv * es; i++) {
        if (f64 || kind == MHA_KV_PLAIN)
            break;
        k[i] = (unsigned char)rng_below(es == 2 && i % 2 ? 0x3c : 256);
        v[i] = (unsigned char)rng_below(es == 2 && i % 2 ? 0x3c : 256);
    }
    for (size_t i = 0; (f64 || kind == MHA_KV_PLAIN) && i < nkv; i++) {
        if (f64)
            ((double *)k)[i] = rng_unit(), ((double *)v)[i] = rng_unit();
        else
            ((float *)k)[i] = (float)rng_unit(), ((float *)v)[i] = (float)rng_unit();
    }
    for (size_t i = 0; i < B * G * Tk; i++)
        ksc[i] = (float)(0.02 * (1 + rng_unit())), vsc[i] = (float)(0.02 * (1 + rng_unit()));
    // The pages: a shuffled permutation of 1 .. P - 1 (page 0 pads the
    // table), key j of (b, g) at row j % ps of page bt[b, j / ps].
    int32_t *bt = xcalloc(B * pps, 4), *perm = xcalloc(P, 4);
    for (size_t p = 0; p < P; p++)
        perm[p] = (int32_t)p;
    for (size_t p = P - 1; shuffle && p > 1; p--) {
        const size_t r = 1 + rng_below((int)p);
        const int32_t t = perm[p];
        perm[p] = perm[r], perm[r] = t;
    }
    size_t next = 1;
    for (size_t b = 0; b < B; b++)
        for (size_t p = 0; p < pps; p++)
            bt[b * pps + p] = perm[next++];
    for (size_t b = 0; b < B; b++)
        for (size_t g = 0; g < G; g++)
            for (size_t j = 0; j < Tk; j++) {
                const size_t page = (size_t)bt[b * pps + j / ps], r = j % ps;
                const size_t src = (b * G + g) * Tk + j, dst = (page * G + g) * ps + r;
                memcpy(kp + dst * d * es, k + src * d * es, d * es);
                memcpy(vp + dst * d * es, v + src * d * es, d * es);
                kpsc[dst] = ksc[src], vpsc[dst] = vsc[src];
            }
    decode_config D = decode_config_make(B, Tq, Tk, H, G, d, K->causal);
    const mha_config cc = D.cfg;
    mha_config cp = cc;
    cp.Tk = pps * ps;
    cp.block_table = bt, cp.pages_per_seq = pps, cp.page_size = ps, cp.num_pages = P;
    const mha_strides sq = {H * Tq * d, Tq * d, d}, skc = {G * Tk * d, Tk * d, d};
    const mha_strides skp = {G * ps * d, ps * d, d};
    const mha_strides sscc = {G * Tk, Tk, 1}, sscp = {G * ps, ps, 1};
    unsigned char *o[2] = {xcalloc(no, rs), xcalloc(no, rs)};
    unsigned char *w[2] = {xcalloc(nw, rs), xcalloc(nwp, rs)}, *l[2] = {xcalloc(nl, rs),
                                                                         xcalloc(nl, rs)};
    const int i8 = kind == MHA_KV_I8;
    const mha_dtype dt = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32;
    for (size_t ii = 0; ii < sizeof k_isas / sizeof k_isas[0]; ii++) {
        if (mha_set_isa(k_isas[ii]) != k_isas[ii])
            continue;
        for (int nth = 1; nth <= 3; nth += 2) {
            mha_set_num_threads(nth);
            const mha_params pc = {.dtype = dt, .out = o[0], .weights = K->weights ? w[0] : NULL,
                                   .lse = l[0], .q = q, .k = k, .v = v, .sq = sq, .sk = skc,
                                   .sv = skc, .so = sq, .kv_storage = kind,
                                   .k_scale = i8 ? ksc : NULL, .v_scale = i8 ? vsc : NULL,
                                   .sks = sscc, .svs = sscc};
            const mha_params pp = {.dtype = dt, .out = o[1], .weights = K->weights ? w[1] : NULL,
                                   .lse = l[1], .q = q, .k = kp, .v = vp, .sq = sq, .sk = skp,
                                   .sv = skp, .so = sq, .kv_storage = kind,
                                   .k_scale = i8 ? kpsc : NULL, .v_scale = i8 ? vpsc : NULL,
                                   .sks = sscp, .svs = sscp};
            mha_error err;
            mha_status st = mha_attend(&cc, &pc, &err);
            CHECK(st == MHA_OK, "%s contiguous: status %d %s", K->name, (int)st, err.msg);
            st = mha_attend(&cp, &pp, &err);
            CHECK(st == MHA_OK, "%s paged: status %d %s", K->name, (int)st, err.msg);
            CHECK(memcmp(o[0], o[1], no * rs) == 0 && memcmp(l[0], l[1], nl * rs) == 0,
                  "%s kind %d f64 %d page_size %zu isa %s threads %d: out or lse differ",
                  K->name, (int)kind, f64, ps, mha_isa_name((mha_isa)k_isas[ii]), nth);
            // The weights: the paged call's rows are pps * ps wide, the
            // keys past Tk zero.
            int same = 1;
            for (size_t r = 0; K->weights && r < B * H * Tq; r++) {
                same &= memcmp(w[0] + r * Tk * rs, w[1] + r * pps * ps * rs, Tk * rs) == 0;
                for (size_t j = Tk; j < pps * ps; j++)
                    same &= f64 ? ((double *)w[1])[r * pps * ps + j] == 0
                                : ((float *)w[1])[r * pps * ps + j] == 0;
            }
            CHECK(same, "%s kind %d page_size %zu isa %s threads %d: weights differ", K->name,
                  (int)kind, ps, mha_isa_name((mha_isa)k_isas[ii]), nth);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    free(q), free(k), free(v), free(kp), free(vp), free(ksc), free(vsc), free(kpsc);
    free(vpsc), free(bt), free(perm), decode_config_free(&D);
    for (int i = 0; i < 2; i++)
        free(o[i]), free(w[i]), free(l[i]);
}

static void test_refusals(void)
{
    float q[8] = {0}, pool[3 * 4 * 4] = {0}, out[8];
    size_t wd = 4;
    double scale = 1;
    int32_t bad[2] = {0, 3}, neg[2] = {-1, 0}, ok[2] = {0, 1};
    const mha_strides s = {8, 8, 4}, sp = {16, 16, 4};
    const mha_params prm = {.dtype = MHA_DTYPE_F32, .out = out, .q = q, .k = pool, .v = pool,
                            .sq = s, .sk = sp, .sv = sp, .so = s};
    const mha_config base = {.B = 1, .Tq = 1, .Tk = 8, .H = 1, .G = 1, .dk = &wd, .dv = &wd,
                             .scale = &scale, .block_table = ok, .pages_per_seq = 2,
                             .page_size = 4, .num_pages = 3};
    struct {
        mha_config c;
        mha_field field;
        const char *want;
    } cases[] = {
        {base, MHA_FIELD_BLOCK_TABLE, "block_table[0, 1] = 3 is not a page in [0, num_pages = 3)"},
        {base, MHA_FIELD_BLOCK_TABLE, "block_table[0, 0] = -1 is not a page"},
        {base, MHA_FIELD_PAGE_SIZE, "page_size = 0 is not in [1, MHA_MAX_ELEMS]"},
        {base, MHA_FIELD_BLOCK_TABLE, "hold 8 keys, fewer than Tk = 9"},
        {base, MHA_FIELD_BLOCK_TABLE, "block_table is NULL with pages_per_seq = 2"},
        {base, MHA_FIELD_BLOCK_TABLE, "num_pages = 0 is not in [1, "},
    };
    cases[0].c.block_table = bad;
    cases[1].c.block_table = neg;
    cases[2].c.page_size = 0;
    cases[3].c.Tk = 9;
    cases[4].c.block_table = NULL;
    cases[5].c.num_pages = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mha_error err;
        const mha_status st = mha_attend(&cases[i].c, &prm, &err);
        CHECK(st == MHA_ERR_ARG && err.field == cases[i].field &&
                  strstr(err.msg, cases[i].want) != NULL,
              "refusal %zu: status %d field %d msg '%s', want '%s'", i, (int)st,
              (int)err.field, err.msg, cases[i].want);
    }
    // The table is mha_attend's alone.
    mha_error err;
    mha_status st = mha_forward(&base, &prm, &err);
    CHECK(st == MHA_ERR_ARG && err.field == MHA_FIELD_BLOCK_TABLE &&
              strstr(err.msg, "mha_attend alone") != NULL,
          "forward with a block table: status %d msg '%s'", (int)st, err.msg);
    st = mha_attend(&base, &prm, &err);
    CHECK(st == MHA_OK, "a good table: status %d msg '%s'", (int)st, err.msg);
}

int main(int argc, char **argv)
{
    g_quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const pcase cases[] = {
        {"decode", 3, 4, 2, 1, 77, 19, 0, 0},
        {"decode weights", 3, 4, 2, 1, 77, 19, 0, 1},
        {"decode split", 2, 4, 1, 1, 2100, 64, 0, 0},
        {"prefill causal", 3, 2, 2, 5, 200, 33, 1, 0},
        {"prefill weights", 2, 6, 2, 5, 130, 16, 1, 1},
    };
    const mha_kv_storage kinds[] = {MHA_KV_PLAIN, MHA_KV_F16, MHA_KV_BF16, MHA_KV_I8};
    const size_t sizes[] = {1, 7, 16, 128};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (g_quick && cases[i].Tk > 1000)
            continue;
        for (size_t s = 0; s < 4; s++) {
            for (size_t k = 0; k < 4; k++)
                for (int shuffle = 0; shuffle < 2; shuffle++)
                    check_paged(&cases[i], kinds[k], 0, sizes[s], shuffle);
            check_paged(&cases[i], MHA_KV_PLAIN, 1, sizes[s], 1);
        }
    }
    test_refusals();
    printf("test_paged: %ld checks, %d failures\n", g_checks, g_failures);
    return g_failures != 0;
}
