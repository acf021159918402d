#include "calibrate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dp.h"
#include "kvtc/error.h"
#include "kvtc/features.h"
#include "kvtc/llama_session.h"
#include "kvtc/util.h"
#include "pca.h"

namespace kvtc {

std::string ratio_key(double ratio) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", ratio);
  return b;
}

static BlockErrors block_errors_of(const Transform& t) {
  BlockErrors e;
  e.n_components = t.r;
  e.sizes = t.sizes;
  e.n_tokens = t.n_heldout;
  for (const auto& v : t.block_errors) {
    std::vector<std::array<double, kNumQTypes>> rows(v.size() / kNumQTypes);
    for (size_t j = 0; j < rows.size(); ++j)
      for (int q = 0; q < kNumQTypes; ++q) rows[j][q] = v[j * kNumQTypes + q];
    e.err.push_back(std::move(rows));
  }
  return e;
}

std::array<Allocation, 2> joint_allocation_for_ratio(const Transform& k, const Transform& v, double ratio) {
  require(ratio >= 1.0 && ratio <= 4096, "ratio must be in [1, 4096], got " + ratio_key(ratio));
  require(k.p == v.p, "joint allocation: keys and values differ in p");
  const uint64_t budget = uint64_t(std::floor(double(k.p) * 16.0 / ratio));
  const BlockErrors ek = block_errors_of(k), ev = block_errors_of(v);
  std::vector<double> ck, cv;
  allocate_bits(ek, 2 * budget, 2, &ck);
  allocate_bits(ev, 2 * budget, 2, &cv);
  const size_t total = (2 * budget) / 2;
  size_t best_k = total / 2;
  double best = INFINITY;
  for (size_t bk = 0; bk <= total; ++bk) {
    const double x = ck[bk] / k.total_variance + cv[total - bk] / v.total_variance;
    if (x < best) best = x, best_k = bk;
  }
  std::array<Allocation, 2> out{allocate_bits(ek, best_k * 2, 2), allocate_bits(ev, (total - best_k) * 2, 2)};
  for (auto& a : out) a.nominal_ratio = ratio;
  return out;
}

AllocationSet allocation_set(const Calibration& cal, double ratio, bool joint) {
  AllocationSet al(cal.blocks.size());
  for (size_t b = 0; b < cal.blocks.size(); ++b) {
    if (joint) {
      al[b] = joint_allocation_for_ratio(cal.blocks[b][0], cal.blocks[b][1], ratio);
      continue;
    }
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      auto it = t.tables.find(ratio_key(ratio));
      al[b][kv] = it != t.tables.end() ? it->second : allocation_for_ratio(t, ratio);
    }
  }
  return al;
}

Allocation allocation_for_ratio(const Transform& t, double ratio) {
  require(ratio >= 1.0 && ratio <= 4096, "ratio must be in [1, 4096], got " + ratio_key(ratio));
  const BlockErrors e = block_errors_of(t);
  const uint64_t budget = uint64_t(std::floor(double(t.p) * 16.0 / ratio));
  Allocation a = allocate_bits(e, budget, 2);
  a.nominal_ratio = ratio;
  return a;
}

namespace {

// Rows spooled as f16 to an anonymous temporary file, replayed for the
// randomized route's passes (1.8 GB for 160K tokens of p = 5,760).
class SpoolSource : public RowSource {
 public:
  explicit SpoolSource(uint32_t p) : p_(p), f_(std::tmpfile()) { require(f_ != nullptr, "calibrate: cannot create a temporary spool file"); }
  ~SpoolSource() override { std::fclose(f_); }
  void append(const float* x, size_t n) {
    buf_.resize(n * p_);
    for (size_t i = 0; i < n * p_; ++i) buf_[i] = f32_to_f16(x[i]);
    require(std::fwrite(buf_.data(), 2, buf_.size(), f_) == buf_.size(), "calibrate: writing the spool file failed (disk full?)");
    rows_ += n;
  }
  uint32_t p() const override { return p_; }
  void reset() override {
    std::fflush(f_);
    std::rewind(f_);
    at_ = 0;
  }
  size_t next(float* rows, size_t max_rows) override {
    const size_t n = std::min<size_t>(max_rows, rows_ - at_);
    buf_.resize(n * p_);
    require(std::fread(buf_.data(), 2, buf_.size(), f_) == buf_.size(), "calibrate: reading the spool file failed");
    for (size_t i = 0; i < buf_.size(); ++i) rows[i] = f16_to_f32(buf_[i]);
    at_ += n;
    return n;
  }

