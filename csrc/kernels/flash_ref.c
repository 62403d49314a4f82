/*
 * flash_ref.c - the portable fused attention pass (template in
 * flash_impl.h, contract in flash.h), float32 and float64: plain C with
 * "vectors" of one lane and libm's exp. Always compiled, always tested,
 * and what runs under MHATTN_ISA=scalar.
 */
#include <math.h>

#include "flash.h"

/* x86 maxps semantics: b when either is NaN. */
#define FLASH_REF_MAX(a, b) ((a) > (b) ? (a) : (b))

/* float32 */
#define FN(name) flash_ref_f32_##name
#define FLASH_KERNEL mha_flash_ref_f32
#define REAL float
#define FLASH_F64 0
#define VEC float
#define VLEN 1
#define MR 4
#define NV 4
#define BQ 96
#define BK 64
#define VZERO() 0.0f
#define VSET1(x) (x)
#define VLOAD(p) (*(p))
#define VLOADU(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSTOREU(p, v) (*(p) = (v))
#define VBCAST(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define SFMA(a, b, c) ((a) * (b) + (c))
#define VMUL(a, b) ((a) * (b))
#define VADD(a, b) ((a) + (b))
#define VSUB(a, b) ((a) - (b))
#define VDIV(a, b) ((a) / (b))
#define VMAX(a, b) FLASH_REF_MAX(a, b)
#define VHMAX(v) (v)
#define VHSUM(v) (v)
#define VSELBOOL(v, p) (*(p) ? (v) : -INFINITY)
#define VEXP(v) expf(v)
#include "flash_impl.h"

/* float64 */
#define FN(name) flash_ref_f64_##name
#define FLASH_KERNEL mha_flash_ref_f64
#define REAL double
#define FLASH_F64 1
#define VEC double
#define VLEN 1
#define MR 4
#define NV 4
#define BQ 96
#define BK 64
#define VZERO() 0.0
#define VSET1(x) (x)
#define VLOAD(p) (*(p))
#define VLOADU(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSTOREU(p, v) (*(p) = (v))
#define VBCAST(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define SFMA(a, b, c) ((a) * (b) + (c))
#define VMUL(a, b) ((a) * (b))
#define VADD(a, b) ((a) + (b))
#define VSUB(a, b) ((a) - (b))
#define VDIV(a, b) ((a) / (b))
#define VMAX(a, b) FLASH_REF_MAX(a, b)
#define VHMAX(v) (v)
#define VHSUM(v) (v)
#define VSELBOOL(v, p) (*(p) ? (v) : -INFINITY)
#define VEXP(v) exp(v)
#include "flash_impl.h"
