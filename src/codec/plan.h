// Internal: the container rules both codecs share — the CPU's
// (src/codec/encode.cpp, decode.cpp) and the GPU's (src/cuda/) — written
// once: the token layout and chunking, the encoder's input checks and
// header, and everything a decoder checks before it decodes K/V.
// Part of kvtc_codec (the decoder library); plain C++.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "container.h"
#include "kvtc/alloc.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"
#include "kvtc/kv_capture.h"
#include "kvtc/rope.h"

namespace kvtc::container {

// Components an allocation uses: the end of its last block.
uint32_t r_used(const std::vector<BlockAlloc>& a);

// Tokens of a block of n: raw sink [0, s_end), coded [s_end, w_begin), raw
// window [w_begin, n).
struct TokenLayout {
  uint32_t s_end = 0, w_begin = 0;
};
TokenLayout token_layout(uint32_t n, uint32_t sink, uint32_t window);
// Coded ranges [t0, t1) of [c0, c1), chunk by chunk.
std::vector<std::pair<uint32_t, uint32_t>> chunk_ranges(uint32_t c0, uint32_t c1, uint32_t chunk_tokens);

// ---- encoding ------------------------------------------------------------
// kvtc_compress's checks: model fingerprint, block count and geometry
// against the calibration, allocation size, chunk_tokens, level, token ids.
// Uses only the capture's host part (k and v may be empty).
void check_compress_inputs(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);
// Quantizes and packs one chunk of n tokens from token-major coefficients
// d[t * ld + component] into the byte layout of docs/format.md ("Packed
// planes"); packed_bytes(alloc, n) bytes. The GPU kernels are held to it.
std::vector<uint8_t> pack_chunk(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc);
// The JSON header of docs/format.md.
std::string header_json(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);

// ---- decoding ------------------------------------------------------------
struct BlockHeader {
  std::vector<int32_t> layers;
  uint32_t n_head_kv = 0, head_dim = 0, n_tokens = 0;
  std::array<std::vector<BlockAlloc>, 2> alloc;
  std::array<uint32_t, 2> r_used{0, 0};
};
struct Header {
  std::string calibration_id, model_sha256;
  uint32_t sink = 0, window = 0, chunk_tokens = 0;
  bool has_tokens = false;
  bool keys_derope = true;  // header keys_rope: "removed" (absent: removed) or "kept"
  std::map<std::string, std::string> capture_meta;
  std::vector<BlockHeader> blocks;
};
// Parses and range-checks the header; Error names `origin` and the field.
Header parse_header(const std::string& js, const std::string& origin);
// Token counts per block from the positions sections, which must tile
// [0, n) (in any order: appended containers add ranges at the end).
void derive_token_counts(const Parsed& P, Header& H, const std::string& origin);

// Everything a decoder checks before decoding K/V: the header, calibration
// id, keys_rope and block geometry against the calibration, positions and
// token tiling, and the coverage of every (block, kind, token) exactly once
// by raw and chunk sections of the right sizes. Positions and token ids are
// decoded here. Sections point into the parsed buffer.
struct DecodePlan {
  Header H;
  KvCapture host;                               // meta, tokens, per block layers/geometry/pos; k and v empty
  std::vector<Section> kv_sections;             // raw and chunk sections, validated, in file order
  std::vector<std::optional<RopeParams>> rope;  // per block, where its keys are coded and de-RoPEd
};
DecodePlan plan_decode(const Parsed& P, const Calibration& cal, const std::string& origin);

}  // namespace kvtc::container
