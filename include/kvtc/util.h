// kvtc: small utilities — hashing, whole-file I/O with atomic replace,
// CPU feature detection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvtc {

// Lower-case hex SHA-256 of a file's contents, streamed in 1 MiB reads.
// Throws Error naming the path when it cannot be read.
std::string sha256_file(const std::string& path);
std::string sha256_bytes(std::span<const uint8_t> data);

// Reads a whole file. Throws Error naming the path on failure.
std::vector<uint8_t> read_file(const std::string& path);

// Writes `data` to `path` atomically: the bytes go to a temporary file in
// the same directory, are flushed, and the temporary is renamed over `path`.
// On any failure the temporary is removed, `path` is left as it was, and
// Error names the path. Safe to call from several threads on distinct paths.
void write_file_atomic(const std::string& path, std::span<const uint8_t> data);

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

// IEEE binary16 <-> binary32, exact for every finite half and for inf/NaN.
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even
// The same over arrays; F16C instructions where the CPU has them (chosen at
// run time), the scalar functions otherwise. Results are identical.
void f16_to_f32_n(const uint16_t* in, float* out, size_t n);
void f32_to_f16_n(const float* in, uint16_t* out, size_t n);

}  // namespace kvtc
