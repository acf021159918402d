// The entropy-coded chunks (container versions 2-4, src/format/ecsq.h) in
// both layouts: the normative tables, bit-exact round trips, the rate
// estimate, escapes and shifts, corrupt payloads, and the 32-lane
// decoder's kernels against one another. Synthetic coefficients on purpose: these
// test the coder; tests/test_codec_cli.py runs the mode on a real model's
// cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "core/util.h"
#include "format/ecsq.h"
#include "kvtc/error.h"

using namespace kvtc;
using namespace kvtc::container;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// n x ru coefficients, component j with standard deviation sd0 * decay^j,
// Laplace-distributed (heavier than Gaussian, as PCA coefficients of caches).
std::vector<float> coeffs(uint32_t n, uint32_t ru, double sd0, double decay, uint32_t seed) {
  std::mt19937 rng(seed);
  std::exponential_distribution<double> ex(1.0);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> d(size_t(n) * ru);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < ru; ++j) {
      const double b = sd0 * std::pow(decay, j) / std::sqrt(2.0);
      d[size_t(t) * ru + j] = float((sign(rng) ? 1 : -1) * ex(rng) * b);
    }
  return d;
}

// The encoder's layout: component-major, d'[j * n + t].
std::vector<float> cm(const std::vector<float>& d, uint32_t n, uint32_t ru) {
  std::vector<float> o(d.size());
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < ru; ++j) o[size_t(j) * n + t] = d[size_t(t) * ru + j];
  return o;
}

// What the decoder must give for coefficient x: the code's reconstruction.
void expect_close(const std::vector<float>& d, const std::vector<float>& out, float step) {
  ASSERT_EQ(d.size(), out.size());
  for (size_t i = 0; i < d.size(); ++i) ASSERT_LE(std::fabs(d[i] - out[i]), step * 1.0f + 1e-6f * std::fabs(d[i])) << "coefficient " << i;
}

// ecsq_decode_codes gives the codes whose reconstructions ecsq_decode_chunk
// writes (component-major), bit for bit.
void expect_codes_agree(const std::vector<uint8_t>& bytes, uint32_t n, uint32_t ru, EcsqLayout L) {
  std::vector<float> values(size_t(n) * ru, -1);
  std::vector<int32_t> codes(size_t(n) * ru, -1);
  ecsq_decode_chunk(bytes.data(), bytes.size(), n, ru, L, values.data(), "chunk", true);
  ecsq_decode_codes(bytes.data(), bytes.size(), n, ru, L, codes.data(), "chunk");
  const float step = ecsq_chunk_step(bytes.data(), bytes.size(), "chunk"), offset = ecsq_chunk_offset(bytes.data(), bytes.size(), "chunk");
  for (size_t i = 0; i < codes.size(); ++i) {
    const int32_t c = codes[i];
    const float a = c == 0 ? 0.0f : (float(std::abs(c)) - offset) * step;
    ASSERT_EQ(values[i], c < 0 ? -a : a) << "value " << i << ", code " << c;
  }
}

const EcsqLayout kLayouts[] = {EcsqLayout::kLanes4, EcsqLayout::kLanes32};
std::string name(EcsqLayout L) {
  return L == EcsqLayout::kLanes4 ? "4 lanes" : "32 lanes";
}

}  // namespace

