// kvtc — KV Cache Transform Coding. Entry point of the command-line tool.
#include <cstdio>
#include <cstdlib>
#include <map>

#include "commands.h"
#include "kvtc/codec.h"
#include "kvtc/error.h"
#include "kvtc/llama.h"

namespace kvtc::cli {

std::string default_model() {
  const char* e = std::getenv("KVTC_MODEL");
  return e && *e ? e : KVTC_DEFAULT_MODEL;
}

std::string default_corpus() {
  const char* e = std::getenv("KVTC_CORPUS");
  return e && *e ? e : KVTC_DEFAULT_CORPUS;
}

}  // namespace kvtc::cli

int main(int argc, char** argv) {
  using namespace kvtc::cli;
  CLI::App app{"kvtc — KV Cache Transform Coding: compress an LLM's idle KV cache and restore it\n(evaluation, benchmarks and analysis: kvtc-lab)"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Show llama.cpp's log");
  app.set_version_flag("--version", "kvtc " + kvtc::library_info().version + " (llama.cpp " + kvtc::kLlamaCppCommit + ")");
  std::map<CLI::App*, Action> actions;
  auto reg = [&](Action (*add)(CLI::App&)) {
    size_t before = app.get_subcommands({}).size();
    Action a = add(app);
    actions[app.get_subcommands({})[before]] = a;
  };
  reg(add_capture);
  reg(add_restore);
  reg(add_info);
  reg(add_tokens);
  reg(add_calibrate);
  reg(add_compress);
  reg(add_decompress);
  reg(add_inspect);
  reg(add_append);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  kvtc::set_llama_verbose(verbose);
  try {
    for (auto& [sub, act] : actions)
      if (sub->parsed()) return act();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtc: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
