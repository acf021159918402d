// RoPE: our forward rotation against ggml's own ggml_rope_ext (the code
// that rotated the keys in the cache), and forward/inverse round trips, for
// every variant our models use. Synthetic vectors: this tests the rotation.
#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <ggml.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "codec/rope.h"
#include "core/capture_io.h"
#include "core/util.h"
#include "kvtc/error.h"
#include "kvtc/store.h"

using namespace kvtc;

namespace {

struct Variant {
  const char* name;
  RopeLayout layout;
  uint32_t head_dim, n_rot;
  float base, scale;
  bool factors;
  // YaRN and the magnitude factor (llama.cpp's yarn_ext_factor,
  // yarn_attn_factor, n_ctx_orig_yarn; betas at llama.cpp's defaults 32, 1).
  float ext = 0, attn = 1;
  uint32_t n_ctx_orig = 0;
};

std::vector<float> random_keys(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

// ggml's CPU backend, as llama.cpp loads it: the variant of
// libggml-cpu-*.so this CPU runs best (scripts/bootstrap.sh).
ggml_backend_t cpu_backend() {
  static ggml_backend_t b = [] {
    ggml_backend_load_all();
    return ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
  }();
  if (b == nullptr) throw Error("ggml: no CPU backend could be loaded");
  return b;
}

// ggml_rope_ext on [head_dim, 1 head, n_tok] (ggml's ne order).
std::vector<float> ggml_rope(const std::vector<float>& x, const std::vector<int32_t>& pos, const kvtc::Rope& p, uint32_t head_dim) {
  ggml_init_params ip{ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
  ggml_context* ctx = ggml_init(ip);
  const int64_t n_tok = int64_t(pos.size());
  ggml_tensor* a = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head_dim, 1, n_tok);
  ggml_tensor* ps = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tok);
  ggml_tensor* ff = nullptr;
  if (!p.freq_factors.empty()) ff = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, int64_t(p.freq_factors.size()));
  const int mode = p.layout == RopeLayout::kNeox ? GGML_ROPE_TYPE_NEOX : 0;
  ggml_tensor* r = ggml_rope_ext(ctx, a, ps, ff, int(p.n_rot), mode, p.ext_factor != 0 ? int(p.n_ctx_orig) : 8192, p.freq_base, p.freq_scale,
                                 p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow);
  ggml_cgraph* g = ggml_new_graph(ctx);
  ggml_build_forward_expand(g, r);
  ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, cpu_backend());
  ggml_backend_tensor_set(a, x.data(), 0, x.size() * 4);
  ggml_backend_tensor_set(ps, pos.data(), 0, pos.size() * 4);
  if (ff != nullptr) ggml_backend_tensor_set(ff, p.freq_factors.data(), 0, p.freq_factors.size() * 4);
  const ggml_status st = ggml_backend_graph_compute(cpu_backend(), g);
  std::vector<float> out(x.size());
  ggml_backend_tensor_get(r, out.data(), 0, out.size() * 4);
  ggml_backend_buffer_free(buf);
  ggml_free(ctx);
  if (st != GGML_STATUS_SUCCESS) throw Error("ggml_backend_graph_compute failed");
  return out;
}

}  // namespace

class RopeVsGgml : public ::testing::TestWithParam<Variant> {};

