#include "testing.h"

#include <algorithm>

#include "center.cuh"
#include "codec_impl.h"
#include "kvtc/error.h"
#include "synth.cuh"

namespace kvtc::cuda {

CudaKvCapture synthesize(CudaCodec& codec, const KvCapture& shape, const std::vector<std::array<std::vector<float>, 2>>& sigma, uint64_t seed) {
  CudaCodec::Impl& I = CudaCodecAccess::impl(codec);
  require(shape.blocks.size() == I.tr.size() && sigma.size() == I.tr.size(), "synthesize: block count differs from the calibration's");
  const bool derope = I.cal.keys_derope;
  CudaKvCapture out;
  out.host.model_sha256 = shape.model_sha256;
  out.host.meta = shape.meta;
  out.host.tokens = shape.tokens;
  out.kv.resize(shape.blocks.size());
  constexpr uint32_t kTile = 16384;
  for (size_t b = 0; b < shape.blocks.size(); ++b) {
    const KvBlock& sb = shape.blocks[b];
    KvBlock h;
    static_cast<BlockGeometry&>(h) = sb.geometry();
    h.pos = sb.pos;
    out.host.blocks.push_back(h);
    const uint32_t n = h.n_tokens();
    for (int kv = 0; kv < 2; ++kv) {
      const CudaCodec::Impl::Tr& T = I.tr[b][kv];
      require(T.p == h.features(), "synthesize: block " + std::to_string(b) + " feature count differs from the calibration's");
      out.kv[b][kv] = CudaBuffer(h.numel() * 2);
      const uint32_t ru = uint32_t(std::min<size_t>(sigma[b][kv].size(), T.r));
      const bool rope = kv == 0 && derope && rotates(h.rope);
      Blob m;
      const size_t sig_off = m.add(sigma[b][kv].data(), size_t(ru) * 4);
      const size_t fac_off = rope && !h.rope.freq_factors.empty() ? m.add(h.rope.freq_factors) : 0;
      std::vector<int32_t> iota(n);
      for (uint32_t t = 0; t < n; ++t) iota[t] = int32_t(t);
      const size_t tok_off = m.add(iota);
      const size_t pos_off = m.add(h.pos);
      I.upload_meta(m);
      const uint8_t* M = I.meta.as<uint8_t>();
      const uint32_t tile = std::min(kTile, std::max(n, 1u));
      const size_t ld = round_up(tile, 16);
      I.dt.reserve(size_t(std::max(ru, 1u)) * ld * 4);
      I.x.reserve(size_t(tile) * T.p * 4);
      if (rope) {
        I.rope_c.reserve(size_t(tile) * (h.rope.n_rot / 2) * 8);
        I.rope_s.reserve(size_t(tile) * (h.rope.n_rot / 2) * 8);
      }
      for (uint32_t t0 = 0; t0 < n; t0 += tile) {
        const uint32_t m_rows = std::min(tile, n - t0);
        launch_gaussian(I.dt.as<float>(), ld, ru, m_rows, reinterpret_cast<const float*>(M + sig_off), seed * 0x9e3779b97f4a7c15ull + b * 2 + kv, t0,
                        I.st);
        launch_center_fill(I.x.as<float>(), T.mu.as<float>(), m_rows, T.p, I.st);
        I.proj->decode(I.dt.p, ElemType::kF32, false, ld, T.basis.p, m_rows, T.p, ru, I.x.as<float>(), 1.0f);
        RopeDev rd;
        const double *c = nullptr, *s = nullptr;
        if (rope) {
          rd = rope_dev(h.rope, h.head_dim, reinterpret_cast<const float*>(M + fac_off));
          launch_rope_table(reinterpret_cast<const int32_t*>(M + pos_off) + t0, m_rows, rd, false, I.rope_c.as<double>(), I.rope_s.as<double>(),
                            I.st);
          c = I.rope_c.as<double>();
          s = I.rope_s.as<double>();
        }
        launch_scatter(I.x.as<float>(), nullptr, m_rows, reinterpret_cast<const int32_t*>(M + tok_off) + t0, c, s, rd,
                       static_cast<uint16_t*>(out.kv[b][kv].get()), h.n_layer() * h.n_head_kv, n, h.head_dim, I.st);
      }
      check(cudaStreamSynchronize(I.st), "synthesize");
    }
  }
  return out;
}

}  // namespace kvtc::cuda
