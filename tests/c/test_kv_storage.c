/*
 * test_kv_storage.c - mha_attend on a KV cache stored in float16, bfloat16
 * or int8 (mha_params.kv_storage, issue 36): the kernels widen each key
 * block as they read it, so a call on such a cache gives the bits of the
 * same call on float32 k and v holding the widened values (half: exact;
 * int8: (float)q * scale, the product the kernels form).
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   ./test_kv_storage [quick]  quick: the shorter caches only
 *
 * What is checked, on every ISA this machine runs and at 1 and 3 threads:
 *   - a cache of capacity C > Tk in its (B, G, C, d) layout, with per-item
 *     key lengths aligned bottom-right (a decode step: Tq = 1, split-K past
 *     1024 keys; a prefill chunk: Tq = 5, causal), GQA, and weights wanted
 *     or not (the one-row decode kernels or the packed tiles): out, lse and
 *     the weights equal the float32 call's bit for bit;
 *   - int8 with NaN and inf scales: the rows of items whose keys include
 *     that key are NaN, as they are with NaN keys in float32, and rows
 *     that never see it are not;
 *   - the decode kernels' GQA groups: a split-K decode step gives the bits
 *     of the same step with each kv head repeated for its query heads
 *     (check_group_bits);
 *   - the refusals, each MHA_ERR_ARG naming the field in its message: an
 *     unknown kv_storage, a half or int8 storage on a float64 call, int8
 *     without a scale, a scale without int8.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "mha.h"
#include "threads.h"

#include "harness.h"

static int g_quick;
static const int k_isas[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512, MHA_ISA_NEON};

typedef struct {
    const char *name;
    size_t B, H, G, Tq, Tk, C, d;
    int causal, weights;
} kcase;

/* One storage kind of one case: the float32 call on the widened values
   against the call on the storage, bit for bit, on every ISA and at 1 and
   3 threads. bad: a NaN scale at key 2 of (0, 0) and an inf one at key 3
   of item 1 (int8 only). */
