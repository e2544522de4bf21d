// The scalar reference of the CPU runtime's kernels (namespace ref): always built, the kernel set
// of a CPU without a vector set (OC_ISA_SCALAR), and what every vector set is tested against bit
// for bit. It fixes the arithmetic each set follows:
//   - low-bit products: exact int32 sums per group of inputs, then per group, in float,
//     f = fma(a, s xs, f); f = fma(m, xs gsum, f) (affine kinds: w = q s + m), or for q8
//     y = a (row_scale xs);
//   - fp32 dot products: 16 lanes, lane l accumulating inputs l, l + 16, ... with fused
//     multiply-adds, summed as a tree (reduce16); a tail past the last 16 added in order after;
//   - axpy: one fused multiply-add per element;
//   - SnakeBeta: one polynomial per element (see snake_row), std::sin where it cannot reduce.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
#pragma once
#include "../oc_pool.h"
#include "../oc_types.h"

namespace {
namespace ref {

// 16 lanes summed as a tree: lanes l and l + 8, then l and l + 4, then l and l + 2, then 0 and 1
// (the order of _mm512_reduce_add_ps; each vector set mirrors it)
inline float reduce16(const float* a) {
  float r8[8], r4[4];
  for (int l = 0; l < 8; l++) r8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; l++) r4[l] = r8[l] + r8[l + 4];
  const float r0 = r4[0] + r4[2], r1 = r4[1] + r4[3];
  return r0 + r1;
}

// the tail of a dot product past its last whole 16 lanes: a plain multiply, then an add
inline float dot_tail(float s, const float* a, const float* b, int i, int k) {
  for (; i < k; i++) {
    const float p = a[i] * b[i];
    s = s + p;
  }
  return s;
}

inline float dot_f32(const float* w, const float* x, int k) {
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= k; i += 16)
    for (int l = 0; l < 16; l++) acc[l] = std::fmaf(w[i + l], x[i + l], acc[l]);
  return dot_tail(reduce16(acc), w, x, i, k);
}

inline float load_kv(const void* base, int bf16, int64_t idx) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[idx]) : static_cast<const float*>(base)[idx];
}

// the tail of q . K past its last whole 16 lanes, as dot_tail
inline float dot_kv_tail(float s, const float* q, const void* kb, int bf16, int64_t off, int i, int d) {
  for (; i < d; i++) {
    const float p = q[i] * load_kv(kb, bf16, off + i);
    s = s + p;
  }
  return s;
}

// q . K[off : off + d] over a bf16 or fp32 cache
inline float dot_kv(const float* q, const void* kb, int bf16, int64_t off, int d) {
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; l++) acc[l] = std::fmaf(q[i + l], load_kv(kb, bf16, off + i + l), acc[l]);
  return dot_kv_tail(reduce16(acc), q, kb, bf16, off, i, d);
}

// out += a V[off : off + d]
inline void axpy_kv(float a, const void* vb, int bf16, int64_t off, float* out, int d) {
  for (int i = 0; i < d; i++) out[i] = std::fmaf(a, load_kv(vb, bf16, off + i), out[i]);
}

// One group's epilogue (affine kinds): the group's exact sum a of one activation row into f.
inline float affine_group(float f, int32_t a, float s, float m, float xs, int32_t gsum) {
  f = std::fmaf((float)a, s * xs, f);
  return std::fmaf(m, xs * (float)gsum, f);
}

// Weight code q of row `row` (0..15) of block nb at input i (0..k-1), per kind's layout
// (omni_cpu.cpp's overview, oc_gemm.h's kernels); q8: the signed byte.
inline int32_t code_at(const OcLinear& L, int64_t nb, int row, int i) {
  const int k = L.k;
  if (L.kind == 0) {
    const int kq = i / 4, lane = i % 4;
    const uint8_t byte = L.w[(nb * (k / 8) + kq / 2) * 64 + row * 4 + lane];
    return (kq % 2 == 0) ? (byte & 15) : (byte >> 4);
  }
  if (L.kind == 1) return (int8_t)L.w[(nb * (k / 4) + i / 4) * 64 + row * 4 + i % 4];
  // q6 (3), q5 (4), q8g (5): per group of 64 inputs, 4 steps of 16 inputs
  const int ng = k / 64, sbytes = L.kind == 3 ? 192 : L.kind == 4 ? 160 : 256;
  const int j = i / 64, ii = i % 64, kq = ii / 4, lane = ii % 4, pos = row * 4 + lane, u = kq % 4;
  const uint8_t* tp = L.w + (nb * ng + j) * 4 * sbytes + (kq / 4) * sbytes;
  if (L.kind == 5) return tp[u * 64 + pos];
  const uint8_t nib = tp[((kq / 2) % 2) * 64 + pos];
  int32_t q = (kq % 2 == 0) ? (nib & 15) : (nib >> 4);
  if (L.kind == 3) return q | ((tp[128 + pos] >> (2 * u)) & 3) << 4;
  return q | ((tp[128 + pos % 32] >> ((pos < 32 ? 0 : 4) + u)) & 1) << 4;
}

