// CalibrationFitter (kvtc/calibration.h): K/V caches -> PCA per (cache
// block, K/V) -> held-out block errors -> DP tables. No llama.cpp: the
// corpus route (src/llama/calibrate_corpus.cpp) feeds it captures.
#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>

#include "calib/dp.h"
#include "calib/pca.h"
#include "codec/features.h"
#include "codec/rope.h"
#include "core/util.h"
#include "kvtc/calibration.h"
#include "kvtc/error.h"

namespace kvtc {

namespace {

// Rows spooled as f16 to an anonymous temporary file, replayed for the
// randomized route's passes (1.8 GB for 160K tokens of p = 5,760).
class SpoolSource : public RowSource {
 public:
  explicit SpoolSource(uint32_t p) : p_(p), f_(std::tmpfile()) { require(f_ != nullptr, "calibrate: cannot create a temporary spool file"); }
  ~SpoolSource() override { std::fclose(f_); }
  SpoolSource(const SpoolSource&) = delete;
  SpoolSource& operator=(const SpoolSource&) = delete;
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

// Runs [t0, t1) of a block's tokens whose position is >= skip (the sinks
// left out), in token order.
std::vector<std::pair<uint32_t, uint32_t>> kept_runs(const KvBlock& b, uint32_t skip) {
  std::vector<std::pair<uint32_t, uint32_t>> runs;
  for (uint32_t t = 0; t < b.n_tokens();) {
    if (b.pos[t] < int32_t(skip)) {
      ++t;
      continue;
    }
    uint32_t e = t;
    while (e < b.n_tokens() && b.pos[e] >= int32_t(skip)) ++e;
    runs.push_back({t, e});
    t = e;
  }
  return runs;
}

// The first feature of each of `groups` runs of consecutive layers (group i:
// layers [i L / groups, (i+1) L / groups)); empty for one group.
std::vector<uint32_t> layer_group_starts(const BlockGeometry& g, uint32_t groups) {
  std::vector<uint32_t> starts;
  if (groups <= 1) return starts;
  const uint32_t L = g.n_layer(), per_layer = g.n_head_kv * g.head_dim;
  for (uint32_t i = 0; i < groups; ++i) starts.push_back(uint32_t(uint64_t(i) * L / groups) * per_layer);
  return starts;
}

}  // namespace

struct CalibrationFitter::Impl {
  CacheGeometry g;
  FitOptions opt;
  std::vector<bool> randomized;
  std::vector<std::array<std::unique_ptr<CovAccumulator>, 2>> acc;
  std::vector<std::array<std::unique_ptr<SpoolSource>, 2>> spool;
  std::vector<std::array<std::vector<float>, 2>> held;
  std::vector<uint64_t> fit_n, held_n;
  bool spent = false;