TEST_P(RopeVsGgml, ForwardMatchesGgmlAndInverseRoundTrips) {
  const Variant& v = GetParam();
  std::mt19937 rng(42);
  kvtc::Rope p;
  p.layout = v.layout;
  p.n_rot = v.n_rot;
  p.freq_base = v.base;
  p.freq_scale = v.scale;
  if (v.factors)
    for (uint32_t i = 0; i < v.n_rot / 2; ++i) p.freq_factors.push_back(1.0f + 7.0f * float(i) / float(v.n_rot));
  p.ext_factor = v.ext;
  p.attn_factor = v.attn;
  p.n_ctx_orig = v.n_ctx_orig;
  std::vector<int32_t> pos;
  for (int32_t t : {0, 1, 2, 3, 17, 127, 128, 1000, 4095, 8191, 30000}) pos.push_back(t);
  const std::vector<float> x = random_keys(pos.size() * v.head_dim, rng);
  std::vector<float> ours = x;
  rope_rotate(ours.data(), pos.data(), pos.size(), p, v.head_dim, false);
  const std::vector<float> ref = ggml_rope(x, pos, p, v.head_dim);
  double max_err = 0, max_abs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    max_err = std::max(max_err, double(std::fabs(ours[i] - ref[i])));
    max_abs = std::max(max_abs, double(std::fabs(ref[i])));
  }
  // ggml takes cosf/sinf of the same f32 angle; we use double: a few f32
  // ulps of the largest value apart, far below the f16 keys' resolution.
  // YaRN's mixed angle may differ by an f32 ulp where ggml's compiler fuses
  // its products (src/codec/rope.cpp): measured 6.9e-6 of the largest
  // value (norm_yarn_x2, position 30000 at 15x its n_ctx_orig); bound
  // 2e-5, 3x, still 1/50 of f16's resolution. Without the magnitude
  // factor all three YaRN variants fail.
  EXPECT_LT(max_err, (v.ext != 0 ? 2e-5 : 4e-6) * max_abs) << "forward rotation differs from ggml_rope_ext";
  std::vector<float> back = ours;
  rope_rotate(back.data(), pos.data(), pos.size(), p, v.head_dim, true);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 2e-6 * max_abs) << i;
  // Dimensions past n_rot are untouched.
  for (size_t t = 0; t < pos.size(); ++t)
    for (uint32_t d = v.n_rot; d < v.head_dim; ++d) EXPECT_EQ(ours[t * v.head_dim + d], x[t * v.head_dim + d]);
}

INSTANTIATE_TEST_SUITE_P(Variants, RopeVsGgml,
                         ::testing::Values(Variant{"norm_smollm2", RopeLayout::kNorm, 64, 64, 100000.0f, 1.0f, false},
                                           Variant{"neox_gemma_global", RopeLayout::kNeox, 256, 256, 1000000.0f, 1.0f, false},
                                           Variant{"neox_gemma_swa", RopeLayout::kNeox, 256, 256, 10000.0f, 1.0f, false},
                                           Variant{"norm_linear_scale", RopeLayout::kNorm, 128, 128, 500000.0f, 0.25f, false},
                                           Variant{"norm_llama3_factors", RopeLayout::kNorm, 128, 128, 500000.0f, 1.0f, true},
                                           Variant{"neox_partial_rot", RopeLayout::kNeox, 128, 64, 10000.0f, 1.0f, false},
                                           // Qwen2.5 at 4x its 32K (--rope-scaling yarn --rope-scale 4), llama.cpp's attention factor
                                           Variant{"neox_yarn_x4", RopeLayout::kNeox, 128, 128, 1000000.0f, 0.25f, false, 1.0f, 0.878f, 32768},
                                           Variant{"norm_yarn_x2", RopeLayout::kNorm, 64, 64, 100000.0f, 0.5f, false, 1.0f, 1.0f, 2048},
                                           Variant{"norm_yarn_factors", RopeLayout::kNorm, 128, 128, 500000.0f, 0.125f, true, 0.5f, 1.0f, 8192},
                                           // a magnitude factor without YaRN (ext_factor 0)
                                           Variant{"norm_attn_factor", RopeLayout::kNorm, 64, 64, 10000.0f, 1.0f, false, 0.0f, 0.8f, 0}),
                         [](const auto& i) { return std::string(i.param.name); });

