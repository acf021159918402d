#include "kvtc/rope.h"

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "kvtc/error.h"

namespace kvtc {

namespace {

const std::string& meta_get(const std::map<std::string, std::string>& m, const std::string& key, const std::string& origin) {
  auto it = m.find(key);
  require(it != m.end(), origin + ": __metadata__['" + key + "'] is missing (needed for RoPE)");
  return it->second;
}

float meta_float(const std::map<std::string, std::string>& m, const std::string& key, const std::string& origin) {
  const std::string& v = meta_get(m, key, origin);
  char* end = nullptr;
  float x = std::strtof(v.c_str(), &end);
  require(!v.empty() && *end == '\0' && std::isfinite(x), origin + ": __metadata__['" + key + "'] is '" + v + "', expected a number");
  return x;
}

}  // namespace

RopeParams rope_params_from_meta(const std::map<std::string, std::string>& meta, bool swa, uint32_t head_dim, const std::string& origin) {
  RopeParams p;
  p.head_dim = head_dim;
  const std::string& t = meta_get(meta, "rope_type", origin);
  if (t == "norm")
    p.layout = RopeParams::Layout::kNorm;
  else if (t == "neox")
    p.layout = RopeParams::Layout::kNeox;
  else if (t == "none")
    p.layout = RopeParams::Layout::kNone;
  else
    throw Error(origin + ": __metadata__['rope_type'] is '" + t + "'; kvtc supports norm, neox and none");
  if (p.layout == RopeParams::Layout::kNone) return p;
  const std::string scaling = meta.count("rope_scaling_type") ? meta.at("rope_scaling_type") : "none";
  require(scaling == "none" || scaling == "linear",
          origin + ": __metadata__['rope_scaling_type'] is '" + scaling + "'; kvtc supports none and linear (YaRN not yet)");
  p.n_rot = uint32_t(meta_float(meta, "n_rot", origin));
  require(p.n_rot % 2 == 0 && p.n_rot <= head_dim,
          origin + ": n_rot " + std::to_string(p.n_rot) + " must be even and <= head_dim " + std::to_string(head_dim));
  p.freq_base = meta_float(meta, swa ? "rope_freq_base_swa" : "rope_freq_base", origin);
  p.freq_scale = meta_float(meta, swa ? "rope_freq_scale_swa" : "rope_freq_scale", origin);
  require(p.freq_base > 0 && p.freq_scale > 0, origin + ": RoPE frequency base and scale must be positive");
  if (!swa && meta.count("rope_freq_factors")) {
    try {
      p.freq_factors = nlohmann::json::parse(meta.at("rope_freq_factors")).get<std::vector<float>>();
    } catch (const std::exception&) {
      throw Error(origin + ": __metadata__['rope_freq_factors'] is not a JSON list of numbers");
    }
    require(
        p.freq_factors.empty() || p.freq_factors.size() == p.n_rot / 2,
        origin + ": rope_freq_factors has " + std::to_string(p.freq_factors.size()) + " entries, expected n_rot/2 = " + std::to_string(p.n_rot / 2));
  }
  return p;
}

RopeTable rope_table(const int32_t* pos, size_t n_tok, const RopeParams& p, bool inverse) {
  RopeTable t;
  t.layout = p.layout;
  t.head_dim = p.head_dim;
  t.n_tok = n_tok;
  if (p.layout == RopeParams::Layout::kNone || p.n_rot == 0) return t;
  t.half = p.n_rot / 2;
  // ggml computes theta_i = pos * theta_scale^i by repeated f32
  // multiplication, divides by the frequency factor, multiplies by
  // freq_scale, then takes cosf/sinf. We reproduce the f32 angle exactly
  // and take cos/sin in double: the forward rotation then differs from
  // ggml's by at most an ulp of the result.
  const float theta_scale = std::pow(p.freq_base, -2.0f / float(p.n_rot));
  t.c.resize(n_tok * t.half);
  t.s.resize(n_tok * t.half);
  for (size_t k = 0; k < n_tok; ++k) {
    float theta = float(pos[k]);
    for (uint32_t i = 0; i < t.half; ++i) {
      const float ff = p.freq_factors.empty() ? 1.0f : p.freq_factors[i];
      const float th = p.freq_scale * (theta / ff);
      t.c[k * t.half + i] = std::cos(double(th));
      t.s[k * t.half + i] = inverse ? -std::sin(double(th)) : std::sin(double(th));
      theta *= theta_scale;
    }
  }
  return t;
}

void rope_apply(float* x, const RopeTable& t) {
  if (t.half == 0) return;
  const bool norm = t.layout == RopeParams::Layout::kNorm;
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

void rope_rotate(float* x, const int32_t* pos, size_t n_tok, const RopeParams& p, bool inverse) {
  rope_apply(x, rope_table(pos, n_tok, p, inverse));
}

}  // namespace kvtc
