// libFuzzer target: the safetensors parser, and the capture and calibration
// readers above it (the calibration's file checksum is skipped in fuzzing
// builds, as the container's are, so the fuzzer reaches the parser).
#include "codec/calibration_io.h"
#include "core/capture_io.h"
#include "core/safetensors.h"
#include "kvtc/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const kvtc::SafeTensors st = kvtc::safetensors_parse({data, size}, "fuzz");
    try {
      kvtc::capture_from_safetensors(st, "fuzz");
    } catch (const kvtc::Error&) {
    }
    for (bool decoder_only : {false, true}) {
      try {
        kvtc::calibration_parse({data, size}, "fuzz", decoder_only);
      } catch (const kvtc::Error&) {
      }
    }
  } catch (const kvtc::Error&) {
  }
  return 0;
}
