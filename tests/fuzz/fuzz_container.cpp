// libFuzzer target: the .kvtc decoder (and inspect) on arbitrary bytes.
// Built with FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION so that checksums do
// not stop the fuzzer at the first byte it changes.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kvtc::Calibration cal = kvtc::fuzz::small_calibration();
  const std::span<const uint8_t> b(data, size);
  try {
    kvtc::inspect(b, "fuzz");
  } catch (const kvtc::Error&) {
  }
  try {
    kvtc::decompress(b, cal, "fuzz");
  } catch (const kvtc::Error&) {
  }
  return 0;
}
