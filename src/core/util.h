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
#include "kvtc/error.h"
#include "kvtc/files.h"

namespace kvtc {

// What read_file and write_file_atomic throw when the system refuses the
// I/O (open, read, write, fsync, rename: EACCES, EMFILE, EIO, ENOSPC,
// ENOENT, EISDIR ...), as opposed to an Error about the bytes themselves:
// a reader that checks the bytes (the prompt store's disk tier) deletes a
// file whose bytes are wrong but keeps one it merely could not read this
// time. code() is the errno.
class IoError : public Error {
 public:
  IoError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// write_file_atomic (kvtc/files.h) without the directory's fsync when
// sync_dir is false: for a writer that renames several files into one
// directory and syncs it once after the last (sync_directory), as the
// prompt store's disk tier does with a prompt's chunks (on ext4 here a
// directory fsync doubles the cost of a 60 KB file: 2.6 -> 5.7 ms).
void write_file_atomic(const std::string& path, std::span<const uint8_t> data, bool sync_dir);
// fsyncs directory `dir` (what makes renames into it survive a crash);
// IoError names `path`, the file renamed there.
void sync_directory(const std::string& dir, const std::string& path);

std::string sha256_bytes(std::span<const uint8_t> data);
// "%.9g": enough digits for a float to read back bit for bit.
std::string fmt_g9(double x);

// Runtime CPU features (x86-64 CPUID + XGETBV, so a feature counts only
// when the OS also saves its registers). All false on other architectures.
struct CpuFeatures {
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false, avx512_fp16 = false, avx512_vnni = false;
  bool avx512cd = false, avx512dq = false, avx512_vbmi = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  std::string brand;  // CPUID brand string, trimmed
};
const CpuFeatures& cpu_features();
// Whether the decoder's AVX-512 conversion kernels (the int8 path's codes,
// re-RoPE with f16 rounding) run where the CPU has them (the default), or
// their scalar forms everywhere: the same bits either way, the control
// kvtc-lab bench --scalar-kernels measures them against. Process-wide; set
// it between codec calls (lab_support.h declares it for the tools).
void set_vector_kernels(bool on);
bool vector_kernels();

// Asks the kernel for transparent huge pages over the whole 2 MiB pages
// inside [p, p + bytes) (Linux madvise(MADV_HUGEPAGE); a no-op elsewhere,
// for less than 2 MiB, or where the kernel says no). For a large buffer
// about to be written for the first time: a decoded 8K-token SmolLM2 cache
// (189 MB) took ~185 ms to zero-fill in 4 KiB pages on a 2-core KVM EPYC,
// ~20-25 ms in huge pages (and up to ~400 ms the first time the kernel
// had to compact memory for them).
void advise_huge_pages(const void* p, size_t bytes);
// v.reserve(n), then the advice above over those n elements.
template <class T>
void reserve_huge_pages(std::vector<T>& v, size_t n) {
  v.reserve(n);
  advise_huge_pages(v.data(), n * sizeof(T));
}
// Names of the features present, in a fixed order.
std::vector<std::string> cpu_feature_names(const CpuFeatures& f);

}  // namespace kvtc
