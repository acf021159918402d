// Allocations for a nominal ratio from a calibration's block errors
// (kvtc/calibration.h): the DP of src/calib/dp.cpp, per transform or with
// one budget shared by keys and values.
#include <cmath>
#include <cstdio>

#include "calib/dp.h"
#include "kvtc/calibration.h"
#include "kvtc/error.h"

namespace kvtc {

std::string ratio_key(double ratio) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", ratio);
  return b;
}

namespace {

BlockErrors block_errors_of(const Transform& t) {
  require(!t.sizes.empty() && t.block_errors.size() == t.sizes.size(),
          "allocation: the calibration's block errors are missing (loaded with decoder_only?)");
  BlockErrors e;
  e.n_components = t.r;
  e.sizes = t.sizes;
  e.n_tokens = t.n_heldout;
  for (const auto& v : t.block_errors) {
    std::vector<std::array<double, kNumQTypes>> rows(v.size() / kNumQTypes);
    for (size_t j = 0; j < rows.size(); ++j)
      for (int q = 0; q < kNumQTypes; ++q) rows[j][q] = v[j * kNumQTypes + q];
    e.err.push_back(std::move(rows));
  }
  return e;
}

void check_ratio(double ratio) {
  require(ratio >= 1.0 && ratio <= 4096, "ratio must be in [1, 4096], got " + ratio_key(ratio));
}

}  // namespace

Allocation allocation_for_ratio(const Transform& t, double ratio) {
  check_ratio(ratio);
  const BlockErrors e = block_errors_of(t);
  const uint64_t budget = uint64_t(std::floor(double(t.p) * 16.0 / ratio));
  Allocation a = allocate_bits(e, budget, 2);
  a.nominal_ratio = ratio;
  return a;
}

std::array<Allocation, 2> joint_allocation_for_ratio(const Transform& k, const Transform& v, double ratio) {
  check_ratio(ratio);
  require(k.p == v.p, "joint allocation: keys and values differ in p");
  const uint64_t budget = uint64_t(std::floor(double(k.p) * 16.0 / ratio));
  const BlockErrors ek = block_errors_of(k), ev = block_errors_of(v);
  std::vector<double> ck, cv;
  allocate_bits(ek, 2 * budget, 2, &ck);
  allocate_bits(ev, 2 * budget, 2, &cv);
  const size_t total = (2 * budget) / 2;
  size_t best_k = total / 2;
  double best = INFINITY;
  for (size_t bk = 0; bk <= total; ++bk) {
    const double x = ck[bk] / k.total_variance + cv[total - bk] / v.total_variance;
    if (x < best) best = x, best_k = bk;
  }
  std::array<Allocation, 2> out{allocate_bits(ek, best_k * 2, 2), allocate_bits(ev, (total - best_k) * 2, 2)};
  for (auto& a : out) a.nominal_ratio = ratio;
  return out;
}

AllocationSet allocation_set(const Calibration& cal, double ratio, bool joint) {
  check_ratio(ratio);
  AllocationSet al(cal.blocks.size());
  for (size_t b = 0; b < cal.blocks.size(); ++b) {
    if (joint) {
      al[b] = joint_allocation_for_ratio(cal.blocks[b][0], cal.blocks[b][1], ratio);
      continue;
    }
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      auto it = t.tables.find(ratio_key(ratio));
      al[b][kv] = it != t.tables.end() ? it->second : allocation_for_ratio(t, ratio);
    }
  }
  return al;
}

}  // namespace kvtc
