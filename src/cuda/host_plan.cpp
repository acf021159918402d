#include "host_plan.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <nlohmann/json.hpp>

#include "../codec/parallel.h"
#include "kvtc/error.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"

namespace kvtc::cuda {

using namespace container;

uint32_t r_used(const std::vector<BlockAlloc>& a) {
  return a.empty() ? 0 : a.back().start + a.back().size;
}

TokenLayout token_layout(uint32_t n, uint32_t sink, uint32_t window) {
  const uint32_t s_end = std::min(sink, n);
  return {s_end, std::max(s_end, n > window ? n - window : 0u)};
}

std::vector<std::pair<uint32_t, uint32_t>> chunk_ranges(uint32_t c0, uint32_t c1, uint32_t chunk_tokens) {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (uint32_t t = c0; t < c1; t += chunk_tokens) out.push_back({t, std::min(c1, t + chunk_tokens)});
  return out;
}

size_t packed_chunk_bytes(const std::vector<BlockAlloc>& alloc, uint32_t n) {
  size_t b = 0;
  for (const BlockAlloc& a : alloc) {
    if (a.type == QType::kNone) continue;
    b += size_t(n) * qtype_param_bits(a.type) / 8;
    b += (size_t(n) * a.size * qtype_code_bits(a.type) + 7) / 8;
  }
  return b;
}

uint32_t chunk_tokens_fitting(const AllocationSet& alloc, uint32_t limit, size_t max_bytes) {
  uint32_t best = 0;
  for (uint32_t n = 16; n <= limit; n += 16) {
    bool ok = true;
    for (const auto& bk : alloc)
      for (const Allocation& a : bk) ok = ok && packed_chunk_bytes(a.blocks, n) <= max_bytes;
    if (!ok) break;  // bytes grow with n
    best = n;
  }
  return best;
}

size_t append_chunk_segments(const std::vector<BlockAlloc>& alloc, uint32_t row0, uint32_t n, uint64_t off, bool include_none,
                             std::vector<QSeg>& segs) {
  size_t bytes = 0;
  for (const BlockAlloc& a : alloc) {
    if (a.type == QType::kNone) {
      if (include_none) segs.push_back({off + bytes, row0, n, a.start, a.size, uint32_t(a.type), 0});
      continue;
    }
    segs.push_back({off + bytes, row0, n, a.start, a.size, uint32_t(a.type), 0});
    bytes += size_t(n) * qtype_param_bits(a.type) / 8;
    bytes += (size_t(n) * a.size * qtype_code_bits(a.type) + 7) / 8;
  }
  return bytes;
}

void append_encode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles) {
  for (size_t i = first; i < segs.size(); ++i) {
    const QSeg& s = segs[i];
    if (QType(s.type) == QType::kNone) continue;
    const size_t bytes = (size_t(s.n) * s.size * qtype_code_bits(QType(s.type)) + 7) / 8;
    for (size_t b = 0; b < bytes; b += kEncTileBytes) tiles.push_back({uint32_t(i), uint32_t(b)});
  }
}

void append_decode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles) {
  for (size_t i = first; i < segs.size(); ++i) {
    const size_t codes = size_t(segs[i].n) * segs[i].size;
    for (size_t c = 0; c < codes; c += kDecTileCodes) tiles.push_back({uint32_t(i), uint32_t(c)});
  }
}