TEST(RopeMeta, ParsesAndRefuses) {
  std::map<std::string, std::string> m{{"rope_type", "neox"},           {"n_rot", "256"},
                                       {"rope_freq_base", "1000000"},   {"rope_freq_scale", "1"},
                                       {"rope_freq_base_swa", "10000"}, {"rope_freq_scale_swa", "1"},
                                       {"rope_freq_factors", "[]"},     {"rope_scaling_type", "none"}};
  const kvtc::Rope g = rope_from_meta(m, false, 256, "f");
  EXPECT_TRUE(g.unsupported.empty()) << g.unsupported;
  EXPECT_EQ(g.layout, RopeLayout::kNeox);
  EXPECT_EQ(g.freq_base, 1000000.0f);
  EXPECT_EQ(rope_from_meta(m, true, 256, "f").freq_base, 10000.0f);
  // What kvtc cannot undo is kept as a reason (captures of such models still
  // work; coding their keys is refused with it), never silently identity.
  auto refused = [&](const std::map<std::string, std::string>& bad, const char* why) {
    const kvtc::Rope r = rope_from_meta(bad, false, 256, "f");
    EXPECT_NE(r.unsupported.find(why), std::string::npos) << r.unsupported;
    EXPECT_THROW(require_rope_supported(r, "x"), Error);
    std::vector<float> x(256);
    const int32_t pos = 3;
    EXPECT_THROW(rope_rotate(x.data(), &pos, 1, r, 256, false), Error);
  };
  auto bad = m;
  bad["rope_type"] = "mrope";
  refused(bad, "mrope");
  bad = m;
  bad["rope_scaling_type"] = "yarn";  // without its parameters
  refused(bad, "yarn_ext_factor");
  bad["yarn_ext_factor"] = "1", bad["yarn_attn_factor"] = "1", bad["yarn_beta_fast"] = "32", bad["yarn_beta_slow"] = "1";
  bad["n_ctx_orig_yarn"] = "0";  // YaRN needs its training context
  refused(bad, "n_ctx_orig");
  bad = m;
  bad["n_rot"] = "300";
  refused(bad, "n_rot");
  bad = m;
  bad.erase("rope_freq_base");
  refused(bad, "rope_freq_base");
  bad = m;
  bad["rope_freq_factors"] = "[1,2]";
  refused(bad, "rope_freq_factors");
  // The typed values written back as strings read back equal.
  CacheGeometry geo;
  geo.model_sha256 = "m";
  geo.blocks.resize(2);
  for (auto& b : geo.blocks) b.head_dim = 256, b.layers = {0};
  geometry_from_meta(m, geo, "f");
  EXPECT_EQ(geo.blocks[1].rope.freq_base, 10000.0f);
  CacheGeometry again = geo;
  geometry_from_meta(meta_with_geometry({}, geo), again, "f");
  EXPECT_EQ(again.blocks[0].rope, geo.blocks[0].rope);
  EXPECT_EQ(again.blocks[1].rope, geo.blocks[1].rope);
  // Plain RoPE writes no YaRN key (files as before).
  for (const char* k : {"yarn_ext_factor", "yarn_attn_factor", "n_ctx_orig_yarn"}) EXPECT_EQ(meta_with_geometry({}, geo).count(k), 0u) << k;
}

