// kvtc-lab: the research tooling — quality evaluation (eval), speed
// benchmark (bench), multi-turn session demo (session) and the paper's
// evidence (analyze). Built on the public headers of the library and of
// the llama.cpp integration only; the library never links it.
#pragma once

#include <string>
#include <vector>

#include "cli.h"
#include "kvtc/llama.h"

namespace kvtc::lab {

using cli::Action;
using cli::model_option;
using cli::ms_since;

Action add_eval(CLI::App& app);
Action add_bench(CLI::App& app);
Action add_session(CLI::App& app);
Action add_analyze(CLI::App& app);

inline std::string default_model() {
  return default_model_path();
}
inline std::string default_corpus() {
  return default_corpus_dir();
}

// The text of a token sequence: the pieces of each token, concatenated.
inline std::string text_of(const Model& m, const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t t : tokens) s += m.token_text(t);
  return s;
}

}  // namespace kvtc::lab
