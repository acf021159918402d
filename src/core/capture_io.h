// Internal: the metadata strings of the file formats <-> the typed cache
// geometry of kvtc/cache.h, and captures <-> safetensors / parsed blobs.
// These are the only places that read or write geometry as strings
// (capture files, calibration files, the container header's capture_meta).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "core/state_blob.h"
#include "kvtc/cache.h"

namespace kvtc {

constexpr const char* kCaptureFormat = "kvtc-capture";
constexpr int kCaptureFormatVersion = 1;

using Meta = std::map<std::string, std::string>;

// The RoPE of one block from metadata keys (docs/capture-format.md):
// rope_type, n_rot, rope_freq_base/_scale (sliding-window block:
// rope_freq_base_swa/_scale_swa), rope_freq_factors (full-attention block
// only), rope_scaling_type. A rotation kvtc cannot undo (M-RoPE, YaRN, a
// missing or malformed key) is returned with `unsupported` saying why,
// naming `origin` and the key; nothing is thrown.
Rope rope_from_meta(const Meta& meta, bool swa, uint32_t head_dim, const std::string& origin);
// Error (naming `who`) when the rotation cannot be undone exactly
// (Rope::unsupported is set). Here, below the format and the codec, because
// both check it: the container's rules (format/plan.cpp) for the keys of
// every block that is coded, the codec (codec/rope.cpp) before rotating.
void require_rope_supported(const Rope& r, const std::string& who);

// One block's RoPE as a source states it (a file's metadata strings here, a
// GGUF header in src/llama), for rope_from_facts, the one place that says
// which rotations kvtc undoes exactly. Each source reads the facts (and its
// own defaults) and names them in the messages as it calls them.
struct RopeFacts {
  std::string type;     // norm, neox, none, or what the source says
  std::string scaling;  // none, linear, or what the source says
  double n_rot = 0;     // rotated dimensions (a double: a file may say 63.5)
  float freq_base = 0, freq_scale = 0;
  std::vector<float> freq_factors;  // n_rot/2 of them, or none
  // scaling "yarn": its parameters (Rope's fields of the same names), read
  // by the source; yarn_error says why they could not be.
  float ext_factor = 0, attn_factor = 1, beta_fast = 32, beta_slow = 1;
  double n_ctx_orig = 0;
  std::string yarn_error;
  // Why the source could not read a fact (empty: read), reported when the
  // rules reach it, so a message names the first fault in the rules' order.
  std::string n_rot_error, freq_error, factors_error;
  // How the messages name the type, the scaling and the factors (the
  // source's own words: a metadata key, a GGUF tensor).
  const char* type_name = "rope type";
  const char* scaling_name = "rope scaling";
  const char* factors_name = "rope frequency factors";
};
// The rules: layout norm, neox or none (none: nothing else is read);
// scaling none, linear or yarn (with its parameters: ext_factor >= 0,
// attn_factor, betas positive, n_ctx_orig a positive integer when
// ext_factor is not 0); n_rot an even integer <= head_dim;
// base and scale positive; factors none or n_rot/2. A rotation outside them
// comes back with `unsupported` = "origin: why"; nothing is thrown.
Rope rope_from_facts(const RopeFacts& f, uint32_t head_dim, const std::string& origin);

// Fills model_sha256 and, per block (whose layers, heads and dims the
// caller has set; block 1 is the sliding-window block), rope and
// sliding_window (n_swa) from metadata.
void geometry_from_meta(const Meta& meta, CacheGeometry& g, const std::string& origin);
// `provenance` with the typed fields written over their keys: model_sha256;
// the RoPE keys of every block whose rotation is supported (an unsupported
// one keeps the keys it was read from); n_swa for an iSWA cache. Floats are
// written "%.9g" (exact for f32). Error when two blocks disagree on what
// the format stores once (layout, n_rot).
Meta meta_with_geometry(const Meta& provenance, const CacheGeometry& g);
// JSON list of layer indices ("[0,1,2]") and back; Error names `where`.
std::string layers_to_json(const std::vector<int32_t>& layers);
std::vector<int32_t> layers_from_json(const std::string& s, const std::string& where);

SafeTensors capture_to_safetensors(const KvCapture& c);
// Validates names, dtypes, shapes and metadata; `origin` names the file.
KvCapture capture_from_safetensors(const SafeTensors& st, const std::string& origin);

// Blob -> capture: one non-empty stream per block, one sequence per cell,
// f16 rows of g's geometry; Error names the block, stream and field.
KvCapture capture_from_blob(const SeqBlob& blob, const CacheGeometry& g, const std::string& origin);
// Capture -> blob for a context of layout `to`; cells in the capture's order.
SeqBlob capture_to_blob(const KvCapture& c, const StateLayout& to);

// Tokens [t0, t0 + n) of a single-block cache: one decoded piece's share of
// a state assembled from pieces (the prompt store's restores).
struct BlockRun {
  const KvBlock* block = nullptr;
  uint32_t t0 = 0, n = 0;
};
// The sequence state of the runs' tokens in order, for a context of layout
// `to`: byte for byte state_from_capture of the capture the runs would join
// into, written straight from the runs (one copy of the K/V bytes instead
// of two: join, then the state). The runs must share one single-block
// geometry; cells take the runs' positions.
std::vector<uint8_t> state_from_runs(std::span<const BlockRun> runs, const StateLayout& to);

// A llama.cpp state read into a capture with what it takes to write it back
// in the same form: the state's layout and, for a context state
// (llama_state_get_data), its architecture name, recorded in c.meta under
// llama_state, llama_state_arch, llama_state_v_trans, llama_state_streams,
// llama_state_seq_id (docs/llama-state.md "In a container"). Either form.
KvCapture capture_from_any_state(std::span<const uint8_t> blob, const CacheGeometry& g, const std::string& origin);
// The inverse: the capture as a state of the recorded form, in layout `to`,
// or in the recorded layout when `to` is null. Error naming `origin` when a
// capture without the record needs it (to is null).
std::vector<uint8_t> state_as_recorded(const KvCapture& c, const StateLayout* to, const std::string& origin);

}  // namespace kvtc
