// Golden containers: files written by format version 1 must keep decoding,
// and the must-fail files must keep failing with a clear error. The inputs
// are the small synthetic capture and calibration of tools/fuzz (synthetic
// on purpose: the files test the format, and stay a few KB).
// Regenerate (only when the format version changes):
//   KVTC_REGENERATE_GOLDEN=1 build/tests/kvtc_tests_golden
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "format/container.h"
#include "fuzz/fuzz_common.h"
#include "kvtc/kvtc.h"

using namespace kvtc;
namespace fs = std::filesystem;

namespace {

const std::string kDir = KVTC_GOLDEN_DIR;

void regenerate() {
  KvCapture c = fuzz::small_capture(64);
  Calibration cal = fuzz::small_calibration();
  CompressOptions o;
  o.sink = 2;
  o.window = 8;
  o.chunk_tokens = 16;
  o.precision = Precision::kF32;  // reproducible on any machine
  std::vector<uint8_t> good = compress(c, cal, fuzz::small_alloc(), o);
  fs::create_directories(kDir);
  write_file_atomic(kDir + "/ok.kvtc", good);
  calibration_save(kDir + "/calibration.safetensors", cal);
  capture_save(kDir + "/original.safetensors", c);
  write_file_atomic(kDir + "/fail_truncated.kvtc", std::vector<uint8_t>(good.begin(), good.end() - 7));
  std::vector<uint8_t> flip = good;
  flip[flip.size() / 2] ^= 0x10;
  write_file_atomic(kDir + "/fail_bitflip.kvtc", flip);
  Calibration other = cal;
  other.blocks[0][0].mu[0] += 1.0f;
  other.id = calibration_compute_id(other);
  write_file_atomic(kDir + "/fail_wrong_calibration.kvtc", compress(c, other, fuzz::small_alloc(), o));
  std::vector<uint8_t> v2 = good;
  v2[4] = 2;
  write_file_atomic(kDir + "/fail_version.kvtc", v2);
}

}  // namespace

namespace {
void check_v1_decode(const KvCapture& c);
}  // namespace

TEST(Golden, V1Decodes) {
  if (std::getenv("KVTC_REGENERATE_GOLDEN")) regenerate();
  // The calibration as written now (file format 2) and as first written
  // (format 1, tests/golden/v1/calibration-v1.safetensors): the same id.
  for (const char* file : {"calibration.safetensors", "calibration-v1.safetensors"}) {
    SCOPED_TRACE(file);
    const Calibration cal = calibration_load(kDir + "/" + file, true);
    const KvCapture c = decompress(read_file(kDir + "/ok.kvtc"), cal, "ok.kvtc");
    check_v1_decode(c);
  }
}

namespace {
void check_v1_decode(const KvCapture& c) {
  KvCapture ref = capture_load(kDir + "/original.safetensors");
  ASSERT_EQ(c.blocks[0].n_tokens(), 64u);
  EXPECT_EQ(c.tokens, ref.tokens);
  EXPECT_EQ(c.blocks[0].pos, ref.blocks[0].pos);
  // Raw tokens exact; coded components 0..4 of 16 (identity basis): bounded error.
  ReconError e = reconstruction_error(ref, c, 2, 8);
  EXPECT_EQ(e.tokens, 64u - 2 - 8);
  EXPECT_LT(e.k, 0.9);
  EXPECT_LT(e.v, 0.9);
  for (uint32_t t : {0u, 1u, 56u, 63u})
    for (uint32_t d = 0; d < 8; ++d) EXPECT_EQ(c.blocks[0].k[c.blocks[0].index(1, 0, t, d)], ref.blocks[0].k[ref.blocks[0].index(1, 0, t, d)]);
}
}  // namespace

