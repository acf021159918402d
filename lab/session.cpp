// kvtc-lab session: a multi-turn chat, played twice on the same model. Between
// turns the session is idle: path "kvtc" compresses its cache to a .kvtc
// file and frees the context; the next turn restores it from the file and
// decodes only the new message. Path "recompute" keeps nothing and
// prefills the whole history again. Per turn: time to first token of
// both, bytes at rest, and whether the replies match.
//
// The user messages are real text of the evaluation split, a slice per
// turn, wrapped in the model's ChatML turns (SmolLM2-Instruct's template).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvtc/corpus.h"
#include "kvtc/kvtc.h"
#include "kvtc/llama.h"
#include "lab.h"

namespace kvtc::lab {

namespace {

struct SessionArgs {
  std::string model, calib, corpus, text, out_dir = "out/session";
  double ratio = 16;
  uint32_t turns = 4, turn_tokens = 400, reply = 32;
  bool json = false;
};

// Generates up to n greedy tokens (stops after an end-of-generation token)
// and leaves every generated token in the cache.
std::vector<int32_t> reply_tokens(Session& s, const Model& m, uint32_t n) {
  std::vector<int32_t> out;
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t t = s.argmax();
    out.push_back(t);
    s.decode({t}, s.pos_max() + 1);
    if (m.is_eog(t)) break;
  }
  return out;
}

int run_session(const SessionArgs& a) {
  using clk = std::chrono::steady_clock;
  auto model = Model::load(a.model);
  Calibration cal = calibration_load(a.calib);
  std::string text_file = a.text;
  if (text_file.empty()) {  // the first long evaluation prose document
    const std::vector<CorpusDoc> docs = Corpus::load(a.corpus).docs("eval", {"prose"}, uint64_t(a.turns) * a.turn_tokens);
    require(!docs.empty(), "session: no evaluation prose document is long enough; pass --text");
    text_file = docs.front().path;
  }
  std::vector<uint8_t> raw = read_file(text_file);
  const std::vector<int32_t> doc = model->tokenize(std::string(raw.begin(), raw.end()), false, false);
  require(doc.size() >= size_t(a.turns) * a.turn_tokens, text_file + ": shorter than turns x turn-tokens");
  std::filesystem::create_directories(a.out_dir);

  SessionOptions so;
  so.n_ctx = std::min(model->info().n_ctx_train, a.turns * (a.turn_tokens + a.reply + 64) + 64);
  Session sk(*model, so), sr(*model, so);  // kvtc path, recompute path
  std::vector<int32_t> hist_k, hist_r;     // each path's own history (its own replies)
  const std::vector<int32_t> bos = model->tokenize("", true, false);
  hist_k = hist_r = bos;
  const AllocationSet al = allocation_set(cal, a.ratio);
  nlohmann::ordered_json J;
  J["model"] = model->info().path;
  J["calibration"] = a.calib;
  J["nominal_ratio"] = a.ratio;
  J["text"] = text_file;
  J["turns"] = nlohmann::json::array();
  std::string kvtc_file;
  int matched_turns = 0;
  for (uint32_t k = 0; k < a.turns; ++k) {
    std::vector<int32_t> slice(doc.begin() + k * a.turn_tokens, doc.begin() + (k + 1) * a.turn_tokens);
    const std::string msg = "<|im_start|>user\nHere is part " + std::to_string(k + 1) + " of a text:\n\n" + text_of(*model, slice) +
                            "\n\nWhat happens in this part? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n";
    const std::vector<int32_t> user = model->tokenize(msg, false, true);
    nlohmann::ordered_json T;
    T["turn"] = k + 1;
    T["user_tokens"] = user.size();
    // kvtc path: restore the idle cache from its file, decode the message.
    auto t0 = clk::now();
    double restore_ms = 0;
    if (!kvtc_file.empty()) {
      KvCapture back = decompress(read_file(kvtc_file), cal, kvtc_file);
      sk.restore(back);
      restore_ms = ms_since(t0);
    } else {
      sk.clear();
      if (!bos.empty()) sk.decode(bos, 0);
    }
    sk.decode(user, int32_t(hist_k.size()));
    const double ttft_k = ms_since(t0);
    hist_k.insert(hist_k.end(), user.begin(), user.end());
    // Recompute path: the whole history again.
    t0 = clk::now();
    sr.clear();
    std::vector<int32_t> all = hist_r;
    all.insert(all.end(), user.begin(), user.end());
    sr.decode(all, 0);
    const double ttft_r = ms_since(t0);
    hist_r = all;
    const std::vector<int32_t> rk = reply_tokens(sk, *model, a.reply), rr = reply_tokens(sr, *model, a.reply);
    hist_k.insert(hist_k.end(), rk.begin(), rk.end());
    hist_r.insert(hist_r.end(), rr.begin(), rr.end());
    // The session goes idle: compress the cache to disk, free the context.
    t0 = clk::now();
    KvCapture cap = sk.capture();
    cap.tokens = hist_k;
    std::vector<uint8_t> bytes = compress(cap, cal, al);
    kvtc_file = a.out_dir + "/turn" + std::to_string(k + 1) + ".kvtc";
    write_file_atomic(kvtc_file, bytes);
    const double store_ms = ms_since(t0);
    sk.clear();
    const bool same = rk == rr;
    matched_turns += same;
    uint32_t agree = 0;
    while (agree < rk.size() && agree < rr.size() && rk[agree] == rr[agree]) ++agree;
    T["history_tokens"] = hist_k.size();
    T["ttft_kvtc_ms"] = ttft_k;
    T["restore_ms"] = restore_ms;
    T["ttft_recompute_ms"] = ttft_r;
    T["store_ms"] = store_ms;
    T["f16_bytes"] = cap.f16_bytes_per_token() * hist_k.size();
    T["kvtc_bytes"] = bytes.size();
    T["reply_kvtc"] = text_of(*model, rk);
    T["reply_recompute"] = text_of(*model, rr);
    T["replies_equal"] = same;
    T["tokens_equal_before_first_difference"] = agree;
    if (!a.json) {
      std::printf("turn %u: history %zu tokens (+%zu new)\n", k + 1, hist_k.size(), user.size());
      if (k == 0)
        std::printf("  first turn: both paths prefill the message (%.0f ms / %.0f ms)\n", ttft_k, ttft_r);
      else
        std::printf("  time to first token: restore from .kvtc + new message %.0f ms (restore %.0f ms) | recompute all %.0f ms  -> %.1fx\n", ttft_k,
                    restore_ms, ttft_r, ttft_r / ttft_k);
      std::printf("  at rest: %.2f MB f16 -> %.2f MB .kvtc (%.1fx), stored in %.0f ms\n", T["f16_bytes"].get<uint64_t>() / 1e6, bytes.size() / 1e6,
                  double(T["f16_bytes"].get<uint64_t>()) / bytes.size(), store_ms);
      std::printf("  reply (kvtc):      %s\n", T["reply_kvtc"].get<std::string>().c_str());
      std::printf("  reply (recompute): %s\n", T["reply_recompute"].get<std::string>().c_str());
      std::printf("  replies %s (%u tokens equal before the first difference)\n", same ? "match" : "differ", agree);
    }
    J["turns"].push_back(T);
  }
  J["replies_matching"] = matched_turns;
  if (a.json)
    std::printf("%s\n", J.dump(2).c_str());
  else
    std::printf("replies matching: %d of %u turns\n", matched_turns, a.turns);
  return 0;
}

}  // namespace

