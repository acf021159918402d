// Internal: the codec's projection on the PCA basis, in f32 (OpenBLAS
// sgemm) or bf16 (oneDNN's matmul on AVX512-BF16 or AMX), chosen at run
// time. Centring is done here too: in bf16 it is fused into the pass that
// rounds the GEMM's input (encode) or is the GEMM's bias (decode).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"

namespace kvtc::detail {

// kAuto -> kBF16 where bf16_projection_available(), else kInt8 where the
// CPU has AVX2 and int8_projection_available() (a decode mode: see
// float_precision), else kF32. An explicit
// kBF16 on a CPU without a native kernel, kInt8 without
// int8_projection_available(), or a GPU-only precision (kTF32, kF16), is an
// Error naming `who`.
Precision resolve_precision(Precision requested, const char* who);

// What the float GEMMs run in for a resolved precision: kInt8's encoder,
// its DP chunks and its leading components run as kAuto would.
Precision float_precision(Precision resolved);

// The name of calibration `cal`'s transform (block, kv: 0 keys, 1 values)
// for Projector's cache: the calibration id (SHA-256 of every mean and
// basis) names the content of all its transforms together, so the
// transform's place in it must be part of the name. ("" when cal.id is.)
std::string transform_key(const Calibration& cal, size_t block, int kv);

// One transform's first `ru` basis rows, ready for either precision. Made
// once per codec call and shared read-only by the worker threads; for bf16
// the rows are rounded (ru x p bf16: 11.8 MB for 1024 x 5760, ~5 ms) once
// per transform: with `key` (transform_key()) the rounded rows are kept in a
// process-wide cache of 8 and shared by later calls. The prompt store codes
// each 256-token piece in a call of its own: without the cache a 1.8K-token
// SmolLM2 restore rounded both bases 7 times. An empty `key` rounds them
// here, uncached. Never keyed by address: a calibration freed and loaded
// again may put its value basis where its key basis was (the Python tests'
// KvtcCaches did, and coded values on the keys' rows: KL 0.8-1.6 after a
// restore instead of 0.024).
// A basis in 7-bit integers for kInt8: B[j][f] ~ q[j][f] * scale[f], |q|
// <= 63 (oneDNN's AVX2 kernel without VNNI adds two u8 x s8 products in
// 16 bits: 255 * 63 * 2 fits, 255 * 127 * 2 saturates), one scale per
// feature over all ru rows. Made from the f32 basis by IEEE division and
// rounding: the same bytes on every CPU.
struct Int8Basis {
  std::vector<int8_t> q;     // [ru][p]
  std::vector<float> scale;  // [p]
};

// A layer-grouped basis (FitOptions::layer_groups) as the projection
// multiplies it: the features split into runs [c0, c0 + w) such that each of
// the first ru components is zero outside one run. Found in the basis
// itself (its exact zeros, which bf16 and int8 keep), so a container needs
// no record of it: the calibration id covers the basis. One PCA's dense
// basis gives one run, and the projection stays one GEMM.
struct GroupedBasis {
  struct Group {
    uint32_t c0 = 0, w = 0;
    std::vector<uint32_t> comps;  // this run's components among the first ru, ascending
    // Its rows packed [comps.size() rounded up to 32][w] (zero rows past
    // them), in the precisions the Projector runs: f32 on the f32 path,
    // bf16 on the bf16 path, int8 (the dense Int8Basis's bytes) with kInt8.
    std::vector<float> f32;
    std::vector<uint16_t> bf16;
    std::vector<int8_t> s8;
  };
  std::vector<Group> groups;  // empty: one run (dense)
};

// The runs of T's first ru components; empty when they form one run or
// splitting saves under 10% of the multiply-adds (the GEMMs are then
// slower apart). Rows are packed in none of the precisions.
GroupedBasis find_groups(const Transform& T, uint32_t ru);

// Whether Projectors made from now on multiply a grouped basis run by run
// (default on). Off: one dense GEMM over the zeros, the control that
// kvtc-lab bench and the tests compare against. Process-wide.
void set_grouped_projection(bool on);
bool grouped_projection();

// The int8 decode's first step, apart for the tests: component-major codes
// c[k][n] of one chunk (k components, n tokens) as 8-bit fixed-point values
// sign(c) (8 |c| - round(8 offset)), token-major into a [n][k], and each
// value clamped at +-127 as (token, component, remainder) in outliers.
// vector: the AVX-512BW path (int8_codes_vector_path(): this CPU has it;
// the decoder takes it there), else the scalar one. Both give the same
// bytes and the same outliers in the same order.
void int8_codes(const int32_t* c, uint32_t k, uint32_t n, float offset, bool vector, std::vector<int8_t>* a,
                std::vector<std::array<int32_t, 3>>* outliers);
bool int8_codes_vector_path();

// Buffers Projector::decode_codes reuses across calls (the caller's, one per
// thread at a time; grown, never shrunk).
struct DecodeScratch {
  std::vector<int8_t> cm, a;
  std::vector<float> lead;
};

// With a layer-grouped basis (find_groups: more than one run, and
// grouped_projection() when made) every GEMM below runs once per run on
// that run's features and components (gathered; the int8 path's float
// share rounded up to 32 components within each run), the same products
// less those with the basis's zeros: ~1.8x fewer multiply-adds for
// SmolLM2's 2 runs of 15 layers.
class Projector {
 public:
  Projector(const Transform& T, uint32_t ru, Precision resolved, const std::string& key = {});

