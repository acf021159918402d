// kvtc calibrate / compress / decompress / inspect.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kvtc/kvtc.h"
#include "kvtc/llama.h"

extern "C" char* openblas_get_corename(void) __attribute__((weak));  // weak: another BLAS still links

namespace kvtc::cli {

namespace {

void check_output_path(const std::string& out) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(out).parent_path();
  std::error_code ec;
  if (dir.empty()) dir = ".";
  require(fs::is_directory(dir, ec), out + ": output directory " + dir.string() + " does not exist");
  require(!fs::is_directory(out, ec), out + ": is a directory, expected a file path");
}

nlohmann::ordered_json calib_summary(const Calibration& cal, const std::string& path) {
  nlohmann::ordered_json j;
  j["output"] = path;
  j["calibration_id"] = cal.id;
  j["model_sha256"] = cal.geometry.model_sha256;
  for (const char* k : {"arch", "calib_tokens", "calib_documents", "heldout_tokens", "pca_route", "layer_groups"})
    if (cal.meta.count(k)) j[k] = cal.meta.at(k);
  j["blocks"] = nlohmann::json::array();
  for (size_t b = 0; b < cal.blocks.size(); ++b)
    for (int kv = 0; kv < 2; ++kv) {
      const Transform& t = cal.blocks[b][kv];
      nlohmann::ordered_json x;
      x["block"] = b;
      x["kind"] = kv == 0 ? "keys" : "values";
      x["p"] = t.p;
      x["r"] = t.r;
      double top = 0;
      for (float v : t.variance) top += v;
      x["explained_variance_r"] = t.total_variance > 0 ? top / t.total_variance : 0;
      for (uint32_t k : {16u, 64u, 256u, 1024u})
        if (k <= t.r) {
          double s = 0;
          for (uint32_t i = 0; i < k; ++i) s += t.variance[i];
          x["explained_variance_top" + std::to_string(k)] = s / t.total_variance;
        }
      std::vector<std::pair<std::string, Allocation>> tabs(t.tables.begin(), t.tables.end());
      std::sort(tabs.begin(), tabs.end(), [](const auto& x, const auto& y) { return x.second.nominal_ratio < y.second.nominal_ratio; });
      for (const auto& [name, a] : tabs) {
        uint32_t coded = 0;
        for (const BlockAlloc& ba : a.blocks)
          if (ba.type != QType::kNone) coded = ba.start + ba.size;
        x["ratios"][name] = {{"budget_bits_per_token", a.budget_bits},
                             {"bits_per_token", a.bits},
                             {"components_coded", coded},
                             {"heldout_relative_error", t.total_variance > 0 ? a.error / t.total_variance : 0}};
      }
      j["blocks"].push_back(x);
    }
  return j;
}

}  // namespace

