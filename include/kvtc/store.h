// kvtc: a prompt store — the KV caches of idle prompts kept compressed, in
// RAM and on disk, for a server to restore the longest matching one before
// the next turn (docs/store.md). What kvtc-server's prompt cache is made of.
//
// A prompt's cache is kept as fixed-size *chunks* of chunk_tokens tokens
// (each its own .kvtc container, keyed by a chained hash of the tokens
// before and in it, salted with the model, calibration and settings) plus
// a per-prompt *tail*: the last tokens, whose most recent `window` stay raw
// (docs/method.md §6). Chunks are shared: twenty chats that open with the
// same long system prompt store its chunks once. Prompts must sit at
// positions 0..n-1. A sliding-window (iSWA) model's cache has a second
// block, the window's last n_swa positions: it is kept in the tail, and such
// a stored prompt is restored whole only (docs/store.md "Sliding-window
// models").
//
// The lookup follows llama-server's prompt cache: an entry is a candidate
// when its longest common prefix with the new prompt keeps at least 25% of
// it, and wins when it beats the slot's own prompt on both the kept share
// and the similarity to the new prompt; entries contained in a newer
// prompt are dropped; the least recently used go first when over budget.
//
// Saving never blocks the caller: put() queues the raw state and a worker
// thread compresses it. Restoring decodes only the chunks the match needs.
// A disk tier survives restarts; a file that fails its checksum is dropped
// (a miss, never an error), one that cannot be read this time is kept (a
// miss); a directory that cannot be written disables the tier (reported in
// stats()), and the store keeps serving from RAM.
// Thread safety: every member function may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtc/cache.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"

