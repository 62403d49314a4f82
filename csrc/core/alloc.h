/*
 * alloc.h - the core's scratch allocations, internal to csrc/.
 *
 * mha_scratch(&p, n, size) allocates n elements of `size` bytes, checks
 * the byte count, never asks for 0 bytes (so NULL always means failure),
 * and aligns the block to a cache line (64 bytes), which the SIMD kernels'
 * aligned loads and the per-thread padding assume. Free with
 * mha_scratch_free(), never free(): on Windows the block comes from
 * _aligned_malloc, which only _aligned_free may release (platform.h).
 *
 * Blocks of MHA_HUGE_MIN bytes and more are aligned to 2 MiB and advised
 * as transparent huge pages (Linux, where THP is in "madvise" mode, the
 * default of many distributions). glibc often hands such blocks back to
 * the OS on free, so a call touches fresh pages: on 4 KiB pages that is
 * one fault per page, on 2 MiB pages one per 512. Measured (float32,
 * d_model 512, 8 heads, 1 thread, a training-loop pattern that keeps the
 * context and the gradients alive): a backward at T = 1024 went from 2963
 * faults and a median of 53-55 ms to 243-268 faults and 46.6-46.9 ms.
 * The advice is only advice: where it is refused, or the OS has no such
 * call, the block is an ordinary one.
 *
 * Freed huge blocks are kept for reuse, at most 8 of them and 64 MiB in
 * all, and a later request takes the smallest kept block of at least its
 * size and at most twice it: so a loop of calls of one shape faults in its
 * scratch once, not on every call. Measured (forward, float32, T = 128,
 * B = 8, d_model 512, 2 threads): 16 page faults per call, each zeroing a
 * 2 MiB page, and 6% of the profile in clear_page, before; none per call
 * after. The kept blocks stay allocated until the process ends; blocks
 * that do not fit are freed as before. Off under AddressSanitizer.
 */
#ifndef MHA_ALLOC_H
#define MHA_ALLOC_H

#include <stddef.h>

#include "mha.h"

#define MHA_HUGE_MIN ((size_t)1 << 20)

mha_status mha_scratch(void **p, size_t n, size_t size);

/* The same, never on huge pages nor from the kept blocks: for small
   buffers that glibc keeps between calls. (The GEMM's packing buffer was
   one, when huge blocks were not yet kept: forward at T = 128, d_model
   512, float64, 2 threads, median 2.0 ms on fresh huge pages, 1.5 ms
   without. Kept, they are as fast, and glibc did not always keep it.) */
mha_status mha_scratch_small(void **p, size_t n, size_t size);

/* Frees a block of either; NULL is a no-op. */
void mha_scratch_free(void *p);

/* Bytes of huge blocks kept for reuse now (0 where the cache is off). */
size_t mha_scratch_kept(void);

#endif /* MHA_ALLOC_H */
