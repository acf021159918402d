#include "codec/project.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/util.h"
#include "format/ecsq.h"
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
    case Precision::kInt8: return "int8";
  }
  return "?";
}

Precision parse_precision(const std::string& s) {
  if (s == "auto") return Precision::kAuto;
  if (s == "f32") return Precision::kF32;
  if (s == "bf16") return Precision::kBF16;
  if (s == "tf32") return Precision::kTF32;
  if (s == "f16") return Precision::kF16;
  if (s == "int8") return Precision::kInt8;
  throw Error("precision: expected auto, f32, bf16, tf32, f16 or int8, got '" + s + "'");
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
// ldc: the row stride of dst (0: n), a layer group's columns of the
// decoder's [m][p] output.
dnnl::matmul::primitive_desc make_pd(bool decode, uint32_t m, uint32_t n, uint32_t k, bool src_t = false, uint32_t ldc = 0) {
  using D = dnnl::memory::dims;
  dnnl::memory::desc src(D{m, k}, dt::bf16, src_t ? tag::ba : tag::ab), wei(D{k, n}, dt::bf16, decode ? tag::ab : tag::ba),
      dst(D{m, n}, dt::f32, D{ldc ? ldc : n, 1});
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

// kInt8's decode: src [m][k] s8 codes, weights [k][n] s8 basis, dst f32
// += per-column scale * (src weights): the sum post-op adds to what the
// float GEMM of the leading components and the mean left in dst.
// The per-column scales go in one of two ways. Run-time output scales are
// what oneDNN 2.6's gemm:jit takes on VNNI and AVX2, but its AMX kernel
// (brg:avx512_core_amx_int8) refuses them and the matmul then falls back to
// gemm:jit: on a 2-core Xeon with AMX, 256 x 5760 x 1024, 422 GOP/s. A
// binary multiply by a [1][n] scale row before the sum (the same products,
// scaled once in f32) runs on the tiles at 1,060 GOP/s there; on the same
// Xeon capped at AVX512_CORE_VNNI it picks brg:avx512_core_vnni at 597
// against gemm:jit's 740, so it is taken only where it gets the AMX kernel
// (a scratch probe, bench/results/speed-amx.md).
dnnl::matmul::primitive_desc make_pd_s8(uint32_t m, uint32_t n, uint32_t k, bool binary_scales, uint32_t ldc = 0) {
  using D = dnnl::memory::dims;
  dnnl::memory::desc src(D{m, k}, dt::s8, tag::ab), wei(D{k, n}, dt::s8, tag::ab), dst(D{m, n}, dt::f32, D{ldc ? ldc : n, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::post_ops po;
  if (binary_scales)
    po.append_binary(dnnl::algorithm::binary_mul, dnnl::memory::desc(D{1, n}, dt::f32, tag::ab));
  else
    attr.set_output_scales(2, {DNNL_RUNTIME_F32_VAL});
  po.append_sum(1.0f);
  attr.set_post_ops(po);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), attr, engine());
}

// Whether this CPU's int8 decode takes its scales as a binary post-op (its
// AMX kernel), probed once.
bool s8_binary_scales() {
  static const bool yes = [] {
    if (!cpu_features().amx_int8) return false;
    try {
      return std::string(make_pd_s8(64, 64, 64, true).impl_info_str()).find("amx") != std::string::npos;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return yes;
}

dnnl::matmul::primitive_desc make_pd_s8(uint32_t m, uint32_t n, uint32_t k, uint32_t ldc = 0) {
  return make_pd_s8(m, n, k, s8_binary_scales(), ldc);
}

// Primitives are JIT-compiled (0.5-3 ms each), so each thread keeps the few
// shapes a call uses (full and last chunks, K and V). A primitive made
// inside the codec's parallel region is set up for one thread; one made
// outside may use all: the thread count is part of the key.
struct Matmul {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};
enum MatmulKind : uint32_t { kEncodeBf16, kDecodeBf16, kDecodeS8 };
const Matmul& matmul_for(MatmulKind kind, uint32_t m, uint32_t n, uint32_t k, bool src_t, uint32_t ldc) {
  thread_local std::map<std::array<uint32_t, 7>, Matmul> cache;
  const uint32_t nthr = omp_in_parallel() ? 1u : uint32_t(omp_get_max_threads());
  const std::array<uint32_t, 7> key{kind, m, n, k, nthr, src_t, ldc};
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 64) cache.clear();  // a long-lived thread seeing many shapes
    dnnl::matmul::primitive_desc pd = kind == kDecodeS8 ? make_pd_s8(m, n, k, ldc) : make_pd(kind == kDecodeBf16, m, n, k, src_t, ldc);
    it = cache.emplace(key, Matmul{pd, dnnl::matmul(pd)}).first;
  }
  return it->second;
}

// Runs a cached primitive; `bias_or_scales` is the bias (bf16 decode) or
// the output scales (s8).
void execute(MatmulKind kind, uint32_t m, uint32_t n, uint32_t k, const void* a, const void* b, const float* bias_or_scales, float* c, bool src_t,
             uint32_t ldc = 0) {
  try {
    const Matmul& mm = matmul_for(kind, m, n, k, src_t, ldc);
    const dnnl::matmul::primitive_desc& pd = mm.pd;
    thread_local dnnl::stream s(engine());
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, dnnl::memory(pd.src_desc(), engine(), const_cast<void*>(a))},
                                               {DNNL_ARG_WEIGHTS, dnnl::memory(pd.weights_desc(), engine(), const_cast<void*>(b))},
                                               {DNNL_ARG_DST, dnnl::memory(pd.dst_desc(), engine(), c)}};
    if (bias_or_scales && kind == kDecodeS8 && s8_binary_scales())
      args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                   dnnl::memory({{1, dnnl::memory::dim(n)}, dt::f32, tag::ab}, engine(), const_cast<float*>(bias_or_scales)));
    else if (bias_or_scales && kind == kDecodeS8)
      args.emplace(DNNL_ARG_ATTR_OUTPUT_SCALES,
                   dnnl::memory({{dnnl::memory::dim(n)}, dt::f32, tag::a}, engine(), const_cast<float*>(bias_or_scales)));
    else if (bias_or_scales)
      args.emplace(DNNL_ARG_BIAS, dnnl::memory(pd.bias_desc(), engine(), const_cast<float*>(bias_or_scales)));
    const size_t scratch = pd.scratchpad_desc().get_size();
    if (scratch > 0) {
      thread_local std::vector<uint8_t> pad;
      if (pad.size() < scratch) pad.resize(scratch);
      args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(pd.scratchpad_desc(), engine(), pad.data()));
    }
    mm.prim.execute(s, args);
    s.wait();
  } catch (const dnnl::error& e) {
    throw Error(std::string(kind == kDecodeS8 ? "int8" : "bf16") + " projection (oneDNN matmul " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                std::to_string(k) + "): " + e.what());
  }
}

