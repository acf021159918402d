// The GPU backend (kvtc/cuda.h): device buffers, the codec's state, the
// single-capture and host-memory forms, the device error metric. The
// pipelines are src/cuda/cuda_encode.cpp and cuda_decode.cpp; the container
// rules they follow are the CPU's (src/format/).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "codec/rope.h"
#include "codec_impl.h"
#include "core/parallel.h"
#include "kvtc/error.h"
#include "synth.cuh"

namespace kvtc {

namespace cuda {

void DevBuf::reserve(size_t bytes) {
  if (bytes <= n) return;
  if (p) check(cudaFree(p), "cudaFree");
  p = nullptr;
  n = 0;
  const size_t want = std::max<size_t>(bytes + bytes / 8, 1 << 20);
  check(cudaMalloc(&p, want), "cudaMalloc (workspace)");
  n = want;
}
DevBuf::~DevBuf() {
  if (p) cudaFree(p);
}

void HostBuf::reserve(size_t bytes) {
  if (bytes <= n) return;
  if (p) check(cudaFreeHost(p), "cudaFreeHost");
  p = nullptr;
  n = 0;
  const size_t want = std::max<size_t>(bytes + bytes / 8, 1 << 20);
  check(cudaHostAlloc(&p, want, cudaHostAllocDefault), "cudaHostAlloc (staging)");
  n = want;
}
HostBuf::~HostBuf() {
  if (p) cudaFreeHost(p);
}

Timeline::~Timeline() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}
cudaEvent_t Timeline::ev() {
  cudaEvent_t e;
  check(cudaEventCreate(&e), "cudaEventCreate");
  pool_.push_back(e);
  return e;
}
void Timeline::begin(Stage s) {
  if (!on_) return;
  spans_.push_back({s, ev(), nullptr});
  check(cudaEventRecord(spans_.back().a, st_), "cudaEventRecord");
}
void Timeline::end() {
  if (!on_) return;
  spans_.back().b = ev();
  check(cudaEventRecord(spans_.back().b, st_), "cudaEventRecord");
}
void Timeline::fill(CodecStats* out, double host_entropy_ms, double host_ms, double total_ms, int threads, Precision projection,
                    const std::string& backend) {
  if (!out) return;
  double st[kNStages] = {};
  for (const Span& s : spans_) {
    float ms = 0;
    if (s.b && cudaEventElapsedTime(&ms, s.a, s.b) == cudaSuccess) st[s.stage] += ms;
  }
  out->gather_ms = st[kSGather];
  out->center_ms = st[kSCenter];
  out->project_ms = st[kSProject];
  out->quant_ms = st[kSQuant];
  out->entropy_ms = st[kSEntropy] + host_entropy_ms;
  out->transfer_ms = st[kSTransfer];
  out->host_ms = host_ms;
  out->total_ms = total_ms;
  out->threads = threads;
  out->projection = projection;
  out->entropy_backend = backend;
}

GemmMode gemm_mode(Precision p) {
  switch (p) {
    case Precision::kAuto:
    case Precision::kF32: return {Precision::kF32, ElemType::kF32, false};
    case Precision::kTF32: return {Precision::kTF32, ElemType::kF32, true};
    case Precision::kBF16: return {Precision::kBF16, ElemType::kBf16, false};
    case Precision::kF16: return {Precision::kF16, ElemType::kF16, false};
    case Precision::kInt8: throw Error("CUDA: precision int8 is a CPU decode mode (oneDNN's integer GEMM); the GPU runs f32, tf32, bf16 or f16");
  }
  throw Error("CUDA: unknown precision");
}

RopeDev rope_dev(const Rope& r, uint32_t head_dim, const float* d_factors) {
  require_rope_supported(r, "CUDA");
  require(!r.yarn(),
          "CUDA: keys rotated with YaRN or a RoPE magnitude factor (rope_scaling_type yarn) are coded and decoded on the CPU only "
          "for now (kvtc::compress / kvtc::decompress)");
  RopeDev d;
  d.layout = r.layout == RopeLayout::kNorm ? 1 : r.layout == RopeLayout::kNeox ? 2 : 0;
  d.n_rot = d.layout ? r.n_rot : 0;
  d.head_dim = head_dim;
  // The CPU's expression (src/codec/rope.cpp): float pow, then the f32
  // recurrence on the device.
  d.theta_scale = d.n_rot ? std::pow(r.freq_base, -2.0f / float(d.n_rot)) : 1.0f;
  d.freq_scale = r.freq_scale;
  d.freq_factors = r.freq_factors.empty() ? nullptr : d_factors;
  return d;
}

void split_copy(std::vector<CopyOp>& ops, const uint8_t* src, uint8_t* dst, uint64_t bytes) {
  for (uint64_t o = 0; o < bytes; o += kCopyOpMax) ops.push_back({src + o, dst + o, std::min<uint64_t>(kCopyOpMax, bytes - o)});
}

void mix_backend(std::string& b, const char* x) {
  if (b.empty())
    b = x;
  else if (b.find(x) == std::string::npos)
    b += std::string("+") + x;
}

}  // namespace cuda

