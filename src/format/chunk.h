// Internal: the byte layout of one coded chunk (docs/format.md "Packed
// planes"), written once: the offsets of every allocation block's planes,
// the CPU packer and unpacker, and the segment offsets the GPU kernels
// (src/cuda/quant.cu) write and read, which are held to pack_chunk's bytes
// by tests/test_cuda.cpp.
//
// For each allocation block of type != none, in order: its parameter
// planes (the n low bytes of a parameter then its n high bytes; int2/int4:
// minimums then steps, fp8: scales), then its codes component-major,
// LSB-first, padded to a whole byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvtc/calibration.h"

namespace kvtc::container {

// Where one allocation block's bytes sit in a chunk of n tokens. Blocks of
// type none have no bytes (params == codes == end) but are listed, so the
// decoder can zero their components.
struct PlaneSpan {
  BlockAlloc blk;
  size_t params = 0;  // offset of the first parameter plane
  size_t codes = 0;   // offset of the codes
  size_t end = 0;     // one past the codes
};
std::vector<PlaneSpan> chunk_layout(const std::vector<BlockAlloc>& alloc, uint32_t n);
// Bytes of a chunk of n tokens (the layout's end); for an entropy-coded
// allocation (is_ecsq) an upper bound, the payload's size varies.
size_t packed_bytes(const Allocation& alloc, uint32_t n);
// The allocation is entropy-coded (Coding::kEntropy: container version 2,
// src/format/ecsq.h).
inline bool is_ecsq(const Allocation& alloc) {
  return alloc.coding == Coding::kEntropy;
}

// Components an allocation uses: the end of its last block.
uint32_t r_used(const std::vector<BlockAlloc>& alloc);

// Quantizes and packs n tokens of token-major coefficients d[t * ld + j];
// packed_bytes(alloc, n) bytes.
std::vector<uint8_t> pack_chunk(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc);
// The inverse: d[t * r_used + j] for the n tokens, dropped components 0.
// buf holds packed_bytes(alloc, n) bytes (checked by the caller).
void unpack_chunk(const uint8_t* buf, const std::vector<BlockAlloc>& alloc, uint32_t n, uint32_t r_used, float* d);

}  // namespace kvtc::container
