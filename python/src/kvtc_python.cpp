// kvtc's Python binding (nanobind): the public API of <kvtc/kvtc.h> on numpy
// arrays, DLPack tensors (torch CPU tensors) and bytes. The GIL is released
// while the codec runs; every kvtc::Error reaches Python as kvtc.Error
// (a ValueError) with the library's message. Shapes follow the library:
// K and V as [layers, kv_heads, tokens, head_dim], one array per cache
// block (a list for iSWA models, which have two).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvtc/kvtc.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using kvtc::Error;

// ---- bytes in and out -------------------------------------------------------

// Any object with the buffer protocol (bytes, bytearray, memoryview, mmap,
// a uint8 numpy array), held for the call: the GIL can be released while
// the view is read, and a bytearray cannot be resized meanwhile.
class Bytes {
 public:
  Bytes(nb::handle h, const char* what) {
    if (PyObject_GetBuffer(h.ptr(), &view_, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      throw nb::type_error(
          (std::string(what) + ": expected bytes, bytearray, memoryview or another C-contiguous buffer, got " + nb::type_name(h.type()).c_str())
              .c_str());
    }
  }
  ~Bytes() { PyBuffer_Release(&view_); }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  std::span<const uint8_t> span() const { return {static_cast<const uint8_t*>(view_.buf), size_t(view_.len)}; }

 private:
  Py_buffer view_{};
};

nb::bytes to_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

// ---- arrays in --------------------------------------------------------------

using AnyArray = nb::ndarray<nb::ro>;

std::string shape_str(const AnyArray& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string dtype_str(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  const char* k = d.code == uint8_t(C::Float)    ? "float"
                  : d.code == uint8_t(C::Int)    ? "int"
                  : d.code == uint8_t(C::UInt)   ? "uint"
                  : d.code == uint8_t(C::Bfloat) ? "bfloat"
                  : d.code == uint8_t(C::Bool)   ? "bool"
                                                 : "other";
  return std::string(k) + std::to_string(d.bits);
}

void require_cpu(const AnyArray& a, const std::string& what) {
  if (a.device_type() != nb::device::cpu::value)
    throw Error(what + ": the array is on device type " + std::to_string(a.device_type()) +
                " (DLPack); kvtc's Python binding reads CPU memory (tensor.cpu())");
}

// Element (l, h, t, d) offsets of a 4-D array, in elements (DLPack strides).
struct Strides4 {
  int64_t s[4];
  explicit Strides4(const AnyArray& a) {
    if (a.stride_ptr() != nullptr) {
      for (int i = 0; i < 4; ++i) s[i] = a.stride(i);
    } else {
      s[3] = 1;
      for (int i = 2; i >= 0; --i) s[i] = s[i + 1] * int64_t(a.shape(i + 1));
    }
  }
};

// Capacity for n values, asking Linux for transparent huge pages where the
// buffer is large: the copy into a fresh buffer otherwise pays one page
// fault per 4 KiB on first touch (~23,000 for an 8K-token SmolLM2 K), the
// larger part of the binding's cost over the codec. A hint: without THP
// (or with it off) the pages are ordinary.
template <typename T>
void reserve_huge(std::vector<T>& out, size_t n) {
  out.reserve(n);
  const size_t bytes = n * sizeof(T);
  if (bytes < (size_t(4) << 20)) return;
  const uintptr_t page = 4096, b = (reinterpret_cast<uintptr_t>(out.data()) + page - 1) & ~(page - 1),
                  e = reinterpret_cast<uintptr_t>(out.data()) + bytes;
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
}

// K or V of one block, f16 or f32, any strides, into f16 bits in kvtc's
// [layer][head][token][dim] order. f32 is rounded to nearest even; a value
// that does not fit f16 (|x| > 65504) or is NaN becomes inf/NaN, which the
// encoder then refuses with its place. A C-contiguous f16 array is one copy
// (no zero-fill first); the rest runs on `threads` threads over the rows:
// the binding's work should stay a few percent of the codec's.
void gather_f16(const AnyArray& a, std::vector<uint16_t>& out, int threads) {
  const size_t L = a.shape(0), H = a.shape(1), T = a.shape(2), D = a.shape(3);
  const Strides4 st(a);
  const bool f16 = a.dtype().bits == 16;
  const uint8_t* base = static_cast<const uint8_t*>(a.data());
  const size_t isz = f16 ? 2 : 4;
  const size_t n = L * H * T * D;
  reserve_huge(out, n);
  if (f16 && st.s[3] == 1 && st.s[2] == int64_t(D) && st.s[1] == int64_t(T * D) && st.s[0] == int64_t(H * T * D)) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(base);
    out.assign(p, p + n);
    return;
  }
  out.resize(n);
  const int64_t rows = int64_t(L * H * T);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : omp_get_max_threads())
  for (int64_t r = 0; r < rows; ++r) {
    const size_t t = size_t(r) % T, h = size_t(r) / T % H, l = size_t(r) / T / H;
    const uint8_t* p = base + (int64_t(l) * st.s[0] + int64_t(h) * st.s[1] + int64_t(t) * st.s[2]) * int64_t(isz);
    uint16_t* o = &out[size_t(r) * D];
    if (st.s[3] == 1 && f16) {
      std::memcpy(o, p, D * 2);
    } else {  // through an aligned row: a numpy view may sit at any byte offset
      float row[1024];
      for (size_t d0 = 0; d0 < D; d0 += 1024) {
        const size_t m = std::min<size_t>(1024, D - d0);
        if (st.s[3] == 1) {  // f32 rows
          std::memcpy(row, p + d0 * 4, m * 4);
          kvtc::f32_to_f16_n(row, o + d0, m);
          continue;
        }
        for (size_t d = 0; d < m; ++d) {
          const uint8_t* q = p + int64_t(d0 + d) * st.s[3] * int64_t(isz);
          if (f16)
            std::memcpy(&o[d0 + d], q, 2);
          else
            std::memcpy(&row[d], q, 4);
        }
        if (!f16) kvtc::f32_to_f16_n(row, o + d0, m);
      }
    }
  }
}

std::vector<int32_t> int_vector(nb::handle obj, const std::string& what) {
  AnyArray a;
  if (!nb::try_cast(obj, a)) {
    // A list or tuple of ints.
    try {
      return nb::cast<std::vector<int32_t>>(obj);
    } catch (const nb::cast_error&) {
      throw Error(what + ": expected a 1-D integer array or a sequence of ints, got " + std::string(nb::type_name(obj.type()).c_str()));
    }
  }
  require_cpu(a, what);
  if (a.ndim() != 1) throw Error(what + ": shape " + shape_str(a) + ", expected 1 dimension");
  const auto d = a.dtype();
  const bool is_int = d.code == uint8_t(nb::dlpack::dtype_code::Int) || d.code == uint8_t(nb::dlpack::dtype_code::UInt);
  if (!is_int || (d.bits != 32 && d.bits != 64)) throw Error(what + ": dtype " + dtype_str(d) + ", expected int32 or int64");
  std::vector<int32_t> out(a.shape(0));
  const int64_t stride = a.stride_ptr() ? a.stride(0) : 1;
  const uint8_t* base = static_cast<const uint8_t*>(a.data());
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t v;
    if (d.bits == 32) {
      int32_t x;
      std::memcpy(&x, base + int64_t(i) * stride * 4, 4);
      v = d.code == uint8_t(nb::dlpack::dtype_code::UInt) ? int64_t(uint32_t(x)) : x;
    } else {
      std::memcpy(&v, base + int64_t(i) * stride * 8, 8);
    }
    if (v < INT32_MIN || v > INT32_MAX) throw Error(what + "[" + std::to_string(i) + "] = " + std::to_string(v) + " does not fit int32");
    out[i] = int32_t(v);
  }
  return out;
}

