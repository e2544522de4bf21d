// The ARM64 NEON kernel set (Graviton, Ampere, Apple, Raspberry Pi): SDOT where the CPU has the
// dot-product extension (ARMv8.2 +dotprod; mandatory from v8.4), SMMLA for 4-row tiles where it
// has int8 matrix multiply (ARMv8.6 +i8mm), and widening multiplies (SMULL / SMLAL / SADALP)
// on a plain ARMv8 core (Cortex-A53 / A72). Part of omni_cpu.cpp (one translation unit); see
// there and kernels/isa.h for the overview. Every path gives ref::'s products bit for bit
// (tests/test_cpu_arm64.py runs each under qemu against the host's reference).
//
// Products: the activations stay signed int8 (prepare_q8 does nothing) and so do the weights as
// the kernels read them: q4 / q5 / q6 codes (0..63) as they are, q8 as stored, q8g's unsigned
// codes c as c - 128 (one EOR with 0x80), the 128 sum x8 term added back from the group sums.
// One packed layout serves every set: per block of 16 rows, 64 bytes per k-quad are four 16-byte
// vectors of 4 rows x 4 consecutive inputs, so an SDOT of one such vector with a lane (4 bytes)
// of the activations gives 4 rows' sums of 4 inputs, as VPDPBUSD does for 16 rows on AVX-512.
// Integer sums are exact whatever the order; the float epilogue is ref::affine_group's two
// fused multiply-adds (vfmaq_f32(acc, a, b) = fmaf(a, b, acc)).
#pragma once

#if defined(__ARM_FEATURE_DOTPROD)
#define OC_NEON_DOT 1
#else
#define OC_NEON_DOT 0
#endif
// SMMLA runs beside SDOT (which takes a tile's other rows): I8MM without the dot-product flag
// (clang 14's -march=armv8.6-a+i8mm; every such CPU has SDOT, the compiler is not told) builds
// the plain NEON set; -march=native and -mcpu=... set both
#if defined(__ARM_FEATURE_MATMUL_INT8) && OC_NEON_DOT
#define OC_NEON_MMLA 1
#else
#define OC_NEON_MMLA 0
#endif

