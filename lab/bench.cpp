// kvtc-lab bench: codec speed with fixed columns, restore against recompute,
// and the machine's own yardsticks (GEMM peak, memcpy), in one run.
//
// Per context length: llama.cpp prefills real text of the evaluation split
// (recompute_ms = what a session pays without a cache), the raw f16 state
// is taken and loaded back (raw_restore_ms), zstd and libdeflate code the
// raw cache; then per nominal ratio the cache is compressed and decompressed
// `--repeat` times (the fastest run is reported, as the others include
// page-faults and cold caches) with per-stage times, and restored into
// llama.cpp: restore_ms = decompress + state load. Contexts past the
// model's trained length are measured on the real capture tiled (each key
// with its own position), at 16x only: the codec's time against length, not
// llama.cpp's, is what they show, and recompute_ms is then null.
#include <libdeflate.h>
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "baselines.h"
#include "kvtc/corpus.h"
#include "kvtc/internal/lab_support.h"
#include "kvtc/kvtc.h"
#include "kvtc/llama.h"
#include "lab.h"
#if KVTC_WITH_CUDA
#include "bench_cuda.h"
#endif

namespace kvtc::lab {

namespace {

using clock_type = std::chrono::steady_clock;

struct BenchArgs {
  std::string model, calib, corpus, out_json, out_md;
  std::vector<uint32_t> contexts{1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<double> ratios{8, 16, 32, 64};
  std::vector<int> levels;                      // DEFLATE level sweep (empty: none)
  std::vector<std::string> precisions{"auto"};  // projection precisions, a row each
  std::vector<std::string> codings{"dp"};       // dp, ecsq (the entropy-coded mode at the nominal ratio): a row each
  uint32_t window_bits = 16;                    // the raw window's width (CompressOptions::window_bits)
  std::string device = "cpu";                   // or cuda (tools/kvtc/bench_cuda.cpp)
  int batch = 1;                                // sequences per codec call (cuda)
  int threads = 0, repeat = 3;
  bool json = false;
  bool scalar_kernels = false;  // the decoder's conversions without AVX-512 (the control for them)
  uint32_t ecsq_lanes = 32;     // 4: entropy-coded chunks as version 2 wrote them (the control for 32 lanes)
  bool dense = false;           // a layer-grouped calibration's basis as one dense GEMM over its zeros (the control)
};

// Resident-set high-water mark of this process (VmHWM), reset on request
// (Linux >= 4.0: writing 5 to /proc/self/clear_refs).
double vm_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atof(line.c_str() + std::strlen(key));
  return 0;
}
void reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

// Real text of at least n tokens: the evaluation split's longest document.
std::vector<int32_t> bench_tokens(const Model& m, const std::string& corpus, uint32_t n) {
  const std::vector<CorpusDoc> docs = Corpus::load(corpus).docs("eval");
  require(!docs.empty(), "bench: no evaluation documents");
  const CorpusDoc* best = &docs.front();
  for (const CorpusDoc& d : docs)
    if (d.tokens > best->tokens) best = &d;
  std::vector<int32_t> t = m.tokenize(corpus_text(*best));
  require(t.size() >= n, "bench: the longest evaluation document has " + std::to_string(t.size()) + " tokens, fewer than " + std::to_string(n));
  t.resize(n);
  return t;
}

// The capture repeated to n tokens (codec timing only). Each copied key
// keeps its own position: keys carry RoPE at that position, and new
// positions would make the de-RoPEd keys garbage (K error 0.3-0.5 instead of
// the real capture's 0.007 at 16x); the codec's work does not depend on
// the position values.
KvCapture tile(const KvCapture& c, uint32_t n) {
  KvCapture o;
  o.model_sha256 = c.model_sha256;
  o.meta = c.meta;
  for (const KvBlock& b : c.blocks) {
    KvBlock x;
    static_cast<BlockGeometry&>(x) = b.geometry();
    for (uint32_t t = 0; t < n; ++t) x.pos.push_back(b.pos[t % b.n_tokens()]);
    x.k.resize(x.numel());
    x.v.resize(x.numel());
    for (uint32_t l = 0; l < b.n_layer(); ++l)
      for (uint32_t h = 0; h < b.n_head_kv; ++h)
        for (uint32_t t = 0; t < n; ++t) {
          const uint32_t s = t % b.n_tokens();
          std::memcpy(&x.k[x.index(l, h, t, 0)], &b.k[b.index(l, h, s, 0)], b.head_dim * 2);
          std::memcpy(&x.v[x.index(l, h, t, 0)], &b.v[b.index(l, h, s, 0)], b.head_dim * 2);
        }
    o.blocks.push_back(std::move(x));
  }
  for (uint32_t t = 0; t < n; ++t) o.tokens.push_back(c.tokens.empty() ? 0 : c.tokens[t % c.tokens.size()]);
  return o;
}

// Best of `repeat` runs of f, in ms.
template <class F>
double best_ms(int repeat, F&& f) {
  double best = 1e300;
  for (int i = 0; i < std::max(1, repeat); ++i) {
    const auto t0 = clock_type::now();
    f();
    best = std::min(best, ms_since(t0));
  }
  return best;
}

double memcpy_gbs(size_t bytes, int repeat) {
  std::vector<uint8_t> a(bytes, 1), b(bytes);
  const double ms = best_ms(repeat, [&] { std::memcpy(b.data(), a.data(), bytes); });
  return double(bytes) / (ms * 1e6);
}

// ---- the run, step by step ----------------------------------------------------

// What the measurements of every context share.
struct BenchRun {
  const BenchArgs& a;
  std::unique_ptr<Model> model;
  Calibration cal;
  int hw = 1, threads = 1;  // hardware threads; threads the codec and llama.cpp use
  bool cuda = false;
  std::vector<Precision> precs;  // --precision, parsed (CPU)
  std::string bf16_impl;         // the bf16 projection's library, or why there is none
  bool bf16 = false;
  clock_type::time_point t_start;
  explicit BenchRun(const BenchArgs& args) : a(args) {}
};

// The model and calibration, and the result's fields that say what ran
// where: files, threads, CPU, the device (its options checked), bf16.
nlohmann::ordered_json load_and_describe(BenchRun& B) {
  const BenchArgs& a = B.a;
  B.model = Model::load(a.model);
  require(!a.calib.empty(), "bench: --calib is required (make calibrate, or the quick calibration `make demo` fits)");
  B.cal = calibration_load(a.calib);
  B.hw = int(std::max(1u, std::thread::hardware_concurrency()));
  B.threads = a.threads > 0 ? a.threads : B.hw;
  nlohmann::ordered_json R;
  R["model"] = B.model->info().path;
  R["calibration"] = a.calib;
  R["calibration_id"] = B.cal.id;
  R["threads"] = B.threads;
  R["hardware_threads"] = B.hw;
  const LibraryInfo li = library_info();
  R["cpu"] = li.cpu;
  R["cpu_features"] = li.cpu_features;
  R["repeat"] = a.repeat;
  R["vector_kernels"] = !a.scalar_kernels;
  R["ecsq_lanes"] = a.ecsq_lanes;
  B.cuda = a.device == "cuda";
  require(B.cuda || a.device == "cpu", "bench: --device must be cpu or cuda, got '" + a.device + "'");
  require(B.cuda || a.batch == 1, "bench: --batch is for --device cuda (the CPU codec takes one sequence per call)");
  if (B.cuda) {
    require(a.levels.empty(), "bench: --levels sweeps the CPU's libdeflate; leave it out with --device cuda");
    require(a.window_bits == 16 && std::find(a.codings.begin(), a.codings.end(), "ecsq") == a.codings.end(),
            "bench: the GPU encoder codes the DP with an f16 window only (docs/gpu.md): --device cuda takes --coding dp --window-bits 16");
#if KVTC_WITH_CUDA
    R["device"] = cuda_bench_device(a.precisions);  // Error with the reason when no GPU is usable
#else
    throw Error("bench --device cuda: this kvtc was built without the GPU path (nvcc was not found at configure time; docs/gpu.md)");
#endif
  } else {
    R["device"] = "cpu";
    for (const std::string& p : a.precisions) B.precs.push_back(parse_precision(p));
  }
  B.bf16 = bf16_projection_available(&B.bf16_impl);
  R["bf16_projection"] = B.bf16 ? B.bf16_impl : "unavailable: " + B.bf16_impl;
  return R;
}

// The machine's yardsticks, with the codec's own GEMM libraries (OpenBLAS
// sgemm; oneDNN bf16 where the CPU has it), on all threads.
nlohmann::ordered_json machine_yardsticks(const BenchRun& B) {
  const BenchArgs& a = B.a;
  const bool bf16 = B.bf16;
  const Transform& T0 = B.cal.blocks[0][0];
  nlohmann::ordered_json base;
  for (Precision p : {Precision::kF32, Precision::kBF16}) {
    if (p == Precision::kBF16 && !bf16) continue;
    const std::string k = precision_name(p);
    base["gemm_peak_gflops_" + k] = projection_gemm_gflops(p, 2048, 2048, 2048, a.repeat);
    base["gemm_codec_shape_gflops_" + k] = projection_gemm_gflops(p, 256, 1024, T0.p, a.repeat);
    std::fprintf(stderr, "[bench] GEMM %s: %.0f GFLOP/s (2048^3), %.0f GFLOP/s (256 x 1024 x %u)\n", k.c_str(),
                 base["gemm_peak_gflops_" + k].get<double>(), base["gemm_codec_shape_gflops_" + k].get<double>(), T0.p);
  }
  // The int8 decode's GEMM (s8 codes [256][1024] times an s8 basis [1024][p],
  // f32 out), where --precision int8 is asked for: giga-operations, as above.
  if (std::find(B.precs.begin(), B.precs.end(), Precision::kInt8) != B.precs.end()) {
    base["gemm_peak_gops_int8"] = projection_gemm_gflops(Precision::kInt8, 2048, 2048, 2048, a.repeat);
    base["gemm_codec_shape_gops_int8"] = projection_gemm_gflops(Precision::kInt8, 256, T0.p, 1024, a.repeat);
    std::fprintf(stderr, "[bench] GEMM int8: %.0f GOP/s (2048^3), %.0f GOP/s (256 x %u x 1024)\n", base["gemm_peak_gops_int8"].get<double>(),
                 base["gemm_codec_shape_gops_int8"].get<double>(), T0.p);
  }
  base["memcpy_gbs"] = memcpy_gbs(size_t(256) << 20, a.repeat);
  return base;
}

// One context's cache: real text prefilled (recompute, state get and raw
// restore timed; it becomes the longest real capture), or past the trained
// length the longest real capture tiled. Fills C's per-context fields.
KvCapture context_capture(const BenchRun& B, Session& s, const std::vector<int32_t>& text, uint32_t ctx, KvCapture& longest,
                          nlohmann::ordered_json& C) {
  KvCapture cap;
  if (ctx <= B.model->info().n_ctx_train) {
    std::vector<int32_t> toks(text.begin(), text.begin() + ctx);
    s.clear();
    const auto t0 = clock_type::now();
    s.decode(toks, 0);
    C["recompute_ms"] = ms_since(t0);  // prefill: what a session pays without its cache
    auto t1 = clock_type::now();
    cap = s.capture();
    C["state_get_ms"] = ms_since(t1);
    cap.tokens = toks;
    C["raw_restore_ms"] = best_ms(B.a.repeat, [&] { s.restore(cap); });
    longest = cap;
    C["tiled"] = false;
  } else {
    require(!longest.blocks.empty(), "bench: contexts past the trained length need a real one first");
    cap = tile(longest, ctx);
    C["recompute_ms"] = nullptr;
    C["tiled"] = true;
  }
  return cap;
}

// The lossless coders on the raw cache: ratio and time.
void lossless_baselines(const KvCapture& cap, nlohmann::ordered_json& C) {
  const uint64_t raw = cap.f16_bytes();
  for (auto [name, level] : {std::pair<const char*, int>{"zstd", 3}, {"deflate", 6}}) {
    uint64_t n = 0;
    const double ms = best_ms(1, [&] { n = baselines::lossless_bytes(cap, name, level); });
    C["lossless"][std::string(name) + "-" + std::to_string(level)] = {{"ratio", double(raw) / double(n)}, {"ms", ms}};
  }
}

// The CPU codec at one ratio and precision: the fastest of --repeat
// compressions and decompressions with their stage times, and the
// reconstruction error (so that precisions compare). *dec and *bytes: the
// last run's output.
void cpu_codec_row(const BenchRun& B, const KvCapture& cap, const AllocationSet& al, CompressOptions& co, const std::string& pname,
                   nlohmann::ordered_json& X, KvCapture* dec, std::vector<uint8_t>* bytes) {
  const BenchArgs& a = B.a;
  const uint64_t raw = cap.f16_bytes();
  co.precision = parse_precision(pname);
  CodecStats enc_st, dec_st;
  double enc_ms = 1e300, dec_ms = 1e300;
  for (int r = 0; r < std::max(1, a.repeat); ++r) {
    CodecStats st;
    co.stats = &st;
    auto t0 = clock_type::now();
    *bytes = compress(cap, B.cal, al, co);
    const double ms = ms_since(t0);
    if (ms < enc_ms) enc_ms = ms, enc_st = st;
  }
  for (int r = 0; r < std::max(1, a.repeat); ++r) {
    CodecStats st;
    DecompressOptions dopt;
    dopt.threads = B.threads;
    dopt.precision = co.precision;
    dopt.stats = &st;
    *dec = KvCapture{};  // free the previous repeat's output first: peak memory is one output
    auto t0 = clock_type::now();
    *dec = decompress(*bytes, B.cal, "bench", dopt);
    const double ms = ms_since(t0);
    if (ms < dec_ms) dec_ms = ms, dec_st = st;
  }
  // int8 is a decode mode: "int8" names the row, the encoder's precision beside it.
  X["precision"] = (dec_st.projection == Precision::kInt8 ? std::string("int8 (enc ") + precision_name(enc_st.projection) + ")"
                                                          : std::string(precision_name(enc_st.projection))) +
                   (dec_st.projection_groups > 1 ? ", " + std::to_string(dec_st.projection_groups) + " runs" : std::string());
  X["projection_groups"] = dec_st.projection_groups;
  X["batch"] = 1;
  X["compressed_mb"] = double(bytes->size()) / 1e6;
  X["ratio"] = double(raw) / double(bytes->size());
  X["compress_ms"] = enc_ms;
  X["decompress_ms"] = dec_ms;
  X["encode_gbs"] = double(raw) / (enc_ms * 1e6);
  X["decode_gbs"] = double(raw) / (dec_ms * 1e6);
  auto stages = [](const CodecStats& t) {
    return nlohmann::ordered_json{{"gather_rope_ms", t.gather_ms}, {"center_ms", t.center_ms},   {"project_ms", t.project_ms},
                                  {"quant_pack_ms", t.quant_ms},   {"entropy_ms", t.entropy_ms}, {"threads", t.threads}};
  };
  X["encode_stages"] = stages(enc_st);
  X["decode_stages"] = stages(dec_st);
  // Accuracy, so that the precisions compare: relative squared
  // error of the coded tokens (sink and window are exact).
  const ReconError err = reconstruction_error(cap, *dec, co.sink, co.window);
  X["rel_error_k"] = err.k;
  X["rel_error_v"] = err.v;
}

// Projection throughput: 2 n p r flops per coded K/V and sequence (a
// layer-grouped basis multiplied run by run: 2 n sum_g r_g p_g, what runs),
// over the stage's thread time x threads (GPU: its wall time).
// The components used are the container's (an entropy-coded kind keeps
// what its step needs, fewer than its allocation set offers).
void projection_gflops(const Calibration& cal, const std::vector<uint8_t>& bytes, bool cuda, nlohmann::ordered_json& X) {
  double flops = 0, macs_total = 0;
  const ContainerInfo ci = inspect(bytes, "bench");
  const AllocationSet& al = ci.header.alloc;
  for (size_t b = 0; b < al.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      const auto& bl = al[b][kv].blocks;
      const uint32_t ru = bl.empty() ? 0 : bl.back().start + bl.back().size;
      const double macs = cuda ? double(cal.blocks[b][kv].p) * ru : double(projection_macs_per_token(cal.blocks[b][kv], ru));
      flops += 2.0 * double(ci.n_compressed_tokens) / double(al.size()) * macs;
      macs_total += macs;
    }
  X["projection_macs_per_token"] = macs_total;
  flops *= X["batch"].get<double>();
  for (const char* dir : {"encode", "decode"}) {
    const auto& st = X[std::string(dir) + "_stages"];
    const double pm = st["project_ms"].get<double>();
    X[std::string("project_gflops_") + dir] = pm > 0 ? flops / (pm * 1e6) * st["threads"].get<double>() : 0;
  }
}

// Restore = decompress + state load into llama.cpp; then the first logits
// (one token re-decoded) for time to first token.
void restore_timings(const BenchRun& B, Session& s, const KvCapture& cap, const KvCapture& dec, uint32_t ctx, const nlohmann::ordered_json& C,
                     nlohmann::ordered_json& X) {
  const double dec_ms = X["decompress_ms"].get<double>();
  // Best of --repeat like the codec: one load varies 0.3-1.1 s at 8K
  // (page faults of the state buffer), which hid the codec's share.
  const double load_ms = best_ms(B.a.repeat, [&] { s.restore(dec); });
  X["state_load_ms"] = load_ms;
  X["restore_ms"] = dec_ms + load_ms;
  const int32_t last = cap.tokens.back();
  s.remove_from(int32_t(ctx) - 1);
  auto t0 = clock_type::now();
  s.decode({last}, int32_t(ctx) - 1);
  X["first_logits_ms"] = ms_since(t0);
  X["speedup_vs_recompute"] = C["recompute_ms"].get<double>() / (dec_ms + load_ms);
}

// One row: the codec at one ratio and precision on the context's cache
// (CPU or GPU), its projection throughput, peak memory and, on real text,
// the restore into llama.cpp.
nlohmann::ordered_json codec_row(const BenchRun& B, Session& s, const KvCapture& cap, uint32_t ctx, double ratio, const std::string& pname,
                                 const std::string& coding, const nlohmann::ordered_json& C) {
  const BenchArgs& a = B.a;
  AllocationSet al = coding == "ecsq" ? ecsq_allocation_set(B.cal, ratio) : allocation_set(B.cal, ratio);
  CompressOptions co;
  co.threads = B.threads;
  co.window_bits = a.window_bits;
  std::vector<uint8_t> bytes;
  const double rss0 = vm_kb("VmRSS:");
  reset_peak();
  KvCapture dec;
  nlohmann::ordered_json X;
  X["nominal_ratio"] = ratio;
  X["coding"] = coding;
  X["window_bits"] = a.window_bits;
  if (B.cuda) {
#if KVTC_WITH_CUDA
    X.update(cuda_bench_row(cap, B.cal, al, co, pname, a.batch, a.repeat, &dec, &bytes));
#endif
  } else {
    cpu_codec_row(B, cap, al, co, pname, X, &dec, &bytes);
  }
  const double peak_mb = (vm_kb("VmHWM:") - rss0) / 1024.0;
  const double enc_ms = X["compress_ms"].get<double>(), dec_ms = X["decompress_ms"].get<double>();
  projection_gflops(B.cal, bytes, B.cuda, X);  // the GPU multiplies the dense basis
  X["peak_extra_mb"] = peak_mb;
  if (ctx <= B.model->info().n_ctx_train) restore_timings(B, s, cap, dec, ctx, C, X);
  std::fprintf(stderr, "[bench] %u tokens, %gx %s %s: %.2fx, compress %.0f ms, decompress %.0f ms (%.0f s)\n", ctx, ratio, coding.c_str(),
               X["precision"].get<std::string>().c_str(), X["ratio"].get<double>(), enc_ms, dec_ms,
               std::chrono::duration<double>(clock_type::now() - B.t_start).count());
  return X;
}

// One context: its cache, the lossless baselines, every ratio and
// precision (past the trained context only 16x, or the first ratio: those
// rows show time against length, the ratios are covered by the real ones),
// and the context's restore figure.
nlohmann::ordered_json measure_context(const BenchRun& B, Session& s, const std::vector<int32_t>& text, uint32_t ctx, KvCapture& longest) {
  const BenchArgs& a = B.a;
  nlohmann::ordered_json C;
  C["tokens"] = ctx;
  const KvCapture cap = context_capture(B, s, text, ctx, longest, C);
  C["raw_mb"] = double(cap.f16_bytes()) / 1e6;
  lossless_baselines(cap, C);
  C["ratios"] = nlohmann::json::array();
  for (double ratio : a.ratios)
    for (const std::string& coding : a.codings)
      for (const std::string& pname : a.precisions) {
        const double only = std::find(a.ratios.begin(), a.ratios.end(), 16.0) != a.ratios.end() ? 16.0 : a.ratios.front();
        if (C["tiled"].get<bool>() && ratio != only) continue;
        C["ratios"].push_back(codec_row(B, s, cap, ctx, ratio, pname, coding, C));
      }
  // The per-context figure asked for: restore at 16x (else the first
  // ratio), the first precision's row. Chosen before C gains a key: an
  // ordered_json object is a vector, so inserting moves C["ratios"].
  nlohmann::json restore;
  for (const auto& X : C["ratios"])
    if (X.contains("restore_ms") && (restore.is_null() || (X["nominal_ratio"] == 16.0 && restore[1] != 16.0)))
      restore = {X["restore_ms"], X["nominal_ratio"]};
  if (!restore.is_null()) C["restore_ms"] = restore[0];
  return C;
}

// DEFLATE level choice on the longest real capture, 16x.
nlohmann::ordered_json level_sweep(const BenchRun& B, const KvCapture& cap) {
  const BenchArgs& a = B.a;
  AllocationSet al = allocation_set(B.cal, 16);
  nlohmann::ordered_json sweep = nlohmann::json::array();
  for (int level : a.levels) {
    CompressOptions co;
    co.threads = B.threads;
    co.precision = B.precs.front();
    co.deflate_level = level;
    std::vector<uint8_t> bytes;
    const double enc = best_ms(a.repeat, [&] { bytes = compress(cap, B.cal, al, co); });
    DecompressOptions dopt;
    dopt.threads = B.threads;
    dopt.precision = B.precs.front();
    const double dec = best_ms(a.repeat, [&] { (void)decompress(bytes, B.cal, "bench", dopt); });
    sweep.push_back({{"level", level},
                     {"tokens", cap.blocks[0].n_tokens()},
                     {"ratio", double(cap.f16_bytes()) / double(bytes.size())},
                     {"compress_ms", enc},
                     {"decompress_ms", dec}});
  }
  return sweep;
}

// The device note (GPU rows) and the machine's yardsticks.
void yardsticks_markdown(const BenchRun& B, const nlohmann::ordered_json& R, std::ostream& md) {
  const BenchArgs& a = B.a;
  const nlohmann::ordered_json& base = R["baselines"];
  const int threads = B.threads;
  const bool cuda = B.cuda;
  const std::string& bf16_impl = B.bf16_impl;
  const Transform& T0 = B.cal.blocks[0][0];
  char b[512];
  if (cuda)
    md << "\nDevice: " << R["device"].get<std::string>() << ". Rows: the GPU codec on the cache held in GPU memory (upload not timed), " << a.batch
       << " sequence(s) per call; containers come back to host memory and are decoded back into GPU memory; stages are GPU "
       << "wall ms (transfer and host work in the JSON); restore = GPU decompress + download + llama.cpp state load on the CPU build; the "
       << "host CPU's yardsticks follow.\n";
  std::snprintf(b, sizeof b, "\nGEMM peak (%d threads, 2048^3 / the codec's shape 256 x 1024 x %u): f32 %.0f / %.0f GFLOP/s (OpenBLAS sgemm)",
                threads, T0.p, base["gemm_peak_gflops_f32"].get<double>(), base["gemm_codec_shape_gflops_f32"].get<double>());
  md << b;
  if (base.contains("gemm_peak_gflops_bf16")) {
    std::snprintf(b, sizeof b, ", bf16 %.0f / %.0f GFLOP/s (oneDNN %s)", base["gemm_peak_gflops_bf16"].get<double>(),
                  base["gemm_codec_shape_gflops_bf16"].get<double>(), bf16_impl.c_str());
    md << b;
  } else {
    md << ", no bf16 (" << bf16_impl << ")";
  }
  if (base.contains("gemm_peak_gops_int8")) {
    std::string impl;
    int8_projection_available(&impl);
    std::snprintf(b, sizeof b, ", int8 %.0f / %.0f GOP/s (oneDNN %s; its shape: 256 x %u x 1024, codes times the basis)",
                  base["gemm_peak_gops_int8"].get<double>(), base["gemm_codec_shape_gops_int8"].get<double>(), impl.c_str(), T0.p);
    md << b;
  }
  std::snprintf(b, sizeof b, "; memcpy %.1f GB/s.\n\n", base["memcpy_gbs"].get<double>());
  md << b;
}

// One row per context, ratio and precision: sizes, times, stages,
// throughput, error, memory, restore against recompute.
void codec_markdown(const BenchRun& B, const nlohmann::ordered_json& R, std::ostream& md) {
  const bool cuda = B.cuda;
  char b[512];
  md << "| tokens | raw MB | nominal | proj | comp. MB | ratio | compress ms | decompress ms | enc GB/s | dec GB/s | enc stages "
        "gather/center/proj/quant/entropy ms | "
        "dec stages ms | proj GFLOP/s enc/dec | rel. err K/V | threads | peak +MB | restore ms | recompute ms | speed-up |\n";
  md << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& C : R["contexts"]) {
    for (const auto& X : C["ratios"]) {
      auto st = [](const nlohmann::json& s) {
        char o[128];
        std::snprintf(o, sizeof o, "%.0f/%.0f/%.0f/%.0f/%.0f", s["gather_rope_ms"].get<double>(), s["center_ms"].get<double>(),
                      s["project_ms"].get<double>(), s["quant_pack_ms"].get<double>(), s["entropy_ms"].get<double>());
        return std::string(o);
      };
      std::string rest = "—", rec = "—", sp = "—";
      if (X.contains("restore_ms")) {
        std::snprintf(b, sizeof b, "%.0f", X["restore_ms"].get<double>());
        rest = b;
        std::snprintf(b, sizeof b, "%.0f", C["recompute_ms"].get<double>());
        rec = b;
        std::snprintf(b, sizeof b, "%.1fx", X["speedup_vs_recompute"].get<double>());
        sp = b;
      } else {
        rec = "(tiled)";
      }
      // threads, or GPU x sequences per call
      const std::string thr = cuda ? "GPU x" + std::to_string(X["batch"].get<int>()) : std::to_string(X["encode_stages"]["threads"].get<int>());
      const std::string nominal =
          (X.value("coding", std::string("dp")) == "ecsq" ? " ecsq" : "") + std::string(X.value("window_bits", 16u) == 8 ? " w8" : "");
      std::snprintf(
          b, sizeof b,
          "| %u | %.1f | %gx%s | %s | %.2f | %.2fx | %.0f | %.0f | %.2f | %.2f | %s | %s | %.0f/%.0f | %.5f/%.5f | %s | %.0f | %s | %s | %s |\n",
          C["tokens"].get<uint32_t>(), C["raw_mb"].get<double>(), X["nominal_ratio"].get<double>(), nominal.c_str(),
          X["precision"].get<std::string>().c_str(), X["compressed_mb"].get<double>(), X["ratio"].get<double>(), X["compress_ms"].get<double>(),
          X["decompress_ms"].get<double>(), X["encode_gbs"].get<double>(), X["decode_gbs"].get<double>(), st(X["encode_stages"]).c_str(),
          st(X["decode_stages"]).c_str(), X["project_gflops_encode"].get<double>(), X["project_gflops_decode"].get<double>(),
          X["rel_error_k"].get<double>(), X["rel_error_v"].get<double>(), thr.c_str(), X["peak_extra_mb"].get<double>(), rest.c_str(), rec.c_str(),
          sp.c_str());
      md << b;
    }
  }
}

// The per-context baselines: recompute, raw state load, lossless coders.
void baselines_markdown(const nlohmann::ordered_json& R, std::ostream& md) {
  char b[512];
  md << "\nBaselines per context: llama.cpp prefill (recompute), raw f16 state load, lossless coders on the raw cache.\n\n"
        "| tokens | recompute ms | raw state load ms | zstd-3 ratio / ms | deflate-6 ratio / ms |\n|---|---|---|---|---|\n";
  for (const auto& C : R["contexts"]) {
    std::string rec = C["recompute_ms"].is_null() ? "(tiled)" : std::to_string(int(C["recompute_ms"].get<double>()));
    std::string rr = C.contains("raw_restore_ms") ? std::to_string(int(C["raw_restore_ms"].get<double>())) : "—";
    std::snprintf(b, sizeof b, "| %u | %s | %s | %.3fx / %.0f | %.3fx / %.0f |\n", C["tokens"].get<uint32_t>(), rec.c_str(), rr.c_str(),
                  C["lossless"]["zstd-3"]["ratio"].get<double>(), C["lossless"]["zstd-3"]["ms"].get<double>(),
                  C["lossless"]["deflate-6"]["ratio"].get<double>(), C["lossless"]["deflate-6"]["ms"].get<double>());
    md << b;
  }
}

// The DEFLATE level sweep, when there is one.
void level_sweep_markdown(const nlohmann::ordered_json& R, std::ostream& md) {
  if (!R.contains("level_sweep")) return;
  char b[512];
  md << "\nDEFLATE level (16x, " << R["level_sweep"][0]["tokens"].get<uint32_t>()
     << " tokens):\n\n| level | ratio | compress ms | decompress ms |\n|---|---|---|---|\n";
  for (const auto& L : R["level_sweep"]) {
    std::snprintf(b, sizeof b, "| %d | %.2fx | %.0f | %.0f |\n", L["level"].get<int>(), L["ratio"].get<double>(), L["compress_ms"].get<double>(),
                  L["decompress_ms"].get<double>());
    md << b;
  }
}

// The tables: the device note, the yardsticks, one row per context, ratio
// and precision, the per-context baselines, the level sweep.
std::string bench_markdown(const BenchRun& B, const nlohmann::ordered_json& R) {
  std::ostringstream md;
  yardsticks_markdown(B, R, md);
  codec_markdown(B, R, md);
  baselines_markdown(R, md);
  level_sweep_markdown(R, md);
  return md.str();
}

int run_bench(const BenchArgs& a) {
  BenchRun B(a);
  B.t_start = clock_type::now();
  nlohmann::ordered_json R = load_and_describe(B);
  R["baselines"] = machine_yardsticks(B);

  // The contexts in order, real text up to the longest one the model was
  // trained for, in one llama.cpp context of that size.
  const uint32_t n_train = B.model->info().n_ctx_train;
  std::vector<uint32_t> contexts = a.contexts;
  std::sort(contexts.begin(), contexts.end());
  uint32_t max_real = 0;
  for (uint32_t c : contexts)
    if (c <= n_train) max_real = c;
  require(max_real > 0, "bench: at least one context must fit the model's trained length (" + std::to_string(n_train) + " tokens)");
  std::vector<int32_t> text = bench_tokens(*B.model, a.corpus, max_real);
  SessionOptions so;
  so.n_ctx = max_real + 16;
  so.n_threads = B.threads;
  Session s(*B.model, so);
  KvCapture longest;  // the longest real capture, tiled past the trained context
  R["contexts"] = nlohmann::json::array();
  for (uint32_t ctx : contexts) R["contexts"].push_back(measure_context(B, s, text, ctx, longest));
  if (!a.levels.empty()) R["level_sweep"] = level_sweep(B, longest);
  R["seconds"] = std::chrono::duration<double>(clock_type::now() - B.t_start).count();

  const std::string md = bench_markdown(B, R);
  if (!a.out_json.empty()) {
    const std::string js = R.dump(1) + "\n";
    write_file_atomic(a.out_json, {reinterpret_cast<const uint8_t*>(js.data()), js.size()});
  }
  if (!a.out_md.empty()) write_file_atomic(a.out_md, {reinterpret_cast<const uint8_t*>(md.data()), md.size()});
  if (a.json)
    std::printf("%s\n", R.dump(2).c_str());
  else
    std::printf("%s", md.c_str());
  return 0;
}

}  // namespace

