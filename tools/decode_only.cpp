// A decoder-only program: links kvtc_decoder alone (the core, the container
// rules and the CPU decoder: no encoder, no calibration fitting, no
// llama.cpp) to prove the decoder stands by itself.
//   kvtc_decode_only IN.kvtc CALIBRATION [OUT.safetensors]
#include <cstdio>

#include "kvtc/kvtc.h"

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: kvtc_decode_only IN.kvtc CALIBRATION [OUT.safetensors]\n");
    return 2;
  }
  try {
    const kvtc::Calibration cal = kvtc::calibration_load(argv[2], /*decoder_only=*/true);
    const kvtc::KvCapture c = kvtc::decompress(kvtc::read_file(argv[1]), cal, argv[1]);
    if (argc == 4) kvtc::capture_save(argv[3], c);
    std::printf("decoded %u tokens\n", c.blocks[0].n_tokens());
    return 0;
  } catch (const kvtc::Error& e) {
    std::fprintf(stderr, "kvtc_decode_only: error: %s\n", e.what());
    return 1;
  }
}