// c's rows ldc apart (0: n).
void run(bool decode, uint32_t m, uint32_t n, uint32_t k, const uint16_t* a, const uint16_t* b, const float* bias, float* c, bool src_t = false,
         uint32_t ldc = 0) {
  execute(decode ? kDecodeBf16 : kEncodeBf16, m, n, k, a, b, bias, c, src_t, ldc);
}

// c[m][n] += scales[n] * (a[m][k] b[k][n]), integers summed exactly in 32 bits.
void run_s8(uint32_t m, uint32_t n, uint32_t k, const int8_t* a, const int8_t* b, const float* scales, float* c, uint32_t ldc = 0) {
  execute(kDecodeS8, m, n, k, a, b, scales, c, false, ldc);
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

namespace {
#if KVTC_HAVE_DNNL
// Whether oneDNN has a native kernel for the primitive `make` describes
// (`what`: "bf16" or "int8"; `lacks`: what the reason adds), probed once
// by the caller's static.
template <class Make>
std::pair<bool, std::string> probe_native(const char* what, const std::string& lacks, Make make) {
  try {
    const std::string name = make().impl_info_str();
    if (!native(name)) return {false, std::string("oneDNN has only a reference ") + what + " kernel here (" + name + ")" + lacks};
    return {true, name};
  } catch (const dnnl::error& e) {
    return {false, std::string("oneDNN has no ") + what + " matmul on this CPU (" + e.what() + ")" + lacks};
  }
}
#define KVTC_PROBE(what, lacks, pd) probe_native(what, lacks, [] { return pd; })
#else
#define KVTC_PROBE(what, lacks, pd) std::pair<bool, std::string>(false, "built without oneDNN (libdnnl-dev)")
#endif
}  // namespace

bool bf16_projection_available(std::string* impl) {
  static const std::pair<bool, std::string> probe = KVTC_PROBE("bf16", ": the CPU lacks AVX512-BF16 and AMX", make_pd(false, 64, 64, 64));
  if (impl) *impl = probe.second;
  return probe.first;
}

bool int8_projection_available(std::string* impl) {
  static const std::pair<bool, std::string> probe = KVTC_PROBE("int8", "", make_pd_s8(64, 64, 64));
  if (impl) *impl = probe.second;
  return probe.first;
}
#undef KVTC_PROBE

void set_grouped_projection(bool on) {
  detail::set_grouped_projection(on);
}

uint64_t projection_macs_per_token(const Transform& t, uint32_t ru) {
  const detail::GroupedBasis G = detail::grouped_projection() ? detail::find_groups(t, ru) : detail::GroupedBasis{};
  if (G.groups.empty()) return uint64_t(ru) * t.p;
  uint64_t macs = 0;
  for (const detail::GroupedBasis::Group& g : G.groups) macs += uint64_t(g.comps.size()) * g.w;
  return macs;
}

double projection_gemm_gflops(Precision p, uint32_t m, uint32_t n, uint32_t k, int repeat) {
  p = detail::resolve_precision(p, "projection_gemm_gflops");
  if (p == Precision::kInt8) {  // the decoder's shape: codes [m][k] times the basis [k][n]
#if KVTC_HAVE_DNNL
    std::vector<int8_t> a(size_t(m) * k, 3), b(size_t(k) * n, -5);
    std::vector<float> sc(n, 0.01f), c(size_t(m) * n, 0.0f);
    double best = 1e300;
    for (int i = 0; i < std::max(1, repeat) + 1; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run_s8(m, n, k, a.data(), b.data(), sc.data(), c.data());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) best = std::min(best, s);
    }
    return 2.0 * m * n * k / (best * 1e9);
#endif
  }
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
  // kAuto: the integer projection for the decoder's entropy-coded chunks
  // (the rest runs as float_precision says) where AVX2 runs it and bf16 is
  // not faster. On an AVX2-only EPYC it decodes the entropy-coded mode
  // 1.33-1.51x faster than f32 at +0.8% squared error and a KL within
  // +1.2% +- 5.5% of f32's over 8 prompts (bench/results/speed-int8.md,
  // quality-int8.md); on an AVX-512 VNNI + BF16 EPYC (Zen 4) 1.57x faster
  // than bf16 at DP-16x's error (8K SmolLM2: 855 -> 544 ms; oneDNN's int8
  // GEMM at ~700 GOP/s against bf16's ~395) with a KL +1.2% +- 2.0% (16x)
  // and -3.3% +- 1.7% (32x) of bf16's over 32 prompts (speed-vnni.md,
  // quality-int8-vnni.md). Where the CPU has AMX: int8 where its int8
  // matmul runs on the tiles (s8_binary_scales: 1,306 GOP/s against AMX
  // bf16's 695 on a 2-core Xeon, the 8K decode at DP-16x's error 621 ->
  // 423 ms, bench/results/speed-amx-int8.md; where the machine ran faster,
  // a tie, 345 against 348 ms, speed-amx-int8-fast.md; the integer products
  // are exact, so the KL above holds), else bf16 (oneDNN's VNNI int8, 373
  // GOP/s there, lost to AMX bf16: speed-amx.md); bf16 also where it is
  // native without VNNI.
  if (requested == Precision::kAuto) {
    const CpuFeatures& c = cpu_features();
    const bool int8 = c.avx2 && int8_projection_available();
    if (int8 && s8_binary_scales()) return Precision::kInt8;
    if (bf16 && (c.amx_bf16 || !int8 || !c.avx512_vnni)) return Precision::kBF16;
    return int8 ? Precision::kInt8 : Precision::kF32;
  }
  if (requested == Precision::kTF32 || requested == Precision::kF16)
    throw Error(std::string(who) + ": precision " + precision_name(requested) + " is a GPU mode; the CPU projection runs f32 or bf16");
  if (requested == Precision::kBF16 && !bf16) throw Error(std::string(who) + ": precision bf16 asked for, but " + why + "; use f32 or auto");
  if (requested == Precision::kInt8 && !int8_projection_available(&why))
    throw Error(std::string(who) + ": precision int8 asked for, but " + why + "; use f32, bf16 or auto");
  return requested;
}