Action add_session(CLI::App& app) {
  auto a = std::make_shared<SessionArgs>();
  a->model = default_model();
  a->corpus = default_corpus();
  CLI::App* sub = app.add_subcommand("session", "Multi-turn chat: restore each turn's cache from .kvtc vs recompute the history");
  model_option(sub, a->model, "GGUF model (a chat model with ChatML turns)");
  sub->add_option("--calib", a->calib, "Calibration file")->required();
  sub->add_option("--corpus", a->corpus, "Corpus root")->capture_default_str();
  sub->add_option("--text", a->text, "Text to discuss (default: an evaluation prose document)");
  sub->add_option("-r,--ratio", a->ratio, "Nominal compression ratio")->capture_default_str()->check(CLI::Range(1.0, 4096.0));
  sub->add_option("--turns", a->turns, "Turns")->capture_default_str()->check(CLI::Range(1, 64));
  sub->add_option("--turn-tokens", a->turn_tokens, "Text tokens per user message")->capture_default_str()->check(CLI::Range(16, 8192));
  sub->add_option("--reply", a->reply, "Greedy reply tokens at most")->capture_default_str()->check(CLI::Range(1, 1024));
  sub->add_option("-o,--out-dir", a->out_dir, "Where the per-turn .kvtc files go")->capture_default_str();
  sub->add_flag("--json", a->json, "Print JSON");
  return [a] { return run_session(*a); };
}

}  // namespace kvtc::lab
