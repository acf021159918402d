// kvtc: a captured KV cache in canonical form, and its safetensors file.
//
// The capture file (docs/capture-format.md) is safetensors, so that Python
// users can read it with the tools they already have:
//   k, v     F16 [n_layer, n_head_kv, n_tokens, head_dim]  keys exactly as
//            llama.cpp stores them (RoPE applied), values as stored
//   pos      I32 [n_tokens]   position of each token (cache-slot order)
//   tokens   I32 [n_tokens]   token id of each cached position
//   k_swa, v_swa, pos_swa     the same for the sliding-window layers of an
//            iSWA model (Gemma 3); these hold only the window the model
//            keeps, so their n_tokens is smaller
//   __metadata__              strings (see kCaptureMetaKeys in the spec)
// Thread safety: plain values; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvtc/safetensors.h"
#include "kvtc/state_blob.h"

namespace kvtc {

constexpr const char* kCaptureFormat = "kvtc-capture";
constexpr int kCaptureFormatVersion = 1;

// One KV cache block (the whole cache; or, for iSWA models, the global or
// the sliding-window layers).
struct KvBlock {
  std::vector<int32_t> layers;  // model layer index of each layer held
  uint32_t n_head_kv = 0;
  uint32_t head_dim = 0;
  std::vector<int32_t> pos;  // [n_tokens], cache-slot order
  std::vector<uint16_t> k;   // f16 bits, [n_layer][n_head_kv][n_tokens][head_dim]
  std::vector<uint16_t> v;   // same shape as k

  uint32_t n_layer() const { return uint32_t(layers.size()); }
  uint32_t n_tokens() const { return uint32_t(pos.size()); }
  size_t numel() const { return size_t(n_layer()) * n_head_kv * n_tokens() * head_dim; }
  size_t index(uint32_t l, uint32_t h, uint32_t t, uint32_t d) const { return ((size_t(l) * n_head_kv + h) * n_tokens() + t) * head_dim + d; }
};

struct KvCapture {
  std::map<std::string, std::string> meta;
  std::vector<KvBlock> blocks;  // [0]: base cache; [1]: sliding-window cache (iSWA)
  std::vector<int32_t> tokens;  // token id of each cell of blocks[0]

  // Bytes of K and V at f16 per token of blocks[0], summed over all blocks'
  // layers: n_layer x n_head_kv x head_dim x 2 (K and V) x 2 bytes.
  uint64_t f16_bytes_per_token() const;
};

// What the model says about its cache: which model layers each blob block
// holds, and the per-layer K/V geometry. Supplied by the llama integration.
struct CacheGeometry {
  std::vector<std::vector<int32_t>> block_layers;  // per blob block
  uint32_t n_head_kv = 0;
  uint32_t head_dim_k = 0;
  uint32_t head_dim_v = 0;
};

// Blob -> canonical. The blob must come from one sequence (one non-empty
// stream per block, one seq id per cell) of an F16 cache whose geometry
// matches; otherwise Error names the block, stream and field.
KvCapture capture_from_blob(const SeqBlob& blob, const CacheGeometry& g, const std::string& origin);

// Canonical -> blob for a target context. `target_empty` is the parsed blob
// of the (empty) destination sequence in that context: it fixes the number
// of blocks and streams the context expects. `v_trans` must be the target
// context's V layout (1 when flash attention is off). Cells are written in
// the capture's order, tagged with `dest_seq`.
SeqBlob capture_to_blob(const KvCapture& c, const SeqBlob& target_empty, uint32_t v_trans, int32_t dest_seq);

SafeTensors capture_to_safetensors(const KvCapture& c);
// Validates names, dtypes, shapes and metadata; `origin` names the file.
KvCapture capture_from_safetensors(const SafeTensors& st, const std::string& origin);

void capture_save(const std::string& path, const KvCapture& c);  // atomic
KvCapture capture_load(const std::string& path);

}  // namespace kvtc
