// The prompt store (include/kvtc/store.h, docs/store.md): llama-server's
// lookup rules over a list of tiers (store/tier.h) — RAM, the queue of
// puts, disk, then the remote ones — and the coder the worker runs for each
// put. The key scheme and entry file are store/keys.*, the pieces and the
// codec store/pieces.*, each tier its own file.
//
// Locking: every tier and the queue lock themselves; this file's mutex
// guards only the store's own counters. Coding, decoding and I/O run
// outside every lock on immutable data (pieces are shared_ptrs to const
// bytes), so a take decodes while the worker codes the next put.
#include "kvtc/store.h"

#include <openssl/crypto.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>

#include "core/capture_io.h"
#include "core/parallel.h"
#include "format/container.h"
#include "format/plan.h"
#include "kvtc/error.h"
#include "kvtc/files.h"
#include "store/keys.h"
#include "store/pieces.h"
#include "store/queue.h"
#include "store/tier.h"

namespace kvtc {

using namespace kvtc::store;

struct PromptStore::Impl {
  std::unique_ptr<Sealer> sealer;
  std::unique_ptr<Scheme> scheme;
  std::unique_ptr<PieceCodec> codec;
  TierContext ctx;
  // Lookup order: RAM, the queue, disk, then the remote tiers. The queue is
  // also tiers[1], not owned twice.
  std::vector<std::unique_ptr<Tier>> tiers;
  PutQueue* queue = nullptr;

  mutable std::mutex mu;  // the counters below
  StoreStats st;          // the store's own fields; tiers add theirs in stats()
  std::map<std::string, uint64_t> hits;

  // A take's result before it is assembled into a capture or a state.
  struct Restored {
    std::vector<KvCapture> parts;          // decoded pieces, in order ...
    std::shared_ptr<const KvCapture> raw;  // ... or the uncoded cache (a queued put)
    uint32_t n = 0;
    const char* tier = "";
    double redis_ms = 0;
    uint64_t redis_bytes = 0;
  };

  void count(uint64_t StoreStats::*field, uint64_t v = 1) {
    std::lock_guard<std::mutex> g(mu);
    st.*field += v;
  }

  bool contained(std::span<const int32_t> tokens, const std::string& root) const {
    for (const auto& t : tiers)
      if (t->holds(tokens, root)) return true;
    return false;
  }

