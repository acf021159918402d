// kvtc: the llama.cpp integration (library kvtc_llama, which links the
// pinned llama.cpp built by scripts/bootstrap.sh) — load a GGUF model, run
// a sequence, take its KV cache out as a KvCapture and put one back, and
// fit a calibration from a text corpus. Not part of <kvtc/kvtc.h>: a
// server that has its own llama.cpp uses the codec with state blobs
// (compress_state, decompress_state) and fills CacheGeometry itself.
//
// One Model may back several Sessions. Neither is thread-safe: use one
// Session per thread. All errors are kvtc::Error naming the model path or
// the operation; llama.cpp's own log lines are kept quiet unless
// set_llama_verbose(true), and its last error lines are appended to ours.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvtc/calibration.h"
#include "kvtc/corpus.h"
#include "kvtc/store.h"

struct llama_model;
struct llama_context;

namespace kvtc {

// The llama.cpp commit our static libraries are built from (the pin in
// scripts/bootstrap.sh); recorded in every capture.
constexpr const char* kLlamaCppCommit = "4df29be4f";
// The ggml CPU variant llama.cpp runs on in this process, by ggml's name
// ("zen4", "haswell", "x64", ...): the best of llama_cpu_variants() this CPU
// runs, loaded at the first call of this or of Model::load, or the one the
// environment's KVTC_GGML_CPU names ("auto": ggml's choice). Throws
// kvtc::Error when none loads. Thread-safe.
std::string llama_cpu_build();

// The CPU variants built beside libllama (scripts/bootstrap.sh), sorted.
std::vector<std::string> llama_cpu_variants();

// The variant the environment's KVTC_GGML_CPU asks for; "" when it leaves
// the choice to ggml (unset, empty or "auto").
std::string llama_cpu_requested();

void set_llama_verbose(bool on);

// The model and corpus this build's programs default to: $KVTC_MODEL and
// $KVTC_CORPUS when set, else the SmolLM2 GGUF and the corpus the
// bootstrap put under .deps/ of the build's source tree.
std::string default_model_path();
std::string default_corpus_dir();

// The models the bootstrap provides, by short name: "smollm2" (the
// default; scripts/bootstrap.sh), "gemma3" (the iSWA test model) and
// "qwen" (Qwen2.5-Coder-1.5B-Instruct; make models-large). Paths under
// .deps/models of the build's source tree; `present` when the file is there.
struct NamedModel {
  std::string name, path, what, how;  // how: the command that fetches it
  bool present = false;
};
std::vector<NamedModel> named_models();
// A short name's path, anything else unchanged. Error for a known name whose
// file is missing (naming the command that fetches it).
std::string resolve_model(const std::string& name_or_path);

struct ModelInfo {
  std::string path;
  std::string arch;  // general.architecture
  std::string name;  // general.name, if present
  std::string desc;  // llama_model_desc, e.g. "llama ?B Q4_1"
  uint64_t file_size = 0;
  uint64_t n_params = 0;
  uint32_t n_layer = 0, n_head = 0, n_head_kv = 0, n_embd = 0;
  uint32_t head_dim_k = 0, head_dim_v = 0;
  uint32_t n_ctx_train = 0;
  uint32_t n_vocab = 0;
  // RoPE, as llama.cpp applies it to stored keys.
  std::string rope_type;  // "norm", "neox", "mrope", "vision", "imrope" or "none"
  uint32_t n_rot = 0;
  float rope_freq_base = 0, rope_freq_scale = 1;
  std::string rope_scaling_type;  // GGUF <arch>.rope.scaling.type, "" when absent
  float rope_scaling_factor = 0;
  uint32_t rope_scaling_orig_ctx = 0;
  std::vector<float> rope_freq_factors;  // tensor rope_freqs.weight (Llama 3), empty if none
  // Sliding-window attention (iSWA caches); n_swa == 0 when absent.
  uint32_t n_swa = 0;
  std::vector<bool> swa_layer;  // [n_layer]
  float rope_freq_base_swa = 0, rope_freq_scale_swa = 1;
};

class Model {
 public:
  // Checks the file (exists, GGUF magic) before handing it to llama.cpp.
  // vocab_only loads the vocabulary alone (for tokenizing): info() then
  // holds only path, file size, GGUF keys and n_vocab; no Session may use it.
  static std::unique_ptr<Model> load(const std::string& path, bool vocab_only = false);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelInfo& info() const { return info_; }
  llama_model* raw() const { return model_; }
  // add_bos follows the model's own setting; special tokens are not parsed.
  std::vector<int32_t> tokenize(const std::string& text) const;
  // With control over both: parse_special turns "<|im_start|>" and the
  // like into their single tokens (for chat templates).
  std::vector<int32_t> tokenize(const std::string& text, bool add_bos, bool parse_special) const;
  std::string token_text(int32_t token) const;
  bool is_eog(int32_t token) const;
  // SHA-256 of the model file, computed on first use (~0.3 s per 100 MB).
  const std::string& sha256() const;
  // The cache this model keeps: per block of a sequence blob, the model
  // layers it holds, heads, dims, the RoPE its keys carry and the sliding
  // window; with the fingerprint (sha256(), so the first call hashes the file).
  CacheGeometry geometry() const;