namespace kvtc {

// What besides the model file and the calibration decides the K/V bytes a
// context computes for a prompt: its RoPE as llama.cpp resolved it for that
// context (llama_cparams: a --rope-freq-base, --rope-scaling or YaRN flag
// changes every key). Part of the store's salt (docs/store.md "Keys"), so
// a store filled under other settings is never read. kvtc-server fills it
// from its context (context_kv_settings in <kvtc/llama.h>), KvtcCache from
// llama-cpp-python's context; a program that leaves it unset (all zero)
// shares keys only with others that do.
struct KvSettings {
  float rope_freq_base = 0, rope_freq_scale = 0;
  uint32_t n_ctx_orig_yarn = 0;
  float yarn_ext_factor = 0, yarn_attn_factor = 0, yarn_beta_fast = 0, yarn_beta_slow = 0;
  // "rope_freq_base=10000;rope_freq_scale=1;..." with "%.9g" numbers (f32
  // exactly), in this order; "" when unset. The salt's kv_settings line.
  std::string text() const;
  bool operator==(const KvSettings&) const = default;
};

// g with the RoPE a context of settings `s` rotates its keys with, so that
// the codec removes exactly that rotation: block 0's freq_base and
// freq_scale from s (a sliding-window block keeps its own, as llama.cpp's
// layers do), and on every block the magnitude factor (yarn_attn_factor)
// and, when yarn_ext_factor is not 0, YaRN's parameters. A block whose
// source asked for YaRN without its parameters (Rope::yarn_unresolved: a
// GGUF that says rope scaling "yarn", e.g. a 128K Qwen2.5 or gpt-oss
// conversion) is completed the same way and becomes supported. Unset
// settings (text() "") and blocks without RoPE or whose RoPE kvtc cannot
// undo otherwise are returned as they are. Why: the GGUF's RoPE is not the context's under
// --rope-freq-base, --rope-scaling or --yarn-*; coding with the GGUF's
// left the rotation's difference in the keys (SmolLM2 at 16x, 4
// documents: KL 0.141 under --rope-freq-base 20000 and 0.82 under YaRN x2;
// 0.017 and 0.019 with the context's RoPE removed, 0.012 with plain RoPE;
// bench/results/rope-settings.md).
CacheGeometry geometry_with_settings(const CacheGeometry& g, const KvSettings& s);

struct StoreOptions {
  double ratio = 16;  // nominal ratio of the coded tokens
  // Sliding-window (iSWA) models: the nominal ratio of block 0, the global
  // layers (every token: the long-range memory); 0: the default,
  // min(ratio, 4) (global_ratio_of). Refused for single-block models. Part
  // of the salt.
  double global_ratio = 0;
  KvSettings kv_settings;  // the context's settings that shape its K/V (above); part of the salt
  bool raw = false;        // keep pieces as raw f16 (every token in the raw window, no DEFLATE): the baseline kvtc is measured against
  // Pieces in the entropy-coded mode (container version 2,
  // ecsq_allocation_set: one step rate-controlled to `ratio` per piece,
  // rANS; the default: ~20% fewer bytes than the DP at equal error,
  // decoding as fast, bench/results/entropy.md) or, false, the DP
  // allocation with DEFLATE (version 1). Where the entropy-coded store
  // cannot code (a sliding-window (iSWA) model's two blocks, raw) the DP or
  // raw pieces are used whatever this says; fingerprint() names what is.
  bool entropy_coded = true;
  uint32_t chunk_tokens = 256;  // tokens per shared chunk (multiple of 16)
  uint32_t sink = 4;            // raw tokens at the start (in the first chunk)
  uint32_t window = 128;        // raw tokens at the end (in the tail)
  // Bits per value of the tail's raw window: 8 (the default: container
  // version 3, CompressOptions::window_bits; about half the window's
  // bytes, its KL within the noise of f16's, bench/results/window8.md) or
  // 16 (f16). Raw stores stay f16. Part of the salt through the pieces'
  // container version.
  uint32_t window_bits = 8;
  int deflate_level = 6;
  Precision precision = Precision::kAuto;
  uint64_t ram_bytes = 0;   // the RAM tier's budget of stored bytes; 0: no limit
  std::string disk_dir;     // the disk tier's directory (created); empty: no disk tier
  uint64_t disk_bytes = 0;  // the disk tier's budget of file bytes; 0: no limit
  bool async = true;        // compress puts on a worker thread (false: in put itself)
  // Raw state queued for the worker at most; a put past it is skipped (ask
  // wants(tokens, bytes) before copying a state). 0: max(1 GiB, ram_bytes).
  // A put is a whole prompt's raw f16 cache, n_tokens x (layers x KV heads x
  // head_dim x 4) bytes — 1 GiB for 8K tokens of an 8B GQA model (32 x 8 x
  // 128) — so size it for two of the longest prompts (kvtc-server does:
  // docs/server.md).
  uint64_t max_pending_bytes = 0;
  int threads = 0;          // the worker's coding threads (0: all hardware threads)
  int restore_threads = 0;  // take()'s decoding threads (0: all)
  // Compression is background work: the worker thread runs at this nice
  // value (Linux, per thread; 0 leaves it) and pauses between chunks while a
  // take() decodes, so restores and the caller's own work come first.
  int worker_nice = 10;
  // Buffers of coded put_states kept for state_buffer() to hand out again
  // (at most this many; 0: none). A state copied into a fresh buffer pays a
  // page fault per 4 KiB: for a 49 MiB state of Qwen2.5-Coder-1.5B (1.8K
  // tokens) ~19 ms alone and 40-220 ms while restores and the worker run,
  // against ~2 ms into a kept one. What they keep is memory the queue held
  // at its peak anyway (each at most one put's raw state; StoreStats::
  // spare_bytes), kept mapped while idle.
  int spare_state_buffers = 2;
  // The shared tier (docs/store.md "Redis"), below RAM and disk: one Redis
  // server, redis://[[user]:password@]host[:port][/db], or a Redis Cluster
  // given by "host:port" seeds; both empty: none. Every store with the same
  // model, calibration and settings reads what any of them wrote, so any
  // replica resumes any conversation. Puts are written by the worker thread;
  // a take asks Redis when the local tiers hold less than the whole prompt
  // (one round trip to find the longest stored prefix, one to fetch it). A
  // Redis that is down, slow, a missing or damaged value: a miss, never an
  // error (counted in stats(), logged at the change); retried after retry_ms.
  std::string redis_url;
  std::vector<std::string> redis_cluster;
  // Deadlines, each for one whole exchange (name resolution, connecting,
  // sending, every reply; docs/store.md "Redis", "Time"), whatever Redis
  // does (frozen, trickling, a name that does not resolve):
  // - a take's two exchanges run on the caller's thread (kvtc-server: its
  //   loop, which every slot waits on), so each gets
  //   redis_lookup_timeout_ms, plus its bytes at redis_min_mib_s for the
  //   fetch: a take holds its caller at most 2 x 100 ms + the match's bytes
  //   / 100 MiB/s (6 MB, a 2.5K-token SmolLM2 session: 60 ms; 35 MB, an 8B
  //   one: 350 ms) + decoding, and one more lookup deadline to delete a
  //   damaged value when it finds one. 100 ms: a few decode steps of the
  //   other slots, and ~15x what both exchanges took together on loopback
  //   for a 5.7 MiB restore (6.8 ms p50, 11.8 ms p99;
  //   bench/results/serve-redis.md);
  // - the worker's writes: redis_timeout_ms, plus their bytes at
  //   redis_min_mib_s.
  int redis_connect_timeout_ms = 250;  // resolving and connecting, within the deadline
  int redis_lookup_timeout_ms = 100;
  int redis_timeout_ms = 2000;
  // The slowest transfer rate a deadline allows for (MiB/s, ~0.84 Gbit/s):
  // a large fetch or write on a slow link is not cut short, a stalled one is.
  double redis_min_mib_s = 100;
  // After a failure, Redis is not asked for this long (calls fail at once,
  // without the network); then one attempt, bounded like any exchange.
  int redis_retry_ms = 2000;
  // Every key written expires after this long (0: never); a take's hit
  // renews the keys it read, and a put the chunks it shares. The bound on
  // Redis's growth when maxmemory is not set: one TTL's worth of writes. A
  // day: a conversation resumed the next day still restores; one idle for
  // longer is recomputed (one prefill).
  int64_t redis_ttl_s = 86400;
  // Secrets (docs/store.md "Secrets"). `secret`: the bytes of a secret
  // file (read_store_secret below; at least 32 bytes), shared by every
  // process that shares the store; empty: none, and the store is exactly as
  // without this option (same salt, keys and bytes). With it, every value
  // kept outside the process (disk files, Redis values, the Redis index's
  // tokens included) is authenticated with HMAC-SHA256 and bound to its
  // key: a value written without the secret, with another, or copied under
  // another key is foreign, dropped (deleted) and never decoded
  // (StoreStats::foreign_dropped); the key chain is keyed too, so nobody
  // without the secret can compute a prompt's keys; another secret or mode
  // is another store (another directory and Redis namespace). `encrypt`
  // (needs a secret): AES-256-GCM instead, so a reader of the disk or Redis
  // learns key names, value sizes and timing, not tokens or K/V. The RAM
  // tier and the queue of puts are in the process and stay plain.
  std::vector<uint8_t> secret;
  bool encrypt = false;
  // Redis AUTH for one server and for a Cluster (every node): AUTH
  // [user] password on each new connection. A redis:// URL may carry them
  // instead (one server only); giving both is refused.
  std::string redis_user, redis_password;
  // Where the store says what happened (a disk tier disabled, a corrupt
  // file dropped, a put skipped); called from the store's threads.
  std::function<void(const std::string&)> log;
};

// One tier's figures (StoreStats::tiers), in the order a take asks them.
struct TierStats {
  std::string name;              // "ram", "pending" (puts not coded yet), "disk", "redis"
  bool enabled = true;           // false: configured, but disabled by an error (error says why)
  bool up = true;                // remote tiers: the last exchange worked
  std::string error;             // why it is disabled or down, if it is
  uint64_t entries = 0;          // prompts it holds (remote tiers: not counted, 0)
  uint64_t chunks = 0;           // distinct chunks it holds
  uint64_t bytes = 0;            // bytes it holds (the queue: raw state bytes)
  uint64_t hits = 0;             // takes it served
  uint64_t corrupt_dropped = 0;  // pieces or entries it refused by checksum or content, and dropped
  uint64_t foreign_dropped = 0;  // values that did not open with the store's secret (docs/store.md "Secrets"), dropped unread
  uint64_t io_errors = 0;        // reads the system refused (the files kept)
  uint64_t missing = 0;          // files its index named that were gone
  uint64_t scan_pending = 0;     // files found at start not verified yet
};

struct StoreStats {
  uint64_t entries = 0, chunks = 0, ram_bytes = 0;  // the RAM tier
  uint64_t disk_entries = 0, disk_chunks = 0, disk_bytes = 0;
  bool disk_enabled = false;                       // false when there is none or it was disabled by an error
  std::string disk_error;                          // why it was disabled
  uint64_t puts = 0;                               // puts stored
  uint64_t puts_contained = 0;                     // puts not needed: a stored or queued prompt holds all their tokens
  uint64_t puts_skipped = 0;                       // puts refused (queue full) or failed (bad cache; logged)
  uint64_t pending = 0, pending_bytes = 0;         // puts queued for the worker, and their raw bytes
  uint64_t pending_budget = 0;                     // the queue's budget (max_pending_bytes, or its default); 0: no queue (not async)
  uint64_t spare_buffers = 0, spare_bytes = 0;     // coded puts' buffers kept for state_buffer(), and their bytes
  uint64_t buffers_reused = 0, buffers_new = 0;    // state_buffer() calls served from a kept buffer, and with a new one
  uint64_t buffers_prepared = 0;                   // buffers prepare_state_buffer() made
  uint64_t chunks_written = 0, chunks_shared = 0;  // chunks coded, and chunks a put found stored already
  uint64_t hits_ram = 0, hits_pending = 0, hits_disk = 0, hits_redis = 0, misses = 0;
  uint64_t tokens_restored = 0;
  uint64_t corrupt_dropped = 0;  // files or entries refused by checksum or content, dropped
  // Values that did not open with the store's secret (written without it,
  // with another, under another key, or changed since), dropped unread;
  // 0 without a secret.
  uint64_t foreign_dropped = 0;
  // The disk tier's I/O (docs/store.md "Disk"): only a file whose bytes fail
  // their checks is deleted (corrupt_dropped).
  uint64_t disk_io_errors = 0;     // reads the system refused (EACCES, EMFILE, EIO, ENOMEM ...): a miss, the files kept
  uint64_t disk_missing = 0;       // files the index named that were gone (removed from outside); a chunk is rewritten by the next put through it
  uint64_t disk_scan_pending = 0;  // entry files found at start and not verified yet (the scan runs in the background)
  double disk_scan_ms = 0;         // the start-up scan's time (so far, while it runs)
  // The Redis tier (all zero without one).
  bool redis_enabled = false;  // configured
  bool redis_up = false;       // the last exchange with it worked and lookups are not paused
  std::string redis_error;     // the last failure
  std::string redis_where;     // "redis://host:port/db" or "cluster host:port,..."
  // Set when Redis would grow without bound (maxmemory 0) or fail writes
  // when full (maxmemory-policy noeviction), naming the nodes; checked once
  // it answers (also logged; a Redis that refuses CONFIG GET is logged as
  // unknown and leaves this empty).
  std::string redis_config_warning;
  uint64_t redis_lookups = 0;  // takes that asked Redis
  // Takes answered "miss" without asking, after a take failed and until a
  // probe (PING to every master within a take's deadline, on the tier's
  // own thread, every redis_retry_ms) succeeds; and those probes.
  uint64_t redis_lookups_skipped = 0, redis_probes = 0;
  bool redis_lookups_paused = false;  // now: takes are answered without asking
  uint64_t redis_errors = 0;          // exchanges that failed (down, past their deadline, error reply)
  uint64_t redis_missing = 0;         // values an index named that were gone (evicted), or chunks a match lacked
  uint64_t redis_chunks_written = 0, redis_entries_written = 0, redis_entries_dropped = 0;  // dropped: contained in a newer prompt
  uint64_t redis_bytes_written = 0, redis_bytes_read = 0;
  uint64_t redis_redirects = 0;  // cluster MOVED/ASK replies followed
  double redis_lookup_ms = 0;    // takes' time in Redis round trips (finding and fetching), in all
  double redis_write_ms = 0;     // the worker's time writing to Redis, in all
  double save_ms = 0;            // worker time coding puts, in all
  double restore_ms = 0;         // caller time decoding takes, in all
  std::vector<TierStats> tiers;  // every tier, in lookup order (the named fields above repeat some of it)
};

// The ratio a store codes a sliding-window model's global layers at:
// o.global_ratio, or by default min(o.ratio, 4); 0 for a single-block model
// or a raw store. Why 4 (Gemma 3 270M, bench/results/swa.md, 8 prompts of
// 2K tokens): text KL with the global layers alone coded 0.063 at 16x, 0.026
// at 8x, 0.0052 at 4x, 0.0042 at 2x, while the window alone at 16x measured
// 0.014; needles found at 2K 50% uncoded, 0% with the global layers at 8x or
// 16x (8 prompts: +-35 points).
// They cost 3 KiB of f16 per token there; the window ~7.5 MiB per prompt.
double global_ratio_of(const CacheGeometry& g, const StoreOptions& o);

class PromptStore {
 public:
  // The calibration must be of the geometry's model and cover its blocks
  // (a sliding-window model's two; its pieces are DP-coded).
  // Opens the disk tier when there is one and returns: its files are read
  // back by a background thread, and become hits as they are verified
  // (flush() waits for it). Error on bad options.
  PromptStore(const Calibration& cal, const CacheGeometry& g, const StoreOptions& opt = {});
  ~PromptStore();  // finishes the queued puts first
  PromptStore(const PromptStore&) = delete;
  PromptStore& operator=(const PromptStore&) = delete;