Action add_calibrate(CLI::App& app) {
  auto o = std::make_shared<CorpusCalibrateOptions>();
  auto out = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  o->model_path = default_model();
  o->corpus_dir = default_corpus();
  CLI::App* sub = app.add_subcommand("calibrate", "PCA basis and bit-allocation tables from the calibration corpus");
  model_option(sub, o->model_path, "GGUF model");
  sub->add_option("--corpus", o->corpus_dir, "Corpus root (manifest.json, calib/)")->capture_default_str();
  sub->add_option("--tokens", o->n_tokens, "Tokens for the PCA fit")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--heldout", o->heldout_tokens, "Held-out tokens for the block errors")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--rank-max", o->fit.rank_max, "Largest number of components kept")->capture_default_str()->check(CLI::PositiveNumber);
  sub->add_option("--doc-tokens", o->max_doc_tokens, "Tokens per document at most (0: the model's context)")->capture_default_str();
  sub->add_option("--ratios", o->fit.ratios, "Nominal ratios to tabulate")->capture_default_str();
  sub->add_option("--pca", o->fit.pca_route, "PCA route: exact, randomized or auto (exact while p <= 12288)")
      ->check(CLI::IsMember({"auto", "exact", "randomized"}))
      ->capture_default_str();
  sub->add_option("--power-iters", o->fit.power_iters, "Power iterations of the randomized route")->capture_default_str();
  sub->add_option("--threads", o->threads, "Threads (default: all)");
  // The RoPE flags a server runs with, so the components are fitted on the
  // keys it computes; llama-server's names. It buys little
  // (bench/results/rope-settings-calib.md), but the file then names them.
  sub->add_option("--rope-scaling", o->rope.scaling, "RoPE scaling of the contexts: none, linear or yarn (default: the GGUF's)")
      ->check(CLI::IsMember({"none", "linear", "yarn"}));
  sub->add_option("--rope-freq-base", o->rope.freq_base, "RoPE base frequency of the contexts (default: the GGUF's)")->check(CLI::PositiveNumber);
  sub->add_option("--rope-freq-scale", o->rope.freq_scale, "RoPE frequency scale of the contexts (default: the GGUF's)")->check(CLI::PositiveNumber);
  sub->add_option_function<float>(
         "--rope-scale", [o](float n) { o->rope.freq_scale = 1.0f / n; }, "RoPE context scaling factor N: --rope-freq-scale 1/N")
      ->check(CLI::PositiveNumber);
  sub->add_option("--yarn-orig-ctx", o->rope.yarn_orig_ctx, "YaRN's original context of the contexts (default: the GGUF's)");
  sub->add_option("--layer-groups", o->fit.layer_groups,
                  "One PCA per run of consecutive layers (this many runs): the decoder multiplies each run apart, ~1.8x fewer multiply-adds "
                  "with 2 for ~12% more bits at equal error (meta layer_groups)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  sub->add_flag("--keep-rope", o->fit.keep_rope, "Ablation: fit keys with RoPE applied, as llama.cpp stores them (meta keys_rope = kept)");
  sub->add_option("--kinds", o->kinds, "Corpus kinds to calibrate on (prose, docs, code, math; default all)");
  sub->add_option("-o,--output", *out, "Output calibration file (.safetensors)")->required();
  sub->add_flag("--json", *json, "Print the summary as JSON");
  return [o, out, json] {
    check_output_path(*out);
    const bool tty = ::isatty(2);
    auto t0 = std::chrono::steady_clock::now();
    // Seconds per stage (ProgressFn: the time since the previous call
    // belongs to the stage named), so the summary says how much was prefill.
    std::map<std::string, double> stage_s;
    double last_ms = 0;
    ProgressFn prog = [&](const std::string& stage, uint64_t done, uint64_t total) {
      const double now = ms_since(t0);
      stage_s[stage] += (now - last_ms) / 1000;
      last_ms = now;
      if (!tty) return;
      std::fprintf(stderr, "\r[calibrate] %-8s %3.0f%% (%llu/%llu) %.0f s   ", stage.c_str(), total ? 100.0 * done / total : 100.0,
                   (unsigned long long)done, (unsigned long long)total, ms_since(t0) / 1000);
      std::fflush(stderr);
    };
    Calibration cal = calibrate_from_corpus(*o, prog);
    if (tty) std::fprintf(stderr, "\n");
    // Which BLAS kernels made it (main.cpp pins them; KVTC_CALIB_BLAS=native does not).
    const char* env_core = std::getenv("OPENBLAS_CORETYPE");
    const char* env_threads = std::getenv("OPENBLAS_NUM_THREADS");
    const char* blas_mode = std::getenv("KVTC_CALIB_BLAS");
    cal.meta["blas"] = std::string("OpenBLAS ") + (openblas_get_corename ? openblas_get_corename() : "(another BLAS)") +
                       ", OPENBLAS_NUM_THREADS=" + (env_threads ? env_threads : "unset") +
                       (blas_mode && std::string(blas_mode) == "native" ? " (KVTC_CALIB_BLAS=native: not pinned)"
                        : env_core                                      ? " (pinned: the same bytes on any x86-64-v3 CPU)"
                                                                        : "");
    {
      // Which ggml CPU variant made the K/V (main.cpp pins haswell).
      const std::string cpu = llama_cpu_build();
      cal.meta["llama_cpu"] =
          cpu + (!llama_cpu_requested().empty() ? (cpu == "haswell" ? " (pinned: the same K/V on any x86-64-v3 CPU)" : " (KVTC_GGML_CPU)")
                                                : " (ggml's choice for this CPU: not reproducible on others)");
    }
    calibration_save(*out, cal);
    nlohmann::ordered_json j = calib_summary(cal, *out);
    j["seconds"] = ms_since(t0) / 1000;
    j["stage_seconds"] = stage_s;
    if (*json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("calibration %s… written to %s (%.0f s", cal.id.substr(0, 16).c_str(), out->c_str(), ms_since(t0) / 1000);
      for (const auto& [st, sec] : stage_s) std::printf("; %s %.0f s", st.c_str(), sec);
      std::printf(")\n");
      std::printf("  %s fit tokens from %s documents, %s held-out tokens\n", cal.meta["calib_tokens"].c_str(), cal.meta["calib_documents"].c_str(),
                  cal.meta["heldout_tokens"].c_str());
      for (const auto& x : j["blocks"]) {
        std::printf("  block %d %-6s p=%u r=%u explained@64=%.3f\n", x["block"].get<int>(), x["kind"].get<std::string>().c_str(),
                    x["p"].get<unsigned>(), x["r"].get<unsigned>(), x.value("explained_variance_top64", 0.0));
        for (auto it = x["ratios"].begin(); it != x["ratios"].end(); ++it)
          std::printf("    %5sx: %6llu bits/token, %5u components, held-out rel. error %.4f\n", it.key().c_str(),
                      (unsigned long long)it.value()["bits_per_token"].get<uint64_t>(), it.value()["components_coded"].get<unsigned>(),
                      it.value()["heldout_relative_error"].get<double>());
      }
    }
    return 0;
  };
}

