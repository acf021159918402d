// A KV cache in memory (kvtc/cache.h): typed geometry <-> the metadata
// strings of the file formats, capture files, llama.cpp state blobs.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/capture_io.h"
#include "core/util.h"
#include "kvtc/cache.h"
#include "kvtc/error.h"

namespace kvtc {

namespace {

const char* kBlockSuffix[] = {"", "_swa"};

// Rows of one blob layer (cell-major, head-major inside a row) into the
// canonical [head][token][dim] slab of one layer.
void rows_to_heads(const BlobLayer& L, uint32_t n_tok, uint32_t n_head, uint32_t head_dim, uint16_t* dst) {
  const auto* src = reinterpret_cast<const uint8_t*>(L.rows.data());
  for (uint32_t t = 0; t < n_tok; ++t)
    for (uint32_t h = 0; h < n_head; ++h)
      std::memcpy(dst + (size_t(h) * n_tok + t) * head_dim, src + t * L.row_size + size_t(h) * head_dim * 2, size_t(head_dim) * 2);
}

void heads_to_rows(const uint16_t* src, uint32_t n_tok, uint32_t n_head, uint32_t head_dim, BlobLayer& L) {
  L.type = kGgmlTypeF16;
  L.row_size = uint64_t(n_head) * head_dim * 2;
  reserve_huge_pages(L.rows, L.row_size * n_tok);  // 3 MB a layer at 8K tokens on SmolLM2
  L.rows.resize(L.row_size * n_tok);
  for (uint32_t t = 0; t < n_tok; ++t)
    for (uint32_t h = 0; h < n_head; ++h)
      std::memcpy(L.rows.data() + t * L.row_size + size_t(h) * head_dim * 2, src + (size_t(h) * n_tok + t) * head_dim, size_t(head_dim) * 2);
}

Tensor f16_tensor(const KvBlock& b, const std::vector<uint16_t>& x) {
  Tensor t;
  t.dtype = DType::F16;
  t.shape = {b.n_layer(), b.n_head_kv, b.n_tokens(), b.head_dim};
  t.data.resize(x.size() * 2);
  std::memcpy(t.data.data(), x.data(), t.data.size());
  return t;
}

Tensor i32_tensor(const std::vector<int32_t>& x) {
  Tensor t;
  t.dtype = DType::I32;
  t.shape = {x.size()};
  t.data.resize(x.size() * 4);
  std::memcpy(t.data.data(), x.data(), t.data.size());
  return t;
}

}  // namespace

const char* rope_layout_name(RopeLayout l) {
  switch (l) {
    case RopeLayout::kNone: return "none";
    case RopeLayout::kNorm: return "norm";
    case RopeLayout::kNeox: return "neox";
  }
  return "?";
}

CacheGeometry KvCapture::geometry() const {
  CacheGeometry g;
  g.model_sha256 = model_sha256;
  for (const KvBlock& b : blocks) g.blocks.push_back(b.geometry());
  return g;
}

uint64_t KvCapture::f16_bytes_per_token() const {
  uint64_t b = 0;
  for (const KvBlock& blk : blocks) b += uint64_t(blk.features()) * 2 * 2;
  return b;
}

uint64_t KvCapture::f16_bytes() const {
  uint64_t n = 0;
  for (const KvBlock& b : blocks) n += uint64_t(b.numel()) * 2 * 2;
  return n;
}

// ---------------------------------------------------------------- metadata

std::string layers_to_json(const std::vector<int32_t>& layers) {
  return nlohmann::json(layers).dump();
}

std::vector<int32_t> layers_from_json(const std::string& s, const std::string& where) {
  try {
    return nlohmann::json::parse(s).get<std::vector<int32_t>>();
  } catch (const std::exception&) {
    throw Error(where + ": expected a JSON list of layer indices, found '" + s + "'");
  }
}

namespace {

// Parses key as a finite number into *x; else returns why not.
std::string meta_number(const Meta& m, const std::string& key, float* x) {
  auto it = m.find(key);
  if (it == m.end()) return "__metadata__['" + key + "'] is missing (needed for RoPE)";
  const std::string& v = it->second;
  char* end = nullptr;
  *x = std::strtof(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(*x)) return "__metadata__['" + key + "'] is '" + v + "', expected a number";
  return "";
}

std::string floats_json(const std::vector<float>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + fmt_g9(v[i]);
  return s + "]";
}

}  // namespace

void require_rope_supported(const Rope& r, const std::string& who) {
  require(r.unsupported.empty(), who + ": the keys' RoPE cannot be undone: " + r.unsupported);
}

Rope rope_from_facts(const RopeFacts& f, uint32_t head_dim, const std::string& origin) {
  Rope r;
  auto unsupported = [&](const std::string& why) {
    Rope u;
    u.unsupported = origin + ": " + why;
    return u;
  };
  if (f.type == "none") return r;
  if (f.type == "norm")
    r.layout = RopeLayout::kNorm;
  else if (f.type == "neox")
    r.layout = RopeLayout::kNeox;
  else
    return unsupported(std::string(f.type_name) + " '" + f.type + "'; kvtc supports norm, neox and none");
  if (f.scaling != "none" && f.scaling != "linear" && f.scaling != "yarn")
    return unsupported(std::string(f.scaling_name) + " '" + f.scaling + "'; kvtc supports none, linear and yarn");
  if (!f.n_rot_error.empty()) return unsupported(f.n_rot_error);
  r.n_rot = f.n_rot >= 0 && f.n_rot <= 65536 ? uint32_t(f.n_rot) : 1;
  if (double(r.n_rot) != f.n_rot || r.n_rot % 2 != 0 || r.n_rot > head_dim)
    return unsupported("n_rot " + fmt_g9(f.n_rot) + " must be even and <= head_dim " + std::to_string(head_dim));
  if (!f.freq_error.empty()) return unsupported(f.freq_error);
  r.freq_base = f.freq_base;
  r.freq_scale = f.freq_scale;
  if (!(r.freq_base > 0 && r.freq_scale > 0)) return unsupported("RoPE frequency base and scale must be positive");
  if (!f.factors_error.empty()) return unsupported(f.factors_error);
  r.freq_factors = f.freq_factors;
  if (!r.freq_factors.empty() && r.freq_factors.size() != r.n_rot / 2)
    return unsupported(std::string(f.factors_name) + " has " + std::to_string(r.freq_factors.size()) +
                       " entries, expected n_rot/2 = " + std::to_string(r.n_rot / 2));
  if (f.scaling == "yarn") {
    if (!f.yarn_error.empty()) {  // the plain rotation, marked: a context's settings complete it
      r.unsupported = origin + ": " + f.yarn_error;
      r.yarn_unresolved = true;
      return r;
    }
    if (!(std::isfinite(f.ext_factor) && f.ext_factor >= 0 && std::isfinite(f.attn_factor) && f.attn_factor > 0 && std::isfinite(f.beta_fast) &&
          f.beta_fast > 0 && std::isfinite(f.beta_slow) && f.beta_slow > 0))
      return unsupported("YaRN's ext_factor must be >= 0 and attn_factor, beta_fast and beta_slow positive (got " + fmt_g9(f.ext_factor) + ", " +
                         fmt_g9(f.attn_factor) + ", " + fmt_g9(f.beta_fast) + ", " + fmt_g9(f.beta_slow) + ")");
    if (f.ext_factor != 0 && !(f.n_ctx_orig >= 1 && f.n_ctx_orig <= 16777216 && double(uint32_t(f.n_ctx_orig)) == f.n_ctx_orig))
      return unsupported("YaRN's n_ctx_orig " + fmt_g9(f.n_ctx_orig) + " must be a positive integer");
    r.ext_factor = f.ext_factor;
    r.attn_factor = f.attn_factor;
    r.beta_fast = f.beta_fast;
    r.beta_slow = f.beta_slow;
    r.n_ctx_orig = f.ext_factor != 0 ? uint32_t(f.n_ctx_orig) : 0;
  }
  return r;
}

Rope rope_from_meta(const Meta& meta, bool swa, uint32_t head_dim, const std::string& origin) {
  auto it = meta.find("rope_type");
  if (it == meta.end()) {
    Rope u;
    u.unsupported = origin + ": __metadata__['rope_type'] is missing (needed for RoPE)";
    return u;
  }
  RopeFacts f;
  f.type_name = "__metadata__['rope_type'] is";
  f.scaling_name = "__metadata__['rope_scaling_type'] is";
  f.factors_name = "rope_freq_factors";
  f.type = it->second;
  auto st = meta.find("rope_scaling_type");
  f.scaling = st == meta.end() ? "none" : st->second;
  float n_rot = 0;
  f.n_rot_error = meta_number(meta, "n_rot", &n_rot);
  f.n_rot = n_rot;
  f.freq_error = meta_number(meta, swa ? "rope_freq_base_swa" : "rope_freq_base", &f.freq_base);
  if (f.freq_error.empty()) f.freq_error = meta_number(meta, swa ? "rope_freq_scale_swa" : "rope_freq_scale", &f.freq_scale);
  if (f.scaling == "yarn") {
    float n_orig = 0;
    f.yarn_error = meta_number(meta, "yarn_ext_factor", &f.ext_factor);
    if (f.yarn_error.empty()) f.yarn_error = meta_number(meta, "yarn_attn_factor", &f.attn_factor);
    if (f.yarn_error.empty()) f.yarn_error = meta_number(meta, "yarn_beta_fast", &f.beta_fast);
    if (f.yarn_error.empty()) f.yarn_error = meta_number(meta, "yarn_beta_slow", &f.beta_slow);
    if (f.yarn_error.empty()) f.yarn_error = meta_number(meta, "n_ctx_orig_yarn", &n_orig);
    f.n_ctx_orig = n_orig;
  }
  if (auto ff = meta.find("rope_freq_factors"); !swa && ff != meta.end()) {
    try {
      f.freq_factors = nlohmann::json::parse(ff->second).get<std::vector<float>>();
    } catch (const std::exception&) {
      f.factors_error = "__metadata__['rope_freq_factors'] is not a JSON list of numbers";
    }
  }
  return rope_from_facts(f, head_dim, origin);
}

void geometry_from_meta(const Meta& meta, CacheGeometry& g, const std::string& origin) {
  if (auto it = meta.find("model_sha256"); it != meta.end()) g.model_sha256 = it->second;
  for (size_t b = 0; b < g.blocks.size(); ++b) {
    BlockGeometry& bg = g.blocks[b];
    bg.rope = rope_from_meta(meta, b == 1, bg.head_dim, origin);
    bg.sliding_window = 0;
    if (b == 1)
      if (auto it = meta.find("n_swa"); it != meta.end()) bg.sliding_window = uint32_t(std::strtoul(it->second.c_str(), nullptr, 10));
  }
}

CacheGeometry geometry_from_facts(const std::map<std::string, std::string>& facts, const std::string& origin) {
  auto whole = [&](const char* key, uint32_t lo) {
    auto it = facts.find(key);
    require(it != facts.end(), origin + ": the fact '" + key + "' is missing");
    char* end = nullptr;
    const unsigned long long v = std::strtoull(it->second.c_str(), &end, 10);
    require(!it->second.empty() && *end == '\0' && it->second[0] != '-' && v >= lo && v <= 1000000,
            origin + ": the fact '" + key + "' is '" + it->second + "', expected an integer >= " + std::to_string(lo));
    return uint32_t(v);
  };
  CacheGeometry g;
  auto sha = facts.find("model_sha256");
  require(sha != facts.end() && sha->second.size() == 64 && sha->second.find_first_not_of("0123456789abcdef") == std::string::npos,
          origin + ": the fact 'model_sha256' must be 64 lowercase hex digits");
  // The facts carry no layer pattern (which layers are sliding-window),
  // which llama.cpp derives per architecture: kvtc-server stores these
  // models (from the model itself, model_geometry), the facts do not yet.
  require(whole("n_swa", 0) == 0, origin +
                                      ": a sliding-window (iSWA) model: its cache blocks cannot be told from these facts yet "
                                      "(no layer pattern); kvtc-server stores such models");
  BlockGeometry b;
  const uint32_t n_layer = whole("n_layer", 1);
  for (uint32_t il = 0; il < n_layer; ++il) b.layers.push_back(int32_t(il));
  b.n_head_kv = whole("n_head_kv", 1);
  b.head_dim = whole("head_dim", 1);
  g.blocks.push_back(b);
  Meta m(facts.begin(), facts.end());
  if (auto ff = m.find("rope_freq_factors"); ff != m.end() && (ff->second.empty() || ff->second == "[]")) m.erase(ff);
  geometry_from_meta(m, g, origin);
  return g;
}

Meta meta_with_geometry(const Meta& provenance, const CacheGeometry& g) {
  Meta m = provenance;
  if (!g.model_sha256.empty()) m["model_sha256"] = g.model_sha256;
  if (g.blocks.empty()) return m;
  const Rope& r0 = g.blocks[0].rope;
  if (r0.unsupported.empty()) {
    m["rope_type"] = rope_layout_name(r0.layout);
    if (r0.layout != RopeLayout::kNone) {
      m["n_rot"] = std::to_string(r0.n_rot);
      m["rope_freq_base"] = fmt_g9(r0.freq_base);
      m["rope_freq_scale"] = fmt_g9(r0.freq_scale);
      m["rope_freq_factors"] = floats_json(r0.freq_factors);
      // YaRN or a magnitude factor: scaling "yarn" and its parameters, which
      // a reader older than them refuses (it knows none and linear) rather
      // than re-rotating otherwise. Plain RoPE keeps what the file said
      // (the GGUF's scaling; bytes as before), unless that was "yarn".
      if (r0.yarn()) {
        m["rope_scaling_type"] = "yarn";
        m["yarn_ext_factor"] = fmt_g9(r0.ext_factor);
        m["yarn_attn_factor"] = fmt_g9(r0.attn_factor);
        m["yarn_beta_fast"] = fmt_g9(r0.beta_fast);
        m["yarn_beta_slow"] = fmt_g9(r0.beta_slow);
        m["n_ctx_orig_yarn"] = std::to_string(r0.n_ctx_orig);
      } else {
        if (auto st = m.find("rope_scaling_type"); st != m.end() && st->second == "yarn") st->second = "linear";
        for (const char* k : {"yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow", "n_ctx_orig_yarn"}) m.erase(k);
      }
    }
  }
  if (g.blocks.size() > 1) {
    const BlockGeometry& b1 = g.blocks[1];
    const Rope& r1 = b1.rope;
    if (r1.unsupported.empty() && r1.layout != RopeLayout::kNone) {
      require(r0.unsupported.empty() && r1.layout == r0.layout && r1.n_rot == r0.n_rot && r1.freq_factors.empty() && r1.ext_factor == r0.ext_factor &&
                  r1.attn_factor == r0.attn_factor && r1.beta_fast == r0.beta_fast && r1.beta_slow == r0.beta_slow && r1.n_ctx_orig == r0.n_ctx_orig,
              "the sliding-window block's RoPE differs from the first block's in layout, n_rot, factors or YaRN; the file formats store those "
              "once");
      m["rope_freq_base_swa"] = fmt_g9(r1.freq_base);
      m["rope_freq_scale_swa"] = fmt_g9(r1.freq_scale);
    }
    m["n_swa"] = std::to_string(b1.sliding_window);
  }
  return m;
}

// ---------------------------------------------------------------- capture files

SafeTensors capture_to_safetensors(const KvCapture& c) {
  require(!c.blocks.empty() && c.blocks.size() <= 2, "capture: expected 1 or 2 cache blocks");
  SafeTensors st;
  st.metadata = meta_with_geometry(c.meta, c.geometry());
  st.metadata["format"] = kCaptureFormat;
  st.metadata["format_version"] = std::to_string(kCaptureFormatVersion);
  st.metadata["n_tokens"] = std::to_string(c.blocks[0].n_tokens());
  for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
    const KvBlock& b = c.blocks[bi];
    require(b.k.size() == b.numel() && b.v.size() == b.numel(), "capture: block " + std::to_string(bi) + " K/V size differs from its shape");
    const std::string sfx = kBlockSuffix[bi];
    st.add("k" + sfx, f16_tensor(b, b.k));
    st.add("v" + sfx, f16_tensor(b, b.v));
    st.add("pos" + sfx, i32_tensor(b.pos));
    st.metadata["layers" + sfx] = layers_to_json(b.layers);
  }
  if (!c.tokens.empty()) {
    require(c.tokens.size() == c.blocks[0].n_tokens(), "capture: tokens and positions differ in length");
    st.add("tokens", i32_tensor(c.tokens));
  }
  return st;
}

