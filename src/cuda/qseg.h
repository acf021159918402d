// Internal (GPU path): the segment and tile records the quantization
// kernels walk (built on the host by host_plan.h). Kept free of heavy
// includes so that .cu files can use it.
#pragma once

#include <cstdint>

namespace kvtc::cuda {

// One allocation block of one chunk. Rows are columns of the
// component-major coefficient plane Dt[comp][ld].
struct QSeg {
  uint64_t off = 0;    // byte offset (from the launch's base pointer) of the parameter planes; codes follow them
  uint32_t row0 = 0;   // first row of the chunk
  uint32_t n = 0;      // tokens in the chunk
  uint32_t comp0 = 0;  // first component
  uint32_t size = 0;   // components
  uint32_t type = 0;   // QType
  uint32_t pad = 0;
};
// A slice of a segment for one CUDA block: encode tiles cover
// kEncTileBytes code bytes, decode tiles kDecTileCodes codes.
struct QTile {
  uint32_t seg = 0;
  uint32_t begin = 0;
};
constexpr uint32_t kEncTileBytes = 1024;
constexpr uint32_t kDecTileCodes = 2048;

}  // namespace kvtc::cuda
