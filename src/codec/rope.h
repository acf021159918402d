// Internal: rotary position embedding of stored keys, applied and undone
// exactly as llama.cpp's CPU backend computes it (ggml_rope_ext).
//
// Keys in a llama.cpp cache carry RoPE; the codec removes it before the PCA
// (the position rotation hides the low-rank structure, docs/method.md §2) and
// puts it back after reconstruction. Layouts NORM (pairs 2i, 2i+1) and NEOX
// (pairs i, i + n_rot/2), frequency base and linear scale, per-pair
// frequency factors (Llama 3's rope_freqs); kvtc::Rope describes them.
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/capture_io.h"  // require_rope_supported
#include "kvtc/cache.h"

namespace kvtc {

// The cos/sin of every (token, pair) for a run of positions, computed once
// and applied to every layer and head of a block: the angles do not depend
// on the layer (30 layers x 3 heads share them in SmolLM2).
struct RopeTable {
  RopeLayout layout = RopeLayout::kNone;
  uint32_t half = 0, head_dim = 0;
  size_t n_tok = 0;
  std::vector<double> c, s;  // [n_tok][half]; s negated for the inverse
};
// The table of tokens at pos[0..n_tok); inverse = true undoes the rotation.
RopeTable rope_table(const int32_t* pos, size_t n_tok, const Rope& r, uint32_t head_dim, bool inverse);
// Rotates x in place: x is [t.n_tok][head_dim] (one head).
void rope_apply(float* x, const RopeTable& t);
// The decoder's last step for one head: the n_tok rows of `in` (row k at
// in + k * stride, head_dim floats; not changed) rotated by t (none when
// t.half == 0) and rounded to f16 into out[n_tok][head_dim] — the bits
// rope_apply then f32_to_f16_n give, on every CPU. With AVX-512F and n_rot
// a multiple of 16 (at most 512) the rotation runs 8 pairs at a time in double (each
// product and sum rounded apart, as the scalar code's) from ex, else row
// by row through rope_apply. ex: rope_expand(t), shared by the heads.
struct RopeExpanded {
  // [n_tok][n_rot]: dimension d's rotated value is x[d] cc[d] + x[partner(d)] ss[d],
  // partner d ^ 1 (NORM) or d +- n_rot / 2 (NEOX). Empty where the vector path does not apply.
  std::vector<double> cc, ss;
};
RopeExpanded rope_expand(const RopeTable& t);
void rope_apply_f16(const float* in, size_t stride, const RopeTable& t, const RopeExpanded& ex, uint16_t* out);
// rope_apply(x, rope_table(...)). Apply then undo returns x within a few f32 ulps.
void rope_rotate(float* x, const int32_t* pos, size_t n_tok, const Rope& r, uint32_t head_dim, bool inverse);

}  // namespace kvtc