Action add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  a->model = default_model();
  a->corpus = default_corpus();
  CLI::App* sub = app.add_subcommand("bench", "Codec speed (fixed columns) with restore vs recompute, GEMM peak and memcpy as yardsticks");
  model_option(sub, a->model, "GGUF model");
  sub->add_option("--calib", a->calib, "Calibration file")->required();
  sub->add_option("--corpus", a->corpus, "Corpus root")->capture_default_str();
  sub->add_option("--context", a->contexts, "Context lengths (past the model's trained length: the real capture tiled, codec only)")
      ->capture_default_str()
      ->check(CLI::Range(64u, 1u << 20));
  sub->add_option("-r,--ratio", a->ratios, "Nominal ratios")->capture_default_str()->check(CLI::Range(1.0, 4096.0));
  sub->add_option("--levels", a->levels, "Also sweep these DEFLATE levels at the longest real context, 16x")->check(CLI::Range(0, 12));
  sub->add_option("--precision", a->precisions,
                  "Projection precisions, a row each: auto, f32, bf16, int8 (decode; the encoder runs as auto) (cuda also tf32, f16; auto = f32 "
                  "there)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "f32", "bf16", "tf32", "f16", "int8"}));
  sub->add_option("--coding", a->codings, "dp (the paper's DP + DEFLATE) and/or ecsq (the entropy-coded mode): a row each")
      ->capture_default_str()
      ->check(CLI::IsMember({"dp", "ecsq"}));
  sub->add_option("--window-bits", a->window_bits, "The raw window: 16 (f16) or 8 (container version 3)")
      ->capture_default_str()
      ->check(CLI::IsMember({8, 16}));
  sub->add_option("--device", a->device, "cpu, or cuda: the GPU codec on caches held in GPU memory (docs/gpu.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--batch", a->batch, "Sequences per codec call (--device cuda)")->capture_default_str()->check(CLI::Range(1, 256));
  sub->add_option("--threads", a->threads, "Threads for the codec and llama.cpp (0: all)")->capture_default_str();
  sub->add_option("--repeat", a->repeat, "Runs per measurement; the fastest is reported")->capture_default_str()->check(CLI::Range(1, 100));
  sub->add_option("--out-json", a->out_json, "Write the JSON here");
  sub->add_option("--out-md", a->out_md, "Write the tables here");
  sub->add_flag("--json", a->json, "Print JSON instead of the tables");
  sub->add_flag(
      "--dense", a->dense,
      "A layer-grouped calibration (kvtc calibrate --layer-groups) multiplied as one dense GEMM over its zeros: the control for its runs apart");
  sub->add_flag("--scalar-kernels", a->scalar_kernels,
                "The decoder's int8 code conversion, re-RoPE and 32-lane rANS in their scalar forms (the same bits): the control for their "
                "vector kernels");
  sub->add_option("--ecsq-lanes", a->ecsq_lanes,
                  "Entropy-coded chunks in 32 lanes (container version 4) or 4 (version 2, as earlier writers): the control for 32 lanes")
      ->capture_default_str()
      ->check(CLI::IsMember({4, 32}));
  return [a] {
    if (a->dense) set_grouped_projection(false);
    if (a->scalar_kernels) set_vector_kernels(false);
    set_ecsq_writer_lanes(a->ecsq_lanes);
    return run_bench(*a);
  };
}

}  // namespace kvtc::lab
