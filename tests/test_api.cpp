// The public API (include/kvtc/kvtc.h) on synthetic caches — synthetic on
// purpose: these test the algorithm and the formats, not a model (the
// real-model tests are test_llama.cpp and the CLI tests). Covered: every
// byte of a calibration file is integrity-checked; the fitter recovers a
// low-rank structure from caller-supplied caches; llama.cpp state blobs in
// and out; the typed container header; feature rows in and out.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "codec/calibration_io.h"
#include "core/state_blob.h"
#include "fuzz/fuzz_common.h"
#include "kvtc/internal/lab_support.h"
#include "kvtc/kvtc.h"
#include "synthetic.h"

using namespace kvtc;
namespace fs = std::filesystem;

namespace {

fs::path temp_path(const std::string& name) {
  return fs::temp_directory_path() / ("kvtc-test-api-" + std::to_string(::getpid()) + "-" + name);
}

}  // namespace

// ---- the calibration file ----------------------------------------------------

TEST(CalibrationFile, SaveLoadKeepsEverything) {
  const Calibration cal = fitted();
  const fs::path path = temp_path("cal.safetensors");
  calibration_save(path, cal);
  const Calibration back = calibration_load(path);
  EXPECT_EQ(back.id, cal.id);
  EXPECT_EQ(back.geometry.model_sha256, cal.geometry.model_sha256);
  ASSERT_EQ(back.geometry.blocks.size(), 1u);
  EXPECT_EQ(back.geometry.blocks[0], cal.geometry.blocks[0]);  // layers, heads, dims, RoPE with factors
  EXPECT_TRUE(back.keys_derope);
  EXPECT_EQ(back.meta.at("calib_tokens"), cal.meta.at("calib_tokens"));
  EXPECT_EQ(back.blocks[0][0].tables.size(), 2u);
  EXPECT_EQ(back.blocks[0][1].tables.at("8").blocks, cal.blocks[0][1].tables.at("8").blocks);
  EXPECT_EQ(back.meta.count("file_xxh64"), 0u);  // structural keys are not provenance
  fs::remove(path);
}

// Every byte of the file, header included, is covered: flipping bits of
// any byte gives a refusal that names the file — never a silently changed
// calibration (a byte changed in calibration_id or the corpus fields used
// to be accepted). In memory through calibration_parse, the loader's own
// code after read_file (a file write per flip would take minutes), and a
// few flips through real files.
TEST(CalibrationFile, EveryByteFlipIsRefused) {
  FitOptions small;
  small.rank_max = 16;  // a 12 KB file: 48K parses in a few seconds
  small.ratios = {8};
  const Calibration cal = fit_calibration({lowrank_capture(300, 10), lowrank_capture(300, 11)}, {lowrank_capture(200, 50)}, small);
  const fs::path good = temp_path("flip-src.safetensors"), bad = temp_path("flip.safetensors");
  calibration_save(good, cal);
  const std::vector<uint8_t> bytes = read_file(good);
  ASSERT_GT(bytes.size(), 2000u);
  const std::string name = good.string();
  EXPECT_EQ(calibration_parse(bytes, name, false).id, cal.id);
  size_t refused = 0;
  for (size_t i = 0; i < bytes.size(); ++i)
    for (uint8_t mask : {uint8_t(1u << (i % 8)), uint8_t(0xff)}) {
      std::vector<uint8_t> x = bytes;
      x[i] ^= mask;
      for (bool decoder_only : {false, true}) {
        const std::string e = error_of([&] { calibration_parse(x, name, decoder_only); });
        ASSERT_FALSE(e.empty()) << "byte " << i << " ^ " << int(mask) << " accepted (decoder_only " << decoder_only << ")";
        ASSERT_NE(e.find(name), std::string::npos) << "byte " << i << ": error does not name the file: " << e;
        ++refused;
      }
    }
  EXPECT_EQ(refused, bytes.size() * 2 * 2);
  // Through files: a flip in the JSON header, in the checksum, in a tensor.
  const uint64_t header = uint64_t(bytes[0]) | uint64_t(bytes[1]) << 8;
  for (size_t i : {size_t(3), size_t(40), size_t(header / 2), size_t(header + 7), bytes.size() - 1}) {
    std::vector<uint8_t> x = bytes;
    x[i] ^= 0x10;
    write_file_atomic(bad, x);
    const std::string e = error_of([&] { calibration_load(bad); });
    EXPECT_NE(e.find(bad.string()), std::string::npos) << i << ": " << e;
  }
  // Truncation anywhere, and trailing bytes, are refused as well.
  for (size_t n : {size_t(0), size_t(7), size_t(100), bytes.size() / 2, bytes.size() - 1})
    EXPECT_FALSE(error_of([&] { calibration_parse(std::vector<uint8_t>(bytes.begin(), bytes.begin() + n), name, false); }).empty()) << n;
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_FALSE(error_of([&] { calibration_parse(longer, name, false); }).empty());
  fs::remove(good);
  fs::remove(bad);
}