static void check_kind(const kcase *K, mha_kv_storage kind, int bad)
{
    const size_t B = K->B, H = K->H, G = K->G, Tq = K->Tq, Tk = K->Tk, C = K->C, d = K->d;
    const size_t nq = B * H * Tq * d, nkv = B * G * C * d, ns = B * G * C;
    const size_t no = B * H * Tq * d, nw = B * H * Tq * Tk, nl = B * H * Tq;
    float *q = xcalloc(nq, 4), *kf = xcalloc(nkv, 4), *vf = xcalloc(nkv, 4);
    float *ksc = xcalloc(ns, 4), *vsc = xcalloc(ns, 4);
    uint16_t *kh = xcalloc(nkv, 2), *vh = xcalloc(nkv, 2);
    int8_t *ki = xcalloc(nkv, 1), *vi = xcalloc(nkv, 1);
    for (size_t i = 0; i < nq; i++)
        q[i] = (float)rng_unit();
    for (size_t i = 0; i < ns; i++) {
        ksc[i] = (float)(0.02 * (1.5 + rng_unit()));
        vsc[i] = (float)(0.02 * (1.5 + rng_unit()));
    }
    if (bad && kind == MHA_KV_I8) {
        ksc[2] = NAN;               // (b, g, j) = (0, 0, 2)
        vsc[G * C + 3] = INFINITY;  // (1, 0, 3)
    }
    for (size_t i = 0; i < nkv; i++) {
        const float x = (float)(2 * rng_unit()), y = (float)(2 * rng_unit());
        if (kind == MHA_KV_I8) {
            ki[i] = (int8_t)(rng_below(255) - 127), vi[i] = (int8_t)(rng_below(255) - 127);
            kf[i] = (float)ki[i] * ksc[i / d], vf[i] = (float)vi[i] * vsc[i / d];
        } else if (kind == MHA_KV_F16) {
            kh[i] = mha_f32_to_f16(x), vh[i] = mha_f32_to_f16(y);
            kf[i] = mha_f16_to_f32(kh[i]), vf[i] = mha_f16_to_f32(vh[i]);
        } else {
            kh[i] = mha_f32_to_bf16(x), vh[i] = mha_f32_to_bf16(y);
            kf[i] = mha_bf16_to_f32(kh[i]), vf[i] = mha_bf16_to_f32(vh[i]);
        }
    }
    decode_config D = decode_config_make(B, Tq, Tk, H, G, d, K->causal);
    const mha_config cfg = D.cfg;
    const mha_strides sq = {H * Tq * d, Tq * d, d}, skv = {G * C * d, C * d, d};
    const mha_strides ssc = {G * C, C, 1};
    float *o[2] = {xcalloc(no, 4), xcalloc(no, 4)}, *w[2] = {xcalloc(nw, 4), xcalloc(nw, 4)};
    float *l[2] = {xcalloc(nl, 4), xcalloc(nl, 4)};
    void *ks = kind == MHA_KV_I8 ? (void *)ki : kh;
    void *vs = kind == MHA_KV_I8 ? (void *)vi : vh;
    for (size_t ii = 0; ii < sizeof k_isas / sizeof k_isas[0]; ii++) {
        if (mha_set_isa(k_isas[ii]) != k_isas[ii])
            continue;
        for (int nth = 1; nth <= 3; nth += 2) {
            mha_set_num_threads(nth);
            const mha_params pf = {.dtype = MHA_DTYPE_F32, .out = o[0],
                                   .weights = K->weights ? w[0] : NULL, .lse = l[0],
                                   .q = q, .k = kf, .v = vf, .sq = sq, .sk = skv, .sv = skv,
                                   .so = sq};
            const mha_params ps = {.dtype = MHA_DTYPE_F32, .out = o[1],
                                   .weights = K->weights ? w[1] : NULL, .lse = l[1],
                                   .q = q, .k = ks, .v = vs, .sq = sq, .sk = skv, .sv = skv,
                                   .so = sq, .kv_storage = kind,
                                   .k_scale = kind == MHA_KV_I8 ? ksc : NULL,
                                   .v_scale = kind == MHA_KV_I8 ? vsc : NULL,
                                   .sks = ssc, .svs = ssc};
            mha_error err;
            mha_status st = mha_attend(&cfg, &pf, &err);
            CHECK(st == MHA_OK, "%s: float32 status %d", K->name, (int)st);
            st = mha_attend(&cfg, &ps, &err);
            CHECK(st == MHA_OK, "%s kind %d: status %d (%s)", K->name, (int)kind, (int)st,
                  err.msg);
            CHECK(memcmp(o[0], o[1], no * 4) == 0 && memcmp(l[0], l[1], nl * 4) == 0 &&
                      (!K->weights || memcmp(w[0], w[1], nw * 4) == 0),
                  "%s kind %d bad %d %s nth %d: not the float32 call's bits", K->name,
                  (int)kind, bad, mha_isa_name((mha_isa)k_isas[ii]), nth);
            if (bad && kind == MHA_KV_I8) {
                // Item 0's rows see key 2 (every row sees keys 0 .. 3):
                // NaN there; item 1's rows read the inf value scale of key
                // 3 with a weight != 0: not finite. Item B - 1 > 1: finite.
                int nan0 = 1, bad1 = 1, fine = 1;
                for (size_t h = 0; h < H / G; h++)
                    for (size_t c = 0; c < d; c++) {
                        nan0 &= isnan(o[1][(0 * H + h) * Tq * d + c]);
                        bad1 &= !isfinite(o[1][(1 * H + h) * Tq * d + c]);
                    }
                for (size_t i = (B - 1) * H * Tq * d; i < no; i++)
                    fine &= isfinite(o[1][i]);
                CHECK(nan0 && bad1 && fine, "%s: NaN / inf scales: nan0 %d bad1 %d fine %d",
                      K->name, nan0, bad1, fine);
            }
        }
    }
    mha_set_num_threads(0);
    mha_set_isa(MHA_ISA_AVX512);
    free(q), free(kf), free(vf), free(ksc), free(vsc), free(kh), free(vh), free(ki), free(vi);
    decode_config_free(&D);
    for (int i = 0; i < 2; i++)
        free(o[i]), free(w[i]), free(l[i]);
}

/* The decode kernels' GQA groups (flash.inc, flash_rows_hg: FLASH_HG query
   heads of a kv head read each key row once): a split-K decode step with
   H / G = hg query heads per kv head gives the bits of the same step with
   every kv head repeated for its query heads (G = H, one head at a time),
   for float32 rows and each storage kind, hg 4 and 6 (a whole group and
   the rest one by one), widths 64 and 19 (the leftover columns), per-head
   ALiBi slopes (the masks run per head between the two halves). */