  // D[n][ru] = (X[n][p] - mu) B[:ru]', or D' [ru][n] with component_major
  // (the entropy coder's order). X is clobbered (centred in place on the
  // f32 path). Times the centring and the GEMM into `clk`.
  void encode(float* x, uint32_t n, float* d, StageClock* clk, bool component_major = false) const;
  // X[n][p] = D[n][ru] B[:ru] + mu; with component_major, d is D' [ru][n]
  // (the entropy-coded chunks' order).
  void decode(const float* d, uint32_t n, float* x, StageClock* clk, bool component_major = false) const;
  // The same for an entropy-coded chunk from its integer codes, c' [ru][n]
  // as ecsq_decode_codes writes them (rows past the chunk's own zero), with
  // the chunk's step and offset: each code's value sign(c) (|c| - offset)
  // step. With kInt8 the components after the last one with over a quarter
  // of its fixed-point codes (3 fraction bits) past 8 bits run in the
  // integer GEMM (their rarer wide codes clamped, the remainders added
  // apart; the leading ones as decode()); otherwise exactly decode() of the
  // values, component-major. Thread-safe (const; oneDNN's primitives and
  // scratchpads are per thread).
  // `scratch`: buffers to reuse (null: allocated here).
  void decode_codes(const int32_t* c, uint32_t n, float step, float offset, float* x, StageClock* clk, DecodeScratch* scratch = nullptr) const;

  uint32_t ru() const { return ru_; }
  // Runs multiplied apart (1: one dense GEMM).
  size_t groups() const { return grouped_ ? grouped_->groups.size() : 1; }
  // Whether decode_codes multiplies integers (the caller then decodes the
  // codes, not their float values).
  bool int8() const { return int8_; }

 private:
  // decode() over D's first k rows (component-major d with n columns, or
  // token-major with ru_ columns).
  void decode_rows(const float* d, uint32_t n, uint32_t k, float* x, StageClock* clk, bool component_major) const;
  // The same run by run: X[:, c0:c0+w] = D[:, comps] B_g + mu[c0:c0+w].
  void decode_rows_grouped(const float* d, uint32_t n, uint32_t k, float* x, StageClock* clk, bool component_major) const;
  // One run's float GEMM: X[:, c0:c0+w] = dg B_g[:m] + mu, dg component-major
  // [m][n] (cm) or token-major [n][m]; m = 0 writes the mean.
  void group_gemm(const GroupedBasis::Group& G, const float* dg, uint32_t m, uint32_t n, bool cm, float* x, StageClock* clk) const;
  void encode_grouped(float* x, uint32_t n, float* d, StageClock* clk, bool component_major) const;
  void center(float* x, uint32_t n, StageClock* clk) const;  // X[n][p] -= mu, in place (the f32 encoder's)

  const Transform& T_;
  uint32_t ru_;
  Precision prec_;  // of the float GEMMs: kF32 or kBF16
  bool int8_ = false;
  std::shared_ptr<const std::vector<uint16_t>> basis_bf16_;  // [ru][p], bf16 path only
  std::shared_ptr<const Int8Basis> basis_s8_;                // kInt8 only
  std::shared_ptr<const GroupedBasis> grouped_;              // null: one dense GEMM
};

}  // namespace kvtc::detail