Precision float_precision(Precision resolved) {
  if (resolved != Precision::kInt8) return resolved;
  return bf16_projection_available() ? Precision::kBF16 : Precision::kF32;
}

namespace {
// Rounded bases by transform (transform_key: calibration id, block, K or
// V), kind (bf16 or int8), shape and rows. Newest first; 8 at most (2 per
// block and ratio in use) and 256 MiB (SmolLM2's 5,760 features: 1,000
// rows are 11 MiB in bf16). `probe`, 16 of the f32 entries, guards against
// a key that does not name the content (a Calibration whose bases were
// changed after its id was set).
constexpr size_t kProbe = 16;
struct RoundedBasis {
  std::string key;
  bool s8;
  uint32_t p, ru;
  std::array<float, kProbe> probe;
  std::shared_ptr<const void> rows;
  size_t bytes;
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

std::shared_ptr<const Int8Basis> quantize_basis(const Transform& T, uint32_t ru) {
  auto b = std::make_shared<Int8Basis>();
  const uint32_t p = T.p;
  b->q.resize(size_t(ru) * p);
  b->scale.assign(p, 0.0f);
  for (uint32_t j = 0; j < ru; ++j)
    for (uint32_t f = 0; f < p; ++f) b->scale[f] = std::max(b->scale[f], std::fabs(T.basis[size_t(j) * p + f]));
  std::vector<float> inv(p);
  for (uint32_t f = 0; f < p; ++f) {
    b->scale[f] = b->scale[f] > 0 ? b->scale[f] / 63.0f : 1.0f;
    inv[f] = 1.0f / b->scale[f];
  }
  for (uint32_t j = 0; j < ru; ++j)
    for (uint32_t f = 0; f < p; ++f) b->q[size_t(j) * p + f] = int8_t(std::clamp(std::nearbyint(T.basis[size_t(j) * p + f] * inv[f]), -63.0f, 63.0f));
  return b;
}

std::array<float, kProbe> probe_of(const Transform& T, uint32_t ru) {
  std::array<float, kProbe> a{};
  const size_t n = size_t(ru) * T.p;
  for (size_t i = 0; i < kProbe; ++i) a[i] = T.basis[(n - 1) * i / (kProbe - 1)];
  return a;
}
}  // namespace

namespace {
std::atomic<bool> g_grouped{true};
}  // namespace

void set_grouped_projection(bool on) {
  g_grouped = on;
}
bool grouped_projection() {
  return g_grouped;
}

GroupedBasis find_groups(const Transform& T, uint32_t ru) {
  const uint32_t p = T.p;
  GroupedBasis out;
  if (ru < 2 || p < 2) return out;
  // Each component's support [lo, hi]; lo = p for an all-zero row.
  std::vector<uint32_t> lo(ru, p), hi(ru, 0);
  for (uint32_t j = 0; j < ru; ++j) {
    const float* row = T.basis.data() + size_t(j) * p;
    for (uint32_t f = 0; f < p; ++f)
      if (row[f] != 0.0f) {
        lo[j] = f;
        break;
      }
    for (uint32_t f = p; f-- > lo[j];)
      if (row[f] != 0.0f) {
        hi[j] = f;
        break;
      }
  }
  // The supports' union as disjoint runs: sorted by start, merged where they meet.
  std::vector<std::pair<uint32_t, uint32_t>> iv;
  for (uint32_t j = 0; j < ru; ++j)
    if (lo[j] < p) iv.push_back({lo[j], hi[j]});
  std::sort(iv.begin(), iv.end());
  std::vector<uint32_t> starts;
  uint32_t end = 0;
  for (size_t i = 0; i < iv.size(); ++i) {
    if (i == 0 || iv[i].first > end) starts.push_back(iv[i].first);
    end = i == 0 ? iv[i].second : std::max(end, iv[i].second);
  }
  if (starts.size() < 2) return out;
  starts[0] = 0;  // features no component touches join the run before them: zero in every row
  out.groups.resize(starts.size());
  for (size_t g = 0; g < starts.size(); ++g) {
    out.groups[g].c0 = starts[g];
    out.groups[g].w = (g + 1 < starts.size() ? starts[g + 1] : p) - starts[g];
  }
  for (uint32_t j = 0; j < ru; ++j) {
    const size_t g = lo[j] < p ? size_t(std::upper_bound(starts.begin(), starts.end(), lo[j]) - starts.begin()) - 1 : 0;
    out.groups[g].comps.push_back(j);
  }
  // 2 runs of SmolLM2's 5,760 features: ~1.8x fewer multiply-adds; below
  // 10% the extra, smaller GEMMs (and the gathering) would not pay.
  double macs = 0;
  for (const GroupedBasis::Group& G : out.groups) macs += double(G.comps.size()) * G.w;
  if (macs > 0.9 * double(ru) * p) out.groups.clear();
  return out;
}

std::string transform_key(const Calibration& cal, size_t block, int kv) {
  if (cal.id.empty()) return {};
  return cal.id + "/" + std::to_string(block) + (kv ? "/v" : "/k");
}

// The rounded rows of T (bf16, or int8 with s8) from the cache, or made
// by `make` (outside the lock: two threads may both make them once) and
// kept; an empty key makes them uncached.
template <class V, class Make>
std::shared_ptr<const V> cached_rows(const Transform& T, uint32_t ru, const std::string& key, bool s8, size_t bytes, Make make) {
  if (key.empty()) return make();
  const std::array<float, kProbe> probe = probe_of(T, ru);
  {
    std::lock_guard<std::mutex> g(g_rounded_mu);
    for (auto it = g_rounded.begin(); it != g_rounded.end(); ++it)
      if (it->ru == ru && it->p == T.p && it->s8 == s8 && it->key == key) {
        if (std::memcmp(it->probe.data(), probe.data(), sizeof probe) != 0) {
          g_rounded.erase(it);  // not what the key names (anymore): made again below
          break;
        }
        g_rounded.splice(g_rounded.begin(), g_rounded, it);
        return std::static_pointer_cast<const V>(it->rows);
      }
  }
  std::shared_ptr<const V> rows = make();
  std::lock_guard<std::mutex> g(g_rounded_mu);
  g_rounded.push_front({key, s8, T.p, ru, probe, rows, bytes});
  size_t total = 0, kept = 0;
  for (auto it = g_rounded.begin(); it != g_rounded.end(); ++it, ++kept) {
    total += it->bytes;
    if (kept + 1 > kRoundedMax || (kept > 0 && total > kRoundedBytes)) {
      g_rounded.erase(it, g_rounded.end());
      break;
    }
  }
  return rows;
}

Projector::Projector(const Transform& T, uint32_t ru, Precision resolved, const std::string& key)
    : T_(T), ru_(ru), prec_(float_precision(resolved)), int8_(resolved == Precision::kInt8) {
  require(prec_ != Precision::kAuto, "Projector: unresolved precision");
  if (ru_ == 0) return;
  require(size_t(ru_) * T.p <= T.basis.size(), "Projector: more rows than the basis holds");
  const size_t n = size_t(ru_) * T.p;
  if (prec_ == Precision::kBF16) basis_bf16_ = cached_rows<std::vector<uint16_t>>(T, ru_, key, false, n * 2, [&] { return round_basis(T, ru_); });
  if (int8_) basis_s8_ = cached_rows<Int8Basis>(T, ru_, key, true, n + size_t(T.p) * 4, [&] { return quantize_basis(T, ru_); });
  if (!grouped_projection()) return;
  // Found before the cache is asked: on a dense basis each row's first and
  // last entries are nonzero, so this reads 2 ru floats and one PCA's
  // Projectors take no slot of the cache of rounded rows.
  GroupedBasis found = find_groups(T, ru_);
  if (found.groups.empty()) return;
  // Packed in the precisions this Projector runs (the key says which).
  const bool f32 = prec_ == Precision::kF32, bf16 = prec_ == Precision::kBF16;
  const std::string gkey = key.empty() ? key : key + "/groups/" + (f32 ? "f32" : "bf16") + (int8_ ? "+s8" : "");
  size_t bytes = 0;
  for (const GroupedBasis::Group& g : found.groups) bytes += (g.comps.size() + 31) / 32 * 32 * g.w * ((f32 ? 4 : 2) + (int8_ ? 1 : 0));
  grouped_ = cached_rows<GroupedBasis>(T, ru_, gkey, false, bytes, [&] {
    auto G = std::make_shared<GroupedBasis>(std::move(found));
    const uint32_t p = T.p;
    for (GroupedBasis::Group& g : G->groups) {
      const size_t rows = (g.comps.size() + 31) / 32 * 32;
      if (f32) g.f32.assign(rows * g.w, 0.0f);
      if (bf16) g.bf16.assign(rows * g.w, 0);
      if (int8_) g.s8.assign(rows * g.w, 0);
      for (size_t i = 0; i < g.comps.size(); ++i) {
        const size_t src = size_t(g.comps[i]) * p + g.c0, dst = i * g.w;
        if (f32) std::copy_n(T.basis.data() + src, g.w, g.f32.data() + dst);
        if (bf16) std::copy_n(basis_bf16_->data() + src, g.w, g.bf16.data() + dst);
        if (int8_) std::copy_n(basis_s8_->q.data() + src, g.w, g.s8.data() + dst);
      }
    }
    return std::shared_ptr<const GroupedBasis>(G);
  });
}

void Projector::center(float* x, uint32_t n, StageClock* clk) const {
  StageTimer st(clk, kCenter);
  const uint32_t p = T_.p;
  for (uint32_t t = 0; t < n; ++t) {
    float* row = x + size_t(t) * p;
    for (uint32_t f = 0; f < p; ++f) row[f] -= T_.mu[f];
  }
}

void Projector::group_gemm(const GroupedBasis::Group& G, const float* dg, uint32_t m, uint32_t n, bool cm, float* x, StageClock* clk) const {
  const uint32_t p = T_.p;
  if (prec_ == Precision::kF32 || m == 0) {
    {
      StageTimer st(clk, kCenter);
      for (uint32_t t = 0; t < n; ++t) std::memcpy(x + size_t(t) * p + G.c0, T_.mu.data() + G.c0, size_t(G.w) * 4);
    }
    if (m == 0) return;
    StageTimer st(clk, kProject);
    cblas_sgemm(CblasRowMajor, cm ? CblasTrans : CblasNoTrans, CblasNoTrans, int(n), int(G.w), int(m), 1.0f, dg, cm ? int(n) : int(m), G.f32.data(),
                int(G.w), 1.0f, x + G.c0, int(p));
    return;
  }
#if KVTC_HAVE_DNNL
  std::vector<uint16_t> db(size_t(n) * m);
  {
    StageTimer st(clk, kCenter);
    sub_to_bf16(dg, nullptr, db.data(), db.size());
  }
  StageTimer st(clk, kProject);
  run(true, n, G.w, m, db.data(), G.bf16.data(), T_.mu.data() + G.c0, x + G.c0, cm, p);
#else
  throw Error("Projector: bf16 without oneDNN");
#endif
}

void Projector::decode_rows_grouped(const float* d, uint32_t n, uint32_t k, float* x, StageClock* clk, bool component_major) const {
  std::vector<float> dg;
  for (const GroupedBasis::Group& G : grouped_->groups) {
    const uint32_t m = uint32_t(std::lower_bound(G.comps.begin(), G.comps.end(), k) - G.comps.begin());
    {
      StageTimer st(clk, kCenter);
      dg.resize(size_t(n) * m);
      if (component_major)
        for (uint32_t i = 0; i < m; ++i) std::memcpy(dg.data() + size_t(i) * n, d + size_t(G.comps[i]) * n, size_t(n) * 4);
      else
        for (uint32_t t = 0; t < n; ++t)
          for (uint32_t i = 0; i < m; ++i) dg[size_t(t) * m + i] = d[size_t(t) * ru_ + G.comps[i]];
    }
    group_gemm(G, dg.data(), m, n, component_major, x, clk);
  }
}

void Projector::encode_grouped(float* x, uint32_t n, float* d, StageClock* clk, bool component_major) const {
  const uint32_t p = T_.p;
  const bool f32 = prec_ == Precision::kF32;
  if (f32) center(x, n, clk);
  std::vector<float> og;
  std::vector<uint16_t> xb;
  for (const GroupedBasis::Group& G : grouped_->groups) {
    const uint32_t m = uint32_t(G.comps.size()), w = G.w;
    if (m == 0) continue;
    og.resize(size_t(n) * m);
    if (f32) {
      StageTimer st(clk, kProject);
      if (component_major)  // og [m][n] = B_g X_g'
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n), int(w), 1.0f, G.f32.data(), int(w), x + G.c0, int(p), 0.0f, og.data(),
                    int(n));
      else  // og [n][m] = X_g B_g'
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(m), int(w), 1.0f, x + G.c0, int(p), G.f32.data(), int(w), 0.0f, og.data(),
                    int(m));
    } else {
#if KVTC_HAVE_DNNL
      {
        StageTimer st(clk, kCenter);
        xb.resize(size_t(n) * w);
        for (uint32_t t = 0; t < n; ++t) sub_to_bf16(x + size_t(t) * p + G.c0, T_.mu.data() + G.c0, xb.data() + size_t(t) * w, w);
      }
      StageTimer st(clk, kProject);
      if (component_major)
        run(false, m, n, w, G.bf16.data(), xb.data(), nullptr, og.data());
      else
        run(false, n, m, w, xb.data(), G.bf16.data(), nullptr, og.data());
#else
      throw Error("Projector: bf16 without oneDNN");
#endif
    }
    StageTimer st(clk, kProject);  // the run's components to their places in D
    if (component_major)
      for (uint32_t i = 0; i < m; ++i) std::memcpy(d + size_t(G.comps[i]) * n, og.data() + size_t(i) * n, size_t(n) * 4);
    else
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t i = 0; i < m; ++i) d[size_t(t) * ru_ + G.comps[i]] = og[size_t(t) * m + i];
  }
}