  // ---------------------------------------------------------------- storing
  // Codes one put and files it in every tier. The worker's thread (or the
  // caller's when not async); errors are logged, never thrown.
  void code(const Pending& q) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      KvCapture owned;
      const KvCapture& c = codec->checked_capture(q.tokens, q.blob, q.cap, owned);
      Coded out;
      out.piece = scheme->piece_of(q.tokens, q.root);
      const uint32_t m = uint32_t(out.piece.chunks.size());
      // Chunks held already (RAM) are shared; the rest are coded here.
      out.chunks.resize(m);
      std::vector<size_t> todo;
      for (uint32_t i = 0; i < m; ++i) {
        for (const auto& t : tiers)
          if ((out.chunks[i] = t->chunk(out.piece.chunks[i]))) break;
        if (!out.chunks[i]) todo.push_back(i);
      }
      detail::parallel_for(todo.size() + 1, ctx.opt.threads, [&](size_t j) {
        queue->yield_to_takes();  // a restore in progress goes first
        if (j == todo.size())
          out.tail = std::make_shared<const Bytes>(codec->code_tail(c, q.tokens, m));
        else
          out.chunks[todo[j]] = std::make_shared<const Bytes>(codec->code_chunk(c, q.tokens, uint32_t(todo[j])));
      });
      if (tiers.size() > 2)  // disk or Redis: the entry file, the same bytes in both
        out.entry_file = std::make_shared<const Bytes>(scheme->entry_file(out.piece, *out.tail));
      for (const auto& t : tiers) t->put(out);
      std::lock_guard<std::mutex> g(mu);
      st.chunks_written += todo.size();
      st.chunks_shared += m - todo.size();
      ++st.puts;
      st.save_ms += ms_since(t0);
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu);
      ++st.puts_skipped;
      st.save_ms += ms_since(t0);
      ctx.log(std::string("kvtc store: put not stored: ") + x.what());
    }
  }

  void enqueue(std::shared_ptr<Pending> q) {
    if (q->tokens.empty() || contained(q->tokens, q->root)) return count(&StoreStats::puts_contained);
    if (!queue->push(std::move(q))) count(&StoreStats::puts_skipped);
  }

  // ---------------------------------------------------------------- taking
  // Decodes what a tier fetched; a piece that fails its checks ends the
  // match before it and is dropped by the tier (with every later damaged
  // one, so that the next writer replaces them).
  Restored decode(Tier& t, const Fetched& f) const {
    Restored r;
    r.tier = t.name();
    r.redis_ms = f.ms;
    r.redis_bytes = f.bytes;
    r.n = f.n;
    if (f.raw) {
      r.raw = f.raw;
      return r;
    }
    const uint32_t C = scheme->chunk_tokens(), m = uint32_t(f.piece.chunks.size());
    const size_t pieces = std::min<size_t>((r.n + C - 1) / C, m + 1);
    require(pieces <= f.chunks.size() || (pieces == f.chunks.size() + 1 && f.chunks.size() == m && f.tail),
            "kvtc store: the " + std::string(t.name()) + " tier fetched fewer pieces than its match needs");
    r.parts.resize(pieces);
    std::vector<std::string> errs(pieces);
    const std::string origin = std::string("kvtc store: ") + t.name() + " entry " + f.piece.key.substr(0, 16);
    detail::parallel_for(pieces, ctx.opt.restore_threads, [&](size_t i) {
      try {
        r.parts[i] =
            codec->decode_piece(f.piece, i == m ? std::span<const uint8_t>(*f.tail) : std::span<const uint8_t>(*f.chunks[i]), uint32_t(i), origin);
      } catch (const std::exception& x) {
        errs[i] = x.what();
      }
    });
    for (size_t i = 0; i < pieces; ++i) {
      if (errs[i].empty()) continue;
      (void)t.drop_damaged(f, i, errs[i]);
      r.n = std::min<uint32_t>(r.n, uint32_t(i * C));
    }
    r.parts.resize(std::min<size_t>(pieces, (r.n + C - 1) / C));  // n only shrinks
    if (!codec->restorable(r.n, f.piece.tokens.size())) {
      // A sliding-window model's match cut short (a piece gone or damaged):
      // the window's state is at the prompt's end only, so nothing is restored.
      r.n = 0;
      r.parts.clear();
    }
    return r;
  }

  // llama-server's rules (server_prompt_cache::load, docs/store.md "Lookup"):
  // the slot's own prompt `current` sets the bar; a stored prompt is a
  // candidate when its common prefix keeps >= 25% of it, and wins when it
  // beats the bar on both the kept share and the similarity to the new
  // prompt; the first one in order (the local tiers, oldest first) wins
  // ties (but the more similar of two that keep the same share). The remote tiers are asked only when that leaves part of the
  // prompt to compute: their longest candidate wins when it restores more
  // and beats the slot's own prompt. The winner is fetched and decoded; if
  // its pieces come back shorter than the next best (evicted, damaged),
  // the next best is used. Every tier is asked for the chain from `root`
  // only (the take's tenant): another tenant's prompts are no candidates.
  std::optional<Restored> restore(std::span<const int32_t> current, std::span<const int32_t> tokens, const std::string& root) {
    if (tokens.empty()) return std::nullopt;
    const auto t0 = std::chrono::steady_clock::now();
    const size_t lcp_cur = common_prefix(current, tokens);
    const float keep_bar = current.empty() ? -1.0f : float(lcp_cur) / float(current.size());
    const float sim_bar = float(lcp_cur) / float(tokens.size());
    auto sim = [&](size_t lcp) { return float(lcp) / float(tokens.size()); };
    PutQueue::Taking taking(*queue);  // the worker waits between pieces while this take restores
    for (int attempt = 0; attempt < 2; ++attempt) {
      struct Choice {
        Tier* tier;
        Candidate c;
      };
      std::vector<Choice> choices;  // best last
      float keep_best = keep_bar, sim_best = sim_bar;
      for (const auto& t : tiers) {
        if (t->remote()) continue;
        // Between two stored prompts that keep the same share (a
        // sliding-window model's turns, each kept whole: the older ones are
        // not dropped) the one restoring more wins; upstream's rule, which
        // keeps the first, never meets the tie otherwise (a prefix is dropped
        // when a prompt containing it is stored).
        for (const Candidate& c : t->lookup(tokens, root))
          if (c.keep >= 0.25f && (keep_best < c.keep || (!choices.empty() && keep_best == c.keep)) && sim_best < sim(c.lcp) &&
              codec->restorable(c.lcp, c.whole)) {
            keep_best = c.keep;
            sim_best = sim(c.lcp);
            if (choices.empty()) choices.push_back({t.get(), c});
            choices.back() = {t.get(), c};
          }
      }
      for (const auto& t : tiers) {
        const size_t have = choices.empty() ? 0 : choices.back().c.lcp;
        if (!t->remote() || have >= tokens.size()) continue;
        std::optional<Candidate> best;
        for (const Candidate& c : t->lookup(tokens, root))
          if (c.keep >= 0.25f && (!best || c.lcp > best->lcp) && codec->restorable(c.lcp, c.whole)) best = c;
        if (best && best->lcp > have && keep_bar < best->keep && sim_bar < sim(best->lcp)) choices.push_back({t.get(), *best});
      }
      bool gone = false;
      for (size_t k = choices.size(); k-- > 0;) {
        Tier& t = *choices[k].tier;
        const size_t floor = k ? choices[k - 1].c.lcp : 0;  // the next best restores this much
        try {
          std::optional<Fetched> f = t.fetch(tokens, root, choices[k].c, uint32_t(choices[k].c.lcp));
          if (!f) {
            gone = true;
            continue;
          }
          Restored r = decode(t, *f);
          if (r.n == 0 || r.n <= floor || !(sim_bar < sim(r.n))) continue;
          std::lock_guard<std::mutex> g(mu);
          ++hits[t.name()];
          st.tokens_restored += r.n;
          st.restore_ms += ms_since(t0);
          if (f->whole && r.n == choices[k].c.lcp && &t != tiers[0].get()) {
            // The whole entry came from below: keep it in RAM too.
            Coded c{f->piece, f->chunks, f->tail, nullptr};
            tiers[0]->put(c);
          }
          return r;
        } catch (const std::exception& x) {
          // A pending put that does not parse, a tier that failed: a miss
          // for this candidate; the caller recomputes.
          ctx.log(std::string("kvtc store: dropped a damaged entry (recomputing instead): ") + x.what());
          count(&StoreStats::corrupt_dropped);
        }
      }
      if (!gone) break;  // else an entry went between lookup and fetch: look again, once
    }
    std::lock_guard<std::mutex> g(mu);
    ++st.misses;
    return std::nullopt;
  }
};

