// The .kvtc encoder.

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "container.h"
#include "kvtc/codec.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"
#include "kvtc/util.h"
#include "parallel.h"
#include "plan.h"
#include "project.h"

namespace kvtc {

namespace {

using namespace container;

uint32_t r_used(const Allocation& a) {
  return container::r_used(a.blocks);
}

std::vector<uint8_t> i32_bytes(const int32_t* p, size_t n) {
  std::vector<uint8_t> b(n * 4);
  std::memcpy(b.data(), p, b.size());
  return b;
}

// f16 values of tokens [t0, t1), laid out [layer][head][token][dim].
std::vector<uint8_t> raw_bytes(const KvBlock& kb, int kv, uint32_t t0, uint32_t t1) {
  const std::vector<uint16_t>& src = kv == 0 ? kb.k : kb.v;
  std::vector<uint8_t> raw;
  raw.reserve(size_t(t1 - t0) * kb.n_layer() * kb.n_head_kv * kb.head_dim * 2);
  for (uint32_t l = 0; l < kb.n_layer(); ++l)
    for (uint32_t h = 0; h < kb.n_head_kv; ++h) {
      const auto* p = reinterpret_cast<const uint8_t*>(&src[kb.index(l, h, t0, 0)]);
      raw.insert(raw.end(), p, p + size_t(t1 - t0) * kb.head_dim * 2);
    }
  return raw;
}

// Projects, quantizes and packs tokens [t0, t1) of one block and kind.
std::vector<uint8_t> encode_chunk(const KvBlock& kb, int kv, const detail::Projector& P, const Allocation& A, const RopeParams* rope, uint32_t t0,
                                  uint32_t t1, detail::StageClock* clk) {
  using detail::StageTimer;
  const uint32_t n = t1 - t0, ru = P.ru();
  std::vector<float> feat(size_t(n) * feature_dim(kb)), d(size_t(n) * std::max(ru, 1u));
  {
    StageTimer st(clk, detail::kGather);
    gather_features(kb, KvKind(kv), rope, t0, t1, feat.data());
  }
  P.encode(feat.data(), n, d.data(), clk);  // D = (X - mu) B[:ru]'
  StageTimer st(clk, detail::kQuant);
  return pack_chunk(d.data(), n, ru, A.blocks);
}

// Body sections for new tokens [n0, n1) of every block (positions, tokens,
// the sink if n0 == 0, coded chunks of [c0, c1)); then the tail (window).
// Every section is made independently (in parallel), then appended in the
// order of docs/format.md, so the bytes do not depend on the thread count.
void write_body(std::vector<uint8_t>& out, const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                uint32_t n0, uint32_t c0) {
  using Job = std::function<std::vector<uint8_t>()>;
  std::vector<Job> jobs;
  detail::StageClock clk;
  detail::StageClock* ck = opt.stats ? &clk : nullptr;
  auto section = [&, ck](uint32_t kind, uint32_t b, uint32_t kv, uint32_t t0, uint32_t t1, std::function<std::vector<uint8_t>()> payload) {
    jobs.push_back([=, &opt]() {
      std::vector<uint8_t> pl = payload();
      detail::StageTimer st(ck, detail::kEntropy);
      std::vector<uint8_t> o;
      write_section(o, kind, b, kv, t0, t1, pl, opt.deflate_level);
      return o;
    });
  };
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    section(kPositions, uint32_t(b), 0, n0, kb.n_tokens(), [&kb, n0] { return i32_bytes(kb.pos.data() + n0, kb.n_tokens() - n0); });
    if (b == 0 && !c.tokens.empty()) {
      require(c.tokens.size() == kb.n_tokens(), "compress: tokens and positions differ in length");
      section(kTokens, 0, 0, n0, kb.n_tokens(), [&c, &kb, n0] { return i32_bytes(c.tokens.data() + n0, kb.n_tokens() - n0); });
    }
  }
  // Keys are de-RoPEd unless the calibration was fitted on them as stored
  // (the no-RoPE-removal ablation, meta keys_rope = "kept").
  const bool derope = calibration_keys_derope(cal);
  std::vector<RopeParams> rope(c.blocks.size());
  for (size_t b = 0; derope && b < c.blocks.size(); ++b) rope[b] = rope_params_from_meta(c.meta, b == 1, c.blocks[b].head_dim, "compress");
  // The basis, rounded once per call for bf16 (~5 ms per transform).
  const Precision prec = detail::resolve_precision(opt.precision, "compress");
  std::vector<std::array<std::unique_ptr<detail::Projector>, 2>> proj(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) proj[b][kv] = std::make_unique<detail::Projector>(cal.blocks[b][kv], r_used(alloc[b][kv]), prec);
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    const TokenLayout L = token_layout(kb.n_tokens(), opt.sink, opt.window);
    for (int kv = 0; kv < 2; ++kv) {
      if (n0 == 0 && L.s_end > 0) section(kRaw, uint32_t(b), uint32_t(kv), 0, L.s_end, [&kb, kv, L] { return raw_bytes(kb, kv, 0, L.s_end); });
      const RopeParams* rp = kv == 0 && derope ? &rope[b] : nullptr;
      const detail::Projector* P = proj[b][kv].get();
      const Allocation* A = &alloc[b][kv];
      for (auto [t0, t1] : chunk_ranges(std::max(c0, L.s_end), L.w_begin, opt.chunk_tokens))
        section(kChunk, uint32_t(b), uint32_t(kv), t0, t1,
                [&kb, kv, P, A, rp, t0 = t0, t1 = t1, ck] { return encode_chunk(kb, kv, *P, *A, rp, t0, t1, ck); });
    }
  }
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    const TokenLayout L = token_layout(kb.n_tokens(), opt.sink, opt.window);
    if (L.w_begin < kb.n_tokens())
      for (int kv = 0; kv < 2; ++kv)
        section(kRaw, uint32_t(b), uint32_t(kv), L.w_begin, kb.n_tokens(), [&kb, kv, L] { return raw_bytes(kb, kv, L.w_begin, kb.n_tokens()); });
  }
  std::vector<std::vector<uint8_t>> made(jobs.size());
  const int threads = detail::resolve_threads(opt.threads, jobs.size());
  detail::parallel_for(jobs.size(), threads, [&](size_t i) { made[i] = jobs[i](); });
  size_t total = out.size();
  for (const auto& m : made) total += m.size();
  out.reserve(total);
  for (const auto& m : made) out.insert(out.end(), m.begin(), m.end());
  clk.export_to(opt.stats, threads);
  if (opt.stats) opt.stats->projection = prec;
}

}  // namespace