// One array per block: a single array, or a list/tuple of them.
std::vector<nb::handle> per_block(nb::handle obj, size_t n_blocks, const std::string& what) {
  std::vector<nb::handle> out;
  const bool seq = nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj);
  // With one block, a sequence is that block's value (positions as a list of
  // ints), unless it is a one-element list of an array.
  if (seq && (n_blocks > 1 || (nb::len(obj) == 1 && !nb::isinstance<nb::int_>(obj[0])))) {
    for (nb::handle h : obj) out.push_back(h);
  } else {
    out.push_back(obj);
  }
  if (out.size() != n_blocks)
    throw Error(what + ": " + std::to_string(out.size()) + " array(s), the calibration's model has " + std::to_string(n_blocks) + " cache block(s)" +
                (n_blocks > 1 ? " (pass a list: the global layers' array, then the sliding-window layers')" : ""));
  return out;
}

// ---- arrays out -------------------------------------------------------------

nb::dlpack::dtype f16_dtype() {
  return nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
}

template <typename T>
nb::object numpy_array(std::vector<T>&& v, std::vector<size_t> shape, nb::dlpack::dtype dt) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy>(heap->data(), shape.size(), shape.data(), owner, nullptr, dt));
}

// The decoded K or V of a block as a numpy array: f16 without a copy (the
// vector moves into the array's owner), f32 converted on `threads` threads.
nb::object block_array(const kvtc::KvBlock& b, std::vector<uint16_t>&& x, bool as_f32, int threads) {
  std::vector<size_t> shape{b.n_layer(), b.n_head_kv, b.n_tokens(), b.head_dim};
  if (!as_f32) return numpy_array(std::move(x), shape, f16_dtype());
  std::vector<float> f;
  {
    nb::gil_scoped_release unlocked;
    reserve_huge(f, x.size());
    f.resize(x.size());
    const int64_t step = 1 << 16, n = int64_t(x.size());
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : omp_get_max_threads())
    for (int64_t i = 0; i < n; i += step) kvtc::f16_to_f32_n(x.data() + i, f.data() + i, size_t(std::min(step, n - i)));
    std::vector<uint16_t>().swap(x);
  }
  return numpy_array(std::move(f), shape, nb::dtype<float>());
}

nb::object int_array(std::vector<int32_t> v) {
  const size_t n = v.size();
  return numpy_array(std::move(v), {n}, nb::dtype<int32_t>());
}

// ---- options ------------------------------------------------------------------

kvtc::CompressOptions compress_options(uint32_t sink, uint32_t window, uint32_t chunk_tokens, int level, int threads, const std::string& precision,
                                       uint32_t window_bits) {
  kvtc::CompressOptions o;
  o.sink = sink;
  o.window = window;
  o.window_bits = window_bits;  // 16 or 8; compress says which else
  o.chunk_tokens = chunk_tokens;
  o.deflate_level = level;
  o.threads = threads;
  o.precision = kvtc::parse_precision(precision);
  return o;
}

// step: the entropy-coded mode's fixed quantizer step (0: rate control).
double ecsq_step(const std::string& coding, double step) {
  if (!(step >= 0 && std::isfinite(step))) throw Error("step " + std::to_string(step) + ": expected 0 (rate control) or a positive step");
  if (step > 0 && coding != "ecsq") throw Error("step applies to coding='ecsq' only");
  return step;
}

kvtc::DecompressOptions decompress_options(int threads, const std::string& precision) {
  kvtc::DecompressOptions o;
  o.threads = threads;
  o.precision = kvtc::parse_precision(precision);
  return o;
}

nb::dict geometry_dict(const kvtc::BlockGeometry& g) {
  nb::dict d;
  d["layers"] = g.layers;
  d["kv_heads"] = g.n_head_kv;
  d["head_dim"] = g.head_dim;
  d["features"] = g.features();
  d["sliding_window"] = g.sliding_window;
  d["rope"] = kvtc::rope_layout_name(g.rope.layout);
  d["rope_dims"] = g.rope.n_rot;
  d["rope_base"] = g.rope.freq_base;
  return d;
}

// ---- the calibration ------------------------------------------------------------

kvtc::KvSettings kv_settings_of(nb::handle kv_settings);  // below

class PyCalibration {
 public:
  static PyCalibration load(const std::string& path, bool decoder_only) {
    PyCalibration c;
    {
      nb::gil_scoped_release unlocked;
      c.cal_ = std::make_shared<const kvtc::Calibration>(kvtc::calibration_load(path, decoder_only));
    }
    c.path_ = path;
    c.decoder_only_ = decoder_only;
    c.allocs_ = std::make_shared<Allocs>();
    return c;
  }

  // One already in memory (a calibration learned, or the fleet's); `path`
  // names it in errors (a file it was written to, or what it is).
  static PyCalibration of(std::shared_ptr<const kvtc::Calibration> cal, const std::string& path) {
    PyCalibration c;
    c.cal_ = std::move(cal);
    c.path_ = path;
    c.allocs_ = std::make_shared<Allocs>();
    return c;
  }

  const kvtc::Calibration& cal() const { return *cal_; }
  const std::string& path() const { return path_; }
  bool decoder_only() const { return decoder_only_; }

  // The allocation for a ratio, computed once (the DP takes up to seconds
  // for a ratio without a stored table).
  // coding "ecsq": the entropy-coded mode (needs only the spectrum, so a
  // decoder_only calibration compresses too).
  std::shared_ptr<const kvtc::AllocationSet> alloc(double ratio, bool joint, const std::string& coding) const {
    if (coding != "dp" && coding != "ecsq") throw Error("coding '" + coding + "': expected 'dp' or 'ecsq'");
    const bool ecsq = coding == "ecsq";
    if (ecsq && joint) throw Error("joint=True applies to the DP allocation (coding='dp') only");
    if (decoder_only_ && !ecsq) throw Error(path_ + ": loaded with decoder_only=True, which has no allocation tables; load it in full to compress");
    if (!(ratio >= 1 && ratio <= 4096)) throw Error("ratio " + std::to_string(ratio) + ": expected a nominal ratio in [1, 4096]");
    std::lock_guard<std::mutex> lock(allocs_->mu);
    auto key = std::make_tuple(ratio, joint, ecsq);
    auto it = allocs_->sets.find(key);
    if (it != allocs_->sets.end()) return it->second;
    auto a = std::make_shared<const kvtc::AllocationSet>(ecsq ? kvtc::ecsq_allocation_set(*cal_, ratio) : kvtc::allocation_set(*cal_, ratio, joint));
    allocs_->sets.emplace(key, a);
    return a;
  }