KvCapture capture_from_safetensors(const SafeTensors& st, const std::string& origin) {
  auto meta = [&](const std::string& key) -> const std::string& {
    auto it = st.metadata.find(key);
    require(it != st.metadata.end(), origin + ": __metadata__['" + key + "'] is missing (not a kvtc capture?)");
    return it->second;
  };
  require(meta("format") == kCaptureFormat, origin + ": __metadata__['format'] is '" + meta("format") + "', expected '" + kCaptureFormat + "'");
  require(meta("format_version") == std::to_string(kCaptureFormatVersion),
          origin + ": capture format_version " + meta("format_version") + ", this kvtc reads version " + std::to_string(kCaptureFormatVersion));
  KvCapture c;
  c.meta = st.metadata;
  for (size_t bi = 0; bi < 2; ++bi) {
    const std::string sfx = kBlockSuffix[bi];
    if (bi > 0 && !st.find("k" + sfx)) break;
    const Tensor& k = st.get("k" + sfx, origin);
    const Tensor& v = st.get("v" + sfx, origin);
    const Tensor& p = st.get("pos" + sfx, origin);
    const std::string w = origin + ": tensor 'k" + sfx + "'";
    require(k.dtype == DType::F16 && v.dtype == DType::F16, w + ": k and v must be F16");
    require(k.shape.size() == 4 && k.shape == v.shape, w + ": expected k and v of the same 4-D shape [n_layer, n_head_kv, n_tokens, head_dim]");
    require(p.dtype == DType::I32 && p.shape.size() == 1 && p.shape[0] == k.shape[2],
            origin + ": tensor 'pos" + sfx + "' must be I32 [" + std::to_string(k.shape[2]) + "]");
    require(k.shape[0] > 0 && k.shape[1] > 0 && k.shape[2] > 0 && k.shape[3] > 0, w + ": empty dimension");
    require(k.shape[1] <= 4096 && k.shape[3] <= 4096, w + ": n_head_kv and head_dim must be at most 4096");
    KvBlock b;
    b.layers = layers_from_json(meta("layers" + sfx), origin + ": __metadata__['layers" + sfx + "']");
    require(b.layers.size() == k.shape[0], origin + ": __metadata__['layers" + sfx + "'] lists " + std::to_string(b.layers.size()) +
                                               " layers, tensor 'k" + sfx + "' has " + std::to_string(k.shape[0]));
    b.n_head_kv = uint32_t(k.shape[1]);
    b.head_dim = uint32_t(k.shape[3]);
    b.pos.resize(p.shape[0]);
    std::memcpy(b.pos.data(), p.data.data(), p.data.size());
    b.k.resize(k.numel());
    b.v.resize(v.numel());
    std::memcpy(b.k.data(), k.data.data(), k.data.size());
    std::memcpy(b.v.data(), v.data.data(), v.data.size());
    c.blocks.push_back(std::move(b));
  }
  require(meta("n_tokens") == std::to_string(c.blocks[0].n_tokens()),
          origin + ": __metadata__['n_tokens'] is " + meta("n_tokens") + ", tensor 'k' holds " + std::to_string(c.blocks[0].n_tokens()));
  if (const Tensor* t = st.find("tokens")) {
    require(t->dtype == DType::I32 && t->shape.size() == 1 && t->shape[0] == c.blocks[0].n_tokens(),
            origin + ": tensor 'tokens' must be I32 [" + std::to_string(c.blocks[0].n_tokens()) + "]");
    c.tokens.resize(t->shape[0]);
    std::memcpy(c.tokens.data(), t->data.data(), t->data.size());
  }
  CacheGeometry g = c.geometry();
  geometry_from_meta(c.meta, g, origin);
  c.model_sha256 = g.model_sha256;
  for (size_t b = 0; b < c.blocks.size(); ++b) static_cast<BlockGeometry&>(c.blocks[b]) = g.blocks[b];
  return c;
}

