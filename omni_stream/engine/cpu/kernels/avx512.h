// The AVX-512 kernel set (VNNI dot products, F16C; GFNI and AMX where the CPU has them).
// Part of omni_cpu.cpp (one translation unit); see there and kernels/isa.h for the overview.
//
// Products: activations quantized per row to int8 times the packed weights on VPDPBUSD
// (u8 x s8 -> s32): the weights are the unsigned operand of the affine kinds, the activations
// (x8 + 128, prepare_q8) of q8. With AMX (int8 tiles), q4 products of >= 16 rows run on tiles.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define OC_AMX 1
constexpr int kAmxMinRows = 16;  // products of fewer rows stay on VNNI (a tile is 16 rows)
#else
#define OC_AMX 0
#endif

namespace {
namespace simd {

constexpr const char* kIsa = "avx512";
constexpr const char* kFeatures = "+vnni"
#if defined(__GFNI__)
                                  "+gfni"
#endif
#if OC_AMX
                                  "+amx"
#endif
    ;

// Software prefetch distance of the weight stream (bytes ahead): one thread keeps more reads in
// flight than the hardware prefetcher alone (~7% on a code-predictor sub-step, 1 thread).
#ifndef OC_PF
#define OC_PF 2048
#endif
typedef int32_t __attribute__((may_alias, aligned(1))) i32a;  // 4 activation bytes as one word

// MT rows of int8 activations (inputs kk .. kk + 15 of each) times 4 VPDPBUSD weight operands
// (one per k-quad), into each row's A accumulator chains (the 3rd and 4th quads wrap onto the
// first two when A == 2). Broadcasts come straight from memory (VPDPBUSD's {1to16} operand).
template <int MT, int A>
inline void dot4(__m512i (&iacc)[MT][A], __m512i w0, __m512i w1, __m512i w2, __m512i w3,
                 const int8_t* x8, int k, int kk) {
  for (int r = 0; r < MT; r++) {
    const i32a* xr = reinterpret_cast<const i32a*>(x8 + (int64_t)r * k + kk);
    iacc[r][0] = _mm512_dpbusd_epi32(iacc[r][0], w0, _mm512_set1_epi32(xr[0]));
    iacc[r][1] = _mm512_dpbusd_epi32(iacc[r][1], w1, _mm512_set1_epi32(xr[1]));
    iacc[r][2 % A] = _mm512_dpbusd_epi32(iacc[r][2 % A], w2, _mm512_set1_epi32(xr[2]));
    iacc[r][3 % A] = _mm512_dpbusd_epi32(iacc[r][3 % A], w3, _mm512_set1_epi32(xr[3]));
  }
}

// One group's integer sums a of one activation row into its float accumulator f, for weights
// w = q s + m: f += a (s xs) + m (xs sum x8) (the affine kinds' epilogue, every kernel's).
inline __m512 affine_group(__m512 f, __m512i a, __m512 sc, __m512 mn, float xs, int32_t gsum) {
  f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sc, _mm512_set1_ps(xs)), f);
  return _mm512_fmadd_ps(mn, _mm512_set1_ps(xs * (float)gsum), f);
}