// Output blocks [b0, b1) (16 rows each) of a low-bit product for m activation rows: x8 [m][k]
// signed int8 (q8 too), xs [m] their scales, gsum [m][k / group] their group sums (affine
// kinds); y [m][L.n].
inline void lowbit_blocks(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum,
                          int m, int64_t b0, int64_t b1, float* y) {
  const int k = L.k;
  const int g = L.kind == 0 ? L.group : 64, ng = k / g;
  for (int r = 0; r < m; r++) {
    const int8_t* xr = x8 + (int64_t)r * k;
    for (int64_t nb = b0; nb < b1; nb++)
      for (int row = 0; row < 16; row++) {
        const int64_t n = nb * 16 + row;
        if (L.kind == 1) {
          int32_t s = 0;
          for (int i = 0; i < k; i++) s += code_at(L, nb, row, i) * xr[i];
          y[(int64_t)r * L.n + n] = (float)s * (L.row_scale[n] * xs[r]);
          continue;
        }
        const uint16_t* sp = L.scales + (nb * ng) * 32;
        float f = 0.f;
        for (int j = 0; j < ng; j++) {
          int32_t s = 0;
          for (int i = j * g; i < (j + 1) * g; i++) s += code_at(L, nb, row, i) * xr[i];
          f = affine_group(f, s, f16_to_f32(sp[j * 32 + row]), f16_to_f32(sp[j * 32 + 16 + row]), xs[r],
                           gsum[(int64_t)r * ng + j]);
        }
        y[(int64_t)r * L.n + n] = f;
      }
  }
}

// SnakeBeta y = x + sin(alpha x)^2 / beta of one element, in the arithmetic every set follows:
// sin^2 has period pi, so v = alpha x is reduced by the nearest multiple of pi (pi split in
// three parts, exact products for |k| < 2^11) and sin is its Taylor polynomial to degree 11 on
// [-pi/2, pi/2] (error < 1e-7, far below a bf16 step); |v| >= 4096, inf and NaN take std::sin.
constexpr float kInvPi = 0.318309886183790671f, kPi1 = 3.140625f, kPi2 = 9.675025939941406e-4f,
                kPi3 = 1.5099580252808664e-7f, kSnakeLimit = 4096.f;
constexpr float kSin11 = 2.5052108385441720e-8f, kSin9 = -2.7557319223985893e-6f,
                kSin7 = 1.9841269841269841e-4f, kSin5 = -8.3333333333333333e-3f,
                kSin3 = 1.6666666666666667e-1f;

inline float snake_exact(float x, float a, float ib) {
  const float s = std::sin(x * a);
  const float s2 = s * s;
  const float t = ib * s2;
  return x + t;
}

inline float snake_one(float x, float a, float ib) {
  const float v = x * a;
  if (!(std::fabs(v) < kSnakeLimit)) return snake_exact(x, a, ib);
  const float k = std::nearbyint(v * kInvPi);
  float rr = std::fmaf(-k, kPi1, v);
  rr = std::fmaf(-k, kPi2, rr);
  rr = std::fmaf(-k, kPi3, rr);
  const float r2 = rr * rr;
  float poly = std::fmaf(kSin11, r2, kSin9);
  poly = std::fmaf(poly, r2, kSin7);
  poly = std::fmaf(poly, r2, kSin5);
  poly = std::fmaf(poly, r2, kSin3);
  const float s = std::fmaf(-(rr * r2), poly, rr);
  return std::fmaf(ib, s * s, x);
}

// one row of t bf16 values of one channel (alpha a, 1 / beta ib); x and y may be one buffer
inline void snake_row(const uint16_t* x, uint16_t* y, float a, float ib, int64_t t) {
  for (int64_t i = 0; i < t; i++) y[i] = f32_to_bf16(snake_one(bf16_to_f32(x[i]), a, ib));
}

// the same over fp32 values (no rounding past snake_one's)
inline void snake_row_f32(const float* x, float* y, float a, float ib, int64_t t) {
  for (int64_t i = 0; i < t; i++) y[i] = snake_one(x[i], a, ib);
}

// No int8 tiles (sets without them use these): no product is tiled.
inline int tile_rows(const OcLinear&, int) { return 0; }
inline void tile_blocks(const OcLinear&, const int8_t*, const float*, const int32_t*, int, int64_t, int64_t,
                        float*) {}

}  // namespace ref
}  // namespace