double global_ratio_of(const CacheGeometry& g, const StoreOptions& o) {
  if (g.blocks.size() < 2 || o.raw) return 0;
  return o.global_ratio > 0 ? o.global_ratio : std::min(o.ratio, 4.0);
}

PromptStore::PromptStore(const Calibration& cal, const CacheGeometry& g, const StoreOptions& opt) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  container::check_geometry(g, cal, "kvtc store");
  require(opt.chunk_tokens >= 16 && opt.chunk_tokens % 16 == 0 && opt.chunk_tokens <= 65536,
          "kvtc store: chunk_tokens must be a multiple of 16 in [16, 65536], got " + std::to_string(opt.chunk_tokens));
  require(opt.sink <= opt.chunk_tokens, "kvtc store: sink must not exceed chunk_tokens");
  require(opt.ratio >= 1 && opt.ratio <= 4096, "kvtc store: ratio must be in [1, 4096]");
  require(opt.deflate_level >= 0 && opt.deflate_level <= 12, "kvtc store: deflate_level must be 0..12");
  require(opt.global_ratio == 0 || (opt.global_ratio >= 1 && opt.global_ratio <= 4096), "kvtc store: global_ratio must be 0 or in [1, 4096]");
  require(opt.global_ratio == 0 || g.blocks.size() > 1,
          "kvtc store: global_ratio is for sliding-window (iSWA) models, whose global layers are block 0; this model keeps one block: use ratio");
  // Entropy-coded pieces for single-block caches: the iSWA pieces (issue
  // 31) were built and measured with the DP's allocation only, so those stay
  // DP; raw pieces are raw.
  const bool ecsq = opt.entropy_coded && !opt.raw && g.blocks.size() == 1;
  AllocationSet alloc = ecsq ? ecsq_allocation_set(cal, opt.ratio) : allocation_set(cal, opt.ratio);
  const double global = global_ratio_of(g, opt);
  if (global > 0 && global != opt.ratio) alloc[0] = allocation_set(cal, global)[0];
  SchemeFields f;
  f.model_sha256 = g.model_sha256;
  f.calibration_id = cal.id;
  require(opt.window_bits == 16 || opt.window_bits == 8, "kvtc store: window_bits must be 16 or 8, got " + std::to_string(opt.window_bits));
  CompressOptions pieces;  // what names the pieces' container version (PieceCodec::copt)
  pieces.window_bits = opt.raw ? 16 : opt.window_bits;
  f.container_version = container::container_version(alloc, pieces);
  f.window_bits = pieces.window_bits;
  f.chunk_tokens = opt.chunk_tokens;
  f.ratio = opt.raw ? "raw" : ratio_key(opt.ratio) + (ecsq ? "-ecsq" : "");
  f.sink = opt.sink;
  f.window = opt.window;
  f.kv_settings = opt.kv_settings.text();
  if (g.blocks.size() > 1)
    f.swa = "end;n_swa=" + std::to_string(g.blocks[1].sliding_window) + (global > 0 ? ";global_ratio=" + ratio_key(global) : "");
  I.sealer = std::make_unique<Sealer>(opt.secret, opt.encrypt);  // Error: a secret too short, encrypt without one
  f.protection = I.sealer->protection();
  I.scheme = std::make_unique<Scheme>(f, I.sealer->chain_key());
  // The secret itself is not kept: the sealer and the scheme hold the keys
  // derived from it.
  StoreOptions o = opt;
  o.secret.clear();
  I.codec = std::make_unique<PieceCodec>(cal, g, o, alloc, o.chunk_tokens);
  I.ctx.scheme = I.scheme.get();
  I.ctx.codec = I.codec.get();
  I.ctx.seal = I.sealer.get();
  I.ctx.opt = o;
  // The tiers, in lookup order. A new tier: its file, and one line here.
  I.tiers.push_back(make_ram_tier(I.ctx));
  auto queue = std::make_unique<PutQueue>(I.ctx, [this](const Pending& q) { impl_->code(q); });
  I.queue = queue.get();
  I.tiers.push_back(std::move(queue));
  if (!opt.disk_dir.empty()) I.tiers.push_back(make_disk_tier(I.ctx));
  if (!opt.redis_url.empty() || !opt.redis_cluster.empty()) I.tiers.push_back(make_redis_tier(I.ctx));
}

