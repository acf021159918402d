#include "calib/dp.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "kvtc/error.h"

namespace kvtc {

using container::kQuantizers;
using container::Quantizer;
constexpr size_t kNq = kQuantizers.size();

BlockErrors measure_block_errors(const float* d, size_t n_tok, uint32_t r, const std::vector<uint32_t>& sizes) {
  BlockErrors e;
  e.n_components = r;
  e.sizes = sizes;
  e.n_tokens = n_tok;
  e.err.resize(sizes.size());
  for (size_t si = 0; si < sizes.size(); ++si) {
    const uint32_t s = sizes[si];
    const uint32_t nb = r / s;
    e.err[si].assign(nb, {});
#pragma omp parallel for schedule(dynamic)
    for (int64_t j = 0; j < int64_t(nb); ++j) {
      std::array<double, kNq> acc{};
      for (size_t t = 0; t < n_tok; ++t) {
        const float* x = d + t * r + size_t(j) * s;
        for (size_t q = 0; q < kNq; ++q) acc[q] += container::block_sq_error(kQuantizers[q], x, s);
      }
      e.err[si][size_t(j)] = acc;
    }
  }
  return e;
}

Allocation allocate_bits(const BlockErrors& e, uint64_t budget_bits, uint32_t unit, std::vector<double>* error_curve) {
  const uint32_t r = e.n_components;
  require(unit > 0, "allocate_bits: unit must be positive");
  for (uint32_t s : e.sizes)
    for (const Quantizer& q : kQuantizers)
      require(container::block_bits(q, s) % unit == 0, "allocate_bits: block cost not a multiple of the budget unit");
  // A cell's choice is one byte, size index x kNq + quantizer index, 0xff
  // meaning "same as b - 1": 63 sizes with 4 quantizers (the method uses 5).
  require(e.sizes.size() * kNq < 0xff,
          "allocate_bits: " + std::to_string(e.sizes.size()) + " block sizes x " + std::to_string(kNq) + " quantizers do not fit a one-byte choice");
  const uint64_t B = budget_bits / unit;
  // 5 bytes per cell: 2^28 cells is 1.3 GB (p = 5,760 at ratio 2 needs 2^27).
  require(uint64_t(r + 1) * (B + 1) <= (uint64_t(1) << 28),
          "allocate_bits: DP table of " + std::to_string(uint64_t(r + 1) * (B + 1)) + " cells is too large; raise the budget unit");
  const size_t W = size_t(B) + 1;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // best[i * W + b]: least error of components [0, i) within b units
  // (monotone in b). choice packs (size index, quantizer index) of the last
  // block as si * kNq + q; 0xff means "same as b - 1" (the extra unit is
  // unused).
  std::vector<float> best(size_t(r + 1) * W, kInf);
  std::vector<uint8_t> choice(size_t(r + 1) * W, 0xff);
  std::fill(best.begin(), best.begin() + W, 0.0f);
  for (uint32_t i = 1; i <= r; ++i) {
    float* bi = &best[size_t(i) * W];
    uint8_t* ci = &choice[size_t(i) * W];
    for (size_t si = 0; si < e.sizes.size(); ++si) {
      const uint32_t s = e.sizes[si];
      if (i % s != 0) continue;
      const auto& err = e.err[si][(i - s) / s];
      const float* prev = &best[size_t(i - s) * W];
      for (size_t q = 0; q < kNq; ++q) {
        const size_t cost = container::block_bits(kQuantizers[q], s) / unit;
        if (cost > B) continue;
        const float add = float(err[q]);
        const uint8_t code = uint8_t(si * kNq + q);
        for (size_t b = cost; b < W; ++b) {
          const float v = prev[b - cost] + add;
          if (v < bi[b]) {
            bi[b] = v;
            ci[b] = code;
          }
        }
      }
    }
    for (size_t b = 1; b < W; ++b)
      if (bi[b - 1] <= bi[b]) {
        bi[b] = bi[b - 1];
        ci[b] = 0xff;
      }
  }
  if (error_curve) {
    error_curve->resize(W);
    for (size_t b = 0; b < W; ++b) (*error_curve)[b] = e.n_tokens ? best[size_t(r) * W + b] / double(e.n_tokens) : 0;
  }
  Allocation a;
  a.budget_bits = budget_bits;
  a.error = e.n_tokens ? best[size_t(r) * W + B] / double(e.n_tokens) : 0;
  require(std::isfinite(a.error), "allocate_bits: no allocation fits the budget");
  size_t b = B;
  uint32_t i = r;
  std::vector<BlockAlloc> rev;
  while (i > 0) {
    uint8_t c = choice[size_t(i) * W + b];
    if (c == 0xff) {
      --b;
      continue;
    }
    const uint32_t s = e.sizes[c / kNq];
    const Quantizer& q = kQuantizers[c % kNq];
    rev.push_back({i - s, s, q.type});
    b -= container::block_bits(q, s) / unit;
    i -= s;
  }
  // Neighbours of equal type stay separate blocks (each has its own
  // per-token parameters); trailing dropped blocks are implicit.
  for (auto it = rev.rbegin(); it != rev.rend(); ++it) {
    a.bits += container::block_bits(it->type, it->size);
    a.blocks.push_back(*it);
  }
  while (!a.blocks.empty() && container::quantizer(a.blocks.back().type).rule == QRule::kZero) a.blocks.pop_back();
  return a;
}

}  // namespace kvtc
