#include "methods.h"

#include <cmath>

#include "baselines.h"

namespace kvtc::lab {

const char* const kMethodHelp =
    "vanilla, kvtc-<R>x[-ecsq|-joint][-w8][-all][-global|-window][-f32|-bf16|-int8][@NAME], fp8, kivi-2, kivi-4, q8_0[-k|-v], q4_0[-k|-v], "
    "streaming-<R>x, svd-<R>x, zstd, deflate";

namespace {

Error bad(const std::string& name) {
  return Error("eval: unknown method '" + name + "' (" + kMethodHelp + ")");
}

// "<R>x" -> R in [1, 4096].
double ratio_of(const std::string& name, const std::string& s) {
  if (s.size() < 2 || s.back() != 'x') throw bad(name);
  size_t used = 0;
  double r = 0;
  try {
    r = std::stod(s.substr(0, s.size() - 1), &used);
  } catch (const std::exception&) {
    throw bad(name);
  }
  if (used != s.size() - 1 || !(r >= 1 && r <= 4096)) throw bad(name);
  return r;
}

bool starts(const std::string& s, const char* p) {
  return s.rfind(p, 0) == 0;
}

// kvtc-<R>x[-ecsq|-joint][-w8][-all][-global|-window][-f32|-bf16|-int8][@NAME],
// parsed. -w8: the raw window at 8 bits (container version 3). -ecsq: the
// entropy-coded mode (container version 2)
// rate-controlled to R on the coded tokens (the DP's R is nominal: it
// reaches ~1.13 R after DEFLATE). -global / -window: a sliding-window
// model's block 0 (the global layers) or block 1 (the window) alone is
// coded, the other kept f16, to tell apart what each block costs.
// -f32 / -bf16 / -int8: the projection's precision (both ways; -int8 is a
// decoder's choice, the encoder runs as auto: Precision::kInt8).
struct KvtcSpec {
  double ratio = 0;
  bool joint = false, all = false, ecsq = false, w8 = false;
  int only_block = -1;  // -global: 0, -window: 1
  Precision precision = Precision::kAuto;
  std::string calib;
};
KvtcSpec parse_kvtc(const std::string& name) {
  KvtcSpec k;
  std::string rest = name.substr(5);
  if (size_t at = rest.find('@'); at != std::string::npos) {
    k.calib = rest.substr(at + 1);
    rest = rest.substr(0, at);
    if (k.calib.empty()) throw bad(name);
  }
  auto strip = [&](const std::string& suf) {
    if (rest.size() > suf.size() && rest.compare(rest.size() - suf.size(), suf.size(), suf) == 0) {
      rest.resize(rest.size() - suf.size());
      return true;
    }
    return false;
  };
  if (strip("-bf16"))
    k.precision = Precision::kBF16;
  else if (strip("-f32"))
    k.precision = Precision::kF32;
  else if (strip("-int8"))
    k.precision = Precision::kInt8;
  if (strip("-global"))
    k.only_block = 0;
  else if (strip("-window"))
    k.only_block = 1;
  k.all = strip("-all");
  k.w8 = strip("-w8");
  k.ecsq = strip("-ecsq");
  k.joint = !k.ecsq && strip("-joint");
  k.ratio = ratio_of(name, rest);
  return k;
}

class Vanilla : public Method {
 public:
  Vanilla() : Method("vanilla") {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override {
    *bytes = c.f16_bytes();
    return c;
  }
};

class Fp8 : public Method {
 public:
  Fp8() : Method("fp8") {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override { return baselines::fp8_per_token(c, bytes); }
};

class Kivi : public Method {
 public:
  explicit Kivi(int bits) : Method("kivi-" + std::to_string(bits)), bits_(bits) {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override { return baselines::kivi(c, bits_, 32, 128, bytes); }

 private:
  int bits_;
};

class Lossless : public Method {
 public:
  explicit Lossless(const std::string& coder) : Method(coder) {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override {
    *bytes = baselines::lossless_bytes(c, name());
    return c;
  }
  bool ratio_only() const override { return true; }
};

// "q8_0", "q4_0", or with "-k" / "-v" only the keys or the values quantized:
// llama.cpp's own cache types, to tell apart what each side costs.
class Native : public Method {
 public:
  explicit Native(const std::string& name) : Method(name) {
    type_ = name.substr(0, 4);
    const std::string side = name.size() > 4 ? name.substr(5) : "";
    k_ = side == "v" ? "f16" : type_;
    v_ = side == "k" ? "f16" : type_;
  }
  // ggml blocks of 32 values: q8_0 34 bytes, q4_0 18 (f16: 64).
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override {
    const uint64_t half = c.f16_bytes() / 2;  // K or V in f16
    auto side = [&](const std::string& t) { return t == "f16" ? half : half / 64 * (t == "q8_0" ? 34 : 18); };
    *bytes = side(k_) + side(v_);
    return c;
  }
  std::pair<std::string, std::string> native_cache_types() const override { return {k_, v_}; }

