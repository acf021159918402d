// libFuzzer target: llama.cpp state-blob parser and the capture mapping.
#include "kvtc/error.h"
#include "kvtc/kv_capture.h"
#include "kvtc/state_blob.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    kvtc::SeqBlob b = kvtc::seq_blob_parse({data, size}, size > 0 && (data[0] & 1), "fuzz");
    kvtc::CacheGeometry g{{{0, 1}}, 1, 4, 4};
    kvtc::KvCapture c = kvtc::capture_from_blob(b, g, "fuzz");
    (void)c;
  } catch (const kvtc::Error&) {
  }
  return 0;
}
