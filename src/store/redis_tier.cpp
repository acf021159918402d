// The shared tier (docs/store.md "Redis"): the same pieces as the disk tier
// under kvtc:<compat>:c:<chunk key> and kvtc:<compat>:e:<entry key>, and
// per chunk level an index hash kvtc:<compat>:x:<c_j> from the key of every
// entry whose last full chunk is c_j (c_0: its tenant's root, the salt for
// tenant "") to its tokens after that chunk. A lookup is one round trip
// (which chunks exist, the indexes along the prompt), a fetch one more; a
// put four (the worker's thread).
// Two connections: a take never waits behind the worker's writes, and each
// has its deadline (a take's short, it holds the caller; the worker's
// longer). Once a take fails (down, past its deadline, a bad reply) the
// takes after it answer "miss" without touching the network, and a third
// connection on the tier's own thread asks every master for PING within a
// take's deadline every redis_retry_ms until all answer: an outage costs
// the caller (the server's loop) one deadline, not one per retry interval
// (issue 28: 0.1 s every 2 s, more with a cluster's map refresh). Every key expires after redis_ttl_s, renewed by the hits and
// puts that use it. A Redis that is down or slow, a missing or damaged
// value: a miss or a shorter match, never an error (counted, logged once
// per outage). With a secret (store/seal.h) every value — chunk, entry and
// each index field's value, which holds tokens — is sealed for its kind and
// key; one that does not open is foreign: deleted (DEL, HDEL), counted
// (foreign_dropped), never decoded.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/util.h"
#include "kvtc/error.h"
#include "store/redis.h"
#include "store/tier.h"

namespace kvtc::store {
namespace {

using detail::RedisCommand;
using detail::RedisReply;

// An index value: u64 LE write time (ms since the Unix epoch), then the
// entry's tokens after its last full chunk (int32 LE).
std::string index_value(std::span<const int32_t> t) {
  std::string s;
  s.reserve(8 + 4 * t.size());
  const uint64_t now = uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  for (int i = 0; i < 8; ++i) s.push_back(char(now >> (8 * i)));
  for (int32_t x : t)
    for (int i = 0; i < 4; ++i) s.push_back(char(uint32_t(x) >> (8 * i)));
  return s;
}
bool index_value_ok(const std::string& v) {
  return v.size() >= 8 && (v.size() - 8) % 4 == 0;
}
size_t index_tokens(const std::string& v) {
  return (v.size() - 8) / 4;
}
uint64_t index_time(const std::string& v) {
  return get_le64(reinterpret_cast<const uint8_t*>(v.data()));
}
// How many leading tokens of `t` the index value `v` matches.
size_t value_prefix(const std::string& v, std::span<const int32_t> t) {
  const size_t n = std::min(index_tokens(v), t.size());
  size_t i = 0;
  while (i < n && int32_t(get_le32(reinterpret_cast<const uint8_t*>(v.data()) + 8 + 4 * i)) == t[i]) ++i;
  return i;
}
// Fails on an error reply (OOM under maxmemory-policy noeviction, WRONGTYPE).
void check(std::span<const RedisReply> r, const char* what) {
  for (const auto& x : r)
    if (!x.ok()) throw detail::RedisError(std::string(what) + ": " + x.str);
}

// Fields one index hash keeps at most: a lookup reads every field of the
// levels it visits (up to ~1.5 KB each at chunk 256 + window 128), so a
// chunk that thousands of short chats share (a system prompt) must not make
// every lookup read megabytes. The oldest go first, and their entries with
// them (no lookup could find them again); their chunks are shared and age
// out by TTL or LRU.
constexpr size_t kIndexFieldsMax = 32;
// What an entry holds besides its tail's K/V bytes, at most: the .kvse
// header (its JSON names every chunk key, ~70 bytes each) and the
// containers' own; for a fetch's deadline only (64 KB: 0.6 ms at 100 MiB/s).
constexpr uint64_t kEntryOverhead = 65536;

class RedisTier final : public Tier {
 public:
  explicit RedisTier(const TierContext& ctx) : ctx_(ctx) {
    const StoreOptions& o = ctx.opt;
    require(o.redis_lookup_timeout_ms > 0 && o.redis_timeout_ms > 0 && o.redis_connect_timeout_ms > 0 && o.redis_retry_ms >= 0,
            "redis: redis_lookup_timeout_ms, redis_timeout_ms and redis_connect_timeout_ms must be positive, redis_retry_ms not negative");
    require(o.redis_min_mib_s > 0, "redis: redis_min_mib_s must be positive");
    require(o.redis_ttl_s >= 0, "redis: redis_ttl_s must not be negative (0: keys never expire)");
    detail::RedisOptions ro = detail::redis_options(o);
    ro.timeout_ms = o.redis_lookup_timeout_ms;
    take_ = std::make_unique<detail::Redis>(ro);  // Error on a malformed URL: refused at start
    ro.timeout_ms = o.redis_timeout_ms;
    put_ = std::make_unique<detail::Redis>(ro);
    ro.timeout_ms = o.redis_lookup_timeout_ms;  // a probe passes only if a take would
    ro.retry_ms = 0;                            // its own pace is probe_loop's
    probe_ = std::make_unique<detail::Redis>(ro);
    where_ = take_->describe();
    prober_ = std::thread([this] { probe_loop(); });
    if (o.redis_ttl_s > 0) ttl_ = std::to_string(o.redis_ttl_s);
    for (const BlockGeometry& b : ctx.codec->geometry().blocks) raw_per_token_ += 4ull * b.features();  // K and V, f16
    // The memory settings, on the worker's connection and deadline (a
    // start, not a take); then the take's connection is opened, so that the
    // first take does not pay for it. Neither is fatal: retried later.
    std::lock_guard<std::mutex> pg(put_mu_);
    if (!check_config()) {
      take_failed();
      return;
    }
    std::lock_guard<std::mutex> tg(take_mu_);
    try {
      check(take_->run({{"PING"}}), "PING");
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu_);
      failed(x.what());
      take_failed();
    }
  }

