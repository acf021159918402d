// Internal: milliseconds since a steady-clock time point, for the times the
// library reports (CodecStats, the prompt store's counters). Header-only:
// the GPU path's host code (src/cuda) uses it too. The programs (tools/,
// lab/) include only include/kvtc/ and have their own in tools/common/cli.h.
#pragma once

#include <chrono>

namespace kvtc {

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvtc
