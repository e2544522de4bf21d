// The one place that picks the CPU runtime's kernel set. Part of omni_cpu.cpp (one translation
// unit); see there for the overview.
//
// Every set implements the same primitives (namespace simd) over the same packed weights:
//   lowbit_blocks   the low-bit products (q4 / q5 / q6 / q8g / q8) of output blocks [b0, b1)
//   prepare_q8      the q8 activations as the set's kernel reads them (in place)
//   dot_f32         one fp32 dot product (the f32 products)
//   dot_kv, axpy_kv the attention's products over a bf16 or fp32 KV cache
//   snake_row       Code2Wav's SnakeBeta over one bf16 row (snake_row_f32: fp32)
//   tile_rows, tile_blocks  products of many rows on int8 tiles (AMX; ref's: none tiled)
// and reports itself (kIsa, kFeatures). scalar.h is the reference (namespace ref): always built,
// and it fixes the arithmetic: integer sums exact, every float reduction in the order of 16
// lanes summed as a tree (ref::reduce16), every multiply-add fused. The vector sets follow that
// order, so every set gives the reference's products bit for bit (tests/test_cpu_isa.py, and
// tests/test_cpu_arm64.py under qemu for ARM64).
//
// The set is chosen from the compiler's target (engine/cpu/build.py builds with -march=native,
// capped by OMNI_STREAM_CPU_ISA): OC_FORCE_SCALAR forces the reference, OC_FORCE_AVX2 the AVX2
// set on an AVX-512 target (tests).
#pragma once

#define OC_ISA_SCALAR 0
#define OC_ISA_AVX2 1
#define OC_ISA_AVX512 2
#define OC_ISA_NEON 3

#if defined(OC_FORCE_SCALAR)
#define OC_ISA OC_ISA_SCALAR
#elif (defined(__x86_64__) || defined(_M_X64)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    defined(OC_FORCE_AVX2)
#define OC_ISA OC_ISA_AVX2  // tests: the AVX2 set on an AVX-512 target (see avx2.h's QuadSum)
#elif (defined(__x86_64__) || defined(_M_X64)) && defined(__AVX512F__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define OC_ISA OC_ISA_AVX512
#elif (defined(__x86_64__) || defined(_M_X64)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OC_ISA OC_ISA_AVX2
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define OC_ISA OC_ISA_NEON
#else
#define OC_ISA OC_ISA_SCALAR
#endif

#if OC_ISA == OC_ISA_AVX512 || OC_ISA == OC_ISA_AVX2
#include <immintrin.h>
#elif OC_ISA == OC_ISA_NEON
#include <arm_neon.h>
#endif

#include "scalar.h"
#if OC_ISA == OC_ISA_AVX512
#include "avx512.h"
#elif OC_ISA == OC_ISA_AVX2
#include "avx2.h"
#elif OC_ISA == OC_ISA_NEON
#include "neon.h"
#else
namespace {
namespace simd {  // the reference is the kernel set
constexpr const char* kIsa = "scalar";
constexpr const char* kFeatures = "";
using ref::axpy_kv;
using ref::dot_f32;
using ref::dot_kv;
using ref::lowbit_blocks;
using ref::snake_row;
using ref::snake_row_f32;
using ref::tile_blocks;
using ref::tile_rows;
inline void prepare_q8(int8_t*, size_t) {}
}  // namespace simd
}  // namespace
#endif

// AMX int8 tiles (avx512.h): products of >= kAmxMinRows rows
#ifndef OC_AMX
#define OC_AMX 0
#endif