// A context's settings (context_kv_settings) on the GGUF's geometry: block
// 0's base and scale, every block's YaRN and magnitude factor; written to
// metadata as scaling "yarn" and read back equal.
TEST(RopeMeta, ContextSettingsAndYarnRoundTrip) {
  CacheGeometry g;
  g.model_sha256 = "m";
  g.blocks.resize(2);
  for (auto& b : g.blocks) b.head_dim = 256, b.layers = {0}, b.rope.layout = RopeLayout::kNeox, b.rope.n_rot = 256;
  g.blocks[0].rope.freq_base = 1000000.0f;
  g.blocks[1].rope.freq_base = 10000.0f;
  g.blocks[1].sliding_window = 512;
  EXPECT_EQ(geometry_with_settings(g, KvSettings{}).blocks[0].rope, g.blocks[0].rope);  // unset: as it was
  KvSettings s{.rope_freq_base = 2000000.0f,
               .rope_freq_scale = 0.25f,
               .n_ctx_orig_yarn = 32768,
               .yarn_ext_factor = 1.0f,
               .yarn_attn_factor = 0.878f,
               .yarn_beta_fast = 32.0f,
               .yarn_beta_slow = 1.0f};
  const CacheGeometry y = geometry_with_settings(g, s);
  EXPECT_EQ(y.blocks[0].rope.freq_base, 2000000.0f);
  EXPECT_EQ(y.blocks[0].rope.freq_scale, 0.25f);
  EXPECT_EQ(y.blocks[1].rope.freq_base, 10000.0f);  // the sliding-window layers keep theirs
  for (const auto& b : y.blocks) {
    EXPECT_TRUE(b.rope.yarn());
    EXPECT_EQ(b.rope.ext_factor, 1.0f);
    EXPECT_EQ(b.rope.attn_factor, 0.878f);
    EXPECT_EQ(b.rope.n_ctx_orig, 32768u);
  }
  const Meta m = meta_with_geometry({{"rope_scaling_type", "none"}}, y);
  EXPECT_EQ(m.at("rope_scaling_type"), "yarn");
  CacheGeometry back = g;
  geometry_from_meta(m, back, "f");
  EXPECT_EQ(back.blocks[0].rope, y.blocks[0].rope);
  EXPECT_EQ(back.blocks[1].rope, y.blocks[1].rope);
  // A GGUF that says rope scaling "yarn" itself gives no parameters
  // (llama.cpp resolves them for a context): the plain rotation, marked
  // unresolved and refused alone; a context's settings complete it to the
  // same rotation as above. A rotation no setting makes undoable (M-RoPE)
  // stays refused.
  CacheGeometry gy = g, gm = g;
  for (auto& b : gy.blocks) b.rope.unsupported = "m.gguf: no parameters", b.rope.yarn_unresolved = true;
  gm.blocks[0].rope.unsupported = "m.gguf: rope type 'mrope'";
  EXPECT_EQ(geometry_with_settings(gy, KvSettings{}).blocks[0].rope, gy.blocks[0].rope);
  const CacheGeometry yr = geometry_with_settings(gy, s);
  EXPECT_EQ(yr.blocks[0].rope, y.blocks[0].rope);
  EXPECT_EQ(yr.blocks[1].rope, y.blocks[1].rope);
  EXPECT_EQ(geometry_with_settings(gm, s).blocks[0].rope, gm.blocks[0].rope);
  // Plain settings (a context without YaRN): no YaRN, the GGUF's
  // "yarn" (if it said so) not carried into a plain file.
  s.yarn_ext_factor = 0.0f;
  s.yarn_attn_factor = 1.0f;
  const CacheGeometry p = geometry_with_settings(g, s);
  EXPECT_FALSE(p.blocks[0].rope.yarn());
  EXPECT_EQ(p.blocks[0].rope.n_ctx_orig, 0u);
  const Meta pm = meta_with_geometry({{"rope_scaling_type", "yarn"}, {"yarn_ext_factor", "1"}}, p);
  EXPECT_EQ(pm.at("rope_scaling_type"), "linear");
  EXPECT_EQ(pm.count("yarn_ext_factor"), 0u);
}

