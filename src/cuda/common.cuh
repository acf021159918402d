// Internal (GPU path): error checks and small helpers shared by the kernel
// families. Includable from host C++ (no kernel syntax here); device-only
// helpers live in the kernel files; the scalar math shared with the CPU is
// src/core/scalar.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvtc::cuda {

// Throws kvtc::Error("CUDA error in <what>: <name>: <string>") unless e is cudaSuccess.
void check(cudaError_t e, const char* what);
// Checks the last kernel launch (cudaGetLastError).
void check_launch(const char* what);
// Launches a trivial kernel on the current device and waits: the error
// says whether this build can run there (e.g. no kernel image for its
// architecture).
cudaError_t probe_device();

inline size_t round_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

// Blocks for a grid-stride loop over n items with `threads` per block.
inline unsigned grid_blocks(size_t n, unsigned threads, unsigned max_blocks = 1u << 16) {
  size_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return unsigned(b < max_blocks ? b : max_blocks);
}

// Element type of feature rows / coefficient planes fed to the GEMM.
enum class ElemType : int { kF32 = 0, kBf16 = 1, kF16 = 2 };
inline size_t elem_bytes(ElemType t) {
  return t == ElemType::kF32 ? 4 : 2;
}

}  // namespace kvtc::cuda
