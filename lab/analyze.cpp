// kvtc-lab analyze: the paper's evidence on our model, as one JSON file
// with every number (analyze.json) and a markdown summary; bench/plots.py
// draws the figures from the JSON with matplotlib.
//
//   procrustes  Figure 3: cosine similarity of every pair of (layer, KV
//               head) before and after orthogonal Procrustes alignment, for
//               keys (RoPE removed) and values
//   calib-size  Figure 6-like: reconstruction error at the nominal ratio
//               against the number of calibration tokens (one calibration
//               file per point)
//   position    error per token-position bucket on long captures
//   bits        per-component bit counts of the calibration's table
//   domain      calibrations of one corpus kind applied to evaluation
//               captures of each kind (kinds x kinds matrix)
//
// Evaluation captures are prefilled once per run from evaluation-split
// documents (a seeded random window of each, BOS first, as `kvtc eval`
// picks them) and kept in memory; every calibration is applied to the same
// captures. Errors are ||x - x'||^2 / ||x||^2 over the coded tokens (sink
// and window are stored raw), pooled over captures, keys as stored.
#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "kvtc/corpus.h"
#include "kvtc/internal/lab_support.h"
#include "kvtc/kvtc.h"
#include "kvtc/llama.h"
#include "lab.h"

namespace kvtc::lab {

namespace {

const std::vector<std::string> kKinds{"prose", "docs", "code", "math"};
const std::vector<std::string> kAnalyses{"procrustes", "calib-size", "position", "bits", "domain"};

struct AnalyzeArgs {
  std::string model, corpus;
  std::string calib = ".deps/calib/smollm2-160k.safetensors";
  std::vector<std::string> calib_sizes;    // files, one point each
  std::vector<std::string> domain_calibs;  // "kind=path" (row name = kind)
  std::vector<std::string> what = kAnalyses;
  std::string out_dir = "bench/results/analyze", out_md;
  uint32_t context = 2048, samples = 2;
  uint32_t position_context = 4096, position_samples = 1, bucket = 128;
  uint32_t procrustes_tokens = 8192;
  double ratio = 16;
  uint64_t seed = 1;
  bool json = false;
};

struct Cap {
  std::string doc, kind;
  uint32_t offset = 0;
  KvCapture c;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return ms_since(t0) / 1000.0;
}

void log(std::chrono::steady_clock::time_point t0, const char* fmt, const std::string& a = "") {
  std::fprintf(stderr, "[analyze %6.1f s] ", seconds_since(t0));
  std::fprintf(stderr, fmt, a.c_str());
  std::fprintf(stderr, "\n");
}

// Round to 6 significant digits for the JSON (matrices stay readable).
double r6(double x) {
  if (!std::isfinite(x) || x == 0) return x;
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", x);
  return std::strtod(b, nullptr);
}

// JSON with one line per array of plain values (a matrix: one row a line).
void pretty(const nlohmann::ordered_json& j, std::string& o, int ind) {
  const std::string pad(size_t(ind) + 1, ' ');
  if (j.is_object() && !j.empty()) {
    o += "{\n";
    size_t i = 0;
    for (auto it = j.begin(); it != j.end(); ++it, ++i) {
      o += pad + nlohmann::json(it.key()).dump() + ": ";
      pretty(it.value(), o, ind + 1);
      o += i + 1 < j.size() ? ",\n" : "\n";
    }
    o += std::string(size_t(ind), ' ') + "}";
  } else if (j.is_array() && std::any_of(j.begin(), j.end(), [](const auto& e) { return e.is_structured(); })) {
    o += "[\n";
    for (size_t i = 0; i < j.size(); ++i) {
      o += pad;
      pretty(j[i], o, ind + 1);
      o += i + 1 < j.size() ? ",\n" : "\n";
    }
    o += std::string(size_t(ind), ' ') + "]";
  } else {
    o += j.dump();
  }
}

// ---- evaluation captures ---------------------------------------------------

// The first n tokens of a single-block capture (what prefilling only those
// tokens gives: attention is causal).
KvCapture truncate_capture(const KvCapture& c, uint32_t n) {
  require(c.blocks.size() == 1, "analyze: internal: truncating a multi-block capture");
  const KvBlock& b = c.blocks[0];
  KvCapture o;
  o.model_sha256 = c.model_sha256;
  o.meta = c.meta;
  o.meta["n_tokens"] = std::to_string(n);
  KvBlock nb;
  static_cast<BlockGeometry&>(nb) = b.geometry();
  nb.pos.assign(b.pos.begin(), b.pos.begin() + n);
  nb.k.resize(size_t(b.n_layer()) * b.n_head_kv * n * b.head_dim);
  nb.v.resize(nb.k.size());
  for (uint32_t l = 0; l < b.n_layer(); ++l)
    for (uint32_t h = 0; h < b.n_head_kv; ++h) {
      const size_t src = b.index(l, h, 0, 0), dst = nb.index(l, h, 0, 0);
      std::copy_n(b.k.begin() + src, size_t(n) * b.head_dim, nb.k.begin() + dst);
      std::copy_n(b.v.begin() + src, size_t(n) * b.head_dim, nb.v.begin() + dst);
    }
  o.blocks.push_back(std::move(nb));
  o.tokens.assign(c.tokens.begin(), c.tokens.begin() + std::min<size_t>(n, c.tokens.size()));
  return o;
}

// Per kind, `n_ctx_caps` captures of `context` tokens and `n_pos_caps` of
// `pos_context` tokens, from the same documents where both are wanted.
// Captures are returned round-robin over kinds (first document of each
// kind, then the second, ...).
void make_captures(const AnalyzeArgs& a, Model& m, uint32_t n_ctx_caps, uint32_t n_pos_caps, std::vector<Cap>& ctx_caps, std::vector<Cap>& pos_caps,
                   std::chrono::steady_clock::time_point t0) {
  const uint32_t per_kind = std::max(n_ctx_caps, n_pos_caps);
  if (per_kind == 0) return;
  const uint32_t need = std::max(n_ctx_caps ? a.context : 0, n_pos_caps ? a.position_context : 0);
  SessionOptions so;
  so.n_ctx = need + 16;
  Session s(m, so);
  const Corpus corpus = Corpus::load(a.corpus);
  std::vector<std::vector<Cap>> by_kind_ctx(kKinds.size()), by_kind_pos(kKinds.size());
  for (size_t ki = 0; ki < kKinds.size(); ++ki) {
    const std::string& kind = kKinds[ki];
    std::vector<CorpusDoc> docs = corpus.docs("eval", {kind}, need);
    std::mt19937_64 shuffle_rng(a.seed + ki), rng(a.seed * 1000003 + ki);
    shuffle_docs(docs, shuffle_rng);
    WindowReader windows(m, std::move(docs), rng);
    uint32_t got = 0;
    while (got < per_kind) {
      const uint32_t len = std::max(got < n_ctx_caps ? a.context : 0, got < n_pos_caps ? a.position_context : 0);
      std::optional<TextWindow> win = windows.next(len);
      if (!win) break;
      const std::vector<int32_t>& w = win->tokens;
      s.clear();
      s.decode(w, 0);
      KvCapture c = s.capture();
      c.tokens = w;
      const Cap base{win->doc.id, kind, win->offset, {}};
      // The first n tokens' capture: this one cut (attention is causal), or,
      // for an iSWA cache, whose window block cannot be cut, prefilled again.
      auto first = [&](uint32_t n) {
        Cap x = base;
        if (len == n) {
          x.c = c;
        } else if (c.blocks.size() == 1) {
          x.c = truncate_capture(c, n);
        } else {
          std::vector<int32_t> w2(w.begin(), w.begin() + n);
          s.clear();
          s.decode(w2, 0);
          x.c = s.capture();
          x.c.tokens = w2;
        }
        return x;
      };
      if (got < n_ctx_caps) by_kind_ctx[ki].push_back(first(a.context));
      if (got < n_pos_caps) by_kind_pos[ki].push_back(first(a.position_context));
      ++got;
      log(t0, "prefilled %s", win->doc.id + " (" + std::to_string(len) + " tokens)");
    }
    require(got == per_kind, "analyze: only " + std::to_string(got) + " evaluation documents of kind " + kind + " hold " + std::to_string(need) +
                                 " tokens; ask for fewer samples or a shorter context");
  }
  for (uint32_t i = 0; i < per_kind; ++i)
    for (size_t ki = 0; ki < kKinds.size(); ++ki) {
      if (i < by_kind_ctx[ki].size()) ctx_caps.push_back(std::move(by_kind_ctx[ki][i]));
      if (i < by_kind_pos[ki].size()) pos_caps.push_back(std::move(by_kind_pos[ki][i]));
    }
}

// ---- reconstruction error ----------------------------------------------------

struct RoundTrip {
  ReconError err;
  uint64_t f16_bytes = 0, stored_bytes = 0;  // coded tokens only (chunk sections)
};

RoundTrip round_trip(const Cap& cap, const Calibration& cal, const AllocationSet& al, std::vector<ReconError>* per_token) {
  const CompressOptions opt{};
  std::vector<uint8_t> enc = compress(cap.c, cal, al, opt);
  KvCapture dec = decompress(enc, cal, cap.doc);
  const ContainerInfo ci = inspect(enc, cap.doc);
  RoundTrip r;
  r.err = reconstruction_error(cap.c, dec, opt.sink, opt.window, per_token);
  r.f16_bytes = ci.f16_bytes_compressed;
  r.stored_bytes = ci.stored_bytes_compressed;
  return r;
}

// ---- Procrustes head similarity ---------------------------------------------

struct HeadSim {
  uint32_t heads = 0;
  // [heads][heads]: all tokens, R fitted on the same tokens (in-sample).
  std::vector<double> before, after;
  // R fitted on the first T_fit rows, cosines on the other rows.
  std::vector<double> before_heldout, after_heldout;
};

// X: [T][p] features (p = heads * hd), rows [0, T_fit) for the held-out
// fit and [T_fit, T) for its evaluation; centred here, in place.
HeadSim head_similarity(std::vector<float>& X, uint32_t T, uint32_t T_fit, uint32_t heads, uint32_t hd) {
  const uint32_t p = heads * hd, T_eval = T - T_fit;
  require(T_fit >= 1 && T_eval >= 1, "analyze: internal: empty Procrustes split");
  std::vector<double> mu(p, 0);
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t f = 0; f < p; ++f) mu[f] += X[size_t(t) * p + f];
  for (double& m : mu) m /= T;
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t f = 0; f < p; ++f) X[size_t(t) * p + f] -= float(mu[f]);
  // Z: each head's vector of each token scaled to unit length, so that the
  // mean cosine of (x_i R, x_j) is <R, Z_i^T Z_j>_F / T (R orthogonal keeps
  // norms) and before alignment trace(Z_i^T Z_j) / T.
  std::vector<float> Z(X.size());
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t h = 0; h < heads; ++h) {
      const float* x = &X[size_t(t) * p + size_t(h) * hd];
      double n2 = 0;
      for (uint32_t d = 0; d < hd; ++d) n2 += double(x[d]) * x[d];
      const double inv = n2 > 0 ? 1 / std::sqrt(n2) : 0;
      float* z = &Z[size_t(t) * p + size_t(h) * hd];
      for (uint32_t d = 0; d < hd; ++d) z[d] = float(x[d] * inv);
    }
  // Upper triangles of X^T X and Z^T Z over the fit rows, the evaluation
  // rows and (their sum) all rows: SYRK over T rows in all.
  const size_t pp = size_t(p) * p;
  auto syrk = [&](const std::vector<float>& A, uint32_t r0, uint32_t n, float beta, std::vector<float>& G) {
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, int(p), int(n), 1.0f, A.data() + size_t(r0) * p, int(p), beta, G.data(), int(p));
  };
  std::vector<float> Gx_fit(pp), Gx_all, Gz_eval(pp), Gz_all;
  syrk(X, 0, T_fit, 0.0f, Gx_fit);
  Gx_all = Gx_fit;
  syrk(X, T_fit, T_eval, 1.0f, Gx_all);
  syrk(Z, T_fit, T_eval, 0.0f, Gz_eval);
  Gz_all = Gz_eval;
  syrk(Z, 0, T_fit, 1.0f, Gz_all);
  X.clear(), X.shrink_to_fit(), Z.clear(), Z.shrink_to_fit();

  HeadSim s;
  s.heads = heads;
  for (auto* m : {&s.before, &s.after, &s.before_heldout, &s.after_heldout}) m->assign(size_t(heads) * heads, 0);
  std::vector<double> M(size_t(hd) * hd), U(M.size()), VT(M.size()), R(M.size()), S(hd);
  // R = U V^T (U S V^T = X_i^T X_j) minimises ||X_i R - X_j||_F over
  // orthogonal R; returns <R, Z_i^T Z_j>.
  auto aligned = [&](const std::vector<float>& Gx, const std::vector<float>& Gz, uint32_t i, uint32_t j) {
    for (uint32_t a = 0; a < hd; ++a)
      for (uint32_t b = 0; b < hd; ++b) M[size_t(a) * hd + b] = Gx[size_t(i * hd + a) * p + j * hd + b];
    const int info = LAPACKE_dgesdd(LAPACK_ROW_MAJOR, 'A', int(hd), int(hd), M.data(), int(hd), S.data(), U.data(), int(hd), VT.data(), int(hd));
    require(info == 0, "analyze: SVD did not converge for heads " + std::to_string(i) + ", " + std::to_string(j));
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(hd), int(hd), int(hd), 1.0, U.data(), int(hd), VT.data(), int(hd), 0.0, R.data(),
                int(hd));
    double dot = 0;
    for (uint32_t a = 0; a < hd; ++a)
      for (uint32_t b = 0; b < hd; ++b) dot += R[size_t(a) * hd + b] * Gz[size_t(i * hd + a) * p + j * hd + b];
    return dot;
  };
  auto trace = [&](const std::vector<float>& Gz, uint32_t i, uint32_t j) {
    double tr = 0;
    for (uint32_t d = 0; d < hd; ++d) tr += Gz[size_t(i * hd + d) * p + j * hd + d];
    return tr;
  };
  auto put = [&](std::vector<double>& m, uint32_t i, uint32_t j, double v) { m[size_t(i) * heads + j] = m[size_t(j) * heads + i] = v; };
  // 64 x 64 SVDs: threads only cost synchronisation here.
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  for (uint32_t i = 0; i < heads; ++i) {
    // The diagonal: 1 unless some token's head vector is zero.
    put(s.before, i, i, trace(Gz_all, i, i) / T);
    put(s.after, i, i, trace(Gz_all, i, i) / T);
    put(s.before_heldout, i, i, trace(Gz_eval, i, i) / T_eval);
    put(s.after_heldout, i, i, trace(Gz_eval, i, i) / T_eval);
    for (uint32_t j = i + 1; j < heads; ++j) {  // (i, j) with i < j lies in the upper triangles
      put(s.before, i, j, trace(Gz_all, i, j) / T);
      put(s.after, i, j, aligned(Gx_all, Gz_all, i, j) / T);
      put(s.before_heldout, i, j, trace(Gz_eval, i, j) / T_eval);
      put(s.after_heldout, i, j, aligned(Gx_fit, Gz_eval, i, j) / T_eval);
    }
  }
  openblas_set_num_threads(blas_threads);
  return s;
}

