#include "format/plan.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/capture_io.h"
#include "format/ecsq.h"
#include "format/quantizers.h"
#include "format/raw8.h"
#include "kvtc/error.h"

namespace kvtc::container {

using json = nlohmann::json;

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

std::vector<SectionPlan> plan_sections(const KvCapture& c, const CompressOptions& opt, uint32_t n0, uint32_t c0) {
  std::vector<SectionPlan> out;
  for (uint32_t b = 0; b < c.blocks.size(); ++b) {
    const uint32_t n = c.blocks[b].n_tokens();
    out.push_back({kPositions, b, 0, n0, n});
    if (b == 0 && !c.tokens.empty()) out.push_back({kTokens, 0, 0, n0, n});
  }
  for (uint32_t b = 0; b < c.blocks.size(); ++b) {
    const TokenLayout L = token_layout(c.blocks[b].n_tokens(), opt.sink, opt.window);
    for (uint32_t kv = 0; kv < 2; ++kv) {
      if (n0 == 0 && L.s_end > 0) out.push_back({kRaw, b, kv, 0, L.s_end});
      for (auto [t0, t1] : chunk_ranges(std::max(c0, L.s_end), L.w_begin, opt.chunk_tokens)) out.push_back({kChunk, b, kv, t0, t1});
    }
  }
  for (uint32_t b = 0; b < c.blocks.size(); ++b) {
    const uint32_t n = c.blocks[b].n_tokens();
    const TokenLayout L = token_layout(n, opt.sink, opt.window);
    if (L.w_begin < n)
      for (uint32_t kv = 0; kv < 2; ++kv) out.push_back({opt.window_bits == 8 ? kRaw8 : kRaw, b, kv, L.w_begin, n});
  }
  return out;
}

void check_geometry(const CacheGeometry& g, const Calibration& cal, const std::string& who) {
  const std::string& a = g.model_sha256;
  const std::string& b = cal.geometry.model_sha256;
  require(!a.empty() && a == b, who + ": the cache comes from model " + (a.empty() ? std::string("?") : a.substr(0, 16)) +
                                    "…, the calibration from " + (b.empty() ? std::string("?") : b.substr(0, 16)) +
                                    "… (wrong calibration for this model)");
  require(g.blocks.size() == cal.blocks.size(),
          who + ": the cache has " + std::to_string(g.blocks.size()) + " block(s), the calibration " + std::to_string(cal.blocks.size()));
  for (size_t i = 0; i < g.blocks.size(); ++i) {
    const BlockGeometry& x = g.blocks[i];
    const std::string bw = who + ": block " + std::to_string(i);
    for (int kv = 0; kv < 2; ++kv)
      require(cal.blocks[i][kv].p == x.features(),
              bw + " has " + std::to_string(x.features()) + " features, the calibration " + std::to_string(cal.blocks[i][kv].p));
    if (i < cal.geometry.blocks.size() && !cal.geometry.blocks[i].layers.empty()) {
      const BlockGeometry& y = cal.geometry.blocks[i];
      require(x.layers == y.layers && x.n_head_kv == y.n_head_kv && x.head_dim == y.head_dim,
              bw + " holds " + std::to_string(x.n_layer()) + " layers x " + std::to_string(x.n_head_kv) + " KV heads x " +
                  std::to_string(x.head_dim) + " dims, the calibration's " + std::to_string(y.n_layer()) + " x " + std::to_string(y.n_head_kv) +
                  " x " + std::to_string(y.head_dim) + " (other layers)");
    }
  }
}

namespace {

// Index of the first f16 value of x[0, n) that is NaN or infinite (exponent
// bits all ones), or n. Four values per 64-bit word: adding 0x0400 to a
// lane's masked exponent carries into its bit 15 only when all five exponent
// bits are set, and never into the next lane; the loop vectorizes, so the
// scan runs near memory speed (~10 ms for an 8K-token SmolLM2 cache, ~1% of
// compressing it at 16x).
size_t first_non_finite(const uint16_t* x, size_t n) {
  constexpr uint64_t kExp = 0x7c007c007c007c00ull, kOne = 0x0400040004000400ull, kTop = 0x8000800080008000ull;
  const size_t words = n / 4;
  uint64_t any = 0;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, x + 4 * i, 8);
    any |= ((w & kExp) + kOne) & kTop;
  }
  if (any == 0) {
    for (size_t i = 4 * words; i < n; ++i)
      if ((x[i] & 0x7c00) == 0x7c00) return i;
    return n;
  }
  for (size_t i = 0; i < n; ++i)  // rare: find where, for the message
    if ((x[i] & 0x7c00) == 0x7c00) return i;
  return n;
}

