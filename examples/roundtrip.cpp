// kvtc example: compress a KV cache held in memory and decompress it, with
// nothing but the installed library:
//
//   find_package(kvtc)  +  target_link_libraries(app PRIVATE kvtc::kvtc)
//   #include <kvtc/kvtc.h>
//
//   roundtrip CALIBRATION CACHE [RATIO [MAX_ERROR]]
//
// CALIBRATION comes from `kvtc calibrate` (or kvtc::fit_calibration on
// caches of your own); CACHE is any K/V cache — here a capture file from
// `kvtc capture`, copied into the arrays an engine would hand over. Prints
// the ratio and the reconstruction error; exits 1 when the error of keys or
// values exceeds MAX_ERROR (default 0.25) or on any error.
#include <kvtc/kvtc.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

// An engine's cache as plain f32 arrays, per block [layer][head][token][dim],
// turned into a kvtc::KvCapture: the geometry (which model, which layers,
// heads, dims, RoPE) plus positions and f16 values.
kvtc::KvCapture from_arrays(const kvtc::CacheGeometry& g, const std::vector<std::vector<float>>& k, const std::vector<std::vector<float>>& v,
                            const std::vector<std::vector<int32_t>>& pos) {
  kvtc::KvCapture c;
  c.model_sha256 = g.model_sha256;
  for (size_t b = 0; b < g.blocks.size(); ++b) {
    kvtc::KvBlock blk;
    static_cast<kvtc::BlockGeometry&>(blk) = g.blocks[b];
    blk.pos = pos[b];
    blk.k.resize(blk.numel());
    blk.v.resize(blk.numel());
    kvtc::f32_to_f16_n(k[b].data(), blk.k.data(), blk.numel());
    kvtc::f32_to_f16_n(v[b].data(), blk.v.data(), blk.numel());
    c.blocks.push_back(std::move(blk));
  }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc > 5) {
    std::fprintf(stderr, "usage: %s CALIBRATION CACHE [RATIO [MAX_ERROR]]\n", argv[0]);
    return 2;
  }
  const double ratio = argc > 3 ? std::atof(argv[3]) : 16.0;
  const double max_error = argc > 4 ? std::atof(argv[4]) : 0.25;
  try {
    const kvtc::Calibration cal = kvtc::calibration_load(argv[1]);
    // The engine's arrays (from a capture file here).
    const kvtc::KvCapture file = kvtc::capture_load(argv[2]);
    std::vector<std::vector<float>> k, v;
    std::vector<std::vector<int32_t>> pos;
    for (const kvtc::KvBlock& b : file.blocks) {
      k.emplace_back(b.numel());
      v.emplace_back(b.numel());
      kvtc::f16_to_f32_n(b.k.data(), k.back().data(), b.numel());
      kvtc::f16_to_f32_n(b.v.data(), v.back().data(), b.numel());
      pos.push_back(b.pos);
    }
    const kvtc::KvCapture cache = from_arrays(file.geometry(), k, v, pos);

    // Compress at the ratio asked for, and back.
    kvtc::CompressOptions opt;  // sink 4, window 128, chunks of 256 tokens, DEFLATE 6
    const std::vector<uint8_t> bytes = kvtc::compress(cache, cal, kvtc::allocation_set(cal, ratio), opt);
    const kvtc::ContainerInfo info = kvtc::inspect(bytes, "in memory");
    const kvtc::KvCapture back = kvtc::decompress(bytes, cal, "in memory");
    const kvtc::ReconError e = kvtc::reconstruction_error(cache, back, opt.sink, opt.window);
    std::printf("%u tokens, %zu bytes: %.2fx on the coded tokens, %.2fx on the whole cache; relative error K %.5f, V %.5f\n",
                cache.blocks[0].n_tokens(), bytes.size(), info.ratio_compressed_tokens(), info.ratio_whole_cache(), e.k, e.v);
    if (!(e.k <= max_error && e.v <= max_error)) {
      std::fprintf(stderr, "roundtrip: error above %g\n", max_error);
      return 1;
    }
    return 0;
  } catch (const kvtc::Error& e) {
    std::fprintf(stderr, "roundtrip: %s\n", e.what());
    return 1;
  }
}
