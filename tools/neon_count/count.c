/* One call of the core, repeated `reps` times (0 = setup only), for
   instruction counting under qemu: count op f64 reps */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dispatch.h"
#include "gemm.h"
#include "mha.h"
#include "threads.h"

static double *rnd(size_t n)
{
    double *p = malloc((n ? n : 1) * sizeof *p);
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        p[i] = (double)(s >> 11) * 0x1p-53 - 0.5;
    }
    return p;
}
static void *typed(const double *d, size_t n, int f64)
{
    void *p = malloc((n ? n : 1) * (f64 ? 8 : 4));
    for (size_t i = 0; i < n; i++) {
        if (f64) ((double *)p)[i] = d[i];
        else ((float *)p)[i] = (float)d[i];
    }
    return p;
}
#define T(n) typed(rnd(n), n, f64)
#define Z(n) calloc((size_t)(n) + 1, f64 ? 8 : 4)

int main(int argc, char **argv)
{
    const char *op = argv[1];
    const int f64 = atoi(argv[2]), reps = atoi(argv[3]);
    mha_set_num_threads(1);
    size_t dk[2] = {64, 64}, dv[2] = {64, 64};
    double scale[8];
    for (int h = 0; h < 8; h++) scale[h] = 0.125;
    mha_config c;
    memset(&c, 0, sizeof c);
    if (strcmp(op, "gemm") == 0) {
        const size_t M = 192, N = 192, K = 256;
        void *A = T(M * K), *B = T(K * N), *C = Z(M * N);
        for (int r = 0; r < reps; r++)
            f64 ? mha_gemm_f64(C, N, A, K, 0, B, N, 0, NULL, M, N, K, 0)
                : mha_gemm_f32(C, N, A, K, 0, B, N, 0, NULL, M, N, K, 0);
        printf("%s\n", mha_isa_name(mha_get_isa()));
        return 0;
    }
    if (strcmp(op, "decode") == 0) {
        /* mha_attend, Tq = 1, Tk = 2048, H = 8, G = 2, d = 64: split-K decode */
        c.Dout = 8 * 64, c.B = 1, c.Tq = 1, c.Tk = 2048, c.H = 8, c.G = 2, c.dk = dk, c.dv = dv, c.scale = scale;
        void *q = T(8 * 64), *k = T(2 * 2048 * 64), *v = T(2 * 2048 * 64), *o = Z(8 * 64);
        const mha_strides sq = {8 * 64, 64, 64}, sk = {2 * 2048 * 64, 2048 * 64, 64};
        const mha_strides so = {8 * 64, 64, 64};
        const mha_params prm = {.dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .out = o, .q = q,
                                .k = k, .v = v, .sq = sq, .sk = sk, .sv = sk, .so = so};
        for (int r = 0; r < reps; r++)
            printf("st %d\n", mha_attend(&c, &prm, NULL));
        printf("%s\n", mha_isa_name(mha_get_isa()));
        return 0;
    }
    /* attention only (no projections: fwd/bwd of mha_attend via identity
       would still run GEMMs), so mha_attend for "fwd" with Tq = Tk = 256,
       H = 4, d = 64, causal; "bwd": mha_attend_backward of the same */
    const size_t Tq = 256, Tk = 256, H = 4;
    c.Dout = H * 64, c.B = 1, c.Tq = Tq, c.Tk = Tk, c.H = H, c.G = H, c.dk = (size_t[]){64, 64, 64, 64};
    c.dv = (size_t[]){64, 64, 64, 64}, c.scale = scale, c.causal = 1;
    const size_t S = H * 64;
    void *q = T(Tq * S), *k = T(Tk * S), *v = T(Tk * S), *o = Z(Tq * S), *lse = Z(H * Tq);
    const mha_strides st = {Tq * S, 64, S};
    /* One params struct: mha_attend's out and lse are what the backward
       reads; its fused layout is the same (B = 1, bthd). */
    mha_params prm = {.dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .out = o, .lse = lse,
                      .q = q, .k = k, .v = v, .sq = st, .sk = st, .sv = st, .so = st};
    mha_attend(&c, &prm, NULL);
    if (strcmp(op, "fwd") == 0) {
        for (int r = 0; r < reps; r++)
            mha_attend(&c, &prm, NULL);
    } else {
        prm.dout = T(Tq * S), prm.dq = Z(Tq * S), prm.dk = Z(Tk * S), prm.dv = Z(Tk * S);
        for (int r = 0; r < reps; r++)
            printf("st %d\n", mha_attend_backward(&c, &prm, NULL));
    }
    printf("%s\n", mha_isa_name(mha_get_isa()));
    return 0;
}
