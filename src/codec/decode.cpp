// The .kvtc decoder: needs only the calibration's mean and basis.

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "container.h"
#include "kvtc/codec.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"
#include "kvtc/util.h"
#include "parallel.h"
#include "project.h"

namespace kvtc {

namespace {

using json = nlohmann::json;
using namespace container;

struct BlockHeader {
  std::vector<int32_t> layers;
  uint32_t n_head_kv = 0, head_dim = 0, n_tokens = 0;
  std::array<std::vector<BlockAlloc>, 2> alloc;
  std::array<uint32_t, 2> r_used{0, 0};
};

struct Header {
  std::string calibration_id, model_sha256;
  uint32_t sink = 0, window = 0, chunk_tokens = 0;
  bool has_tokens = false;
  bool keys_derope = true;  // header keys_rope: "removed" (absent: removed) or "kept"
  std::map<std::string, std::string> capture_meta;
  std::vector<BlockHeader> blocks;
};

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
          BlockAlloc ba{a.at(0).get<uint32_t>(), a.at(1).get<uint32_t>(), QType(a.at(2).get<int>())};
          require(ba.start == next && ba.size >= 1 && ba.size <= 4096 && int(ba.type) >= 0 && int(ba.type) < kNumQTypes,
                  "allocation blocks must tile a prefix");
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

// Unpacks one chunk into d[n_tok][r_used] (dropped components 0).
static void unpack_chunk(const std::vector<uint8_t>& buf, const std::vector<BlockAlloc>& alloc, uint32_t n_tok, uint32_t r_used, float* d) {
  std::fill(d, d + size_t(n_tok) * r_used, 0.0f);
  // E4M3 decodes through a 256-entry table (the same function's values).
  static const std::array<float, 256> e4m3 = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = e4m3_to_f32(uint8_t(i));
    return t;
  }();
  size_t off = 0;
  std::vector<float> lo(n_tok), st(n_tok);
  for (const BlockAlloc& b : alloc) {
    if (b.type == QType::kNone) continue;
    const uint32_t np = qtype_param_bits(b.type) / 16;
    std::vector<uint16_t> params(size_t(n_tok) * 2, 0);
    for (uint32_t k = 0; k < np; ++k, off += 2 * size_t(n_tok))  // low-byte plane, then high-byte plane
      for (uint32_t t = 0; t < n_tok; ++t) params[size_t(t) * 2 + k] = uint16_t(buf[off + t] | buf[off + n_tok + t] << 8);
    for (uint32_t t = 0; t < n_tok; ++t) {
      lo[t] = f16_to_f32(params[size_t(t) * 2]);
      st[t] = f16_to_f32(params[size_t(t) * 2 + 1]);
    }
    // Codes LSB-first, contiguous, component-major: code j = i * n_tok + t
    // at bit j * cb (cb = 2, 4 or 8: never across a byte).
    const uint32_t cb = qtype_code_bits(b.type);
    const uint8_t mask = uint8_t((1u << cb) - 1);
    const uint8_t* in = buf.data() + off;
    size_t j = 0;
    for (uint32_t i = 0; i < b.size; ++i) {
      float* col = d + b.start + i;
      if (b.type == QType::kFp8) {
        for (uint32_t t = 0; t < n_tok; ++t, ++j) col[size_t(t) * r_used] = e4m3[in[j]] * lo[t];
      } else {
        for (uint32_t t = 0; t < n_tok; ++t, ++j) {
          const size_t bit = j * cb;
          col[size_t(t) * r_used] = lo[t] + float((in[bit >> 3] >> (bit & 7)) & mask) * st[t];
        }
      }
    }
    off += (size_t(n_tok) * b.size * cb + 7) / 8;
  }
}

// Token counts per block from the positions sections, which must tile
// [0, n) (in any order: appended containers add ranges at the end).
static void derive_token_counts(const Parsed& P, Header& H, const std::string& origin) {
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

KvCapture kvtc_decompress(const std::vector<uint8_t>& bytes, const Calibration& cal, const std::string& origin, const DecompressOptions& opt) {
  Parsed P = parse(bytes, origin);
  Header H = parse_header(P.header_json, origin);
  require(H.calibration_id == cal.id, origin + ": encoded with calibration " + H.calibration_id.substr(0, 16) + "…, but the calibration given is " +
                                          cal.id.substr(0, 16) + "… (wrong calibration file)");
  require(H.blocks.size() == cal.blocks.size(), origin + ": block count differs from the calibration's");
  require(H.keys_derope == calibration_keys_derope(cal),
          origin + ": header keys_rope says " + (H.keys_derope ? "removed" : "kept") + ", the calibration's meta keys_rope the opposite");
  for (const Section& s : P.sections)
    require(s.block < H.blocks.size(), origin + ": " + section_name(s.kind) + " section: block " + std::to_string(s.block) + " does not exist");
  derive_token_counts(P, H, origin);
  KvCapture c;
  c.meta = H.capture_meta;
  c.blocks.resize(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b) {
    const BlockHeader& bh = H.blocks[b];
    KvBlock& kb = c.blocks[b];
    kb.layers = bh.layers;
    kb.n_head_kv = bh.n_head_kv;
    kb.head_dim = bh.head_dim;
    kb.pos.assign(bh.n_tokens, 0);
    kb.k.assign(kb.numel(), 0);
    kb.v.assign(kb.numel(), 0);
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      require(t.p == feature_dim(kb), origin + ": block " + std::to_string(b) + " has " + std::to_string(feature_dim(kb)) +
                                          " features, the calibration " + std::to_string(t.p));
      require(bh.r_used[kv] <= t.r,
              origin + ": allocation uses " + std::to_string(bh.r_used[kv]) + " components, the calibration holds " + std::to_string(t.r));
    }
  }
  if (H.has_tokens) c.tokens.assign(H.blocks[0].n_tokens, 0);
  // Coverage: every (block, kind, token) decoded exactly once; positions
  // and tokens likewise.
  std::vector<std::array<std::vector<uint8_t>, 2>> seen(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b)
    for (auto& s : seen[b]) s.assign(H.blocks[b].n_tokens, 0);
  std::vector<uint8_t> tok_seen(H.has_tokens ? H.blocks[0].n_tokens : 0, 0);
  // Positions first: keys need them for RoPE.
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
  // RoPE parameters per block (keys of coded chunks only).
  std::vector<std::optional<RopeParams>> rope(H.blocks.size());
  // Validate every K/V section and its coverage serially; decode the coded
  // chunks in parallel afterwards (they write disjoint token ranges).
  std::vector<const Section*> jobs;
  for (const Section& s : P.sections) {
    if (s.kind != kRaw && s.kind != kChunk) continue;
    const std::string where = origin + ": " + section_name(s.kind) + " section (block " + std::to_string(s.block) + ", tokens " +
                              std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
    require(s.kv <= 1, where + ": kv must be 0 or 1");
    KvBlock& kb = c.blocks[s.block];
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
      if (s.kv == 0 && H.keys_derope && !rope[s.block]) rope[s.block] = rope_params_from_meta(H.capture_meta, s.block == 1, kb.head_dim, origin);
    }
    jobs.push_back(&s);
  }
  // The basis, rounded once per call for bf16 (~5 ms per transform).
  const Precision prec = detail::resolve_precision(opt.precision, origin.c_str());
  std::vector<std::array<std::unique_ptr<detail::Projector>, 2>> proj(H.blocks.size());
  for (size_t b = 0; b < H.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) proj[b][kv] = std::make_unique<detail::Projector>(cal.blocks[b][kv], H.blocks[b].r_used[kv], prec);
  detail::StageClock clk;
  detail::StageClock* ck = opt.stats ? &clk : nullptr;
  const int threads = detail::resolve_threads(opt.threads, jobs.size());
  detail::parallel_for(jobs.size(), threads, [&](size_t i) {
    using detail::StageTimer;
    const Section& s = *jobs[i];
    KvBlock& kb = c.blocks[s.block];
    const BlockHeader& bh = H.blocks[s.block];
    const KvKind kind = KvKind(s.kv);
    const uint32_t n = s.t1 - s.t0;
    std::vector<uint8_t> pl;
    {
      StageTimer st(ck, detail::kEntropy);
      pl = payload(s, origin);
      if (s.kind == kRaw) {
        std::vector<uint16_t>& dst = s.kv == 0 ? kb.k : kb.v;
        size_t off = 0;
        for (uint32_t l = 0; l < kb.n_layer(); ++l)
          for (uint32_t h = 0; h < kb.n_head_kv; ++h) {
            std::memcpy(&dst[kb.index(l, h, s.t0, 0)], pl.data() + off, size_t(n) * kb.head_dim * 2);
            off += size_t(n) * kb.head_dim * 2;
          }
        return;
      }
    }
    const detail::Projector& P = *proj[s.block][s.kv];
    const uint32_t ru = bh.r_used[s.kv];
    std::vector<float> d(size_t(n) * std::max(ru, 1u)), feat(size_t(n) * feature_dim(kb));
    {
      StageTimer st(ck, detail::kQuant);
      unpack_chunk(pl, bh.alloc[s.kv], n, ru, d.data());
    }
    P.decode(d.data(), n, feat.data(), ck);  // X = D B[:ru] + mu
    StageTimer st(ck, detail::kGather);
    const bool rerope = kind == KvKind::kKey && H.keys_derope;
    scatter_features(feat.data(), kind, rerope ? &*rope[s.block] : nullptr, s.t0, s.t1, kb);
  });
  clk.export_to(opt.stats, threads);
  if (opt.stats) opt.stats->projection = prec;
  for (size_t b = 0; b < H.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv)
      for (uint32_t t = 0; t < H.blocks[b].n_tokens; ++t)
        require(seen[b][kv][t], origin + ": token " + std::to_string(t) + " of block " + std::to_string(b) + (kv ? " (V)" : " (K)") +
                                    " is missing (truncated file?)");
  return c;
}

