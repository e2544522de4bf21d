// omni-stream's CPU runtime of the decode step: low-bit products and whole-frame loops.
//
// The decode step is the one formulation of models/layers.py (DecoderStack.forward): new tokens
// in, RMSNorm, q|k|v, per-head RMSNorm on q and k, rotary with sign-folded sin, attention over
// [past ++ new] keys with one softmax, o, RMSNorm, gate|up, SiLU, down; the normed hidden out.
// This file runs it with no Python between operations: a talker step, the code predictor's 15
// sub-steps with their sampling, and the embedding sums that join them, each one C call. The
// caller (engine/cpu/native.py) owns every buffer (weights packed once, KV caches, sampling
// state) and passes pointers; nothing here allocates per call except per-thread scratch kept
// in the pool.
//
// Products (see engine/cpu/native.py for the packing): activations are quantized per row to
// int8 and multiplied with VPDPBUSD (u8 x s8 -> s32).
//   q4: unsigned nibbles q with a per-(row, group) fp16 scale s and offset m: w = q s + m;
//       sum w x = xs (s sum q x8 + m sum x8) per group.
//   q8: signed bytes with a per-row scale; activations as the unsigned operand x8 + 128, and
//       the 128 sum w term removed with the row sums.
//   f32: exact fp32 weights.
// Layouts (N a multiple of 16, K a multiple of 4 and of the q4 group):
//   q4 weights [N/16][K/4][32] bytes, byte j: row j/4 of the block (low nibble) and row 8 + j/4
//      (high nibble) at input 4 kq + j%4; scales [N/16][K/G][2][16] fp16 (scale, offset).
//   q8 weights [N/16][K/4][64] bytes, byte 4 r + i: row r at input 4 kq + i.
// Built with -march=native by engine/cpu/build.py; without AVX-512 VNNI the same code runs
// with a scalar fallback (correct, slow; the profile does not pick this engine there).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define OC_VNNI 1
#else
#define OC_VNNI 0
#endif

