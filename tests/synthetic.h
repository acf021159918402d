// Synthetic caches for the tests that are about the algorithm and the
// formats, not a model (test_api.cpp, test_store.cpp): a small geometry
// whose de-RoPEd keys and values lie near a rank-6 subspace, and a
// calibration fitted to it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/util.h"
#include "kvtc/internal/lab_support.h"  // set_feature_rows
#include "kvtc/kvtc.h"
#include "store/seal.h"  // hkdf_sha256, hmac_sha256: the chain of a store with a secret

namespace kvtc {

// 2 layers x 2 KV heads x 16 dims (p = 64), NEOX RoPE with factors.
inline CacheGeometry lowrank_geometry() {
  CacheGeometry g;
  g.model_sha256 = "synthetic-lowrank";
  BlockGeometry b;
  b.layers = {0, 1};
  b.n_head_kv = 2;
  b.head_dim = 16;
  b.rope.layout = RopeLayout::kNeox;
  b.rope.n_rot = 16;
  b.rope.freq_base = 10000.0f;
  for (uint32_t i = 0; i < 8; ++i) b.rope.freq_factors.push_back(1.0f + 0.5f * float(i));
  g.blocks.push_back(b);
  return g;
}

// n tokens at positions pos0.. whose rows near the rank-6 subspace (plus 1%
// noise) are drawn from rng_of(t) for token t: one generator for the whole
// capture, or one per token.
inline KvCapture lowrank_capture_with(uint32_t n, int32_t pos0, const std::function<std::mt19937&(uint32_t t, int kv)>& rng_of) {
  const CacheGeometry g = lowrank_geometry();
  KvCapture c;
  c.model_sha256 = g.model_sha256;
  KvBlock b;
  static_cast<BlockGeometry&>(b) = g.blocks[0];
  for (uint32_t t = 0; t < n; ++t) b.pos.push_back(pos0 + int32_t(t));
  b.k.assign(b.numel(), 0);
  b.v.assign(b.numel(), 0);
  const uint32_t p = b.features(), rank = 6;
  std::mt19937 dirs(99);  // the same subspace for every capture
  std::normal_distribution<float> g01(0.0f, 1.0f);
  std::vector<float> dir(size_t(2) * rank * p);
  for (float& x : dir) x = g01(dirs);
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<float> rows(size_t(n) * p);
    for (uint32_t t = 0; t < n; ++t) {
      std::mt19937& rng = rng_of(t, kv);
      float z[rank];
      for (uint32_t j = 0; j < rank; ++j) z[j] = g01(rng) * 2.0f / float(j + 1);
      for (uint32_t f = 0; f < p; ++f) {
        float x = 0.01f * g01(rng) + (kv ? 0.3f : -0.2f);
        for (uint32_t j = 0; j < rank; ++j) x += z[j] * dir[(size_t(kv) * rank + j) * p + f] * 0.3f;
        rows[size_t(t) * p + f] = x;
      }
    }
    set_feature_rows(b, kv == 0, /*rerope=*/true, 0, n, std::move(rows));
  }
  c.blocks.push_back(std::move(b));
  return c;
}

// One generator (seed) for the whole capture; tokens 100, 101, ...
inline KvCapture lowrank_capture(uint32_t n, uint32_t seed, int32_t pos0 = 0) {
  std::mt19937 rng(seed);
  KvCapture c = lowrank_capture_with(n, pos0, [&](uint32_t, int) -> std::mt19937& { return rng; });
  for (uint32_t t = 0; t < n; ++t) c.tokens.push_back(int32_t(100 + t));
  return c;
}

// The cache a causal "model" would keep for a prompt: token t's rows depend
// on its id and position only, so prompts that share a prefix share its
// cache exactly (as they do in a real model, up to arithmetic).
inline KvCapture prompt_capture(std::span<const int32_t> tokens) {
  std::mt19937 rng;
  KvCapture c = lowrank_capture_with(uint32_t(tokens.size()), 0, [&](uint32_t t, int kv) -> std::mt19937& {
    rng.seed(uint32_t(tokens[t]) * 2654435761u + t * 40503u + uint32_t(kv) * 977u);
    return rng;
  });
  c.tokens.assign(tokens.begin(), tokens.end());
  return c;
}