  ~RedisTier() override {
    {
      std::lock_guard<std::mutex> g(probe_mu_);
      stop_ = true;
    }
    probe_cv_.notify_all();
    prober_.join();  // at most one probe's deadline
  }

  const char* name() const override { return "redis"; }
  bool remote() const override { return true; }

  // Round trip 1: which chunks of the prompt are stored, and the entries
  // hanging off each of them. Candidates: the leading run of stored chunks
  // (kept whole), and every index field at a level within that run.
  std::vector<Candidate> lookup(std::span<const int32_t> tokens, const std::string& root) override {
    if (skip_take()) return {};
    std::lock_guard<std::mutex> rg(take_mu_);
    const auto t0 = Clock::now();
    const uint32_t C = ctx_.scheme->chunk_tokens();
    const size_t K = tokens.size() / C;
    const std::vector<std::string> keys = ctx_.scheme->chunk_keys(tokens, uint32_t(K), root);  // the tenant's chain: only its keys are asked
    std::vector<Candidate> out;
    try {
      // STRLEN: whether each chunk is there, and its size (a fetch's
      // deadline allows for its bytes); 0 when it is not.
      std::vector<RedisCommand> q;
      for (size_t i = 0; i < K; ++i) q.push_back({"STRLEN", rkey('c', keys[i])});
      for (size_t j = 0; j <= K; ++j) q.push_back({"HGETALL", rkey('x', level_key(root, keys, j))});
      const auto r = take_->run(q);
      // STRLEN cannot fail but for the connection (NOAUTH, LOADING): Redis
      // is not usable; or for a value of the wrong type, counted as there
      // (the fetch's GET finds it and drops it). An index of the wrong type
      // reads as empty.
      for (size_t i = 0; i < K; ++i)
        if (!r[i].ok() && r[i].str.rfind("WRONGTYPE", 0) != 0) throw detail::RedisError("STRLEN: " + r[i].str);
      std::vector<uint64_t> upto(1, 0);  // bytes of the chunks before each level
      size_t run = 0;
      while (run < K && (!r[run].ok() || r[run].integer > 0)) upto.push_back(upto.back() + uint64_t(std::max(0LL, r[run++].integer)));
      const double ms = ms_since(t0);
      out.push_back({run * C, 1.0f, "", run, ms, upto[run]});
      std::vector<RedisCommand> foreign;  // index fields whose values do not open: HDEL
      for (size_t j = 0; j <= run; ++j) {
        const auto& h = r[K + j].elements;
        const auto rest = tokens.subspan(j * C);
        const std::string& lk = level_key(root, keys, j);
        for (size_t f = 0; f + 1 < h.size(); f += 2) {
          std::string plain;
          if (!open_index(lk, h[f].str, h[f + 1].str, plain)) {
            foreign.push_back({"HDEL", rkey('x', lk), h[f].str});
            continue;
          }
          const std::string& v = ctx_.seal->on() ? plain : h[f + 1].str;
          if (!index_value_ok(v)) continue;
          const size_t lcp = j * C + value_prefix(v, rest), whole = j * C + index_tokens(v);
          // The entry: its tokens as int32 and its tail, raw at most.
          const uint64_t entry = kEntryOverhead + 4 * whole + raw_per_token_ * index_tokens(v);
          out.push_back({lcp, float(lcp) / float(whole), h[f].str, j, ms, upto[j] + entry, whole});
        }
      }
      account(t0, true, "");
      // Deleted at once (one more exchange, only when there are some): the
      // next lookup must not pay for them again.
      if (!foreign.empty()) finish(foreign, 0, 0, 0, 0, true, "", /*lookup=*/false, foreign.size());
    } catch (const std::exception& x) {
      account(t0, false, x.what());
      take_failed();
      out.clear();
    }
    return out;
  }

