// kvtc eval: what each compression ratio costs in model quality, measured
// the way the paper measures it — prefill a context with llama.cpp, take
// the sequence's state, encode and decode it with a method, restore it into
// a fresh sequence, then continue.
//
// Tasks: ppl (perplexity of the next 256 real-text tokens, teacher-forced),
// kld (mean next-token KL divergence from vanilla over those tokens), agree
// (of 64 greedy tokens, how many match vanilla before the first difference,
// and the share of samples where all 64 match) on real text of the
// evaluation split; niah, vt, kvr and code (eval_tasks.h), scored in
// percent. Each task has its own prompts and prefill; every method runs on
// the same prompts, so differences are paired. Methods: see parse_method.
//
// --records FILE keeps one JSON line per (prompt, method) as each prompt
// finishes (fsynced), and a later run with the same file computes only the
// (prompt, method) pairs it lacks: long evaluations survive a stop and grow
// over sessions, and a method added to recorded prompts costs one prefill
// and its own restores per prompt; bench/quality_records.py turns the
// records into tables.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "eval_tasks.h"
#include "kvtc/corpus.h"
#include "kvtc/kvtc.h"
#include "kvtc/llama.h"
#include "lab.h"
#include "methods.h"

namespace kvtc::lab {

namespace {

struct EvalArgs {
  std::string model, calib, corpus, out_json, out_md, records, record_tag;
  std::vector<std::string> tasks{"ppl", "kld", "agree"};
  std::vector<std::string> methods{"vanilla", "kvtc-8x", "kvtc-16x", "kvtc-32x", "kvtc-64x"};
  std::vector<uint32_t> contexts{2048};
  std::vector<uint32_t> samples{8};  // per context (one value: all contexts)
  uint32_t cont = 256, greedy = 64;
  std::vector<std::string> calib_extra;  // NAME=FILE, for kvtc-<R>x@NAME
  std::string precision = "auto";        // kvtc methods without a precision suffix
  uint64_t seed = 1;
  bool json = false, verbose_tasks = false;
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

// A prompt of one task: text (ppl/kld/agree share it) or a retrieval task.
struct Prompt {
  std::string task, id;  // task "text" for the ppl/kld/agree group
  uint32_t index = 0;    // within its task at this context (the records' key)
  std::vector<int32_t> tokens, cont;
  TaskPrompt gen;
};

// n text samples of ctx + cont tokens: seeded random windows of distinct
// evaluation documents.
std::vector<Prompt> text_prompts(const Model& m, const Corpus& corpus, uint32_t ctx, uint32_t cont, uint32_t n, uint64_t seed) {
  const uint32_t need = ctx + cont;
  std::vector<CorpusDoc> docs = corpus.docs("eval", {}, need);
  std::mt19937_64 rng(seed);
  shuffle_docs(docs, rng);
  WindowReader windows(m, std::move(docs), rng);
  std::vector<Prompt> out;
  while (out.size() < n) {
    std::optional<TextWindow> w = windows.next(need);
    if (!w) break;
    Prompt p;
    p.task = "text";
    p.index = uint32_t(out.size());
    p.id = w->doc.id;
    p.tokens.assign(w->tokens.begin(), w->tokens.begin() + ctx);
    p.cont.assign(w->tokens.begin() + ctx, w->tokens.end());
    out.push_back(std::move(p));
  }
  require(out.size() == n,
          "eval: only " + std::to_string(out.size()) + " evaluation documents hold " + std::to_string(need) + " tokens; ask for fewer samples");
  return out;
}

// Haystacks: prose and docs of the evaluation split, cycled.
std::vector<Prompt> task_prompts(const Model& m, const Corpus& corpus, const std::string& task, uint32_t ctx, uint32_t n, uint64_t seed) {
  std::vector<CorpusDoc> docs = corpus.docs("eval", {"prose", "docs"}, ctx);
  require(task == "kvr" || !docs.empty(), "eval: no prose/docs evaluation document holds " + std::to_string(ctx) + " tokens");
  std::mt19937_64 rng(seed);
  shuffle_docs(docs, rng);
  std::vector<Prompt> out;
  for (uint32_t i = 0; i < n; ++i) {
    std::string text, id;
    if (task != "kvr") {
      const CorpusDoc& d = docs[i % docs.size()];
      // Start at a paragraph boundary chosen by the seed.
      const std::string s = corpus_text(d);
      size_t off = s.size() > 8 * ctx ? size_t(rng() % (s.size() - 8 * ctx)) : 0;
      if (off > 0) off = std::min(s.size(), s.find("\n\n", off) == std::string::npos ? off : s.find("\n\n", off) + 2);
      text = s.substr(off);
      id = d.id;
    }
    Prompt p;
    p.task = task;
    p.index = i;
    p.gen = make_task_prompt(m, task, text, id, ctx, seed, i);
    p.id = p.gen.id;
    p.tokens = p.gen.tokens;
    out.push_back(std::move(p));
  }
  return out;
}

// Code completion: Python files of the evaluation split holding ctx tokens
// (by the manifest's count), cycled; each prompt its own target line.
std::vector<Prompt> code_prompts(const Model& m, const Corpus& corpus, uint32_t ctx, uint32_t n, uint64_t seed) {
  std::vector<CorpusDoc> docs = corpus.docs("eval", {"code"}, ctx);
  require(!docs.empty(), "eval: no code evaluation document holds " + std::to_string(ctx) + " tokens");
  std::mt19937_64 rng(seed);
  shuffle_docs(docs, rng);
  std::vector<Prompt> out;
  for (uint32_t i = 0; i < n; ++i) {
    const CorpusDoc& d = docs[i % docs.size()];
    Prompt p;
    p.task = "code";
    p.index = i;
    p.gen = make_code_prompt(m, corpus_text(d), d.id, ctx, seed, i);
    p.id = p.gen.id;
    p.tokens = p.gen.tokens;
    out.push_back(std::move(p));
  }
  return out;
}

// Greedy tokens until the first non-blank line is complete (or n tokens,
// or end of generation): a code completion's answer is one line.
std::string greedy_line(Session& s, const Model& m, uint32_t n) {
  std::string out;
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t t = s.argmax();
    if (m.is_eog(t)) break;
    out += m.token_text(t);
    const size_t a = out.find_first_not_of(" \t\r\n");
    if (a != std::string::npos && out.find('\n', a) != std::string::npos) break;
    if (i + 1 < n) s.decode({t}, s.pos_max() + 1);
  }
  return out;
}

// The records file (--records): what identifies a result across runs.
struct RecordKey {
  std::string model, calib, method, task;
  uint64_t seed;
  uint32_t cont, greedy, ctx, index;
  auto tie() const { return std::tie(model, calib, method, task, seed, cont, greedy, ctx, index); }
  bool operator<(const RecordKey& o) const { return tie() < o.tie(); }
};

RecordKey record_key(const nlohmann::json& r) {
  return {r.at("model_sha256"), r.at("calibration_id"), r.at("method"),  r.at("task"), r.at("seed"),
          r.at("continuation"), r.at("greedy"),         r.at("context"), r.at("index")};
}

// The records already in `path` by key (absent file: none). A torn last
// line (a run killed while writing) is skipped with a note.
std::map<RecordKey, nlohmann::json> read_records(const std::string& path) {
  std::map<RecordKey, nlohmann::json> keys;
  std::ifstream f(path);
  std::string line;
  size_t n = 0, bad = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.empty()) continue;
    try {
      nlohmann::json r = nlohmann::json::parse(line);
      RecordKey k = record_key(r);  // before the move: json's operator= takes its argument by value
      keys[std::move(k)] = std::move(r);
    } catch (const std::exception&) {
      ++bad;
    }
  }
  if (bad) std::fprintf(stderr, "[eval] %s: %zu of %zu lines are not records (a torn write?); skipped\n", path.c_str(), bad, n);
  return keys;
}

