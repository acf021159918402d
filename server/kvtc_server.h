// kvtc-server: llama-server (pinned llama.cpp, tools/server) whose host
// prompt cache keeps kvtc-compressed prompts in a kvtc::PromptStore (RAM
// tier + optional disk tier, shared prefix chunks; docs/store.md,
// docs/server.md). The patch (server/llama-server.patch) only calls these
// functions; this file is compiled into llama.cpp's server-context target.
//
// Threading: llama-server calls save/load/update from its main loop (one
// thread); kvtc_server_metrics() and kvtc_server_prefetch() from HTTP threads. The store compresses on
// its own worker thread.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

struct llama_context;
struct llama_model;
struct server_prompt;
struct server_prompt_cache;
struct server_prompt_cache_state;
struct server_tokens;

struct kvtc_server_params {
  std::string calib;                       // --kvtc-calib FILE: enables kvtc; "auto": learned from the prompts served
  int64_t calib_tokens = 32768;            // --kvtc-calib-tokens N: auto: tokens learned before the fit
  double calib_share = 0.05;               // --kvtc-calib-share X: auto: learning's CPU time / the prefill time of what it learns from
  double ratio = 16;                       // --kvtc-ratio R
  double global_ratio = 0;                 // --kvtc-ratio-global R (sliding-window models; 0: the model's default)
  std::string disk;                        // --kvtc-disk DIR: the disk tier
  int64_t disk_mib = 0;                    // --kvtc-disk-mib N: its budget (0: no limit)
  int64_t pending_mib = 0;                 // --kvtc-pending-mib N: raw state waiting to be compressed at most (0: sized for the model)
  int threads = 1;                         // --kvtc-threads N: compression threads beside inference
  int window = 128;                        // --kvtc-window N: the newest tokens of a stored prompt kept raw (docs/method.md §6)
  int window_bits = 8;                     // --kvtc-window-bits 8|16: those tokens at 8 bits (container version 3), the default, or f16
  bool raw = false;                        // --kvtc-raw: store raw f16 through the same tiers (a benchmark baseline)
  bool ecsq = false;                       // --kvtc-ecsq: entropy-coded pieces (container version 2), the default, asked for explicitly
  bool dp = false;                         // --kvtc-dp: the DP allocation with DEFLATE (container version 1) instead
  std::string redis;                       // --kvtc-redis redis://HOST:PORT[/DB]: the shared tier on one Redis
  std::vector<std::string> redis_cluster;  // --kvtc-redis-cluster HOST:PORT,...: ... or on a Redis Cluster
  int64_t redis_ttl_s = -1;                // --kvtc-redis-ttl S: every Redis key's time to live (0: none; -1: the store's default, a day)
  // --kvtc-secret-file F: read when the flags are taken (a bad file stops
  // the start before the model loads); the bytes are handed to the store
  // and wiped here once it is built.
  std::string secret_file;
  std::vector<uint8_t> secret;
  bool encrypt = false;               // --kvtc-encrypt: AES-256-GCM at rest (needs the secret)
  std::string redis_user;             // --kvtc-redis-user U: AUTH's user name (ACLs), one server or a cluster
  std::string redis_password_file;    // --kvtc-redis-password-file F: AUTH's password, one server or a cluster
  std::string redis_password;         // its first line
  std::vector<std::string> warnings;  // about the files above (readable by others): logged at attach
  bool tenant_from_api_key = false;   // --kvtc-tenant-from-api-key: every request is its API key's tenant (docs/server.md "Tenants")
  bool prefetch = true;               // false: --kvtc-no-prefetch, restores decode on the loop (a benchmark's baseline)
  // --kvtc-restore-max-cost X: the store is asked only while a restore is
  // measured to cost at most X times the prefill of the tokens it restores
  // (both measured on this server as it runs; docs/server.md "Restore or
  // recompute"). Default 1: the faster of the two.
  double restore_max_cost = 1.0;
};

// The flags of this process (set by kvtc_server_take_args).
kvtc_server_params& kvtc_server_config();

// Takes the --kvtc-* flags out of argv (before llama.cpp's parser sees
// them); prints their help when argv asks for --help. False with `err` set
// on a bad value.
bool kvtc_server_take_args(int& argc, char** argv, std::string& err);

class kvtc_prompt_cache {
 public:
  ~kvtc_prompt_cache();

  // llama-server's prompt_save: takes the slot's state raw and queues it
  // for compression. False when nothing was stored (already held, error).
  bool save(const server_prompt& prompt, llama_context* ctx, int32_t id_slot);
  // server_prompt_cache::load: restores the best stored prompt into the
  // slot when it beats the slot's own; false only when restoring failed
  // (the caller then clears the slot and recomputes).
  bool load(server_prompt& prompt, const server_tokens& tokens_new, llama_context* ctx, int32_t id_slot);
  // A slot finished its task: with a shared tier (Redis) the turn is saved
  // now, not when the slot is next reused, as the conversation's next turn
  // may land on another replica. No-op without one.
  void on_release(const server_prompt& prompt, llama_context* ctx, int32_t id_slot);
  // server_prompt_cache::update: logs the store's state; true while kvtc
  // keeps the prompts. With --kvtc-calib auto, false while the calibration
  // is learned (upstream's raw cache serves meanwhile, `raw` its prompts);
  // the call that finds the fitted calibration's store ready puts it in
  // place, moves the prompts of `raw` into it (compressed in the
  // background) and empties `raw`. Loop thread.
  bool update(std::list<server_prompt_cache_state>& raw);
  // --kvtc-calib auto (docs/server.md "A calibration learned from the
  // prompts served"): true until the learned calibration's store is in
  // place; then save() and load() run as with a calibration file. Loop thread.
  bool learning() const;
  // While learning, llama-server's prompt_save: hands the slot's state to
  // the learner (a copy on the loop, when it is not busy with the previous
  // one) and says whether upstream's raw cache may keep the prompt: only
  // when it is no tenant's (upstream's cache knows no tenants).
  bool learn(const server_prompt& prompt, llama_context* ctx, int32_t id_slot);
  // While learning, whether upstream's raw cache may restore into the slot
  // (its new task is no tenant's): a tenant's task restores nothing.
  bool raw_cache_allowed(int32_t id_slot) const;
  // A context shift in slot `id_slot` (llama-server's pre_decode): the
  // cells past n_keep were moved to other positions, so their K/V is no
  // longer what a prefill of the slot's tokens computes; the slot is not
  // saved while it holds them (its tokens still continue `tokens` past n_keep).
  void on_context_shift(int32_t id_slot, const server_tokens& tokens, int32_t n_keep);

