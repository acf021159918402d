// kvtc CLI (the product: capture, restore, info, tokens, calibrate, compress,
// decompress, append, inspect): one function per subcommand. Each registers
// its options on the CLI11 app and returns the action to run once parsing
// succeeded. Uses only the public headers of the library and of the
// llama.cpp integration.
#pragma once

#include <string>
#include <vector>

#include "cli.h"
#include "kvtc/llama.h"

namespace kvtc::cli {

// The text of a token sequence: the pieces of each token, concatenated.
inline std::string text_of(const Model& m, const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t t : tokens) s += m.token_text(t);
  return s;
}

inline std::string default_model() {
  return default_model_path();
}
inline std::string default_corpus() {
  return default_corpus_dir();
}

Action add_capture(CLI::App& app);
Action add_restore(CLI::App& app);
Action add_info(CLI::App& app);
Action add_tokens(CLI::App& app);
Action add_calibrate(CLI::App& app);
Action add_compress(CLI::App& app);
Action add_decompress(CLI::App& app);
Action add_inspect(CLI::App& app);
Action add_append(CLI::App& app);

}  // namespace kvtc::cli