// The rules are written once (rope_from_facts) for both sources: a file's
// metadata (rope_from_meta) and a GGUF header (src/llama's rope_of, with
// these names). Each message names the fact as its source calls it, and
// with several faults the first in the rules' order is the one reported.
TEST(RopeFacts, MessagesNameTheSource) {
  const std::map<std::string, std::string> m{{"rope_type", "neox"},         {"n_rot", "256"},
                                             {"rope_freq_base", "1000000"}, {"rope_freq_scale", "1"},
                                             {"rope_freq_factors", "[]"},   {"rope_scaling_type", "none"}};
  auto why = [&](const std::map<std::string, std::string>& changed, const std::vector<std::string>& erased = {}) {
    auto bad = m;
    for (const auto& [k, v] : changed) bad[k] = v;
    for (const auto& k : erased) bad.erase(k);
    return rope_from_meta(bad, false, 256, "f").unsupported;
  };
  EXPECT_EQ(why({}), "");
  EXPECT_EQ(why({{"rope_type", "none"}, {"n_rot", "x"}}), "");  // none reads nothing else
  EXPECT_EQ(why({}, {"rope_type"}), "f: __metadata__['rope_type'] is missing (needed for RoPE)");
  EXPECT_EQ(why({{"rope_type", "mrope"}}), "f: __metadata__['rope_type'] is 'mrope'; kvtc supports norm, neox and none");
  EXPECT_EQ(why({{"rope_scaling_type", "yarn"}}), "f: __metadata__['yarn_ext_factor'] is missing (needed for RoPE)");
  EXPECT_EQ(why({{"rope_scaling_type", "dynamic"}}), "f: __metadata__['rope_scaling_type'] is 'dynamic'; kvtc supports none, linear and yarn");
  EXPECT_EQ(why({{"rope_scaling_type", ""}}), "f: __metadata__['rope_scaling_type'] is ''; kvtc supports none, linear and yarn");
  EXPECT_EQ(why({{"n_rot", "63.5"}}), "f: n_rot 63.5 must be even and <= head_dim 256");
  EXPECT_EQ(why({{"n_rot", "300"}}), "f: n_rot 300 must be even and <= head_dim 256");
  EXPECT_EQ(why({{"n_rot", "2x"}}), "f: __metadata__['n_rot'] is '2x', expected a number");
  EXPECT_EQ(why({}, {"rope_freq_base"}), "f: __metadata__['rope_freq_base'] is missing (needed for RoPE)");
  EXPECT_EQ(why({{"rope_freq_scale", "0"}}), "f: RoPE frequency base and scale must be positive");
  EXPECT_EQ(why({{"rope_freq_factors", "x"}}), "f: __metadata__['rope_freq_factors'] is not a JSON list of numbers");
  EXPECT_EQ(why({{"rope_freq_factors", "[1,2]"}}), "f: rope_freq_factors has 2 entries, expected n_rot/2 = 128");
  EXPECT_EQ(why({{"n_rot", "7"}}, {"rope_freq_base"}), "f: n_rot 7 must be even and <= head_dim 256");
  EXPECT_EQ(why({{"rope_freq_scale", "-1"}, {"rope_freq_factors", "x"}}), "f: RoPE frequency base and scale must be positive");

  RopeFacts g;
  g.type_name = "rope type";
  g.scaling_name = "rope scaling";
  g.factors_name = "rope_freqs";
  g.type = "norm";
  g.scaling = "none";
  g.n_rot = 64;
  g.freq_base = 100000;
  g.freq_scale = 1;
  EXPECT_EQ(rope_from_facts(g, 64, "m.gguf").unsupported, "");
  EXPECT_EQ(rope_from_facts(g, 64, "m.gguf").layout, RopeLayout::kNorm);
  auto gwhy = [&](auto change) {
    RopeFacts b = g;
    change(b);
    return rope_from_facts(b, 64, "m.gguf").unsupported;
  };
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.type = "mrope"; }), "m.gguf: rope type 'mrope'; kvtc supports norm, neox and none");
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.scaling = "dynamic"; }), "m.gguf: rope scaling 'dynamic'; kvtc supports none, linear and yarn");
  // A source that cannot read YaRN's parameters says why (src/llama's rope_of for a GGUF's own yarn).
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.scaling = "yarn", b.yarn_error = "no parameters"; }), "m.gguf: no parameters");
  {  // ... and keeps the plain rotation, marked for a context's settings to complete (geometry_with_settings)
    RopeFacts b = g;
    b.scaling = "yarn", b.yarn_error = "no parameters";
    const Rope u = rope_from_facts(b, 64, "m.gguf");
    EXPECT_TRUE(u.yarn_unresolved);
    EXPECT_EQ(u.layout, RopeLayout::kNorm);
    EXPECT_EQ(u.freq_base, 100000.0f);
    EXPECT_FALSE(rope_from_facts(g, 64, "m.gguf").yarn_unresolved);
  }
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.scaling = "yarn", b.ext_factor = 1, b.n_ctx_orig = 0; }),
            "m.gguf: YaRN's n_ctx_orig 0 must be a positive integer");
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.scaling = "yarn", b.attn_factor = 0; }),
            "m.gguf: YaRN's ext_factor must be >= 0 and attn_factor, beta_fast and beta_slow positive (got 0, 0, 32, 1)");
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.n_rot = 65; }), "m.gguf: n_rot 65 must be even and <= head_dim 64");
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.freq_base = 0; }), "m.gguf: RoPE frequency base and scale must be positive");
  EXPECT_EQ(gwhy([](RopeFacts& b) { b.freq_factors.assign(3, 1.0f); }), "m.gguf: rope_freqs has 3 entries, expected n_rot/2 = 32");
}

