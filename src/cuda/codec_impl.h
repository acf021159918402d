// Internal (GPU path): the state of a CudaCodec and the host helpers its
// pipelines share (src/cuda/cuda_encode.cpp, cuda_decode.cpp), and the
// test and benchmark support (testing.cpp). Host C++ over the CUDA runtime;
// the kernels are behind the .cuh launchers.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.cuh"
#include "core/timing.h"
#include "entropy.cuh"
#include "kvtc/cuda.h"
#include "project.cuh"
#include "rope_gather.cuh"

namespace kvtc::cuda {

using clock_type = std::chrono::steady_clock;

// KVTC_CUDA_TRACE=1: one stderr line per compress/decompress call with the
// host's own phases in ms (the Timeline's stages are device events and
// lump the host's work into one "host" figure; bench/results/gpu.md found
// it 75% of an 8 x 32K decode). Off: one getenv per process, no clock reads.
class HostTrace {
 public:
  explicit HostTrace(const char* who) : who_(who), on_(enabled()) {
    if (on_) t_ = clock_type::now();
  }
  void mark(const char* phase) {
    if (!on_) return;
    const auto now = clock_type::now();
    char b[64];
    std::snprintf(b, sizeof b, " %s=%.2f", phase, std::chrono::duration<double, std::milli>(now - t_).count());
    line_ += b;
    t_ = now;
  }
  void count(const char* what, size_t n) {
    if (on_) line_ += std::string(" ") + what + "#" + std::to_string(n);
  }
  ~HostTrace() {
    if (on_) std::fprintf(stderr, "[kvtc-cuda-trace] %s:%s\n", who_, line_.c_str());
  }
  static bool enabled() {
    static const bool on = [] {
      const char* e = std::getenv("KVTC_CUDA_TRACE");
      return e != nullptr && *e != '\0' && *e != '0';
    }();
    return on;
  }

 private:
  const char* who_;
  bool on_;
  clock_type::time_point t_;
  std::string line_;
};

// Grow-only device buffer (workspaces reused call after call).
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  DevBuf(DevBuf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr, o.n = 0; }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void reserve(size_t bytes);
  template <typename T>
  T* as(size_t byte_off = 0) const {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(p) + byte_off);
  }
  ~DevBuf();
};
// Grow-only pinned host buffer.
struct HostBuf {
  void* p = nullptr;
  size_t n = 0;
  HostBuf() = default;
  HostBuf(const HostBuf&) = delete;
  HostBuf& operator=(const HostBuf&) = delete;
  void reserve(size_t bytes);
  uint8_t* b(size_t off = 0) const { return static_cast<uint8_t*>(p) + off; }
  ~HostBuf();
};

// Small host arrays collected at aligned offsets, for one upload.
struct Blob {
  std::vector<uint8_t> h;
  size_t add(const void* src, size_t bytes, size_t align = 16) {
    const size_t off = round_up(h.size(), align);
    h.resize(off + bytes);
    if (bytes) std::memcpy(h.data() + off, src, bytes);
    return off;
  }
  template <typename T>
  size_t add(const std::vector<T>& v) {
    return add(v.data(), v.size() * sizeof(T));
  }
};

// The stages of CodecStats a GPU call times with CUDA events.
enum Stage { kSGather, kSCenter, kSProject, kSQuant, kSEntropy, kSTransfer, kNStages };

// CUDA-event spans per stage on one stream, summed after the final sync.
class Timeline {
 public:
  Timeline(cudaStream_t st, bool on) : st_(st), on_(on) {}
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  void begin(Stage s);
  void end();
  // The device stages collected, plus what the host measured itself.
  void fill(CodecStats* out, double host_entropy_ms, double host_ms, double total_ms, int threads, Precision projection, const std::string& backend);

 private:
  struct Span {
    Stage stage;
    cudaEvent_t a, b;
  };
  cudaEvent_t ev();
  cudaStream_t st_;
  bool on_;
  std::vector<cudaEvent_t> pool_;
  std::vector<Span> spans_;
};

// The cuBLAS mode of a precision: kAuto and kF32 are sgemm (the closest to
// the CPU; no GPU accuracy figure is measured yet), kTF32 tensor cores on
// f32 data, kBF16 / kF16 16-bit GEMM inputs with f32 accumulation.
struct GemmMode {
  Precision precision = Precision::kF32;  // resolved
  ElemType et = ElemType::kF32;           // feature / coefficient element type fed to the GEMM
  bool tf32 = false;
};
GemmMode gemm_mode(Precision p);

// The device form of a block's RoPE (d_factors: its frequency factors on
// the device, or nullptr).
RopeDev rope_dev(const Rope& r, uint32_t head_dim, const float* d_factors);
// Whether a block's keys are rotated (a table is needed).
inline bool rotates(const Rope& r) {
  return r.layout != RopeLayout::kNone && r.n_rot > 0;
}

// Appends ops copying `bytes` from src to dst in pieces of at most kCopyOpMax.
void split_copy(std::vector<CopyOp>& ops, const uint8_t* src, uint8_t* dst, uint64_t bytes);
// "a+b" names of the entropy backends a call used.
void mix_backend(std::string& b, const char* x);

}  // namespace kvtc::cuda

namespace kvtc {

struct CudaCodec::Impl {
  Calibration cal;
  CudaOptions opt;
  cudaStream_t st = nullptr;
  std::unique_ptr<cuda::Projector> proj;
  size_t align = 16;  // payload slot alignment (nvCOMP's when built with it)
  // One transform on the device: mean, basis, and 16-bit basis copies made
  // on first use by a bf16 / f16 call.
  struct Tr {
    cuda::DevBuf mu, basis, basis_bf16, basis_f16;
    uint32_t p = 0, r = 0;
  };
  std::vector<std::array<Tr, 2>> tr;
  // Workspaces, grown as needed and kept between calls.
  cuda::DevBuf x, dt, rope_c, rope_s, arena, comp, meta, stage, nvtemp, small;
  cuda::HostBuf h_meta, h_stage, h_small;

  // Host threads for a call (CompressOptions / DecompressOptions::threads).
  static int threads(int requested);
  // The basis of (b, kv) in the GEMM's element type.
  const void* gemm_basis(size_t b, int kv, cuda::ElemType et);
  // Copies a table blob to the device meta buffer (on the codec's stream).
  void upload_meta(const cuda::Blob& m);
};

// Access to a codec's state for src/cuda/testing.cpp.
struct CudaCodecAccess {
  static CudaCodec::Impl& impl(CudaCodec& c) { return *c.impl_; }
};

}  // namespace kvtc