  nb::bytes compress(nb::handle k, nb::handle v, nb::handle positions, double ratio, uint32_t sink, uint32_t window, nb::handle tokens,
                     uint32_t chunk_tokens, int level, int threads, const std::string& precision, bool joint,
                     const std::map<std::string, std::string>& meta, const std::string& coding, double step, uint32_t window_bits) const {
    const kvtc::CacheGeometry& g = cal_->geometry;
    const size_t nb_ = g.blocks.size();
    const auto ks = per_block(k, nb_, "k"), vs = per_block(v, nb_, "v"), ps = per_block(positions, nb_, "positions");
    kvtc::KvCapture c;
    c.model_sha256 = g.model_sha256;
    c.meta = meta;
    std::vector<AnyArray> ka(nb_), va(nb_);
    for (size_t b = 0; b < nb_; ++b) {
      const std::string sfx = nb_ > 1 ? "[" + std::to_string(b) + "]" : "";
      for (int kv = 0; kv < 2; ++kv) {
        const std::string what = (kv == 0 ? "k" : "v") + sfx;
        AnyArray& a = kv == 0 ? ka[b] : va[b];
        if (!nb::try_cast(kv == 0 ? ks[b] : vs[b], a))
          throw Error(what + ": expected a numpy array or a tensor with __dlpack__, got " +
                      std::string(nb::type_name((kv == 0 ? ks[b] : vs[b]).type()).c_str()));
        require_cpu(a, what);
        const auto d = a.dtype();
        if (d.code != uint8_t(nb::dlpack::dtype_code::Float) || (d.bits != 16 && d.bits != 32) || d.lanes != 1)
          throw Error(what + ": dtype " + dtype_str(d) + ", expected float16 or float32");
        if (a.ndim() != 4) throw Error(what + ": shape " + shape_str(a) + ", expected 4 dimensions [layers, kv_heads, tokens, head_dim]");
        const kvtc::BlockGeometry& bg = g.blocks[b];
        if (a.shape(0) != bg.n_layer() || a.shape(1) != bg.n_head_kv || a.shape(3) != bg.head_dim)
          throw Error(what + ": shape " + shape_str(a) + ", the calibration's model has [" + std::to_string(bg.n_layer()) + ", " +
                      std::to_string(bg.n_head_kv) + ", tokens, " + std::to_string(bg.head_dim) + "] (calibration of another model?)");
      }
      if (va[b].shape(2) != ka[b].shape(2)) throw Error("v" + sfx + ": shape " + shape_str(va[b]) + ", k" + sfx + "'s is " + shape_str(ka[b]));
      kvtc::KvBlock kb;
      static_cast<kvtc::BlockGeometry&>(kb) = g.blocks[b];
      kb.pos = int_vector(ps[b], "positions" + sfx);
      if (kb.pos.size() != ka[b].shape(2))
        throw Error("positions" + sfx + ": " + std::to_string(kb.pos.size()) + " entries, k" + sfx + " holds " + std::to_string(ka[b].shape(2)) +
                    " tokens");
      c.blocks.push_back(std::move(kb));
    }
    if (!tokens.is_none()) c.tokens = int_vector(tokens, "tokens");
    const auto alloc_set = alloc(ratio, joint, coding);
    kvtc::CompressOptions o = compress_options(sink, window, chunk_tokens, level, threads, precision, window_bits);
    o.ecsq_step = ecsq_step(coding, step);
    std::vector<uint8_t> out;
    {
      nb::gil_scoped_release unlocked;
      for (size_t b = 0; b < nb_; ++b) {
        gather_f16(ka[b], c.blocks[b].k, threads);
        gather_f16(va[b], c.blocks[b].v, threads);
      }
      out = kvtc::compress(c, *cal_, *alloc_set, o);
    }
    return to_bytes(out);
  }

  nb::tuple decompress(nb::handle data, const std::string& dtype, bool return_tokens, int threads, const std::string& precision) const {
    if (dtype != "float16" && dtype != "float32") throw Error("dtype '" + dtype + "': expected 'float16' or 'float32'");
    const Bytes in(data, "decompress");
    kvtc::KvCapture c;
    {
      nb::gil_scoped_release unlocked;
      c = kvtc::decompress(in.span(), *cal_, "container", decompress_options(threads, precision));
    }
    const bool f32 = dtype == "float32";
    nb::list ks, vs, ps;
    for (kvtc::KvBlock& b : c.blocks) {
      ks.append(block_array(b, std::move(b.k), f32, threads));
      vs.append(block_array(b, std::move(b.v), f32, threads));
      ps.append(int_array(std::move(b.pos)));
    }
    auto one = [&](nb::list& l) -> nb::object { return l.size() == 1 ? nb::object(l[0]) : nb::object(l); };
    if (return_tokens) return nb::make_tuple(one(ks), one(vs), one(ps), c.tokens.empty() ? nb::none() : int_array(c.tokens));
    return nb::make_tuple(one(ks), one(vs), one(ps));
  }

  nb::bytes compress_state(nb::handle blob, double ratio, uint32_t sink, uint32_t window, nb::handle tokens, uint32_t chunk_tokens, int level,
                           int threads, const std::string& precision, bool joint, const std::string& coding, double step, uint32_t window_bits,
                           nb::handle kv_settings) const {
    const Bytes in(blob, "compress_state");
    const kvtc::CacheGeometry geom = kvtc::geometry_with_settings(cal_->geometry, kv_settings_of(kv_settings));
    std::vector<int32_t> tok;
    if (!tokens.is_none()) tok = int_vector(tokens, "tokens");
    const auto alloc_set = alloc(ratio, joint, coding);
    kvtc::CompressOptions o = compress_options(sink, window, chunk_tokens, level, threads, precision, window_bits);
    o.ecsq_step = ecsq_step(coding, step);
    std::vector<uint8_t> out;
    {
      nb::gil_scoped_release unlocked;
      out = kvtc::compress_state(in.span(), geom, *cal_, *alloc_set, o, tok);
    }
    return to_bytes(out);
  }

  nb::bytes decompress_state(nb::handle data, std::optional<uint32_t> v_trans, std::optional<std::vector<uint32_t>> streams,
                             std::optional<int32_t> seq_id, int threads, const std::string& precision) const {
    const Bytes in(data, "decompress_state");
    const kvtc::DecompressOptions o = decompress_options(threads, precision);
    std::vector<uint8_t> out;
    if (!v_trans && !streams && !seq_id) {
      nb::gil_scoped_release unlocked;
      out = kvtc::decompress_state(in.span(), *cal_, "container", o);
    } else {
      // Unset fields keep what the container recorded (or the defaults of a
      // context with one stream per block, flash attention, sequence 0).
      const kvtc::ContainerHeader h = kvtc::inspect(in.span(), "container").header;
      auto rec = [&](const char* key) -> std::optional<std::string> {
        auto it = h.meta.find(key);
        return it == h.meta.end() ? std::nullopt : std::optional<std::string>(it->second);
      };
      kvtc::StateLayout to;
      to.v_trans = v_trans ? *v_trans : rec("llama_state_v_trans") == std::optional<std::string>("1") ? 1 : 0;
      to.seq_id = seq_id ? *seq_id : 0;
      if (streams) to.streams = *streams;
      nb::gil_scoped_release unlocked;
      out = kvtc::decompress_state(in.span(), *cal_, to, "container", o);
    }
    return to_bytes(out);
  }

  nb::dict info() const {
    nb::dict d;
    d["path"] = path_;
    d["id"] = cal_->id;
    d["model_sha256"] = cal_->geometry.model_sha256;
    d["keys_derope"] = cal_->keys_derope;
    nb::list blocks;
    for (size_t b = 0; b < cal_->blocks.size(); ++b) {
      nb::dict bd = b < cal_->geometry.blocks.size() ? geometry_dict(cal_->geometry.blocks[b]) : nb::dict();
      bd["components_k"] = cal_->blocks[b][0].r;
      bd["components_v"] = cal_->blocks[b][1].r;
      blocks.append(bd);
    }
    d["blocks"] = blocks;
    std::vector<std::string> ratios;
    if (!cal_->blocks.empty())
      for (const auto& [key, a] : cal_->blocks[0][0].tables) ratios.push_back(key);
    d["stored_ratios"] = ratios;
    d["meta"] = cal_->meta;
    return d;
  }

