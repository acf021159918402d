// The .kvtc encoder (CPU): compress, compress_bound, append, compress_state.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>

#include "codec/features.h"
#include "codec/project.h"
#include "core/capture_io.h"
#include "core/parallel.h"
#include "core/timing.h"
#include "format/chunk.h"
#include "format/container.h"
#include "format/ecsq.h"
#include "format/plan.h"
#include "format/raw8.h"
#include "kvtc/codec.h"

namespace kvtc {

namespace {

using namespace container;

std::vector<uint8_t> i32_bytes(const int32_t* p, size_t n) {
  std::vector<uint8_t> b(n * 4);
  std::memcpy(b.data(), p, b.size());
  return b;
}

// f16 values of tokens [t0, t1), laid out [layer][head][token][dim].
std::vector<uint8_t> raw_bytes(const KvBlock& kb, int kv, uint32_t t0, uint32_t t1) {
  const std::vector<uint16_t>& src = kv == 0 ? kb.k : kb.v;
  std::vector<uint8_t> raw;
  raw.reserve(size_t(t1 - t0) * kb.features() * 2);
  for (uint32_t l = 0; l < kb.n_layer(); ++l)
    for (uint32_t h = 0; h < kb.n_head_kv; ++h) {
      const auto* p = reinterpret_cast<const uint8_t*>(&src[kb.index(l, h, t0, 0)]);
      raw.insert(raw.end(), p, p + size_t(t1 - t0) * kb.head_dim * 2);
    }
  return raw;
}

// Projects, quantizes and packs tokens [t0, t1) of one block and kind.
std::vector<uint8_t> encode_chunk(const KvBlock& kb, int kv, const detail::Projector& P, const Allocation& A, const Rope* rope, uint32_t t0,
                                  uint32_t t1, detail::StageClock* clk) {
  using detail::StageTimer;
  const uint32_t n = t1 - t0, ru = P.ru();
  std::vector<float> feat(size_t(n) * kb.features()), d(size_t(n) * std::max(ru, 1u));
  {
    StageTimer st(clk, detail::kGather);
    gather_features(kb, KvKind(kv), rope, t0, t1, feat.data());
  }
  P.encode(feat.data(), n, d.data(), clk);  // D = (X - mu) B[:ru]'
  StageTimer st(clk, detail::kQuant);
  return pack_chunk(d.data(), n, ru, A.blocks);
}

// ---- the entropy-coded mode's rate control (docs/format.md, version 2)

// Bits per sample of round(N(0, s^2)), s in quantizer steps, interpolated in
// log2(s) from a table made once (the spectrum's rate model).
double gauss_round_bits(double s) {
  constexpr int kLo = -12 * 16, kHi = 8 * 16;  // s = 2^-12 .. 2^8 in 1/16 octaves
  static const std::vector<double> tab = [] {
    std::vector<double> t;
    for (int i = kLo; i <= kHi; ++i) {
      const double sd = std::exp2(i / 16.0);
      double h = 0;
      const int K = int(std::ceil(sd * 9)) + 2;
      for (int k = -K; k <= K; ++k) {
        const double p = 0.5 * (std::erf((k + 0.5) / (sd * M_SQRT2)) - std::erf((k - 0.5) / (sd * M_SQRT2)));
        if (p > 0) h -= p * std::log2(p);
      }
      t.push_back(h);
    }
    return t;
  }();
  if (s <= 0) return 0;
  const double x = std::log2(s) * 16 - kLo;
  if (x <= 0) return tab.front() * (s / std::exp2(kLo / 16.0));
  if (x >= kHi - kLo) return tab.back() + std::log2(s) - kHi / 16.0;
  const size_t i = size_t(x);
  return tab[i] + (x - double(i)) * (tab[i + 1] - tab[i]);
}

// The step at which a Gaussian model of the spectrum spends `bits` per token.
double model_step(const std::vector<float>& var, double bits) {
  auto rate = [&](double step) {
    double r = 0;
    for (float v : var) r += gauss_round_bits(std::sqrt(std::max(0.0, double(v))) / step);
    return r;
  };
  double sd = 0;
  for (float v : var) sd = std::max(sd, std::sqrt(std::max(0.0, double(v))));
  double lo = std::log2(std::max(sd, 1e-30)) - 40, hi = std::log2(std::max(sd, 1e-30)) + 4;
  for (int it = 0; it < 50; ++it) {
    const double mid = 0.5 * (lo + hi);
    (rate(std::exp2(mid)) > bits ? lo : hi) = mid;
  }
  return std::exp2(hi);
}

// Coefficients of the entropy-coded chunks, projected once before the
// header is written (rate control and the trimmed r_used need them), and
// the step of every entropy-coded (block, kind).
struct EcsqPrep {
  AllocationSet alloc;                                      // final: ecsq blocks trimmed to their last nonzero component
  std::vector<std::vector<float>> coeffs;                   // per plan index: [ld][n], component-major (entropy-coded chunks only)
  std::vector<std::vector<uint8_t>> ids;                    // per plan index: table ids rate control chose at the final step (or empty)
  std::vector<std::array<uint32_t, 2>> ld;                  // projected components per (block, kind)
  std::vector<std::array<container::EcsqParams, 2>> param;  // per (block, kind)
  uint32_t groups = 1;                                      // most runs of layers a projection multiplied apart
};

// `steps` (append): per (block, kind) the container's step, 0 where none;
// trim: shrink r_used to the last component with a nonzero code (a new
// container; append keeps the header's). layout: the container version's.
EcsqPrep prepare_ecsq(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                      const std::vector<SectionPlan>& plan, const std::vector<std::array<float, 2>>& steps, bool trim, Precision prec,
                      container::EcsqLayout layout, detail::StageClock* ck) {
  EcsqPrep E;
  E.alloc = alloc;
  E.coeffs.resize(plan.size());
  E.ids.resize(plan.size());
  E.ld.assign(c.blocks.size(), {0, 0});
  E.param.resize(c.blocks.size());
  std::vector<size_t> jobs;
  for (size_t i = 0; i < plan.size(); ++i)
    if (plan[i].kind == kChunk && is_ecsq(alloc[plan[i].block][plan[i].kv])) jobs.push_back(i);
  bool any = false;
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv)
      if (is_ecsq(alloc[b][kv])) {
        any = true;
        E.param[b][kv].rounding = float(opt.ecsq_rounding);
        E.param[b][kv].layout = layout;
      }
  if (!any) return E;
  require(opt.ecsq_rounding >= 0 && opt.ecsq_rounding <= 0.5, "compress: ecsq_rounding must be in [0, 0.5]");
  require(opt.ecsq_step >= 0 && std::isfinite(opt.ecsq_step), "compress: ecsq_step must be 0 (rate control) or a positive step");
  require(opt.ecsq_min_sd >= 0 && std::isfinite(opt.ecsq_min_sd), "compress: ecsq_min_sd must be >= 0");
  // Components kept at a step: those whose calibration standard deviation
  // is at least ecsq_min_sd x step (the spectrum falls, so a prefix).
  auto kept = [&](const Transform& t, double step, uint32_t cap) {
    uint32_t n = 0;
    for (uint32_t j = 0; j < std::min(cap, t.r); ++j)
      if (std::sqrt(std::max(0.0, double(t.variance[j]))) >= opt.ecsq_min_sd * step) n = j + 1;
    return std::max(n, 1u);
  };
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      if (!is_ecsq(alloc[b][kv])) continue;
      const Transform& t = cal.blocks[b][kv];
      const uint32_t cap = alloc[b][kv].blocks[0].size;
      const float fixed = b < steps.size() && steps[b][kv] > 0 ? steps[b][kv] : float(opt.ecsq_step);
      // Projected components: with rate control, those kept at half the
      // step the spectrum's Gaussian model predicts (the cache may need a
      // finer step than the calibration's held-out tokens).
      E.ld[b][kv] = !trim       ? cap
                    : fixed > 0 ? kept(t, fixed, cap)
                                : kept(t, 0.5 * model_step(t.variance, std::floor(double(t.p) * 16 / alloc[b][kv].nominal_ratio)), cap);
      // A multiple of 64 rows: oneDNN's bf16 GEMM for [ld x p] x [p x 256]
      // took 230-270 thread-ms on SmolLM2 at 22-23.5x with ld a multiple of
      // 64, and 350-450 (ld 1887-1922) or 725-770 (1936, 1952: multiples
      // of 16) otherwise; the extra rows cost ~2%.
      if (trim) E.ld[b][kv] = std::min(cap, (E.ld[b][kv] + 63) / 64 * 64);
    }
  std::vector<std::array<std::unique_ptr<detail::Projector>, 2>> proj(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv)
      if (E.ld[b][kv]) {
        proj[b][kv] = std::make_unique<detail::Projector>(cal.blocks[b][kv], E.ld[b][kv], prec, detail::transform_key(cal, b, kv));
        E.groups = std::max<uint32_t>(E.groups, uint32_t(proj[b][kv]->groups()));
      }
  const int threads = detail::resolve_threads(opt.threads, jobs.size());
  detail::parallel_for(jobs.size(), threads, [&](size_t k) {
    const SectionPlan& s = plan[jobs[k]];
    const KvBlock& kb = c.blocks[s.block];
    const uint32_t n = s.t1 - s.t0, ld = E.ld[s.block][s.kv];
    std::vector<float> feat(size_t(n) * kb.features());
    std::vector<float>& d = E.coeffs[jobs[k]];
    d.resize(size_t(n) * ld);
    {
      detail::StageTimer st(ck, detail::kGather);
      gather_features(kb, KvKind(s.kv), s.kv == 0 && cal.keys_derope ? &kb.rope : nullptr, s.t0, s.t1, feat.data());
    }
    proj[s.block][s.kv]->encode(feat.data(), n, d.data(), ck, true);
  });
  detail::StageTimer st(ck, detail::kQuant);
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (uint32_t kv = 0; kv < 2; ++kv) {
      const uint32_t ld = E.ld[b][kv];
      if (!ld) continue;
      std::vector<size_t> mine;
      for (size_t i : jobs)
        if (plan[i].block == b && plan[i].kv == kv) mine.push_back(i);
      container::EcsqParams& p = E.param[b][kv];
      const Transform& tr = cal.blocks[b][kv];
      // Payload bytes of every chunk at a step (on the components kept at
      // it), and the last nonzero component.
      // stride > 1: from every stride-th token only, scaled (the search's
      // first steps; ~1% off, which the last full steps correct).
      // ids (exact estimates only): each chunk's table ids, which the
      // encoder then takes instead of choosing them again.
      auto measure = [&](float step, uint32_t* last, uint32_t stride = 1, bool quick = false, std::vector<std::vector<uint8_t>>* ids = nullptr) {
        container::EcsqParams q = p;
        q.step = step;
        const uint32_t ru = trim ? kept(tr, step, ld) : ld;
        std::vector<double> bytes(mine.size());
        std::vector<uint32_t> lasts(mine.size(), 0);
        if (ids) ids->assign(mine.size(), std::vector<uint8_t>(ru));
        detail::parallel_for(mine.size(), detail::resolve_threads(opt.threads, mine.size()), [&](size_t k) {
          const SectionPlan& s = plan[mine[k]];
          const uint32_t n = s.t1 - s.t0, m = std::max(1u, n / stride);
          const double fixed = double(container::ecsq_fixed_bytes(ru, q.layout));
          const double est =
              container::ecsq_estimate_bytes(E.coeffs[mine[k]].data(), n, ru, q, stride, &lasts[k], quick, ids ? (*ids)[k].data() : nullptr);
          bytes[k] = fixed + (est - fixed) * double(n) / double(m);
        });
        if (last) *last = lasts.empty() ? 0 : *std::max_element(lasts.begin(), lasts.end());
        double sum = 0;
        for (double x : bytes) sum += x;
        return sum;
      };
      uint32_t picked_last = 0;                      // rate control's last nonzero component at the step it picks
      std::vector<std::vector<uint8_t>> picked_ids;  // and its table ids per chunk
      if (b < steps.size() && steps[b][kv] > 0) {
        p.step = steps[b][kv];
      } else if (opt.ecsq_step > 0) {
        p.step = float(opt.ecsq_step);
      } else if (!mine.empty()) {
        // Rate control: the step whose payloads meet the ratio's bytes (f16
        // bytes of the coded tokens / ratio, less the section headers);
        // bytes fall as the step grows.
        const double ratio = alloc[b][kv].nominal_ratio;
        require(ratio >= 1, "compress: an entropy-coded allocation needs a nominal ratio >= 1 (ecsq_allocation_set) or ecsq_step");
        // The cache's own spectrum (per-component mean square of its
        // coefficients) for the search's first guess: the calibration's is
        // not the cache's (its guess was 0.5-0.8 octave off, and by more or
        // less per model and ratio), which cost ~2 more estimates.
        double target = 0, maxabs = 0;
        uint64_t tokens = 0;
        std::vector<double> ms(ld, 0.0);
        // Each chunk's sums (a component's over its tokens in order) and
        // largest |coefficient| in parallel, then added in chunk order (the
        // same doubles as one loop; on one thread it took ~130 ms of the
        // 1.2 s encode of SmolLM2's 8K cache at 16x).
        std::vector<std::vector<double>> part(mine.size());
        std::vector<float> part_max(mine.size(), 0.0f);
        detail::parallel_for(mine.size(), detail::resolve_threads(opt.threads, mine.size()), [&](size_t k) {
          const uint32_t n = plan[mine[k]].t1 - plan[mine[k]].t0;
          const float* d = E.coeffs[mine[k]].data();
          part[k].assign(ld, 0.0);
          float mx = 0;
          for (uint32_t j = 0; j < ld; ++j) {
            double a = 0;
            for (uint32_t t = 0; t < n; ++t) {
              const float v = d[size_t(j) * n + t];
              a += double(v) * v;
              mx = std::max(mx, std::fabs(v));
            }
            part[k][j] = a;
          }
          part_max[k] = mx;
        });
        for (size_t k = 0; k < mine.size(); ++k) {
          const uint32_t n = plan[mine[k]].t1 - plan[mine[k]].t0;
          target += double(n) * c.blocks[b].features() * 2 / ratio - double(kSectionHeaderBytes);
          for (uint32_t j = 0; j < ld; ++j) ms[j] += part[k][j];
          maxabs = std::max(maxabs, double(part_max[k]));
          tokens += n;
        }
        std::vector<float> own(ld);
        for (uint32_t j = 0; j < ld; ++j) own[j] = float(ms[j] / double(std::max<uint64_t>(tokens, 1)));
        const double own_bits =
            (target - double(mine.size()) * double(container::ecsq_fixed_bytes(ld, p.layout))) * 8 / double(std::max<uint64_t>(tokens, 1));
        // Secant steps on log bytes against log2 step (nearly straight:
        // -0.8 to -1.0 per octave measured at 8-128x), first on every 4th
        // token with the quick table choice, from a guess by the cache's own
        // spectrum, then on all tokens, exact: 1-3 quick and 1-2 exact
        // estimates, the payloads within [-0.6%, +0.2%] of the target (a
        // bisection from the calibration spectrum's step took ~17, ~45% of
        // the encoder's time on Qwen2.5 at 24x; bench/results/entropy.md).
        const double rms = std::sqrt(std::accumulate(ms.begin(), ms.end(), 0.0) / double(std::max<uint64_t>(tokens * ld, 1)));
        const double guess = own_bits > 0 ? model_step(own, own_bits) : model_step(tr.variance, std::floor(double(tr.p) * 16 / ratio));
        const double lt = std::log(std::max(target, 1.0));
        // No step finer than max |d| / 2^20: codes stay far from the 2^24
        // clamp, and quantization noise far under any error that matters. A
        // target more bytes than that spends (few components for the ratio:
        // a 64-component calibration at 16x needs ~90 bits per code) is not
        // met: the file is smaller, its error the dropped components'. (The
        // search once went on to clamped codes there: error 0.40 for the
        // DP's 0.15.)
        const double xmin = maxabs > 0 ? std::log2(maxabs) - 20 : -1e300;
        // A point of the search: log2 step, log(bytes / target) and (exact
        // only) one past the last nonzero component there.
        struct Pt {
          double x, f;
          uint32_t last = 0;
          std::vector<std::vector<uint8_t>> ids;
        };
        // The quick estimate reads 0.5-2% under the exact one: it is aimed
        // at -1%, so that the first exact estimate lands near the target.
        auto at = [&](double x, bool exact) {
          Pt q{x, 0, 0, {}};
          q.f = std::log(measure(float(std::exp2(x)), &q.last, exact ? 1 : 4, !exact, exact ? &q.ids : nullptr)) - lt + (exact ? 0.0 : 0.01);
          return q;
        };
        // Secant steps from the last point of `pts` until its error is in
        // [lo, hi], aiming at `aim`: the slope of the last two points where
        // they give a falling one, else -0.9; moves clamped to `clamp`
        // octaves.
        auto secant = [&](std::vector<Pt>& pts, bool exact, double lo, double hi, double aim, int iters, double clamp) {
          double sl = -0.9;
          for (int it = 0; it < iters && (pts.back().f > hi || pts.back().f < lo); ++it) {
            const Pt& v = pts.back();  // (the push below is the last use)
            if (pts.size() >= 2) {
              const Pt& u = pts[pts.size() - 2];
              if (v.x != u.x && (v.f - u.f) / (v.x - u.x) < -1e-3) sl = (v.f - u.f) / (v.x - u.x);
            }
            const double x = std::max(xmin, std::clamp(v.x - (v.f - aim) / sl, v.x - clamp, v.x + clamp));
            if (x == v.x) break;  // at the finest step and still under the target
            pts.push_back(at(x, exact));
          }
        };
        // The Gaussian model with rounding puts the step 0.47-0.69 octave
        // too coarse on both models at 16-64x (the codes are heavier-tailed
        // than Gaussian, the zero bin wider): started 0.55 finer.
        const double x0 = std::max(xmin, std::log2(std::isfinite(guess) && guess > 0 ? guess : std::max(rms, 1e-20)) - 0.55);
        std::vector<Pt> quick{at(x0, false)};
        secant(quick, false, -0.006, 0.006, 0, 6, 2);
        std::vector<Pt> seen{at(quick.back().x, true)};
        secant(seen, true, -0.006, 0.002, -0.002, 4, 1);
        // Never over the target where the search can tell: the finest step
        // within it (0.2%), else the coarsest seen.
        Pt* pick = nullptr;
        for (Pt& q : seen)
          if (q.f <= 0.002 && (!pick || q.x < pick->x)) pick = &q;
        if (!pick)
          for (Pt& q : seen)
            if (!pick || q.x > pick->x) pick = &q;
        p.step = float(std::exp2(pick->x));
        picked_last = pick->last;
        picked_ids = std::move(pick->ids);
      } else {
        p.step = 1;  // no coded tokens: nothing uses it
      }
      if (trim) {
        uint32_t last = picked_last;
        if (!mine.empty() && !picked_last) measure(p.step, &last);
        E.alloc[b][kv].blocks = {{0, std::max(last, 1u), QType::kNone}};  // still Coding::kEntropy
        if (!picked_ids.empty())
          for (size_t k = 0; k < mine.size(); ++k) E.ids[mine[k]] = std::move(picked_ids[k]);
      }
    }
  return E;
}

