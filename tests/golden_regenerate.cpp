// Writes the golden files of tests/test_golden.cpp and prints the
// checksums of their decoded tensors, to be pasted into the test. Never run
// by the tests: the golden files are the format's promise, rewritten only
// when a format version is deliberately changed (tests/golden/README.md).
//   build/tests/kvtc_golden_regenerate v1   # tests/golden/v1 (format version 1)
//   build/tests/kvtc_golden_regenerate v2   # tests/golden/v2 (version 2, from v1's input)
//   build/tests/kvtc_golden_regenerate v2-encoder  # only tests/golden/v2/reencoded.kvtc (an encoder change)
//   build/tests/kvtc_golden_regenerate v3   # tests/golden/v3 (version 3: v2's coding, the window at 8 bits)
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

// The v1 capture and calibration, coded with ecsq at 2x.
void regenerate_v2() {
  const KvCapture c = capture_load(kDir + "/original.safetensors");
  const Calibration cal = calibration_load(kDir + "/calibration.safetensors");
  const std::vector<uint8_t> good = compress(c, cal, ecsq_allocation_set(cal, 2), golden::options());
  fs::create_directories(kDir2);
  write_file_atomic(kDir2 + "/ok.kvtc", good);
  write_file_atomic(kDir2 + "/fail_truncated.kvtc", std::vector<uint8_t>(good.begin(), good.end() - 5));
  std::vector<uint8_t> v = good;
  v[4] = 3;
  write_file_atomic(kDir2 + "/fail_version.kvtc", v);
  v[4] = 1;
  write_file_atomic(kDir2 + "/fail_ecsq_in_v1.kvtc", v);
}

// What today's encoder writes for the same input: the bytes the re-encode
// test pins. Rewritten when the encoder's choices deliberately change (rate
// control's search picks another step), which ok.kvtc never is.
void regenerate_v2_encoder() {
  const KvCapture c = capture_load(kDir + "/original.safetensors");
  const Calibration cal = calibration_load(kDir + "/calibration.safetensors");
  write_file_atomic(kDir2 + "/reencoded.kvtc", compress(c, cal, ecsq_allocation_set(cal, 2), golden::options()));
}

// The v1 capture and calibration, ecsq at 2x with the window at 8 bits:
// entropy-coded chunks and raw8 sections in one file.
void regenerate_v3() {
  const KvCapture c = capture_load(kDir + "/original.safetensors");
  const Calibration cal = calibration_load(kDir + "/calibration.safetensors");
  const std::vector<uint8_t> good = compress(c, cal, ecsq_allocation_set(cal, 2), golden::options_v3());
  fs::create_directories(kDir3);
  write_file_atomic(kDir3 + "/ok.kvtc", good);
  std::vector<uint8_t> v = good;
  v[4] = 4;
  write_file_atomic(kDir3 + "/fail_version.kvtc", v);
  v[4] = 2;
  write_file_atomic(kDir3 + "/fail_raw8_in_v2.kvtc", v);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc == 2 ? argv[1] : "";
  if (what != "v1" && what != "v2" && what != "v2-encoder" && what != "v3" && what != "sums") {
    std::fprintf(stderr, "usage: %s v1|v2|v2-encoder|v3|sums\n", argv[0]);
    return 2;
  }
  try {
    if (what == "v1") regenerate_v1();
    if (what == "v2") regenerate_v2();
    if (what == "v2" || what == "v2-encoder") regenerate_v2_encoder();
    if (what == "v3") regenerate_v3();
    const Calibration cal = calibration_load(kDir + "/calibration.safetensors", true);
    for (const std::string& dir : {kDir, kDir2, kDir3}) {
      const KvCapture c = decompress(read_file(dir + "/ok.kvtc"), cal, "ok.kvtc", golden::decode_options());
      std::printf("%s/ok.kvtc decodes to %s\n", dir.c_str(), golden::decoded_checksum(c).c_str());
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "kvtc_golden_regenerate: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