std::vector<uint8_t> pack_reference(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc) {
  std::vector<uint8_t> packed(packed_chunk_bytes(alloc, n), 0);
  size_t off = 0;
  std::vector<uint16_t> params(size_t(n) * 2);
  std::vector<uint8_t> codes;
  for (const BlockAlloc& blk : alloc) {
    if (blk.type == QType::kNone) continue;
    codes.resize(size_t(n) * blk.size);
    for (uint32_t t = 0; t < n; ++t)
      quantize_block(blk.type, d + size_t(t) * ld + blk.start, blk.size, &codes[size_t(t) * blk.size], &params[size_t(t) * 2]);
    const uint32_t np = qtype_param_bits(blk.type) / 16;
    for (uint32_t k = 0; k < np; ++k) {
      for (uint32_t t = 0; t < n; ++t) packed[off + t] = uint8_t(params[size_t(t) * 2 + k]);
      for (uint32_t t = 0; t < n; ++t) packed[off + n + t] = uint8_t(params[size_t(t) * 2 + k] >> 8);
      off += 2 * size_t(n);
    }
    const uint32_t cb = qtype_code_bits(blk.type);
    size_t j = 0;
    for (uint32_t i = 0; i < blk.size; ++i)
      for (uint32_t t = 0; t < n; ++t, ++j) {
        const size_t bit = j * cb;
        packed[off + (bit >> 3)] = uint8_t(packed[off + (bit >> 3)] | (codes[size_t(t) * blk.size + i] << (bit & 7)));
      }
    off += (size_t(n) * blk.size * cb + 7) / 8;
  }
  return packed;
}

// ---------------------------------------------------------------- encode

void check_compress_inputs(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  require(!c.blocks.empty(), "compress: empty capture");
  auto it = c.meta.find("model_sha256");
  auto jt = cal.meta.find("model_sha256");
  require(it != c.meta.end() && jt != cal.meta.end() && it->second == jt->second,
          "compress: the capture comes from model " + (it == c.meta.end() ? std::string("?") : it->second.substr(0, 16)) +
              "…, the calibration from " + (jt == cal.meta.end() ? std::string("?") : jt->second.substr(0, 16)) +
              "… (wrong calibration for this model)");
  require(c.blocks.size() == cal.blocks.size() && alloc.size() == c.blocks.size(),
          "compress: capture, calibration and allocation disagree on the block count");
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      require(cal.blocks[b][kv].p == feature_dim(c.blocks[b]),
              "compress: block " + std::to_string(b) + " feature count differs from the calibration's");
      require(r_used(alloc[b][kv].blocks) <= cal.blocks[b][kv].r, "compress: allocation uses more components than the calibration holds");
    }
  require(opt.chunk_tokens >= 16 && opt.chunk_tokens % 16 == 0 && opt.chunk_tokens <= 65536,
          "compress: chunk_tokens must be a multiple of 16 in 16..65536");
  require(opt.deflate_level >= 0 && opt.deflate_level <= 12, "compress: deflate level must be 0..12");
  if (!c.tokens.empty()) require(c.tokens.size() == c.blocks[0].n_tokens(), "compress: tokens and positions differ in length");
}

std::string encode_header_json(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  nlohmann::ordered_json h;
  h["format"] = "kvtc";
  h["version"] = kContainerVersion;
  h["calibration_id"] = cal.id;
  h["model_sha256"] = c.meta.at("model_sha256");
  h["sink"] = opt.sink;
  h["window"] = opt.window;
  h["chunk_tokens"] = opt.chunk_tokens;
  h["deflate_level"] = opt.deflate_level;
  h["has_tokens"] = !c.tokens.empty();
  h["keys_rope"] = calibration_keys_derope(cal) ? "removed" : "kept";
  h["capture_meta"] = c.meta;
  h["blocks"] = nlohmann::json::array();
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    nlohmann::ordered_json jb;
    jb["layers"] = kb.layers;
    jb["n_head_kv"] = kb.n_head_kv;
    jb["head_dim"] = kb.head_dim;
    jb["nominal_ratio"] = {alloc[b][0].nominal_ratio, alloc[b][1].nominal_ratio};
    jb["alloc"] = nlohmann::ordered_json::array();
    for (int kv = 0; kv < 2; ++kv) {
      nlohmann::ordered_json a = nlohmann::ordered_json::array();
      for (const BlockAlloc& x : alloc[b][kv].blocks) a.push_back({x.start, x.size, int(x.type)});
      jb["alloc"].push_back(a);
    }
    h["blocks"].push_back(jb);
  }
  std::string s = h.dump();
  require(s.size() <= kMaxHeaderBytes, "compress: header too large");
  return s;
}

static void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
static void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
static uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
static uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

