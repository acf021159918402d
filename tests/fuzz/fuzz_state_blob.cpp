// libFuzzer target: llama.cpp state-blob parser and the capture mapping.
#include "core/capture_io.h"
#include "core/state_blob.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kvtc::CacheGeometry g = [] {
    kvtc::CacheGeometry x;
    kvtc::BlockGeometry b;
    b.layers = {0, 1};
    b.n_head_kv = 1;
    b.head_dim = 4;
    x.blocks.push_back(b);
    return x;
  }();
  try {
    const kvtc::SeqBlob b = kvtc::seq_blob_parse({data, size}, size > 0 && (data[0] & 1), "fuzz");
    const kvtc::KvCapture c = kvtc::capture_from_blob(b, g, "fuzz");
    (void)c;
  } catch (const kvtc::Error&) {
  }
  return 0;
}