 private:
  Model() = default;
  llama_model* model_ = nullptr;
  ModelInfo info_;
  mutable std::string sha256_;
};

// The cache geometry of a model another program loaded with its own
// llama.cpp built from the same commit (kLlamaCppCommit) — a server:
// `gguf_path` is the file it loaded (its header gives the RoPE details, its
// SHA-256 the fingerprint: ~0.3 s per 100 MB). Error as Model::geometry().
CacheGeometry model_geometry(const llama_model* m, const std::string& gguf_path);

// The state layout of a context another program created (a server), for
// the states it restores into it (PromptStore::take_state,
// decompress_state): the streams of each cache block and the V layout
// (transposed without flash attention), which llama.cpp's API does not
// expose once the context has resolved "auto". Learned from the state of
// one token decoded into sequence `probe_seq`, which must be empty and is
// emptied again: call it before the context serves. Also checks that the
// cache is one kvtc codes with geometry `g` (f16 K and V, one sequence per
// cell); Error naming what differs otherwise. The result's seq_id is
// probe_seq; set it per restore.
StateLayout context_state_layout(llama_context* ctx, const CacheGeometry& g, int32_t probe_seq = 0);

// The settings a context computes its K/V under beyond the model file (its
// RoPE as llama.cpp resolved them: --rope-freq-base/-scale, --rope-scaling,
// the YaRN parameters), for StoreOptions::kv_settings. Read from the
// context itself (llama.cpp's own llama_cparams at kLlamaCppCommit), so
// every way of setting them — flags, GGUF defaults, llama.cpp's own
// derivations (YaRN's attention factor) — is covered.
KvSettings context_kv_settings(const llama_context* ctx);

// The context's RoPE flags, named as llama-server's (0 or "": the GGUF's).
// They change the keys a model computes (context_kv_settings reads what
// llama.cpp resolved). A calibration fitted under a server's settings codes
// its keys barely better than one fitted under the GGUF's (SmolLM2 16x, KL
// 0.0225 -> 0.0193 under base 20000, 0.0255 -> 0.0257 under YaRN x2;
// bench/results/rope-settings-calib.md): the codec removes the context's
// rotation either way.
struct RopeFlags {
  std::string scaling;         // --rope-scaling: "" (the GGUF's), "none", "linear" or "yarn"
  float freq_base = 0;         // --rope-freq-base
  float freq_scale = 0;        // --rope-freq-scale (--rope-scale N is 1/N)
  uint32_t yarn_orig_ctx = 0;  // --yarn-orig-ctx: YaRN's original context (0: the GGUF's or n_ctx_train)
};

struct SessionOptions {
  uint32_t n_ctx = 0;      // 0: the model's trained context
  bool flash_attn = true;  // fixed, never AUTO: it decides the V layout (v_trans = !flash_attn)
  int n_threads = 0;       // 0: all hardware threads
  uint32_t n_batch = 2048;
  uint32_t n_ubatch = 512;
  // llama.cpp's own cache types, for running its quantized caches natively
  // as a baseline: "f16" (default), "q8_0" or "q4_0". capture() and
  // restore() need f16 (our blob parser reads f16 rows only).
  std::string cache_type_k = "f16", cache_type_v = "f16";
  RopeFlags rope;  // the context's RoPE (above)
};

class Session {
 public:
  Session(const Model& model, const SessionOptions& opt);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint32_t n_ctx() const { return n_ctx_; }
  const SessionOptions& options() const { return opt_; }
  const Model& model() const { return model_; }

