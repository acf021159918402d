// Internal: the entropy-coded chunks of container version 2
// (docs/format.md "Entropy-coded chunks"): one uniform quantizer step for
// every PCA component of a chunk (entropy-constrained scalar quantization),
// integer codes coded component by component with static frequency tables
// (src/format/ecsq_tables.inc) by interleaved rANS: 4 states over bytes
// (container versions 2 and 3) or 32 over 16-bit words (version 4, which
// a decoder steps 32 tokens at a time in vector registers).
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

// The two payload layouts (docs/format.md "Entropy-coded chunks"), the
// same codes and tables either way:
// - kLanes4 (container versions 2 and 3): 4 rANS states over one byte
//   stream, the bypass bits (escapes, shifts) coded inside it as events.
// - kLanes32 (version 4): token t of a component uses state t mod 32;
//   16-bit words; the bypass bits in a plain bit stream after the words.
//   Why: 32 tokens of a component are then one table, two 16-lane gathers
//   in flight together and at most 32 words, with no event of another kind
//   between them, so a vector decoder takes them at once, where the 4-state
//   stream is walked one event at a time (bench/results/entropy.md).
enum class EcsqLayout : uint32_t { kLanes4 = 4, kLanes32 = 32 };
inline constexpr uint32_t kEcsqWideLanes = 32;  // kLanes32's states
// The layout of a container version's entropy-coded chunks (2, 3: kLanes4).
inline EcsqLayout ecsq_layout(uint32_t container_version) {
  return container_version >= 4 ? EcsqLayout::kLanes32 : EcsqLayout::kLanes4;
}

// Bytes in front of the rANS data: step, reconstruction offset, one table
// id per component, the rANS states (4 or 32 u32) and, for kLanes32, the
// u32 count of rANS words.
inline size_t ecsq_fixed_bytes(uint32_t ru, EcsqLayout layout) {
  return 8 + size_t(ru) + (layout == EcsqLayout::kLanes4 ? 16 : 4 * kEcsqWideLanes + 4);
}

// Encoder knobs (the decoder needs none but the layout, which the
// container's version gives it).
struct EcsqParams {
  float step = 1;                            // quantizer step, feature units (> 0)
  float rounding = 0.5f;                     // q = sign(d) floor(|d| / step + rounding): 0.5 rounds, less widens the zero bin
  EcsqLayout layout = EcsqLayout::kLanes32;  // what new containers use; appending to a version 2 or 3 file keeps kLanes4
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
// `layout`: the container's (ecsq_layout of its version).
void ecsq_decode_chunk(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, EcsqLayout layout, float* d, const std::string& where,
                       bool component_major = false);

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
void ecsq_decode_codes(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, EcsqLayout layout, int32_t* codes, const std::string& where);

// The step of a payload (append reuses the container's), Error if absent.
float ecsq_chunk_step(const uint8_t* buf, size_t len, const std::string& where);
// Its reconstruction offset (in [-0.5, 0.5]), Error if absent or outside.
float ecsq_chunk_offset(const uint8_t* buf, size_t len, const std::string& where);

// For tests and benchmarks: the kLanes32 decoder's symbol kernel. kAuto
// (the default) takes AVX-512 where the CPU has AVX-512 F/BW/VL, else AVX2,
// else scalar, and scalar when vector_kernels() is off; forcing one the CPU
// lacks is refused. All give the same codes and the same errors. Process-
// wide; set it while no decoder runs.
enum class Rans32Kernel : uint32_t { kAuto, kScalar, kAvx2, kAvx512 };
void ecsq_set_rans32_kernel(Rans32Kernel k);
Rans32Kernel ecsq_rans32_kernel();  // the one a decode runs now (never kAuto)

// For tests and the format spec: frequencies of table `id` (1..), 64 of
// them, summing to 4096; the number of tables; the SHA-256 of the table
// file as docs/format.md records it is checked by tests/test_ecsq.cpp.
const uint16_t* ecsq_table(uint32_t index);
uint32_t ecsq_table_count();

}  // namespace kvtc::container
