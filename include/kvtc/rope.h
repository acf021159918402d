// kvtc: rotary position embedding of stored keys, applied and undone
// exactly as llama.cpp's CPU backend computes it (ggml_rope_ext).
//
// Keys in a llama.cpp cache carry RoPE; the codec removes it before the PCA
// (the position rotation hides the low-rank structure) and puts it back
// after reconstruction. Supported: NORM (pairs 2i, 2i+1) and NEOX (pairs
// i, i + n_rot/2) layouts, frequency base and linear scale, per-dimension
// frequency factors (Llama 3's rope_freqs). YaRN is refused (its
// extrapolation mix is not yet needed by our models).
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvtc {

struct RopeParams {
  enum class Layout { kNone, kNorm, kNeox };
  Layout layout = Layout::kNone;
  uint32_t n_rot = 0;     // rotated dimensions at the start of each head (even)
  uint32_t head_dim = 0;  // dimensions per head; n_rot..head_dim-1 pass through
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;
  std::vector<float> freq_factors;  // [n_rot / 2] or empty
};

// RoPE of one capture block from a capture's metadata (docs/capture-format.md).
// `swa` selects the sliding-window layers' base and scale. Throws Error
// naming `origin` and the key when a value is missing or unsupported.
RopeParams rope_params_from_meta(const std::map<std::string, std::string>& meta, bool swa, uint32_t head_dim, const std::string& origin);

// Rotates x in place: x is [n_tok][head_dim] (one head), token t at
// position pos[t]. inverse = true undoes the rotation (rotation by -theta).
// Apply then undo returns x within a few f32 ulps.
void rope_rotate(float* x, const int32_t* pos, size_t n_tok, const RopeParams& p, bool inverse);

// The cos/sin of every (token, pair) for a run of positions, computed once
// and applied to every layer and head of a block: the angles do not depend
// on the layer (30 layers x 3 heads share them in SmolLM2). rope_apply with
// a table gives exactly rope_rotate's result.
struct RopeTable {
  RopeParams::Layout layout = RopeParams::Layout::kNone;
  uint32_t half = 0, head_dim = 0;
  size_t n_tok = 0;
  std::vector<double> c, s;  // [n_tok][half]; s negated for the inverse
};
RopeTable rope_table(const int32_t* pos, size_t n_tok, const RopeParams& p, bool inverse);
void rope_apply(float* x, const RopeTable& t);  // x: [t.n_tok][head_dim]

}  // namespace kvtc
