// The .kvtc encoder.
#include <cblas.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "container.h"
#include "kvtc/codec.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"
#include "kvtc/util.h"

namespace kvtc {

namespace {

using namespace container;

class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>& o) : o_(o) {}
  void put(uint32_t v, uint32_t bits) {
    for (uint32_t i = 0; i < bits; ++i, ++pos_) {
      if ((pos_ & 7) == 0) o_.push_back(0);
      o_.back() |= uint8_t(((v >> i) & 1) << (pos_ & 7));
    }
  }

 private:
  std::vector<uint8_t>& o_;
  size_t pos_ = 0;
};

uint32_t r_used(const Allocation& a) {
  return a.blocks.empty() ? 0 : a.blocks.back().start + a.blocks.back().size;
}

void check_match(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc) {
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
      require(r_used(alloc[b][kv]) <= cal.blocks[b][kv].r, "compress: allocation uses more components than the calibration holds");
    }
}

std::vector<uint32_t> raw_tokens(uint32_t n, uint32_t sink, uint32_t window) {
  std::vector<uint32_t> r;
  for (uint32_t t = 0; t < n; ++t)
    if (t < sink || t + window >= n) r.push_back(t);
  return r;
}

// Middle token ranges [t0, t1) of a block, chunk by chunk.
std::vector<std::pair<uint32_t, uint32_t>> chunks(uint32_t n, const CompressOptions& o) {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  if (n <= o.sink + o.window) return out;
  for (uint32_t t = o.sink; t < n - o.window; t += o.chunk_tokens) out.push_back({t, std::min(n - o.window, t + o.chunk_tokens)});
  return out;
}

}  // namespace

uint64_t kvtc_compress_bound(const KvCapture& c, const AllocationSet& alloc, const CompressOptions& opt) {
  require(alloc.size() == c.blocks.size(), "compress: the allocation has " + std::to_string(alloc.size()) + " block(s), the capture " +
                                               std::to_string(c.blocks.size()) + " (calibration of another model?)");
  uint64_t n = kFileHeaderBytes + kMaxHeaderBytes;  // the JSON header is bounded by the format's limit
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    n += 2 * section_bound(size_t(kb.n_tokens()) * 4);
    const uint64_t raw = raw_tokens(kb.n_tokens(), opt.sink, opt.window).size();
    for (int kv = 0; kv < 2; ++kv) {
      n += section_bound(raw * kb.n_layer() * kb.n_head_kv * kb.head_dim * 2);
      for (auto [t0, t1] : chunks(kb.n_tokens(), opt)) n += section_bound(packed_bytes(alloc[b][kv].blocks, t1 - t0));
    }
  }
  return n;
}

