// kvtc-server's prompt cache (server/kvtc_server.h): llama-server's hooks
// onto a kvtc::PromptStore.
#include "kvtc_server.h"

#include <kvtc/kvtc.h>
#include <kvtc/llama.h>
#include <openssl/evp.h>
#include <string.h>  // explicit_bzero
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "llama.h"
#include "server-common.h"
#include "server-task.h"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What the store cannot say itself: how long the server's loop was held.
struct LoopTimes {
  uint64_t saves = 0, restores = 0, restore_failures = 0;
  uint64_t shifted_not_saved = 0;  // saves refused: the slot's cache was shifted (context shift)
  double save_ms = 0, save_max_ms = 0;
  double restore_ms = 0, restore_max_ms = 0;
  // Every load, hit or miss: the lookup (and a Redis round trip when the
  // local tiers hold less than the prompt) holds the loop even when it finds
  // nothing, so a slow or frozen Redis shows here (issue 28: 5.8 s before
  // the per-exchange deadlines; bounded by 2 x redis_lookup_timeout_ms +
  // the fetch's bytes + decoding now, docs/server.md "Time").
  uint64_t lookups = 0;
  double lookup_ms = 0, lookup_max_ms = 0;
  // Prefetches (HTTP threads, kvtc_server_prefetch): lookups and decoding
  // a request waits for before its task is queued, off the loop.
  uint64_t prefetches = 0, prefetch_hits = 0, prefetch_used = 0, prefetch_dropped = 0;
  double prefetch_ms = 0, prefetch_max_ms = 0;
  // Restore or recompute: both costs per token as measured on this server
  // (exponential means, 0 until measured), and the lookups not made because
  // restoring measured slower.
  // Decayed sums (ms, tokens): a mean weighted by tokens, so that a restore
  // of a 24-token chat template does not outweigh one of 4K tokens.
  double restore_ms_sum = 0, restore_tokens_sum = 0, prefill_ms_sum = 0, prefill_tokens_sum = 0;
  uint64_t declined = 0, declined_run = 0;
  double restore_ms_per_token() const { return restore_tokens_sum > 0 ? restore_ms_sum / restore_tokens_sum : 0; }
  double prefill_ms_per_token() const { return prefill_tokens_sum > 0 ? prefill_ms_sum / prefill_tokens_sum : 0; }
  double perf_ms = -1;  // the context's prompt-processing counters at the last sample
  int64_t perf_tokens = 0;
};

// Restore or recompute (issue 29): a restore's cost per token it restores
// (lookup, Redis, decoding, state load) against llama.cpp's own prompt
// processing per token (llama_perf_context: t_p_eval_ms over n_p_eval, the
// batches of more than one token, every slot's), each an exponential mean
// decayed by 1/4 per sample (a mean over the last few, weighted by tokens). On 2 EPYC cores kvtc restores SmolLM2 at ~0.2 ms
// per token and prefills at ~4 ms (bench/results/serve-smollm2.md); a GPU
// prefills at a few thousand tokens a second, where a CPU decode can lose.
constexpr double kCostAlpha = 0.25;
constexpr int64_t kPrefillSampleTokens = 128;  // a sample spans at least this many prompt tokens
// While restores are declined, every 16th candidate restores anyway, so a
// cost that changed (a Redis that recovered, a busier GPU) is seen again.
constexpr uint64_t kExploreEvery = 16;

void decayed_add(double& ms_sum, double& tokens_sum, double ms, double tokens) {
  ms_sum = (1 - kCostAlpha) * ms_sum + ms;
  tokens_sum = (1 - kCostAlpha) * tokens_sum + tokens;
}

// Loop thread (it reads the context's counters); `t` under its mutex.
void sample_prefill(LoopTimes& t, llama_context* ctx) {
  const llama_perf_context_data d = llama_perf_context(ctx);
  if (t.perf_ms < 0 || d.n_p_eval < t.perf_tokens) {  // first sample, or the counters were reset
    t.perf_ms = d.t_p_eval_ms;
    t.perf_tokens = d.n_p_eval;
    return;
  }
  if (d.n_p_eval - t.perf_tokens < kPrefillSampleTokens) return;
  decayed_add(t.prefill_ms_sum, t.prefill_tokens_sum, d.t_p_eval_ms - t.perf_ms, double(d.n_p_eval - t.perf_tokens));
  t.perf_ms = d.t_p_eval_ms;
  t.perf_tokens = d.n_p_eval;
}

// Whether to ask the store for a prompt now: yes until both costs are
// measured, then while a restore costs at most max_cost x recomputing. `t`
// under its mutex.
bool restore_pays(LoopTimes& t, double max_cost) {
  const double r = t.restore_ms_per_token(), c = t.prefill_ms_per_token();
  if (r <= 0 || c <= 0 || r <= max_cost * c) {
    t.declined_run = 0;
    return true;
  }
  if (++t.declined_run % kExploreEvery == 0) return true;
  ++t.declined;
  return false;
}

// The attached store, for /metrics (HTTP threads) as well as the loop.
std::mutex g_mu;
std::weak_ptr<kvtc_prompt_cache::impl> g_live;
std::string g_disabled;  // why kvtc was disabled while the server ran on (waking from sleep), or ""

// The tenant of each slot's cells: the tenant of the last task that used
// the slot ("" for a slot no tenant used). Kept here, not in the store,
// because the slots outlive a store disabled on waking. Loop thread only.
std::map<int32_t, std::string> g_slot_tenant;

const std::string& slot_tenant(int32_t id_slot) {
  return g_slot_tenant[id_slot];
}

// A salt's bytes at most: a client's random salt or a hash of a user id
// needs 22 (128 bits in base64) to 64 (a SHA-256 in hex); 256 leaves room
// for readable ones and bounds what every request hashes into its root.
constexpr size_t kCacheSaltMaxBytes = 256;

std::string sha256_hex(const std::string& s) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(s.data(), s.size(), md, &n, EVP_sha256(), nullptr) != 1) throw std::runtime_error("kvtc: SHA-256 failed (OpenSSL)");
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) out += {hex[md[i] >> 4], hex[md[i] & 15]};
  return out;
}

// The API key a request authenticated with, as llama-server's
// middleware_validate_api_key reads it: the Authorization header (without
// "Bearer "), or X-Api-Key when there is none; header names in any case.
std::string api_key_of(const std::map<std::string, std::string>& headers) {
  auto header = [&](const char* name) {
    for (const auto& [k, v] : headers)
      if (k.size() == std::strlen(name) &&
          std::equal(k.begin(), k.end(), name, [](char a, char b) { return std::tolower(uint8_t(a)) == std::tolower(uint8_t(b)); }))
        return v;
    return std::string();
  };
  std::string key = header("Authorization");
  if (key.empty()) key = header("X-Api-Key");
  if (key.rfind("Bearer ", 0) == 0) key = key.substr(7);
  return key;
}

}  // namespace

struct kvtc_prompt_cache::impl {
  // The learner's thread reads the members below (mu, times, ready): it
  // stops first (a fit under way finishes: CalibrationFitter::finish has no cancel).
  ~impl() { learner.reset(); }
  // --kvtc-calib auto: the learner, and whether the store is in place (set
  // once, by the loop, after `store`; read by HTTP threads before they touch it).
  std::unique_ptr<kvtc::CalibrationLearner> learner;
  std::unique_ptr<kvtc::PromptStore> ready;  // built by the learner's on_ready, off the loop; update() puts it in place (under mu)
  std::atomic<bool> live{false};
  // A slot whose cells a context shift moved: its tokens from n_keep on
  // (at most kShiftWindow of them) right after the shift. While the slot's
  // tokens still continue them, its cache is the shifted one.
  static constexpr size_t kShiftWindow = 32;
  struct Shift {
    size_t n_keep = 0;
    std::vector<llama_token> after;
  };
  std::map<int32_t, Shift> shifted;  // loop thread only
  // Slots whose cells the last load() restored (loop thread only): for a
  // sliding-window model those hold exactly the window at the restored
  // prompt's end (kvtc_server_window_restored).
  std::set<int32_t> restored;
  std::unique_ptr<kvtc::PromptStore> store;
  kvtc::CacheGeometry geom;  // the model's, as the store keys it
  kvtc::StateLayout layout;  // of the server's context (seq_id set per restore); written under pf_mu after start
  kvtc::StoreOptions opt;
  std::string calib_path;
  mutable std::mutex mu;  // guards times and state_bytes_per_token
  LoopTimes times;
  // A slot state's bytes per token at the last save (0 before one), for the
  // prefetch to ready a buffer of the right size for the coming save.
  double state_bytes_per_token = 0;
  // Prefetched restores waiting for their task's load(), newest last; and
  // what each idle slot holds (its tenant, its tokens), for the prefetch to
  // compare with. Both under pf_mu (HTTP threads and the loop).
  struct Prefetched {
    std::string tenant;
    llama_tokens tokens;  // the request's prompt
    uint32_t held = 0;    // the prefix an idle slot held when the store was asked (a match had to beat it)
    // LoopTimes::saves before the store was asked: a save since then (the
    // request's own previous turn, still in its slot when a quick client's
    // next request arrived) may hold what the prefetch could not find.
    uint64_t saves_at = 0;
    // The state for llama_state_seq_set_data, built for sequence 0: at the
    // pinned llama.cpp the host path reads the blob's sequence ids and
    // discards them (llama_context::state_seq_set_data, then
    // llama_kv_cache::state_read_meta: "directly discard it - we will use
    // dest_seq_id instead"), so it loads into whichever slot runs the task.
    std::optional<kvtc::PromptStore::StateMatch> m;
    uint64_t bytes = 0;
    double ms = 0;  // its lookup, Redis round trips and decoding
    Clock::time_point at;
    // cache_prompt false: the task recomputes its prompt whatever the slot
    // receives (upstream loads, then starts at n_past 0), so nothing is restored.
    bool recompute = false;
  };
  std::mutex pf_mu;
  std::deque<Prefetched> prefetched;
  uint64_t prefetched_bytes = 0;
  std::map<int32_t, std::pair<std::string, llama_tokens>> idle;
};

