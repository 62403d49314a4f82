/*
 * dispatch.h - which SIMD kernels the core runs.
 *
 * The instruction set is detected once (cpuid + xgetbv on x86; NEON on
 * every aarch64 CPU), then capped once by the environment variable
 * MHATTN_ISA=scalar|avx2|avx512|neon at first use. A cap above what the CPU
 * (and the OS, for the wide register state) supports is lowered to what it
 * supports, so forcing is only ever downward. Each architecture has its own
 * ladder, scalar < avx2 < avx512 on x86 and scalar < neon on aarch64; a
 * name from another architecture's ladder caps nothing (it is, like any
 * ISA this CPU lacks, lowered to the best this CPU has).
 */
#ifndef MHA_DISPATCH_H
#define MHA_DISPATCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    MHA_ISA_SCALAR = 0, /* portable C, always compiled and always tested */
    MHA_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C, OS support for ymm state   */
    MHA_ISA_AVX512 = 2, /* AVX-512F (+ the above), OS support for zmm    */
    MHA_ISA_NEON = 3,   /* AArch64 Advanced SIMD: every aarch64 CPU      */
} mha_isa;

/* The best ISA this CPU and OS support (ignores the environment). */
mha_isa mha_isa_detect(void);

/* The ISA in force: detected, capped by MHATTN_ISA (read once, at the
   first call), or by the last mha_set_isa; on a thread inside a call, the
   ISA that call pinned (mha_isa_pin). Cheap: a thread-local and an atomic
   load. */
mha_isa mha_get_isa(void);

/* A call runs on one ISA: mha_isa_pin reads the ISA in force and makes
   this thread's mha_get_isa return it, whatever mha_set_isa does from
   other threads, until mha_isa_unpin(the value mha_isa_pin returned)
   restores the pin before it (-1: none; calls may nest). The entry points
   pin for the whole call (mha_call_typed), so that every step of it (the
   forward's half-weight panels, packed for one ISA and then multiplied by
   GEMMs that each read the ISA again) agrees on it. */
int mha_isa_pin(void);
void mha_isa_unpin(int previous);

/* Caps the ISA at run time (for tests): the ISA in force becomes
   min(isa, mha_isa_detect()); the environment cap is replaced, so a test
   may go back up to the detected ISA. Returns the ISA now in force. */
int mha_set_isa(mha_isa isa);

/* The L2 cache of one core in bytes (cpuid leaf 0x80000006 on x86), or 0
   where it is not known (other architectures, or an x86 CPU or hypervisor
   that does not say). Only speed may depend on it, never bits. */
size_t mha_l2_bytes(void);

/* "scalar", "avx2", "avx512", "neon" ("unknown" for anything else). */
const char *mha_isa_name(mha_isa isa);

#ifdef __cplusplus
}
#endif

#endif /* MHA_DISPATCH_H */