nlohmann::ordered_json sim_summary(const HeadSim& s, uint32_t n_head_kv, bool matrices) {
  double ob = 0, oa = 0, sb = 0, sa = 0, cb = 0, ca = 0, ab = 0;
  uint64_t no = 0, ns = 0, nc = 0;
  for (uint32_t i = 0; i < s.heads; ++i)
    for (uint32_t j = 0; j < s.heads; ++j) {
      if (i == j) continue;
      const double b = s.before[size_t(i) * s.heads + j], a = s.after[size_t(i) * s.heads + j];
      ob += b, oa += a, ab += std::fabs(b), ++no;
      if (i / n_head_kv == j / n_head_kv)
        sb += b, sa += a, ++ns;
      else
        cb += b, ca += a, ++nc;
    }
  nlohmann::ordered_json j;
  j["mean_offdiag_before"] = r6(ob / no);
  j["mean_offdiag_after"] = r6(oa / no);
  j["mean_abs_offdiag_before"] = r6(ab / no);
  if (ns) {
    j["mean_same_layer_before"] = r6(sb / ns);
    j["mean_same_layer_after"] = r6(sa / ns);
  }
  j["mean_cross_layer_before"] = r6(cb / nc);
  j["mean_cross_layer_after"] = r6(ca / nc);
  double hb = 0, ha = 0;
  for (uint32_t i = 0; i < s.heads; ++i)
    for (uint32_t k = 0; k < s.heads; ++k)
      if (i != k) hb += s.before_heldout[size_t(i) * s.heads + k], ha += s.after_heldout[size_t(i) * s.heads + k];
  j["mean_offdiag_before_heldout"] = r6(hb / no);
  j["mean_offdiag_after_heldout"] = r6(ha / no);
  if (matrices) {
    auto mat = [&](const std::vector<double>& m) {
      nlohmann::json rows = nlohmann::json::array();
      for (uint32_t i = 0; i < s.heads; ++i) {
        nlohmann::json row = nlohmann::json::array();
        for (uint32_t k = 0; k < s.heads; ++k) row.push_back(std::round(m[size_t(i) * s.heads + k] * 1e3) / 1e3);
        rows.push_back(row);
      }
      return rows;
    };
    j["before"] = mat(s.before);
    j["after"] = mat(s.after);
  }
  return j;
}

