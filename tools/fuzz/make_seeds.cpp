// Writes seed inputs for the fuzzers: a valid container, capture file and
// state blob built from the synthetic capture.
#include <cstdio>
#include <string>

#include "fuzz_common.h"
#include "kvtc/kv_capture.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  using namespace kvtc;
  KvCapture c = fuzz::small_capture(48);
  CompressOptions o;
  o.sink = 2;
  o.window = 6;
  o.chunk_tokens = 16;
  write_file_atomic(dir + "/container/seed.kvtc", kvtc_compress(c, fuzz::small_calibration(), fuzz::small_alloc(), o));
  write_file_atomic(dir + "/safetensors/capture.safetensors", safetensors_serialize(capture_to_safetensors(c)));
  SeqBlob empty;
  empty.blocks = {BlobBlock{{BlobStream{}}}};
  std::vector<uint8_t> blob = seq_blob_write(capture_to_blob(c, empty, 1, 0));
  write_file_atomic(dir + "/state_blob/seed.bin", blob);
  return 0;
}