namespace {
// Prefetched restores kept at most (a task is queued right after its
// prefetch, so one waits only while the slots are busy): 8, 1 GiB of
// decoded state (f16; a 4K-token SmolLM2 prompt is 90 MiB), 60 s each.
constexpr size_t kPrefetchMax = 8;
constexpr uint64_t kPrefetchBytes = 1ull << 30;
constexpr double kPrefetchTtlMs = 60000;

size_t common_prefix(const llama_tokens& a, const llama_tokens& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}
}  // namespace

kvtc_server_params& kvtc_server_config() {
  static kvtc_server_params p;
  return p;
}

bool kvtc_server_take_args(int& argc, char** argv, std::string& err) {
  kvtc_server_params& p = kvtc_server_config();
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], val;
    if (a == "-h" || a == "--help" || a == "--usage") {
      std::printf(
          "----- kvtc (compressed prompt cache) -----\n\n"
          "--kvtc-calib FNAME       kvtc calibration of this model (kvtc calibrate); enables kvtc: the prompt cache\n"
          "                         (--cache-ram, now of compressed bytes) keeps prompts compressed\n"
          "--kvtc-calib auto        learn the calibration from the prompts served: they are kept raw (upstream's cache) until\n"
          "                         it is fitted (in the background), then compressed; written beside --kvtc-disk, reused at start\n"
          "--kvtc-calib-tokens N    auto: tokens learned before the fit (default: 32768; held out: N/16 more)\n"
          "--kvtc-calib-share X     auto: learning's CPU time at most X times the prefill time of the tokens it learns from\n"
          "                         (tokens are sampled to keep it; default: 0.05)\n"
          "--kvtc-ratio N           nominal compression ratio of the coded tokens (default: 16)\n"
          "--kvtc-ratio-global N    sliding-window (iSWA) models: the global layers' ratio (default: min(--kvtc-ratio, 4):\n"
          "                         the long-range memory; bench/results/swa.md)\n"
          "--kvtc-disk PATH         a disk tier below RAM: compressed prompts survive restarts\n"
          "--kvtc-disk-mib N        the disk tier's budget in MiB (default: 0, no limit)\n"
          "--kvtc-pending-mib N     raw state waiting to be compressed, in MiB, at most; a save past it is not taken\n"
          "                         (default: 0, the largest of 1024, --cache-ram and two context-full prompts of the model)\n"
          "--kvtc-threads N         threads compressing beside inference (default: 1)\n"
          "--kvtc-window N          the newest tokens of a stored prompt kept raw, uncompressed (default: 128, the paper's)\n"
          "--kvtc-window-bits B     those tokens at B = 16 bits (f16) or 8 (int8 with an f16 scale per key channel / value token,\n"
          "                         container version 3: about half their bytes; default: 8)\n"
          "--kvtc-redis URL         a shared tier below RAM and disk on one Redis, redis://[[user]:password@]host[:port][/db]:\n"
          "                         every replica with the same model, calibration and flags resumes any conversation\n"
          "--kvtc-redis-cluster L   ... or on a Redis Cluster: L = host:port,host:port,... (any of its masters)\n"
          "--kvtc-redis-ttl N       seconds a Redis key lives unless a restore or a save uses it again (default: 86400; 0: no expiry)\n"
          "--kvtc-redis-user U      Redis AUTH user name (ACLs), for --kvtc-redis and --kvtc-redis-cluster\n"
          "--kvtc-redis-password-file F\n"
          "                         Redis AUTH password: the first line of F (kept off the command line), for --kvtc-redis and\n"
          "                         --kvtc-redis-cluster (every node)\n"
          "--kvtc-secret-file F     a secret shared by every replica (F's bytes, at least 32: openssl rand 32 > F; chmod 600):\n"
          "                         every value on disk and in Redis is authenticated (HMAC-SHA256) and bound to its key; one\n"
          "                         written without the secret is dropped, never served; keys cannot be computed without it\n"
          "--kvtc-encrypt           ... and encrypted at rest (AES-256-GCM): disk and Redis hold no readable tokens or KV\n"
          "--kvtc-dp                the DP allocation with DEFLATE (container version 1) instead of entropy-coded pieces (the\n"
          "                         default: one step rate-controlled to --kvtc-ratio, rANS, docs/format.md version 2; ~20%\n"
          "                         fewer bytes at equal error); sliding-window (iSWA) models' pieces are DP-coded either way\n"
          "--kvtc-ecsq              entropy-coded pieces, the default (refused where they cannot be: iSWA models, --kvtc-dp)\n"
          "--kvtc-raw               store raw f16 pieces through the same tiers, uncompressed (a baseline for benchmarks)\n"
          "--kvtc-no-prefetch       restore on the server loop, as before restores moved to the request's thread (a baseline for\n"
          "                         benchmarks: every slot pauses while one restores)\n"
          "--kvtc-restore-max-cost X  ask the store only while a restore measures at most X times the prefill of the tokens\n"
          "                         it restores (both measured as the server runs; default: 1, the faster of the two)\n"
          "--kvtc-tenant-from-api-key  every request is its API key's tenant (with --api-key/--api-key-file): prompts are never\n"
          "                         shared between keys; a request's cache_salt then separates tenants within a key\n\n");
    }
    if (a.rfind("--kvtc-", 0) != 0) {
      argv[out++] = argv[i];
      continue;
    }
    if (a == "--kvtc-no-prefetch") {
      p.prefetch = false;
      continue;
    }
    if (a == "--kvtc-raw" || a == "--kvtc-ecsq" || a == "--kvtc-dp" || a == "--kvtc-encrypt" || a == "--kvtc-tenant-from-api-key") {  // no value
      (a == "--kvtc-raw"       ? p.raw
       : a == "--kvtc-ecsq"    ? p.ecsq
       : a == "--kvtc-dp"      ? p.dp
       : a == "--kvtc-encrypt" ? p.encrypt
                               : p.tenant_from_api_key) = true;
      continue;
    }
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      val = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (i + 1 < argc) {
      val = argv[++i];
    } else {
      err = a + ": a value is expected";
      return false;
    }
    try {
      size_t used = 0;
      if (a == "--kvtc-calib") {
        p.calib = val;
        used = val.size();
      } else if (a == "--kvtc-disk") {
        p.disk = val;
        used = val.size();
      } else if (a == "--kvtc-redis") {
        p.redis = val;
        used = val.size();
      } else if (a == "--kvtc-redis-cluster") {
        p.redis_cluster.clear();
        for (size_t at = 0; at <= val.size();) {
          const size_t c = std::min(val.find(',', at), val.size());
          if (c > at) p.redis_cluster.push_back(val.substr(at, c - at));
          at = c + 1;
        }
        used = p.redis_cluster.empty() ? 0 : val.size();
      } else if (a == "--kvtc-ratio") {
        p.ratio = std::stod(val, &used);
        if (!(p.ratio >= 1 && p.ratio <= 4096)) throw std::out_of_range("");
      } else if (a == "--kvtc-ratio-global") {
        p.global_ratio = std::stod(val, &used);
        if (!(p.global_ratio >= 1 && p.global_ratio <= 4096)) throw std::out_of_range("");
      } else if (a == "--kvtc-disk-mib") {
        p.disk_mib = std::stoll(val, &used);
        if (p.disk_mib < 0) throw std::out_of_range("");
      } else if (a == "--kvtc-pending-mib") {
        p.pending_mib = std::stoll(val, &used);
        if (p.pending_mib < 0 || p.pending_mib > (int64_t(1) << 40)) throw std::out_of_range("");
      } else if (a == "--kvtc-window") {
        p.window = std::stoi(val, &used);
        if (p.window < 0 || p.window > 65536) throw std::out_of_range("");
      } else if (a == "--kvtc-window-bits") {
        p.window_bits = std::stoi(val, &used);
        if (p.window_bits != 8 && p.window_bits != 16) throw std::out_of_range("");
      } else if (a == "--kvtc-threads") {
        p.threads = std::stoi(val, &used);
        if (p.threads < 1 || p.threads > 1024) throw std::out_of_range("");
      } else if (a == "--kvtc-secret-file" || a == "--kvtc-redis-password-file") {
        // Read now: a missing, empty or short file stops the start before
        // the model loads, with an error naming it.
        std::string warning;
        try {
          if (a == "--kvtc-secret-file") {
            p.secret_file = val;
            p.secret = kvtc::read_store_secret(val, &warning);
          } else {
            p.redis_password_file = val;
            p.redis_password = kvtc::read_password_file(val, &warning);
          }
        } catch (const std::exception& e) {
          err = a + ": " + e.what();
          return false;
        }
        if (!warning.empty()) p.warnings.push_back(a + " " + warning);
        used = val.size();
      } else if (a == "--kvtc-redis-user") {
        p.redis_user = val;
        used = val.size();
      } else if (a == "--kvtc-calib-tokens") {
        p.calib_tokens = std::stoll(val, &used);
        if (p.calib_tokens < 64 || p.calib_tokens > (int64_t(1) << 32)) throw std::out_of_range("");
      } else if (a == "--kvtc-calib-share") {
        p.calib_share = std::stod(val, &used);
        if (!(p.calib_share > 0 && p.calib_share <= 1000)) throw std::out_of_range("");
      } else if (a == "--kvtc-restore-max-cost") {
        p.restore_max_cost = std::stod(val, &used);
        if (!(p.restore_max_cost > 0 && p.restore_max_cost <= 1e9)) throw std::out_of_range("");
      } else if (a == "--kvtc-redis-ttl") {
        p.redis_ttl_s = std::stoll(val, &used);
        if (p.redis_ttl_s < 0) throw std::out_of_range("");
      } else {
        err = a +
              ": unknown kvtc flag (--kvtc-calib, --kvtc-calib-tokens, --kvtc-calib-share, --kvtc-ratio, --kvtc-ratio-global, --kvtc-disk, "
              "--kvtc-disk-mib, "
              "--kvtc-pending-mib, --kvtc-threads, --kvtc-window, "
              "--kvtc-redis, --kvtc-redis-cluster, --kvtc-redis-ttl, --kvtc-redis-user, --kvtc-redis-password-file, --kvtc-secret-file, "
              "--kvtc-encrypt, --kvtc-ecsq, --kvtc-dp, --kvtc-raw, --kvtc-no-prefetch, --kvtc-restore-max-cost, --kvtc-tenant-from-api-key)";
        return false;
      }
      if (used != val.size() || val.empty()) throw std::invalid_argument("");
    } catch (const std::exception&) {
      err = a + ": bad value '" + val +
            "' (ratio in [1, 4096], restore cost in (0, 1e9], calibration tokens >= 64, share in (0, 1000], window bits 8 or 16, "
            "sizes and threads whole numbers >= 0)";
      return false;
    }
  }
  argc = out;
  argv[argc] = nullptr;
  if (!p.redis.empty() && !p.redis_cluster.empty()) {
    err = "--kvtc-redis and --kvtc-redis-cluster: give one of them";
    return false;
  }
  if ((!p.redis.empty() || !p.redis_cluster.empty()) && p.calib.empty()) {
    err = "--kvtc-redis needs --kvtc-calib";
    return false;
  }
  if (p.tenant_from_api_key && p.calib.empty()) {
    err = "--kvtc-tenant-from-api-key needs --kvtc-calib (tenants are kvtc's prompt cache's)";
    return false;
  }
  if (p.encrypt && p.secret.empty()) {
    err = "--kvtc-encrypt needs --kvtc-secret-file (the keys are derived from it)";
    return false;
  }
  if (!p.secret.empty() && p.calib.empty()) {
    err = "--kvtc-secret-file needs --kvtc-calib";
    return false;
  }
  if ((!p.redis_password.empty() || !p.redis_user.empty()) && p.redis.empty() && p.redis_cluster.empty()) {
    err = "--kvtc-redis-password-file and --kvtc-redis-user need --kvtc-redis or --kvtc-redis-cluster";
    return false;
  }
  if (!p.redis_user.empty() && p.redis_password.empty()) {
    err = "--kvtc-redis-user needs --kvtc-redis-password-file";
    return false;
  }
  return true;
}

