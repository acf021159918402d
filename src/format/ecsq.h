// Internal: the entropy-coded chunks of container version 2
// (docs/format.md "Entropy-coded chunks"): one uniform quantizer step for
// every PCA component of a chunk (entropy-constrained scalar quantization),
// integer codes coded component by component with static frequency tables
// (src/format/ecsq_tables.inc) by a 4-way interleaved rANS coder.
//
// Why: the fixed-rate quantizers of the DP spend a scale per token and
// block and leave DEFLATE only ~13% to find; one step for all components
// gives every component the same distortion (reverse water-filling), weak
// components become mostly zeros that cost almost nothing, and the
// per-component tables code what remains near its entropy.
// Thread safety: pure functions over caller buffers; the tables are built
// once (thread-safe static initialisation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvtc::container {

// Bytes in front of the rANS data: step, reconstruction offset, one table
// id per component, four rANS states.
inline size_t ecsq_fixed_bytes(uint32_t ru) {
  return 8 + size_t(ru) + 16;
}

// Encoder knobs (the decoder needs none of them).
struct EcsqParams {
  float step = 1;         // quantizer step, feature units (> 0)
  float rounding = 0.5f;  // q = sign(d) floor(|d| / step + rounding): 0.5 rounds, less widens the zero bin
};

// Codes n tokens of component-major coefficients d[j * n + t], j < ru (the
// rows of a [ld][n] array with ld >= ru: its first ru components).
// `chosen`: the ru table ids ecsq_estimate_bytes gave for the same d, n and
// p with stride 1 and not quick (the same choice, not made again), or null.
std::vector<uint8_t> ecsq_encode_chunk(const float* d, uint32_t n, uint32_t ru, const EcsqParams& p, const uint8_t* chosen = nullptr);

// The payload bytes ecsq_encode_chunk would write, from the same choices
// and the tables' code lengths (the rANS overhead, < 0.1%, aside): what
// rate control searches on. With stride > 1, of the max(1, n / stride)
// tokens 0, stride, 2 stride, ... only (the caller scales). `last_nonzero`,
// when given, is raised to one past the last component with a nonzero code.
// quick: fewer candidate tables (~1% more bytes, 3x faster): a search's
// first steps. `ids`, when given, receives the ru table ids chosen.
double ecsq_estimate_bytes(const float* d, uint32_t n, uint32_t ru, const EcsqParams& p, uint32_t stride = 1, uint32_t* last_nonzero = nullptr,
                           bool quick = false, uint8_t* ids = nullptr);

// Decodes a payload of `len` bytes into d[t * ru + j] for the n tokens, or
// d[j * n + t] with component_major (the stream's order: no transpose).
// Every read is bounds-checked; Error names `where` and what was wrong.
void ecsq_decode_chunk(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, float* d, const std::string& where, bool component_major = false);

// The reconstruction of code c: sign(c) (|c| - offset) step, 0 for c = 0
// (docs/format.md "Entropy-coded chunks").
inline float ecsq_value(int32_t c, float step, float offset) {
  const float a = c == 0 ? 0.0f : (float(c < 0 ? -c : c) - offset) * step;
  return c < 0 ? -a : a;
}

// The same payload's integer codes, component-major: codes[j * n + t] = c,
// whose reconstruction is sign(c) (|c| - offset) step (0 for c = 0), |c| <=
// 2^24. For a decoder that multiplies integers (Precision::kInt8): the
// float values would be turned back into these codes.
void ecsq_decode_codes(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, int32_t* codes, const std::string& where);

// The step of a payload (append reuses the container's), Error if absent.
float ecsq_chunk_step(const uint8_t* buf, size_t len, const std::string& where);
// Its reconstruction offset (in [-0.5, 0.5]), Error if absent or outside.
float ecsq_chunk_offset(const uint8_t* buf, size_t len, const std::string& where);

// For tests and the format spec: frequencies of table `id` (1..), 64 of
// them, summing to 4096; the number of tables; the SHA-256 of the table
// file as docs/format.md records it is checked by tests/test_ecsq.cpp.
const uint16_t* ecsq_table(uint32_t index);
uint32_t ecsq_table_count();

}  // namespace kvtc::container
