// kvtc: the calibration file — per model, per cache block, for keys and
// values: mean, PCA basis, spectrum, held-out block errors, and bit
// allocation tables per nominal ratio. Written by `kvtc calibrate`, read by
// the encoder (all of it) and the decoder (mean and basis only).
//
// Stored as safetensors (docs/calibration-format.md) with
// __metadata__["format"] = "kvtc-calibration". Its `calibration_id` is the
// SHA-256 of the mean and basis tensors: containers record it, and the
// decoder refuses a calibration whose id differs. The loader recomputes the
// id, so a corrupted basis is caught too.
// Thread safety: plain values.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvtc/alloc.h"
#include "kvtc/safetensors.h"

namespace kvtc {

constexpr const char* kCalibFormat = "kvtc-calibration";
constexpr int kCalibFormatVersion = 1;

struct Transform {
  uint32_t p = 0, r = 0;
  std::vector<float> mu;        // [p]
  std::vector<float> basis;     // [r][p]
  std::vector<float> variance;  // [r]
  double total_variance = 0;
  // Held-out squared errors per aligned block (see src/calib/dp.h): for
  // block size sizes[i], [r / size][kNumQTypes], summed over n_heldout tokens.
  std::vector<uint32_t> sizes;
  std::vector<std::vector<float>> block_errors;
  uint64_t n_heldout = 0;
  std::map<std::string, Allocation> tables;  // key: nominal ratio as written ("16")
};

struct Calibration {
  std::map<std::string, std::string> meta;       // model fingerprint, geometry, RoPE (capture keys), corpus, tokens
  std::vector<std::array<Transform, 2>> blocks;  // [cache block][0 = keys, 1 = values]
  std::string id;                                // calibration_id
};

// Whether keys are de-RoPEd before projection: meta["keys_rope"] is
// "removed" (the default when absent) or "kept" (an ablation). Any other
// value was refused by the loader.
inline bool calibration_keys_derope(const Calibration& c) {
  auto it = c.meta.find("keys_rope");
  return it == c.meta.end() || it->second != "kept";
}

// SHA-256 over every mean and basis, in block/kind order.
std::string calibration_compute_id(const Calibration& c);

SafeTensors calibration_to_safetensors(const Calibration& c);
// Checks format, version, shapes and the id; `origin` names the file.
// decoder_only skips the error and allocation tables.
Calibration calibration_from_safetensors(const SafeTensors& st, const std::string& origin, bool decoder_only = false);

void calibration_save(const std::string& path, const Calibration& c);  // atomic
Calibration calibration_load(const std::string& path, bool decoder_only = false);

}  // namespace kvtc
