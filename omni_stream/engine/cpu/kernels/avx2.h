// The AVX2 kernel set (AVX2 + FMA + F16C; AVX-VNNI's VPDPBUSD where the CPU has it): the x86-64
// of laptops, desktops and the cloud's Zen 2 / Zen 3 / pre-Ice Lake servers.
// Part of omni_cpu.cpp (one translation unit); see there and kernels/isa.h for the overview.
//
// The packed layout is AVX-512's: a 64-byte vector of 16 rows x 4 inputs is two 32-byte halves
// here (rows 0-7, rows 8-15), each multiplied by a broadcast of 4 activation bytes.
// Products, exact int32 sums of u8 x s8 quads per row:
//   - with AVX-VNNI: VPDPBUSD (u8 weights x s8 activations, no saturation), as AVX-512;
//   - without: VPMADDUBSW (pairs into int16, saturating past 32767) then VPMADDWD by ones into
//     int32. Each kind adds int16 partials only as often as they cannot saturate (QuadSum):
//     q4 codes <= 15 (8 adds of |pair| <= 3810), q5 <= 31 (4 adds), q6 <= 63 (2 adds); q8g's
//     codes (<= 255) are split into nibbles (a = lo + 16 hi); q8's signed weights go in as
//     sign(w, x) against |x| (|pair| <= 32258, one add).
// The float epilogues and reductions are ref's (kernels/scalar.h), so the products are the
// scalar reference's (and the AVX-512 set's) bit for bit.
#pragma once

namespace {
namespace simd {

constexpr const char* kIsa = "avx2";
// VPDPBUSD on 8 lanes: AVX-VNNI's VEX form, or (tests, OC_AVX2_VNNI_EVEX) the same instruction's
// EVEX form of AVX512-VNNI + VL, so the AVX-VNNI path runs on a CPU without AVX-VNNI (qemu
// has none either)
#if defined(__AVXVNNI__)
#define OC_AVX2_VNNI 1
inline __m256i dpbusd8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#elif defined(OC_AVX2_VNNI_EVEX) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define OC_AVX2_VNNI 1
inline __m256i dpbusd8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
#else
#define OC_AVX2_VNNI 0
#endif

constexpr const char* kFeatures = "+fma+f16c"
#if OC_AVX2_VNNI
                                  "+avxvnni"
#endif
    ;

#ifndef OC_PF
#define OC_PF 2048
#endif

#ifndef OC_TILE_Q4
#define OC_TILE_Q4 4
#endif
#ifndef OC_TILE_Q56
#define OC_TILE_Q56 4
#endif
#ifndef OC_TILE_Q8G
#define OC_TILE_Q8G 2
#endif

typedef int32_t __attribute__((may_alias, aligned(1))) i32u;  // 4 activation bytes as one word

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const i32u*>(p)); }

// Exact int32 sums of 4 (u8 w)(s8 x) products per lane. Without AVX-VNNI the caller flushes
// the int16 partial into the int32 sums before it could saturate (see the file's comment).
struct QuadSum {
  __m256i s32 = _mm256_setzero_si256();
#if !OC_AVX2_VNNI
  __m256i s16 = _mm256_setzero_si256();
#endif
  inline void add(__m256i w, __m256i x) {
#if OC_AVX2_VNNI
    s32 = dpbusd8(s32, w, x);
#else
    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w, x));
#endif
  }
  inline void flush() {
#if !OC_AVX2_VNNI
    s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    s16 = _mm256_setzero_si256();
#endif
  }
};

// f += a (s xs) then f += m (xs gsum): ref::affine_group on 8 rows
inline __m256 affine_group(__m256 f, __m256i a, __m256 sc, __m256 mn, float xs, int32_t gsum) {
  f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(sc, _mm256_set1_ps(xs)), f);
  return _mm256_fmadd_ps(mn, _mm256_set1_ps(xs * (float)gsum), f);
}