void Projector::encode(float* x, uint32_t n, float* d, StageClock* clk, bool component_major) const {
  const uint32_t p = T_.p;
  if (grouped_) return encode_grouped(x, n, d, clk, component_major);
  if (prec_ == Precision::kF32 || ru_ == 0) {
    center(x, n, clk);
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
  decode_rows(d, n, ru_, x, clk, component_major);
}

void Projector::decode_rows(const float* d, uint32_t n, uint32_t k, float* x, StageClock* clk, bool component_major) const {
  const uint32_t p = T_.p;
  require(k <= ru_ && (component_major || k == ru_), "Projector: rows to decode");
  if (grouped_ && k > 0) return decode_rows_grouped(d, n, k, x, clk, component_major);
  if (prec_ == Precision::kF32 || k == 0) {
    {
      StageTimer st(clk, kCenter);
      for (uint32_t t = 0; t < n; ++t) std::memcpy(x + size_t(t) * p, T_.mu.data(), size_t(p) * 4);
    }
    if (k == 0) return;
    StageTimer st(clk, kProject);
    cblas_sgemm(CblasRowMajor, component_major ? CblasTrans : CblasNoTrans, CblasNoTrans, int(n), int(p), int(k), 1.0f, d,
                component_major ? int(n) : int(ru_), T_.basis.data(), int(p), 1.0f, x, int(p));
    return;
  }
#if KVTC_HAVE_DNNL
  std::vector<uint16_t> db(size_t(n) * k);
  {
    StageTimer st(clk, kCenter);
    sub_to_bf16(d, nullptr, db.data(), db.size());  // component-major: the first k rows are the first k * n values
  }
  StageTimer st(clk, kProject);
  run(true, n, p, k, db.data(), basis_bf16_->data(), T_.mu.data(), x, component_major);
#else
  throw Error("Projector: bf16 without oneDNN");
#endif
}

// kInt8's codes: v = sign(q) (8 |q| - round(8 offset)), the reconstruction
// sign(q) (|q| - offset) in units of step / 8 with the offset rounded to
// 1/8 (an error of 1/16 step at most on a nonzero code). Fraction bits, on
// SmolLM2's 4K cache at 22.8x (256-token chunks of ~1,550 components; before
// outliers were corrected apart): 2 left 32-64 components to the float GEMM
// and added 1.3% to the error, 3 left 128-368 and added 0.5%, 4 left
// 400-1,000 and added nothing measurable.
constexpr int kFracBits = 3;

bool int8_codes_vector_path() {
#if defined(__x86_64__)
  static const bool v = cpu_features().avx512f && cpu_features().avx512bw && cpu_features().avx512vl;
  return v && vector_kernels();
#else
  return false;
#endif
}

namespace {
// A code past 8 bits in the integer GEMM: its remainder, added apart.
struct Outlier {
  uint32_t t, i;  // token; row among those converted
  int32_t rest;
};

// |v| of kInt8's fixed-point value v = sign(q) (8 |q| - ro) before the
// clamp: 0 for q = 0, >= 4 otherwise (ro is in [-4, 4]).
inline int32_t s8_magnitude(int32_t q, int32_t ro) {
  const int32_t sg = q >> 31;
  return ((((q ^ sg) - sg) << kFracBits) - ro) * int32_t(q != 0);
}
// The remainder past the clamp of code q, |v| = m > 127.
inline Outlier outlier_of(uint32_t t, uint32_t i, int32_t q, int32_t m) {
  return {t, i, q < 0 ? 127 - m : m - 127};
}
// One code as its value clamped to 8 bits; the remainder of token t,
// converted row i, goes to outliers.
inline int8_t code_to_s8(int32_t q, int32_t ro, uint32_t t, uint32_t i, std::vector<Outlier>& outliers) {
  const int32_t sg = q >> 31, m = s8_magnitude(q, ro), cl = std::min(m, 127);
  if (m > 127) outliers.push_back(outlier_of(t, i, q, m));
  return int8_t((cl ^ sg) - sg);
}

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics warn of their own _mm512_undefined_epi32()
// (GCC bug 105593), once per use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// A 16 x 16 byte matrix, row i in r[i], transposed in place: four rounds of
// unpacks (bytes, then 16-, 32-, 64-bit units of the previous round).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void transpose16x16_epi8(__m128i* r) {
  __m128i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // a[i]: rows 2i, 2i+1 interleaved, columns 0..7; a[8 + i]: 8..15
    a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    a[i + 8] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)  // b[8h + i]: rows 4i..4i+3, columns 8h..8h+3; b[8h + 4 + i]: 8h+4..8h+7
    for (int i = 0; i < 4; ++i) {
      b[h * 8 + i] = _mm_unpacklo_epi16(a[h * 8 + 2 * i], a[h * 8 + 2 * i + 1]);
      b[h * 8 + 4 + i] = _mm_unpackhi_epi16(a[h * 8 + 2 * i], a[h * 8 + 2 * i + 1]);
    }
  for (int q = 0; q < 4; ++q)  // a[4q + 2e + i]: rows 8i..8i+7, columns 4q+2e, 4q+2e+1
    for (int i = 0; i < 2; ++i) {
      a[q * 4 + i] = _mm_unpacklo_epi32(b[q * 4 + 2 * i], b[q * 4 + 2 * i + 1]);
      a[q * 4 + 2 + i] = _mm_unpackhi_epi32(b[q * 4 + 2 * i], b[q * 4 + 2 * i + 1]);
    }
  for (int q = 0; q < 4; ++q)  // r[j]: column j, rows 0..15
    for (int e = 0; e < 2; ++e) {
      r[q * 4 + 2 * e] = _mm_unpacklo_epi64(a[q * 4 + e * 2], a[q * 4 + e * 2 + 1]);
      r[q * 4 + 2 * e + 1] = _mm_unpackhi_epi64(a[q * 4 + e * 2], a[q * 4 + e * 2 + 1]);
    }
}

