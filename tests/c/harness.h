/*
 * harness.h - what every C test here shares: a CHECK that counts checks
 * and failures (printing the first 40), reproducible random numbers
 * (xorshift64*), allocation that cannot fail, typed (float32 / float64)
 * copies of double arrays, a monotonic clock, threads that can be waited
 * for, and the naive attention reference (mha.h's contract, densely, in
 * double, one rule per line) that the attention tests compare the core
 * with. Include it once, after the system headers, from a test's single
 * compile unit.
 *
 * Everything OS-specific comes from the core's platform layer
 * (csrc/core/platform.h), so the tests build wherever the core does
 * (Linux, macOS, Windows).
 */
#ifndef MHA_TEST_HARNESS_H
#define MHA_TEST_HARNESS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "mha.h"
#include "platform.h"
#include "rules.h"   /* mha_rel_bucket: T5's buckets, held to transformers' in Python */

static int g_failures;
static long g_checks;

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        g_checks++;                                                           \
        if (!(cond)) {                                                        \
            g_failures++;                                                     \
            if (g_failures <= 40) {                                           \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);          \
                fprintf(stderr, __VA_ARGS__);                                 \
                fprintf(stderr, "\n");                                        \
            }                                                                 \
        }                                                                     \
    } while (0)

/* xorshift64*: reproducible inputs in [-1, 1) */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static inline uint64_t rng_u64(void)
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}
static inline double rng_unit(void)
{
    return (double)(rng_u64() >> 11) * 0x1p-53 * 2.0 - 1.0;
}
static inline size_t rng_below(size_t n) { return n ? (size_t)(rng_u64() % n) : 0; }

/* Seconds on a monotonic clock. */
static inline double now_s(void)
{
    return 1e-9 * (double)mha_now_ns();
}

/* calloc that exits the test (status 2) when memory runs out. */
static inline void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* n doubles, uniform in [lo, hi), each exactly a float (so that the
   float32 calls see the same values as the float64 ones). Drawn as
   mid + half * u: for lo = -hi, mid is 0 and half is hi exactly, so
   rand_vec(n, amp) has the bits of amp * u. */
