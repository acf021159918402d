// kvtc-server's prompt cache (server/kvtc_server.h): llama-server's hooks
// onto a kvtc::PromptStore.
#include "kvtc_server.h"

#include <kvtc/kvtc.h>
#include <kvtc/llama.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

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
  double save_ms = 0, save_max_ms = 0;
  double restore_ms = 0, restore_max_ms = 0;
};

// The attached store, for /metrics (HTTP threads) as well as the loop.
std::mutex g_mu;
std::weak_ptr<kvtc_prompt_cache::impl> g_live;

}  // namespace

struct kvtc_prompt_cache::impl {
  std::unique_ptr<kvtc::PromptStore> store;
  kvtc::StateLayout layout;  // of the server's context (seq_id set per restore)
  kvtc::StoreOptions opt;
  std::string calib_path;
  mutable std::mutex mu;  // guards times
  LoopTimes times;
};

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
          "--kvtc-ratio N           nominal compression ratio of the coded tokens (default: 16)\n"
          "--kvtc-disk PATH         a disk tier below RAM: compressed prompts survive restarts\n"
          "--kvtc-disk-mib N        the disk tier's budget in MiB (default: 0, no limit)\n"
          "--kvtc-threads N         threads compressing beside inference (default: 1)\n"
          "--kvtc-window N          the newest tokens of a stored prompt kept raw, uncompressed (default: 128, the paper's)\n"
          "--kvtc-redis URL         a shared tier below RAM and disk on one Redis, redis://[[user]:password@]host[:port][/db]:\n"
          "                         every replica with the same model, calibration and flags resumes any conversation\n"
          "--kvtc-redis-cluster L   ... or on a Redis Cluster: L = host:port,host:port,... (any of its masters)\n"
          "--kvtc-redis-ttl N       seconds a Redis key lives unless a restore or a save uses it again (default: 86400; 0: no expiry)\n"
          "--kvtc-ecsq              entropy-coded pieces (one step rate-controlled to --kvtc-ratio, rANS; docs/format.md version 2)\n"
          "                         instead of the DP allocation with DEFLATE\n"
          "--kvtc-raw               store raw f16 pieces through the same tiers, uncompressed (a baseline for benchmarks)\n\n");
    }
    if (a.rfind("--kvtc-", 0) != 0) {
      argv[out++] = argv[i];
      continue;
    }
    if (a == "--kvtc-raw" || a == "--kvtc-ecsq") {  // the flags without a value
      (a == "--kvtc-raw" ? p.raw : p.ecsq) = true;
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
      } else if (a == "--kvtc-disk-mib") {
        p.disk_mib = std::stoll(val, &used);
        if (p.disk_mib < 0) throw std::out_of_range("");
      } else if (a == "--kvtc-window") {
        p.window = std::stoi(val, &used);
        if (p.window < 0 || p.window > 65536) throw std::out_of_range("");
      } else if (a == "--kvtc-threads") {
        p.threads = std::stoi(val, &used);
        if (p.threads < 1 || p.threads > 1024) throw std::out_of_range("");
      } else if (a == "--kvtc-redis-ttl") {
        p.redis_ttl_s = std::stoll(val, &used);
        if (p.redis_ttl_s < 0) throw std::out_of_range("");
      } else {
        err = a +
              ": unknown kvtc flag (--kvtc-calib, --kvtc-ratio, --kvtc-disk, --kvtc-disk-mib, --kvtc-threads, --kvtc-window, --kvtc-redis, "
              "--kvtc-redis-cluster, --kvtc-redis-ttl, --kvtc-ecsq, --kvtc-raw)";
        return false;
      }
      if (used != val.size() || val.empty()) throw std::invalid_argument("");
    } catch (const std::exception&) {
      err = a + ": bad value '" + val + "' (ratio in [1, 4096], sizes and threads whole numbers >= 0)";
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
  return true;
}

kvtc_prompt_cache::~kvtc_prompt_cache() = default;