TEST(CalibrationFile, VersionOneFilesStillLoad) {
  // tests/golden/v1/calibration.safetensors predates the whole-file checksum
  // and the geometry keys: it loads, with only p known per block.
  const Calibration v1 = calibration_load(std::string(KVTC_GOLDEN_DIR) + "/calibration-v1.safetensors");
  EXPECT_EQ(v1.geometry.model_sha256, "fuzz");
  ASSERT_EQ(v1.geometry.blocks.size(), 1u);
  EXPECT_TRUE(v1.geometry.blocks[0].layers.empty());
  EXPECT_EQ(v1.blocks[0][0].p, 16u);
  EXPECT_EQ(v1.id, fuzz::small_calibration().id);
}

// ---- fitting -----------------------------------------------------------------

TEST(Fit, RecoversALowRankStructureFromCallerCaches) {
  const Calibration cal = fitted();
  EXPECT_EQ(cal.meta.at("calib_tokens"), std::to_string(3 * (300 - 4)));  // the 4 sink positions left out
  EXPECT_EQ(cal.meta.at("heldout_tokens"), std::to_string(200 - 4));
  const Transform& tk = cal.blocks[0][0];
  double top6 = 0;
  for (uint32_t j = 0; j < 6; ++j) top6 += tk.variance[j];
  EXPECT_GT(top6 / tk.total_variance, 0.99);  // de-RoPEd keys: 6 components explain them
  // At 8x the reconstruction of a new cache is close.
  const KvCapture c = lowrank_capture(400, 77);
  const std::vector<uint8_t> bytes = compress(c, cal, allocation_set(cal, 8));
  const ReconError e = reconstruction_error(c, decompress(bytes, cal, "mem"), 4, 128);
  EXPECT_LT(e.k, 0.01);
  EXPECT_LT(e.v, 0.01);
  EXPECT_EQ(e.tokens, 400u - 4 - 128);
  // Fitted on keys as stored (RoPE kept), the same keys need far more components.
  FitOptions kept;
  kept.keep_rope = true;
  kept.ratios = {8};
  const Calibration ck = fit_calibration({lowrank_capture(300, 10), lowrank_capture(300, 11)}, {lowrank_capture(200, 50)}, kept);
  EXPECT_FALSE(ck.keys_derope);
  double kept6 = 0;
  for (uint32_t j = 0; j < 6; ++j) kept6 += ck.blocks[0][0].variance[j];
  EXPECT_LT(kept6 / ck.blocks[0][0].total_variance, top6 / tk.total_variance);
}

TEST(Fit, RefusesWhatItCannotUse) {
  CalibrationFitter f(lowrank_geometry());
  KvCapture other = lowrank_capture(50, 1);
  other.model_sha256 = "another";
  EXPECT_NE(error_of([&] { f.add(other); }).find("another model"), std::string::npos);
  KvCapture yarn = lowrank_capture(50, 1);
  yarn.blocks[0].rope.unsupported = "rope scaling 'yarn'";
  EXPECT_NE(error_of([&] { f.add(yarn); }).find("yarn"), std::string::npos);
  EXPECT_NE(error_of([&] { f.finish(); }).find("need at least"), std::string::npos);  // nothing added yet
  FitOptions bad;
  bad.pca_route = "magic";
  EXPECT_THROW(CalibrationFitter(lowrank_geometry(), bad), Error);
}

