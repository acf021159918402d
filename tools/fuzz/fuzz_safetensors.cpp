// libFuzzer target: safetensors parser, capture and calibration readers.
#include "kvtc/calibration.h"
#include "kvtc/error.h"
#include "kvtc/kv_capture.h"
#include "kvtc/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    kvtc::SafeTensors st = kvtc::safetensors_parse({data, size}, "fuzz");
    try {
      kvtc::capture_from_safetensors(st, "fuzz");
    } catch (const kvtc::Error&) {
    }
    try {
      kvtc::calibration_from_safetensors(st, "fuzz");
    } catch (const kvtc::Error&) {
    }
  } catch (const kvtc::Error&) {
  }
  return 0;
}
