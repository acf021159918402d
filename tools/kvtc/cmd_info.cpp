// kvtc info: what this kvtc is built from and what it would use.
// kvtc tokens: token counts of text files under a model's tokenizer.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvtc/error.h"
#include "kvtc/llama_session.h"
#include "kvtc/util.h"

namespace kvtc::cli {

namespace {

nlohmann::ordered_json model_summary(const std::string& path) {
  nlohmann::ordered_json j;
  j["path"] = path;
  try {
    auto m = Model::load(path);  // weights are mmapped: ~0.1 s
    const ModelInfo& mi = m->info();
    j["exists"] = true;
    j["name"] = mi.name;
    j["arch"] = mi.arch;
    j["desc"] = mi.desc;
    j["file_bytes"] = mi.file_size;
    j["n_layer"] = mi.n_layer;
    j["n_head"] = mi.n_head;
    j["n_head_kv"] = mi.n_head_kv;
    j["head_dim"] = mi.head_dim_k;
    j["n_embd"] = mi.n_embd;
    j["n_ctx_train"] = mi.n_ctx_train;
    j["n_vocab"] = mi.n_vocab;
    j["rope_type"] = mi.rope_type;
    j["n_rot"] = mi.n_rot;
    j["rope_freq_base"] = mi.rope_freq_base;
    j["rope_freq_scale"] = mi.rope_freq_scale;
    j["rope_freq_factors"] = mi.rope_freq_factors.size();
    j["n_swa"] = mi.n_swa;
    uint64_t feat = 0;
    for (const auto& bl : m->geometry().block_layers) feat += bl.size();
    j["kv_features_per_token"] = feat * mi.n_head_kv * mi.head_dim_k;  // p of method.md, keys (values alike)
    j["kv_f16_bytes_per_token"] = feat * mi.n_head_kv * mi.head_dim_k * 2 * 2;
  } catch (const Error& e) {
    j["exists"] = false;
    j["error"] = e.what();
  }
  return j;
}

nlohmann::ordered_json corpus_summary(const std::string& root) {
  nlohmann::ordered_json j;
  j["root"] = root;
  const std::string manifest = root + "/manifest.json";
  j["manifest"] = manifest;
  std::ifstream f(manifest);
  if (!f) {
    j["built"] = false;
    return j;
  }
  j["built"] = true;
  try {
    nlohmann::json m = nlohmann::json::parse(f);
    std::map<std::string, std::map<std::string, std::pair<int, long>>> agg;  // split -> kind -> (docs, tokens)
    for (const auto& d : m.at("documents")) {
      auto& e = agg[d.at("split").get<std::string>()][d.at("kind").get<std::string>()];
      e.first += 1;
      e.second += d.at("tokens").get<long>();
    }
    for (const auto& [split, kinds] : agg) {
      nlohmann::ordered_json s;
      s["path"] = root + "/" + split;
      for (const auto& [kind, e] : kinds) s["kinds"][kind] = {{"documents", e.first}, {"tokens", e.second}};
      j[split] = s;
    }
  } catch (const std::exception& e) {
    j["error"] = std::string("manifest unreadable: ") + e.what();
  }
  return j;
}

}  // namespace

Action add_info(CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  auto model = std::make_shared<std::string>(default_model());
  CLI::App* sub = app.add_subcommand("info", "Version, llama.cpp commit, default model, corpus and CPU features");
  sub->add_flag("--json", *json, "JSON output");
  sub->add_option("-m,--model", *model, "Model to describe")->capture_default_str();
  return [json, model] {
    nlohmann::ordered_json j;
    j["kvtc_version"] = KVTC_VERSION;
    j["llama_cpp_commit"] = kLlamaCppCommit;
    j["default_model"] = model_summary(*model);
    j["corpus"] = corpus_summary(default_corpus());
    const CpuFeatures& f = cpu_features();
    j["cpu"] = {{"brand", f.brand}, {"features", cpu_feature_names(f)}};
    if (*json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("kvtc %s (llama.cpp %s)\n", KVTC_VERSION, kLlamaCppCommit);
      const auto& m = j["default_model"];
      std::printf("model   %s\n", m["path"].get<std::string>().c_str());
      if (m["exists"].get<bool>())
        std::printf("        %s: %s, %u layers, %u KV heads x %u dims, context %u, RoPE %s\n", m["name"].get<std::string>().c_str(),
                    m["desc"].get<std::string>().c_str(), m["n_layer"].get<unsigned>(), m["n_head_kv"].get<unsigned>(), m["head_dim"].get<unsigned>(),
                    m["n_ctx_train"].get<unsigned>(), m["rope_type"].get<std::string>().c_str());
      else
        std::printf("        unavailable: %s\n", m["error"].get<std::string>().c_str());
      std::printf("corpus  %s (%s)\n", j["corpus"]["root"].get<std::string>().c_str(),
                  j["corpus"]["built"].get<bool>() ? "built" : "not built: make corpus");
      std::string feats;
      for (const auto& s : cpu_feature_names(f)) feats += s + " ";
      std::printf("cpu     %s\n        %s\n", f.brand.c_str(), feats.c_str());
    }
    return 0;
  };
}

Action add_tokens(CLI::App& app) {
  auto files = std::make_shared<std::vector<std::string>>();
  auto model = std::make_shared<std::string>(default_model());
  CLI::App* sub = app.add_subcommand("tokens", "Count tokens of text files (JSON lines: path, tokens)");
  sub->add_option("files", *files, "Text files")->required();
  sub->add_option("-m,--model", *model, "Tokenizer model")->capture_default_str();
  return [files, model] {
    auto m = Model::load(*model, /*vocab_only=*/true);
    for (const auto& p : *files) {
      std::vector<uint8_t> raw = read_file(p);
      size_t n = m->tokenize(std::string(raw.begin(), raw.end())).size();
      std::printf("%s\n", nlohmann::json({{"path", p}, {"tokens", n}}).dump().c_str());
    }
    return 0;
  };
}

}  // namespace kvtc::cli
