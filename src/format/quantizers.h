// Internal: the quantizers of the container format, described once
// (docs/format.md "Header", "Packed planes of a chunk", "Dequantization").
//
// A fixed-rate quantizer is one row of kQuantizers: its type code (the
// QType value, written in the container header's and the calibration
// tables' [start, size, type] triples), its name, its code and parameter
// widths, and its rule: the arithmetic family whose scalar steps are in
// core/scalar.h, shared with the GPU. Everything else derives from the row:
// the chunk layout and the CPU packer/unpacker (format/chunk.cpp), the
// block quantizer below, which the calibration's block errors use too (so
// the DP measures exactly what the encoder writes: calib/dp.cpp), the DP's
// choices and the columns of Transform::block_errors (the table's order),
// and the GPU kernels' segment records (cuda/host_plan.cpp fills each
// segment's rule and widths from its row; cuda/quant.cu switches on the
// rule and never sees a type code).
//
// The entropy-coded mode (container version 2, format/ecsq.h) is not a
// fixed-rate quantizer but a coding of a whole allocation
// (Allocation::coding): its one block has a type code of its own in the
// container header (kEcsqTypeCode) but no row, no fixed width, and the DP
// never chooses it.
//
// Adding a quantizer: docs/architecture.md "Adding a quantizer".
// Thread safety: constants and pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/scalar.h"
#include "kvtc/calibration.h"

namespace kvtc::container {

struct Quantizer {
  QType type;          // its type code in the container header and the calibration's tables is uint32_t(type)
  const char* name;    // qtype_name(type): "none", "int2", "int4", "fp8"
  uint32_t code_bits;  // bits per component and token; divides 8, so a code never straddles a byte of the packed planes
  uint32_t n_params;   // f16 parameters per token and block, each one plane (n low bytes, n high bytes): at most 2
  QRule rule;          // how codes and parameters are chosen and decoded (core/scalar.h)
};

// The fixed-rate quantizers, in the order the DP enumerates them and the
// calibration's block errors list them ([r / size][kNumQTypes] columns).
inline constexpr std::array<Quantizer, kNumQTypes> kQuantizers{{
    {QType::kNone, "none", 0, 0, QRule::kZero},    // dropped: decoded as 0
    {QType::kInt2, "int2", 2, 2, QRule::kAffine},  // f16 minimum, f16 step
    {QType::kInt4, "int4", 4, 2, QRule::kAffine},  // f16 minimum, f16 step
    {QType::kFp8, "fp8", 8, 1, QRule::kE4M3},      // f16 scale = absmax / 448
}};

// The type code of the block of an entropy-coded allocation
// (Coding::kEntropy) in the container header: docs/format.md "Entropy-coded
// chunks", the single [0, r_used, 4] triple of its kind. header_type_code
// (kvtc/codec.h) writes it, parse_header (format/plan.cpp) reads it.
inline constexpr uint32_t kEcsqTypeCode = 4;

// The row of a type code; nullptr when no fixed-rate quantizer has it (the
// entropy-coded block's code included). Parsers validate codes with it.
constexpr const Quantizer* find_quantizer(uint32_t code) {
  for (const Quantizer& q : kQuantizers)
    if (uint32_t(q.type) == code) return &q;
  return nullptr;
}
// The row of t; Error when t has none (an allocation that did not come
// through check_compress_inputs or a parser).
const Quantizer& quantizer(QType t);
// Its index in kQuantizers: the DP's choice, the block errors' column.
size_t quantizer_index(QType t);

// What adding a row must keep true, checked at compile time.
consteval bool quantizers_are_consistent() {
  for (const Quantizer& q : kQuantizers) {
    if (uint32_t(q.type) == kEcsqTypeCode) return false;                                  // 4 is the entropy-coded block's
    if (find_quantizer(uint32_t(q.type)) != &q) return false;                             // one row per code
    if (q.code_bits > 8 || (q.code_bits && 8 % q.code_bits)) return false;                // pack_chunk's byte-aligned codes
    if (q.n_params > 2) return false;                                                     // quantize_block's params[2]
    if ((q.rule == QRule::kZero) != (q.code_bits == 0 && q.n_params == 0)) return false;  // only kZero codes nothing
    if (q.rule == QRule::kAffine && q.n_params != 2) return false;                        // minimum, step
    if (q.rule == QRule::kE4M3 && (q.n_params != 1 || q.code_bits != 8)) return false;    // scale; E4M3 is 8 bits
  }
  return kQuantizers[0].rule == QRule::kZero;  // the DP's "dropped" choice (calib/dp.cpp trims trailing ones)
}
static_assert(quantizers_are_consistent(), "src/format/quantizers.h: kQuantizers breaks a rule of quantizers_are_consistent()");

// Bits of one block of `size` components for one token, parameters included.
constexpr uint32_t block_bits(const Quantizer& q, uint32_t size) {
  return q.code_bits * size + 16 * q.n_params;
}
inline uint32_t block_bits(QType t, uint32_t size) {
  return block_bits(quantizer(t), size);
}

// Quantizes x[0..n) as one block: n codes (one per byte, the low code_bits
// used) and the f16 parameters (params[0], params[1]; unused ones 0).
// Parameters are rounded to f16 before the codes are chosen, so the
// decoder, which sees only the f16 values, reconstructs what the encoder
// measured.
void quantize_block(const Quantizer& q, const float* x, size_t n, uint8_t* codes, uint16_t params[2]);
// Reconstructs n values from codes and params.
void dequantize_block(const Quantizer& q, const uint8_t* codes, size_t n, const uint16_t params[2], float* out);
// Squared error of coding x[0..n) with q (quantize + dequantize); runs
// longer than 1,024 (the largest DP block) are coded as consecutive blocks.
double block_sq_error(const Quantizer& q, const float* x, size_t n);

inline void quantize_block(QType t, const float* x, size_t n, uint8_t* codes, uint16_t params[2]) {
  quantize_block(quantizer(t), x, n, codes, params);
}
inline void dequantize_block(QType t, const uint8_t* codes, size_t n, const uint16_t params[2], float* out) {
  dequantize_block(quantizer(t), codes, n, params, out);
}
inline double block_sq_error(QType t, const float* x, size_t n) {
  return block_sq_error(quantizer(t), x, n);
}

}  // namespace kvtc::container