std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

std::string tokens_label(double n) {
  if (n >= 1000) return fmt(std::fmod(n, 1000) == 0 ? "%.0fK" : "%.1fK", n / 1000);
  return fmt("%.0f", n);
}

// ---- the command, step by step ------------------------------------------------

using time_point = std::chrono::steady_clock::time_point;

bool wants(const AnalyzeArgs& a, const std::string& what) {
  return std::find(a.what.begin(), a.what.end(), what) != a.what.end();
}

std::string basename_of(const std::string& p) {
  return std::filesystem::path(p).filename().string();
}

// Checks the options and that every calibration file named exists, before
// minutes of prefill; returns the domain rows (name, file).
std::vector<std::pair<std::string, std::string>> check_inputs(const AnalyzeArgs& a) {
  for (const auto& w : a.what)
    require(std::find(kAnalyses.begin(), kAnalyses.end(), w) != kAnalyses.end(),
            "analyze: unknown analysis '" + w + "' (procrustes, calib-size, position, bits, domain)");
  require(a.ratio > 0, "analyze: --ratio must be positive");
  require(a.bucket > 0, "analyze: --bucket must be positive");
  std::vector<std::pair<std::string, std::string>> domain;
  if (wants(a, "calib-size")) {
    require(!a.calib_sizes.empty(), "analyze: calib-size needs --calib-sizes FILE...");
    for (const auto& f : a.calib_sizes) require(std::filesystem::exists(f), "analyze: " + f + ": no such calibration file");
  }
  if (wants(a, "domain")) {
    require(!a.domain_calibs.empty(), "analyze: domain needs --domain-calibs KIND=FILE...");
    for (const auto& d : a.domain_calibs) {
      const size_t eq = d.find('=');
      require(eq != std::string::npos && eq > 0 && eq + 1 < d.size(), "analyze: --domain-calibs wants NAME=FILE, got '" + d + "'");
      domain.push_back({d.substr(0, eq), d.substr(eq + 1)});
      require(std::filesystem::exists(domain.back().second), "analyze: " + domain.back().second + ": no such calibration file");
    }
  }
  if (wants(a, "position") || wants(a, "bits")) require(std::filesystem::exists(a.calib), "analyze: " + a.calib + ": no such calibration file");
  return domain;
}