// codes_to_s8 in 16 x 16 tiles: 16 codes of a row converted in one vector,
// 16 rows' bytes transposed in registers and stored token-major, without
// the component-major staging. On the Zen 4 EPYC, a 256-token chunk of
// 2,100 rows: 0.125 ms against the staged scalar loop's 0.50. The outliers
// come per token in increasing row order, as the scalar loop's do, so the
// sums add_outliers makes are the same to the bit.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void codes_to_s8_avx512(const int32_t* const* rows, uint32_t k, uint32_t n, int32_t ro,
                                                                             int8_t* a, std::vector<Outlier>& outliers) {
  const uint32_t n16 = n / 16 * 16, k16 = k / 16 * 16;
  const __m512i vro = _mm512_set1_epi32(ro), v127 = _mm512_set1_epi32(127), zero = _mm512_setzero_si512();
  for (uint32_t t0 = 0; t0 < n16; t0 += 16) {
    for (uint32_t i0 = 0; i0 < k16; i0 += 16) {
      __m128i r[16];
      for (uint32_t ii = 0; ii < 16; ++ii) {
        const __m512i q = _mm512_loadu_si512(rows[i0 + ii] + t0);
        const __mmask16 nz = _mm512_test_epi32_mask(q, q), neg = _mm512_cmplt_epi32_mask(q, zero);
        const __m512i m = _mm512_maskz_sub_epi32(nz, _mm512_slli_epi32(_mm512_abs_epi32(q), kFracBits), vro);
        const __mmask16 over = _mm512_cmpgt_epi32_mask(m, v127);
        const __m512i cl = _mm512_min_epi32(m, v127);
        r[ii] = _mm512_cvtepi32_epi8(_mm512_mask_sub_epi32(cl, neg, zero, cl));
        if (over) {
          alignas(64) int32_t mm[16], qq[16];
          _mm512_store_si512(mm, m);
          _mm512_store_si512(qq, q);
          for (uint32_t l = 0; l < 16; ++l)
            if (over >> l & 1) outliers.push_back(outlier_of(t0 + l, i0 + ii, qq[l], mm[l]));
        }
      }
      transpose16x16_epi8(r);
      for (uint32_t tt = 0; tt < 16; ++tt) _mm_storeu_si128(reinterpret_cast<__m128i*>(a + size_t(t0 + tt) * k + i0), r[tt]);
    }
    for (uint32_t t = t0; t < t0 + 16; ++t)
      for (uint32_t i = k16; i < k; ++i) a[size_t(t) * k + i] = code_to_s8(rows[i][t], ro, t, i, outliers);
  }
  for (uint32_t t = n16; t < n; ++t)
    for (uint32_t i = 0; i < k; ++i) a[size_t(t) * k + i] = code_to_s8(rows[i][t], ro, t, i, outliers);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) uint32_t count_wide_avx512(const int32_t* row, uint32_t n, int32_t wide, uint32_t* done) {
  const __m512i w = _mm512_set1_epi32(wide);
  uint32_t over = 0, t = 0;
  for (; t + 16 <= n; t += 16) over += uint32_t(__builtin_popcount(_mm512_cmpge_epi32_mask(_mm512_abs_epi32(_mm512_loadu_si512(row + t)), w)));
  *done = t;
  return over;
}

