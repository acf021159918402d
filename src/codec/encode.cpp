// The .kvtc encoder (CPU): compress, compress_bound, append, compress_state.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>

#include "codec/features.h"
#include "codec/project.h"
#include "core/capture_io.h"
#include "core/parallel.h"
#include "format/chunk.h"
#include "format/container.h"
#include "format/plan.h"
#include "kvtc/codec.h"

namespace kvtc {

namespace {

using namespace container;

std::vector<uint8_t> i32_bytes(const int32_t* p, size_t n) {
  std::vector<uint8_t> b(n * 4);
  std::memcpy(b.data(), p, b.size());
  return b;
}

// f16 values of tokens [t0, t1), laid out [layer][head][token][dim].
std::vector<uint8_t> raw_bytes(const KvBlock& kb, int kv, uint32_t t0, uint32_t t1) {
  const std::vector<uint16_t>& src = kv == 0 ? kb.k : kb.v;
  std::vector<uint8_t> raw;
  raw.reserve(size_t(t1 - t0) * kb.features() * 2);
  for (uint32_t l = 0; l < kb.n_layer(); ++l)
    for (uint32_t h = 0; h < kb.n_head_kv; ++h) {
      const auto* p = reinterpret_cast<const uint8_t*>(&src[kb.index(l, h, t0, 0)]);
      raw.insert(raw.end(), p, p + size_t(t1 - t0) * kb.head_dim * 2);
    }
  return raw;
}

// Projects, quantizes and packs tokens [t0, t1) of one block and kind.
std::vector<uint8_t> encode_chunk(const KvBlock& kb, int kv, const detail::Projector& P, const Allocation& A, const Rope* rope, uint32_t t0,
                                  uint32_t t1, detail::StageClock* clk) {
  using detail::StageTimer;
  const uint32_t n = t1 - t0, ru = P.ru();
  std::vector<float> feat(size_t(n) * kb.features()), d(size_t(n) * std::max(ru, 1u));
  {
    StageTimer st(clk, detail::kGather);
    gather_features(kb, KvKind(kv), rope, t0, t1, feat.data());
  }
  P.encode(feat.data(), n, d.data(), clk);  // D = (X - mu) B[:ru]'
  StageTimer st(clk, detail::kQuant);
  return pack_chunk(d.data(), n, ru, A.blocks);
}

// The sections of plan_sections(c, opt, n0, c0), each made independently
// (in parallel), then appended in plan order, so the bytes do not depend
// on the thread count.
void write_body(std::vector<uint8_t>& out, const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                uint32_t n0, uint32_t c0) {
  const auto t_start = std::chrono::steady_clock::now();
  detail::StageClock clk;
  detail::StageClock* ck = opt.stats ? &clk : nullptr;
  // Keys are de-RoPEd unless the calibration was fitted on them as stored
  // (the no-RoPE-removal ablation); the basis is rounded once per call for
  // bf16 (~5 ms per transform).
  const Precision prec = detail::resolve_precision(opt.precision, "compress");
  std::vector<std::array<std::unique_ptr<detail::Projector>, 2>> proj(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) proj[b][kv] = std::make_unique<detail::Projector>(cal.blocks[b][kv], r_used(alloc[b][kv].blocks), prec);
  const std::vector<SectionPlan> plan = plan_sections(c, opt, n0, c0);
  std::vector<std::vector<uint8_t>> made(plan.size());
  const int threads = detail::resolve_threads(opt.threads, plan.size());
  detail::parallel_for(plan.size(), threads, [&](size_t i) {
    const SectionPlan& s = plan[i];
    const KvBlock& kb = c.blocks[s.block];
    std::vector<uint8_t> pl;
    switch (s.kind) {
      case kPositions: pl = i32_bytes(kb.pos.data() + s.t0, s.t1 - s.t0); break;
      case kTokens: pl = i32_bytes(c.tokens.data() + s.t0, s.t1 - s.t0); break;
      case kRaw: pl = raw_bytes(kb, int(s.kv), s.t0, s.t1); break;
      default: {
        const Rope* rope = s.kv == 0 && cal.keys_derope ? &kb.rope : nullptr;
        pl = encode_chunk(kb, int(s.kv), *proj[s.block][s.kv], alloc[s.block][s.kv], rope, s.t0, s.t1, ck);
      }
    }
    detail::StageTimer st(ck, detail::kEntropy);
    write_section(made[i], s.kind, s.block, s.kv, s.t0, s.t1, pl, opt.deflate_level);
  });
  size_t total = out.size();
  for (const auto& m : made) total += m.size();
  out.reserve(total);
  for (const auto& m : made) out.insert(out.end(), m.begin(), m.end());
  if (opt.stats) {
    clk.export_to(opt.stats, threads);
    opt.stats->projection = prec;
    opt.stats->entropy_backend = opt.deflate_level > 0 ? "libdeflate" : "stored";
    opt.stats->transfer_ms = opt.stats->host_ms = 0;
    opt.stats->total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start).count();
  }
}

}  // namespace