 private:
  uint32_t p_;
  FILE* f_;
  std::vector<uint16_t> buf_;
  uint64_t rows_ = 0, at_ = 0;
};

struct Doc {
  std::string file, id, kind;
  uint64_t tokens;
  std::string order = {};  // sha256 of the id: a stable shuffle
};

std::vector<Doc> calib_docs(const std::string& corpus, const std::vector<std::string>& kinds) {
  const std::string path = corpus + "/manifest.json";
  std::ifstream f(path);
  require(f.good(), path + ": cannot open (run `make corpus`)");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
  std::vector<Doc> docs;
  for (const auto& d : m.at("documents"))
    if (d.at("split") == "calib" && (kinds.empty() || std::find(kinds.begin(), kinds.end(), d.at("kind").get<std::string>()) != kinds.end()))
      docs.push_back({corpus + "/" + d.at("file").get<std::string>(), d.at("id").get<std::string>(), d.at("kind").get<std::string>(),
                      d.at("tokens").get<uint64_t>()});
  require(!docs.empty(), path + ": no calibration documents" + (kinds.empty() ? std::string() : " of the kinds asked for"));
  // Interleave kinds and sources: order by a hash of the id (stable).
  for (Doc& d : docs) d.order = sha256_bytes({reinterpret_cast<const uint8_t*>(d.id.data()), d.id.size()});
  std::sort(docs.begin(), docs.end(), [](const Doc& a, const Doc& b) { return a.order < b.order; });
  return docs;
}

}  // namespace