namespace {

// ------------------------------------------------------------------------------ thread pool
// Workers spin between jobs while a frame runs (a frame issues hundreds of short products) and
// fall back to short sleeps after ~2 ms idle.
class Pool {
 public:
  explicit Pool(int n) : n_(std::max(1, n)) {
    for (int i = 1; i < n_; i++) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    stop_.store(true);
    gen_.fetch_add(1);
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }
  template <class F>
  void run(F&& f) {
    if (n_ == 1) {
      f(0);
      return;
    }
    fn_ = [](void* ctx, int t) { (*static_cast<F*>(ctx))(t); };
    ctx_ = &f;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
    f(0);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;  // the generation at construction (a job may be posted before we run)
    while (true) {
      int spins = 0;
      uint64_t g;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
        if (++spins < 200000) {
          _mm_pause();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
      seen = g;
      if (stop_.load()) return;
      fn_(ctx_, id);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }
  int n_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
};

inline void split(int64_t total, int parts, int t, int64_t* lo, int64_t* hi) {
  int64_t base = total / parts, rem = total % parts;
  *lo = t * base + std::min<int64_t>(t, rem);
  *hi = *lo + base + (t < rem ? 1 : 0);
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even (as torch's .to(bfloat16))
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

}  // namespace

extern "C" {

// ------------------------------------------------------------------------------ types (C ABI)
struct OcLinear {
  int32_t kind, n, k, group;  // kind 0 q4, 1 q8, 2 f32
  const uint8_t* w;
  const uint16_t* scales;     // q4
  const float* row_scale;     // q8
  const int32_t* row_sum;     // q8
  const float* wf;            // f32 [n][k]
  const float* bias;          // [n] or null
};

struct OcLayer {
  OcLinear qkv, o, gate_up, down;
  const float *ln1, *ln2, *q_norm, *k_norm;
};

struct OcStack {
  int32_t layers, hidden, heads, kv_heads, head_dim, ffn;
  float eps;
  const OcLayer* layer;
  const float* norm;
};

// KV caches of one stack: per layer K and V [slots][kv_heads][length][head_dim], bf16 or fp32
struct OcCache {
  void* const* k;
  void* const* v;
  int32_t length, bf16;
};

void* oc_pool_create(int32_t threads) { return new Pool(threads); }
void oc_pool_destroy(void* p) { delete static_cast<Pool*>(p); }
int32_t oc_has_vnni() { return OC_VNNI; }

}  // extern "C"

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

#if OC_VNNI
// VPDPBUSD has a latency of several cycles: each row keeps 4 independent accumulators (one per
// k-quad of a 16-byte step) so the chains overlap, summed at the end of each group.
template <int MT>
void q4_block(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int nb,
              float* y, int ldy) {
  const int k = L.k, g = L.group, ng = k / g;
  const uint8_t* wb = L.w + (int64_t)nb * (k / 4) * 32;
  const uint16_t* sb = L.scales + (int64_t)nb * ng * 32;
  __m512 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm512_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < ng; j++) {
    __m512i iacc[MT][4];
    for (int r = 0; r < MT; r++)
      for (int u = 0; u < 4; u++) iacc[r][u] = _mm512_setzero_si512();
    const uint8_t* wp = wb + (int64_t)j * (g / 4) * 32;
    for (int kq = 0; kq < g / 4; kq += 4) {
      __m512i wv[4];
      for (int u = 0; u < 4; u++) {
        __m256i raw = _mm256_loadu_si256((const __m256i*)(wp + (kq + u) * 32));
        __m256i lo = _mm256_and_si256(raw, mask);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        wv[u] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      const int kk = j * g + kq * 4;
      for (int r = 0; r < MT; r++) {
        const int8_t* xr = x8 + (int64_t)r * k + kk;
        for (int u = 0; u < 4; u++) {
          int32_t xv;
          std::memcpy(&xv, xr + 4 * u, 4);
          iacc[r][u] = _mm512_dpbusd_epi32(iacc[r][u], wv[u], _mm512_set1_epi32(xv));
        }
      }
    }
    __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + j * 32 + 16)));
    for (int r = 0; r < MT; r++) {
      __m512i a = _mm512_add_epi32(_mm512_add_epi32(iacc[r][0], iacc[r][1]),
                                   _mm512_add_epi32(iacc[r][2], iacc[r][3]));
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sc, _mm512_set1_ps(xs[r])), facc[r]);
      facc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r] * (float)gsum[(int64_t)r * ng + j]), facc[r]);
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
    for (int r = 0; r < MT; r++)
      for (int u = 0; u < 4; u++) {
        int32_t xv;
        std::memcpy(&xv, xu + (int64_t)r * k + (kq + u) * 4, 4);
        iacc[r][u] = _mm512_dpbusd_epi32(iacc[r][u], _mm512_set1_epi32(xv), wv[u]);
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
#endif

// scalar reference of both low-bit kernels (no VNNI on this CPU)
void lowbit_scalar(const OcLinear& L, const int8_t* x8, const float* xs, const int32_t* gsum, int m,
                   int64_t n0, int64_t n1, float* y) {
  const int k = L.k;
  for (int r = 0; r < m; r++)
    for (int64_t n = n0; n < n1; n++) {
      int64_t nb = n / 16, row = n % 16;
      double acc = 0;
      if (L.kind == 0) {
        int g = L.group, ng = k / g;
        for (int j = 0; j < ng; j++) {
          int32_t s = 0;
          for (int i = 0; i < g; i++) {
            int kk = j * g + i, kq = kk / 4, lane = kk % 4;
            uint8_t byte = L.w[(nb * (k / 4) + kq) * 32 + (row % 8) * 4 + lane];
            int q = row < 8 ? (byte & 15) : (byte >> 4);
            s += q * x8[(int64_t)r * k + kk];
          }
          const uint16_t* sp = L.scales + (nb * ng + j) * 32;
          acc += (double)f16_to_f32(sp[row]) * s * xs[r] +
                 (double)f16_to_f32(sp[16 + row]) * gsum[(int64_t)r * ng + j] * xs[r];
        }
      } else {
        int32_t s = 0;
        for (int kk = 0; kk < k; kk++)
          s += (int8_t)L.w[(nb * (k / 4) + kk / 4) * 64 + row * 4 + kk % 4] * x8[(int64_t)r * k + kk];
        acc = (double)s * L.row_scale[n] * xs[r];
      }
      y[(int64_t)r * L.n + n] = (float)acc;
    }
}

void f32_rows(const OcLinear& L, const float* x, int m, int64_t n0, int64_t n1, float* y) {
  const int k = L.k;
  for (int r = 0; r < m; r++) {
    const float* xr = x + (int64_t)r * k;
    for (int64_t n = n0; n < n1; n++) {
      const float* w = L.wf + n * k;
#if OC_VNNI
      __m512 acc = _mm512_setzero_ps();
      int i = 0;
      for (; i + 16 <= k; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(xr + i), acc);
      float s = _mm512_reduce_add_ps(acc);
      for (; i < k; i++) s += w[i] * xr[i];
#else
      float s = 0.f;
      for (int i = 0; i < k; i++) s += w[i] * xr[i];
#endif
      y[(int64_t)r * L.n + n] = s;
    }
  }
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
      split(L.n, pool->size(), t, &lo, &hi);
      f32_rows(L, x, m, lo, hi, y);
    });
  } else {
    const int g = L.kind == 0 ? L.group : 0;
    s.x8.resize((size_t)m * L.k);
    s.xs.resize(m);
    s.gsum.resize(g > 0 ? (size_t)m * (L.k / g) : 1);
    quantize_rows(x, m, L.k, g, s.x8.data(), s.xs.data(), s.gsum.data());
#if OC_VNNI
    if (L.kind == 1)  // q8: activations as the unsigned operand of VPDPBUSD
      for (size_t i = 0; i < s.x8.size(); i++) s.x8[i] = (int8_t)(uint8_t)(s.x8[i] + 128);
#endif
    const int nblocks = L.n / 16;
    pool->run([&](int t) {
      int64_t b0, b1;
      split(nblocks, pool->size(), t, &b0, &b1);
#if OC_VNNI
      for (int64_t nb = b0; nb < b1; nb++)
        for (int r0 = 0; r0 < m; r0 += 4) {
          int mt = std::min(4, m - r0);
          const int8_t* xr = s.x8.data() + (int64_t)r0 * L.k;
          const float* xsr = s.xs.data() + r0;
          float* yr = y + (int64_t)r0 * L.n;
          if (L.kind == 0) {
            const int32_t* gs = s.gsum.data() + (int64_t)r0 * (L.k / g);
            switch (mt) {
              case 1: q4_block<1>(L, xr, xsr, gs, nb, yr, L.n); break;
              case 2: q4_block<2>(L, xr, xsr, gs, nb, yr, L.n); break;
              case 3: q4_block<3>(L, xr, xsr, gs, nb, yr, L.n); break;
              default: q4_block<4>(L, xr, xsr, gs, nb, yr, L.n); break;
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
#else
      lowbit_scalar(L, s.x8.data(), s.xs.data(), s.gsum.data(), m, b0 * 16, b1 * 16, y);
#endif
    });
  }
  if (L.bias)
    for (int r = 0; r < m; r++)
      for (int n = 0; n < L.n; n++) y[(int64_t)r * L.n + n] += L.bias[n];
}

// ------------------------------------------------------------------------------ step pieces
void rms_norm(const float* x, const float* w, int n, float eps, float* out) {
  double ss = 0;
  for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
  float r = 1.f / std::sqrt((float)(ss / n) + eps);
  for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

// x [d] rotated in place: x * cos + swap_halves(x) * sin (sin sign-folded)
void rope(float* x, const float* cs, const float* sn, int d) {
  int h = d / 2;
  for (int i = 0; i < h; i++) {
    float a = x[i], b = x[i + h];
    x[i] = a * cs[i] + b * sn[i];
    x[i + h] = b * cs[i + h] + a * sn[i + h];
  }
}

inline float load_kv(const void* base, int bf16, int64_t idx) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[idx]) : static_cast<const float*>(base)[idx];
}
inline void store_kv(void* base, int bf16, int64_t idx, float v) {
  if (bf16) static_cast<uint16_t*>(base)[idx] = f32_to_bf16(v);
  else static_cast<float*>(base)[idx] = v;
}

float dot_kv(const float* q, const void* kb, int bf16, int64_t off, int d) {
#if OC_VNNI
  __m512 acc = _mm512_setzero_ps();
  if (bf16) {
    const uint16_t* k = static_cast<const uint16_t*>(kb) + off;
    for (int i = 0; i < d; i += 16) {
      __m512i kk = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(k + i))), 16);
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_castsi512_ps(kk), acc);
    }
  } else {
    const float* k = static_cast<const float*>(kb) + off;
    for (int i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int i = 0; i < d; i++) s += q[i] * load_kv(kb, bf16, off + i);
  return s;
#endif
}