namespace {
namespace simd {

constexpr const char* kIsa = "neon";
constexpr const char* kFeatures = ""
#if OC_NEON_DOT
                                  "+dotprod"
#endif
#if OC_NEON_MMLA
                                  "+i8mm"
#endif
    ;

// Software prefetch distance of the weight stream (bytes ahead), as avx512.h's
#ifndef OC_PF
#define OC_PF 2048
#endif

// ------------------------------------------------------------------------------ weight decoding
// A step is 16 inputs of one block (16 rows), in every kind's layout: q4 128 bytes (two 64-byte
// k-quad pairs of nibbles), q6 192 / q5 160 (two nibble vectors, then the top bits; see
// avx512.h), q8 / q8g 256 (one 64-byte vector per k-quad). Half H of a step is its k-quads
// 2H, 2H + 1; decode<KIND, H>(p, v) gives their weights of rows 4v .. 4v + 3 (4 inputs each) as
// signed bytes w0 (k-quad 2H) and w1 (2H + 1). The kernels decode one row vector at a time and
// multiply it at once, so few weight registers are live beside the accumulators.
template <int KIND>
constexpr int step_bytes() {
  return KIND == 0 ? 128 : KIND == 3 ? 192 : KIND == 4 ? 160 : 256;
}

template <int S>  // e << S (S > 0) or e >> -S (S < 0), per byte
inline uint8x16_t shift_u8(uint8x16_t e) {
  if constexpr (S > 0) return vshlq_n_u8(e, S);
  else if constexpr (S < 0) return vshrq_n_u8(e, -S);
  else return e;
}

template <int KIND, int H>
inline void decode(const uint8_t* p, int v, int8x16_t& w0, int8x16_t& w1) {
  if constexpr (KIND == 1 || KIND == 5) {
    uint8x16_t b0 = vld1q_u8(p + (2 * H) * 64 + 16 * v), b1 = vld1q_u8(p + (2 * H + 1) * 64 + 16 * v);
    if constexpr (KIND == 5) {  // c - 128
      b0 = veorq_u8(b0, vdupq_n_u8(0x80));
      b1 = veorq_u8(b1, vdupq_n_u8(0x80));
    }
    w0 = vreinterpretq_s8_u8(b0);
    w1 = vreinterpretq_s8_u8(b1);
  } else {
    const uint8x16_t lo4 = vdupq_n_u8(0x0F);
    const uint8x16_t r = vld1q_u8(p + H * 64 + 16 * v);
    uint8x16_t lo, hi;  // k-quads 2H (low nibbles) and 2H + 1 (high nibbles)
    if constexpr (KIND == 3) {
      // q6: byte 4 r + i of the top-bit vector holds the top 2 bits of k-quad u at 2u, 2u + 1
      const uint8x16_t c = vld1q_u8(p + 128 + 16 * v);
      if constexpr (H == 0) {
        lo = vsliq_n_u8(r, vandq_u8(c, vdupq_n_u8(0x03)), 4);                 // bits 0-1 to 4-5
        hi = vsriq_n_u8(vshlq_n_u8(vandq_u8(c, vdupq_n_u8(0x0C)), 2), r, 4);  // bits 2-3 to 4-5
      } else {
        lo = vbslq_u8(vdupq_n_u8(0x30), c, vandq_u8(r, lo4));                 // bits 4-5 stay
        hi = vsriq_n_u8(vshrq_n_u8(c, 2), r, 4);                              // bits 6-7 to 4-5
      }
    } else {
      lo = vandq_u8(r, lo4);
      hi = vshrq_n_u8(r, 4);
      if constexpr (KIND == 4) {
        // q5: lane p = 16 v + j takes bit u of byte p % 32 (v < 2) or bit 4 + u (v >= 2) of the
        // 32 top-bit bytes; moved to bit 4
        const uint8x16_t e = vld1q_u8(p + 128 + 16 * (v & 1));
        const uint8x16_t b4 = vdupq_n_u8(0x10);
        if (v < 2) {
          lo = vbslq_u8(b4, shift_u8<4 - 2 * H>(e), lo);
          hi = vbslq_u8(b4, shift_u8<3 - 2 * H>(e), hi);
        } else {
          lo = vbslq_u8(b4, shift_u8<-2 * H>(e), lo);
          hi = vbslq_u8(b4, shift_u8<-2 * H - 1>(e), hi);
        }
      }
    }
    w0 = vreinterpretq_s8_u8(lo);
    w1 = vreinterpretq_s8_u8(hi);
  }
}

// ------------------------------------------------------------------------------ integer sums
// MT activation rows times the weights, into per-row int32 sums of the block's 16 rows: per
// half-step H, begin<H>(xv) (xv[r]: row r's 16 activation bytes of the step), then add<H>(v,
// w0, w1) per row vector; sums(a): a[r][v] = rows 4v .. 4v + 3 of row r.
#if OC_NEON_DOT
// SDOT by lane: 8 per row and half-step; rows of 1-2 keep two chains (one per half) so the
// multiply-adds overlap.
template <int MT>
struct DotRows {
  static constexpr int A = MT <= 2 ? 2 : 1;
  int32x4_t acc[MT][A][4];
  const int8x16_t* x;
  void zero() {
    for (int r = 0; r < MT; r++)
      for (int c = 0; c < A; c++)
        for (int v = 0; v < 4; v++) acc[r][c][v] = vdupq_n_s32(0);
  }
  template <int H>
  void begin(const int8x16_t* xv) { x = xv; }
  template <int H>
  void add(int v, int8x16_t w0, int8x16_t w1) {
    for (int r = 0; r < MT; r++) {
      int32x4_t& a = acc[r][H % A][v];
      a = vdotq_laneq_s32(a, w0, x[r], 2 * H);
      a = vdotq_laneq_s32(a, w1, x[r], 2 * H + 1);
    }
  }
  void sums(int32x4_t (&a)[MT][4]) const {
    for (int r = 0; r < MT; r++)
      for (int v = 0; v < 4; v++) a[r][v] = A == 2 ? vaddq_s32(acc[r][0][v], acc[r][A - 1][v]) : acc[r][0][v];
  }
};
template <int MT>
using Rows = DotRows<MT>;
constexpr int kTile = 4;  // rows per tile (4 accumulators per row)
#else
// No SDOT: SMULL / SMLAL of the half-step's two k-quads (int8 x int8 products, |p| <= 128 x 127;
// two of them fit int16 exactly), then SADALP into int32 pairs per row: acc[r][v][0] holds
// rows 4v, 4v + 1 (two lanes each), [1] rows 4v + 2, 4v + 3; ADDP folds the pairs.
template <int MT>
struct MullRows {
  int32x4_t acc[MT][4][2];
  int8x16_t x0[MT], x1[MT];  // the half-step's two activation quads, broadcast
  void zero() {
    for (int r = 0; r < MT; r++)
      for (int v = 0; v < 4; v++) acc[r][v][0] = acc[r][v][1] = vdupq_n_s32(0);
  }
  template <int H>
  void begin(const int8x16_t* xv) {
    for (int r = 0; r < MT; r++) {
      const int32x4_t x32 = vreinterpretq_s32_s8(xv[r]);
      x0[r] = vreinterpretq_s8_s32(vdupq_laneq_s32(x32, 2 * H));
      x1[r] = vreinterpretq_s8_s32(vdupq_laneq_s32(x32, 2 * H + 1));
    }
  }
  template <int H>
  void add(int v, int8x16_t w0, int8x16_t w1) {
    for (int r = 0; r < MT; r++) {
      int16x8_t p = vmull_s8(vget_low_s8(w0), vget_low_s8(x0[r]));
      p = vmlal_s8(p, vget_low_s8(w1), vget_low_s8(x1[r]));
      acc[r][v][0] = vpadalq_s16(acc[r][v][0], p);
      int16x8_t q = vmull_high_s8(w0, x0[r]);
      q = vmlal_high_s8(q, w1, x1[r]);
      acc[r][v][1] = vpadalq_s16(acc[r][v][1], q);
    }
  }
  void sums(int32x4_t (&a)[MT][4]) const {
    for (int r = 0; r < MT; r++)
      for (int v = 0; v < 4; v++) a[r][v] = vpaddq_s32(acc[r][v][0], acc[r][v][1]);
  }
};
template <int MT>
using Rows = MullRows<MT>;
// one row per tile: with 8 accumulators per row a tile of 2 spills them in the loop (GCC 12:
// ~85 instructions per row and step, against 81 for one row)
constexpr int kTile = 1;
#endif

#if OC_NEON_MMLA
// SMMLA (2 x 8 by 8 x 2 int8 -> 2 x 2 int32) for a tile of 4 rows: per half-step each row
// vector's two k-quads are zipped into rows of 8 inputs (rows 4v, 4v + 1 | 4v + 2, 4v + 3), and
// each pair of activation rows (8 inputs each) multiplies both: 8 ZIP + 16 SMMLA per 4 rows where
// SDOT takes 32. Not for fewer rows: with one pair of rows the zips cost what SMMLA saves
// (8 ZIP + 8 SMMLA against 16 SDOT), and one row would waste half of each SMMLA; a single row
// (decode at batch 1, the common case) is bound by the weight stream anyway.
struct MmlaRows4 {
  int32x4_t acc[2][4][2];  // [row pair][v][rows 4v, 4v+1 | 4v+2, 4v+3]: a.w0 a.w1 b.w0 b.w1
  int8x16_t xp[2];         // per row pair: 8 inputs of row a, then of row b
  void zero() {
    for (int p = 0; p < 2; p++)
      for (int v = 0; v < 4; v++) acc[p][v][0] = acc[p][v][1] = vdupq_n_s32(0);
  }
  template <int H>
  void begin(const int8x16_t* xv) {
    for (int p = 0; p < 2; p++) {
      const int64x2_t a = vreinterpretq_s64_s8(xv[2 * p]), b = vreinterpretq_s64_s8(xv[2 * p + 1]);
      xp[p] = vreinterpretq_s8_s64(H == 0 ? vzip1q_s64(a, b) : vzip2q_s64(a, b));
    }
  }
  template <int H>
  void add(int v, int8x16_t w0, int8x16_t w1) {
    const int32x4_t a = vreinterpretq_s32_s8(w0), b = vreinterpretq_s32_s8(w1);
    const int8x16_t z0 = vreinterpretq_s8_s32(vzip1q_s32(a, b));
    const int8x16_t z1 = vreinterpretq_s8_s32(vzip2q_s32(a, b));
    for (int p = 0; p < 2; p++) {
      acc[p][v][0] = vmmlaq_s32(acc[p][v][0], xp[p], z0);
      acc[p][v][1] = vmmlaq_s32(acc[p][v][1], xp[p], z1);
    }
  }
  void sums(int32x4_t (&a)[4][4]) const {
    for (int p = 0; p < 2; p++)
      for (int v = 0; v < 4; v++) {
        const int64x2_t s0 = vreinterpretq_s64_s32(acc[p][v][0]), s1 = vreinterpretq_s64_s32(acc[p][v][1]);
        a[2 * p][v] = vreinterpretq_s32_s64(vzip1q_s64(s0, s1));
        a[2 * p + 1][v] = vreinterpretq_s32_s64(vzip2q_s64(s0, s1));
      }
  }
};
#endif

// ------------------------------------------------------------------------------ products
inline float32x4_t load_f16x4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Block nb (16 rows) of one product for MT activation rows (stride k), in y (stride ldy): per
// group, exact int32 sums by Acc, then ref::affine_group per row (q8: ref's a (row_scale xs)).
// One row keeps its float sums in registers; a tile of more keeps them in y between groups (the
// registers go to the integer accumulators).
template <int KIND, int MT, class Acc>
void lowbit_block(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int64_t nb,
                  float* y, int ldy) {
  constexpr int SB = step_bytes<KIND>();
  const int k = L.k, g = KIND == 0 ? L.group : KIND == 1 ? k : 64, ng = k / g, steps = g / 16;
  const uint8_t* wp = L.w + nb * (int64_t)(k / 16) * SB;
  const uint16_t* sb = KIND == 1 ? nullptr : L.scales + nb * (int64_t)ng * 32;
  float* yb = y + nb * 16;
  float32x4_t f1[4];  // MT == 1: the float sums
  for (int v = 0; v < 4; v++) f1[v] = vdupq_n_f32(0.f);
  for (int j = 0; j < ng; j++) {
    Acc acc;
    acc.zero();
    for (int s = 0; s < steps; s++, wp += SB) {
      for (int o = 0; o < SB; o += 64) __builtin_prefetch(wp + OC_PF + o, 0, 3);
      int8x16_t xv[MT];
      for (int r = 0; r < MT; r++) xv[r] = vld1q_s8(x8 + (int64_t)r * k + j * g + s * 16);
      int8x16_t w0, w1;
      acc.template begin<0>(xv);
      for (int v = 0; v < 4; v++) {
        decode<KIND, 0>(wp, v, w0, w1);
        acc.template add<0>(v, w0, w1);
      }
      acc.template begin<1>(xv);
      for (int v = 0; v < 4; v++) {
        decode<KIND, 1>(wp, v, w0, w1);
        acc.template add<1>(v, w0, w1);
      }
    }
    int32x4_t a[MT][4];
    acc.sums(a);
    if constexpr (KIND == 1) {  // one group: the whole row
      for (int v = 0; v < 4; v++) {
        const float32x4_t rs = vld1q_f32(L.row_scale + nb * 16 + 4 * v);
        for (int r = 0; r < MT; r++)
          vst1q_f32(yb + (int64_t)r * ldy + 4 * v, vmulq_f32(vcvtq_f32_s32(a[r][v]), vmulq_n_f32(rs, xs[r])));
      }
      return;
    } else {
      float32x4_t sc[4], mn[4];
      for (int v = 0; v < 4; v++) {
        sc[v] = load_f16x4(sb + j * 32 + 4 * v);
        mn[v] = load_f16x4(sb + j * 32 + 16 + 4 * v);
      }
      for (int r = 0; r < MT; r++) {
        const int32_t gs = gsum[(int64_t)r * ng + j];
        const float xg = xs[r] * (float)gs;
        for (int v = 0; v < 4; v++) {
          int32x4_t ar = a[r][v];
          if constexpr (KIND == 5) ar = vaddq_s32(ar, vdupq_n_s32(gs * 128));  // codes were c - 128
          float* yp = yb + (int64_t)r * ldy + 4 * v;
          float32x4_t f = MT == 1 ? f1[v] : j == 0 ? vdupq_n_f32(0.f) : vld1q_f32(yp);
          f = vfmaq_f32(f, vcvtq_f32_s32(ar), vmulq_n_f32(sc[v], xs[r]));
          f = vfmaq_n_f32(f, mn[v], xg);
          if constexpr (MT == 1) f1[v] = f;
          else vst1q_f32(yp, f);
        }
      }
    }
  }
  if constexpr (MT == 1 && KIND != 1)
    for (int v = 0; v < 4; v++) vst1q_f32(yb + 4 * v, f1[v]);
}

template <int KIND>
void lowbit_tile(int mt, const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gs, int64_t nb,
                 float* y) {
#if OC_NEON_MMLA
  if (mt == 4) return lowbit_block<KIND, 4, MmlaRows4>(L, x8, xs, gs, nb, y, L.n);
#endif
  switch (mt) {
    case 1: return lowbit_block<KIND, 1, Rows<1>>(L, x8, xs, gs, nb, y, L.n);
#if OC_NEON_DOT
    case 2: return lowbit_block<KIND, 2, Rows<2>>(L, x8, xs, gs, nb, y, L.n);
    case 3: return lowbit_block<KIND, 3, Rows<3>>(L, x8, xs, gs, nb, y, L.n);
    default: return lowbit_block<KIND, 4, Rows<4>>(L, x8, xs, gs, nb, y, L.n);
#else
    default: return;  // kTile 1
#endif
  }
}

// q8 reads signed activations as they are
inline void prepare_q8(int8_t*, size_t) {}

// output blocks [b0, b1) for m rows, in tiles of kTile rows (q4's group a multiple of 16)
inline void lowbit_blocks(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum,
                          int m, int64_t b0, int64_t b1, float* y) {
  const int ng = L.kind == 0 ? L.k / L.group : L.kind == 1 ? 0 : L.k / 64;  // gsum's row stride
  for (int64_t nb = b0; nb < b1; nb++)
    for (int r0 = 0; r0 < m; r0 += kTile) {
      const int mt = std::min(kTile, m - r0);
      const int8_t* xr = x8 + (int64_t)r0 * L.k;
      const float* xsr = xs + r0;
      const int32_t* gs = gsum + (int64_t)r0 * ng;
      float* yr = y + (int64_t)r0 * L.n;
      switch (L.kind) {
        case 0: lowbit_tile<0>(mt, L, xr, xsr, gs, nb, yr); break;
        case 1: lowbit_tile<1>(mt, L, xr, xsr, gs, nb, yr); break;
        case 3: lowbit_tile<3>(mt, L, xr, xsr, gs, nb, yr); break;
        case 4: lowbit_tile<4>(mt, L, xr, xsr, gs, nb, yr); break;
        default: lowbit_tile<5>(mt, L, xr, xsr, gs, nb, yr); break;
      }
    }
}

using ref::tile_blocks;
using ref::tile_rows;

// ------------------------------------------------------------------------------ fp32 products
// 16 lanes as 4 vectors (lanes 0-3, 4-7, 8-11, 12-15) summed in ref::reduce16's order: lanes
// l + 8, then + 4, then + 2, then lane 0 + lane 1
inline float reduce16(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
  const float32x4_t r4 = vaddq_f32(vaddq_f32(a0, a2), vaddq_f32(a1, a3));
  return vpadds_f32(vadd_f32(vget_low_f32(r4), vget_high_f32(r4)));
}

inline float dot_f32(const float* w, const float* x, int k) {
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    a0 = vfmaq_f32(a0, vld1q_f32(w + i), vld1q_f32(x + i));
    a1 = vfmaq_f32(a1, vld1q_f32(w + i + 4), vld1q_f32(x + i + 4));
    a2 = vfmaq_f32(a2, vld1q_f32(w + i + 8), vld1q_f32(x + i + 8));
    a3 = vfmaq_f32(a3, vld1q_f32(w + i + 12), vld1q_f32(x + i + 12));
  }
  return ref::dot_tail(reduce16(a0, a1, a2, a3), w, x, i, k);
}

// 8 cache values from idx as two float vectors (bf16: the bits in the top half)
inline void load8_kv(const void* base, int bf16, int64_t idx, float32x4_t& lo, float32x4_t& hi) {
  if (bf16) {
    const uint16x8_t b = vld1q_u16(static_cast<const uint16_t*>(base) + idx);
    lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
    hi = vreinterpretq_f32_u32(vshll_high_n_u16(b, 16));
  } else {
    lo = vld1q_f32(static_cast<const float*>(base) + idx);
    hi = vld1q_f32(static_cast<const float*>(base) + idx + 4);
  }
}

inline float dot_kv(const float* q, const void* kb, int bf16, int64_t off, int d) {
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    float32x4_t k0, k1, k2, k3;
    load8_kv(kb, bf16, off + i, k0, k1);
    load8_kv(kb, bf16, off + i + 8, k2, k3);
    a0 = vfmaq_f32(a0, vld1q_f32(q + i), k0);
    a1 = vfmaq_f32(a1, vld1q_f32(q + i + 4), k1);
    a2 = vfmaq_f32(a2, vld1q_f32(q + i + 8), k2);
    a3 = vfmaq_f32(a3, vld1q_f32(q + i + 12), k3);
  }
  return ref::dot_kv_tail(reduce16(a0, a1, a2, a3), q, kb, bf16, off, i, d);
}

