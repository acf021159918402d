// Internal (GPU path), kernel family (c): per-token block quantization and
// the container's packed planes, the device twin of quantize_block /
// dequantize_block (src/format/quantizers.cpp) and of pack_chunk /
// unpack_chunk (src/format/chunk.cpp). Each segment carries its
// quantizer's rule and widths from src/format/quantizers.h (qseg.h); a
// kernel branch per rule (core/scalar.h's QRule), none per type.
//
// Coefficients live component-major: Dt[comp * ld + row] (one component's
// values for consecutive tokens are contiguous, so the per-token reductions
// and the component-major code planes both read coalesced). Segments and
// tiles come from qseg.h (built by host_plan.h). Identical float input gives
// byte-identical parameters and codes: the parameter and code arithmetic is
// the CPU's own (core/scalar.h, __host__ __device__: f16 rounding, the int
// step rounded up, E4M3 round-to-nearest-even saturating, no FMA
// contraction), and min/max/abs-max use the CPU's comparison order (so
// -0/+0 pick the same operand).
#pragma once

#include "common.cuh"
#include "qseg.h"

namespace kvtc::cuda {

// Parameter planes of every segment (one CUDA block per segment); `base`
// + seg.off is where the segment's planes go.
void launch_quant_params(const float* dt, size_t ld, const QSeg* segs, uint32_t n_segs, uint8_t* base, cudaStream_t st);
// Code planes (one CUDA block per encode tile); reads the parameters the
// previous launch wrote.
void launch_quant_codes(const float* dt, size_t ld, const QSeg* segs, const QTile* tiles, uint32_t n_tiles, uint8_t* base, cudaStream_t st);
// Decoder: planes at base + seg.off -> dt (component-major, type dt_type),
// type-none segments zero-filled.
void launch_unpack(const uint8_t* base, const QSeg* segs, const QTile* tiles, uint32_t n_tiles, void* dt, size_t ld, ElemType dt_type,
                   cudaStream_t st);

}  // namespace kvtc::cuda