void require_finite(const KvBlock& b, size_t bi) {
  for (int kv = 0; kv < 2; ++kv) {
    const std::vector<uint16_t>& x = kv == 0 ? b.k : b.v;
    const size_t i = first_non_finite(x.data(), x.size());
    if (i == x.size()) continue;
    const size_t d = i % b.head_dim, t = i / b.head_dim % b.n_tokens(), h = i / b.head_dim / b.n_tokens() % b.n_head_kv,
                 l = i / b.head_dim / b.n_tokens() / b.n_head_kv;
    char bits[8];
    std::snprintf(bits, sizeof bits, "0x%04x", unsigned(x[i]));
    throw Error("compress: block " + std::to_string(bi) + (kv == 0 ? " K" : " V") + "[layer " + std::to_string(l) + ", head " + std::to_string(h) +
                ", token " + std::to_string(t) + ", dim " + std::to_string(d) + "] is " + ((x[i] & 0x3ff) ? "NaN" : "infinite") + " (f16 bits " +
                bits + "): kvtc codes finite caches only");
  }
}

}  // namespace

void check_compress_inputs(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  require(!c.blocks.empty(), "compress: empty capture");
  check_geometry(c.geometry(), cal, "compress");
  require(alloc.size() == c.blocks.size(), "compress: the allocation has " + std::to_string(alloc.size()) + " block(s), the capture " +
                                               std::to_string(c.blocks.size()) + " (allocation of another calibration?)");
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    require(c.blocks[b].n_tokens() <= (1u << 24), "compress: block " + std::to_string(b) + " holds more than 2^24 tokens");
    if (cal.keys_derope) require_rope_supported(c.blocks[b].rope, "compress: block " + std::to_string(b));
    for (int kv = 0; kv < 2; ++kv) {
      uint32_t next = 0;
      const bool ecsq = is_ecsq(alloc[b][kv]);
      for (const BlockAlloc& a : alloc[b][kv].blocks) {
        require(ecsq || (a.start == next && a.size >= 1 && a.size <= 4096 && find_quantizer(uint32_t(a.type))),
                "compress: allocation blocks must tile a prefix of the components, each of 1..4096 (an entropy-coded allocation is one "
                "ecsq block)");
        next = a.start + a.size;
      }
      require(!ecsq || (alloc[b][kv].blocks.size() == 1 && alloc[b][kv].blocks[0].start == 0 && next >= 1),
              "compress: an entropy-coded allocation is one block starting at component 0");
      require(next <= cal.blocks[b][kv].r,
              "compress: allocation uses " + std::to_string(next) + " components, the calibration holds " + std::to_string(cal.blocks[b][kv].r));
    }
  }
  require(opt.chunk_tokens >= 16 && opt.chunk_tokens % 16 == 0 && opt.chunk_tokens <= 65536,
          "compress: chunk_tokens must be a multiple of 16 in 16..65536");
  require(opt.deflate_level >= 0 && opt.deflate_level <= 12, "compress: deflate level must be 0..12");
  require(opt.window_bits == 16 || opt.window_bits == 8, "compress: window_bits must be 16 or 8, got " + std::to_string(opt.window_bits));
  if (!c.tokens.empty()) require(c.tokens.size() == c.blocks[0].n_tokens(), "compress: tokens and positions differ in length");
  for (size_t b = 0; b < c.blocks.size(); ++b)
    if (c.blocks[b].k.size() == c.blocks[b].numel() && c.blocks[b].v.size() == c.blocks[b].numel()) require_finite(c.blocks[b], b);
}

std::atomic<uint32_t> g_ecsq_writer_lanes{32};  // set_ecsq_writer_lanes (lab_support.h)

uint32_t container_version(const AllocationSet& alloc) {
  for (const auto& bk : alloc)
    for (const Allocation& a : bk)
      if (is_ecsq(a)) return g_ecsq_writer_lanes == 4 ? 2 : 4;  // 32-lane chunks (4 lanes: a lab control)
  return 1;
}

