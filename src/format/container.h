// Internal: the .kvtc container's bytes (docs/format.md) — file and section
// headers, checksums, DEFLATE of one section, the parser — written once for
// the CPU encoder, the CPU decoder, append and the GPU backend.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvtc/error.h"

namespace kvtc::container {

constexpr uint8_t kMagic[4] = {'K', 'V', 'T', 'C'};
constexpr size_t kFileHeaderBytes = 4 + 4 + 4 + 8;     // magic, version, header_len, header xxh64
constexpr size_t kSectionHeaderBytes = 5 * 4 + 3 * 8;  // kind, block, kv, t0, t1, raw_len, stored_len, xxh64
constexpr uint32_t kMaxHeaderBytes = 16u << 20;

// kRaw8 (version 3): raw tokens at 8 bits (format/raw8.h).
enum SectionKind : uint32_t { kPositions = 1, kTokens = 2, kRaw = 3, kChunk = 4, kRaw8 = 5 };
inline bool is_raw(uint32_t kind) {
  return kind == kRaw || kind == kRaw8;
}
const char* section_name(uint32_t kind);

struct Section {
  uint32_t kind = 0, block = 0, kv = 0, t0 = 0, t1 = 0;
  uint64_t raw_len = 0, stored_len = 0, xxh = 0;
  const uint8_t* data = nullptr;  // stored bytes, inside the parsed buffer
};

uint64_t xxh64(const uint8_t* p, size_t n);

// The file header (magic, version, header length, header checksum) and the
// JSON: kFileHeaderBytes + json.size() bytes at dst.
// `version`: 1 unless an allocation is entropy-coded (2) or the window is
// 8-bit (3) (docs/format.md).
void put_file_header(uint8_t* dst, const std::string& json, uint32_t version = 1);
void write_file_header(std::vector<uint8_t>& o, const std::string& json, uint32_t version = 1);  // appends
// One section header (kSectionHeaderBytes) at dst; xxh is the checksum of
// the stored bytes that follow it.
void put_section_header(uint8_t* dst, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, uint64_t raw_len, uint64_t stored_len,
                        uint64_t xxh);
// DEFLATE of a payload at `level` with libdeflate (one compressor per thread
// and level); empty when level is 0 or coding would not make it smaller.
std::vector<uint8_t> deflate(const std::vector<uint8_t>& payload, int level);
// Appends a section whose payload is `payload` DEFLATE-coded at `level`
// (stored as is when that would not be smaller; raw_len == stored_len marks it).
void write_section(std::vector<uint8_t>& o, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, const std::vector<uint8_t>& payload,
                   int level);
uint64_t section_bound(size_t payload_bytes);

struct Parsed {
  uint32_t version = 0;
  size_t header_end = 0;  // kFileHeaderBytes + header length: where the sections start
  std::string header_json;
  std::vector<Section> sections;
};
// Checks magic, version, lengths and every checksum (the sections' on
// `threads` threads, 0: all); payloads not decoded. Sections point into b.
Parsed parse(const uint8_t* b, size_t size, const std::string& origin, int threads = 1);
inline Parsed parse(std::span<const uint8_t> bytes, const std::string& origin, int threads = 1) {
  return parse(bytes.data(), bytes.size(), origin, threads);
}
// Inflates (or copies) one section's payload to exactly raw_len bytes.
std::vector<uint8_t> payload(const Section& s, const std::string& origin);

}  // namespace kvtc::container
