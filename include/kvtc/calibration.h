// kvtc: the calibration — what kvtc learns once per model (docs/method.md §3-4):
// per cache block, for keys and values, the feature mean, the PCA basis and
// spectrum, held-out block errors, and bit-allocation tables per nominal
// ratio. The decoder uses only means and bases; the encoder also takes an
// allocation (AllocationSet) for the ratio it codes at.
//
// A calibration is fitted from K/V caches the caller supplies
// (CalibrationFitter, fit_calibration: no llama.cpp needed), or from a text
// corpus through the llama.cpp integration (<kvtc/llama.h>,
// calibrate_from_corpus), which is a thin layer over the fitter.
// Stored as safetensors (docs/calibration-format.md); every byte of the
// file is checksummed and the loader refuses a file that was changed.
// Thread safety: plain values; a CalibrationFitter is used by one thread.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtc/cache.h"

namespace kvtc {

// ---- bit allocation ------------------------------------------------------
// A *block* of a fixed-rate allocation is a run of consecutive PCA
// components coded, for one token, with one type and one set of f16
// parameters:
//   kNone  0 bits: dropped (decoded as 0)
//   kInt2  2 bits/component + f16 minimum + f16 step (min-max affine)
//   kInt4  4 bits/component + f16 minimum + f16 step
//   kFp8   8 bits/component (E4M3, saturating) + f16 scale = absmax / 448
// These are the types the DP chooses among. A value is the type's code in
// the container header and the calibration file (docs/format.md); code 4
// is the entropy-coded block's (Coding::kEntropy), so a new type takes 5.
enum class QType : uint8_t { kNone = 0, kInt2 = 1, kInt4 = 2, kFp8 = 3 };
constexpr int kNumQTypes = 4;     // the fixed-rate types, the columns of Transform::block_errors
const char* qtype_name(QType t);  // "none", "int2", "int4", "fp8"

// How an allocation codes its components.
enum class Coding : uint8_t {
  // Blocks of fixed-rate types, each with its own per-token parameters
  // (container version 1): what the DP makes (allocation_for_ratio).
  kFixedRate = 0,
  // Entropy-coded (container version 2): one uniform step for all
  // components of a chunk, codes rANS-coded per component with static
  // tables (docs/format.md "Entropy-coded chunks"). The allocation holds one
  // block, [0, size): size is the components the encoder projects on; its
  // type is unused (kNone). Not a DP result: ecsq_allocation_set makes it,
  // the rate control of compress picks the step.
  kEntropy = 1,
};

struct BlockAlloc {
  uint32_t start = 0;  // first component
  uint32_t size = 0;   // components in the block
  QType type = QType::kNone;
  bool operator==(const BlockAlloc&) const = default;
};

// A partition of components [0, r_used) into blocks; the components after
// the last block are dropped.
struct Allocation {
  double nominal_ratio = 0;  // 16-bit original bits / budget
  uint64_t budget_bits = 0;  // per token, parameters included
  uint64_t bits = 0;         // per token actually used (<= budget_bits)
  double error = 0;          // expected squared error per token (held-out estimate)
  Coding coding = Coding::kFixedRate;
  std::vector<BlockAlloc> blocks;
};

// The allocation of each (cache block, kind): [block][0 = keys, 1 = values].
using AllocationSet = std::vector<std::array<Allocation, 2>>;

// ---- the calibration -----------------------------------------------------
struct Transform {
  uint32_t p = 0, r = 0;        // features, components kept
  std::vector<float> mu;        // [p] feature mean, features ordered [layer][head][dim]
  std::vector<float> basis;     // [r][p] components, unit norm, by decreasing variance
  std::vector<float> variance;  // [r] variance along each component
  double total_variance = 0;    // trace of the covariance
  // Held-out squared errors of each aligned block of size sizes[i], coded
  // with each QType: [r / sizes[i]][kNumQTypes], summed over n_heldout tokens.
  std::vector<uint32_t> sizes;
  std::vector<std::vector<float>> block_errors;
  uint64_t n_heldout = 0;
  std::map<std::string, Allocation> tables;  // precomputed allocations, key: ratio_key(nominal ratio)
};

struct Calibration {
  // The model and cache it was fitted for: the encoder refuses a capture of
  // another model or geometry. Files older than format version 2 may lack
  // the layers of a block (then only the feature count p is checked).
  CacheGeometry geometry;
  // Keys were de-RoPEd before the fit (the method); false: fitted on keys as
  // stored (an ablation): encoder and decoder then skip (de-)rotation.
  bool keys_derope = true;
  std::vector<std::array<Transform, 2>> blocks;  // [cache block][0 = keys, 1 = values]
  std::map<std::string, std::string> meta;       // provenance: corpus, tokens, PCA route, ...
  std::string id;                                // calibration_id: SHA-256 of every mean and basis; containers record it
};

// SHA-256 over every mean and basis (f32 little-endian), blocks in order,
// keys before values.
std::string calibration_compute_id(const Calibration& c);

// Writes atomically (format version 2: every byte covered by a checksum).
void calibration_save(const std::string& path, const Calibration& c);
// Verifies the file's checksum, format, shapes and id; Error names the
// file and field. decoder_only skips the block errors and tables (the
// decoder needs neither).
Calibration calibration_load(const std::string& path, bool decoder_only = false);

// "16" for 16.0, "12.5" for 12.5: the key of Transform::tables.
std::string ratio_key(double ratio);

// The least-error allocation of `t` for a nominal ratio in [1, 4096], from
// its block errors (dynamic programming, docs/method.md §4): a budget of
// floor(p x 16 / ratio) bits per token.
Allocation allocation_for_ratio(const Transform& t, double ratio);
// Keys and values of one block under one shared budget of
// 2 x floor(p x 16 / ratio) bits per token, split between them to minimise
// the sum of their relative errors (error / total variance).
std::array<Allocation, 2> joint_allocation_for_ratio(const Transform& k, const Transform& v, double ratio);
// Every (block, kind)'s allocation for a ratio: the stored table when the
// calibration has one for that ratio, else computed from the block errors;
// joint shares one budget between K and V. Needs a calibration loaded
// without decoder_only.
AllocationSet allocation_set(const Calibration& cal, double ratio, bool joint = false);
// The entropy-coded mode at a target ratio (f16 bytes of the coded tokens /
// their chunk sections, for keys and for values): per (block, kind) a
// Coding::kEntropy allocation of one block over all r components; compress then searches the
// quantizer step that meets the ratio on the cache itself, keeps the
// components that matter at that step (CompressOptions::ecsq_min_sd) and
// trims the block to the last one with a nonzero code. Works with a
// calibration loaded decoder_only too (it needs only the spectrum).
AllocationSet ecsq_allocation_set(const Calibration& cal, double ratio);

// ---- fitting --------------------------------------------------------------
struct FitOptions {
  uint32_t rank_max = 10000;                  // r = min(rank_max, p)
  std::vector<double> ratios{8, 16, 32, 64};  // tables stored in the calibration
  // "exact" (p x p covariance + LAPACK eigensolver), "randomized" (Halko
  // subspace iteration over rows spooled to a temporary file as f16), or
  // "auto": exact while p <= 12,288 (the covariance and its copy then take
  // <= 2.4 GB).
  std::string pca_route = "auto";
  uint32_t power_iters = 8;  // randomized route
  // Tokens whose position is below this are left out: the attention sinks,
  // which the codec never compresses (docs/method.md §6).
  uint32_t skip_sinks = 4;
  // Ablation (the paper's Figure 4): fit keys as stored, RoPE applied.
  bool keep_rope = false;
  // Layer-grouped PCA (docs/method.md "Layer groups"): each cache block's
  // layers split into this many runs of consecutive layers (as equal as
  // they divide: group i holds layers [i L / G, (i+1) L / G)), one PCA per
  // run, every component zero outside its run's features, all components
  // merged by decreasing variance. The decoder finds the groups in the
  // basis (its zeros) and multiplies each run apart: with 2 groups ~1.8x
  // fewer multiply-adds for ~12% more bits at equal error on SmolLM2
  // (bench/results/grouped-pca-reading.md). 1: one PCA over all layers
  // (the method). Needs the exact PCA route; at most the block's layers.
  uint32_t layer_groups = 1;
};

// stage: "prefill" (the model's forward pass over a document), "stream"
// (that document's rows into the covariances), "pca" (finish: PCA, held-out
// errors, DP tables); done / total in that stage's units. Called after the
// stage's step, so the time since the previous call belongs to `stage`.
using ProgressFn = std::function<void(const std::string& stage, uint64_t done, uint64_t total)>;

// Streams K/V caches into a calibration without keeping them: the fit
// rows go into a p x p covariance (or a spool file), held-out rows are
// kept (4,096 tokens of p = 5,760: 190 MB for K and V) for the block
// errors. Caches are added whole; their geometry must equal the fitter's
// (RoPE supported, unless keep_rope). Memory: O(p^2) per (block, kind) on
// the exact route.
class CalibrationFitter {
 public:
  CalibrationFitter(const CacheGeometry& g, const FitOptions& opt = {});
  ~CalibrationFitter();
  CalibrationFitter(const CalibrationFitter&) = delete;
  CalibrationFitter& operator=(const CalibrationFitter&) = delete;