 private:
  std::string type_, k_, v_;
};

bool is_native(const std::string& n) {
  for (const char* t : {"q8_0", "q4_0"})
    for (const char* side : {"", "-k", "-v"})
      if (n == std::string(t) + side) return true;
  return false;
}

class Streaming : public Method {
 public:
  Streaming(const std::string& name, double ratio) : Method(name), ratio_(ratio) {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override { return baselines::streaming_evict(c, ratio_, 4, bytes); }

 private:
  double ratio_;
};

std::vector<uint8_t> kvtc_encode(const KvtcSpec& k, const KvCapture& c, const Calibration& cal) {
  CompressOptions opt;
  opt.precision = k.precision;
  if (k.all) opt.sink = 0, opt.window = 0;
  if (k.w8) opt.window_bits = 8;
  return compress(c, cal, k.ecsq ? ecsq_allocation_set(cal, k.ratio) : allocation_set(cal, k.ratio, k.joint), opt);
}

// Block b of a capture or calibration alone, as a one-block one (its id kept).
KvCapture block_alone(const KvCapture& c, size_t b) {
  KvCapture o;
  o.model_sha256 = c.model_sha256;
  if (b == 0) o.tokens = c.tokens;  // the ids are block 0's tokens'
  o.blocks.push_back(c.blocks.at(b));
  return o;
}
Calibration block_alone(const Calibration& cal, size_t b) {
  Calibration o = cal;
  o.blocks = {cal.blocks.at(b)};
  o.geometry.blocks = {cal.geometry.blocks.at(b)};
  return o;
}

class Kvtc : public Method {
 public:
  Kvtc(const std::string& name, KvtcSpec k, const Calibration& cal) : Method(name), k_(std::move(k)), cal_(cal) {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override {
    if (k_.only_block >= 0) {
      const size_t b = size_t(k_.only_block);
      require(c.blocks.size() == 2,
              name() + ": -global and -window are for sliding-window models (two cache blocks); this cache has " + std::to_string(c.blocks.size()));
      const Calibration one = block_alone(cal_, b);
      KvtcSpec whole = k_;
      whole.only_block = -1;
      const std::vector<uint8_t> enc = kvtc_encode(whole, block_alone(c, b), one);
      DecompressOptions dopt;
      dopt.precision = k_.precision;
      KvCapture out = c;
      out.blocks[b] = std::move(decompress(enc, one, name(), dopt).blocks.at(0));
      *bytes = enc.size() + block_alone(c, 1 - b).f16_bytes();
      return out;
    }
    const std::vector<uint8_t> enc = kvtc_encode(k_, c, cal_);
    *bytes = enc.size();
    DecompressOptions dopt;
    dopt.precision = k_.precision;
    return decompress(enc, cal_, name(), dopt);
  }

 private:
  KvtcSpec k_;
  const Calibration& cal_;
};

// Per-prompt low rank at the size kvtc-<R>x takes on the same sample.
class Svd : public Method {
 public:
  Svd(const std::string& name, double ratio, const Calibration& cal) : Method(name), ratio_(ratio), cal_(cal) {}
  KvCapture apply(const KvCapture& c, uint64_t* bytes) const override {
    KvtcSpec k;
    k.ratio = ratio_;
    const uint64_t target = kvtc_encode(k, c, cal_).size();
    return baselines::svd_lowrank(c, target, 4, CompressOptions{}.sink, CompressOptions{}.window, bytes);
  }

 private:
  double ratio_;
  const Calibration& cal_;
};

}  // namespace

MethodSpec parse_method(const std::string& name) {
  MethodSpec m;
  m.name = name;
  if (name == "vanilla" || name == "fp8" || name == "kivi-2" || name == "kivi-4" || name == "zstd" || name == "deflate" || is_native(name)) return m;
  if (starts(name, "streaming-")) {
    ratio_of(name, name.substr(10));
  } else if (starts(name, "svd-")) {
    ratio_of(name, name.substr(4));
    m.needs_calibration = true;
  } else if (starts(name, "kvtc-")) {
    m.calibration = parse_kvtc(name).calib;
    m.needs_calibration = true;
  } else {
    throw bad(name);
  }
  return m;
}

std::unique_ptr<Method> make_method(const MethodSpec& spec, const std::map<std::string, Calibration>& cals, Precision precision) {
  const std::string& n = spec.name;
  if (n == "vanilla") return std::make_unique<Vanilla>();
  if (n == "fp8") return std::make_unique<Fp8>();
  if (n == "kivi-2" || n == "kivi-4") return std::make_unique<Kivi>(n == "kivi-2" ? 2 : 4);
  if (n == "zstd" || n == "deflate") return std::make_unique<Lossless>(n);
  if (is_native(n)) return std::make_unique<Native>(n);
  if (starts(n, "streaming-")) return std::make_unique<Streaming>(n, ratio_of(n, n.substr(10)));
  auto it = cals.find(spec.calibration);
  require(it != cals.end(), "eval: method " + n + " needs " + (spec.calibration.empty() ? "--calib" : "--calib-extra " + spec.calibration + "=FILE"));
  if (starts(n, "svd-")) return std::make_unique<Svd>(n, ratio_of(n, n.substr(4)), it->second);
  KvtcSpec k = parse_kvtc(n);
  if (k.precision == Precision::kAuto) k.precision = precision;
  return std::make_unique<Kvtc>(n, std::move(k), it->second);
}

}  // namespace kvtc::lab