// The table file is the one docs/format.md names (its SHA-256), and every
// table is a distribution over 4096 with an escape.
TEST(Ecsq, TablesAreTheSpecifiedOnes) {
  const std::string text = slurp(std::string(KVTC_SOURCE_DIR) + "/src/format/ecsq_tables.inc");
  ASSERT_FALSE(text.empty());
  const std::string sha = sha256_bytes({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  const std::string spec = slurp(std::string(KVTC_SOURCE_DIR) + "/docs/format.md");
  EXPECT_NE(spec.find(sha), std::string::npos) << "docs/format.md does not record the tables' SHA-256 " << sha;
  ASSERT_EQ(ecsq_table_count(), 82u);
  for (uint32_t k = 0; k < ecsq_table_count(); ++k) {
    const uint16_t* f = ecsq_table(k);
    uint32_t sum = 0;
    for (int u = 0; u < 64; ++u) sum += f[u];
    EXPECT_EQ(sum, 4096u) << "table " << k;
    EXPECT_GE(f[63], 1u) << "table " << k;
  }
}

TEST(Ecsq, RoundTripsAndEstimatesItsSize) {
  for (EcsqLayout L : kLayouts)
    for (uint32_t n : {1u, 16u, 37u, 256u})
      for (float step : {0.05f, 0.3f, 2.0f}) {
        SCOPED_TRACE(name(L) + ", n " + std::to_string(n) + ", step " + std::to_string(step));
        const uint32_t ru = 48;
        const std::vector<float> d = coeffs(n, ru, 20.0, 0.85, n + 7);
        EcsqParams p;
        p.layout = L;
        p.step = step;
        const std::vector<uint8_t> bytes = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p);
        std::vector<float> out(d.size(), -1);
        ecsq_decode_chunk(bytes.data(), bytes.size(), n, ru, L, out.data(), "chunk");
        expect_close(d, out, step);
        expect_codes_agree(bytes, n, ru, L);
        // The same bytes again (the encoder is deterministic).
        EXPECT_EQ(bytes, ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p));
        const double est = ecsq_estimate_bytes(cm(d, n, ru).data(), n, ru, p);
        // The states hold up to 2 bytes each before they emit a word.
        EXPECT_NEAR(est, double(bytes.size()), 0.02 * double(bytes.size()) + 24 + 2 * uint32_t(L)) << "estimate";
        EXPECT_EQ(ecsq_chunk_step(bytes.data(), bytes.size(), "chunk"), step);
      }
}

// A step far below the coefficients: shifts and escapes carry codes up to
// 2^24; beyond, codes clamp (the error grows, the stream stays valid).
TEST(Ecsq, LargeCodesUseShiftsAndEscapes) {
  for (EcsqLayout L : kLayouts) {
    SCOPED_TRACE(name(L));
    const uint32_t n = 64, ru = 6;
    std::vector<float> d = coeffs(n, ru, 1.0, 1.0, 3);
    for (uint32_t t = 0; t < n; ++t) {
      d[size_t(t) * ru + 0] *= 1e5f;                         // ~1e5 steps: shifted
      d[size_t(t) * ru + 1] = t == 5 ? 3e3f : 0.0f;          // one outlier in zeros: escaped
      d[size_t(t) * ru + 2] = 0.0f;                          // all zero: id 0
      d[size_t(t) * ru + 3] = float(t % 2 ? 1 : -1) * 5e7f;  // beyond 2^24 steps: clamped
    }
    EcsqParams p;
    p.layout = L;
    p.step = 1.0f;
    const std::vector<uint8_t> bytes = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p);
    EXPECT_EQ(bytes[8 + 2], 0) << "an all-zero component has id 0";
    std::vector<float> out(d.size());
    ecsq_decode_chunk(bytes.data(), bytes.size(), n, ru, L, out.data(), "chunk");
    expect_codes_agree(bytes, n, ru, L);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t j = 0; j < ru; ++j) {
        const float x = d[size_t(t) * ru + j], y = out[size_t(t) * ru + j];
        if (j == 3)
          EXPECT_NEAR(std::fabs(y), float(1 << 24), 0.5f) << "clamped at 2^24 steps";
        else
          EXPECT_LE(std::fabs(x - y), 1.0f) << "t " << t << " j " << j;
      }
  }
}

