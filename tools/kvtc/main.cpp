// kvtc — KV Cache Transform Coding. Entry point of the command-line tool.
#include "cli.h"
#include "commands.h"

int main(int argc, char** argv) {
  using namespace kvtc::cli;
  return run("kvtc",
             "kvtc — KV Cache Transform Coding: compress an LLM's idle KV cache and restore it\n(evaluation, benchmarks and analysis: kvtc-lab)",
             {add_capture, add_restore, add_info, add_tokens, add_calibrate, add_compress, add_decompress, add_inspect, add_append}, argc, argv);
}
