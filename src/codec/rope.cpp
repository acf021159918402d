#include "codec/rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/util.h"
#include "kvtc/error.h"

namespace kvtc {

RopeTable rope_table(const int32_t* pos, size_t n_tok, const Rope& p, uint32_t head_dim, bool inverse) {
  require_rope_supported(p, "rope");
  require(p.n_rot <= head_dim && p.n_rot % 2 == 0, "rope: n_rot must be even and at most head_dim");
  require(p.freq_factors.empty() || p.freq_factors.size() == p.n_rot / 2, "rope: freq_factors must hold n_rot / 2 entries");
  require(p.layout == RopeLayout::kNone || (std::isfinite(p.freq_base) && p.freq_base > 0 && std::isfinite(p.freq_scale) && p.freq_scale > 0),
          "rope: freq_base and freq_scale must be positive and finite");
  require(p.layout == RopeLayout::kNone || !p.yarn() ||
              (std::isfinite(p.ext_factor) && p.ext_factor >= 0 && std::isfinite(p.attn_factor) && p.attn_factor > 0 && std::isfinite(p.beta_fast) &&
               p.beta_fast > 0 && std::isfinite(p.beta_slow) && p.beta_slow > 0 && (p.ext_factor == 0 || p.n_ctx_orig > 0)),
          "rope: YaRN needs ext_factor >= 0, attn_factor, beta_fast and beta_slow positive and finite, and n_ctx_orig > 0");
  RopeTable t;
  t.layout = p.layout;
  t.head_dim = head_dim;
  t.n_tok = n_tok;
  if (p.layout == RopeLayout::kNone || p.n_rot == 0) return t;
  t.half = p.n_rot / 2;
  // ggml computes theta_i = pos * theta_scale^i by repeated f32
  // multiplication, divides by the frequency factor, multiplies by
  // freq_scale, then takes cosf/sinf. We reproduce the f32 angle exactly
  // and take cos/sin in double: the forward rotation then differs from
  // ggml's (cosf/sinf of the same angle) by a few f32 ulps at most
  // (tests/test_rope.cpp holds it to 4e-6 of the largest value).
  //
  // YaRN (ext_factor != 0): pair i's angle is the interpolated one
  // (freq_scale x the extrapolated) mixed with the extrapolated one by
  // ramp(i) x ext_factor, ramp 1 below the correction dim of beta_fast and
  // 0 above beta_slow's, linear between; the correction dim of a beta is
  // the pair count whose wavelength fits beta times into n_ctx_orig, in
  // f32 as ggml's ggml_rope_yarn_corr_dims. The mix's two products may be
  // fused by ggml's compiler and not by ours: one f32 ulp of the angle,
  // ~1e-4 rad at the ramp's largest angles (~1,600 rad at 4x the
  // training context), a tenth of f16's resolution. Every rotation is
  // scaled by mscale; the inverse divides by it.
  const float theta_scale = std::pow(p.freq_base, -2.0f / float(p.n_rot));
  const bool ramp = p.ext_factor != 0.0f;  // Rope::yarn() also counts a magnitude factor alone
  float lo = 0, hi = 0;
  if (ramp) {
    auto corr_dim = [&](float beta) {
      return float(p.n_rot) * std::log(float(p.n_ctx_orig) / (beta * 2.0f * float(M_PI))) / (2.0f * std::log(p.freq_base));
    };
    lo = std::max(0.0f, std::floor(corr_dim(p.beta_fast)));
    hi = std::min(float(p.n_rot) - 1.0f, std::ceil(corr_dim(p.beta_slow)));
  }
  const float mscale = ramp ? p.attn_factor * (1.0f + 0.1f * std::log(1.0f / p.freq_scale)) : p.attn_factor;
  const double m = inverse ? 1.0 / double(mscale) : double(mscale);
  t.c.resize(n_tok * t.half);
  t.s.resize(n_tok * t.half);
  for (size_t k = 0; k < n_tok; ++k) {
    float theta = float(pos[k]);
    for (uint32_t i = 0; i < t.half; ++i) {
      const float ff = p.freq_factors.empty() ? 1.0f : p.freq_factors[i];
      const float extrap = theta / ff;
      float th = p.freq_scale * extrap;
      if (ramp) {
        const float y = (float(i) - lo) / std::max(0.001f, hi - lo);
        const float mix = (1.0f - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
        th = th * (1.0f - mix) + extrap * mix;
      }
      t.c[k * t.half + i] = std::cos(double(th)) * m;
      t.s[k * t.half + i] = (inverse ? -std::sin(double(th)) : std::sin(double(th))) * m;
      theta *= theta_scale;
    }
  }
  return t;
}

void rope_apply(float* x, const RopeTable& t) {
  if (t.half == 0) return;
  const bool norm = t.layout == RopeLayout::kNorm;
  for (size_t k = 0; k < t.n_tok; ++k) {
    float* row = x + k * t.head_dim;
    const double* c = &t.c[k * t.half];
    const double* s = &t.s[k * t.half];
    for (uint32_t i = 0; i < t.half; ++i) {
      const uint32_t a = norm ? 2 * i : i, b = norm ? 2 * i + 1 : i + t.half;
      const double x0 = row[a], x1 = row[b];
      row[a] = float(x0 * c[i] - x1 * s[i]);
      row[b] = float(x0 * s[i] + x1 * c[i]);
    }
  }
}

namespace {
bool rope_vector_path() {
#if defined(__x86_64__)
  static const bool v = cpu_features().avx512f && cpu_features().f16c;
  return v && vector_kernels();
#else
  return false;
#endif
}

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics warn of their own _mm512_undefined_* (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The *_round_pd forms: a product and a sum the compiler may not fuse into
// one FMA (the plain ones it may, with -ffp-contract=fast), so each rounds
// as the scalar rope_apply's do. A row in SmolLM2's 8K decode: 64 keys; the
// staged copy, rotation and conversion took ~80 thread-ms of 8,060 tokens'
// keys and values on the Zen 4 EPYC.
__attribute__((target("avx512f,f16c"))) void rope_apply_f16_avx512(const float* in, size_t stride, const RopeTable& t, const RopeExpanded& ex,
                                                                   uint16_t* out) {
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const uint32_t D = t.head_dim, nr = 2 * t.half, half = t.half;
  const bool norm = t.layout == RopeLayout::kNorm;
  alignas(64) double xd[512];
  alignas(64) float y[512];
  for (size_t k = 0; k < t.n_tok; ++k) {
    const float* x = in + k * stride;
    for (uint32_t d = 0; d < nr; d += 8) _mm512_store_pd(xd + d, _mm512_cvtps_pd(_mm256_loadu_ps(x + d)));
    const double* cc = &ex.cc[k * nr];
    const double* ss = &ex.ss[k * nr];
    for (uint32_t d = 0; d < nr; d += 8) {
      const __m512d v = _mm512_load_pd(xd + d);
      const __m512d w = norm ? _mm512_permute_pd(v, 0x55) : _mm512_load_pd(xd + (d < half ? d + half : d - half));
      const __m512d r =
          _mm512_add_round_pd(_mm512_mul_round_pd(v, _mm512_loadu_pd(cc + d), kRn), _mm512_mul_round_pd(w, _mm512_loadu_pd(ss + d), kRn), kRn);
      _mm256_store_ps(y + d, _mm512_cvtpd_ps(r));
    }
    uint16_t* o = out + k * D;
    uint32_t d = 0;
    for (; d + 16 <= nr; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), _mm512_cvtps_ph(_mm512_load_ps(y + d), _MM_FROUND_TO_NEAREST_INT));
    for (; d + 16 <= D; d += 16)  // past n_rot: not rotated
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), _mm512_cvtps_ph(_mm512_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
    if (d < D) f32_to_f16_n(x + d, o + d, D - d);
  }
}
#pragma GCC diagnostic pop
#endif
}  // namespace

RopeExpanded rope_expand(const RopeTable& t) {
  RopeExpanded ex;
  const uint32_t nr = 2 * t.half;
  // xd/y above hold one row of up to 512 rotated dimensions.
  if (t.half == 0 || nr % 16 != 0 || nr > 512 || !rope_vector_path()) return ex;
  const bool norm = t.layout == RopeLayout::kNorm;
  ex.cc.resize(t.n_tok * nr);
  ex.ss.resize(t.n_tok * nr);
  for (size_t k = 0; k < t.n_tok; ++k)
    for (uint32_t i = 0; i < t.half; ++i) {
      const uint32_t a = norm ? 2 * i : i, b = norm ? 2 * i + 1 : i + t.half;
      const double c = t.c[k * t.half + i], sn = t.s[k * t.half + i];
      // x_a c - x_b s as x_a c + x_b (-s): the same double; x_a s + x_b c as x_b c + x_a s.
      ex.cc[k * nr + a] = c, ex.ss[k * nr + a] = -sn;
      ex.cc[k * nr + b] = c, ex.ss[k * nr + b] = sn;
    }
  return ex;
}

void rope_apply_f16(const float* in, size_t stride, const RopeTable& t, const RopeExpanded& ex, uint16_t* out) {
  const uint32_t D = t.head_dim;
  if (t.half == 0) {
    for (size_t k = 0; k < t.n_tok; ++k) f32_to_f16_n(in + k * stride, out + k * D, D);
    return;
  }
#if defined(__x86_64__)
  if (!ex.cc.empty()) return rope_apply_f16_avx512(in, stride, t, ex, out);
#endif
  std::vector<float> tmp(t.n_tok * D);
  for (size_t k = 0; k < t.n_tok; ++k) std::memcpy(&tmp[k * D], in + k * stride, size_t(D) * 4);
  rope_apply(tmp.data(), t);
  f32_to_f16_n(tmp.data(), out, tmp.size());
}

void rope_rotate(float* x, const int32_t* pos, size_t n_tok, const Rope& r, uint32_t head_dim, bool inverse) {
  rope_apply(x, rope_table(pos, n_tok, r, head_dim, inverse));
}

}  // namespace kvtc