// The result's fields before the analyses: model, settings, the captures.
nlohmann::ordered_json result_header(const AnalyzeArgs& a, const Model& model, bool need_ctx, const std::vector<Cap>& ctx_caps,
                                     const std::vector<Cap>& pos_caps) {
  nlohmann::ordered_json res;
  res["model"] = model.info().path;
  res["model_sha256"] = model.sha256();
  res["ratio"] = a.ratio;
  res["seed"] = a.seed;
  res["analyses"] = a.what;
  res["sink"] = CompressOptions{}.sink;
  res["window"] = CompressOptions{}.window;
  auto cap_list = [](const std::vector<Cap>& caps) {
    nlohmann::json l = nlohmann::json::array();
    for (const Cap& c : caps)
      l.push_back({{"document", c.doc}, {"kind", c.kind}, {"offset", c.offset}, {"tokens", c.c.blocks.empty() ? 0 : c.c.blocks[0].n_tokens()}});
    return l;
  };
  if (need_ctx) res["captures"] = {{"context", a.context}, {"samples_per_kind", a.samples}, {"documents", cap_list(ctx_caps)}};
  if (!pos_caps.empty())
    res["position_captures"] = {{"context", a.position_context}, {"samples_per_kind", a.position_samples}, {"documents", cap_list(pos_caps)}};
  return res;
}