  struct impl;
  std::shared_ptr<impl> p;
};

// Called where llama-server creates its prompt cache: when --kvtc-calib is
// given, attaches a kvtc store to `cache` (which must exist: --cache-ram
// not 0). Loads and checks the calibration against the model and refuses
// what kvtc cannot store (multimodal, a draft model, LoRA adapters, model
// metadata overrides, control vectors, recurrent or hybrid caches, a
// quantized cache type). The store's salt names the model file, the
// calibration, the kvtc flags and the context's RoPE as llama.cpp resolved
// it (docs/store.md "Keys"). False, with the reason logged, when the
// server must not start (also: --kvtc-tenant-from-api-key without
// --api-key or --api-key-file, `has_api_keys`). `resuming`: the server wakes from
// --sleep-idle-seconds with the store it had (cache->kvtc, kept by the
// patch) and a new context: the store is kept (no calibration reload, no
// model hash, no disk rescan) and bound to the new context; whatever fails
// then disables kvtc (logged, kvtc:disabled 1) and the server serves on,
// never refused.
bool kvtc_server_attach(server_prompt_cache* cache, const llama_model* model, llama_context* ctx, const std::string& model_path,
                        int32_t cache_ram_mib, bool has_draft, bool has_mtmd, bool has_lora, bool has_kv_overrides, bool has_control_vectors,
                        bool has_api_keys, bool resuming);

// Prometheus lines (kvtc:*) of the attached store, "" when none; any thread.
std::string kvtc_server_metrics();

// Restores off the loop (docs/server.md "Time"): called by a completion
// request's HTTP thread once its prompt is tokenized, before the task is
// queued. Asks the store for `tokens` of `tenant` as a slot would — against
// the idle slot of that tenant that shares the longest prefix with them, so
// a conversation still held by its slot costs nothing — and decodes the
// match here, on this thread, while the loop serves the other slots. The
// task's load() (the loop) then only writes the decoded state into its slot.
// With `cache_prompt` false nothing is looked up, and the task's load
// restores nothing (upstream would restore, then recompute from token 0).
// No-op when kvtc is not attached. Never throws: a failure leaves the load
// to the loop, as without a prefetch.
void kvtc_server_prefetch(const server_tokens& tokens, const std::string& tenant, bool cache_prompt);

// Tenants (docs/server.md "Tenants"): a tenant's prompts are stored on a key
// chain of their own (docs/store.md "Tenants"), and no slot reuses one
// tenant's KV for another.
//
// The tenant of a completion request (handle_completions_impl, an HTTP
// thread): "" (none: the server as without tenants) unless the request has
// `cache_salt` (vLLM's field: a non-empty string of at most 256 bytes; its
// bytes are the tenant), or --kvtc-tenant-from-api-key is given: then
// "api-key:" + the SHA-256 of the API key the request authenticated with
// (never the key itself), with "\n" + cache_salt appended when it has one,
// so keys never share prompts whatever salts they send. Throws
// std::invalid_argument naming the field and what is expected (the
// client's 400): cache_salt not a string, empty or too long, or a tenant
// while kvtc does not run (its isolation would not be there).
std::string kvtc_server_request_tenant(const nlohmann::ordered_json& data, const std::map<std::string, std::string>& headers);

// A task of `tenant` was given slot `id_slot` (get_available_slot: the
// least recently used, a similarity pick or id_slot), whose cells and
// `prompt` are those of the slot's last task. When that was another
// tenant's, the prompt is saved for its own tenant and the slot emptied
// (its cells and tokens), so that llama-server's prefix reuse cannot give
// this task another tenant's KV; the slot is this tenant's from now on.
// True then, when the store is attached: the caller restores the task's
// tenant's own best prompt (prompt_load). The child tasks of n_cmpl > 1
// skip get_available_slot but need nothing: they run on copies of their
// parent's cells (the same tenant's), and upstream empties a child's slot
// when it ends (server_slot::release). Loop thread only.
bool kvtc_server_switch_tenant(server_prompt_cache* cache, server_prompt& prompt, llama_context* ctx, int32_t id_slot, const std::string& tenant);

// Sliding-window models (docs/store.md "Sliding-window models"): called
// where llama-server finds too few window cells in a slot (pos_min >=
// pos_next - n_swa, "forcing full prompt re-processing"). True when the
// slot's cells are a state kvtc restored in its last load() and they hold
// every window position the next token reads (from pos_next - n_swa + 1,
// one earlier when the last prompt token is evaluated again): the restore
// is used instead of recomputing the whole prompt. Consumes the slot's
// mark; false otherwise (upstream's rule stands). Loop thread only.
bool kvtc_server_window_restored(server_prompt_cache* cache, int32_t id_slot, int32_t pos_min, int32_t pos_next, int32_t n_swa, bool has_new_tokens);