static void check_group_bits(mha_kv_storage kind, size_t hg, size_t d)
{
    const size_t B = 2, G = 2, H = G * hg, Tk = 1500, C = 1600;
    const size_t es = kind == MHA_KV_PLAIN ? 4 : kind == MHA_KV_I8 ? 1 : 2;
    const size_t nq = B * H * d, nkv = B * G * C * d, nkr = B * H * C * d;
    float *q = xcalloc(nq, 4), *ksc = xcalloc(B * G * C, 4), *vsc = xcalloc(B * G * C, 4);
    float *ksr = xcalloc(B * H * C, 4), *vsr = xcalloc(B * H * C, 4);
    unsigned char *k = xcalloc(nkv, es), *v = xcalloc(nkv, es);
    unsigned char *kr = xcalloc(nkr, es), *vr = xcalloc(nkr, es);
    for (size_t i = 0; i < nq; i++)
        q[i] = (float)rng_unit();
    for (size_t i = 0; i < B * G * C; i++) {
        ksc[i] = (float)(0.02 * (1.5 + rng_unit()));
        vsc[i] = (float)(0.02 * (1.5 + rng_unit()));
    }
    for (size_t i = 0; i < nkv; i++) {
        const float x = (float)(2 * rng_unit()), y = (float)(2 * rng_unit());
        if (kind == MHA_KV_PLAIN) {
            memcpy(k + 4 * i, &x, 4), memcpy(v + 4 * i, &y, 4);
        } else if (kind == MHA_KV_I8) {
            k[i] = (unsigned char)(int8_t)(rng_below(255) - 127);
            v[i] = (unsigned char)(int8_t)(rng_below(255) - 127);
        } else {
            const uint16_t a = kind == MHA_KV_F16 ? mha_f32_to_f16(x) : mha_f32_to_bf16(x);
            const uint16_t c = kind == MHA_KV_F16 ? mha_f32_to_f16(y) : mha_f32_to_bf16(y);
            memcpy(k + 2 * i, &a, 2), memcpy(v + 2 * i, &c, 2);
        }
    }
    // (B, G, C, d) repeated to (B, H, C, d): query head h reads kv head h / hg
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < H; h++) {
            const size_t src = (b * G + h / hg) * C, dst = (b * H + h) * C;
            memcpy(kr + dst * d * es, k + src * d * es, C * d * es);
            memcpy(vr + dst * d * es, v + src * d * es, C * d * es);
            memcpy(ksr + dst, ksc + src, C * 4), memcpy(vsr + dst, vsc + src, C * 4);
        }
    // 1199 keys: a last block of 15 (a group of 3 keys, not 4)
    int64_t len[2] = {(int64_t)Tk, (int64_t)Tk - 301};
    size_t dk[24];
    double scale[24], slopes[24];
    for (size_t h = 0; h < H; h++)
        dk[h] = d, scale[h] = 1 / sqrt((double)d) * (1 + 0.1 * (double)h),
        slopes[h] = 0.01 * (double)(h + 1);
    mha_config cfg = {.B = B, .Tq = 1, .Tk = Tk, .H = H, .G = G, .dk = dk, .dv = dk,
                      .scale = scale, .alibi = slopes, .key_lengths = len,
                      .lengths_aligned = 1};
    float *o[2] = {xcalloc(nq, 4), xcalloc(nq, 4)}, *l[2] = {xcalloc(B * H, 4),
                                                             xcalloc(B * H, 4)};
    const mha_strides sq = {H * d, d, d};
    for (size_t ii = 0; ii < sizeof k_isas / sizeof k_isas[0]; ii++) {
        if (mha_set_isa(k_isas[ii]) != k_isas[ii])
            continue;
        for (int rep = 0; rep < 2; rep++) {
            const size_t Gr = rep ? H : G;
            const mha_strides skv = {Gr * C * d, C * d, d}, ssc = {Gr * C, C, 1};
            cfg.G = Gr;
            const int i8 = kind == MHA_KV_I8;
            const mha_params p = {.dtype = MHA_DTYPE_F32, .out = o[rep], .lse = l[rep],
                                  .q = q, .k = rep ? kr : k, .v = rep ? vr : v, .sq = sq,
                                  .sk = skv, .sv = skv, .so = sq, .kv_storage = kind,
                                  .k_scale = i8 ? (rep ? ksr : ksc) : NULL,
                                  .v_scale = i8 ? (rep ? vsr : vsc) : NULL,
                                  .sks = ssc, .svs = ssc};
            mha_error err;
            const mha_status st = mha_attend(&cfg, &p, &err);
            CHECK(st == MHA_OK, "group kind %d hg %zu: status %d (%s)", (int)kind, hg,
                  (int)st, err.msg);
        }
        CHECK(memcmp(o[0], o[1], nq * 4) == 0 && memcmp(l[0], l[1], B * H * 4) == 0,
              "group kind %d hg %zu d %zu %s: GQA decode is not the repeated heads' bits",
              (int)kind, hg, d, mha_isa_name((mha_isa)k_isas[ii]));
    }
    mha_set_isa(MHA_ISA_AVX512);
    free(q), free(ksc), free(vsc), free(ksr), free(vsr), free(k), free(v), free(kr), free(vr);
    for (int i = 0; i < 2; i++)
        free(o[i]), free(l[i]);
}