ReconError reconstruction_error(const KvCapture& ref, const KvCapture& dec, uint32_t sink, uint32_t window) {
  require(ref.blocks.size() == dec.blocks.size(), "reconstruction_error: block counts differ");
  ReconError r;
  double nk = 0, dk = 0, nv = 0, dv = 0;
  for (size_t b = 0; b < ref.blocks.size(); ++b) {
    const KvBlock &x = ref.blocks[b], &y = dec.blocks[b];
    require(x.numel() == y.numel() && x.pos == y.pos, "reconstruction_error: block " + std::to_string(b) + " differs in shape or positions");
    const uint32_t n = x.n_tokens();
    for (uint32_t t = 0; t < n; ++t) {
      if (t < sink || t + window >= n) continue;
      if (b == 0) ++r.tokens;
      for (uint32_t l = 0; l < x.n_layer(); ++l)
        for (uint32_t h = 0; h < x.n_head_kv; ++h)
          for (uint32_t d = 0; d < x.head_dim; ++d) {
            const size_t i = x.index(l, h, t, d);
            const double a = f16_to_f32(x.k[i]), c = f16_to_f32(y.k[i]), e = f16_to_f32(x.v[i]), f = f16_to_f32(y.v[i]);
            nk += (a - c) * (a - c);
            dk += a * a;
            nv += (e - f) * (e - f);
            dv += e * e;
          }
    }
  }
  r.k = dk > 0 ? nk / dk : 0;
  r.v = dv > 0 ? nv / dv : 0;
  return r;
}