#pragma GCC diagnostic pop
#endif

// How many of a row's n codes pass 8 bits: |c| >= wide.
uint32_t count_wide(const int32_t* row, uint32_t n, int32_t wide) {
  uint32_t over = 0, t = 0;
#if defined(__x86_64__)
  if (int8_codes_vector_path()) over = count_wide_avx512(row, n, wide, &t);
#endif
  for (; t < n; ++t) over += uint32_t(row[t] >= wide) + uint32_t(row[t] <= -wide);
  return over;
}

// rows[i] (i < k), each n codes of the chunk, as kInt8's fixed-point values
// (code_to_s8) token-major into a [n][k], the clamped remainders into
// outliers (those of one token in increasing i on both paths, which is
// what add_outliers' sums depend on). cm: the scalar path's staging.
template <class Row>
void codes_to_s8(Row rows, uint32_t k, uint32_t n, int32_t ro, std::vector<int8_t>& cm, std::vector<int8_t>& a, std::vector<Outlier>& outliers,
                 bool vector = int8_codes_vector_path()) {
  a.resize(size_t(n) * k);
#if defined(__x86_64__)
  if (vector) {
    thread_local std::vector<const int32_t*> ptrs;
    ptrs.resize(k);
    for (uint32_t i = 0; i < k; ++i) ptrs[i] = rows(i);
    return codes_to_s8_avx512(ptrs.data(), k, n, ro, a.data(), outliers);
  }
#endif
  cm.resize(size_t(k) * n);  // written whole below
  for (uint32_t i = 0; i < k; ++i) {
    const int32_t* row = rows(i);
    int8_t* out = cm.data() + size_t(i) * n;
    uint32_t over = 0;
    for (uint32_t t = 0; t < n; ++t) {
      const int32_t q = row[t], sg = q >> 31, m = s8_magnitude(q, ro), cl = std::min(m, 127);
      over += uint32_t(m > 127);
      out[t] = int8_t((cl ^ sg) - sg);
    }
    if (over)
      for (uint32_t t = 0; t < n; ++t) {
        const int32_t m = s8_magnitude(row[t], ro);
        if (m > 127) outliers.push_back(outlier_of(t, i, row[t], m));
      }
  }
  // Token-major for the GEMM (its transposed-source kernel ran ~20% slower
  // on an AVX2 EPYC), in 32 x 32 tiles.
  constexpr uint32_t kTile = 32;
  for (uint32_t t0 = 0; t0 < n; t0 += kTile)
    for (uint32_t i0 = 0; i0 < k; i0 += kTile)
      for (uint32_t t = t0; t < std::min(n, t0 + kTile); ++t)
        for (uint32_t i = i0; i < std::min(k, i0 + kTile); ++i) a[size_t(t) * k + i] = cm[size_t(i) * n + t];
}