Calibration calibrate(const CalibrateOptions& opt, const ProgressFn& progress) {
  auto model = Model::load(opt.model_path);
  const ModelInfo& mi = model->info();
  const CacheGeometry g = model->geometry();
  std::vector<Doc> docs = calib_docs(opt.corpus_dir, opt.kinds);
  SessionOptions so;
  so.n_ctx = opt.max_doc_tokens ? std::min(opt.max_doc_tokens, mi.n_ctx_train) : mi.n_ctx_train;
  so.n_threads = opt.threads;
  Session s(*model, so);

  const size_t nb = g.block_layers.size();
  std::vector<uint32_t> p(nb);
  for (size_t b = 0; b < nb; ++b) p[b] = uint32_t(g.block_layers[b].size()) * g.n_head_kv * g.head_dim_k;
  require(opt.pca_route == "auto" || opt.pca_route == "exact" || opt.pca_route == "randomized",
          "calibrate: PCA route must be auto, exact or randomized, got '" + opt.pca_route + "'");
  std::vector<bool> randomized(nb);
  std::vector<std::array<std::unique_ptr<CovAccumulator>, 2>> acc(nb);
  std::vector<std::array<std::unique_ptr<SpoolSource>, 2>> spool(nb);
  for (size_t b = 0; b < nb; ++b) {
    randomized[b] = opt.pca_route == "randomized" || (opt.pca_route == "auto" && p[b] > 12288);
    for (int k = 0; k < 2; ++k) {
      if (randomized[b])
        spool[b][k] = std::make_unique<SpoolSource>(p[b]);
      else
        acc[b][k] = std::make_unique<CovAccumulator>(p[b]);
    }
  }
  std::vector<std::array<std::vector<float>, 2>> held(nb);
  std::vector<uint64_t> held_n(nb, 0);
  std::map<std::string, std::string> capture_meta;
  uint64_t fit = 0, docs_fit = 0, docs_held = 0;
  std::vector<float> buf;
  size_t di = 0;
  for (; di < docs.size() && (fit < opt.n_tokens || held_n[0] < opt.heldout_tokens); ++di) {
    // Every 8th document goes to the held-out set until it is full.
    const bool to_held = held_n[0] < opt.heldout_tokens && (di % 8 == 7 || fit >= opt.n_tokens);
    if (!to_held && fit >= opt.n_tokens) continue;
    std::vector<uint8_t> raw = read_file(docs[di].file);
    std::vector<int32_t> toks = model->tokenize(std::string(raw.begin(), raw.end()));
    const uint64_t want = to_held ? opt.heldout_tokens - held_n[0] : opt.n_tokens - fit;
    const size_t n = std::min<size_t>({toks.size(), size_t(s.n_ctx()), size_t(want + opt.skip_sinks)});
    if (n <= opt.skip_sinks + 1) continue;
    toks.resize(n);
    s.clear();
    s.decode(toks, 0);
    KvCapture c = s.capture();
    if (capture_meta.empty()) capture_meta = c.meta;
    for (size_t b = 0; b < nb; ++b) {
      const KvBlock& blk = c.blocks[b];
      RopeParams rope = rope_params_from_meta(c.meta, b == 1, blk.head_dim, "calibration capture");
      // The first tokens are sinks only in block 0 (the SWA block starts later).
      const uint32_t t_begin = b == 0 ? opt.skip_sinks : (blk.pos.front() < int32_t(opt.skip_sinks) ? opt.skip_sinks - blk.pos.front() : 0);
      for (int k = 0; k < 2; ++k) {
        for (uint32_t t0 = t_begin; t0 < blk.n_tokens(); t0 += 512) {
          const uint32_t t1 = std::min(blk.n_tokens(), t0 + 512);
          buf.resize(size_t(t1 - t0) * p[b]);
          gather_features(blk, KvKind(k), opt.keep_rope ? nullptr : &rope, t0, t1, buf.data());
          if (to_held)
            held[b][k].insert(held[b][k].end(), buf.begin(), buf.end());
          else if (randomized[b])
            spool[b][k]->append(buf.data(), t1 - t0);
          else
            acc[b][k]->add(buf.data(), t1 - t0);
        }
      }
      if (to_held) held_n[b] += blk.n_tokens() - t_begin;
    }
    if (to_held) {
      ++docs_held;
    } else {
      fit += n - opt.skip_sinks;
      ++docs_fit;
    }
    if (progress) progress("prefill", std::min(fit, opt.n_tokens) + std::min(held_n[0], opt.heldout_tokens), opt.n_tokens + opt.heldout_tokens);
  }
  require(fit >= 2 && held_n[0] > 0,
          "calibrate: the corpus yielded " + std::to_string(fit) + " fit and " + std::to_string(held_n[0]) + " held-out tokens; need more text");

  Calibration cal;
  cal.blocks.resize(nb);
  uint64_t step = 0;
  for (size_t b = 0; b < nb; ++b)
    for (int k = 0; k < 2; ++k) {
      if (progress) progress("pca", step++, 2 * nb);
      RandomizedOptions ro;
      ro.power_iters = opt.power_iters;
      Pca pca = randomized[b] ? randomized_pca(*spool[b][k], opt.rank_max, ro) : acc[b][k]->finish(opt.rank_max);
      acc[b][k].reset();
      spool[b][k].reset();
      Transform& t = cal.blocks[b][k];
      t.p = pca.p;
      t.r = pca.r;
      t.mu = std::move(pca.mu);
      t.basis = std::move(pca.basis);
      t.variance.assign(pca.variance.begin(), pca.variance.end());
      t.total_variance = pca.total_variance;
      Pca view;
      view.p = t.p;
      view.r = t.r;
      view.mu = t.mu;
      view.basis = t.basis;
      const size_t nh = held[b][k].size() / t.p;
      std::vector<float> d(nh * t.r);
      pca_project(view, held[b][k].data(), nh, d.data());
      held[b][k].clear();
      held[b][k].shrink_to_fit();
      for (uint32_t sz : default_block_sizes())
        if (sz <= t.r) t.sizes.push_back(sz);
      BlockErrors e = measure_block_errors(d.data(), nh, t.r, t.sizes);
      t.n_heldout = nh;
      for (const auto& rows : e.err) {
        std::vector<float> v;
        for (const auto& r4 : rows) v.insert(v.end(), r4.begin(), r4.end());
        t.block_errors.push_back(std::move(v));
      }
      for (double ratio : opt.ratios) t.tables[ratio_key(ratio)] = allocation_for_ratio(t, ratio);
    }
  if (progress) progress("pca", 2 * nb, 2 * nb);

  static const char* kCopy[] = {"arch",
                                "model_name",
                                "model_sha256",
                                "llama_cpp_commit",
                                "n_layer",
                                "n_head_kv",
                                "head_dim",
                                "rope_type",
                                "n_rot",
                                "rope_freq_base",
                                "rope_freq_scale",
                                "rope_scaling_type",
                                "rope_scaling_factor",
                                "rope_scaling_orig_ctx",
                                "rope_freq_factors",
                                "n_swa",
                                "rope_freq_base_swa",
                                "rope_freq_scale_swa"};
  for (const char* k : kCopy)
    if (capture_meta.count(k)) cal.meta[k] = capture_meta.at(k);
  for (size_t b = 0; b < nb; ++b) cal.meta[b == 0 ? "layers" : "layers_swa"] = nlohmann::json(g.block_layers[b]).dump();
  cal.meta["calib_tokens"] = std::to_string(fit);
  cal.meta["calib_documents"] = std::to_string(docs_fit);
  cal.meta["heldout_tokens"] = std::to_string(held_n[0]);
  cal.meta["heldout_documents"] = std::to_string(docs_held);
  cal.meta["skip_sinks"] = std::to_string(opt.skip_sinks);
  cal.meta["calib_n_ctx"] = std::to_string(s.n_ctx());
  cal.meta["corpus_manifest_sha256"] = sha256_file(opt.corpus_dir + "/manifest.json");
  cal.meta["pca_route"] = randomized[0]
                              ? "randomized: Halko subspace iteration, " + std::to_string(opt.power_iters) + " power iterations, rows spooled as f16"
                              : "exact: streamed f32 SYRK into f64, LAPACK dsyevr";
  cal.meta["keys_rope"] = opt.keep_rope ? "kept" : "removed";
  if (!opt.kinds.empty()) cal.meta["calib_kinds"] = nlohmann::json(opt.kinds).dump();
  cal.meta["kvtc_version"] = KVTC_VERSION;
  cal.id = calibration_compute_id(cal);
  return cal;
}

}  // namespace kvtc
