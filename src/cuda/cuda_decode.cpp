// The GPU decoder (CudaCodec::decompress), in stages:
//   plan      every check of the CPU decoder (container::plan_decode, with
//             the section checksums verified on the host threads), slots
//             in one device arena for each section's stored bytes and, when
//             deflated, its payload; the output buffers; one job per
//             (container, block, K/V) with its segments and tiles;
//   stage     the stored bytes (or, without nvCOMP, the payloads inflated
//             by libdeflate) into pinned host memory, one upload;
//             entropy-coded chunks (version 2) are rANS-decoded here by the
//             host threads, straight into their job's coefficient plane
//             (host_plan.h says why), and 8-bit raw tokens (version 3)
//             widened to f16 (a few MB: the window);
//   inflate   nvCOMP decompresses every deflated section in one batched call;
//   transform raw sections copied into the cache layout; per job: unpack +
//             dequantize (DP chunks; an entropy-coded job's plane is already
//             uploaded), GEMM, add the mean + re-RoPE + round to f16 into
//             the cache;
//   check     nvCOMP's statuses (a corrupt stream is an Error naming the section).
#include <algorithm>
#include <map>
#include <tuple>

#include "codec_impl.h"
#include "core/parallel.h"
#include "format/chunk.h"
#include "format/plan.h"
#include "format/raw8.h"
#include "host_plan.h"
#include "kvtc/error.h"
#include "quant.cuh"