void capture_save(const std::string& path, const KvCapture& c) {
  safetensors_save(path, capture_to_safetensors(c));
}

KvCapture capture_load(const std::string& path) {
  return capture_from_safetensors(safetensors_load(path), path);
}

std::vector<uint8_t> capture_serialize(const KvCapture& c) {
  return safetensors_serialize(capture_to_safetensors(c));
}

KvCapture capture_parse(std::span<const uint8_t> bytes, const std::string& origin) {
  return capture_from_safetensors(safetensors_parse(bytes, origin), origin);
}

// ---------------------------------------------------------------- state blobs

KvCapture capture_from_blob(const SeqBlob& blob, const CacheGeometry& g, const std::string& origin) {
  require(blob.blocks.size() == g.blocks.size(), origin + ": the blob holds " + std::to_string(blob.blocks.size()) +
                                                     " cache block(s), the model has " + std::to_string(g.blocks.size()) +
                                                     " (blob from another model or layout?)");
  KvCapture c;
  c.model_sha256 = g.model_sha256;
  for (size_t bi = 0; bi < blob.blocks.size(); ++bi) {
    const std::string bw = origin + ": block[" + std::to_string(bi) + "]";
    const BlobBlock& B = blob.blocks[bi];
    const BlockGeometry& bg = g.blocks[bi];
    require(bg.n_head_kv > 0 && bg.head_dim > 0 && !bg.layers.empty(), bw + ": the geometry given has no layers, heads or dims");
    const BlobStream* s = nullptr;
    for (const BlobStream& st : B.streams) {
      if (st.cell_count == 0) continue;
      require(s == nullptr, bw + ": cells in more than one stream (a multi-sequence blob?); expected one sequence");
      s = &st;
    }
    require(s != nullptr, bw + ": no cells (empty sequence)");
    require(s->ext.empty(), bw + ": M-RoPE cells are not supported by capture format v1");
    require(s->k.size() == bg.layers.size(), bw + ": n_layer " + std::to_string(s->k.size()) + ", the model's cache holds " +
                                                 std::to_string(bg.layers.size()) + " layers here (blob from another model?)");
    KvBlock kb;
    static_cast<BlockGeometry&>(kb) = bg;
    kb.pos = s->pos;
    for (uint32_t i = 0; i < s->cell_count; ++i)
      require(s->seq_ids[i].size() == 1,
              bw + ": cell " + std::to_string(i) + " belongs to " + std::to_string(s->seq_ids[i].size()) + " sequences; expected 1");
    const uint64_t row = uint64_t(bg.n_head_kv) * bg.head_dim * 2;
    kb.k.resize(kb.numel());
    kb.v.resize(kb.numel());
    const size_t slab = size_t(bg.n_head_kv) * s->cell_count * bg.head_dim;
    for (size_t l = 0; l < bg.layers.size(); ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        const BlobLayer& L = kv == 0 ? s->k[l] : s->v[l];
        const std::string lw = bw + (kv == 0 ? ".k[" : ".v[") + std::to_string(l) + "]";
        require(L.type == kGgmlTypeF16, lw + ".type: ggml type " + std::to_string(L.type) + ", expected 1 (F16): kvtc captures need an f16 cache");
        require(L.row_size == row, lw + ".row_size: " + std::to_string(L.row_size) + " bytes, expected " + std::to_string(row) + " (n_head_kv " +
                                       std::to_string(bg.n_head_kv) + " x head_dim " + std::to_string(bg.head_dim) + " x 2)");
        rows_to_heads(L, s->cell_count, bg.n_head_kv, bg.head_dim, (kv == 0 ? kb.k.data() : kb.v.data()) + l * slab);
      }
    }
    c.blocks.push_back(std::move(kb));
  }
  return c;
}

