// Thread pool and bf16/fp16 helpers of the CPU runtime.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OC_PAUSE() _mm_pause()
#else
#define OC_PAUSE() std::this_thread::yield()
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
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
    while (pending_.load(std::memory_order_acquire) != 0) OC_PAUSE();
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;  // the generation at construction (a job may be posted before we run)
    while (true) {
      int spins = 0;
      uint64_t g;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
        if (++spins < 200000) {
          OC_PAUSE();
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
inline float f16_to_f32(uint16_t h) {  // IEEE half -> float, portable (the scalar path)
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        exp--;
      }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000 | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace
