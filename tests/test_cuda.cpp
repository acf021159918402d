// The GPU path against the CPU reference (issue 6).
//
// Host tests (run everywhere, no GPU): the planning code the GPU codec
// shares — chunk byte layout, segment tables and tiles, the header JSON,
// the parallel-checksum parser — checked against the CPU encoder's bytes.
// GPU tests (skip with a message when no device can run this build):
// each kernel family against its CPU twin on synthetic data (codes and
// parameters byte-identical given identical floats; RoPE within 1 f32 ulp;
// centring exact; GEMM within a stated bound), then whole containers both
// ways (GPU compress -> CPU decompress, CPU compress -> GPU decompress),
// exact payload equality where the float input is identical (a signed
// permutation basis makes the projection exact on both sides), batching,
// errors, and the device-side synthetic data and error metric.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <tuple>

#include "core/scalar.h"
#include "cuda/center.cuh"
#include "cuda/codec_impl.h"
#include "cuda/host_plan.h"
#include "cuda/project.cuh"
#include "cuda/quant.cuh"
#include "cuda/rope_gather.cuh"
#include "cuda/testing.h"
#include "format/ecsq.h"
#include "format/plan.h"
#include "format/quantizers.h"
#include "kvtc/cuda.h"
#include "kvtc/internal/lab_support.h"
#include "kvtc/kvtc.h"

using namespace kvtc;