// The sections of `plan` (plan_sections(c, opt, n0, c0)), each made
// independently (in parallel), then appended in plan order, so the bytes do
// not depend on the thread count. Entropy-coded chunks come from `ecsq`'s
// coefficients.
void write_body(std::vector<uint8_t>& out, const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                const std::vector<SectionPlan>& plan, const EcsqPrep& ecsq, detail::StageClock* ck, Precision prec,
                std::chrono::steady_clock::time_point t_start) {
  detail::StageClock& clk = *ck;
  if (!opt.stats) ck = nullptr;
  // Keys are de-RoPEd unless the calibration was fitted on them as stored
  // (the no-RoPE-removal ablation); the basis is rounded for bf16 once per
  // calibration (Projector: ~5 ms per transform).
  std::vector<std::array<std::unique_ptr<detail::Projector>, 2>> proj(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv)
      if (!is_ecsq(alloc[b][kv]))
        proj[b][kv] = std::make_unique<detail::Projector>(cal.blocks[b][kv], r_used(alloc[b][kv].blocks), prec, detail::transform_key(cal, b, kv));
  std::vector<std::vector<uint8_t>> made(plan.size());
  const int threads = detail::resolve_threads(opt.threads, plan.size());
  bool any_ecsq = false, any_dp = false;
  detail::parallel_for(plan.size(), threads, [&](size_t i) {
    const SectionPlan& s = plan[i];
    const KvBlock& kb = c.blocks[s.block];
    std::vector<uint8_t> pl;
    int level = opt.deflate_level;
    switch (s.kind) {
      case kPositions: pl = i32_bytes(kb.pos.data() + s.t0, s.t1 - s.t0); break;
      case kTokens: pl = i32_bytes(c.tokens.data() + s.t0, s.t1 - s.t0); break;
      case kRaw: pl = raw_bytes(kb, int(s.kv), s.t0, s.t1); break;
      case kRaw8: pl = container::raw8_encode(kb, s.kv, s.t0, s.t1); break;
      default: {
        if (is_ecsq(alloc[s.block][s.kv])) {
          detail::StageTimer st(ck, detail::kEntropy);
          pl = container::ecsq_encode_chunk(ecsq.coeffs[i].data(), s.t1 - s.t0, r_used(alloc[s.block][s.kv].blocks), ecsq.param[s.block][s.kv],
                                            ecsq.ids[i].empty() ? nullptr : ecsq.ids[i].data());
          level = 0;  // rANS output: DEFLATE finds nothing
          break;
        }
        const Rope* rope = s.kv == 0 && cal.keys_derope ? &kb.rope : nullptr;
        pl = encode_chunk(kb, int(s.kv), *proj[s.block][s.kv], alloc[s.block][s.kv], rope, s.t0, s.t1, ck);
      }
    }
    detail::StageTimer st(ck, detail::kEntropy);
    write_section(made[i], s.kind, s.block, s.kv, s.t0, s.t1, pl, level);
  });
  for (const SectionPlan& s : plan)
    if (s.kind == kChunk) (is_ecsq(alloc[s.block][s.kv]) ? any_ecsq : any_dp) = true;
  size_t total = out.size();
  for (const auto& m : made) total += m.size();
  out.reserve(total);
  for (const auto& m : made) out.insert(out.end(), m.begin(), m.end());
  if (opt.stats) {
    clk.export_to(opt.stats, threads);
    opt.stats->projection = prec;
    opt.stats->projection_groups = ecsq.groups;
    for (const auto& pk : proj)
      for (const auto& P : pk)
        if (P) opt.stats->projection_groups = std::max<uint32_t>(opt.stats->projection_groups, uint32_t(P->groups()));
    const std::string dp = opt.deflate_level > 0 ? "libdeflate" : "stored";
    opt.stats->entropy_backend = any_ecsq && any_dp ? dp + "+rans" : any_ecsq ? "rans" : dp;
    opt.stats->transfer_ms = opt.stats->host_ms = 0;
    opt.stats->total_ms = ms_since(t_start);
  }
}

}  // namespace

