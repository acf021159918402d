// Fuzzing helpers: a small synthetic capture and calibration (synthetic on
// purpose: the fuzzers exercise the parsers, not the model).
#pragma once

#include <cmath>
#include <random>

#include "kvtc/kvtc.h"

namespace kvtc::fuzz {

// 2 layers x 1 head x 8 dims: p = 16.
// The typed geometry of small_capture: NORM RoPE over all 8 dims, base 1e4.
inline CacheGeometry small_geometry() {
  CacheGeometry g;
  g.model_sha256 = "fuzz";
  BlockGeometry b;
  b.layers = {0, 1};
  b.n_head_kv = 1;
  b.head_dim = 8;
  b.rope.layout = RopeLayout::kNorm;
  b.rope.n_rot = 8;
  b.rope.freq_base = 10000.0f;
  g.blocks.push_back(b);
  return g;
}

inline KvCapture small_capture(uint32_t n_tok) {
  KvCapture c;
  const CacheGeometry geo = small_geometry();
  c.model_sha256 = geo.model_sha256;
  c.meta = {{"rope_scaling_type", "none"}};
  KvBlock b;
  static_cast<BlockGeometry&>(b) = geo.blocks[0];
  for (uint32_t t = 0; t < n_tok; ++t) b.pos.push_back(int32_t(t));
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  b.k.resize(b.numel());
  b.v.resize(b.numel());
  std::vector<float> x(b.numel());
  for (auto& e : x) e = g(rng);
  f32_to_f16_n(x.data(), b.k.data(), x.size());
  for (auto& e : x) e = g(rng);
  f32_to_f16_n(x.data(), b.v.data(), x.size());
  c.blocks.push_back(b);
  for (uint32_t t = 0; t < n_tok; ++t) c.tokens.push_back(int32_t(t));
  return c;
}

inline Calibration small_calibration() {
  Calibration cal;
  cal.geometry = small_geometry();
  cal.blocks.resize(1);
  for (int kv = 0; kv < 2; ++kv) {
    Transform& t = cal.blocks[0][kv];
    t.p = t.r = 16;
    t.mu.assign(16, 0.1f);
    t.basis.assign(256, 0.0f);
    for (int i = 0; i < 16; ++i) t.basis[i * 16 + i] = 1.0f;
    t.variance.assign(16, 1.0f);
    t.total_variance = 16;
  }
  cal.id = calibration_compute_id(cal);
  return cal;
}

inline AllocationSet small_alloc() {
  Allocation a;
  a.blocks = {{0, 1, QType::kFp8}, {1, 1, QType::kInt4}, {2, 1, QType::kInt2}, {3, 1, QType::kNone}, {4, 1, QType::kInt4}};
  return AllocationSet{{a, a}};
}

}  // namespace kvtc::fuzz