// VPDPBUSD has a latency of several cycles: each row keeps 4 independent accumulators (one per
// k-quad of a 16-byte step) so the chains overlap, summed at the end of each group.
// q4 layout: per block of 16 rows, 64 bytes per pair of k-quads: byte 4 r + i holds row r's
// weight at input 4 kq + i (low nibble) and 4 (kq + 1) + i (high nibble). One 64-byte load,
// two masks and a shift give two VPDPBUSD operands (rows 0..15 in the lanes).
template <int MT>
void q4_block(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int nb,
              float* y, int ldy) {
  const int k = L.k, g = L.group, ng = k / g;
  const uint8_t* wb = L.w + (int64_t)nb * (k / 8) * 64;
  const uint16_t* sb = L.scales + (int64_t)nb * ng * 32;
  __m512 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < ng; j++) {
    constexpr int A = MT <= 4 ? 4 : 2;  // accumulator chains per row (32 vector registers)
    __m512i iacc[MT][A];
    for (int r = 0; r < MT; r++)
      for (int u = 0; u < A; u++) iacc[r][u] = _mm512_setzero_si512();
    const uint8_t* wp = wb + (int64_t)j * (g / 8) * 64;
    for (int kp = 0; kp < g / 8; kp += 2) {  // 2 loads = 4 k-quads = 16 inputs
      _mm_prefetch((const char*)(wp + kp * 64 + OC_PF), _MM_HINT_T0);
      _mm_prefetch((const char*)(wp + (kp + 1) * 64 + OC_PF), _MM_HINT_T0);
      __m512i r0 = _mm512_loadu_si512((const void*)(wp + kp * 64));
      __m512i r1 = _mm512_loadu_si512((const void*)(wp + (kp + 1) * 64));
      // high nibbles are used in place (x16, folded back with >> 4 per group): no shifts
      __m512i w0 = _mm512_and_si512(r0, mask);
      __m512i w1 = _mm512_andnot_si512(mask, r0);
      __m512i w2 = _mm512_and_si512(r1, mask);
      __m512i w3 = _mm512_andnot_si512(mask, r1);
      dot4<MT, A>(iacc, w0, w1, w2, w3, x8, k, j * g + kp * 8);
    }
    __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32 + 16)));
    for (int r = 0; r < MT; r++) {
      // chains 0 (and 2) hold low nibbles, 1 (and 3) high nibbles times 16 (exact multiples)
      __m512i lo = iacc[r][0], hi = iacc[r][1];
      if constexpr (A == 4) {
        lo = _mm512_add_epi32(lo, iacc[r][2]);
        hi = _mm512_add_epi32(hi, iacc[r][3]);
      }
      __m512i a = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
      facc[r] = affine_group(facc[r], a, sc, mn, xs[r], gsum[(int64_t)r * ng + j]);
    }
  }
  for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + (int64_t)r * ldy + nb * 16, facc[r]);
}

// q6 / q5 layout: per block of 16 rows and group of 64 inputs, 4 steps t of 16 inputs: two
// vectors of low nibbles in the q4 layout (k-quads 4 t .. 4 t + 3), then their top bits:
//   q6, one vector: byte 4 r + i, bits 2 u..2 u + 1 hold the top two bits of row r's input
//       4 (4 t + u) + i (768 bytes per group);
//   q5, half a vector: lane p = 4 r + i of k-quad 4 t + u is bit u of byte p (p < 32, low
//       nibble) or of byte p - 32 (high nibble) (640 bytes per group).
// One step reads its bytes (one sequential stream) and unpacks 4 VPDPBUSD operands of unsigned
// 5- or 6-bit weights; the scales and the epilogue are q4's.
// q8g (BITS 8): unsigned bytes with the group's scale and offset, in the q8 layout (one vector
// per k-quad, 4 per step; 1024 bytes per group): heavy-tailed rows lose less to a per-group
// range than to a per-row one.
template <int BITS>
constexpr int step_bytes() { return BITS == 8 ? 256 : BITS == 6 ? 192 : 160; }

#if defined(__GFNI__)
// GF2P8AFFINEQB matrices (one per qword lane): output bit i of a byte is the parity of the
// byte ANDed with matrix byte 7 - i. q6: bits 2u, 2u + 1 to bits 4, 5 (matrix bytes 3 and 2).
constexpr long long kTop6[4] = {(1LL << 24) | (2LL << 16), (4LL << 24) | (8LL << 16),
                                (16LL << 24) | (32LL << 16), (64LL << 24) | (128LL << 16)};
