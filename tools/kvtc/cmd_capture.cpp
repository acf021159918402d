// kvtc capture: run a model over a text and write its KV cache to a
// safetensors capture file (docs/capture-format.md).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvtc/cache.h"
#include "kvtc/error.h"
#include "kvtc/files.h"
#include "kvtc/llama.h"

namespace kvtc::cli {

namespace {

struct CaptureArgs {
  std::string model, text, out;
  int64_t max_tokens = 0;
  uint32_t n_ctx = 0;
  std::string flash_attn = "on";
  int threads = 0;
  bool json = false;
};

int run_capture(const CaptureArgs& a) {
  using clock = std::chrono::steady_clock;
  std::vector<uint8_t> raw = read_file(a.text);
  require(!raw.empty(), a.text + ": the text file is empty");
  std::string text(raw.begin(), raw.end());
  // Fail on an unwritable destination before minutes of prefill.
  {
    namespace fs = std::filesystem;
    fs::path dir = fs::path(a.out).parent_path();
    std::error_code ec;
    if (dir.empty()) dir = ".";
    require(fs::is_directory(dir, ec), a.out + ": output directory " + dir.string() + " does not exist");
    require(!fs::is_directory(a.out, ec), a.out + ": is a directory, expected a file path");
  }
  auto model = Model::load(a.model);
  const ModelInfo& mi = model->info();
  std::vector<int32_t> tokens = model->tokenize(text);
  const size_t n_text = tokens.size();
  require(n_text > 0, a.text + ": the text tokenizes to no tokens");
  SessionOptions so;
  so.n_ctx = a.n_ctx ? a.n_ctx : mi.n_ctx_train;
  so.flash_attn = a.flash_attn == "on";
  so.n_threads = a.threads;
  if (a.max_tokens > 0 && size_t(a.max_tokens) < tokens.size()) tokens.resize(size_t(a.max_tokens));
  require(tokens.size() <= so.n_ctx, a.text + ": the text has " + std::to_string(tokens.size()) + " tokens, more than the context of " +
                                         std::to_string(so.n_ctx) + " tokens (" + (a.n_ctx ? "--ctx" : "the model's trained context") +
                                         "); pass --max-tokens N to keep the first N");
  Session s(*model, so);
  auto t0 = clock::now();
  s.decode(tokens, 0);
  const double prefill_ms = ms_since(t0);
  t0 = clock::now();
  KvCapture c = s.capture();
  const double state_ms = ms_since(t0);
  c.tokens = tokens;  // cells are in position order in a fresh single-sequence context
  for (size_t i = 0; i < c.blocks[0].pos.size(); ++i)
    require(c.blocks[0].pos[i] == int32_t(i), "capture: unexpected cell order in a fresh context (cell " + std::to_string(i) + " holds position " +
                                                  std::to_string(c.blocks[0].pos[i]) + ")");
  c.meta["source_text"] = std::filesystem::path(a.text).filename().string();
  c.meta["source_text_sha256"] = sha256_file(a.text);
  c.meta["text_tokens"] = std::to_string(n_text);
  c.meta["next_token"] = std::to_string(s.argmax());
  t0 = clock::now();
  capture_save(a.out, c);
  const double write_ms = ms_since(t0);
  const uint64_t file_bytes = std::filesystem::file_size(a.out);
  const uint64_t bpt = c.f16_bytes_per_token();
  const double tok_s = tokens.size() / (prefill_ms / 1000.0);
  if (a.json) {
    nlohmann::ordered_json j;
    j["output"] = a.out;
    j["model"] = mi.path;
    j["arch"] = mi.arch;
    j["tokens"] = tokens.size();
    j["text_tokens"] = n_text;
    j["n_ctx"] = s.n_ctx();
    j["flash_attn"] = so.flash_attn;
    j["bytes_per_token"] = bpt;
    j["kv_bytes"] = bpt * tokens.size();
    j["file_bytes"] = file_bytes;
    j["prefill_ms"] = prefill_ms;
    j["prefill_tokens_per_s"] = tok_s;
    j["state_get_ms"] = state_ms;
    j["write_ms"] = write_ms;
    j["blocks"] = nlohmann::json::array();
    for (const KvBlock& b : c.blocks)
      j["blocks"].push_back({{"n_layer", b.n_layer()}, {"n_head_kv", b.n_head_kv}, {"n_tokens", b.n_tokens()}, {"head_dim", b.head_dim}});
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("captured %zu tokens of %s with %s (%s)\n", tokens.size(), a.text.c_str(), mi.name.empty() ? mi.arch.c_str() : mi.name.c_str(),
                mi.desc.c_str());
    for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
      const KvBlock& b = c.blocks[bi];
      std::printf("  block %zu: %u layers x %u KV heads x %u tokens x %u dims (f16)\n", bi, b.n_layer(), b.n_head_kv, b.n_tokens(), b.head_dim);
    }
    std::printf("  bytes per token  %llu (K+V, f16, all layers)\n", (unsigned long long)bpt);
    std::printf("  prefill          %.1f ms (%.0f tokens/s, n_ctx %u, flash attention %s)\n", prefill_ms, tok_s, s.n_ctx(),
                so.flash_attn ? "on" : "off");
    std::printf("  state get        %.1f ms; file write %.1f ms\n", state_ms, write_ms);
    std::printf("  wrote %s (%.2f MiB)\n", a.out.c_str(), file_bytes / 1048576.0);
  }
  return 0;
}

}  // namespace

Action add_capture(CLI::App& app) {
  auto a = std::make_shared<CaptureArgs>();
  CLI::App* sub = app.add_subcommand("capture", "Run a model over a text and write its KV cache (safetensors)");
  a->model = default_model();
  model_option(sub, a->model, "GGUF model");
  sub->add_option("-t,--text", a->text, "UTF-8 text file to prefill")->required();
  sub->add_option("-o,--output", a->out, "Output .safetensors path")->required();
  sub->add_option("--max-tokens", a->max_tokens, "Keep only the first N tokens of the text")->check(CLI::PositiveNumber);
  sub->add_option("--ctx", a->n_ctx, "Context size in tokens (default: the model's trained context)")->check(CLI::PositiveNumber);
  sub->add_option("--flash-attn", a->flash_attn, "Flash attention (decides llama.cpp's V layout)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  sub->add_option("--threads", a->threads, "Threads (default: all)");
  sub->add_flag("--json", a->json, "Print a JSON summary");
  return [a] { return run_capture(*a); };
}

}  // namespace kvtc::cli
