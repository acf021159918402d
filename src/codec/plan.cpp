#include "plan.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kvtc/error.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"

namespace kvtc::container {

using json = nlohmann::json;

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

// ---------------------------------------------------------------- encoding

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

std::vector<uint8_t> pack_chunk(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc) {
  std::vector<uint8_t> packed(packed_bytes(alloc, n), 0);
  size_t off = 0;
  std::vector<uint16_t> params(size_t(n) * 2);
  std::vector<uint8_t> all_codes;
  for (const BlockAlloc& blk : alloc) {
    if (blk.type == QType::kNone) continue;
    all_codes.resize(size_t(n) * blk.size);
    for (uint32_t t = 0; t < n; ++t)
      quantize_block(blk.type, d + size_t(t) * ld + blk.start, blk.size, &all_codes[size_t(t) * blk.size], &params[size_t(t) * 2]);
    // Byte layout for DEFLATE (docs/format.md; measured in bench/results/ratio.md):
    // parameters as a low-byte plane then a high-byte plane (the high bytes,
    // sign and exponent, repeat a lot), codes component-major (one
    // component's codes for all tokens share a distribution).
    const uint32_t np = qtype_param_bits(blk.type) / 16;
    for (uint32_t k = 0; k < np; ++k) {
      for (uint32_t t = 0; t < n; ++t) packed[off + t] = uint8_t(params[size_t(t) * 2 + k]);
      for (uint32_t t = 0; t < n; ++t) packed[off + n + t] = uint8_t(params[size_t(t) * 2 + k] >> 8);
      off += 2 * size_t(n);
    }
    // Codes LSB-first, contiguous: code j (= component * n + token) at bit
    // j * cb. cb is 2, 4 or 8, so a code never straddles a byte.
    const uint32_t cb = qtype_code_bits(blk.type);
    uint8_t* o = &packed[off];
    size_t j = 0;
    for (uint32_t i = 0; i < blk.size; ++i)
      for (uint32_t t = 0; t < n; ++t, ++j) {
        const size_t bit = j * cb;
        o[bit >> 3] = uint8_t(o[bit >> 3] | (all_codes[size_t(t) * blk.size + i] << (bit & 7)));
      }
    off += (size_t(n) * blk.size * cb + 7) / 8;
  }
  require(off == packed.size(), "compress: internal packing size mismatch");
  return packed;
}

std::string header_json(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
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

// ---------------------------------------------------------------- decoding

Header parse_header(const std::string& js, const std::string& origin) {
  Header h;
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
      BlockHeader x;
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

void derive_token_counts(const Parsed& P, Header& H, const std::string& origin) {
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
}

DecodePlan plan_decode(const Parsed& P, const Calibration& cal, const std::string& origin) {
  DecodePlan D;
  D.H = parse_header(P.header_json, origin);
  Header& H = D.H;
  require(H.calibration_id == cal.id, origin + ": encoded with calibration " + H.calibration_id.substr(0, 16) + "…, but the calibration given is " +
                                          cal.id.substr(0, 16) + "… (wrong calibration file)");
  require(H.blocks.size() == cal.blocks.size(), origin + ": block count differs from the calibration's");
  require(H.keys_derope == calibration_keys_derope(cal),
          origin + ": header keys_rope says " + (H.keys_derope ? "removed" : "kept") + ", the calibration's meta keys_rope the opposite");
  for (const Section& s : P.sections)
    require(s.block < H.blocks.size(), origin + ": " + section_name(s.kind) + " section: block " + std::to_string(s.block) + " does not exist");
  derive_token_counts(P, H, origin);
  KvCapture& c = D.host;
  c.meta = H.capture_meta;
  c.blocks.resize(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b) {
    const BlockHeader& bh = H.blocks[b];
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
  // Positions and token ids (keys need the positions for RoPE).
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
  // K/V sections: sizes, ranges, and every (block, kind, token) exactly once.
  std::vector<std::array<std::vector<uint8_t>, 2>> seen(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b)
    for (auto& s : seen[b]) s.assign(H.blocks[b].n_tokens, 0);
  D.rope.resize(H.blocks.size());
  for (const Section& s : P.sections) {
    if (s.kind != kRaw && s.kind != kChunk) continue;
    const std::string where = origin + ": " + section_name(s.kind) + " section (block " + std::to_string(s.block) + ", tokens " +
                              std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
    require(s.kv <= 1, where + ": kv must be 0 or 1");
    const KvBlock& kb = c.blocks[s.block];
    const BlockHeader& bh = H.blocks[s.block];
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
      require(s.raw_len == packed_bytes(bh.alloc[s.kv], n), where + ": payload size does not match the allocation");
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

}  // namespace kvtc::container