SeqBlob capture_to_blob(const KvCapture& c, const StateLayout& to) {
  require(to.streams.empty() || to.streams.size() == c.blocks.size(), "restore: the target context has " + std::to_string(to.streams.size()) +
                                                                          " cache block(s), the capture has " + std::to_string(c.blocks.size()) +
                                                                          " (capture from another model?)");
  require(to.v_trans <= 1, "restore: v_trans must be 0 or 1");
  require(to.seq_id >= 0, "restore: the destination sequence id must be >= 0");
  SeqBlob out;
  out.seq_id = to.seq_id;
  for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
    const KvBlock& kb = c.blocks[bi];
    require(kb.k.size() == kb.numel() && kb.v.size() == kb.numel(), "restore: block " + std::to_string(bi) + " K/V size differs from its shape");
    const size_t n_stream = to.streams.empty() ? 1 : to.streams[bi];
    require(n_stream >= 1, "restore: the target context has no stream in block " + std::to_string(bi));
    BlobBlock B;
    B.streams.resize(n_stream);
    // llama.cpp loads every stream's cells into the destination sequence's
    // own stream, so which index carries them does not matter; use the
    // sequence's index where it exists, as llama.cpp itself would.
    BlobStream& s = B.streams[size_t(to.seq_id) < n_stream ? size_t(to.seq_id) : 0];
    s.cell_count = kb.n_tokens();
    s.pos = kb.pos;
    s.seq_ids.assign(kb.n_tokens(), std::vector<int32_t>{to.seq_id});
    s.v_trans = to.v_trans;
    s.k.resize(kb.n_layer());
    s.v.resize(kb.n_layer());
    const size_t slab = size_t(kb.n_head_kv) * kb.n_tokens() * kb.head_dim;
    for (uint32_t l = 0; l < kb.n_layer(); ++l) {
      heads_to_rows(kb.k.data() + l * slab, kb.n_tokens(), kb.n_head_kv, kb.head_dim, s.k[l]);
      heads_to_rows(kb.v.data() + l * slab, kb.n_tokens(), kb.n_head_kv, kb.head_dim, s.v[l]);
    }
    out.blocks.push_back(std::move(B));
  }
  return out;
}

