// kvtc info: what this kvtc is built from and what it would use.
// kvtc tokens: token counts of text files under a model's tokenizer.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvtc/codec.h"
#include "kvtc/corpus.h"
#include "kvtc/error.h"
#include "kvtc/files.h"
#include "kvtc/llama.h"

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
    for (const BlockGeometry& b : m->geometry().blocks) feat += b.features();
    j["kv_features_per_token"] = feat;  // p of docs/method.md, keys (values alike), all blocks
    j["kv_f16_bytes_per_token"] = feat * 2 * 2;
  } catch (const Error& e) {
    j["exists"] = false;
    j["error"] = e.what();
  }
  return j;
}

nlohmann::ordered_json corpus_summary(const std::string& root) {
  nlohmann::ordered_json j;
  j["root"] = root;
  j["manifest"] = root + "/manifest.json";
  if (!std::filesystem::exists(root + "/manifest.json")) {
    j["built"] = false;
    return j;
  }
  j["built"] = true;
  try {
    const Corpus corpus = Corpus::load(root);
    std::map<std::string, std::map<std::string, std::pair<int, long>>> agg;  // split -> kind -> (docs, tokens)
    for (const char* split : {"calib", "eval"})
      for (const CorpusDoc& d : corpus.docs(split)) {
        auto& e = agg[d.split][d.kind];
        e.first += 1;
        e.second += long(d.tokens);
      }
    for (const auto& [split, kinds] : agg) {
      nlohmann::ordered_json s;
      s["path"] = root + "/" + split;
      for (const auto& [kind, e] : kinds) s["kinds"][kind] = {{"documents", e.first}, {"tokens", e.second}};
      j[split] = s;
    }
  } catch (const Error& e) {
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
  model_option(sub, *model, "Model to describe");
  return [json, model] {
    nlohmann::ordered_json j;
    const LibraryInfo li = library_info();
    j["kvtc_version"] = li.version;
    j["llama_cpp_commit"] = kLlamaCppCommit;
    j["llama_cpp_cpu"] = llama_cpu_build();
    j["llama_cpp_cpu_variants"] = llama_cpu_variants();
    j["default_model"] = model_summary(*model);
    nlohmann::ordered_json named = nlohmann::ordered_json::array();
    for (const NamedModel& m : named_models())
      named.push_back({{"name", m.name}, {"path", m.path}, {"what", m.what}, {"present", m.present}, {"fetched_by", m.how}});
    j["models"] = named;
    j["corpus"] = corpus_summary(default_corpus());
    j["cpu"] = {{"brand", li.cpu}, {"features", li.cpu_features}};
    j["bf16_projection"] = li.bf16 ? li.bf16_projection : "unavailable: " + li.bf16_projection;
    j["int8_projection"] = li.int8 ? li.int8_projection : "unavailable: " + li.int8_projection;
    j["auto_precision"] = {{"encode", precision_name(li.auto_encode)}, {"decode", precision_name(li.auto_decode)}};
    if (*json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::string variants;
      for (const std::string& v : llama_cpu_variants()) variants += (variants.empty() ? "" : " ") + v;
      std::printf("kvtc %s (llama.cpp %s, CPU code: %s, %s among %s)\n", li.version.c_str(), kLlamaCppCommit, llama_cpu_build().c_str(),
                  llama_cpu_requested().empty() ? "ggml's run-time choice" : "KVTC_GGML_CPU's", variants.c_str());
      const auto& m = j["default_model"];
      std::printf("model   %s\n", m["path"].get<std::string>().c_str());
      if (m["exists"].get<bool>())
        std::printf("        %s: %s, %u layers, %u KV heads x %u dims, context %u, RoPE %s\n", m["name"].get<std::string>().c_str(),
                    m["desc"].get<std::string>().c_str(), m["n_layer"].get<unsigned>(), m["n_head_kv"].get<unsigned>(), m["head_dim"].get<unsigned>(),
                    m["n_ctx_train"].get<unsigned>(), m["rope_type"].get<std::string>().c_str());
      else
        std::printf("        unavailable: %s\n", m["error"].get<std::string>().c_str());
      for (const auto& m : j["models"])
        std::printf(
            "%-7s %-8s %s: %s\n", &m == &j["models"][0] ? "models" : "", m["name"].get<std::string>().c_str(), m["what"].get<std::string>().c_str(),
            m["present"].get<bool>() ? m["path"].get<std::string>().c_str() : ("not fetched (" + m["fetched_by"].get<std::string>() + ")").c_str());
      std::printf("corpus  %s (%s)\n", j["corpus"]["root"].get<std::string>().c_str(),
                  j["corpus"]["built"].get<bool>() ? "built" : "not built: make corpus");
      std::string feats;
      for (const auto& s : li.cpu_features) feats += s + " ";
      std::printf("cpu     %s\n        %s\n", li.cpu.c_str(), feats.c_str());
      std::printf("        projection: bf16 %s; int8 %s; auto: encode %s, decode %s\n", j["bf16_projection"].get<std::string>().c_str(),
                  j["int8_projection"].get<std::string>().c_str(), precision_name(li.auto_encode), precision_name(li.auto_decode));
    }
    return 0;
  };
}

Action add_tokens(CLI::App& app) {
  auto files = std::make_shared<std::vector<std::string>>();
  auto model = std::make_shared<std::string>(default_model());
  CLI::App* sub = app.add_subcommand("tokens", "Count tokens of text files (JSON lines: path, tokens)");
  sub->add_option("files", *files, "Text files")->required();
  model_option(sub, *model, "Tokenizer model");
  return [files, model] {
    auto m = Model::load(*model, /*vocab_only=*/true);
    for (const auto& p : *files) {
      const std::vector<uint8_t> raw = read_file(p);
      const size_t n = m->tokenize(std::string(raw.begin(), raw.end())).size();
      std::printf("%s\n", nlohmann::json({{"path", p}, {"tokens", n}}).dump().c_str());
    }
    return 0;
  };
}

}  // namespace kvtc::cli