// The head-pair similarity table.
void procrustes_markdown(const nlohmann::ordered_json& pj, std::ostream& md) {
  const uint32_t T = pj["tokens"].get<uint32_t>();
  md << "\n### Head-pair similarity (Figure 3)\n\nMean cosine similarity over all pairs of different (layer, KV head), " << T
     << " tokens, centred, before and after orthogonal Procrustes alignment (held out: R fitted on half of the tokens, measured on the other "
        "half):\n\n| | before | after | after, held out | same layer before / after | across layers before / after |\n|---|---|---|---|---|---|\n";
  for (const char* k : {"keys", "values"}) {
    const auto& s = pj[k];
    md << "| " << k << " | " << fmt("%.4f", s["mean_offdiag_before"].get<double>()) << " | " << fmt("%.4f", s["mean_offdiag_after"].get<double>())
       << " | " << fmt("%.4f", s["mean_offdiag_after_heldout"].get<double>()) << " | " << fmt("%.4f", s.value("mean_same_layer_before", 0.0)) << " / "
       << fmt("%.4f", s.value("mean_same_layer_after", 0.0)) << " | " << fmt("%.4f", s["mean_cross_layer_before"].get<double>()) << " / "
       << fmt("%.4f", s["mean_cross_layer_after"].get<double>()) << " |\n";
  }
  md << "\n![head similarity](procrustes.png)\n";
}

// 1. Procrustes (Figure 3): head-pair similarity of keys and values before
// and after alignment, in sample and held out.
nlohmann::ordered_json procrustes_analysis(const AnalyzeArgs& a, const std::vector<Cap>& ctx_caps, std::ostream& md, time_point t0) {
  const KvBlock& b0 = ctx_caps.front().c.blocks[0];
  const uint32_t heads = b0.n_layer() * b0.n_head_kv, hd = b0.head_dim, p = heads * hd;
  // An equal share of tokens from each capture, sinks left out.
  const uint32_t sink = CompressOptions{}.sink;
  const uint32_t share = (a.procrustes_tokens + uint32_t(ctx_caps.size()) - 1) / uint32_t(ctx_caps.size());
  nlohmann::ordered_json pj;
  HeadSim sims[2];
  uint32_t T = 0, T_fit = 0;
  for (int kv = 0; kv < 2; ++kv) {
    // Each capture's share [sink, sink + n): its first half goes to the
    // rows of the held-out fit, its second half to the held-out
    // evaluation; the in-sample numbers use all rows.
    std::vector<std::pair<const Cap*, std::pair<uint32_t, uint32_t>>> fit, ev;
    uint32_t total = 0;
    for (const Cap& cap : ctx_caps) {
      const KvBlock& b = cap.c.blocks[0];
      if (total >= a.procrustes_tokens || b.n_tokens() <= sink) continue;
      const uint32_t n = std::min({share, b.n_tokens() - sink, a.procrustes_tokens - total});
      fit.push_back({&cap, {sink, sink + n / 2}});
      ev.push_back({&cap, {sink + n / 2, sink + n}});
      total += n;
    }
    std::vector<float> X(size_t(total) * p);
    T = T_fit = 0;
    for (auto* part : {&fit, &ev})
      for (const auto& [cap, range] : *part) {
        const KvBlock& b = cap->c.blocks[0];
        const uint32_t n = range.second - range.first;
        if (n == 0) continue;
        const std::vector<float> rows = feature_rows(b, kv == 0, true, range.first, range.second);
        std::copy(rows.begin(), rows.end(), &X[size_t(T) * p]);
        T += n;
        if (part == &fit) T_fit += n;
      }
    require(T_fit >= 2 && T - T_fit >= 2, "analyze: procrustes needs at least 4 tokens");
    sims[kv] = head_similarity(X, T, T_fit, heads, hd);
    log(t0, "procrustes: %s done", kv == 0 ? "keys" : "values");
  }
  pj["tokens"] = T;
  pj["heldout_fit_tokens"] = T_fit;
  pj["heldout_eval_tokens"] = T - T_fit;
  pj["method"] =
      "per head, centred [T x head_dim] token matrices; before: mean over tokens of cosine(x_i, x_j); after: R = U V^T from the SVD of "
      "X_i^T X_j, mean cosine(x_i R, x_j); *_heldout: R fitted on the first half of each capture's tokens, cosines on the second half";
  pj["heads"] = heads;
  pj["n_layer"] = b0.n_layer();
  pj["n_head_kv"] = b0.n_head_kv;
  pj["head_dim"] = hd;
  pj["head_order"] = "layer-major: index = layer * n_head_kv + head";
  pj["keys"] = sim_summary(sims[0], b0.n_head_kv, true);
  pj["values"] = sim_summary(sims[1], b0.n_head_kv, true);
  pj["image"] = "procrustes.png";
  procrustes_markdown(pj, md);
  return pj;
}