KvCapture capture_from_state(std::span<const uint8_t> blob, const CacheGeometry& g, const std::string& origin) {
  return capture_from_blob(seq_blob_parse(blob, false, origin), g, origin);
}

StateLayout state_layout(std::span<const uint8_t> empty_blob, uint32_t v_trans, int32_t seq_id, const std::string& origin) {
  const SeqBlob b = seq_blob_parse(empty_blob, false, origin);
  StateLayout l;
  for (const BlobBlock& B : b.blocks) l.streams.push_back(uint32_t(B.streams.size()));
  l.v_trans = v_trans;
  l.seq_id = seq_id;
  return l;
}

namespace {
StateLayout layout_of(const SeqBlob& b, const std::string& origin) {
  StateLayout l;
  l.seq_id = b.seq_id;
  bool found = false;
  for (const BlobBlock& B : b.blocks) {
    l.streams.push_back(uint32_t(B.streams.size()));
    for (const BlobStream& s : B.streams)
      if (s.cell_count > 0 && !found) {
        l.v_trans = s.v_trans;
        found = true;
      }
  }
  require(found, origin + ": the sequence holds no cell, so its V layout is unknown (state_layout_of needs a non-empty sequence)");
  return l;
}
}  // namespace

StateLayout state_layout_of(std::span<const uint8_t> blob, const std::string& origin) {
  return layout_of(seq_blob_parse(blob, false, origin), origin);
}

