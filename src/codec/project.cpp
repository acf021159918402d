#include "codec/project.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/util.h"
#include "kvtc/error.h"
#include "kvtc/internal/lab_support.h"  // projection_gemm_gflops

#if KVTC_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvtc {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kAuto: return "auto";
    case Precision::kF32: return "f32";
    case Precision::kBF16: return "bf16";
    case Precision::kTF32: return "tf32";
    case Precision::kF16: return "f16";
  }
  return "?";
}

Precision parse_precision(const std::string& s) {
  if (s == "auto") return Precision::kAuto;
  if (s == "f32") return Precision::kF32;
  if (s == "bf16") return Precision::kBF16;
  if (s == "tf32") return Precision::kTF32;
  if (s == "f16") return Precision::kF16;
  throw Error("precision: expected auto, f32, bf16, tf32 or f16, got '" + s + "'");
}

namespace {

#if KVTC_HAVE_DNNL
dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

// Encode: src [m][k] bf16, weights the basis [n][k] read as k x n, dst f32.
// Decode: src [m][k] bf16 (or [k][m] with src_t: component-major codes),
// weights the basis [k][n], bias mu [n], dst f32.
// The scratchpad is the caller's (run(): one per thread): in oneDNN's
// default "library" mode, a build without DNNL_ENABLE_CONCURRENT_EXEC (the
// default) shares one scratchpad between primitives, and the codec runs
// distinct primitives at once (chunks in parallel_for, the store's worker
// beside a restore), which then may overwrite each other's.
dnnl::matmul::primitive_desc make_pd(bool decode, uint32_t m, uint32_t n, uint32_t k, bool src_t = false) {
  using D = dnnl::memory::dims;
  dnnl::memory::desc src(D{m, k}, dt::bf16, src_t ? tag::ba : tag::ab), wei(D{k, n}, dt::bf16, decode ? tag::ab : tag::ba),
      dst(D{m, n}, dt::f32, tag::ab);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (decode) return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dnnl::memory::desc(D{1, n}, dt::f32, tag::ab), dst), attr, engine());
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), attr, engine());
}

// oneDNN falls back to reference C++ loops ("ref:any", ~100x slower) where
// the ISA lacks bf16; only a JIT kernel counts as native.
bool native(const std::string& impl) {
  return impl.rfind("ref", 0) != 0 && impl.find("any") == std::string::npos;
}

// Primitives are JIT-compiled (0.5-3 ms each), so each thread keeps the few
// shapes a call uses (full and last chunks, K and V). A primitive made
// inside the codec's parallel region is set up for one thread; one made
// outside may use all: the thread count is part of the key.
struct Matmul {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};
const Matmul& matmul_for(bool decode, uint32_t m, uint32_t n, uint32_t k, bool src_t) {
  thread_local std::map<std::array<uint32_t, 6>, Matmul> cache;
  const uint32_t nthr = omp_in_parallel() ? 1u : uint32_t(omp_get_max_threads());
  const std::array<uint32_t, 6> key{decode, m, n, k, nthr, src_t};
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 64) cache.clear();  // a long-lived thread seeing many shapes
    dnnl::matmul::primitive_desc pd = make_pd(decode, m, n, k, src_t);
    it = cache.emplace(key, Matmul{pd, dnnl::matmul(pd)}).first;
  }
  return it->second;
}

void run(bool decode, uint32_t m, uint32_t n, uint32_t k, const uint16_t* a, const uint16_t* b, const float* bias, float* c, bool src_t = false) {
  try {
    const Matmul& mm = matmul_for(decode, m, n, k, src_t);
    const dnnl::matmul::primitive_desc& pd = mm.pd;
    thread_local dnnl::stream s(engine());
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, dnnl::memory(pd.src_desc(), engine(), const_cast<uint16_t*>(a))},
                                               {DNNL_ARG_WEIGHTS, dnnl::memory(pd.weights_desc(), engine(), const_cast<uint16_t*>(b))},
                                               {DNNL_ARG_DST, dnnl::memory(pd.dst_desc(), engine(), c)}};
    if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(pd.bias_desc(), engine(), const_cast<float*>(bias)));
    const size_t scratch = pd.scratchpad_desc().get_size();
    if (scratch > 0) {
      thread_local std::vector<uint8_t> pad;
      if (pad.size() < scratch) pad.resize(scratch);
      args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(pd.scratchpad_desc(), engine(), pad.data()));
    }
    mm.prim.execute(s, args);
    s.wait();
  } catch (const dnnl::error& e) {
    throw Error(std::string("bf16 projection (oneDNN matmul ") + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                "): " + e.what());
  }
}
#endif