static inline double *rand_range(size_t n, double lo, double hi)
{
    const double mid = 0.5 * (lo + hi), half = 0.5 * (hi - lo);
    double *v = xcalloc(n, sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = (double)(float)(mid + half * rng_unit());
    return v;
}

/* n doubles, uniform in [-amp, amp), each exactly a float. */
static inline double *rand_vec(size_t n, double amp)
{
    return rand_range(n, -amp, amp);
}

/* ------------------------------------------------------------------ */
/* Typed buffers: the core takes float32 or float64 arrays (f64 says    */
/* which) through void pointers; the tests keep their values in double. */

/* n zeroed elements of the type. */
static inline void *zalloc(size_t n, int f64)
{
    return xcalloc(n, f64 ? sizeof(double) : sizeof(float));
}

/* A typed copy of n doubles (f64: a plain copy; else each rounded to
   float, exact for values rand_range drew). */
static inline void *typed(const double *src, size_t n, int f64)
{
    void *dst = zalloc(n, f64);
    for (size_t i = 0; i < n; i++) {
        if (f64)
            ((double *)dst)[i] = src[i];
        else
            ((float *)dst)[i] = (float)src[i];
    }
    return dst;
}

/* Element i of a typed array, as a double. */
static inline double val(const void *a, size_t i, int f64)
{
    return f64 ? ((const double *)a)[i] : (double)((const float *)a)[i];
}

/* Do two typed arrays of n elements hold the same bits? Two NULLs (an
   output not asked for on either side) are the same; one NULL is not. */
static inline int same_bytes(const void *a, const void *b, size_t n, int f64)
{
    if (a == NULL || b == NULL)
        return a == b;
    return memcmp(a, b, n * (f64 ? sizeof(double) : sizeof(float))) == 0;
}

/* ------------------------------------------------------------------ */
/* Threads that can be waited for, on the platform layer's.            */

typedef struct {
    mha_mutex lock;
    mha_cond done;
    int left;
} harness_latch;

typedef struct {
    void (*fn)(void *);
    void *arg;
    harness_latch *latch;
} harness_job;

static inline void harness_job_run(void *p)
{
    harness_job *j = p;
    j->fn(j->arg);
    mha_mutex_lock(&j->latch->lock);
    if (--j->latch->left == 0)
        mha_cond_signal(&j->latch->done);
    mha_mutex_unlock(&j->latch->lock);
}

/* Runs fn(args[t]) for t < n (at most 16), each on a thread of its own
   (inline where a thread cannot be had), and returns when all are done. */
static inline void run_threads(int n, void (*fn)(void *), void *const *args)
{
    harness_latch latch;
    harness_job jobs[16];
    if (n > 16)
        n = 16;
    if (mha_mutex_init(&latch.lock) != 0 || mha_cond_init(&latch.done) != 0) {
        fprintf(stderr, "run_threads: no mutex / condition variable\n");
        exit(2);
    }
    latch.left = n;
    for (int t = 0; t < n; t++) {
        jobs[t] = (harness_job){fn, args[t], &latch};
        if (mha_thread_spawn(harness_job_run, &jobs[t]) != 0)
            harness_job_run(&jobs[t]);
    }
    mha_mutex_lock(&latch.lock);
    while (latch.left > 0)
        mha_cond_wait(&latch.done, &latch.lock);
    mha_mutex_unlock(&latch.lock);
    mha_cond_destroy(&latch.done);
    mha_mutex_destroy(&latch.lock);
}

/* ------------------------------------------------------------------ */
/* The reference: which keys a query sees and how a score is formed,   */
/* from mha.h's contract; then one row of softmax attention.            */
/* maskb / maskd: the bool / additive mask as dense (B, H, Tq, Tk)      */
/* arrays in double (the config's mask may be rebound to a float copy). */

/* Positions of query i and key j of batch item b (packed: within their
   sequence); 0 when j is in another packed sequence. */
static inline int ref_place(const mha_config *c, size_t b, size_t i, size_t j,
                            int64_t *pi, int64_t *pj)
{
    if (c->nseq > 0) {
        size_t s = 0;
        while (!(c->cu_q[s] <= (int64_t)i && (int64_t)i < c->cu_q[s + 1]))
            s++;
        const int64_t nq = c->cu_q[s + 1] - c->cu_q[s], nk = c->cu_k[s + 1] - c->cu_k[s];
        *pi = (int64_t)i - c->cu_q[s] + nk - nq;
        *pj = (int64_t)j - c->cu_k[s];
        return (int64_t)j >= c->cu_k[s] && (int64_t)j < c->cu_k[s + 1];
    }
    int64_t tk = (int64_t)c->Tk;
    if (c->lengths_aligned && c->key_lengths)
        tk = c->key_lengths[b];
    *pi = c->has_q_offset ? (int64_t)i + c->q_offset : (int64_t)i + tk - (int64_t)c->Tq;
    *pj = (int64_t)j;
    return 1;
}

/* Is key j visible from query i in batch item b, head h? */
static inline int ref_visible(const mha_config *c, const uint8_t *maskb, size_t b,
                              size_t h, size_t i, size_t j)
{
    int64_t pi, pj;
    if (!ref_place(c, b, i, j, &pi, &pj))
        return 0; /* another sequence's key */
    if (c->key_lengths && (int64_t)j >= c->key_lengths[b])
        return 0;
    if (c->causal && pj > pi)
        return 0;
    if (c->windowed && c->window_left >= 0 && pj < pi - c->window_left)
        return 0;
    if (c->windowed && c->window_right >= 0 && pj > pi + c->window_right)
        return 0;
    if (c->chunk > 0) { /* the same chunk, by floor division */
        const int64_t n = (int64_t)c->chunk;
        const int64_t ci = (pi >= 0 ? pi : pi - n + 1) / n, cj = pj / n;
        if (ci != cj)
            return 0;
    }
    if (c->key_mask && c->key_mask[b * c->Tk + j] == 0)
        return 0;
    if (c->mask_kind == MHA_MASK_BOOL &&
        maskb[((b * c->H + h) * c->Tq + i) * c->Tk + j] == 0)
        return 0;
    if (c->bm_block != NULL) { /* the block mask's entry, then its bit */
        const size_t bq = c->bm_bq, bk = c->bm_bk, nkb = (c->Tk + bk - 1) / bk;
        const int32_t v = c->bm_block[b * c->bm_bstride + h * c->bm_hstride +
                                      i / bq * nkb + j / bk];
        if (v == MHA_BM_EMPTY)
            return 0;
        if (v >= 0) {
            const size_t r = i % bq, col = j % bk;
            if (((c->bm_bits[((size_t)v * bq + r) * ((bk + 7) / 8) + col / 8] >> (col % 8)) &
                 1) == 0)
                return 0;
        }
    }
    return 1;
}

/* The score of (b, h, i, j) from the dot product q_i . k_j: scale, then
   softcap, then ALiBi and the additive mask. */
static inline double ref_score(const mha_config *c, double scale, const double *maskd,
                               size_t b, size_t h, size_t i, size_t j, double dot)
{
    double s = scale * dot;
    if (c->softcap > 0)
        s = c->softcap * tanh(s / c->softcap);
    if (c->alibi) {
        int64_t pi, pj;
        ref_place(c, b, i, j, &pi, &pj);
        s += -c->alibi[b * c->alibi_bstride + h] * (double)llabs(pi - pj);
    }
    if (c->rel_table) { /* T5's bias: a double table (rel_buckets, H) */
        int64_t pi, pj;
        ref_place(c, b, i, j, &pi, &pj);
        s += ((const double *)c->rel_table)[mha_rel_bucket(c, pj - pi) * c->H + h];
    }
    if (c->mask_kind == MHA_MASK_ADD)
        s += maskd[((b * c->H + h) * c->Tq + i) * c->Tk + j];
    return s;
}

/* One row of attention: query q_i (dk wide) of batch item b, head h,
   against keys k_j = k + j * kst (dk wide) and values v_j = v + j * vst
   (dv wide), j < Tk. sink: the head's sink logit or NULL. Writes the
   output row o (dv), the weights w (Tk; NULL: not wanted) and returns the
   lse: -inf, o = 0, w = 0 when no key is visible and there is no sink. */
static inline double ref_row(const mha_config *c, double scale, const uint8_t *maskb,
                             const double *maskd, const double *sink, size_t b,
                             size_t h, size_t i, const double *q_i, const double *k,
                             size_t kst, const double *v, size_t vst, size_t dk,
                             size_t dv, double *o, double *w)
{
    const size_t Tk = c->Tk;
    double *s = xcalloc(Tk, sizeof *s);
    double m = sink ? *sink : -INFINITY, Z = 0;
    for (size_t j = 0; j < Tk; j++) {
        s[j] = -INFINITY;
        if (!ref_visible(c, maskb, b, h, i, j))
            continue;
        double dot = 0;
        for (size_t d = 0; d < dk; d++)
            dot += q_i[d] * k[j * kst + d];
        s[j] = ref_score(c, scale, maskd, b, h, i, j, dot);
        m = s[j] > m ? s[j] : m;
    }
    if (sink)
        Z += exp(*sink - m);
    for (size_t j = 0; j < Tk; j++)
        Z += s[j] == -INFINITY ? 0 : exp(s[j] - m);
    for (size_t d = 0; d < dv; d++)
        o[d] = 0;
    for (size_t j = 0; j < Tk; j++) {
        const double p = Z == 0 || s[j] == -INFINITY ? 0 : exp(s[j] - m) / Z;
        if (w != NULL)
            w[j] = p;
        for (size_t d = 0; p != 0 && d < dv; d++)
            o[d] += p * v[j * vst + d];
    }
    free(s);
    return Z == 0 ? -INFINITY : m + log(Z);
}

/* A decode test's config over a cache (test_kv_storage.c, test_paged.c):
   B sequences of Tk keys, item b of length Tk - b (Tk / (2B)) (lengths
   aligned, so each query sits at its item's end), H query heads over G kv
   heads of width d, scale 1/sqrt(d). The arrays it points at are the
   struct's own: free them with decode_config_free. */
typedef struct {
    mha_config cfg;
    int64_t *len;
    size_t *dk;
    double *scale;
} decode_config;

static inline decode_config decode_config_make(size_t B, size_t Tq, size_t Tk, size_t H,
                                               size_t G, size_t d, int causal)
{
    decode_config D;
    D.len = xcalloc(B, sizeof *D.len);
    for (size_t b = 0; b < B; b++)
        D.len[b] = (int64_t)(Tk - b * (Tk / (2 * B)));
    D.dk = xcalloc(G, sizeof *D.dk);
    for (size_t g = 0; g < G; g++)
        D.dk[g] = d;
    D.scale = xcalloc(H, sizeof *D.scale);
    for (size_t h = 0; h < H; h++)
        D.scale[h] = 1 / sqrt((double)d);
    D.cfg = (mha_config){.B = B, .Tq = Tq, .Tk = Tk, .H = H, .G = G, .dk = D.dk,
                         .dv = D.dk, .scale = D.scale, .causal = causal,
                         .key_lengths = D.len, .lengths_aligned = 1};
    return D;
}

static inline void decode_config_free(decode_config *D)
{
    free(D->len), free(D->dk), free(D->scale);
}

/* The best ISA mha_set_isa selects here, which the tests' loops over ISAs
   run up to: the CPU's (mha_isa_detect), or, in a build with the emulated
   AVX-512 (-DMHA_EMULATE_AVX512=1, csrc/kernels/simd_emu512.h), avx512 on
   an AVX2 CPU. Probed through mha_set_isa; the ISA in force is kept. */
static inline mha_isa harness_best_isa(void)
{
    const mha_isa before = mha_get_isa();
    const mha_isa best = (mha_isa)mha_set_isa(MHA_ISA_AVX512);
    mha_set_isa(before);
    return best;
}

#endif /* MHA_TEST_HARNESS_H */
