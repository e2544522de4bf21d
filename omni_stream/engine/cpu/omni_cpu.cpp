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
// Products (see engine/cpu/packing.py for the packing): activations are quantized per row to
// int8 and multiplied with the weights' codes in exact int32 sums, by the kernel set this build
// runs (kernels/isa.h picks one: AVX-512 VNNI, AVX2, NEON or the scalar reference; each gives
// the reference's products bit for bit).
//   q4: unsigned nibbles q with a per-(row, group) fp16 scale s and offset m: w = q s + m;
//       sum w x = xs (s sum q x8 + m sum x8) per group.
//   q6 / q5: as q4 with 6- / 5-bit q (the nibble plus the top bits, beside it per 16 inputs).
//   q8g: as q4 with 8-bit q (unsigned bytes, the group's scale and offset), in q8's layout.
//   q8: signed bytes with a per-row scale; activations as the unsigned operand x8 + 128, and
//       the 128 sum w term removed with the row sums.
//   f32: exact fp32 weights.
// Layouts (N a multiple of 16, K a multiple of 4 and of the q4 group):
//   q4 weights [N/16][K/8][64] bytes, byte 4 r + i: row r at input 4 kq + i (low nibble) and
//      4 (kq + 1) + i (high nibble), kq even; scales [N/16][K/G][2][16] fp16 (scale, offset).
//   q6 / q5 weights [N/16][K/64][4][192 / 160] bytes: per group and 16 inputs, two vectors
//      of nibbles in the q4 layout, then the top bits (oc_gemm.h q56_block); scales as q4's.
//   q8 weights [N/16][K/4][64] bytes, byte 4 r + i: row r at input 4 kq + i.
// Built with -march=native by engine/cpu/build.py (capped by OMNI_STREAM_CPU_ISA); oc_isa()
// says which kernel set and features it runs. With AMX (int8 tiles), q4 products of >= 16 rows
// (prefills, wide batches) run on tiles, bit for bit the VNNI kernel's results.

#include "oc_pool.h"
#include "oc_types.h"
#include "oc_gemm.h"
#include "oc_step.h"
#include "oc_sample.h"
#include "oc_snake.h"

#include <string>

// ------------------------------------------------------------------------------ C entry points
extern "C" {

void* oc_pool_create(int32_t threads) { return new Pool(threads); }
// `lent` of the threads run on another process's cores (see Pool); cpus[threads]: each
// thread's CPU (-1: unpinned; cpus[0] is the caller and is not pinned here)
void* oc_pool_create_lent(int32_t threads, int32_t lent, const int32_t* cpus) {
  return new Pool(threads, lent, cpus);
}
void oc_pool_destroy(void* p) { delete static_cast<Pool*>(p); }
void oc_pool_set_lease(void* p, void* lease) {
  static_cast<Pool*>(p)->set_lease(static_cast<CoreLease*>(lease));
}
// jobs run on the pool's own threads only / with its lent threads (since creation)
void oc_pool_jobs(void* p, uint64_t* own, uint64_t* lent) {
  *own = static_cast<Pool*>(p)->jobs_own();
  *lent = static_cast<Pool*>(p)->jobs_lent();
}
int32_t oc_lease_acquire(void* lease, int64_t timeout_us) {
  return lease_acquire(static_cast<CoreLease*>(lease), timeout_us);
}
void oc_lease_release(void* lease) { lease_release(static_cast<CoreLease*>(lease)); }
// the kernel set this build runs and its features, e.g. "avx2+fma+f16c", "avx512+vnni+gfni+amx",
// "neon+dotprod+i8mm", "scalar"; and its level (0 scalar, 1 avx2, 2 avx512, 3 neon)
const char* oc_isa() {
  static const std::string name = std::string(simd::kIsa) + simd::kFeatures;
  return name.c_str();
}
int32_t oc_isa_level() { return OC_ISA; }
int32_t oc_has_vnni() { return OC_ISA == OC_ISA_AVX512; }  // the AVX-512 VNNI kernels
// Code2Wav's SnakeBeta over bf16 [rows][t] (row r: channel r % channels); see oc_snake.h
void oc_snake_bf16(const uint16_t* x, uint16_t* y, const float* alpha, const float* inv_beta,
                   int64_t rows, int32_t channels, int64_t t) {
  snake_bf16(x, y, alpha, inv_beta, rows, channels, t);
}
// the same over fp32 (no rounding past the float math)
void oc_snake_f32(const float* x, float* y, const float* alpha, const float* inv_beta, int64_t rows,
                  int32_t channels, int64_t t) {
  snake_f32(x, y, alpha, inv_beta, rows, channels, t);
}
// AMX int8 tiles compiled in and granted by the OS (products of >= 16 rows use them)
int32_t oc_has_amx() {
#if OC_AMX
  return amx_enabled() ? 1 : 0;
#else
  return 0;
#endif
}

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

// The scalar reference's product (kernels/scalar.h), one thread: what every kernel set's
// oc_linear must give bit for bit (tests).
void oc_linear_ref(const OcLinear* L, const float* x, int32_t m, float* y) {
  const int g = L->kind == 1 || L->kind == 2 ? 0 : L->group;
  std::vector<int8_t> x8((size_t)m * L->k);
  std::vector<float> xs(m);
  std::vector<int32_t> gsum(g > 0 ? (size_t)m * (L->k / g) : 1);
  if (L->kind == 2) {
    for (int r = 0; r < m; r++)
      for (int n = 0; n < L->n; n++) y[(int64_t)r * L->n + n] = ref::dot_f32(L->wf + (int64_t)n * L->k, x + (int64_t)r * L->k, L->k);
  } else {
    quantize_rows(x, m, L->k, g, x8.data(), xs.data(), gsum.data());
    ref::lowbit_blocks(*L, x8.data(), xs.data(), gsum.data(), m, 0, L->n / 16, y);
  }
  add_bias(*L, m, y);
}

// The attention's primitives over n cache rows of width d (bf16 or fp32), by this build's kernel
// set (ref 0) or the scalar reference (ref 1): dots[j] = q . K[j]; out += sum_j a[j] V[j].
void oc_kv_products(int32_t use_ref, const float* q, const void* kv, int32_t bf16, int32_t d, int32_t n,
                    const float* a, float* dots, float* out) {
  for (int j = 0; j < n; j++) {
    dots[j] = use_ref ? ref::dot_kv(q, kv, bf16, (int64_t)j * d, d) : simd::dot_kv(q, kv, bf16, (int64_t)j * d, d);
    if (use_ref) ref::axpy_kv(a[j], kv, bf16, (int64_t)j * d, out, d);
    else simd::axpy_kv(a[j], kv, bf16, (int64_t)j * d, out, d);
  }
}

// SnakeBeta by the scalar reference (oc_snake_bf16's / oc_snake_f32's arguments)
void oc_snake_bf16_ref(const uint16_t* x, uint16_t* y, const float* alpha, const float* inv_beta,
                       int64_t rows, int32_t channels, int64_t t) {
  for (int64_t r = 0; r < rows; r++) ref::snake_row(x + r * t, y + r * t, alpha[r % channels], inv_beta[r % channels], t);
}
void oc_snake_f32_ref(const float* x, float* y, const float* alpha, const float* inv_beta, int64_t rows,
                      int32_t channels, int64_t t) {
  for (int64_t r = 0; r < rows; r++)
    ref::snake_row_f32(x + r * t, y + r * t, alpha[r % channels], inv_beta[r % channels], t);
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