 private:
  struct Allocs {
    std::mutex mu;
    std::map<std::tuple<double, bool, bool>, std::shared_ptr<const kvtc::AllocationSet>> sets;
  };
  std::shared_ptr<const kvtc::Calibration> cal_;
  std::shared_ptr<Allocs> allocs_;
  std::string path_;
  bool decoder_only_ = false;
};

nb::dict inspect_dict(nb::handle data) {
  const Bytes in(data, "inspect");
  kvtc::ContainerInfo info;
  {
    nb::gil_scoped_release unlocked;
    info = kvtc::inspect(in.span(), "container");
  }
  const kvtc::ContainerHeader& h = info.header;
  nb::dict d;
  d["version"] = h.version;
  d["calibration_id"] = h.calibration_id;
  d["model_sha256"] = h.geometry.model_sha256;
  d["sink"] = h.sink;
  d["window"] = h.window;
  d["chunk_tokens"] = h.chunk_tokens;
  d["deflate_level"] = h.deflate_level;
  d["has_tokens"] = h.has_tokens;
  d["keys_derope"] = h.keys_derope;
  nb::list blocks;
  for (size_t b = 0; b < h.geometry.blocks.size(); ++b) {
    nb::dict bd = geometry_dict(h.geometry.blocks[b]);
    if (b < h.n_tokens.size()) bd["tokens"] = h.n_tokens[b];
    if (b < h.alloc.size()) {
      bd["nominal_ratio_k"] = h.alloc[b][0].nominal_ratio;
      bd["nominal_ratio_v"] = h.alloc[b][1].nominal_ratio;
    }
    blocks.append(bd);
  }
  d["blocks"] = blocks;
  d["meta"] = h.meta;
  d["file_bytes"] = info.file_bytes;
  d["tokens"] = info.n_tokens;
  d["compressed_tokens"] = info.n_compressed_tokens;
  d["f16_bytes_all"] = info.f16_bytes_all;
  d["f16_bytes_compressed"] = info.f16_bytes_compressed;
  d["stored_bytes_compressed"] = info.stored_bytes_compressed;
  d["ratio_compressed_tokens"] = info.ratio_compressed_tokens();
  d["ratio_whole_cache"] = info.ratio_whole_cache();
  nb::list sections;
  for (const auto& s : info.sections) {
    nb::dict sd;
    sd["kind"] = s.kind;
    sd["block"] = s.block;
    sd["kv"] = s.kv == 0 ? "k" : "v";
    sd["tokens"] = nb::make_tuple(s.t0, s.t1);
    sd["stored_bytes"] = s.stored_bytes;
    sd["raw_bytes"] = s.raw_bytes;
    sections.append(sd);
  }
  d["sections"] = sections;
  return d;
}

// ---- the prompt store -------------------------------------------------------------

// A tenant (docs/store.md "Tenants"): a str (its UTF-8 bytes), bytes or
// None (none: ""). kvtc-server's cache_salt is the same bytes.
std::string tenant_of(nb::handle h) {
  if (h.is_none()) return {};
  if (nb::isinstance<nb::str>(h)) return nb::cast<std::string>(h);
  if (nb::isinstance<nb::bytes>(h)) {
    nb::bytes b = nb::borrow<nb::bytes>(h);
    return std::string(b.c_str(), b.size());
  }
  throw nb::type_error((std::string("tenant: expected str, bytes or None, got ") + nb::type_name(h.type()).c_str()).c_str());
}

// A context's RoPE settings (kvtc.llama_cpp.context_kv_settings' dict), or
// unset for None.
kvtc::KvSettings kv_settings_of(nb::handle kv_settings) {
  kvtc::KvSettings k;
  if (kv_settings.is_none()) return k;
  if (!nb::isinstance<nb::dict>(kv_settings)) throw Error("kv_settings: a dict (kvtc.llama_cpp reads it from the context) or None");
  nb::dict d = nb::borrow<nb::dict>(kv_settings);
  auto num = [&](const char* key) {
    if (!d.contains(key)) throw Error(std::string("kv_settings: '") + key + "' is missing");
    return nb::cast<double>(d[key]);
  };
  k.rope_freq_base = float(num("rope_freq_base"));
  k.rope_freq_scale = float(num("rope_freq_scale"));
  k.n_ctx_orig_yarn = uint32_t(num("n_ctx_orig_yarn"));
  k.yarn_ext_factor = float(num("yarn_ext_factor"));
  k.yarn_attn_factor = float(num("yarn_attn_factor"));
  k.yarn_beta_fast = float(num("yarn_beta_fast"));
  k.yarn_beta_slow = float(num("yarn_beta_slow"));
  return k;
}

// The store options PromptStore and Learner share: the context's settings
// (part of every key), the Redis tier (with AUTH and deadlines) and the
// secret. Lines to log (a password or secret file others can read) go to
// `warnings`.
kvtc::StoreOptions shared_options(nb::handle kv_settings, const std::string& redis_url, const std::vector<std::string>& redis_cluster,
                                  const std::string& redis_user, const std::string& redis_password_file, int64_t redis_ttl_s,
                                  int redis_lookup_timeout_ms, int redis_timeout_ms, const std::string& secret_file, bool encrypt,
                                  std::vector<std::string>& warnings) {
  kvtc::StoreOptions o;
  o.kv_settings = kv_settings_of(kv_settings);
  o.redis_url = redis_url;
  o.redis_cluster = redis_cluster;
  if (!redis_url.empty() && !redis_cluster.empty()) throw Error("redis_url and redis_cluster: give one (a server or a cluster's seeds)");
  std::string warning;
  if (!redis_password_file.empty()) o.redis_password = kvtc::read_password_file(redis_password_file, &warning);
  if (!warning.empty()) warnings.push_back("redis_password_file " + warning);
  o.redis_user = redis_user;
  if ((!o.redis_password.empty() || !redis_user.empty()) && redis_url.empty() && redis_cluster.empty())
    throw Error("redis_password_file and redis_user need redis_url or redis_cluster");
  if (!redis_user.empty() && o.redis_password.empty()) throw Error("redis_user needs redis_password_file (AUTH user password)");
  o.redis_ttl_s = redis_ttl_s;
  o.redis_lookup_timeout_ms = redis_lookup_timeout_ms;
  o.redis_timeout_ms = redis_timeout_ms;
  // The secret file's bytes (docs/store.md "Secrets"): Error naming the
  // file when it is missing, empty or shorter than 32 bytes.
  std::string secret_warning;
  if (!secret_file.empty()) o.secret = kvtc::read_store_secret(secret_file, &secret_warning);
  if (!secret_warning.empty()) warnings.push_back("secret_file " + secret_warning);
  o.encrypt = encrypt;
  return o;
}

// Lines logged on threads without the GIL, waiting for Python (messages()):
// at most 1,000, the oldest dropped.
// A warning's line starts "warning: " (the store's lines are all warnings).
struct LogLines {
  std::mutex mu;
  std::deque<std::string> lines;
  void add(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(line);
    if (lines.size() > 1000) lines.pop_front();
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::string> out(lines.begin(), lines.end());
    lines.clear();
    return out;
  }
};