inline __m256 half_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// q4 (layout: omni_cpu.cpp): per 64-byte chunk, k-quad 2c in the low nibbles and 2c + 1 in the
// high ones; the int16 partials take 4 chunks (8 adds) between flushes (groups of 32 k).
template <int MT>
void q4_block(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int64_t nb,
              float* y, int ldy) {
  const int k = L.k, g = L.group, ng = k / g;
  const uint8_t* wb = L.w + nb * (k / 8) * 64;
  const uint16_t* sb = L.scales + nb * ng * 32;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 f[MT][2];
  for (int r = 0; r < MT; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int j = 0; j < ng; j++) {
    QuadSum q[MT][2];
    const uint8_t* wp = wb + (int64_t)j * (g / 8) * 64;
    for (int c = 0; c < g / 8; c++) {
      _mm_prefetch((const char*)(wp + c * 64 + OC_PF), _MM_HINT_T0);
      const __m256i h0 = _mm256_loadu_si256((const __m256i*)(wp + c * 64));
      const __m256i h1 = _mm256_loadu_si256((const __m256i*)(wp + c * 64 + 32));
      const __m256i l0 = _mm256_and_si256(h0, m4), u0 = _mm256_and_si256(_mm256_srli_epi16(h0, 4), m4);
      const __m256i l1 = _mm256_and_si256(h1, m4), u1 = _mm256_and_si256(_mm256_srli_epi16(h1, 4), m4);
      const int kk = j * g + c * 8;
      for (int r = 0; r < MT; r++) {
        const __m256i xa = bcast4(x8 + (int64_t)r * k + kk), xb = bcast4(x8 + (int64_t)r * k + kk + 4);
        q[r][0].add(l0, xa);
        q[r][0].add(u0, xb);
        q[r][1].add(l1, xa);
        q[r][1].add(u1, xb);
      }
      if ((c & 3) == 3 || c == g / 8 - 1)
        for (int r = 0; r < MT; r++) {
          q[r][0].flush();
          q[r][1].flush();
        }
    }
    const __m256 sc0 = half_f16(sb + j * 32), sc1 = half_f16(sb + j * 32 + 8);
    const __m256 mn0 = half_f16(sb + j * 32 + 16), mn1 = half_f16(sb + j * 32 + 24);
    for (int r = 0; r < MT; r++) {
      const int32_t gs = gsum[(int64_t)r * ng + j];
      f[r][0] = affine_group(f[r][0], q[r][0].s32, sc0, mn0, xs[r], gs);
      f[r][1] = affine_group(f[r][1], q[r][1].s32, sc1, mn1, xs[r], gs);
    }
  }
  for (int r = 0; r < MT; r++) {
    _mm256_storeu_ps(y + (int64_t)r * ldy + nb * 16, f[r][0]);
    _mm256_storeu_ps(y + (int64_t)r * ldy + nb * 16 + 8, f[r][1]);
  }
}

// q6 / q5 / q8g (layouts: avx512.h's q56_block): per group of 64 inputs, 4 steps of 16.
template <int BITS>
constexpr int step_bytes() { return BITS == 8 ? 256 : BITS == 6 ? 192 : 160; }

// Adds between flushes without AVX-VNNI: q5 4, q6 2 (per step of 4 k-quads: 1 and 2 flushes),
// q8g's nibbles 8 (a flush every 2 steps).
template <int BITS>
constexpr int adds_per_flush() { return BITS == 8 ? 8 : BITS == 6 ? 2 : 4; }

