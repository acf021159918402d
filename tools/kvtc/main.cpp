// kvtc — KV Cache Transform Coding. Entry point of the command-line tool.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cli.h"
#include "commands.h"

namespace {

// `kvtc calibrate` runs with OpenBLAS's kernels and thread count pinned
// (docs/calibration-format.md, "Reproducible calibration"): OpenBLAS picks its
// kernels per CPU when it loads, and both the kernel and the number of
// threads change how its sums round, so the same inputs gave other
// calibration bytes — another id, and stores and records that no longer
// match — on other machines (measured: SkylakeX vs Haswell kernels,
// 1 vs 2 threads, four ids for one small calibration). Haswell's are the
// AVX2/FMA kernels every CPU kvtc runs on has (it needs x86-64-v3). They
// are read from the environment when the library loads, so the process
// starts again with them set. KVTC_CALIB_BLAS=native leaves OpenBLAS's
// own choice (faster on AVX-512 CPUs, not reproducible across machines).
constexpr const char* kBlasCore = "Haswell";
constexpr const char* kBlasThreads = "2";

void pin_blas_for_calibrate(char** argv) {
  const char* mode = std::getenv("KVTC_CALIB_BLAS");
  if (mode && std::strcmp(mode, "native") == 0) return;
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  const char* threads = std::getenv("OPENBLAS_NUM_THREADS");
  if (core && threads && std::strcmp(core, kBlasCore) == 0 && std::strcmp(threads, kBlasThreads) == 0) return;
  ::setenv("OPENBLAS_CORETYPE", kBlasCore, 1);
  ::setenv("OPENBLAS_NUM_THREADS", kBlasThreads, 1);
  ::execv("/proc/self/exe", argv);
  std::fprintf(stderr, "kvtc calibrate: could not start again with OpenBLAS pinned (%s); this calibration's bytes depend on this CPU\n",
               std::strerror(errno));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvtc::cli;
  if (argc >= 2 && std::strcmp(argv[1], "calibrate") == 0) pin_blas_for_calibrate(argv);
  return run("kvtc",
             "kvtc — KV Cache Transform Coding: compress an LLM's idle KV cache and restore it\n(evaluation, benchmarks and analysis: kvtc-lab)",
             {add_capture, add_restore, add_info, add_tokens, add_calibrate, add_compress, add_decompress, add_inspect, add_append}, argc, argv);
}
