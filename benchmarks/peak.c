/* peak.c: this machine's fused multiply-add peak, for benchmarks/bench.py.
 *
 * bench.py compiles this file at start-up (cc -O2 -shared -fPIC), loads it
 * with ctypes and times peak_fma_f32 / peak_fma_f64 itself, so that the
 * benchmark's "% of peak" is measured on the same machine, in the same run,
 * as the figures it is compared with.  ctypes releases the GIL around the
 * call, so several Python threads calling it at once measure the multi-core
 * peak directly.
 *
 * Each routine runs NACC independent chains acc = acc * m + a.  An FMA has a
 * latency of 4 to 5 cycles on recent x86 cores and two FMA pipes can each
 * start one per cycle, so at least 8 to 10 chains must be in flight to keep
 * both pipes busy; 12 accumulators plus the two constants fit in the 16 ymm
 * registers of AVX2.  m = 1 - 2^-20 and a small keep the values bounded and
 * normal (no denormal slow-down, no overflow), and the result is returned so
 * the compiler cannot drop the loop.
 *
 * The AVX-512F and AVX2+FMA variants are compiled with target attributes,
 * not a global -mavx512f or -mavx2, so the file builds with plain "cc -O2"
 * and the scalar fallback runs anywhere; peak_isa() says which one
 * peak_fma_* used: the widest the CPU runs, because that is the machine's
 * peak.  (Some cores split a 512-bit FMA into two 256-bit halves and peak
 * no higher with AVX-512 than with AVX2; others, such as AMD Zen 5, have
 * full-width pipes and peak twice as high.  Measuring settles it.)
 *
 * Floating-point operations per call: iters * peak_flops_per_iter(dtype).
 */
#include <stddef.h>

#define NACC 12

#if defined(__x86_64__) || defined(__i386__)
#define PEAK_X86 1
#include <immintrin.h>
#endif

/* ---- scalar fallback: NACC independent chains of a*m + a ---------------- */

static float peak_f32_scalar(long iters, float m, float a)
{
    float acc[NACC];
    for (int i = 0; i < NACC; i++)
        acc[i] = 1.0f + (float)i;
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < NACC; i++)
            acc[i] = acc[i] * m + a;
    float s = 0.0f;
    for (int i = 0; i < NACC; i++)
        s += acc[i];
    return s;
}

static double peak_f64_scalar(long iters, double m, double a)
{
    double acc[NACC];
    for (int i = 0; i < NACC; i++)
        acc[i] = 1.0 + (double)i;
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < NACC; i++)
            acc[i] = acc[i] * m + a;
    double s = 0.0;
    for (int i = 0; i < NACC; i++)
        s += acc[i];
    return s;
}

/* ---- AVX2 + FMA: 12 ymm accumulators, written out so that each lives in
 * its own register (an array indexed in a loop may be spilled at -O2). ---- */

#ifdef PEAK_X86
#define FMA12(F, m, a)                                                       \
    a0 = F(a0, m, a); a1 = F(a1, m, a); a2 = F(a2, m, a); a3 = F(a3, m, a);  \
    a4 = F(a4, m, a); a5 = F(a5, m, a); a6 = F(a6, m, a); a7 = F(a7, m, a);  \
    a8 = F(a8, m, a); a9 = F(a9, m, a); a10 = F(a10, m, a); a11 = F(a11, m, a)

__attribute__((target("avx2,fma")))
static float peak_f32_avx2(long iters, float mf, float af)
{
    const __m256 m = _mm256_set1_ps(mf), a = _mm256_set1_ps(af);
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = _mm256_set1_ps(2.0f),
           a2 = _mm256_set1_ps(3.0f), a3 = _mm256_set1_ps(4.0f),
           a4 = _mm256_set1_ps(5.0f), a5 = _mm256_set1_ps(6.0f),
           a6 = _mm256_set1_ps(7.0f), a7 = _mm256_set1_ps(8.0f),
           a8 = _mm256_set1_ps(9.0f), a9 = _mm256_set1_ps(10.0f),
           a10 = _mm256_set1_ps(11.0f), a11 = _mm256_set1_ps(12.0f);
    for (long it = 0; it < iters; it++) {
        FMA12(_mm256_fmadd_ps, m, a);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    float t = 0.0f;
    for (int i = 0; i < 8; i++)
        t += lanes[i];
    return t;
}

__attribute__((target("avx2,fma")))
static double peak_f64_avx2(long iters, double mf, double af)
{
    const __m256d m = _mm256_set1_pd(mf), a = _mm256_set1_pd(af);
    __m256d a0 = _mm256_set1_pd(1.0), a1 = _mm256_set1_pd(2.0),
            a2 = _mm256_set1_pd(3.0), a3 = _mm256_set1_pd(4.0),
            a4 = _mm256_set1_pd(5.0), a5 = _mm256_set1_pd(6.0),
            a6 = _mm256_set1_pd(7.0), a7 = _mm256_set1_pd(8.0),
            a8 = _mm256_set1_pd(9.0), a9 = _mm256_set1_pd(10.0),
            a10 = _mm256_set1_pd(11.0), a11 = _mm256_set1_pd(12.0);
    for (long it = 0; it < iters; it++) {
        FMA12(_mm256_fmadd_pd, m, a);
    }
    __m256d s = _mm256_add_pd(_mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)),
                              _mm256_add_pd(_mm256_add_pd(a4, a5), _mm256_add_pd(a6, a7)));
    s = _mm256_add_pd(s, _mm256_add_pd(_mm256_add_pd(a8, a9), _mm256_add_pd(a10, a11)));
    double lanes[4];
    _mm256_storeu_pd(lanes, s);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}