bool kvtc_prompt_cache::save(const server_prompt& prompt, llama_context* ctx, int32_t id_slot) {
  const auto t0 = Clock::now();
  try {
    llama_tokens tokens = prompt.tokens.get_text_tokens();
    if (tokens.empty() || !p->store->wants(tokens)) return false;
    const size_t size = llama_state_seq_get_size_ext(ctx, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE);
    std::vector<uint8_t> blob(size);
    if (llama_state_seq_get_data_ext(ctx, blob.data(), size, id_slot, LLAMA_STATE_SEQ_FLAGS_NONE) != size) {
      SRV_WRN("kvtc: could not read slot %d's state; not saved\n", id_slot);
      return false;
    }
    const size_t n = tokens.size();
    p->store->put_state(std::move(tokens), std::move(blob));
    const double ms = ms_since(t0);
    {
      std::lock_guard<std::mutex> g(p->mu);
      ++p->times.saves;
      p->times.save_ms += ms;
      p->times.save_max_ms = std::max(p->times.save_max_ms, ms);
    }
    SRV_INF("kvtc: saving a %zu-token prompt (%.1f MiB raw) held the loop %.2f ms; compressing in the background\n", n, size / 1048576.0, ms);
    return true;
  } catch (const std::exception& e) {
    SRV_WRN("kvtc: prompt not saved: %s\n", e.what());
    return false;
  }
}

void kvtc_prompt_cache::on_release(const server_prompt& prompt, llama_context* ctx, int32_t id_slot) {
  if (p->opt.redis_url.empty() && p->opt.redis_cluster.empty()) return;
  (void)save(prompt, ctx, id_slot);
}