std::vector<uint8_t> kvtc_compress(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  check_match(c, cal, alloc);
  require(opt.chunk_tokens >= 16 && opt.chunk_tokens % 16 == 0 && opt.chunk_tokens <= 65536,
          "compress: chunk_tokens must be a multiple of 16 in 16..65536");
  require(opt.deflate_level >= 0 && opt.deflate_level <= 12, "compress: deflate level must be 0..12");
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
  h["capture_meta"] = c.meta;
  h["blocks"] = nlohmann::json::array();
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    nlohmann::ordered_json jb;
    jb["layers"] = kb.layers;
    jb["n_head_kv"] = kb.n_head_kv;
    jb["head_dim"] = kb.head_dim;
    jb["n_tokens"] = kb.n_tokens();
    jb["nominal_ratio"] = {alloc[b][0].nominal_ratio, alloc[b][1].nominal_ratio};
    jb["alloc"] = nlohmann::ordered_json::array();
    for (int kv = 0; kv < 2; ++kv) {
      nlohmann::ordered_json a = nlohmann::ordered_json::array();
      for (const BlockAlloc& x : alloc[b][kv].blocks) a.push_back({x.start, x.size, int(x.type)});
      jb["alloc"].push_back(a);
    }
    h["blocks"].push_back(jb);
  }
  const std::string hs = h.dump();
  require(hs.size() <= kMaxHeaderBytes, "compress: header too large");
  std::vector<uint8_t> out;
  out.reserve(size_t(std::min<uint64_t>(kvtc_compress_bound(c, alloc, opt), uint64_t(1) << 32)));
  write_file_header(out, hs);
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    std::vector<uint8_t> pl(kb.pos.size() * 4);
    std::memcpy(pl.data(), kb.pos.data(), pl.size());
    write_section(out, kPositions, uint32_t(b), 0, 0, kb.n_tokens(), pl, opt.deflate_level);
    if (b == 0 && !c.tokens.empty()) {
      require(c.tokens.size() == kb.n_tokens(), "compress: tokens and positions differ in length");
      pl.resize(c.tokens.size() * 4);
      std::memcpy(pl.data(), c.tokens.data(), pl.size());
      write_section(out, kTokens, 0, 0, 0, kb.n_tokens(), pl, opt.deflate_level);
    }
  }
  std::vector<float> feat, d, q(1024);
  std::vector<uint8_t> codes(1024);
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    const std::vector<uint32_t> rt = raw_tokens(kb.n_tokens(), opt.sink, opt.window);
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<uint16_t>& src = kv == 0 ? kb.k : kb.v;
      std::vector<uint8_t> raw;
      raw.reserve(rt.size() * kb.n_layer() * kb.n_head_kv * kb.head_dim * 2);
      for (uint32_t l = 0; l < kb.n_layer(); ++l)
        for (uint32_t hh = 0; hh < kb.n_head_kv; ++hh)
          for (uint32_t t : rt) {
            const auto* p = reinterpret_cast<const uint8_t*>(&src[kb.index(l, hh, t, 0)]);
            raw.insert(raw.end(), p, p + size_t(kb.head_dim) * 2);
          }
      write_section(out, kRaw, uint32_t(b), uint32_t(kv), 0, kb.n_tokens(), raw, opt.deflate_level);
      const Transform& T = cal.blocks[b][kv];
      const Allocation& A = alloc[b][kv];
      const uint32_t ru = r_used(A);
      RopeParams rope;
      if (kv == 0) rope = rope_params_from_meta(c.meta, b == 1, kb.head_dim, "compress");
      for (auto [t0, t1] : chunks(kb.n_tokens(), opt)) {
        const uint32_t n = t1 - t0;
        feat.resize(size_t(n) * T.p);
        gather_features(kb, KvKind(kv), kv == 0 ? &rope : nullptr, t0, t1, feat.data());
        for (uint32_t t = 0; t < n; ++t)
          for (uint32_t f = 0; f < T.p; ++f) feat[size_t(t) * T.p + f] -= T.mu[f];
        d.resize(size_t(n) * std::max(ru, 1u));
        if (ru > 0)  // D = (X - mu) B[:ru]'
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(ru), int(T.p), 1.0f, feat.data(), int(T.p), T.basis.data(), int(T.p), 0.0f,
                      d.data(), int(ru));
        std::vector<uint8_t> packed;
        packed.reserve(packed_bytes(A.blocks, n));
        std::vector<uint16_t> params(size_t(n) * 2);
        for (const BlockAlloc& blk : A.blocks) {
          if (blk.type == QType::kNone) continue;
          std::vector<uint8_t> all_codes(size_t(n) * blk.size);
          for (uint32_t t = 0; t < n; ++t)
            quantize_block(blk.type, &d[size_t(t) * ru + blk.start], blk.size, &all_codes[size_t(t) * blk.size], &params[size_t(t) * 2]);
          const uint32_t np = qtype_param_bits(blk.type) / 16;
          for (uint32_t k = 0; k < np; ++k)
            for (uint32_t t = 0; t < n; ++t) {
              packed.push_back(uint8_t(params[size_t(t) * 2 + k]));
              packed.push_back(uint8_t(params[size_t(t) * 2 + k] >> 8));
            }
          BitWriter bw(packed);
          const uint32_t cb = qtype_code_bits(blk.type);
          for (uint8_t code : all_codes) bw.put(code, cb);
        }
        require(packed.size() == packed_bytes(A.blocks, n), "compress: internal packing size mismatch");
        write_section(out, kChunk, uint32_t(b), uint32_t(kv), t0, t1, packed, opt.deflate_level);
      }
    }
  }
  return out;
}

}  // namespace kvtc