// The code operand of k-quad u (0..3) of a step, half h (rows 8h .. 8h + 7).
template <int BITS>
inline __m256i unpack(const uint8_t* tp, int u, int h, __m256i m4) {
  if constexpr (BITS == 8) return _mm256_loadu_si256((const __m256i*)(tp + u * 64 + h * 32));
  const __m256i raw = _mm256_loadu_si256((const __m256i*)(tp + (u / 2) * 64 + h * 32));
  const __m256i nib = (u % 2 == 0) ? _mm256_and_si256(raw, m4) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  if constexpr (BITS == 6) {  // bits 2u, 2u + 1 of byte 4 r + i to bits 4, 5
    const __m256i c = _mm256_loadu_si256((const __m256i*)(tp + 128 + h * 32));
    const __m256i top = _mm256_set1_epi8(0x30);
    __m256i t;
    switch (u) {
      case 0: t = _mm256_slli_epi16(c, 4); break;
      case 1: t = _mm256_slli_epi16(c, 2); break;
      case 2: t = c; break;
      default: t = _mm256_srli_epi16(c, 2); break;
    }
    return _mm256_or_si256(nib, _mm256_and_si256(t, top));
  } else {  // q5: lane p < 32 takes bit u of byte p, lane p >= 32 bit 4 + u of byte p - 32
    const __m256i b = _mm256_loadu_si256((const __m256i*)(tp + 128));
    const __m256i e = h == 0 ? _mm256_and_si256(b, m4) : _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    __m256i t;
    switch (u) {
      case 0: t = _mm256_slli_epi16(e, 4); break;
      case 1: t = _mm256_slli_epi16(e, 3); break;
      case 2: t = _mm256_slli_epi16(e, 2); break;
      default: t = _mm256_slli_epi16(e, 1); break;
    }
    return _mm256_or_si256(nib, _mm256_and_si256(t, _mm256_set1_epi8(0x10)));
  }
}

template <int MT, int BITS>
void q56_block(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int64_t nb,
               float* y, int ldy) {
  constexpr int SB = step_bytes<BITS>();
#if OC_AVX2_VNNI
  constexpr bool split = false;  // VPDPBUSD takes the 8-bit codes whole
#else
  constexpr bool split = BITS == 8;  // q8g codes as two nibbles: a = lo + 16 hi
#endif
  const int k = L.k, ng = k / 64;
  const uint8_t* wb = L.w + nb * ng * 4 * SB;
  const uint16_t* sb = L.scales + nb * ng * 32;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 f[MT][2];
  for (int r = 0; r < MT; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int j = 0; j < ng; j++) {
    QuadSum q[MT][2], hi[MT][split ? 2 : 1];
    const uint8_t* wp = wb + (int64_t)j * 4 * SB;
    int adds = 0;
    for (int t = 0; t < 4; t++) {
      const uint8_t* tp = wp + t * SB;
      for (int pf = 0; pf < SB; pf += 64) _mm_prefetch((const char*)(tp + OC_PF + pf), _MM_HINT_T0);
      const int kk = j * 64 + t * 16;
      for (int u = 0; u < 4; u++) {
        for (int h = 0; h < 2; h++) {
          const __m256i w = unpack<BITS>(tp, u, h, m4);
          for (int r = 0; r < MT; r++) {
            const __m256i x = bcast4(x8 + (int64_t)r * k + kk + 4 * u);
            if constexpr (split) {
              q[r][h].add(_mm256_and_si256(w, m4), x);
              hi[r][h].add(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), x);
            } else {
              q[r][h].add(w, x);
            }
          }
        }
        if (++adds == adds_per_flush<BITS>()) {
          adds = 0;
          for (int r = 0; r < MT; r++)
            for (int h = 0; h < 2; h++) {
              q[r][h].flush();
              if constexpr (split) hi[r][h].flush();
            }
        }
      }
    }
    for (int r = 0; r < MT; r++)  // 16 adds per group: every kind's last flush is done
      for (int h = 0; h < 2; h++) {
        __m256i a = q[r][h].s32;
        if constexpr (split) a = _mm256_add_epi32(a, _mm256_slli_epi32(hi[r][h].s32, 4));
        f[r][h] = affine_group(f[r][h], a, half_f16(sb + j * 32 + 8 * h), half_f16(sb + j * 32 + 16 + 8 * h), xs[r],
                               gsum[(int64_t)r * ng + j]);
      }
  }
  for (int r = 0; r < MT; r++) {
    _mm256_storeu_ps(y + (int64_t)r * ldy + nb * 16, f[r][0]);
    _mm256_storeu_ps(y + (int64_t)r * ldy + nb * 16 + 8, f[r][1]);
  }
}