// 2. Error against calibration tokens (Figure 6): each --calib-sizes file
// on the same captures, sorted by its calibration tokens.
nlohmann::ordered_json calib_size_analysis(const AnalyzeArgs& a, const std::vector<Cap>& ctx_caps, std::ostream& md, time_point t0) {
  const std::string rk = ratio_key(a.ratio);
  struct Pt {
    std::string file;
    double tokens, k, v, ratio;
    nlohmann::ordered_json j;
  };
  std::vector<Pt> pts;
  for (const std::string& f : a.calib_sizes) {
    Calibration cal = calibration_load(f);
    AllocationSet al = allocation_set(cal, a.ratio);
    ReconError e;
    uint64_t f16 = 0, st = 0;
    for (const Cap& cap : ctx_caps) {
      RoundTrip r = round_trip(cap, cal, al, nullptr);
      e.add(r.err);
      f16 += r.f16_bytes, st += r.stored_bytes;
    }
    nlohmann::ordered_json j;
    j["file"] = basename_of(f);
    j["calibration_id"] = cal.id;
    for (const char* k : {"calib_tokens", "calib_documents", "calib_n_ctx", "heldout_tokens", "calib_kinds"})
      if (cal.meta.count(k)) j[k] = cal.meta.at(k);
    j["k"] = r6(e.k);
    j["v"] = r6(e.v);
    j["coded_tokens"] = e.tokens;
    j["ratio_coded_tokens"] = r6(double(f16) / double(st));
    pts.push_back({f, std::stod(cal.meta.count("calib_tokens") ? cal.meta.at("calib_tokens") : "0"), e.k, e.v, double(f16) / double(st), j});
    log(t0, "calib-size: %s done", basename_of(f));
  }
  std::sort(pts.begin(), pts.end(), [](const Pt& x, const Pt& y) { return x.tokens < y.tokens; });
  nlohmann::ordered_json cj;
  cj["points"] = nlohmann::json::array();
  md << "\n### Error against calibration tokens (Figure 6)\n\nRelative squared error at " << rk << "x on " << ctx_caps.size()
     << " evaluation captures of " << a.context
     << " tokens:\n\n| calibration | tokens | documents (tokens each at most) | keys | values | ratio (coded tokens) "
        "|\n|---|---|---|---|---|---|\n";
  for (const Pt& pt : pts) {
    cj["points"].push_back(pt.j);
    md << "| " << basename_of(pt.file) << " | " << tokens_label(pt.tokens) << " | " << pt.j.value("calib_documents", std::string("?")) << " ("
       << pt.j.value("calib_n_ctx", std::string("?")) << ") | " << fmt("%.4f", pt.k) << " | " << fmt("%.4f", pt.v) << " | " << fmt("%.2fx", pt.ratio)
       << " |\n";
  }
  cj["image"] = "calib_size.png";
  md << "\n![error vs calibration tokens](calib_size.png)\n";
  return cj;
}

// 3. Error against token position: --calib on the long captures, pooled
// per --bucket tokens.
nlohmann::ordered_json position_analysis(const AnalyzeArgs& a, const std::vector<Cap>& pos_caps, const Calibration& cal, const AllocationSet& al,
                                         std::ostream& md, time_point t0) {
  const std::string rk = ratio_key(a.ratio);
  const uint32_t n = a.position_context, nb = (n + a.bucket - 1) / a.bucket;
  std::vector<ReconError> buckets(nb);
  ReconError total;
  for (size_t i = 0; i < pos_caps.size(); ++i) {
    std::vector<ReconError> pt;
    RoundTrip r = round_trip(pos_caps[i], cal, al, &pt);
    total.add(r.err);
    for (uint32_t t = 0; t < pt.size(); ++t) buckets[t / a.bucket].add(pt[t]);
  }
  log(t0, "position: done");
  nlohmann::ordered_json pj;
  pj["calibration"] = basename_of(a.calib);
  pj["context"] = n;
  pj["bucket"] = a.bucket;
  pj["k"] = r6(total.k);
  pj["v"] = r6(total.v);
  pj["buckets"] = nlohmann::json::array();
  double kmin = INFINITY, kmax = 0, vmin = INFINITY, vmax = 0;
  for (uint32_t i = 0; i < nb; ++i) {
    const ReconError& e = buckets[i];
    if (e.tokens == 0) continue;  // all raw (sink or window)
    const uint32_t from = i * a.bucket, to = std::min(n, from + a.bucket);
    pj["buckets"].push_back({{"from", from}, {"to", to}, {"coded_tokens", e.tokens}, {"k", r6(e.k)}, {"v", r6(e.v)}});
    kmin = std::min(kmin, e.k), kmax = std::max(kmax, e.k), vmin = std::min(vmin, e.v), vmax = std::max(vmax, e.v);
  }
  pj["image"] = "position.png";
  md << "\n### Error against token position\n\n"
     << pos_caps.size() << " evaluation captures of " << n << " tokens, " << basename_of(a.calib) << ", " << rk << "x, " << a.bucket
     << "-token buckets (sink and window are stored raw and left out):\n\n| | overall | bucket min | bucket max |\n|---|---|---|---|\n"
     << "| keys | " << fmt("%.4f", total.k) << " | " << fmt("%.4f", kmin) << " | " << fmt("%.4f", kmax) << " |\n"
     << "| values | " << fmt("%.4f", total.v) << " | " << fmt("%.4f", vmin) << " | " << fmt("%.4f", vmax) << " |\n"
     << "\n![error vs position](position.png)\n";
  return pj;
}