using cuda::check;

// ------------------------------------------------------------ CudaBuffer

// Owned buffers come from the device's stream-ordered pool (allocated and
// freed on the legacy default stream, which orders itself with the codec's
// blocking stream), so that decoding into fresh buffers call after call does
// not pay cudaMalloc/cudaFree; plain cudaMalloc where pools are unsupported.
static bool pools_supported() {
  static const bool ok = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMemoryPoolsSupported, dev) != cudaSuccess) return false;
    if (v) {
      cudaMemPool_t pool;
      if (cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
        uint64_t keep = UINT64_MAX;  // keep freed memory for reuse
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      }
    }
    cudaGetLastError();
    return v != 0;
  }();
  return ok;
}

CudaBuffer::CudaBuffer(size_t bytes) : n_(bytes), owned_(true) {
  if (!bytes) return;
  pooled_ = pools_supported();
  if (pooled_)
    check(cudaMallocAsync(&p_, bytes, cudaStreamLegacy), "cudaMallocAsync");
  else
    check(cudaMalloc(&p_, bytes), "cudaMalloc");
}
CudaBuffer CudaBuffer::wrap(void* device_ptr, size_t bytes) {
  CudaBuffer b;
  b.p_ = device_ptr;
  b.n_ = bytes;
  b.owned_ = false;
  return b;
}
static void release(void* p, bool pooled) {
  if (!p) return;
  if (pooled)
    cudaFreeAsync(p, cudaStreamLegacy);
  else
    cudaFree(p);
}
CudaBuffer::~CudaBuffer() {
  if (owned_) release(p_, pooled_);
}
CudaBuffer::CudaBuffer(CudaBuffer&& o) noexcept : p_(o.p_), n_(o.n_), owned_(o.owned_), pooled_(o.pooled_) {
  o.p_ = nullptr;
  o.n_ = 0;
  o.owned_ = false;
}
CudaBuffer& CudaBuffer::operator=(CudaBuffer&& o) noexcept {
  if (this != &o) {
    if (owned_) release(p_, pooled_);
    p_ = o.p_;
    n_ = o.n_;
    owned_ = o.owned_;
    pooled_ = o.pooled_;
    o.p_ = nullptr;
    o.n_ = 0;
    o.owned_ = false;
  }
  return *this;
}

// ------------------------------------------------------------ free functions

bool cuda_available(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = std::string("no usable CUDA driver or device (cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")";
    cudaGetLastError();
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  e = cuda::probe_device();
  if (e != cudaSuccess) {
    if (why)
      *why = std::string("this build's kernels cannot run on device 0 (") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) +
             "; built for CMAKE_CUDA_ARCHITECTURES " KVTC_CUDA_ARCHS ")";
    cudaGetLastError();
    return false;
  }
  if (why) why->clear();
  return true;
}

bool cuda_has_nvcomp() {
  return cuda::nvc::built();
}