  // Round trip 2: the chunks the match needs, and the entry when its tail is.
  std::optional<Fetched> fetch(std::span<const int32_t> tokens, const std::string& root, const Candidate& c, uint32_t n) override {
    if (skip_take()) return Fetched{};
    std::lock_guard<std::mutex> rg(take_mu_);
    const auto t0 = Clock::now();
    const uint32_t C = ctx_.scheme->chunk_tokens();
    const std::vector<std::string> keys = ctx_.scheme->chunk_keys(tokens, uint32_t(c.level), root);
    Fetched f;
    f.ms = c.ms;
    std::vector<RedisCommand> drop;  // damaged, foreign or dangling values
    uint64_t missing = 0, corrupt = 0, foreign = 0;
    try {
      const bool want_tail = !c.entry.empty() && n > c.level * C;
      const size_t need = std::min<size_t>((n + C - 1) / C, c.level);
      // A hit renews what it reads: each GET is followed by an EXPIRE in
      // the same pipeline (GETEX needs Redis 6.2), and the entry's index
      // hash with its entry. Still one round trip.
      std::vector<RedisCommand> q;
      std::vector<std::string> names;  // the GETs' keys, in order
      std::vector<size_t> at;          // and their places in q
      auto get = [&](const std::string& key) {
        at.push_back(q.size());
        q.push_back({"GET", key});
        names.push_back(key);
        if (!ttl_.empty()) q.push_back({"EXPIRE", key, ttl_});
      };
      for (size_t i = 0; i < need; ++i) get(rkey('c', keys[i]));
      if (want_tail) {
        get(rkey('e', c.entry));
        if (!ttl_.empty()) q.push_back({"EXPIRE", rkey('x', level_key(root, keys, c.level)), ttl_});
      }
      auto all = take_->run(q, deadline_ms(ctx_.opt.redis_lookup_timeout_ms, c.bytes));
      f.ms += ms_since(t0);       // both round trips, before any decoding
      std::vector<RedisReply> r;  // the GETs' replies
      for (size_t i : at) r.push_back(std::move(all[i]));
      for (size_t i = 0; i < r.size(); ++i) {
        f.bytes += r[i].str.size();
        if (r[i].type != RedisReply::Type::kString && r[i].type != RedisReply::Type::kNil) {
          // Not ours (WRONGTYPE): a miss; the key is cleared for the next writer.
          ctx_.log("kvtc store: dropped a Redis value that is not a string: " + names[i] + ": " + r[i].str);
          drop.push_back({"DEL", names[i]});
          r[i] = RedisReply{};
        }
      }
      size_t have = 0;  // leading chunks fetched
      while (have < need && r[have].type == RedisReply::Type::kString) ++have;
      if (have < need) ++missing;  // evicted: a shorter match
      // Opened (with a secret): a foreign chunk ends the match before it.
      std::vector<BytesPtr> got;
      for (size_t i = 0; i < have; ++i) {
        Bytes b(r[i].str.begin(), r[i].str.end());
        try {
          ctx_.seal->open(kSealChunk, keys[i], b, "redis " + names[i]);
        } catch (const ForeignValue& x) {
          ++foreign;
          ctx_.log(std::string("kvtc store: dropped a foreign Redis chunk (recomputing instead): ") + x.what());
          drop.push_back({"DEL", names[i]});
          have = i;
          break;
        }
        got.push_back(std::make_shared<const Bytes>(std::move(b)));
      }
      if (have < need) n = std::min<uint32_t>(n, uint32_t(have * C));
      f.piece.tokens.assign(tokens.begin(), tokens.end());
      f.piece.root = root;
      f.piece.chunks.assign(keys.begin(), keys.begin() + std::ptrdiff_t(have));
      if (want_tail && n > c.level * C) {
        const RedisReply& e = r.back();
        const std::string where = "redis " + rkey('e', c.entry);
        if (e.type != RedisReply::Type::kString) {
          ++missing;
          drop.push_back({"HDEL", rkey('x', level_key(root, keys, c.level)), c.entry});
          n = uint32_t(c.level * C);
        } else {
          try {
            auto tb = std::make_shared<Bytes>();
            Bytes eb(e.str.begin(), e.str.end());
            ctx_.seal->open(kSealEntry, c.entry, eb, where);
            Piece p = ctx_.scheme->parse_entry(eb, where, tb.get());
            require(p.chunks.size() == c.level && p.key == c.entry && p.root == root, where + ": not the entry its index names");
            f.piece = std::move(p);
            f.tail = std::move(tb);
          } catch (const ForeignValue& x) {
            ++foreign;
            ctx_.log(std::string("kvtc store: dropped a foreign Redis entry (recomputing instead): ") + x.what());
            drop.push_back({"HDEL", rkey('x', level_key(root, keys, c.level)), c.entry});
            drop.push_back({"DEL", rkey('e', c.entry)});
            n = uint32_t(c.level * C);
          } catch (const std::exception& x) {
            ++corrupt;
            ctx_.log(std::string("kvtc store: dropped a damaged Redis entry: ") + x.what());
            drop.push_back({"HDEL", rkey('x', level_key(root, keys, c.level)), c.entry});
            drop.push_back({"DEL", rkey('e', c.entry)});
            n = uint32_t(c.level * C);
          }
        }
      }
      if (!f.tail) n = std::min<uint32_t>(n, uint32_t(f.piece.chunks.size() * C));
      f.chunks = std::move(got);
      f.n = n;
      f.whole = f.tail && have == c.level;
      finish(drop, missing, corrupt, f.bytes, ms_since(t0), true, "", true, foreign);
      return f;
    } catch (const std::exception& x) {  // down, late or failing: nothing restored, and no second lookup
      finish(drop, missing, corrupt, f.bytes, ms_since(t0), false, x.what(), true, foreign);
      take_failed();
      return Fetched{};
    }
  }

