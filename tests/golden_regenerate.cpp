// Writes the golden files of tests/test_golden.cpp and prints the
// checksums of their decoded tensors, to be pasted into the test. Never run
// by the tests: the golden files are the format's promise, rewritten only
// when a format version is deliberately changed (tests/golden/README.md).
//   build/tests/kvtc_golden_regenerate v1   # tests/golden/v1 (format version 1)
//   build/tests/kvtc_golden_regenerate v4   # tests/golden/v4 (version 4: ecsq in 32 lanes, from v1's input)
//   build/tests/kvtc_golden_regenerate v4-encoder  # only tests/golden/v4/reencoded.kvtc (an encoder change)
//   build/tests/kvtc_golden_regenerate sums # only print the checksums of the files as they are
#include <cstdio>
#include <filesystem>
#include <string>

#include "fuzz/fuzz_common.h"
#include "golden_common.h"

using namespace kvtc;
namespace fs = std::filesystem;

namespace {

const std::string kDir = KVTC_GOLDEN_DIR;
const std::string kDir2 = KVTC_GOLDEN_V2_DIR;
const std::string kDir3 = KVTC_GOLDEN_V3_DIR;
const std::string kDir4 = KVTC_GOLDEN_V4_DIR;

void regenerate_v1() {
  KvCapture c = fuzz::small_capture(64);
  Calibration cal = fuzz::small_calibration();
  const CompressOptions o = golden::options();
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

// tests/golden/v2 and v3 are frozen: today's writer codes ecsq in version
// 4's layout, so it can no longer write them (git holds the code that did).

// The v1 capture and calibration, coded with ecsq at 2x by a version-4
// writer: the chunks in 32 lanes.
void regenerate_v4() {
  const KvCapture c = capture_load(kDir + "/original.safetensors");
  const Calibration cal = calibration_load(kDir + "/calibration.safetensors");
  const std::vector<uint8_t> good = compress(c, cal, ecsq_allocation_set(cal, 2), golden::options_v4());
  fs::create_directories(kDir4);
  write_file_atomic(kDir4 + "/ok.kvtc", good);
  write_file_atomic(kDir4 + "/fail_truncated.kvtc", std::vector<uint8_t>(good.begin(), good.end() - 5));
  std::vector<uint8_t> v = good;
  v[4] = 5;
  write_file_atomic(kDir4 + "/fail_version.kvtc", v);
  v[4] = 3;  // 32-lane chunks read as 4-lane ones
  write_file_atomic(kDir4 + "/fail_lanes32_in_v3.kvtc", v);
}

// What today's encoder writes for the same input: the bytes the re-encode
// test pins. Rewritten when the encoder's choices deliberately change (rate
// control's search picks another step), which ok.kvtc never is.
void regenerate_v4_encoder() {
  const KvCapture c = capture_load(kDir + "/original.safetensors");
  const Calibration cal = calibration_load(kDir + "/calibration.safetensors");
  write_file_atomic(kDir4 + "/reencoded.kvtc", compress(c, cal, ecsq_allocation_set(cal, 2), golden::options_v4()));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc == 2 ? argv[1] : "";
  if (what != "v1" && what != "v4" && what != "v4-encoder" && what != "sums") {
    std::fprintf(stderr, "usage: %s v1|v4|v4-encoder|sums (v2 and v3 are frozen)\n", argv[0]);
    return 2;
  }
  try {
    if (what == "v1") regenerate_v1();
    if (what == "v4") regenerate_v4();
    if (what == "v4" || what == "v4-encoder") regenerate_v4_encoder();
    const Calibration cal = calibration_load(kDir + "/calibration.safetensors", true);
    for (const std::string& dir : {kDir, kDir2, kDir3, kDir4}) {
      const KvCapture c = decompress(read_file(dir + "/ok.kvtc"), cal, "ok.kvtc", golden::decode_options());
      std::printf("%s/ok.kvtc decodes to %s\n", dir.c_str(), golden::decoded_checksum(c).c_str());
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "kvtc_golden_regenerate: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