PromptStore::~PromptStore() {
  impl_->queue->stop();  // finishes the queued puts while every tier is still there
}

const std::string& PromptStore::fingerprint() const {
  return impl_->scheme->salt();
}

const std::string& PromptStore::protection() const {
  return impl_->sealer->protection();
}

bool PromptStore::wants(std::span<const int32_t> tokens, std::string_view tenant) const {
  return !tokens.empty() && !impl_->contained(tokens, impl_->scheme->tenant_root(tenant));
}

bool PromptStore::wants(std::span<const int32_t> tokens, uint64_t bytes, std::string_view tenant) const {
  if (!wants(tokens, tenant)) return false;
  if (impl_->queue->fits(bytes)) return true;
  impl_->count(&StoreStats::puts_skipped);
  impl_->ctx.log("kvtc store: a " + std::to_string(tokens.size()) + "-token put of " + std::to_string(bytes) +
                 " raw bytes does not fit the queue now (max_pending_bytes " + std::to_string(impl_->queue->budget()) + "); not taken");
  return false;
}

void PromptStore::put_state(std::vector<int32_t> tokens, std::vector<uint8_t> blob, std::string_view tenant) {
  auto q = std::make_shared<Pending>();
  q->tokens = std::move(tokens);
  q->root = impl_->scheme->tenant_root(tenant);
  q->blob = std::move(blob);
  q->bytes = q->blob.size();
  impl_->enqueue(std::move(q));
}

std::vector<uint8_t> PromptStore::state_buffer(size_t bytes, bool* kept) {
  return impl_->queue->buffer(bytes, kept);
}

void PromptStore::prepare_state_buffer(size_t bytes) {
  impl_->queue->prepare(bytes);
}