  // Tenants (docs/store.md "Tenants"): every put and take names one, any
  // bytes (kvtc-server: a request's cache_salt, or its API key's hash); ""
  // (the default) is the store as without tenants, its keys and files
  // unchanged. A tenant's prompts are keyed on a chain of their own, so a
  // take of one tenant never restores, and a put never shares a chunk with
  // or drops, another tenant's prompt, in any tier; their lookups cost one
  // another no more than one comparison per stored prompt. What they share:
  // the budgets (one tenant's puts evict another's oldest) and stats().

  // Whether saving `tokens` would add anything: false when an entry of the
  // tenant already holds all of them (llama-server's alloc() skips such a
  // save).
  bool wants(std::span<const int32_t> tokens, std::string_view tenant = {}) const;
  // ... and whether a put of `bytes` (its state blob's or capture's raw
  // size) would be queued now: false when it does not fit the queue's
  // budget (max_pending_bytes; counted in puts_skipped and logged), so that
  // the caller does not copy a state that put_state would skip.
  bool wants(std::span<const int32_t> tokens, uint64_t bytes, std::string_view tenant = {}) const;
  // Stores the cache of `tokens` (positions 0..n-1): a llama.cpp state blob
  // of one sequence (put_state) or a capture. Returns at once when async.
  void put_state(std::vector<int32_t> tokens, std::vector<uint8_t> blob, std::string_view tenant = {});
  // A buffer of `bytes` bytes to copy a state into for put_state (contents
  // unspecified): a coded put's buffer when one with room is kept
  // (StoreOptions::spare_state_buffers; its pages are mapped already), else
  // a new one (*kept, when given, says which). The caller owns it; give it
  // to put_state, or drop it.
  std::vector<uint8_t> state_buffer(size_t bytes, bool* kept = nullptr);
  // Makes sure a kept buffer with room for `bytes`, written that far,
  // exists: a new one's pages (~20 ms for 50 MiB), or a kept one's growth,
  // are written here, so that a coming save's state_buffer() does not
  // (kvtc-server calls it from a request's thread before the loop saves
  // the slot it will reuse). Counted in StoreStats::buffers_prepared.
  void prepare_state_buffer(size_t bytes);
  void put(std::vector<int32_t> tokens, KvCapture cache, std::string_view tenant = {});

