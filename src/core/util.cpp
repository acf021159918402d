#include "core/util.h"

#include <atomic>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "kvtc/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

#include <algorithm>
#endif

namespace kvtc {
namespace {

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

std::string errno_text() {
  return std::strerror(errno);
}

// Throws IoError("path: what: strerror(errno)"), errno read before the
// message is built (an allocation may change it).
[[noreturn]] void io_fail(const std::string& path, const char* what) {
  const int code = errno;
  throw IoError(path + ": " + what + ": " + std::strerror(code), code);
}

std::string hex(const unsigned char* p, unsigned n) {
  static const char* d = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (unsigned i = 0; i < n; ++i) {
    s[2 * i] = d[p[i] >> 4];
    s[2 * i + 1] = d[p[i] & 15];
  }
  return s;
}

struct Sha256 {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  Sha256() { require(ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1, "sha256: OpenSSL init failed"); }
  ~Sha256() { EVP_MD_CTX_free(ctx); }
  void update(const void* p, size_t n) { EVP_DigestUpdate(ctx, p, n); }
  std::string hexdigest() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned n = 0;
    EVP_DigestFinal_ex(ctx, md, &n);
    return hex(md, n);
  }
};

}  // namespace

std::string sha256_file(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  require(f != nullptr, path + ": cannot open for reading: " + errno_text());
  Sha256 h;
  std::vector<unsigned char> buf(1 << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f.get())) > 0) h.update(buf.data(), n);
  require(!std::ferror(f.get()), path + ": read error: " + errno_text());
  return h.hexdigest();
}

std::string fmt_g9(double x) {
  char b[64];
  std::snprintf(b, sizeof b, "%.9g", x);
  return b;
}

std::string sha256_bytes(std::span<const uint8_t> data) {
  Sha256 h;
  h.update(data.data(), data.size());
  return h.hexdigest();
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw IoError(path + ": is a directory, expected a file", EISDIR);
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) io_fail(path, "cannot open for reading");
  std::vector<uint8_t> out;
  std::vector<uint8_t> buf(1 << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f.get())) > 0) out.insert(out.end(), buf.begin(), buf.begin() + n);
  if (std::ferror(f.get())) io_fail(path, "read error");
  return out;
}

void write_file_atomic(const std::string& path, std::span<const uint8_t> data) {
  write_file_atomic(path, data, true);
}

void sync_directory(const std::string& dir, const std::string& path) {
  // EINVAL: the file system has nothing to sync for directories.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) io_fail(path, "renamed into place, but its directory cannot be opened to sync it");
  if (::fsync(dfd) != 0 && errno != EINVAL) {
    const int code = errno;
    ::close(dfd);
    throw IoError(path + ": renamed into place, but syncing its directory failed: " + std::strerror(code), code);
  }
  ::close(dfd);
}