kvtc_prompt_cache::~kvtc_prompt_cache() = default;

void kvtc_prompt_cache::on_context_shift(int32_t id_slot, const server_tokens& tokens, int32_t n_keep) {
  const llama_tokens t = tokens.get_text_tokens();
  impl::Shift& s = p->shifted[id_slot];
  s.n_keep = size_t(std::max(0, n_keep));
  s.after.assign(t.begin() + std::ptrdiff_t(std::min(s.n_keep, t.size())),
                 t.begin() + std::ptrdiff_t(std::min(s.n_keep + impl::kShiftWindow, t.size())));
  SRV_INF("kvtc: slot %d's cache was shifted past token %zu; not saved while it holds the shifted cells\n", id_slot, s.n_keep);
}

bool kvtc_prompt_cache::save(const server_prompt& prompt, llama_context* ctx, int32_t id_slot) {
  const auto t0 = Clock::now();
  try {
    llama_tokens tokens = prompt.tokens.get_text_tokens();
    if (auto it = p->shifted.find(id_slot); it != p->shifted.end()) {
      const impl::Shift& s = it->second;
      const bool still = tokens.size() > s.n_keep &&
                         std::equal(s.after.begin(), s.after.begin() + std::ptrdiff_t(std::min(s.after.size(), tokens.size() - s.n_keep)),
                                    tokens.begin() + std::ptrdiff_t(s.n_keep));
      if (still) {
        std::lock_guard<std::mutex> g(p->mu);
        ++p->times.shifted_not_saved;
        return false;
      }
      p->shifted.erase(it);  // the shifted cells are gone: the slot was recomputed past n_keep
    }
    if (tokens.empty()) return false;
    // The size is counted without copying; the store is asked before the
    // copy (which holds the loop) whether it wants these tokens and has
    // room for this much raw state (max_pending_bytes: counted and logged
    // when not).
    const size_t size = llama_state_seq_get_size_ext(ctx, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE);
    const std::string& tenant = slot_tenant(id_slot);  // the cells' own (a slot changing tenants is saved before it changes)
    if (!p->store->wants(tokens, size, tenant)) return false;
    // Each step's share of the hold is logged: where a long hold comes from
    // (a lock, page faults, the copy) is not otherwise visible.
    const double ms_ask = ms_since(t0);
    // A kept buffer when there is one: a fresh one's page faults cost more
    // than the copy (StoreOptions::spare_state_buffers).
    bool kept = false;
    std::vector<uint8_t> blob = p->store->state_buffer(size, &kept);
    const double ms_buf = ms_since(t0) - ms_ask;
    if (llama_state_seq_get_data_ext(ctx, blob.data(), size, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE) != size) {
      SRV_WRN("kvtc: could not read slot %d's state; not saved\n", id_slot);
      return false;
    }
    const double ms_copy = ms_since(t0) - ms_ask - ms_buf;
    const size_t n = tokens.size();
    p->store->put_state(std::move(tokens), std::move(blob), tenant);
    const double ms = ms_since(t0);
    {
      std::lock_guard<std::mutex> g(p->mu);
      ++p->times.saves;
      p->state_bytes_per_token = double(size) / double(n);
      p->times.save_ms += ms;
      p->times.save_max_ms = std::max(p->times.save_max_ms, ms);
    }
    SRV_INF(
        "kvtc: saving a %zu-token prompt (%.1f MiB raw) held the loop %.2f ms (asking the store %.2f, %s buffer %.2f, copy %.2f, "
        "queueing %.2f); compressing in the background\n",
        n, size / 1048576.0, ms, ms_ask, kept ? "kept" : "new", ms_buf, ms_copy, ms - ms_ask - ms_buf - ms_copy);
    return true;
  } catch (const std::exception& e) {
    SRV_WRN("kvtc: prompt not saved: %s\n", e.what());
    return false;
  }
}

void kvtc_prompt_cache::on_release(const server_prompt& prompt, llama_context* ctx, int32_t id_slot) {
  {
    std::lock_guard<std::mutex> g(p->mu);
    sample_prefill(p->times, ctx);
  }
  {
    std::lock_guard<std::mutex> g(p->pf_mu);
    p->idle[id_slot] = {slot_tenant(id_slot), prompt.tokens.get_text_tokens()};
  }
  if (!p->live || (p->opt.redis_url.empty() && p->opt.redis_cluster.empty())) return;
  (void)save(prompt, ctx, id_slot);
}