// f32 -> bf16, round to nearest even (finite inputs; a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__x86_64__)
// VCVTNEPS2BF16: 16 values per instruction, round to nearest even like
// to_bf16 (it flushes f32 denormals, below 1.2e-38, to zero: no cache value
// or basis entry is that small and non-zero in practice).
__attribute__((target("avx512f,avx512bf16"))) void sub_to_bf16_avx512(const float* x, const float* mu, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (mu) v = _mm512_sub_ps(v, _mm512_loadu_ps(mu + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
  for (; i < n; ++i) out[i] = to_bf16(mu ? x[i] - mu[i] : x[i]);
}
#endif

// out = bf16(x - mu) (mu may be null).
void sub_to_bf16(const float* x, const float* mu, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  static const bool vec = cpu_features().avx512f && cpu_features().avx512_bf16;
  if (vec) return sub_to_bf16_avx512(x, mu, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = to_bf16(mu ? x[i] - mu[i] : x[i]);
}

}  // namespace

bool bf16_projection_available(std::string* impl) {
  static const std::pair<bool, std::string> probe = []() -> std::pair<bool, std::string> {
#if KVTC_HAVE_DNNL
    try {
      const std::string name = make_pd(false, 64, 64, 64).impl_info_str();
      if (!native(name)) return {false, "oneDNN has only a reference bf16 kernel here (" + name + "): the CPU lacks AVX512-BF16 and AMX"};
      return {true, name};
    } catch (const dnnl::error& e) {
      return {false, std::string("oneDNN has no bf16 matmul on this CPU (") + e.what() + "): the CPU lacks AVX512-BF16 and AMX"};
    }
#else
    return {false, "built without oneDNN (libdnnl-dev)"};
#endif
  }();
  if (impl) *impl = probe.second;
  return probe.first;
}

double projection_gemm_gflops(Precision p, uint32_t m, uint32_t n, uint32_t k, int repeat) {
  p = detail::resolve_precision(p, "projection_gemm_gflops");
  // Values of the codec's scale; the time does not depend on them.
  std::vector<float> a(size_t(m) * k, 0.5f), b(size_t(n) * k, 0.25f), c(size_t(m) * n);
  std::vector<uint16_t> ab, bb;
  if (p == Precision::kBF16) {
    ab.resize(a.size()), bb.resize(b.size());
    sub_to_bf16(a.data(), nullptr, ab.data(), a.size());
    sub_to_bf16(b.data(), nullptr, bb.data(), b.size());
  }
  double best = 1e300;
  for (int i = 0; i < std::max(1, repeat) + 1; ++i) {  // +1: the first run JIT-compiles and faults pages in
    const auto t0 = std::chrono::steady_clock::now();
    if (p == Precision::kF32)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n), int(k), 1.0f, a.data(), int(k), b.data(), int(k), 0.0f, c.data(), int(n));
#if KVTC_HAVE_DNNL
    else
      run(false, m, n, k, ab.data(), bb.data(), nullptr, c.data());
#endif
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, s);
  }
  return 2.0 * m * n * k / (best * 1e9);
}

