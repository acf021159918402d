// What tests/test_golden.cpp and the tool that writes its files
// (tests/golden_regenerate.cpp) share: the options every golden container
// was written with, and the checksum of a decoded cache.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/util.h"
#include "kvtc/kvtc.h"

namespace kvtc::golden {

// The options every golden file was written with (both versions).
inline CompressOptions options(int threads = 0) {
  CompressOptions o;
  o.sink = 2;
  o.window = 8;
  o.chunk_tokens = 16;
  o.threads = threads;
  o.precision = Precision::kF32;  // reproducible on any machine
  return o;
}

// Version 3's: the same, with the window at 8 bits.
inline CompressOptions options_v3(int threads = 0) {
  CompressOptions o = options(threads);
  o.window_bits = 8;
  return o;
}

// Version 4's: chunks of 64 tokens (its 32 rANS states take 132 bytes a
// chunk, more than half of what a 16-token chunk of 16 components has at
// 2x).
inline CompressOptions options_v4(int threads = 0) {
  CompressOptions o = options(threads);
  o.chunk_tokens = 64;
  return o;
}

// The decode the checksums pin: the CPU path with an f32 projection. The
// golden calibration's basis is the identity (tests/fuzz/fuzz_common.h), so
// every projected value is one exact product plus exact zeros, whatever
// order a BLAS kernel sums them in: the same bits on every CPU (checked
// with OPENBLAS_CORETYPE=Prescott, Sandybridge, Haswell, SkylakeX and the
// default here). bf16 (precision auto on AVX512-BF16) rounds the inputs
// and gives other bits, so it is not pinned.
inline DecompressOptions decode_options() {
  DecompressOptions o;
  o.precision = Precision::kF32;
  return o;
}

// SHA-256 of the decoded f16 tensors: every block's K, then its V, as
// little-endian f16 bits.
inline std::string decoded_checksum(const KvCapture& c) {
  std::vector<uint8_t> bytes;
  for (const KvBlock& b : c.blocks)
    for (const std::vector<uint16_t>* a : {&b.k, &b.v}) {
      const auto* p = reinterpret_cast<const uint8_t*>(a->data());
      bytes.insert(bytes.end(), p, p + a->size() * sizeof(uint16_t));
    }
  return sha256_bytes(bytes);
}

}  // namespace kvtc::golden
