// The command-line shell `kvtc` and `kvtc-lab` share: subcommands that
// register their options on a CLI11 app and return the action to run, the
// -v/--verbose and --version flags, and errors printed as "PROG: error: ..."
// with exit status 1 (parse errors: CLI11's own exit codes), and the
// timer of the times the commands print. The build's default model and
// corpus come from kvtc_llama (kvtc::default_model_path, default_corpus_dir).
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kvtc/codec.h"
#include "kvtc/llama.h"

namespace kvtc::cli {

using Action = std::function<int()>;
using Subcommand = Action (*)(CLI::App&);

// Milliseconds since t0 (steady clock), for the timings the commands print.
// The library's own is src/core/timing.h, which the programs may not
// include (docs/architecture.md); the two are the same one line.
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// -m/--model: a GGUF path or one of the bootstrap's short names (kvtc info
// lists them), resolved to its path as the option is parsed.
inline CLI::Option* model_option(CLI::App* sub, std::string& target, const std::string& help) {
  std::string names;
  for (const NamedModel& m : named_models()) names += (names.empty() ? "" : ", ") + m.name;
  return sub->add_option("-m,--model", target, help + "; a path or a name: " + names)
      ->capture_default_str()
      ->transform(CLI::Validator(
          [](std::string& s) {
            try {
              s = resolve_model(s);
              return std::string();
            } catch (const std::exception& e) {
              return std::string(e.what());
            }
          },
          "", "model"));
}

inline int run(const std::string& prog, const std::string& description, const std::vector<Subcommand>& subcommands, int argc, char** argv) {
  CLI::App app{description};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Show llama.cpp's log");
  app.set_version_flag("--version", prog + " " + library_info().version + " (llama.cpp " + kLlamaCppCommit + ")");
  std::map<CLI::App*, Action> actions;
  for (Subcommand add : subcommands) {
    const size_t before = app.get_subcommands({}).size();
    Action a = add(app);
    actions[app.get_subcommands({})[before]] = a;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  set_llama_verbose(verbose);
  try {
    for (auto& [sub, act] : actions)
      if (sub->parsed()) return act();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", prog.c_str(), e.what());
    return 1;
  }
  return 1;
}

}  // namespace kvtc::cli
