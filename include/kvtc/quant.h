// kvtc: the scalar quantizers of the codec, shared by encoder, decoder and
// calibration (the DP measures block errors with exactly these).
//
// A *block* is a run of consecutive PCA components coded, for one token,
// with one type and one set of parameters:
//   kNone  0 bits: the components are dropped (decoded as 0)
//   kInt2  2 bits/component + f16 minimum + f16 step (min-max affine)
//   kInt4  4 bits/component + f16 minimum + f16 step
//   kFp8   8 bits/component (E4M3, saturating) + f16 scale = absmax / 448
// Parameters are rounded to f16 *before* quantizing, so the decoder, which
// only sees the f16 values, reconstructs exactly what the encoder measured.
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtc {

enum class QType : uint8_t { kNone = 0, kInt2 = 1, kInt4 = 2, kFp8 = 3 };
constexpr int kNumQTypes = 4;

const char* qtype_name(QType t);
// Bits per component of the codes.
uint32_t qtype_code_bits(QType t);
// Bits of per-token block parameters (scale, offset) in f16.
uint32_t qtype_param_bits(QType t);
// Total bits of one block of `size` components for one token.
inline uint32_t block_bits(QType t, uint32_t size) {
  return t == QType::kNone ? 0 : qtype_code_bits(t) * size + qtype_param_bits(t);
}

// Quantizes x[0..n) as one block. Writes n codes (one per byte, low bits
// used) and the f16 parameters (params[0], params[1]; unused ones 0).
void quantize_block(QType t, const float* x, size_t n, uint8_t* codes, uint16_t params[2]);
// Reconstructs n values from codes and params.
void dequantize_block(QType t, const uint8_t* codes, size_t n, const uint16_t params[2], float* out);
// Squared error of coding x[0..n) with type t (quantize + dequantize).
double block_sq_error(QType t, const float* x, size_t n);

// FP8 E4M3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; max 448;
// 0x7f/0xff are NaN and never produced): round to nearest even, saturating.
uint8_t f32_to_e4m3(float x);
float e4m3_to_f32(uint8_t v);

}  // namespace kvtc
