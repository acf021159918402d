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

// ... and with llama.cpp's CPU code pinned to ggml's haswell variant
// (x86-64-v3), for the same reason: each variant rounds the forward pass
// differently (the small calibration's id: 72f77e8b… with AVX-512 kernels,
// f37a9222… with x86-64-v3 ones, same inputs and machine), so the K/V a
// calibration is fitted on would follow the CPU. Read by the library when it
// loads the CPU backend, so no restart. A KVTC_GGML_CPU already set
// (auto: ggml's choice, ~10% faster on AVX-512 CPUs) is kept; a CPU without
// x86-64-v3 runs ggml's choice for it, with a warning.
void pin_llama_cpu_for_calibrate() {
  const char* cur = std::getenv("KVTC_GGML_CPU");
  if (cur && *cur) return;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("avx")) {
    ::setenv("KVTC_GGML_CPU", "haswell", 1);
  } else {
    std::fprintf(stderr,
                 "kvtc calibrate: this CPU lacks x86-64-v3 (AVX2, FMA, BMI2): llama.cpp runs ggml's variant for it, "
                 "and the calibration's bytes will not match those made on x86-64-v3 CPUs\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvtc::cli;
  if (argc >= 2 && std::strcmp(argv[1], "calibrate") == 0) {
    pin_llama_cpu_for_calibrate();
    pin_blas_for_calibrate(argv);
  }
  return run("kvtc",
             "kvtc — KV Cache Transform Coding: compress an LLM's idle KV cache and restore it\n(evaluation, benchmarks and analysis: kvtc-lab)",
             {add_capture, add_restore, add_info, add_tokens, add_calibrate, add_compress, add_decompress, add_inspect, add_append}, argc, argv);
}
