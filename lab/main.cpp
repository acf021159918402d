// kvtc-lab — evaluation, benchmarks and analysis of kvtc (docs/eval.md,
// bench/). The product CLI is `kvtc`.
#include "cli.h"
#include "lab.h"

int main(int argc, char** argv) {
  using namespace kvtc::lab;
  return kvtc::cli::run("kvtc-lab", "kvtc-lab — evaluation, benchmarks and analysis of KV Cache Transform Coding",
                        {add_eval, add_bench, add_session, add_analyze}, argc, argv);
}
