// context_kv_settings (<kvtc/llama.h>): the RoPE settings a llama.cpp
// context resolved, read from its llama_cparams. llama.h does not expose
// them, and re-deriving them from the parameters would copy llama.cpp's
// rules (a 0 base means the GGUF's; YaRN's attention factor is computed
// from the scale and the model's log multiplier): the context's own
// values are the ones its keys were rotated with. llama-context.h is an
// internal header of the pinned commit (kLlamaCppCommit); only the
// non-virtual get_cparams() and the plain llama_cparams struct are used,
// and tests/test_llama.cpp checks the values against the public getters
// where llama.h has them (n_ctx, n_batch, n_ubatch, n_seq_max).
#include "kvtc/error.h"
#include "kvtc/llama.h"
#include "llama-context.h"

namespace kvtc {

KvSettings context_kv_settings(const llama_context* ctx) {
  require(ctx != nullptr, "context_kv_settings: no context");
  const llama_cparams& c = ctx->get_cparams();
  require(c.n_ctx == llama_n_ctx(ctx) && c.n_batch == llama_n_batch(ctx) && c.n_ubatch == llama_n_ubatch(ctx) && c.n_seq_max == llama_n_seq_max(ctx),
          "context_kv_settings: llama.cpp's context parameters are not laid out as at " + std::string(kLlamaCppCommit) +
              " (a llama.cpp other than the pinned one?)");
  KvSettings s;
  s.rope_freq_base = c.rope_freq_base;
  s.rope_freq_scale = c.rope_freq_scale;
  s.n_ctx_orig_yarn = c.n_ctx_orig_yarn;
  s.yarn_ext_factor = c.yarn_ext_factor;
  s.yarn_attn_factor = c.yarn_attn_factor;
  s.yarn_beta_fast = c.yarn_beta_fast;
  s.yarn_beta_slow = c.yarn_beta_slow;
  return s;
}

}  // namespace kvtc
