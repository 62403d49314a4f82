/*
 * check.h - how the core's checks report a rejection (mha_error, mha.h),
 * internal to csrc/core/. mha_check_config (config.c) checks a config; the
 * entry points (forward_impl.h, backward_impl.h, project_impl.h) check
 * their mha_params with these, so every rejection reaches the caller the
 * same way: a status, a field id and a message with the values seen.
 */
#ifndef MHA_CHECK_H
#define MHA_CHECK_H

#include <stddef.h>

#include "mha.h"

#if defined(__GNUC__) || defined(__clang__)
#define MHA_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define MHA_PRINTF(f, a)
#endif

/* Returns st, having written field and the formatted message into *err
   (when err is not NULL; the message is cut at 255 characters). */
mha_status mha_reject(mha_error *err, mha_status st, mha_field field, const char *fmt, ...)
    MHA_PRINTF(4, 5);

/* Clears *err (field NONE, empty message); err may be NULL. */
void mha_error_clear(mha_error *err);

/* An entry point for one element type (mha_forward_f32, ...). */
typedef mha_status (*mha_typed_fn)(const mha_config *cfg, const mha_params *prm,
                                   mha_error *err);

/* What an operation reads beyond plain, contiguous operands (mha_call_typed's
   `reads`): half weights (the forward), a paged cache's block table
   (mha_attend alone). */
enum { MHA_READS_HALF_WEIGHTS = 1, MHA_READS_PAGES = 2 };

/* An entry point of mha.h: clears *err, checks that there are a config and
   params of a known dtype, plain weights (mha_params.w_storage) unless reads
   has MHA_READS_HALF_WEIGHTS, and no block table unless it has
   MHA_READS_PAGES, then runs f32 or f64 as prm->dtype says. */
mha_status mha_call_typed(const mha_config *cfg, const mha_params *prm, mha_error *err,
                          mha_typed_fn f32, mha_typed_fn f64, unsigned reads);

/* MHA_OK when the q/k transforms are off, as attention alone (mha_attend,
   mha_attend_backward) needs: they belong to the projections. */
mha_status mha_check_no_qk(const mha_config *cfg, mha_error *err);

/* A buffer a call needs: NULL only when it holds no element. */
typedef struct {
    const void *p;
    int needed;         /* nonzero: the call reads or writes elements */
    const char *name;   /* its field in mha_params                  */
} mha_required;

/* MHA_OK, or MHA_ERR_ARG naming the first of the n buffers that is NULL
   though needed. */
mha_status mha_check_required(const mha_required *r, size_t n, mha_error *err);

#endif /* MHA_CHECK_H */