uint64_t kvtc_compress_bound(const KvCapture& c, const AllocationSet& alloc, const CompressOptions& opt) {
  require(alloc.size() == c.blocks.size(), "compress: the allocation has " + std::to_string(alloc.size()) + " block(s), the capture " +
                                               std::to_string(c.blocks.size()) + " (calibration of another model?)");
  uint64_t n = kFileHeaderBytes + kMaxHeaderBytes;  // the JSON header is bounded by the format's limit
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const KvBlock& kb = c.blocks[b];
    const TokenLayout L = token_layout(kb.n_tokens(), opt.sink, opt.window);
    const uint64_t row = uint64_t(kb.n_layer()) * kb.n_head_kv * kb.head_dim * 2;
    n += 2 * section_bound(size_t(kb.n_tokens()) * 4);
    for (int kv = 0; kv < 2; ++kv) {
      n += section_bound(L.s_end * row) + section_bound((kb.n_tokens() - L.w_begin) * row);
      for (auto [t0, t1] : chunk_ranges(L.s_end, L.w_begin, opt.chunk_tokens)) n += section_bound(packed_bytes(alloc[b][kv].blocks, t1 - t0));
    }
  }
  return n;
}

std::vector<uint8_t> kvtc_compress(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  check_compress_inputs(c, cal, alloc, opt);
  const std::string hs = header_json(c, cal, alloc, opt);
  std::vector<uint8_t> out;
  out.reserve(size_t(std::min<uint64_t>(kvtc_compress_bound(c, alloc, opt), uint64_t(1) << 32)));
  write_file_header(out, hs);
  write_body(out, c, cal, alloc, opt, 0, 0);
  return out;
}