// Layer groups (FitOptions::layer_groups): one PCA per run of layers, the
// components zero outside their run and merged by variance; the codec
// multiplies the runs apart and decodes what the dense GEMM over the zeros
// decodes. Synthetic caches: the fit's and the projection's arithmetic.
TEST(Fit, LayerGroupsFitARunEachAndDecodeAsTheDenseGemm) {
  FitOptions o;
  o.ratios = {4, 8};
  o.layer_groups = 2;
  std::vector<KvCapture> fit, held;
  for (uint32_t i = 0; i < 3; ++i) fit.push_back(lowrank_capture(300, 10 + i));
  held.push_back(lowrank_capture(200, 50));
  const Calibration one = fit_calibration(fit, held, {.ratios = {4, 8}});
  const Calibration cal = fit_calibration(fit, held, o);
  EXPECT_EQ(cal.meta.at("layer_groups"), "2");
  EXPECT_EQ(one.meta.count("layer_groups"), 0u);
  EXPECT_NE(cal.id, one.id);
  for (int kv = 0; kv < 2; ++kv) {
    const Transform &t = cal.blocks[0][kv], &u = one.blocks[0][kv];
    ASSERT_EQ(t.p, 64u);  // 2 layers x 2 heads x 16: layer 0 is features 0..31
    ASSERT_EQ(t.r, 64u);
    EXPECT_NEAR(t.total_variance, u.total_variance, 1e-9 * u.total_variance);
    uint32_t in0 = 0;
    double top_t = 0, top_u = 0;
    for (uint32_t j = 0; j < t.r; ++j) {
      const float* row = &t.basis[size_t(j) * t.p];
      const bool zero0 = std::all_of(row, row + 32, [](float x) { return x == 0.0f; });
      const bool zero1 = std::all_of(row + 32, row + 64, [](float x) { return x == 0.0f; });
      EXPECT_NE(zero0, zero1) << "component " << j << " must lie in one layer group";
      in0 += !zero0;
      if (j > 0) EXPECT_LE(t.variance[j], t.variance[j - 1]);
      // One PCA's leading variances bound any other basis's (Ky Fan; f32 variances: 1e-6).
      top_t += t.variance[j], top_u += u.variance[j];
      EXPECT_LE(top_t, top_u * (1 + 1e-6)) << "top " << j + 1;
    }
    EXPECT_EQ(in0, 32u);
  }
  // Saved and loaded: the same basis, the same id.
  const fs::path file = temp_path("grouped.safetensors");
  calibration_save(file.string(), cal);
  const Calibration back = calibration_load(file.string());
  fs::remove(file);
  EXPECT_EQ(back.id, cal.id);
  EXPECT_EQ(back.meta.at("layer_groups"), "2");
  // The codec, run by run and dense, at 8x (DP and entropy-coded), in f32
  // and auto: the same codes and nearly the same values (measured on a Zen
  // 4 EPYC: identical bytes and decoded f16; bounds 1% of the bytes and 2
  // f16 ulps, for kernels that sum in another order), and close to the cache.
  const KvCapture c = lowrank_capture(600, 77);
  for (Coding coding : {Coding::kFixedRate, Coding::kEntropy})
    for (Precision prec : {Precision::kF32, Precision::kAuto}) {
      SCOPED_TRACE(std::string(coding == Coding::kEntropy ? "ecsq " : "dp ") + precision_name(prec));
      const AllocationSet alloc = coding == Coding::kEntropy ? ecsq_allocation_set(cal, 8) : allocation_set(cal, 8);
      CodecStats es, ds, es_dense, ds_dense;
      CompressOptions co;
      co.precision = prec;
      DecompressOptions dopt;
      dopt.precision = prec;
      co.stats = &es, dopt.stats = &ds;
      const std::vector<uint8_t> grouped = compress(c, cal, alloc, co);
      const KvCapture out = decompress(grouped, cal, "mem", dopt);
      set_grouped_projection(false);
      co.stats = &es_dense, dopt.stats = &ds_dense;
      const std::vector<uint8_t> dense = compress(c, cal, alloc, co);
      const KvCapture dense_out = decompress(grouped, cal, "mem", dopt);
      set_grouped_projection(true);
      EXPECT_EQ(es.projection_groups, 2u);
      EXPECT_EQ(ds.projection_groups, 2u);
      EXPECT_EQ(es_dense.projection_groups, 1u);
      EXPECT_EQ(ds_dense.projection_groups, 1u);
      EXPECT_EQ(grouped.size(), dense.size());
      size_t differ = 0;
      for (size_t i = 0; i < grouped.size(); ++i) differ += grouped[i] != dense[i];
      EXPECT_LE(differ, grouped.size() / 100) << "the codes of the runs apart and of the dense GEMM";
      const KvBlock &a = out.blocks[0], &b = dense_out.blocks[0];
      ASSERT_EQ(a.k.size(), b.k.size());
      double worst = 0;
      for (const auto& [x, y] : {std::pair{&a.k, &b.k}, std::pair{&a.v, &b.v}})
        for (size_t i = 0; i < x->size(); ++i) {
          const double fx = f16_to_f32((*x)[i]), fy = f16_to_f32((*y)[i]);
          worst = std::max(worst, std::fabs(fx - fy) / f16_ulp(std::max(std::fabs(fx), std::fabs(fy))));
        }
      EXPECT_LE(worst, 2.0) << "f16 ulps between the runs apart and the dense GEMM";
      std::printf("  %s %s: %zu of %zu container bytes differ, decoded <= %.0f f16 ulp apart\n", coding == Coding::kEntropy ? "ecsq" : "dp",
                  precision_name(prec), differ, grouped.size(), worst);
      const ReconError e = reconstruction_error(c, out, 4, 128);
      EXPECT_LT(e.k, 0.02);
      EXPECT_LT(e.v, 0.02);
    }
  // What a grouped fit cannot do.
  FitOptions three = o;
  three.layer_groups = 3;  // 2 layers
  EXPECT_NE(error_of([&] { CalibrationFitter(lowrank_geometry(), three); }).find("layer groups"), std::string::npos);
  FitOptions rnd = o;
  rnd.pca_route = "randomized";
  EXPECT_NE(error_of([&] { CalibrationFitter(lowrank_geometry(), rnd); }).find("exact PCA route"), std::string::npos);
}