void put_file_header(uint8_t* dst, const std::string& json) {
  std::memcpy(dst, kMagic, 4);
  put32(dst + 4, kContainerVersion);
  put32(dst + 8, uint32_t(json.size()));
  put64(dst + 12, xxh64(reinterpret_cast<const uint8_t*>(json.data()), json.size()));
  std::memcpy(dst + kFileHeaderBytes, json.data(), json.size());
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

// ---------------------------------------------------------------- decode

namespace {

using json = nlohmann::json;

// container::parse with the section checksums verified in parallel.
Parsed parse_parallel(const uint8_t* b, size_t size, const std::string& origin, int threads) {
  Parsed out;
  require(size >= kFileHeaderBytes, origin + ": not a .kvtc container (" + std::to_string(size) + " bytes, the 20-byte file header is missing)");
  require(std::memcmp(b, kMagic, 4) == 0, origin + ": not a .kvtc container (magic is not 'KVTC')");
  out.version = get32(b + 4);
  require(out.version == 1, origin + ": container version " + std::to_string(out.version) + ", this kvtc reads version 1");
  const uint32_t hl = get32(b + 8);
  require(hl <= kMaxHeaderBytes && hl <= size - kFileHeaderBytes,
          origin + ": header_len " + std::to_string(hl) + " exceeds the file (" + std::to_string(size) + " bytes; truncated?)");
  const uint8_t* h = b + kFileHeaderBytes;
  require(xxh64(h, hl) == get64(b + 12), origin + ": header checksum mismatch (corrupted file)");
  out.header_json.assign(reinterpret_cast<const char*>(h), hl);
  size_t off = kFileHeaderBytes + hl;
  std::vector<size_t> at;
  while (off < size) {
    const std::string where = origin + ": section " + std::to_string(out.sections.size()) + " at byte " + std::to_string(off);
    require(size - off >= kSectionHeaderBytes, where + ": truncated section header");
    Section s;
    const uint8_t* p = b + off;
    s.kind = get32(p);
    s.block = get32(p + 4);
    s.kv = get32(p + 8);
    s.t0 = get32(p + 12);
    s.t1 = get32(p + 16);
    s.raw_len = get64(p + 20);
    s.stored_len = get64(p + 28);
    s.xxh = get64(p + 36);
    at.push_back(off);
    off += kSectionHeaderBytes;
    require(s.kind >= kPositions && s.kind <= kChunk, where + ": unknown section kind " + std::to_string(s.kind));
    require(s.stored_len <= size - off,
            where + ": stored_len " + std::to_string(s.stored_len) + " exceeds the " + std::to_string(size - off) + " bytes left (truncated file?)");
    require(s.raw_len <= (uint64_t(1) << 36) && s.stored_len <= s.raw_len, where + ": implausible lengths");
    s.data = b + off;
    off += s.stored_len;
    out.sections.push_back(s);
  }
  std::vector<uint8_t> bad(out.sections.size(), 0);
  detail::parallel_for(out.sections.size(), detail::resolve_threads(threads, out.sections.size()), [&](size_t i) {
    const Section& s = out.sections[i];
    bad[i] = xxh64(s.data, s.stored_len) != s.xxh;
  });
  for (size_t i = 0; i < bad.size(); ++i)
    require(!bad[i], origin + ": section " + std::to_string(i) + " at byte " + std::to_string(at[i]) + " (" + section_name(out.sections[i].kind) +
                         "): checksum mismatch (corrupted file)");
  return out;
}

DecodeHeader parse_header(const std::string& js, const std::string& origin) {
  DecodeHeader h;
  try {
    json j = json::parse(js);
    require(j.at("format") == "kvtc", "format is not 'kvtc'");
    h.calibration_id = j.at("calibration_id").get<std::string>();
    h.model_sha256 = j.at("model_sha256").get<std::string>();
    h.sink = j.at("sink").get<uint32_t>();
    h.window = j.at("window").get<uint32_t>();
    h.chunk_tokens = j.at("chunk_tokens").get<uint32_t>();
    h.has_tokens = j.at("has_tokens").get<bool>();
    const std::string kr = j.value("keys_rope", std::string("removed"));
    require(kr == "removed" || kr == "kept", "keys_rope must be 'removed' or 'kept', got '" + kr + "'");
    h.keys_derope = kr == "removed";
    h.capture_meta = j.at("capture_meta").get<std::map<std::string, std::string>>();
    require(h.chunk_tokens >= 1 && h.chunk_tokens <= 65536, "chunk_tokens out of range");
    const json& bl = j.at("blocks");
    require(bl.is_array() && bl.size() >= 1 && bl.size() <= 2, "blocks must hold 1 or 2 entries");
    for (const json& b : bl) {
      DecodeBlock x;
      x.layers = b.at("layers").get<std::vector<int32_t>>();
      x.n_head_kv = b.at("n_head_kv").get<uint32_t>();
      x.head_dim = b.at("head_dim").get<uint32_t>();
      require(!x.layers.empty() && x.layers.size() <= 4096 && x.n_head_kv >= 1 && x.n_head_kv <= 4096 && x.head_dim >= 1 && x.head_dim <= 4096,
              "block geometry out of range");
      require(uint64_t(x.layers.size()) * x.n_head_kv * x.head_dim <= (1u << 20), "block feature count out of range");
      for (int kv = 0; kv < 2; ++kv) {
        uint32_t next = 0;
        for (const json& a : b.at("alloc").at(kv)) {
          const int ty = a.at(2).get<int>();
          BlockAlloc ba{a.at(0).get<uint32_t>(), a.at(1).get<uint32_t>(), QType(ty)};
          require(ba.start == next && ba.size >= 1 && ba.size <= 4096 && ty >= 0 && ty < kNumQTypes, "allocation blocks must tile a prefix");
          next = ba.start + ba.size;
          x.alloc[kv].push_back(ba);
        }
        x.r_used[kv] = next;
      }
      h.blocks.push_back(std::move(x));
    }
  } catch (const Error& e) {
    throw Error(origin + ": container header: " + e.what());
  } catch (const std::exception& e) {
    throw Error(origin + ": container header is malformed: " + e.what());
  }
  return h;
}

}  // namespace

DecodePlan plan_decode(const uint8_t* bytes, size_t size, const Calibration& cal, const std::string& origin, int threads) {
  Parsed P = parse_parallel(bytes, size, origin, threads);
  DecodePlan D;
  D.H = parse_header(P.header_json, origin);
  DecodeHeader& H = D.H;
  require(H.calibration_id == cal.id, origin + ": encoded with calibration " + H.calibration_id.substr(0, 16) + "…, but the calibration given is " +
                                          cal.id.substr(0, 16) + "… (wrong calibration file)");
  require(H.blocks.size() == cal.blocks.size(), origin + ": block count differs from the calibration's");
  require(H.keys_derope == calibration_keys_derope(cal),
          origin + ": header keys_rope says " + (H.keys_derope ? "removed" : "kept") + ", the calibration's meta keys_rope the opposite");
  for (const Section& s : P.sections)
    require(s.block < H.blocks.size(), origin + ": " + section_name(s.kind) + " section: block " + std::to_string(s.block) + " does not exist");
  // Token counts from the positions sections, which must tile [0, n).
  for (size_t b = 0; b < H.blocks.size(); ++b) {
    std::vector<std::pair<uint32_t, uint32_t>> r;
    for (const Section& s : P.sections)
      if (s.kind == kPositions && s.block == b) r.push_back({s.t0, s.t1});
    std::sort(r.begin(), r.end());
    uint32_t next = 0;
    for (auto [t0, t1] : r) {
      require(t0 == next && t1 > t0, origin + ": positions sections of block " + std::to_string(b) + " do not tile the tokens (gap or overlap at " +
                                         std::to_string(next) + ")");
      next = t1;
    }
    require(next >= 1 && next <= (1u << 24), origin + ": block " + std::to_string(b) + " has no positions (truncated file?)");
    H.blocks[b].n_tokens = next;
  }
  KvCapture& c = D.host;
  c.meta = H.capture_meta;
  c.blocks.resize(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b) {
    const DecodeBlock& bh = H.blocks[b];
    KvBlock& kb = c.blocks[b];
    kb.layers = bh.layers;
    kb.n_head_kv = bh.n_head_kv;
    kb.head_dim = bh.head_dim;
    kb.pos.assign(bh.n_tokens, 0);
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      require(t.p == feature_dim(kb), origin + ": block " + std::to_string(b) + " has " + std::to_string(feature_dim(kb)) +
                                          " features, the calibration " + std::to_string(t.p));
      require(bh.r_used[kv] <= t.r,
              origin + ": allocation uses " + std::to_string(bh.r_used[kv]) + " components, the calibration holds " + std::to_string(t.r));
    }
  }
  if (H.has_tokens) c.tokens.assign(H.blocks[0].n_tokens, 0);
  std::vector<std::array<std::vector<uint8_t>, 2>> seen(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b)
    for (auto& s : seen[b]) s.assign(H.blocks[b].n_tokens, 0);
  std::vector<uint8_t> tok_seen(H.has_tokens ? H.blocks[0].n_tokens : 0, 0);
  for (const Section& s : P.sections) {
    if (s.kind != kPositions && s.kind != kTokens) continue;
    const std::string where = origin + ": " + section_name(s.kind) + " section (tokens " + std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
    const uint32_t n = H.blocks[s.block].n_tokens;
    require(s.t0 < s.t1 && s.t1 <= n && s.raw_len == uint64_t(s.t1 - s.t0) * 4, where + ": bad range or size");
    std::vector<uint8_t> pl = payload(s, origin);
    if (s.kind == kPositions) {
      std::memcpy(c.blocks[s.block].pos.data() + s.t0, pl.data(), pl.size());
    } else {
      require(s.block == 0 && H.has_tokens, where + ": unexpected");
      for (uint32_t t = s.t0; t < s.t1; ++t) {
        require(!tok_seen[t], where + ": token " + std::to_string(t) + " given twice");
        tok_seen[t] = 1;
      }
      std::memcpy(c.tokens.data() + s.t0, pl.data(), pl.size());
    }
  }
  for (uint8_t x : tok_seen) require(x, origin + ": token ids are incomplete (truncated file?)");
  D.rope.resize(H.blocks.size());
  for (const Section& s : P.sections) {
    if (s.kind != kRaw && s.kind != kChunk) continue;
    const std::string where = origin + ": " + section_name(s.kind) + " section (block " + std::to_string(s.block) + ", tokens " +
                              std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
    require(s.kv <= 1, where + ": kv must be 0 or 1");
    KvBlock& kb = c.blocks[s.block];
    const DecodeBlock& bh = H.blocks[s.block];
    require(s.t0 < s.t1 && s.t1 <= bh.n_tokens, where + ": bad token range");
    auto& cover = seen[s.block][s.kv];
    for (uint32_t t = s.t0; t < s.t1; ++t) {
      require(!cover[t], where + ": token " + std::to_string(t) + " decoded twice");
      cover[t] = 1;
    }
    const uint32_t n = s.t1 - s.t0;
    if (s.kind == kRaw) {
      const uint64_t want = uint64_t(n) * kb.n_layer() * kb.n_head_kv * kb.head_dim * 2;
      require(s.raw_len == want, where + ": expected " + std::to_string(want) + " bytes of raw f16");
    } else {
      require(n <= H.chunk_tokens, where + ": more tokens than chunk_tokens");
      require(s.raw_len == packed_chunk_bytes(bh.alloc[s.kv], n), where + ": payload size does not match the allocation");
      if (s.kv == 0 && H.keys_derope && !D.rope[s.block]) D.rope[s.block] = rope_params_from_meta(H.capture_meta, s.block == 1, kb.head_dim, origin);
    }
    D.kv_sections.push_back(s);
  }
  for (size_t b = 0; b < H.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv)
      for (uint32_t t = 0; t < H.blocks[b].n_tokens; ++t)
        require(seen[b][kv][t], origin + ": token " + std::to_string(t) + " of block " + std::to_string(b) + (kv ? " (V)" : " (K)") +
                                    " is missing (truncated file?)");
  return D;
}

}  // namespace kvtc::cuda