namespace {
// One cache block's share of a sequence state (docs/llama-state.md): its
// stream count, then in the sequence's stream the runs' cells and K/V, f16
// rows cell-major (V transposed when to.v_trans). `bi` names the block in
// errors. bytes() sizes it; write(w) writes it at w and returns the end.
struct BlockWriter {
  std::span<const BlockRun> runs;
  uint32_t n_stream = 1;
  uint64_t n = 0;  // cells

  BlockWriter(std::span<const BlockRun> r, const StateLayout& to, size_t bi) : runs(r) {
    require(!runs.empty() && runs[0].block, "restore: no pieces to assemble in block " + std::to_string(bi));
    const KvBlock& g = *runs[0].block;
    for (const BlockRun& x : runs) {
      require(x.block && x.block->geometry() == g.geometry(), "restore: the pieces of block " + std::to_string(bi) + " differ in geometry");
      require(x.block->k.size() == x.block->numel() && x.block->v.size() == x.block->numel() && uint64_t(x.t0) + x.n <= x.block->n_tokens(),
              "restore: block " + std::to_string(bi) + " K/V size differs from its shape");
      n += x.n;
    }
    n_stream = to.streams.empty() ? 1 : to.streams[bi];
    require(n_stream >= 1, "restore: the target context has no stream in block " + std::to_string(bi));
  }
  // Stream count 4, 4 per stream; for the one that holds the cells 12 per
  // cell, v_trans and n_layer 8, per layer K 12 + rows and V 12 (rows) or
  // 12 (transposed).
  uint64_t bytes() const {
    const KvBlock& g = *runs[0].block;
    const uint64_t row = uint64_t(g.n_head_kv) * g.head_dim * 2;
    return 4 + 4 * uint64_t(n_stream) + (n ? 12 * n + 8 + uint64_t(g.n_layer()) * (12 + 12 + 2 * n * row) : 0);
  }
  uint8_t* write(uint8_t* w, const StateLayout& to) const {
    const KvBlock& g = *runs[0].block;
    const uint32_t L = g.n_layer(), H = g.n_head_kv, D = g.head_dim;
    const uint64_t row = uint64_t(H) * D * 2;  // f16 bytes of one cell of one layer
    auto put = [&](auto v) {
      std::memcpy(w, &v, sizeof v);
      w += sizeof v;
    };
    put(n_stream);
    // llama.cpp loads every stream's cells into the destination sequence's
    // own stream, so which index carries them does not matter; use the
    // sequence's index where it exists, as llama.cpp itself would.
    const uint32_t mine = uint32_t(to.seq_id) < n_stream ? uint32_t(to.seq_id) : 0;
    for (uint32_t s = 0; s < n_stream; ++s) {
      if (s != mine || n == 0) {
        put(uint32_t(0));
        continue;
      }
      put(uint32_t(n));
      for (const BlockRun& r : runs)
        for (uint32_t t = 0; t < r.n; ++t) {
          put(int32_t(r.block->pos[r.t0 + t]));
          put(uint32_t(1));
          put(int32_t(to.seq_id));
        }
      put(uint32_t(to.v_trans));
      put(uint32_t(L));
      const size_t hd_bytes = size_t(D) * 2;
      auto rows = [&](bool keys, uint32_t l) {  // cell-major: each cell's heads in order
        for (const BlockRun& r : runs) {
          const KvBlock& b = *r.block;
          const uint16_t* x = (keys ? b.k : b.v).data() + size_t(l) * H * b.n_tokens() * D;
          for (uint32_t t = r.t0; t < r.t0 + r.n; ++t)
            for (uint32_t h = 0; h < H; ++h, w += hd_bytes) std::memcpy(w, x + (size_t(h) * b.n_tokens() + t) * D, hd_bytes);
        }
      };
      for (uint32_t l = 0; l < L; ++l) {
        put(int32_t(kGgmlTypeF16));
        put(uint64_t(row));
        rows(true, l);
      }
      for (uint32_t l = 0; l < L; ++l) {
        put(int32_t(kGgmlTypeF16));
        if (!to.v_trans) {
          put(uint64_t(row));
          rows(false, l);
          continue;
        }
        put(uint32_t(2));
        put(uint32_t(H * D));
        // Transposed: for each of the n_embd_v elements, every cell in turn.
        for (uint32_t h = 0; h < H; ++h)
          for (uint32_t d = 0; d < D; ++d)
            for (const BlockRun& r : runs) {
              const KvBlock& b = *r.block;
              const uint16_t* x = b.v.data() + (size_t(l) * H + h) * b.n_tokens() * D + d;
              for (uint32_t t = r.t0; t < r.t0 + r.n; ++t, w += 2) std::memcpy(w, x + size_t(t) * D, 2);
            }
      }
    }
    return w;
  }
};

// The state of one run list per cache block, written once into memory asked
// for huge pages: one copy of the K/V bytes (an 8K-token SmolLM2 cache,
// 189 MB: 128-886 ms through rows then blob, 53-61 ms so;
// bench/results/restore-load-vnni.md).
std::vector<uint8_t> state_from_blocks(std::span<const std::span<const BlockRun>> blocks, const StateLayout& to, const char* what) {
  require(to.streams.empty() || to.streams.size() == blocks.size(), "restore: the target context has " + std::to_string(to.streams.size()) +
                                                                        " cache block(s), the " + what + " " + std::to_string(blocks.size()) +
                                                                        " (capture from another model?)");
  require(to.v_trans <= 1, "restore: v_trans must be 0 or 1");
  require(to.seq_id >= 0, "restore: the destination sequence id must be >= 0");
  std::vector<BlockWriter> writers;
  uint64_t bytes = 8;  // magic, seq_id
  for (size_t bi = 0; bi < blocks.size(); ++bi) {
    writers.emplace_back(blocks[bi], to, bi);
    bytes += writers.back().bytes();
  }
  std::vector<uint8_t> out;
  reserve_huge_pages(out, bytes);
  out.resize(bytes);
  uint8_t* w = out.data();
  std::memcpy(w, &kSeqBlobMagic, 4);
  std::memcpy(w + 4, &to.seq_id, 4);
  w += 8;
  for (const BlockWriter& bw : writers) w = bw.write(w, to);
  require(w == out.data() + out.size(), "restore: internal error: state size mismatch");
  return out;
}
}  // namespace

