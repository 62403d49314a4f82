/*
 * isa_target.h - compile a region of a file for an ISA the rest of the
 * build does not assume, with no per-file flags in any build:
 *
 *     #include <immintrin.h>   (every system header, before the region)
 *     #include "isa_target.h"
 *     MHA_TARGET_BEGIN("avx2,fma")
 *     ... every function defined here is compiled for AVX2 + FMA ...
 *     MHA_TARGET_END
 *
 * The ISA string is the one gcc and clang take in
 * __attribute__((target(...))):
 *   clang  #pragma clang attribute push(__attribute__((target(isa))),
 *          apply_to = function) ... pop (clang ignores #pragma GCC target),
 *          in the namespace "mha" so that it cannot pop someone else's;
 *   gcc    #pragma GCC push_options / target(isa) ... pop_options;
 *   MSVC   nothing: its intrinsics compile without /arch, and /arch would
 *          let it use the ISA in the portable code of the same file too.
 * Code in the region runs only where dispatch.c found the ISA. Why system
 * headers come first: a function a header defines inside the region gets
 * the ISA too, so a call from outside the region would run ISA code
 * unchecked, or fail to compile (gcc's intrinsics).
 */
#ifndef MHA_ISA_TARGET_H
#define MHA_ISA_TARGET_H

#define MHA_PRAGMA(text) _Pragma(#text)

#if defined(__clang__)
#define MHA_TARGET_BEGIN(isa)                                                 \
    MHA_PRAGMA(clang attribute mha.push(__attribute__((target(isa))),         \
                                        apply_to = function))
#define MHA_TARGET_END MHA_PRAGMA(clang attribute mha.pop)
#elif defined(__GNUC__)
#define MHA_TARGET_BEGIN(isa)                                                 \
    MHA_PRAGMA(GCC push_options) MHA_PRAGMA(GCC target(isa))
#define MHA_TARGET_END MHA_PRAGMA(GCC pop_options)
#else
#define MHA_TARGET_BEGIN(isa)
#define MHA_TARGET_END
#endif

#endif /* MHA_ISA_TARGET_H */