static void test_refusals(void)
{
    float q[8] = {0}, k[8] = {0}, out[8], sc[2] = {1, 1};
    int8_t k8[8] = {0};
    double dq[8] = {0}, dk8[8] = {0}, dout[8];
    size_t w = 4;
    double scale = 1;
    const mha_config cfg = {.B = 1, .Tq = 1, .Tk = 2, .H = 1, .G = 1, .dk = &w, .dv = &w,
                            .scale = &scale};
    const mha_strides s = {8, 8, 4}, ssc = {2, 2, 1};
    struct {
        mha_params p;
        const char *want;
    } cases[] = {
        {{.dtype = MHA_DTYPE_F32, .out = out, .q = q, .k = k, .v = k, .sq = s, .sk = s,
          .sv = s, .so = s, .kv_storage = (mha_kv_storage)7}, "kv_storage = 7"},
        {{.dtype = MHA_DTYPE_F64, .out = dout, .q = dq, .k = dk8, .v = dk8, .sq = s, .sk = s,
          .sv = s, .so = s, .kv_storage = MHA_KV_F16}, "needs dtype MHA_DTYPE_F32"},
        {{.dtype = MHA_DTYPE_F32, .out = out, .q = q, .k = k8, .v = k8, .sq = s, .sk = s,
          .sv = s, .so = s, .kv_storage = MHA_KV_I8, .k_scale = sc}, "v_scale is NULL"},
        {{.dtype = MHA_DTYPE_F32, .out = out, .q = q, .k = k, .v = k, .sq = s, .sk = s,
          .sv = s, .so = s, .kv_storage = MHA_KV_BF16, .v_scale = sc, .svs = ssc},
         "v_scale is given"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mha_error err;
        const mha_status st = mha_attend(&cfg, &cases[i].p, &err);
        CHECK(st == MHA_ERR_ARG && err.field == MHA_FIELD_PARAMS &&
                  strstr(err.msg, cases[i].want) != NULL,
              "refusal %zu: status %d field %d msg '%s', want '%s'", i, (int)st,
              (int)err.field, err.msg, cases[i].want);
    }
}

int main(int argc, char **argv)
{
    g_quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const kcase cases[] = {
        {"decode", 3, 4, 2, 1, 77, 100, 19, 0, 0},
        {"decode weights", 3, 4, 2, 1, 77, 100, 19, 0, 1},
        {"decode split", 2, 4, 1, 1, 2100, 2200, 64, 0, 0},
        {"decode split mha", 2, 3, 3, 1, 1500, 1600, 8, 0, 0},
        {"prefill causal", 3, 2, 2, 5, 200, 230, 33, 1, 0},
        {"prefill weights", 2, 6, 2, 5, 130, 140, 16, 1, 1},
    };
    const mha_kv_storage kinds[] = {MHA_KV_F16, MHA_KV_BF16, MHA_KV_I8};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (g_quick && cases[i].Tk > 1000)
            continue;
        for (size_t k = 0; k < 3; k++)
            check_kind(&cases[i], kinds[k], 0);
    }
    check_kind(&cases[0], MHA_KV_I8, 1);
    check_kind(&cases[4], MHA_KV_I8, 1);
    const mha_kv_storage all[] = {MHA_KV_PLAIN, MHA_KV_F16, MHA_KV_BF16, MHA_KV_I8};
    for (size_t k = 0; k < 4; k++)
        for (size_t hg = 4; hg <= 6; hg += 2)
            for (size_t d = 19; d <= 64; d += 45)
                check_group_bits(all[k], hg, d);
    test_refusals();
    printf("test_kv_storage: %ld checks, %d failures\n", g_checks, g_failures);
    return g_failures != 0;
}