uint64_t compress_bound(const KvCapture& c, const AllocationSet& alloc, const CompressOptions& opt) {
  require(alloc.size() == c.blocks.size(), "compress: the allocation has " + std::to_string(alloc.size()) + " block(s), the capture " +
                                               std::to_string(c.blocks.size()) + " (calibration of another model?)");
  uint64_t n = kFileHeaderBytes + kMaxHeaderBytes;  // the JSON header is bounded by the format's limit
  for (const SectionPlan& s : plan_sections(c, opt, 0, 0)) {
    const KvBlock& kb = c.blocks[s.block];
    const uint32_t t = s.t1 - s.t0;
    const uint64_t payload = s.kind == kChunk  ? packed_bytes(alloc[s.block][s.kv], t)
                             : s.kind == kRaw  ? uint64_t(t) * kb.features() * 2
                             : s.kind == kRaw8 ? container::raw8_bytes(kb, s.kv, t)
                                               : uint64_t(t) * 4;
    n += section_bound(payload);
  }
  return n;
}

std::vector<uint8_t> compress(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  check_compress_inputs(c, cal, alloc, opt);
  for (size_t b = 0; b < c.blocks.size(); ++b)
    require(c.blocks[b].k.size() == c.blocks[b].numel() && c.blocks[b].v.size() == c.blocks[b].numel(),
            "compress: block " + std::to_string(b) + " K/V size differs from its shape");
  const auto t_start = std::chrono::steady_clock::now();
  detail::StageClock clk;
  // kInt8 is a decode mode: the encoder runs as kAuto would.
  const Precision prec = detail::float_precision(detail::resolve_precision(opt.precision, "compress"));
  const std::vector<SectionPlan> plan = plan_sections(c, opt, 0, 0);
  const EcsqPrep E =
      prepare_ecsq(c, cal, alloc, opt, plan, {}, true, prec, container::ecsq_layout(container_version(alloc, opt)), opt.stats ? &clk : nullptr);
  const std::string hs = header_json(c, cal, E.alloc, opt);
  std::vector<uint8_t> out;
  out.reserve(size_t(std::min<uint64_t>(compress_bound(c, E.alloc, opt), uint64_t(1) << 32)));
  write_file_header(out, hs, container_version(E.alloc, opt));
  write_body(out, c, cal, E.alloc, opt, plan, E, &clk, prec, t_start);
  return out;
}