void write_file_atomic(const std::string& path, std::span<const uint8_t> data, bool sync_dir) {
  namespace fs = std::filesystem;
  fs::path target(path);
  std::error_code ec;
  if (fs::is_directory(target, ec)) throw IoError(path + ": is a directory, expected a file path to write", EISDIR);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  // Appended piece by piece: GCC 12 warns falsely (-Wrestrict, its bug
  // 105329) on "." + std::string.
  std::string base = ".";
  base += target.filename().string();
  base += ".tmp-XXXXXX";
  const std::string tmpl = (dir / base).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0) {
    const int code = errno;
    throw IoError(path + ": cannot create a temporary file in " + dir.string() + ": " + std::strerror(code), code);
  }
  std::string tmp(name.data());
  auto fail = [&](const std::string& what) {
    const int code = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw IoError(path + ": " + what + ": " + std::strerror(code), code);
  };
  size_t off = 0;
  while (off < data.size()) {
    ssize_t w = ::write(fd, data.data() + off, data.size() - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("write failed");
    }
    off += static_cast<size_t>(w);
  }
  if (::fchmod(fd, 0644) != 0) fail("chmod failed");
  if (::fsync(fd) != 0) fail("fsync failed");
  if (::close(fd) != 0) {
    const int code = errno;
    ::unlink(tmp.c_str());
    throw IoError(path + ": close failed: " + std::strerror(code), code);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int code = errno;
    ::unlink(tmp.c_str());
    throw IoError(path + ": cannot rename the temporary file into place: " + std::strerror(code), code);
  }
  // The new name lives in the directory: until the directory is synced, a
  // crash can bring back the old name (or none) even though the file's
  // bytes were synced above.
  if (sync_dir) sync_directory(dir.string(), path);
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, cx, d;
    if (!__get_cpuid(0, &a, &b, &cx, &d)) return c;
    unsigned max_leaf = a;
    __get_cpuid(1, &a, &b, &cx, &d);
    bool osxsave = cx & (1u << 27);
    uint64_t xcr0 = 0;
    if (osxsave) {
      unsigned lo, hi;
      __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      xcr0 = (uint64_t(hi) << 32) | lo;
    }
    bool ymm = (xcr0 & 0x6) == 0x6;           // SSE + AVX state
    bool zmm = ymm && (xcr0 & 0xe0) == 0xe0;  // opmask + ZMM state
    bool tmm = (xcr0 & 0x60000) == 0x60000;   // AMX tile config + data
    c.sse42 = cx & (1u << 20);
    c.avx = ymm && (cx & (1u << 28));
    c.fma = ymm && (cx & (1u << 12));
    c.f16c = ymm && (cx & (1u << 29));
    if (max_leaf >= 7) {
      __cpuid_count(7, 0, a, b, cx, d);
      c.avx2 = ymm && (b & (1u << 5));
      c.bmi2 = b & (1u << 8);
      c.avx512f = zmm && (b & (1u << 16));
      c.avx512bw = zmm && (b & (1u << 30));
      c.avx512vl = zmm && (b & (1u << 31));
      c.avx512dq = zmm && (b & (1u << 17));
      c.avx512cd = zmm && (b & (1u << 28));
      c.avx512_vbmi = zmm && (cx & (1u << 1));
      c.avx512_vnni = zmm && (cx & (1u << 11));
      c.avx512_fp16 = zmm && (d & (1u << 23));
      c.amx_bf16 = tmm && (d & (1u << 22));
      c.amx_tile = tmm && (d & (1u << 24));
      c.amx_int8 = tmm && (d & (1u << 25));
      unsigned a1, b1, c1, d1;
      __cpuid_count(7, 1, a1, b1, c1, d1);
      c.avx512_bf16 = zmm && (a1 & (1u << 5));
    }
    __get_cpuid(0x80000000, &a, &b, &cx, &d);
    if (a >= 0x80000004) {
      unsigned r[12];
      for (unsigned i = 0; i < 3; ++i) __get_cpuid(0x80000002 + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
      std::string s(reinterpret_cast<const char*>(r), 48);
      s = s.c_str();
      size_t b0 = s.find_first_not_of(' '), e0 = s.find_last_not_of(' ');
      c.brand = b0 == std::string::npos ? "" : s.substr(b0, e0 - b0 + 1);
    }
#endif
    return c;
  }();
  return f;
}

std::vector<std::string> cpu_feature_names(const CpuFeatures& f) {
  std::vector<std::string> v;
  auto add = [&](bool on, const char* n) {
    if (on) v.emplace_back(n);
  };
  add(f.sse42, "sse4.2");
  add(f.avx, "avx");
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.bmi2, "bmi2");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512cd, "avx512cd");
  add(f.avx512dq, "avx512dq");
  add(f.avx512_vbmi, "avx512_vbmi");
  add(f.avx512_vnni, "avx512_vnni");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.avx512_fp16, "avx512_fp16");
  add(f.amx_tile, "amx_tile");
  add(f.amx_bf16, "amx_bf16");
  add(f.amx_int8, "amx_int8");
  return v;
}

}  // namespace kvtc

namespace kvtc {

namespace {

#if defined(__x86_64__)
// F16C converts 8 values per instruction; VCVTPS2PH with imm 0 rounds to
// nearest even, as f32_to_f16 does (checked in tests/test_util.cpp).
__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = f16_to_f32(in[i]);
}
__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = f32_to_f16(in[i]);
}
#endif

}  // namespace

namespace {
std::atomic<bool> g_vector_kernels{true};
}  // namespace

void set_vector_kernels(bool on) {
  g_vector_kernels = on;
}
bool vector_kernels() {
  return g_vector_kernels;
}

void f16_to_f32_n(const uint16_t* in, float* out, size_t n) {
#if defined(__x86_64__)
  static const bool f16c = cpu_features().f16c && cpu_features().avx;
  if (f16c) return f16_to_f32_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(in[i]);
}

void f32_to_f16_n(const float* in, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  static const bool f16c = cpu_features().f16c && cpu_features().avx;
  if (f16c) return f32_to_f16_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

void advise_huge_pages(const void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1), e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);  // advice: a refusal changes nothing but the time
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace kvtc