// Appends lines and makes them durable before the next prompt starts. A
// torn last line (no line break) is closed first, so it cannot swallow the
// first new record.
void append_records(const std::string& path, const std::string& lines) {
  std::string out = lines;
  {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (in && in.tellg() > 0) {
      in.seekg(-1, std::ios::end);
      if (in.get() != '\n') out.insert(out.begin(), '\n');
    }
  }
  FILE* f = std::fopen(path.c_str(), "a");
  require(f != nullptr, path + ": cannot open the records file for appending");
  const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size() && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  std::fclose(f);
  require(ok, path + ": writing records failed (disk full?)");
}

// ---- the run, step by step ----------------------------------------------------

using clock_type = std::chrono::steady_clock;

bool has_task(const EvalArgs& a, const std::string& t) {
  return std::find(a.tasks.begin(), a.tasks.end(), t) != a.tasks.end();
}

void check_tasks(const EvalArgs& a) {
  for (const auto& t : a.tasks)
    require(t == "ppl" || t == "kld" || t == "agree" || t == "niah" || t == "vt" || t == "kvr" || t == "code",
            "eval: unknown task '" + t + "' (ppl, kld, agree, niah, vt, kvr, code)");
}

// The columns of the results: the tasks, and code's second score.
std::vector<std::string> result_columns(const EvalArgs& a) {
  std::vector<std::string> cols = a.tasks;
  if (has_task(a, "code")) cols.push_back("code_es");
  return cols;
}