void axpy_kv(float a, const void* vb, int bf16, int64_t off, float* out, int d) {
#if OC_VNNI
  __m512 av = _mm512_set1_ps(a);
  if (bf16) {
    const uint16_t* v = static_cast<const uint16_t*>(vb) + off;
    for (int i = 0; i < d; i += 16) {
      __m512i vv = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + i))), 16);
      _mm512_storeu_ps(out + i, _mm512_fmadd_ps(av, _mm512_castsi512_ps(vv), _mm512_loadu_ps(out + i)));
    }
  } else {
    const float* v = static_cast<const float*>(vb) + off;
    for (int i = 0; i < d; i += 16)
      _mm512_storeu_ps(out + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
  }
#else
  for (int i = 0; i < d; i++) out[i] += a * load_kv(vb, bf16, off + i);
#endif
}

struct StepScratch {
  std::vector<float> h, qkv, attn, proj, gu, act;
  std::vector<std::vector<float>> scores;  // one per pool thread
  Scratch q;
};

// Attention of row r's query heads of kv head hk over cache positions [0, pos[r]] of its slot.
void attend_rows(const float* qkv, int qkv_n, int H, int Hkv, int D, const void* kc, const void* vc,
                 int bf16, int64_t length, int64_t slot, int64_t p, float* out, std::vector<float>& sc,
                 int hk) {
  const int grp = H / Hkv;
  const float scale = 1.f / std::sqrt((float)D);
  const int64_t n = p + 1;
  sc.resize((size_t)n * grp);
  const int64_t base = (slot * Hkv + hk) * length * D;
  for (int64_t j = 0; j < n; j++)
    for (int g = 0; g < grp; g++)
      sc[g * n + j] = dot_kv(qkv + (hk * grp + g) * D, kc, bf16, base + j * D, D) * scale;
  for (int g = 0; g < grp; g++) {
    float* s = sc.data() + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; j++) mx = std::max(mx, s[j]);
    double z = 0;
    for (int64_t j = 0; j < n; j++) {
      s[j] = std::exp(s[j] - mx);
      z += s[j];
    }
    float inv = (float)(1.0 / z);
    float* o = out + (hk * grp + g) * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; j++) axpy_kv(s[j] * inv, vc, bf16, base + j * D, o, D);
  }
}

