/*
 * dispatch.c - run-time choice of the SIMD kernels (see dispatch.h).
 *
 * Detection is cpuid for what the CPU implements plus xgetbv for what the
 * OS saves on a context switch: a CPU may have AVX-512 while the kernel (or
 * a hypervisor) does not enable zmm state, and then the instructions fault.
 * On aarch64 there is nothing to detect: NEON is part of the base ISA.
 */
#include "dispatch.h"
#include "kernels.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* x86 detection, the one compiler-specific part of this file: <cpuid.h>
   and inline asm with gcc and clang, <intrin.h> with MSVC (clang-cl takes
   the MSVC branch). */
#if defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <intrin.h>
#define MHA_X86 1
/* leaf, subleaf -> eax, ebx, ecx, edx; 0 when leaf is past the maximum
   of its range (basic, or extended from 0x80000000) */
static int x86_cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    int v[4];
    __cpuid(v, (int)(leaf & 0x80000000u));
    if ((unsigned)v[0] < leaf)
        return 0;
    __cpuidex(v, (int)leaf, (int)sub);
    for (int i = 0; i < 4; i++)
        r[i] = (unsigned)v[i];
    return 1;
}
/* XCR0, the mask of register state the OS saves. MSVC's _xgetbv needs no
   target flag. */
static unsigned long long read_xcr0(void)
{
    return _xgetbv(0);
}
#elif defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MHA_X86 1
static int x86_cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    /* int in clang, unsigned in gcc */
    if ((unsigned)__get_cpuid_max(leaf & 0x80000000u, NULL) < leaf)
        return 0;
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    return 1;
}
/* XCR0, the mask of register state the OS saves. Inline asm rather than
   _xgetbv() so this file needs no -mxsave / target attribute. */
static unsigned long long read_xcr0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}
#endif

#if defined(__aarch64__)
#define MHA_AARCH64 1
#endif

/* The ISA in force under a cap `want`: the best this CPU has at or below
   it on this architecture's ladder (dispatch.h). aarch64's ladder is
   scalar < neon, so a cap of scalar is scalar, and any other (neon, or an
   x86 name) leaves NEON; on x86 the enum's order is the ladder, and neon,
   above it, caps nothing. */
static mha_isa isa_cap(mha_isa want, mha_isa detected)
{
#ifdef MHA_AARCH64
    return want == MHA_ISA_SCALAR ? MHA_ISA_SCALAR : detected;
#else
#if MHA_EMULATE_AVX512 && defined(MHA_HAVE_X86_KERNELS)
    /* the test build's emulated AVX-512 (isa_avx512.c) needs AVX2 + FMA */
    if (want == MHA_ISA_AVX512 && detected >= MHA_ISA_AVX2)
        return MHA_ISA_AVX512;
#endif
    return want < detected ? want : detected;
#endif
}

mha_isa mha_isa_detect(void)
{
#ifdef MHA_X86
    unsigned r[4]; /* eax, ebx, ecx, edx */
    if (!x86_cpuid(1, 0, r))
        return MHA_ISA_SCALAR;
    const unsigned c = r[2];
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1;
    /* F16C (half <-> float, the half precision rows of kernels.inc): every
       AVX2 CPU made has it, but it is a feature bit of its own, so the
       AVX2 path asks for it rather than assume it */
    const int f16c = (c >> 29) & 1;
    if (!osxsave || !avx || !fma || !f16c)
        return MHA_ISA_SCALAR;
    const unsigned long long xcr0 = read_xcr0();
    /* bit 1 SSE (xmm), bit 2 AVX (upper ymm) */
    if ((xcr0 & 0x6) != 0x6)
        return MHA_ISA_SCALAR;
    if (!x86_cpuid(7, 0, r))
        return MHA_ISA_SCALAR;
    const unsigned b = r[1];
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1;
    if (!avx2)
        return MHA_ISA_SCALAR;
    /* bits 5-7: opmask, upper halves of zmm0-15, zmm16-31 */
    if (avx512f && (xcr0 & 0xe6) == 0xe6)
        return MHA_ISA_AVX512;
    return MHA_ISA_AVX2;
#elif defined(MHA_AARCH64)
    return MHA_ISA_NEON;
#else
    return MHA_ISA_SCALAR;
#endif
}