  bool drop_damaged(const Fetched& f, size_t i, const std::string& why) override {
    const size_t m = f.piece.chunks.size();
    std::vector<RedisCommand> drop;
    if (i == m) {
      drop.push_back({"HDEL", rkey('x', level_key(f.piece.root, f.piece.chunks, m)), f.piece.key});
      drop.push_back({"DEL", rkey('e', f.piece.key)});
    } else {
      drop.push_back({"DEL", rkey('c', f.piece.chunks[i])});
    }
    ctx_.log("kvtc store: dropped a damaged Redis value: " + why);
    std::lock_guard<std::mutex> rg(take_mu_);
    finish(drop, 0, 1, 0, 0, true, "", /*lookup=*/false);
    return true;
  }

  // Writes a coded prompt: the chunks it lacks, then the entry, then the
  // index (data before index; a reader treats a dangling index or a missing
  // chunk as a shorter match), and drops the entries this prompt contains.
  void put(const Coded& c) override {
    const Piece& p = c.piece;
    std::lock_guard<std::mutex> rg(put_mu_);
    const auto t0 = Clock::now();
    const uint32_t C = ctx_.scheme->chunk_tokens();
    const size_t m = p.chunks.size(), n = p.tokens.size();
    uint64_t chunks = 0, bytes = 0, dropped = 0, foreign = 0;
    if (!check_config()) return;  // Redis is not answering (counted, logged)
    try {
      const Sealer& seal = *ctx_.seal;
      const Bytes ef_own = c.entry_file ? Bytes() : ctx_.scheme->entry_file(p, *c.tail);
      const Bytes& ef_plain = c.entry_file ? *c.entry_file : ef_own;
      const Bytes ef_sealed = seal.on() ? seal.seal(kSealEntry, p.key, ef_plain) : Bytes();
      const Bytes& ef = seal.on() ? ef_sealed : ef_plain;
      const int base = ctx_.opt.redis_timeout_ms;
      // SET with the TTL, when there is one.
      auto set = [&](std::string key, const Bytes& v) {
        RedisCommand x{"SET", std::move(key), std::string(v.begin(), v.end())};
        if (!ttl_.empty()) x.insert(x.end(), {"EX", ttl_});
        return x;
      };
      // 1: which chunks are there, and the entries that may be prefixes of
      // this prompt. EXPIRE answers 1 for a key that is there and renews
      // its TTL (a system prompt's chunks live as long as chats use them)
      // and its LRU clock; without a TTL, TOUCH does the latter.
      std::vector<RedisCommand> q;
      for (size_t i = 0; i < m; ++i)
        q.push_back(ttl_.empty() ? RedisCommand{"TOUCH", rkey('c', p.chunks[i])} : RedisCommand{"EXPIRE", rkey('c', p.chunks[i]), ttl_});
      for (size_t j = 0; j <= m; ++j) q.push_back({"HGETALL", rkey('x', level_key(p.root, p.chunks, j))});
      const auto r = put_->run(q);
      check(std::span(r).first(m), ttl_.empty() ? "TOUCH" : "EXPIRE");
      // 2: the missing chunks.
      q.clear();
      uint64_t chunk_bytes = 0;
      for (size_t i = 0; i < m; ++i)
        if (r[i].integer == 0) {
          q.push_back(seal.on() ? set(rkey('c', p.chunks[i]), seal.seal(kSealChunk, p.chunks[i], *c.chunks[i]))
                                : set(rkey('c', p.chunks[i]), *c.chunks[i]));
          chunk_bytes += q.back()[2].size();
          ++chunks;
        }
      check(put_->run(q, deadline_ms(base, chunk_bytes)), "SET chunk");
      // 3: the entry.
      check(put_->run({set(rkey('e', p.key), ef)}, deadline_ms(base, ef.size())), "SET entry");
      bytes = chunk_bytes + ef.size();
      // 4: the index; then the entries this one contains go.
      q.clear();
      const std::string index = rkey('x', level_key(p.root, p.chunks, m));
      if (!r[2 * m].ok()) q.push_back({"DEL", index});  // not a hash (not ours): replaced
      const std::string iv = index_value(std::span(p.tokens).subspan(m * C));
      if (seal.on()) {
        const Bytes sv = seal.seal(kSealIndex, index_seal_key(level_key(p.root, p.chunks, m), p.key),
                                   std::span(reinterpret_cast<const uint8_t*>(iv.data()), iv.size()));
        q.push_back({"HSET", index, p.key, std::string(sv.begin(), sv.end())});
      } else {
        q.push_back({"HSET", index, p.key, iv});
      }
      if (!ttl_.empty()) q.push_back({"EXPIRE", index, ttl_});
      for (size_t j = 0; j <= m; ++j) {
        const auto& h = r[m + j].elements;
        const auto rest = std::span(p.tokens).subspan(j * C);
        std::vector<std::pair<uint64_t, std::string>> kept;  // (time, key) of the fields that stay
        const std::string& lk = level_key(p.root, p.chunks, j);
        for (size_t f = 0; f + 1 < h.size(); f += 2) {
          const std::string& key = h[f].str;
          if (key == p.key) continue;
          std::string plain;
          if (!open_index(lk, key, h[f + 1].str, plain)) {  // foreign: cleared
            q.push_back({"HDEL", rkey('x', lk), key});
            ++foreign;
            continue;
          }
          const std::string& v = seal.on() ? plain : h[f + 1].str;
          if (!index_value_ok(v)) {  // not ours: cleared
            q.push_back({"HDEL", rkey('x', level_key(p.root, p.chunks, j)), key});
            continue;
          }
          // (A sliding-window model's shorter prompt is not restored from
          // this one, whose window state is at its end only: it stays.)
          if (ctx_.codec->n_swa() == 0 && index_tokens(v) <= rest.size() && value_prefix(v, rest) == index_tokens(v)) {
            q.push_back({"HDEL", rkey('x', level_key(p.root, p.chunks, j)), key});
            q.push_back({"DEL", rkey('e', key)});
            ++dropped;
            continue;
          }
          kept.emplace_back(index_time(v), key);
        }
        if (j == m && kept.size() + 1 > kIndexFieldsMax) {  // the new field counts
          std::sort(kept.begin(), kept.end());
          for (size_t i = 0; i + kIndexFieldsMax < kept.size() + 1; ++i) {
            q.push_back({"HDEL", index, kept[i].second});
            q.push_back({"DEL", rkey('e', kept[i].second)});  // no lookup finds it any more
          }
        }
      }
      check(put_->run(q), "HSET index");
      std::lock_guard<std::mutex> g(mu_);
      fine();
      foreign_ += foreign;
      chunks_written_ += chunks;
      ++entries_written_;
      entries_dropped_ += dropped;
      bytes_written_ += bytes;
      write_ms_ += ms_since(t0);
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu_);
      failed(std::string("writing a ") + std::to_string(n) + "-token prompt: " + x.what());
      write_ms_ += ms_since(t0);
    }
  }