inline void axpy_kv(float a, const void* vb, int bf16, int64_t off, float* out, int d) {
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    float32x4_t v0, v1;
    load8_kv(vb, bf16, off + i, v0, v1);
    vst1q_f32(out + i, vfmaq_n_f32(vld1q_f32(out + i), v0, a));
    vst1q_f32(out + i + 4, vfmaq_n_f32(vld1q_f32(out + i + 4), v1, a));
  }
  ref::axpy_kv(a, vb, bf16, off + i, out + i, d - i);
}

// ------------------------------------------------------------------------------ SnakeBeta
// ref::snake_one on 4 lanes (v = x a given); lanes with !(|v| < 4096) (NaN too) are redone by
// ref::snake_exact by the caller
inline float32x4_t snake4(float32x4_t xv, float32x4_t v, float ib) {
  const float32x4_t k = vrndnq_f32(vmulq_n_f32(v, ref::kInvPi));
  float32x4_t rr = vfmsq_f32(v, k, vdupq_n_f32(ref::kPi1));  // fmaf(-k, pi1, v)
  rr = vfmsq_f32(rr, k, vdupq_n_f32(ref::kPi2));
  rr = vfmsq_f32(rr, k, vdupq_n_f32(ref::kPi3));
  const float32x4_t r2 = vmulq_f32(rr, rr);
  float32x4_t poly = vfmaq_f32(vdupq_n_f32(ref::kSin9), vdupq_n_f32(ref::kSin11), r2);
  poly = vfmaq_f32(vdupq_n_f32(ref::kSin7), poly, r2);
  poly = vfmaq_f32(vdupq_n_f32(ref::kSin5), poly, r2);
  poly = vfmaq_f32(vdupq_n_f32(ref::kSin3), poly, r2);
  const float32x4_t s = vfmsq_f32(rr, vmulq_f32(rr, r2), poly);  // fmaf(-(rr r2), poly, rr)
  return vfmaq_n_f32(xv, vmulq_f32(s, s), ib);                      // fmaf(ib, s s, x)
}