// x[t][0..w) += rest * sc[f] q[f] for each outlier, q = qrows[o.i] (w
// apart), x's rows ldx apart: what the integer GEMM would have added with
// wider codes, on the same integer basis.
void add_outliers(const std::vector<Outlier>& outliers, const int8_t* qrows, const float* sc, uint32_t w, float* x, uint32_t ldx) {
  for (const Outlier& o : outliers) {
    const int8_t* qrow = qrows + size_t(o.i) * w;
    float* xr = x + size_t(o.t) * ldx;
    const float r = float(o.rest);
    for (uint32_t f = 0; f < w; ++f) xr[f] += r * (sc[f] * float(qrow[f]));
  }
}
}  // namespace

void int8_codes(const int32_t* c, uint32_t k, uint32_t n, float offset, bool vector, std::vector<int8_t>* a,
                std::vector<std::array<int32_t, 3>>* outliers) {
  require(!vector || int8_codes_vector_path(), "int8_codes: this CPU has no AVX-512BW");
  std::vector<int8_t> cm;
  std::vector<Outlier> o;
  codes_to_s8([&](uint32_t i) { return c + size_t(i) * n; }, k, n, int32_t(std::lround(std::ldexp(double(offset), kFracBits))), cm, *a, o, vector);
  outliers->clear();
  for (const Outlier& x : o) outliers->push_back({int32_t(x.t), int32_t(x.i), x.rest});
}