// The decoder's fused rotation and f16 rounding (rope_apply_f16: AVX-512 in
// double where the CPU has it) against rope_apply then f32_to_f16_n: the same
// bits, for both layouts, a partial rotation (n_rot < head_dim), a rotation
// the vector path does not take (n_rot 12) and rows read with a stride.
// Synthetic keys: the test is about the arithmetic.
TEST(RopeF16, FusedPathGivesTheStagedBits) {
  std::mt19937 g(5);
  std::normal_distribution<float> nd;
  struct Case {
    RopeLayout layout;
    uint32_t head_dim, n_rot;
  };
  bool vector_taken = false;
  for (const Case cs : {Case{RopeLayout::kNorm, 64, 64}, Case{RopeLayout::kNeox, 128, 128}, Case{RopeLayout::kNeox, 64, 32},
                        Case{RopeLayout::kNorm, 80, 48}, Case{RopeLayout::kNorm, 64, 12}, Case{RopeLayout::kNone, 64, 0}}) {
    Rope r;
    r.layout = cs.layout, r.n_rot = cs.n_rot, r.freq_base = 100000.0f;
    const uint32_t n = 37, stride = 3 * cs.head_dim + 5;
    std::vector<int32_t> pos(n);
    for (uint32_t k = 0; k < n; ++k) pos[k] = int32_t(k * 211 + 3);
    std::vector<float> in(size_t(n) * stride);
    for (float& v : in) v = 20.0f * nd(g);
    const RopeTable t = rope_table(pos.data(), n, r, cs.head_dim, false);
    std::vector<float> staged(size_t(n) * cs.head_dim);
    for (uint32_t k = 0; k < n; ++k)
      for (uint32_t d = 0; d < cs.head_dim; ++d) staged[size_t(k) * cs.head_dim + d] = in[size_t(k) * stride + d];
    rope_apply(staged.data(), t);
    std::vector<uint16_t> want(staged.size()), got(staged.size());
    f32_to_f16_n(staged.data(), want.data(), staged.size());
    const RopeExpanded ex = rope_expand(t);
    vector_taken |= !ex.cc.empty();
    rope_apply_f16(in.data(), stride, t, ex, got.data());
    EXPECT_EQ(got, want) << "head_dim " << cs.head_dim << ", n_rot " << cs.n_rot;
    EXPECT_TRUE(rope_expand(t).cc.empty() || cs.n_rot % 16 == 0) << "the vector path needs n_rot a multiple of 16";
  }
  if (!vector_taken) GTEST_SKIP() << "no AVX-512 here: the staged path checked alone";
}
