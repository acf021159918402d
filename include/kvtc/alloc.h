// kvtc: bit allocation — which quantization type codes which run of PCA
// components. The encoder and decoder read it from the calibration file;
// the calibration computes it by dynamic programming (src/calib/dp.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kvtc/quant.h"

namespace kvtc {

struct BlockAlloc {
  uint32_t start = 0;  // first component
  uint32_t size = 0;   // components in the block
  QType type = QType::kNone;
};

// A partition of components [0, n_components) into blocks. Components past
// the last block are dropped (as kNone).
struct Allocation {
  double nominal_ratio = 0;  // 16-bit original bits / budget
  uint64_t budget_bits = 0;  // per token, scales and offsets included
  uint64_t bits = 0;         // per token actually used (<= budget_bits)
  double error = 0;          // expected squared error per token (held-out estimate)
  std::vector<BlockAlloc> blocks;
};

// Block sizes of the method (method.md §4).
inline const std::vector<uint32_t>& default_block_sizes() {
  static const std::vector<uint32_t> s{1, 16, 64, 256, 1024};
  return s;
}

}  // namespace kvtc