/* ---- AVX-512F: the same 12 chains on zmm registers (32 exist). -------- */

/* The 12 float accumulators a0 .. a11 (1, 2, ..., 12) of the zmm chains,
   and their sum (for peak_f32_avx512 and peak_dpbf16_avx512). */
#define ZMM12_F32                                                            \
    __m512 a0 = _mm512_set1_ps(1.0f), a1 = _mm512_set1_ps(2.0f),             \
           a2 = _mm512_set1_ps(3.0f), a3 = _mm512_set1_ps(4.0f),             \
           a4 = _mm512_set1_ps(5.0f), a5 = _mm512_set1_ps(6.0f),             \
           a6 = _mm512_set1_ps(7.0f), a7 = _mm512_set1_ps(8.0f),             \
           a8 = _mm512_set1_ps(9.0f), a9 = _mm512_set1_ps(10.0f),            \
           a10 = _mm512_set1_ps(11.0f), a11 = _mm512_set1_ps(12.0f)
#define ZMM12_SUM_F32()                                                      \
    _mm512_reduce_add_ps(_mm512_add_ps(                                      \
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), \
                      _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))), \
        _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))))

__attribute__((target("avx512f")))
static float peak_f32_avx512(long iters, float mf, float af)
{
    const __m512 m = _mm512_set1_ps(mf), a = _mm512_set1_ps(af);
    ZMM12_F32;
    for (long it = 0; it < iters; it++) {
        FMA12(_mm512_fmadd_ps, m, a);
    }
    return ZMM12_SUM_F32();
}

__attribute__((target("avx512f")))
static double peak_f64_avx512(long iters, double mf, double af)
{
    const __m512d m = _mm512_set1_pd(mf), a = _mm512_set1_pd(af);
    __m512d a0 = _mm512_set1_pd(1.0), a1 = _mm512_set1_pd(2.0),
            a2 = _mm512_set1_pd(3.0), a3 = _mm512_set1_pd(4.0),
            a4 = _mm512_set1_pd(5.0), a5 = _mm512_set1_pd(6.0),
            a6 = _mm512_set1_pd(7.0), a7 = _mm512_set1_pd(8.0),
            a8 = _mm512_set1_pd(9.0), a9 = _mm512_set1_pd(10.0),
            a10 = _mm512_set1_pd(11.0), a11 = _mm512_set1_pd(12.0);
    for (long it = 0; it < iters; it++) {
        FMA12(_mm512_fmadd_pd, m, a);
    }
    __m512d s = _mm512_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)),
                              _mm512_add_pd(_mm512_add_pd(a4, a5), _mm512_add_pd(a6, a7)));
    s = _mm512_add_pd(s, _mm512_add_pd(_mm512_add_pd(a8, a9), _mm512_add_pd(a10, a11)));
    return _mm512_reduce_add_pd(s);
}

/* ---- AVX512-BF16: vdpbf16ps, 32 bfloat16 products summed in pairs into
 * 16 float lanes, on 12 zmm chains. Not an FMA peak: half_precision.py
 * sets its multiply-add rate beside vfmadd231ps's, the figure that decides
 * whether a bfloat16 kernel would gain by it (on some cores it issues at a
 * quarter of vfmadd231ps's rate, and so does half the multiply-adds). x is
 * bfloat16 1.0, y 2^-20: the sums grow slowly and stay normal. Built only
 * by compilers that know the instruction (gcc 10, clang 9 and later). -- */