  // Feature rows of every kept token of c, block by block, to sink(b, kind, rows, n).
  template <class Sink>
  uint64_t feed(const KvCapture& c, const char* who, Sink&& sink) {
    require(!spent, std::string(who) + ": the fitter has finished already");
    require(c.blocks.size() == g.blocks.size(),
            std::string(who) + ": the cache has " + std::to_string(c.blocks.size()) + " block(s), the fitter " + std::to_string(g.blocks.size()));
    require(g.model_sha256.empty() || c.model_sha256 == g.model_sha256, std::string(who) + ": the cache is of another model than the fitter's");
    std::vector<float> buf;
    uint64_t rows0 = 0;
    for (size_t b = 0; b < c.blocks.size(); ++b) {
      const KvBlock& blk = c.blocks[b];
      const BlockGeometry& bg = g.blocks[b];
      require(blk.layers == bg.layers && blk.n_head_kv == bg.n_head_kv && blk.head_dim == bg.head_dim,
              std::string(who) + ": block " + std::to_string(b) + "'s layers, heads or dims differ from the fitter's geometry");
      require(blk.k.size() == blk.numel() && blk.v.size() == blk.numel(),
              std::string(who) + ": block " + std::to_string(b) + " K/V size differs from its shape");
      if (!opt.keep_rope) require_rope_supported(blk.rope, std::string(who) + ": block " + std::to_string(b));
      const uint32_t p = bg.features();
      const std::vector<std::pair<uint32_t, uint32_t>> runs = kept_runs(blk, opt.skip_sinks);
      for (int k = 0; k < 2; ++k)
        for (auto [r0, r1] : runs)
          for (uint32_t t0 = r0; t0 < r1; t0 += 512) {
            const uint32_t t1 = std::min(r1, t0 + 512);
            buf.resize(size_t(t1 - t0) * p);
            gather_features(blk, KvKind(k), opt.keep_rope ? nullptr : &blk.rope, t0, t1, buf.data());
            sink(b, k, buf.data(), size_t(t1 - t0));
          }
      uint64_t rows = 0;
      for (auto [r0, r1] : runs) rows += r1 - r0;
      if (b == 0) rows0 = rows;
    }
    return rows0;
  }
};

CalibrationFitter::CalibrationFitter(const CacheGeometry& g, const FitOptions& opt) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  require(!g.blocks.empty() && g.blocks.size() <= 2, "calibrate: the geometry must have 1 or 2 blocks");
  require(opt.pca_route == "auto" || opt.pca_route == "exact" || opt.pca_route == "randomized",
          "calibrate: PCA route must be auto, exact or randomized, got '" + opt.pca_route + "'");
  require(opt.rank_max >= 1, "calibrate: rank_max must be at least 1");
  for (double r : opt.ratios) require(r >= 1 && r <= 4096, "calibrate: ratios must be in [1, 4096], got " + ratio_key(r));
  require(opt.layer_groups >= 1, "calibrate: layer_groups must be at least 1");
  require(opt.layer_groups == 1 || opt.pca_route != "randomized", "calibrate: layer groups need the exact PCA route, not randomized");
  I.g = g;
  I.opt = opt;
  const size_t nb = g.blocks.size();
  I.randomized.resize(nb);
  I.acc.resize(nb);
  I.spool.resize(nb);
  I.held.resize(nb);
  I.fit_n.assign(nb, 0);
  I.held_n.assign(nb, 0);
  for (size_t b = 0; b < nb; ++b) {
    const uint32_t p = g.blocks[b].features();
    require(p >= 1 && p <= (1u << 20), "calibrate: block " + std::to_string(b) + " has " + std::to_string(p) + " features (1 .. 2^20 supported)");
    I.randomized[b] = opt.pca_route == "randomized" || (opt.pca_route == "auto" && p > 12288 && opt.layer_groups == 1);
    require(opt.layer_groups <= g.blocks[b].n_layer(), "calibrate: block " + std::to_string(b) + " has " + std::to_string(g.blocks[b].n_layer()) +
                                                           " layer(s), fewer than the " + std::to_string(opt.layer_groups) +
                                                           " layer groups asked for");
    for (int k = 0; k < 2; ++k) {
      if (I.randomized[b])
        I.spool[b][k] = std::make_unique<SpoolSource>(p);
      else
        I.acc[b][k] = std::make_unique<CovAccumulator>(p);
    }
  }
}

CalibrationFitter::~CalibrationFitter() = default;

uint64_t CalibrationFitter::add(const KvCapture& c) {
  Impl& I = *impl_;
  const uint64_t n = I.feed(c, "calibrate", [&](size_t b, int k, const float* x, size_t rows) {
    if (I.randomized[b])
      I.spool[b][k]->append(x, rows);
    else
      I.acc[b][k]->add(x, rows);
    if (k == 0) I.fit_n[b] += rows;
  });
  return n;
}

uint64_t CalibrationFitter::add_heldout(const KvCapture& c) {
  Impl& I = *impl_;
  return I.feed(c, "calibrate (held-out)", [&](size_t b, int k, const float* x, size_t rows) {
    I.held[b][k].insert(I.held[b][k].end(), x, x + rows * I.g.blocks[b].features());
    if (k == 0) I.held_n[b] += rows;
  });
}

uint64_t CalibrationFitter::fit_tokens() const {
  return impl_->fit_n[0];
}

uint64_t CalibrationFitter::heldout_tokens() const {
  return impl_->held_n[0];
}

Calibration CalibrationFitter::finish(const ProgressFn& progress) {
  Impl& I = *impl_;
  require(!I.spent, "calibrate: the fitter has finished already");
  for (size_t b = 0; b < I.g.blocks.size(); ++b)
    require(I.fit_n[b] >= 2 && I.held_n[b] > 0, "calibrate: block " + std::to_string(b) + " got " + std::to_string(I.fit_n[b]) + " fit and " +
                                                    std::to_string(I.held_n[b]) + " held-out tokens; need at least 2 and 1 (more text)");
  I.spent = true;
  const size_t nb = I.g.blocks.size();
  Calibration cal;
  cal.geometry = I.g;
  cal.keys_derope = !I.opt.keep_rope;
  cal.blocks.resize(nb);
  uint64_t step = 0;
  bool gram = false;  // any block's exact PCA through the Gram matrix (fewer tokens than features)
  for (size_t b = 0; b < nb; ++b)
    for (int k = 0; k < 2; ++k) {
      if (progress) progress("pca", step++, 2 * nb);
      RandomizedOptions ro;
      ro.power_iters = I.opt.power_iters;
      Pca pca = I.randomized[b] ? randomized_pca(*I.spool[b][k], I.opt.rank_max, ro)
                                : I.acc[b][k]->finish(I.opt.rank_max, layer_group_starts(I.g.blocks[b], I.opt.layer_groups));
      gram = gram || pca.gram;
      I.acc[b][k].reset();
      I.spool[b][k].reset();
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
      const size_t nh = I.held[b][k].size() / t.p;
      std::vector<float> d(nh * t.r);
      pca_project(view, I.held[b][k].data(), nh, d.data());
      I.held[b][k].clear();
      I.held[b][k].shrink_to_fit();
      for (uint32_t sz : {1u, 16u, 64u, 256u, 1024u})  // the method's block sizes (docs/method.md §4)
        if (sz <= t.r) t.sizes.push_back(sz);
      BlockErrors e = measure_block_errors(d.data(), nh, t.r, t.sizes);
      t.n_heldout = nh;
      for (const auto& rows : e.err) {
        std::vector<float> v;
        for (const auto& r4 : rows) v.insert(v.end(), r4.begin(), r4.end());
        t.block_errors.push_back(std::move(v));
      }
      for (double ratio : I.opt.ratios) t.tables[ratio_key(ratio)] = allocation_for_ratio(t, ratio);
    }
  if (progress) progress("pca", 2 * nb, 2 * nb);
  cal.meta["calib_tokens"] = std::to_string(I.fit_n[0]);
  cal.meta["heldout_tokens"] = std::to_string(I.held_n[0]);
  cal.meta["skip_sinks"] = std::to_string(I.opt.skip_sinks);
  cal.meta["pca_route"] =
      I.randomized[0] ? "randomized: Halko subspace iteration, " + std::to_string(I.opt.power_iters) + " power iterations, rows spooled as f16"
      : gram          ? "exact: Gram matrix of the calibration rows (fewer than the features), LAPACK dsyevr"
      : I.opt.layer_groups > 1 ? "exact: streamed f32 SYRK into f64, LAPACK dsyevr per layer group (" + std::to_string(I.opt.layer_groups) + ")"
                               : "exact: streamed f32 SYRK into f64, LAPACK dsyevr";
  if (I.opt.layer_groups > 1) cal.meta["layer_groups"] = std::to_string(I.opt.layer_groups);
  cal.meta["kvtc_version"] = KVTC_VERSION;
  cal.id = calibration_compute_id(cal);
  return cal;
}

Calibration fit_calibration(const std::vector<KvCapture>& fit, const std::vector<KvCapture>& heldout, const FitOptions& opt) {
  require(!fit.empty() && !heldout.empty(), "fit_calibration: give at least one cache to fit and one held out");
  CalibrationFitter f(fit[0].geometry(), opt);
  for (const KvCapture& c : fit) f.add(c);
  for (const KvCapture& c : heldout) f.add_heldout(c);
  return f.finish();
}

}  // namespace kvtc