// round to nearest even, NaN kept NaN (as f32_to_bf16)
inline uint16x4_t to_bf16(float32x4_t out) {
  const uint32x4_t u = vreinterpretq_u32_f32(out);
  const uint32x4_t bias = vaddq_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)), vdupq_n_u32(0x7fff));
  const uint16x4_t rounded = vaddhn_u32(u, bias);  // (u + bias) >> 16
  const uint16x4_t qnan = vorr_u16(vshrn_n_u32(u, 16), vdup_n_u16(0x40));
  return vbsl_u16(vmovn_u32(vceqq_f32(out, out)), rounded, qnan);
}

// ref::snake_one on 8 lanes (two vectors) in place
inline void snake8(float32x4_t& x0, float32x4_t& x1, float a, float ib) {
  const float32x4_t v0 = vmulq_n_f32(x0, a), v1 = vmulq_n_f32(x1, a);
  float32x4_t o0 = snake4(x0, v0, ib), o1 = snake4(x1, v1, ib);
  const float32x4_t lim = vdupq_n_f32(ref::kSnakeLimit);
  const uint32x4_t ok = vandq_u32(vcaltq_f32(v0, lim), vcaltq_f32(v1, lim));  // |v| < 4096 (false for NaN)
  if (vminvq_u32(ok) == 0) {  // some lane takes std::sin
    float o[8], xs[8], vs[8];
    vst1q_f32(o, o0);
    vst1q_f32(o + 4, o1);
    vst1q_f32(xs, x0);
    vst1q_f32(xs + 4, x1);
    vst1q_f32(vs, v0);
    vst1q_f32(vs + 4, v1);
    for (int j = 0; j < 8; j++)
      if (!(std::fabs(vs[j]) < ref::kSnakeLimit)) o[j] = ref::snake_exact(xs[j], a, ib);
    o0 = vld1q_f32(o);
    o1 = vld1q_f32(o + 4);
  }
  x0 = o0;
  x1 = o1;
}

