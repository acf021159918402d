// kvtc: the GPU path (issue 6) — the codec of kvtc/codec.h run next to a
// cache held in GPU memory: CUDA kernels for gather/de-RoPE, centring,
// quantization and bit packing, cuBLAS for the projection, nvCOMP for
// DEFLATE (when built with it; otherwise libdeflate on the host).
//
// Compatibility with the CPU path (the reference):
// - The container is the one of docs/format.md, section by section in the
//   CPU encoder's order: a container written here decodes with
//   kvtc_decompress and one written by kvtc_compress decodes here.
// - Quantized codes and parameters are byte-identical to the CPU's given
//   identical float input (same f16 rounding of parameters, step rounded up,
//   E4M3 nearest-even saturating; no FMA contraction in these stages).
// - Float stages: de-RoPE/re-RoPE use the CPU's f32 angle recurrence and
//   double rotation; cos/sin are CUDA's double functions (<= 2 double ulps
//   from glibc's), so a rotated value is within 1 f32 ulp of the CPU's
//   (identical in all but ~1e-8 of values). Centring is exact. The
//   projection is a GEMM with a different summation order (f32: relative
//   error ~1e-6 of the row norm; tf32/bf16/f16 are opt-in and cost more,
//   measured by tools/kvtc_gpu_bench).
// - DEFLATE streams differ from libdeflate's bytes (another encoder) but are
//   plain RFC 1951 streams. nvCOMP compresses at most 64 KiB per stream, so
//   with nvCOMP the GPU encoder lowers chunk_tokens (in multiples of 16) until
//   a chunk's payload fits; payloads that never fit are deflated on the
//   host. Raw sink/window sections are stored uncompressed (f16 barely
//   compresses; the format allows stored sections).
// Thread safety: a CudaCodec is used by one thread at a time; distinct
// codecs are independent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvtc/calibration.h"
#include "kvtc/codec.h"
#include "kvtc/kv_capture.h"

namespace kvtc {

// True when a CUDA device can run this build's kernels; otherwise false with
// the reason in *why (no driver, no device, wrong architecture).
bool kvtc_cuda_available(std::string* why = nullptr);
// Whether this build has nvCOMP (DEFLATE on the GPU).
bool kvtc_cuda_has_nvcomp();
// One line: device name, compute capability, memory, CUDA/cuBLAS/nvCOMP versions.
std::string kvtc_cuda_describe();

enum class CudaGemm {
  kF32,   // cublasSgemm, true f32 (the default; closest to the CPU)
  kTf32,  // f32 data, TF32 tensor cores (cublasGemmEx, CUBLAS_COMPUTE_32F_FAST_TF32)
  kBf16,  // bf16 features and basis, f32 accumulate (cublasGemmEx)
  kF16,   // f16 features and basis, f32 accumulate (cublasGemmEx)
};
const char* cuda_gemm_name(CudaGemm g);
CudaGemm cuda_gemm_from_name(const std::string& s);  // "f32", "tf32", "bf16", "f16"; Error otherwise

struct CudaOptions {
  int device = 0;
  CudaGemm gemm = CudaGemm::kF32;
  bool nvcomp = true;         // use nvCOMP when built with it
  int nvcomp_algorithm = -1;  // nvCOMP Deflate algorithm 0..5; -1: from deflate_level (<=3: 1, <=6: 2, <=9: 4, else 5)
  int host_threads = 0;       // host threads for checksums, copies and host DEFLATE (0: all)
};

// Wall time of each stage in milliseconds (GPU stages from CUDA events on
// the codec's stream; host stages from the host clock).
struct CudaStageTimes {
  double gather_ms = 0;         // cache layout <-> feature rows, (de-)RoPE, and the centring fused into them
  double center_ms = 0;         // standalone centring passes (0: both directions fuse it into gather / scatter)
  double project_ms = 0;        // cuBLAS GEMM
  double quant_ms = 0;          // quantize + pack / unpack + dequantize
  double entropy_ms = 0;        // nvCOMP (or host libdeflate) both ways
  double transfer_ms = 0;       // host <-> device copies of containers and section layout
  double host_ms = 0;           // parsing, checksums, headers, assembling containers
  double total_ms = 0;          // the whole call
  std::string entropy_backend;  // "nvcomp", "libdeflate-host", "stored", or a mix
};

// Device memory: owned (freed on destruction) or a view of memory someone
// else owns (wrap). Move-only. Owned memory is allocated and freed in order
// on the legacy default stream (the codec's own stream is a blocking stream,
// so its work is ordered with it); callers that use it from non-blocking
// streams synchronize first.
class CudaBuffer {
 public:
  CudaBuffer() = default;
  explicit CudaBuffer(size_t bytes);  // device memory (stream-ordered pool where supported); throws Error on failure
  static CudaBuffer wrap(void* device_ptr, size_t bytes);
  ~CudaBuffer();
  CudaBuffer(CudaBuffer&& o) noexcept;
  CudaBuffer& operator=(CudaBuffer&& o) noexcept;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  void* get() const { return p_; }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
  bool owned_ = false;
  bool pooled_ = false;  // from the stream-ordered pool (cudaMallocAsync)
};

// A capture whose K and V live in GPU memory: `host` holds the metadata,
// token ids and each block's layers, geometry and positions (its k and v
// vectors are empty); kv[b][0] / kv[b][1] hold K / V of block b as f16
// [n_layer][n_head_kv][n_tokens][head_dim], the layout of KvBlock.
struct CudaKvCapture {
  KvCapture host;
  std::vector<std::array<CudaBuffer, 2>> kv;
  const uint16_t* k(size_t b) const { return static_cast<const uint16_t*>(kv[b][0].get()); }
  const uint16_t* v(size_t b) const { return static_cast<const uint16_t*>(kv[b][1].get()); }
};
CudaKvCapture cuda_upload(const KvCapture& c, int device = 0);
KvCapture cuda_download(const CudaKvCapture& c);

class CudaCodec {
 public:
  // Uploads every block's mean and basis (and a bf16/f16 copy for those GEMM
  // modes). Throws Error when no usable device exists.
  CudaCodec(const Calibration& cal, const CudaOptions& opt = CudaOptions{});
  ~CudaCodec();
  CudaCodec(const CudaCodec&) = delete;
  CudaCodec& operator=(const CudaCodec&) = delete;

