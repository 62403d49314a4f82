/*
 * each_type.h - compiles a per-type template once for each element type:
 *
 *   #define MHA_TEMPLATE "forward_impl.h"
 *   #include "each_type.h"
 *
 * includes the template with MHA_F64 0 (float; dtype.h then binds REAL,
 * PICK, ... to float), then with MHA_F64 1 (double), and unbinds
 * MHA_TEMPLATE. One place says how a template is instantiated, where every
 * driver and the kernels' unit each wrote the six lines (bottleneck's
 * templating, one source per algorithm for both types). A computed
 * #include is ISO C (C11 6.10.2p4): gcc, clang and MSVC take it. No include
 * guard on purpose.
 */
#ifndef MHA_TEMPLATE
#error "each_type.h: define MHA_TEMPLATE to the template's file name first"
#endif

#define MHA_F64 0
#include MHA_TEMPLATE
#undef MHA_F64

#define MHA_F64 1
#include MHA_TEMPLATE
#undef MHA_F64

#undef MHA_TEMPLATE
