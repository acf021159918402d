// The GPU codec: host orchestration of the kernel families (rope_gather,
// center, quant, project, entropy) around the container code shared with
// the CPU path. See include/kvtc/cuda_codec.h for what is guaranteed.
//
// Encode, per batch: plan every payload (sink/window raw sections and coded
// chunks) at aligned offsets of one device arena; per job (capture, block,
// K/V): RoPE table, gather + de-RoPE + centring, GEMM, quantize + pack into
// the arena; nvCOMP compresses every payload of at most 64 KiB in one
// batched call; the host lays the containers out, a batched device copy
// assembles them in a staging buffer, one copy brings it to pinned host
// memory, and the host writes headers and checksums (in parallel) and hands
// out the containers. Decode mirrors it.
#include "kvtc/cuda_codec.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <tuple>

#include "../codec/container.h"
#include "../codec/parallel.h"
#include "center.cuh"
#include "common.cuh"
#include "entropy.cuh"
#include "host_plan.h"
#include "kvtc/error.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"
#include "kvtc/util.h"
#include "project.cuh"
#include "quant.cuh"
#include "rope_gather.cuh"
#include "synth.cuh"

namespace kvtc {

using cuda::check;
using cuda::ElemType;
using cuda::QSeg;
using cuda::QTile;
using namespace container;

namespace {

using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t).count();
}

// Grow-only device / pinned host buffers.
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  void reserve(size_t bytes) {
    if (bytes <= n) return;
    if (p) check(cudaFree(p), "cudaFree");
    p = nullptr;
    n = 0;
    const size_t want = std::max<size_t>(bytes + bytes / 8, 1 << 20);
    check(cudaMalloc(&p, want), "cudaMalloc (workspace)");
    n = want;
  }
  template <typename T>
  T* as(size_t byte_off = 0) const {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(p) + byte_off);
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
};
struct HostBuf {
  void* p = nullptr;
  size_t n = 0;
  void reserve(size_t bytes) {
    if (bytes <= n) return;
    if (p) check(cudaFreeHost(p), "cudaFreeHost");
    p = nullptr;
    n = 0;
    const size_t want = std::max<size_t>(bytes + bytes / 8, 1 << 20);
    check(cudaHostAlloc(&p, want, cudaHostAllocDefault), "cudaHostAlloc (staging)");
    n = want;
  }
  uint8_t* b(size_t off = 0) const { return static_cast<uint8_t*>(p) + off; }
  ~HostBuf() {
    if (p) cudaFreeHost(p);
  }
};

// Collects small host arrays at aligned offsets for one upload.
struct Blob {
  std::vector<uint8_t> h;
  size_t add(const void* src, size_t bytes, size_t align = 16) {
    const size_t off = cuda::round_up(h.size(), align);
    h.resize(off + bytes);
    if (bytes) std::memcpy(h.data() + off, src, bytes);
    return off;
  }
  template <typename T>
  size_t add(const std::vector<T>& v) {
    return add(v.data(), v.size() * sizeof(T));
  }
};

enum Stage { kSGather, kSCenter, kSProject, kSQuant, kSEntropy, kSTransfer, kNStages };

// CUDA-event spans per stage on one stream, summed after the final sync.
class Timeline {
 public:
  explicit Timeline(cudaStream_t st, bool on) : st_(st), on_(on) {}
  ~Timeline() {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  void begin(Stage s) {
    if (!on_) return;
    spans_.push_back({s, ev(), nullptr});
    check(cudaEventRecord(spans_.back().a, st_), "cudaEventRecord");
  }
  void end() {
    if (!on_) return;
    spans_.back().b = ev();
    check(cudaEventRecord(spans_.back().b, st_), "cudaEventRecord");
  }
  void collect(double out[kNStages]) {
    for (const Span& s : spans_) {
      float ms = 0;
      if (s.b && cudaEventElapsedTime(&ms, s.a, s.b) == cudaSuccess) out[s.stage] += ms;
    }
  }
  // The stages collected, plus what the host measured itself.
  CudaStageTimes times(double host_entropy_ms, double host_ms, double total_ms, std::string backend) {
    double st[kNStages] = {};
    collect(st);
    CudaStageTimes t;
    t.gather_ms = st[kSGather];
    t.center_ms = st[kSCenter];
    t.project_ms = st[kSProject];
    t.quant_ms = st[kSQuant];
    t.entropy_ms = st[kSEntropy] + host_entropy_ms;
    t.transfer_ms = st[kSTransfer];
    t.host_ms = host_ms;
    t.total_ms = total_ms;
    t.entropy_backend = std::move(backend);
    return t;
  }

 private:
  struct Span {
    Stage stage;
    cudaEvent_t a, b;
  };
  cudaEvent_t ev() {
    cudaEvent_t e;
    check(cudaEventCreate(&e), "cudaEventCreate");
    pool_.push_back(e);
    return e;
  }
  cudaStream_t st_;
  bool on_;
  std::vector<cudaEvent_t> pool_;
  std::vector<Span> spans_;
};

cuda::RopeDev rope_dev(const RopeParams& p, const float* d_factors) {
  cuda::RopeDev r;
  r.layout = p.layout == RopeParams::Layout::kNorm ? 1 : p.layout == RopeParams::Layout::kNeox ? 2 : 0;
  r.n_rot = r.layout ? p.n_rot : 0;
  r.head_dim = p.head_dim;
  // The CPU's expression (rope.cpp): float pow, then the f32 recurrence on the device.
  r.theta_scale = r.n_rot ? std::pow(p.freq_base, -2.0f / float(p.n_rot)) : 1.0f;
  r.freq_scale = p.freq_scale;
  r.freq_factors = p.freq_factors.empty() ? nullptr : d_factors;
  return r;
}

// Splits a copy into ops of at most kCopyOpMax bytes.
void split_copy(std::vector<cuda::CopyOp>& ops, const uint8_t* src, uint8_t* dst, uint64_t bytes) {
  for (uint64_t o = 0; o < bytes; o += cuda::kCopyOpMax) ops.push_back({src + o, dst + o, std::min<uint64_t>(cuda::kCopyOpMax, bytes - o)});
}

int nvcomp_algorithm(const CudaOptions& o, int level) {
  if (o.nvcomp_algorithm >= 0) return o.nvcomp_algorithm;
  return level <= 3 ? 1 : level <= 6 ? 2 : level <= 9 ? 4 : 5;
}

void mix_backend(std::string& b, const char* x) {
  if (b.empty())
    b = x;
  else if (b.find(x) == std::string::npos)
    b += std::string("+") + x;
}

}  // namespace

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