// 8 bf16 values (x and y may be one buffer)
inline void snake8_bf16(const uint16_t* x, uint16_t* y, float a, float ib) {
  const uint16x8_t raw = vld1q_u16(x);
  float32x4_t x0 = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(raw), 16));
  float32x4_t x1 = vreinterpretq_f32_u32(vshll_high_n_u16(raw, 16));
  snake8(x0, x1, a, ib);
  vst1q_u16(y, vcombine_u16(to_bf16(x0), to_bf16(x1)));
}

inline void snake8_f32(const float* x, float* y, float a, float ib) {
  float32x4_t x0 = vld1q_f32(x), x1 = vld1q_f32(x + 4);
  snake8(x0, x1, a, ib);
  vst1q_f32(y, x0);
  vst1q_f32(y + 4, x1);
}

// SnakeBeta over one row, ref::snake_one per element (8 lanes at a time; the row's last partial
// 8 through ref's scalar code, the same bits either way); bf16 rounded as f32_to_bf16, or fp32
inline void snake_row(const uint16_t* xr, uint16_t* yr, float a, float ib, int64_t t) {
  int64_t i = 0;
  for (; i + 8 <= t; i += 8) snake8_bf16(xr + i, yr + i, a, ib);
  ref::snake_row(xr + i, yr + i, a, ib, t - i);
}

inline void snake_row_f32(const float* xr, float* yr, float a, float ib, int64_t t) {
  int64_t i = 0;
  for (; i + 8 <= t; i += 8) snake8_f32(xr + i, yr + i, a, ib);
  ref::snake_row_f32(xr + i, yr + i, a, ib, t - i);
}

}  // namespace simd
}  // namespace
