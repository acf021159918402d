// Internal (GPU path): the segment and tile tables the quantization kernels
// walk, built on the host from the container's chunk layout
// (format/chunk.h, the same offsets the CPU packer writes), and the
// nvCOMP chunk-size fitting. Plain C++ (no CUDA), so the host-side tests
// run on machines without a GPU. Everything else the GPU codec plans (the
// sections, their order, the header, the decoder's checks) is the CPU's own
// code in src/format/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common.cuh"  // ElemType (host C++; no kernels)
#include "format/chunk.h"
#include "format/ecsq.h"
#include "kvtc/calibration.h"
#include "qseg.h"

namespace kvtc::cuda {

// nvCOMP's Deflate compresses at most this many bytes per stream.
constexpr size_t kNvcompMaxChunkBytes = 65536;

// Largest multiple of 16 <= limit whose chunks fit max_bytes under every
// allocation of `alloc`; 0 when not even 16 tokens fit.
uint32_t chunk_tokens_fitting(const AllocationSet& alloc, uint32_t limit, size_t max_bytes);

// Appends the segments of one chunk (rows row0..row0+n) whose planes start
// at byte `off`; returns the chunk's bytes. With include_none, blocks of
// type none get a segment too (the decoder zero-fills their components;
// such a segment has no bytes).
size_t append_chunk_segments(const std::vector<BlockAlloc>& alloc, uint32_t row0, uint32_t n, uint64_t off, bool include_none,
                             std::vector<QSeg>& segs);
// Tiles of segs[first..]: encode covers code bytes, decode covers codes
// (and the elements of type-none segments).
void append_encode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles);
void append_decode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles);

// Entropy-coded chunks (container versions 2-4, type 4) on the GPU decoder.
// Their rANS streams are sequential — 4 (or, version 4, 16) interleaved
// states share one stream, so one chunk is one thread's work — and the CPU
// decodes them fast enough (bench/results/entropy.md), so they decode on
// the host threads with the CPU's own decoder (format/ecsq.h: the same
// checks, the same codes; `layout` the container version's) and the device does the rest (GEMM, mean,
// re-RoPE, scatter). Writes the chunk's n x ru coefficients into the job's
// component-major plane: dt[j * ld + row0 + t] for j < ru, t < n, in
// element type et (f32 as decoded; bf16 / f16 rounded to nearest even, what
// the device's own conversion of a DP plane does). `scratch` is reused
// between calls (n * ru floats). Error names `where` on a bad payload.
// Thread safety: distinct (dt rows, scratch) per concurrent call.
void ecsq_chunk_to_plane(const uint8_t* payload, size_t len, container::EcsqLayout layout, uint32_t row0, uint32_t n, uint32_t ru, void* dt,
                         size_t ld, ElemType et, const std::string& where, std::vector<float>& scratch);
// f32 -> bf16, round to nearest even (NaN kept quiet), as __float2bfloat16_rn.
uint16_t f32_to_bf16(float f);

}  // namespace kvtc::cuda