ContainerInfo kvtc_inspect(const std::vector<uint8_t>& bytes, const std::string& origin) {
  Parsed P = parse(bytes, origin);
  Header H = parse_header(P.header_json, origin);
  ContainerInfo ci;
  ci.version = P.version;
  ci.calibration_id = H.calibration_id;
  ci.model_sha256 = H.model_sha256;
  ci.header_json = P.header_json;
  ci.file_bytes = bytes.size();
  for (const Section& s : P.sections) require(s.block < H.blocks.size(), origin + ": section of a block that does not exist");
  derive_token_counts(P, H, origin);
  for (const BlockHeader& b : H.blocks) {
    const uint64_t per_tok = uint64_t(b.layers.size()) * b.n_head_kv * b.head_dim * 2 * 2;
    ci.n_tokens += b.n_tokens;
    ci.f16_bytes_all += per_tok * b.n_tokens;
  }
  for (const Section& s : P.sections) {
    ContainerInfo::Section x{section_name(s.kind), s.block, s.kv, s.t0, s.t1, s.stored_len, s.raw_len};
    ci.sections.push_back(x);
    if (s.kind == kChunk) {
      require(s.block < H.blocks.size() && s.t1 >= s.t0, origin + ": bad chunk section");
      const BlockHeader& b = H.blocks[s.block];
      ci.stored_bytes_compressed += s.stored_len + kSectionHeaderBytes;
      ci.payload_bytes_compressed += s.raw_len + kSectionHeaderBytes;
      if (s.kv == 0) {
        ci.n_compressed_tokens += s.t1 - s.t0;
        ci.f16_bytes_compressed += uint64_t(b.layers.size()) * b.n_head_kv * b.head_dim * 2 * 2 * (s.t1 - s.t0);
      }
    }
  }
  return ci;
}

}  // namespace kvtc