// Any truncation or byte change of a payload is an Error or a valid decode
// (the container's checksum catches the rest), never a crash or an
// out-of-range write; a payload of another size or component count too.
TEST(Ecsq, CorruptPayloadsAreErrors) {
  for (EcsqLayout L : kLayouts) {
    SCOPED_TRACE(name(L));
    const uint32_t n = 32, ru = 12;
    const std::vector<float> d = coeffs(n, ru, 8.0, 0.8, 11);
    EcsqParams p;
    p.layout = L;
    p.step = 0.25f;
    const std::vector<uint8_t> good = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p);
    std::vector<float> out(size_t(n) * ru);
    std::vector<int32_t> codes(size_t(n) * ru);
    for (size_t len = 0; len < good.size(); ++len) {
      EXPECT_THROW(ecsq_decode_chunk(good.data(), len, n, ru, L, out.data(), "truncated"), Error) << "length " << len;
      EXPECT_THROW(ecsq_decode_codes(good.data(), len, n, ru, L, codes.data(), "truncated"), Error) << "length " << len;
    }
    std::vector<uint8_t> longer = good;
    longer.push_back(0);
    EXPECT_THROW(ecsq_decode_chunk(longer.data(), longer.size(), n, ru, L, out.data(), "longer"), Error);
    std::mt19937 rng(5);
    int errors = 0;
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<uint8_t> b = good;
      b[rng() % b.size()] ^= uint8_t(1 + rng() % 255);
      try {
        ecsq_decode_chunk(b.data(), b.size(), n, ru, L, out.data(), "flipped");
      } catch (const Error&) {
        ++errors;
      }
      // The integer decoder makes the same checks (the step's and offset's
      // aside: its caller reads them apart).
      if (std::equal(b.begin(), b.begin() + 8, good.begin())) {
        bool threw = false;
        try {
          ecsq_decode_codes(b.data(), b.size(), n, ru, L, codes.data(), "flipped");
        } catch (const Error&) {
          threw = true;
        }
        bool threw_float = false;
        try {
          ecsq_decode_chunk(b.data(), b.size(), n, ru, L, out.data(), "flipped");
        } catch (const Error&) {
          threw_float = true;
        }
        EXPECT_EQ(threw, threw_float) << "trial " << trial;
      }
    }
    EXPECT_GT(errors, 1000) << "the end-of-stream check catches most changes";
    std::vector<uint8_t> bad_id = good;
    bad_id[8] = 240;
    try {
      ecsq_decode_chunk(bad_id.data(), bad_id.size(), n, ru, L, out.data(), "chunk X");
      ADD_FAILURE() << "decoded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("chunk X: table id 240 of component 0"), std::string::npos) << e.what();
    }
    std::vector<uint8_t> bad_step = good;
    bad_step[3] = 0xff;  // NaN
    EXPECT_THROW(ecsq_decode_chunk(bad_step.data(), bad_step.size(), n, ru, L, out.data(), "nan"), Error);
  }
}

// Coding the same data more finely costs more bytes and errs less: the
// knob rate control turns is monotone where it searches.
TEST(Ecsq, BytesFallAsTheStepGrows) {
  for (EcsqLayout L : kLayouts) {
    SCOPED_TRACE(name(L));
    const uint32_t n = 256, ru = 64;
    const std::vector<float> d = coeffs(n, ru, 10.0, 0.9, 21);
    double prev = 1e30;
    for (float step : {0.01f, 0.03f, 0.1f, 0.3f, 1.0f, 3.0f}) {
      EcsqParams p;
      p.layout = L;
      p.step = step;
      const double b = double(ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p).size());
      EXPECT_LT(b, prev) << "step " << step;
      prev = b;
    }
  }
}

namespace {
// Restores the automatic choice however a test ends.
struct KernelGuard {
  ~KernelGuard() { ecsq_set_rans32_kernel(Rans32Kernel::kAuto); }
};
}  // namespace

