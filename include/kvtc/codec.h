// kvtc: compress a KV cache into a .kvtc container and back
// (docs/format.md), on the CPU. The GPU backend (<kvtc/cuda.h>) takes the
// same options, fills the same statistics and writes the same container.
//
// In each cache block the first `sink` and the last `window` tokens are
// stored raw (f16); the others are de-RoPEd (keys), centred, projected on
// the calibration's PCA basis, quantized by the allocation, bit-packed
// plane by plane and DEFLATE-coded in independent chunks of at most
// `chunk_tokens` tokens. The decoder needs only the calibration's means
// and bases (load it with decoder_only = true).
// Thread safety: functions are reentrant; inputs are not modified; each
// call uses its own worker threads (CompressOptions::threads).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "kvtc/cache.h"
#include "kvtc/calibration.h"

namespace kvtc {

// The newest container version this library writes and reads. Version 2
// adds entropy-coded chunks (Coding::kEntropy), version 3 the 8-bit window,
// version 4 the entropy-coded chunks' 32-lane layout (docs/format.md), in
// which they are written now; a container without them is still written as
// version 1 (3 with an 8-bit window), byte for byte what earlier releases
// wrote. Every version is read.
constexpr uint32_t kContainerVersion = 4;

// Arithmetic of the projection on the PCA basis (the codec's GEMM, ~90% of
// its CPU time). kBF16 rounds the GEMM's inputs (centred features or
// dequantized coefficients, and the basis) to bfloat16 and accumulates in
// f32: ~2x faster where the CPU has AVX512-BF16 or AMX (oneDNN), at a
// measured cost (bench/results/quality-precision.md). kTF32 and kF16 exist
// on the GPU only; the CPU refuses them. kAuto: the encoder in bf16 where
// the CPU runs it natively, else f32; the decoder in kInt8 where the CPU
// has AVX2, except where bf16 is native and the CPU lacks AVX-512 VNNI, or
// has AMX without oneDNN's AMX int8 kernel: bf16 there; else f32; on the
// GPU, f32. Any precision decodes any container; byte-identical output
// across machines needs kF32.
// kInt8 (CPU decode): the entropy-coded
// chunks' integer codes, in fixed point with 3 fraction bits for the
// reconstruction offset, times the basis in 7-bit integers with one scale
// per feature, in oneDNN's integer GEMM (AMX tiles where the CPU has
// them; else gemm:jit: VNNI where the CPU has it, AVX2's vpmaddubsw); a chunk's leading components whose
// codes pass the 8-bit range, the DP's chunks and the encoder run in bf16
// where native, else f32. ~0.8% more squared error than f32, KL on the model
// within noise of f32's; the entropy-coded decode 1.33-1.51x faster than f32
// on AVX2 (bench/results/speed-int8.md, quality-int8.md) and 1.57x faster
// than bf16 on a Zen 4 EPYC with AVX-512 VNNI (speed-vnni.md,
// quality-int8-vnni.md).
enum class Precision : uint8_t { kAuto, kF32, kBF16, kTF32, kF16, kInt8 };
const char* precision_name(Precision p);          // "auto", "f32", "bf16", "tf32", "f16", "int8"
Precision parse_precision(const std::string& s);  // Error naming the accepted values

// Time per codec stage. CPU: milliseconds of thread time summed over the
// worker threads (so at most threads x wall time); GPU: device time from
// CUDA events, plus the transfer and host stages. Filled when a pointer is
// passed in the options; the caller owns it.
struct CodecStats {
  double gather_ms = 0;                    // f16 <-> f32 and (de-)RoPE, cache layout <-> feature rows
  double center_ms = 0;                    // subtracting / adding the mean (0 where fused into gather or the GEMM)
  double project_ms = 0;                   // the GEMM with the PCA basis
  double quant_ms = 0;                     // quantization and bit packing, or unpacking and dequantization
  double entropy_ms = 0;                   // DEFLATE / inflate, checksums, raw sections
  double transfer_ms = 0;                  // GPU: host <-> device copies (CPU: 0)
  double host_ms = 0;                      // GPU: planning, headers, assembling containers on the host (CPU: 0)
  double total_ms = 0;                     // wall time of the call
  int threads = 1;                         // worker (CPU) or host (GPU) threads used
  Precision projection = Precision::kF32;  // what the projection ran in (never kAuto)
  // Runs of layers the projection multiplied apart, most over the cache's
  // (block, K/V) transforms: 1 for one PCA's dense basis, the calibration's
  // layer_groups for a layer-grouped one (FitOptions::layer_groups).
  uint32_t projection_groups = 1;
  std::string entropy_backend;  // "libdeflate", "nvcomp", "libdeflate-host", "stored", or a mix
};

struct CompressOptions {
  uint32_t sink = 4;            // raw tokens at the start of each block
  uint32_t window = 128;        // raw tokens at the end of each block
  uint32_t chunk_tokens = 256;  // coded tokens per independently decodable chunk (multiple of 16, <= 65536)
  int deflate_level = 6;        // libdeflate level 0..12 (0: stored)
  // Worker threads (GPU: host threads) for this call; 0: all hardware
  // threads. The output does not depend on it.
  int threads = 0;
  // The codes depend on it (bf16 rounds the projection's input).
  Precision precision = Precision::kAuto;
  CodecStats* stats = nullptr;  // optional, not owned
  // Entropy-coded allocations only (Coding::kEntropy, ecsq_allocation_set;
  // the decoder needs neither): a fixed quantizer step in feature units
  // instead of rate control's search for the allocation's nominal ratio
  // (0: search), and the quantizer's rounding, q = sign(d) floor(|d| /
  // step + rounding) (0.5: nearest; less widens the zero bin, which the
  // decoder's reconstruction offset follows: 0.35 saves ~1 point more bytes
  // than 0.5 at equal error on SmolLM2 and Qwen2.5, bench/results/entropy.md).
  // Components whose calibration standard deviation is under ecsq_min_sd x
  // step are dropped: mostly zeros, they cost little in bytes but their
  // basis rows cost the projection as much as any (0: keep every one). 0.7
  // decodes at 0.88-1.01x the DP's time at equal error on Qwen2.5-1.5B and
  // SmolLM2 for ~20% fewer bytes; 0.5 saved ~4 points more but decoded
  // at 0.98-1.11x (bench/results/entropy.md).
  double ecsq_step = 0;
  double ecsq_rounding = 0.35;
  double ecsq_min_sd = 0.7;
  // Bits per value of the raw window (the last `window` tokens; the sink
  // stays f16): 16 (f16, as the cache holds them) or 8 (int8 codes with an
  // f16 scale per key channel / value token; container version 3,
  // docs/format.md). 8 halves the window's bytes: at 4K tokens and 16x
  // the window is ~1/3 of the container (bench/results/window8.md).
  uint32_t window_bits = 16;
};

struct DecompressOptions {
  int threads = 0;  // 0: all hardware threads; the output does not depend on it
  Precision precision = Precision::kAuto;
  CodecStats* stats = nullptr;
};

// Upper bound of the container size of `c` (to size buffers before encoding).
uint64_t compress_bound(const KvCapture& c, const AllocationSet& alloc, const CompressOptions& opt = {});

// Encodes a cache. The calibration must be of the capture's model and
// geometry, and the allocation of the calibration's; Error otherwise.
// Returns the container's exact bytes.
std::vector<uint8_t> compress(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt = {});

// Decodes a whole container. Refuses a calibration whose id differs from
// the one the container names; `origin` names the input in errors.
KvCapture decompress(std::span<const uint8_t> container, const Calibration& cal, const std::string& origin, const DecompressOptions& opt = {});

// Grows a container by the new tokens of a longer cache without re-encoding
// what it holds: `grown` is the whole cache (its first tokens must be the
// container's, at the same positions) with a positive multiple of 16 more
// tokens. Tokens that leave the raw window are coded into new chunks; the
// old window sections, always the file's last, are replaced. bytes[0,
// kept_bytes) of the result equal the input's: a file can be truncated
// there and the rest appended. sink, window, chunk size, level and the
// allocation come from the container; threads, precision and stats from
// `opt`. Single-cache models only (not iSWA).
struct AppendResult {
  std::vector<uint8_t> bytes;
  size_t kept_bytes = 0;
};
AppendResult append(std::span<const uint8_t> container, const KvCapture& grown, const Calibration& cal, const std::string& origin,
                    const CompressOptions& opt = {});

// ---- llama.cpp state blobs ------------------------------------------------
// compress(capture_from_state(blob, g)) with the token ids given (or none).
// `blob` is a sequence state (llama_state_seq_get_data) or a whole
// context's state (llama_state_get_data; llama-cpp-python's
// LlamaState.llama_state), told apart by its first bytes; the container
// records which, with the state's layout (V layout, streams, sequence id)
// and a context state's architecture name (docs/llama-state.md).
std::vector<uint8_t> compress_state(std::span<const uint8_t> blob, const CacheGeometry& g, const Calibration& cal, const AllocationSet& alloc,
                                    const CompressOptions& opt = {}, std::span<const int32_t> tokens = {});
// The state again, for a context of layout `to`: bytes for
// llama_state_seq_set_data (a sequence state, or a container not made by
// compress_state) or llama_state_set_data (a context state).
std::vector<uint8_t> decompress_state(std::span<const uint8_t> container, const Calibration& cal, const StateLayout& to, const std::string& origin,
                                      const DecompressOptions& opt = {});
// The same in the layout recorded at compression (the source context's);
// Error for a container compress_state did not make.
std::vector<uint8_t> decompress_state(std::span<const uint8_t> container, const Calibration& cal, const std::string& origin,
                                      const DecompressOptions& opt = {});

// ---- inspection -------------------------------------------------------------
// The container header, typed (docs/format.md "Header").
struct ContainerHeader {
  uint32_t version = 0;
  std::string calibration_id;
  uint32_t sink = 0, window = 0, chunk_tokens = 0;
  int deflate_level = 0;
  bool has_tokens = false;
  bool keys_derope = true;
  uint32_t window_bits = 16;                // 8: the window's sections are raw8 (version 3)
  CacheGeometry geometry;                   // model fingerprint and per-block layers, heads, dims, RoPE, window
  std::map<std::string, std::string> meta;  // the capture's provenance strings
  AllocationSet alloc;                      // per block and kind: allocation blocks and nominal ratio
  std::vector<uint32_t> n_tokens;           // per block (from the positions sections)
};

// Layout and sizes without decoding (every checksum verified).
struct ContainerInfo {
  ContainerHeader header;
  struct Section {
    std::string kind;  // "positions", "tokens", "raw", "raw8", "chunk"
    uint32_t block = 0, kv = 0, t0 = 0, t1 = 0;
    uint64_t stored_bytes = 0, raw_bytes = 0;
  };
  std::vector<Section> sections;
  uint64_t file_bytes = 0;
  uint64_t n_tokens = 0, n_compressed_tokens = 0;        // over all blocks
  uint64_t f16_bytes_all = 0, f16_bytes_compressed = 0;  // K+V at f16
  uint64_t stored_bytes_compressed = 0;                  // chunk sections incl. their headers
  uint64_t payload_bytes_compressed = 0;                 // the same before DEFLATE (packed codes + parameters + headers)