AppendResult kvtc_append(const std::vector<uint8_t>& container, const KvCapture& c, const Calibration& cal, const std::string& origin) {
  const Parsed P = parse(container, origin);
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(P.header_json);
  } catch (const std::exception& e) {
    throw Error(origin + ": container header is malformed: " + e.what());
  }
  require(h.value("calibration_id", "") == cal.id, origin + ": written with another calibration (wrong calibration file)");
  require(h.at("blocks").size() == 1 && c.blocks.size() == 1,
          origin + ": appending is supported for single-cache models only (an iSWA model's window block does not grow by appending)");
  CompressOptions opt;
  opt.sink = h.at("sink").get<uint32_t>();
  opt.window = h.at("window").get<uint32_t>();
  opt.chunk_tokens = h.at("chunk_tokens").get<uint32_t>();
  opt.deflate_level = h.at("deflate_level").get<int>();
  AllocationSet alloc(1);
  for (int kv = 0; kv < 2; ++kv) {
    for (const auto& a : h.at("blocks").at(0).at("alloc").at(kv))
      alloc[0][kv].blocks.push_back({a.at(0).get<uint32_t>(), a.at(1).get<uint32_t>(), QType(a.at(2).get<int>())});
    alloc[0][kv].nominal_ratio = h.at("blocks").at(0).at("nominal_ratio").at(kv).get<double>();
  }
  check_compress_inputs(c, cal, alloc, opt);
  require(h.at("has_tokens").get<bool>() == !c.tokens.empty(), origin + ": the capture must carry token ids exactly when the container does");
  // Old token count and positions.
  std::vector<int32_t> old_pos;
  uint32_t n_old = 0;
  for (const Section& s : P.sections)
    if (s.kind == kPositions) n_old = std::max(n_old, s.t1);
  old_pos.resize(n_old);
  for (const Section& s : P.sections)
    if (s.kind == kPositions) {
      std::vector<uint8_t> pl = payload(s, origin);
      require(pl.size() == size_t(s.t1 - s.t0) * 4, origin + ": bad positions section");
      std::memcpy(old_pos.data() + s.t0, pl.data(), pl.size());
    }
  const KvBlock& kb = c.blocks[0];
  const uint32_t n_new = kb.n_tokens();
  require(n_new > n_old && (n_new - n_old) % 16 == 0, "append: the capture must add a positive multiple of 16 tokens (the container holds " +
                                                          std::to_string(n_old) + ", the capture " + std::to_string(n_new) + ")");
  require(n_old >= opt.sink, "append: the container is shorter than its sink; compress the whole capture instead");
  require(std::equal(old_pos.begin(), old_pos.end(), kb.pos.begin()),
          "append: the capture's first " + std::to_string(n_old) + " positions differ from the container's");
  // The old window sections are the file's tail: everything before them stays.
  const TokenLayout Lo = token_layout(n_old, opt.sink, opt.window);
  size_t tail = container.size();
  if (Lo.w_begin < n_old) {
    require(P.sections.size() >= 2, origin + ": no window sections at the end");
    for (size_t i = P.sections.size() - 2; i < P.sections.size(); ++i) {
      const Section& s = P.sections[i];
      require(s.kind == kRaw && s.t0 == Lo.w_begin && s.t1 == n_old, origin + ": the last sections are not the raw window (not appendable)");
    }
    tail = size_t(P.sections[P.sections.size() - 2].data - container.data()) - kSectionHeaderBytes;
  }
  AppendResult r;
  r.kept_bytes = tail;
  r.bytes.assign(container.begin(), container.begin() + tail);
  write_body(r.bytes, c, cal, alloc, opt, n_old, Lo.w_begin);
  return r;
}

}  // namespace kvtc