bool kvtc_prompt_cache::load(server_prompt& prompt, const server_tokens& tokens_new, llama_context* ctx, int32_t id_slot) {
  const auto t0 = Clock::now();
  struct Held {  // the loop's time in this call, whatever it returns
    impl& p;
    Clock::time_point t0;
    ~Held() {
      const double ms = ms_since(t0);
      std::lock_guard<std::mutex> g(p.mu);
      ++p.times.lookups;
      p.times.lookup_ms += ms;
      p.times.lookup_max_ms = std::max(p.times.lookup_max_ms, ms);
    }
  } held{*p, t0};
  const llama_tokens want = tokens_new.get_text_tokens();
  const std::string& tenant = slot_tenant(id_slot);
  p->restored.erase(id_slot);  // until a restore below writes its cells
  // This request's prefetch, if it ran: the store was asked already, off the loop.
  std::optional<impl::Prefetched> pf;
  uint64_t saves_now = 0;
  {
    std::lock_guard<std::mutex> g(p->pf_mu);
    p->idle.erase(id_slot);  // busy until released
    for (auto it = p->prefetched.rbegin(); it != p->prefetched.rend(); ++it)
      if (it->tenant == tenant && it->tokens == want) {
        pf = std::move(*it);
        p->prefetched_bytes -= it->bytes;
        p->prefetched.erase(std::next(it).base());
        break;
      }
  }
  if (pf && pf->recompute) return true;
  {
    std::lock_guard<std::mutex> g(p->mu);
    sample_prefill(p->times, ctx);
    saves_now = p->times.saves;
    // No prefetch ran (--kvtc-no-prefetch, or it was dropped): the choice is made here.
    if (!pf && !restore_pays(p->times, kvtc_server_config().restore_max_cost)) return true;
  }
  // The match: the prefetch's when it beats what the slot holds; else,
  // when the prefetch compared with less than the slot holds or did not
  // run, the store asked here, on the loop.
  std::optional<kvtc::PromptStore::StateMatch> m;
  bool prefetched = false;
  double off_loop_ms = 0;  // the prefetch's own time (lookup, Redis, decoding)
  if (pf) {
    const size_t have = common_prefix(prompt.tokens.get_text_tokens(), want);
    if (pf->m && pf->m->common_prefix > have) {
      m = std::move(pf->m);
      prefetched = true;
      off_loop_ms = pf->ms;
    } else if (have >= pf->held && saves_now == pf->saves_at) {
      return true;  // nothing stored beats the slot's own: the prefetch asked the store, and nothing was saved since
    }
    // Else the store is asked again here: a prompt saved after the prefetch
    // (its own previous turn, when the request came before that turn's slot
    // was released and then taken by another task) would otherwise be
    // recomputed (seen in the two-slot test under load: 1 run in 8).
  }
  try {
    if (!m) {
      kvtc::StateLayout to = p->layout;
      to.seq_id = id_slot;
      // The slot is the new task's tenant's by now (kvtc_server_switch_tenant
      // emptied it if it was another's): its prompt is that tenant's too.
      m = p->store->take_state(prompt.tokens.get_text_tokens(), want, to, tenant);
      if (!m) return true;  // nothing better than what the slot holds
    }
    const size_t n = llama_state_seq_set_data_ext(ctx, m->state.data(), m->state.size(), id_slot, LLAMA_STATE_SEQ_FLAGS_NONE);
    if (n != m->state.size()) throw kvtc::Error("llama.cpp refused the restored state (" + std::to_string(m->state.size()) + " bytes)");
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> g(p->mu);
    ++p->times.restore_failures;
    SRV_WRN("kvtc: restore failed, recomputing the prompt: %s\n", e.what());
    return false;
  }
  prompt.tokens = server_tokens(m->tokens, false);
  prompt.checkpoints.clear();
  p->restored.insert(id_slot);
  const double ms = ms_since(t0);
  {
    std::lock_guard<std::mutex> g(p->mu);
    ++p->times.restores;
    p->times.prefetch_used += prefetched;
    if (m->common_prefix > 0) decayed_add(p->times.restore_ms_sum, p->times.restore_tokens_sum, off_loop_ms + ms, double(m->common_prefix));
    p->times.restore_ms += ms;
    p->times.restore_max_ms = std::max(p->times.restore_max_ms, ms);
  }
  // "in <ms>": the whole restore (bench/serve.py reads this line); then
  // how much of it held the loop when the decoding ran off it.
  const std::string redis = m->redis_bytes ? string_format(" (Redis round trips %.2f ms, %.3f MiB)", m->redis_ms, m->redis_bytes / 1048576.0) : "";
  const std::string loop = prefetched ? string_format("; decoded off the loop, which it held %.2f ms", ms) : "";
  SRV_INF("kvtc: restored %u tokens (common prefix) from the %s tier in %.2f ms%s%s\n", m->common_prefix, m->tier, off_loop_ms + ms, redis.c_str(),
          loop.c_str());
  return true;
}

bool kvtc_server_window_restored(server_prompt_cache* cache, int32_t id_slot, int32_t pos_min, int32_t pos_next, int32_t n_swa, bool has_new_tokens) {
  if (!cache || !cache->kvtc || n_swa <= 0) return false;
  auto& restored = cache->kvtc->p->restored;
  if (!restored.erase(id_slot)) return false;  // the slot's own cells: upstream's rule
  // A token at position p reads the window positions (p - n_swa, p]
  // (llama_hparams::is_masked_swa, standard windows): the first one
  // computed, pos_next (or pos_next - 1 when the last prompt token is
  // evaluated again), needs its cells from pos_next - n_swa + 1 on.
  // Upstream asks its own cells for two more (pos_min < pos_next - n_swa),
  // which a state never holds: llama.cpp writes only the window's n_swa
  // cells (llama_kv_cache::state_write), so its own saved states fail it too.
  const int32_t need = std::max<int32_t>(0, pos_next - n_swa + 1 - (has_new_tokens ? 0 : 1));
  if (pos_min > need) return false;
  SRV_DBG("kvtc: slot %d's restored window starts at %d; the next token reads from %d\n", id_slot, pos_min, need);
  return true;
}

bool kvtc_prompt_cache::learning() const {
  return !p->live.load(std::memory_order_relaxed);  // the loop sets it
}

bool kvtc_prompt_cache::raw_cache_allowed(int32_t id_slot) const {
  return slot_tenant(id_slot).empty();
}

bool kvtc_prompt_cache::learn(const server_prompt& prompt, llama_context* ctx, int32_t id_slot) {
  const bool raw_ok = slot_tenant(id_slot).empty();
  llama_tokens tokens = prompt.tokens.get_text_tokens();
  std::optional<std::vector<uint8_t>> buf = p->learner->begin(tokens.size());
  if (!buf) return raw_ok;  // not learning, busy, or less than one run
  // The copy holds the loop (~1 ms for 10 MiB into a kept buffer); the
  // parsing and learning run on the learner's thread.
  const auto t0 = Clock::now();
  const size_t size = llama_state_seq_get_size_ext(ctx, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE);
  if (buf->capacity() < size) {
    // Half as much again, as the store's save buffers (a conversation's next
    // turn still fits), and no copy of the old bytes: Qwen's 1.5K-token
    // states (~42 MiB) held the loop 19-34 ms when the kept one grew.
    *buf = std::vector<uint8_t>();
    buf->reserve(size + size / 2);
  }
  buf->resize(size);
  if (llama_state_seq_get_data_ext(ctx, buf->data(), size, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE) != size) buf->clear();
  p->learner->submit(std::move(*buf), std::move(tokens), ms_since(t0));
  return raw_ok;
}

bool kvtc_prompt_cache::update(std::list<server_prompt_cache_state>& raw) {
  if (!p->live) {
    std::unique_ptr<kvtc::PromptStore> ready;
    {
      std::lock_guard<std::mutex> g(p->mu);
      ready = std::move(p->ready);
    }
    if (!ready) return false;  // still learning (or failed): upstream's cache serves
    p->store = std::move(ready);
    p->live.store(true, std::memory_order_release);
    // What upstream's cache held moves into the store, compressed by the
    // worker like any save (learn() let it keep no tenant's prompt).
    uint64_t moved = 0, bytes = 0;
    for (server_prompt_cache_state& st : raw) {
      llama_tokens tokens = st.prompt.tokens.get_text_tokens();
      const size_t n = st.data.main.size();
      if (n == 0 || !st.data.drft.empty() || !p->store->wants(tokens, n, "")) continue;
      p->store->put_state(std::move(tokens), std::move(st.data.main), "");
      ++moved;
      bytes += n;
    }
    raw.clear();
    p->learner->mark_live(moved);
    SRV_INF("kvtc: --kvtc-calib auto: the compressed store is in place; %llu raw prompts (%.1f MiB) moved into it\n", (unsigned long long)moved,
            bytes / 1048576.0);
  }
  const kvtc::StoreStats s = p->store->stats();
  SRV_INF("kvtc: %llu prompts in RAM (%llu chunks, %.2f MiB compressed), %llu on disk (%.2f MiB), %llu queued\n", (unsigned long long)s.entries,
          (unsigned long long)s.chunks, s.ram_bytes / 1048576.0, (unsigned long long)s.disk_entries, s.disk_bytes / 1048576.0,
          (unsigned long long)s.pending);
  return true;
}