// q8 (signed weights, per-row scale): |x| against sign(w, x), one add per flush
template <int MT>
void q8_block(const OcLinear& L, const int8_t* x8, const float* xs, int64_t nb, float* y, int ldy) {
  const int k = L.k;
  const uint8_t* wb = L.w + nb * (k / 4) * 64;
  QuadSum q[MT][2];
  for (int kq = 0; kq < k / 4; kq++) {
    _mm_prefetch((const char*)(wb + (int64_t)kq * 64 + OC_PF), _MM_HINT_T0);
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wb + (int64_t)kq * 64));
    const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wb + (int64_t)kq * 64 + 32));
    for (int r = 0; r < MT; r++) {
      const __m256i x = bcast4(x8 + (int64_t)r * k + kq * 4), ax = _mm256_abs_epi8(x);
      q[r][0].add(ax, _mm256_sign_epi8(w0, x));
      q[r][1].add(ax, _mm256_sign_epi8(w1, x));
      q[r][0].flush();
      q[r][1].flush();
    }
  }
  for (int r = 0; r < MT; r++)
    for (int h = 0; h < 2; h++) {
      const __m256 rs = _mm256_loadu_ps(L.row_scale + nb * 16 + 8 * h);
      _mm256_storeu_ps(y + (int64_t)r * ldy + nb * 16 + 8 * h,
                       _mm256_mul_ps(_mm256_cvtepi32_ps(q[r][h].s32), _mm256_mul_ps(rs, _mm256_set1_ps(xs[r]))));
    }
}

inline void prepare_q8(int8_t*, size_t) {}  // q8 takes the signed activations as they are

template <int MT>
inline void block_rows(const OcLinear& L, const int8_t* xr, const float* xsr, const int32_t* gs, int64_t nb,
                       float* yr) {
  switch (L.kind) {
    case 0: q4_block<MT>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 1: q8_block<MT>(L, xr, xsr, nb, yr, L.n); break;
    case 3: q56_block<MT, 6>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 4: q56_block<MT, 5>(L, xr, xsr, gs, nb, yr, L.n); break;
    default: q56_block<MT, 8>(L, xr, xsr, gs, nb, yr, L.n); break;
  }
}

// Activation rows per tile, per kind (rows share each weight load; past these the accumulators
// spill out of the 16 vector registers: q8g without AVX-VNNI keeps 4 per row). Measured on
// products of 4 rows, AMD EPYC Zen 4 at the AVX2 cap (-D to try others).
inline int tile_rows_for(const OcLinear& L) {
  if (L.kind == 0) return OC_TILE_Q4;
  if (L.kind == 5 && !OC_AVX2_VNNI) return OC_TILE_Q8G;
  return OC_TILE_Q56;
}

// output blocks [b0, b1) for m rows, in tiles of tile_rows_for(L) rows
inline void lowbit_blocks(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum,
                          int m, int64_t b0, int64_t b1, float* y) {
  const int ng = L.kind == 1 ? 0 : L.k / (L.kind == 0 ? L.group : 64), mt = tile_rows_for(L);
  for (int64_t nb = b0; nb < b1; nb++)
    for (int r0 = 0; r0 < m; r0 += mt) {
      const int8_t* xr = x8 + (int64_t)r0 * L.k;
      const int32_t* gs = gsum + (int64_t)r0 * ng;
      float* yr = y + (int64_t)r0 * L.n;
      switch (std::min(mt, m - r0)) {
        case 1: block_rows<1>(L, xr, xs + r0, gs, nb, yr); break;
        case 2: block_rows<2>(L, xr, xs + r0, gs, nb, yr); break;
        case 3: block_rows<3>(L, xr, xs + r0, gs, nb, yr); break;
        default: block_rows<4>(L, xr, xs + r0, gs, nb, yr); break;
      }
    }
}

using ref::tile_blocks;
using ref::tile_rows;