// 4. Bits per component: --calib's allocation at the ratio, per block and
// kind, as runs of one quantizer type.
nlohmann::ordered_json bits_analysis(const AnalyzeArgs& a, const Calibration& cal, const AllocationSet& al, std::ostream& md) {
  const std::string rk = ratio_key(a.ratio);
  nlohmann::ordered_json bj;
  bj["calibration"] = basename_of(a.calib);
  bj["ratio"] = a.ratio;
  bj["blocks"] = nlohmann::json::array();
  md << "\n### Bits per component (" << basename_of(a.calib) << ", " << rk
     << "x)\n\n| block | kind | bits/token (budget) | components coded | fp8 | int4 | int2 |\n|---|---|---|---|---|---|---|\n";
  for (size_t b = 0; b < al.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      const Allocation& A = al[b][kv];
      nlohmann::ordered_json j;
      j["block"] = b;
      j["kind"] = kv == 0 ? "keys" : "values";
      j["budget_bits_per_token"] = A.budget_bits;
      j["bits_per_token"] = A.bits;
      const Transform& tr = cal.blocks[b][kv];
      j["heldout_relative_error"] = r6(tr.total_variance > 0 ? A.error / tr.total_variance : 0);
      std::map<std::string, uint32_t> per_type;
      uint32_t coded = 0;
      // Runs of consecutive components with one type.
      nlohmann::json runs = nlohmann::json::array();
      for (const BlockAlloc& ba : A.blocks) {
        if (ba.type == QType::kNone) continue;
        per_type[qtype_name(ba.type)] += ba.size;
        coded += ba.size;
        if (!runs.empty() && runs.back()["type"] == qtype_name(ba.type) && runs.back()["to"].get<uint32_t>() == ba.start)
          runs.back()["to"] = ba.start + ba.size;
        else
          runs.push_back(
              {{"from", ba.start}, {"to", ba.start + ba.size}, {"type", qtype_name(ba.type)}, {"bits_per_component", qtype_code_bits(ba.type)}});
      }
      j["components"] = cal.blocks[b][kv].r;
      j["components_coded"] = coded;
      j["components_per_type"] = per_type;
      j["runs"] = runs;
      bj["blocks"].push_back(j);
      auto cnt = [&](const char* t) { return per_type.count(t) ? per_type.at(t) : 0u; };
      md << "| " << b << " | " << (kv == 0 ? "keys" : "values") << " | " << A.bits << " (" << A.budget_bits << ") | " << coded << " | " << cnt("fp8")
         << " | " << cnt("int4") << " | " << cnt("int2") << " |\n";
    }
  return bj;
}

// 5. Cross-domain: each --domain-calibs calibration on the captures of each
// corpus kind.
nlohmann::ordered_json domain_analysis(const AnalyzeArgs& a, const std::vector<std::pair<std::string, std::string>>& domain,
                                       const std::vector<Cap>& ctx_caps, std::ostream& md, time_point t0) {
  const std::string rk = ratio_key(a.ratio);
  nlohmann::ordered_json dj;
  dj["eval_kinds"] = kKinds;
  dj["rows"] = nlohmann::json::array();
  std::vector<double> mk, mv;
  std::vector<std::string> rows;
  for (const auto& [name, file] : domain) {
    Calibration cal = calibration_load(file);
    AllocationSet al = allocation_set(cal, a.ratio);
    std::vector<ReconError> per(kKinds.size());
    ReconError all;
    for (const Cap& cap : ctx_caps) {
      RoundTrip r = round_trip(cap, cal, al, nullptr);
      per[size_t(std::find(kKinds.begin(), kKinds.end(), cap.kind) - kKinds.begin())].add(r.err);
      all.add(r.err);
    }
    nlohmann::ordered_json j;
    j["calib"] = name;
    j["file"] = basename_of(file);
    for (const char* k : {"calib_tokens", "calib_documents", "calib_kinds"})
      if (cal.meta.count(k)) j[k] = cal.meta.at(k);
    j["k"] = nlohmann::json::array();
    j["v"] = nlohmann::json::array();
    for (const ReconError& e : per) {
      j["k"].push_back(r6(e.k));
      j["v"].push_back(r6(e.v));
      mk.push_back(e.k);
      mv.push_back(e.v);
    }
    j["k_all_kinds"] = r6(all.k);
    j["v_all_kinds"] = r6(all.v);
    dj["rows"].push_back(j);
    rows.push_back(name);
    log(t0, "domain: %s done", name);
  }
  dj["image"] = "domain.png";
  md << "\n### Cross-domain calibration\n\nRelative squared error at " << rk
     << "x, calibration kind (rows) on evaluation captures of each kind (columns; " << a.samples << " x " << a.context
     << " tokens each):\n\n| calibration |";
  for (const auto& k : kKinds) md << " K " << k << " |";
  for (const auto& k : kKinds) md << " V " << k << " |";
  md << "\n|---|";
  for (size_t i = 0; i < 2 * kKinds.size(); ++i) md << "---|";
  md << "\n";
  for (size_t r = 0; r < rows.size(); ++r) {
    md << "| " << rows[r] << " |";
    for (size_t k = 0; k < kKinds.size(); ++k) md << " " << fmt("%.4f", mk[r * kKinds.size() + k]) << " |";
    for (size_t k = 0; k < kKinds.size(); ++k) md << " " << fmt("%.4f", mv[r * kKinds.size() + k]) << " |";
    md << "\n";
  }
  md << "\n![cross-domain error](domain.png)\n";
  return dj;
}