std::vector<uint8_t> state_from_capture(const KvCapture& c, const StateLayout& to) {
  require(!c.blocks.empty(), "restore: the capture holds no cache block");
  std::vector<BlockRun> all;
  for (const KvBlock& b : c.blocks) all.push_back({&b, 0, b.n_tokens()});
  std::vector<std::span<const BlockRun>> blocks;
  for (const BlockRun& r : all) blocks.emplace_back(&r, 1);
  return state_from_blocks(blocks, to, "capture");
}

std::vector<uint8_t> state_from_runs(std::span<const BlockRun> runs, const StateLayout& to) {
  return state_from_blocks(std::span(&runs, 1), to, "pieces");
}

namespace {
constexpr uint32_t kMaxArchBytes = 64;  // llama.cpp's names are <= 16 ("deepseek2", "command-r", ...)
bool arch_char(uint8_t ch) {
  return std::isalnum(ch) || ch == '.' || ch == '_' || ch == '-';
}
// Little-endian, as llama.cpp writes its state on the hosts it runs on (x86-64, arm64).
uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void store_u32(uint8_t* p, uint32_t v) {
  std::memcpy(p, &v, 4);
}
}  // namespace

bool is_context_state(std::span<const uint8_t> blob) {
  if (blob.size() < 4) return false;
  const uint32_t n = load_u32(blob.data());
  if (n == kSeqBlobMagic || n == 0 || n > kMaxArchBytes || blob.size() < 4 + size_t(n)) return false;
  return std::all_of(blob.begin() + 4, blob.begin() + 4 + n, arch_char);
}