inline std::vector<int32_t> seq_ids(int32_t first, size_t n) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = first + int32_t(i);
  return v;
}

// A sliding-window (iSWA) model on the same pattern: block 0 as above
// (the "global" layers), block 1 two more layers (2, 3) with a window of
// n_swa tokens and their own RoPE (no factors, another base), whose rows
// depend on the token's id and position only, like block 0's.
inline CacheGeometry swa_geometry(uint32_t n_swa) {
  CacheGeometry g = lowrank_geometry();
  g.model_sha256 = "synthetic-swa";
  BlockGeometry b = g.blocks[0];
  b.layers = {2, 3};
  b.sliding_window = n_swa;
  b.rope.freq_factors.clear();
  b.rope.freq_base = 5000.0f;
  g.blocks.push_back(b);
  return g;
}

// The cache llama.cpp keeps of a prompt for such a model: block 0 every
// token, block 1 the window (positions [n - n_swa, n)), its cells in a
// ring's order (rotated by `rotate`) as a state holds them.
inline KvCapture swa_capture(std::span<const int32_t> tokens, uint32_t n_swa, uint32_t rotate = 0) {
  const CacheGeometry g = swa_geometry(n_swa);
  KvCapture c = prompt_capture(tokens);
  c.model_sha256 = g.model_sha256;
  const uint32_t n = uint32_t(tokens.size()), w0 = n > n_swa ? n - n_swa : 0, w = n - w0;
  // Rows drawn like block 0's, from other seeds, then re-roped with block 1's RoPE.
  std::vector<int32_t> shifted(tokens.begin(), tokens.end());
  for (int32_t& t : shifted) t += 7919;
  const KvCapture src = prompt_capture(shifted);
  KvBlock b;
  static_cast<BlockGeometry&>(b) = g.blocks[1];
  for (uint32_t i = 0; i < w; ++i) b.pos.push_back(int32_t(w0 + (i + rotate) % w));
  b.k.assign(b.numel(), 0);
  b.v.assign(b.numel(), 0);
  const uint32_t p = b.features();
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<float> rows(size_t(w) * p);
    for (uint32_t i = 0; i < w; ++i) {
      const std::vector<float> r = feature_rows(src.blocks[0], kv == 0, /*derope=*/true, uint32_t(b.pos[i]), uint32_t(b.pos[i]) + 1);
      std::copy(r.begin(), r.end(), rows.begin() + size_t(i) * p);
    }
    set_feature_rows(b, kv == 0, /*rerope=*/true, 0, w, std::move(rows));
  }
  c.blocks.push_back(std::move(b));
  return c;
}

inline Calibration swa_fitted(uint32_t n_swa) {
  FitOptions o;
  o.ratios = {4, 8};
  std::vector<KvCapture> fit, held;
  for (uint32_t i = 0; i < 4; ++i) fit.push_back(swa_capture(seq_ids(20000 + 1000 * int32_t(i), 300), n_swa));
  held.push_back(swa_capture(seq_ids(60000, 200), n_swa));
  return fit_calibration(fit, held, o);
}

inline Calibration fitted() {
  FitOptions o;
  o.ratios = {4, 8};
  std::vector<KvCapture> fit, held;
  for (uint32_t i = 0; i < 3; ++i) fit.push_back(lowrank_capture(300, 10 + i));
  held.push_back(lowrank_capture(200, 50));
  return fit_calibration(fit, held, o);
}

// Token sequences for the store tests: first, first+1, ...; a then b.
inline std::vector<int32_t> seq(int32_t first, size_t n) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = first + int32_t(i);
  return v;
}
inline std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// What the codec gives for a whole prompt in one container with a store's
// sink, window, ratio and precision: the store must restore this, as the
// codes are per token and chunking changes nothing but the GEMM's rounding
// (see matches_prefix).
inline KvCapture whole_roundtrip(const std::vector<int32_t>& tokens, const StoreOptions& o, const Calibration& cal) {
  CompressOptions c;
  c.sink = o.sink;
  c.window = o.window;
  c.precision = o.precision;
  const std::vector<uint8_t> bytes = compress(prompt_capture(tokens), cal, allocation_set(cal, o.ratio), c);
  DecompressOptions d;
  d.precision = o.precision;
  return decompress(bytes, cal, "whole", d);
}