// One decode step of a stack for m rows: row r is a token of cache slot slot[r] at position
// pos[r] that attends the slot's cached positions [0, pos[r]) (written by earlier steps or, for
// the tokens of one prefill, by the rows before it in this call) and itself. x [m][hidden] is
// updated in place to the normed hidden state.
void stack_step(Pool* pool, const OcStack& S, const OcCache& C, int m, const int64_t* slot,
                const int64_t* pos, const float* cos_tab, const float* sin_tab, float* x,
                StepScratch& st) {
  const int hid = S.hidden, H = S.heads, Hkv = S.kv_heads, D = S.head_dim, F = S.ffn;
  const int qkv_n = (H + 2 * Hkv) * D;
  st.h.resize((size_t)m * hid);
  st.qkv.resize((size_t)m * qkv_n);
  st.attn.resize((size_t)m * H * D);
  st.proj.resize((size_t)m * hid);
  st.gu.resize((size_t)m * 2 * F);
  st.act.resize((size_t)m * F);
  st.scores.resize(pool->size());
  for (int l = 0; l < S.layers; l++) {
    const OcLayer& L = S.layer[l];
    for (int r = 0; r < m; r++) rms_norm(x + (int64_t)r * hid, L.ln1, hid, S.eps, st.h.data() + (int64_t)r * hid);
    linear(pool, L.qkv, st.h.data(), m, st.qkv.data(), st.q);
    void* kc = C.k[l];
    void* vc = C.v[l];
    // per-head norms, rotary, then the new keys/values go into the cache at their positions
    for (int r = 0; r < m; r++) {
      float* q = st.qkv.data() + (int64_t)r * qkv_n;
      float* k = q + H * D;
      float* v = k + Hkv * D;
      const float* cs = cos_tab + pos[r] * D;
      const float* sn = sin_tab + pos[r] * D;
      for (int h = 0; h < H; h++) {
        rms_norm(q + h * D, L.q_norm, D, S.eps, q + h * D);
        rope(q + h * D, cs, sn, D);
      }
      for (int h = 0; h < Hkv; h++) {
        rms_norm(k + h * D, L.k_norm, D, S.eps, k + h * D);
        rope(k + h * D, cs, sn, D);
        int64_t off = ((slot[r] * Hkv + h) * (int64_t)C.length + pos[r]) * D;
        for (int i = 0; i < D; i++) {
          store_kv(kc, C.bf16, off + i, k[h * D + i]);
          store_kv(vc, C.bf16, off + i, v[h * D + i]);
        }
      }
    }
    // attention: each kv head serves its group of query heads (keys read once per group);
    // (row, kv head) pairs are shared out over the pool's threads
    pool->run([&](int t) {
      int64_t lo, hi;
      split((int64_t)m * Hkv, pool->size(), t, &lo, &hi);
      for (int64_t i = lo; i < hi; i++) {
        int r = (int)(i / Hkv), hk = (int)(i % Hkv);
        attend_rows(st.qkv.data() + (int64_t)r * qkv_n, qkv_n, H, Hkv, D, kc, vc, C.bf16, C.length,
                    slot[r], pos[r], st.attn.data() + (int64_t)r * H * D, st.scores[t], hk);
      }
    });
    linear(pool, L.o, st.attn.data(), m, st.proj.data(), st.q);
    for (size_t i = 0; i < (size_t)m * hid; i++) x[i] += st.proj[i];
    for (int r = 0; r < m; r++) rms_norm(x + (int64_t)r * hid, L.ln2, hid, S.eps, st.h.data() + (int64_t)r * hid);
    linear(pool, L.gate_up, st.h.data(), m, st.gu.data(), st.q);
    for (int r = 0; r < m; r++) {
      const float* gu = st.gu.data() + (int64_t)r * 2 * F;
      float* a = st.act.data() + (int64_t)r * F;
      for (int i = 0; i < F; i++) {
        float g = gu[i];
        a[i] = g / (1.f + std::exp(-g)) * gu[F + i];
      }
    }
    linear(pool, L.down, st.act.data(), m, st.proj.data(), st.q);
    for (size_t i = 0; i < (size_t)m * hid; i++) x[i] += st.proj[i];
  }
  for (int r = 0; r < m; r++) rms_norm(x + (int64_t)r * hid, S.norm, hid, S.eps, x + (int64_t)r * hid);
}

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

