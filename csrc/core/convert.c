/*
 * convert.c - mha_convert (contract in mha.h): whole buffers between
 * float32 and the half storage types, through the row converters of the
 * ISA in force (kernels.h: widen_f16 ... narrow_bf16), which reproduce
 * core/half.h bit for bit. What a caller uses to hand half values to the
 * float32 drivers and to round their results once.
 *
 * A large buffer is cut into fixed chunks of CHUNK elements shared by the
 * threads; each element's conversion is independent of the others, so the
 * bits never depend on the thread count.
 */
#include <stddef.h>
#include <stdint.h>

#include "dispatch.h"
#include "kernels.h"
#include "mha.h"
#include "threads.h"

/* 64 Ki elements: 256 KiB of float32, a chunk that sits in L2 and is
   long enough to hide a task's start. Below two chunks, one thread. */
#define CHUNK ((size_t)65536)

typedef void (*widen_fn)(float *dst, const uint16_t *src, size_t n);
typedef void (*narrow_fn)(uint16_t *dst, const float *src, size_t n);

typedef struct {
    widen_fn widen;   /* one of the two is set */
    narrow_fn narrow;
    void *dst;
    const void *src;
    size_t n;
} convert_job;

static void convert_chunk(void *ctx, size_t task, int ith)
{
    (void)ith;
    const convert_job *j = ctx;
    const size_t i0 = task * CHUNK;
    const size_t len = j->n - i0 < CHUNK ? j->n - i0 : CHUNK;
    if (j->widen != NULL)
        j->widen((float *)j->dst + i0, (const uint16_t *)j->src + i0, len);
    else
        j->narrow((uint16_t *)j->dst + i0, (const float *)j->src + i0, len);
}

mha_status mha_convert(void *dst, mha_dtype to, const void *src, mha_dtype from, size_t n)
{
    const mha_kernels *k = mha_kernels_for(mha_get_isa(), 0);
    convert_job j = {NULL, NULL, dst, src, n};
    if (to == MHA_DTYPE_F32 && from == MHA_DTYPE_F16)
        j.widen = k->widen_f16;
    else if (to == MHA_DTYPE_F32 && from == MHA_DTYPE_BF16)
        j.widen = k->widen_bf16;
    else if (to == MHA_DTYPE_F16 && from == MHA_DTYPE_F32)
        j.narrow = k->narrow_f16;
    else if (to == MHA_DTYPE_BF16 && from == MHA_DTYPE_F32)
        j.narrow = k->narrow_bf16;
    else
        return MHA_ERR_ARG;
    if (n == 0)
        return MHA_OK;
    if (dst == NULL || src == NULL)
        return MHA_ERR_ARG;
    const size_t ntasks = n / CHUNK + (n % CHUNK != 0);
    if (ntasks < 2) {
        convert_chunk(&j, 0, 0);
        return MHA_OK;
    }
    return mha_parallel_for(ntasks, convert_chunk, &j);
}