// One f16 unit in the last place at |v| (the spacing of f16 values there).
inline double f16_ulp(double v) {
  v = std::fabs(v);
  return v < 6.103515625e-05 ? 5.960464477539063e-08 : std::ldexp(1.0, std::ilogb(v) - 10);
}

// The first n tokens of `got` are those of `full` (a whole_roundtrip of the
// same prompt) up to the projection GEMM's f32 rounding. Bit equality is not
// what a CPU promises: OpenBLAS's AVX2 sgemm (its Haswell and Zen kernels)
// rounds a row differently with the number of rows in the call and the row's
// place in it (OPENBLAS_CORETYPE=Sandybridge, and the AVX-512 machines CI
// had before: bit-equal on these tests), and a chunk is another call than
// the whole prompt. Measured on such a CPU (Store.RestoresWhat...): 1 of
// 38,400 values differed, by one f16 step. So, for each token and kind (K,
// V), over all layers and heads:
// - every value within one f16 step of full's (an f32 rounding that moved
//   the f16 rounding), or
// - d <= 2 e (1 + 1e-3) + 1e-3 x, with d = |got - full|, e = |full -
//   original| (the codec's error on that token), x = |original|: a rounding
//   moved a coefficient across a quantizer step boundary. Such a coefficient
//   sat on the boundary, so both restores are half a step from it and differ
//   by one step, at most twice the token's error (1e-3 x: the f16 steps).
//   At most 1% of the rows (and 1) may do this.
// A token restored from the wrong place, position or chunk differs by about
// its own norm (20x or more the codec's error at ratio 8), and fails.
inline ::testing::AssertionResult matches_prefix(const KvCapture& got, const KvCapture& full, uint32_t n) {
  if (got.blocks.size() != 1) return ::testing::AssertionFailure() << got.blocks.size() << " blocks, expected 1";
  const KvBlock& a = got.blocks.at(0);
  const KvBlock& b = full.blocks.at(0);
  if (a.n_tokens() != n || b.n_tokens() < n) return ::testing::AssertionFailure() << "tokens " << a.n_tokens() << ", expected " << n;
  if (full.tokens.size() < n) return ::testing::AssertionFailure() << "the reference holds " << full.tokens.size() << " token ids, expected " << n;
  const KvCapture original = prompt_capture(std::span<const int32_t>(full.tokens.data(), n));
  const KvBlock& o = original.blocks.at(0);
  const auto f32 = [](uint16_t h) {
    float x;
    f16_to_f32_n(&h, &x, 1);
    return double(x);
  };
  uint32_t flips = 0;
  const uint32_t max_flips = std::max<uint32_t>(1, 2 * n / 100);
  for (uint32_t t = 0; t < n; ++t) {
    if (a.pos[t] != b.pos[t]) return ::testing::AssertionFailure() << "pos " << t;
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<uint16_t>& A = kv ? a.v : a.k;
      const std::vector<uint16_t>& B = kv ? b.v : b.k;
      const std::vector<uint16_t>& O = kv ? o.v : o.k;
      double dd = 0, ee = 0, xx = 0;
      bool rounding = true;
      for (uint32_t l = 0; l < a.n_layer(); ++l)
        for (uint32_t h = 0; h < a.n_head_kv; ++h)
          for (uint32_t d = 0; d < a.head_dim; ++d) {
            const double g = f32(A[a.index(l, h, t, d)]), f = f32(B[b.index(l, h, t, d)]), x = f32(O[o.index(l, h, t, d)]);
            dd += (g - f) * (g - f), ee += (f - x) * (f - x), xx += x * x;
            rounding = rounding && std::fabs(g - f) <= f16_ulp(std::max(std::fabs(g), std::fabs(f)));
          }
      if (rounding) continue;
      const double dn = std::sqrt(dd), en = std::sqrt(ee), xn = std::sqrt(xx);
      const char* kind = kv ? "V" : "K";
      if (dn > 2 * en * (1 + 1e-3) + 1e-3 * xn)
        return ::testing::AssertionFailure() << "token " << t << " " << kind << ": differs by " << dn << ", more than twice the codec's error " << en
                                             << " (norm " << xn << ")";
      if (++flips > max_flips)
        return ::testing::AssertionFailure() << "more than " << max_flips << " of " << 2 * n << " token rows differ beyond rounding (token " << t
                                             << " " << kind << ": " << dn << ", norm " << xn << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// The store's key chain (docs/store.md "Keys", "Secrets"), computed here
// from the spec, not by the store. Without a secret c_0 is the salt and a
// link SHA-256('c' or 'e' | parent's hex | tokens, int32 LE); with one,
// c_0 = HMAC-SHA256(K_chain, salt) and each link an HMAC-SHA256 under
// K_chain = HKDF-SHA256(secret, "kvtc-store-secret/1", "kvtc key chain").
// A store's secret for the tests: n bytes counting up from `first`.
inline std::vector<uint8_t> secret_of(uint8_t first, size_t n = 32) {
  std::vector<uint8_t> s(n);
  for (size_t i = 0; i < n; ++i) s[i] = uint8_t(first + i);
  return s;
}
inline StoreOptions with_secret(StoreOptions o, const std::vector<uint8_t>& secret, bool encrypt) {
  o.secret = secret;
  o.encrypt = encrypt;
  return o;
}
inline std::vector<uint8_t> chain_secret_key(std::span<const uint8_t> secret) {
  const std::string salt = "kvtc-store-secret/1", label = "kvtc key chain";
  return store::hkdf_sha256(secret, std::span(reinterpret_cast<const uint8_t*>(salt.data()), salt.size()),
                            std::span(reinterpret_cast<const uint8_t*>(label.data()), label.size()), 32);
}
inline std::string chain_hash(std::span<const uint8_t> secret, std::span<const uint8_t> b) {
  return secret.empty() ? sha256_bytes(b) : store::hex(store::hmac_sha256(chain_secret_key(secret), b));
}
inline std::string chain_root(const PromptStore& s, std::span<const uint8_t> secret = {}) {
  const std::string& salt = s.fingerprint();
  return secret.empty() ? salt : chain_hash(secret, std::span(reinterpret_cast<const uint8_t*>(salt.data()), salt.size()));
}
inline std::string chain_link(char domain, const std::string& parent, std::span<const int32_t> tokens, std::span<const uint8_t> secret = {}) {
  std::vector<uint8_t> b = {uint8_t(domain)};
  b.insert(b.end(), parent.begin(), parent.end());
  for (int32_t t : tokens)
    for (int k = 0; k < 4; ++k) b.push_back(uint8_t(uint32_t(t) >> (8 * k)));
  return chain_hash(secret, b);
}
// The root of a tenant's key chain in store `s` (docs/store.md "Tenants"):
// over 't' | c_0's hex | the tenant's bytes, hashed as a link is.
inline std::string tenant_root(const PromptStore& s, const std::string& tenant, std::span<const uint8_t> secret = {}) {
  const std::string r = chain_root(s, secret);
  std::vector<uint8_t> b = {uint8_t('t')};
  b.insert(b.end(), r.begin(), r.end());
  b.insert(b.end(), tenant.begin(), tenant.end());
  return chain_hash(secret, b);
}
// The chain key c_{i+1} of the chunks of `tokens` on the chain from `root`
// (chain_root, or a tenant's: tenant_root).
inline std::string chain_key_from(const std::string& root, const std::vector<int32_t>& tokens, size_t i, uint32_t C,
                                  std::span<const uint8_t> secret = {}) {
  std::string h = root;
  for (size_t j = 0; j <= i; ++j) h = chain_link('c', h, std::span(tokens).subspan(j * C, C), secret);
  return h;
}
// The chain key c_{i+1} of the chunks of `tokens` in store `s`.
inline std::string chain_key(const PromptStore& s, const std::vector<int32_t>& tokens, size_t i, uint32_t C, std::span<const uint8_t> secret = {}) {
  std::string h = chain_root(s, secret);
  for (size_t j = 0; j <= i; ++j) h = chain_link('c', h, std::span(tokens).subspan(j * C, C), secret);
  return h;
}

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace kvtc
