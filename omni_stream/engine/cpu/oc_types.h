// The C ABI structs shared with engine/cpu/native.py (ctypes mirrors there).
// Part of omni_cpu.cpp (one translation unit); see there for the overview.
#pragma once
#include <cstdint>

extern "C" {

struct OcLinear {
  int32_t kind, n, k, group;  // kind 0 q4, 1 q8, 2 f32, 3 q6, 4 q5, 5 q8g
  const uint8_t* w;
  const uint16_t* scales;     // q4, q5, q6, q8g
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


}  // extern "C"