bool kvtc_prompt_cache::load(server_prompt& prompt, const server_tokens& tokens_new, llama_context* ctx, int32_t id_slot) {
  const auto t0 = Clock::now();
  std::optional<kvtc::PromptStore::StateMatch> m;
  try {
    kvtc::StateLayout to = p->layout;
    to.seq_id = id_slot;
    m = p->store->take_state(prompt.tokens.get_text_tokens(), tokens_new.get_text_tokens(), to);
    if (!m) return true;  // nothing better than what the slot holds
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
  const double ms = ms_since(t0);
  {
    std::lock_guard<std::mutex> g(p->mu);
    ++p->times.restores;
    p->times.restore_ms += ms;
    p->times.restore_max_ms = std::max(p->times.restore_max_ms, ms);
  }
  if (m->redis_bytes)
    SRV_INF("kvtc: restored %u tokens (common prefix) from the %s tier in %.2f ms (Redis round trips %.2f ms, %.3f MiB)\n", m->common_prefix, m->tier,
            ms, m->redis_ms, m->redis_bytes / 1048576.0);
  else
    SRV_INF("kvtc: restored %u tokens (common prefix) from the %s tier in %.2f ms\n", m->common_prefix, m->tier, ms);
  return true;
}

void kvtc_prompt_cache::update() {
  const kvtc::StoreStats s = p->store->stats();
  SRV_INF("kvtc: %llu prompts in RAM (%llu chunks, %.2f MiB compressed), %llu on disk (%.2f MiB), %llu queued\n", (unsigned long long)s.entries,
          (unsigned long long)s.chunks, s.ram_bytes / 1048576.0, (unsigned long long)s.disk_entries, s.disk_bytes / 1048576.0,
          (unsigned long long)s.pending);
}

bool kvtc_server_attach(server_prompt_cache* cache, const llama_model* model, llama_context* ctx, const std::string& model_path,
                        int32_t cache_ram_mib, bool has_draft, bool has_mtmd, bool has_lora) {
  const kvtc_server_params& cfg = kvtc_server_config();
  if (cfg.calib.empty()) return true;
  auto refuse = [](const std::string& why) {
    SRV_ERR("kvtc: %s\n", why.c_str());
    return false;
  };
  if (!cache) return refuse("--kvtc-calib needs the prompt cache; --cache-ram 0 disables it");
  if (has_mtmd) return refuse("multimodal models (--mmproj) are not supported with --kvtc-calib yet");
  if (has_draft) return refuse("a draft model (speculative decoding) is not supported with --kvtc-calib yet");
  // An adapter changes every key and value: the store's keys would have to name it.
  if (has_lora) return refuse("LoRA adapters are not supported with --kvtc-calib yet");
  if (llama_model_is_recurrent(model) || llama_model_is_hybrid(model)) return refuse("recurrent and hybrid models keep no KV cache kvtc can code");
  try {
    auto I = std::make_shared<kvtc_prompt_cache::impl>();
    I->calib_path = cfg.calib;
    const kvtc::Calibration cal = kvtc::calibration_load(cfg.calib);
    const kvtc::CacheGeometry geom = kvtc::model_geometry(model, model_path);
    kvtc::StoreOptions& o = I->opt;
    o.ratio = cfg.ratio;
    o.raw = cfg.raw;
    o.entropy_coded = cfg.ecsq;
    o.ram_bytes = cache_ram_mib > 0 ? uint64_t(cache_ram_mib) << 20 : 0;
    o.disk_dir = cfg.disk;
    o.disk_bytes = uint64_t(cfg.disk_mib) << 20;
    o.redis_url = cfg.redis;
    o.redis_cluster = cfg.redis_cluster;
    if (cfg.redis_ttl_s >= 0) o.redis_ttl_s = cfg.redis_ttl_s;
    o.threads = cfg.threads;
    o.window = uint32_t(cfg.window);
    o.restore_threads = 0;  // a restore holds the loop: every core decodes
    o.log = [](const std::string& s) { SRV_WRN("%s\n", s.c_str()); };
    try {
      I->store = std::make_unique<kvtc::PromptStore>(cal, geom, o);
    } catch (const kvtc::Error& e) {
      const std::string w = e.what();
      throw kvtc::Error(w.rfind("redis", 0) == 0 ? w : cfg.calib + ": " + w);  // a bad --kvtc-redis names itself
    }
    // The context's state layout (V transposed or not, streams per block),
    // which restores are written for; also refuses a quantized cache. The
    // slots have not started yet, so sequence 0 is free for the probe.
    I->layout = kvtc::context_state_layout(ctx, geom, 0);
    const kvtc::StoreStats s = I->store->stats();
    if (o.raw) SRV_INF("%s\n", "kvtc: --kvtc-raw: pieces are stored as raw f16, uncompressed (a baseline)");
    if (o.entropy_coded) SRV_INF("%s\n", "kvtc: --kvtc-ecsq: pieces are entropy-coded (container version 2)");
    SRV_INF("kvtc: prompt cache compressed %.4gx with %s (calibration %.16s, store %.16s); RAM budget %d MiB; disk tier %s%s\n", o.ratio,
            cfg.calib.c_str(), cal.id.c_str(), I->store->fingerprint().c_str(), cache_ram_mib,
            cfg.disk.empty() ? "off" : (s.disk_enabled ? cfg.disk.c_str() : "DISABLED: "),
            s.disk_enabled ? (" (" + std::to_string(s.disk_entries) + " prompts read back)").c_str() : s.disk_error.c_str());
    if (s.redis_enabled)
      SRV_INF("kvtc: Redis tier %s: %s\n", s.redis_where.c_str(),
              s.redis_up ? "connected" : ("unreachable for now (retrying): " + s.redis_error).c_str());
    cache->kvtc = std::make_unique<kvtc_prompt_cache>();
    cache->kvtc->p = I;
    std::lock_guard<std::mutex> g(g_mu);
    g_live = I;
    return true;
  } catch (const std::exception& e) {
    return refuse(std::string("refusing to start: ") + e.what());
  }
}

std::string kvtc_server_metrics() {
  std::shared_ptr<kvtc_prompt_cache::impl> I;
  {
    std::lock_guard<std::mutex> g(g_mu);
    I = g_live.lock();
  }
  if (!I) return "";
  const kvtc::StoreStats s = I->store->stats();
  LoopTimes t;
  {
    std::lock_guard<std::mutex> g(I->mu);
    t = I->times;
  }
  std::ostringstream o;
  auto item = [&](const char* name, const char* type, const char* help, double v, const std::string& labels = "") {
    o << "# HELP kvtc:" << name << " " << help << "\n# TYPE kvtc:" << name << " " << type << "\nkvtc:" << name << labels << " " << v << "\n";
  };
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
  item("saves_total", "counter", "Prompts stored", double(s.puts));
  item("saves_contained_total", "counter", "Saves not needed: a stored prompt held all their tokens", double(s.puts_contained));
  item("saves_skipped_total", "counter", "Saves refused or failed (logged)", double(s.puts_skipped));
  item("pending", "gauge", "Saves waiting to be compressed", double(s.pending));
  item("pending_bytes", "gauge", "Raw bytes of the saves waiting", double(s.pending_bytes));
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
  item("restore_failures_total", "counter", "Restores that failed (the prompt was recomputed)", double(t.restore_failures));
  item("compress_seconds_total", "counter", "Worker time compressing saves", s.save_ms / 1e3);
  item("loop_save_seconds_total", "counter", "Time saves held the server loop (state copy)", t.save_ms / 1e3);
  item("loop_save_seconds_max", "gauge", "Longest a save held the server loop", t.save_max_ms / 1e3);
  item("loop_restore_seconds_total", "counter", "Time restores held the server loop (decode + state load)", t.restore_ms / 1e3);
  item("loop_restore_seconds_max", "gauge", "Longest a restore held the server loop", t.restore_max_ms / 1e3);
  item("loop_saves_total", "counter", "Saves that held the loop", double(t.saves));
  item("loop_restores_total", "counter", "Restores into a slot", double(t.restores));
  return o.str();
}