  // Rows for the PCA. Returns the rows added from block 0.
  uint64_t add(const KvCapture& c);
  // Rows for the held-out block errors (tokens never used for the PCA).
  uint64_t add_heldout(const KvCapture& c);
  uint64_t fit_tokens() const;      // rows of block 0 added by add()
  uint64_t heldout_tokens() const;  // rows of block 0 added by add_heldout()
  // PCA per (block, kind), block errors on the held-out rows, the DP tables.
  // Needs at least 2 fit rows and 1 held-out row; the fitter is spent after.
  Calibration finish(const ProgressFn& progress = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The same in one call, for caches already in memory.
Calibration fit_calibration(const std::vector<KvCapture>& fit, const std::vector<KvCapture>& heldout, const FitOptions& opt = {});

// ---- learning from served prompts (kvtc-server --kvtc-calib auto) ----------
struct OnlineCalibrationOptions {
  uint64_t fit_tokens = 32768;  // rows for the PCA before enough() (docs/calibration-format.md "Learned from served prompts")
  uint64_t heldout_tokens = 0;  // rows held out for the block errors; 0: fit_tokens / 16
  // Prefixes an earlier add() saw are not learned again, in runs of this
  // many tokens (a system prompt every conversation repeats would weigh
  // once per conversation otherwise).
  uint32_t run_tokens = 64;
  FitOptions fit;
};

// A CalibrationFitter fed with the prompts a server serves: each add() gives
// a whole prompt's cache (a slot's state, tokens and positions 0..n-1);
// only the runs past the longest prefix an earlier add() saw go in, every
// `stride`-th of their tokens (the caller sets stride from what learning
// costs beside prefill). Whole runs are held out, while the held-out rows
// are fewer than their share, so held-out rows are never the neighbours of
// fit rows. Memory: the fitter's (O(p^2) per K/V on the exact route: 265
// MB each for SmolLM2-135M, p = 5,760; 411 MB for Qwen2.5-1.5B, p = 7,168)
// plus 8 bytes per run seen. One thread uses it.
class OnlineCalibrator {
 public:
  OnlineCalibrator(const CacheGeometry& g, const OnlineCalibrationOptions& opt = {});
  ~OnlineCalibrator();
  OnlineCalibrator(const OnlineCalibrator&) = delete;
  OnlineCalibrator& operator=(const OnlineCalibrator&) = delete;

  // `c` holds the prompt `tokens` (c's block 0 has tokens.size() tokens at
  // positions 0..n-1, as a slot's state does). Returns the rows it added.
  uint64_t add(const KvCapture& c, std::span<const int32_t> tokens, uint32_t stride = 1);
  uint64_t seen_tokens() const;  // tokens of every add()
  uint64_t new_tokens() const;   // of those, past a prefix seen before
  uint64_t fit_tokens() const;
  uint64_t heldout_tokens() const;
  uint64_t fit_target() const;
  uint64_t heldout_target() const;
  bool enough() const;  // both targets met
  // CalibrationFitter::finish, with meta "source" saying where the rows came from.
  Calibration finish(const ProgressFn& progress = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtc
