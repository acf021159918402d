// Internal (calibration): block errors and the dynamic-programming bit
// allocation (docs/method.md §4).
//
// Components are grouped into *aligned* blocks: a block of size s starts at
// a multiple of s. Alignment keeps the error table linear in the number of
// components per (size, type) — measuring every start for size 1024 would
// cost 1024x more. What alignment costs against free block starts is not
// measured; the allocations found fall monotonically along the component
// index (bench/results/bits_per_component_*.png), where aligned runs fit.
//
// best[i][b] = least error coding components [0, i) in at most b units,
// filled by enumerating the last block [i - s, i) and its type. The
// recursion is exact because a block is quantized from its own
// coefficients only (its own parameters), so its error does not depend on
// the other blocks, and squared errors add over blocks.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/quantizers.h"
#include "kvtc/calibration.h"

namespace kvtc {

struct BlockErrors {
  uint32_t n_components = 0;
  std::vector<uint32_t> sizes;
  // err[si][j][q]: squared error summed over the measured tokens of the
  // block [j * sizes[si], (j + 1) * sizes[si]) coded with
  // container::kQuantizers[q], the fixed-rate quantizers the DP chooses
  // among (src/format/quantizers.h).
  std::vector<std::vector<std::array<double, container::kQuantizers.size()>>> err;
  size_t n_tokens = 0;
};

// d: [n_tok][r] PCA coefficients of held-out tokens (row-major).
BlockErrors measure_block_errors(const float* d, size_t n_tok, uint32_t r, const std::vector<uint32_t>& sizes);

// Least-error allocation within budget_bits per token. `unit` is the budget
// granularity in bits (every block cost must be a multiple: 2 for the
// method's types). At most 63 block sizes with 4 quantizers (a DP cell's choice is one byte:
// size index x quantizer count + quantizer, 0xff reserved). Errors in the result are per token (divided by n_tokens).
// error_curve, when given, receives the least per-token error for every
// budget 0, unit, 2 unit, ..., budget_bits (one DP gives them all).
Allocation allocate_bits(const BlockErrors& e, uint64_t budget_bits, uint32_t unit = 2, std::vector<double>* error_curve = nullptr);

}  // namespace kvtc
