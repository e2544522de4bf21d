// Sampling of the CPU runtime: the chain and noise of engine/sampling.py.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
#pragma once
#include "oc_pool.h"

namespace {

// ------------------------------------------------------------------------------ sampling
// The same chain and the same counter-based noise as engine/sampling.py: NaN scores are -inf,
// scores shifted by the row max then divided by T, exactly top-k by (score desc, id asc),
// top-p on that distribution, Gumbel-max over the allowed candidates only; -1 when nothing
// may be drawn.
constexpr int64_t GOLDEN = (int64_t)0x9e3779b97f4a7c15ULL;
inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
inline float noise_u(uint64_t key, int64_t tok) {
  uint64_t th = mix64((uint64_t)tok * (uint64_t)GOLDEN);
  uint64_t x = mix64(key ^ th);
  uint32_t top = (uint32_t)(x >> (64 - 23));
  return ((float)top + 0.5f) * (1.0f / 8388608.0f);
}

struct SampleParams {
  int32_t greedy, top_k;
  float temperature, top_p;
};

int64_t sample_row(const float* scores_in, int v, const SampleParams& p, int64_t seed, int64_t counter,
                   std::vector<float>& sbuf, std::vector<int32_t>& ibuf) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float fmax = std::numeric_limits<float>::max();
  if (p.greedy) {
    int64_t best = -1;
    float bv = ninf;
    for (int i = 0; i < v; i++) {
      float s = scores_in[i];
      if (std::isnan(s)) continue;
      if (s > bv) {
        bv = s;
        best = i;
      }
    }
    return best;  // -1 when every score is -inf or NaN
  }
  sbuf.resize(v);
  float mx = ninf;
  for (int i = 0; i < v; i++) {
    float s = scores_in[i];
    s = std::isnan(s) ? ninf : (s == std::numeric_limits<float>::infinity() ? fmax : s);
    sbuf[i] = s;
    mx = std::max(mx, s);
  }
  float shift = std::max(mx, -fmax);
  for (int i = 0; i < v; i++) sbuf[i] = (sbuf[i] - shift) / p.temperature;
  int k = (p.top_k > 0 && p.top_k < v) ? p.top_k : v;
  ibuf.resize(v);
  for (int i = 0; i < v; i++) ibuf[i] = i;
  auto better = [&](int32_t a, int32_t b) {
    return sbuf[a] > sbuf[b] || (sbuf[a] == sbuf[b] && a < b);
  };
  if (k < v) std::nth_element(ibuf.begin(), ibuf.begin() + k, ibuf.end(), better);
  std::sort(ibuf.begin(), ibuf.begin() + k, better);
  int n = 0;  // allowed prefix: finite scores within top-k
  while (n < k && sbuf[ibuf[n]] > ninf) n++;
  if (n == 0) return -1;
  if (p.top_p < 1.f) {
    double z = 0;
    float top = sbuf[ibuf[0]];
    std::vector<double> e(n);
    for (int i = 0; i < n; i++) z += (e[i] = std::exp((double)sbuf[ibuf[i]] - top));
    double before = 0;
    int keep = 0;
    for (int i = 0; i < n; i++) {
      if (i > 0 && before / z >= p.top_p) break;
      before += e[i];
      keep = i + 1;
    }
    n = keep;
  }
  uint64_t key = mix64((uint64_t)seed * (uint64_t)GOLDEN + (uint64_t)counter);
  int64_t best = -1;
  float bv = ninf;
  for (int i = 0; i < n; i++) {
    int32_t tok = ibuf[i];
    float g = -std::log(-std::log(noise_u(key, tok)));
    float z = sbuf[tok] + g;
    if (z > bv || best < 0) {
      bv = z;
      best = tok;
    }
  }
  return best;
}

}  // namespace