// The encoder's output is stable: re-encoding the golden input gives the
// golden file's sections byte for byte (the JSON header may gain fields),
// on one thread and on several. Catches any change of quantization,
// packing or DEFLATE input layout, e.g. by a faster implementation.
TEST(Golden, ReencodeIsByteIdentical) {
  KvCapture c = capture_load(kDir + "/original.safetensors");
  Calibration cal = calibration_load(kDir + "/calibration.safetensors");
  const std::vector<uint8_t> golden = read_file(kDir + "/ok.kvtc");
  const container::Parsed g = container::parse(golden, "ok.kvtc");
  for (int threads : {1, 2, 3}) {
    CompressOptions o;
    o.sink = 2;
    o.window = 8;
    o.chunk_tokens = 16;
    o.threads = threads;
    o.precision = Precision::kF32;
    const std::vector<uint8_t> now = compress(c, cal, fuzz::small_alloc(), o);
    const container::Parsed n = container::parse(now, "re-encoded");
    ASSERT_EQ(n.sections.size(), g.sections.size());
    for (size_t i = 0; i < g.sections.size(); ++i) {
      const auto &a = g.sections[i], &b = n.sections[i];
      EXPECT_EQ(a.kind, b.kind);
      EXPECT_EQ(a.t0, b.t0);
      EXPECT_EQ(a.t1, b.t1);
      EXPECT_EQ(a.raw_len, b.raw_len);
      EXPECT_EQ(container::payload(a, "golden"), container::payload(b, "now")) << "section " << i << ", threads " << threads;
    }
  }
}

TEST(Golden, V1MustFail) {
  Calibration cal = calibration_load(kDir + "/calibration.safetensors", true);
  const std::pair<const char*, const char*> cases[] = {{"fail_truncated.kvtc", "truncated"},
                                                       {"fail_bitflip.kvtc", "checksum"},
                                                       {"fail_wrong_calibration.kvtc", "wrong calibration"},
                                                       {"fail_version.kvtc", "version 2"}};
  for (const auto& [file, needle] : cases) {
    try {
      decompress(read_file(kDir + "/" + file), cal, file);
      ADD_FAILURE() << file << " decoded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << file << ": " << e.what();
    }
  }
}

// Appending in groups of 16 leaves every earlier byte alone and decodes to
// what compressing the grown cache in one go decodes to.
TEST(Append, KeepsThePrefixAndMatchesOneShot) {
  KvCapture full = fuzz::small_capture(112);
  Calibration cal = fuzz::small_calibration();
  CompressOptions o;
  o.sink = 2;
  o.window = 8;
  o.chunk_tokens = 32;
  auto prefix_of = [&](uint32_t n) {
    KvCapture c = full;
    KvBlock& b = c.blocks[0];
    KvBlock nb = b;
    nb.pos.resize(n);
    nb.k.assign(nb.numel(), 0);
    nb.v.assign(nb.numel(), 0);
    for (uint32_t l = 0; l < b.n_layer(); ++l)
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t d = 0; d < b.head_dim; ++d) {
          nb.k[nb.index(l, 0, t, d)] = b.k[b.index(l, 0, t, d)];
          nb.v[nb.index(l, 0, t, d)] = b.v[b.index(l, 0, t, d)];
        }
    c.blocks[0] = nb;
    c.tokens.resize(n);
    return c;
  };
  std::vector<uint8_t> bytes = compress(prefix_of(64), cal, fuzz::small_alloc(), o);
  for (uint32_t n : {80u, 112u}) {
    AppendResult r = append(bytes, prefix_of(n), cal, "grow");
    ASSERT_LE(r.kept_bytes, bytes.size());
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.begin() + r.kept_bytes, r.bytes.begin())) << "append rewrote earlier bytes";
    EXPECT_GT(r.kept_bytes, bytes.size() / 2);
    KvCapture a = decompress(r.bytes, cal, "appended");
    KvCapture one = decompress(compress(prefix_of(n), cal, fuzz::small_alloc(), o), cal, "one-shot");
    EXPECT_EQ(a.blocks[0].pos, one.blocks[0].pos);
    EXPECT_EQ(a.blocks[0].k, one.blocks[0].k);
    EXPECT_EQ(a.blocks[0].v, one.blocks[0].v);
    EXPECT_EQ(a.tokens, one.tokens);
    bytes = r.bytes;
  }
  EXPECT_THROW(append(bytes, prefix_of(112), cal, "same"), Error);  // nothing new
  KvCapture odd = fuzz::small_capture(120);
  EXPECT_THROW(append(bytes, odd, cal, "odd"), Error);  // 8 new tokens: not a multiple of 16
  KvCapture moved = fuzz::small_capture(128);
  moved.blocks[0].pos[5] = 999;
  EXPECT_THROW(append(bytes, moved, cal, "moved"), Error);  // positions differ
}
