// kvtc-lab: the research tooling — quality evaluation (eval), speed
// benchmark (bench), multi-turn session demo (session) and the paper's
// evidence (analyze). Built on the public headers of the library and of
// the llama.cpp integration only; the library never links it.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "kvtc/llama.h"

namespace kvtc::lab {

using Action = std::function<int()>;

Action add_eval(CLI::App& app);
Action add_bench(CLI::App& app);
Action add_session(CLI::App& app);
Action add_analyze(CLI::App& app);

// Default model: $KVTC_MODEL, else the SmolLM2 GGUF the bootstrap extracted.
std::string default_model();
// Default corpus root: $KVTC_CORPUS, else the one `make corpus` built.
std::string default_corpus();

// The text of a token sequence: the pieces of each token, concatenated.
inline std::string text_of(const Model& m, const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t t : tokens) s += m.token_text(t);
  return s;
}

// Milliseconds since t0 (steady clock), for the timings the commands print.
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvtc::lab