int run_analyze(const AnalyzeArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::pair<std::string, std::string>> domain = check_inputs(a);
  std::filesystem::create_directories(a.out_dir);
  const std::string out = a.out_dir + "/";

  auto model = Model::load(a.model);
  const bool need_ctx = wants(a, "procrustes") || wants(a, "calib-size") || wants(a, "domain");
  std::vector<Cap> ctx_caps, pos_caps;
  make_captures(a, *model, need_ctx ? a.samples : 0, wants(a, "position") ? a.position_samples : 0, ctx_caps, pos_caps, t0);

  nlohmann::ordered_json res = result_header(a, *model, need_ctx, ctx_caps, pos_caps);
  std::ostringstream md;  // the summary tables
  if (wants(a, "procrustes")) res["procrustes"] = procrustes_analysis(a, ctx_caps, md, t0);
  if (wants(a, "calib-size")) res["calib_size"] = calib_size_analysis(a, ctx_caps, md, t0);
  if (wants(a, "position") || wants(a, "bits")) {
    Calibration cal = calibration_load(a.calib);
    AllocationSet al = allocation_set(cal, a.ratio);
    if (wants(a, "position")) res["position"] = position_analysis(a, pos_caps, cal, al, md, t0);
    if (wants(a, "bits")) res["bits_per_component"] = bits_analysis(a, cal, al, md);
  }
  if (wants(a, "domain")) res["domain"] = domain_analysis(a, domain, ctx_caps, md, t0);

  res["seconds"] = r6(seconds_since(t0));
  std::string js;
  pretty(res, js, 0);
  js += "\n";
  write_file_atomic(out + "analyze.json", {reinterpret_cast<const uint8_t*>(js.data()), js.size()});
  if (!a.out_md.empty()) {
    const std::string s = md.str();
    write_file_atomic(a.out_md, {reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  }
  if (a.json)
    std::printf("%s", js.c_str());
  else
    std::printf("%s\nwrote %sanalyze.json\n", md.str().c_str(), out.c_str());
  return 0;
}

}  // namespace

Action add_analyze(CLI::App& app) {
  auto a = std::make_shared<AnalyzeArgs>();
  a->model = default_model();
  a->corpus = default_corpus();
  CLI::App* sub =
      app.add_subcommand("analyze", "The paper's evidence on a model: head similarity, error vs calibration size, position and domain; PNG + JSON");
  model_option(sub, a->model, "GGUF model");
  sub->add_option("--corpus", a->corpus, "Corpus root")->capture_default_str();
  sub->add_option("--what", a->what, "Analyses: procrustes, calib-size, position, bits, domain")->delimiter(',')->capture_default_str();
  sub->add_option("--calib", a->calib, "Calibration for position and bits")->capture_default_str();
  sub->add_option("--calib-sizes", a->calib_sizes, "Calibration files for calib-size, one point each");
  sub->add_option("--domain-calibs", a->domain_calibs, "NAME=FILE calibrations for domain, one row each (e.g. prose=cal-prose.safetensors)");
  sub->add_option("--context", a->context, "Tokens per evaluation capture (procrustes, calib-size, domain)")
      ->capture_default_str()
      ->check(CLI::Range(16, 1 << 20));
  sub->add_option("--samples", a->samples, "Evaluation documents per corpus kind")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--position-context", a->position_context, "Tokens per capture for position")
      ->capture_default_str()
      ->check(CLI::Range(16, 1 << 20));
  sub->add_option("--position-samples", a->position_samples, "Documents per kind for position")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--bucket", a->bucket, "Tokens per position bucket")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--procrustes-tokens", a->procrustes_tokens, "Tokens for the head similarity (an equal share of each capture)")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  sub->add_option("-r,--ratio", a->ratio, "Nominal compression ratio")->capture_default_str();
  sub->add_option("--seed", a->seed, "Seed for document and window choice")->capture_default_str();
  sub->add_option("-o,--out", a->out_dir, "Output directory for the PNGs and analyze.json")->capture_default_str();
  sub->add_option("--out-md", a->out_md, "Write the summary tables (markdown) here");
  sub->add_flag("--json", a->json, "Print the JSON instead of the tables");
  return [a] { return run_analyze(*a); };
}

}  // namespace kvtc::lab
