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
#include "kvtc/alloc.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"
#include "kvtc/kv_capture.h"
#include "kvtc/rope.h"
#include "qseg.h"

namespace kvtc::cuda {

// nvCOMP's Deflate compresses at most this many bytes per stream.
constexpr size_t kNvcompMaxChunkBytes = 65536;

uint32_t r_used(const std::vector<BlockAlloc>& a);

struct TokenLayout {
  uint32_t s_end = 0, w_begin = 0;  // raw sink [0, s_end), coded [s_end, w_begin), raw window [w_begin, n)
};
TokenLayout token_layout(uint32_t n, uint32_t sink, uint32_t window);
std::vector<std::pair<uint32_t, uint32_t>> chunk_ranges(uint32_t c0, uint32_t c1, uint32_t chunk_tokens);

// Bytes of one chunk of n tokens (== container::packed_bytes).
size_t packed_chunk_bytes(const std::vector<BlockAlloc>& alloc, uint32_t n);
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

// The CPU encoder's packing of one chunk, from token-major coefficients
// d[t * ld + component] (quantize_block per token and block, then the
// planes). Reference for the GPU kernels.
std::vector<uint8_t> pack_reference(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc);

// ---- container (encode) ------------------------------------------------
// kvtc_compress's checks (model fingerprint, geometry, allocation size,
// chunk_tokens, level) on a capture's host part (k/v may be empty).
void check_compress_inputs(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);
// The JSON header kvtc_compress writes (docs/format.md).
std::string encode_header_json(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);
void put_file_header(uint8_t* dst, const std::string& json);  // kFileHeaderBytes + json.size() bytes
void put_section_header(uint8_t* dst, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, uint64_t raw_len, uint64_t stored_len,
                        uint64_t xxh);

// ---- container (decode) ------------------------------------------------
struct DecodeBlock {
  std::vector<int32_t> layers;
  uint32_t n_head_kv = 0, head_dim = 0, n_tokens = 0;
  std::vector<BlockAlloc> alloc[2];
  uint32_t r_used[2] = {0, 0};
};
struct DecodeHeader {
  std::string calibration_id, model_sha256;
  uint32_t sink = 0, window = 0, chunk_tokens = 0;
  bool has_tokens = false, keys_derope = true;
  std::map<std::string, std::string> capture_meta;
  std::vector<DecodeBlock> blocks;
};
// Everything kvtc_decompress checks before decoding K/V: magic, version,
// checksums (verified on `threads` threads), header, calibration id, block
// geometry against the calibration, positions and token tiling, and the
// coverage of every (block, kind, token) exactly once by raw and chunk
// sections of the right sizes. Positions and token ids are decoded here.
struct DecodePlan {
  DecodeHeader H;
  KvCapture host;                               // meta, tokens, per block layers/geometry/pos; k and v empty
  std::vector<container::Section> kv_sections;  // raw and chunk sections, validated, file order
  std::vector<std::optional<RopeParams>> rope;  // per block, when keys of that block are coded and de-RoPEd
};
DecodePlan plan_decode(const uint8_t* bytes, size_t n, const Calibration& cal, const std::string& origin, int threads);

}  // namespace kvtc::cuda
