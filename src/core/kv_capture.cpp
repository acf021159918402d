#include "kvtc/kv_capture.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "kvtc/error.h"

namespace kvtc {

namespace {

const char* kBlockSuffix[] = {"", "_swa"};

std::string layers_json(const std::vector<int32_t>& l) {
  return nlohmann::json(l).dump();
}

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

std::vector<int32_t> parse_layers(const std::string& s, const std::string& where) {
  try {
    auto j = nlohmann::json::parse(s);
    std::vector<int32_t> v = j.get<std::vector<int32_t>>();
    return v;
  } catch (const std::exception&) {
    throw Error(where + ": expected a JSON list of layer indices, found '" + s + "'");
  }
}

}  // namespace

uint64_t KvCapture::f16_bytes_per_token() const {
  uint64_t b = 0;
  for (const KvBlock& blk : blocks) b += uint64_t(blk.n_layer()) * blk.n_head_kv * blk.head_dim * 2 * 2;
  return b;
}

KvCapture capture_from_blob(const SeqBlob& blob, const CacheGeometry& g, const std::string& origin) {
  require(blob.blocks.size() == g.block_layers.size(), origin + ": the blob holds " + std::to_string(blob.blocks.size()) +
                                                           " cache block(s), the model has " + std::to_string(g.block_layers.size()) +
                                                           " (blob from another model or layout?)");
  require(g.head_dim_k == g.head_dim_v, origin + ": K head_dim " + std::to_string(g.head_dim_k) + " differs from V head_dim " +
                                            std::to_string(g.head_dim_v) + "; not supported by capture format v1");
  KvCapture c;
  for (size_t bi = 0; bi < blob.blocks.size(); ++bi) {
    const std::string bw = origin + ": block[" + std::to_string(bi) + "]";
    const BlobBlock& B = blob.blocks[bi];
    const BlobStream* s = nullptr;
    for (const BlobStream& st : B.streams) {
      if (st.cell_count == 0) continue;
      require(s == nullptr, bw + ": cells in more than one stream (a multi-sequence blob?); expected one sequence");
      s = &st;
    }
    require(s != nullptr, bw + ": no cells (empty sequence)");
    require(s->ext.empty(), bw + ": M-RoPE cells are not supported by capture format v1");
    const auto& layers = g.block_layers[bi];
    require(s->k.size() == layers.size(), bw + ": n_layer " + std::to_string(s->k.size()) + ", the model's cache holds " +
                                              std::to_string(layers.size()) + " layers here (blob from another model?)");
    KvBlock kb;
    kb.layers = layers;
    kb.n_head_kv = g.n_head_kv;
    kb.head_dim = g.head_dim_k;
    kb.pos = s->pos;
    for (uint32_t i = 0; i < s->cell_count; ++i)
      require(s->seq_ids[i].size() == 1,
              bw + ": cell " + std::to_string(i) + " belongs to " + std::to_string(s->seq_ids[i].size()) + " sequences; expected 1");
    const uint64_t row = uint64_t(g.n_head_kv) * g.head_dim_k * 2;
    kb.k.resize(kb.numel());
    kb.v.resize(kb.numel());
    const size_t slab = size_t(g.n_head_kv) * s->cell_count * g.head_dim_k;
    for (size_t l = 0; l < layers.size(); ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        const BlobLayer& L = kv == 0 ? s->k[l] : s->v[l];
        const std::string lw = bw + (kv == 0 ? ".k[" : ".v[") + std::to_string(l) + "]";
        require(L.type == kGgmlTypeF16, lw + ".type: ggml type " + std::to_string(L.type) + ", expected 1 (F16): kvtc captures need an f16 cache");
        require(L.row_size == row, lw + ".row_size: " + std::to_string(L.row_size) + " bytes, expected " + std::to_string(row) + " (n_head_kv " +
                                       std::to_string(g.n_head_kv) + " x head_dim " + std::to_string(g.head_dim_k) + " x 2)");
        rows_to_heads(L, s->cell_count, g.n_head_kv, g.head_dim_k, (kv == 0 ? kb.k.data() : kb.v.data()) + l * slab);
      }
    }
    c.blocks.push_back(std::move(kb));
  }
  return c;
}

SeqBlob capture_to_blob(const KvCapture& c, const SeqBlob& target_empty, uint32_t v_trans, int32_t dest_seq) {
  require(target_empty.blocks.size() == c.blocks.size(), "restore: the target context has " + std::to_string(target_empty.blocks.size()) +
                                                             " cache block(s), the capture has " + std::to_string(c.blocks.size()) +
                                                             " (capture from another model?)");
  SeqBlob out;
  out.seq_id = dest_seq;
  for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
    const KvBlock& kb = c.blocks[bi];
    const size_t n_stream = target_empty.blocks[bi].streams.size();
    BlobBlock B;
    B.streams.resize(n_stream);
    // llama.cpp loads every stream's cells into the destination sequence's
    // own stream, so which index carries them does not matter; use the
    // sequence's index where it exists, as llama.cpp itself would.
    BlobStream& s = B.streams[size_t(dest_seq) < n_stream ? size_t(dest_seq) : 0];
    s.cell_count = kb.n_tokens();
    s.pos = kb.pos;
    s.seq_ids.assign(kb.n_tokens(), std::vector<int32_t>{dest_seq});
    s.v_trans = v_trans;
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

SafeTensors capture_to_safetensors(const KvCapture& c) {
  require(!c.blocks.empty() && c.blocks.size() <= 2, "capture: expected 1 or 2 cache blocks");
  SafeTensors st;
  st.metadata = c.meta;
  st.metadata["format"] = kCaptureFormat;
  st.metadata["format_version"] = std::to_string(kCaptureFormatVersion);
  st.metadata["n_tokens"] = std::to_string(c.blocks[0].n_tokens());
  for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
    const KvBlock& b = c.blocks[bi];
    const std::string sfx = kBlockSuffix[bi];
    st.add("k" + sfx, f16_tensor(b, b.k));
    st.add("v" + sfx, f16_tensor(b, b.v));
    st.add("pos" + sfx, i32_tensor(b.pos));
    st.metadata["layers" + sfx] = layers_json(b.layers);
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
    KvBlock b;
    b.layers = parse_layers(meta("layers" + sfx), origin + ": __metadata__['layers" + sfx + "']");
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
  return c;
}

void capture_save(const std::string& path, const KvCapture& c) {
  safetensors_save(path, capture_to_safetensors(c));
}

KvCapture capture_load(const std::string& path) {
  return capture_from_safetensors(safetensors_load(path), path);
}

}  // namespace kvtc
