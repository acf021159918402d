// Internal: small utilities — hashing, number formatting, CPU feature
// detection. (Public: whole-file I/O in kvtc/files.h, f16 arrays in
// kvtc/cache.h; the scalar f16 and E4M3 math is in scalar.h, shared with
// the GPU.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/scalar.h"
#include "kvtc/cache.h"
#include "kvtc/files.h"

namespace kvtc {

std::string sha256_bytes(std::span<const uint8_t> data);
// "%.9g": enough digits for a float to read back bit for bit.
std::string fmt_g9(double x);

// Runtime CPU features (x86-64 CPUID + XGETBV, so a feature counts only
// when the OS also saves its registers). All false on other architectures.
struct CpuFeatures {
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false, avx512_fp16 = false, avx512_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  std::string brand;  // CPUID brand string, trimmed
};
const CpuFeatures& cpu_features();
// Names of the features present, in a fixed order.
std::vector<std::string> cpu_feature_names(const CpuFeatures& f);

}  // namespace kvtc