namespace {

// The store over `cal`, with its start-up lines in the log. `name`: where
// the calibration came from (a file), named in its errors.
std::unique_ptr<kvtc::PromptStore> open_store(const kvtc_prompt_cache::impl& I, const kvtc::Calibration& cal, const std::string& name) {
  const kvtc_server_params& cfg = kvtc_server_config();
  const kvtc::StoreOptions& o = I.opt;
  std::unique_ptr<kvtc::PromptStore> store;
  try {
    store = std::make_unique<kvtc::PromptStore>(cal, I.geom, o);
  } catch (const kvtc::Error& e) {
    const std::string w = e.what();
    throw kvtc::Error(w.rfind("redis", 0) == 0 ? w : name + ": " + w);  // a bad --kvtc-redis names itself
  }
  const kvtc::StoreStats s = store->stats();
  const double global = kvtc::global_ratio_of(I.geom, o);
  if (o.raw) SRV_INF("%s\n", "kvtc: --kvtc-raw: pieces are stored as raw f16, uncompressed (a baseline)");
  if (!o.raw && o.window_bits == 8)
    SRV_INF("kvtc: the newest %u tokens of a prompt are kept raw at 8 bits (container version 3; --kvtc-window-bits 16: f16)\n", o.window);
  if (!o.raw)
    SRV_INF("%s\n", o.entropy_coded && I.geom.blocks.size() == 1
                        ? "kvtc: pieces are entropy-coded (container version 2; --kvtc-dp: the DP allocation with DEFLATE)"
                        : "kvtc: pieces are DP-coded with DEFLATE (container version 1)");
  SRV_INF(
      "kvtc: prompt cache compressed %.4gx%s with %s (calibration %.16s, store %.16s); RAM budget %.0f MiB; pending budget %.0f MiB; disk tier "
      "%s%s\n",
      o.ratio, global > 0 ? string_format(" (the global layers %.4gx, the window %.4gx)", global, o.ratio).c_str() : "", name.c_str(), cal.id.c_str(),
      store->fingerprint().c_str(), o.ram_bytes / 1048576.0, o.max_pending_bytes / 1048576.0,
      cfg.disk.empty() ? "off" : (s.disk_enabled ? cfg.disk.c_str() : "DISABLED: "),
      s.disk_enabled ? (" (" + std::to_string(s.disk_scan_pending) + " entry files found: prompts read back in the background)").c_str()
                     : s.disk_error.c_str());
  SRV_INF("kvtc: the store's keys name the context's settings: %s\n", o.kv_settings.text().c_str());
  // What protects the values outside the process (never the secret: its
  // key id names it, so replicas that print the same id share a store).
  const std::string& prot = store->protection();
  if (!prot.empty())
    SRV_INF("kvtc: secret %s (key id %s): every value on disk and in Redis is %s and bound to its key; foreign values are dropped\n",
            cfg.secret_file.c_str(), prot.substr(prot.find("key=") + 4).c_str(),
            o.encrypt ? "encrypted and authenticated (AES-256-GCM)" : "authenticated (HMAC-SHA256), not encrypted");
  else if (!cfg.disk.empty() || s.redis_enabled)
    SRV_INF("%s\n",
            "kvtc: no --kvtc-secret-file: values on disk and in Redis are neither authenticated nor encrypted (whoever can write there "
            "can plant KV this server serves; docs/server.md)");
  if (s.redis_enabled)
    SRV_INF("kvtc: Redis tier %s: %s\n", s.redis_where.c_str(),
            s.redis_up ? "connected" : ("unreachable for now (retrying): " + s.redis_error).c_str());
  return store;
}

// The store keeps only the keys derived from the secret; no other copy of
// it or of the Redis password (its client keeps its own) stays here once
// the store is built.
void wipe_secrets(kvtc_prompt_cache::impl& I) {
  auto wipe = [](auto& v) {
    if (!v.empty()) explicit_bzero(v.data(), v.size());
    v.clear();
  };
  wipe(I.opt.secret);
  wipe(kvtc_server_config().secret);
  wipe(I.opt.redis_password);
  wipe(kvtc_server_config().redis_password);
}

// --kvtc-calib auto's options for kvtc::find_learned_calibration and the
// learner: the file beside the disk tier, the fleet through Redis, the
// stride following the loop's measured prefill, the server's log.
kvtc::LearnerOptions learner_options(const std::shared_ptr<kvtc_prompt_cache::impl>& I) {
  const kvtc_server_params& cfg = kvtc_server_config();
  kvtc::LearnerOptions lo;
  lo.tokens = uint64_t(cfg.calib_tokens);
  lo.share = cfg.calib_share;
  lo.ratio = cfg.ratio;
  lo.file = cfg.disk.empty() ? "" : kvtc::learned_calibration_file(cfg.disk, I->geom.model_sha256);
  lo.fleet = I->opt;
  lo.fleet.log = [](const std::string& s) { SRV_WRN("%s\n", s.c_str()); };
  kvtc_prompt_cache::impl* raw = I.get();  // the learner stops before impl's other members go (~impl)
  lo.prefill_ms_per_token = [raw] {
    std::lock_guard<std::mutex> g(raw->mu);
    return raw->times.prefill_ms_per_token();
  };
  lo.log = [](bool warning, const std::string& s) {
    if (warning)
      SRV_WRN("%s\n", s.c_str());
    else
      SRV_INF("%s\n", s.c_str());
  };
  return lo;
}

void start_learner(const std::shared_ptr<kvtc_prompt_cache::impl>& I, kvtc::LearnerOptions lo) {
  const std::string file = lo.file;
  kvtc_prompt_cache::impl* raw = I.get();
  // The store is opened on the learner's thread, off the loop; update() puts it in place.
  lo.on_ready = [raw](const kvtc::Calibration& c, const std::string& name) {
    std::unique_ptr<kvtc::PromptStore> store = open_store(*raw, c, name);
    wipe_secrets(*raw);
    std::lock_guard<std::mutex> g(raw->mu);
    raw->ready = std::move(store);
  };
  I->learner = std::make_unique<kvtc::CalibrationLearner>(I->geom, std::move(lo));
  SRV_INF(
      "kvtc: --kvtc-calib auto: no calibration yet: prompts are kept raw (upstream's cache, --cache-ram) while %lld tokens of the prompts "
      "served are learned (sampled to cost at most %.3g of their prefill time)%s\n",
      (long long)kvtc_server_config().calib_tokens, kvtc_server_config().calib_share,
      file.empty() ? "; no --kvtc-disk: the calibration will not be kept across restarts" : ("; then written to " + file).c_str());
}

}  // namespace

