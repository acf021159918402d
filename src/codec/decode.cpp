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
#include "plan.h"
#include "project.h"

namespace kvtc {

using namespace container;

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

KvCapture kvtc_decompress(const std::vector<uint8_t>& bytes, const Calibration& cal, const std::string& origin, const DecompressOptions& opt) {
  // Every check first (src/codec/plan.cpp, shared with the GPU decoder):
  // then the coded chunks decode in parallel into disjoint token ranges.
  DecodePlan D = plan_decode(parse(bytes, origin, opt.threads), cal, origin);
  const Header& H = D.H;
  KvCapture c = std::move(D.host);
  for (KvBlock& kb : c.blocks) {
    kb.k.assign(kb.numel(), 0);
    kb.v.assign(kb.numel(), 0);
  }
  const std::vector<Section>& jobs = D.kv_sections;
  const std::vector<std::optional<RopeParams>>& rope = D.rope;
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
    const Section& s = jobs[i];
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