  // f16 bytes of the coded tokens / their chunk sections (the paper's ratio).
  double ratio_compressed_tokens() const;
  // f16 bytes of the whole cache / the file (raw sink and window included).
  double ratio_whole_cache() const;
};
ContainerInfo inspect(std::span<const uint8_t> container, const std::string& origin);
// The type code block `b` of allocation `a` carries in the container
// header's "alloc" triples (docs/format.md "Header"): b.type's value in a
// fixed-rate allocation, 4 in an entropy-coded one (`kvtc inspect --json`
// prints these).
uint32_t header_type_code(const Allocation& a, const BlockAlloc& b);

// Relative squared reconstruction error ||x - x'||^2 / ||x||^2 of keys and
// values over the tokens that are not raw (sink/window), all blocks pooled.
// The captures must have the same geometry and positions.
struct ReconError {
  double k = 0, v = 0;            // the relative errors
  double k_err = 0, k_norm = 0;   // ||x - x'||^2 and ||x||^2 of keys, summed in double
  double v_err = 0, v_norm = 0;   // the same of values
  uint64_t tokens = 0;            // coded tokens of block 0
  void add(const ReconError& o);  // pools another measurement (sums add, ratios follow)
};
// per_token, when given, receives block 0's measurement token by token
// ([n_tokens]; zero for raw tokens), to pool by position. Public, unlike
// the lab's other measuring helpers (kvtc/internal/lab_support.h), because
// the product reports it: `kvtc decompress --reference` and the installed
// example (examples/roundtrip.cpp).
ReconError reconstruction_error(const KvCapture& ref, const KvCapture& dec, uint32_t sink, uint32_t window,
                                std::vector<ReconError>* per_token = nullptr);

// ---- this build and this CPU ---------------------------------------------
// Whether this build and CPU run the bf16 projection natively (not an
// emulation). `impl`, when given, receives oneDNN's kernel name (for
// example "brg:avx512_core_bf16") or the reason it is not available.
// Thread-safe; probes once.
bool bf16_projection_available(std::string* impl = nullptr);
// The same for Precision::kInt8's integer GEMM (oneDNN's s8 x s8 matmul:
// "gemm:jit" on AVX2 and later, whose kernel uses VNNI where the CPU has
// it; a reference kernel does not count).
bool int8_projection_available(std::string* impl = nullptr);

struct LibraryInfo {
  std::string version;                    // kvtc's
  std::string cpu;                        // CPUID brand string
  std::vector<std::string> cpu_features;  // those kvtc checks, present ones
  bool f16c = false;                      // the f16 conversions use F16C
  std::string bf16_projection;            // oneDNN's kernel, or why there is none
  bool bf16 = false;
  std::string int8_projection;  // the same for Precision::kInt8
  bool int8 = false;
  // What Precision::kAuto runs here: the encoder (never kInt8) and the
  // decoder (kInt8: its entropy-coded chunks; the rest as the encoder).
  Precision auto_encode = Precision::kF32, auto_decode = Precision::kF32;
};
LibraryInfo library_info();

}  // namespace kvtc