bool kvtc_server_attach(server_prompt_cache* cache, const llama_model* model, llama_context* ctx, const std::string& model_path,
                        int32_t cache_ram_mib, bool has_draft, bool has_mtmd, bool has_lora, bool has_kv_overrides, bool has_control_vectors,
                        bool has_api_keys, bool resuming) {
  const kvtc_server_params& cfg = kvtc_server_config();
  if (cfg.calib.empty()) return true;
  if (resuming) {
    // Waking from sleep: the model and context are new, the store is the
    // one the server had (the patch kept it). Nothing is reloaded, hashed
    // or rescanned; the new context is checked to compute what the store's
    // keys name, and its layout is learned again. Never refused: a failure
    // here disables kvtc and the server serves on (upstream aborts when
    // this returns false after sleeping).
    if (!cache || !cache->kvtc) return true;  // off before sleeping: stays off
    try {
      const std::shared_ptr<kvtc_prompt_cache::impl>& I = cache->kvtc->p;
      const kvtc::KvSettings now = kvtc::context_kv_settings(ctx);
      if (!(now == I->opt.kv_settings)) throw kvtc::Error("the context's settings changed across sleep: " + now.text());
      const kvtc::StateLayout layout = kvtc::context_state_layout(ctx, I->geom, 0);
      {
        std::lock_guard<std::mutex> g(I->pf_mu);  // prefetches read it
        I->layout = layout;
        I->prefetched.clear();  // built for the context before sleeping
        I->prefetched_bytes = 0;
        I->idle.clear();
      }
      I->shifted.clear();  // the slots start empty
      if (I->live)
        SRV_INF("kvtc: awake with the store kept (%llu prompts in RAM)\n", (unsigned long long)I->store->stats().entries);
      else
        SRV_INF("%s\n", "kvtc: awake, still learning the calibration (--kvtc-calib auto)");
    } catch (const std::exception& e) {
      SRV_WRN("kvtc: disabled after waking, serving without the compressed cache: %s\n", e.what());
      cache->kvtc.reset();
      std::lock_guard<std::mutex> g(g_mu);
      g_disabled = e.what();
    }
    return true;
  }
  auto refuse = [](const std::string& why) {
    SRV_ERR("kvtc: %s\n", why.c_str());
    return false;
  };
  if (!cache) return refuse("--kvtc-calib needs the prompt cache; --cache-ram 0 disables it");
  if (has_mtmd) return refuse("multimodal models (--mmproj) are not supported with --kvtc-calib yet");
  if (has_draft) return refuse("a draft model (speculative decoding) is not supported with --kvtc-calib yet");
  // An adapter changes every key and value: the store's keys would have to name it.
  if (has_lora) return refuse("LoRA adapters are not supported with --kvtc-calib yet");
  // Both change the K/V a model computes without changing its file, which is
  // what the store's keys name (and the calibration was fitted on).
  if (has_kv_overrides)
    return refuse("--override-kv is not supported with --kvtc-calib: it changes the model the store's keys and the calibration name");
  if (has_control_vectors) return refuse("control vectors are not supported with --kvtc-calib yet: they change every layer's keys and values");
  if (llama_model_is_recurrent(model) || llama_model_is_hybrid(model)) return refuse("recurrent and hybrid models keep no KV cache kvtc can code");
  // Without keys every request would be one tenant (""), silently shared.
  if (cfg.tenant_from_api_key && !has_api_keys) return refuse("--kvtc-tenant-from-api-key needs --api-key or --api-key-file");
  try {
    auto I = std::make_shared<kvtc_prompt_cache::impl>();
    I->calib_path = cfg.calib;
    const bool learn = cfg.calib == "auto";
    // The context's RoPE (--rope-freq-base/-scale, --rope-scaling, --yarn-*),
    // not the GGUF's: the codec removes the rotation the keys carry.
    const kvtc::KvSettings kv_settings = kvtc::context_kv_settings(ctx);
    const kvtc::CacheGeometry geom = kvtc::geometry_with_settings(kvtc::model_geometry(model, model_path), kv_settings);
    // A rotation kvtc cannot undo (M-RoPE, say) would fail every save and
    // recompute every prompt: said once, here, rather than at each save.
    if (!cfg.raw)
      for (const kvtc::BlockGeometry& b : geom.blocks)
        if (!b.rope.unsupported.empty())
          return refuse("this model's keys carry a rotation kvtc cannot undo, so they cannot be coded: " + b.rope.unsupported +
                        " (--kvtc-raw stores them uncompressed)");
    if (learn && geom.blocks.size() > 1)
      return refuse(
          "--kvtc-calib auto does not learn sliding-window (iSWA) models yet (their cache keeps two blocks): calibrate once with "
          "`kvtc calibrate -m " +
          model_path + " -o FILE` and pass --kvtc-calib FILE");
    kvtc::StoreOptions& o = I->opt;
    o.ratio = cfg.ratio;
    o.global_ratio = cfg.global_ratio;
    if (geom.blocks.size() == 1 && cfg.global_ratio > 0)
      return refuse("--kvtc-ratio-global is for sliding-window (iSWA) models; this model's cache is one block: use --kvtc-ratio");
    o.raw = cfg.raw;
    if (cfg.ecsq && (cfg.dp || cfg.raw))
      return refuse(std::string("--kvtc-ecsq and ") + (cfg.dp ? "--kvtc-dp" : "--kvtc-raw") + " exclude each other");
    if (cfg.ecsq && geom.blocks.size() > 1)
      return refuse("--kvtc-ecsq: a sliding-window (iSWA) model's pieces are DP-coded (entropy-coded pieces are for single-block caches)");
    o.entropy_coded = !cfg.dp;
    o.ram_bytes = cache_ram_mib > 0 ? uint64_t(cache_ram_mib) << 20 : 0;
    o.disk_dir = cfg.disk;
    o.disk_bytes = uint64_t(cfg.disk_mib) << 20;
    o.redis_url = cfg.redis;
    o.redis_cluster = cfg.redis_cluster;
    o.redis_user = cfg.redis_user;
    o.redis_password = cfg.redis_password;
    o.secret = cfg.secret;
    o.encrypt = cfg.encrypt;
    if (cfg.redis_ttl_s >= 0) o.redis_ttl_s = cfg.redis_ttl_s;
    o.threads = cfg.threads;
    o.window = uint32_t(cfg.window);
    o.window_bits = uint32_t(cfg.window_bits);
    o.kv_settings = kv_settings;  // --rope-freq-base, --rope-scaling, YaRN: part of the salt
    o.restore_threads = 0;        // a restore holds the loop: every core decodes
    // The queue of raw states waiting for the worker: a save is the slot's
    // whole f16 cache, n_tokens x B bytes (B = layers x KV heads x head_dim
    // x 4: 23,040 for SmolLM2-135M, 131,072 for an 8B GQA model, whose 8K
    // tokens are 1 GiB: more than the old fixed budget, so such a prompt was
    // never stored). Room for two prompts as long as a slot holds (one being
    // coded, one waiting), and no less than the library's default, max(1
    // GiB, --cache-ram); --kvtc-pending-mib sets it.
    uint64_t per_token = 0;
    for (const kvtc::BlockGeometry& b : geom.blocks) per_token += uint64_t(b.features()) * 2 * 2;
    const uint64_t context_full = uint64_t(llama_n_ctx_seq(ctx)) * per_token;
    o.max_pending_bytes = cfg.pending_mib > 0 ? uint64_t(cfg.pending_mib) << 20 : std::max({uint64_t(1) << 30, o.ram_bytes, 2 * context_full});
    o.log = [](const std::string& s) { SRV_WRN("%s\n", s.c_str()); };
    for (const std::string& w : cfg.warnings) SRV_WRN("kvtc: %s\n", w.c_str());
    // The context's state layout (V transposed or not, streams per block),
    // which restores are written for; also refuses a quantized cache. The
    // slots have not started yet, so sequence 0 is free for the probe.
    I->geom = geom;
    I->layout = kvtc::context_state_layout(ctx, geom, 0);
    if (!learn) {
      I->store = open_store(*I, kvtc::calibration_load(cfg.calib), cfg.calib);
      wipe_secrets(*I);
      I->live = true;
    } else {
      // A calibration this server learned before (beside the disk tier,
      // or the fleet's in Redis) is used as it is; else it is learned from
      // the prompts served.
      kvtc::LearnerOptions lo = learner_options(I);
      std::string from;
      if (std::optional<kvtc::Calibration> cal = kvtc::find_learned_calibration(geom, lo, &from)) {
        SRV_INF("kvtc: --kvtc-calib auto: the calibration learned before, from %s (%.16s, %s tokens)\n", from.c_str(), cal->id.c_str(),
                cal->meta.count("calib_tokens") ? cal->meta.at("calib_tokens").c_str() : "?");
        I->store = open_store(*I, *cal, from);
        wipe_secrets(*I);
        lo.wipe_secrets();  // the options' copies
        I->live = true;
      } else {
        start_learner(I, std::move(lo));
      }
    }
    cache->kvtc = std::make_unique<kvtc_prompt_cache>();
    cache->kvtc->p = I;
    std::lock_guard<std::mutex> g(g_mu);
    g_live = I;
    return true;
  } catch (const std::exception& e) {
    return refuse(std::string("refusing to start: ") + e.what());
  }
}