TEST(Fit, FeatureRowsRoundTrip) {
  KvCapture c = lowrank_capture(40, 3, 1000);
  const KvBlock before = c.blocks[0];
  const std::vector<float> rows = feature_rows(c.blocks[0], true, true, 5, 30);
  ASSERT_EQ(rows.size(), size_t(25) * 64);
  set_feature_rows(c.blocks[0], true, true, 5, 30, rows);
  size_t differ = 0;
  for (size_t i = 0; i < before.k.size(); ++i) differ += before.k[i] != c.blocks[0].k[i];
  EXPECT_LE(differ, before.k.size() / 200);  // de-RoPE then re-RoPE: within an f16 rounding for a few values
  EXPECT_THROW(feature_rows(c.blocks[0], true, true, 30, 50), Error);
}

// ---- state blobs and the typed header ------------------------------------------

TEST(StateApi, BlobInContainerOutBlobBack) {
  const Calibration cal = fitted();
  const KvCapture c = lowrank_capture(300, 21);
  // A single-sequence blob as llama.cpp writes it (flash attention: v_trans 0).
  const StateLayout layout{{1}, 0, 0};
  const std::vector<uint8_t> blob = state_from_capture(c, layout);
  const KvCapture from = capture_from_state(blob, lowrank_geometry(), "blob");
  EXPECT_EQ(from.blocks[0].k, c.blocks[0].k);
  EXPECT_EQ(from.blocks[0].pos, c.blocks[0].pos);
  const std::vector<uint8_t> kv = compress_state(blob, lowrank_geometry(), cal, allocation_set(cal, 8), {}, c.tokens);
  EXPECT_EQ(inspect(kv, "kv").header.has_tokens, true);
  // Back into a context without flash attention and with 2 streams, as sequence 1.
  const StateLayout to{{2}, 1, 1};
  const std::vector<uint8_t> restored = decompress_state(kv, cal, to, "kv");
  const SeqBlob sb = seq_blob_parse(restored, false, "restored");
  EXPECT_EQ(sb.seq_id, 1);
  ASSERT_EQ(sb.blocks[0].streams.size(), 2u);
  EXPECT_EQ(sb.blocks[0].streams[1].cell_count, 300u);
  EXPECT_EQ(sb.blocks[0].streams[1].v_trans, 1u);
  const KvCapture dec = capture_from_state(restored, lowrank_geometry(), "restored");
  EXPECT_LT(reconstruction_error(c, dec, 4, 128).k, 0.01);
  // The empty blob of a context tells its stream counts.
  SeqBlob empty;
  empty.blocks.resize(1);
  empty.blocks[0].streams.resize(3);
  EXPECT_EQ(state_layout(seq_blob_write(empty), 0, 0, "empty").streams, (std::vector<uint32_t>{3}));
  // Wrong geometry, wrong calibration, corrupt bytes: errors, no crash.
  CacheGeometry wrong = lowrank_geometry();
  wrong.blocks[0].n_head_kv = 4;
  EXPECT_THROW(capture_from_state(blob, wrong, "blob"), Error);
  CacheGeometry other_model = lowrank_geometry();
  other_model.model_sha256 = "x";
  EXPECT_NE(error_of([&] { compress_state(blob, other_model, cal, allocation_set(cal, 8)); }).find("wrong calibration"), std::string::npos);
  std::vector<uint8_t> cut(blob.begin(), blob.begin() + blob.size() / 2);
  EXPECT_THROW(capture_from_state(cut, lowrank_geometry(), "cut"), Error);
}