std::string cuda_describe() {
  std::string why;
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  char b[512];
  if (!cuda_available(&why)) {
    std::snprintf(b, sizeof b, "no device (%s); CUDA runtime %d, driver %d, nvCOMP %s", why.c_str(), rt, drv, cuda::nvc::version().c_str());
    return b;
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  cuda::Projector pr;
  std::snprintf(b, sizeof b, "%s (sm_%d%d, %d SMs, %.1f GiB), CUDA runtime %d, driver %d, cuBLAS %d, nvCOMP %s, kernels for %s", p.name, p.major,
                p.minor, p.multiProcessorCount, double(p.totalGlobalMem) / double(1ull << 30), rt, drv, pr.version(), cuda::nvc::version().c_str(),
                KVTC_CUDA_ARCHS);
  return b;
}

CudaKvCapture cuda_upload(const KvCapture& c, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  CudaKvCapture d;
  d.host.model_sha256 = c.model_sha256;
  d.host.meta = c.meta;
  d.host.tokens = c.tokens;
  d.kv.resize(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    KvBlock h;
    static_cast<BlockGeometry&>(h) = kb.geometry();
    h.pos = kb.pos;
    require(kb.k.size() == kb.numel() && kb.v.size() == kb.numel(), "cuda_upload: block " + std::to_string(b) + " K/V size differs from its shape");
    for (int kv = 0; kv < 2; ++kv) {
      d.kv[b][kv] = CudaBuffer(kb.numel() * 2);
      check(cudaMemcpy(d.kv[b][kv].get(), (kv ? kb.v : kb.k).data(), kb.numel() * 2, cudaMemcpyHostToDevice), "upload K/V");
    }
    d.host.blocks.push_back(std::move(h));
  }
  return d;
}

KvCapture cuda_download(const CudaKvCapture& d) {
  KvCapture c = d.host;
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    KvBlock& kb = c.blocks[b];
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<uint16_t>& dst = kv ? kb.v : kb.k;
      dst.resize(kb.numel());
      check(cudaMemcpy(dst.data(), d.kv[b][kv].get(), kb.numel() * 2, cudaMemcpyDeviceToHost), "download K/V");
    }
  }
  return c;
}

ReconError cuda_reconstruction_error(const CudaKvCapture& ref, const CudaKvCapture& dec, uint32_t sink, uint32_t window) {
  require(ref.host.blocks.size() == dec.host.blocks.size() && ref.kv.size() == ref.host.blocks.size() && dec.kv.size() == dec.host.blocks.size(),
          "reconstruction_error: block counts differ");
  double* acc = nullptr;  // [K err, K norm, V err, V norm]
  check(cudaMalloc(&acc, 4 * sizeof(double)), "cudaMalloc (error sums)");
  struct Free {
    double* p;
    ~Free() { cudaFree(p); }
  } free_acc{acc};
  check(cudaMemset(acc, 0, 4 * sizeof(double)), "memset");
  ReconError r;
  for (size_t b = 0; b < ref.host.blocks.size(); ++b) {
    const KvBlock &x = ref.host.blocks[b], &y = dec.host.blocks[b];
    require(x.numel() == y.numel() && x.pos == y.pos, "reconstruction_error: block " + std::to_string(b) + " differs in shape or positions");
    const uint32_t n = x.n_tokens();
    const uint32_t lo = sink, hi = n > window ? n - window : 0;
    if (hi <= lo) continue;
    if (b == 0) r.tokens = hi - lo;
    for (int kv = 0; kv < 2; ++kv)
      cuda::launch_sq_err(static_cast<const uint16_t*>(ref.kv[b][kv].get()), static_cast<const uint16_t*>(dec.kv[b][kv].get()),
                          x.n_layer() * x.n_head_kv, n, x.head_dim, lo, hi, acc + 2 * kv, cudaStreamLegacy);
  }
  double h[4];
  check(cudaMemcpy(h, acc, sizeof h, cudaMemcpyDeviceToHost), "error sums D2H");
  r.k_err = h[0], r.k_norm = h[1], r.v_err = h[2], r.v_norm = h[3];
  r.add(ReconError{});  // the ratios
  return r;
}

// ------------------------------------------------------------ CudaCodec

int CudaCodec::Impl::threads(int requested) {
  return detail::resolve_threads(requested, 1u << 20);
}