void Projector::decode_codes(const int32_t* c, uint32_t n, float step, float offset, float* x, StageClock* clk, DecodeScratch* scratch) const {
  if (!int8_ || ru_ == 0) {
    std::vector<float> d(size_t(ru_) * n);
    {
      StageTimer st(clk, kQuant);
      for (size_t i = 0; i < d.size(); ++i) d[i] = container::ecsq_value(c[i], step, offset);
    }
    return decode(d.data(), n, x, clk, true);
  }
#if KVTC_HAVE_DNNL
  DecodeScratch own;
  DecodeScratch& S = scratch ? *scratch : own;
  const uint32_t p = T_.p;
  // v = sign(c) (8 |c| - ro) for c != 0, ro = round(8 offset) in [-4, 4]:
  // |v| >= 4, and |v| > 127 iff |c| >= wide.
  const int32_t ro = int32_t(std::lround(std::ldexp(double(offset), kFracBits)));
  const int32_t wide = (127 + ro) / 8 + 1;
  // A component runs in the float GEMM when more than a quarter of its
  // codes pass 8 bits (the leading ones: the step is shared and their
  // variance is largest); in the others a code past 8 bits is clamped and
  // its remainder added apart (p multiply-adds, as the float GEMM would
  // spend on it: the integer GEMM is 1.3-2x faster, so a quarter still pays).
  // j0, the first integer component, rounded up to 32 so that a few
  // primitive shapes serve every chunk.
  uint32_t j0 = 0;
  {
    StageTimer st(clk, kQuant);
    for (uint32_t j = 0; j < ru_; ++j) {
      const int32_t* row = c + size_t(j) * n;
      if (count_wide(row, n, wide) > n / 4) j0 = j + 1;
    }
    j0 = std::min(ru_, (j0 + 31) / 32 * 32);
  }
  const float unit = std::ldexp(step, -kFracBits);
  std::vector<float> sc(p);
  for (uint32_t f = 0; f < p; ++f) sc[f] = basis_s8_->scale[f] * unit;
  std::vector<Outlier> outliers;
  std::vector<float>& lead = S.lead;
  if (grouped_) {
    // Run by run: its components before j0 (rounded up to 32 within the
    // run, so that a few shapes serve every chunk) in the float GEMM, the
    // rest in the integer one, each on the run's own features.
    for (const GroupedBasis::Group& G : grouped_->groups) {
      const uint32_t mg = uint32_t(G.comps.size());
      const uint32_t a0 = uint32_t(std::lower_bound(G.comps.begin(), G.comps.end(), j0) - G.comps.begin());
      const uint32_t a = std::min(mg, (a0 + 31) / 32 * 32), k = mg - a;
      outliers.clear();
      {
        StageTimer st(clk, kQuant);
        lead.resize(size_t(a) * n);
        for (uint32_t i = 0; i < a; ++i) {
          const int32_t* row = c + size_t(G.comps[i]) * n;
          for (uint32_t t = 0; t < n; ++t) lead[size_t(i) * n + t] = container::ecsq_value(row[t], step, offset);
        }
        codes_to_s8([&](uint32_t i) { return c + size_t(G.comps[a + i]) * n; }, k, n, ro, S.cm, S.a, outliers);
      }
      group_gemm(G, lead.data(), a, n, true, x, clk);  // the mean and the leading components
      if (k == 0) continue;
      StageTimer st(clk, kProject);
      const int8_t* q = G.s8.data() + size_t(a) * G.w;
      run_s8(n, G.w, k, S.a.data(), q, sc.data() + G.c0, x + G.c0, p);
      add_outliers(outliers, q, sc.data() + G.c0, G.w, x + G.c0, p);
    }
    return;
  }
  {
    StageTimer st(clk, kQuant);
    lead.resize(size_t(j0) * n);
    for (size_t i = 0; i < lead.size(); ++i) lead[i] = container::ecsq_value(c[i], step, offset);
    codes_to_s8([&](uint32_t i) { return c + size_t(j0 + i) * n; }, ru_ - j0, n, ro, S.cm, S.a, outliers);
  }
  decode_rows(lead.data(), n, j0, x, clk, true);  // the mean and the leading components
  if (j0 == ru_) return;
  StageTimer st(clk, kProject);
  const int8_t* q = basis_s8_->q.data() + size_t(j0) * p;
  run_s8(n, p, ru_ - j0, S.a.data(), q, sc.data(), x);
  add_outliers(outliers, q, sc.data(), p, x, p);
#else
  throw Error("Projector: int8 without oneDNN");
#endif
}

}  // namespace detail
}  // namespace kvtc