  // The best stored prompt of `tenant` for `tokens` when the slot holds
  // `current` (llama-server's load() rules; `current` must be the same
  // tenant's, or empty), decoded: its first n tokens (n at least the common
  // prefix with `tokens`, rounded up to a chunk) and their cache.
  struct Match {
    std::vector<int32_t> tokens;
    KvCapture cache;
    uint32_t common_prefix = 0;  // with the new prompt
    const char* tier = "";       // "ram", "pending", "disk" or "redis"
    double redis_ms = 0;         // redis: time in the two round trips (finding, fetching)
    uint64_t redis_bytes = 0;    // redis: bytes fetched
  };
  std::optional<Match> take(std::span<const int32_t> current, std::span<const int32_t> tokens, std::string_view tenant = {});

  // The same match as a llama.cpp sequence state for a context of layout
  // `to` (streams, V layout, the slot's sequence id: state_layout, or
  // context_state_layout in <kvtc/llama.h>), ready for
  // llama_state_seq_set_data: what take() returns passed through
  // state_from_capture, but written straight from the decoded pieces (one
  // copy of the K/V bytes after decoding instead of three). The state holds
  // match.tokens at positions 0..n-1.
  struct StateMatch {
    std::vector<int32_t> tokens;
    std::vector<uint8_t> state;
    uint32_t common_prefix = 0;
    const char* tier = "";
    double redis_ms = 0;
    uint64_t redis_bytes = 0;
  };
  std::optional<StateMatch> take_state(std::span<const int32_t> current, std::span<const int32_t> tokens, const StateLayout& to,
                                       std::string_view tenant = {});

