/*
 * harness.h - what every C test here shares: a CHECK that counts checks
 * and failures (printing the first 40), reproducible random numbers
 * (xorshift64*) and a monotonic clock. Include it once, after the system
 * headers, from a test's single compile unit.
 */
#ifndef MHA_TEST_HARNESS_H
#define MHA_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>

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
static uint64_t rng_u64(void)
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

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* MHA_TEST_HARNESS_H */
