// Internal (GPU path): host-side planning shared by the CUDA codec and its
// tests — token layout, chunking, the segment tables the quantization
// kernels walk, the container header and a parallel-checksum parser. Plain
// C++ (no CUDA), so the host-side tests run on machines without a GPU.
//
// Byte layout of a chunk (docs/format.md, "Packed planes"): for each
// allocation block of type != none, the parameter planes (low bytes of n
// tokens, then high bytes; int2/int4: minimums then steps; fp8: scales),
// then the codes component-major, LSB-first, padded to a byte.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../codec/container.h"
#include "../codec/plan.h"
#include "kvtc/alloc.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"
#include "kvtc/kv_capture.h"
#include "kvtc/rope.h"
#include "qseg.h"

namespace kvtc::cuda {

// nvCOMP's Deflate compresses at most this many bytes per stream.
constexpr size_t kNvcompMaxChunkBytes = 65536;

// The container rules the CPU codec uses too (src/codec/plan.h).
using container::chunk_ranges;
using container::r_used;
using container::token_layout;
using container::TokenLayout;

// Bytes of one chunk of n tokens.
inline size_t packed_chunk_bytes(const std::vector<BlockAlloc>& alloc, uint32_t n) {
  return container::packed_bytes(alloc, n);
}
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

// The CPU encoder's packing of one chunk (container::pack_chunk): the
// reference for the GPU kernels.
inline std::vector<uint8_t> pack_reference(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc) {
  return container::pack_chunk(d, n, ld, alloc);
}

// ---- container (encode) ------------------------------------------------
using container::check_compress_inputs;                       // kvtc_compress's checks on a capture's host part
using container::header_json;                                 // the JSON header kvtc_compress writes
void put_file_header(uint8_t* dst, const std::string& json);  // kFileHeaderBytes + json.size() bytes
void put_section_header(uint8_t* dst, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, uint64_t raw_len, uint64_t stored_len,
                        uint64_t xxh);

// ---- container (decode) ------------------------------------------------
// container::plan_decode (every check kvtc_decompress makes before decoding
// K/V) with the section checksums verified on `threads` threads.
using container::DecodePlan;
DecodePlan plan_decode(const uint8_t* bytes, size_t n, const Calibration& cal, const std::string& origin, int threads);

}  // namespace kvtc::cuda