const void* CudaCodec::Impl::gemm_basis(size_t b, int kv, cuda::ElemType et) {
  Tr& t = tr[b][kv];
  if (et == cuda::ElemType::kF32) return t.basis.p;
  cuda::DevBuf& h = et == cuda::ElemType::kBf16 ? t.basis_bf16 : t.basis_f16;
  if (!h.p) {
    const size_t n = size_t(t.r) * t.p;
    h.reserve(n * 2);
    cuda::launch_convert(t.basis.as<float>(), h.p, et, n, st);
  }
  return h.p;
}

void CudaCodec::Impl::upload_meta(const cuda::Blob& m) {
  if (m.h.empty()) return;
  h_meta.reserve(m.h.size());
  meta.reserve(m.h.size());
  std::memcpy(h_meta.p, m.h.data(), m.h.size());
  check(cudaMemcpyAsync(meta.p, h_meta.p, m.h.size(), cudaMemcpyHostToDevice, st), "upload tables");
}

CudaCodec::CudaCodec(const Calibration& cal, const CudaOptions& opt) : impl_(std::make_unique<Impl>()) {
  std::string why;
  require(cuda_available(&why), "CUDA: " + why);
  check(cudaSetDevice(opt.device), "cudaSetDevice");
  Impl& I = *impl_;
  I.cal = cal;
  I.opt = opt;
  check(cudaStreamCreate(&I.st), "cudaStreamCreate");
  I.proj = std::make_unique<cuda::Projector>();
  I.proj->set_stream(I.st);
  I.align = cuda::nvc::built() ? std::max<size_t>(16, cuda::nvc::alignment()) : 16;
  I.tr.resize(cal.blocks.size());
  for (size_t b = 0; b < cal.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      Impl::Tr& d = I.tr[b][kv];
      d.p = t.p;
      d.r = t.r;
      require(t.mu.size() == t.p && t.basis.size() == size_t(t.r) * t.p, "CudaCodec: calibration block " + std::to_string(b) + " has no mean/basis");
      d.mu.reserve(t.mu.size() * 4);
      d.basis.reserve(t.basis.size() * 4);
      check(cudaMemcpy(d.mu.p, t.mu.data(), t.mu.size() * 4, cudaMemcpyHostToDevice), "upload mean");
      check(cudaMemcpy(d.basis.p, t.basis.data(), t.basis.size() * 4, cudaMemcpyHostToDevice), "upload basis");
    }
  check(cudaStreamSynchronize(I.st), "CudaCodec init");
}

CudaCodec::~CudaCodec() {
  if (impl_ && impl_->st) {
    cudaStreamSynchronize(impl_->st);
    impl_->proj.reset();
    cudaStreamDestroy(impl_->st);
  }
}

const CudaOptions& CudaCodec::options() const {
  return impl_->opt;
}
const Calibration& CudaCodec::calibration() const {
  return impl_->cal;
}

std::vector<uint8_t> CudaCodec::compress(const CudaKvCapture& c, const AllocationSet& alloc, const CompressOptions& opt) {
  std::vector<std::vector<uint8_t>> out;
  compress({&c}, alloc, opt, out);
  return std::move(out[0]);
}

CudaKvCapture CudaCodec::decompress(std::span<const uint8_t> container, const std::string& origin, const DecompressOptions& opt) {
  std::vector<CudaKvCapture> out = decompress(std::vector<std::span<const uint8_t>>{container}, origin, opt);
  return std::move(out[0]);
}

// ------------------------------------------------------------ host conveniences

std::vector<uint8_t> compress_cuda(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                                   const CudaOptions& copt) {
  CudaCodec codec(cal, copt);
  const CudaKvCapture d = cuda_upload(c, copt.device);
  return codec.compress(d, alloc, opt);
}

KvCapture decompress_cuda(std::span<const uint8_t> container, const Calibration& cal, const std::string& origin, const DecompressOptions& opt,
                          const CudaOptions& copt) {
  CudaCodec codec(cal, copt);
  return cuda_download(codec.decompress(container, origin, opt));
}

}  // namespace kvtc