namespace {

// ---------------------------------------------------------------- fixtures

// The rotation of the test caches: base 1e4 on 16-dim heads; the
// sliding-window block (block 1) uses scale 0.5; factors 1 + 0.25 i.
Rope rope_for(const std::string& layout, uint32_t n_rot, bool factors, bool swa) {
  Rope r;
  r.layout = layout == "neox" ? RopeLayout::kNeox : layout == "norm" ? RopeLayout::kNorm : RopeLayout::kNone;
  r.n_rot = r.layout == RopeLayout::kNone ? 0 : n_rot;
  r.freq_base = 10000.0f;
  r.freq_scale = swa ? 0.5f : 1.0f;
  if (factors && !swa)
    for (uint32_t i = 0; i < n_rot / 2; ++i) r.freq_factors.push_back(float(1.0 + 0.25 * i));
  return r;
}

// A block of n tokens with low-rank structure plus noise (so that a PCA
// basis compresses it), positions shuffled a little (cache-slot order).
KvBlock make_block(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t n, uint32_t seed, int32_t pos0 = 0) {
  KvBlock b;
  for (uint32_t l = 0; l < layers; ++l) b.layers.push_back(int32_t(l));
  b.n_head_kv = heads;
  b.head_dim = dim;
  for (uint32_t t = 0; t < n; ++t) b.pos.push_back(pos0 + int32_t(t));
  if (n > 8) std::swap(b.pos[3], b.pos[5]);
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const uint32_t p = layers * heads * dim, rank = 6;
  std::vector<float> dir(size_t(rank) * p);
  for (auto& x : dir) x = g(rng);
  b.k.resize(b.numel());
  b.v.resize(b.numel());
  for (int kv = 0; kv < 2; ++kv)
    for (uint32_t t = 0; t < n; ++t) {
      float z[rank];
      for (uint32_t j = 0; j < rank; ++j) z[j] = g(rng) * (3.0f / float(j + 1));
      for (uint32_t l = 0; l < layers; ++l)
        for (uint32_t h = 0; h < heads; ++h)
          for (uint32_t d = 0; d < dim; ++d) {
            const size_t f = (size_t(l) * heads + h) * dim + d;
            float x = 0.1f * g(rng) + (kv ? 0.5f : -0.25f);
            for (uint32_t j = 0; j < rank; ++j) x += z[j] * dir[j * p + f] * 0.5f;
            (kv ? b.v : b.k)[b.index(l, h, t, d)] = f32_to_f16(x);
          }
    }
  return b;
}

KvCapture make_capture(uint32_t n, const std::string& rope = "norm", uint32_t seed = 1, bool two_blocks = false, bool factors = false) {
  KvCapture c;
  c.model_sha256 = "test-model";
  c.blocks.push_back(make_block(2, 2, 16, n, seed));
  c.blocks.back().rope = rope_for(rope, 16, factors, false);
  if (two_blocks) {
    c.blocks.push_back(make_block(1, 2, 16, std::min<uint32_t>(n, 40), seed + 7, int32_t(n > 40 ? n - 40 : 0)));
    c.blocks.back().layers = {2};
    c.blocks.back().sliding_window = 40;
    c.blocks.back().rope = rope_for(rope, 16, factors, true);
  }
  for (uint32_t t = 0; t < n; ++t) c.tokens.push_back(int32_t(1000 + t));
  return c;
}

// Orthonormal basis (Gram-Schmidt on random rows) or a signed permutation
// (exact projection on any GEMM: one product per output).
Transform make_transform(uint32_t p, bool permutation, uint32_t seed) {
  Transform t;
  t.p = t.r = p;
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  t.mu.resize(p);
  for (auto& x : t.mu) x = 0.3f * g(rng);
  t.basis.assign(size_t(p) * p, 0.0f);
  if (permutation) {
    std::vector<uint32_t> perm(p);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (uint32_t i = 0; i < p; ++i) t.basis[size_t(i) * p + perm[i]] = (i % 3 == 1) ? -1.0f : 1.0f;
  } else {
    std::vector<double> q(size_t(p) * p);
    for (auto& x : q) x = g(rng);
    for (uint32_t i = 0; i < p; ++i) {
      for (uint32_t j = 0; j < i; ++j) {
        double d = 0;
        for (uint32_t f = 0; f < p; ++f) d += q[size_t(i) * p + f] * q[size_t(j) * p + f];
        for (uint32_t f = 0; f < p; ++f) q[size_t(i) * p + f] -= d * q[size_t(j) * p + f];
      }
      double nn = 0;
      for (uint32_t f = 0; f < p; ++f) nn += q[size_t(i) * p + f] * q[size_t(i) * p + f];
      for (uint32_t f = 0; f < p; ++f) q[size_t(i) * p + f] /= std::sqrt(nn);
    }
    for (size_t k = 0; k < q.size(); ++k) t.basis[k] = float(q[k]);
  }
  t.variance.assign(p, 1.0f);
  t.total_variance = p;
  return t;
}

Calibration make_calibration(const KvCapture& c, bool permutation) {
  Calibration cal;
  cal.geometry = c.geometry();
  cal.blocks.resize(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) cal.blocks[b][kv] = make_transform(c.blocks[b].features(), permutation, uint32_t(11 + b * 2 + kv));
  cal.id = calibration_compute_id(cal);
  return cal;
}

Allocation make_alloc(uint32_t p) {
  Allocation a;
  a.nominal_ratio = 4;
  // Every type, block sizes that do not divide the token counts, a dropped
  // run in the middle, and components past the last block dropped.
  const std::vector<BlockAlloc> all = {{0, 1, QType::kFp8},   {1, 3, QType::kFp8},    {4, 5, QType::kInt4},  {9, 7, QType::kInt2},
                                       {16, 4, QType::kNone}, {20, 12, QType::kInt4}, {32, 16, QType::kInt2}};
  for (const BlockAlloc& b : all)
    if (b.start + b.size <= p) a.blocks.push_back(b);
  return a;
}

AllocationSet make_alloc_set(const KvCapture& c) {
  AllocationSet s(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b) s[b] = {make_alloc(c.blocks[b].features()), make_alloc(c.blocks[b].features())};
  return s;
}

CompressOptions small_opts(int level) {
  CompressOptions o;
  o.sink = 4;
  o.window = 24;
  o.chunk_tokens = 32;
  o.deflate_level = level;
  o.threads = 2;
  o.precision = Precision::kF32;  // the reference the GPU is held to
  return o;
}

// The CPU decoder in f32: the reference the GPU is held to (auto would be
// bf16 on a host with AVX512-BF16 or AMX).
KvCapture cpu_decode(const std::vector<uint8_t>& bytes, const Calibration& cal, const std::string& origin) {
  DecompressOptions o;
  o.precision = Precision::kF32;
  return decompress(bytes, cal, origin, o);
}

// Section payloads of a container, keyed by (kind, block, kv, t0, t1).
std::map<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>, std::vector<uint8_t>> payloads(const std::vector<uint8_t>& bytes) {
  container::Parsed P = container::parse(bytes, "test");
  std::map<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>, std::vector<uint8_t>> m;
  for (const container::Section& s : P.sections) m[{s.kind, s.block, s.kv, s.t0, s.t1}] = container::payload(s, "test");
  return m;
}

uint32_t f32_ulps(float a, float b) {
  int32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  if ((x < 0) != (y < 0)) return (a == b) ? 0 : 0x7fffffff;
  return uint32_t(std::abs(int64_t(x) - int64_t(y)));
}
uint32_t f16_ulps(uint16_t a, uint16_t b) {
  if (a == b) return 0;
  if ((a ^ b) & 0x8000) return (((a | b) & 0x7fff) == 0) ? 0 : 0xffff;
  return uint32_t(std::abs(int(a & 0x7fff) - int(b & 0x7fff)));
}

#define REQUIRE_GPU()                     \
  do {                                    \
    std::string why_;                     \
    if (!cuda_available(&why_)) {         \
      GTEST_SKIP() << "no GPU: " << why_; \
    }                                     \
  } while (0)

template <typename T>
CudaBuffer to_device(const std::vector<T>& v) {
  CudaBuffer b(std::max<size_t>(v.size() * sizeof(T), 1));
  if (!v.empty()) {
    EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  return b;
}
template <typename T>
std::vector<T> to_host(const CudaBuffer& b, size_t n) {
  std::vector<T> v(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(v.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

// Coefficients with the awkward cases: ties, signed zeros, equal values
// in a block, subnormals, values near the fp8 saturation point.
std::vector<float> tricky_coefficients(uint32_t n, uint32_t r, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> d(size_t(n) * r);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < r; ++j) {
      float x = g(rng) * std::exp2(float(int(t % 13) - 6));
      switch ((t * 7 + j) % 23) {
        case 0: x = 0.0f; break;
        case 1: x = -0.0f; break;
        case 2: x = std::ldexp(1.0f, -140); break;  // f32 subnormal
        case 3: x = 448.0f * 1.03f; break;
        case 4: x = float(j % 4) * 0.25f; break;  // exact grid values (ties after scaling)
        default: break;
      }
      if (t % 17 == 5) x = 1.5f;  // a whole token of equal values: zero step
      d[size_t(t) * r + j] = x;
    }
  return d;
}

}  // namespace

// ================================================================ host tests

TEST(CudaHost, ChunkBytesSegmentsAndTilesMatchTheFormat) {
  const Allocation a = make_alloc(64);
  for (uint32_t n : {1u, 3u, 16u, 31u, 32u, 100u, 256u}) {
    std::vector<cuda::QSeg> segs;
    const size_t bytes = cuda::append_chunk_segments(a.blocks, 7, n, 1000, false, segs);
    EXPECT_EQ(bytes, container::packed_bytes(a, n));
    // Segments tile the chunk in allocation order, each params then codes.
    uint64_t off = 1000;
    for (const cuda::QSeg& s : segs) {
      EXPECT_EQ(s.off, off);
      EXPECT_EQ(s.row0, 7u);
      EXPECT_EQ(s.n, n);
      EXPECT_NE(s.rule, QRule::kZero);
      off += size_t(n) * 2 * s.n_params + (size_t(n) * s.size * s.code_bits + 7) / 8;
    }
    EXPECT_EQ(off, 1000 + bytes);
    std::vector<cuda::QSeg> with_none;
    cuda::append_chunk_segments(a.blocks, 0, n, 0, true, with_none);
    ASSERT_EQ(with_none.size(), a.blocks.size());
    // Each segment carries its block's quantizer row (format/quantizers.h).
    for (size_t i = 0; i < a.blocks.size(); ++i) {
      const container::Quantizer& q = container::quantizer(a.blocks[i].type);
      EXPECT_EQ(with_none[i].rule, q.rule);
      EXPECT_EQ(with_none[i].code_bits, q.code_bits);
      EXPECT_EQ(with_none[i].n_params, q.n_params);
    }
    // Encode tiles cover every code byte once; decode tiles every code once.
    std::vector<cuda::QTile> et, dt;
    cuda::append_encode_tiles(segs, 0, et);
    cuda::append_decode_tiles(with_none, 0, dt);
    std::map<uint32_t, size_t> enc_cover, dec_cover;
    for (const cuda::QTile& t : et) {
      const cuda::QSeg& s = segs[t.seg];
      const size_t code_bytes = (size_t(n) * s.size * s.code_bits + 7) / 8;
      enc_cover[t.seg] += std::min<size_t>(cuda::kEncTileBytes, code_bytes - t.begin);
    }
    for (size_t i = 0; i < segs.size(); ++i) EXPECT_EQ(enc_cover[uint32_t(i)], (size_t(n) * segs[i].size * segs[i].code_bits + 7) / 8);
    for (const cuda::QTile& t : dt) dec_cover[t.seg] += std::min<size_t>(cuda::kDecTileCodes, size_t(n) * with_none[t.seg].size - t.begin);
    for (size_t i = 0; i < with_none.size(); ++i) EXPECT_EQ(dec_cover[uint32_t(i)], size_t(n) * with_none[i].size);
  }
}

TEST(CudaHost, ChunkTokensFittingNvcompLimit) {
  // SmolLM2's 16x allocation of the 160K calibration: 5,744 bits per token.
  Allocation a;
  a.blocks = {{0, 16, QType::kFp8},    {16, 16, QType::kInt4},  {32, 16, QType::kInt4},   {48, 16, QType::kInt4},   {64, 64, QType::kInt4},
              {128, 64, QType::kInt4}, {192, 64, QType::kInt4}, {256, 256, QType::kInt4}, {512, 256, QType::kInt4}, {768, 256, QType::kInt4}};
  for (uint32_t s = 1024; s < 1536; s += 64) a.blocks.push_back({s, 64, QType::kInt2});
  AllocationSet set{{a, a}};
  const uint32_t n = cuda::chunk_tokens_fitting(set, 256, cuda::kNvcompMaxChunkBytes);
  EXPECT_EQ(n % 16, 0u);
  EXPECT_LE(container::packed_bytes(a, n), cuda::kNvcompMaxChunkBytes);
  EXPECT_GT(container::packed_bytes(a, n + 16), cuda::kNvcompMaxChunkBytes);
  EXPECT_EQ(n, 80u);                                                                // 718 bytes per token
  EXPECT_EQ(cuda::chunk_tokens_fitting(set, 64, cuda::kNvcompMaxChunkBytes), 64u);  // the caller's limit wins
  Allocation big;
  big.blocks = {{0, 5000, QType::kFp8}};
  EXPECT_EQ(cuda::chunk_tokens_fitting(AllocationSet{{big, big}}, 256, cuda::kNvcompMaxChunkBytes), 0u);
}

TEST(CudaHost, ReferencePackerEqualsTheCpuEncoder) {
  // Stored sections (level 0): the CPU container's chunk payloads are the
  // packed planes themselves. With a signed permutation basis the
  // coefficients are the centred (de-RoPEd) features, computed here with
  // the CPU's gather.
  for (const std::string rope : {"norm", "neox"}) {
    const KvCapture c = make_capture(150, rope, 3);
    const Calibration cal = make_calibration(c, true);
    const AllocationSet al = make_alloc_set(c);
    const CompressOptions o = small_opts(0);
    const auto pl = payloads(compress(c, cal, al, o));
    const KvBlock& kb = c.blocks[0];
    size_t chunks = 0;
    for (const auto& [key, bytes] : pl) {
      auto [kind, b, kv, t0, t1] = key;
      if (kind != container::kChunk) continue;
      const Transform& T = cal.blocks[b][kv];
      const uint32_t n = t1 - t0;
      std::vector<float> x = feature_rows(kb, kv == 0, true, t0, t1), d(size_t(n) * T.r);
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t f = 0; f < T.p; ++f) x[size_t(t) * T.p + f] -= T.mu[f];
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t j = 0; j < T.r; ++j) {
          float s = 0;
          for (uint32_t f = 0; f < T.p; ++f)
            if (T.basis[size_t(j) * T.p + f] != 0.0f) s = 0.0f + x[size_t(t) * T.p + f] * T.basis[size_t(j) * T.p + f];  // +0 as a GEMM sums
          d[size_t(t) * T.r + j] = s;
        }
      EXPECT_EQ(container::pack_chunk(d.data(), n, T.r, al[b][kv].blocks), bytes) << rope << " chunk " << t0 << ".." << t1 << " kv " << kv;
      ++chunks;
    }
    EXPECT_EQ(chunks, 2u * 4u);  // tokens 4..126 in chunks of 32, K and V
  }
}

TEST(CudaHost, TheSharedContainerCodeReadsWhatItWrites) {
  // The GPU encoder writes its headers with container::put_file_header /
  // put_section_header and plans its sections with plan_sections, the CPU
  // encoder's own functions; the GPU decoder plans with plan_decode. Check
  // those against a CPU container byte for byte.
  const KvCapture c = make_capture(130, "neox", 5, true, true);
  const Calibration cal = make_calibration(c, false);
  const AllocationSet al = make_alloc_set(c);
  const CompressOptions o = small_opts(6);
  const std::vector<uint8_t> bytes = compress(c, cal, al, o);
  const container::Parsed P = container::parse(bytes, "test", 2);
  EXPECT_EQ(container::header_json(c, cal, al, o), P.header_json);
  std::vector<uint8_t> hdr(container::kFileHeaderBytes + P.header_json.size());
  container::put_file_header(hdr.data(), P.header_json);
  EXPECT_TRUE(std::equal(hdr.begin(), hdr.end(), bytes.begin()));
  const std::vector<container::SectionPlan> plan = container::plan_sections(c, o, 0, 0);
  ASSERT_EQ(plan.size(), P.sections.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    const container::Section& s = P.sections[i];
    EXPECT_EQ(std::tie(plan[i].kind, plan[i].block, plan[i].kv, plan[i].t0, plan[i].t1), std::tie(s.kind, s.block, s.kv, s.t0, s.t1)) << i;
    uint8_t sh[container::kSectionHeaderBytes];
    container::put_section_header(sh, s.kind, s.block, s.kv, s.t0, s.t1, s.raw_len, s.stored_len, s.xxh);
    EXPECT_TRUE(std::equal(sh, sh + sizeof sh, s.data - container::kSectionHeaderBytes)) << i;
  }
  // The decode plan: positions, tokens, geometry and K/V sections as the CPU sees them.
  const container::DecodePlan D = container::plan_decode(P, cal, "test");
  ASSERT_EQ(D.host.blocks.size(), 2u);
  EXPECT_EQ(D.host.blocks[0].pos, c.blocks[0].pos);
  EXPECT_EQ(D.host.blocks[1].pos, c.blocks[1].pos);
  EXPECT_EQ(D.host.tokens, c.tokens);
  EXPECT_EQ(D.host.blocks[0].rope, c.blocks[0].rope);
  EXPECT_EQ(D.host.blocks[1].rope, c.blocks[1].rope);
  size_t kv_secs = 0;
  for (const auto& s : P.sections) kv_secs += s.kind == container::kRaw || s.kind == container::kChunk;
  EXPECT_EQ(D.kv_sections.size(), kv_secs);
  // Corruption and a wrong calibration are refused.
  std::vector<uint8_t> bad = bytes;
  bad[bad.size() - 3] ^= 0x40;
  try {
    container::plan_decode(container::parse(bad, "bad.kvtc", 2), cal, "bad.kvtc");
    FAIL() << "corruption not detected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
  }
  Calibration other = cal;
  other.id = "0000";
  EXPECT_THROW(container::plan_decode(P, other, "x"), Error);
}

TEST(CudaHost, EntropyCodedChunksDecodeIntoTheJobPlane) {
  // The GPU decoder's entropy-coded path (issue 32 item 6): the host threads
  // rANS-decode each chunk with the CPU's decoder into its job's
  // component-major plane [ru][ld] at its rows; the device then projects.
  // Checked here against ecsq_decode_chunk itself, in f32 (exact) and in
  // the 16-bit GEMM types (rounded to nearest even).
  const KvCapture c = make_capture(203, "norm", 71);
  const Calibration cal = make_calibration(c, false);
  const AllocationSet al = ecsq_allocation_set(cal, 6);
  const std::vector<uint8_t> bytes = compress(c, cal, al, small_opts(0));
  const container::Parsed P = container::parse(bytes, "t.kvtc", 2);
  const container::DecodePlan D = container::plan_decode(P, cal, "t.kvtc");
  ASSERT_EQ(container::container_version(D.H.alloc), 4u);
  const container::EcsqLayout lay = container::ecsq_layout(D.H.version);
  ASSERT_EQ(lay, container::EcsqLayout::kLanes32);
  for (uint32_t kv = 0; kv < 2; ++kv) {
    std::vector<const container::Section*> chunks;
    for (const container::Section& s : D.kv_sections)
      if (s.kind == container::kChunk && s.kv == kv) chunks.push_back(&s);
    ASSERT_GE(chunks.size(), 3u);  // 203 - 4 sink - 24 window tokens in 32-token chunks
    std::sort(chunks.begin(), chunks.end(), [](auto* a, auto* b) { return a->t0 < b->t0; });
    const uint32_t ru = D.r_used[0][kv];
    ASSERT_GT(ru, 0u);
    uint32_t rows = 0;
    for (auto* s : chunks) rows += s->t1 - s->t0;
    const size_t ld = cuda::round_up(rows, 16);
    std::vector<float> plane(ru * ld, -7.0f), scratch;
    std::vector<uint16_t> bf(ru * ld, 0xdead), hf(ru * ld, 0xdead);
    uint32_t row0 = 0;
    std::vector<std::vector<float>> ref;
    for (auto* s : chunks) {
      const std::vector<uint8_t> pl = container::payload(*s, "t.kvtc");
      const uint32_t n = s->t1 - s->t0;
      cuda::ecsq_chunk_to_plane(pl.data(), pl.size(), lay, row0, n, ru, plane.data(), ld, cuda::ElemType::kF32, "t", scratch);
      cuda::ecsq_chunk_to_plane(pl.data(), pl.size(), lay, row0, n, ru, bf.data(), ld, cuda::ElemType::kBf16, "t", scratch);
      cuda::ecsq_chunk_to_plane(pl.data(), pl.size(), lay, row0, n, ru, hf.data(), ld, cuda::ElemType::kF16, "t", scratch);
      std::vector<float> d(size_t(n) * ru);
      container::ecsq_decode_chunk(pl.data(), pl.size(), n, ru, lay, d.data(), "t", false);  // token-major d[t * ru + j]
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t j = 0; j < ru; ++j) {
          const float x = d[size_t(t) * ru + j];
          const size_t at = size_t(j) * ld + row0 + t;
          ASSERT_EQ(plane[at], x) << "component " << j << " row " << row0 + t;
          ASSERT_EQ(bf[at], cuda::f32_to_bf16(x));
          ASSERT_EQ(hf[at], f32_to_f16(x));
          if (x != 0.0f) {
            ASSERT_NEAR(f16_to_f32(hf[at]), x, std::abs(x) * 0x1p-11f + 0x1p-24f);
          }
        }
      row0 += n;
    }
    // Rows past the job's are the plane's padding: left as they were.
    for (uint32_t j = 0; j < ru; ++j)
      for (size_t r = rows; r < ld; ++r) ASSERT_EQ(plane[j * ld + r], -7.0f);
    // A damaged stream is an Error naming the chunk (the CPU decoder's checks).
    std::vector<uint8_t> pl = container::payload(*chunks[1], "t.kvtc");
    pl.resize(container::ecsq_fixed_bytes(ru, lay) - 1);
    try {
      cuda::ecsq_chunk_to_plane(pl.data(), pl.size(), lay, 0, chunks[1]->t1 - chunks[1]->t0, ru, plane.data(), ld, cuda::ElemType::kF32,
                                "t.kvtc: chunk section (block 0 K, tokens 36..68)", scratch);
      FAIL() << "a truncated entropy-coded chunk was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("t.kvtc: chunk section"), std::string::npos) << e.what();
    }
  }
  // bf16 rounding: nearest, ties to even, NaN quiet, overflow to inf.
  EXPECT_EQ(cuda::f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(cuda::f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // tie, even stays
  EXPECT_EQ(cuda::f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(cuda::f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(cuda::f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(cuda::f32_to_bf16(3.4e38f), 0x7f80);
  EXPECT_EQ(cuda::f32_to_bf16(std::nanf("")) & 0x7fc0, 0x7fc0);
}

TEST(CudaHost, AvailabilityAndPrecisionModes) {
  std::string why;
  const bool ok = cuda_available(&why);
  if (!ok) {
    EXPECT_FALSE(why.empty());
  }
  EXPECT_FALSE(cuda_describe().empty());
  // Every Precision maps to a cuBLAS mode; auto is f32 (the CPU's reference).
  EXPECT_EQ(cuda::gemm_mode(Precision::kAuto).precision, Precision::kF32);
  EXPECT_EQ(cuda::gemm_mode(Precision::kBF16).et, cuda::ElemType::kBf16);
  EXPECT_TRUE(cuda::gemm_mode(Precision::kTF32).tf32);
  EXPECT_EQ(cuda::gemm_mode(Precision::kF16).et, cuda::ElemType::kF16);
  // The CPU refuses the GPU-only modes by name.
  const KvCapture c = make_capture(64);
  const Calibration cal = make_calibration(c, false);
  CompressOptions o = small_opts(6);
  o.precision = Precision::kTF32;
  try {
    compress(c, cal, make_alloc_set(c), o);
    FAIL() << "tf32 accepted on the CPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPU mode"), std::string::npos) << e.what();
  }
}

// ================================================================ GPU: kernels

TEST(CudaKernels, QuantizeAndPackByteIdentical) {
  REQUIRE_GPU();
  const uint32_t r = 48;
  const Allocation a = make_alloc(r);
  for (uint32_t n : {1u, 13u, 100u, 256u}) {
    // Two chunks of one job: rows [0, n) and [n, n + 37).
    const uint32_t n2 = 37, rows = n + n2;
    const std::vector<float> d = tricky_coefficients(rows, r, n);  // token-major [rows][r]
    const size_t ld = cuda::round_up(rows, 16);
    std::vector<float> dt(size_t(r) * ld, 0.0f);
    for (uint32_t t = 0; t < rows; ++t)
      for (uint32_t j = 0; j < r; ++j) dt[size_t(j) * ld + t] = d[size_t(t) * r + j];
    std::vector<cuda::QSeg> segs;
    const size_t b1 = cuda::append_chunk_segments(a.blocks, 0, n, 0, false, segs);
    const size_t off2 = cuda::round_up(b1, 16);
    const size_t b2 = cuda::append_chunk_segments(a.blocks, n, n2, off2, false, segs);
    std::vector<cuda::QTile> tiles;
    cuda::append_encode_tiles(segs, 0, tiles);
    CudaBuffer d_dt = to_device(dt), d_segs = to_device(segs), d_tiles = to_device(tiles);
    CudaBuffer d_out(off2 + b2);
    ASSERT_EQ(cudaMemset(d_out.get(), 0xAB, off2 + b2), cudaSuccess);
    cuda::launch_quant_params(static_cast<float*>(d_dt.get()), ld, static_cast<cuda::QSeg*>(d_segs.get()), uint32_t(segs.size()),
                              static_cast<uint8_t*>(d_out.get()), nullptr);
    cuda::launch_quant_codes(static_cast<float*>(d_dt.get()), ld, static_cast<cuda::QSeg*>(d_segs.get()), static_cast<cuda::QTile*>(d_tiles.get()),
                             uint32_t(tiles.size()), static_cast<uint8_t*>(d_out.get()), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> got = to_host<uint8_t>(d_out, off2 + b2);
    const std::vector<uint8_t> want1 = container::pack_chunk(d.data(), n, r, a.blocks);
    const std::vector<uint8_t> want2 = container::pack_chunk(d.data() + size_t(n) * r, n2, r, a.blocks);
    EXPECT_TRUE(std::equal(want1.begin(), want1.end(), got.begin())) << "chunk 1, n=" << n;
    EXPECT_TRUE(std::equal(want2.begin(), want2.end(), got.begin() + off2)) << "chunk 2, n=" << n;

    // Unpack + dequantize: bit-identical to dequantize_block.
    std::vector<cuda::QSeg> dsegs;
    cuda::append_chunk_segments(a.blocks, 0, n, 0, true, dsegs);
    cuda::append_chunk_segments(a.blocks, n, n2, off2, true, dsegs);
    std::vector<cuda::QTile> dtiles;
    cuda::append_decode_tiles(dsegs, 0, dtiles);
    CudaBuffer d_dsegs = to_device(dsegs), d_dtiles = to_device(dtiles);
    CudaBuffer d_back(size_t(r) * ld * 4);
    ASSERT_EQ(cudaMemset(d_back.get(), 0x7F, size_t(r) * ld * 4), cudaSuccess);
    cuda::launch_unpack(static_cast<uint8_t*>(d_out.get()), static_cast<cuda::QSeg*>(d_dsegs.get()), static_cast<cuda::QTile*>(d_dtiles.get()),
                        uint32_t(dtiles.size()), d_back.get(), ld, cuda::ElemType::kF32, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> back = to_host<float>(d_back, size_t(r) * ld);
    const uint32_t ru = container::r_used(a.blocks);
    size_t mismatches = 0;
    for (uint32_t t = 0; t < rows; ++t)
      for (const BlockAlloc& blk : a.blocks) {
        uint8_t codes[64];
        uint16_t p[2];
        float want[64];
        container::quantize_block(blk.type, &d[size_t(t) * r + blk.start], blk.size, codes, p);
        container::dequantize_block(blk.type, codes, blk.size, p, want);
        for (uint32_t i = 0; i < blk.size; ++i) {
          const float g = back[size_t(blk.start + i) * ld + t];
          if (std::memcmp(&g, &want[i], 4) != 0) ++mismatches;
        }
      }
    EXPECT_EQ(mismatches, 0u) << "n=" << n << " (r_used " << ru << ")";
  }
}

TEST(CudaKernels, GatherDeRopeAndScatterReRopeMatchTheCpu) {
  REQUIRE_GPU();
  for (const std::string rope : {"norm", "neox"})
    for (bool factors : {false, true}) {
      KvCapture c = make_capture(300, rope, 9, false, factors);
      KvBlock& kb = c.blocks[0];
      for (uint32_t t = 0; t < kb.n_tokens(); ++t) kb.pos[t] = int32_t(t * 37 + 5);  // long-range positions
      const Rope& rp = kb.rope;
      const uint32_t p = kb.features(), t0 = 7, t1 = 290, n = t1 - t0, lh = kb.n_layer() * kb.n_head_kv;
      std::vector<float> mu(p);
      for (uint32_t f = 0; f < p; ++f) mu[f] = 0.01f * float(f % 17) - 0.05f;
      // CPU: gather (de-RoPE), centre.
      std::vector<float> want = feature_rows(kb, true, true, t0, t1);
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t f = 0; f < p; ++f) want[size_t(t) * p + f] -= mu[f];
      // GPU.
      CudaBuffer d_k = to_device(kb.k), d_mu = to_device(mu), d_x(size_t(n) * p * 4);
      std::vector<int32_t> pos(kb.pos.begin() + t0, kb.pos.begin() + t1);
      CudaBuffer d_pos = to_device(pos), d_c(size_t(n) * 8 * 8), d_s(size_t(n) * 8 * 8), d_ff = to_device(rp.freq_factors);
      const cuda::RopeDev rd = cuda::rope_dev(rp, kb.head_dim, static_cast<float*>(d_ff.get()));
      EXPECT_EQ(rd.layout, rope == "norm" ? 1 : 2);
      cuda::launch_rope_table(static_cast<int32_t*>(d_pos.get()), n, rd, true, static_cast<double*>(d_c.get()), static_cast<double*>(d_s.get()),
                              nullptr);
      cuda::launch_gather(static_cast<uint16_t*>(d_k.get()), lh, kb.n_tokens(), kb.head_dim, t0, n, static_cast<double*>(d_c.get()),
                          static_cast<double*>(d_s.get()), rd, static_cast<float*>(d_mu.get()), d_x.get(), cuda::ElemType::kF32, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = to_host<float>(d_x, size_t(n) * p);
      uint32_t worst = 0;
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const uint32_t u = f32_ulps(got[i], want[i]);
        worst = std::max(worst, u);
        differ += u != 0;
      }
      EXPECT_LE(worst, 1u) << rope << (factors ? " with factors" : "");
      EXPECT_LE(differ, got.size() / 1000) << rope;

      // Scatter: rows (centred back) -> re-RoPE -> f16 at the same tokens.
      std::vector<float> rows = want;
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t f = 0; f < p; ++f) rows[size_t(t) * p + f] += mu[f];
      KvBlock cpu = kb;
      set_feature_rows(cpu, true, true, t0, t1, rows);
      std::vector<int32_t> row_tok(n);
      for (uint32_t t = 0; t < n; ++t) row_tok[t] = int32_t(t0 + t);
      // The GPU gets the centred rows and adds mu itself (fused, as in decoding).
      CudaBuffer d_rows = to_device(want), d_tok = to_device(row_tok), d_out = to_device(kb.k);
      cuda::launch_rope_table(static_cast<int32_t*>(d_pos.get()), n, rd, false, static_cast<double*>(d_c.get()), static_cast<double*>(d_s.get()),
                              nullptr);
      cuda::launch_scatter(static_cast<float*>(d_rows.get()), static_cast<float*>(d_mu.get()), n, static_cast<int32_t*>(d_tok.get()),
                           static_cast<double*>(d_c.get()), static_cast<double*>(d_s.get()), rd, static_cast<uint16_t*>(d_out.get()), lh,
                           kb.n_tokens(), kb.head_dim, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint16_t> gk = to_host<uint16_t>(d_out, kb.numel());
      uint32_t worst16 = 0;
      size_t differ16 = 0;
      for (size_t i = 0; i < gk.size(); ++i) {
        const uint32_t u = f16_ulps(gk[i], cpu.k[i]);
        worst16 = std::max(worst16, u);
        differ16 += u != 0;
      }
      EXPECT_LE(worst16, 1u) << rope;
      EXPECT_LE(differ16, gk.size() / 1000) << rope;
    }
}

TEST(CudaKernels, ValuesGatherAndCentringAreExact) {
  REQUIRE_GPU();
  const KvCapture c = make_capture(64, "norm", 4);
  const KvBlock& kb = c.blocks[0];
  const uint32_t p = kb.features(), n = 64, lh = kb.n_layer() * kb.n_head_kv;
  const std::vector<float> want = feature_rows(kb, false, false, 0, n);
  std::vector<float> mu(p, 0.0f);
  for (uint32_t f = 0; f < p; ++f) mu[f] = std::sin(float(f)) * 0.7f;
  CudaBuffer d_v = to_device(kb.v), d_x(size_t(n) * p * 4), d_mu = to_device(mu);
  cuda::launch_gather(static_cast<uint16_t*>(d_v.get()), lh, n, kb.head_dim, 0, n, nullptr, nullptr, cuda::RopeDev{}, nullptr, d_x.get(),
                      cuda::ElemType::kF32, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host<float>(d_x, want.size()), want);
  cuda::launch_center_sub(static_cast<float*>(d_x.get()), static_cast<float*>(d_mu.get()), n, p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> sub = want;
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t f = 0; f < p; ++f) sub[size_t(t) * p + f] -= mu[f];
  EXPECT_EQ(to_host<float>(d_x, want.size()), sub);
  cuda::launch_center_add(static_cast<float*>(d_x.get()), static_cast<float*>(d_mu.get()), n, p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> add = sub;
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t f = 0; f < p; ++f) add[size_t(t) * p + f] += mu[f];
  EXPECT_EQ(to_host<float>(d_x, want.size()), add);
  cuda::launch_center_fill(static_cast<float*>(d_x.get()), static_cast<float*>(d_mu.get()), n, p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> filled = to_host<float>(d_x, want.size());
  for (uint32_t t = 0; t < n; ++t) EXPECT_TRUE(std::equal(mu.begin(), mu.end(), filled.begin() + size_t(t) * p));
}

TEST(CudaKernels, ProjectionWithinBound) {
  REQUIRE_GPU();
  // Encode GEMM D = X B^T against a double reference. Bound for f32: the
  // error of an f32 dot product of length p, |err| <= p * eps * sum|x||b|
  // (we check 4e-6 of the row norm, ~30x what summation order costs);
  // tf32/bf16/f16 round inputs to 10/7/10 mantissa bits: reported, bounded
  // loosely.
  const uint32_t n = 200, p = 320, ru = 96;
  const Transform T = make_transform(p, false, 3);
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * p);
  for (auto& v : x) v = g(rng);
  std::vector<double> ref(size_t(n) * ru);
  std::vector<double> row_norm(n);
  for (uint32_t t = 0; t < n; ++t) {
    double nn = 0;
    for (uint32_t f = 0; f < p; ++f) nn += double(x[size_t(t) * p + f]) * x[size_t(t) * p + f];
    row_norm[t] = std::sqrt(nn);
    for (uint32_t j = 0; j < ru; ++j) {
      double s = 0;
      for (uint32_t f = 0; f < p; ++f) s += double(x[size_t(t) * p + f]) * T.basis[size_t(j) * p + f];
      ref[size_t(t) * ru + j] = s;
    }
  }
  cuda::Projector pr;
  const size_t ldd = cuda::round_up(n, 16);
  CudaBuffer d_x = to_device(x), d_b = to_device(T.basis), d_dt(size_t(ru) * ldd * 4);
  CudaBuffer d_xh(x.size() * 2), d_bh(T.basis.size() * 2);
  for (auto [mode, bound] : std::vector<std::pair<Precision, double>>{
           {Precision::kF32, 4e-6}, {Precision::kTF32, 4e-3}, {Precision::kBF16, 3e-2}, {Precision::kF16, 4e-3}}) {
    const cuda::ElemType et = cuda::gemm_mode(mode).et;
    const void* xp = d_x.get();
    const void* bp = d_b.get();
    if (et != cuda::ElemType::kF32) {
      cuda::launch_convert(static_cast<float*>(d_x.get()), d_xh.get(), et, x.size(), nullptr);
      cuda::launch_convert(static_cast<float*>(d_b.get()), d_bh.get(), et, T.basis.size(), nullptr);
      xp = d_xh.get();
      bp = d_bh.get();
    }
    pr.encode(xp, et, cuda::gemm_mode(mode).tf32, bp, n, p, ru, static_cast<float*>(d_dt.get()), ldd);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> dt = to_host<float>(d_dt, size_t(ru) * ldd);
    double worst = 0;
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t j = 0; j < ru; ++j) worst = std::max(worst, std::fabs(dt[size_t(j) * ldd + t] - ref[size_t(t) * ru + j]) / row_norm[t]);
    EXPECT_LE(worst, bound) << precision_name(mode);
    std::printf("[ projection %-4s ] max |D - D_ref| / |x| = %.3g\n", precision_name(mode), worst);
  }
}

// ================================================================ GPU: containers

namespace {

void expect_close_f16(const KvCapture& a, const KvCapture& b, const char* what, uint32_t max_ulps) {
  ASSERT_EQ(a.blocks.size(), b.blocks.size());
  for (size_t bl = 0; bl < a.blocks.size(); ++bl) {
    EXPECT_EQ(a.blocks[bl].pos, b.blocks[bl].pos);
    for (int kv = 0; kv < 2; ++kv) {
      const auto& x = kv ? a.blocks[bl].v : a.blocks[bl].k;
      const auto& y = kv ? b.blocks[bl].v : b.blocks[bl].k;
      ASSERT_EQ(x.size(), y.size());
      uint32_t worst = 0;
      for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, f16_ulps(x[i], y[i]));
      EXPECT_LE(worst, max_ulps) << what << " block " << bl << (kv ? " V" : " K");
    }
  }
  EXPECT_EQ(a.tokens, b.tokens);
}

}  // namespace

TEST(CudaCodecTest, ExactPayloadsWithAPermutationBasis) {
  REQUIRE_GPU();
  // Identical float input on both sides (signed permutation basis: the
  // GEMM is exact), so every chunk payload must be byte-identical to the
  // CPU encoder's, and the decoders must agree exactly (RoPE: <= 1 ulp).
  for (const std::string rope : {"norm", "neox"}) {
    const KvCapture c = make_capture(203, rope, 21, true);
    const Calibration cal = make_calibration(c, true);
    const AllocationSet al = make_alloc_set(c);
    CompressOptions o = small_opts(0);
    const std::vector<uint8_t> cpu = compress(c, cal, al, o);
    const std::vector<uint8_t> gpu = compress_cuda(c, cal, al, o);
    EXPECT_EQ(gpu, cpu) << rope << ": stored containers must be byte-identical";
    o.deflate_level = 6;
    const std::vector<uint8_t> cpu6 = compress(c, cal, al, o);
    const std::vector<uint8_t> gpu6 = compress_cuda(c, cal, al, o);
    const auto pc = payloads(cpu6), pg = payloads(gpu6);
    // nvCOMP may lower chunk_tokens; compare payloads where the ranges agree,
    // and require every GPU chunk to equal the CPU reference packing.
    size_t same = 0;
    for (const auto& [k, v] : pg) {
      auto it = pc.find(k);
      if (it != pc.end()) {
        EXPECT_EQ(v, it->second) << rope << " section kind " << std::get<0>(k) << " tokens " << std::get<3>(k);
        ++same;
      }
    }
    EXPECT_GT(same, 4u);
    const KvCapture a = cpu_decode(gpu6, cal, "gpu6");
    const KvCapture b = decompress_cuda(gpu6, cal, "gpu6");
    const KvCapture d = decompress_cuda(cpu6, cal, "cpu6");
    const KvCapture e = cpu_decode(cpu6, cal, "cpu6");
    expect_close_f16(a, b, "GPU container: CPU vs GPU decode", 1);
    expect_close_f16(e, d, "CPU container: CPU vs GPU decode", 1);
    expect_close_f16(a, e, "GPU vs CPU container, CPU decode", 1);
  }
}

TEST(CudaCodecTest, RoundTripsBothWaysWithADenseBasis) {
  REQUIRE_GPU();
  const KvCapture c = make_capture(331, "norm", 33, true, true);
  const Calibration cal = make_calibration(c, false);
  const AllocationSet al = make_alloc_set(c);
  const CompressOptions o = small_opts(6);
  const std::vector<uint8_t> cpu = compress(c, cal, al, o);
  const ContainerInfo ci_cpu = inspect(cpu, "cpu");
  for (Precision g : {Precision::kF32, Precision::kTF32, Precision::kBF16}) {
    CompressOptions og = o;
    og.precision = g;
    CodecStats st;
    og.stats = &st;
    const std::vector<uint8_t> gpu = compress_cuda(c, cal, al, og);
    EXPECT_EQ(st.projection, g);  // the GPU honours the precision asked for
    EXPECT_GT(st.total_ms, 0.0);
    const ContainerInfo ci = inspect(gpu, "gpu");  // checksums and layout
    EXPECT_EQ(ci.n_tokens, ci_cpu.n_tokens);
    const KvCapture by_cpu = cpu_decode(gpu, cal, "gpu");  // GPU -> CPU
    const KvCapture ref = cpu_decode(cpu, cal, "cpu");
    const ReconError ec = reconstruction_error(c, ref, o.sink, o.window), eg = reconstruction_error(c, by_cpu, o.sink, o.window);
    std::printf("[ %-4s ] rel. error K %.4g V %.4g (CPU: K %.4g V %.4g); size %zu (CPU %zu)\n", precision_name(g), eg.k, eg.v, ec.k, ec.v, gpu.size(),
                cpu.size());
    const double tol = g == Precision::kF32 ? 0.02 : g == Precision::kTF32 ? 0.05 : 0.25;
    EXPECT_NEAR(eg.k, ec.k, tol * ec.k + 1e-7) << precision_name(g);
    EXPECT_NEAR(eg.v, ec.v, tol * ec.v + 1e-7) << precision_name(g);
    DecompressOptions dg;
    dg.precision = g;
    const KvCapture by_gpu = decompress_cuda(cpu, cal, "cpu", dg);  // CPU -> GPU
    const ReconError e2 = reconstruction_error(c, by_gpu, o.sink, o.window);
    EXPECT_NEAR(e2.k, ec.k, tol * ec.k + 1e-7);
    EXPECT_NEAR(e2.v, ec.v, tol * ec.v + 1e-7);
    if (g == Precision::kF32) {
      // Same container, two decoders: only GEMM summation order and RoPE ulps differ.
      expect_close_f16(ref, by_gpu, "CPU container decoded on CPU and GPU", 4);
    }
  }
}

TEST(CudaCodecTest, BatchEqualsSingleAndAppendWorks) {
  REQUIRE_GPU();
  const KvCapture a = make_capture(180, "norm", 41), b = make_capture(77, "norm", 42), c = make_capture(20, "norm", 43);
  const Calibration cal = make_calibration(a, false);
  const AllocationSet al = make_alloc_set(a);
  const CompressOptions o = small_opts(6);
  CudaCodec codec(cal);
  CudaKvCapture da = cuda_upload(a), db = cuda_upload(b), dc = cuda_upload(c);
  std::vector<std::vector<uint8_t>> batch, single;
  CodecStats t;
  CompressOptions ot = o;
  ot.stats = &t;
  codec.compress({&da, &db, &dc}, al, ot, batch);
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_GT(t.total_ms, 0.0);
  EXPECT_FALSE(t.entropy_backend.empty());
  const CudaKvCapture* each[3] = {&da, &db, &dc};
  for (int i = 0; i < 3; ++i) {
    codec.compress({each[i]}, al, o, single);
    EXPECT_EQ(single[0], batch[i]) << i;
  }
  // Batched decode equals CPU decode of each.
  DecompressOptions dt;
  dt.stats = &t;
  std::vector<CudaKvCapture> back = codec.decompress({batch[0], batch[1], batch[2]}, "batch", dt);
  EXPECT_GT(t.total_ms, 0.0);
  const KvCapture* orig[3] = {&a, &b, &c};
  for (int i = 0; i < 3; ++i) {
    const KvCapture cpu = cpu_decode(batch[i], cal, "b");
    expect_close_f16(cpu, cuda_download(back[i]), "batched decode", 4);
    EXPECT_EQ(cpu.tokens, orig[i]->tokens);
  }
  // A GPU container is appendable by the CPU (windows are the last sections).
  KvCapture grown = make_capture(180 + 32, "norm", 41);
  for (int kv = 0; kv < 2; ++kv)  // same first 180 tokens
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t h = 0; h < 2; ++h)
        for (uint32_t t = 0; t < 180; ++t)
          for (uint32_t d = 0; d < 16; ++d)
            (kv ? grown.blocks[0].v : grown.blocks[0].k)[grown.blocks[0].index(l, h, t, d)] =
                (kv ? a.blocks[0].v : a.blocks[0].k)[a.blocks[0].index(l, h, t, d)];
  const AppendResult ar = append(batch[0], grown, cal, "gpu.kvtc");
  EXPECT_GT(ar.kept_bytes, 0u);
  EXPECT_EQ(cpu_decode(ar.bytes, cal, "appended").blocks[0].n_tokens(), 212u);
}

TEST(CudaCodecTest, EntropyCodedContainersDecode) {
  REQUIRE_GPU();
  // Container versions 2 and 3 (the CPU's default since issue 32, and the
  // 8-bit window) decode on the GPU: the host rANS-decodes, the device projects. Same container, two
  // decoders: in f32 only GEMM summation order and RoPE ulps differ; the
  // 16-bit modes within the DP's tolerances. Encoding stays CPU-only.
  const KvCapture c = make_capture(331, "neox", 81, true, true);
  const Calibration cal = make_calibration(c, false);
  const AllocationSet al = ecsq_allocation_set(cal, 6);
  const CompressOptions o = small_opts(0);
  const std::vector<uint8_t> bytes = compress(c, cal, al, o);
  ASSERT_EQ(container::parse(bytes, "v2", 2).version, 2u) << "expected a version-2 container";
  const KvCapture ref = cpu_decode(bytes, cal, "cpu");
  const ReconError ec = reconstruction_error(c, ref, o.sink, o.window);
  for (Precision g : {Precision::kF32, Precision::kTF32, Precision::kBF16, Precision::kF16}) {
    DecompressOptions dg;
    dg.precision = g;
    CodecStats st;
    dg.stats = &st;
    const KvCapture back = decompress_cuda(bytes, cal, "v2.kvtc", dg);
    EXPECT_EQ(st.entropy_backend, "rans-host") << precision_name(g);
    EXPECT_GT(st.entropy_ms, 0.0) << precision_name(g);
    const ReconError e = reconstruction_error(c, back, o.sink, o.window);
    const double tol = g == Precision::kF32 ? 0.02 : g == Precision::kTF32 ? 0.05 : 0.25;
    EXPECT_NEAR(e.k, ec.k, tol * ec.k + 1e-7) << precision_name(g);
    EXPECT_NEAR(e.v, ec.v, tol * ec.v + 1e-7) << precision_name(g);
    if (g == Precision::kF32) expect_close_f16(ref, back, "version-2 container decoded on CPU and GPU", 4);
  }
  // Batched with a DP container: each equals its CPU decode.
  const std::vector<uint8_t> dp = compress(c, cal, make_alloc_set(c), small_opts(6));
  CudaCodec codec(cal);
  DecompressOptions d32;
  d32.precision = Precision::kF32;
  CodecStats st;
  d32.stats = &st;
  std::vector<CudaKvCapture> two = codec.decompress({dp, bytes}, "mixed", d32);
  EXPECT_NE(st.entropy_backend.find("rans-host"), std::string::npos) << st.entropy_backend;
  expect_close_f16(cpu_decode(dp, cal, "dp"), cuda_download(two[0]), "DP container in a mixed batch", 4);
  expect_close_f16(ref, cuda_download(two[1]), "version-2 container in a mixed batch", 4);
  // A damaged chunk is refused (its section checksum), as by the CPU decoder.
  std::vector<uint8_t> bad = bytes;
  const container::Parsed P = container::parse(bytes, "v2", 2);
  for (const container::Section& s : P.sections)
    if (s.kind == container::kChunk) {
      const size_t at = size_t(s.data - bytes.data()) + s.stored_len - 2;
      bad[at] ^= 0x5a;
      break;
    }
  EXPECT_THROW(decompress_cuda(bad, cal, "bad-v2"), Error);
  // The encoder still refuses entropy-coded allocations, by name.
  try {
    compress_cuda(c, cal, al, o);
    FAIL() << "the GPU encoder accepted an ecsq allocation";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ecsq"), std::string::npos) << e.what();
  }
  // Version 3 (the window at 8 bits): the host widens the raw8 sections to
  // f16, the device copies them as raw ones; the same cache as the CPU's.
  CompressOptions o8 = o;
  o8.window_bits = 8;
  const std::vector<uint8_t> v3 = compress(c, cal, al, o8);
  ASSERT_EQ(container::parse(v3, "v3", 2).version, 3u);
  const KvCapture ref3 = cpu_decode(v3, cal, "cpu-v3");
  DecompressOptions f32;
  f32.precision = Precision::kF32;
  expect_close_f16(ref3, decompress_cuda(v3, cal, "v3.kvtc", f32), "version-3 container decoded on CPU and GPU", 4);
  try {
    compress_cuda(c, cal, make_alloc_set(c), o8);
    FAIL() << "the GPU encoder accepted window_bits 8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("window_bits 8"), std::string::npos) << e.what();
  }
}

// A CPU-written container's raw window is one DEFLATE stream per K/V (here
// 600 tokens x 64 features x 2 B = 76,800 B); nvCOMP inflates one stream on
// one thread block, so streams over its 64 KiB chunk go to libdeflate on
// the host threads (an H200 spent ~140 ms on a 1.5 MB window otherwise:
// bench/results/gpu.md). Same bytes out either way.
TEST(CudaCodecTest, LargeDeflatedSectionsInflateOnTheHost) {
  REQUIRE_GPU();
  const KvCapture c = make_capture(700, "norm", 61);
  const Calibration cal = make_calibration(c, false);
  CompressOptions o = small_opts(6);
  o.window = 600;
  const std::vector<uint8_t> bytes = compress(c, cal, make_alloc_set(c), o);
  size_t big = 0, small = 0;
  for (const container::Section& s : container::parse(bytes, "big").sections) {
    if (s.stored_len == s.raw_len || s.kind == container::kPositions || s.kind == container::kTokens) continue;  // those two: plan_decode's
    (s.raw_len > cuda::kNvcompMaxChunkBytes ? big : small)++;
  }
  ASSERT_GT(big, 0u) << "the test needs a deflated section over 64 KiB";
  DecompressOptions d;
  d.precision = Precision::kF32;
  CodecStats st;
  d.stats = &st;
  const KvCapture g = decompress_cuda(bytes, cal, "big", d);
  expect_close_f16(cpu_decode(bytes, cal, "big"), g, "CPU container with a 76.8 KB raw window, CPU vs GPU", 4);
  if (cuda::nvc::built()) {
    EXPECT_EQ(st.entropy_backend, small ? "nvcomp+libdeflate-host" : "libdeflate-host") << big << " large, " << small << " small deflated sections";
  }
}

TEST(CudaCodecTest, ErrorsMatchTheCpuDecoder) {
  REQUIRE_GPU();
  const KvCapture c = make_capture(100, "norm", 51);
  const Calibration cal = make_calibration(c, false);
  const std::vector<uint8_t> bytes = compress(c, cal, make_alloc_set(c), small_opts(6));
  std::vector<uint8_t> bad = bytes;
  bad[bad.size() / 2] ^= 0x10;
  EXPECT_THROW(decompress_cuda(bad, cal, "bad"), Error);
  EXPECT_THROW(decompress_cuda(std::vector<uint8_t>(bytes.begin(), bytes.end() - 9), cal, "trunc"), Error);
  Calibration other = make_calibration(c, true);
  EXPECT_THROW(decompress_cuda(bytes, other, "other"), Error);
  KvCapture wrong = c;
  wrong.model_sha256 = "another";
  EXPECT_THROW(compress_cuda(wrong, cal, make_alloc_set(c), small_opts(6)), Error);
}

TEST(CudaCodecTest, SynthesizeAndDeviceErrorMetric) {
  REQUIRE_GPU();
  KvCapture shape = make_capture(500, "norm", 61);
  const Calibration cal = make_calibration(shape, false);
  CudaCodec codec(cal);
  std::vector<std::array<std::vector<float>, 2>> sigma(1);
  for (int kv = 0; kv < 2; ++kv)
    for (uint32_t j = 0; j < 64; ++j) sigma[0][kv].push_back(2.0f / std::sqrt(float(j + 1)));
  CudaKvCapture syn = cuda::synthesize(codec, shape, sigma, 7);
  const KvCapture host = cuda_download(syn);
  // The synthetic cache follows the spectrum: projecting its de-RoPEd,
  // centred features on the basis gives variances ~ sigma^2.
  const KvBlock& kb = host.blocks[0];
  const std::vector<float> x = feature_rows(kb, true, true, 0, kb.n_tokens());
  const Transform& T = cal.blocks[0][0];
  for (uint32_t j : {0u, 10u, 40u}) {
    double s2 = 0;
    for (uint32_t t = 0; t < kb.n_tokens(); ++t) {
      double d = 0;
      for (uint32_t f = 0; f < 64; ++f) d += (x[size_t(t) * 64 + f] - T.mu[f]) * T.basis[size_t(j) * 64 + f];
      s2 += d * d;
    }
    s2 /= kb.n_tokens();
    EXPECT_NEAR(std::sqrt(s2), sigma[0][0][j], 0.12 * sigma[0][0][j] + 2e-3) << "component " << j;
  }
  std::vector<std::vector<uint8_t>> out;
  const CompressOptions o = small_opts(6);
  codec.compress({&syn}, make_alloc_set(shape), o, out);
  const CudaKvCapture back = codec.decompress(out[0], "syn");
  const ReconError dev = cuda_reconstruction_error(syn, back, o.sink, o.window);
  const ReconError cpu = reconstruction_error(host, cuda_download(back), o.sink, o.window);
  EXPECT_NEAR(dev.k, cpu.k, 1e-9 + 1e-6 * cpu.k);
  EXPECT_NEAR(dev.v, cpu.v, 1e-9 + 1e-6 * cpu.v);
  EXPECT_EQ(dev.tokens, cpu.tokens);
}