TEST(StateApi, ContextStateRoundTripsInItsOwnForm) {
  const Calibration cal = fitted();
  const KvCapture c = lowrank_capture(300, 22);
  // llama_state_get_data's form: u32 length, the architecture, the cache as a
  // sequence blob holds it after magic and seq_id.
  const std::vector<uint8_t> seq = state_from_capture(c, StateLayout{{1}, 1, 0});
  const std::vector<uint8_t> ctx = context_state_join("qwen2", seq, "ctx");
  ASSERT_EQ(ctx.size(), seq.size() - 8 + 4 + 5);
  EXPECT_EQ(std::string(ctx.begin() + 4, ctx.begin() + 9), "qwen2");
  EXPECT_TRUE(is_context_state(ctx));
  EXPECT_FALSE(is_context_state(seq));
  const ContextState cs = context_state_split(ctx, "ctx");
  EXPECT_EQ(cs.arch, "qwen2");
  EXPECT_EQ(cs.seq_blob, seq);  // seq_id 0 in both headers
  EXPECT_EQ(context_state_join(cs.arch, cs.seq_blob, "again"), ctx);
  // compress_state takes either form; decompress_state gives back the form and
  // (without a layout) the layout it was given: here byte-identical at 1x
  // quality is not the point, the structure is.
  const std::vector<uint8_t> kv = compress_state(ctx, lowrank_geometry(), cal, allocation_set(cal, 8), {}, c.tokens);
  EXPECT_EQ(inspect(kv, "kv").header.meta.at("llama_state"), "context");
  const std::vector<uint8_t> back = decompress_state(kv, cal, "kv");
  ASSERT_TRUE(is_context_state(back));
  ASSERT_EQ(back.size(), ctx.size());
  const ContextState bs = context_state_split(back, "back");
  EXPECT_EQ(bs.arch, "qwen2");
  const SeqBlob sb = seq_blob_parse(bs.seq_blob, false, "back");
  EXPECT_EQ(sb.blocks[0].streams[0].v_trans, 1u);
  EXPECT_LT(reconstruction_error(c, capture_from_state(bs.seq_blob, lowrank_geometry(), "back"), 4, 128).k, 0.01);
  // An explicit layout wins; the form stays.
  const std::vector<uint8_t> flash = decompress_state(kv, cal, StateLayout{{1}, 0, 0}, "kv");
  EXPECT_EQ(seq_blob_parse(context_state_split(flash, "flash").seq_blob, false, "flash").blocks[0].streams[0].v_trans, 0u);
  // A sequence state stays one, in its recorded layout.
  const std::vector<uint8_t> kv_seq = compress_state(seq, lowrank_geometry(), cal, allocation_set(cal, 8));
  const std::vector<uint8_t> seq_back = decompress_state(kv_seq, cal, "kv_seq");
  EXPECT_FALSE(is_context_state(seq_back));
  EXPECT_EQ(seq_back.size(), seq.size());
  // A container of a capture records no state: a layout must be given.
  const std::vector<uint8_t> plain = compress(c, cal, allocation_set(cal, 8));
  EXPECT_NE(error_of([&] { decompress_state(plain, cal, "plain"); }).find("no llama.cpp state layout recorded"), std::string::npos);
  EXPECT_FALSE(is_context_state(decompress_state(plain, cal, StateLayout{{1}, 0, 0}, "plain")));
  // Bad context states: errors that say what was expected.
  EXPECT_NE(error_of([&] { context_state_split(seq, "s"); }).find("this is a sequence state"), std::string::npos);
  std::vector<uint8_t> bad = ctx;
  bad[5] = ' ';
  EXPECT_FALSE(is_context_state(bad));
  EXPECT_THROW(context_state_join("", seq, "j"), Error);
  EXPECT_THROW(context_state_join("qwen2", std::vector<uint8_t>(4, 0), "j"), Error);
  std::vector<uint8_t> cut(ctx.begin(), ctx.begin() + ctx.size() / 2);
  EXPECT_THROW(compress_state(cut, lowrank_geometry(), cal, allocation_set(cal, 8)), Error);
}

TEST(Codec, NonFiniteInputIsRefusedWithItsPlace) {
  const Calibration cal = fitted();
  KvCapture c = lowrank_capture(300, 23);
  KvBlock& b = c.blocks[0];
  b.v[b.index(1, 0, 77, 5)] = 0x7e00;  // f16 NaN
  const std::string e = error_of([&] { compress(c, cal, allocation_set(cal, 8)); });
  EXPECT_NE(e.find("V[layer 1, head 0, token 77, dim 5] is NaN"), std::string::npos) << e;
  b.v[b.index(1, 0, 77, 5)] = 0;
  b.k[b.index(0, 1, 299, 0)] = 0xfc00;  // -inf, in the raw window
  EXPECT_NE(error_of([&] { compress(c, cal, allocation_set(cal, 8)); }).find("K[layer 0, head 1, token 299, dim 0] is infinite"), std::string::npos);
  b.k[b.index(0, 1, 299, 0)] = 0x7bff;  // the largest finite f16 is fine
  EXPECT_NO_THROW(compress(c, cal, allocation_set(cal, 8)));
}

