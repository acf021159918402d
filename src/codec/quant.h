// Internal: the scalar quantizers of the codec (kvtc::QType), shared by
// encoder, decoder and calibration (the DP measures block errors with
// exactly these). Their arithmetic lives in core/scalar.h, which the GPU
// kernels share. Parameters are rounded to f16 *before* quantizing, so the
// decoder, which only sees the f16 values, reconstructs exactly what the
// encoder measured.
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvtc/calibration.h"

namespace kvtc {

// Bits per component of the codes: 0, 2, 4, 8.
uint32_t qtype_code_bits(QType t);
// Bits of per-token block parameters in f16: 0 (none), 32 (int: minimum and
// step), 16 (fp8: scale).
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

}  // namespace kvtc
