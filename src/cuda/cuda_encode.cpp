// The GPU encoder (CudaCodec::compress), in stages:
//   plan      the sections of every capture in container order
//             (container::plan_sections, the CPU's), payload slots in one
//             device arena, one job per (capture, block, K/V) with its
//             quantization segments and tiles (host_plan.h);
//   transform per job: RoPE table, gather + de-RoPE + centring, GEMM,
//             quantize + pack into the arena (raw sections: device copies);
//   entropy   nvCOMP compresses every payload of at most 64 KiB in one
//             batched call; the rest (nvCOMP absent, or larger) on the
//             host with libdeflate, as the CPU encoder does; positions and
//             tokens sections are made on the host while the GPU works;
//   assemble  the host lays the containers out, a batched device copy
//             gathers their bytes in a staging buffer, one copy brings it
//             to pinned host memory, and the host writes the headers and
//             checksums (container::put_*, the CPU's writers).
#include <algorithm>
#include <map>

#include "codec_impl.h"
#include "core/parallel.h"
#include "format/plan.h"
#include "host_plan.h"
#include "kvtc/error.h"
#include "quant.cuh"

namespace kvtc {

using namespace container;
using cuda::check;

namespace {

// A payload made on the device: a raw or chunk section's bytes before
// entropy coding, at arena offset `off`.
struct Payload {
  uint32_t cap, kind, block, kv, t0, t1;
  uint64_t off, bytes;
};
// The coded tokens [c0, c1) of one (capture, block, K/V), rows in token order.
struct Job {
  uint32_t cap, b, kv, c0, c1, ru;
  size_t seg0, nseg, tile0, ntile;
  int rope = -1;       // index into EncodePlan::ropes when keys are rotated
  size_t pos_off = 0;  // byte offset of the rows' positions in the table blob
};
struct RopeSlot {
  Rope rope;
  uint32_t head_dim = 0;
  size_t factors_off = 0;  // in the table blob
};

struct EncodePlan {
  CompressOptions opt;  // as asked, chunk_tokens lowered to fit nvCOMP
  bool use_nv = false;
  std::vector<std::string> headers;                 // per capture
  std::vector<std::vector<SectionPlan>> host_secs;  // per capture: positions and tokens sections
  std::vector<Payload> pls;                         // in container order
  std::vector<std::vector<size_t>> cap_pls;         // per capture: indices into pls
  std::vector<Job> jobs;
  std::vector<cuda::QSeg> segs;
  std::vector<cuda::QTile> tiles;
  std::vector<RopeSlot> ropes;
  cuda::Blob meta;  // tables uploaded once: factors, positions, segments, tiles, copies, nvCOMP pointers
  uint64_t arena = 0;
  size_t max_rows = 0, max_ru = 0;
};

// Where each payload's entropy coding happens.
enum Route : uint8_t { kStoredDev, kNv, kHost };
struct EntropyPlan {
  std::vector<uint8_t> route;
  std::vector<size_t> nv_index, nv_list, host_list;
  size_t nv_max = 0, nv_total = 0, nv_slot = 0, nv_temp = 0;
  size_t ptrs_off = 0, sizes_off = 0, outp_off = 0;  // nvCOMP arrays in the table blob
  int algo = 0;
};

void check_inputs(const CudaCodec::Impl& I, const std::vector<const CudaKvCapture*>& caps, const AllocationSet& alloc, const CompressOptions& opt) {
  for (const CudaKvCapture* c : caps) {
    require(c != nullptr, "compress: null capture");
    check_compress_inputs(c->host, I.cal, alloc, opt);
    require(container_version(alloc) == 1,
            "compress: the GPU backend codes the DP allocations only; entropy-coded (ecsq) allocations need the CPU encoder for now");
    require(opt.window_bits == 16, "compress: the GPU backend writes f16 windows only; window_bits 8 needs the CPU encoder for now");
    require(c->kv.size() == c->host.blocks.size(), "compress: device K/V missing for some blocks");
    for (size_t b = 0; b < c->kv.size(); ++b)
      for (int kv = 0; kv < 2; ++kv)
        require(c->kv[b][kv].get() && c->kv[b][kv].bytes() >= c->host.blocks[b].numel() * 2,
                "compress: device K/V of block " + std::to_string(b) + " smaller than its shape");
  }
}

EncodePlan plan_encode(const CudaCodec::Impl& I, const std::vector<const CudaKvCapture*>& caps, const AllocationSet& alloc,
                       const CompressOptions& opt) {
  EncodePlan E;
  E.opt = opt;
  E.use_nv = cuda::nvc::built() && I.opt.nvcomp && opt.deflate_level > 0;
  if (E.use_nv) {
    const uint32_t f = cuda::chunk_tokens_fitting(alloc, opt.chunk_tokens, cuda::kNvcompMaxChunkBytes);
    if (f >= 16) E.opt.chunk_tokens = f;
  }
  E.headers.resize(caps.size());
  E.host_secs.resize(caps.size());
  E.cap_pls.resize(caps.size());
  for (uint32_t i = 0; i < caps.size(); ++i) {
    const KvCapture& c = caps[i]->host;
    E.headers[i] = header_json(c, I.cal, alloc, E.opt);
    std::vector<int> rope_of(c.blocks.size(), -1);
    if (I.cal.keys_derope)
      for (size_t b = 0; b < c.blocks.size(); ++b) {
        if (!cuda::rotates(c.blocks[b].rope)) continue;
        RopeSlot rs{c.blocks[b].rope, c.blocks[b].head_dim, 0};
        if (!rs.rope.freq_factors.empty()) rs.factors_off = E.meta.add(rs.rope.freq_factors);
        E.ropes.push_back(rs);
        rope_of[b] = int(E.ropes.size() - 1);
      }
    Job* job = nullptr;
    auto close_job = [&] {
      if (!job) return;
      job->nseg = E.segs.size() - job->seg0;
      cuda::append_encode_tiles(E.segs, job->seg0, E.tiles);
      job->ntile = E.tiles.size() - job->tile0;
      job = nullptr;
    };
    for (const SectionPlan& s : plan_sections(c, E.opt, 0, 0)) {
      if (s.kind == kPositions || s.kind == kTokens) {
        E.host_secs[i].push_back(s);
        continue;
      }
      const KvBlock& kb = c.blocks[s.block];
      const uint64_t bytes = s.kind == kRaw ? uint64_t(s.t1 - s.t0) * kb.features() * 2 : packed_bytes(alloc[s.block][s.kv], s.t1 - s.t0);
      E.arena = cuda::round_up(E.arena, I.align);
      E.pls.push_back({i, s.kind, s.block, s.kv, s.t0, s.t1, E.arena, bytes});
      E.cap_pls[i].push_back(E.pls.size() - 1);
      E.arena += bytes;
      if (s.kind != kChunk) continue;
      if (!job || job->b != s.block || job->kv != s.kv) {
        close_job();
        const TokenLayout L = token_layout(kb.n_tokens(), E.opt.sink, E.opt.window);
        E.jobs.push_back({i, s.block, s.kv, L.s_end, L.w_begin, r_used(alloc[s.block][s.kv].blocks), E.segs.size(), 0, E.tiles.size(), 0, -1, 0});
        job = &E.jobs.back();
        if (s.kv == 0 && rope_of[s.block] >= 0) {
          job->rope = rope_of[s.block];
          job->pos_off = E.meta.add(kb.pos.data() + L.s_end, size_t(L.w_begin - L.s_end) * 4);
        }
        E.max_rows = std::max<size_t>(E.max_rows, L.w_begin - L.s_end);
        E.max_ru = std::max<size_t>(E.max_ru, job->ru);
      }
      cuda::append_chunk_segments(alloc[s.block][s.kv].blocks, s.t0 - job->c0, s.t1 - s.t0, E.pls.back().off, false, E.segs);
    }
    close_job();
  }
  return E;
}

EntropyPlan plan_entropy(CudaCodec::Impl& I, EncodePlan& E) {
  EntropyPlan P;
  const int level = E.opt.deflate_level;
  P.route.resize(E.pls.size());
  P.nv_index.assign(E.pls.size(), SIZE_MAX);
  for (size_t k = 0; k < E.pls.size(); ++k) {
    const Payload& p = E.pls[k];
    if (level == 0 || p.bytes == 0)
      P.route[k] = kStoredDev;
    else if (E.use_nv && p.bytes <= cuda::kNvcompMaxChunkBytes)
      P.route[k] = kNv;
    else if (E.use_nv && p.kind == kRaw)
      P.route[k] = kStoredDev;  // big raw f16 sections: stored (DEFLATE gains little on f16)
    else
      P.route[k] = kHost;
    if (P.route[k] == kNv) {
      P.nv_index[k] = P.nv_list.size();
      P.nv_list.push_back(k);
      P.nv_max = std::max<size_t>(P.nv_max, p.bytes);
      P.nv_total += p.bytes;
    } else if (P.route[k] == kHost) {
      P.host_list.push_back(k);
    }
  }
  P.algo = I.opt.nvcomp_algorithm >= 0 ? I.opt.nvcomp_algorithm : level <= 3 ? 1 : level <= 6 ? 2 : level <= 9 ? 4 : 5;
  if (!P.nv_list.empty()) {
    P.nv_slot = cuda::round_up(cuda::nvc::compress_max_output(P.nv_max, P.algo), I.align);
    P.nv_temp = cuda::nvc::compress_temp_bytes(P.nv_list.size(), P.nv_max, P.nv_total, P.algo);
    I.comp.reserve(P.nv_slot * P.nv_list.size());
    I.nvtemp.reserve(std::max<size_t>(P.nv_temp, 1));
    std::vector<const void*> in_ptrs(P.nv_list.size());
    std::vector<size_t> in_sizes(P.nv_list.size());
    std::vector<void*> out_ptrs(P.nv_list.size());
    for (size_t q = 0; q < P.nv_list.size(); ++q) {
      in_ptrs[q] = I.arena.as<uint8_t>(E.pls[P.nv_list[q]].off);
      in_sizes[q] = E.pls[P.nv_list[q]].bytes;
      out_ptrs[q] = I.comp.as<uint8_t>(q * P.nv_slot);
    }
    P.ptrs_off = E.meta.add(in_ptrs);
    P.sizes_off = E.meta.add(in_sizes);
    P.outp_off = E.meta.add(out_ptrs);
  }
  return P;
}

// Small device results: nvCOMP's compressed sizes, then its statuses.
size_t status_offset(const EntropyPlan& P) {
  return cuda::round_up(P.nv_list.size() * 8, 16);
}
size_t results_bytes(const EntropyPlan& P) {
  return status_offset(P) + P.nv_list.size() * 4 + 16;
}

// Uploads the tables, copies the raw sections into the arena, and runs
// every job: gather (+ de-RoPE, centring), GEMM, quantize + pack; then nvCOMP.
void transform_and_deflate(CudaCodec::Impl& I, const std::vector<const CudaKvCapture*>& caps, EncodePlan& E, const EntropyPlan& P,
                           const cuda::GemmMode& gm, cuda::Timeline& tl) {
  // Raw payloads: gathered from the cache layout [l][h][t0..t1)[d].
  std::vector<cuda::CopyOp> raw_ops;
  for (const Payload& p : E.pls) {
    if (p.kind != kRaw) continue;
    const KvBlock& kb = caps[p.cap]->host.blocks[p.block];
    const uint8_t* cache = static_cast<const uint8_t*>(caps[p.cap]->kv[p.block][p.kv].get());
    const uint64_t run = uint64_t(p.t1 - p.t0) * kb.head_dim * 2;
    for (uint32_t lh = 0; lh < kb.n_layer() * kb.n_head_kv; ++lh)
      cuda::split_copy(raw_ops, cache + (uint64_t(lh) * kb.n_tokens() + p.t0) * kb.head_dim * 2, I.arena.as<uint8_t>(p.off + lh * run), run);
  }
  const size_t segs_off = E.meta.add(E.segs), tiles_off = E.meta.add(E.tiles), raw_ops_off = E.meta.add(raw_ops);
  const size_t ldd = cuda::round_up(std::max<size_t>(E.max_rows, 1), 16);
  uint32_t max_p = 1;
  for (const auto& t : I.tr) max_p = std::max({max_p, t[0].p, t[1].p});
  I.x.reserve(std::max<size_t>(E.max_rows, 1) * max_p * cuda::elem_bytes(gm.et));
  I.dt.reserve(std::max<size_t>(E.max_ru, 1) * ldd * 4);
  size_t max_table = 0;
  for (const Job& j : E.jobs)
    if (j.rope >= 0) max_table = std::max<size_t>(max_table, size_t(j.c1 - j.c0) * (E.ropes[size_t(j.rope)].rope.n_rot / 2));
  I.rope_c.reserve(std::max<size_t>(max_table, 1) * 8);
  I.rope_s.reserve(std::max<size_t>(max_table, 1) * 8);
  I.small.reserve(results_bytes(P));
  I.h_small.reserve(results_bytes(P));

  tl.begin(cuda::kSTransfer);
  I.upload_meta(E.meta);
  tl.end();
  const uint8_t* M = I.meta.as<uint8_t>();
  tl.begin(cuda::kSGather);
  cuda::launch_batched_copy(reinterpret_cast<const cuda::CopyOp*>(M + raw_ops_off), uint32_t(raw_ops.size()), I.st);
  tl.end();
  for (const Job& j : E.jobs) {
    const KvBlock& kb = caps[j.cap]->host.blocks[j.b];
    const CudaCodec::Impl::Tr& T = I.tr[j.b][j.kv];
    const uint32_t n = j.c1 - j.c0;
    const uint16_t* cache = static_cast<const uint16_t*>(caps[j.cap]->kv[j.b][j.kv].get());
    tl.begin(cuda::kSGather);
    cuda::RopeDev rd;
    const double *c = nullptr, *s = nullptr;
    if (j.rope >= 0) {
      const RopeSlot& rs = E.ropes[size_t(j.rope)];
      rd = cuda::rope_dev(rs.rope, rs.head_dim, reinterpret_cast<const float*>(M + rs.factors_off));
      cuda::launch_rope_table(reinterpret_cast<const int32_t*>(M + j.pos_off), n, rd, true, I.rope_c.as<double>(), I.rope_s.as<double>(), I.st);
      c = I.rope_c.as<double>();
      s = I.rope_s.as<double>();
    }
    cuda::launch_gather(cache, kb.n_layer() * kb.n_head_kv, kb.n_tokens(), kb.head_dim, j.c0, n, c, s, rd, T.mu.as<float>(), I.x.p, gm.et, I.st);
    tl.end();
    const size_t jl = cuda::round_up(n, 16);
    if (j.ru > 0) {
      tl.begin(cuda::kSProject);
      I.proj->encode(I.x.p, gm.et, gm.tf32, I.gemm_basis(j.b, int(j.kv), gm.et), n, T.p, j.ru, I.dt.as<float>(), jl);
      tl.end();
    }
    tl.begin(cuda::kSQuant);
    const cuda::QSeg* sg = reinterpret_cast<const cuda::QSeg*>(M + segs_off) + j.seg0;
    cuda::launch_quant_params(I.dt.as<float>(), jl, sg, uint32_t(j.nseg), I.arena.as<uint8_t>(), I.st);
    // Tiles index segments globally; the kernel reads segs[tile.seg], so pass the global table.
    cuda::launch_quant_codes(I.dt.as<float>(), jl, reinterpret_cast<const cuda::QSeg*>(M + segs_off),
                             reinterpret_cast<const cuda::QTile*>(M + tiles_off) + j.tile0, uint32_t(j.ntile), I.arena.as<uint8_t>(), I.st);
    tl.end();
  }
  if (!P.nv_list.empty()) {
    tl.begin(cuda::kSEntropy);
    cuda::nvc::compress(reinterpret_cast<const void* const*>(M + P.ptrs_off), reinterpret_cast<const size_t*>(M + P.sizes_off), P.nv_max,
                        P.nv_list.size(), I.nvtemp.p, P.nv_temp, reinterpret_cast<void* const*>(M + P.outp_off), I.small.as<size_t>(0),
                        I.small.as<int>(status_offset(P)), P.algo, I.st);
    tl.end();
  }
}

// The containers' bytes: host-deflated payloads, the device-sourced ones
// gathered at their final offsets, then headers and checksums on the host.
struct Assembled {
  double host_deflate_ms = 0;
  std::string backend;
};
Assembled assemble(CudaCodec::Impl& I, const std::vector<const CudaKvCapture*>& caps, const EncodePlan& E, const EntropyPlan& P, int threads,
                   cuda::Timeline& tl, std::vector<std::vector<uint8_t>>& out, double& host_ms) {
  Assembled A;
  const int level = E.opt.deflate_level;
  // Payloads deflated on the host come back first.
  std::vector<size_t> host_off(E.pls.size(), 0);
  size_t host_bytes = 0;
  for (size_t k : P.host_list) {
    host_off[k] = host_bytes;
    host_bytes += cuda::round_up(E.pls[k].bytes, 16);
  }
  tl.begin(cuda::kSTransfer);
  if (!P.host_list.empty()) {
    I.h_stage.reserve(host_bytes);
    for (size_t k : P.host_list)
      check(cudaMemcpyAsync(I.h_stage.b(host_off[k]), I.arena.as<uint8_t>(E.pls[k].off), E.pls[k].bytes, cudaMemcpyDeviceToHost, I.st),
            "payload D2H");
  }
  if (!P.nv_list.empty()) check(cudaMemcpyAsync(I.h_small.p, I.small.p, results_bytes(P), cudaMemcpyDeviceToHost, I.st), "nvCOMP sizes D2H");
  tl.end();
  // While the GPU works: the positions and tokens sections (libdeflate, as the CPU encoder).
  auto t_host = cuda::clock_type::now();
  std::vector<std::vector<std::vector<uint8_t>>> host_secs(caps.size());
  detail::parallel_for(caps.size(), detail::resolve_threads(threads, caps.size()), [&](size_t i) {
    const KvCapture& c = caps[i]->host;
    for (const SectionPlan& s : E.host_secs[i]) {
      const int32_t* src = s.kind == kPositions ? c.blocks[s.block].pos.data() : c.tokens.data();
      std::vector<uint8_t> pl(size_t(s.t1 - s.t0) * 4);
      std::memcpy(pl.data(), src + s.t0, pl.size());
      host_secs[i].emplace_back();
      write_section(host_secs[i].back(), s.kind, s.block, s.kv, s.t0, s.t1, pl, level);
    }
  });
  host_ms += ms_since(t_host);
  check(cudaStreamSynchronize(I.st), "compress (GPU stages)");

  t_host = cuda::clock_type::now();
  const size_t* comp_sizes = reinterpret_cast<const size_t*>(I.h_small.b(0));
  const int* statuses = reinterpret_cast<const int*>(I.h_small.b(status_offset(P)));
  for (size_t q = 0; q < P.nv_list.size(); ++q)
    require(statuses[q] == 0, "compress: nvCOMP failed on a chunk: " + cuda::nvc::status_string(statuses[q]));
  std::vector<std::vector<uint8_t>> host_sec(E.pls.size());
  {
    const auto t_hd = cuda::clock_type::now();
    detail::parallel_for(P.host_list.size(), detail::resolve_threads(threads, P.host_list.size()), [&](size_t q) {
      const size_t k = P.host_list[q];
      const Payload& p = E.pls[k];
      std::vector<uint8_t> pl(I.h_stage.b(host_off[k]), I.h_stage.b(host_off[k]) + p.bytes);
      write_section(host_sec[k], p.kind, p.block, p.kv, p.t0, p.t1, pl, level);
    });
    A.host_deflate_ms = ms_since(t_hd);
  }
  // Section sizes and offsets, in container order: positions and tokens,
  // then the payload sections as planned.
  std::vector<uint64_t> stored(E.pls.size()), sec_off(E.pls.size());
  std::vector<uint64_t> cap_off(caps.size() + 1, 0);
  std::vector<std::vector<uint64_t>> hs_off(caps.size());
  uint64_t total = 0;
  for (uint32_t i = 0; i < caps.size(); ++i) {
    cap_off[i] = total;
    uint64_t o = kFileHeaderBytes + E.headers[i].size();
    for (const auto& h : host_secs[i]) {
      hs_off[i].push_back(o);
      o += h.size();
    }
    for (size_t k : E.cap_pls[i]) {
      const Payload& p = E.pls[k];
      if (P.route[k] == kNv) {
        const size_t cs = comp_sizes[P.nv_index[k]];
        stored[k] = (cs > 0 && cs < p.bytes) ? cs : p.bytes;
        cuda::mix_backend(A.backend, "nvcomp");
      } else if (P.route[k] == kHost) {
        stored[k] = host_sec[k].size() - kSectionHeaderBytes;
        cuda::mix_backend(A.backend, "libdeflate-host");
      } else {
        stored[k] = p.bytes;
        if (p.kind == kChunk) cuda::mix_backend(A.backend, "stored");
      }
      sec_off[k] = o;
      o += kSectionHeaderBytes + stored[k];
    }
    total += o;
  }
  cap_off[caps.size()] = total;
  // Device-sourced section data -> staging at its final offsets.
  std::vector<cuda::CopyOp> ops;
  I.stage.reserve(total);
  for (size_t k = 0; k < E.pls.size(); ++k) {
    if (P.route[k] == kHost) continue;
    const uint8_t* src =
        (P.route[k] == kNv && stored[k] < E.pls[k].bytes) ? I.comp.as<uint8_t>(P.nv_index[k] * P.nv_slot) : I.arena.as<uint8_t>(E.pls[k].off);
    cuda::split_copy(ops, src, I.stage.as<uint8_t>(cap_off[E.pls[k].cap] + sec_off[k] + kSectionHeaderBytes), stored[k]);
  }
  cuda::Blob m2;
  const size_t ops_off = m2.add(ops);
  host_ms += ms_since(t_host) - A.host_deflate_ms;
  tl.begin(cuda::kSTransfer);
  // The second table upload reuses the meta buffers: the first one's
  // consumers have finished (the stream was synchronized above).
  I.upload_meta(m2);
  cuda::launch_batched_copy(reinterpret_cast<const cuda::CopyOp*>(I.meta.as<uint8_t>(ops_off)), uint32_t(ops.size()), I.st);
  I.h_stage.reserve(total);  // host-deflated payloads were consumed above
  check(cudaMemcpyAsync(I.h_stage.p, I.stage.p, total, cudaMemcpyDeviceToHost, I.st), "containers D2H");
  tl.end();
  check(cudaStreamSynchronize(I.st), "compress (assembly)");

  // Headers, checksums, hand out.
  t_host = cuda::clock_type::now();
  detail::parallel_for(E.pls.size(), detail::resolve_threads(threads, E.pls.size()), [&](size_t k) {
    const Payload& p = E.pls[k];
    uint8_t* at = I.h_stage.b(cap_off[p.cap] + sec_off[k]);
    if (P.route[k] == kHost) {
      std::memcpy(at, host_sec[k].data(), host_sec[k].size());
      return;
    }
    const uint64_t x = xxh64(at + kSectionHeaderBytes, stored[k]);
    put_section_header(at, p.kind, p.block, p.kv, p.t0, p.t1, p.bytes, stored[k], x);
  });
  for (uint32_t i = 0; i < caps.size(); ++i) {
    uint8_t* base = I.h_stage.b(cap_off[i]);
    put_file_header(base, E.headers[i]);
    for (size_t h = 0; h < host_secs[i].size(); ++h) std::memcpy(base + hs_off[i][h], host_secs[i][h].data(), host_secs[i][h].size());
  }
  out.resize(caps.size());
  detail::parallel_for(caps.size(), detail::resolve_threads(threads, caps.size()),
                       [&](size_t i) { out[i].assign(I.h_stage.b(cap_off[i]), I.h_stage.b(cap_off[i + 1])); });
  host_ms += ms_since(t_host);
  return A;
}

}  // namespace

void CudaCodec::compress(const std::vector<const CudaKvCapture*>& caps, const AllocationSet& alloc, const CompressOptions& opt,
                         std::vector<std::vector<uint8_t>>& out) {
  Impl& I = *impl_;
  const auto t_start = cuda::clock_type::now();
  const cuda::GemmMode gm = cuda::gemm_mode(opt.precision);
  const int threads = Impl::threads(opt.threads);
  out.resize(caps.size());
  if (caps.empty()) return;
  check(cudaSetDevice(I.opt.device), "cudaSetDevice");
  auto t_host = cuda::clock_type::now();
  cuda::HostTrace trace("compress");
  check_inputs(I, caps, alloc, opt);
  EncodePlan E = plan_encode(I, caps, alloc, opt);
  trace.mark("plan");
  I.arena.reserve(std::max<uint64_t>(E.arena, 1));
  const EntropyPlan P = plan_entropy(I, E);
  trace.mark("entropy-plan");
  double host_ms = ms_since(t_host);
  cuda::Timeline tl(I.st, opt.stats != nullptr);
  transform_and_deflate(I, caps, E, P, gm, tl);
  trace.mark("device");
  const Assembled A = assemble(I, caps, E, P, threads, tl, out, host_ms);
  trace.mark("assemble");
  tl.fill(opt.stats, A.host_deflate_ms, host_ms, ms_since(t_start), threads, gm.precision, A.backend.empty() ? "stored" : A.backend);
}

}  // namespace kvtc
