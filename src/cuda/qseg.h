// Internal (GPU path): the segment and tile records the quantization
// kernels walk (built on the host by host_plan.h). Kept free of heavy
// includes so that .cu files can use it.
#pragma once

#include <cstdint>

#include "core/scalar.h"  // QRule

namespace kvtc::cuda {

// One allocation block of one chunk. Rows are columns of the
// component-major coefficient plane Dt[comp][ld]. The block's quantizer is
// given by its row of src/format/quantizers.h (host_plan.cpp copies the
// rule and widths), so the kernels switch on the rule and never see a
// type code.
struct QSeg {
  uint64_t off = 0;           // byte offset (from the launch's base pointer) of the parameter planes; codes follow them
  uint32_t row0 = 0;          // first row of the chunk
  uint32_t n = 0;             // tokens in the chunk
  uint32_t comp0 = 0;         // first component
  uint32_t size = 0;          // components
  QRule rule = QRule::kZero;  // kZero: no bytes, decoded as 0
  uint8_t code_bits = 0;      // bits per code (divides 8)
  uint8_t n_params = 0;       // f16 parameter planes (n low bytes, n high bytes each) before the codes
  uint8_t pad0 = 0;
  uint32_t pad = 0;
};
static_assert(sizeof(QSeg) == 32, "QSeg is uploaded as bytes: 32 on host and device");
// A slice of a segment for one CUDA block: encode tiles cover
// kEncTileBytes code bytes, decode tiles kDecTileCodes codes.
struct QTile {
  uint32_t seg = 0;
  uint32_t begin = 0;
};
constexpr uint32_t kEncTileBytes = 1024;
constexpr uint32_t kDecTileCodes = 2048;

}  // namespace kvtc::cuda