uint32_t container_version(const AllocationSet& alloc, const CompressOptions& opt) {
  const uint32_t v = container_version(alloc);
  return opt.window_bits == 8 ? std::max(v, 3u) : v;
}

std::string header_json(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  nlohmann::ordered_json h;
  h["format"] = "kvtc";
  h["version"] = container_version(alloc, opt);
  h["calibration_id"] = cal.id;
  h["model_sha256"] = c.model_sha256;
  h["sink"] = opt.sink;
  h["window"] = opt.window;
  if (opt.window_bits != 16) h["window_bits"] = opt.window_bits;  // absent: 16 (versions 1 and 2 byte for byte)
  h["chunk_tokens"] = opt.chunk_tokens;
  h["deflate_level"] = opt.deflate_level;
  h["has_tokens"] = !c.tokens.empty();
  h["keys_rope"] = cal.keys_derope ? "removed" : "kept";
  h["capture_meta"] = meta_with_geometry(c.meta, c.geometry());
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
      for (const BlockAlloc& x : alloc[b][kv].blocks) a.push_back({x.start, x.size, header_type_code(alloc[b][kv], x)});
      jb["alloc"].push_back(a);
    }
    h["blocks"].push_back(jb);
  }
  std::string s = h.dump();
  require(s.size() <= kMaxHeaderBytes, "compress: header too large");
  return s;
}

// ---------------------------------------------------------------- decoding

ContainerHeader parse_header(const std::string& js, const std::string& origin) {
  ContainerHeader h;
  h.version = kContainerVersion;
  try {
    json j = json::parse(js);
    require(j.at("format") == "kvtc", "format is not 'kvtc'");
    h.calibration_id = j.at("calibration_id").get<std::string>();
    h.sink = j.at("sink").get<uint32_t>();
    h.window = j.at("window").get<uint32_t>();
    h.window_bits = j.value("window_bits", 16u);
    require(h.window_bits == 16 || h.window_bits == 8, "window_bits must be 16 or 8, got " + std::to_string(h.window_bits));
    h.chunk_tokens = j.at("chunk_tokens").get<uint32_t>();
    h.deflate_level = j.value("deflate_level", 0);
    h.has_tokens = j.at("has_tokens").get<bool>();
    const std::string kr = j.value("keys_rope", std::string("removed"));
    require(kr == "removed" || kr == "kept", "keys_rope must be 'removed' or 'kept', got '" + kr + "'");
    h.keys_derope = kr == "removed";
    h.meta = j.at("capture_meta").get<std::map<std::string, std::string>>();
    require(h.chunk_tokens >= 1 && h.chunk_tokens <= 65536, "chunk_tokens out of range");
    const json& bl = j.at("blocks");
    require(bl.is_array() && bl.size() >= 1 && bl.size() <= 2, "blocks must hold 1 or 2 entries");
    for (const json& b : bl) {
      BlockGeometry x;
      x.layers = b.at("layers").get<std::vector<int32_t>>();
      x.n_head_kv = b.at("n_head_kv").get<uint32_t>();
      x.head_dim = b.at("head_dim").get<uint32_t>();
      require(!x.layers.empty() && x.layers.size() <= 4096 && x.n_head_kv >= 1 && x.n_head_kv <= 4096 && x.head_dim >= 1 && x.head_dim <= 4096,
              "block geometry out of range");
      require(uint64_t(x.layers.size()) * x.n_head_kv * x.head_dim <= (1u << 20), "block feature count out of range");
      std::array<Allocation, 2> al;
      for (int kv = 0; kv < 2; ++kv) {
        uint32_t next = 0;
        const json& aj = b.at("alloc").at(kv);
        for (const json& a : aj) {
          const int ty = a.at(2).get<int>();
          BlockAlloc ba{a.at(0).get<uint32_t>(), a.at(1).get<uint32_t>(), QType(ty)};
          if (ty == int(kEcsqTypeCode)) {
            require(aj.size() == 1 && ba.start == 0 && ba.size >= 1 && ba.size <= (1u << 20), "an ecsq block must be its allocation's only one");
            al[kv].coding = Coding::kEntropy;
            ba.type = QType::kNone;  // unused in an entropy-coded allocation
          } else {
            require(ba.start == next && ba.size >= 1 && ba.size <= 4096 && ty >= 0 && find_quantizer(uint32_t(ty)),
                    "allocation blocks must tile a prefix");
          }
          next = ba.start + ba.size;
          al[kv].blocks.push_back(ba);
        }
        if (b.contains("nominal_ratio")) al[kv].nominal_ratio = b.at("nominal_ratio").at(kv).get<double>();
      }
      h.geometry.blocks.push_back(std::move(x));
      h.alloc.push_back(std::move(al));
    }
    geometry_from_meta(h.meta, h.geometry, origin + ": container header capture_meta");
    h.geometry.model_sha256 = j.at("model_sha256").get<std::string>();
  } catch (const Error& e) {
    throw Error(origin + ": container header: " + e.what());
  } catch (const std::exception& e) {
    throw Error(origin + ": container header is malformed: " + e.what());
  }
  return h;
}

