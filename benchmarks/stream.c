/* stream.c: this machine's read bandwidth, for benchmarks/bench_decode.py.
 *
 * bench_decode.py compiles this file at start-up (cc -O2 -shared -fPIC),
 * loads it with ctypes and calls stream_read from n Python threads at once,
 * each on its own slice of one buffer (ctypes releases the GIL), so the
 * figure is the read rate of n cores streaming together: what a decode step
 * on n threads can at best read K and V at.
 *
 * stream_read sums n floats with 8 independent accumulators of 8 lanes
 * (AVX2, by a target attribute, where the CPU has it; plain C otherwise),
 * enough to keep the loads, not the adds, the limit. The sum is returned so
 * the compiler cannot drop the loop.
 */
#include <stddef.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("avx2"))) static float read_avx2(const float *a, size_t n)
{
    __m256 acc[8];
    for (int u = 0; u < 8; u++)
        acc[u] = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int u = 0; u < 8; u++)
            acc[u] = _mm256_add_ps(acc[u], _mm256_loadu_ps(a + i + 8 * u));
    for (int u = 1; u < 8; u++)
        acc[0] = _mm256_add_ps(acc[0], acc[u]);
    float lanes[8], s = 0;
    _mm256_storeu_ps(lanes, acc[0]);
    for (int u = 0; u < 8; u++)
        s += lanes[u];
    for (; i < n; i++)
        s += a[i];
    return s;
}
#endif

static float read_plain(const float *a, size_t n)
{
    float acc[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++)
            acc[u] += a[i + u];
    float s = 0;
    for (int u = 0; u < 8; u++)
        s += acc[u];
    for (; i < n; i++)
        s += a[i];
    return s;
}

/* The sum of a[0 .. n-1], read once, reps times over. */
float stream_read(const float *a, size_t n, int reps)
{
    float s = 0;
    for (int r = 0; r < reps; r++) {
#if defined(__x86_64__) || defined(__i386__)
        if (__builtin_cpu_supports("avx2")) {
            s += read_avx2(a, n);
            continue;
        }
#endif
        s += read_plain(a, n);
    }
    return s;
}