class PyStore {
 public:
  PyStore(const PyCalibration& cal, double ratio, bool raw, uint32_t chunk_tokens, uint32_t sink, uint32_t window, uint64_t ram_bytes,
          const std::string& disk_dir, uint64_t disk_bytes, bool async, int threads, int restore_threads, const std::string& redis_url,
          const std::string& precision, bool entropy_coded, const std::string& model_sha256, nb::handle kv_settings, const std::string& secret_file,
          bool encrypt, const std::vector<std::string>& redis_cluster, const std::string& redis_user, const std::string& redis_password_file,
          int64_t redis_ttl_s, int redis_lookup_timeout_ms, int redis_timeout_ms, double global_ratio, uint32_t window_bits)
      : cal_(cal), log_(std::make_shared<LogLines>()) {
    if (cal.decoder_only()) throw Error(cal.path() + ": the store compresses; load the calibration without decoder_only");
    std::vector<std::string> warnings;
    kvtc::StoreOptions o = shared_options(kv_settings, redis_url, redis_cluster, redis_user, redis_password_file, redis_ttl_s,
                                          redis_lookup_timeout_ms, redis_timeout_ms, secret_file, encrypt, warnings);
    // The model the caches come from: its file's SHA-256 (the calibration's
    // model by default). A calibration of another file is refused below.
    // ... and the RoPE its context rotates keys with (rope_freq_base,
    // rope_scaling_type, YaRN), which the codec removes: not the calibration's.
    kvtc::CacheGeometry geom = kvtc::geometry_with_settings(cal.cal().geometry, o.kv_settings);
    if (!model_sha256.empty()) geom.model_sha256 = model_sha256;
    o.ratio = ratio;
    o.global_ratio = global_ratio;
    o.raw = raw;
    o.entropy_coded = entropy_coded;
    o.chunk_tokens = chunk_tokens;
    o.sink = sink;
    o.window = window;
    o.window_bits = window_bits;
    o.ram_bytes = ram_bytes;
    o.disk_dir = disk_dir;
    o.disk_bytes = disk_bytes;
    o.async = async;
    o.threads = threads;
    o.restore_threads = restore_threads;
    o.precision = kvtc::parse_precision(precision);
    std::shared_ptr<LogLines> log = log_;
    o.log = [log](const std::string& line) { log->add(line); };
    for (const std::string& w : warnings) o.log("kvtc store: " + w);
    nb::gil_scoped_release unlocked;
    store_ = std::make_unique<kvtc::PromptStore>(cal.cal(), geom, o);
    // The store keeps only the keys derived from it.
    if (!o.secret.empty()) explicit_bzero(o.secret.data(), o.secret.size());
  }

  bool wants(nb::handle tokens, nb::handle tenant) const {
    const std::vector<int32_t> t = int_vector(tokens, "tokens");
    return store().wants(t, tenant_of(tenant));
  }

  // A sequence or context state of `tokens` (positions 0..n-1).
  void put_state(nb::handle tokens, nb::handle blob, nb::handle tenant) {
    std::vector<int32_t> t = int_vector(tokens, "tokens");
    const std::string who = tenant_of(tenant);
    std::vector<uint8_t> b;
    {
      const Bytes in(blob, "put_state");
      const auto s = in.span();
      if (kvtc::is_context_state(s)) {
        kvtc::ContextState cs = kvtc::context_state_split(s, "put_state");
        b = std::move(cs.seq_blob);
      } else {
        b = store().state_buffer(s.size());  // a kept buffer's pages are mapped already
        std::copy(s.begin(), s.end(), b.begin());
      }
    }
    nb::gil_scoped_release unlocked;
    store().put_state(std::move(t), std::move(b), who);
  }

  // The best stored prompt for `tokens` when the context holds `current`,
  // as a state for a context of the given layout: a context state when
  // `arch` is given, else a sequence state of sequence seq_id.
  std::optional<nb::dict> take(nb::handle current, nb::handle tokens, uint32_t v_trans, std::vector<uint32_t> streams, int32_t seq_id,
                               const std::string& arch, nb::handle tenant) {
    const std::vector<int32_t> cur = int_vector(current, "current"), tok = int_vector(tokens, "tokens");
    const std::string who = tenant_of(tenant);
    std::optional<kvtc::PromptStore::StateMatch> m;
    {
      nb::gil_scoped_release unlocked;
      m = store().take_state(cur, tok, kvtc::StateLayout{streams, v_trans, seq_id}, who);
      if (m && !arch.empty()) m->state = kvtc::context_state_join(arch, m->state, "take");
    }
    if (!m) return std::nullopt;
    nb::dict d;
    d["tokens"] = int_array(std::move(m->tokens));
    d["state"] = to_bytes(m->state);
    d["common_prefix"] = m->common_prefix;
    d["tier"] = std::string(m->tier);
    return d;
  }

  void flush() {
    nb::gil_scoped_release unlocked;
    store().flush();
  }

  nb::dict stats() const {
    const kvtc::StoreStats s = store().stats();
    nb::dict d;
#define KVTC_STAT(name) d[#name] = s.name
    KVTC_STAT(entries);
    KVTC_STAT(chunks);
    KVTC_STAT(ram_bytes);
    KVTC_STAT(disk_entries);
    KVTC_STAT(disk_chunks);
    KVTC_STAT(disk_bytes);
    KVTC_STAT(disk_enabled);
    KVTC_STAT(disk_error);
    KVTC_STAT(puts);
    KVTC_STAT(puts_contained);
    KVTC_STAT(puts_skipped);
    KVTC_STAT(pending);
    KVTC_STAT(pending_bytes);
    KVTC_STAT(pending_budget);
    KVTC_STAT(spare_buffers);
    KVTC_STAT(spare_bytes);
    KVTC_STAT(buffers_reused);
    KVTC_STAT(buffers_new);
    KVTC_STAT(buffers_prepared);
    KVTC_STAT(chunks_written);
    KVTC_STAT(chunks_shared);
    KVTC_STAT(hits_ram);
    KVTC_STAT(hits_pending);
    KVTC_STAT(hits_disk);
    KVTC_STAT(hits_redis);
    KVTC_STAT(misses);
    KVTC_STAT(tokens_restored);
    KVTC_STAT(corrupt_dropped);
    KVTC_STAT(foreign_dropped);
    KVTC_STAT(disk_io_errors);
    KVTC_STAT(disk_missing);
    KVTC_STAT(disk_scan_pending);
    KVTC_STAT(redis_enabled);
    KVTC_STAT(redis_up);
    KVTC_STAT(redis_error);
    KVTC_STAT(save_ms);
    KVTC_STAT(restore_ms);
#undef KVTC_STAT
    return d;
  }

  std::vector<std::string> messages() {
    return log_->take();
  }

  const std::string& fingerprint() const {
    return store().fingerprint();
  }
  const std::string& protection() const {
    return store().protection();
  }
  void close() {
    nb::gil_scoped_release unlocked;
    store_.reset();
  }
  kvtc::PromptStore& store() const {
    if (!store_) throw Error("the store is closed");
    return *store_;
  }

 private:
  PyCalibration cal_;  // keeps the calibration alive as long as the store
  std::shared_ptr<LogLines> log_;
  std::unique_ptr<kvtc::PromptStore> store_;
};

// ---- a calibration learned from the prompts served -------------------------------