// q5, top bit u of a lane: bit u of its byte in the low half (qwords 0-3), bit 4 + u in the
// high half (qwords 4-7), to bit 4 (matrix byte 3)
inline __m512i top5(int u) {
  const long long lo = (1LL << u) << 24, hi = (1LL << (4 + u)) << 24;
  return _mm512_set_epi64(hi, hi, hi, hi, lo, lo, lo, lo);
}
#endif

template <int MT, int BITS>
void q56_block(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int nb,
               float* y, int ldy) {
  constexpr int SB = step_bytes<BITS>();
  const int k = L.k, ng = k / 64;
  const uint8_t* wb = L.w + (int64_t)nb * ng * 4 * SB;
  const uint16_t* sb = L.scales + (int64_t)nb * ng * 32;
  __m512 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(BITS == 6 ? 0x30 : 0x10);
  for (int j = 0; j < ng; j++) {
    constexpr int A = MT <= 4 ? 4 : 2;
    __m512i iacc[MT][A];
    for (int r = 0; r < MT; r++)
      for (int u = 0; u < A; u++) iacc[r][u] = _mm512_setzero_si512();
    const uint8_t* wp = wb + (int64_t)j * 4 * SB;
    for (int t = 0; t < 4; t++) {
      const uint8_t* tp = wp + t * SB;
      _mm_prefetch((const char*)(tp + OC_PF), _MM_HINT_T0);
      _mm_prefetch((const char*)(tp + OC_PF + 64), _MM_HINT_T0);
      _mm_prefetch((const char*)(tp + OC_PF + 128), _MM_HINT_T0);
      if constexpr (BITS == 8) _mm_prefetch((const char*)(tp + OC_PF + 192), _MM_HINT_T0);
      __m512i r0 = _mm512_loadu_si512((const void*)tp);
      __m512i r1 = _mm512_loadu_si512((const void*)(tp + 64));
      __m512i w0, w1, w2, w3;
      if constexpr (BITS == 8) {
        w0 = r0;
        w1 = r1;
        w2 = _mm512_loadu_si512((const void*)(tp + 128));
        w3 = _mm512_loadu_si512((const void*)(tp + 192));
#if defined(__GFNI__)
      } else if constexpr (BITS == 6) {
        // the top bits by one GF(2) affine map each (bits 2u, 2u + 1 of c to bits 4, 5), merged
        // with the nibble in one ternary op ((a & lo4) | g): the same bytes as below
        __m512i c = _mm512_loadu_si512((const void*)(tp + 128));
        __m512i s1 = _mm512_srli_epi16(r0, 4), s3 = _mm512_srli_epi16(r1, 4);
        w0 = _mm512_ternarylogic_epi32(r0, _mm512_gf2p8affine_epi64_epi8(c, _mm512_set1_epi64(kTop6[0]), 0), lo4, 0xEC);
        w1 = _mm512_ternarylogic_epi32(s1, _mm512_gf2p8affine_epi64_epi8(c, _mm512_set1_epi64(kTop6[1]), 0), lo4, 0xEC);
        w2 = _mm512_ternarylogic_epi32(r1, _mm512_and_si512(c, top), lo4, 0xEC);
        w3 = _mm512_ternarylogic_epi32(s3, _mm512_gf2p8affine_epi64_epi8(c, _mm512_set1_epi64(kTop6[3]), 0), lo4, 0xEC);
      } else {
        // q5: both halves of the 32 top-bit bytes in one broadcast; lane p < 32 takes bit u of
        // byte p, lane p >= 32 bit 4 + u of byte p - 32: a GF(2) affine map per half moves it
        // to bit 4
        __m512i bb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(tp + 128)));
        __m512i s1 = _mm512_srli_epi16(r0, 4), s3 = _mm512_srli_epi16(r1, 4);
        w0 = _mm512_ternarylogic_epi32(r0, _mm512_gf2p8affine_epi64_epi8(bb, top5(0), 0), lo4, 0xEC);
        w1 = _mm512_ternarylogic_epi32(s1, _mm512_gf2p8affine_epi64_epi8(bb, top5(1), 0), lo4, 0xEC);
        w2 = _mm512_ternarylogic_epi32(r1, _mm512_gf2p8affine_epi64_epi8(bb, top5(2), 0), lo4, 0xEC);
        w3 = _mm512_ternarylogic_epi32(s3, _mm512_gf2p8affine_epi64_epi8(bb, top5(3), 0), lo4, 0xEC);
      }
#else
      } else if constexpr (BITS == 6) {
        __m512i n0 = _mm512_and_si512(r0, lo4), n1 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4);
        __m512i n2 = _mm512_and_si512(r1, lo4), n3 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), lo4);
        __m512i c = _mm512_loadu_si512((const void*)(tp + 128));
        w0 = _mm512_or_si512(n0, _mm512_and_si512(_mm512_slli_epi16(c, 4), top));
        w1 = _mm512_or_si512(n1, _mm512_and_si512(_mm512_slli_epi16(c, 2), top));
        w2 = _mm512_or_si512(n2, _mm512_and_si512(c, top));
        w3 = _mm512_or_si512(n3, _mm512_and_si512(_mm512_srli_epi16(c, 2), top));
      } else {
        __m512i n0 = _mm512_and_si512(r0, lo4), n1 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), lo4);
        __m512i n2 = _mm512_and_si512(r1, lo4), n3 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), lo4);
        __m256i b = _mm256_loadu_si256((const __m256i*)(tp + 128));
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        __m512i e = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, m4)),
                                       _mm256_and_si256(_mm256_srli_epi16(b, 4), m4), 1);
        w0 = _mm512_or_si512(n0, _mm512_and_si512(_mm512_slli_epi16(e, 4), top));
        w1 = _mm512_or_si512(n1, _mm512_and_si512(_mm512_slli_epi16(e, 3), top));
        w2 = _mm512_or_si512(n2, _mm512_and_si512(_mm512_slli_epi16(e, 2), top));
        w3 = _mm512_or_si512(n3, _mm512_and_si512(_mm512_slli_epi16(e, 1), top));
      }
