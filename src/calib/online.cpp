// OnlineCalibrator (kvtc/calibration.h): a CalibrationFitter fed with the
// prompts a server serves, each prefix learned once.
#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "kvtc/calibration.h"
#include "kvtc/error.h"

namespace kvtc {

namespace {

// A run's key: its prefix's hash chained with its tokens (splitmix64 over
// each id). In memory only, never compared across machines.
uint64_t chain(uint64_t h, std::span<const int32_t> run) {
  for (int32_t t : run) {
    uint64_t z = h + 0x9e3779b97f4a7c15ull + uint64_t(uint32_t(t));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    h = z ^ (z >> 31);
  }
  return h;
}

// The tokens `idx` of `c` (block 0's token order), as a capture of their own:
// positions kept (the fitter removes RoPE by position).
KvCapture pick(const KvCapture& c, const std::vector<uint32_t>& idx) {
  KvCapture out;
  out.model_sha256 = c.model_sha256;
  const KvBlock& b = c.blocks[0];
  KvBlock s;
  static_cast<BlockGeometry&>(s) = b.geometry();
  s.pos.reserve(idx.size());
  for (uint32_t t : idx) s.pos.push_back(b.pos[t]);
  s.k.resize(s.numel());
  s.v.resize(s.numel());
  const size_t d = b.head_dim;
  for (uint32_t l = 0; l < b.n_layer(); ++l)
    for (uint32_t h = 0; h < b.n_head_kv; ++h)
      for (size_t i = 0; i < idx.size(); ++i) {
        std::memcpy(&s.k[s.index(l, h, uint32_t(i), 0)], &b.k[b.index(l, h, idx[i], 0)], d * 2);
        std::memcpy(&s.v[s.index(l, h, uint32_t(i), 0)], &b.v[b.index(l, h, idx[i], 0)], d * 2);
      }
  out.blocks.push_back(std::move(s));
  return out;
}

}  // namespace

struct OnlineCalibrator::Impl {
  OnlineCalibrationOptions opt;
  uint64_t heldout_target = 0;
  CalibrationFitter fitter;
  std::unordered_set<uint64_t> seen;  // keys of the runs learned (or skipped as seen)
  uint64_t seen_tokens = 0, new_tokens = 0, fit = 0, held = 0;
  Impl(const CacheGeometry& g, const OnlineCalibrationOptions& o) : opt(o), fitter(g, o.fit) {}
};

OnlineCalibrator::OnlineCalibrator(const CacheGeometry& g, const OnlineCalibrationOptions& opt) {
  require(g.blocks.size() == 1, "calibrate (served prompts): the model keeps " + std::to_string(g.blocks.size()) +
                                    " cache blocks (sliding-window layers); only single-block caches are learned from");
  require(opt.fit_tokens >= 2, "calibrate (served prompts): fit_tokens must be at least 2");
  require(opt.run_tokens >= 1, "calibrate (served prompts): run_tokens must be at least 1");
  impl_ = std::make_unique<Impl>(g, opt);
  impl_->heldout_target = std::max<uint64_t>(1, opt.heldout_tokens ? opt.heldout_tokens : opt.fit_tokens / 16);
}

OnlineCalibrator::~OnlineCalibrator() = default;

uint64_t OnlineCalibrator::add(const KvCapture& c, std::span<const int32_t> tokens, uint32_t stride) {
  Impl& I = *impl_;
  require(c.blocks.size() == 1, "calibrate (served prompts): the cache has " + std::to_string(c.blocks.size()) + " blocks, 1 expected");
  const KvBlock& b = c.blocks[0];
  require(b.n_tokens() == tokens.size(),
          "calibrate (served prompts): the cache holds " + std::to_string(b.n_tokens()) + " tokens, the prompt " + std::to_string(tokens.size()));
  for (uint32_t t = 0; t < b.n_tokens(); ++t)
    if (b.pos[t] != int32_t(t))
      throw Error("calibrate (served prompts): cache token " + std::to_string(t) + " is at position " + std::to_string(b.pos[t]) +
                  ", a prompt's cache holds positions 0..n-1 in order");
  stride = std::max<uint32_t>(1, stride);
  const size_t R = I.opt.run_tokens, n = tokens.size();
  I.seen_tokens += n;
  // Whole runs only: a prompt's last partial run is learned when a longer
  // prompt (its next turn) completes it.
  std::vector<uint32_t> fit, held;
  uint64_t h = 0, fresh = 0;
  bool past = false;  // past the longest prefix seen before
  for (size_t r0 = 0; r0 + R <= n; r0 += R) {
    h = chain(h, tokens.subspan(r0, R));
    if (!past && I.seen.count(h)) continue;
    past = true;
    I.seen.insert(h);
    fresh += R;
    // Held out while its rows are fewer than their share of the fit rows
    // (its target, scaled to how far the fit has come).
    const bool hold = I.held + held.size() < I.heldout_target && (I.held + held.size()) * I.opt.fit_tokens <= (I.fit + fit.size()) * I.heldout_target;
    std::vector<uint32_t>& into = hold ? held : fit;
    for (size_t t = r0; t < r0 + R; t += stride) into.push_back(uint32_t(t));
  }
  I.new_tokens += fresh;
  uint64_t rows = 0;
  if (!fit.empty()) {
    rows += I.fitter.add(pick(c, fit));
    I.fit = I.fitter.fit_tokens();
  }
  if (!held.empty()) {
    rows += I.fitter.add_heldout(pick(c, held));
    I.held = I.fitter.heldout_tokens();
  }
  return rows;
}

uint64_t OnlineCalibrator::seen_tokens() const {
  return impl_->seen_tokens;
}
uint64_t OnlineCalibrator::new_tokens() const {
  return impl_->new_tokens;
}
uint64_t OnlineCalibrator::fit_tokens() const {
  return impl_->fit;
}
uint64_t OnlineCalibrator::heldout_tokens() const {
  return impl_->held;
}
uint64_t OnlineCalibrator::fit_target() const {
  return impl_->opt.fit_tokens;
}
uint64_t OnlineCalibrator::heldout_target() const {
  return impl_->heldout_target;
}
bool OnlineCalibrator::enough() const {
  return impl_->fit >= impl_->opt.fit_tokens && impl_->held >= impl_->heldout_target;
}

Calibration OnlineCalibrator::finish(const ProgressFn& progress) {
  Calibration c = impl_->fitter.finish(progress);
  c.meta["source"] = "served prompts (kvtc-server --kvtc-calib auto): " + std::to_string(impl_->seen_tokens) + " tokens seen, " +
                     std::to_string(impl_->new_tokens) + " past prefixes seen before, in runs of " + std::to_string(impl_->opt.run_tokens);
  return c;
}

}  // namespace kvtc
