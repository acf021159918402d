#include "format/container.h"

#include <libdeflate.h>
#include <xxhash.h>

#include <cstring>
#include <memory>

#include "core/parallel.h"
#include "kvtc/codec.h"

namespace kvtc::container {

const char* section_name(uint32_t kind) {
  switch (kind) {
    case kPositions: return "positions";
    case kTokens: return "tokens";
    case kRaw: return "raw";
    case kChunk: return "chunk";
    case kRaw8: return "raw8";
    default: return "unknown";
  }
}

uint64_t xxh64(const uint8_t* p, size_t n) {
  return XXH64(p, n, 0);
}

namespace {

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

}  // namespace

static uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
static uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

void put_file_header(uint8_t* dst, const std::string& json, uint32_t version) {
  require(json.size() <= kMaxHeaderBytes, "compress: header too large");
  std::memcpy(dst, kMagic, 4);
  put32(dst + 4, version);
  put32(dst + 8, uint32_t(json.size()));
  put64(dst + 12, xxh64(reinterpret_cast<const uint8_t*>(json.data()), json.size()));
  std::memcpy(dst + kFileHeaderBytes, json.data(), json.size());
}

void write_file_header(std::vector<uint8_t>& o, const std::string& json, uint32_t version) {
  const size_t at = o.size();
  o.resize(at + kFileHeaderBytes + json.size());
  put_file_header(o.data() + at, json, version);
}

void put_section_header(uint8_t* dst, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, uint64_t raw_len, uint64_t stored_len,
                        uint64_t xxh) {
  put32(dst, kind);
  put32(dst + 4, block);
  put32(dst + 8, kv);
  put32(dst + 12, t0);
  put32(dst + 16, t1);
  put64(dst + 20, raw_len);
  put64(dst + 28, stored_len);
  put64(dst + 36, xxh);
}

struct CompressorDeleter {
  void operator()(libdeflate_compressor* c) const { libdeflate_free_compressor(c); }
};
struct DecompressorDeleter {
  void operator()(libdeflate_decompressor* d) const { libdeflate_free_decompressor(d); }
};

uint64_t section_bound(size_t payload_bytes) {
  // libdeflate's documented bound for one stream (its own formula, level
  // independent): compress_bound(NULL, n).
  return kSectionHeaderBytes + libdeflate_deflate_compress_bound(nullptr, payload_bytes);
}

std::vector<uint8_t> deflate(const std::vector<uint8_t>& payload, int level) {
  if (level <= 0 || payload.empty()) return {};
  // One compressor per thread and level: allocating one costs more than
  // compressing a small section (libdeflate's level-6 state is ~0.5 MB).
  thread_local std::unique_ptr<libdeflate_compressor, CompressorDeleter> c;
  thread_local int c_level = -1;
  if (!c || c_level != level) {
    c.reset(libdeflate_alloc_compressor(level));
    c_level = level;
  }
  require(c != nullptr, "kvtc: libdeflate could not allocate a compressor");
  std::vector<uint8_t> stored(libdeflate_deflate_compress_bound(c.get(), payload.size()));
  const size_t n = libdeflate_deflate_compress(c.get(), payload.data(), payload.size(), stored.data(), stored.size());
  if (n == 0 || n >= payload.size()) return {};  // incompressible: the caller stores it
  stored.resize(n);
  return stored;
}

void write_section(std::vector<uint8_t>& o, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, const std::vector<uint8_t>& payload,
                   int level) {
  const std::vector<uint8_t> d = deflate(payload, level);
  const std::vector<uint8_t>& stored = d.empty() ? payload : d;
  const size_t at = o.size();
  o.resize(at + kSectionHeaderBytes);
  put_section_header(o.data() + at, kind, block, kv, t0, t1, payload.size(), stored.size(), xxh64(stored.data(), stored.size()));
  o.insert(o.end(), stored.begin(), stored.end());
}

Parsed parse(const uint8_t* b, size_t size, const std::string& origin, int threads) {
  Parsed out;
  require(size >= kFileHeaderBytes, origin + ": not a .kvtc container (" + std::to_string(size) + " bytes, the 20-byte file header is missing)");
  require(std::memcmp(b, kMagic, 4) == 0, origin + ": not a .kvtc container (magic is not 'KVTC')");
  out.version = get_u32(b + 4);
  require(out.version >= 1 && out.version <= kContainerVersion,
          origin + ": container version " + std::to_string(out.version) + ", this kvtc reads versions 1 to " + std::to_string(kContainerVersion));
  const uint32_t hl = get_u32(b + 8);
  require(hl <= kMaxHeaderBytes && hl <= size - kFileHeaderBytes,
          origin + ": header_len " + std::to_string(hl) + " exceeds the file (" + std::to_string(size) + " bytes; truncated?)");
  const uint8_t* h = b + kFileHeaderBytes;
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  require(xxh64(h, hl) == get_u64(b + 12), origin + ": header checksum mismatch (corrupted file)");
#endif
  out.header_json.assign(reinterpret_cast<const char*>(h), hl);
  size_t off = kFileHeaderBytes + hl;
  out.header_end = off;
  std::vector<size_t> at;
  while (off < size) {
    const std::string where = origin + ": section " + std::to_string(out.sections.size()) + " at byte " + std::to_string(off);
    require(size - off >= kSectionHeaderBytes, where + ": truncated section header");
    Section s;
    const uint8_t* p = b + off;
    s.kind = get_u32(p);
    s.block = get_u32(p + 4);
    s.kv = get_u32(p + 8);
    s.t0 = get_u32(p + 12);
    s.t1 = get_u32(p + 16);
    s.raw_len = get_u64(p + 20);
    s.stored_len = get_u64(p + 28);
    s.xxh = get_u64(p + 36);
    at.push_back(off);
    off += kSectionHeaderBytes;
    require(s.kind >= kPositions && s.kind <= kRaw8, where + ": unknown section kind " + std::to_string(s.kind));
    require(s.stored_len <= size - off,
            where + ": stored_len " + std::to_string(s.stored_len) + " exceeds the " + std::to_string(size - off) + " bytes left (truncated file?)");
    require(s.raw_len <= (uint64_t(1) << 36) && s.stored_len <= s.raw_len, where + ": implausible lengths");
    s.data = b + off;
    off += s.stored_len;
    out.sections.push_back(s);
  }
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  // Checksums once the walk is done, on `threads` threads (~10 GB/s each).
  std::vector<uint8_t> bad(out.sections.size(), 0);
  detail::parallel_for(out.sections.size(), detail::resolve_threads(threads, out.sections.size()), [&](size_t i) {
    const Section& s = out.sections[i];
    bad[i] = xxh64(s.data, s.stored_len) != s.xxh;
  });
  for (size_t i = 0; i < bad.size(); ++i)
    require(!bad[i], origin + ": section " + std::to_string(i) + " at byte " + std::to_string(at[i]) + " (" + section_name(out.sections[i].kind) +
                         "): checksum mismatch (corrupted file)");
#endif
  return out;
}

std::vector<uint8_t> payload(const Section& s, const std::string& origin) {
  std::vector<uint8_t> out(s.raw_len);
  if (s.stored_len == s.raw_len) {
    if (s.raw_len) std::memcpy(out.data(), s.data, s.raw_len);
    return out;
  }
  thread_local std::unique_ptr<libdeflate_decompressor, DecompressorDeleter> d(libdeflate_alloc_decompressor());
  require(d != nullptr, "kvtc: libdeflate could not allocate a decompressor");
  size_t actual = 0;
  libdeflate_result r = libdeflate_deflate_decompress(d.get(), s.data, s.stored_len, out.data(), out.size(), &actual);
  require(
      r == LIBDEFLATE_SUCCESS && actual == s.raw_len,
      origin + ": " + section_name(s.kind) + " section: DEFLATE stream is corrupt or does not inflate to " + std::to_string(s.raw_len) + " bytes");
  return out;
}

}  // namespace kvtc::container
