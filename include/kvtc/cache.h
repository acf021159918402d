// kvtc: a KV cache held in memory — its typed geometry (model fingerprint,
// and per cache block: layers, KV heads, head_dim, RoPE, sliding window)
// and its tokens — and the two ways it crosses a process boundary without
// the codec: the capture file (safetensors, docs/capture-format.md) and
// llama.cpp's sequence-state blob (docs/llama-state.md).
//
// Metadata strings exist only at file I/O: the loaders parse them into the
// typed fields, the writers write the typed fields back over them. `meta`
// carries the rest (where the cache came from) untouched.
// Thread safety: plain values; the functions are reentrant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace kvtc {

// How keys carry their position (docs/method.md §2). kNorm rotates the pairs
// (2i, 2i+1) of each head's first n_rot dimensions, kNeox the pairs
// (i, i + n_rot/2), by pos * freq_scale * base^(-2i/n_rot) / freq_factors[i]
// radians, as llama.cpp's CPU backend computes it.
enum class RopeLayout : uint8_t { kNone, kNorm, kNeox };
const char* rope_layout_name(RopeLayout l);  // "none", "norm", "neox"

struct Rope {
  RopeLayout layout = RopeLayout::kNone;
  uint32_t n_rot = 0;               // rotated dimensions at the start of each head (even, <= head_dim)
  float freq_base = 10000.0f;       // theta base
  float freq_scale = 1.0f;          // linear position scaling (1 / factor), folded in as llama.cpp does
  std::vector<float> freq_factors;  // [n_rot / 2] per-pair divisors (Llama 3's rope_freqs), or empty
  // YaRN (llama.cpp's --rope-scaling yarn and --yarn-*, as the context
  // resolved them: context_kv_settings). ext_factor 0 is plain RoPE. Else
  // the angle of pair i mixes the interpolated angle (x freq_scale) and the
  // extrapolated one by a ramp over the pairs between the correction dims
  // of beta_fast and beta_slow at n_ctx_orig, and the magnitude is scaled
  // by attn_factor x (1 + 0.1 ln(1 / freq_scale)); with ext_factor 0 by
  // attn_factor alone (1: none). Container and capture metadata say
  // rope_scaling_type "yarn" when either differs from plain (docs/capture-format.md).
  float ext_factor = 0.0f, attn_factor = 1.0f;
  float beta_fast = 32.0f, beta_slow = 1.0f;
  uint32_t n_ctx_orig = 0;
  bool yarn() const { return ext_factor != 0.0f || attn_factor != 1.0f; }
  // Non-empty when the keys carry a rotation kvtc cannot undo exactly
  // (M-RoPE, missing parameters): the reason. Such a cache can be
  // captured and restored, but not coded with a calibration that removes
  // RoPE; the encoder refuses it with this text.
  std::string unsupported;
  // With `unsupported`: the source asks for YaRN without its parameters (a
  // GGUF's rope scaling "yarn": llama.cpp resolves them from the GGUF and
  // the flags when it creates a context). The other fields hold the plain
  // rotation; geometry_with_settings (kvtc/store.h) completes it from a
  // context's settings and clears both.
  bool yarn_unresolved = false;
  bool operator==(const Rope&) const = default;
};

// One KV cache block: the whole cache, or, for an iSWA model (Gemma 3),
// the global-attention layers (block 0) or the sliding-window layers
// (block 1, sliding_window > 0).
struct BlockGeometry {
  std::vector<int32_t> layers;  // model layer index of each layer held, in cache order
  uint32_t n_head_kv = 0;       // KV heads per layer
  uint32_t head_dim = 0;        // dimensions per head (keys and values alike)
  uint32_t sliding_window = 0;  // 0: full attention; else the window in tokens
  Rope rope;                    // the rotation the stored keys carry
  uint32_t n_layer() const { return uint32_t(layers.size()); }
  // p: the length of one token's feature vector (docs/method.md §1), all layers
  // and heads concatenated: n_layer x n_head_kv x head_dim.
  uint32_t features() const { return n_layer() * n_head_kv * head_dim; }
  bool operator==(const BlockGeometry&) const = default;
};

struct CacheGeometry {
  std::string model_sha256;  // SHA-256 of the model file: caches and calibrations of different models never mix
  std::vector<BlockGeometry> blocks;
};

// A block's geometry plus its tokens.
struct KvBlock : BlockGeometry {
  std::vector<int32_t> pos;  // [n_tokens] position of each token, cache-slot order
  std::vector<uint16_t> k;   // f16 bits, [n_layer][n_head_kv][n_tokens][head_dim], keys as stored (RoPE applied)
  std::vector<uint16_t> v;   // same shape as k

  uint32_t n_tokens() const { return uint32_t(pos.size()); }
  size_t numel() const { return size_t(n_layer()) * n_head_kv * n_tokens() * head_dim; }
  size_t index(uint32_t l, uint32_t h, uint32_t t, uint32_t d) const { return ((size_t(l) * n_head_kv + h) * n_tokens() + t) * head_dim + d; }
  const BlockGeometry& geometry() const { return *this; }
};

struct KvCapture {
  std::string model_sha256;
  std::vector<KvBlock> blocks;              // [0]: the cache (iSWA: global layers); [1]: sliding-window layers
  std::vector<int32_t> tokens;              // token id of each token of blocks[0], or empty
  std::map<std::string, std::string> meta;  // provenance strings (docs/capture-format.md), not read by the codec

