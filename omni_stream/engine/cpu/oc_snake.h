// SnakeBeta of Code2Wav in one pass over bf16 activations: y = x + sin(alpha x)^2 / beta.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
//
// torch runs it as five bf16 ops (mul, sin, pow, mul, add), each a pass over memory with its own
// rounding: about a quarter of a streaming decode call. Here: one pass, float math, one
// rounding at the end. sin^2 has period pi, so x alpha is reduced by the nearest multiple of pi
// (pi split in three parts, exact products for |k| < 2^11) and sin is its Taylor polynomial to
// degree 11 on [-pi/2, pi/2] (error < 1e-7, far below a bf16 step). Lanes holding a value the
// reduction cannot carry (|alpha x| >= 4096, inf, NaN) are computed with std::sin instead.
#pragma once
#include "oc_pool.h"

namespace {

inline float snake_scalar(float x, float a, float ib) {
  float s = std::sin(x * a);
  return x + ib * (s * s);
}

// rows of t values, row r of channel r % channels; x and y may be the same buffer
void snake_bf16(const uint16_t* x, uint16_t* y, const float* alpha, const float* inv_beta,
                int64_t rows, int channels, int64_t t) {
  for (int64_t r = 0; r < rows; r++) {
    const float a = alpha[r % channels], ib = inv_beta[r % channels];
    const uint16_t* xr = x + r * t;
    uint16_t* yr = y + r * t;
    int64_t i = 0;
#if OC_VNNI
    const __m512 va = _mm512_set1_ps(a), vib = _mm512_set1_ps(ib);
    const __m512 inv_pi = _mm512_set1_ps(0.318309886183790671f);
    const __m512 p1 = _mm512_set1_ps(3.140625f), p2 = _mm512_set1_ps(9.675025939941406e-4f),
                 p3 = _mm512_set1_ps(1.5099580252808664e-7f);
    const __m512 lim = _mm512_set1_ps(4096.f);
    // every element goes through the same instructions whatever its place in the row (the
    // row's last partial vector through masked loads and stores, never a scalar tail), and
    // whether it takes the std::sin fallback depends on its own value only: a stream's audio
    // is then the same bits whichever chunks its frames were decoded in
    for (; i < t; i += 16) {
      const __mmask16 live = t - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (t - i)) - 1);
      __m512 xv = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, xr + i)), 16));
      __m512 v = _mm512_mul_ps(xv, va);
      __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, inv_pi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 rr = _mm512_fnmadd_ps(k, p1, v);
      rr = _mm512_fnmadd_ps(k, p2, rr);
      rr = _mm512_fnmadd_ps(k, p3, rr);
      __m512 r2 = _mm512_mul_ps(rr, rr);
      __m512 poly = _mm512_set1_ps(2.5052108385441720e-8f);
      poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(-2.7557319223985893e-6f));
      poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(1.9841269841269841e-4f));
      poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(-8.3333333333333333e-3f));
      poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(1.6666666666666667e-1f));
      // sin r = r - r^3 (1/3! - r^2/5! + ...)
      __m512 s = _mm512_fnmadd_ps(_mm512_mul_ps(rr, r2), poly, rr);
      __m512 out = _mm512_fmadd_ps(vib, _mm512_mul_ps(s, s), xv);
      // !(|v| < 4096) is also true for NaN: those lanes alone take std::sin
      const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(v), lim, _CMP_NLT_UQ) & live;
      if (big) {
        alignas(64) float buf[16], xs[16];
        _mm512_store_ps(buf, out);
        _mm512_store_ps(xs, xv);
        for (int j = 0; j < 16; j++)
          if (big >> j & 1) buf[j] = snake_scalar(xs[j], a, ib);
        out = _mm512_load_ps(buf);
      }
      // round to nearest even, NaN kept NaN (as f32_to_bf16)
      __m512i u = _mm512_castps_si512(out);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
      __mmask16 nan = _mm512_cmp_ps_mask(out, out, _CMP_UNORD_Q);
      __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      rounded = _mm512_mask_mov_epi32(rounded, nan, qnan);
      _mm256_mask_storeu_epi16(yr + i, live, _mm512_cvtepi32_epi16(rounded));
    }
#endif
    for (; i < t; i++) yr[i] = f32_to_bf16(snake_scalar(bf16_to_f32(xr[i]), a, ib));
  }
}

}  // namespace