TEST(Inspect, TypedHeader) {
  const Calibration cal = fitted();
  KvCapture c = lowrank_capture(333, 31);
  c.meta["source"] = "test";
  CompressOptions o;
  o.chunk_tokens = 64;
  o.deflate_level = 9;
  const std::vector<uint8_t> bytes = compress(c, cal, allocation_set(cal, 4), o);
  const ContainerInfo ci = inspect(bytes, "x");
  const ContainerHeader& h = ci.header;
  EXPECT_EQ(h.version, 1u);  // DP allocations: still version 1 (version 2 only with entropy-coded ones)
  EXPECT_EQ(h.calibration_id, cal.id);
  EXPECT_EQ(h.geometry.model_sha256, c.model_sha256);
  ASSERT_EQ(h.geometry.blocks.size(), 1u);
  EXPECT_EQ(h.geometry.blocks[0], c.blocks[0].geometry());  // RoPE with its factors round-trips through the strings
  EXPECT_EQ(h.meta.at("source"), "test");
  EXPECT_EQ(h.sink, 4u);
  EXPECT_EQ(h.window, 128u);
  EXPECT_EQ(h.chunk_tokens, 64u);
  EXPECT_EQ(h.deflate_level, 9);
  EXPECT_EQ(h.n_tokens, (std::vector<uint32_t>{333}));
  EXPECT_EQ(h.alloc[0][0].nominal_ratio, 4.0);
  EXPECT_EQ(h.alloc[0][1].blocks, allocation_set(cal, 4)[0][1].blocks);
  EXPECT_EQ(ci.n_compressed_tokens, 333u - 4 - 128);
  EXPECT_GT(ci.ratio_compressed_tokens(), 3.0);
  EXPECT_NEAR(ci.ratio_whole_cache(), double(c.f16_bytes()) / double(bytes.size()), 1e-12);
  // The decoder gives back the typed geometry and provenance too.
  const KvCapture d = decompress(bytes, cal, "x");
  EXPECT_EQ(d.model_sha256, c.model_sha256);
  EXPECT_EQ(d.blocks[0].rope, c.blocks[0].rope);
  EXPECT_EQ(d.meta.at("source"), "test");
  EXPECT_EQ(d.tokens, c.tokens);
}

TEST(Codec, StatsAndOptionsAreHonoured) {
  const Calibration cal = fitted();
  const KvCapture c = lowrank_capture(500, 41);
  CodecStats s;
  CompressOptions o;
  o.threads = 2;
  o.precision = Precision::kF32;
  o.stats = &s;
  const std::vector<uint8_t> a = compress(c, cal, allocation_set(cal, 8), o);
  EXPECT_EQ(s.projection, Precision::kF32);
  EXPECT_EQ(s.threads, 2);
  EXPECT_GT(s.total_ms, 0.0);
  EXPECT_EQ(s.entropy_backend, "libdeflate");
  o.threads = 1;
  EXPECT_EQ(compress(c, cal, allocation_set(cal, 8), o), a);  // output independent of threads
  o.precision = Precision::kF16;
  EXPECT_NE(error_of([&] { compress(c, cal, allocation_set(cal, 8), o); }).find("GPU mode"), std::string::npos);
  EXPECT_THROW(parse_precision("int4"), Error);
  EXPECT_EQ(parse_precision("tf32"), Precision::kTF32);
  // int8 is a decode mode: the encoder runs (and reports) what auto would,
  // the same bytes; the DP's chunks decode as auto's.
  if (int8_projection_available()) {
    CompressOptions oi = o, oa = o;
    oi.precision = Precision::kInt8, oa.precision = Precision::kAuto;
    CodecStats si, sa;
    oi.stats = &si, oa.stats = &sa;
    EXPECT_EQ(compress(c, cal, allocation_set(cal, 8), oi), compress(c, cal, allocation_set(cal, 8), oa));
    EXPECT_EQ(si.projection, sa.projection);
    DecompressOptions di, da;
    di.precision = Precision::kInt8, da.precision = Precision::kAuto;
    di.stats = &si;
    EXPECT_EQ(decompress(a, cal, "int8", di).blocks[0].k, decompress(a, cal, "auto", da).blocks[0].k);
    EXPECT_EQ(si.projection, Precision::kInt8);
    // What auto decodes with: int8 where the CPU has AVX2, unless bf16 is
    // native and the CPU lacks AVX-512 VNNI, or has AMX with the int8 matmul
    // off its tiles (then bf16; project.cpp resolve_precision), else f32 —
    // the entropy-coded chunks then bit for bit as an explicit int8 decode.
    const LibraryInfo li = library_info();
    const std::vector<std::string>& feats = li.cpu_features;
    auto has = [&](const char* f) { return std::find(feats.begin(), feats.end(), f) != feats.end(); };
    const bool avx2 = has("avx2");
    const bool amx_int8 = avx2 && li.int8 && li.int8_projection.find("amx") != std::string::npos;
    const bool bf16_wins = !amx_int8 && bf16_projection_available() && (has("amx_bf16") || !avx2 || !has("avx512_vnni"));
    const Precision want = bf16_wins ? Precision::kBF16 : avx2 ? Precision::kInt8 : Precision::kF32;
    const std::vector<uint8_t> e = compress(c, cal, ecsq_allocation_set(cal, 8), oa);
    da.stats = &sa;
    const KvCapture ea = decompress(e, cal, "auto", da);
    EXPECT_EQ(sa.projection, want);
    if (want == Precision::kInt8) {
      EXPECT_EQ(ea.blocks[0].v, decompress(e, cal, "int8", di).blocks[0].v);
    }
  }
  const LibraryInfo li = library_info();
  EXPECT_FALSE(li.version.empty());
}

