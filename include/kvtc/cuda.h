// kvtc: the GPU backend — the codec of <kvtc/codec.h> run next to a cache
// held in GPU memory: CUDA kernels for gather/de-RoPE, centring,
// quantization and bit packing, cuBLAS for the projection, nvCOMP for
// DEFLATE (when built with it; otherwise libdeflate on the host). Library
// kvtc_cuda; built where nvcc is found (docs/gpu.md).
//
// A sibling of the CPU backend: the same CompressOptions, DecompressOptions
// and CodecStats, the same checks and errors, the same container.
// - Options: `precision` picks the cuBLAS mode (kF32 sgemm, the default and
//   kAuto; kTF32 tensor cores on f32 data; kBF16 / kF16 16-bit inputs with
//   f32 accumulation); `threads` is the host threads for checksums, copies
//   and host DEFLATE; `stats` receives device time per stage (CUDA events)
//   plus transfer and host time.
// - Compatibility: a container written here decodes with kvtc::decompress
//   and one written by kvtc::compress decodes here. Quantized codes and
//   parameters are byte-identical to the CPU's given identical float input
//   (one __host__ __device__ copy of the f16, E4M3 and quantizer math).
//   De-RoPE/re-RoPE use the CPU's f32 angle recurrence and double rotation;
//   CUDA's double cos/sin are within 2 ulps of glibc's, so a rotated value
//   is within 1 f32 ulp of the CPU's. The projection sums in another order
//   (f32: relative error ~1e-6 of the row norm).
// - DEFLATE streams differ from libdeflate's bytes (another encoder) but
//   are plain RFC 1951 streams. nvCOMP compresses at most 64 KiB per
//   stream, so with nvCOMP the encoder lowers chunk_tokens (in multiples of
//   16) until a chunk's payload fits; payloads that never fit are deflated
//   on the host. Raw sink/window sections are stored (f16 barely
//   compresses; the format allows stored sections).
// Thread safety: a CudaCodec is used by one thread at a time; distinct
// codecs are independent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtc/cache.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"

namespace kvtc {

// True when a CUDA device can run this build's kernels; otherwise false with
// the reason in *why (no driver, no device, wrong architecture).
bool cuda_available(std::string* why = nullptr);
// Whether this build has nvCOMP (DEFLATE on the GPU).
bool cuda_has_nvcomp();
// One line: device name, compute capability, memory, CUDA/cuBLAS/nvCOMP versions.
std::string cuda_describe();

struct CudaOptions {
  int device = 0;
  bool nvcomp = true;         // use nvCOMP when built with it
  int nvcomp_algorithm = -1;  // nvCOMP Deflate algorithm 0..5; -1: from deflate_level (<=3: 1, <=6: 2, <=9: 4, else 5)
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

// A capture whose K and V live in GPU memory: `host` holds the geometry,
// positions, token ids and provenance (its k and v vectors are empty);
// kv[b][0] / kv[b][1] hold K / V of block b as f16
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
  // Uploads every block's mean and basis. Throws Error when no usable
  // device exists.
  explicit CudaCodec(const Calibration& cal, const CudaOptions& opt = CudaOptions{});
  ~CudaCodec();
  CudaCodec(const CudaCodec&) = delete;
  CudaCodec& operator=(const CudaCodec&) = delete;

  const CudaOptions& options() const;
  const Calibration& calibration() const;

  // kvtc::compress for a device-resident capture.
  std::vector<uint8_t> compress(const CudaKvCapture& c, const AllocationSet& alloc, const CompressOptions& opt = {});
  // A batch, one container each, in one pass over the GPU (the capacity of
  // out's vectors is reused across calls). Stats cover the whole batch.
  void compress(const std::vector<const CudaKvCapture*>& caps, const AllocationSet& alloc, const CompressOptions& opt,
                std::vector<std::vector<uint8_t>>& out);
  // kvtc::decompress into GPU memory. Version-2 (entropy-coded) containers
  // too: their rANS chunks decode on `threads` host threads, the rest on
  // the device (docs/gpu.md); compress codes the DP's allocations only.
  CudaKvCapture decompress(std::span<const uint8_t> container, const std::string& origin, const DecompressOptions& opt = {});
  std::vector<CudaKvCapture> decompress(const std::vector<std::span<const uint8_t>>& containers, const std::string& origin,
                                        const DecompressOptions& opt = {});

  struct Impl;

 private:
  friend struct CudaCodecAccess;  // src/cuda: test and benchmark support
  std::unique_ptr<Impl> impl_;
};

// kvtc::reconstruction_error computed on the device.
ReconError cuda_reconstruction_error(const CudaKvCapture& ref, const CudaKvCapture& dec, uint32_t sink, uint32_t window);

// Host-memory conveniences: upload, CudaCodec, download. The results equal
// what kvtc::compress / kvtc::decompress accept and return.
std::vector<uint8_t> compress_cuda(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt = {},
                                   const CudaOptions& copt = CudaOptions{});
KvCapture decompress_cuda(std::span<const uint8_t> container, const Calibration& cal, const std::string& origin, const DecompressOptions& opt = {},
                          const CudaOptions& copt = CudaOptions{});

}  // namespace kvtc