// The model, the methods and their calibrations, for every context.
struct EvalSetup {
  std::unique_ptr<Model> model;
  std::map<std::string, std::string> calib_files;  // "": --calib; NAME: --calib-extra NAME=FILE
  std::map<std::string, Calibration> cals;         // the same keys
  std::vector<std::unique_ptr<Method>> methods;    // vanilla first
  std::string calib_id;                            // --calib's id (the records' key), or ""
};

// Method names and calibrations are checked before the model is loaded and
// minutes of prefill begin.
EvalSetup load_setup(const EvalArgs& a) {
  std::vector<MethodSpec> specs;
  for (const auto& n : a.methods) specs.push_back(parse_method(n));
  const Precision prec = parse_precision(a.precision);
  require(!specs.empty() && specs.front().name == "vanilla", "eval: the first method must be vanilla (the reference of kld and agree)");
  EvalSetup S;
  if (!a.calib.empty()) S.calib_files[""] = a.calib;
  for (const auto& e : a.calib_extra) {
    const size_t eq = e.find('=');
    require(eq != std::string::npos && eq > 0 && eq + 1 < e.size(), "eval: --calib-extra takes NAME=FILE, got '" + e + "'");
    S.calib_files[e.substr(0, eq)] = e.substr(eq + 1);
  }
  for (const MethodSpec& m : specs)
    if (m.needs_calibration)
      require(S.calib_files.count(m.calibration),
              "eval: method " + m.name + " needs " + (m.calibration.empty() ? "--calib" : "--calib-extra " + m.calibration + "=FILE"));
  S.model = Model::load(a.model);
  for (const auto& [k, f] : S.calib_files) S.cals.emplace(k, calibration_load(f));
  for (const MethodSpec& m : specs) S.methods.push_back(make_method(m, S.cals, prec));
  S.calib_id = S.cals.count("") ? S.cals.at("").id : "";
  return S;
}

// The calibration's calib_tokens, "" when it has none.
std::string calib_tokens_of(const Calibration& cal) {
  auto it = cal.meta.find("calib_tokens");
  return it == cal.meta.end() ? "" : it->second;
}

// The result's fields before its contexts: model, calibrations, settings.
nlohmann::ordered_json result_header(const EvalArgs& a, const EvalSetup& S) {
  nlohmann::ordered_json result;
  result["model"] = S.model->info().path;
  result["model_sha256"] = S.model->sha256();
  result["calibration"] = a.calib;
  if (S.cals.count("")) result["calibration_id"] = S.cals.at("").id;
  for (const auto& [k, f] : S.calib_files)
    if (!k.empty())
      result["calibration_extra"][k] = {{"file", f},
                                        {"id", S.cals.at(k).id},
                                        {"calib_tokens", calib_tokens_of(S.cals.at(k))},
                                        {"keys_rope", S.cals.at(k).keys_derope ? "removed" : "kept"}};
  result["seed"] = a.seed;
  result["samples"] = a.samples;
  result["continuation_tokens"] = a.cont;
  result["greedy_tokens"] = a.greedy;
  result["tasks"] = a.tasks;
  result["contexts"] = nlohmann::json::array();
  return result;
}

// What the run gathers over all contexts and prompts.
struct EvalTally {
  std::map<RecordKey, nlohmann::json> have;  // --records: the records there already
  size_t skipped = 0, reused = 0;            // prompts all recorded; single methods' results taken from records
  bool vanilla_exact = true;                 // vanilla's logits equal the never-restored cache's, bit for bit
  size_t vanilla_compared = 0;               // text prompts where that was compared (not taken from records)
};

// Every task's prompts at one context: text (ppl/kld/agree), then niah, vt,
// kvr, code.
std::vector<Prompt> context_prompts(const Model& m, const Corpus& corpus, const EvalArgs& a, uint32_t ctx, uint32_t n_samples) {
  std::vector<Prompt> prompts;
  const bool text = has_task(a, "ppl") || has_task(a, "kld") || has_task(a, "agree");
  if (text) prompts = text_prompts(m, corpus, ctx, a.cont, n_samples, a.seed + ctx);
  for (const char* t : {"niah", "vt", "kvr"})
    if (has_task(a, t)) {
      auto p = task_prompts(m, corpus, t, ctx, n_samples, a.seed + ctx);
      prompts.insert(prompts.end(), p.begin(), p.end());
    }
  if (has_task(a, "code")) {
    auto p = code_prompts(m, corpus, ctx, n_samples, a.seed + ctx);
    prompts.insert(prompts.end(), p.begin(), p.end());
  }
  return prompts;
}