// kvtc::CalibrationLearner for the Python KvtcCache("auto"): the model's
// geometry from the facts llama-cpp-python reads (kvtc::geometry_from_facts),
// the file and the fleet as kvtc-server's --kvtc-calib auto has them.
class PyLearner {
 public:
  PyLearner(const std::map<std::string, std::string>& facts, uint64_t tokens, double share, double ratio, const std::string& disk_dir,
            nb::handle kv_settings, const std::string& redis_url, const std::vector<std::string>& redis_cluster, const std::string& redis_user,
            const std::string& redis_password_file, int64_t redis_ttl_s, int redis_lookup_timeout_ms, int redis_timeout_ms,
            const std::string& secret_file, bool encrypt)
      : log_(std::make_shared<LogLines>()), prefill_(std::make_shared<std::atomic<double>>(0.0)) {
    std::vector<std::string> warnings;
    opt_.fleet = shared_options(kv_settings, redis_url, redis_cluster, redis_user, redis_password_file, redis_ttl_s, redis_lookup_timeout_ms,
                                redis_timeout_ms, secret_file, encrypt, warnings);
    // The context's RoPE, not the GGUF's: what the learner removes from the keys.
    geom_ = kvtc::geometry_with_settings(kvtc::geometry_from_facts(facts, "KvtcCache('auto'): the model's facts"), opt_.fleet.kv_settings);
    std::shared_ptr<LogLines> log = log_;
    opt_.fleet.log = [log](const std::string& line) { log->add("warning: " + line); };
    for (const std::string& w : warnings) log->add("warning: kvtc store: " + w);
    opt_.tokens = tokens;
    opt_.share = share;
    opt_.ratio = ratio;
    opt_.file = disk_dir.empty() ? "" : kvtc::learned_calibration_file(disk_dir, geom_.model_sha256);
    std::shared_ptr<std::atomic<double>> prefill = prefill_;
    opt_.prefill_ms_per_token = [prefill] { return prefill->load(); };
    opt_.log = [log](bool warning, const std::string& line) { log->add(warning ? "warning: " + line : line); };
  }
  ~PyLearner() {
    nb::gil_scoped_release unlocked;  // a fit under way finishes first
    learner_.reset();
    opt_.wipe_secrets();
  }

  // The calibration learned before (the fleet's, else the file's), or None.
  std::optional<PyCalibration> find() {
    std::optional<kvtc::Calibration> c;
    std::string from;
    {
      nb::gil_scoped_release unlocked;
      c = kvtc::find_learned_calibration(geom_, opt_, &from);
    }
    if (!c) return std::nullopt;
    return PyCalibration::of(std::make_shared<const kvtc::Calibration>(std::move(*c)), from);
  }

  void start() {
    if (learner_) throw Error("Learner.start: started already");
    nb::gil_scoped_release unlocked;
    learner_ = std::make_unique<kvtc::CalibrationLearner>(geom_, opt_);
    opt_.wipe_secrets();  // the learner keeps its own copy until it has published
  }

  // Hands a prompt's state (a llama.cpp context or sequence state of
  // `tokens` at positions 0..n-1) to the learner: copied into its kept
  // buffer with the GIL released; False when it was not taken (busy, not
  // learning, fewer than 64 tokens). prefill_ms_per_token: the caller's
  // measured prompt processing per token (0: unknown), which the stride follows.
  bool offer(nb::handle tokens, nb::handle state, double prefill_ms_per_token) {
    kvtc::CalibrationLearner& L = learner();
    std::vector<int32_t> t = int_vector(tokens, "tokens");
    if (prefill_ms_per_token > 0 && std::isfinite(prefill_ms_per_token)) prefill_->store(prefill_ms_per_token);
    const Bytes in(state, "offer");  // before begin(): a bad argument must not leave a buffer handed out
    const auto s = in.span();
    std::optional<std::vector<uint8_t>> buf = L.begin(t.size());
    if (!buf) return false;
    nb::gil_scoped_release unlocked;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      buf->assign(s.begin(), s.end());
    } catch (...) {
      L.submit({}, {}, 0);  // the buffer back: begin() hands out one at a time
      throw;
    }
    L.submit(std::move(*buf), std::move(t), std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    return true;
  }

  std::optional<PyCalibration> calibration() const {
    std::shared_ptr<const kvtc::Calibration> c = learner().calibration();
    if (!c) return std::nullopt;
    const kvtc::LearnerStatus st = learner().status();
    return PyCalibration::of(std::move(c), st.file.empty() ? "the calibration learned (kept in memory only)" : st.file);
  }

  void mark_live(uint64_t moved) { learner().mark_live(moved); }

  nb::dict status() const {
    nb::dict d;
    if (!learner_) {
      d["state"] = "not started";
      return d;
    }
    const kvtc::LearnerStatus s = learner_->status();
    d["state"] = s.state;
    d["error"] = s.error;
    d["file"] = s.file;
    d["calibration_id"] = s.calib_id;
#define KVTC_STAT(f) d[#f] = s.f
    KVTC_STAT(seen);
    KVTC_STAT(fresh);
    KVTC_STAT(fit);
    KVTC_STAT(held);
    KVTC_STAT(fit_target);
    KVTC_STAT(held_target);
    KVTC_STAT(samples);
    KVTC_STAT(busy);
    KVTC_STAT(refused);
    KVTC_STAT(moved);
    KVTC_STAT(stride);
    KVTC_STAT(cpu_ms);
    KVTC_STAT(loop_ms);
    KVTC_STAT(loop_max_ms);
    KVTC_STAT(fit_s);
#undef KVTC_STAT
    return d;
  }

  nb::dict geometry() const {
    return geometry_dict(geom_.blocks.at(0));
  }
  const std::string& file() const {
    return opt_.file;
  }
  std::vector<std::string> messages() {
    return log_->take();
  }

 private:
  kvtc::CalibrationLearner& learner() const {
    if (!learner_) throw Error("the learner is not started (Learner.start)");
    return *learner_;
  }
  kvtc::CacheGeometry geom_;
  kvtc::LearnerOptions opt_;
  std::shared_ptr<LogLines> log_;
  std::shared_ptr<std::atomic<double>> prefill_;
  std::unique_ptr<kvtc::CalibrationLearner> learner_;
};

}  // namespace