uint64_t compress_bound(const KvCapture& c, const AllocationSet& alloc, const CompressOptions& opt) {
  require(alloc.size() == c.blocks.size(), "compress: the allocation has " + std::to_string(alloc.size()) + " block(s), the capture " +
                                               std::to_string(c.blocks.size()) + " (calibration of another model?)");
  uint64_t n = kFileHeaderBytes + kMaxHeaderBytes;  // the JSON header is bounded by the format's limit
  for (const SectionPlan& s : plan_sections(c, opt, 0, 0)) {
    const KvBlock& kb = c.blocks[s.block];
    const uint32_t t = s.t1 - s.t0;
    const uint64_t payload = s.kind == kChunk ? packed_bytes(alloc[s.block][s.kv].blocks, t)
                             : s.kind == kRaw ? uint64_t(t) * kb.features() * 2
                                              : uint64_t(t) * 4;
    n += section_bound(payload);
  }
  return n;
}

std::vector<uint8_t> compress(const KvCapture& c, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt) {
  check_compress_inputs(c, cal, alloc, opt);
  for (size_t b = 0; b < c.blocks.size(); ++b)
    require(c.blocks[b].k.size() == c.blocks[b].numel() && c.blocks[b].v.size() == c.blocks[b].numel(),
            "compress: block " + std::to_string(b) + " K/V size differs from its shape");
  const std::string hs = header_json(c, cal, alloc, opt);
  std::vector<uint8_t> out;
  out.reserve(size_t(std::min<uint64_t>(compress_bound(c, alloc, opt), uint64_t(1) << 32)));
  write_file_header(out, hs);
  write_body(out, c, cal, alloc, opt, 0, 0);
  return out;
}

AppendResult append(std::span<const uint8_t> container, const KvCapture& c, const Calibration& cal, const std::string& origin,
                    const CompressOptions& run) {
  const Parsed P = parse(container, origin, run.threads);
  const ContainerHeader H = read_header(P, origin);
  require(H.calibration_id == cal.id, origin + ": written with another calibration (wrong calibration file)");
  require(H.geometry.blocks.size() == 1 && c.blocks.size() == 1,
          origin + ": appending is supported for single-cache models only (an iSWA model's window block does not grow by appending)");
  CompressOptions opt = run;
  opt.sink = H.sink;
  opt.window = H.window;
  opt.chunk_tokens = H.chunk_tokens;
  opt.deflate_level = H.deflate_level;
  const AllocationSet& alloc = H.alloc;
  check_compress_inputs(c, cal, alloc, opt);
  require(H.has_tokens == !c.tokens.empty(), origin + ": the capture must carry token ids exactly when the container does");
  const BlockGeometry& hg = H.geometry.blocks[0];
  require(c.blocks[0].layers == hg.layers && c.blocks[0].n_head_kv == hg.n_head_kv && c.blocks[0].head_dim == hg.head_dim &&
              c.model_sha256 == H.geometry.model_sha256,
          "append: the capture's model or geometry differs from the container's");
  const uint32_t n_old = H.n_tokens[0];
  std::vector<int32_t> old_pos(n_old);
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
  require(kb.k.size() == kb.numel() && kb.v.size() == kb.numel(), "append: the capture's K/V size differs from its shape");
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

std::vector<uint8_t> compress_state(std::span<const uint8_t> blob, const CacheGeometry& g, const Calibration& cal, const AllocationSet& alloc,
                                    const CompressOptions& opt, std::span<const int32_t> tokens) {
  KvCapture c = capture_from_any_state(blob, g, "compress_state");
  c.tokens.assign(tokens.begin(), tokens.end());
  return compress(c, cal, alloc, opt);
}

}  // namespace kvtc
