// A/B for issue 45: the runtime's hand-written AVX2 q4 block (kernels/avx2.h) against the same
// product written with Google Highway (Debian's libhwy-dev 1.0.3), both for AVX2, one thread,
// one activation row (a decode step's product), weights resident in L2/L3 (the code predictor's
// re-read case) and streamed from memory. Highway 1.0.3 has no u8 x s8 pair product
// (VPMADDUBSW / VPDPBUSD): its portable path widens codes and activations to int16 and uses
// ReorderWidenMulAccumulate (VPMADDWD). Both give the same integer sums (checked below).
//
//   g++ -O3 -march=native -mno-avx512f -std=c++17 -ffp-contract=off \
//       benchmarks/tts/kernels_ab/hwy_q4.cpp -o /tmp/hwy_q4 && /tmp/hwy_q4
// (-march=haswell makes Highway 1.0.3 pick its SSSE3 target; the build must reach AVX2, which
// main() checks.) apt-get install libhwy-dev.
#include <hwy/highway.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../../../omni_stream/engine/cpu/omni_cpu.cpp"

namespace hn = hwy::HWY_NAMESPACE;

// the activations of each 64-byte chunk as the int16 operands: k-quad 2c (xa) and 2c + 1 (xb),
// each repeated for 4 rows; made once per product and shared by every block
static std::vector<int16_t> widen_activations(const int8_t* x8, int k) {
  std::vector<int16_t> xw((size_t)k / 8 * 32);
  for (int c = 0; c < k / 8; c++)
    for (int r = 0; r < 4; r++)
      for (int i = 0; i < 4; i++) {
        xw[c * 32 + r * 4 + i] = x8[c * 8 + i];
        xw[c * 32 + 16 + r * 4 + i] = x8[c * 8 + 4 + i];
      }
  return xw;
}

// the integer sums of one q4 block (16 rows) over groups of 64 inputs, into acc [ng][16]
static void hwy_q4_sums(const uint8_t* wb, const int16_t* xw, int k, int32_t* acc) {
  const hn::ScalableTag<uint8_t> du8;
  const hn::ScalableTag<int16_t> di16;
  const hn::ScalableTag<int32_t> di32;
  const hn::Half<decltype(du8)> dh8;
  const auto m4 = hn::Set(du8, 0x0F);
  for (int j = 0; j < k / 64; j++) {
    // per half (8 rows): int32 lanes hold pair sums; rows r: lanes 2r', 2r' + 1 of each product
    auto s0 = hn::Zero(di32), s1 = hn::Zero(di32), s2 = hn::Zero(di32), s3 = hn::Zero(di32);
    for (int c = 0; c < 8; c++) {
      const uint8_t* p = wb + ((size_t)j * 8 + c) * 64;
      const int16_t* xc = xw + ((size_t)j * 8 + c) * 32;
      const auto va = hn::LoadU(di16, xc), vb = hn::LoadU(di16, xc + 16);
      for (int h = 0; h < 2; h++) {
        const auto v = hn::LoadU(du8, p + 32 * h);
        const auto lo = hn::And(v, m4);
        const auto hi = hn::And(hn::BitCast(du8, hn::ShiftRight<4>(hn::BitCast(hn::RepartitionToWide<decltype(du8)>(), v))), m4);
        // rows 0-3 / 4-7 of the half: the lower / upper 16 bytes, widened to int16
        auto& a0 = h ? s2 : s0;
        auto& a1 = h ? s3 : s1;
        auto w0 = hn::BitCast(di16, hn::PromoteTo(hn::Rebind<uint16_t, decltype(dh8)>(), hn::LowerHalf(dh8, lo)));
        auto w1 = hn::BitCast(di16, hn::PromoteTo(hn::Rebind<uint16_t, decltype(dh8)>(), hn::UpperHalf(dh8, lo)));
        auto u0 = hn::BitCast(di16, hn::PromoteTo(hn::Rebind<uint16_t, decltype(dh8)>(), hn::LowerHalf(dh8, hi)));
        auto u1 = hn::BitCast(di16, hn::PromoteTo(hn::Rebind<uint16_t, decltype(dh8)>(), hn::UpperHalf(dh8, hi)));
        auto t0 = hn::Zero(di32), t1 = hn::Zero(di32);
        a0 = hn::ReorderWidenMulAccumulate(di32, w0, va, a0, t0);
        a1 = hn::ReorderWidenMulAccumulate(di32, w1, va, a1, t1);
        a0 = hn::ReorderWidenMulAccumulate(di32, u0, vb, a0, t0);
        a1 = hn::ReorderWidenMulAccumulate(di32, u1, vb, a1, t1);
      }
    }
    // pair sums -> row sums (lanes 2i, 2i + 1 of each vector are one row)
    int32_t tmp[4][8];
    hn::StoreU(s0, di32, tmp[0]);
    hn::StoreU(s1, di32, tmp[1]);
    hn::StoreU(s2, di32, tmp[2]);
    hn::StoreU(s3, di32, tmp[3]);
    for (int q = 0; q < 4; q++)
      for (int i = 0; i < 4; i++) acc[j * 16 + q * 4 + i] = tmp[q][2 * i] + tmp[q][2 * i + 1];
  }
}