void kvtc_server_prefetch(const server_tokens& tokens, const std::string& tenant, bool cache_prompt) {
  if (!kvtc_server_config().prefetch) return;
  std::shared_ptr<kvtc_prompt_cache::impl> I;
  {
    std::lock_guard<std::mutex> g(g_mu);
    I = g_live.lock();
  }
  if (!I || !I->live.load(std::memory_order_acquire)) return;  // no store yet (--kvtc-calib auto)
  const auto t0 = Clock::now();
  try {
    kvtc_prompt_cache::impl::Prefetched e;
    e.tenant = tenant;
    e.tokens = tokens.get_text_tokens();
    if (e.tokens.empty()) return;
    e.recompute = !cache_prompt;
    llama_tokens best;                 // the idle slot of this tenant that shares the most with the prompt: where it will likely run
    size_t longest = e.tokens.size();  // the longest prompt the loop may save next: an idle slot's, or this one's on release
    {
      std::lock_guard<std::mutex> g(I->pf_mu);
      for (const auto& [id, held] : I->idle) {
        longest = std::max(longest, held.second.size());
        if (held.first == tenant && common_prefix(held.second, e.tokens) > e.held) {
          e.held = uint32_t(common_prefix(held.second, e.tokens));
          best = held.second;
        }
      }
    }
    // The save the loop makes when this task takes a slot (or releases
    // it) copies the slot's state into a kept buffer; one that has to be
    // new pays its page faults on the loop (~20 ms for 50 MiB alone,
    // 120-220 ms measured while a restore decodes). Written here instead,
    // off the loop, when none kept has room (the bytes per token of the
    // last save; 2% and 64 KiB of slack for the state's headers).
    double bpt = 0;
    {
      std::lock_guard<std::mutex> g(I->mu);
      bpt = I->state_bytes_per_token;
    }
    if (bpt > 0) I->store->prepare_state_buffer(size_t(double(longest) * bpt * 1.02) + (64u << 10));
    kvtc::StateLayout to;
    {
      std::lock_guard<std::mutex> g(I->pf_mu);
      to = I->layout;
    }
    to.seq_id = 0;  // any slot's (Prefetched::m)
    {
      std::lock_guard<std::mutex> g(I->mu);
      e.saves_at = I->times.saves;
      // Restoring measured slower than recomputing: the task's load() restores nothing.
      if (!e.recompute) e.recompute = !restore_pays(I->times, kvtc_server_config().restore_max_cost);
    }
    if (!e.recompute) e.m = I->store->take_state(best, e.tokens, to, tenant);
    if (e.m) e.bytes = e.m->state.size();
    e.at = Clock::now();
    const double ms = e.ms = ms_since(t0);
    std::lock_guard<std::mutex> g(I->pf_mu);
    // The oldest go first past the bounds (their tasks load on the loop).
    uint64_t dropped = 0;
    while (!I->prefetched.empty() && (I->prefetched.size() >= kPrefetchMax || I->prefetched_bytes + e.bytes > kPrefetchBytes ||
                                      ms_since(I->prefetched.front().at) > kPrefetchTtlMs)) {
      I->prefetched_bytes -= I->prefetched.front().bytes;
      I->prefetched.pop_front();
      ++dropped;
    }
    const bool hit = e.m.has_value();
    if (e.bytes <= kPrefetchBytes) {
      I->prefetched_bytes += e.bytes;
      I->prefetched.push_back(std::move(e));
    } else {
      ++dropped;
    }
    std::lock_guard<std::mutex> tg(I->mu);
    ++I->times.prefetches;
    I->times.prefetch_hits += hit;
    I->times.prefetch_dropped += dropped;
    I->times.prefetch_ms += ms;
    I->times.prefetch_max_ms = std::max(I->times.prefetch_max_ms, ms);
  } catch (const std::exception& x) {
    SRV_WRN("kvtc: prefetch failed (the slot will look on the loop): %s\n", x.what());
  }
}

std::string kvtc_server_metrics() {
  std::shared_ptr<kvtc_prompt_cache::impl> I;
  std::string disabled;
  {
    std::lock_guard<std::mutex> g(g_mu);
    I = g_live.lock();
    disabled = g_disabled;
  }
  if (!I) {
    if (disabled.empty()) return "";
    for (char& c : disabled)
      if (c == '"' || c == '\\' || c == '\n') c = '\'';
    return "# HELP kvtc:disabled kvtc was disabled while the server ran on (the label says why)\n# TYPE kvtc:disabled gauge\nkvtc:disabled{error=\"" +
           disabled + "\"} 1\n";
  }
  LoopTimes t;
  {
    std::lock_guard<std::mutex> g(I->mu);
    t = I->times;
  }
  std::ostringstream o;
  auto item = [&](const char* name, const char* type, const char* help, double v, const std::string& labels = "") {
    o << "# HELP kvtc:" << name << " " << help << "\n# TYPE kvtc:" << name << " " << type << "\nkvtc:" << name << labels << " " << v << "\n";
  };
  if (I->learner) {  // --kvtc-calib auto
    const kvtc::LearnerStatus L = I->learner->status();
    for (const char* st : {"learning", "fitting", "ready", "live", "failed"})
      item("calib_state", "gauge", "--kvtc-calib auto: learning, fitting, ready (the store built), live (prompts stored compressed) or failed",
           L.state == st ? 1 : 0, std::string("{state=\"") + st + "\"}");
    item("calib_tokens_seen_total", "counter", "Tokens of the prompts handed to the learner", double(L.seen));
    item("calib_tokens_new_total", "counter", "Of those, tokens past a prefix learned from before", double(L.fresh));
    item("calib_fit_tokens", "gauge", "Tokens learned for the PCA", double(L.fit));
    item("calib_fit_target", "gauge", "Tokens for the PCA the fit waits for (--kvtc-calib-tokens)", double(L.fit_target));
    item("calib_heldout_tokens", "gauge", "Tokens held out for the block errors", double(L.held));
    item("calib_heldout_target", "gauge", "Held-out tokens the fit waits for", double(L.held_target));
    item("calib_stride", "gauge", "One new token in this many is learned (--kvtc-calib-share)", double(L.stride));
    item("calib_samples_total", "counter", "Slot states learned from", double(L.samples));
    item("calib_samples_busy_total", "counter", "Slot states not taken: the learner was busy with the previous one", double(L.busy));
    item("calib_samples_refused_total", "counter", "Slot states not learned from (not a prompt's cache: shifted)", double(L.refused));
    item("calib_learn_cpu_seconds_total", "counter", "The learner's CPU time (nice 19)", L.cpu_ms / 1e3);
    item("calib_loop_seconds_total", "counter", "Time handing slot states to the learner held the loop (the copy)", L.loop_ms / 1e3);
    item("calib_loop_seconds_max", "gauge", "Longest a hand-over held the loop", L.loop_max_ms / 1e3);
    item("calib_fit_seconds", "gauge", "The fit's time (PCA, held-out errors, tables; 0 before)", L.fit_s);
    item("calib_raw_prompts_moved", "gauge", "Prompts of upstream's raw cache moved into the store when it came in place", double(L.moved));
  }
  if (!I->live.load(std::memory_order_acquire)) {
    // What the learner's stride follows (the store's own lines come once it is in place).
    item("prefill_ms_per_token", "gauge", "llama.cpp's measured prompt processing per token (decayed mean; 0 before the first sample)",
         t.prefill_ms_per_token());
    return o.str();
  }
  const kvtc::StoreStats s = I->store->stats();
  item("ram_prompts", "gauge", "Prompts held compressed in RAM", double(s.entries));
  item("ram_chunks", "gauge", "Distinct prefix chunks held in RAM", double(s.chunks));
  item("ram_bytes", "gauge", "Compressed bytes held in RAM", double(s.ram_bytes));
  item("ram_budget_bytes", "gauge", "The RAM tier's budget (--cache-ram; 0: none)", double(I->opt.ram_bytes));
  // A message as a Prometheus label value: quotes, backslashes and newlines would end it.
  auto label = [](std::string m, const char* name = "error") {
    for (char& c : m)
      if (c == '"' || c == '\\' || c == '\n') c = '\'';
    return std::string("{") + name + "=\"" + m + "\"}";
  };
  item("disk_enabled", "gauge", "1 when the disk tier is in use", s.disk_enabled ? 1 : 0);
  if (!s.disk_error.empty()) item("disk_error", "gauge", "Why the disk tier was disabled (the label)", 1, label(s.disk_error));
  item("disk_prompts", "gauge", "Prompts held on disk", double(s.disk_entries));
  item("disk_chunks", "gauge", "Distinct prefix chunks on disk", double(s.disk_chunks));
  item("disk_bytes", "gauge", "Bytes of the disk tier's files", double(s.disk_bytes));
  item("disk_io_errors_total", "counter", "Disk reads the system refused (EACCES, EMFILE, EIO, ...): a miss, the files kept",
       double(s.disk_io_errors));
  item("disk_missing_total", "counter", "Disk files the index named that were gone (removed from outside); a chunk is rewritten by the next save",
       double(s.disk_missing));
  item("disk_scan_pending", "gauge", "Disk entry files found at start and not verified yet (read back in the background)",
       double(s.disk_scan_pending));
  item("disk_scan_seconds", "gauge", "Time the disk tier's start-up scan took (so far, while it runs)", s.disk_scan_ms / 1e3);
  item("saves_total", "counter", "Prompts stored", double(s.puts));
  item("saves_contained_total", "counter", "Saves not needed: a stored prompt held all their tokens", double(s.puts_contained));
  item("saves_skipped_total", "counter", "Saves refused or failed (logged)", double(s.puts_skipped));
  item("pending", "gauge", "Saves waiting to be compressed", double(s.pending));
  item("pending_bytes", "gauge", "Raw bytes of the saves waiting", double(s.pending_bytes));
  item("pending_budget_bytes", "gauge", "Raw bytes the saves waiting may take (--kvtc-pending-mib); a save past it is not taken",
       double(s.pending_budget));
  item("spare_buffer_bytes", "gauge",
       "Bytes of the buffers kept for the next save, as their last state used them (page faults cost more than the copy)", double(s.spare_bytes));
  item("save_buffers_reused_total", "counter", "Saves that copied into a kept buffer", double(s.buffers_reused));
  item("save_buffers_new_total", "counter", "Saves that copied into a new buffer", double(s.buffers_new));
  item("save_buffers_prepared_total", "counter", "Buffers written off the loop for a coming save (by a request's prefetch)",
       double(s.buffers_prepared));
  item("chunks_written_total", "counter", "Prefix chunks compressed", double(s.chunks_written));
  item("chunks_shared_total", "counter", "Prefix chunks a save found stored already", double(s.chunks_shared));
  if (s.redis_enabled) {
    item("redis_up", "gauge", "1 when the last exchange with Redis worked", s.redis_up ? 1 : 0);
    if (!s.redis_error.empty()) item("redis_last_error", "gauge", "The last Redis failure (the label)", 1, label(s.redis_error));
    if (!s.redis_config_warning.empty())
      item("redis_config_warning", "gauge", "Redis can grow without limit (maxmemory 0) or refuses writes when full (noeviction): the label", 1,
           label(s.redis_config_warning, "warning"));
    item("redis_errors_total", "counter", "Redis exchanges that failed (down, timeout, error reply); the prompt was recomputed",
         double(s.redis_errors));
    item("redis_lookups_total", "counter", "Lookups that asked Redis", double(s.redis_lookups));
    item("redis_lookups_skipped_total", "counter", "Lookups answered as misses without asking, while Redis was failing",
         double(s.redis_lookups_skipped));
    item("redis_lookups_paused", "gauge", "1 while lookups do not ask Redis (one failed; a probe has not yet found it answering in time)",
         s.redis_lookups_paused ? 1.0 : 0.0);
    item("redis_probes_total", "counter", "Background PINGs (every 2 s while lookups are off) that decide when lookups ask Redis again",
         double(s.redis_probes));
    item("redis_missing_total", "counter", "Redis values an index named that were gone (evicted): shorter matches", double(s.redis_missing));
    item("redis_chunks_written_total", "counter", "Prefix chunks written to Redis", double(s.redis_chunks_written));
    item("redis_prompts_written_total", "counter", "Prompts (entries) written to Redis", double(s.redis_entries_written));
    item("redis_prompts_dropped_total", "counter", "Redis entries dropped as contained in a newer prompt", double(s.redis_entries_dropped));
    item("redis_bytes_written_total", "counter", "Bytes written to Redis", double(s.redis_bytes_written));
    item("redis_bytes_read_total", "counter", "Bytes read from Redis", double(s.redis_bytes_read));
    item("redis_redirects_total", "counter", "Redis Cluster MOVED/ASK redirects followed", double(s.redis_redirects));
    item("redis_lookup_seconds_total", "counter", "Time lookups spent in Redis round trips", s.redis_lookup_ms / 1e3);
    item("redis_write_seconds_total", "counter", "Worker time writing to Redis", s.redis_write_ms / 1e3);
  }
  for (const auto& [tier, v] : {std::pair{"ram", s.hits_ram}, {"pending", s.hits_pending}, {"disk", s.hits_disk}, {"redis", s.hits_redis}})
    item("hits_total", "counter", "Restores by tier", double(v), std::string("{tier=\"") + tier + "\"}");
  item("misses_total", "counter", "Lookups that found nothing better than the slot's prompt", double(s.misses));
  item("tokens_restored_total", "counter", "Prompt tokens restored instead of recomputed", double(s.tokens_restored));
  item("dropped_damaged_total", "counter", "Stored prompts or files refused by their checksum or content, dropped", double(s.corrupt_dropped));
  item("dropped_foreign_total", "counter",
       "Values on disk or in Redis that did not open with --kvtc-secret-file (written without it, with another, or moved), dropped unread",
       double(s.foreign_dropped));
  item("restore_failures_total", "counter", "Restores that failed (the prompt was recomputed)", double(t.restore_failures));
  item("compress_seconds_total", "counter", "Worker time compressing saves", s.save_ms / 1e3);
  item("loop_save_seconds_total", "counter", "Time saves held the server loop (state copy)", t.save_ms / 1e3);
  item("loop_save_seconds_max", "gauge", "Longest a save held the server loop", t.save_max_ms / 1e3);
  item("loop_restore_seconds_total", "counter", "Time restores held the server loop (decode unless prefetched, state load)", t.restore_ms / 1e3);
  item("loop_restore_seconds_max", "gauge", "Longest a restore held the server loop", t.restore_max_ms / 1e3);
  item("loop_lookup_seconds_total", "counter", "Time every lookup held the server loop, hits and misses (store, Redis, decode, state load)",
       t.lookup_ms / 1e3);
  item("loop_lookup_seconds_max", "gauge", "Longest a lookup held the server loop, hit or miss", t.lookup_max_ms / 1e3);
  item("loop_lookups_total", "counter", "Lookups (a slot taking a new prompt)", double(t.lookups));
  item("prefetches_total", "counter", "Requests whose stored prompt was looked up and decoded on their HTTP thread, off the loop",
       double(t.prefetches));
  item("prefetch_hits_total", "counter", "Prefetches that found a stored prompt better than an idle slot's", double(t.prefetch_hits));
  item("prefetch_used_total", "counter", "Restores whose decoding was prefetched: the loop only wrote the state", double(t.prefetch_used));
  item("prefetch_dropped_total", "counter", "Prefetched restores dropped unused (bounds: 8, 1 GiB, 60 s)", double(t.prefetch_dropped));
  item("restore_wait_seconds_total", "counter", "Time requests waited for their prefetch (lookup, Redis, decoding), off the loop",
       t.prefetch_ms / 1e3);
  item("restore_wait_seconds_max", "gauge", "Longest a request waited for its prefetch", t.prefetch_max_ms / 1e3);
  item("loop_saves_total", "counter", "Saves that held the loop", double(t.saves));
  item("loop_restores_total", "counter", "Restores into a slot", double(t.restores));
  item("restore_ms_per_token", "gauge", "A restore's measured cost per token it restored (decayed mean; 0 before the first)",
       t.restore_ms_per_token());
  item("prefill_ms_per_token", "gauge", "llama.cpp's measured prompt processing per token (decayed mean; 0 before the first sample)",
       t.prefill_ms_per_token());
  item("restores_declined_total", "counter", "Lookups not made because a restore measured costlier than recomputing (--kvtc-restore-max-cost)",
       double(t.declined));
  item("shifted_not_saved_total", "counter", "Saves refused because a context shift had moved the slot's cells", double(t.shifted_not_saved));
  return o.str();
}

