// kvtc calibration driver: real caches of the calibration corpus -> PCA
// per (cache block, K/V) -> held-out block errors -> DP tables.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtc/calibration.h"
#include "kvtc/codec.h"

namespace kvtc {

struct CalibrateOptions {
  std::string model_path;
  std::string corpus_dir;          // holds manifest.json and calib/
  uint64_t n_tokens = 160000;      // tokens for the PCA fit (method.md: 160K)
  uint64_t heldout_tokens = 4096;  // tokens, from other documents, for the DP's block errors
  uint32_t rank_max = 10000;       // r = min(rank_max, p)
  uint32_t max_doc_tokens = 0;     // 0: the model's trained context
  uint32_t skip_sinks = 4;         // first tokens of each document left out (never compressed)
  std::vector<double> ratios{8, 16, 32, 64};
  // "exact" (p x p covariance + LAPACK), "randomized" (Halko subspace
  // iteration over rows spooled to a temporary file as f16), or "auto":
  // exact while p <= 12,288 (the covariance and its copy then take <= 2.4 GB).
  std::string pca_route = "auto";
  uint32_t power_iters = 8;
  int threads = 0;
  // Ablation (the paper's Figure 4): fit keys as llama.cpp stores them,
  // RoPE applied. Recorded as meta["keys_rope"] = "kept"; encoder and
  // decoder then skip de-RoPE / re-RoPE. Default "removed" (method.md §1).
  bool keep_rope = false;
  // Corpus kinds to draw documents from ("prose", "docs", "code", "math");
  // empty: all. Recorded as meta["calib_kinds"].
  std::vector<std::string> kinds;
};

// stage: "prefill", "pca", "dp"; done/total in that stage's units.
using ProgressFn = std::function<void(const std::string& stage, uint64_t done, uint64_t total)>;

Calibration calibrate(const CalibrateOptions& opt, const ProgressFn& progress);

// The DP table for one nominal ratio from a transform's stored block errors:
// budget = floor(p * 16 / ratio) bits per token.
Allocation allocation_for_ratio(const Transform& t, double ratio);

// Keys and values of one block under one shared budget of
// 2 * floor(p * 16 / ratio) bits per token, split between them to minimise
// the sum of their *relative* errors (error / total variance): values,
// whose relative error is several times the keys' at equal bits
// (bench/results/ratio.md), can take bits from keys.
std::array<Allocation, 2> joint_allocation_for_ratio(const Transform& k, const Transform& v, double ratio);

// The allocation of every (block, K/V) for a nominal ratio: the
// calibration's stored table when it has one, else computed from the stored
// block errors; joint = true shares one budget between K and V (above).
AllocationSet allocation_set(const Calibration& cal, double ratio, bool joint = false);

// "16" for 16.0, "12.5" for 12.5: the key of Transform::tables.
std::string ratio_key(double ratio);

}  // namespace kvtc