#endif
      dot4<MT, A>(iacc, w0, w1, w2, w3, x8, k, j * 64 + t * 16);
    }
    __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32 + 16)));
    for (int r = 0; r < MT; r++) {
      __m512i a = _mm512_add_epi32(iacc[r][0], iacc[r][1]);
      if constexpr (A == 4) a = _mm512_add_epi32(a, _mm512_add_epi32(iacc[r][2], iacc[r][3]));
      facc[r] = affine_group(facc[r], a, sc, mn, xs[r], gsum[(int64_t)r * ng + j]);
    }
  }
  for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + (int64_t)r * ldy + nb * 16, facc[r]);
}

template <int MT>
void q8_block(const OcLinear& L, const uint8_t* xu, const float* xs, int nb, float* y, int ldy) {
  const int k = L.k;
  const uint8_t* wb = L.w + (int64_t)nb * (k / 4) * 64;
  __m512i iacc[MT][4];
  for (int r = 0; r < MT; r++)
    for (int u = 0; u < 4; u++) iacc[r][u] = _mm512_setzero_si512();
  for (int kq = 0; kq < k / 4; kq += 4) {
    __m512i wv[4];
    for (int u = 0; u < 4; u++) wv[u] = _mm512_loadu_si512((const void*)(wb + (int64_t)(kq + u) * 64));
    for (int r = 0; r < MT; r++) {
      const i32a* xr = reinterpret_cast<const i32a*>(xu + (int64_t)r * k + kq * 4);
      for (int u = 0; u < 4; u++)
        iacc[r][u] = _mm512_dpbusd_epi32(iacc[r][u], _mm512_set1_epi32(xr[u]), wv[u]);
    }
  }
  __m512 rs = _mm512_loadu_ps(L.row_scale + nb * 16);
  __m512i sum128 = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(L.row_sum + nb * 16)), 7);
  for (int r = 0; r < MT; r++) {
    __m512i acc = _mm512_add_epi32(_mm512_add_epi32(iacc[r][0], iacc[r][1]),
                                   _mm512_add_epi32(iacc[r][2], iacc[r][3]));
    __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, sum128));
    _mm512_storeu_ps(y + (int64_t)r * ldy + nb * 16, _mm512_mul_ps(a, _mm512_mul_ps(rs, _mm512_set1_ps(xs[r]))));
  }
}
template <int BITS>
void q56_dispatch(int mt, const OcLinear& L, const int8_t* xr, const float* xsr, const int32_t* gs,
                  int64_t nb, float* yr) {
  switch (mt) {
    case 1: q56_block<1, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 2: q56_block<2, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 3: q56_block<3, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 4: q56_block<4, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 5: q56_block<5, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 6: q56_block<6, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    case 7: q56_block<7, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
    default: q56_block<8, BITS>(L, xr, xsr, gs, nb, yr, L.n); break;
  }
}