// The llama.cpp contexts of one context length: the f16 one every restored
// method (and vanilla) continues in, and one per native quantized cache.
struct ContextSessions {
  Session f16;
  std::map<std::string, std::unique_ptr<Session>> native;  // by method: q8_0 / q4_0 contexts
  ContextSessions(const Model& m, const SessionOptions& so, const std::vector<std::unique_ptr<Method>>& methods) : f16(m, so) {
    for (const auto& mt : methods)
      if (!mt->native_cache_types().first.empty()) {
        SessionOptions qo = so;
        std::tie(qo.cache_type_k, qo.cache_type_v) = mt->native_cache_types();
        native[mt->name()] = std::make_unique<Session>(m, qo);
      }
  }
};

// Per method, per-prompt scores (KL and agreement are against vanilla) and
// bytes, over one context's prompts.
struct ContextScores {
  std::map<std::string, std::map<std::string, Stat>> sc;       // method -> column -> per-prompt values
  std::map<std::string, std::pair<uint64_t, uint64_t>> bytes;  // method -> f16 bytes, stored bytes
};

// Every method on one prompt: the prefill, then per method the record that
// stands in for it or its restore and continuation, scored by the prompt's
// task; new records are appended once the prompt is done.
class PromptEval {
 public:
  PromptEval(const EvalArgs& a, const EvalSetup& S, EvalTally& T, ContextSessions& sessions, ContextScores& scores, uint32_t ctx, const Prompt& P)
      : a_(a), S_(S), T_(T), sessions_(sessions), scores_(scores), ctx_(ctx), P_(P), n_(uint32_t(P.tokens.size())) {}

  // Every method has its record already: nothing to compute, no prefill.
  bool all_recorded() const {
    return !a_.records.empty() &&
           std::all_of(S_.methods.begin(), S_.methods.end(), [&](const auto& m) { return T_.have.count(key_of(m->name())) > 0; });
  }

  // Every method's record stands in (as a recorded method does in run()):
  // true when each holds every score wanted, and nothing is computed.
  bool stand_in() {
    find_recorded();
    if (std::any_of(recorded_.begin(), recorded_.end(), [](const nlohmann::json* r) { return r == nullptr; })) return false;
    for (size_t mi = 0; mi < S_.methods.size(); ++mi) run_method(mi);
    return true;
  }

  void run() {
    prefill();
    find_recorded();
    for (size_t mi = 0; mi < S_.methods.size(); ++mi) run_method(mi);
    if (!lines_.empty()) append_records(a_.records, lines_);
  }

 private:
  RecordKey key_of(const std::string& method) const {
    return RecordKey{S_.model->sha256(), S_.calib_id, method, P_.task, a_.seed, a_.cont, a_.greedy, ctx_, P_.index};
  }

  // This prompt's record of method m (with --records, unless recorded).
  void record(const Method& m, uint64_t f16, uint64_t stored, const nlohmann::json& scores, const std::string& output) {
    if (a_.records.empty() || T_.have.count(key_of(m.name()))) return;
    nlohmann::ordered_json r;
    r["model_sha256"] = S_.model->sha256();
    r["calibration_id"] = S_.calib_id;
    r["method"] = m.name();
    r["task"] = P_.task;
    r["seed"] = a_.seed;
    r["continuation"] = a_.cont;
    r["greedy"] = a_.greedy;
    r["context"] = ctx_;
    r["index"] = P_.index;
    r["id"] = P_.id;
    r["tokens"] = n_;
    r["f16_bytes"] = f16;
    r["stored_bytes"] = stored;
    r["scores"] = scores;
    if (!output.empty()) r["output"] = output.substr(0, 240);
    if (!P_.gen.answers.empty()) r["expected"] = P_.gen.answers;
    if (!a_.record_tag.empty()) r["run"] = a_.record_tag;
    lines_ += r.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }

  // The prompt into the f16 context and its cache captured; on text, the
  // continuation on the cache that never left llama.cpp (vanilla, restored
  // without compression, must give these logits bit for bit).
  void prefill() {
    Session& s = sessions_.f16;
    s.clear();
    s.decode(P_.tokens, 0);
    cap_ = s.capture();
    cap_.tokens = P_.tokens;
    // Logits are not in the state: every method re-decodes the last
    // prompt token after restoring, then continues.
    seq_ = {P_.tokens.back()};
    seq_.insert(seq_.end(), P_.cont.begin(), P_.cont.end());
    if (!seq_.empty() && P_.task == "text") seq_.pop_back();
    if (P_.task == "text") {
      s.remove_from(int32_t(n_) - 1);
      s.decode(seq_, int32_t(n_) - 1, &direct_);
    }
  }