  void flush();  // waits until the disk tier's start-up scan is done and every queued put is stored
  // SHA-256 (hex) of the scheme, model, calibration and settings: the root
  // of every key; its first 16 digits name the store's directory.
  const std::string& fingerprint() const;
  // What protects the values kept outside the process: "hmac-sha256;key=<key
  // id>", "aes-256-gcm;key=<key id>" (16 hex digits naming the secret, not
  // revealing it: replicas that print the same id share a store), or "".
  const std::string& protection() const;
  StoreStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---- one calibration for a fleet (kvtc-server --kvtc-calib auto with Redis) ----
// A calibration shared through the Redis tier the options name
// (redis_url or redis_cluster, AUTH, timeouts), under a key that names the
// model file, the context's settings (kv_settings) and the secret's key id,
// its value sealed with the secret like the tier's (docs/store.md "Shared
// calibration"). Both need StoreOptions::secret: without one anybody who can
// write to Redis would choose every replica's calibration (Error).
// Thread safety: reentrant; each call opens its own connection.
//
// The calibration under the key, or nullopt when there is none, Redis cannot
// be reached, or the value does not open or parse (logged through o.log;
// never returned). A hit renews the key's time to live (redis_ttl_s).
std::optional<Calibration> fetch_shared_calibration(const StoreOptions& o, const std::string& model_sha256);
// Publishes `cal` unless the key holds one already (SET NX, with the TTL),
// and returns what the key holds then: `cal`, or the calibration another
// process published first (the caller uses that one: the fleet keeps one
// id, so one cache). nullopt when Redis failed (logged).
std::optional<Calibration> publish_shared_calibration(const StoreOptions& o, const std::string& model_sha256, const Calibration& cal);
// The Redis key (kvtc:calib:1:<32 hex>).
std::string shared_calibration_key(const StoreOptions& o, const std::string& model_sha256);

// ---- a calibration learned from the prompts served ---------------------------
// What kvtc-server's --kvtc-calib auto and the Python KvtcCache("auto")
// share (docs/server.md "A calibration learned from the prompts served"):
// where a learned calibration is kept, how one is found at start, and the
// learner thread that samples prompt states, fits, writes and publishes.

struct LearnerOptions {
  uint64_t tokens = 32768;  // rows for the PCA before the fit (held out: tokens / 16 more)
  // Learning's CPU time at most this share of the prefill time of the
  // tokens it learns from (the stride follows prefill_ms_per_token; 1 or
  // more: every token).
  double share = 0.05;
  double ratio = 16;  // the store's ratio: its DP table is fitted beside 8, 16, 32 and 64
  // Where the calibration is kept (learned_calibration_file()), written
  // atomically after the fit; "": memory only.
  std::string file;
  // The Redis tier and secret it is shared through (learner_shares()); the
  // learner keeps a copy until it has published, then wipes its secret.
  StoreOptions fleet;
  // llama.cpp's measured prompt processing per token, in ms (0: not known
  // yet: every token is learned). Called on the learner's thread.
  std::function<double()> prefill_ms_per_token;
  // Info (warning = false) and warning lines, from any thread.
  std::function<void(bool warning, const std::string&)> log;
  // Called on the learner's thread with the calibration once fitted (or
  // adopted from the fleet) and written, before the state becomes "ready":
  // kvtc-server opens its store there, off its loop. An exception fails
  // the learner (state "failed", its message the error).
  std::function<void(const Calibration&, const std::string& from)> on_ready;
  // Overwrites this copy's secret and Redis password (once handed to the
  // learner, or after find_learned_calibration), so no stray copy stays in memory.
  void wipe_secrets();
};

struct LearnerStatus {
  std::string state;  // learning, fitting, ready (calibration() holds it), live (mark_live()), failed
  std::string error, file, calib_id;
  uint64_t seen = 0, fresh = 0, fit = 0, held = 0, fit_target = 0, held_target = 0;  // tokens (OnlineCalibrator's counts)
  uint64_t samples = 0;                                                              // states learned from
  uint64_t busy = 0;                                                                 // states not taken: the learner was busy with the previous one
  uint64_t refused = 0;                                                              // states not learned from (not a prompt's cache: shifted, say)
  uint64_t moved = 0;                                                                // raw prompts moved into the store (mark_live)
  uint32_t stride = 1;                                                               // one new token in this many is learned
  double cpu_ms = 0;                                                                 // the learner thread's CPU time learning (not fitting)
  double loop_ms = 0, loop_max_ms = 0;                                               // the callers' hand-over copies (submit's copy_ms)
  double fit_s = 0;                                                                  // the fit's time (0: adopted, or not yet)
};

// Where a learned calibration is kept: beside a disk tier's store
// directories, one file per model file ("calibration-auto-<16 hex>.safetensors").
std::string learned_calibration_file(const std::string& disk_dir, const std::string& model_sha256);
// Whether calibrations are shared through Redis: a Redis tier and a secret.
bool learner_shares(const StoreOptions& o);
// Whether `c` was fitted for `g` (its model file, blocks and features).
bool calibration_fits(const Calibration& c, const CacheGeometry& g);
// The calibration learned before: the fleet's (Redis, when learner_shares),
// else o.file's when it fits `g` (one that does not is logged and ignored:
// a new one will replace it). One found only in the file is offered to the
// fleet (the first replica's wins: this one takes that one if it lost); one
// from the fleet is written to o.file. nullopt: learn one. `from` names
// where it came from.
std::optional<Calibration> find_learned_calibration(const CacheGeometry& g, const LearnerOptions& o, std::string* from = nullptr);

// The learner: a thread (nice 19) holding an OnlineCalibrator for `g`
// (single-block caches only). The caller hands it whole prompt states (a
// llama.cpp sequence or context state of tokens at positions 0..n-1); one
// that comes while it is busy is not learned from. With enough tokens it
// fits on the same thread, writes o.file, publishes to the fleet and calls
// o.on_ready; with a fleet, it also looks every 10 s for a calibration
// another replica published, and adopts it instead of fitting. Memory:
// the OnlineCalibrator's (411 MB for Qwen2.5-1.5B) until the fit is done.
// Thread safety: every member may be called from any thread; the
// destructor waits for a fit under way (no cancel).
class CalibrationLearner {
 public:
  CalibrationLearner(const CacheGeometry& g, LearnerOptions o);
  ~CalibrationLearner();
  CalibrationLearner(const CalibrationLearner&) = delete;
  CalibrationLearner& operator=(const CalibrationLearner&) = delete;