namespace detail {

Precision resolve_precision(Precision requested, const char* who) {
  std::string why;
  const bool bf16 = bf16_projection_available(&why);
  if (requested == Precision::kAuto) return bf16 ? Precision::kBF16 : Precision::kF32;
  if (requested == Precision::kTF32 || requested == Precision::kF16)
    throw Error(std::string(who) + ": precision " + precision_name(requested) + " is a GPU mode; the CPU projection runs f32 or bf16");
  if (requested == Precision::kBF16 && !bf16) throw Error(std::string(who) + ": precision bf16 asked for, but " + why + "; use f32 or auto");
  return requested;
}

namespace {
// Rounded bases by transform (transform_key: calibration id, block, K or
// V), shape and rows. Newest first; 8 at most (2 per block and ratio in use)
// and 256 MiB (SmolLM2's 5,760 features: 1,000 rows are 11 MiB). `probe`,
// 16 of the f32 entries, guards against a key that does not name the
// content (a Calibration whose bases were changed after its id was set).
constexpr size_t kProbe = 16;
struct RoundedBasis {
  std::string key;
  uint32_t p, ru;
  std::array<float, kProbe> probe;
  std::shared_ptr<const std::vector<uint16_t>> rows;
};
std::mutex g_rounded_mu;
std::list<RoundedBasis> g_rounded;
constexpr size_t kRoundedMax = 8;
constexpr size_t kRoundedBytes = size_t(256) << 20;

std::shared_ptr<const std::vector<uint16_t>> round_basis(const Transform& T, uint32_t ru) {
  auto rows = std::make_shared<std::vector<uint16_t>>(size_t(ru) * T.p);
  sub_to_bf16(T.basis.data(), nullptr, rows->data(), rows->size());
  return rows;
}

std::array<float, kProbe> probe_of(const Transform& T, uint32_t ru) {
  std::array<float, kProbe> a{};
  const size_t n = size_t(ru) * T.p;
  for (size_t i = 0; i < kProbe; ++i) a[i] = T.basis[(n - 1) * i / (kProbe - 1)];
  return a;
}
}  // namespace

std::string transform_key(const Calibration& cal, size_t block, int kv) {
  if (cal.id.empty()) return {};
  return cal.id + "/" + std::to_string(block) + (kv ? "/v" : "/k");
}

Projector::Projector(const Transform& T, uint32_t ru, Precision resolved, const std::string& key) : T_(T), ru_(ru), prec_(resolved) {
  require(prec_ != Precision::kAuto, "Projector: unresolved precision");
  if (prec_ != Precision::kBF16 || ru_ == 0) return;
  require(size_t(ru_) * T.p <= T.basis.size(), "Projector: more rows than the basis holds");
  if (key.empty()) {
    basis_bf16_ = round_basis(T, ru_);
    return;
  }
  const std::array<float, kProbe> probe = probe_of(T, ru_);
  {
    std::lock_guard<std::mutex> g(g_rounded_mu);
    for (auto it = g_rounded.begin(); it != g_rounded.end(); ++it)
      if (it->ru == ru_ && it->p == T.p && it->key == key) {
        if (std::memcmp(it->probe.data(), probe.data(), sizeof probe) != 0) {
          g_rounded.erase(it);  // not what the key names (anymore): rounded again below
          break;
        }
        basis_bf16_ = it->rows;
        g_rounded.splice(g_rounded.begin(), g_rounded, it);
        return;
      }
  }
  basis_bf16_ = round_basis(T, ru_);  // outside the lock: two threads may both round it once
  std::lock_guard<std::mutex> g(g_rounded_mu);
  g_rounded.push_front({key, T.p, ru_, probe, basis_bf16_});
  size_t bytes = 0, kept = 0;
  for (auto it = g_rounded.begin(); it != g_rounded.end(); ++it, ++kept) {
    bytes += it->rows->size() * 2;
    if (kept + 1 > kRoundedMax || (kept > 0 && bytes > kRoundedBytes)) {
      g_rounded.erase(it, g_rounded.end());
      break;
    }
  }
}

void Projector::encode(float* x, uint32_t n, float* d, StageClock* clk, bool component_major) const {
  const uint32_t p = T_.p;
  if (prec_ == Precision::kF32 || ru_ == 0) {
    {
      StageTimer st(clk, kCenter);
      for (uint32_t t = 0; t < n; ++t) {
        float* row = x + size_t(t) * p;
        for (uint32_t f = 0; f < p; ++f) row[f] -= T_.mu[f];
      }
    }
    if (ru_ == 0) return;
    StageTimer st(clk, kProject);
    if (component_major)  // D' = B[:ru] (X - mu)'
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(ru_), int(n), int(p), 1.0f, T_.basis.data(), int(p), x, int(p), 0.0f, d, int(n));
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(ru_), int(p), 1.0f, x, int(p), T_.basis.data(), int(p), 0.0f, d, int(ru_));
    return;
  }
#if KVTC_HAVE_DNNL
  std::vector<uint16_t> xb(size_t(n) * p);
  {
    StageTimer st(clk, kCenter);
    for (uint32_t t = 0; t < n; ++t) sub_to_bf16(x + size_t(t) * p, T_.mu.data(), xb.data() + size_t(t) * p, p);
  }
  StageTimer st(clk, kProject);
  if (component_major)  // the same product with the operands' roles swapped
    run(false, ru_, n, p, basis_bf16_->data(), xb.data(), nullptr, d);
  else
    run(false, n, ru_, p, xb.data(), basis_bf16_->data(), nullptr, d);
#else
  throw Error("Projector: bf16 without oneDNN");
#endif
}

void Projector::decode(const float* d, uint32_t n, float* x, StageClock* clk, bool component_major) const {
  const uint32_t p = T_.p;
  if (prec_ == Precision::kF32 || ru_ == 0) {
    {
      StageTimer st(clk, kCenter);
      for (uint32_t t = 0; t < n; ++t) std::memcpy(x + size_t(t) * p, T_.mu.data(), size_t(p) * 4);
    }
    if (ru_ == 0) return;
    StageTimer st(clk, kProject);
    cblas_sgemm(CblasRowMajor, component_major ? CblasTrans : CblasNoTrans, CblasNoTrans, int(n), int(p), int(ru_), 1.0f, d,
                component_major ? int(n) : int(ru_), T_.basis.data(), int(p), 1.0f, x, int(p));
    return;
  }
#if KVTC_HAVE_DNNL
  std::vector<uint16_t> db(size_t(n) * ru_);
  {
    StageTimer st(clk, kCenter);
    sub_to_bf16(d, nullptr, db.data(), db.size());
  }
  StageTimer st(clk, kProject);
  run(true, n, p, ru_, db.data(), basis_bf16_->data(), T_.mu.data(), x, component_major);
#else
  throw Error("Projector: bf16 without oneDNN");
#endif
}

}  // namespace detail
}  // namespace kvtc
