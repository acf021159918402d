// DP bit allocation against exhaustive search on small instances
// (synthetic coefficients with a decaying spectrum, as PCA gives).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "calib/dp.h"
#include "format/quantizers.h"
#include "kvtc/calibration.h"
#include "kvtc/error.h"

using namespace kvtc;
using container::kQuantizers;
using container::quantizer_index;

namespace {

std::vector<float> decaying(size_t n_tok, uint32_t r, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n_tok * r);
  for (size_t t = 0; t < n_tok; ++t)
    for (uint32_t i = 0; i < r; ++i) x[t * r + i] = d(rng) * 10.0f * std::pow(0.7f, float(i));
  return x;
}

// All aligned tilings of [0, r) with all types; least error within budget.
double brute(const BlockErrors& e, uint64_t budget) {
  double best = INFINITY;
  std::function<void(uint32_t, uint64_t, double)> go = [&](uint32_t i, uint64_t bits, double err) {
    if (bits > budget) return;
    if (i == e.n_components) {
      best = std::min(best, err);
      return;
    }
    for (size_t si = 0; si < e.sizes.size(); ++si) {
      uint32_t s = e.sizes[si];
      if (i % s || i + s > e.n_components) continue;
      for (size_t q = 0; q < kQuantizers.size(); ++q) go(i + s, bits + container::block_bits(kQuantizers[q], s), err + e.err[si][i / s][q]);
    }
  };
  go(0, 0, 0.0);
  return best;
}

}  // namespace

TEST(Dp, EqualsBruteForce) {
  std::mt19937 rng(3);
  const uint32_t r = 8;
  const std::vector<uint32_t> sizes{1, 2, 4};
  std::vector<float> d = decaying(50, r, rng);
  BlockErrors e = measure_block_errors(d.data(), 50, r, sizes);
  for (uint64_t budget : {0u, 16u, 34u, 40u, 68u, 100u, 150u, 200u, 300u}) {
    Allocation a = allocate_bits(e, budget);
    const double want = brute(e, budget) / 50.0;
    EXPECT_NEAR(a.error, want, 1e-5 * (1 + want)) << "budget " << budget;
    EXPECT_LE(a.bits, budget);
    // The blocks reproduce the reported error and tile a prefix, aligned.
    double err = 0;
    uint32_t next = 0;
    for (const BlockAlloc& b : a.blocks) {
      EXPECT_EQ(b.start, next);
      EXPECT_EQ(b.start % b.size, 0u);
      size_t si = std::find(sizes.begin(), sizes.end(), b.size) - sizes.begin();
      err += e.err[si][b.start / b.size][quantizer_index(b.type)];
      next = b.start + b.size;
    }
    for (uint32_t i = next; i < r; ++i) err += e.err[0][i][quantizer_index(QType::kNone)];
    EXPECT_NEAR(err / 50.0, a.error, 1e-5 * (1 + a.error));
  }
}

TEST(Dp, MoreBudgetNeverHurts) {
  std::mt19937 rng(4);
  const uint32_t r = 256;
  std::vector<float> d = decaying(64, r, rng);
  BlockErrors e = measure_block_errors(d.data(), 64, r, {1, 16, 64, 256});
  double prev = INFINITY;
  for (uint64_t budget = 0; budget <= 2048; budget += 128) {
    Allocation a = allocate_bits(e, budget);
    EXPECT_LE(a.error, prev + 1e-9);
    prev = a.error;
    EXPECT_LE(a.bits, budget);
  }
  EXPECT_THROW(allocate_bits(e, 100, 3), std::exception);  // unit must divide every block cost
}

// A DP cell's choice is one byte (size index x quantizers + quantizer, 0xff
// reserved): 63 block sizes fit with 4 quantizers, 64 are refused by name.
TEST(Dp, ChoiceByteLimitsTheBlockSizes) {
  BlockErrors e;
  e.n_components = 1;
  e.n_tokens = 1;
  for (size_t n : {63u, 64u}) {
    e.sizes.assign(n, 1);
    e.err.assign(n, {std::array<double, kQuantizers.size()>{4, 3, 2, 1}});
    if (n == 63)
      EXPECT_EQ(allocate_bits(e, 100).blocks, (std::vector<BlockAlloc>{{0, 1, QType::kFp8}}));
    else
      EXPECT_THROW(allocate_bits(e, 100), Error);
  }
}

// A shared K+V budget split by relative error: within the combined budget,
// and never worse than the even split in summed relative error.
TEST(Dp, JointKeyValueSplit) {
  std::mt19937 rng(5);
  const uint32_t r = 64;
  auto make = [&](float scale) {
    std::vector<float> d = decaying(200, r, rng);
    for (auto& x : d) x *= scale;
    BlockErrors e = measure_block_errors(d.data(), 200, r, {1, 16, 64});
    Transform t;
    t.p = t.r = r;
    t.sizes = e.sizes;
    t.n_heldout = e.n_tokens;
    for (const auto& rows : e.err) {
      std::vector<float> v;
      for (const auto& q : rows) v.insert(v.end(), q.begin(), q.end());
      t.block_errors.push_back(v);
    }
    double tv = 0;
    for (float x : d) tv += double(x) * x;
    t.total_variance = tv / 200;
    return t;
  };
  Transform k = make(10.0f), v = make(1.0f);
  for (double ratio : {4.0, 8.0, 16.0}) {
    auto j = joint_allocation_for_ratio(k, v, ratio);
    Allocation sk = allocation_for_ratio(k, ratio), sv = allocation_for_ratio(v, ratio);
    const uint64_t budget = uint64_t(std::floor(r * 16.0 / ratio));
    EXPECT_LE(j[0].budget_bits + j[1].budget_bits, 2 * budget);
    EXPECT_LE(j[0].bits + j[1].bits, 2 * budget);
    EXPECT_LE(j[0].error / k.total_variance + j[1].error / v.total_variance, sk.error / k.total_variance + sv.error / v.total_variance + 1e-9);
  }
}
