// kvtc: compress a captured KV cache into a .kvtc container and back
// (docs/format.md). The decoder half (kvtc_decompress, kvtc_inspect) needs
// only the calibration's mean and basis; the encoder half
// (kvtc_compress) also takes the bit allocation.
//
// Tokens: in each cache block the first `sink` and the last `window` tokens
// are stored raw (f16); the rest is de-RoPEd (keys), centred, projected on
// the PCA basis, quantized by the allocation, bit-packed plane by plane and
// DEFLATE-coded in independent chunks of at most `chunk_tokens` tokens.
// Thread safety: functions are reentrant; inputs are not modified.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvtc/alloc.h"
#include "kvtc/calibration.h"
#include "kvtc/kv_capture.h"

namespace kvtc {

constexpr uint32_t kContainerVersion = 1;

// Arithmetic of the projection on the PCA basis (the codec's GEMM, ~90% of
// its time). kBF16 rounds the GEMM's inputs (centred features or
// dequantized coefficients, and the basis) to bfloat16 and accumulates in
// f32: ~2x faster where the CPU has AVX512-BF16 or AMX (oneDNN), at a
// measured cost in bench/results/speed.md. kAuto picks kBF16 there and kF32
// (OpenBLAS sgemm) elsewhere. The container does not depend on how it will
// be decoded: either precision decodes any file.
enum class Precision : uint8_t { kAuto, kF32, kBF16 };
const char* precision_name(Precision p);          // "auto", "f32", "bf16"
Precision parse_precision(const std::string& s);  // Error naming the accepted values
// Whether this build and CPU run the bf16 projection natively (not an
// emulation). `impl`, when given, receives oneDNN's kernel name (for
// example "brg:avx512_core_bf16") or the reason it is not available.
// Thread-safe; probes once.
bool bf16_projection_available(std::string* impl = nullptr);
// The projection's GEMM alone, for benchmarks: C[m][n] = A[m][k] B' (B is
// [n][k], as the encoder multiplies) in `p` (resolved as the codec would),
// on all OpenMP threads, best of `repeat`; returns GFLOP/s (2 m n k flops).
double projection_gemm_gflops(Precision p, uint32_t m, uint32_t n, uint32_t k, int repeat);

// Time per codec stage, in milliseconds of thread time summed over the
// worker threads (so they add up to threads x wall time at most). Filled
// when a pointer is passed in the options; the caller owns it.
struct CodecStageTimes {
  double gather_ms = 0;                    // f16 <-> f32 and (de-)RoPE, cache layout <-> feature rows
  double center_ms = 0;                    // subtracting / adding the mean (bf16: with the rounding of the GEMM input)
  double project_ms = 0;                   // the GEMM with the PCA basis
  double quant_ms = 0;                     // quantization and bit packing (or unpacking and dequantization)
  double entropy_ms = 0;                   // DEFLATE / inflate, checksums, raw sections
  int threads = 1;                         // worker threads used
  Precision projection = Precision::kF32;  // what the projection ran in (never kAuto)
};

struct CompressOptions {
  uint32_t sink = 4;            // raw tokens at the start of each block
  uint32_t window = 128;        // raw tokens at the end of each block
  uint32_t chunk_tokens = 256;  // middle tokens per independently decodable chunk (multiple of 16)
  int deflate_level = 6;        // libdeflate level, 0..12
  // Chunks are coded in parallel on this many threads (0: all hardware
  // threads). The output does not depend on it.
  int threads = 0;
  // The codes depend on it (bf16 rounds the projection's input): for
  // byte-identical output across machines, ask for kF32.
  Precision precision = Precision::kAuto;
  CodecStageTimes* stats = nullptr;  // optional, not owned
};

struct DecompressOptions {
  int threads = 0;  // 0: all hardware threads; the output does not depend on it
  Precision precision = Precision::kAuto;
  CodecStageTimes* stats = nullptr;
};

// The allocation to use for one (block, K/V): [block][kind].
using AllocationSet = std::vector<std::array<Allocation, 2>>;

// Upper bound of the container size for `c` (to size buffers before encoding).
uint64_t kvtc_compress_bound(const KvCapture& c, const AllocationSet& alloc, const CompressOptions& opt);

// Encodes. The calibration must match the capture (model fingerprint,
// geometry); Error otherwise. Returns the exact container bytes.
std::vector<uint8_t> kvtc_compress(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt);

// Appends tokens to a container without re-encoding what it holds: `c` is
// the whole grown cache (its first tokens must be the container's, with
// the same positions) and adds a positive multiple of 16 tokens. Tokens
// that leave the raw window are coded into new chunks; the old window
// sections, always the file's last, are replaced. bytes[0, kept_bytes) of
// the result equal the input's: a file can be truncated there and the rest
// appended. Single-cache models only (not iSWA).
struct AppendResult {
  std::vector<uint8_t> bytes;
  size_t kept_bytes = 0;
};
AppendResult kvtc_append(const std::vector<uint8_t>& container, const KvCapture& c, const Calibration& cal, const std::string& origin);

// Decodes a whole container; refuses a calibration whose id differs from the
// one the container names. `origin` names the input in errors.
KvCapture kvtc_decompress(const std::vector<uint8_t>& bytes, const Calibration& cal, const std::string& origin,
                          const DecompressOptions& opt = DecompressOptions{});

// Layout and sizes without decoding (checksums verified).
struct ContainerInfo {
  uint32_t version = 0;
  std::string calibration_id, model_sha256;
  std::string header_json;
  struct Section {
    std::string kind;  // "positions", "raw", "chunk"
    uint32_t block = 0, kv = 0, t0 = 0, t1 = 0;
    uint64_t stored_bytes = 0, raw_bytes = 0;
  };
  std::vector<Section> sections;
  uint64_t file_bytes = 0;
  uint64_t n_tokens = 0, n_compressed_tokens = 0;        // over all blocks
  uint64_t f16_bytes_all = 0, f16_bytes_compressed = 0;  // K+V at f16
  uint64_t stored_bytes_compressed = 0;                  // chunk sections incl. their headers
  uint64_t payload_bytes_compressed = 0;                 // the same before DEFLATE (packed codes + parameters + headers)
};

// Relative squared reconstruction error ||x - x'||^2 / ||x||^2 of keys and
// values over the tokens that are not raw (sink/window), all blocks summed.
// Captures must have the same geometry and positions.
struct ReconError {
  double k = 0, v = 0;
  uint64_t tokens = 0;  // coded tokens of block 0
};
ReconError reconstruction_error(const KvCapture& ref, const KvCapture& dec, uint32_t sink, uint32_t window);
ContainerInfo kvtc_inspect(const std::vector<uint8_t>& bytes, const std::string& origin);

}  // namespace kvtc
