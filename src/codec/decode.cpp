// The .kvtc decoder (CPU): needs only the calibration's means and bases.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <memory>

#include "codec/features.h"
#include "codec/project.h"
#include "core/capture_io.h"
#include "core/parallel.h"
#include "core/timing.h"
#include "core/util.h"
#include "format/chunk.h"
#include "format/container.h"
#include "format/ecsq.h"
#include "format/plan.h"
#include "format/raw8.h"
#include "kvtc/codec.h"

namespace kvtc {

using namespace container;

KvCapture decompress(std::span<const uint8_t> bytes, const Calibration& cal, const std::string& origin, const DecompressOptions& opt) {
  const auto t_start = std::chrono::steady_clock::now();
  // Every check first (src/format/plan.cpp, shared with the GPU decoder):
  // then the sections decode in parallel into disjoint token ranges.
  DecodePlan D = plan_decode(parse(bytes, origin, opt.threads), cal, origin);
  const ContainerHeader& H = D.H;
  KvCapture c = std::move(D.host);
  for (KvBlock& kb : c.blocks)
    for (std::vector<uint16_t>* x : {&kb.k, &kb.v}) {
      reserve_huge_pages(*x, kb.numel());  // before the first write
      x->assign(kb.numel(), 0);
    }
  const std::vector<Section>& jobs = D.kv_sections;
  // The bases in bf16: rounded once per calibration (Projector: ~5 ms per transform).
  const Precision prec = detail::resolve_precision(opt.precision, origin.c_str());
  // The GEMM's inner size: entropy-coded kinds' r_used rounded up to 64
  // (zero codes; the calibration's rank at most). oneDNN's bf16 GEMM is
  // 3-7% faster so on Qwen2.5 at 23-48x (and up to 3x slower for some sizes
  // in the encoder's shape: encode.cpp). The DP's codes are token-major
  // with r_used as their stride: left as they are.
  auto kpad = [&](size_t b, int kv) -> uint32_t {
    const uint32_t r = D.r_used[b][kv];
    return is_ecsq(H.alloc[b][kv]) ? std::min(cal.blocks[b][kv].r, (r + 63) / 64 * 64) : r;
  };
  std::vector<std::array<std::unique_ptr<detail::Projector>, 2>> proj(c.blocks.size());
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv)
      proj[b][kv] = std::make_unique<detail::Projector>(cal.blocks[b][kv], kpad(b, kv), prec, detail::transform_key(cal, b, kv));
  detail::StageClock clk;
  detail::StageClock* ck = opt.stats ? &clk : nullptr;
  const int threads = detail::resolve_threads(opt.threads, jobs.size());
  // A job's buffers, reused by the next job instead of allocated and
  // zero-filled again (feat alone is 256 x 5,760 x 4 = 5.9 MB on SmolLM2).
  struct Scratch {
    std::vector<float> d, feat;
    std::vector<int32_t> codes;
    detail::DecodeScratch proj;
  };
  detail::ScratchPool<Scratch> pool;
  detail::parallel_for(jobs.size(), threads, [&](size_t i) {
    using detail::StageTimer;
    const Section& s = jobs[i];
    KvBlock& kb = c.blocks[s.block];
    const KvKind kind = KvKind(s.kv);
    const uint32_t n = s.t1 - s.t0;
    std::vector<uint8_t> pl;
    {
      StageTimer st(ck, detail::kEntropy);
      pl = payload(s, origin);
      if (is_raw(s.kind)) {
        if (s.kind == kRaw8) {  // to the f16 layout of a raw section
          std::vector<uint8_t> f16(size_t(n) * kb.features() * 2);
          raw8_decode(
              pl.data(), pl.size(), kb, s.kv, n, reinterpret_cast<uint16_t*>(f16.data()),
              origin + ": raw8 section (block " + std::to_string(s.block) + ", tokens " + std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")");
          pl = std::move(f16);
        }
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
    const uint32_t ru = D.r_used[s.block][s.kv];
    const uint32_t kp = kpad(s.block, int(s.kv));
    const size_t dn = size_t(n) * std::max(kp, 1u);  // rows past r_used: zero codes
    std::unique_ptr<Scratch> sc = pool.take();
    std::vector<float>& d = sc->d;
    std::vector<float>& feat = sc->feat;
    feat.resize(size_t(n) * kb.features());  // written whole by the projection
    if (is_ecsq(H.alloc[s.block][s.kv])) {
      const std::string where = origin + ": chunk section (block " + std::to_string(s.block) + (s.kv ? " V" : " K") + ", tokens " +
                                std::to_string(s.t0) + ".." + std::to_string(s.t1) + ")";
      const float step = ecsq_chunk_step(pl.data(), pl.size(), where), offset = ecsq_chunk_offset(pl.data(), pl.size(), where);
      if (P.int8()) {  // the integer codes as they are, not their float values
        std::vector<int32_t>& codes = sc->codes;
        codes.resize(dn);
        {
          StageTimer st(ck, detail::kEntropy);
          ecsq_decode_codes(pl.data(), pl.size(), n, ru, ecsq_layout(H.version), codes.data(), where);
          std::fill(codes.begin() + size_t(n) * ru, codes.end(), 0);
        }
        P.decode_codes(codes.data(), n, step, offset, feat.data(), ck, &sc->proj);
      } else {
        d.resize(dn);
        {
          StageTimer st(ck, detail::kEntropy);
          ecsq_decode_chunk(pl.data(), pl.size(), n, ru, ecsq_layout(H.version), d.data(), where, true);
          std::fill(d.begin() + size_t(n) * ru, d.end(), 0.0f);
        }
        P.decode(d.data(), n, feat.data(), ck, true);  // X = D B[:ru] + mu, D component-major
      }
    } else {
      d.resize(dn);
      {
        StageTimer st(ck, detail::kQuant);
        unpack_chunk(pl.data(), H.alloc[s.block][s.kv].blocks, n, ru, d.data());
      }
      P.decode(d.data(), n, feat.data(), ck);  // X = D B[:ru] + mu
    }
    {
      StageTimer st(ck, detail::kGather);
      const bool rerope = kind == KvKind::kKey && H.keys_derope;
      scatter_features(feat.data(), kind, rerope ? &kb.rope : nullptr, s.t0, s.t1, kb);
    }
    pool.give(std::move(sc));  // (a job that threw frees its own)
  });
  if (opt.stats) {
    clk.export_to(opt.stats, threads);
    opt.stats->projection = prec;
    opt.stats->projection_groups = 1;
    for (const auto& pk : proj)
      for (const auto& P : pk)
        if (P) opt.stats->projection_groups = std::max<uint32_t>(opt.stats->projection_groups, uint32_t(P->groups()));
    bool ecsq = false, dp = false;
    for (const Section& s : jobs)
      if (s.kind == kChunk) (is_ecsq(H.alloc[s.block][s.kv]) ? ecsq : dp) = true;
    opt.stats->entropy_backend = ecsq && dp ? "libdeflate+rans" : ecsq ? "rans" : "libdeflate";
    opt.stats->transfer_ms = opt.stats->host_ms = 0;
    opt.stats->total_ms = ms_since(t_start);
  }
  return c;
}

std::vector<uint8_t> decompress_state(std::span<const uint8_t> container, const Calibration& cal, const StateLayout& to, const std::string& origin,
                                      const DecompressOptions& opt) {
  return state_as_recorded(decompress(container, cal, origin, opt), &to, origin);
}

std::vector<uint8_t> decompress_state(std::span<const uint8_t> container, const Calibration& cal, const std::string& origin,
                                      const DecompressOptions& opt) {
  return state_as_recorded(decompress(container, cal, origin, opt), nullptr, origin);
}

void ReconError::add(const ReconError& o) {
  k_err += o.k_err, k_norm += o.k_norm, v_err += o.v_err, v_norm += o.v_norm;
  tokens += o.tokens;
  k = k_norm > 0 ? k_err / k_norm : 0;
  v = v_norm > 0 ? v_err / v_norm : 0;
}

ReconError reconstruction_error(const KvCapture& ref, const KvCapture& dec, uint32_t sink, uint32_t window, std::vector<ReconError>* per_token) {
  require(ref.blocks.size() == dec.blocks.size(), "reconstruction_error: block counts differ");
  ReconError r;
  for (size_t b = 0; b < ref.blocks.size(); ++b) {
    const KvBlock &x = ref.blocks[b], &y = dec.blocks[b];
    require(x.numel() == y.numel() && x.pos == y.pos && x.k.size() == x.numel() && y.k.size() == y.numel() && x.v.size() == x.numel() &&
                y.v.size() == y.numel(),
            "reconstruction_error: block " + std::to_string(b) + " differs in shape or positions");
    const uint32_t n = x.n_tokens(), D = x.head_dim;
    std::vector<ReconError> pt(n);
    std::vector<float> a(D), c(D), e(D), f(D);
    for (uint32_t l = 0; l < x.n_layer(); ++l)
      for (uint32_t h = 0; h < x.n_head_kv; ++h)
        for (uint32_t t = 0; t < n; ++t) {
          if (t < sink || t + window >= n) continue;
          const size_t i = x.index(l, h, t, 0);
          f16_to_f32_n(&x.k[i], a.data(), D);
          f16_to_f32_n(&y.k[i], c.data(), D);
          f16_to_f32_n(&x.v[i], e.data(), D);
          f16_to_f32_n(&y.v[i], f.data(), D);
          ReconError& s = pt[t];
          for (uint32_t d = 0; d < D; ++d) {
            s.k_err += (double(a[d]) - c[d]) * (double(a[d]) - c[d]);
            s.k_norm += double(a[d]) * a[d];
            s.v_err += (double(e[d]) - f[d]) * (double(e[d]) - f[d]);
            s.v_norm += double(e[d]) * e[d];
          }
        }
    for (uint32_t t = 0; t < n; ++t) {
      if (t < sink || t + window >= n) continue;
      pt[t].tokens = b == 0 ? 1 : 0;  // count block 0's tokens
      pt[t].add(ReconError{});        // its own ratios
      r.add(pt[t]);
    }
    if (b == 0 && per_token) *per_token = std::move(pt);
  }
  return r;
}

double ContainerInfo::ratio_compressed_tokens() const {
  return stored_bytes_compressed ? double(f16_bytes_compressed) / double(stored_bytes_compressed) : 0;
}

double ContainerInfo::ratio_whole_cache() const {
  return file_bytes ? double(f16_bytes_all) / double(file_bytes) : 0;
}

ContainerInfo inspect(std::span<const uint8_t> bytes, const std::string& origin) {
  const Parsed P = parse(bytes, origin);
  ContainerInfo ci;
  ci.header = read_header(P, origin);
  const ContainerHeader& H = ci.header;
  ci.file_bytes = bytes.size();
  for (size_t b = 0; b < H.geometry.blocks.size(); ++b) {
    ci.n_tokens += H.n_tokens[b];
    ci.f16_bytes_all += uint64_t(H.geometry.blocks[b].features()) * 2 * 2 * H.n_tokens[b];
  }
  for (const Section& s : P.sections) {
    ci.sections.push_back({section_name(s.kind), s.block, s.kv, s.t0, s.t1, s.stored_len, s.raw_len});
    if (s.kind == kChunk) {
      require(s.t1 >= s.t0, origin + ": bad chunk section");
      ci.stored_bytes_compressed += s.stored_len + kSectionHeaderBytes;
      ci.payload_bytes_compressed += s.raw_len + kSectionHeaderBytes;
      if (s.kv == 0) {
        ci.n_compressed_tokens += s.t1 - s.t0;
        ci.f16_bytes_compressed += uint64_t(H.geometry.blocks[s.block].features()) * 2 * 2 * (s.t1 - s.t0);
      }
    }
  }
  return ci;
}

}  // namespace kvtc