#if OC_AMX
// ------------------------------------------------------------------------------ AMX (int8 tiles)
// For products of many rows (a prefill, a batch of >= 16 streams) the q4 kernel runs on AMX
// tiles: per block of 16 output rows and group of 64 inputs, one TDPBSUD multiplies 16
// activation rows (signed bytes, read in place) by the group's weights (the nibbles unpacked to
// bytes: one q4 k-quad of a block is exactly one 64-byte row of an AMX B tile), and the same
// float epilogue as q4_block applies the group's scale and offset, so the result is bit for
// bit the VNNI kernel's. Linux hands out the tile state on request (amx_enabled, once per
// process); without it the VNNI kernel runs.
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_enabled() {
  static const bool ok = [] {
#if defined(__linux__)
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// tmm0: B (16 k-quads x 16 rows x 4), tmm1: A (16 rows x 64 inputs), tmm2: C (16 x 16 int32)
inline void amx_configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 3; t++) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// All m rows of x8 (stride k, padded with rows to whole tiles of 16) times block nb of a q4
// product with groups of 64: each group's weights are unpacked once and multiplied by every
// tile of rows; acc [>= m][16] holds the block's running sums.
void q4_block_amx(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum,
                  int m, int nb, float* acc, float* y, int ldy) {
  const int k = L.k, ng = k / 64;
  const uint8_t* wb = L.w + (int64_t)nb * (k / 8) * 64;
  const uint16_t* sb = L.scales + (int64_t)nb * ng * 32;
  alignas(64) uint8_t bt[16 * 64];
  alignas(64) int32_t ct[16 * 16];
  std::fill(acc, acc + (int64_t)m * 16, 0.f);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < ng; j++) {
    const uint8_t* wp = wb + (int64_t)j * 8 * 64;
    for (int p = 0; p < 8; p++) {  // pair p: k-quads 2p (low nibbles) and 2p + 1 (high)
      __m512i v = _mm512_loadu_si512((const void*)(wp + p * 64));
      _mm512_store_si512((void*)(bt + (2 * p) * 64), _mm512_and_si512(v, mask));
      _mm512_store_si512((void*)(bt + (2 * p + 1) * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
    _tile_loadd(0, bt, 64);
    __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32 + 16)));
    for (int r0 = 0; r0 < m; r0 += 16) {
      _tile_loadd(1, x8 + (int64_t)r0 * k + j * 64, k);
      _tile_zero(2);
      _tile_dpbsud(2, 1, 0);
      _tile_stored(2, ct, 64);
      const int rows = std::min(16, m - r0);
      for (int i = 0; i < rows; i++) {
        const int r = r0 + i;
        __m512i a = _mm512_load_si512((const void*)(ct + i * 16));
        _mm512_storeu_ps(acc + r * 16, affine_group(_mm512_loadu_ps(acc + r * 16), a, sc, mn, xs[r],
                                                    gsum[(int64_t)r * ng + j]));
      }
    }
  }
  for (int r = 0; r < m; r++) _mm512_storeu_ps(y + (int64_t)r * ldy + nb * 16, _mm512_loadu_ps(acc + r * 16));
}
#endif


