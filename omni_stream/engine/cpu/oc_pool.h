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
#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OC_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define OC_PAUSE() __asm__ __volatile__("yield")  // the spin hint (std::this_thread::yield is a syscall)
#else
#define OC_PAUSE() std::this_thread::yield()
#endif



namespace {

// ------------------------------------------------------------------------------ thread pool
// Workers spin between jobs while a frame runs (a frame issues hundreds of short products) and
// fall back to short sleeps after ~2 ms idle.
//
// Lent cores. The last `lent` workers run on cores that belong to another process (the codec
// stage) and take part in a job only while that process does not want them. The two processes
// share a lease of two words (`CoreLease`, in shared memory): the borrower (this pool) sets
// `busy` for the length of each job it gives the lent workers, the owner sets `want` for the
// length of its own work and then waits for `busy` to clear (lease_acquire). Both sides store
// then load with sequential consistency, so either the pool sees `want` and keeps the job on its
// own threads, or the owner sees `busy` and waits for that one job (a product: well under a
// millisecond). Which threads compute a job never changes its result: work is split by output
// rows (or heads), each computed whole by one thread.
struct CoreLease {
  std::atomic<int32_t> want;  // owner: 1 while it computes on its cores
  std::atomic<int32_t> busy;  // borrower: 1 while a job runs on the lent workers
};
static_assert(sizeof(CoreLease) == 8, "the lease is two int32 words in shared memory");

// Block while *word == value (at most timeout_us); shared between processes (the lease lives in
// shared memory). Elsewhere than Linux: a plain sleep.
inline void futex_wait(std::atomic<int32_t>* word, int32_t value, int64_t timeout_us) {
#if defined(__linux__)
  struct timespec ts = {time_t(timeout_us / 1000000), long(timeout_us % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<int32_t*>(word), FUTEX_WAIT, value, &ts, nullptr, 0);
#else
  (void)word;
  (void)value;
  std::this_thread::sleep_for(std::chrono::microseconds(timeout_us));
#endif
}
inline void futex_wake_all(std::atomic<int32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<int32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

inline void pin_thread(int cpu) {
#if defined(__linux__)
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
#else
  (void)cpu;
#endif
}

class Pool {
 public:
  // n threads in all (the caller is thread 0); the last `lent` of them are lent workers; worker
  // i is pinned to cpus[i] when cpus is given (-1: not pinned).
  explicit Pool(int n, int lent = 0, const int32_t* cpus = nullptr)
      : n_(std::clamp(n, 1, 255)), lent_(std::clamp(lent, 0, n_ - 1)) {
    for (int i = 1; i < n_; i++) {
      int cpu = cpus ? cpus[i] : -1;
      workers_.emplace_back([this, i, cpu] {
        pin_thread(cpu);
        loop(i);
      });
    }
  }
  ~Pool() {
    stop_.store(true);
    gen_.fetch_add(1 << 8);
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }
  // threads taking part in the job being run (valid inside run()'s callable)
  int active() const { return active_; }
  void set_lease(CoreLease* lease) { lease_.store(lease, std::memory_order_release); }
  uint64_t jobs_lent() const { return jobs_lent_; }
  uint64_t jobs_own() const { return jobs_own_; }

  template <class F>
  void run(F&& f) {
    int active = n_ - lent_;
    bool lend = false;
    CoreLease* lease = lease_.load(std::memory_order_acquire);
    if (lent_ && lease) {
      lease->busy.store(1, std::memory_order_seq_cst);
      if (lease->want.load(std::memory_order_seq_cst) == 0) {
        active = n_;
        lend = true;
      } else {
        lease->busy.store(0, std::memory_order_release);
      }
    } else if (lent_) {
      active = n_;
    }
    active_ = active;
    (lend ? jobs_lent_ : jobs_own_)++;
    if (active == 1) {
      f(0);
      return;
    }
    fn_ = [](void* ctx, int t) { (*static_cast<F*>(ctx))(t); };
    ctx_ = &f;
    pending_.store(active - 1, std::memory_order_relaxed);
    // the job's thread count travels in the generation word itself (low byte), so a worker
    // that reads a generation reads its own count with it
    uint64_t g = gen_.load(std::memory_order_relaxed);
    gen_.store(((g >> 8) + 1) << 8 | uint64_t(active), std::memory_order_release);
    f(0);
    while (pending_.load(std::memory_order_acquire) != 0) OC_PAUSE();
    if (lend) lease->busy.store(0, std::memory_order_release);
  }

 private:
  CoreLease* yielded(int id) const {  // a lent worker whose core the owner wants back
    if (id < n_ - lent_) return nullptr;
    CoreLease* lease = lease_.load(std::memory_order_acquire);
    return lease && lease->want.load(std::memory_order_relaxed) ? lease : nullptr;
  }
  void loop(int id) {
    uint64_t seen = 0;  // the generation at construction (a job may be posted before we run)
    while (true) {
      int spins = 0;
      uint64_t g;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
        if (CoreLease* lease = yielded(id)) {  // the owner computes here: sleep until it lets go
          futex_wait(&lease->want, 1, 20000);
          spins = 0;
        } else if (++spins < 200000) {
          OC_PAUSE();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
      seen = g;
      if (stop_.load()) return;
      if (id >= int(g & 0xff)) continue;  // a job for the pool's own threads only
      fn_(ctx_, id);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }
  int n_, lent_;
  int active_ = 1;
  std::atomic<CoreLease*> lease_{nullptr};
  uint64_t jobs_lent_ = 0, jobs_own_ = 0;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
};

// The owner's side of a lease: take the lent cores back (waits for the borrower's job in
// flight, at most `timeout_us`, then goes ahead anyway) and give them back.
inline int lease_acquire(CoreLease* lease, int64_t timeout_us) {
  lease->want.store(1, std::memory_order_seq_cst);
  auto t0 = std::chrono::steady_clock::now();
  while (lease->busy.load(std::memory_order_seq_cst)) {
    OC_PAUSE();
    if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(timeout_us)) return 0;
  }
  return 1;
}
inline void lease_release(CoreLease* lease) {
  lease->want.store(0, std::memory_order_seq_cst);
  futex_wake_all(&lease->want);  // the borrower's lent workers wait on it
}

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