void derive_token_counts(const Parsed& P, ContainerHeader& H, const std::string& origin) {
  H.n_tokens.assign(H.geometry.blocks.size(), 0);
  for (const Section& s : P.sections)
    require(s.block < H.geometry.blocks.size(),
            origin + ": " + section_name(s.kind) + " section: block " + std::to_string(s.block) + " does not exist");
  for (size_t b = 0; b < H.geometry.blocks.size(); ++b) {
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
    H.n_tokens[b] = next;
  }
}

ContainerHeader read_header(const Parsed& P, const std::string& origin) {
  ContainerHeader H = parse_header(P.header_json, origin);
  H.version = P.version;
  require(container_version(H.alloc) == 1 || H.version >= 2,
          origin + ": entropy-coded (ecsq) allocations in a version " + std::to_string(H.version) + " container (they need version 2)");
  require(H.window_bits == 16 || H.version >= 3,
          origin + ": an 8-bit window (window_bits 8) in a version " + std::to_string(H.version) + " container (it needs version 3)");
  derive_token_counts(P, H, origin);
  return H;
}

DecodePlan plan_decode(const Parsed& P, const Calibration& cal, const std::string& origin) {
  DecodePlan D;
  D.H = read_header(P, origin);
  const ContainerHeader& H = D.H;
  require(H.calibration_id == cal.id, origin + ": encoded with calibration " + H.calibration_id.substr(0, 16) + "…, but the calibration given is " +
                                          cal.id.substr(0, 16) + "… (wrong calibration file)");
  require(H.keys_derope == cal.keys_derope,
          origin + ": header keys_rope says " + (H.keys_derope ? "removed" : "kept") + ", the calibration's meta keys_rope the opposite");
  require(H.geometry.blocks.size() == cal.blocks.size(), origin + ": block count differs from the calibration's");
  const size_t nb = H.geometry.blocks.size();
  KvCapture& c = D.host;
  c.model_sha256 = H.geometry.model_sha256;
  c.meta = H.meta;
  c.blocks.resize(nb);
  D.r_used.resize(nb);
  for (size_t b = 0; b < nb; ++b) {
    KvBlock& kb = c.blocks[b];
    static_cast<BlockGeometry&>(kb) = H.geometry.blocks[b];
    kb.pos.assign(H.n_tokens[b], 0);
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      D.r_used[b][kv] = r_used(H.alloc[b][kv].blocks);
      require(t.p == kb.features(), origin + ": block " + std::to_string(b) + " has " + std::to_string(kb.features()) +
                                        " features, the calibration " + std::to_string(t.p));
      require(D.r_used[b][kv] <= t.r,
              origin + ": allocation uses " + std::to_string(D.r_used[b][kv]) + " components, the calibration holds " + std::to_string(t.r));
    }
  }
  if (H.has_tokens) c.tokens.assign(H.n_tokens[0], 0);
  // Positions and token ids (keys need the positions for RoPE).
  std::vector<uint8_t> tok_seen(H.has_tokens ? H.n_tokens[0] : 0, 0);
  for (const Section& s : P.sections) {
    if (s.kind != kPositions && s.kind != kTokens) continue;
    const std::string where = origin + ": " + section_name(s.kind) + " section (tokens " + std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
    const uint32_t n = H.n_tokens[s.block];
    require(s.t0 < s.t1 && s.t1 <= n && s.raw_len == uint64_t(s.t1 - s.t0) * 4, where + ": bad range or size");
    std::vector<uint8_t> pl = payload(s, origin);
    if (s.kind == kPositions) {
      std::memcpy(c.blocks[s.block].pos.data() + s.t0, pl.data(), pl.size());
    } else {
      require(s.block == 0 && H.has_tokens, where + ": unexpected");
      for (uint32_t t = s.t0; t < s.t1; ++t) {
        if (tok_seen[t]) throw Error(where + ": token " + std::to_string(t) + " given twice");  // message only on failure: per token
        tok_seen[t] = 1;
      }
      std::memcpy(c.tokens.data() + s.t0, pl.data(), pl.size());
    }
  }
  for (uint8_t x : tok_seen) require(x, origin + ": token ids are incomplete (truncated file?)");
  // K/V sections: sizes, ranges, and every (block, kind, token) exactly once.
  std::vector<std::array<std::vector<uint8_t>, 2>> seen(nb);
  for (size_t b = 0; b < nb; ++b)
    for (auto& s : seen[b]) s.assign(H.n_tokens[b], 0);
  for (const Section& s : P.sections) {
    if (!is_raw(s.kind) && s.kind != kChunk) continue;
    const std::string where = origin + ": " + section_name(s.kind) + " section (block " + std::to_string(s.block) + ", tokens " +
                              std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
    require(s.kv <= 1, where + ": kv must be 0 or 1");
    const KvBlock& kb = c.blocks[s.block];
    require(s.t0 < s.t1 && s.t1 <= H.n_tokens[s.block], where + ": bad token range");
    auto& cover = seen[s.block][s.kv];
    for (uint32_t t = s.t0; t < s.t1; ++t) {
      if (cover[t]) throw Error(where + ": token " + std::to_string(t) + " decoded twice");
      cover[t] = 1;
    }
    const uint32_t n = s.t1 - s.t0;
    if (s.kind == kRaw) {
      const uint64_t want = uint64_t(n) * kb.features() * 2;
      require(s.raw_len == want, where + ": expected " + std::to_string(want) + " bytes of raw f16");
    } else if (s.kind == kRaw8) {
      require(H.version >= 3, where + ": 8-bit raw tokens in a version " + std::to_string(H.version) + " container (they need version 3)");
      const uint64_t want = raw8_bytes(kb, s.kv, n);
      require(s.raw_len == want, where + ": expected " + std::to_string(want) + " bytes of 8-bit raw tokens");
    } else {
      require(n <= H.chunk_tokens, where + ": more tokens than chunk_tokens");
      const Allocation& al = H.alloc[s.block][s.kv];
      if (is_ecsq(al))
        require(s.raw_len >= ecsq_fixed_bytes(al.blocks[0].size, ecsq_layout(H.version)) && s.raw_len <= packed_bytes(al, n),
                where + ": entropy-coded payload of " + std::to_string(s.raw_len) + " bytes, outside what " + std::to_string(n) + " tokens of " +
                    std::to_string(al.blocks[0].size) + " components can take");
      else
        require(s.raw_len == packed_bytes(al, n), where + ": payload size does not match the allocation");
      if (s.kv == 0 && H.keys_derope) require_rope_supported(kb.rope, origin + ": block " + std::to_string(s.block));
    }
    D.kv_sections.push_back(s);
  }
  for (size_t b = 0; b < nb; ++b)
    for (int kv = 0; kv < 2; ++kv)
      for (uint32_t t = 0; t < H.n_tokens[b]; ++t)
        if (!seen[b][kv][t])
          throw Error(origin + ": token " + std::to_string(t) + " of block " + std::to_string(b) + (kv ? " (V)" : " (K)") +
                      " is missing (truncated file?)");
  return D;
}

}  // namespace kvtc::container

namespace kvtc {
void set_ecsq_writer_lanes(uint32_t lanes) {
  require(lanes == 4 || lanes == 32, "set_ecsq_writer_lanes: 4 or 32 lanes, got " + std::to_string(lanes));
  container::g_ecsq_writer_lanes = lanes;
}
}  // namespace kvtc