// ------------------------------------------------------------------------------ C entry points
extern "C" {

struct OcSampling {  // per row of a call
  const int32_t* greedy;
  const int32_t* top_k;
  const float* temperature;
  const float* top_p;
  const int64_t* seed;
  int64_t* counter;   // advanced by one per draw
};

// y[m][n] = x[m][k] W^T: one product (for tests and the prefill's head)
void oc_linear(void* pool, const OcLinear* L, const float* x, int32_t m, float* y) {
  Scratch s;
  linear(static_cast<Pool*>(pool), *L, x, m, y, s);
}

// One decode step of a stack (see stack_step); x [m][hidden] in, normed hidden out (in place).
void oc_stack_step(void* pool, const OcStack* S, const OcCache* C, int32_t m, const int64_t* slot,
                   const int64_t* pos, const float* cos_tab, const float* sin_tab, float* x) {
  StepScratch st;
  stack_step(static_cast<Pool*>(pool), *S, *C, m, slot, pos, cos_tab, sin_tab, x, st);
}

// Draw one token per row from scores [m][v] (already penalised / masked); out [m] (-1: none).
void oc_sample(const float* scores, int32_t m, int32_t v, const OcSampling* sp, int64_t* out) {
  std::vector<float> sbuf;
  std::vector<int32_t> ibuf;
  for (int r = 0; r < m; r++) {
    SampleParams p{sp->greedy[r], sp->top_k[r], sp->temperature[r], sp->top_p[r]};
    out[r] = sample_row(scores + (int64_t)r * v, v, p, sp->seed[r], sp->counter[r], sbuf, ibuf);
    sp->counter[r] += 1;
  }
}

// The code predictor's whole frame for m rows (slots 0..m-1): from the talker's hidden state
// [m][talker_hidden] and codebook-0 ids, 2-token prefill then 14 single-token steps over a
// fresh per-frame cache, each followed by its lm head and a draw. codes [m][groups-1] out
// (-1 for a row with no valid draw; its later inputs use id 0). Embedding tables are fp32 or
// bf16 ([vocab][talker_hidden]); ``proj`` (talker -> code-predictor width) may be null.
struct OcCodePredictor {
  OcStack stack;
  OcCache cache;
  const OcLinear* heads;      // [groups-1]
  const OcLinear* proj;       // null: identity
  const void* talker_codec_emb;   // [talker_vocab][talker_hidden]
  const void* const* cp_emb;      // [groups-1] tables [cp_vocab][talker_hidden]
  int32_t emb_bf16, talker_hidden, talker_vocab, cp_vocab, groups;
  const float* cos_tab;
  const float* sin_tab;
};

static void embed_row(const void* table, int bf16, int64_t id, int width, float* out, bool add) {
  for (int i = 0; i < width; i++) {
    float v = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(table)[id * width + i])
                   : static_cast<const float*>(table)[id * width + i];
    out[i] = add ? out[i] + v : v;
  }
}