  CacheGeometry geometry() const;
  // Bytes of K and V at f16 per token of blocks[0], all blocks' layers:
  // sum of n_layer x n_head_kv x head_dim x 2 (K and V) x 2 bytes.
  uint64_t f16_bytes_per_token() const;
  // Raw f16 bytes of K and V held, all blocks.
  uint64_t f16_bytes() const;
};

// f16 bits <-> f32 over arrays (KvBlock::k and v hold f16 bits): exact
// widening; narrowing rounds to nearest even, overflow to inf. F16C
// instructions where the CPU has them, chosen at run time; the results are
// the same either way.
void f16_to_f32_n(const uint16_t* in, float* out, size_t n);
void f32_to_f16_n(const float* in, uint16_t* out, size_t n);

// ---- capture files (docs/capture-format.md) -----------------------------
// Written atomically (temporary file, then rename); the loader checks
// names, dtypes, shapes and metadata and names the file and field in errors.
void capture_save(const std::string& path, const KvCapture& c);
KvCapture capture_load(const std::string& path);
std::vector<uint8_t> capture_serialize(const KvCapture& c);
KvCapture capture_parse(std::span<const uint8_t> bytes, const std::string& origin);

// ---- llama.cpp sequence-state blobs (llama_state_seq_get_data, flags 0) ----
// The blob itself says neither which model layers each block holds nor
// how keys are rotated: `g` supplies them (Model::geometry() in
// <kvtc/llama.h>, or a server's own model). The blob must hold one
// sequence of an f16 cache; Error names the block, stream and field
// otherwise.
KvCapture capture_from_state(std::span<const uint8_t> blob, const CacheGeometry& g, const std::string& origin);

// A model's cache geometry from the facts another llama.cpp binding reads
// of it (the Python KvtcCache("auto") through llama-cpp-python; kvtc's own
// llama integration reads the same facts in model_geometry(), <kvtc/llama.h>),
// as strings: model_sha256 (64 hex), n_layer, n_head_kv, head_dim (keys
// and values alike), n_swa (0: no sliding-window layers), and the RoPE keys
// of a capture file's metadata (docs/capture-format.md): rope_type (norm,
// neox, none, or what llama.cpp calls another), n_rot, rope_freq_base,
// rope_freq_scale, rope_scaling_type, rope_freq_factors (a JSON list; "[]"
// or absent: none). One block; a sliding-window model is refused (its
// layer pattern is not among the facts). Error names `origin` and the fact;
// a rotation kvtc cannot undo comes back in Rope::unsupported, as from a file.
CacheGeometry geometry_from_facts(const std::map<std::string, std::string>& facts, const std::string& origin);

// What the destination context expects of a blob: streams per block (1
// with llama.cpp's unified cache), the V layout (v_trans = 1 without flash
// attention) and the sequence id the cells are tagged with.
struct StateLayout {
  std::vector<uint32_t> streams;  // per block; empty: 1 stream per block
  uint32_t v_trans = 0;
  int32_t seq_id = 0;
};
// The stream counts of a context, read from the blob of one of its empty
// sequences (llama_state_seq_get_data on a cleared sequence).
StateLayout state_layout(std::span<const uint8_t> empty_blob, uint32_t v_trans, int32_t seq_id, const std::string& origin);
// The layout of the context a blob with at least one cell came from
// (streams per block, V layout, sequence id). Error when no stream holds a
// cell: an empty sequence does not say how its V is laid out.
StateLayout state_layout_of(std::span<const uint8_t> blob, const std::string& origin);
// A blob that llama_state_seq_set_data accepts in a context of layout `to`,
// written from the capture's K/V in one copy (an 8K-token SmolLM2 cache:
// 189 MB, built and loaded into llama.cpp in 53-61 ms on a 2-core Zen 4;
// bench/results/restore-load-vnni.md). Reentrant.
std::vector<uint8_t> state_from_capture(const KvCapture& c, const StateLayout& to);

// ---- llama.cpp context-state blobs (llama_state_get_data) -----------------
// The whole context's state, as llama_state_get_data returns it at
// 4df29be4f and llama-cpp-python keeps it (LlamaState.llama_state): u32 n,
// the model's architecture name (n bytes), then the cache exactly as a
// sequence blob holds it after its seq_id, with every sequence's cells
// (each cell lists the ids of its sequences). No logits: llama.cpp leaves
// them out. These two convert between the forms, byte for byte, so every
// sequence-blob function reads a context's state too (docs/llama-state.md).
struct ContextState {
  std::string arch;               // "llama", "qwen2", ... (what llama.cpp checks on load)
  std::vector<uint8_t> seq_blob;  // the cache as a sequence blob (header seq_id 0)
};
// Whether `blob` starts as a context blob: a u32 length of 1..64 and that
// many bytes of [A-Za-z0-9._-], where a sequence blob starts with its magic.
bool is_context_state(std::span<const uint8_t> blob);
// Error naming `origin` when the blob does not start as a context blob;
// the cache part is checked by whatever parses the sequence blob.
ContextState context_state_split(std::span<const uint8_t> blob, const std::string& origin);
// The context blob of `arch` holding the cache of `seq_blob` (its header,
// magic and seq_id, is dropped; its cells keep their sequence ids).
std::vector<uint8_t> context_state_join(const std::string& arch, std::span<const uint8_t> seq_blob, const std::string& origin);

}  // namespace kvtc
