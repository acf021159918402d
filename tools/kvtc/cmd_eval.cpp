// kvtc eval: what each compression ratio costs in model quality, measured
// the way the paper measures it — prefill a context with llama.cpp, take
// the sequence's state, encode and decode it with a method, restore it into
// a fresh sequence, then continue.
//
// Tasks (this first version): ppl (perplexity of the next 256 real-text
// tokens, teacher-forced), kld (mean next-token KL divergence from the
// uncompressed run over those tokens), agree (of 64 greedy tokens, how many
// match the uncompressed run before the first difference, and the share of
// samples where all 64 match). Methods: vanilla (restore without
// compression) and kvtc-<R>x for any nominal ratio R.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "../../src/baselines/baselines.h"
#include "../../src/calib/calibrate.h"
#include "commands.h"
#include "kvtc/codec.h"
#include "kvtc/error.h"
#include "kvtc/llama_session.h"
#include "kvtc/util.h"

namespace kvtc::cli {

namespace {

struct EvalArgs {
  std::string model, calib, corpus, out_json, out_md;
  std::vector<std::string> tasks{"ppl", "kld", "agree"};
  std::vector<std::string> methods{"vanilla", "kvtc-8x", "kvtc-16x", "kvtc-32x", "kvtc-64x"};
  std::vector<uint32_t> contexts{2048};
  uint32_t samples = 8, cont = 256, greedy = 64;
  uint64_t seed = 1;
  bool json = false;
};

struct Stat {
  std::vector<double> x;
  double mean() const {
    double s = 0;
    for (double v : x) s += v;
    return x.empty() ? 0 : s / double(x.size());
  }
  // 95% half-width of the mean (normal approximation).
  double half() const {
    if (x.size() < 2) return 0;
    double m = mean(), s = 0;
    for (double v : x) s += (v - m) * (v - m);
    return 1.96 * std::sqrt(s / double(x.size() - 1) / double(x.size()));
  }
};

// log-softmax of one row, in double.
void log_softmax(const float* l, size_t n, std::vector<double>& out) {
  out.resize(n);
  double mx = *std::max_element(l, l + n), s = 0;
  for (size_t i = 0; i < n; ++i) s += std::exp(double(l[i]) - mx);
  const double lse = mx + std::log(s);
  for (size_t i = 0; i < n; ++i) out[i] = double(l[i]) - lse;
}

std::vector<std::pair<std::string, std::vector<int32_t>>> pick_samples(const Model& m, const std::string& corpus, uint32_t need, uint32_t n,
                                                                       uint64_t seed) {
  std::ifstream f(corpus + "/manifest.json");
  require(f.good(), corpus + "/manifest.json: cannot open (run `make corpus`)");
  nlohmann::json man = nlohmann::json::parse(f);
  std::vector<std::pair<std::string, std::string>> docs;
  for (const auto& d : man.at("documents"))
    if (d.at("split") == "eval" && d.at("tokens").get<uint32_t>() >= need)
      docs.push_back({d.at("id"), corpus + "/" + d.at("file").get<std::string>()});
  require(!docs.empty(), "eval: no evaluation document holds " + std::to_string(need) + " tokens");
  std::mt19937_64 rng(seed);
  std::shuffle(docs.begin(), docs.end(), rng);
  std::vector<std::pair<std::string, std::vector<int32_t>>> out;
  for (size_t i = 0; out.size() < n && i < docs.size(); ++i) {
    std::vector<uint8_t> raw = read_file(docs[i].second);
    std::vector<int32_t> t = m.tokenize(std::string(raw.begin(), raw.end()));
    if (t.size() < need) continue;
    // A random window of the document, fixed by the seed.
    const size_t off = t.size() > need ? size_t(rng() % (t.size() - need + 1)) : 0;
    std::vector<int32_t> w(t.begin() + off, t.begin() + off + need);
    if (off > 0 && m.info().n_vocab > 0) {
      // Keep the model's BOS at the start, as a real session has it.
      std::vector<int32_t> bos = m.tokenize("");
      if (!bos.empty()) w.front() = bos.front();
    }
    out.push_back({docs[i].first, std::move(w)});
  }
  require(out.size() == n,
          "eval: only " + std::to_string(out.size()) + " evaluation documents hold " + std::to_string(need) + " tokens; ask for fewer samples");
  return out;
}

// Encodes and decodes a capture with `method`; returns the decoded capture
// and the bytes at rest (0 for vanilla).
KvCapture apply_method(const std::string& method, const KvCapture& c, const Calibration* cal, uint64_t* bytes) {
  *bytes = 0;
  if (method == "vanilla") return c;
  if (method == "fp8") return baselines::fp8_per_token(c, bytes);
  if (method == "kivi-2" || method == "kivi-4") return baselines::kivi(c, method == "kivi-2" ? 2 : 4, 32, 128, bytes);
  if (method == "zstd" || method == "deflate") {  // lossless: ratio only, the cache comes back unchanged
    *bytes = baselines::lossless_bytes(c, method);
    return c;
  }
  // kvtc-<R>x: the calibration's table (separate K and V budgets);
  // kvtc-<R>x-joint: one budget for K and V split by relative error.
  const bool joint = method.size() > 6 && method.compare(method.size() - 6, 6, "-joint") == 0;
  const std::string base = joint ? method.substr(0, method.size() - 6) : method;
  if (base.rfind("kvtc-", 0) == 0 && base.size() > 6 && base.back() == 'x') {
    require(cal != nullptr, "eval: method " + method + " needs --calib");
    double ratio = 0;
    try {
      ratio = std::stod(base.substr(5, base.size() - 6));
    } catch (const std::exception&) {
      throw Error("eval: cannot read the ratio of method '" + method + "'");
    }
    AllocationSet al = allocation_set(*cal, ratio, joint);
    std::vector<uint8_t> enc = kvtc_compress(c, *cal, al, CompressOptions{});
    *bytes = enc.size();
    return kvtc_decompress(enc, *cal, method);
  }
  throw Error("eval: unknown method '" + method + "' (vanilla, kvtc-<R>x, kvtc-<R>x-joint, fp8, kivi-2, kivi-4, zstd, deflate)");
}

int run_eval(const EvalArgs& a) {
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  auto model = Model::load(a.model);
  const size_t nv = model->info().n_vocab;
  std::unique_ptr<Calibration> cal;
  if (!a.calib.empty()) cal = std::make_unique<Calibration>(calibration_load(a.calib));
  for (const auto& t : a.tasks) require(t == "ppl" || t == "kld" || t == "agree", "eval: unknown task '" + t + "' (ppl, kld, agree)");
  // Fail on a bad method name before minutes of prefill: a dry run of each
  // method on an empty capture would need a model, so check the names.
  for (const auto& m : a.methods) {
    const bool kvtc = m.rfind("kvtc-", 0) == 0 && (m.back() == 'x' || (m.size() > 6 && m.compare(m.size() - 6, 6, "-joint") == 0));
    require(kvtc || m == "vanilla" || m == "fp8" || m == "kivi-2" || m == "kivi-4" || m == "zstd" || m == "deflate",
            "eval: unknown method '" + m + "' (vanilla, kvtc-<R>x, kvtc-<R>x-joint, fp8, kivi-2, kivi-4, zstd, deflate)");
    require(!kvtc || cal, "eval: method " + m + " needs --calib");
  }
  nlohmann::ordered_json result;
  result["model"] = model->info().path;
  result["model_sha256"] = model->sha256();
  result["calibration"] = a.calib;
  if (cal) result["calibration_id"] = cal->id;
  result["seed"] = a.seed;
  result["samples"] = a.samples;
  result["continuation_tokens"] = a.cont;
  result["greedy_tokens"] = a.greedy;
  result["contexts"] = nlohmann::json::array();
  std::vector<double> lp_ref, lp;
  bool vanilla_exact = true;
  for (uint32_t ctx : a.contexts) {
    const uint32_t need = ctx + a.cont;
    auto samples = pick_samples(*model, a.corpus, need, a.samples, a.seed + ctx);
    SessionOptions so;
    so.n_ctx = need + a.greedy + 16;
    Session s(*model, so);
    // Per method: per-sample scores; KL and agreement are against vanilla.
    std::map<std::string, std::map<std::string, Stat>> sc;
    std::map<std::string, std::pair<uint64_t, uint64_t>> bytes;  // f16 bytes, stored bytes
    for (size_t si = 0; si < samples.size(); ++si) {
      const auto& toks = samples[si].second;
      std::vector<int32_t> context(toks.begin(), toks.begin() + ctx);
      std::vector<int32_t> cont(toks.begin() + ctx, toks.end());
      s.clear();
      s.decode(context, 0);
      KvCapture cap = s.capture();
      cap.tokens = context;
      // The same continuation on the cache that never left llama.cpp: the
      // vanilla method (restore without compression) must give these logits
      // bit for bit.
      std::vector<float> direct;
      {
        s.remove_from(int32_t(ctx) - 1);
        std::vector<int32_t> seq{context.back()};
        seq.insert(seq.end(), cont.begin(), cont.end() - 1);
        s.decode(seq, int32_t(ctx) - 1, &direct);
      }
      std::vector<float> ref_logits;
      std::vector<int32_t> ref_greedy;
      for (const std::string& method : a.methods) {
        uint64_t stored = 0;
        KvCapture dec = apply_method(method, cap, cal.get(), &stored);
        bytes[method].first += cap.f16_bytes_per_token() * ctx;
        bytes[method].second += stored ? stored : cap.f16_bytes_per_token() * ctx;
        s.restore(dec);
        // Logits are not in the state: re-decode the last context token,
        // then teacher-force the continuation.
        s.remove_from(int32_t(ctx) - 1);
        std::vector<int32_t> seq{context.back()};
        seq.insert(seq.end(), cont.begin(), cont.end() - 1);
        std::vector<float> logits;
        s.decode(seq, int32_t(ctx) - 1, &logits);
        if (method == a.methods.front()) ref_logits = logits;
        if (method == "vanilla") {
          const bool same = logits.size() == direct.size() && std::memcmp(logits.data(), direct.data(), logits.size() * sizeof(float)) == 0;
          vanilla_exact = vanilla_exact && same;
        }
        double nll = 0, kl = 0;
        for (size_t i = 0; i < cont.size(); ++i) {
          log_softmax(&logits[i * nv], nv, lp);
          nll -= lp[size_t(cont[i])];
          if (method != a.methods.front()) {
            log_softmax(&ref_logits[i * nv], nv, lp_ref);
            double k = 0;
            for (size_t v = 0; v < nv; ++v) k += std::exp(lp_ref[v]) * (lp_ref[v] - lp[v]);
            kl += k;
          }
        }
        sc[method]["ppl"].x.push_back(std::exp(nll / double(cont.size())));
        sc[method]["kld"].x.push_back(kl / double(cont.size()));
        if (std::find(a.tasks.begin(), a.tasks.end(), "agree") != a.tasks.end()) {
          s.remove_from(int32_t(ctx) - 1);
          s.decode({context.back()}, int32_t(ctx) - 1);
          std::vector<int32_t> g = s.greedy(int(a.greedy));
          if (method == a.methods.front()) ref_greedy = g;
          uint32_t k = 0;
          while (k < g.size() && g[k] == ref_greedy[k]) ++k;
          sc[method]["agree"].x.push_back(k);
          sc[method]["agree_all"].x.push_back(k == g.size() ? 1.0 : 0.0);
        }
      }
      std::fprintf(stderr, "[eval] context %u, sample %zu/%zu (%s) done, %.0f s\n", ctx, si + 1, samples.size(), samples[si].first.c_str(),
                   std::chrono::duration<double>(clock::now() - t_start).count());
    }
    nlohmann::ordered_json cj;
    cj["context"] = ctx;
    cj["documents"] = nlohmann::json::array();
    for (const auto& smp : samples) cj["documents"].push_back(smp.first);
    cj["methods"] = nlohmann::json::array();
    for (const std::string& method : a.methods) {
      nlohmann::ordered_json m;
      m["name"] = method;
      m["ratio"] = double(bytes[method].first) / double(bytes[method].second);
      for (const std::string& t : a.tasks) {
        m["scores"][t] = sc[method][t].mean();
        m["half_width"][t] = sc[method][t].half();
        if (t == "agree") m["scores"]["agree_all"] = sc[method]["agree_all"].mean();
        // Paired difference against the reference method, sample by sample.
        Stat d;
        for (size_t i = 0; i < sc[method][t].x.size(); ++i) d.x.push_back(sc[method][t].x[i] - sc[a.methods.front()][t].x[i]);
        m["paired_diff"][t] = {{"mean", d.mean()}, {"half_width", d.half()}};
      }
      cj["methods"].push_back(m);
    }
    result["contexts"].push_back(cj);
  }
  result["vanilla_equals_no_restore"] = vanilla_exact;
  result["seconds"] = std::chrono::duration<double>(clock::now() - t_start).count();
  if (!a.out_json.empty()) {
    const std::string js = result.dump(1) + "\n";
    write_file_atomic(a.out_json, {reinterpret_cast<const uint8_t*>(js.data()), js.size()});
  }
  std::ostringstream md;
  for (const auto& cj : result["contexts"]) {
    md << "\n### context " << cj["context"].get<uint32_t>() << " tokens, " << a.samples << " samples\n\n| method | ratio (whole cache) |";
    for (const auto& t : a.tasks) md << " " << t << " |";
    md << "\n|---|---|";
    for (size_t i = 0; i < a.tasks.size(); ++i) md << "---|";
    md << "\n";
    for (const auto& m : cj["methods"]) {
      char b[64];
      std::snprintf(b, sizeof b, "%.2fx", m["ratio"].get<double>());
      md << "| " << m["name"].get<std::string>() << " | " << b << " |";
      for (const auto& t : a.tasks) {
        std::snprintf(b, sizeof b, " %.4g ± %.2g", m["scores"][t].get<double>(), m["half_width"][t].get<double>());
        md << b;
        if (t == "agree") {
          std::snprintf(b, sizeof b, " (all %u: %.0f%%)", a.greedy, 100 * m["scores"]["agree_all"].get<double>());
          md << b;
        }
        md << " |";
      }
      md << "\n";
    }
  }
  if (!a.out_md.empty()) {
    const std::string s = md.str();
    write_file_atomic(a.out_md, {reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  }
  if (a.json)
    std::printf("%s\n", result.dump(2).c_str());
  else
    std::printf("%s\nvanilla restore equals no restore (logits bit for bit): %s\n", md.str().c_str(), vanilla_exact ? "yes" : "NO");
  return vanilla_exact ? 0 : 3;
}

}  // namespace

Action add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  a->model = default_model();
  a->corpus = default_corpus();
  CLI::App* sub = app.add_subcommand("eval", "Quality after compress -> restore -> continue (ppl, kld, agree), method by method");
  sub->add_option("-m,--model", a->model, "GGUF model")->capture_default_str();
  sub->add_option("--calib", a->calib, "Calibration file (needed by kvtc methods)");
  sub->add_option("--corpus", a->corpus, "Corpus root")->capture_default_str();
  sub->add_option("--tasks", a->tasks, "Tasks: ppl, kld, agree")->capture_default_str();
  sub->add_option("--methods", a->methods, "Methods; the first is the reference (vanilla)")->capture_default_str();
  sub->add_option("--context", a->contexts, "Context lengths in tokens")->capture_default_str();
  sub->add_option("--samples", a->samples, "Samples per context")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--continuation", a->cont, "Teacher-forced tokens scored after the context")->capture_default_str()->check(CLI::Range(2, 4096));
  sub->add_option("--greedy", a->greedy, "Greedy tokens compared for `agree`")->capture_default_str()->check(CLI::Range(1, 1024));
  sub->add_option("--seed", a->seed, "Seed for document and window choice")->capture_default_str();
  sub->add_option("--out-json", a->out_json, "Write the JSON result here");
  sub->add_option("--out-md", a->out_md, "Write the markdown table here");
  sub->add_flag("--json", a->json, "Print JSON instead of the table");
  return [a] { return run_eval(*a); };
}

}  // namespace kvtc::cli