// q8 reads its activations as VPDPBUSD's unsigned operand: x8 + 128
inline void prepare_q8(int8_t* x8, size_t n) {
  for (size_t i = 0; i < n; i++) x8[i] = (int8_t)(uint8_t)(x8[i] + 128);
}

// output blocks [b0, b1) for m rows (q8: x8 as prepare_q8 left it), tiles of up to 8 rows (4 q8)
inline void lowbit_blocks(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum,
                          int m, int64_t b0, int64_t b1, float* y) {
  const int g = L.kind == 0 ? L.group : 64;
  for (int64_t nb = b0; nb < b1; nb++)
    for (int r0 = 0; r0 < m; r0 += (L.kind == 1 ? 4 : 8)) {
      int mt = std::min(L.kind == 1 ? 4 : 8, m - r0);
      const int8_t* xr = x8 + (int64_t)r0 * L.k;
      const float* xsr = xs + r0;
      float* yr = y + (int64_t)r0 * L.n;
      const int32_t* gs = gsum + (int64_t)r0 * (L.k / g);
      if (L.kind == 3) {
        q56_dispatch<6>(mt, L, xr, xsr, gs, nb, yr);
      } else if (L.kind == 4) {
        q56_dispatch<5>(mt, L, xr, xsr, gs, nb, yr);
      } else if (L.kind == 5) {
        q56_dispatch<8>(mt, L, xr, xsr, gs, nb, yr);
      } else if (L.kind == 0) {
        switch (mt) {
          case 1: q4_block<1>(L, xr, xsr, gs, nb, yr, L.n); break;
          case 2: q4_block<2>(L, xr, xsr, gs, nb, yr, L.n); break;
          case 3: q4_block<3>(L, xr, xsr, gs, nb, yr, L.n); break;
          case 4: q4_block<4>(L, xr, xsr, gs, nb, yr, L.n); break;
          case 5: q4_block<5>(L, xr, xsr, gs, nb, yr, L.n); break;
          case 6: q4_block<6>(L, xr, xsr, gs, nb, yr, L.n); break;
          case 7: q4_block<7>(L, xr, xsr, gs, nb, yr, L.n); break;
          default: q4_block<8>(L, xr, xsr, gs, nb, yr, L.n); break;
        }
      } else {
        const uint8_t* xu = (const uint8_t*)xr;
        switch (mt) {
          case 1: q8_block<1>(L, xu, xsr, nb, yr, L.n); break;
          case 2: q8_block<2>(L, xu, xsr, nb, yr, L.n); break;
          case 3: q8_block<3>(L, xu, xsr, nb, yr, L.n); break;
          default: q8_block<4>(L, xu, xsr, nb, yr, L.n); break;
        }
      }
    }
}

#if OC_AMX
// rows x8 must have for a tiled product of m rows (0: this product is not tiled)
inline int tile_rows(const OcLinear& L, int m) {
  return L.kind == 0 && L.group == 64 && m >= kAmxMinRows && amx_enabled() ? (m + 15) / 16 * 16 : 0;
}
// blocks [b0, b1) of a tiled product (x8, xs, gsum padded with zero rows to tile_rows)
inline void tile_blocks(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int m,
                        int64_t b0, int64_t b1, float* y) {
  if (b0 >= b1) return;
  amx_configure();
  thread_local std::vector<float> acc;  // per-thread scratch, kept between calls
  acc.resize((size_t)(m + 15) / 16 * 16 * 16);
  for (int64_t nb = b0; nb < b1; nb++) q4_block_amx(L, x8, xs, gsum, m, nb, acc.data(), y, L.n);
  _tile_release();
}
#else
using ref::tile_blocks;
using ref::tile_rows;
#endif

// 16 lanes summed in ref::reduce16's order
inline float reduce16(__m512 v) { return _mm512_reduce_add_ps(v); }