  void add_stats(StoreStats& s) const override {
    std::lock_guard<std::mutex> g(mu_);
    s.redis_enabled = true;
    // Up only while lookups are served: a write can still get through a
    // Redis too slow for a lookup's 100 ms deadline (a trickling one answers
    // a 5-byte +OK in 250 ms, within a write's 2 s), which must not report
    // the tier up while every lookup is answered without asking it.
    s.redis_up = up_ && !take_down_.load();
    s.redis_error = error_;
    s.redis_where = where_;
    s.redis_config_warning = config_warning_;
    s.redis_lookups = lookups_;
    s.redis_lookups_skipped = skipped_;
    s.redis_probes = probes_;
    s.redis_lookups_paused = take_down_.load();
    s.redis_errors = errors_;
    s.redis_missing = missing_;
    s.redis_chunks_written = chunks_written_;
    s.redis_entries_written = entries_written_;
    s.redis_entries_dropped = entries_dropped_;
    s.redis_bytes_written = bytes_written_;
    s.redis_bytes_read = bytes_read_;
    s.redis_redirects = take_->redirects() + put_->redirects();
    s.redis_lookup_ms = lookup_ms_;
    s.redis_write_ms = write_ms_;
    s.corrupt_dropped += corrupt_;
    s.foreign_dropped += foreign_;
    TierStats t;
    t.name = name();
    t.up = up_;
    t.error = error_;
    t.corrupt_dropped = corrupt_;
    t.foreign_dropped = foreign_;
    s.tiers.push_back(std::move(t));
  }