// OnlineCalibrator (kvtc-server --kvtc-calib auto) on synthetic prompts
// (the algorithm's bookkeeping, not a model): a prefix is learned once, in
// whole 64-token runs; every stride-th token; held-out runs keep their
// share; a cache that is not a prompt's (shifted positions) is refused.
TEST(OnlineCalibration, EachPrefixOnceWholeRunsAndTheHeldOutShare) {
  OnlineCalibrationOptions o;
  o.fit_tokens = 600;
  o.fit.ratios = {4, 8};
  OnlineCalibrator cal(lowrank_geometry(), o);
  EXPECT_EQ(cal.heldout_target(), 600u / 16);
  const std::vector<int32_t> a = seq(1000, 200);  // 3 whole runs and 8 tokens
  uint64_t rows = cal.add(prompt_capture(a), a);
  EXPECT_EQ(cal.seen_tokens(), 200u);
  EXPECT_EQ(cal.new_tokens(), 192u);
  // The first run is held out (the held-out share is behind), the next two fit;
  // positions 0-3 (sinks) are left out of the first run's rows.
  EXPECT_EQ(cal.heldout_tokens(), 60u);
  EXPECT_EQ(cal.fit_tokens(), 128u);
  EXPECT_EQ(rows, 188u);
  // The same prompt again adds nothing; its next turn only the runs past it.
  EXPECT_EQ(cal.add(prompt_capture(a), a), 0u);
  std::vector<int32_t> a2 = a;
  for (int32_t t = 0; t < 100; ++t) a2.push_back(5000 + t);  // 300 tokens: run 3 (192-255) is new, 256-299 not whole
  cal.add(prompt_capture(a2), a2);
  EXPECT_EQ(cal.new_tokens(), 192u + 64u);
  EXPECT_EQ(cal.fit_tokens(), 192u);
  EXPECT_FALSE(cal.enough());
  // stride 4: a quarter of the new runs' tokens.
  const std::vector<int32_t> b = seq(90000, 256);
  cal.add(prompt_capture(b), b, 4);
  EXPECT_EQ(cal.fit_tokens() + cal.heldout_tokens(), 192u + 60u + 63u);  // 64 rows, less position 0 (a sink)
  for (int i = 0; i < 8 && !cal.enough(); ++i) {
    const std::vector<int32_t> c = seq(200000 + 1000 * i, 256);
    cal.add(prompt_capture(c), c);
  }
  ASSERT_TRUE(cal.enough());
  EXPECT_GE(cal.heldout_tokens(), cal.heldout_target());
  EXPECT_LE(cal.heldout_tokens() * 16, cal.fit_tokens() + 16 * 64);  // one run past its share at most
  const Calibration c = cal.finish();
  EXPECT_NE(c.meta.at("source").find("served prompts"), std::string::npos);
  EXPECT_EQ(c.meta.at("calib_tokens"), std::to_string(cal.fit_tokens()));
  // A cache whose positions are not 0..n-1 (a shifted slot) is refused.
  KvCapture shifted = prompt_capture(a);
  shifted.blocks[0].pos[10] = 99;
  OnlineCalibrator other(lowrank_geometry(), o);
  EXPECT_THROW(other.add(shifted, a), Error);
  EXPECT_THROW(other.add(prompt_capture(a), std::span<const int32_t>(a).first(100)), Error);
}

