// The decode step of a decoder stack (norms, rotary, attention, MLP) for the CPU runtime.
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
#pragma once
#include "oc_gemm.h"

namespace {

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

inline void store_kv(void* base, int bf16, int64_t idx, float v) {
  if (bf16) static_cast<uint16_t*>(base)[idx] = f32_to_bf16(v);
  else static_cast<float*>(base)[idx] = v;
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
      sc[g * n + j] = simd::dot_kv(qkv + (hk * grp + g) * D, kc, bf16, base + j * D, D) * scale;
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
    for (int64_t j = 0; j < n; j++) simd::axpy_kv(s[j] * inv, vc, bf16, base + j * D, o, D);
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
      split((int64_t)m * Hkv, pool->active(), t, &lo, &hi);
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

}  // namespace