// lanes 0-7 and 8-15 summed in ref::reduce16's order
inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 r8 = _mm256_add_ps(lo, hi);
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

inline float dot_f32(const float* w, const float* x, int k) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), hi);
  }
  return ref::dot_tail(reduce16(lo, hi), w, x, i, k);
}

inline __m256 load8_kv(const void* base, int bf16, int64_t idx) {
  if (bf16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(base) + idx))), 16));
  return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
}

inline float dot_kv(const float* q, const void* kb, int bf16, int64_t off, int d) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_kv(kb, bf16, off + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8_kv(kb, bf16, off + i + 8), hi);
  }
  return ref::dot_kv_tail(reduce16(lo, hi), q, kb, bf16, off, i, d);
}

inline void axpy_kv(float a, const void* vb, int bf16, int64_t off, float* out, int d) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(av, load8_kv(vb, bf16, off + i), _mm256_loadu_ps(out + i)));
  ref::axpy_kv(a, vb, bf16, off + i, out + i, d - i);
}

// SnakeBeta of 8 values, ref::snake_one's arithmetic per lane (a row's partial last vector
// goes through ref's scalar code: the same bits either way)
inline __m256 snake8(__m256 xv, float a, float ib) {
  const __m256 v = _mm256_mul_ps(xv, _mm256_set1_ps(a));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(ref::kInvPi)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(ref::kPi1), v);
  rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(ref::kPi2), rr);
  rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(ref::kPi3), rr);
  const __m256 r2 = _mm256_mul_ps(rr, rr);
  __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(ref::kSin11), r2, _mm256_set1_ps(ref::kSin9));
  poly = _mm256_fmadd_ps(poly, r2, _mm256_set1_ps(ref::kSin7));
  poly = _mm256_fmadd_ps(poly, r2, _mm256_set1_ps(ref::kSin5));
  poly = _mm256_fmadd_ps(poly, r2, _mm256_set1_ps(ref::kSin3));
  const __m256 s = _mm256_fnmadd_ps(_mm256_mul_ps(rr, r2), poly, rr);
  __m256 out = _mm256_fmadd_ps(_mm256_set1_ps(ib), _mm256_mul_ps(s, s), xv);
  // !(|v| < 4096) is also true for NaN: those lanes alone take std::sin
  const __m256 absv = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  const int big = _mm256_movemask_ps(_mm256_cmp_ps(absv, _mm256_set1_ps(ref::kSnakeLimit), _CMP_NLT_UQ));
  if (big) {
    alignas(32) float buf[8], xs[8];
    _mm256_store_ps(buf, out);
    _mm256_store_ps(xs, xv);
    for (int j = 0; j < 8; j++)
      if (big >> j & 1) buf[j] = ref::snake_exact(xs[j], a, ib);
    out = _mm256_load_ps(buf);
  }
  return out;
}

inline void snake_row(const uint16_t* xr, uint16_t* yr, float a, float ib, int64_t t) {
  int64_t i = 0;
  for (; i + 8 <= t; i += 8) {
    const __m256 xv = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(xr + i))), 16));
    const __m256 out = snake8(xv, a, ib);
    // round to nearest even, NaN kept NaN (as f32_to_bf16), then 8 x 16 bits
    const __m256i u = _mm256_castps_si256(out);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(out, out, _CMP_UNORD_Q));
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    rounded = _mm256_blendv_epi8(rounded, qnan, nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
    _mm_storeu_si128((__m128i*)(yr + i), _mm256_castsi256_si128(packed));
  }
  ref::snake_row(xr + i, yr + i, a, ib, t - i);
}

inline void snake_row_f32(const float* x, float* y, float a, float ib, int64_t t) {
  int64_t i = 0;
  for (; i + 8 <= t; i += 8) _mm256_storeu_ps(y + i, snake8(_mm256_loadu_ps(x + i), a, ib));
  ref::snake_row_f32(x + i, y + i, a, ib, t - i);
}

}  // namespace simd
}  // namespace