/* SIZE_MAX: not yet read. cpuid is slow in a virtual machine (it traps to
   the hypervisor), so it is asked once; racing first calls store the same. */
static atomic_size_t g_l2 = SIZE_MAX;

size_t mha_l2_bytes(void)
{
    size_t l2 = atomic_load_explicit(&g_l2, memory_order_relaxed);
    if (l2 != SIZE_MAX)
        return l2;
    l2 = 0;
#ifdef MHA_X86
    /* AMD and Intel alike: ecx bits 31-16, the L2 of one core in KiB */
    unsigned r[4];
    if (x86_cpuid(0x80000006u, 0, r))
        l2 = (size_t)(r[2] >> 16) << 10;
#endif
    atomic_store_explicit(&g_l2, l2, memory_order_relaxed);
    return l2;
}

/* -1: not yet decided. Written once at first use (a benign race: every
   thread that races computes the same value) or by mha_set_isa. */
static atomic_int g_isa = -1;

static mha_isa isa_from_env(mha_isa detected)
{
    const char *s = getenv("MHATTN_ISA");
    mha_isa want = detected;
    if (s != NULL) {
        if (strcmp(s, "scalar") == 0)
            want = MHA_ISA_SCALAR;
        else if (strcmp(s, "avx2") == 0)
            want = MHA_ISA_AVX2;
        else if (strcmp(s, "avx512") == 0)
            want = MHA_ISA_AVX512;
        else if (strcmp(s, "neon") == 0)
            want = MHA_ISA_NEON;
        /* anything else (empty, misspelt) leaves the detected ISA */
    }
    return isa_cap(want, detected);
}

/* The ISA the call running on this thread pinned, or -1 (mha_isa_pin). */
static _Thread_local int tls_isa_pin = -1;

int mha_isa_pin(void)
{
    const int previous = tls_isa_pin;
    tls_isa_pin = (int)mha_get_isa();
    return previous;
}

void mha_isa_unpin(int previous) { tls_isa_pin = previous; }

mha_isa mha_get_isa(void)
{
    if (tls_isa_pin >= 0)
        return (mha_isa)tls_isa_pin;
    int isa = atomic_load_explicit(&g_isa, memory_order_relaxed);
    if (isa < 0) {
        int expected = -1;
        const int v = (int)isa_from_env(mha_isa_detect());
        /* if mha_set_isa got in first, keep its value */
        if (!atomic_compare_exchange_strong(&g_isa, &expected, v))
            return (mha_isa)expected;
        isa = v;
    }
    return (mha_isa)isa;
}

int mha_set_isa(mha_isa isa)
{
    const mha_isa detected = mha_isa_detect();
    int v = (int)isa;
    if (v < (int)MHA_ISA_SCALAR)
        v = MHA_ISA_SCALAR;
    if (v > (int)MHA_ISA_NEON)
        v = (int)MHA_ISA_NEON;
    v = (int)isa_cap((mha_isa)v, detected);
    atomic_store(&g_isa, v);
    return v;
}

const char *mha_isa_name(mha_isa isa)
{
    switch (isa) {
    case MHA_ISA_SCALAR: return "scalar";
    case MHA_ISA_AVX2: return "avx2";
    case MHA_ISA_AVX512: return "avx512";
    case MHA_ISA_NEON: return "neon";
    }
    return "unknown";
}

/* The only ISA switch of the core: each ISA's compile unit fills a table
   (kernels.h), and every driver asks here for the one in force. */
const mha_kernels *mha_kernels_for(mha_isa isa, int f64)
{
    switch (isa) {
#ifdef MHA_HAVE_X86_KERNELS
    case MHA_ISA_AVX512:
        return f64 ? &mha_kernels_avx512_f64 : &mha_kernels_avx512_f32;
    case MHA_ISA_AVX2:
        return f64 ? &mha_kernels_avx2_f64 : &mha_kernels_avx2_f32;
#endif
#ifdef MHA_HAVE_NEON_KERNELS
    case MHA_ISA_NEON:
        return f64 ? &mha_kernels_neon_f64 : &mha_kernels_neon_f32;
#endif
    default:
        return f64 ? &mha_kernels_ref_f64 : &mha_kernels_ref_f32;
    }
}