std::string kvtc_server_request_tenant(const nlohmann::ordered_json& data, const std::map<std::string, std::string>& headers) {
  std::string salt;
  const auto it = data.find("cache_salt");
  if (it != data.end() && !it->is_null()) {  // null: as if absent (OpenAI clients send unset fields as null)
    if (!it->is_string()) throw std::invalid_argument(std::string("cache_salt: a string is expected, got ") + it->type_name());
    salt = it->get<std::string>();
    if (salt.empty()) throw std::invalid_argument("cache_salt: a non-empty string is expected (leave the field out for no tenant)");
    if (salt.size() > kCacheSaltMaxBytes)
      throw std::invalid_argument("cache_salt: at most " + std::to_string(kCacheSaltMaxBytes) + " bytes are expected, got " +
                                  std::to_string(salt.size()));
  }
  std::string tenant = salt;
  if (kvtc_server_config().tenant_from_api_key) {
    // The middleware let the request in with this key (kvtc_server_attach
    // refuses the flag without keys); only its hash is kept.
    const std::string key = api_key_of(headers);
    if (!key.empty()) tenant = "api-key:" + sha256_hex(key) + (salt.empty() ? "" : "\n" + salt);
  }
  if (tenant.empty()) return tenant;
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_live.expired()) return tenant;
  }
  throw std::invalid_argument(salt.empty() ? "--kvtc-tenant-from-api-key: kvtc's prompt cache is disabled (see /metrics kvtc:disabled), so "
                                             "requests cannot be kept apart by API key"
                                           : "cache_salt: tenants are kvtc's prompt cache's (--kvtc-calib), which this server does not run");
}

bool kvtc_server_switch_tenant(server_prompt_cache* cache, server_prompt& prompt, llama_context* ctx, int32_t id_slot, const std::string& tenant) {
  std::string& held = g_slot_tenant[id_slot];
  if (held == tenant) return false;
  kvtc_prompt_cache* k = cache ? cache->kvtc.get() : nullptr;
  if (!prompt.tokens.empty()) {
    if (k && !k->learning()) {
      (void)k->save(prompt, ctx, id_slot);  // under the tenant its cells belong to (held, still)
    } else if (k && k->learn(prompt, ctx, id_slot)) {
      // --kvtc-calib auto, still learning: no tenant's prompt, kept raw in
      // upstream's cache as its prompt_save keeps one (server_slot::prompt_save).
      const size_t size = llama_state_seq_get_size_ext(ctx, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE);
      if (server_prompt_cache_state* cur = cache->alloc(prompt, size, 0))
        llama_state_seq_get_data_ext(ctx, cur->data.main.data(), size, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE);
    }
    llama_memory_seq_rm(llama_get_memory(ctx), id_slot, -1, -1);
    prompt.clear();
    SRV_INF("kvtc: slot %d held another tenant's prompt: saved for that tenant, the slot emptied\n", id_slot);
  }
  held = tenant;
  return k != nullptr;
}
