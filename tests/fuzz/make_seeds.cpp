// Writes seed inputs for the fuzzers: a valid container, capture file,
// calibration file and state blobs (sequence and context) built from the synthetic capture.
#include <cstdio>
#include <string>
#include <vector>

#include "codec/calibration_io.h"
#include "core/capture_io.h"
#include "fuzz_common.h"

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
  write_file_atomic(dir + "/container/seed.kvtc", compress(c, fuzz::small_calibration(), fuzz::small_alloc(), o));
  // Container version 2: entropy-coded chunks (the rANS decoder).
  write_file_atomic(dir + "/container/seed_ecsq.kvtc", compress(c, fuzz::small_calibration(), ecsq_allocation_set(fuzz::small_calibration(), 2), o));
  // Container version 3: the window at 8 bits (raw8 sections).
  o.window_bits = 8;
  write_file_atomic(dir + "/container/seed_raw8.kvtc", compress(c, fuzz::small_calibration(), ecsq_allocation_set(fuzz::small_calibration(), 2), o));
  write_file_atomic(dir + "/safetensors/capture.safetensors", capture_serialize(c));
  write_file_atomic(dir + "/safetensors/calibration.safetensors", calibration_serialize(fuzz::small_calibration()));
  const std::vector<uint8_t> seq_state = state_from_capture(c, StateLayout{{1}, 1, 0});
  write_file_atomic(dir + "/state_blob/seed.bin", seq_state);
  // A context state (llama_state_get_data) holding the same cache.
  write_file_atomic(dir + "/state_blob/seed_context.bin", context_state_join("llama", seq_state, "seed"));
  return 0;
}