NB_MODULE(_kvtc, m) {
  m.doc() = "kvtc: KV Cache Transform Coding — compress an LLM's KV cache and restore it (the C++ library's Python binding)";
  nb::exception<kvtc::Error>(m, "Error", PyExc_ValueError);
  m.attr("__version__") = kvtc::library_info().version;
  m.attr("CONTAINER_VERSION") = kvtc::kContainerVersion;

  nb::class_<PyCalibration>(m, "Calibration",
                            "What kvtc learned once per model: per cache block, PCA means and bases and the bit-allocation tables.\n"
                            "Immutable once loaded; safe to share between threads.")
      .def_static("load", &PyCalibration::load, "path"_a, "decoder_only"_a = false,
                  "Loads a calibration file (.safetensors, docs/calibration-format.md), verifying every checksum.\n"
                  "decoder_only=True skips what only the encoder needs (allocation tables, block errors).")
      .def_prop_ro(
          "id", [](const PyCalibration& c) { return c.cal().id; }, "calibration_id: SHA-256 of every mean and basis; containers record it.")
      .def_prop_ro("path", &PyCalibration::path)
      .def_prop_ro(
          "model_sha256", [](const PyCalibration& c) { return c.cal().geometry.model_sha256; }, "SHA-256 of the GGUF the calibration is for.")
      .def("info", &PyCalibration::info, "Geometry (layers, KV heads, head_dim, RoPE) per block, components kept, stored ratios, provenance.")
      .def("compress", &PyCalibration::compress, "k"_a, "v"_a, "positions"_a, nb::kw_only(), "ratio"_a = 16.0, "sink"_a = 4u, "window"_a = 128u,
           "tokens"_a = nb::none(), "chunk_tokens"_a = 256u, "level"_a = 6, "threads"_a = 0, "precision"_a = "auto", "joint"_a = false,
           "meta"_a = std::map<std::string, std::string>(), "coding"_a = "ecsq", "step"_a = 0.0, "window_bits"_a = 8u,
           nb::sig("def compress(self, k: object, v: object, positions: object, *, ratio: float = 16.0, sink: int = 4, window: int = 128, "
                   "tokens: object | None = None, chunk_tokens: int = 256, level: int = 6, threads: int = 0, precision: str = 'auto', "
                   "joint: bool = False, meta: dict[str, str] = {}, coding: str = 'ecsq', step: float = 0.0, window_bits: int = 8) -> bytes"),
           "Compresses a KV cache into a .kvtc container (docs/format.md) and returns its bytes.\n\n"
           "k, v: float16 or float32 arrays [layers, kv_heads, tokens, head_dim] (numpy, or anything with __dlpack__ on the CPU,\n"
           "such as a torch tensor; any strides), keys as the model stores them (RoPE applied); a list of two per array for\n"
           "iSWA models (global layers, then sliding-window layers). positions: int32/int64 [tokens], the position of each token.\n"
           "ratio: nominal compression of the coded tokens; the first `sink` and last `window` tokens stay f16.\n"
           "tokens: optional token ids [tokens], stored with the cache. meta: provenance strings stored in the header.\n"
           "threads: 0 = all hardware threads. precision: 'auto', 'f32' or 'bf16' (the projection's arithmetic).\n"
           "coding: 'ecsq', the default (one quantizer step for every component, rANS, rate-controlled to `ratio` on the coded\n"
           "tokens; container version 4: ~20% fewer bytes than 'dp' at equal error), or 'dp' (the paper's DP allocation +\n"
           "DEFLATE, version 1; needed for the GPU encoder); step > 0 fixes ecsq's step instead.\n"
           "window_bits: 8 (the default) stores the window as int8 with an f16 scale per key channel / value token (container\n"
           "version 3: about half its bytes, its KL within the noise of f16's); 16 keeps it f16, exact.\n"
           "Raises kvtc.Error on a shape, dtype or calibration mismatch and on NaN/inf values. Releases the GIL while coding.")
      .def("decompress", &PyCalibration::decompress, "data"_a, nb::kw_only(), "dtype"_a = "float16", "return_tokens"_a = false, "threads"_a = 0,
           "precision"_a = "auto",
           nb::sig("def decompress(self, data: bytes | bytearray | memoryview, *, dtype: str = 'float16', return_tokens: bool = False, "
                   "threads: int = 0, precision: str = 'auto') -> tuple"),
           "Decodes a container: (k, v, positions) as numpy arrays [layers, kv_heads, tokens, head_dim] of `dtype` ('float16' or\n"
           "'float32') and int32 [tokens]; lists of two for iSWA models. return_tokens=True appends the stored token ids (or None).\n"
           "precision: 'auto' (decode: int8 where the CPU has AVX2, bf16 instead where native without AVX-512 VNNI, else f32; encode: "
           "bf16 where native, else f32), 'f32' (the same bits on any CPU), 'bf16' or 'int8'\n"
           "(entropy-coded chunks in oneDNN's integer GEMM: faster, ~1% more error).\n"
           "Raises kvtc.Error for a container of another calibration, truncated or corrupted bytes. Releases the GIL while decoding.")
      .def("compress_state", &PyCalibration::compress_state, "blob"_a, nb::kw_only(), "ratio"_a = 16.0, "sink"_a = 4u, "window"_a = 128u,
           "tokens"_a = nb::none(), "chunk_tokens"_a = 256u, "level"_a = 6, "threads"_a = 0, "precision"_a = "auto", "joint"_a = false,
           "coding"_a = "ecsq", "step"_a = 0.0, "window_bits"_a = 8u, "kv_settings"_a = nb::none(),
           nb::sig("def compress_state(self, blob: bytes | bytearray | memoryview, *, ratio: float = 16.0, sink: int = 4, window: int = 128, "
                   "tokens: object | None = None, chunk_tokens: int = 256, level: int = 6, threads: int = 0, precision: str = 'auto', "
                   "joint: bool = False, coding: str = 'ecsq', step: float = 0.0, window_bits: int = 8, "
                   "kv_settings: dict[str, float] | None = None) -> bytes"),
           "Compresses a llama.cpp state of an f16 cache: a sequence state (llama_state_seq_get_data) or a whole context's\n"
           "(llama_state_get_data, llama-cpp-python's LlamaState.llama_state). The container records which, and the layout.\n"
           "kv_settings: the context's RoPE (kvtc.llama_cpp.context_kv_settings(llm)) when it is not the model's own\n"
           "(rope_freq_base, rope_freq_scale, rope_scaling_type, YaRN): the rotation the keys carry, which the codec removes.\n"
           "coding, step and window_bits as in compress.")
      .def("decompress_state", &PyCalibration::decompress_state, "data"_a, nb::kw_only(), "v_trans"_a = nb::none(), "streams"_a = nb::none(),
           "seq_id"_a = nb::none(), "threads"_a = 0, "precision"_a = "auto",
           nb::sig("def decompress_state(self, data: bytes | bytearray | memoryview, *, v_trans: int | None = None, "
                   "streams: list[int] | None = None, seq_id: int | None = None, threads: int = 0, precision: str = 'auto') -> bytes"),
           "The llama.cpp state again, in the form compress_state was given, for llama_state_seq_set_data or llama_state_set_data.\n"
           "Without arguments, in the recorded layout; v_trans (1: a context without flash attention), streams (per block) and\n"
           "seq_id retarget it.");

  m.def(
      "state_layout",
      [](nb::handle blob) {
        const Bytes in(blob, "state_layout");
        const auto s = in.span();
        nb::dict d;
        kvtc::StateLayout l;
        if (kvtc::is_context_state(s)) {
          const kvtc::ContextState cs = kvtc::context_state_split(s, "state_layout");
          l = kvtc::state_layout_of(cs.seq_blob, "state_layout");
          d["kind"] = "context";
          d["arch"] = cs.arch;
        } else {
          l = kvtc::state_layout_of(s, "state_layout");
          d["kind"] = "sequence";
          d["arch"] = nb::none();
        }
        d["v_trans"] = l.v_trans;
        d["streams"] = l.streams;
        d["seq_id"] = l.seq_id;
        return d;
      },
      "blob"_a, nb::sig("def state_layout(blob: bytes | bytearray | memoryview) -> dict"),
      "What a llama.cpp state says of its context: {'kind': 'context' or 'sequence', 'arch', 'v_trans', 'streams', 'seq_id'}.\n"
      "Raises kvtc.Error for bytes that are not a non-empty state.");
  m.def("inspect", &inspect_dict, "data"_a, nb::sig("def inspect(data: bytes | bytearray | memoryview) -> dict"),
        "Layout, sizes and measured ratios of a container, without decoding (every checksum verified).");
  m.def(
      "library_info",
      [] {
        const kvtc::LibraryInfo i = kvtc::library_info();
        nb::dict d;
        d["version"] = i.version;
        d["cpu"] = i.cpu;
        d["cpu_features"] = i.cpu_features;
        d["bf16_projection"] = i.bf16_projection;
        d["bf16"] = i.bf16;
        d["int8_projection"] = i.int8_projection;
        d["int8"] = i.int8;
        d["auto_encode"] = kvtc::precision_name(i.auto_encode);
        d["auto_decode"] = kvtc::precision_name(i.auto_decode);
        return d;
      },
      "The library's version, this CPU and the projection kernels it runs.");

  nb::class_<PyLearner>(m, "Learner",
                        "A calibration learned from the prompts served, on a thread of its own (KvtcCache('auto'); kvtc-server's\n"
                        "--kvtc-calib auto, docs/server.md). Thread-safe.")
      .def(nb::init<const std::map<std::string, std::string>&, uint64_t, double, double, const std::string&, nb::handle, const std::string&,
                    const std::vector<std::string>&, const std::string&, const std::string&, int64_t, int, int, const std::string&, bool>(),
           "facts"_a, nb::kw_only(), "tokens"_a = uint64_t(32768), "share"_a = 0.05, "ratio"_a = 16.0, "disk_dir"_a = "",
           "kv_settings"_a = nb::none(), "redis_url"_a = "", "redis_cluster"_a = std::vector<std::string>{}, "redis_user"_a = "",
           "redis_password_file"_a = "", "redis_ttl_s"_a = int64_t(86400), "redis_lookup_timeout_ms"_a = 100, "redis_timeout_ms"_a = 2000,
           "secret_file"_a = "", "encrypt"_a = false,
           "facts: the model's, as strings (model_sha256, n_layer, n_head_kv, head_dim, n_swa, rope_type, n_rot, rope_freq_base,\n"
           "rope_freq_scale, rope_scaling_type, rope_freq_factors; kvtc.llama_cpp.model_facts reads them). tokens: rows for the\n"
           "PCA before the fit (held out: tokens/16 more). share: learning's CPU time at most this share of the prefill time of the\n"
           "tokens it learns from. disk_dir: the calibration is kept there (calibration-auto-<16 hex>.safetensors) and found at\n"
           "the next start. The Redis and secret arguments as PromptStore's: with both, one calibration for every process.")
      .def("find", &PyLearner::find, "The calibration learned before (the fleet's in Redis, else the one in disk_dir), or None.")
      .def("start", &PyLearner::start, "Starts the learner's thread.")
      .def("offer", &PyLearner::offer, "tokens"_a, "state"_a, "prefill_ms_per_token"_a = 0.0,
           "Hands a prompt's llama.cpp state to the learner; False when not taken (busy, not learning, < 64 tokens).")
      .def("calibration", &PyLearner::calibration, "The calibration once fitted or adopted, else None.")
      .def("mark_live", &PyLearner::mark_live, "moved"_a, "The caller stores compressed now (`moved` raw prompts moved into its store).")
      .def("status", &PyLearner::status, "state (learning, fitting, ready, live, failed), tokens learned and targets, samples, stride, times.")
      .def("geometry", &PyLearner::geometry, "The cache geometry read from the facts (as Calibration.info()'s blocks).")
      .def_prop_ro("file", &PyLearner::file, "Where the calibration is kept ('' without disk_dir).")
      .def("messages", &PyLearner::messages, "What the learner logged since the last call (a warning's line starts 'warning: ').");

  nb::class_<PyStore>(m, "PromptStore",
                      "Compressed prompt caches in RAM, on disk and in Redis, keyed by token chunks (docs/store.md): what\n"
                      "kvtc-server's prompt cache is made of. Thread-safe; puts are compressed on a worker thread.")
      .def(nb::init<const PyCalibration&, double, bool, uint32_t, uint32_t, uint32_t, uint64_t, const std::string&, uint64_t, bool, int, int,
                    const std::string&, const std::string&, bool, const std::string&, nb::handle, const std::string&, bool,
                    const std::vector<std::string>&, const std::string&, const std::string&, int64_t, int, int, double, uint32_t>(),
           "calibration"_a, nb::kw_only(), "ratio"_a = 16.0, "raw"_a = false, "chunk_tokens"_a = 256u, "sink"_a = 4u, "window"_a = 128u,
           "ram_bytes"_a = 0, "disk_dir"_a = "", "disk_bytes"_a = 0, "async_puts"_a = true, "threads"_a = 0, "restore_threads"_a = 0,
           "redis_url"_a = "", "precision"_a = "auto", "entropy_coded"_a = true, "model_sha256"_a = "", "kv_settings"_a = nb::none(),
           "secret_file"_a = "", "encrypt"_a = false, "redis_cluster"_a = std::vector<std::string>{}, "redis_user"_a = "",
           "redis_password_file"_a = "", "redis_ttl_s"_a = int64_t(86400), "redis_lookup_timeout_ms"_a = 100, "redis_timeout_ms"_a = 2000,
           "global_ratio"_a = 0.0, "window_bits"_a = 8u,
           "window_bits: the tail's raw window as int8 with f16 scales (8, the default: container version 3, about half its bytes)\n"
           "or f16 (16).\n"
           "global_ratio: a sliding-window model's global layers' ratio (0: min(ratio, 4), kvtc::global_ratio_of).\n"
           "ram_bytes / disk_bytes: budgets of stored bytes (0: none). disk_dir: the disk tier (survives restarts).\n"
           "raw=True keeps f16 pieces (no coding): the exact baseline. entropy_coded (default True): pieces in the entropy-coded\n"
           "mode (container version 4; a sliding-window model's are DP-coded), False: the DP allocation with DEFLATE (version 1).\n"
           "model_sha256: the SHA-256 of the model file the\n"
           "caches come from (default: the calibration's model; another is refused). kv_settings: the context's RoPE as\n"
           "llama.cpp resolved it ({'rope_freq_base', 'rope_freq_scale', 'n_ctx_orig_yarn', 'yarn_ext_factor',\n"
           "'yarn_attn_factor', 'yarn_beta_fast', 'yarn_beta_slow'}), part of the store's keys; None: unset.\n"
           "secret_file: a file of at least 32 bytes shared by every process of the store (openssl rand 32 > F): every value on\n"
           "disk and in Redis is authenticated and bound to its key, and one written without it is dropped, never served;\n"
           "encrypt=True (needs secret_file): encrypted at rest too (AES-256-GCM). docs/store.md \"Secrets\".\n"
           "redis_cluster: host:port seeds of a Redis Cluster instead of redis_url. redis_user, redis_password_file: AUTH on\n"
           "every connection (the file's first line; for every node of a cluster). redis_ttl_s: every Redis key expires this\n"
           "long after the last hit or put that used it (0: never). redis_lookup_timeout_ms: a take's deadline for each Redis\n"
           "round trip, name resolution and connecting included (then a miss, and takes skip Redis until a background PING\n"
           "answers in time); redis_timeout_ms: the worker's, for a put's writes. docs/store.md \"Redis\".")
      .def("wants", &PyStore::wants, "tokens"_a, nb::kw_only(), "tenant"_a = nb::none(), "Whether storing `tokens` for `tenant` would add anything.")
      .def("put_state", &PyStore::put_state, "tokens"_a, "state"_a, nb::kw_only(), "tenant"_a = nb::none(),
           "Stores the cache of `tokens` (positions 0..n-1) from a llama.cpp sequence or context state; returns at once.\n"
           "tenant (str, bytes or None): whose prompt it is (docs/store.md \"Tenants\"): another tenant's take never finds it.")
      .def("take", &PyStore::take, "current"_a, "tokens"_a, nb::kw_only(), "v_trans"_a = 0u, "streams"_a = std::vector<uint32_t>{}, "seq_id"_a = 0,
           "arch"_a = "", "tenant"_a = nb::none(),
           "The best stored prompt of `tenant` for `tokens` when the context holds `current` (llama-server's rules), or None:\n"
           "{'tokens', 'state', 'common_prefix', 'tier'}; 'state' is a context state of `arch` when given, else a sequence state.")
      .def("flush", &PyStore::flush, "Waits until the disk tier's start-up scan is done and every queued put is stored.")
      .def("stats", &PyStore::stats)
      .def("messages", &PyStore::messages, "What the store logged since the last call (a disk tier disabled, a corrupt file dropped, ...).")
      .def_prop_ro("fingerprint", &PyStore::fingerprint)
      .def_prop_ro("protection", &PyStore::protection,
                   "'hmac-sha256;key=<key id>', 'aes-256-gcm;key=<key id>' (the id names the secret, not revealing it) or ''.")
      .def("close", &PyStore::close, "Finishes queued puts and releases the store.");
}