  // Per method, the record that stands in for it, or none; and whether
  // vanilla must run for the others' KL and agreement.
  void find_recorded() {
    // A record stands in only if it holds every score this run takes
    // from the prompt (a text record written without agree does not).
    wanted_ = {P_.task};
    if (P_.task == "text")
      wanted_ = has_task(a_, "agree") ? std::vector<std::string>{"ppl", "kld", "agree", "agree_all"} : std::vector<std::string>{"ppl", "kld"};
    if (P_.task == "code") wanted_ = {"code", "code_es"};
    // Ratio-only methods record no scores, so they are always recomputed
    // (cheap).
    recorded_.assign(S_.methods.size(), nullptr);
    for (size_t mi = 0; mi < S_.methods.size(); ++mi)
      if (auto it = T_.have.find(key_of(S_.methods[mi]->name())); it != T_.have.end()) {
        const nlohmann::json& sc_r = it->second.at("scores");
        if (std::all_of(wanted_.begin(), wanted_.end(), [&](const std::string& t) { return sc_r.contains(t); })) recorded_[mi] = &it->second;
      }
    // Vanilla runs on text whenever another method does: KL and
    // agreement are measured against its logits and tokens.
    need_ref_ = false;
    for (size_t mi = 0; mi < S_.methods.size(); ++mi) {
      const Method& m = *S_.methods[mi];
      need_ref_ = need_ref_ || (P_.task == "text" && !recorded_[mi] && !m.is_reference() && !m.ratio_only());
    }
  }

  void add_bytes(const Method& m, uint64_t f16, uint64_t stored) {
    scores_.bytes[m.name()].first += f16;
    scores_.bytes[m.name()].second += stored;
  }

  void run_method(size_t mi) {
    const Method& m = *S_.methods[mi];
    // A method another run recorded on this prompt is not recomputed
    // (adding one method to 100 recorded prompts then costs its own
    // restores and one prefill each, not every method's again); its
    // recorded scores stand in, so this run's tables stay paired.
    if (recorded_[mi] && !(m.is_reference() && need_ref_)) {
      const nlohmann::json& r = *recorded_[mi];
      add_bytes(m, r.at("f16_bytes").get<uint64_t>(), r.at("stored_bytes").get<uint64_t>());
      for (const std::string& t : wanted_) scores_.sc[m.name()][t].x.push_back(r.at("scores").at(t).get<double>());
      ++T_.reused;
      return;
    }
    uint64_t stored = 0;
    if (m.ratio_only()) {  // the cache would come back bit for bit
      m.apply(cap_, &stored);
      add_bytes(m, cap_.f16_bytes(), stored);
      record(m, cap_.f16_bytes(), stored, nlohmann::json::object(), "");
      return;
    }
    Session* run = &sessions_.f16;
    if (!m.native_cache_types().first.empty()) {
      run = sessions_.native.at(m.name()).get();
      run->clear();
      run->decode(P_.tokens, 0);
      m.apply(cap_, &stored);
    } else {
      KvCapture dec = m.apply(cap_, &stored);
      sessions_.f16.restore(dec);
    }
    add_bytes(m, cap_.f16_bytes(), stored);
    run->remove_from(int32_t(n_) - 1);
    if (P_.task == "text")
      score_text(m, *run, stored);
    else if (P_.task == "code")
      score_code(m, *run, stored);
    else
      score_retrieval(m, *run, stored);
  }

  // ppl and kld over the teacher-forced continuation; agree: greedy tokens
  // against vanilla's.
  void score_text(const Method& m, Session& run, uint64_t stored) {
    const size_t nv = S_.model->info().n_vocab;
    std::vector<float> logits;
    run.decode(seq_, int32_t(n_) - 1, &logits);
    if (m.is_reference()) {
      ref_logits_ = logits;
      T_.vanilla_exact =
          T_.vanilla_exact && logits.size() == direct_.size() && std::memcmp(logits.data(), direct_.data(), logits.size() * sizeof(float)) == 0;
      ++T_.vanilla_compared;
    }
    std::vector<double> lp_ref, lp;
    double nll = 0, kl = 0;
    for (size_t i = 0; i < P_.cont.size(); ++i) {
      log_softmax(&logits[i * nv], nv, lp);
      nll -= lp[size_t(P_.cont[i])];
      log_softmax(&ref_logits_[i * nv], nv, lp_ref);
      double k = 0;
      for (size_t v = 0; v < nv; ++v) k += std::exp(lp_ref[v]) * (lp_ref[v] - lp[v]);
      kl += k;
    }
    auto& sc = scores_.sc[m.name()];
    nlohmann::json js;
    js["ppl"] = std::exp(nll / double(P_.cont.size()));
    js["kld"] = kl / double(P_.cont.size());
    sc["ppl"].x.push_back(js["ppl"]);
    sc["kld"].x.push_back(js["kld"]);
    if (has_task(a_, "agree")) {
      run.remove_from(int32_t(n_) - 1);
      run.decode({P_.tokens.back()}, int32_t(n_) - 1);
      std::vector<int32_t> g = run.greedy(int(a_.greedy));
      if (m.is_reference()) ref_greedy_ = g;
      uint32_t k = 0;
      while (k < g.size() && g[k] == ref_greedy_[k]) ++k;
      sc["agree"].x.push_back(k);
      sc["agree_all"].x.push_back(k == g.size() ? 1.0 : 0.0);
      js["agree"] = k;
      js["agree_all"] = k == g.size() ? 1.0 : 0.0;
    }
    record(m, cap_.f16_bytes(), stored, js, "");
  }