 private:
  using Clock = std::chrono::steady_clock;

  std::string rkey(char kind, const std::string& k) const { return "kvtc:" + ctx_.scheme->compat() + ":" + kind + ":" + k; }
  // The key of index level j: c_j on the prompt's chain, c_0 being its
  // tenant's root (Scheme::root() for tenant "": the salt without a secret).
  static const std::string& level_key(const std::string& root, const std::vector<std::string>& chunks, size_t j) {
    return j == 0 ? root : chunks[j - 1];
  }
  // What an index value is sealed for: its hash's level and its field, so
  // a value copied to another field or level does not open.
  static std::string index_seal_key(const std::string& level, const std::string& field) { return level + "/" + field; }
  // The plain bytes of index field `field`'s value `v` at level `lk` into
  // `out` (with a secret; without one `v` is the plain value and `out` is
  // left empty); false, logged, when it is foreign.
  bool open_index(const std::string& lk, const std::string& field, const std::string& v, std::string& out) const {
    if (!ctx_.seal->on()) return true;
    Bytes b(v.begin(), v.end());
    try {
      ctx_.seal->open(kSealIndex, index_seal_key(lk, field), b, "redis " + rkey('x', lk) + " field " + field.substr(0, 16));
    } catch (const ForeignValue& x) {
      ctx_.log(std::string("kvtc store: dropped a foreign Redis index field: ") + x.what());
      return false;
    }
    out.assign(b.begin(), b.end());
    return true;
  }
  // An exchange's deadline (ms) that allows for moving `bytes` at
  // redis_min_mib_s: a large fetch on a slow link is not cut short. At most
  // a minute more than `base`, whatever sizes Redis reported.
  int deadline_ms(int base, uint64_t bytes) const {
    const double extra = double(bytes) / (ctx_.opt.redis_min_mib_s * 1048576.0) * 1000.0;
    return base + int(std::ceil(std::min(extra, 60000.0)));
  }