namespace kvtc {

using namespace container;
using cuda::check;

namespace {

// One raw or chunk section: where its stored bytes and payload sit in the arena.
// An entropy-coded chunk has no slot bytes on the device: the host decodes
// it into rows row0.. of its job's plane.
struct Slot {
  uint32_t cap;
  const Section* s;
  uint64_t in_off = 0, out_off = 0;  // arena offsets of the stored bytes and (deflated) the payload
  bool deflated = false;
  // Inflated by nvCOMP: deflated, nvCOMP there, and at most 64 KiB raw. One
  // nvCOMP stream inflates on one thread block: a CPU-written 1.47 MB raw
  // window section (128 tokens x 5760 features) held an H200's 8K decode
  // for ~140 ms of its 156; with it on the host threads the decode takes
  // 23 ms in all (bench/results/gpu.md).
  bool nv = false;
  bool ecsq = false;
  size_t job = 0;     // ecsq: the job whose plane it fills
  uint32_t row0 = 0;  // ecsq: its first row there
  // raw8: decoded to f16 on the host into out_off (n x features x 2 bytes)
  bool raw8 = false;
  uint64_t payload() const { return deflated || raw8 ? out_off : in_off; }
};
struct Job {
  uint32_t cap, b, kv, n_rows, ru;
  size_t seg0, nseg, tile0, ntile, rowtok_off, pos_off;
  bool rope;
  bool ecsq = false;
  uint64_t plane_off = 0;  // ecsq: arena offset of the component-major plane [ru][round_up(n_rows, 16)]
};

struct DecodeWork {
  std::vector<DecodePlan> plans;
  bool use_nv = false;
  std::vector<Slot> slots;
  uint64_t arena = 0;
  uint64_t upload = 0;          // arena bytes [0, upload) staged on the host and uploaded; nvCOMP's outputs follow
  std::vector<size_t> nv_list;  // slots inflated by nvCOMP
  size_t nv_max = 0, nv_total = 0, nv_temp = 0;
  size_t in_ptrs_off = 0, in_sizes_off = 0, out_sizes_off = 0, out_ptrs_off = 0;
  std::vector<cuda::CopyOp> raw_ops;
  size_t raw_ops_off = 0;
  std::vector<Job> jobs;
  std::vector<cuda::QSeg> segs;
  std::vector<cuda::QTile> tiles;
  size_t segs_off = 0, tiles_off = 0;
  std::map<std::pair<uint32_t, uint32_t>, size_t> factors_off;             // per (container, block)
  size_t n_ecsq = 0;                                                       // entropy-coded chunk sections
  size_t n_host_inflate = 0;                                               // deflated sections inflated by libdeflate on the host
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, uint64_t> plane_off;  // per entropy-coded (container, block, kind)
  cuda::Blob meta;
  size_t max_rows = 0, max_ru = 0, max_table = 0;
  uint32_t max_p = 1;
};

size_t status_offset(const DecodeWork& W) {
  return cuda::round_up(W.nv_list.size() * 8, 16);
}
size_t results_bytes(const DecodeWork& W) {
  return status_offset(W) + W.nv_list.size() * 4 + 16;
}

void plan_slots(CudaCodec::Impl& I, DecodeWork& W, const cuda::GemmMode& gm) {
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, uint32_t> ecsq_rows;
  for (uint32_t i = 0; i < W.plans.size(); ++i)
    for (const Section& s : W.plans[i].kv_sections) {
      Slot x{i, &s};
      x.deflated = s.stored_len != s.raw_len;
      x.ecsq = s.kind == kChunk && is_ecsq(W.plans[i].H.alloc[s.block][s.kv]);
      x.raw8 = s.kind == kRaw8;
      const bool inflate = x.deflated && !x.ecsq && !x.raw8;  // a DP chunk or an f16 raw section, deflated
      x.nv = inflate && W.use_nv && s.raw_len <= cuda::kNvcompMaxChunkBytes;
      W.n_host_inflate += inflate && !x.nv;
      if (x.ecsq) {
        W.n_ecsq++;
        ecsq_rows[{i, s.block, s.kv}] += s.t1 - s.t0;
      } else if (x.raw8) {
        W.arena = cuda::round_up(W.arena, I.align);
        x.out_off = W.arena;
        W.arena += uint64_t(s.t1 - s.t0) * W.plans[i].host.blocks[s.block].features() * 2;
      } else {
        if (!x.deflated || x.nv) {
          W.arena = cuda::round_up(W.arena, I.align);
          x.in_off = W.arena;
          W.arena += s.stored_len;
        }
        if (x.deflated && !x.nv) {  // inflated on the host into the upload
          W.arena = cuda::round_up(W.arena, I.align);
          x.out_off = W.arena;
          W.arena += s.raw_len;
        }
      }
      W.slots.push_back(x);
    }
  // Each entropy-coded job's plane [ru][round_up(rows, 16)], which the host
  // fills and the one upload carries with the stored bytes.
  for (const auto& [key, rows] : ecsq_rows) {
    W.arena = cuda::round_up(W.arena, I.align);
    W.plane_off[key] = W.arena;
    W.arena += uint64_t(W.plans[std::get<0>(key)].r_used[std::get<1>(key)][std::get<2>(key)]) * cuda::round_up(rows, 16) * cuda::elem_bytes(gm.et);
  }
  // nvCOMP's outputs last: written on the device, so the upload stops
  // before them (the DP's inflated chunks are ~1.1x its stored bytes: the
  // upload of an 8 x 32K batch was about twice what it carried).
  W.upload = W.arena;
  for (Slot& x : W.slots)
    if (x.nv) {
      W.arena = cuda::round_up(W.arena, I.align);
      x.out_off = W.arena;
      W.arena += x.s->raw_len;
    }
  I.arena.reserve(std::max<uint64_t>(W.arena, 1));
  I.h_stage.reserve(std::max<uint64_t>(W.upload, 1));
}

std::vector<CudaKvCapture> allocate_outputs(const DecodeWork& W) {
  std::vector<CudaKvCapture> outs(W.plans.size());
  for (uint32_t i = 0; i < W.plans.size(); ++i) {
    outs[i].host = W.plans[i].host;
    outs[i].kv.resize(W.plans[i].host.blocks.size());
    for (size_t b = 0; b < W.plans[i].host.blocks.size(); ++b)
      for (int kv = 0; kv < 2; ++kv) outs[i].kv[b][kv] = CudaBuffer(W.plans[i].host.blocks[b].numel() * 2);
  }
  return outs;
}

// nvCOMP's pointer and size arrays, the raw copies, the jobs with their
// segments and tiles, RoPE factors: all into the table blob.
void plan_tables(CudaCodec::Impl& I, DecodeWork& W, const std::vector<CudaKvCapture>& outs, const cuda::GemmMode& gm, int threads) {
  for (size_t k = 0; k < W.slots.size(); ++k)
    if (W.slots[k].nv) {
      W.nv_list.push_back(k);
      W.nv_max = std::max<size_t>(W.nv_max, W.slots[k].s->raw_len);
      W.nv_total += W.slots[k].s->raw_len;
    }
  if (!W.nv_list.empty()) {
    std::vector<const void*> in_ptrs;
    std::vector<void*> out_ptrs;
    std::vector<size_t> in_sizes, out_sizes;
    for (size_t k : W.nv_list) {
      in_ptrs.push_back(I.arena.as<uint8_t>(W.slots[k].in_off));
      in_sizes.push_back(W.slots[k].s->stored_len);
      out_ptrs.push_back(I.arena.as<uint8_t>(W.slots[k].out_off));
      out_sizes.push_back(W.slots[k].s->raw_len);
    }
    W.in_ptrs_off = W.meta.add(in_ptrs);
    W.in_sizes_off = W.meta.add(in_sizes);
    W.out_sizes_off = W.meta.add(out_sizes);
    W.out_ptrs_off = W.meta.add(out_ptrs);
    W.nv_temp = cuda::nvc::decompress_temp_bytes(W.nv_list.size(), W.nv_max, W.nv_total);
    I.nvtemp.reserve(std::max<size_t>(W.nv_temp, 1));
  }
  // Raw sections -> cache layout.
  for (const Slot& x : W.slots) {
    if (!is_raw(x.s->kind)) continue;
    const KvBlock& kb = outs[x.cap].host.blocks[x.s->block];
    uint8_t* cache = static_cast<uint8_t*>(outs[x.cap].kv[x.s->block][x.s->kv].get());
    const uint32_t n = x.s->t1 - x.s->t0;
    const uint64_t run = uint64_t(n) * kb.head_dim * 2;
    for (uint32_t lh = 0; lh < kb.n_layer() * kb.n_head_kv; ++lh)
      cuda::split_copy(W.raw_ops, I.arena.as<uint8_t>(x.payload() + lh * run), cache + (uint64_t(lh) * kb.n_tokens() + x.s->t0) * kb.head_dim * 2,
                       run);
  }
  W.raw_ops_off = W.meta.add(W.raw_ops);
  // Jobs: the chunks of one (container, block, kind), rows in token order.
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<size_t>> by_job;
  for (size_t k = 0; k < W.slots.size(); ++k)
    if (W.slots[k].s->kind == kChunk) by_job[{W.slots[k].cap, W.slots[k].s->block, W.slots[k].s->kv}].push_back(k);
  // Each job's segments, tiles and row tables on its own host thread (one
  // job per container, block and K/V; 8 x 32K: 42-49 ms on one thread of an
  // H200's host), then laid out in job order, tiles re-based onto the
  // global segment table.
  struct Local {
    std::tuple<uint32_t, uint32_t, uint32_t> key;
    std::vector<size_t> ks;
    Job j;
    std::vector<cuda::QSeg> segs;
    std::vector<cuda::QTile> tiles;
    std::vector<int32_t> row_tok, row_pos;
  };
  std::vector<Local> L;
  L.reserve(by_job.size());
  for (auto& [key, ks] : by_job) L.push_back({key, std::move(ks), {}, {}, {}, {}, {}});
  detail::parallel_for(L.size(), detail::resolve_threads(threads, L.size()), [&](size_t q) {
    Local& l = L[q];
    auto [i, b, kv] = l.key;
    std::sort(l.ks.begin(), l.ks.end(), [&](size_t a, size_t c) { return W.slots[a].s->t0 < W.slots[c].s->t0; });
    const DecodePlan& P = W.plans[i];
    const KvBlock& kb = P.host.blocks[b];
    Job& j = l.j;
    j = Job{i, b, kv, 0, P.r_used[b][kv], 0, 0, 0, 0, 0, 0, false};
    j.ecsq = is_ecsq(P.H.alloc[b][kv]);
    for (size_t k : l.ks) {
      const Section& s = *W.slots[k].s;
      if (j.ecsq) {
        W.slots[k].job = q;  // every job is pushed, in this order
        W.slots[k].row0 = j.n_rows;
      } else {
        cuda::append_chunk_segments(P.H.alloc[b][kv].blocks, j.n_rows, s.t1 - s.t0, W.slots[k].payload(), true, l.segs);
      }
      for (uint32_t t = s.t0; t < s.t1; ++t) {
        l.row_tok.push_back(int32_t(t));
        l.row_pos.push_back(kb.pos[t]);
      }
      j.n_rows += s.t1 - s.t0;
    }
    cuda::append_decode_tiles(l.segs, 0, l.tiles);
  });
  for (Local& l : L) {
    auto [i, b, kv] = l.key;
    const DecodePlan& P = W.plans[i];
    const KvBlock& kb = P.host.blocks[b];
    Job j = l.j;
    j.seg0 = W.segs.size();
    j.nseg = l.segs.size();
    W.segs.insert(W.segs.end(), l.segs.begin(), l.segs.end());
    j.tile0 = W.tiles.size();
    j.ntile = l.tiles.size();
    for (cuda::QTile t : l.tiles) {
      t.seg += uint32_t(j.seg0);
      W.tiles.push_back(t);
    }
    if (j.ecsq) j.plane_off = W.plane_off.at(l.key);
    j.rowtok_off = W.meta.add(l.row_tok);
    j.rope = kv == 0 && P.H.keys_derope && cuda::rotates(kb.rope);
    if (j.rope) {
      j.pos_off = W.meta.add(l.row_pos);
      W.max_table = std::max<size_t>(W.max_table, size_t(j.n_rows) * (kb.rope.n_rot / 2));
      if (!kb.rope.freq_factors.empty() && !W.factors_off.count({i, b})) W.factors_off[{i, b}] = W.meta.add(kb.rope.freq_factors);
    }
    W.max_rows = std::max<size_t>(W.max_rows, j.n_rows);
    if (!j.ecsq) W.max_ru = std::max<size_t>(W.max_ru, j.ru);
    W.max_p = std::max(W.max_p, I.tr[b][kv].p);
    W.jobs.push_back(j);
  }
  W.segs_off = W.meta.add(W.segs);
  W.tiles_off = W.meta.add(W.tiles);
  const size_t ldd = cuda::round_up(std::max<size_t>(W.max_rows, 1), 16);
  I.x.reserve(std::max<size_t>(W.max_rows, 1) * W.max_p * 4);
  I.dt.reserve(std::max<size_t>(W.max_ru, 1) * ldd * cuda::elem_bytes(gm.et));
  I.rope_c.reserve(std::max<size_t>(W.max_table, 1) * 8);
  I.rope_s.reserve(std::max<size_t>(W.max_table, 1) * 8);
  I.small.reserve(results_bytes(W));
  I.h_small.reserve(results_bytes(W));
}

// The stored bytes (or, without nvCOMP, the inflated payloads) into pinned
// staging, entropy-coded chunks decoded into their job's plane; returns the
// host entropy-decoding time (libdeflate and rANS; 0 when there was none).
double stage_inputs(CudaCodec::Impl& I, const DecodeWork& W, const std::string& origin, int threads, const cuda::GemmMode& gm) {
  const auto t_in = cuda::clock_type::now();
  detail::parallel_for(W.slots.size(), detail::resolve_threads(threads, W.slots.size()), [&](size_t k) {
    const Slot& x = W.slots[k];
    if (x.ecsq) {
      thread_local std::vector<float> scratch;
      const Job& j = W.jobs[x.job];
      const std::string name = W.plans.size() == 1 ? origin : origin + "[" + std::to_string(x.cap) + "]";
      const std::vector<uint8_t> pl = payload(*x.s, name);
      cuda::ecsq_chunk_to_plane(pl.data(), pl.size(), container::ecsq_layout(W.plans[x.cap].H.version), x.row0, x.s->t1 - x.s->t0, j.ru,
                                I.h_stage.b(j.plane_off), cuda::round_up(j.n_rows, 16), gm.et,
                                name + ": chunk section (block " + std::to_string(x.s->block) + (x.s->kv ? " V" : " K") + ", tokens " +
                                    std::to_string(x.s->t0) + ".." + std::to_string(x.s->t1) + ")",
                                scratch);
    } else if (x.raw8) {
      const std::string name = W.plans.size() == 1 ? origin : origin + "[" + std::to_string(x.cap) + "]";
      const std::vector<uint8_t> pl = payload(*x.s, name);
      raw8_decode(pl.data(), pl.size(), W.plans[x.cap].host.blocks[x.s->block], x.s->kv, x.s->t1 - x.s->t0,
                  reinterpret_cast<uint16_t*>(I.h_stage.b(x.out_off)),
                  name + ": raw8 section (block " + std::to_string(x.s->block) + ", tokens " + std::to_string(x.s->t0) + ".." +
                      std::to_string(x.s->t1) + ")");
    } else if (!x.deflated || x.nv) {
      std::memcpy(I.h_stage.b(x.in_off), x.s->data, x.s->stored_len);
    } else {
      std::vector<uint8_t> pl = payload(*x.s, origin);
      std::memcpy(I.h_stage.b(x.out_off), pl.data(), pl.size());
    }
  });
  return W.n_ecsq == 0 && W.n_host_inflate == 0 ? 0.0 : ms_since(t_in);
}

void inflate_and_transform(CudaCodec::Impl& I, const DecodeWork& W, std::vector<CudaKvCapture>& outs, const cuda::GemmMode& gm, cuda::Timeline& tl) {
  tl.begin(cuda::kSTransfer);
  I.upload_meta(W.meta);
  if (W.upload) check(cudaMemcpyAsync(I.arena.p, I.h_stage.p, W.upload, cudaMemcpyHostToDevice, I.st), "containers H2D");
  tl.end();
  const uint8_t* M = I.meta.as<uint8_t>();
  if (!W.nv_list.empty()) {
    tl.begin(cuda::kSEntropy);
    cuda::nvc::decompress(reinterpret_cast<const void* const*>(M + W.in_ptrs_off), reinterpret_cast<const size_t*>(M + W.in_sizes_off),
                          reinterpret_cast<const size_t*>(M + W.out_sizes_off), I.small.as<size_t>(0), W.nv_list.size(), I.nvtemp.p, W.nv_temp,
                          reinterpret_cast<void* const*>(M + W.out_ptrs_off), I.small.as<int>(status_offset(W)), I.st);
    check(cudaMemcpyAsync(I.h_small.p, I.small.p, results_bytes(W), cudaMemcpyDeviceToHost, I.st), "nvCOMP results D2H");
    tl.end();
  }
  tl.begin(cuda::kSGather);
  cuda::launch_batched_copy(reinterpret_cast<const cuda::CopyOp*>(M + W.raw_ops_off), uint32_t(W.raw_ops.size()), I.st);
  tl.end();
  for (const Job& j : W.jobs) {
    const CudaCodec::Impl::Tr& T = I.tr[j.b][j.kv];
    const KvBlock& kb = outs[j.cap].host.blocks[j.b];
    const size_t jl = cuda::round_up(j.n_rows, 16);
    const void* plane = j.ecsq ? static_cast<const void*>(I.arena.as<uint8_t>(j.plane_off)) : I.dt.p;
    if (!j.ecsq) {
      tl.begin(cuda::kSQuant);
      cuda::launch_unpack(I.arena.as<uint8_t>(), reinterpret_cast<const cuda::QSeg*>(M + W.segs_off),
                          reinterpret_cast<const cuda::QTile*>(M + W.tiles_off) + j.tile0, uint32_t(j.ntile), I.dt.p, jl, gm.et, I.st);
      tl.end();
    }
    // X = D B[:ru] (beta 0); the mean is added in the scatter (one f32 add
    // per value, as the CPU's GEMM with beta = 1 onto mu), saving a pass over X.
    tl.begin(cuda::kSProject);
    I.proj->decode(plane, gm.et, gm.tf32, jl, I.gemm_basis(j.b, int(j.kv), gm.et), j.n_rows, T.p, j.ru, I.x.as<float>(), 0.0f);
    tl.end();
    tl.begin(cuda::kSGather);
    cuda::RopeDev rd;
    const double *c = nullptr, *s = nullptr;
    if (j.rope) {
      auto it = W.factors_off.find({j.cap, j.b});
      rd = cuda::rope_dev(kb.rope, kb.head_dim, it == W.factors_off.end() ? nullptr : reinterpret_cast<const float*>(M + it->second));
      cuda::launch_rope_table(reinterpret_cast<const int32_t*>(M + j.pos_off), j.n_rows, rd, false, I.rope_c.as<double>(), I.rope_s.as<double>(),
                              I.st);
      c = I.rope_c.as<double>();
      s = I.rope_s.as<double>();
    }
    cuda::launch_scatter(I.x.as<float>(), T.mu.as<float>(), j.n_rows, reinterpret_cast<const int32_t*>(M + j.rowtok_off), c, s, rd,
                         static_cast<uint16_t*>(outs[j.cap].kv[j.b][j.kv].get()), kb.n_layer() * kb.n_head_kv, kb.n_tokens(), kb.head_dim, I.st);
    tl.end();
  }
  check(cudaStreamSynchronize(I.st), "decompress");
}

void check_statuses(const CudaCodec::Impl& I, const DecodeWork& W, const std::string& origin) {
  if (W.nv_list.empty()) return;
  const size_t* actual = reinterpret_cast<const size_t*>(I.h_small.b(0));
  const int* statuses = reinterpret_cast<const int*>(I.h_small.b(status_offset(W)));
  for (size_t q = 0; q < W.nv_list.size(); ++q) {
    const Section& s = *W.slots[W.nv_list[q]].s;
    require(statuses[q] == 0 && actual[q] == s.raw_len,
            origin + ": " + section_name(s.kind) + " section: DEFLATE stream is corrupt or does not inflate to " + std::to_string(s.raw_len) +
                " bytes (nvCOMP: " + cuda::nvc::status_string(statuses[q]) + ")");
  }
}

// What decoded the chunks: nvCOMP, libdeflate on the host or nothing
// (stored) for the DP's, rANS on the host for the entropy-coded ones.
std::string backend_name(const DecodeWork& W) {
  std::string dp = W.nv_list.empty() ? (W.n_host_inflate ? "libdeflate-host" : "stored") : W.n_host_inflate ? "nvcomp+libdeflate-host" : "nvcomp";
  if (W.n_ecsq == 0) return dp;
  const bool dp_chunks = std::any_of(W.slots.begin(), W.slots.end(), [](const Slot& x) { return x.s->kind == kChunk && !x.ecsq; });
  return dp_chunks ? dp + "+rans-host" : "rans-host";
}

}  // namespace

std::vector<CudaKvCapture> CudaCodec::decompress(const std::vector<std::span<const uint8_t>>& containers, const std::string& origin,
                                                 const DecompressOptions& opt) {
  Impl& I = *impl_;
  const auto t_start = cuda::clock_type::now();
  const cuda::GemmMode gm = cuda::gemm_mode(opt.precision);
  const int threads = Impl::threads(opt.threads);
  check(cudaSetDevice(I.opt.device), "cudaSetDevice");
  auto t_host = cuda::clock_type::now();
  cuda::HostTrace trace("decompress");
  DecodeWork W;
  // One container: its checksums on `threads` threads; a batch: one
  // container per thread (8 x 32K: 35-45 ms one after another on an H200's
  // host). parallel_for throws the first bad container's error, in batch order.
  const size_t nc = containers.size();
  W.plans.resize(nc);
  detail::parallel_for(nc, detail::resolve_threads(threads, nc), [&](size_t i) {
    const std::string name = nc == 1 ? origin : origin + "[" + std::to_string(i) + "]";
    W.plans[i] = plan_decode(parse(containers[i], name, nc == 1 ? threads : 1), I.cal, name);
  });
  trace.mark("parse+plan");
  W.use_nv = cuda::nvc::built() && I.opt.nvcomp;
  plan_slots(I, W, gm);
  trace.mark("slots");
  trace.count("slots", W.slots.size());
  trace.count("ecsq", W.n_ecsq);
  trace.count("threads", size_t(threads));
  std::vector<CudaKvCapture> outs = allocate_outputs(W);
  trace.mark("outputs");
  plan_tables(I, W, outs, gm, threads);
  trace.mark("tables");
  const double host_inflate_ms = stage_inputs(I, W, origin, threads, gm);
  trace.mark("stage");
  double host_ms = ms_since(t_host) - host_inflate_ms;
  cuda::Timeline tl(I.st, opt.stats != nullptr);
  inflate_and_transform(I, W, outs, gm, tl);
  trace.mark("device");
  t_host = cuda::clock_type::now();
  check_statuses(I, W, origin);
  host_ms += ms_since(t_host);
  trace.mark("check");
  tl.fill(opt.stats, host_inflate_ms, host_ms, ms_since(t_start), threads, gm.precision, backend_name(W));
  return outs;
}

}  // namespace kvtc
