// kvtc restore: load a capture into a fresh llama.cpp sequence and continue
// generating from it; --verify recomputes the prefix for comparison.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvtc/cache.h"
#include "kvtc/error.h"
#include "kvtc/llama.h"

namespace kvtc::cli {

namespace {

struct RestoreArgs {
  std::string model, in;
  int generate = 32;
  bool verify = false;
  bool json = false;
  int threads = 0;
  bool ignore_model_hash = false;
  uint32_t n_ctx = 0;
};

int run_restore(const RestoreArgs& a) {
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  KvCapture c = capture_load(a.in);
  const double load_ms = ms_since(t0);
  require(!c.tokens.empty(), a.in + ": tensor 'tokens' is missing; restore needs the token ids to continue");
  auto model = Model::load(a.model);
  if (!a.ignore_model_hash) {
    const std::string& want = c.model_sha256;
    require(want == model->sha256(), a.in + ": captured with a model of sha256 " + want + ", but " + a.model + " has sha256 " + model->sha256() +
                                         " (wrong model; --ignore-model-hash to force)");
  }
  SessionOptions so;
  so.n_ctx = a.n_ctx;
  if (!so.n_ctx && c.meta.count("n_ctx")) {
    const std::string& v = c.meta.at("n_ctx");
    char* end = nullptr;
    unsigned long x = std::strtoul(v.c_str(), &end, 10);
    require(!v.empty() && *end == '\0' && x > 0 && x <= (1ul << 24), a.in + ": __metadata__['n_ctx'] is '" + v + "', expected a positive integer");
    so.n_ctx = uint32_t(x);
  }
  so.flash_attn = !c.meta.count("flash_attn") || c.meta.at("flash_attn") == "enabled";
  so.n_threads = a.threads;
  const int32_t n = int32_t(c.tokens.size());
  require(uint64_t(n) + uint64_t(std::max(a.generate, 0)) <= (so.n_ctx ? so.n_ctx : model->info().n_ctx_train),
          a.in + ": " + std::to_string(n) + " cached tokens + " + std::to_string(a.generate) + " to generate exceed the context (pass --ctx)");
  Session s(*model, so);
  t0 = clock::now();
  s.restore(c);
  const double restore_ms = ms_since(t0);
  // Logits are not part of llama.cpp's state: drop the last position and
  // decode its token again, as llama.cpp's server does after a slot restore.
  t0 = clock::now();
  s.remove_from(n - 1);
  s.decode({c.tokens.back()}, n - 1);
  const double redecode_ms = ms_since(t0);
  std::vector<int32_t> gen = s.greedy(a.generate);

  nlohmann::ordered_json j;
  j["input"] = a.in;
  j["tokens"] = n;
  j["capture_load_ms"] = load_ms;
  j["restore_ms"] = restore_ms;
  j["first_logits_ms"] = redecode_ms;
  j["generated"] = text_of(*model, gen);
  int agree = -1;
  double max_dlogit = 0;
  double recompute_ms = 0;
  if (a.verify) {
    Session r(*model, so);
    std::vector<int32_t> prefix(c.tokens.begin(), c.tokens.end() - 1);
    t0 = clock::now();
    if (!prefix.empty()) r.decode(prefix, 0);
    r.decode({c.tokens.back()}, n - 1);
    recompute_ms = ms_since(t0);
    // Compare first-step logits (same single-token decode on both sides).
    s.remove_from(n - 1);
    s.decode({c.tokens.back()}, n - 1);
    const float* la = s.last_logits();
    const float* lb = r.last_logits();
    for (uint32_t i = 0; i < model->info().n_vocab; ++i) max_dlogit = std::max(max_dlogit, double(std::fabs(la[i] - lb[i])));
    std::vector<int32_t> ref = r.greedy(a.generate);
    agree = 0;
    while (agree < int(ref.size()) && ref[agree] == gen[agree]) ++agree;
    j["recompute_ms"] = recompute_ms;
    j["speedup"] = recompute_ms / (restore_ms + redecode_ms);
    j["max_abs_logit_diff"] = max_dlogit;
    j["greedy_agree"] = agree;
    j["greedy_total"] = a.generate;
  }
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("restored %d tokens from %s into a fresh sequence\n", n, a.in.c_str());
    std::printf("  capture load %.1f ms, state restore %.1f ms, first logits %.1f ms\n", load_ms, restore_ms, redecode_ms);
    std::printf("  greedy continuation (%d tokens): %s\n", a.generate, j["generated"].get<std::string>().c_str());
    if (a.verify) {
      std::printf("  recompute of the prefix: %.1f ms (restore + first logits is %.1fx faster)\n", recompute_ms,
                  recompute_ms / (restore_ms + redecode_ms));
      std::printf("  max |logit difference| vs recompute: %g; greedy tokens matching: %d of %d\n", max_dlogit, agree, a.generate);
    }
  }
  return a.verify && agree != a.generate ? 3 : 0;
}

}  // namespace

Action add_restore(CLI::App& app) {
  auto a = std::make_shared<RestoreArgs>();
  CLI::App* sub = app.add_subcommand("restore", "Load a capture into llama.cpp and continue generating");
  a->model = default_model();
  sub->add_option("input", a->in, "Capture file (.safetensors) from `kvtc capture`")->required();
  model_option(sub, a->model, "GGUF model (must be the one the capture came from)");
  sub->add_option("-n,--generate", a->generate, "Greedy tokens to generate after the restore")->check(CLI::Range(1, 4096))->capture_default_str();
  sub->add_flag("--verify", a->verify, "Also recompute the prefix and compare logits and greedy tokens (exit 3 on a mismatch)");
  sub->add_flag("--ignore-model-hash", a->ignore_model_hash, "Restore even if the model file's sha256 differs from the capture's");
  sub->add_option("--ctx", a->n_ctx, "Context size (default: the capture's n_ctx)")->check(CLI::PositiveNumber);
  sub->add_option("--threads", a->threads, "Threads (default: all)");
  sub->add_flag("--json", a->json, "Print a JSON summary");
  return [a] { return run_restore(*a); };
}

}  // namespace kvtc::cli