  // The next line of code, greedy: exact match and edit similarity.
  void score_code(const Method& m, Session& run, uint64_t stored) {
    run.decode({P_.tokens.back()}, int32_t(n_) - 1);
    const std::string line = first_code_line(greedy_line(run, *S_.model, P_.gen.gen_tokens));
    const CodeLineScore c = score_code_line(P_.gen.answers.front(), line);
    scores_.sc[m.name()]["code"].x.push_back(100.0 * c.exact);
    scores_.sc[m.name()]["code_es"].x.push_back(100.0 * c.edit_similarity);
    record(m, cap_.f16_bytes(), stored, {{"code", 100.0 * c.exact}, {"code_es", 100.0 * c.edit_similarity}}, line);
    if (a_.verbose_tasks)
      std::fprintf(stderr, "[eval] %s %s: %s -> %.0f / %.0f (wanted %s)\n", m.name().c_str(), P_.id.c_str(), line.c_str(), 100.0 * c.exact,
                   100.0 * c.edit_similarity, P_.gen.answers.front().c_str());
  }

  // niah, vt, kvr: the greedy answer scored against the expected ones.
  void score_retrieval(const Method& m, Session& run, uint64_t stored) {
    run.decode({P_.tokens.back()}, int32_t(n_) - 1);
    const std::string out = text_of(*S_.model, run.greedy(int(P_.gen.gen_tokens)));
    // Scores in percent, as RULER reports them.
    const double score = 100.0 * score_generation(P_.gen, out);
    scores_.sc[m.name()][P_.task].x.push_back(score);
    record(m, cap_.f16_bytes(), stored, {{P_.task, score}}, out);
    if (a_.verbose_tasks && std::getenv("KVTC_EVAL_DUMP")) std::fprintf(stderr, "%s\n", text_of(*S_.model, P_.tokens).c_str());
    if (a_.verbose_tasks)
      std::fprintf(stderr, "[eval] %s %s: %s -> %.0f (wanted %s)\n", m.name().c_str(), P_.id.c_str(), out.c_str(), score,
                   P_.gen.answers.front().c_str());
  }

  const EvalArgs& a_;
  const EvalSetup& S_;
  EvalTally& T_;
  ContextSessions& sessions_;
  ContextScores& scores_;
  const uint32_t ctx_;
  const Prompt& P_;
  const uint32_t n_;  // prompt tokens
  KvCapture cap_;
  std::vector<int32_t> seq_;   // re-decoded after a restore: the last prompt token, then the continuation
  std::vector<float> direct_;  // text: the continuation's logits on the never-restored cache
  std::vector<float> ref_logits_;
  std::vector<int32_t> ref_greedy_;
  std::vector<std::string> wanted_;              // the scores a record must hold to stand in
  std::vector<const nlohmann::json*> recorded_;  // per method
  bool need_ref_ = false;
  std::string lines_;  // this prompt's new records
};

// One context's entry of the result: its prompts and, per method, the ratio,
// mean scores with their 95% half-widths and the paired difference against
// vanilla.
nlohmann::ordered_json context_result(uint32_t ctx, uint32_t n_samples, const std::vector<Prompt>& prompts, const EvalSetup& S,
                                      const std::vector<std::string>& cols, ContextScores& scores) {
  auto& sc = scores.sc;
  auto& bytes = scores.bytes;
  nlohmann::ordered_json cj;
  cj["context"] = ctx;
  cj["samples"] = n_samples;
  cj["prompts"] = nlohmann::json::array();
  for (const auto& p : prompts) cj["prompts"].push_back({{"task", p.task}, {"id", p.id}, {"tokens", p.tokens.size()}});
  cj["methods"] = nlohmann::json::array();
  const std::string ref = S.methods.front()->name();
  for (const auto& mm : S.methods) {
    const std::string& method = mm->name();
    nlohmann::ordered_json m;
    m["name"] = method;
    m["ratio"] = double(bytes[method].first) / double(bytes[method].second);
    if (mm->ratio_only()) {
      m["scores"] = nlohmann::json::object();  // ratio only
      cj["methods"].push_back(m);
      continue;
    }
    for (const std::string& t : cols) {
      m["scores"][t] = sc[method][t].mean();
      m["half_width"][t] = sc[method][t].half();
      if (t == "agree") m["scores"]["agree_all"] = sc[method]["agree_all"].mean();
      // Paired difference against vanilla, prompt by prompt.
      Stat d;
      for (size_t i = 0; i < sc[method][t].x.size(); ++i) d.x.push_back(sc[method][t].x[i] - sc[ref][t].x[i]);
      m["paired_diff"][t] = {{"mean", d.mean()}, {"half_width", d.half()}};
    }
    cj["methods"].push_back(m);
  }
  return cj;
}