void PromptStore::put(std::vector<int32_t> tokens, KvCapture cache, std::string_view tenant) {
  auto q = std::make_shared<Pending>();
  q->tokens = std::move(tokens);
  q->root = impl_->scheme->tenant_root(tenant);
  q->cap = std::move(cache);
  q->bytes = q->cap.f16_bytes();
  impl_->enqueue(std::move(q));
}

std::optional<PromptStore::Match> PromptStore::take(std::span<const int32_t> current, std::span<const int32_t> tokens, std::string_view tenant) {
  std::optional<Impl::Restored> r = impl_->restore(current, tokens, impl_->scheme->tenant_root(tenant));
  if (!r) return std::nullopt;
  Match out;
  out.cache = r->raw ? prefix_of(*r->raw, r->n, impl_->codec->n_swa(), tokens) : join(r->parts, r->n);
  out.tokens = out.cache.tokens;
  out.common_prefix = r->n;
  out.tier = r->tier;
  out.redis_ms = r->redis_ms;
  out.redis_bytes = r->redis_bytes;
  return out;
}

std::optional<PromptStore::StateMatch> PromptStore::take_state(std::span<const int32_t> current, std::span<const int32_t> tokens,
                                                               const StateLayout& to, std::string_view tenant) {
  std::optional<Impl::Restored> r = impl_->restore(current, tokens, impl_->scheme->tenant_root(tenant));
  if (!r) return std::nullopt;
  StateMatch out;
  if (r->raw && impl_->codec->n_swa()) {
    out.state = state_from_capture(prefix_of(*r->raw, r->n, impl_->codec->n_swa(), tokens), to);
  } else if (r->raw) {
    const BlockRun run{&r->raw->blocks[0], 0, r->n};
    out.state = state_from_runs(std::span(&run, 1), to);
  } else {
    out.state = join_state(r->parts, r->n, to);
  }
  out.tokens.assign(tokens.begin(), tokens.begin() + r->n);  // the common prefix: the match's own tokens
  out.common_prefix = r->n;
  out.tier = r->tier;
  out.redis_ms = r->redis_ms;
  out.redis_bytes = r->redis_bytes;
  return out;
}

void PromptStore::flush() {
  for (const auto& t : impl_->tiers) t->wait_ready();
  impl_->queue->flush();
}

StoreStats PromptStore::stats() const {
  StoreStats s;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    s = impl_->st;
  }
  for (const auto& t : impl_->tiers) t->add_stats(s);
  std::lock_guard<std::mutex> g(impl_->mu);
  for (TierStats& t : s.tiers) {
    auto it = impl_->hits.find(t.name);
    t.hits = it == impl_->hits.end() ? 0 : it->second;
  }
  s.hits_ram = impl_->hits["ram"];
  s.hits_pending = impl_->hits["pending"];
  s.hits_disk = impl_->hits["disk"];
  s.hits_redis = impl_->hits["redis"];
  return s;
}

namespace {

// A line when `path` can be read by its group or others: a secret that any
// local user can read protects nothing from them.
std::string readable_by_others(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !(st.st_mode & (S_IRGRP | S_IROTH))) return "";
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
  return path + ": readable by " + ((st.st_mode & S_IROTH) ? "others" : "its group") + " (mode " + mode + "); chmod 600 it";
}

}  // namespace

std::vector<uint8_t> read_store_secret(const std::string& path, std::string* warning) {
  std::vector<uint8_t> b = read_file(path);  // IoError naming the file
  if (b.size() < Sealer::kMinSecretBytes) {
    OPENSSL_cleanse(b.data(), b.size());
    throw Error(path + ": the secret file holds " + std::to_string(b.size()) + " bytes, expected at least " +
                std::to_string(Sealer::kMinSecretBytes) + " (e.g. openssl rand 32 > " + path + ")");
  }
  if (warning) *warning = readable_by_others(path);
  return b;
}

std::string read_password_file(const std::string& path, std::string* warning) {
  std::vector<uint8_t> b = read_file(path);
  std::string s(b.begin(), b.end());
  OPENSSL_cleanse(b.data(), b.size());
  s.resize(std::min(s.find('\n'), s.size()));
  if (!s.empty() && s.back() == '\r') s.pop_back();
  require(!s.empty(), path + ": the password file's first line is empty, expected the password");
  if (warning) *warning = readable_by_others(path);
  return s;
}

}  // namespace kvtc
