// Unit tests of kvtc's utilities (synthetic inputs: these test the code
// itself, not model behaviour).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "core/util.h"
#include "kvtc/error.h"

namespace fs = std::filesystem;
using namespace kvtc;

TEST(F16, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(uint16_t(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f)))) << h;
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(F16, KnownValuesAndRounding) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);               // rounds up to inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -26)), 0x0000);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_FLOAT_EQ(f16_to_f32(0x3555), 0.333251953125f);
}

// The array conversions (F16C where the CPU has it) agree bit for bit with
// the scalar reference: every half, and floats around every rounding case.
TEST(F16, ArrayConversionsMatchScalar) {
  std::vector<uint16_t> h(65536);
  for (uint32_t i = 0; i < 65536; ++i) h[i] = uint16_t(i);
  std::vector<float> f(h.size());
  f16_to_f32_n(h.data(), f.data(), h.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const float r = f16_to_f32(uint16_t(i));
    if (std::isnan(r)) {
      EXPECT_TRUE(std::isnan(f[i])) << i;
      continue;
    }
    uint32_t a, b;
    std::memcpy(&a, &f[i], 4);
    std::memcpy(&b, &r, 4);
    ASSERT_EQ(a, b) << "half 0x" << std::hex << i;
  }
  // Floats: every half, the midpoints between neighbours (ties to even)
  // and points just off them, plus out-of-range values.
  std::vector<float> x;
  for (uint32_t i = 0; i < 0x7c00; i += 7) {
    const float lo = f16_to_f32(uint16_t(i)), hi = f16_to_f32(uint16_t(i + 1));
    const float mid = (lo + hi) / 2;
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  x.insert(x.end(), {65520.0f, 1e9f, -1e9f, std::ldexp(1.0f, -26), std::ldexp(1.0f, -25)});
  std::vector<uint16_t> y(x.size());
  f32_to_f16_n(x.data(), y.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], f32_to_f16(x[i])) << "float " << x[i];
}

TEST(Sha256, KnownVector) {
  const char* s = "abc";
  EXPECT_EQ(sha256_bytes({reinterpret_cast<const uint8_t*>(s), 3}), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

class TmpDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("kvtc-test-" + std::to_string(::getpid()) + "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  size_t entries() const { return size_t(std::distance(fs::directory_iterator(dir), fs::directory_iterator())); }
  fs::path dir;
};

TEST_F(TmpDir, AtomicWriteReplacesAndLeavesNoTemporary) {
  std::string p = (dir / "f.bin").string();
  std::vector<uint8_t> a(1000, 7), b(10, 9);
  write_file_atomic(p, a);
  EXPECT_EQ(read_file(p), a);
  write_file_atomic(p, b);
  EXPECT_EQ(read_file(p), b);
  EXPECT_EQ(entries(), 1u);
}

TEST_F(TmpDir, AtomicWriteFailureKeepsTheOldFile) {
  std::string p = (dir / "missing-dir" / "f.bin").string();
  EXPECT_THROW(write_file_atomic(p, std::vector<uint8_t>(3, 1)), Error);
  EXPECT_FALSE(fs::exists(p));
  // A directory in the way is refused and left alone.
  fs::create_directories(dir / "d");
  try {
    write_file_atomic((dir / "d").string(), std::vector<uint8_t>(3, 1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos);
  }
  EXPECT_TRUE(fs::is_directory(dir / "d"));
  EXPECT_EQ(entries(), 1u);
}

TEST_F(TmpDir, ReadFileErrorsNameThePath) {
  try {
    read_file((dir / "nope.txt").string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.txt"), std::string::npos);
  }
  EXPECT_THROW(read_file(dir.string()), Error);
}

// The system's refusals are IoError with the errno (the prompt store keeps a
// file it could not read; it deletes one whose bytes are wrong).
TEST_F(TmpDir, IoFailuresCarryTheirErrno) {
  auto code_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const IoError& e) {
      return e.code();
    }
    return 0;
  };
  EXPECT_EQ(code_of([&] { read_file((dir / "nope.txt").string()); }), ENOENT);
  EXPECT_EQ(code_of([&] { read_file(dir.string()); }), EISDIR);
  EXPECT_EQ(code_of([&] { write_file_atomic((dir / "missing-dir" / "f.bin").string(), std::vector<uint8_t>(3, 1)); }), ENOENT);
  write_file_atomic((dir / "f.bin").string(), std::vector<uint8_t>(3, 1));  // and the directory's sync succeeds here
  EXPECT_EQ(read_file((dir / "f.bin").string()).size(), 3u);
}

TEST(Cpu, FeaturesAreConsistent) {
  const CpuFeatures& f = cpu_features();
  // AVX2 implies AVX, AVX-512 BW implies F: the OS-state checks keep this true.
  EXPECT_TRUE(!f.avx2 || f.avx);
  EXPECT_TRUE(!f.avx512bw || f.avx512f);
  EXPECT_EQ(cpu_feature_names(f).empty(), !f.sse42 && !f.avx);
}