Action add_compress(CLI::App& app) {
  struct A {
    std::string calib, in, out;
    double ratio = 16;
    CompressOptions opt;
    std::string precision = "auto";
    std::string coding = "ecsq";
    bool json = false;
  };
  auto a = std::make_shared<A>();
  a->opt.window_bits = 8;  // the CLI's default (bench/results/window8.md); the library's stays 16 (the GPU encoder writes f16 windows)
  CLI::App* sub = app.add_subcommand("compress", "Compress a capture (.safetensors) into a .kvtc container");
  sub->add_option("input", a->in, "Capture from `kvtc capture`")->required();
  sub->add_option("--calib", a->calib, "Calibration file from `kvtc calibrate`")->required();
  sub->add_option("-r,--ratio", a->ratio, "Nominal compression ratio (DP budget = 16 bits / ratio per feature)")->capture_default_str();
  sub->add_option("--sink", a->opt.sink, "Raw tokens at the start")->capture_default_str();
  sub->add_option("--window", a->opt.window, "Raw recent tokens")->capture_default_str();
  sub->add_option("--window-bits", a->opt.window_bits,
                  "Bits per value of the raw window: 8 (int8 with an f16 scale per key channel / value token; container version 3, "
                  "docs/format.md; its KL within the noise of f16's, bench/results/window8.md) or 16 (f16, exact)")
      ->check(CLI::IsMember({8, 16}))
      ->capture_default_str();
  sub->add_option("--chunk", a->opt.chunk_tokens, "Tokens per independently decodable chunk (multiple of 16)")->capture_default_str();
  sub->add_option("--level", a->opt.deflate_level, "DEFLATE level (0 = store)")->check(CLI::Range(0, 12))->capture_default_str();
  sub->add_option("--precision", a->precision, "Projection: auto (bf16 where the CPU has AVX512-BF16 or AMX), f32 or bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
  sub->add_option("--coding", a->coding,
                  "ecsq: one step for all components, rANS-coded, rate-controlled to --ratio on the coded tokens (version 2, "
                  "docs/format.md; ~20% fewer bytes than dp at equal error, bench/results/entropy.md); dp: the paper's fixed-rate "
                  "quantizers from the DP allocation, then DEFLATE (version 1; --level applies to it; the GPU codec codes it only)")
      ->capture_default_str()
      ->check(CLI::IsMember({"dp", "ecsq"}));
  sub->add_option("--step", a->opt.ecsq_step, "ecsq: a fixed quantizer step (feature units) instead of rate control")->check(CLI::PositiveNumber);
  sub->add_option("--rounding", a->opt.ecsq_rounding, "ecsq: quantizer rounding (0.5 nearest; less widens the zero bin)")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  sub->add_option("--min-sd", a->opt.ecsq_min_sd, "ecsq: drop components whose calibration std. deviation is under this x step")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("-o,--output", a->out, "Output .kvtc file")->required();
  sub->add_flag("--json", a->json, "JSON summary");
  return [a] {
    a->opt.precision = parse_precision(a->precision);
    CodecStats stats;
    a->opt.stats = &stats;
    check_output_path(a->out);
    auto t0 = std::chrono::steady_clock::now();
    KvCapture c = capture_load(a->in);
    Calibration cal = calibration_load(a->calib);
    const double load_ms = ms_since(t0);
    require(a->coding == "ecsq" || (a->opt.ecsq_step == 0 && a->opt.ecsq_rounding == CompressOptions{}.ecsq_rounding &&
                                    a->opt.ecsq_min_sd == CompressOptions{}.ecsq_min_sd),
            "compress: --step, --rounding and --min-sd need --coding ecsq");
    AllocationSet al = a->coding == "ecsq" ? ecsq_allocation_set(cal, a->ratio) : allocation_set(cal, a->ratio);
    t0 = std::chrono::steady_clock::now();
    std::vector<uint8_t> bytes = compress(c, cal, al, a->opt);  // validates the match first
    const uint64_t bound = compress_bound(c, al, a->opt);
    const double enc_ms = ms_since(t0);
    write_file_atomic(a->out, bytes);
    const ContainerInfo ci = inspect(bytes, a->out);
    nlohmann::ordered_json j;
    j["output"] = a->out;
    j["nominal_ratio"] = a->ratio;
    j["coding"] = a->coding;
    j["container_version"] = ci.header.version;
    j["tokens"] = ci.n_tokens;
    j["compressed_tokens"] = ci.n_compressed_tokens;
    j["bytes"] = bytes.size();
    j["bound_bytes"] = bound;
    j["ratio_compressed_tokens"] = ci.ratio_compressed_tokens();
    j["ratio_whole_cache"] = ci.ratio_whole_cache();
    j["payload_bytes_compressed"] = ci.payload_bytes_compressed;
    j["stored_bytes_compressed"] = ci.stored_bytes_compressed;
    j["f16_bytes_compressed"] = ci.f16_bytes_compressed;
    j["f16_bytes_all"] = ci.f16_bytes_all;
    j["ratio_before_deflate"] = ci.payload_bytes_compressed ? double(ci.f16_bytes_compressed) / ci.payload_bytes_compressed : 0;
    j["load_ms"] = load_ms;
    j["encode_ms"] = enc_ms;
    j["projection"] = precision_name(stats.projection);
    j["projection_groups"] = stats.projection_groups;
    j["entropy_backend"] = stats.entropy_backend;
    j["stage_thread_ms"] = {{"gather", stats.gather_ms}, {"center", stats.center_ms},   {"project", stats.project_ms},
                            {"quant", stats.quant_ms},   {"entropy", stats.entropy_ms}, {"threads", stats.threads}};
    if (a->json)
      std::printf("%s\n", j.dump(2).c_str());
    else
      std::printf("compressed %llu tokens (%llu coded) to %s: %llu bytes, %.2fx on coded tokens, %.2fx on the whole cache, %.0f ms\n",
                  (unsigned long long)ci.n_tokens, (unsigned long long)ci.n_compressed_tokens, a->out.c_str(), (unsigned long long)bytes.size(),
                  j["ratio_compressed_tokens"].get<double>(), j["ratio_whole_cache"].get<double>(), enc_ms);
    return 0;
  };
}

Action add_decompress(CLI::App& app) {
  auto in = std::make_shared<std::string>();
  auto calib = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto ref = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  auto precision = std::make_shared<std::string>("auto");
  CLI::App* sub = app.add_subcommand("decompress", "Decode a .kvtc container back into a capture (.safetensors)");
  sub->add_option("input", *in, ".kvtc file")->required();
  sub->add_option("--calib", *calib, "The calibration it was encoded with")->required();
  sub->add_option("-o,--output", *out, "Output .safetensors (optional with --reference)");
  sub->add_option("--reference", *ref, "Original capture: report the reconstruction error of K and V");
  sub->add_option("--precision", *precision,
                  "Projection: auto (int8 where the CPU has AVX2, unless it has native bf16 without AVX-512 VNNI, or AMX without an AMX int8 kernel: "
                  "then bf16; else f32), "
                  "f32 (the same bits on any CPU), bf16, or int8 (entropy-coded chunks in oneDNN's integer GEMM, ~1% more error)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "f32", "bf16", "int8"}));
  sub->add_flag("--json", *json, "JSON summary");
  return [in, calib, out, ref, json, precision] {
    require(!out->empty() || !ref->empty(), "decompress: give -o OUTPUT, --reference CAPTURE, or both");
    if (!out->empty()) check_output_path(*out);
    std::vector<uint8_t> bytes = read_file(*in);
    Calibration cal = calibration_load(*calib, /*decoder_only=*/true);
    auto t0 = std::chrono::steady_clock::now();
    DecompressOptions dopt;
    dopt.precision = parse_precision(*precision);
    CodecStats stats;
    dopt.stats = &stats;
    KvCapture c = decompress(bytes, cal, *in, dopt);
    const double ms = ms_since(t0);
    if (!out->empty()) capture_save(*out, c);
    nlohmann::ordered_json j;
    j["input"] = *in;
    j["tokens"] = c.blocks[0].n_tokens();
    j["decode_ms"] = ms;
    j["projection"] = precision_name(stats.projection);
    j["projection_groups"] = stats.projection_groups;
    j["entropy_backend"] = stats.entropy_backend;
    j["stage_thread_ms"] = {{"gather", stats.gather_ms}, {"center", stats.center_ms},   {"project", stats.project_ms},
                            {"quant", stats.quant_ms},   {"entropy", stats.entropy_ms}, {"threads", stats.threads}};
    if (!ref->empty()) {
      const ContainerHeader h = inspect(bytes, *in).header;
      ReconError e = reconstruction_error(capture_load(*ref), c, h.sink, h.window);
      j["rel_error_k"] = e.k;
      j["rel_error_v"] = e.v;
      j["error_tokens"] = e.tokens;
    }
    if (*json)
      std::printf("%s\n", j.dump(2).c_str());
    else {
      std::printf("decoded %u tokens from %s in %.0f ms%s%s\n", c.blocks[0].n_tokens(), in->c_str(), ms, out->empty() ? "" : " into ", out->c_str());
      if (!ref->empty())
        std::printf("  relative squared error on coded tokens: K %.5f, V %.5f\n", j["rel_error_k"].get<double>(), j["rel_error_v"].get<double>());
    }
    return 0;
  };
}

Action add_append(CLI::App& app) {
  auto container = std::make_shared<std::string>();
  auto capture = std::make_shared<std::string>();
  auto calib = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand("append", "Grow a .kvtc container with the new tokens of a longer capture (in groups of 16)");
  sub->add_option("container", *container, ".kvtc file to grow (replaced atomically)")->required();
  sub->add_option("capture", *capture, "The grown cache: same first tokens, 16k more")->required();
  sub->add_option("--calib", *calib, "The calibration the container was written with")->required();
  return [container, capture, calib] {
    std::vector<uint8_t> bytes = read_file(*container);
    Calibration cal = calibration_load(*calib);
    KvCapture c = capture_load(*capture);
    auto t0 = std::chrono::steady_clock::now();
    AppendResult r = append(bytes, c, cal, *container);
    const double ms = ms_since(t0);
    write_file_atomic(*container, r.bytes);
    std::printf("appended to %s: %zu bytes kept as they were, %zu bytes now, %.0f ms\n", container->c_str(), r.kept_bytes, r.bytes.size(), ms);
    return 0;
  };
}

Action add_inspect(CLI::App& app) {
  auto in = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  CLI::App* sub = app.add_subcommand("inspect", "Layout, sizes and measured ratio of a .kvtc container");
  sub->add_option("input", *in, ".kvtc file")->required();
  sub->add_flag("--json", *json, "JSON output");
  return [in, json] {
    std::vector<uint8_t> bytes = read_file(*in);
    const ContainerInfo ci = inspect(bytes, *in);
    const ContainerHeader& h = ci.header;
    nlohmann::ordered_json j;
    j["file"] = *in;
    j["version"] = h.version;
    j["calibration_id"] = h.calibration_id;
    j["model_sha256"] = h.geometry.model_sha256;
    j["file_bytes"] = ci.file_bytes;
    j["tokens"] = ci.n_tokens;
    j["compressed_tokens"] = ci.n_compressed_tokens;
    j["ratio_compressed_tokens"] = ci.ratio_compressed_tokens();
    j["ratio_whole_cache"] = ci.ratio_whole_cache();
    std::map<std::string, std::pair<uint64_t, uint64_t>> by;
    for (const auto& s : ci.sections) {
      by[s.kind].first += s.stored_bytes;
      by[s.kind].second += s.raw_bytes;
    }
    for (const auto& [k, v] : by) j["sections"][k] = {{"stored_bytes", v.first}, {"payload_bytes", v.second}};
    j["ratio_table"] = nlohmann::json::array();
    for (const auto& al : h.alloc) {
      nlohmann::json ratios = nlohmann::json::array(), allocs = nlohmann::json::array();
      for (const Allocation& a : al) {
        ratios.push_back(a.nominal_ratio);
        nlohmann::json x = nlohmann::json::array();
        for (const BlockAlloc& b : a.blocks) x.push_back({b.start, b.size, header_type_code(a, b)});
        allocs.push_back(x);
      }
      j["ratio_table"].push_back({{"nominal_ratio", ratios}, {"alloc", allocs}});
    }
    j["sink"] = h.sink;
    j["window"] = h.window;
    j["chunk_tokens"] = h.chunk_tokens;
    j["keys_rope"] = h.keys_derope ? "removed" : "kept";
    if (*json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("%s: kvtc v%u, %llu bytes, %llu tokens (%llu coded), ratio %.2fx on coded tokens, %.2fx on the whole cache\n", in->c_str(),
                  h.version, (unsigned long long)ci.file_bytes, (unsigned long long)ci.n_tokens, (unsigned long long)ci.n_compressed_tokens,
                  j["ratio_compressed_tokens"].get<double>(), j["ratio_whole_cache"].get<double>());
      for (const auto& [k, v] : by)
        std::printf("  %-9s %10llu bytes stored (%llu before DEFLATE)\n", k.c_str(), (unsigned long long)v.first, (unsigned long long)v.second);
    }
    return 0;
  };
}

}  // namespace kvtc::cli