void oc_code_predictor_frame(void* pool_, const OcCodePredictor* P, int32_t m, const float* talker_hidden,
                             const int64_t* code0, const OcSampling* sp, int64_t* codes) {
  Pool* pool = static_cast<Pool*>(pool_);
  const int C = P->talker_hidden, Ccp = P->stack.hidden, G = P->groups;
  std::vector<float> in((size_t)2 * m * C), x((size_t)2 * m * Ccp), logits((size_t)m * P->cp_vocab);
  std::vector<int64_t> slot(2 * m), pos(2 * m), tok(m);
  std::vector<float> sbuf;
  std::vector<int32_t> ibuf;
  StepScratch st;
  Scratch s;
  for (int r = 0; r < m; r++) {  // rows: token 0 (hidden) and token 1 (embed code0) per slot
    std::memcpy(&in[(size_t)(2 * r) * C], talker_hidden + (int64_t)r * C, sizeof(float) * C);
    int64_t c0 = std::min<int64_t>(std::max<int64_t>(code0[r], 0), P->talker_vocab - 1);
    embed_row(P->talker_codec_emb, P->emb_bf16, c0, C, &in[(size_t)(2 * r + 1) * C], false);
    slot[2 * r] = slot[2 * r + 1] = r;
    pos[2 * r] = 0;
    pos[2 * r + 1] = 1;
  }
  auto project = [&](int rows) {
    if (P->proj) linear(pool, *P->proj, in.data(), rows, x.data(), s);
    else std::memcpy(x.data(), in.data(), sizeof(float) * rows * Ccp);
  };
  project(2 * m);
  stack_step(pool, P->stack, P->cache, 2 * m, slot.data(), pos.data(), P->cos_tab, P->sin_tab, x.data(), st);
  std::vector<float> h((size_t)m * Ccp);
  for (int r = 0; r < m; r++) std::memcpy(&h[(size_t)r * Ccp], &x[(size_t)(2 * r + 1) * Ccp], sizeof(float) * Ccp);
  std::vector<char> bad(m, 0);
  for (int j = 0; j < G - 1; j++) {
    linear(pool, P->heads[j], h.data(), m, logits.data(), s);
    for (int r = 0; r < m; r++) {
      SampleParams p{sp->greedy[r], sp->top_k[r], sp->temperature[r], sp->top_p[r]};
      int64_t t = sample_row(&logits[(size_t)r * P->cp_vocab], P->cp_vocab, p, sp->seed[r], sp->counter[r], sbuf, ibuf);
      sp->counter[r] += 1;
      if (t < 0 || t >= P->cp_vocab) bad[r] = 1;  // validation at the source
      tok[r] = t;
      codes[(int64_t)r * (G - 1) + j] = t;
    }
    if (j == G - 2) break;
    for (int r = 0; r < m; r++) {
      int64_t t = bad[r] ? 0 : tok[r];
      embed_row(P->cp_emb[j], P->emb_bf16, t, C, &in[(size_t)r * C], false);
      slot[r] = r;
      pos[r] = j + 2;
    }
    project(m);
    std::memcpy(h.data(), x.data(), sizeof(float) * m * Ccp);
    stack_step(pool, P->stack, P->cache, m, slot.data(), pos.data(), P->cos_tab, P->sin_tab, h.data(), st);
  }
  for (int r = 0; r < m; r++)
    if (bad[r])
      for (int j = 0; j < G - 1; j++) codes[(int64_t)r * (G - 1) + j] = -1;
}

}  // extern "C"