AppendResult append(std::span<const uint8_t> container, const KvCapture& c, const Calibration& cal, const std::string& origin,
                    const CompressOptions& run) {
  const Parsed P = parse(container, origin, run.threads);
  const ContainerHeader H = read_header(P, origin);
  require(H.calibration_id == cal.id, origin + ": written with another calibration (wrong calibration file)");
  require(H.geometry.blocks.size() == 1 && c.blocks.size() == 1,
          origin + ": appending is supported for single-cache models only (an iSWA model's window block does not grow by appending)");
  CompressOptions opt = run;
  opt.sink = H.sink;
  opt.window = H.window;
  opt.chunk_tokens = H.chunk_tokens;
  opt.deflate_level = H.deflate_level;
  opt.window_bits = H.window_bits;  // the new window as the old one
  const AllocationSet& alloc = H.alloc;
  check_compress_inputs(c, cal, alloc, opt);
  require(H.has_tokens == !c.tokens.empty(), origin + ": the capture must carry token ids exactly when the container does");
  const BlockGeometry& hg = H.geometry.blocks[0];
  require(c.blocks[0].layers == hg.layers && c.blocks[0].n_head_kv == hg.n_head_kv && c.blocks[0].head_dim == hg.head_dim &&
              c.model_sha256 == H.geometry.model_sha256,
          "append: the capture's model or geometry differs from the container's");
  const uint32_t n_old = H.n_tokens[0];
  std::vector<int32_t> old_pos(n_old);
  for (const Section& s : P.sections)
    if (s.kind == kPositions) {
      std::vector<uint8_t> pl = payload(s, origin);
      require(pl.size() == size_t(s.t1 - s.t0) * 4, origin + ": bad positions section");
      std::memcpy(old_pos.data() + s.t0, pl.data(), pl.size());
    }
  const KvBlock& kb = c.blocks[0];
  const uint32_t n_new = kb.n_tokens();
  require(n_new > n_old && (n_new - n_old) % 16 == 0, "append: the capture must add a positive multiple of 16 tokens (the container holds " +
                                                          std::to_string(n_old) + ", the capture " + std::to_string(n_new) + ")");
  require(n_old >= opt.sink, "append: the container is shorter than its sink; compress the whole capture instead");
  require(std::equal(old_pos.begin(), old_pos.end(), kb.pos.begin()),
          "append: the capture's first " + std::to_string(n_old) + " positions differ from the container's");
  require(kb.k.size() == kb.numel() && kb.v.size() == kb.numel(), "append: the capture's K/V size differs from its shape");
  // The old window sections are the file's tail: everything before them stays.
  const TokenLayout Lo = token_layout(n_old, opt.sink, opt.window);
  size_t tail = container.size();
  if (Lo.w_begin < n_old) {
    require(P.sections.size() >= 2, origin + ": no window sections at the end");
    for (size_t i = P.sections.size() - 2; i < P.sections.size(); ++i) {
      const Section& s = P.sections[i];
      require(is_raw(s.kind) && s.t0 == Lo.w_begin && s.t1 == n_old, origin + ": the last sections are not the raw window (not appendable)");
    }
    tail = size_t(P.sections[P.sections.size() - 2].data - container.data()) - kSectionHeaderBytes;
  }
  // Entropy-coded kinds keep the container's step (its last chunk's), so
  // the new tokens are coded at the same distortion.
  std::vector<std::array<float, 2>> steps(1, {0.0f, 0.0f});
  for (const Section& s : P.sections)
    if (s.kind == kChunk && is_ecsq(alloc[0][s.kv])) {
      const std::vector<uint8_t> pl = payload(s, origin);
      steps[0][s.kv] = container::ecsq_chunk_step(pl.data(), pl.size(), origin + ": chunk section");
    }
  const auto t_start = std::chrono::steady_clock::now();
  detail::StageClock clk;
  const Precision prec = detail::float_precision(detail::resolve_precision(opt.precision, "append"));
  const std::vector<SectionPlan> plan = plan_sections(c, opt, n_old, Lo.w_begin);
  const EcsqPrep E = prepare_ecsq(c, cal, alloc, opt, plan, steps, false, prec, container::ecsq_layout(H.version), opt.stats ? &clk : nullptr);
  AppendResult r;
  r.kept_bytes = tail;
  r.bytes.assign(container.begin(), container.begin() + tail);
  write_body(r.bytes, c, cal, alloc, opt, plan, E, &clk, prec, t_start);
  return r;
}