int main() {
  if (hn::Lanes(hn::ScalableTag<int16_t>()) != 16 || std::strcmp(simd::kIsa, "avx2") != 0) {
    std::printf("build for AVX2 (Highway target %s, kernel set %s): see the command above\n",
                hwy::TargetName(HWY_TARGET), simd::kIsa);
    return 2;
  }
  const int n = 6144, k = 1024, ng = k / 64;
  std::mt19937 rng(1);
  std::vector<uint8_t> w((size_t)n / 16 * (k / 8) * 64);
  for (auto& b : w) b = (uint8_t)rng();
  std::vector<uint16_t> sc((size_t)n / 16 * ng * 32, 0x3c00);  // fp16 1.0
  std::vector<int8_t> x8(k);
  for (auto& v : x8) v = (int8_t)((int)(rng() % 255) - 127);
  std::vector<float> xs(1, 0.01f), y(n);
  std::vector<int32_t> gsum(ng, 0), acc((size_t)ng * 16);
  OcLinear L{0, n, k, 64, w.data(), sc.data(), nullptr, nullptr, nullptr, nullptr};
  // the integer sums agree: Highway's vs the scalar reference's, block 0
  const std::vector<int16_t> xw = widen_activations(x8.data(), k);
  hwy_q4_sums(w.data(), xw.data(), k, acc.data());
  for (int row = 0; row < 16; row++)
    for (int j = 0; j < ng; j++) {
      int32_t s = 0;
      for (int i = j * 64; i < (j + 1) * 64; i++) s += ref::code_at(L, 0, row, i) * x8[i];
      if (s != acc[j * 16 + row]) { std::printf("MISMATCH row %d group %d: %d vs %d\n", row, j, s, acc[j * 16 + row]); return 1; }
    }
  auto time_ms = [&](auto&& fn) {
    double best = 1e9;
    std::vector<double> ts;
    for (int rep = 0; rep < 41; rep++) {
      auto t0 = std::chrono::steady_clock::now();
      fn();
      ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    (void)best;
    return ts[ts.size() / 2];
  };
  double hand = 0, hwy = 0;
  for (int round = 0; round < 5; round++) {  // interleaved; medians of medians
    double a = time_ms([&] { simd::lowbit_blocks(L, x8.data(), xs.data(), gsum.data(), 1, 0, n / 16, y.data()); });
    double b = time_ms([&] {
      const std::vector<int16_t> xv = widen_activations(x8.data(), k);
      for (int nb = 0; nb < n / 16; nb++) hwy_q4_sums(w.data() + (size_t)nb * (k / 8) * 64, xv.data(), k, acc.data());
    });
    std::printf("round %d: hand-written %s %.3f ms, Highway (sums only, no epilogue) %.3f ms\n", round, simd::kIsa, a, b);
    hand += a / 5;
    hwy += b / 5;
  }
  std::printf("q4 %dx%d, 1 row, 1 thread: hand-written %.3f ms, Highway %.3f ms (x%.2f), %.1f MB of weights\n", n, k,
              hand, hwy, hwy / hand, w.size() / 1e6);
  return 0;
}
