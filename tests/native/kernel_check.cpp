// The CPU runtime's kernels on one machine (tests/test_cpu_arm64.py cross-compiles this for
// ARM64 and runs it under qemu): reads cases from a file, runs each through this build's kernel
// set and through the scalar reference, and writes both results for the test to compare with
// the host's reference.
//
//   kernel_check IN OUT
//
// Both files are a magic word, a count, then records; a record is a u32 type, a u32 array count
// and its arrays, each a u64 byte length then the bytes (little-endian, as on both machines).
//   IN   "OCK1", cases:
//        1 product   params i64 [kind, n, k, group, m, threads], w, scales, row_scale, row_sum,
//                    wf, bias, x (an empty array is a null pointer)
//        2 KV        params i64 [bf16, d, n], q [d], kv [n][d], a [n], out [d] (the start)
//        3 snake     params i64 [rows, channels, t], x bf16 [rows][t], alpha, inv_beta
//        4 snake f32 as 3 with x fp32
//   OUT  "OCR1", record 0: the build's oc_isa(); then per case (same types):
//        1 y (oc_linear), y (oc_linear_ref)
//        2 dots, out (oc_kv_products, use_ref 0), dots, out (use_ref 1)
//        3 y (oc_snake_bf16), y (oc_snake_bf16 in place), y (oc_snake_bf16_ref)
//        4 y (oc_snake_f32), y (oc_snake_f32 in place), y (oc_snake_f32_ref)
// Builds for the host too (g++ -O2 -march=native -std=c++17 -ffp-contract=off).
#include "../../omni_stream/engine/cpu/omni_cpu.cpp"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using Bytes = std::vector<uint8_t>;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "kernel_check: %s\n", what.c_str());
  std::exit(2);
}

struct Reader {
  FILE* f;
  template <class T>
  T get() {
    T v;
    if (std::fread(&v, sizeof v, 1, f) != 1) fail("truncated input");
    return v;
  }
  Bytes array() {
    const uint64_t n = get<uint64_t>();
    Bytes b(n);
    if (n && std::fread(b.data(), 1, n, f) != n) fail("truncated array");
    return b;
  }
};

struct Writer {
  FILE* f;
  void put32(uint32_t v) { std::fwrite(&v, sizeof v, 1, f); }
  void record(uint32_t type, const std::vector<std::pair<const void*, size_t>>& arrays) {
    put32(type);
    put32((uint32_t)arrays.size());
    for (auto& [p, n] : arrays) {
      const uint64_t len = n;
      std::fwrite(&len, sizeof len, 1, f);
      if (n) std::fwrite(p, 1, n, f);
    }
  }
};

template <class T>
const T* ptr_of(const Bytes& b) {
  return b.empty() ? nullptr : reinterpret_cast<const T*>(b.data());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) fail("usage: kernel_check IN OUT");
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) fail("cannot open the files");
  Reader r{in};
  Writer w{out};
  if (r.get<uint32_t>() != 0x314B434F) fail("not a case file (OCK1)");  // "OCK1"
  const uint32_t cases = r.get<uint32_t>();
  w.put32(0x3152434F);  // "OCR1"
  w.put32(cases + 1);
  const std::string isa = oc_isa();
  w.record(0, {{isa.data(), isa.size()}});
  void* pools[3] = {nullptr, oc_pool_create(1), oc_pool_create(2)};
  for (uint32_t c = 0; c < cases; c++) {
    const uint32_t type = r.get<uint32_t>(), narr = r.get<uint32_t>();
    std::vector<Bytes> a(narr);
    for (auto& b : a) b = r.array();
    const int64_t* p = ptr_of<int64_t>(a.at(0));
    if (type == 1) {
      if (narr != 8) fail("a product has 8 arrays");
      OcLinear L{};
      L.kind = (int32_t)p[0];
      L.n = (int32_t)p[1];
      L.k = (int32_t)p[2];
      L.group = (int32_t)p[3];
      const int m = (int)p[4], threads = (int)p[5];
      L.w = ptr_of<uint8_t>(a[1]);
      L.scales = ptr_of<uint16_t>(a[2]);
      L.row_scale = ptr_of<float>(a[3]);
      L.row_sum = ptr_of<int32_t>(a[4]);
      L.wf = ptr_of<float>(a[5]);
      L.bias = ptr_of<float>(a[6]);
      const float* x = ptr_of<float>(a[7]);
      std::vector<float> y((size_t)m * L.n), yr((size_t)m * L.n);
      oc_linear(pools[threads == 2 ? 2 : 1], &L, x, m, y.data());
      oc_linear_ref(&L, x, m, yr.data());
      w.record(1, {{y.data(), y.size() * 4}, {yr.data(), yr.size() * 4}});
    } else if (type == 2) {
      if (narr != 5) fail("a KV case has 5 arrays");
      const int bf16 = (int)p[0], d = (int)p[1], n = (int)p[2];
      const float* q = ptr_of<float>(a[1]);
      const float* av = ptr_of<float>(a[3]);
      std::vector<float> dots(n), dots_ref(n), o(ptr_of<float>(a[4]), ptr_of<float>(a[4]) + d), o_ref = o;
      oc_kv_products(0, q, a[2].data(), bf16, d, n, av, dots.data(), o.data());
      oc_kv_products(1, q, a[2].data(), bf16, d, n, av, dots_ref.data(), o_ref.data());
      w.record(2, {{dots.data(), n * 4u}, {o.data(), d * 4u}, {dots_ref.data(), n * 4u}, {o_ref.data(), d * 4u}});
    } else if (type == 3) {
      if (narr != 4) fail("a snake case has 4 arrays");
      const int64_t rows = p[0], t = p[2];
      const int channels = (int)p[1];
      const uint16_t* x = ptr_of<uint16_t>(a[1]);
      const float* alpha = ptr_of<float>(a[2]);
      const float* ib = ptr_of<float>(a[3]);
      std::vector<uint16_t> y(rows * t), yi(x, x + rows * t), yr(rows * t);
      oc_snake_bf16(x, y.data(), alpha, ib, rows, channels, t);
      oc_snake_bf16(yi.data(), yi.data(), alpha, ib, rows, channels, t);
      oc_snake_bf16_ref(x, yr.data(), alpha, ib, rows, channels, t);
      const size_t nb = y.size() * 2;
      w.record(3, {{y.data(), nb}, {yi.data(), nb}, {yr.data(), nb}});
    } else if (type == 4) {
      if (narr != 4) fail("a snake case has 4 arrays");
      const int64_t rows = p[0], t = p[2];
      const int channels = (int)p[1];
      const float* x = ptr_of<float>(a[1]);
      const float* alpha = ptr_of<float>(a[2]);
      const float* ib = ptr_of<float>(a[3]);
      std::vector<float> y(rows * t), yi(x, x + rows * t), yr(rows * t);
      oc_snake_f32(x, y.data(), alpha, ib, rows, channels, t);
      oc_snake_f32(yi.data(), yi.data(), alpha, ib, rows, channels, t);
      oc_snake_f32_ref(x, yr.data(), alpha, ib, rows, channels, t);
      const size_t nb = y.size() * 4;
      w.record(4, {{y.data(), nb}, {yi.data(), nb}, {yr.data(), nb}});
    } else {
      fail("unknown case type " + std::to_string(type));
    }
  }
  oc_pool_destroy(pools[1]);
  oc_pool_destroy(pools[2]);
  if (std::fclose(out) != 0) fail("cannot write the results");
  std::fclose(in);
  return 0;
}