std::vector<uint8_t> compress_state(std::span<const uint8_t> blob, const CacheGeometry& g, const Calibration& cal, const AllocationSet& alloc,
                                    const CompressOptions& opt, std::span<const int32_t> tokens) {
  KvCapture c = capture_from_any_state(blob, g, "compress_state");
  c.tokens.assign(tokens.begin(), tokens.end());
  return compress(c, cal, alloc, opt);
}

}  // namespace kvtc

namespace kvtc {

AllocationSet ecsq_allocation_set(const Calibration& cal, double ratio) {
  require(ratio >= 1 && ratio <= 4096, "ecsq_allocation_set: ratio must be in [1, 4096], got " + std::to_string(ratio));
  AllocationSet out(cal.blocks.size());
  for (size_t b = 0; b < cal.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      require(t.variance.size() == t.r && t.r >= 1, "ecsq_allocation_set: the calibration has no spectrum for block " + std::to_string(b));
      Allocation& a = out[b][kv];
      a.nominal_ratio = ratio;
      a.budget_bits = uint64_t(std::floor(double(t.p) * 16 / ratio));
      // Every component: compress keeps those that matter at the step it
      // finds (CompressOptions::ecsq_min_sd). The error is the Gaussian
      // model's (reverse water-filling: min(variance, step^2 / 12) each).
      const double step = model_step(t.variance, double(a.budget_bits));
      double err = 0;
      for (uint32_t j = 0; j < t.r; ++j) err += std::min(std::max(0.0, double(t.variance[j])), step * step / 12);
      a.error = err;
      a.bits = a.budget_bits;
      a.coding = Coding::kEntropy;
      a.blocks = {{0, t.r, QType::kNone}};  // the type is unused
    }
  return out;
}

}  // namespace kvtc