  // Whether Redis bounds its memory: maxmemory set, and a policy that
  // evicts (docs/store.md "Redis", "Eviction"). Asked on every master once
  // Redis answers (under put_mu_); false when it did not answer (counted
  // and logged as a failure). A Redis that refuses CONFIG GET (renamed,
  // ACL) is logged as unknown.
  bool check_config() {
    if (config_checked_) return true;
    try {
      std::vector<std::string> unbounded, noeviction, unknown;
      for (const auto& [node, r] : put_->run_each({"CONFIG", "GET", "maxmemory*"})) {
        std::string mem, policy;
        for (size_t i = 0; i + 1 < r.elements.size(); i += 2) {
          if (r.elements[i].str == "maxmemory") mem = r.elements[i + 1].str;
          if (r.elements[i].str == "maxmemory-policy") policy = r.elements[i + 1].str;
        }
        if (mem.empty() || policy.empty()) {
          unknown.push_back(node + (r.ok() ? "" : " (" + r.str + ")"));
          continue;
        }
        if (mem == "0") unbounded.push_back(node);
        if (policy == "noeviction") noeviction.push_back(node);
      }
      auto list = [](const std::vector<std::string>& v) {
        std::string s;
        for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
        return s;
      };
      std::string w;
      if (!unbounded.empty())
        w = "maxmemory is 0 on " + list(unbounded) + ": Redis grows without limit (until the OOM killer" +
            (ttl_.empty() ? "" : "; the keys' TTL only slows it") + ")";
      if (!noeviction.empty())
        w += std::string(w.empty() ? "" : "; ") + "maxmemory-policy is noeviction on " + list(noeviction) + ": writes fail with OOM once full";
      if (!w.empty())
        ctx_.log("kvtc store: Redis " + where_ + ": " + w + "; set maxmemory and maxmemory-policy allkeys-lru (docs/store.md \"Redis\")");
      if (!unknown.empty())
        ctx_.log("kvtc store: Redis " + where_ + ": maxmemory and maxmemory-policy unknown on " + list(unknown) +
                 " (CONFIG GET refused); make sure they bound the tier (docs/store.md \"Redis\")");
      config_checked_ = true;
      std::lock_guard<std::mutex> g(mu_);
      config_warning_ = w;
      fine();
      return true;
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu_);
      failed(x.what());
      return false;
    }
  }

  void fine() {  // under mu_
    if (!up_ && !error_.empty()) ctx_.log("kvtc store: Redis " + where_ + " reachable again");
    up_ = true;
  }
  void failed(const std::string& why) {  // under mu_
    ++errors_;
    if (up_ || error_ != why) ctx_.log("kvtc store: Redis unavailable (recomputing instead): " + why);
    up_ = false;
    error_ = why;
  }
  // Takes while Redis is known to fail: a miss at once, counted.
  bool skip_take() {
    if (!take_down_.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> g(mu_);
    ++skipped_;
    return true;
  }
  void take_failed() {
    {
      std::lock_guard<std::mutex> g(probe_mu_);
      take_down_.store(true, std::memory_order_release);
    }
    probe_cv_.notify_one();
  }
  // The tier's own thread: while takes are off, every redis_retry_ms (at
  // least 50 ms) a PING to every master within a take's deadline; takes
  // resume when all answer in time (a trickling or frozen Redis keeps them
  // off: its PING misses the deadline as a take would).
  void probe_loop() {
    const auto every = std::chrono::milliseconds(std::max(ctx_.opt.redis_retry_ms, 50));
    std::unique_lock<std::mutex> lk(probe_mu_);
    for (;;) {
      probe_cv_.wait(lk, [&] { return stop_ || take_down_.load(); });
      if (probe_cv_.wait_for(lk, every, [&] { return stop_; })) return;
      lk.unlock();
      bool ok = true;
      std::string why;
      try {
        const auto r = probe_->run_each({"PING"});
        for (const auto& [node, reply] : r)
          if (!reply.ok() || reply.str != "PONG") {
            ok = false;
            why = node + ": " + (reply.str.empty() ? "no PONG" : reply.str);
          }
        ok = ok && !r.empty();
      } catch (const std::exception& x) {
        ok = false;
        why = x.what();
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        ++probes_;
        if (ok) fine();
      }
      lk.lock();
      if (ok) take_down_.store(false, std::memory_order_release);
    }
  }
  void account(Clock::time_point t0, bool ok, const std::string& err) {  // a lookup's figures
    std::lock_guard<std::mutex> g(mu_);
    ++lookups_;
    lookup_ms_ += ms_since(t0);
    if (ok)
      fine();
    else
      failed(err);
  }
  // Sends the drops (best effort) and adds a fetch's figures. Under take_mu_.
  void finish(const std::vector<RedisCommand>& drop, uint64_t missing, uint64_t corrupt, uint64_t read, double ms, bool ok, const std::string& err,
              bool lookup = true, uint64_t foreign = 0) {
    if (!drop.empty()) {
      try {
        (void)take_->run(drop);
      } catch (const std::exception&) {
      }
    }
    std::lock_guard<std::mutex> g(mu_);
    missing_ += missing;
    corrupt_ += corrupt;
    foreign_ += foreign;
    bytes_read_ += read;
    if (lookup) lookup_ms_ += ms;
    if (ok)
      fine();
    else
      failed(err);
  }

  TierContext ctx_;
  std::string ttl_;                                    // redis_ttl_s as an argument; empty: no TTL
  uint64_t raw_per_token_ = 0;                         // f16 K/V bytes of one token
  std::unique_ptr<detail::Redis> take_, put_, probe_;  // probe_: prober_'s only
  bool config_checked_ = false;                        // under put_mu_
  std::mutex take_mu_, put_mu_;                        // one exchange at a time on each connection
  mutable std::mutex mu_;                              // the figures below
  bool up_ = false;
  std::string error_, where_, config_warning_;
  uint64_t lookups_ = 0, errors_ = 0, missing_ = 0, corrupt_ = 0, foreign_ = 0, skipped_ = 0, probes_ = 0;
  uint64_t chunks_written_ = 0, entries_written_ = 0, entries_dropped_ = 0, bytes_written_ = 0, bytes_read_ = 0;
  double lookup_ms_ = 0, write_ms_ = 0;
  std::atomic<bool> take_down_{false};  // set by a failed take, cleared by a probe (both under probe_mu_)
  std::mutex probe_mu_;
  std::condition_variable probe_cv_;
  bool stop_ = false;   // under probe_mu_
  std::thread prober_;  // last: started once everything above exists
};

}  // namespace

std::unique_ptr<Tier> make_redis_tier(const TierContext& ctx) {
  return std::make_unique<RedisTier>(ctx);
}

}  // namespace kvtc::store

namespace kvtc::detail {

RedisOptions redis_options(const StoreOptions& o) {
  RedisOptions ro;
  ro.url = o.redis_url;
  ro.cluster = o.redis_cluster;
  ro.user = o.redis_user;
  ro.password = o.redis_password;
  ro.connect_timeout_ms = o.redis_connect_timeout_ms;
  ro.retry_ms = o.redis_retry_ms;
  return ro;
}

}  // namespace kvtc::detail