// One context length: its prompts, every method on each, the summary.
nlohmann::ordered_json evaluate_context(const EvalArgs& a, const EvalSetup& S, const Corpus& corpus, const std::vector<std::string>& cols,
                                        uint32_t ctx, uint32_t n_samples, EvalTally& T, clock_type::time_point t_start) {
  const std::vector<Prompt> prompts = context_prompts(*S.model, corpus, a, ctx, n_samples);
  SessionOptions so;
  so.n_ctx = ctx + a.cont + std::max(a.greedy, 64u) + 16;
  ContextSessions sessions(*S.model, so, S.methods);
  ContextScores scores;
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const Prompt& P = prompts[pi];
    PromptEval pe(a, S, T, sessions, scores, ctx, P);
    if (pe.all_recorded() && pe.stand_in()) {  // its scores from the records, into the tables
      ++T.skipped;
      continue;
    }
    pe.run();
    std::fprintf(stderr, "[eval] context %u, prompt %zu/%zu (%s, %s) done, %.0f s\n", ctx, pi + 1, prompts.size(), P.task.c_str(), P.id.c_str(),
                 std::chrono::duration<double>(clock_type::now() - t_start).count());
  }
  return context_result(ctx, n_samples, prompts, S, cols, scores);
}

// The markdown tables: per context, per method the ratio and each column's
// mean ± half-width, with the paired difference against vanilla.
std::string markdown_tables(const nlohmann::ordered_json& result, const std::vector<std::string>& cols, uint32_t greedy) {
  std::ostringstream md;
  for (const auto& cj : result["contexts"]) {
    md << "\n### context " << cj["context"].get<uint32_t>() << " tokens, " << cj["samples"].get<uint32_t>()
       << " samples per task\n\n| method | ratio (whole cache) |";
    for (const auto& t : cols) md << " " << t << " |";
    md << "\n|---|---|";
    for (size_t i = 0; i < cols.size(); ++i) md << "---|";
    md << "\n";
    for (const auto& m : cj["methods"]) {
      char b[96];
      std::snprintf(b, sizeof b, "%.2fx", m["ratio"].get<double>());
      md << "| " << m["name"].get<std::string>() << " | " << b << " |";
      if (m["scores"].empty()) {  // lossless: ratio only
        for (size_t i = 0; i < cols.size(); ++i) md << " (lossless) |";
        md << "\n";
        continue;
      }
      for (const auto& t : cols) {
        const double v = m["scores"][t].get<double>(), h = m["half_width"][t].get<double>();
        if (t == "ppl" || t == "kld")
          std::snprintf(b, sizeof b, " %.4g ± %.2g", v, h);
        else
          std::snprintf(b, sizeof b, " %.1f ± %.1f", v, h);
        md << b;
        if (t == "agree") {
          std::snprintf(b, sizeof b, " (all %u: %.0f%%)", greedy, 100 * m["scores"]["agree_all"].get<double>());
          md << b;
        }
        if (m["name"] != cj["methods"][0]["name"] && t != "kld") {
          // Paired difference against vanilla: what a 1-point claim needs.
          std::snprintf(b, sizeof b, " [Δ %+.3g ± %.2g]", m["paired_diff"][t]["mean"].get<double>(), m["paired_diff"][t]["half_width"].get<double>());
          md << b;
        }
        md << " |";
      }
      md << "\n";
    }
  }
  return md.str();
}