  const CudaOptions& options() const;
  const Calibration& calibration() const;

  // Encodes a batch of device-resident captures, one container each, into
  // out[i] (capacity of out's vectors is reused across calls). Same checks
  // and errors as kvtc_compress.
  void compress(const std::vector<const CudaKvCapture*>& caps, const AllocationSet& alloc, const CompressOptions& opt,
                std::vector<std::vector<uint8_t>>& out, CudaStageTimes* times = nullptr);
  // Decodes a batch of containers into device-resident captures. Same
  // checks and errors as kvtc_decompress; `origin` names the inputs in errors.
  std::vector<CudaKvCapture> decompress(const std::vector<const std::vector<uint8_t>*>& containers, const std::string& origin,
                                        CudaStageTimes* times = nullptr);

  // Test and benchmark support: a capture of the given shape (host: meta,
  // tokens, geometry, positions; k/v ignored) whose features are
  // mu + sum_j sigma[j] z_j B[j] with z_j ~ N(0,1) from a counter-based
  // generator seeded by `seed`, keys then RoPE-rotated (when the
  // calibration removes RoPE) and rounded to f16 — all on the device.
  // sigma[b][kv] holds per-component standard deviations (missing
  // components are 0).
  CudaKvCapture synthesize(const KvCapture& shape, const std::vector<std::array<std::vector<float>, 2>>& sigma, uint64_t seed);
  // reconstruction_error() of kvtc/codec.h computed on the device.
  ReconError reconstruction_error(const CudaKvCapture& ref, const CudaKvCapture& dec, uint32_t sink, uint32_t window);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Host-memory conveniences: upload, CudaCodec, download. The results decode
// with / equal what kvtc_decompress / kvtc_compress accept.
std::vector<uint8_t> kvtc_compress_cuda(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                                        const CudaOptions& copt = CudaOptions{});
KvCapture kvtc_decompress_cuda(const std::vector<uint8_t>& bytes, const Calibration& cal, const std::string& origin,
                               const CudaOptions& copt = CudaOptions{});

}  // namespace kvtc