inline float dot_f32(const float* w, const float* x, int k) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= k; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc);
  return ref::dot_tail(reduce16(acc), w, x, i, k);
}

inline __m512 load16_kv(const void* base, int bf16, int64_t idx) {
  if (bf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(base) + idx))), 16));
  return _mm512_loadu_ps(static_cast<const float*>(base) + idx);
}

inline float dot_kv(const float* q, const void* kb, int bf16, int64_t off, int d) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16_kv(kb, bf16, off + i), acc);
  return ref::dot_kv_tail(reduce16(acc), q, kb, bf16, off, i, d);
}

inline void axpy_kv(float a, const void* vb, int bf16, int64_t off, float* out, int d) {
  const __m512 av = _mm512_set1_ps(a);
  int i = 0;
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(av, load16_kv(vb, bf16, off + i), _mm512_loadu_ps(out + i)));
  ref::axpy_kv(a, vb, bf16, off + i, out + i, d - i);
}

// SnakeBeta of the `live` lanes of 16 values, ref::snake_one's arithmetic per lane
inline __m512 snake16(__m512 xv, float a, float ib, __mmask16 live) {
  const __m512 v = _mm512_mul_ps(xv, _mm512_set1_ps(a));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(ref::kInvPi)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 rr = _mm512_fnmadd_ps(k, _mm512_set1_ps(ref::kPi1), v);
  rr = _mm512_fnmadd_ps(k, _mm512_set1_ps(ref::kPi2), rr);
  rr = _mm512_fnmadd_ps(k, _mm512_set1_ps(ref::kPi3), rr);
  const __m512 r2 = _mm512_mul_ps(rr, rr);
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(ref::kSin11), r2, _mm512_set1_ps(ref::kSin9));
  poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(ref::kSin7));
  poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(ref::kSin5));
  poly = _mm512_fmadd_ps(poly, r2, _mm512_set1_ps(ref::kSin3));
  const __m512 s = _mm512_fnmadd_ps(_mm512_mul_ps(rr, r2), poly, rr);
  __m512 out = _mm512_fmadd_ps(_mm512_set1_ps(ib), _mm512_mul_ps(s, s), xv);
  // !(|v| < 4096) is also true for NaN: those lanes alone take std::sin
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(ref::kSnakeLimit), _CMP_NLT_UQ) & live;
  if (big) {
    alignas(64) float buf[16], xs[16];
    _mm512_store_ps(buf, out);
    _mm512_store_ps(xs, xv);
    for (int j = 0; j < 16; j++)
      if (big >> j & 1) buf[j] = ref::snake_exact(xs[j], a, ib);
    out = _mm512_load_ps(buf);
  }
  return out;
}

inline __mmask16 live16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// SnakeBeta over one bf16 row (the row's last partial vector through masked loads and stores)
inline void snake_row(const uint16_t* xr, uint16_t* yr, float a, float ib, int64_t t) {
  for (int64_t i = 0; i < t; i += 16) {
    const __mmask16 live = live16(t - i);
    const __m512 xv = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, xr + i)), 16));
    const __m512 out = snake16(xv, a, ib, live);
    // round to nearest even, NaN kept NaN (as f32_to_bf16)
    __m512i u = _mm512_castps_si512(out);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(out, out, _CMP_UNORD_Q);
    __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    rounded = _mm512_mask_mov_epi32(rounded, nan, qnan);
    _mm256_mask_storeu_epi16(yr + i, live, _mm512_cvtepi32_epi16(rounded));
  }
}

inline void snake_row_f32(const float* x, float* y, float a, float ib, int64_t t) {
  for (int64_t i = 0; i < t; i += 16) {
    const __mmask16 live = live16(t - i);
    _mm512_mask_storeu_ps(y + i, live, snake16(_mm512_maskz_loadu_ps(live, x + i), a, ib, live));
  }
}

}  // namespace simd
}  // namespace