// The 32-lane decoder's kernels (scalar, and AVX2 and AVX-512 where the CPU
// has them) give the same codes and values as one another and as the
// 4-lane layout of the same coefficients (the codes are the quantizer's,
// only the stream differs), over chunk lengths that end inside a step of
// 32 tokens, with escapes and shifted components; and the same verdict and
// codes on damaged payloads.
TEST(Ecsq, Lanes32KernelsAgree) {
  KernelGuard guard;
  const CpuFeatures& cpu = cpu_features();
  std::vector<Rans32Kernel> kernels = {Rans32Kernel::kScalar};
  if (cpu.avx2) kernels.push_back(Rans32Kernel::kAvx2);
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512vl) kernels.push_back(Rans32Kernel::kAvx512);
  std::printf("32-lane kernels compared: %zu (scalar%s%s)\n", kernels.size(), cpu.avx2 ? ", AVX2" : "", kernels.size() == 3 ? ", AVX-512" : "");
  for (uint32_t n : {1u, 15u, 16u, 17u, 100u, 256u, 300u}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const uint32_t ru = 40;
    std::vector<float> d = coeffs(n, ru, 30.0, 0.88, n + 3);
    for (uint32_t t = 0; t < n; ++t) {
      d[size_t(t) * ru] *= 3e3f;                     // shifted
      if (t % 7 == 3) d[size_t(t) * ru + 5] = 4e3f;  // escaped
    }
    EcsqParams p4, p32;
    p4.step = p32.step = 0.2f;
    p4.layout = EcsqLayout::kLanes4;
    const std::vector<uint8_t> b4 = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p4);
    const std::vector<uint8_t> b32 = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p32);
    // The same information: 116 bytes more of states and word count, less
    // what the 32 states hold before they emit a word (up to 2 bytes each),
    // and the 16-bit words' renormalisation (~0.1%).
    // words' renormalisation (~0.1% here).
    const double more = double(ecsq_fixed_bytes(ru, EcsqLayout::kLanes32) - ecsq_fixed_bytes(ru, EcsqLayout::kLanes4));
    EXPECT_LE(double(b32.size()), double(b4.size()) * 1.01 + more + 2);  // + a half-used word
    EXPECT_GE(double(b32.size()), double(b4.size()) * 0.99 + more - 2 * kEcsqWideLanes);
    std::vector<int32_t> c4(size_t(n) * ru), c32(size_t(n) * ru);
    std::vector<float> v4(size_t(n) * ru), v32(size_t(n) * ru);
    ecsq_decode_codes(b4.data(), b4.size(), n, ru, EcsqLayout::kLanes4, c4.data(), "4");
    ecsq_decode_chunk(b4.data(), b4.size(), n, ru, EcsqLayout::kLanes4, v4.data(), "4", true);
    for (Rans32Kernel k : kernels) {
      ecsq_set_rans32_kernel(k);
      ASSERT_EQ(ecsq_rans32_kernel(), k);
      std::fill(c32.begin(), c32.end(), -99);
      ecsq_decode_codes(b32.data(), b32.size(), n, ru, EcsqLayout::kLanes32, c32.data(), "32");
      ecsq_decode_chunk(b32.data(), b32.size(), n, ru, EcsqLayout::kLanes32, v32.data(), "32", true);
      ASSERT_EQ(c32, c4) << "kernel " << int(k);
      ASSERT_EQ(0, std::memcmp(v32.data(), v4.data(), v4.size() * 4)) << "kernel " << int(k);
    }
    // Damaged: every kernel agrees on throwing, and on the codes where not.
    std::mt19937 rng(n);
    int errors = 0;
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<uint8_t> b = b32;
      b[8 + rng() % (b.size() - 8)] ^= uint8_t(1 + rng() % 255);
      std::vector<int32_t> first;
      int first_threw = -1;
      for (Rans32Kernel k : kernels) {
        ecsq_set_rans32_kernel(k);
        std::vector<int32_t> c(size_t(n) * ru, 0);
        int threw = 0;
        try {
          ecsq_decode_codes(b.data(), b.size(), n, ru, EcsqLayout::kLanes32, c.data(), "damaged");
        } catch (const Error&) {
          threw = 1;
        }
        if (first_threw < 0) {
          first_threw = threw, first = c;
          errors += threw;
          continue;
        }
        ASSERT_EQ(threw, first_threw) << "trial " << trial << " kernel " << int(k);
        if (!threw) {
          ASSERT_EQ(c, first) << "trial " << trial << " kernel " << int(k);
        }
      }
    }
    // Most changes are caught by the end-of-stream checks; not those in the
    // bypass bits, which carry no redundancy (the container's checksum
    // catches them), here ~1/3 of the bytes as component 0 is shifted.
    std::printf("n %u: %d of 300 changes are errors\n", n, errors);
    EXPECT_GT(errors, 150) << "the end-of-stream checks catch most changes";
  }
}