  // A buffer for the next hand-over (the one kept from the last: its pages
  // stay mapped, so the copy into it is the caller's only cost), or nullopt
  // when the learner is not learning, is busy (counted) or `n_tokens` is
  // less than a run (64). Every begin() that returns a buffer is followed
  // by a submit().
  std::optional<std::vector<uint8_t>> begin(size_t n_tokens);
  // The state of `tokens` copied into the buffer begin() gave; an empty
  // state gives the buffer back unused. copy_ms: what the copy held the caller.
  void submit(std::vector<uint8_t>&& state, std::vector<int32_t>&& tokens, double copy_ms = 0);
  // The calibration once fitted or adopted (state ready or live), else null.
  std::shared_ptr<const Calibration> calibration() const;
  // The caller stores compressed now; `moved` raw prompts moved into its store.
  void mark_live(uint64_t moved);
  LearnerStatus status() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// A store secret file (StoreOptions::secret; kvtc-server's
// --kvtc-secret-file): all its bytes, a trailing newline included. Error
// naming the file when it cannot be read, is empty or shorter than 32
// bytes. `warning`, when given, receives a line when the file can be read
// by its group or others (else "").
std::vector<uint8_t> read_store_secret(const std::string& path, std::string* warning = nullptr);
// A password file (kvtc-server's --kvtc-redis-password-file): its first
// line, without the newline. Error naming the file when it cannot be read
// or the line is empty; `warning` as above.
std::string read_password_file(const std::string& path, std::string* warning = nullptr);

}  // namespace kvtc