int run_eval(const EvalArgs& a) {
  const auto t_start = clock_type::now();
  check_tasks(a);
  const std::vector<std::string> cols = result_columns(a);
  const EvalSetup S = load_setup(a);
  nlohmann::ordered_json result = result_header(a, S);
  const Corpus corpus = Corpus::load(a.corpus);
  EvalTally T;
  if (!a.records.empty()) T.have = read_records(a.records);
  require(a.samples.size() == 1 || a.samples.size() == a.contexts.size(), "eval: --samples takes one count or one per --context");
  for (size_t ci = 0; ci < a.contexts.size(); ++ci) {
    const uint32_t ctx = a.contexts[ci], n_samples = a.samples[a.samples.size() == 1 ? 0 : ci];
    result["contexts"].push_back(evaluate_context(a, S, corpus, cols, ctx, n_samples, T, t_start));
  }
  if (!a.records.empty()) {
    result["records"] = a.records;
    result["prompts_already_recorded"] = T.skipped;
    result["method_results_reused"] = T.reused;
    std::fprintf(stderr, "[eval] %zu prompts were in %s already (skipped); %zu results of single methods on other prompts were reused\n", T.skipped,
                 a.records.c_str(), T.reused);
  }
  // A sliding-window model's window cells come back in position order where
  // llama.cpp kept a ring: attention adds the same terms in another order,
  // so its vanilla restore is not bit for bit (and not an error).
  const bool two_blocks = S.model->info().n_swa > 0;
  result["vanilla_equals_no_restore"] = T.vanilla_compared ? nlohmann::json(T.vanilla_exact) : nlohmann::json(nullptr);
  result["seconds"] = std::chrono::duration<double>(clock_type::now() - t_start).count();
  if (!a.out_json.empty()) {
    const std::string js = result.dump(1) + "\n";
    write_file_atomic(a.out_json, {reinterpret_cast<const uint8_t*>(js.data()), js.size()});
  }
  const std::string md = markdown_tables(result, cols, a.greedy);
  if (!a.out_md.empty()) write_file_atomic(a.out_md, {reinterpret_cast<const uint8_t*>(md.data()), md.size()});
  if (a.json)
    std::printf("%s\n", result.dump(2).c_str());
  else
    std::printf("%s\nvanilla restore equals no restore (logits bit for bit): %s\n", md.c_str(),
                !T.vanilla_compared ? "not compared (every text prompt from the records)"
                : T.vanilla_exact   ? "yes"
                : two_blocks        ? "no (a sliding-window model: its window's cells are restored in another order)"
                                    : "NO");
  return T.vanilla_exact || two_blocks ? 0 : 3;
}

}  // namespace

Action add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  a->model = default_model();
  a->corpus = default_corpus();
  CLI::App* sub =
      app.add_subcommand("eval", "Quality after compress -> restore -> continue (ppl, kld, agree, niah, vt, kvr, code), method by method");
  model_option(sub, a->model, "GGUF model");
  sub->add_option("--calib", a->calib, "Calibration file (needed by kvtc and svd methods)");
  sub->add_option("--calib-extra", a->calib_extra, "More calibrations as NAME=FILE, used by kvtc-<R>x@NAME (ablations)");
  sub->add_option("--precision", a->precision,
                  "The projection's precision for kvtc methods without a -f32/-bf16/-int8 suffix (auto picks by CPU: pin it to "
                  "continue a record set on another CPU)")
      ->capture_default_str();
  sub->add_option("--corpus", a->corpus, "Corpus root")->capture_default_str();
  sub->add_option("--tasks", a->tasks, "Tasks: ppl, kld, agree (real text); niah, vt, kvr (retrieval); code (next-line completion)")
      ->capture_default_str();
  sub->add_option("--methods", a->methods, std::string("Methods (vanilla first, the reference): ") + kMethodHelp)->capture_default_str();
  sub->add_option("--context", a->contexts, "Context lengths in tokens")->capture_default_str();
  sub->add_option("--samples", a->samples, "Samples per task: one count, or one per --context")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--continuation", a->cont, "Teacher-forced tokens scored after the context")->capture_default_str()->check(CLI::Range(2, 4096));
  sub->add_option("--greedy", a->greedy, "Greedy tokens compared for `agree`")->capture_default_str()->check(CLI::Range(1, 1024));
  sub->add_option("--seed", a->seed, "Seed for document and window choice")->capture_default_str();
  sub->add_option("--out-json", a->out_json, "Write the JSON result here");
  sub->add_option("--out-md", a->out_md, "Write the markdown table here");
  sub->add_option("--records", a->records,
                  "Append one JSON line per prompt and method here; a (prompt, method) already recorded is not recomputed, its "
                  "recorded scores stand in (resume, or add a method)");
  sub->add_option("--record-tag", a->record_tag, "Stored in each new record as \"run\" (commit, machine)");
  sub->add_flag("--json", a->json, "Print JSON instead of the table");
  sub->add_flag("--show-generations", a->verbose_tasks, "Print each retrieval generation and its score to stderr");
  return [a] { return run_eval(*a); };
}

}  // namespace kvtc::lab
