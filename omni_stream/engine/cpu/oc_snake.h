// SnakeBeta of Code2Wav in one pass over bf16 or fp32 activations: y = x + sin(alpha x)^2 / beta.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
//
// torch runs it as five bf16 ops (mul, sin, pow, mul, add), each a pass over memory with its own
// rounding: about a quarter of a streaming decode call. Here: one pass, float math, one
// rounding at the end, each element by ref::snake_one's arithmetic (kernels/scalar.h) in the
// kernel set's vectors: the same bits on every set and whichever chunks a stream's frames were
// decoded in (an element's result depends on its own value only).
#pragma once
#include "oc_pool.h"
#include "kernels/isa.h"

namespace {

// rows of t values, row r of channel r % channels; x and y may be the same buffer
void snake_bf16(const uint16_t* x, uint16_t* y, const float* alpha, const float* inv_beta,
                int64_t rows, int channels, int64_t t) {
  for (int64_t r = 0; r < rows; r++)
    simd::snake_row(x + r * t, y + r * t, alpha[r % channels], inv_beta[r % channels], t);
}

void snake_f32(const float* x, float* y, const float* alpha, const float* inv_beta, int64_t rows, int channels,
               int64_t t) {
  for (int64_t r = 0; r < rows; r++)
    simd::snake_row_f32(x + r * t, y + r * t, alpha[r % channels], inv_beta[r % channels], t);
}

}  // namespace