bool kvtc_cuda_available(std::string* why) {
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

bool kvtc_cuda_has_nvcomp() {
  return cuda::nvc::built();
}

std::string kvtc_cuda_describe() {
  std::string why;
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  char b[512];
  if (!kvtc_cuda_available(&why)) {
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

const char* cuda_gemm_name(CudaGemm g) {
  switch (g) {
    case CudaGemm::kF32: return "f32";
    case CudaGemm::kTf32: return "tf32";
    case CudaGemm::kBf16: return "bf16";
    case CudaGemm::kF16: return "f16";
  }
  return "?";
}

CudaGemm cuda_gemm_from_name(const std::string& s) {
  if (s == "f32") return CudaGemm::kF32;
  if (s == "tf32") return CudaGemm::kTf32;
  if (s == "bf16") return CudaGemm::kBf16;
  if (s == "f16") return CudaGemm::kF16;
  throw Error("unknown GEMM mode '" + s + "' (f32, tf32, bf16, f16)");
}

CudaKvCapture cuda_upload(const KvCapture& c, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  CudaKvCapture d;
  d.host.meta = c.meta;
  d.host.tokens = c.tokens;
  d.kv.resize(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    KvBlock h;
    h.layers = kb.layers;
    h.n_head_kv = kb.n_head_kv;
    h.head_dim = kb.head_dim;
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

// ------------------------------------------------------------ CudaCodec

struct CudaCodec::Impl {
  Calibration cal;
  CudaOptions opt;
  cudaStream_t st = nullptr;
  std::unique_ptr<cuda::Projector> proj;
  ElemType et = ElemType::kF32;  // feature / coefficient element type of the GEMM
  bool tf32 = false;
  size_t align = 16;  // payload slot alignment
  struct Tr {
    DevBuf mu, basis, basis_h;
    uint32_t p = 0, r = 0;
    const void* gemm_basis(ElemType t) const { return t == ElemType::kF32 ? basis.p : basis_h.p; }
  };
  std::vector<std::array<Tr, 2>> tr;
  DevBuf x, dt, rope_c, rope_s, arena, comp, meta, stage, nvtemp, small;
  HostBuf h_meta, h_stage, h_small;

  int threads() const { return detail::resolve_threads(opt.host_threads, 1u << 20); }
  void upload_meta(const Blob& m) {
    if (m.h.empty()) return;
    h_meta.reserve(m.h.size());
    meta.reserve(m.h.size());
    std::memcpy(h_meta.p, m.h.data(), m.h.size());
    check(cudaMemcpyAsync(meta.p, h_meta.p, m.h.size(), cudaMemcpyHostToDevice, st), "upload tables");
  }
};

CudaCodec::CudaCodec(const Calibration& cal, const CudaOptions& opt) : impl_(std::make_unique<Impl>()) {
  std::string why;
  require(kvtc_cuda_available(&why), "CUDA: " + why);
  check(cudaSetDevice(opt.device), "cudaSetDevice");
  Impl& I = *impl_;
  I.cal = cal;
  I.opt = opt;
  check(cudaStreamCreate(&I.st), "cudaStreamCreate");
  I.proj = std::make_unique<cuda::Projector>();
  I.proj->set_stream(I.st);
  I.et = opt.gemm == CudaGemm::kBf16 ? ElemType::kBf16 : opt.gemm == CudaGemm::kF16 ? ElemType::kF16 : ElemType::kF32;
  I.tf32 = opt.gemm == CudaGemm::kTf32;
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
      if (I.et != ElemType::kF32) {
        d.basis_h.reserve(t.basis.size() * 2);
        cuda::launch_convert(d.basis.as<float>(), d.basis_h.p, I.et, t.basis.size(), I.st);
      }
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

// ------------------------------------------------------------ compress

void CudaCodec::compress(const std::vector<const CudaKvCapture*>& caps, const AllocationSet& alloc, const CompressOptions& opt,
                         std::vector<std::vector<uint8_t>>& out, CudaStageTimes* times) {
  Impl& I = *impl_;
  const auto t_start = clock_type::now();
  double host_ms = 0;
  auto t_host = clock_type::now();
  out.resize(caps.size());
  if (caps.empty()) return;
  for (const CudaKvCapture* c : caps) {
    require(c != nullptr, "compress: null capture");
    cuda::check_compress_inputs(c->host, I.cal, alloc, opt);
    require(c->kv.size() == c->host.blocks.size(), "compress: device K/V missing for some blocks");
    for (size_t b = 0; b < c->kv.size(); ++b)
      for (int kv = 0; kv < 2; ++kv)
        require(c->kv[b][kv].get() && c->kv[b][kv].bytes() >= c->host.blocks[b].numel() * 2,
                "compress: device K/V of block " + std::to_string(b) + " smaller than its shape");
  }
  const bool derope = calibration_keys_derope(I.cal);
  const int level = opt.deflate_level;
  const bool use_nv = cuda::nvc::built() && I.opt.nvcomp && level > 0;
  CompressOptions eo = opt;
  if (use_nv) {
    const uint32_t f = cuda::chunk_tokens_fitting(alloc, opt.chunk_tokens, cuda::kNvcompMaxChunkBytes);
    if (f >= 16) eo.chunk_tokens = f;
  }
  const size_t A = I.align;
  const int threads = I.threads();

  // ---- plan payloads (container order) and jobs
  struct Payload {
    uint32_t cap, kind, block, kv, t0, t1;
    uint64_t off, bytes;  // slot in the arena
  };
  struct Job {
    uint32_t cap, b, kv, c0, c1, ru;
    size_t seg0, nseg, tile0, ntile;
    int rope_block = -1;  // index into rope params (per cap*blocks) when keys are de-RoPEd
    size_t pos_off = 0;   // byte offset of positions in the meta blob
  };
  std::vector<Payload> pls;
  std::vector<Job> jobs;
  std::vector<QSeg> segs;
  std::vector<QTile> tiles;
  std::vector<std::vector<size_t>> cap_pls(caps.size());  // payload indices per capture, container order
  std::vector<std::string> headers(caps.size());
  std::vector<std::vector<std::vector<uint8_t>>> host_secs(caps.size());  // positions / tokens sections
  uint64_t arena = 0;
  Blob meta;
  struct RopeSlot {
    RopeParams p;
    size_t factors_off = 0;
  };
  std::vector<RopeSlot> ropes;
  size_t max_rows = 0, max_ru = 0;
  auto add_payload = [&](uint32_t i, uint32_t kind, uint32_t b, uint32_t kv, uint32_t t0, uint32_t t1, uint64_t bytes) {
    arena = cuda::round_up(arena, A);
    pls.push_back({i, kind, b, kv, t0, t1, arena, bytes});
    cap_pls[i].push_back(pls.size() - 1);
    arena += bytes;
  };
  for (uint32_t i = 0; i < caps.size(); ++i) {
    const KvCapture& c = caps[i]->host;
    headers[i] = cuda::header_json(c, I.cal, alloc, eo);
    for (uint32_t b = 0; b < c.blocks.size(); ++b) {
      const KvBlock& kb = c.blocks[b];
      const cuda::TokenLayout L = cuda::token_layout(kb.n_tokens(), eo.sink, eo.window);
      const uint64_t row = uint64_t(kb.n_layer()) * kb.n_head_kv * kb.head_dim * 2;
      int rope_slot = -1;
      if (derope) {
        RopeSlot rs;
        rs.p = rope_params_from_meta(c.meta, b == 1, kb.head_dim, "compress");
        if (!rs.p.freq_factors.empty()) rs.factors_off = meta.add(rs.p.freq_factors);
        ropes.push_back(rs);
        rope_slot = int(ropes.size() - 1);
      }
      for (uint32_t kv = 0; kv < 2; ++kv) {
        if (L.s_end > 0) add_payload(i, kRaw, b, kv, 0, L.s_end, L.s_end * row);
        if (L.w_begin <= L.s_end) continue;
        Job j{i, b, kv, L.s_end, L.w_begin, cuda::r_used(alloc[b][kv].blocks), segs.size(), 0, tiles.size(), 0, -1, 0};
        for (auto [t0, t1] : cuda::chunk_ranges(L.s_end, L.w_begin, eo.chunk_tokens)) {
          const uint64_t bytes = cuda::packed_chunk_bytes(alloc[b][kv].blocks, t1 - t0);
          add_payload(i, kChunk, b, kv, t0, t1, bytes);
          cuda::append_chunk_segments(alloc[b][kv].blocks, t0 - L.s_end, t1 - t0, pls.back().off, false, segs);
        }
        j.nseg = segs.size() - j.seg0;
        cuda::append_encode_tiles(segs, j.seg0, tiles);
        j.ntile = tiles.size() - j.tile0;
        if (kv == 0 && rope_slot >= 0 && ropes[rope_slot].p.layout != RopeParams::Layout::kNone && ropes[rope_slot].p.n_rot > 0) {
          j.rope_block = rope_slot;
          j.pos_off = meta.add(kb.pos.data() + L.s_end, size_t(L.w_begin - L.s_end) * 4);
        }
        max_rows = std::max<size_t>(max_rows, L.w_begin - L.s_end);
        max_ru = std::max<size_t>(max_ru, j.ru);
        jobs.push_back(j);
      }
    }
    for (uint32_t b = 0; b < c.blocks.size(); ++b) {
      const KvBlock& kb = c.blocks[b];
      const cuda::TokenLayout L = cuda::token_layout(kb.n_tokens(), eo.sink, eo.window);
      const uint64_t row = uint64_t(kb.n_layer()) * kb.n_head_kv * kb.head_dim * 2;
      if (L.w_begin < kb.n_tokens())
        for (uint32_t kv = 0; kv < 2; ++kv) add_payload(i, kRaw, b, kv, L.w_begin, kb.n_tokens(), (kb.n_tokens() - L.w_begin) * row);
    }
  }
  I.arena.reserve(std::max<uint64_t>(arena, 1));
  // Raw payloads: gathered from the cache layout [l][h][t0..t1)[d].
  std::vector<cuda::CopyOp> raw_ops;
  for (const Payload& p : pls) {
    if (p.kind != kRaw) continue;
    const KvBlock& kb = caps[p.cap]->host.blocks[p.block];
    const uint8_t* cache = static_cast<const uint8_t*>(caps[p.cap]->kv[p.block][p.kv].get());
    const uint64_t run = uint64_t(p.t1 - p.t0) * kb.head_dim * 2;
    for (uint32_t lh = 0; lh < kb.n_layer() * kb.n_head_kv; ++lh)
      split_copy(raw_ops, cache + (uint64_t(lh) * kb.n_tokens() + p.t0) * kb.head_dim * 2, I.arena.as<uint8_t>(p.off + lh * run), run);
  }
  // Entropy routing.
  enum Route : uint8_t { kStoredDev, kNv, kHost };
  std::vector<uint8_t> route(pls.size());
  std::vector<size_t> nv_index(pls.size(), SIZE_MAX);
  std::vector<size_t> nv_list, host_list;
  size_t nv_max = 0, nv_total = 0;
  for (size_t k = 0; k < pls.size(); ++k) {
    const Payload& p = pls[k];
    if (level == 0 || p.bytes == 0)
      route[k] = kStoredDev;
    else if (use_nv && p.bytes <= cuda::kNvcompMaxChunkBytes)
      route[k] = kNv;
    else if (use_nv && p.kind == kRaw)
      route[k] = kStoredDev;  // big raw f16 sections: stored (DEFLATE gains little on f16)
    else
      route[k] = kHost;
    if (route[k] == kNv) {
      nv_index[k] = nv_list.size();
      nv_list.push_back(k);
      nv_max = std::max<size_t>(nv_max, p.bytes);
      nv_total += p.bytes;
    } else if (route[k] == kHost) {
      host_list.push_back(k);
    }
  }
  const int algo = nvcomp_algorithm(I.opt, level);
  size_t nv_slot = 0, nv_temp = 0, ptrs_off = 0, sizes_off = 0, outp_off = 0;
  if (!nv_list.empty()) {
    nv_slot = cuda::round_up(cuda::nvc::compress_max_output(nv_max, algo), A);
    nv_temp = cuda::nvc::compress_temp_bytes(nv_list.size(), nv_max, nv_total, algo);
    I.comp.reserve(nv_slot * nv_list.size());
    I.nvtemp.reserve(std::max<size_t>(nv_temp, 1));
    std::vector<const void*> in_ptrs(nv_list.size());
    std::vector<size_t> in_sizes(nv_list.size());
    std::vector<void*> out_ptrs(nv_list.size());
    for (size_t q = 0; q < nv_list.size(); ++q) {
      in_ptrs[q] = I.arena.as<uint8_t>(pls[nv_list[q]].off);
      in_sizes[q] = pls[nv_list[q]].bytes;
      out_ptrs[q] = I.comp.as<uint8_t>(q * nv_slot);
    }
    ptrs_off = meta.add(in_ptrs);
    sizes_off = meta.add(in_sizes);
    outp_off = meta.add(out_ptrs);
  }
  const size_t segs_off = meta.add(segs), tiles_off = meta.add(tiles), raw_ops_off = meta.add(raw_ops);
  const size_t ldd = cuda::round_up(std::max<size_t>(max_rows, 1), 16);
  uint32_t max_p = 1;
  for (const auto& t : I.tr) max_p = std::max({max_p, t[0].p, t[1].p});
  I.x.reserve(std::max<size_t>(max_rows, 1) * max_p * cuda::elem_bytes(I.et));
  I.dt.reserve(std::max<size_t>(max_ru, 1) * ldd * 4);
  size_t max_table = 0;
  for (const Job& j : jobs)
    if (j.rope_block >= 0) max_table = std::max<size_t>(max_table, size_t(j.c1 - j.c0) * (ropes[j.rope_block].p.n_rot / 2));
  I.rope_c.reserve(std::max<size_t>(max_table, 1) * 8);
  I.rope_s.reserve(std::max<size_t>(max_table, 1) * 8);
  // Small device results: nvCOMP sizes and statuses.
  const size_t res_sizes = 0, res_status = cuda::round_up(nv_list.size() * 8, 16);
  const size_t res_bytes = res_status + nv_list.size() * 4 + 16;
  I.small.reserve(res_bytes);
  I.h_small.reserve(res_bytes);
  host_ms += ms_since(t_host);

  // ---- GPU: tables, raw gathers, jobs, nvCOMP
  Timeline tl(I.st, times != nullptr);
  tl.begin(kSTransfer);
  I.upload_meta(meta);
  tl.end();
  const uint8_t* M = I.meta.as<uint8_t>();
  tl.begin(kSGather);
  cuda::launch_batched_copy(reinterpret_cast<const cuda::CopyOp*>(M + raw_ops_off), uint32_t(raw_ops.size()), I.st);
  tl.end();
  for (const Job& j : jobs) {
    const KvBlock& kb = caps[j.cap]->host.blocks[j.b];
    const Impl::Tr& T = I.tr[j.b][j.kv];
    const uint32_t n = j.c1 - j.c0;
    const uint16_t* cache = static_cast<const uint16_t*>(caps[j.cap]->kv[j.b][j.kv].get());
    tl.begin(kSGather);
    cuda::RopeDev rd;
    const double *c = nullptr, *s = nullptr;
    if (j.rope_block >= 0) {
      const RopeSlot& rs = ropes[j.rope_block];
      rd = rope_dev(rs.p, reinterpret_cast<const float*>(M + rs.factors_off));
      cuda::launch_rope_table(reinterpret_cast<const int32_t*>(M + j.pos_off), n, rd, true, I.rope_c.as<double>(), I.rope_s.as<double>(), I.st);
      c = I.rope_c.as<double>();
      s = I.rope_s.as<double>();
    }
    cuda::launch_gather(cache, kb.n_layer() * kb.n_head_kv, kb.n_tokens(), kb.head_dim, j.c0, n, c, s, rd, T.mu.as<float>(), I.x.p, I.et, I.st);
    tl.end();
    const size_t jl = cuda::round_up(n, 16);
    if (j.ru > 0) {
      tl.begin(kSProject);
      I.proj->encode(I.x.p, I.et, I.tf32, T.gemm_basis(I.et), n, T.p, j.ru, I.dt.as<float>(), jl);
      tl.end();
    }
    tl.begin(kSQuant);
    const QSeg* sg = reinterpret_cast<const QSeg*>(M + segs_off) + j.seg0;
    cuda::launch_quant_params(I.dt.as<float>(), jl, sg, uint32_t(j.nseg), I.arena.as<uint8_t>(), I.st);
    // Tiles index segments globally; the kernel reads segs[tile.seg], so pass the global table.
    cuda::launch_quant_codes(I.dt.as<float>(), jl, reinterpret_cast<const QSeg*>(M + segs_off),
                             reinterpret_cast<const QTile*>(M + tiles_off) + j.tile0, uint32_t(j.ntile), I.arena.as<uint8_t>(), I.st);
    tl.end();
  }
  if (!nv_list.empty()) {
    tl.begin(kSEntropy);
    cuda::nvc::compress(reinterpret_cast<const void* const*>(M + ptrs_off), reinterpret_cast<const size_t*>(M + sizes_off), nv_max, nv_list.size(),
                        I.nvtemp.p, nv_temp, reinterpret_cast<void* const*>(M + outp_off), I.small.as<size_t>(res_sizes), I.small.as<int>(res_status),
                        algo, I.st);
    tl.end();
  }
  // Payloads deflated on the host come back first.
  std::vector<size_t> host_off(pls.size(), 0);
  size_t host_bytes = 0;
  for (size_t k : host_list) {
    host_off[k] = host_bytes;
    host_bytes += cuda::round_up(pls[k].bytes, 16);
  }
  tl.begin(kSTransfer);
  if (!host_list.empty()) {
    I.h_stage.reserve(host_bytes);
    for (size_t k : host_list)
      check(cudaMemcpyAsync(I.h_stage.b(host_off[k]), I.arena.as<uint8_t>(pls[k].off), pls[k].bytes, cudaMemcpyDeviceToHost, I.st), "payload D2H");
  }
  if (!nv_list.empty()) check(cudaMemcpyAsync(I.h_small.p, I.small.p, res_bytes, cudaMemcpyDeviceToHost, I.st), "nvCOMP sizes D2H");
  tl.end();
  // While the GPU works: the positions and tokens sections (libdeflate, as the CPU encoder).
  t_host = clock_type::now();
  detail::parallel_for(caps.size(), detail::resolve_threads(threads, caps.size()), [&](size_t i) {
    const KvCapture& c = caps[i]->host;
    for (size_t b = 0; b < c.blocks.size(); ++b) {
      const KvBlock& kb = c.blocks[b];
      std::vector<uint8_t> pl(kb.pos.size() * 4);
      std::memcpy(pl.data(), kb.pos.data(), pl.size());
      host_secs[i].emplace_back();
      write_section(host_secs[i].back(), kPositions, uint32_t(b), 0, 0, kb.n_tokens(), pl, level);
      if (b == 0 && !c.tokens.empty()) {
        std::memcpy(pl.data(), c.tokens.data(), pl.size());
        host_secs[i].emplace_back();
        write_section(host_secs[i].back(), kTokens, 0, 0, 0, kb.n_tokens(), pl, level);
      }
    }
  });
  host_ms += ms_since(t_host);
  check(cudaStreamSynchronize(I.st), "compress (GPU stages)");

  // ---- host: statuses, host DEFLATE, layout
  t_host = clock_type::now();
  const size_t* comp_sizes = reinterpret_cast<const size_t*>(I.h_small.b(res_sizes));
  const int* statuses = reinterpret_cast<const int*>(I.h_small.b(res_status));
  for (size_t q = 0; q < nv_list.size(); ++q)
    require(statuses[q] == 0, "compress: nvCOMP failed on a chunk: " + cuda::nvc::status_string(statuses[q]));
  std::vector<std::vector<uint8_t>> host_sec(pls.size());
  double host_deflate_ms = 0;
  {
    const auto t_hd = clock_type::now();
    detail::parallel_for(host_list.size(), detail::resolve_threads(threads, host_list.size()), [&](size_t q) {
      const size_t k = host_list[q];
      const Payload& p = pls[k];
      std::vector<uint8_t> pl(I.h_stage.b(host_off[k]), I.h_stage.b(host_off[k]) + p.bytes);
      write_section(host_sec[k], p.kind, p.block, p.kv, p.t0, p.t1, pl, level);
    });
    host_deflate_ms = ms_since(t_hd);
  }
  // Section sizes and offsets.
  std::vector<uint64_t> stored(pls.size()), sec_off(pls.size());
  std::vector<uint64_t> cap_off(caps.size() + 1, 0);
  std::vector<std::vector<uint64_t>> hs_off(caps.size());
  std::string backend;
  uint64_t total = 0;
  for (uint32_t i = 0; i < caps.size(); ++i) {
    cap_off[i] = total;
    uint64_t o = kFileHeaderBytes + headers[i].size();
    for (const auto& h : host_secs[i]) {
      hs_off[i].push_back(o);
      o += h.size();
    }
    // Container order: positions/tokens, then the payload sections as planned.
    for (size_t k : cap_pls[i]) {
      const Payload& p = pls[k];
      if (route[k] == kNv) {
        const size_t cs = comp_sizes[nv_index[k]];
        stored[k] = (cs > 0 && cs < p.bytes) ? cs : p.bytes;
        mix_backend(backend, "nvcomp");
      } else if (route[k] == kHost) {
        stored[k] = host_sec[k].size() - kSectionHeaderBytes;
        mix_backend(backend, "libdeflate-host");
      } else {
        stored[k] = p.bytes;
        if (p.kind == kChunk) mix_backend(backend, "stored");
      }
      sec_off[k] = o;
      o += kSectionHeaderBytes + stored[k];
    }
    total += o;
  }
  cap_off[caps.size()] = total;
  // Device-sourced section data -> staging at its final offsets.
  std::vector<cuda::CopyOp> ops;
  I.stage.reserve(total);
  for (size_t k = 0; k < pls.size(); ++k) {
    if (route[k] == kHost) continue;
    const uint8_t* src = (route[k] == kNv && stored[k] < pls[k].bytes) ? I.comp.as<uint8_t>(nv_index[k] * nv_slot) : I.arena.as<uint8_t>(pls[k].off);
    split_copy(ops, src, I.stage.as<uint8_t>(cap_off[pls[k].cap] + sec_off[k] + kSectionHeaderBytes), stored[k]);
  }
  Blob m2;
  const size_t ops_off = m2.add(ops);
  host_ms += ms_since(t_host) - host_deflate_ms;
  tl.begin(kSTransfer);
  // The second table upload reuses the meta buffers: the first one's
  // consumers have finished (the stream was synchronized above).
  I.upload_meta(m2);
  cuda::launch_batched_copy(reinterpret_cast<const cuda::CopyOp*>(I.meta.as<uint8_t>(ops_off)), uint32_t(ops.size()), I.st);
  I.h_stage.reserve(total);  // host-deflated payloads were consumed above
  check(cudaMemcpyAsync(I.h_stage.p, I.stage.p, total, cudaMemcpyDeviceToHost, I.st), "containers D2H");
  tl.end();
  check(cudaStreamSynchronize(I.st), "compress (assembly)");

  // ---- host: headers, checksums, hand out
  t_host = clock_type::now();
  detail::parallel_for(pls.size(), detail::resolve_threads(threads, pls.size()), [&](size_t k) {
    const Payload& p = pls[k];
    uint8_t* at = I.h_stage.b(cap_off[p.cap] + sec_off[k]);
    if (route[k] == kHost) {
      std::memcpy(at, host_sec[k].data(), host_sec[k].size());
      return;
    }
    const uint64_t x = xxh64(at + kSectionHeaderBytes, stored[k]);
    cuda::put_section_header(at, p.kind, p.block, p.kv, p.t0, p.t1, p.bytes, stored[k], x);
  });
  for (uint32_t i = 0; i < caps.size(); ++i) {
    uint8_t* base = I.h_stage.b(cap_off[i]);
    cuda::put_file_header(base, headers[i]);
    for (size_t h = 0; h < host_secs[i].size(); ++h) std::memcpy(base + hs_off[i][h], host_secs[i][h].data(), host_secs[i][h].size());
  }
  detail::parallel_for(caps.size(), detail::resolve_threads(threads, caps.size()),
                       [&](size_t i) { out[i].assign(I.h_stage.b(cap_off[i]), I.h_stage.b(cap_off[i + 1])); });
  host_ms += ms_since(t_host);
  if (times) *times = tl.times(host_deflate_ms, host_ms, ms_since(t_start), backend.empty() ? "stored" : backend);
}

// ------------------------------------------------------------ decompress

std::vector<CudaKvCapture> CudaCodec::decompress(const std::vector<const std::vector<uint8_t>*>& containers, const std::string& origin,
                                                 CudaStageTimes* times) {
  Impl& I = *impl_;
  const auto t_start = clock_type::now();
  auto t_host = clock_type::now();
  double host_ms = 0, host_inflate_ms = 0;
  const int threads = I.threads();
  std::vector<cuda::DecodePlan> plans;
  for (size_t i = 0; i < containers.size(); ++i) {
    require(containers[i] != nullptr, "decompress: null container");
    plans.push_back(cuda::plan_decode(containers[i]->data(), containers[i]->size(), I.cal,
                                      containers.size() == 1 ? origin : origin + "[" + std::to_string(i) + "]", threads));
  }
  std::vector<CudaKvCapture> outs(plans.size());
  const bool use_nv = cuda::nvc::built() && I.opt.nvcomp;
  const size_t A = I.align;
  // ---- slots
  struct Sec {
    uint32_t cap;
    const Section* s;
    uint64_t in_off = 0, out_off = 0;  // arena offsets of the stored bytes and (deflated) the payload
    bool deflated = false;
    uint64_t payload() const { return deflated ? out_off : in_off; }
  };
  std::vector<Sec> secs;
  uint64_t arena = 0;
  for (uint32_t i = 0; i < plans.size(); ++i)
    for (const Section& s : plans[i].kv_sections) {
      Sec x{i, &s};
      x.deflated = s.stored_len != s.raw_len;
      if (!x.deflated || use_nv) {
        arena = cuda::round_up(arena, A);
        x.in_off = arena;
        arena += s.stored_len;
      }
      if (x.deflated) {
        arena = cuda::round_up(arena, A);
        x.out_off = arena;
        arena += s.raw_len;
      }
      secs.push_back(x);
    }
  I.arena.reserve(std::max<uint64_t>(arena, 1));
  I.h_stage.reserve(std::max<uint64_t>(arena, 1));
  // ---- outputs
  for (uint32_t i = 0; i < plans.size(); ++i) {
    outs[i].host = plans[i].host;
    outs[i].kv.resize(plans[i].host.blocks.size());
    for (size_t b = 0; b < plans[i].host.blocks.size(); ++b)
      for (int kv = 0; kv < 2; ++kv) outs[i].kv[b][kv] = CudaBuffer(plans[i].host.blocks[b].numel() * 2);
  }
  // ---- tables
  Blob meta;
  std::vector<size_t> nv_list;
  size_t nv_max = 0, nv_total = 0;
  for (size_t k = 0; k < secs.size(); ++k)
    if (secs[k].deflated && use_nv) {
      nv_list.push_back(k);
      nv_max = std::max<size_t>(nv_max, secs[k].s->raw_len);
      nv_total += secs[k].s->raw_len;
    }
  size_t nv_temp = 0, in_ptrs_off = 0, in_sizes_off = 0, out_sizes_off = 0, out_ptrs_off = 0;
  if (!nv_list.empty()) {
    std::vector<const void*> in_ptrs;
    std::vector<void*> out_ptrs;
    std::vector<size_t> in_sizes, out_sizes;
    for (size_t k : nv_list) {
      in_ptrs.push_back(I.arena.as<uint8_t>(secs[k].in_off));
      in_sizes.push_back(secs[k].s->stored_len);
      out_ptrs.push_back(I.arena.as<uint8_t>(secs[k].out_off));
      out_sizes.push_back(secs[k].s->raw_len);
    }
    in_ptrs_off = meta.add(in_ptrs);
    in_sizes_off = meta.add(in_sizes);
    out_sizes_off = meta.add(out_sizes);
    out_ptrs_off = meta.add(out_ptrs);
    nv_temp = cuda::nvc::decompress_temp_bytes(nv_list.size(), nv_max, nv_total);
    I.nvtemp.reserve(std::max<size_t>(nv_temp, 1));
  }
  // Raw sections -> cache layout.
  std::vector<cuda::CopyOp> raw_ops;
  for (const Sec& x : secs) {
    if (x.s->kind != kRaw) continue;
    const KvBlock& kb = outs[x.cap].host.blocks[x.s->block];
    uint8_t* cache = static_cast<uint8_t*>(outs[x.cap].kv[x.s->block][x.s->kv].get());
    const uint32_t n = x.s->t1 - x.s->t0;
    const uint64_t run = uint64_t(n) * kb.head_dim * 2;
    for (uint32_t lh = 0; lh < kb.n_layer() * kb.n_head_kv; ++lh)
      split_copy(raw_ops, I.arena.as<uint8_t>(x.payload() + lh * run), cache + (uint64_t(lh) * kb.n_tokens() + x.s->t0) * kb.head_dim * 2, run);
  }
  const size_t raw_ops_off = meta.add(raw_ops);
  // Jobs: the chunks of one (capture, block, kind), rows in token order.
  struct Job {
    uint32_t cap, b, kv, n_rows, ru;
    size_t seg0, nseg, tile0, ntile, rowtok_off, pos_off;
    bool rope;
  };
  std::vector<Job> jobs;
  std::vector<QSeg> segs;
  std::vector<QTile> tiles;
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<size_t>> by_job;
  for (size_t k = 0; k < secs.size(); ++k)
    if (secs[k].s->kind == kChunk) by_job[{secs[k].cap, secs[k].s->block, secs[k].s->kv}].push_back(k);
  size_t max_rows = 0, max_ru = 0, max_table = 0;
  uint32_t max_p = 1;
  for (auto& [key, ks] : by_job) {
    auto [i, b, kv] = key;
    std::sort(ks.begin(), ks.end(), [&](size_t a, size_t c) { return secs[a].s->t0 < secs[c].s->t0; });
    const cuda::DecodePlan& P = plans[i];
    const KvBlock& kb = P.host.blocks[b];
    Job j{i, b, kv, 0, P.H.blocks[b].r_used[kv], segs.size(), 0, tiles.size(), 0, 0, 0, false};
    std::vector<int32_t> row_tok, row_pos;
    for (size_t k : ks) {
      const Section& s = *secs[k].s;
      cuda::append_chunk_segments(P.H.blocks[b].alloc[kv], j.n_rows, s.t1 - s.t0, secs[k].payload(), true, segs);
      for (uint32_t t = s.t0; t < s.t1; ++t) {
        row_tok.push_back(int32_t(t));
        row_pos.push_back(kb.pos[t]);
      }
      j.n_rows += s.t1 - s.t0;
    }
    j.nseg = segs.size() - j.seg0;
    cuda::append_decode_tiles(segs, j.seg0, tiles);
    j.ntile = tiles.size() - j.tile0;
    j.rowtok_off = meta.add(row_tok);
    j.rope = kv == 0 && P.H.keys_derope && P.rope[b] && P.rope[b]->layout != RopeParams::Layout::kNone && P.rope[b]->n_rot > 0;
    if (j.rope) {
      j.pos_off = meta.add(row_pos);
      max_table = std::max<size_t>(max_table, size_t(j.n_rows) * (P.rope[b]->n_rot / 2));
    }
    max_rows = std::max<size_t>(max_rows, j.n_rows);
    max_ru = std::max<size_t>(max_ru, j.ru);
    max_p = std::max(max_p, I.tr[b][kv].p);
    jobs.push_back(j);
  }
  // Frequency factors per (capture, block).
  std::map<std::pair<uint32_t, uint32_t>, size_t> factors_off;
  for (const Job& j : jobs)
    if (j.rope && !plans[j.cap].rope[j.b]->freq_factors.empty() && !factors_off.count({j.cap, j.b}))
      factors_off[{j.cap, j.b}] = meta.add(plans[j.cap].rope[j.b]->freq_factors);
  const size_t segs_off = meta.add(segs), tiles_off = meta.add(tiles);
  const size_t ldd = cuda::round_up(std::max<size_t>(max_rows, 1), 16);
  I.x.reserve(std::max<size_t>(max_rows, 1) * max_p * 4);
  I.dt.reserve(std::max<size_t>(max_ru, 1) * ldd * cuda::elem_bytes(I.et));
  I.rope_c.reserve(std::max<size_t>(max_table, 1) * 8);
  I.rope_s.reserve(std::max<size_t>(max_table, 1) * 8);
  const size_t res_status = cuda::round_up(nv_list.size() * 8, 16), res_bytes = res_status + nv_list.size() * 4 + 16;
  I.small.reserve(res_bytes);
  I.h_small.reserve(res_bytes);
  // ---- host: stored bytes (or, without nvCOMP, inflated payloads) into pinned staging
  {
    const auto t_in = clock_type::now();
    detail::parallel_for(secs.size(), detail::resolve_threads(threads, secs.size()), [&](size_t k) {
      const Sec& x = secs[k];
      if (!x.deflated || use_nv) {
        std::memcpy(I.h_stage.b(x.in_off), x.s->data, x.s->stored_len);
      } else {
        std::vector<uint8_t> pl = payload(*x.s, origin);
        std::memcpy(I.h_stage.b(x.out_off), pl.data(), pl.size());
      }
    });
    if (!use_nv) host_inflate_ms = ms_since(t_in);
  }
  host_ms += ms_since(t_host) - host_inflate_ms;

  // ---- GPU
  Timeline tl(I.st, times != nullptr);
  tl.begin(kSTransfer);
  I.upload_meta(meta);
  check(cudaMemcpyAsync(I.arena.p, I.h_stage.p, arena, cudaMemcpyHostToDevice, I.st), "containers H2D");
  tl.end();
  const uint8_t* M = I.meta.as<uint8_t>();
  if (!nv_list.empty()) {
    tl.begin(kSEntropy);
    cuda::nvc::decompress(reinterpret_cast<const void* const*>(M + in_ptrs_off), reinterpret_cast<const size_t*>(M + in_sizes_off),
                          reinterpret_cast<const size_t*>(M + out_sizes_off), I.small.as<size_t>(0), nv_list.size(), I.nvtemp.p, nv_temp,
                          reinterpret_cast<void* const*>(M + out_ptrs_off), I.small.as<int>(res_status), I.st);
    check(cudaMemcpyAsync(I.h_small.p, I.small.p, res_bytes, cudaMemcpyDeviceToHost, I.st), "nvCOMP results D2H");
    tl.end();
  }
  tl.begin(kSGather);
  cuda::launch_batched_copy(reinterpret_cast<const cuda::CopyOp*>(M + raw_ops_off), uint32_t(raw_ops.size()), I.st);
  tl.end();
  for (const Job& j : jobs) {
    const Impl::Tr& T = I.tr[j.b][j.kv];
    const KvBlock& kb = outs[j.cap].host.blocks[j.b];
    const size_t jl = cuda::round_up(j.n_rows, 16);
    tl.begin(kSQuant);
    cuda::launch_unpack(I.arena.as<uint8_t>(), reinterpret_cast<const QSeg*>(M + segs_off), reinterpret_cast<const QTile*>(M + tiles_off) + j.tile0,
                        uint32_t(j.ntile), I.dt.p, jl, I.et, I.st);
    tl.end();
    // X = D B[:ru] (beta 0); the mean is added in the scatter (one f32 add
    // per value, as the CPU's GEMM with beta = 1 onto mu), saving a pass over X.
    tl.begin(kSProject);
    I.proj->decode(I.dt.p, I.et, I.tf32, jl, T.gemm_basis(I.et), j.n_rows, T.p, j.ru, I.x.as<float>(), 0.0f);
    tl.end();
    tl.begin(kSGather);
    cuda::RopeDev rd;
    const double *c = nullptr, *s = nullptr;
    if (j.rope) {
      auto it = factors_off.find({j.cap, j.b});
      rd = rope_dev(*plans[j.cap].rope[j.b], it == factors_off.end() ? nullptr : reinterpret_cast<const float*>(M + it->second));
      cuda::launch_rope_table(reinterpret_cast<const int32_t*>(M + j.pos_off), j.n_rows, rd, false, I.rope_c.as<double>(), I.rope_s.as<double>(),
                              I.st);
      c = I.rope_c.as<double>();
      s = I.rope_s.as<double>();
    }
    cuda::launch_scatter(I.x.as<float>(), T.mu.as<float>(), j.n_rows, reinterpret_cast<const int32_t*>(M + j.rowtok_off), c, s, rd,
                         static_cast<uint16_t*>(outs[j.cap].kv[j.b][j.kv].get()), kb.n_layer() * kb.n_head_kv, kb.n_tokens(), kb.head_dim, I.st);
    tl.end();
  }
  check(cudaStreamSynchronize(I.st), "decompress");
  t_host = clock_type::now();
  if (!nv_list.empty()) {
    const size_t* actual = reinterpret_cast<const size_t*>(I.h_small.b(0));
    const int* statuses = reinterpret_cast<const int*>(I.h_small.b(res_status));
    for (size_t q = 0; q < nv_list.size(); ++q) {
      const Section& s = *secs[nv_list[q]].s;
      require(statuses[q] == 0 && actual[q] == s.raw_len,
              origin + ": " + section_name(s.kind) + " section: DEFLATE stream is corrupt or does not inflate to " + std::to_string(s.raw_len) +
                  " bytes (nvCOMP: " + cuda::nvc::status_string(statuses[q]) + ")");
    }
  }
  host_ms += ms_since(t_host);
  if (times) *times = tl.times(host_inflate_ms, host_ms, ms_since(t_start), nv_list.empty() ? (use_nv ? "stored" : "libdeflate-host") : "nvcomp");
  return outs;
}

// ------------------------------------------------------------ synthetic data, error

CudaKvCapture CudaCodec::synthesize(const KvCapture& shape, const std::vector<std::array<std::vector<float>, 2>>& sigma, uint64_t seed) {
  Impl& I = *impl_;
  require(shape.blocks.size() == I.tr.size() && sigma.size() == I.tr.size(), "synthesize: block count differs from the calibration's");
  const bool derope = calibration_keys_derope(I.cal);
  CudaKvCapture out;
  out.host.meta = shape.meta;
  out.host.tokens = shape.tokens;
  out.kv.resize(shape.blocks.size());
  constexpr uint32_t kTile = 16384;
  for (size_t b = 0; b < shape.blocks.size(); ++b) {
    const KvBlock& sb = shape.blocks[b];
    KvBlock h;
    h.layers = sb.layers;
    h.n_head_kv = sb.n_head_kv;
    h.head_dim = sb.head_dim;
    h.pos = sb.pos;
    out.host.blocks.push_back(h);
    const uint32_t n = h.n_tokens();
    for (int kv = 0; kv < 2; ++kv) {
      const Impl::Tr& T = I.tr[b][kv];
      require(T.p == feature_dim(h), "synthesize: block " + std::to_string(b) + " feature count differs from the calibration's");
      out.kv[b][kv] = CudaBuffer(h.numel() * 2);
      const uint32_t ru = uint32_t(std::min<size_t>(sigma[b][kv].size(), T.r));
      std::optional<RopeParams> rp;
      if (kv == 0 && derope) {
        rp = rope_params_from_meta(shape.meta, b == 1, h.head_dim, "synthesize");
        if (rp->layout == RopeParams::Layout::kNone || rp->n_rot == 0) rp.reset();
      }
      Blob m;
      const size_t sig_off = m.add(sigma[b][kv].data(), size_t(ru) * 4);
      const size_t fac_off = rp && !rp->freq_factors.empty() ? m.add(rp->freq_factors) : 0;
      std::vector<int32_t> iota(n);
      for (uint32_t t = 0; t < n; ++t) iota[t] = int32_t(t);
      const size_t tok_off = m.add(iota);
      const size_t pos_off = m.add(h.pos);
      I.upload_meta(m);
      const uint8_t* M = I.meta.as<uint8_t>();
      const uint32_t tile = std::min(kTile, std::max(n, 1u));
      const size_t ld = cuda::round_up(tile, 16);
      I.dt.reserve(size_t(std::max(ru, 1u)) * ld * 4);
      I.x.reserve(size_t(tile) * T.p * 4);
      if (rp) {
        I.rope_c.reserve(size_t(tile) * (rp->n_rot / 2) * 8);
        I.rope_s.reserve(size_t(tile) * (rp->n_rot / 2) * 8);
      }
      for (uint32_t t0 = 0; t0 < n; t0 += tile) {
        const uint32_t m_rows = std::min(tile, n - t0);
        cuda::launch_gaussian(I.dt.as<float>(), ld, ru, m_rows, reinterpret_cast<const float*>(M + sig_off),
                              seed * 0x9e3779b97f4a7c15ull + b * 2 + kv, t0, I.st);
        cuda::launch_center_fill(I.x.as<float>(), T.mu.as<float>(), m_rows, T.p, I.st);
        I.proj->decode(I.dt.p, ElemType::kF32, false, ld, T.basis.p, m_rows, T.p, ru, I.x.as<float>(), 1.0f);
        cuda::RopeDev rd;
        const double *c = nullptr, *s = nullptr;
        if (rp) {
          rd = rope_dev(*rp, reinterpret_cast<const float*>(M + fac_off));
          cuda::launch_rope_table(reinterpret_cast<const int32_t*>(M + pos_off) + t0, m_rows, rd, false, I.rope_c.as<double>(), I.rope_s.as<double>(),
                                  I.st);
          c = I.rope_c.as<double>();
          s = I.rope_s.as<double>();
        }
        cuda::launch_scatter(I.x.as<float>(), nullptr, m_rows, reinterpret_cast<const int32_t*>(M + tok_off) + t0, c, s, rd,
                             static_cast<uint16_t*>(out.kv[b][kv].get()), h.n_layer() * h.n_head_kv, n, h.head_dim, I.st);
      }
      check(cudaStreamSynchronize(I.st), "synthesize");
    }
  }
  return out;
}

ReconError CudaCodec::reconstruction_error(const CudaKvCapture& ref, const CudaKvCapture& dec, uint32_t sink, uint32_t window) {
  Impl& I = *impl_;
  require(ref.host.blocks.size() == dec.host.blocks.size(), "reconstruction_error: block counts differ");
  I.small.reserve(64);
  check(cudaMemsetAsync(I.small.p, 0, 32, I.st), "memset");
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
                          x.n_layer() * x.n_head_kv, n, x.head_dim, lo, hi, I.small.as<double>(16 * kv), I.st);
  }
  double acc[4];
  check(cudaMemcpyAsync(acc, I.small.p, 32, cudaMemcpyDeviceToHost, I.st), "error D2H");
  check(cudaStreamSynchronize(I.st), "reconstruction_error");
  r.k = acc[1] > 0 ? acc[0] / acc[1] : 0;
  r.v = acc[3] > 0 ? acc[2] / acc[3] : 0;
  return r;
}

// ------------------------------------------------------------ host conveniences

std::vector<uint8_t> kvtc_compress_cuda(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                                        const CudaOptions& copt) {
  CudaCodec codec(cal, copt);
  CudaKvCapture d = cuda_upload(c, copt.device);
  std::vector<std::vector<uint8_t>> out;
  codec.compress({&d}, alloc, opt, out);
  return std::move(out[0]);
}

KvCapture kvtc_decompress_cuda(const std::vector<uint8_t>& bytes, const Calibration& cal, const std::string& origin, const CudaOptions& copt) {
  CudaCodec codec(cal, copt);
  std::vector<CudaKvCapture> d = codec.decompress({&bytes}, origin);
  return cuda_download(d[0]);
}

}  // namespace kvtc
