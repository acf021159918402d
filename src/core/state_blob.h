// kvtc: llama.cpp sequence-state blobs (llama_state_seq_get_data, flags 0),
// parsed into plain structures and written back byte for byte.
//
// Layout at llama.cpp 4df29be4f (docs/llama-state.md has the field table):
//   u32 magic 0xaf143cd8, i32 seq_id,
//   then one *block* per KV cache the model has (one; two for iSWA models
//   such as Gemma 3: the global-attention layers, then the sliding-window
//   ones), each:
//     u32 n_stream, then per stream: u32 cell_count and, if non-zero,
//       cells: {i32 pos, u32 n_seq_id, [i32 x, i32 y if M-RoPE], n_seq_id x i32}
//       u32 v_trans, u32 n_layer,
//       K per layer: i32 ggml_type, u64 row_size, cell_count x row_size bytes
//       V per layer: v_trans == 0: as K;
//                    v_trans == 1: i32 type, u32 elem_size, u32 n_embd_v,
//                                  n_embd_v x cell_count elements (transposed)
// This parser needs no llama.cpp headers: it is pure bytes, and fuzzable.
// Thread safety: all functions are reentrant.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvtc {

// ggml type ids the parser understands for K/V rows.
enum : int32_t { kGgmlTypeF32 = 0, kGgmlTypeF16 = 1, kGgmlTypeBF16 = 30 };

struct BlobLayer {
  int32_t type = 0;           // ggml_type
  uint64_t row_size = 0;      // bytes per cell (n_head_kv * head_dim * elem size)
  std::vector<uint8_t> rows;  // cell_count rows, cell-major (V un-transposed)
};

struct BlobStream {
  uint32_t cell_count = 0;
  std::vector<int32_t> pos;                      // [cell_count], cache-slot order
  std::vector<std::vector<int32_t>> seq_ids;     // [cell_count][n_seq_id]
  std::vector<std::pair<int32_t, int32_t>> ext;  // M-RoPE {x, y}; empty otherwise
  uint32_t v_trans = 0;
  std::vector<BlobLayer> k, v;  // [n_layer] each
};

struct BlobBlock {
  std::vector<BlobStream> streams;  // n_stream entries; empty streams have cell_count 0
};

struct SeqBlob {
  int32_t seq_id = 0;
  std::vector<BlobBlock> blocks;
};

constexpr uint32_t kSeqBlobMagic = 0xaf143cd8u;

// Parses a whole blob. `mrope` must be true for models whose cells carry an
// extra {x, y} position (M-RoPE); the blob itself does not say. Throws Error
// naming `origin`, the field and its byte offset on any inconsistency
// (truncation, impossible counts, V-layer sizes that do not match K,
// unknown type with a transposed V, trailing bytes).
SeqBlob seq_blob_parse(std::span<const uint8_t> bytes, bool mrope, const std::string& origin);

// Inverse of seq_blob_parse: seq_blob_write(seq_blob_parse(b)) == b.
std::vector<uint8_t> seq_blob_write(const SeqBlob& blob);

// Bytes of one ggml element for the types above; 0 for others.
uint32_t ggml_elem_size(int32_t type);

}  // namespace kvtc
