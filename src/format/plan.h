// Internal: the container rules above the bytes, written once for both
// backends (src/codec/encode.cpp, decode.cpp, src/cuda/cuda_codec.cpp) and
// for append and inspect: which tokens are raw and how the coded ones are
// chunked, the order of the sections, the encoder's checks and JSON
// header, and everything a decoder checks before it decodes K/V.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "format/chunk.h"
#include "format/container.h"
#include "kvtc/cache.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"

namespace kvtc::container {

// Tokens of a block of n: raw sink [0, s_end), coded [s_end, w_begin), raw
// window [w_begin, n).
struct TokenLayout {
  uint32_t s_end = 0, w_begin = 0;
};
TokenLayout token_layout(uint32_t n, uint32_t sink, uint32_t window);
// Coded ranges [t0, t1) of [c0, c1), chunk by chunk.
std::vector<std::pair<uint32_t, uint32_t>> chunk_ranges(uint32_t c0, uint32_t c1, uint32_t chunk_tokens);

// ---- encoding ------------------------------------------------------------
// One section to write, in container order.
struct SectionPlan {
  uint32_t kind = 0, block = 0, kv = 0, t0 = 0, t1 = 0;
};
// The sections of tokens [n0, n) of every block, in the order of
// docs/format.md: per block its positions (and block 0's tokens); per block
// and kind the sink (when n0 == 0) and the chunks of [max(c0, sink end),
// window begin); last, every block's raw window. n0 = c0 = 0 is a whole
// container; append passes the old token count and old window start.
std::vector<SectionPlan> plan_sections(const KvCapture& c, const CompressOptions& opt, uint32_t n0, uint32_t c0);

// compress's checks on a capture's host part (k and v may be empty):
// model fingerprint, block count and geometry against the calibration,
// RoPE that can be undone where keys are de-RoPEd, allocation sizes,
// chunk_tokens, level, token ids.
void check_compress_inputs(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);
// Error unless `g` (a capture's or a container's) is the calibration's
// model and geometry: fingerprint, block count, features per block, and
// layers, heads and dims where the calibration records them.
void check_geometry(const CacheGeometry& g, const Calibration& cal, const std::string& who);
// The container version a writer uses for an allocation: 4 where any
// (block, kind) is entropy-coded (its chunks in the 32-lane layout), else
// 1; with the options: at least 3 where the window is 8-bit (opt.window_bits
// 8). Readers accept entropy-coded chunks from version 2 on (versions 2 and
// 3 in the 4-lane layout).
uint32_t container_version(const AllocationSet& alloc);
uint32_t container_version(const AllocationSet& alloc, const CompressOptions& opt);
// The JSON header of docs/format.md.
std::string header_json(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);

// ---- decoding ------------------------------------------------------------
// Parses and range-checks the JSON header; Error names `origin` and the
// field. n_tokens is left empty (the positions sections hold it).
ContainerHeader parse_header(const std::string& js, const std::string& origin);
// Token counts per block from the positions sections, which must tile
// [0, n) (in any order: appended containers add ranges at the end).
void derive_token_counts(const Parsed& P, ContainerHeader& H, const std::string& origin);
// The header of a parsed container with its token counts.
ContainerHeader read_header(const Parsed& P, const std::string& origin);

// Everything a decoder checks before decoding K/V: the header, calibration
// id, keys_rope and block geometry against the calibration, positions and
// token tiling, and the coverage of every (block, kind, token) exactly once
// by raw and chunk sections of the right sizes. Positions and token ids are
// decoded here. Sections point into the parsed buffer.
struct DecodePlan {
  ContainerHeader H;
  KvCapture host;                               // geometry, provenance, tokens, positions; k and v empty
  std::vector<Section> kv_sections;             // raw and chunk sections, validated, in file order
  std::vector<std::array<uint32_t, 2>> r_used;  // per block and kind
};
DecodePlan plan_decode(const Parsed& P, const Calibration& cal, const std::string& origin);

}  // namespace kvtc::container
