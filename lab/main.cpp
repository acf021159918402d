// kvtc-lab — evaluation, benchmarks and analysis of kvtc (docs/eval.md,
// bench/). The product CLI is `kvtc`.
#include <cstdio>
#include <cstdlib>
#include <map>

#include "kvtc/codec.h"
#include "kvtc/error.h"
#include "lab.h"

namespace kvtc::lab {

std::string default_model() {
  const char* e = std::getenv("KVTC_MODEL");
  return e && *e ? e : KVTC_DEFAULT_MODEL;
}

std::string default_corpus() {
  const char* e = std::getenv("KVTC_CORPUS");
  return e && *e ? e : KVTC_DEFAULT_CORPUS;
}

}  // namespace kvtc::lab

int main(int argc, char** argv) {
  using namespace kvtc::lab;
  CLI::App app{"kvtc-lab — evaluation, benchmarks and analysis of KV Cache Transform Coding"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Show llama.cpp's log");
  app.set_version_flag("--version", "kvtc-lab " + kvtc::library_info().version + " (llama.cpp " + kvtc::kLlamaCppCommit + ")");
  std::map<CLI::App*, Action> actions;
  auto reg = [&](Action (*add)(CLI::App&)) {
    size_t before = app.get_subcommands({}).size();
    Action a = add(app);
    actions[app.get_subcommands({})[before]] = a;
  };
  reg(add_eval);
  reg(add_bench);
  reg(add_session);
  reg(add_analyze);
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
    std::fprintf(stderr, "kvtc-lab: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