// CalibrationLearner (kvtc-server --kvtc-calib auto, KvtcCache('auto')) on
// synthetic prompt states (the bookkeeping, not a model): one hand-over at a
// time (a second is counted busy), short and malformed states, the fit on
// its thread, the file written and found again, a file of another model
// ignored with a warning.
TEST(OnlineCalibration, TheLearnerHandsOverFitsWritesAndFinds) {
  const fs::path dir = fs::temp_directory_path() / ("kvtc-learner-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const CacheGeometry g = lowrank_geometry();
  LearnerOptions o;
  o.tokens = 600;
  o.share = 1000;  // every new token
  o.file = learned_calibration_file(dir.string(), g.model_sha256);
  EXPECT_EQ(fs::path(o.file).filename().string(), "calibration-auto-synthetic-lowran.safetensors");
  std::mutex mu;
  std::vector<std::string> warnings;
  o.log = [&](bool warning, const std::string& s) {
    std::lock_guard<std::mutex> lk(mu);
    if (warning) warnings.push_back(s);
  };
  std::string ready_from;
  o.on_ready = [&](const Calibration& c, const std::string& from) {
    std::lock_guard<std::mutex> lk(mu);
    EXPECT_TRUE(calibration_fits(c, g));
    ready_from = from;
  };
  EXPECT_FALSE(find_learned_calibration(g, o));  // nothing learned yet
  CalibrationLearner L(g, o);
  auto wait_samples = [&](uint64_t n) {
    for (int i = 0; i < 2000 && L.status().samples < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_GE(L.status().samples, n);
  };
  EXPECT_FALSE(L.begin(63));  // less than a run
  std::optional<std::vector<uint8_t>> buf = L.begin(200);
  ASSERT_TRUE(buf);
  EXPECT_FALSE(L.begin(200));  // handed out: busy
  EXPECT_EQ(L.status().busy, 1u);
  L.submit({}, {});  // given back unused
  buf = L.begin(300);
  ASSERT_TRUE(buf);
  L.submit(std::vector<uint8_t>(100, 7), seq(1, 300), 0.5);  // not a state: refused, still learning
  wait_samples(1);
  EXPECT_EQ(L.status().refused, 1u);
  EXPECT_EQ(L.status().state, "learning");
  uint64_t fed = 1;
  for (int i = 0; i < 12 && L.status().state == "learning"; ++i) {
    const std::vector<int32_t> t = seq(10000 * (i + 1), 256);
    buf = L.begin(t.size());
    ASSERT_TRUE(buf);
    *buf = state_from_capture(prompt_capture(t), StateLayout{});
    L.submit(std::move(*buf), std::vector<int32_t>(t), 0.25);
    wait_samples(++fed);
  }
  for (int i = 0; i < 2000 && L.status().state == "fitting"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const LearnerStatus st = L.status();
  ASSERT_EQ(st.state, "ready") << st.error;
  EXPECT_GE(st.fit, 600u);
  EXPECT_GE(st.held, 600u / 16);
  EXPECT_DOUBLE_EQ(st.loop_max_ms, 0.5);
  EXPECT_FALSE(L.begin(256));  // no longer learning
  ASSERT_TRUE(L.calibration());
  EXPECT_EQ(L.calibration()->id, st.calib_id);
  EXPECT_EQ(ready_from, o.file);
  L.mark_live(3);
  EXPECT_EQ(L.status().state, "live");
  EXPECT_EQ(L.status().moved, 3u);
  // The next start finds the file.
  std::string from;
  const std::optional<Calibration> again = find_learned_calibration(g, o, &from);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->id, st.calib_id);
  EXPECT_EQ(from, o.file);
  // Another model's file under this model's name: ignored, with a warning.
  CacheGeometry other = g;
  other.model_sha256 = "synthetic-lowrank-other";
  LearnerOptions o2 = o;
  o2.file = o.file;
  EXPECT_FALSE(find_learned_calibration(other, o2));
  {
    std::lock_guard<std::mutex> lk(mu);
    ASSERT_FALSE(warnings.empty());
    EXPECT_NE(warnings.back().find("fitted for another model"), std::string::npos) << warnings.back();
  }
  fs::remove_all(dir);
}