  // Decodes tokens at positions pos0.. into sequence 0, in batches; keeps
  // the logits of the last token, and of every token in all_logits
  // ([n_tokens][n_vocab]) when given. Throws if the context would overflow.
  void decode(const std::vector<int32_t>& tokens, int32_t pos0, std::vector<float>* all_logits = nullptr);
  const float* last_logits() const;  // [n_vocab]
  int32_t argmax() const;
  // Greedy continuation: n tokens starting from the current logits.
  std::vector<int32_t> greedy(int n);

  int32_t pos_max() const;  // -1 when the sequence is empty
  void clear();
  void remove_from(int32_t pos);  // drop positions >= pos

  std::vector<uint8_t> seq_state() const;                // llama_state_seq_get_data, seq 0
  void set_seq_state(const std::vector<uint8_t>& blob);  // llama_state_seq_set_data, seq 0
  uint32_t v_trans() const { return opt_.flash_attn ? 0 : 1; }

  // The model's geometry with this context's RoPE (geometry_with_settings
  // of context_kv_settings): the rotation the cache's keys carry, a GGUF's
  // own YaRN resolved.
  CacheGeometry geometry() const;
  // Takes sequence 0's cache as a KvCapture: geometry() above, and as
  // provenance the model, RoPE and this context (capture_metadata); tokens
  // left empty.
  KvCapture capture() const;
  std::map<std::string, std::string> capture_metadata() const;
  // Replaces sequence 0's cache with `c` (after checking its geometry).
  void restore(const KvCapture& c);

 private:
  const Model& model_;
  SessionOptions opt_;
  llama_context* ctx_ = nullptr;
  uint32_t n_ctx_ = 0;
  std::vector<float> logits_;
};

// ---- calibration from a text corpus ----------------------------------------
// The route of `kvtc calibrate` (docs/calibration-format.md): prefill
// calibration-split documents of the corpus (ordered by a hash of their id),
// up to max_doc_tokens each; every 8th document goes to the held-out set
// until it holds heldout_tokens, the others feed a CalibrationFitter until
// it holds n_tokens. Records the corpus and counts in Calibration::meta.
struct CorpusCalibrateOptions {
  std::string model_path;
  std::string corpus_dir;          // holds manifest.json
  uint64_t n_tokens = 160000;      // tokens for the PCA fit (docs/method.md: 160K)
  uint64_t heldout_tokens = 4096;  // tokens, from other documents, for the DP's block errors
  uint32_t max_doc_tokens = 0;     // 0: the model's trained context
  std::vector<std::string> kinds;  // corpus kinds ("prose", "docs", "code", "math"); empty: all
  int threads = 0;                 // prefill threads (0: all)
  RopeFlags rope;                  // the contexts' RoPE: the calibration is fitted on keys under it
  FitOptions fit;
};
Calibration calibrate_from_corpus(const CorpusCalibrateOptions& opt, const ProgressFn& progress = {});

}  // namespace kvtc