#if defined(__clang__) ? __clang_major__ >= 9 : (defined(__GNUC__) && __GNUC__ >= 10)
#define PEAK_DPBF16 1
#define DP12(x, y)                                                           \
    a0 = _mm512_dpbf16_ps(a0, x, y); a1 = _mm512_dpbf16_ps(a1, x, y);        \
    a2 = _mm512_dpbf16_ps(a2, x, y); a3 = _mm512_dpbf16_ps(a3, x, y);        \
    a4 = _mm512_dpbf16_ps(a4, x, y); a5 = _mm512_dpbf16_ps(a5, x, y);        \
    a6 = _mm512_dpbf16_ps(a6, x, y); a7 = _mm512_dpbf16_ps(a7, x, y);        \
    a8 = _mm512_dpbf16_ps(a8, x, y); a9 = _mm512_dpbf16_ps(a9, x, y);        \
    a10 = _mm512_dpbf16_ps(a10, x, y); a11 = _mm512_dpbf16_ps(a11, x, y)

__attribute__((target("avx512f,avx512bf16")))
static float peak_dpbf16_avx512(long iters)
{
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);   /* 1.0   */
    const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3580);   /* 2^-20 */
    ZMM12_F32;
    for (long it = 0; it < iters; it++) {
        DP12(x, y);
    }
    return ZMM12_SUM_F32();
}
#endif

static int have_avx2_fma(void)
{
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached;
}

/* AVX-512F, with the OS saving zmm state (gcc's check looks at XCR0 too). */
static int have_avx512(void)
{
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f");
    }
    return cached;
}
#else
static int have_avx2_fma(void) { return 0; }
static int have_avx512(void) { return 0; }
#endif

/* ---- exported ---------------------------------------------------------- */

/* 3 when the AVX-512F variants run, 2 for AVX2+FMA, 0 for the scalar
 * fallback (always, when force_scalar is set: bench.py --scalar-peak). */
int peak_isa(int force_scalar)
{
    if (force_scalar)
        return 0;
    return have_avx512() ? 3 : have_avx2_fma() ? 2 : 0;
}

/* Floating-point operations one iteration performs (2 per FMA lane). */
long peak_flops_per_iter(int dtype_bytes, int force_scalar)
{
    const int isa = peak_isa(force_scalar);
    long lanes = 1;
    if (isa >= 2)
        lanes = (dtype_bytes == 4 ? 8 : 4) * (isa == 3 ? 2 : 1);
    return 2L * NACC * lanes;
}

double peak_fma_f32(long iters, int force_scalar)
{
    const float m = 1.0f - 1.0f / (1 << 20), a = 1.0f / (1 << 10);
#ifdef PEAK_X86
    if (peak_isa(force_scalar) == 3)
        return (double)peak_f32_avx512(iters, m, a);
    if (peak_isa(force_scalar) == 2)
        return (double)peak_f32_avx2(iters, m, a);
#endif
    return (double)peak_f32_scalar(iters, m, a);
}

double peak_fma_f64(long iters, int force_scalar)
{
    const double m = 1.0 - 1.0 / (1 << 20), a = 1.0 / (1 << 10);
#ifdef PEAK_X86
    if (peak_isa(force_scalar) == 3)
        return peak_f64_avx512(iters, m, a);
    if (peak_isa(force_scalar) == 2)
        return peak_f64_avx2(iters, m, a);
#endif
    return peak_f64_scalar(iters, m, a);
}

/* 1 when peak_dpbf16 runs vdpbf16ps (the CPU has AVX512-BF16 and this
 * compiler knows it), else 0. */
int peak_dpbf16_ok(void)
{
#if defined(PEAK_X86) && defined(PEAK_DPBF16)
    __builtin_cpu_init();
    return have_avx512() && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* Floating-point operations of one peak_dpbf16 iteration: 12 vdpbf16ps of
 * 32 multiply-adds each. */
long peak_dpbf16_flops_per_iter(void) { return 2L * NACC * 32; }

/* The vdpbf16ps chains (0 where peak_dpbf16_ok() is 0); force_scalar is
 * taken as peak_fma_f32's is, and ignored. */
double peak_dpbf16(long iters, int force_scalar)
{
    (void)force_scalar;
#if defined(PEAK_X86) && defined(PEAK_DPBF16)
    if (peak_dpbf16_ok())
        return (double)peak_dpbf16_avx512(iters);
#endif
    (void)iters;
    return 0.0;
}