// Layout 32's stream rebuilt by hand from docs/format.md for 2 tokens of
// one component coding codes 0 and 1 (symbols 0 and 2): the states, a word
// count of 0, no words, no bits. The encoder writes exactly this and the
// decoder reads it back.
// The encoder's vector paths (choose_table's sums in AVX-512 where the CPU
// has it, the offset in SSE2) make the encoder's choices and bytes of the
// scalar loops: the same estimates, table ids and chunk bytes with vector
// kernels on and off, over spreads that take every kind of table (round
// ones near zero, shifted ones, escapes) and lengths off the vectors' steps.
TEST(Ecsq, EncoderVectorPathsMakeTheScalarBytes) {
  struct VectorGuard {
    ~VectorGuard() { set_vector_kernels(true); }
  } guard;
  for (uint32_t n : {1u, 7u, 16u, 17u, 100u, 256u, 301u}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const uint32_t ru = 48;
    std::vector<float> d = coeffs(n, ru, 4e3, 0.8, n + 11);               // sd 4000 down to ~0.1: shifts, then round tables, then zeros
    for (uint32_t t = 0; t < n; t += 5) d[size_t(t) * ru + 30] = 900.0f;  // escapes in a component of small codes
    const std::vector<float> c = cm(d, n, ru);
    for (float step : {0.05f, 1.0f, 40.0f}) {
      SCOPED_TRACE("step " + std::to_string(step));
      EcsqParams p;
      p.step = step;
      std::vector<uint8_t> ids[2], bytes[2];
      double est[2], quick[2];
      uint32_t last[2] = {0, 0};
      for (int v = 0; v < 2; ++v) {
        set_vector_kernels(v == 1);
        ids[v].assign(ru, 0xff);
        est[v] = ecsq_estimate_bytes(c.data(), n, ru, p, 1, &last[v], false, ids[v].data());
        quick[v] = ecsq_estimate_bytes(c.data(), n, ru, p, 4, nullptr, true, nullptr);
        bytes[v] = ecsq_encode_chunk(c.data(), n, ru, p, nullptr);
      }
      EXPECT_EQ(est[0], est[1]);
      EXPECT_EQ(quick[0], quick[1]);
      EXPECT_EQ(last[0], last[1]);
      EXPECT_EQ(ids[0], ids[1]);
      EXPECT_EQ(bytes[0], bytes[1]);
      // The chunk carries the ids the estimate chose (bytes 8 .. 8 + ru).
      ASSERT_GE(bytes[1].size(), 8u + ru);
      EXPECT_TRUE(std::equal(ids[1].begin(), ids[1].end(), bytes[1].begin() + 8));
    }
  }
}

TEST(Ecsq, Lanes32FollowsTheSpec) {
  EcsqParams p;
  p.step = 1.0f;
  const float d[2] = {0.1f, 1.2f};
  const std::vector<uint8_t> b = ecsq_encode_chunk(d, 2, 1, p, nullptr);
  ASSERT_EQ(b.size(), ecsq_fixed_bytes(1, EcsqLayout::kLanes32)) << "two symbols from states of 2^16 need no word";
  const uint32_t id = b[8];
  ASSERT_GE(id, 1u);
  ASSERT_LT(id, 75u) << "an unshifted round table";
  const uint16_t* f = ecsq_table(id - 1);
  const uint32_t sym[2] = {0, 2}, start[2] = {0, uint32_t(f[0]) + f[1]};
  // From 2^16, token 1 then token 0 (each its own state t mod 32):
  // x <- floor(x / f) 4096 + x mod f + start.
  uint32_t x[kEcsqWideLanes];
  std::fill(x, x + kEcsqWideLanes, 1u << 16);
  for (int t = 1; t >= 0; --t) x[t] = (x[t] / f[sym[t]]) * 4096 + x[t] % f[sym[t]] + start[t];
  for (uint32_t l = 0; l < kEcsqWideLanes; ++l) {
    uint32_t got;
    std::memcpy(&got, b.data() + 9 + 4 * l, 4);
    EXPECT_EQ(got, x[l]) << "state " << l;
  }
  uint32_t nwords;
  std::memcpy(&nwords, b.data() + 9 + 4 * kEcsqWideLanes, 4);
  EXPECT_EQ(nwords, 0u);
  int32_t c[2] = {7, 7};
  ecsq_decode_codes(b.data(), b.size(), 2, 1, EcsqLayout::kLanes32, c, "spec");
  EXPECT_EQ(c[0], 0);
  EXPECT_EQ(c[1], 1);
}