ContextState context_state_split(std::span<const uint8_t> blob, const std::string& origin) {
  require(blob.size() >= 4, origin + ": " + std::to_string(blob.size()) + " bytes, too short for a llama.cpp state");
  require(is_context_state(blob), origin + ": not a llama.cpp context state (expected a u32 length of 1.." + std::to_string(kMaxArchBytes) +
                                      " and an architecture name at offset 0" +
                                      (blob.size() >= 4 && load_u32(blob.data()) == kSeqBlobMagic ? "; this is a sequence state" : "") + ")");
  const uint32_t n = load_u32(blob.data());
  ContextState cs;
  cs.arch.assign(reinterpret_cast<const char*>(blob.data()) + 4, n);
  cs.seq_blob.resize(8 + blob.size() - 4 - n);
  store_u32(cs.seq_blob.data(), kSeqBlobMagic);
  store_u32(cs.seq_blob.data() + 4, 0);
  std::memcpy(cs.seq_blob.data() + 8, blob.data() + 4 + n, blob.size() - 4 - n);
  return cs;
}

std::vector<uint8_t> context_state_join(const std::string& arch, std::span<const uint8_t> seq_blob, const std::string& origin) {
  require(!arch.empty() && arch.size() <= kMaxArchBytes && std::all_of(arch.begin(), arch.end(), [](char ch) { return arch_char(uint8_t(ch)); }),
          origin + ": architecture name '" + arch + "' is not 1.." + std::to_string(kMaxArchBytes) + " characters of [A-Za-z0-9._-]");
  require(seq_blob.size() >= 8 && load_u32(seq_blob.data()) == kSeqBlobMagic,
          origin + ": not a llama.cpp sequence state (magic 0xaf143cd8 expected at offset 0)");
  std::vector<uint8_t> out(4 + arch.size() + seq_blob.size() - 8);
  store_u32(out.data(), uint32_t(arch.size()));
  std::memcpy(out.data() + 4, arch.data(), arch.size());
  std::memcpy(out.data() + 4 + arch.size(), seq_blob.data() + 8, seq_blob.size() - 8);
  return out;
}

}  // namespace kvtc

namespace kvtc {

KvCapture capture_from_any_state(std::span<const uint8_t> blob, const CacheGeometry& g, const std::string& origin) {
  const bool context = is_context_state(blob);
  ContextState cs;
  if (context) cs = context_state_split(blob, origin);
  const SeqBlob b = seq_blob_parse(context ? std::span<const uint8_t>(cs.seq_blob) : blob, false, origin);
  KvCapture c = capture_from_blob(b, g, origin);
  const StateLayout l = layout_of(b, origin);
  c.meta["llama_state"] = context ? "context" : "sequence";
  if (context) c.meta["llama_state_arch"] = cs.arch;
  c.meta["llama_state_v_trans"] = std::to_string(l.v_trans);
  std::string streams;
  for (uint32_t n : l.streams) streams += (streams.empty() ? "" : ",") + std::to_string(n);
  c.meta["llama_state_streams"] = streams;
  c.meta["llama_state_seq_id"] = std::to_string(l.seq_id);
  return c;
}

std::vector<uint8_t> state_as_recorded(const KvCapture& c, const StateLayout* to, const std::string& origin) {
  auto get = [&](const char* key) -> const std::string* {
    auto it = c.meta.find(key);
    return it == c.meta.end() ? nullptr : &it->second;
  };
  const std::string* kind = get("llama_state");
  if (kind != nullptr && *kind != "context" && *kind != "sequence")
    throw Error(origin + ": capture_meta['llama_state'] is '" + *kind + "', expected 'context' or 'sequence'");
  StateLayout l;
  if (to != nullptr) {
    l = *to;
  } else {
    require(kind != nullptr, origin + ": no llama.cpp state layout recorded (not made by compress_state); give the target layout");
    auto number = [&](const char* key, uint32_t max) {
      const std::string* v = get(key);
      require(v != nullptr && !v->empty() && v->size() <= 10 && std::all_of(v->begin(), v->end(), ::isdigit) && std::stoull(*v) <= max,
              origin + ": capture_meta['" + key + "'] is " + (v ? "'" + *v + "'" : "missing") + ", expected an integer 0.." + std::to_string(max));
      return uint32_t(std::stoull(*v));
    };
    l.v_trans = number("llama_state_v_trans", 1);
    l.seq_id = int32_t(number("llama_state_seq_id", 1u << 30));
    const std::string* s = get("llama_state_streams");
    require(s != nullptr, origin + ": capture_meta['llama_state_streams'] is missing");
    size_t at = 0;
    while (at <= s->size()) {
      const size_t comma = std::min(s->find(',', at), s->size());
      const std::string n = s->substr(at, comma - at);
      require(!n.empty() && n.size() <= 4 && std::all_of(n.begin(), n.end(), ::isdigit) && std::stoul(n) >= 1,
              origin + ": capture_meta['llama_state_streams'] is '" + *s + "', expected stream counts 1..9999 separated by commas");
      l.streams.push_back(uint32_t(std::stoul(n)));
      at = comma + 1;
    }
  }
  std::vector<uint8_t> seq = state_from_capture(c, l);
  if (kind == nullptr || *kind == "sequence") return seq;
  const std::string* arch = get("llama_state_arch");
  require(arch != nullptr, origin + ": capture_meta['llama_state_arch'] is missing for a context state");
  return context_state_join(*arch, seq, origin);
}

}  // namespace kvtc
