// The products of the CPU runtime (low-bit q4 / q5 / q6 / q8 / q8g, exact f32): activations
// quantized per row, then the kernel set's blocks (kernels/isa.h) shared out over the pool by
// output blocks of 16 rows. Dispatches on the weight kind only; the ISA is the kernel set's.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
#pragma once
#include "oc_pool.h"
#include "oc_types.h"
#include "kernels/isa.h"

namespace {

// ------------------------------------------------------------------------------ products
// Quantize rows of x [m][k] to int8: x8 [m][k], xs [m], and per-group sums [m][k/g] (g > 0).
void quantize_rows(const float* x, int m, int k, int g, int8_t* x8, float* xs, int32_t* gsum) {
  for (int r = 0; r < m; r++) {
    const float* xr = x + (int64_t)r * k;
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < k; i++) {
      finite &= std::isfinite(xr[i]);
      amax = std::max(amax, std::fabs(xr[i]));
    }
    float s = amax > 0.f ? amax / 127.f : 1.f;
    float inv = 1.f / s;
    // a non-finite input makes the whole output row NaN (as a float product would), so the
    // fault reaches the sampler and the stream is failed instead of drawing from garbage
    xs[r] = finite ? s : std::numeric_limits<float>::quiet_NaN();
    int8_t* q = x8 + (int64_t)r * k;
    for (int i = 0; i < k; i++) {
      float v = std::isfinite(xr[i]) ? xr[i] * inv : 0.f;
      q[i] = (int8_t)std::lrintf(std::max(-127.f, std::min(127.f, v)));
    }
    if (g > 0)
      for (int j = 0; j < k / g; j++) {
        int32_t acc = 0;
        for (int i = 0; i < g; i++) acc += q[j * g + i];
        gsum[(int64_t)r * (k / g) + j] = acc;
      }
  }
}

void f32_rows(const OcLinear& L, const float* x, int m, int64_t n0, int64_t n1, float* y) {
  for (int r = 0; r < m; r++)
    for (int64_t n = n0; n < n1; n++) y[(int64_t)r * L.n + n] = simd::dot_f32(L.wf + n * L.k, x + (int64_t)r * L.k, L.k);
}

// y [m][L.n] += L.bias (none: nothing)
inline void add_bias(const OcLinear& L, int m, float* y) {
  if (L.bias)
    for (int r = 0; r < m; r++)
      for (int n = 0; n < L.n; n++) y[(int64_t)r * L.n + n] += L.bias[n];
}

// Scratch for one product's quantized activations (reused, grown on demand).
struct Scratch {
  std::vector<int8_t> x8;
  std::vector<float> xs;
  std::vector<int32_t> gsum;
};

void linear(Pool* pool, const OcLinear& L, const float* x, int m, float* y, Scratch& s) {
  if (L.kind == 2) {
    pool->run([&](int t) {
      int64_t lo, hi;
      split(L.n, pool->active(), t, &lo, &hi);
      f32_rows(L, x, m, lo, hi, y);
    });
  } else {
    const int g = L.kind == 1 ? 0 : L.group;  // q4, q5, q6: per-group sums
    s.x8.resize((size_t)m * L.k);
    s.xs.resize(m);
    s.gsum.resize(g > 0 ? (size_t)m * (L.k / g) : 1);
    quantize_rows(x, m, L.k, g, s.x8.data(), s.xs.data(), s.gsum.data());
    if (L.kind == 1) simd::prepare_q8(s.x8.data(), s.x8.size());
    const int nblocks = L.n / 16;
    if (const int mp = simd::tile_rows(L, m)) {  // many rows: AMX tiles, x8 padded with zero rows
      s.x8.resize((size_t)mp * L.k, 0);
      s.xs.resize(mp, 0.f);
      s.gsum.resize((size_t)mp * (L.k / g), 0);
      pool->run([&](int t) {
        int64_t b0, b1;
        split(nblocks, pool->active(), t, &b0, &b1);
        simd::tile_blocks(L, s.x8.data(), s.xs.data(), s.gsum.data(), m, b0, b1, y);
      });
    } else {
      pool->run([&](int t) {
        int64_t b0, b1;
        split(nblocks, pool->active(), t, &b0, &b1);
        simd::lowbit_blocks(L, s.x8.data(), s.xs.data(), s.gsum.data(), m, b0, b1, y);
      });
    }
  }
  add_bias(L, m, y);
}

}  // namespace
