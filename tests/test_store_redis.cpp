// The prompt store's Redis tier (docs/store.md "Redis") against real
// redis-server processes — one instance, and a 3-master cluster — with
// synthetic caches (tests/synthetic.h: the tests are about the tier's keys,
// rules and faults, not a model; tests/test_server.py runs two kvtc-server
// replicas over Redis on a real one). Two stores on one Redis stand for two
// server replicas.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>

#include "core/util.h"
#include "kvtc/kvtc.h"
#include "redis_procs.h"
#include "store/redis.h"
#include "synthetic.h"

using namespace kvtc;
using kvtc::testing::RedisCluster;
using kvtc::testing::RedisServer;
using kvtc::testing::TrickleProxy;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

const Calibration& cal() {
  static const Calibration c = fitted();
  return c;
}

fs::path tmp(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("kvtc-test-redis-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(p);
  return p;
}

// As in test_store.cpp: 64-token chunks, sink 4, window 32, ratio 8, f32,
// DP pieces (exact comparisons with whole_roundtrip).
StoreOptions small() {
  StoreOptions o;
  o.entropy_coded = false;
  o.window_bits = 16;  // f16 windows: whole_roundtrip compares exactly
  o.ratio = 8;
  o.chunk_tokens = 64;
  o.sink = 4;
  o.window = 32;
  o.precision = Precision::kF32;
  o.async = false;  // puts are in Redis when put() returns
  o.threads = 2;
  o.redis_retry_ms = 100;
  o.redis_timeout_ms = 1000;
  return o;
}
StoreOptions on(const RedisServer& r) {
  StoreOptions o = small();
  o.redis_url = r.url();
  return o;
}

KvCapture whole_roundtrip(const std::vector<int32_t>& tokens, const StoreOptions& o) {
  return kvtc::whole_roundtrip(tokens, o, cal());
}

// Keys of one kind ('c', 'e', 'x') in a store's namespace.
std::vector<std::string> keys_of(const RedisServer& r, const PromptStore& s, char kind) {
  const auto rep = r.cmd({"KEYS", "kvtc:" + s.fingerprint().substr(0, 16) + ":" + kind + ":*"});
  std::vector<std::string> out;
  for (const auto& e : rep.elements) out.push_back(e.str);
  return out;
}

// The Redis key of chunk i + 1 of `tokens` (chain_key, tests/synthetic.h) or of its index hash.
std::string chunk_key(const PromptStore& s, const std::vector<int32_t>& tokens, size_t i, uint32_t C) {
  return "kvtc:" + s.fingerprint().substr(0, 16) + ":c:" + chain_key(s, tokens, i, C);
}
std::string index_key(const PromptStore& s, const std::vector<int32_t>& tokens, size_t i, uint32_t C) {
  return "kvtc:" + s.fingerprint().substr(0, 16) + ":x:" + chain_key(s, tokens, i, C);
}

// A take, timed (ms on the steady clock).
struct Timed {
  double ms = 0;
  std::optional<PromptStore::Match> m;
};
Timed timed_take(PromptStore& s, std::span<const int32_t> tokens) {
  const auto t0 = Clock::now();
  Timed t;
  t.m = s.take({}, tokens);
  t.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  return t;
}

// The deadline the time tests use for a take's exchanges, and the margin
// they allow over what the store promises: scheduling on a loaded 2-core
// machine (the store tests may run beside a build), not Redis.
constexpr int kLookupMs = 100;
constexpr double kMarginMs = 250;

}  // namespace

TEST(RedisClient, UrlsAreCheckedAtStart) {
  for (const std::string bad :
       {"http://127.0.0.1:6379", "redis://", "redis://host:0", "redis://host:99999", "redis://host:12/x", "redis://host:port"}) {
    detail::RedisOptions o;
    o.url = bad;
    try {
      detail::Redis r(o);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("redis"), std::string::npos) << e.what();
    }
  }
  StoreOptions o = small();
  o.redis_url = "redis//nowhere";
  EXPECT_THROW(PromptStore(cal(), lowrank_geometry(), o), Error);
  // TLS: refused with what to do instead (Debian 12's hiredis has none);
  // a password never shows in a message.
  o.redis_url = "rediss://:hunter2@127.0.0.1:6380";
  std::string e = error_of([&] { PromptStore(cal(), lowrank_geometry(), o); });
  EXPECT_NE(e.find("TLS (rediss://) is not supported"), std::string::npos) << e;
  EXPECT_NE(e.find("stunnel"), std::string::npos) << e;
  EXPECT_EQ(e.find("hunter2"), std::string::npos) << e;
  o.redis_url = "redis://:hunter2@127.0.0.1:port";
  e = error_of([&] { PromptStore(cal(), lowrank_geometry(), o); });
  EXPECT_NE(e.find("redis URL 'redis://***@127.0.0.1:port'"), std::string::npos) << e;
  // A password in the URL and apart: one of them.
  o.redis_url = "redis://:a@127.0.0.1:6379";
  o.redis_password = "b";
  EXPECT_NE(error_of([&] { PromptStore(cal(), lowrank_geometry(), o); }).find("give one of them"), std::string::npos);
}

TEST(StoreRedis, AnyReplicaResumesAnyConversation) {
  RedisServer redis(tmp("replicas"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  EXPECT_TRUE(a.stats().redis_up);
  const auto p = seq(1000, 300);  // 4 chunks of 64 + a 44-token tail
  a.put(p, prompt_capture(p));
  EXPECT_EQ(a.stats().redis_entries_written, 1u);
  EXPECT_EQ(a.stats().redis_chunks_written, 4u);
  EXPECT_EQ(keys_of(redis, a, 'c').size(), 4u);
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 1u);
  const KvCapture ref = whole_roundtrip(p, o);

  // Turn 2 lands on B, which never saw turn 1: restored from Redis, the
  // same bits A restores from its RAM (the same pieces, decoded alike).
  auto m = b.take({}, cat(p, seq(7, 30)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_EQ(m->common_prefix, 300u);
  EXPECT_EQ(m->tokens, p);
  EXPECT_TRUE(matches_prefix(m->cache, ref, 300));
  {
    auto on_a = a.take({}, cat(p, seq(7, 30)));
    ASSERT_TRUE(on_a);
    EXPECT_STREQ(on_a->tier, "ram");
    EXPECT_EQ(on_a->cache.blocks.at(0).k, m->cache.blocks.at(0).k);
    EXPECT_EQ(on_a->cache.blocks.at(0).v, m->cache.blocks.at(0).v);
  }
  StoreStats st = b.stats();
  EXPECT_EQ(st.hits_redis, 1u);
  EXPECT_EQ(st.redis_lookups, 1u);
  EXPECT_GT(st.redis_bytes_read, 0u);
  // ... and kept in B's RAM: the next turn there needs no Redis.
  EXPECT_EQ(st.entries, 1u);
  m = b.take({}, cat(p, seq(9, 10)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "ram");

  // A prompt that leaves the stored one inside its third chunk: the two
  // chunks before it, found by their chained keys alone (a replica cannot
  // restore part of a chunk it has not got).
  PromptStore c(cal(), lowrank_geometry(), o);
  m = c.take({}, cat(seq(1000, 150), seq(5, 100)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_EQ(m->common_prefix, 128u);
  EXPECT_TRUE(matches_prefix(m->cache, ref, 128));
}

TEST(StoreRedis, ContainedEntriesAreDroppedSharedChunksWrittenOnce) {
  RedisServer redis(tmp("contained"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  const auto t1 = seq(1000, 300), t2 = cat(t1, seq(50, 100)), t3 = cat(t2, seq(60, 90));
  a.put(t1, prompt_capture(t1));
  b.put(t2, prompt_capture(t2));  // another replica, the next turn: contains turn 1
  a.put(t3, prompt_capture(t3));
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 1u);  // only the newest entry
  EXPECT_EQ(a.stats().redis_entries_dropped + b.stats().redis_entries_dropped, 2u);
  // Chunks written once: 4 by A, 2 more by B (t2: (400-32)/64 = 5 chunks), 2 by A.
  EXPECT_EQ(a.stats().redis_chunks_written + b.stats().redis_chunks_written, size_t((490 - 32) / 64));
  EXPECT_EQ(keys_of(redis, a, 'c').size(), size_t((490 - 32) / 64));
  // Twenty chats over one system prompt share its chunks in Redis.
  const auto sys = seq(30000, 256);
  for (int i = 0; i < 20; ++i) {
    const auto p = cat(sys, seq(40000 + 1000 * i, 60));
    (i % 2 ? a : b).put(p, prompt_capture(p));
  }
  EXPECT_EQ(keys_of(redis, a, 'c').size(), 7u + 4u);  // (316-32)/64 = 4 chunks each, the system prompt's, stored once
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 21u);
}

TEST(StoreRedis, AnIndexKeepsItsNewest32Fields) {
  RedisServer redis(tmp("cap"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto sys = seq(30000, 64);  // one chunk all share; tails of 40..80 tokens after it
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 40; ++i) {
    ps.push_back(cat(sys, seq(50000 + 1000 * i, 40 + size_t(i))));
    a.put(ps.back(), prompt_capture(ps.back()));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // distinct write times
  }
  EXPECT_EQ(redis.cmd({"HLEN", index_key(a, sys, 0, 64)}).integer, 32);
  // The 8 whose fields went are deleted too: nothing could find them again.
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 32u);
  PromptStore b(cal(), lowrank_geometry(), o);
  auto m = b.take({}, cat(ps.back(), seq(3, 3)));  // the newest: whole
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, ps.back().size());
  m = b.take({}, cat(ps.front(), seq(3, 3)));  // the oldest: its chunk only
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 64u);
}

TEST(StoreRedis, RedisDownMeansRecomputingThenBack) {
  RedisServer redis(tmp("down"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  std::vector<std::string> logs;
  const auto p = seq(1000, 300), q = seq(5000, 200);
  redis.stop();
  a.put(p, prompt_capture(p));  // not in Redis, but in A's RAM; no throw
  EXPECT_FALSE(b.take({}, p));  // a miss: B recomputes
  StoreStats sa = a.stats(), sb = b.stats();
  EXPECT_FALSE(sa.redis_up);
  EXPECT_GE(sa.redis_errors, 1u);
  EXPECT_FALSE(sb.redis_up);
  EXPECT_NE(sb.redis_error.find("127.0.0.1"), std::string::npos) << sb.redis_error;
  EXPECT_EQ(sa.entries, 1u);
  auto m = a.take({}, p);  // A still serves its RAM
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "ram");

  redis.start();                                                // back, empty (no persistence)
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past redis_retry_ms: B's probe (every 100 ms) found it
  a.put(q, prompt_capture(q));
  EXPECT_TRUE(a.stats().redis_up);
  m = b.take({}, q);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_TRUE(b.stats().redis_up);
}

TEST(StoreRedis, DamagedValuesAreDroppedAndTheRestUsed) {
  RedisServer redis(tmp("damaged"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  const KvCapture ref = whole_roundtrip(p, o);
  const std::string c3 = chunk_key(a, p, 2, 64);
  ASSERT_EQ(redis.cmd({"EXISTS", c3}).integer, 1);

  // One flipped byte in the middle of chunk 3: refused by its checksum,
  // deleted; the two chunks before it are restored.
  const std::string v = redis.cmd({"GET", c3}).str;
  std::string bad = v;
  bad[bad.size() / 2] = char(bad[bad.size() / 2] ^ 0x5a);
  redis.cmd({"SET", c3, bad});
  {
    PromptStore b(cal(), lowrank_geometry(), o);
    auto m = b.take({}, cat(p, seq(3, 10)));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, 128u);
    EXPECT_TRUE(matches_prefix(m->cache, ref, 128));
    EXPECT_EQ(b.stats().corrupt_dropped, 1u);
    EXPECT_EQ(redis.cmd({"EXISTS", c3}).integer, 0);
  }
  // A truncated entry (as a writer that died mid-value would leave, if SET
  // were not atomic): refused by its checksum, dropped with its index field.
  redis.cmd({"SET", c3, v});
  const auto ek = keys_of(redis, a, 'e');
  ASSERT_EQ(ek.size(), 1u);
  const std::string e = redis.cmd({"GET", ek[0]}).str;
  redis.cmd({"SET", ek[0], e.substr(0, e.size() - 100)});
  {
    PromptStore b(cal(), lowrank_geometry(), o);
    auto m = b.take({}, cat(p, seq(3, 10)));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, 256u);  // the chunks, without the tail
    EXPECT_TRUE(matches_prefix(m->cache, ref, 256));
    EXPECT_EQ(b.stats().corrupt_dropped, 1u);
    EXPECT_EQ(keys_of(redis, a, 'e').size(), 0u);
    EXPECT_EQ(redis.cmd({"HLEN", index_key(a, p, 3, 64)}).integer, 0);
  }
  // A value of the wrong type where a chunk should be: a miss, not an
  // error, and Redis is not taken for down.
  redis.cmd({"DEL", chunk_key(a, p, 0, 64)});
  redis.cmd({"HSET", chunk_key(a, p, 0, 64), "f", "v"});
  PromptStore b(cal(), lowrank_geometry(), o);
  EXPECT_FALSE(b.take({}, cat(p, seq(3, 10))));
  EXPECT_TRUE(b.stats().redis_up);
  EXPECT_EQ(redis.cmd({"EXISTS", chunk_key(a, p, 0, 64)}).integer, 0);  // dropped
}

TEST(StoreRedis, MissingPiecesGiveAShorterPrefixNeverAPartialEntry) {
  RedisServer redis(tmp("missing"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  const KvCapture ref = whole_roundtrip(p, o);
  // A writer killed after its chunks and before its entry leaves chunks
  // that no entry names (and, at worst, an index naming nothing).
  const auto ek = keys_of(redis, a, 'e');
  ASSERT_EQ(ek.size(), 1u);
  redis.cmd({"DEL", ek[0]});
  {
    PromptStore b(cal(), lowrank_geometry(), o);
    auto m = b.take({}, cat(p, seq(3, 10)));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, 256u);
    EXPECT_TRUE(matches_prefix(m->cache, ref, 256));
    EXPECT_EQ(b.stats().redis_missing, 1u);
  }
  // An evicted middle chunk: the chunks before it.
  redis.cmd({"DEL", chunk_key(a, p, 1, 64)});
  PromptStore b(cal(), lowrank_geometry(), o);
  auto m = b.take({}, cat(p, seq(3, 10)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 64u);
  EXPECT_TRUE(matches_prefix(m->cache, ref, 64));
  redis.cmd({"DEL", chunk_key(a, p, 0, 64)});
  EXPECT_FALSE(b.take({}, cat(p, seq(3, 10))));
}

TEST(StoreRedis, MaxmemoryEvictionOnlyShortensMatches) {
  // Redis's own LRU evicting under a budget below what is stored (~1 MB
  // put, 600 KB allowed): every take is a miss or a correct prefix, never
  // an error.
  RedisServer redis(tmp("lru"), {"--maxmemory-policy", "allkeys-lru"});
  const std::string mem = redis.cmd({"INFO", "memory"}).str;
  const long long used = std::stoll(mem.substr(mem.find("used_memory:") + 12));
  ASSERT_TRUE(redis.cmd({"CONFIG", "SET", "maxmemory", std::to_string(used + 600000)}).ok());  // ~60% of the 1 MB put
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto shared = seq(1000, 128);  // a 2-chunk prefix every prompt starts with
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 40; ++i) {
    // Redis's LRU clock ticks once a second: four batches a second apart,
    // so that the older batches are the ones evicted.
    if (i % 10 == 0 && i) std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    prompts.push_back(cat(shared, seq(100000 + 1000 * i, 200 + 7 * i)));
    a.put(prompts.back(), prompt_capture(prompts.back()));
  }
  const std::string info = redis.cmd({"INFO", "stats"}).str;
  const size_t at = info.find("evicted_keys:");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GT(std::stoll(info.substr(at + 13)), 0) << "nothing was evicted; the test needs a smaller maxmemory";
  // Freeze what the puts' evictions left: the takes' replies count against
  // maxmemory too (client output buffers are in used_memory; 40 takes
  // evicted ~20 more keys, the shared chunks among them in 1 run of 25, and
  // then every later take missed). One more writer after the evictions
  // must put back whatever of the shared prefix is gone (its TOUCH finds
  // it missing), so every prompt has at least those 128 tokens to match.
  ASSERT_TRUE(redis.cmd({"CONFIG", "SET", "maxmemory", "0"}).ok());
  const auto last = cat(shared, seq(900000, 150));
  a.put(last, prompt_capture(last));
  PromptStore b(cal(), lowrank_geometry(), o);
  auto m = b.take({}, cat(last, seq(9, 5)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, last.size());
  size_t hits = 0, whole = 0;
  for (const auto& p : prompts) {
    m = b.take({}, cat(p, seq(9, 5)));
    if (!m) continue;
    ++hits;
    whole += m->common_prefix == p.size();
    ASSERT_GE(m->common_prefix, shared.size());
    ASSERT_LE(m->common_prefix, p.size());
    ASSERT_EQ(m->common_prefix % 64 == 0 || m->common_prefix == p.size(), true) << m->common_prefix;
    ASSERT_TRUE(matches_prefix(m->cache, whole_roundtrip(p, o), m->common_prefix));
  }
  // Which keys went is Redis's sampled choice (keys written within one LRU
  // second are alike to it), so how many prompts survive whole varies from
  // run to run (0 to 10 of 40 in 25 runs); that every one still matches
  // the shared prefix, that some came back shorter, and none wrong, does not.
  EXPECT_EQ(hits, prompts.size());
  EXPECT_LT(whole, prompts.size());  // evicted pieces shortened the rest
  EXPECT_EQ(b.stats().redis_errors, 0u);
}

TEST(StoreRedis, OtherModelsCalibrationsAndSettingsNeverMix) {
  RedisServer redis(tmp("compat"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  FitOptions f;
  f.ratios = {8};
  const Calibration other = fit_calibration({lowrank_capture(300, 60), lowrank_capture(300, 61)}, {lowrank_capture(200, 62)}, f);
  PromptStore b(other, lowrank_geometry(), o);
  EXPECT_FALSE(b.take({}, p));
  StoreOptions o4 = o;
  o4.ratio = 4;
  PromptStore c(cal(), lowrank_geometry(), o4);
  EXPECT_FALSE(c.take({}, p));
  EXPECT_EQ(b.stats().redis_errors + c.stats().redis_errors, 0u);
  // An entry of another namespace copied under this one's key is refused
  // by its salt (the keys would never collide; a copy is the worst case).
  b.put(p, prompt_capture(p));
  const auto eb = keys_of(redis, b, 'e'), ea = keys_of(redis, a, 'e');
  ASSERT_EQ(eb.size(), 1u);
  ASSERT_EQ(ea.size(), 1u);
  redis.cmd({"SET", ea[0], redis.cmd({"GET", eb[0]}).str});
  PromptStore d(cal(), lowrank_geometry(), o);
  auto m = d.take({}, cat(p, seq(3, 3)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 256u);  // the chunks; the foreign entry dropped
  EXPECT_EQ(d.stats().corrupt_dropped, 1u);
}

// Tenants (docs/store.md "Tenants") on a shared Redis: replica B never
// restores tenant A's prompt for another tenant (not even its chunks
// alone: they are on A's chain), walks no key of A's, and restores it for A.
TEST(StoreRedis, TenantsNeverShareAPrompt) {
  RedisServer redis(tmp("tenants"));
  const StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300), next = cat(p, seq(7, 30));
  a.put(p, prompt_capture(p), "tenant-a");
  EXPECT_FALSE(b.take({}, next, "tenant-b"));
  EXPECT_FALSE(b.take({}, next));
  EXPECT_EQ(b.stats().redis_bytes_read, 0u);  // nothing of A's fetched
  EXPECT_EQ(b.stats().redis_lookups, 2u);
  // A's index starts at its root, not at the salt (tenant ""'s level 0).
  const std::string ns = "kvtc:" + a.fingerprint().substr(0, 16);
  const std::string root = tenant_root(a, "tenant-a");
  EXPECT_EQ(redis.cmd({"EXISTS", ns + ":x:" + chain_key_from(root, p, 3, 64)}).integer, 1);
  EXPECT_EQ(redis.cmd({"EXISTS", ns + ":x:" + a.fingerprint()}).integer, 0);
  auto m = b.take({}, next, "tenant-a");
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_EQ(m->common_prefix, 300u);
  // B stores the same prompt for its tenant: 4 chunks of its own, and A's
  // entry stays (only an entry of the same tenant is dropped as contained).
  b.put(next, prompt_capture(next), "tenant-b");
  EXPECT_EQ(keys_of(redis, a, 'c').size(), 8u);
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 2u);
  // A's entry copied under B's key (a writer who can, without the secret
  // of issue 28's other half): refused by its root, dropped; B restores its
  // own chunks only.
  std::string key_a, key_b;
  for (const std::string& k : keys_of(redis, a, 'e')) (redis.cmd({"GET", k}).str.find("\"n_tokens\":300") != std::string::npos ? key_a : key_b) = k;
  ASSERT_FALSE(key_a.empty());
  ASSERT_FALSE(key_b.empty());
  redis.cmd({"SET", key_b, redis.cmd({"GET", key_a}).str});
  PromptStore c(cal(), lowrank_geometry(), o);
  m = c.take({}, cat(next, seq(3, 3)), "tenant-b");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 256u);  // B's 4 chunks; the foreign entry dropped
  EXPECT_EQ(c.stats().corrupt_dropped, 1u);
}

TEST(StoreRedis, PasswordAndDatabase) {
  RedisServer redis(tmp("auth"), {"--requirepass", "s3cret"});
  StoreOptions o = small();
  o.redis_url = "redis://:s3cret@127.0.0.1:" + std::to_string(redis.port()) + "/3";
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  EXPECT_TRUE(a.stats().redis_up) << a.stats().redis_error;
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  auto m = b.take({}, p);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  o.redis_url = "redis://:wrong@127.0.0.1:" + std::to_string(redis.port());
  PromptStore c(cal(), lowrank_geometry(), o);
  EXPECT_FALSE(c.stats().redis_up);
  EXPECT_NE(c.stats().redis_error.find("WRONGPASS"), std::string::npos) << c.stats().redis_error;
  EXPECT_FALSE(c.take({}, p));
  // The same AUTH given apart from the URL (kvtc-server's
  // --kvtc-redis-password-file), with an ACL user (--kvtc-redis-user).
  detail::RedisOptions admin;
  admin.url = "redis://:s3cret@127.0.0.1:" + std::to_string(redis.port());
  ASSERT_TRUE(detail::Redis(admin).run1({"ACL", "SETUSER", "kvtc", "on", ">u-pass", "~*", "+@all"}).ok());
  o.redis_url = "redis://127.0.0.1:" + std::to_string(redis.port()) + "/3";
  o.redis_user = "kvtc";
  o.redis_password = "u-pass";
  PromptStore d(cal(), lowrank_geometry(), o);
  EXPECT_TRUE(d.stats().redis_up) << d.stats().redis_error;
  auto md = d.take({}, p);
  ASSERT_TRUE(md);
  EXPECT_STREQ(md->tier, "redis");
}

// Every key is written with the TTL; a hit renews what it read (the
// chunks, the entry, its index), a put the chunks it shares; 0: no TTL.
TEST(StoreRedis, EveryKeyExpiresAndUseRenewsIt) {
  RedisServer redis(tmp("ttl"));
  StoreOptions o = on(redis);
  o.redis_ttl_s = 1000;
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  const auto keys = redis.cmd({"KEYS", "kvtc:*"}).elements;
  ASSERT_EQ(keys.size(), 4u + 1u + 1u);  // 4 chunks, the entry, its index
  auto ttl = [&](const std::string& k) { return redis.cmd({"TTL", k}).integer; };
  for (const auto& k : keys) {
    EXPECT_GT(ttl(k.str), 990) << k.str;
    EXPECT_LE(ttl(k.str), 1000) << k.str;
    redis.cmd({"EXPIRE", k.str, "500"});  // older
  }
  PromptStore b(cal(), lowrank_geometry(), o);
  auto m = b.take({}, cat(p, seq(7, 3)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 300u);
  for (const auto& k : keys) {
    EXPECT_GT(ttl(k.str), 990) << k.str;
    redis.cmd({"EXPIRE", k.str, "500"});
  }
  // A chat over the same first 128 tokens: it renews those 2 chunks.
  const auto q = cat(seq(1000, 128), seq(70000, 100));
  a.put(q, prompt_capture(q));
  for (size_t i = 0; i < 4; ++i) {
    if (i < 2)
      EXPECT_GT(ttl(chunk_key(a, p, i, 64)), 990) << i;
    else
      EXPECT_LE(ttl(chunk_key(a, p, i, 64)), 500) << i;
  }
  o.redis_ttl_s = 0;
  PromptStore c(cal(), lowrank_geometry(), o);
  const auto r = seq(20000, 300);
  c.put(r, prompt_capture(r));
  EXPECT_EQ(ttl(chunk_key(a, r, 0, 64)), -1);  // no TTL
  EXPECT_EQ(ttl(index_key(a, r, 3, 64)), -1);  // the index of its 4th chunk
}

// A Redis that would grow until the OOM killer (maxmemory 0, its default)
// or refuse writes when full (noeviction, its default policy) is named at
// start, in the log and in the stats; one that evicts within a budget is
// not; one that refuses CONFIG is logged as unknown.
TEST(StoreRedis, WarnsWhenRedisMemoryIsUnbounded) {
  std::mutex mu;
  std::vector<std::string> logs;
  auto logged = [&](const std::string& what) {
    std::lock_guard<std::mutex> g(mu);
    return std::any_of(logs.begin(), logs.end(), [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  auto warning_of = [&](const std::string& name, const std::vector<std::string>& args) {
    RedisServer redis(tmp(name), args);
    StoreOptions o = on(redis);
    o.log = [&](const std::string& s) {
      std::lock_guard<std::mutex> g(mu);
      logs.push_back(s);
    };
    PromptStore s(cal(), lowrank_geometry(), o);
    EXPECT_TRUE(s.stats().redis_up) << s.stats().redis_error;
    return s.stats().redis_config_warning;
  };
  std::string w = warning_of("defaults", {});
  EXPECT_NE(w.find("maxmemory is 0 on 127.0.0.1:"), std::string::npos) << w;
  EXPECT_NE(w.find("maxmemory-policy is noeviction on 127.0.0.1:"), std::string::npos) << w;
  EXPECT_TRUE(logged(w));
  w = warning_of("noeviction", {"--maxmemory", "100mb"});
  EXPECT_EQ(w.find("maxmemory is 0"), std::string::npos) << w;
  EXPECT_NE(w.find("maxmemory-policy is noeviction"), std::string::npos) << w;
  w = warning_of("lru", {"--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"});
  EXPECT_EQ(w, "");
  w = warning_of("no-config", {"--rename-command", "CONFIG", ""});
  EXPECT_EQ(w, "");
  EXPECT_TRUE(logged("maxmemory and maxmemory-policy unknown on 127.0.0.1:"));
}

// Redis under SIGSTOP: the kernel accepts the connection and the commands,
// nothing answers. A take waits one lookup deadline and is a miss (no
// fetch follows a failed lookup); the takes after it do not touch the
// network at all, also past redis_retry_ms: the tier's probe asks Redis
// then, on its own thread. A put's write on the worker waits on the frozen
// Redis to its own deadline and is skipped, holding no take. After SIGCONT
// the next probe finds it and it serves again.
TEST(StoreRedis, AFrozenRedisHoldsATakeOneDeadline) {
  RedisServer redis(tmp("frozen"));
  StoreOptions o = on(redis);
  o.redis_lookup_timeout_ms = kLookupMs;
  o.redis_timeout_ms = 1000;
  o.redis_retry_ms = 300;
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300), q = seq(5000, 300);
  a.put(p, prompt_capture(p));
  o.async = true;
  PromptStore b(cal(), lowrank_geometry(), o);
  ASSERT_TRUE(b.stats().redis_up);
  EXPECT_FALSE(b.take({}, seq(90000, 100)));  // a lookup: the connection is open when Redis freezes

  redis.freeze();
  const Timed t1 = timed_take(b, cat(p, seq(7, 3)));
  EXPECT_FALSE(t1.m);
  EXPECT_GE(t1.ms, kLookupMs - 5);  // it did wait on Redis
  EXPECT_LT(t1.ms, kLookupMs + kMarginMs);
  StoreStats st = b.stats();
  EXPECT_FALSE(st.redis_up);
  EXPECT_NE(st.redis_error.find("no complete answer within 100 ms"), std::string::npos) << st.redis_error;
  const Timed t2 = timed_take(b, cat(p, seq(7, 3)));  // within redis_retry_ms: no network
  EXPECT_FALSE(t2.m);
  EXPECT_LT(t2.ms, kLookupMs / 2);
  // A put: B's worker writes it to the frozen Redis (a 1 s deadline)
  // while B's takes keep their own.
  b.put(q, prompt_capture(q));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // past redis_retry_ms twice: probes asked Redis, not the take
  const Timed t3 = timed_take(b, cat(p, seq(7, 3)));
  EXPECT_FALSE(t3.m);
  EXPECT_LT(t3.ms, kLookupMs / 2);
  st = b.stats();
  EXPECT_EQ(st.redis_lookups_skipped, 2u);
  EXPECT_GE(st.redis_probes, 1u);  // every 300 ms, each ending at its 100 ms deadline
  const auto f0 = Clock::now();
  b.flush();  // the write gives up at its deadline
  const double flush_ms = std::chrono::duration<double, std::milli>(Clock::now() - f0).count();
  EXPECT_LT(flush_ms, 1000 + kMarginMs);
  st = b.stats();
  EXPECT_NE(st.redis_error.find("writing a 300-token prompt"), std::string::npos) << st.redis_error;
  std::printf(
      "[ measured ] frozen Redis, lookup deadline %d ms: take %.1f ms, %.3f ms within redis_retry_ms, %.1f ms after it (a put writing),"
      " the put's write gave up after %.0f ms (flush)\n",
      kLookupMs, t1.ms, t2.ms, t3.ms, flush_ms);

  redis.thaw();
  std::this_thread::sleep_for(std::chrono::milliseconds(450));  // a probe (every 300 + 100 ms) finds it
  EXPECT_TRUE(b.stats().redis_up);
  auto m = b.take({}, cat(p, seq(7, 3)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_EQ(m->common_prefix, 300u);
  EXPECT_TRUE(b.stats().redis_up);
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 1u);                 // q's write was skipped ...
  std::this_thread::sleep_for(std::chrono::milliseconds(350));  // (the worker's connection is past its retry too)
  b.put(cat(q, seq(3, 3)), prompt_capture(cat(q, seq(3, 3))));
  b.flush();
  EXPECT_EQ(keys_of(redis, a, 'e').size(), 2u);  // ... and the next one written
}

// A Redis that answers, but a byte every 20 ms (a proxy in between): the
// exchange ends at its deadline whether the lookup's reply trickles or the
// fetch's, and afterwards every reply is its own command's.
TEST(StoreRedis, ATricklingReplyEndsAtTheDeadline) {
  RedisServer redis(tmp("trickle"));
  TrickleProxy proxy(redis.port());
  StoreOptions o = on(redis);
  PromptStore a(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  const KvCapture ref = whole_roundtrip(p, o);
  o.redis_url = proxy.url();
  o.redis_lookup_timeout_ms = kLookupMs;
  o.redis_retry_ms = 200;
  PromptStore b(cal(), lowrank_geometry(), o);
  ASSERT_TRUE(b.stats().redis_up) << b.stats().redis_error;

  proxy.mode = TrickleProxy::kTrickle;  // the lookup's reply (~350 bytes: 7 s) trickles
  const Timed t1 = timed_take(b, cat(p, seq(7, 3)));
  EXPECT_FALSE(t1.m);
  EXPECT_GE(t1.ms, kLookupMs - 5);
  EXPECT_LT(t1.ms, kLookupMs + kMarginMs);
  EXPECT_LT(timed_take(b, cat(p, seq(7, 3))).ms, kLookupMs / 2);  // takes are off until a probe passes
  proxy.mode = TrickleProxy::kTrickleAfterGet;                    // the lookup passes; the fetch's reply (~30 KB) trickles
  std::this_thread::sleep_for(std::chrono::milliseconds(300));    // the probe (200 ms after the failure; no GET) passes
  const Timed t2 = timed_take(b, cat(p, seq(7, 3)));
  EXPECT_FALSE(t2.m);
  EXPECT_GE(proxy.gets_seen, 1);  // the fetch was sent
  EXPECT_GE(t2.ms, kLookupMs - 5);
  EXPECT_LT(t2.ms, 2 * kLookupMs + kMarginMs);  // the fetch's deadline allows for its ~100 KB at 100 MiB/s: 1 ms
  EXPECT_NE(b.stats().redis_error.find("no complete answer within"), std::string::npos) << b.stats().redis_error;
  std::printf("[ measured ] trickling Redis (1 byte / 20 ms), lookup deadline %d ms: take %.1f ms (lookup trickles), %.1f ms (fetch trickles)\n",
              kLookupMs, t1.ms, t2.ms);

  proxy.mode = TrickleProxy::kPass;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the next probe passes
  auto m = b.take({}, cat(p, seq(7, 3)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_EQ(m->common_prefix, 300u);
  EXPECT_TRUE(matches_prefix(m->cache, ref, 300));
  EXPECT_EQ(b.stats().corrupt_dropped, 0u);
}

// After an exchange cut at its deadline in the middle of a reply, or one
// whose reply does not parse, the next exchanges read their own replies:
// the connection that held the rest was closed, not reused.
TEST(RedisClient, NoExchangeReadsAnEarlierOnesReply) {
  RedisServer redis(tmp("desync"));
  TrickleProxy proxy(redis.port());
  const std::string big(200, 'A');
  redis.cmd({"SET", "a", big});
  redis.cmd({"SET", "b", "bbb"});
  detail::RedisOptions ro;
  ro.url = proxy.url();
  ro.timeout_ms = kLookupMs;
  ro.retry_ms = 0;
  detail::Redis r(ro);
  ASSERT_EQ(r.run1({"GET", "b"}).str, "bbb");
  auto in_step = [&] {
    for (int i = 0; i < 5; ++i) {
      const auto rs = r.run({{"GET", "b"}, {"GET", "a"}, {"PING"}});
      ASSERT_EQ(rs.size(), 3u);
      EXPECT_EQ(rs[0].str, "bbb");
      EXPECT_EQ(rs[1].str, big);
      EXPECT_EQ(rs[2].str, "PONG");
    }
  };
  for (int round = 0; round < 3; ++round) {
    proxy.mode = TrickleProxy::kTrickle;  // ~220 bytes of replies at 1 byte / 20 ms: cut after ~5
    try {
      (void)r.run({{"GET", "a"}, {"GET", "b"}});
      ADD_FAILURE() << "a trickling reply was not cut at the deadline";
    } catch (const detail::RedisDown& e) {
      EXPECT_NE(std::string(e.what()).find("no complete answer within 100 ms (0 of 2 replies)"), std::string::npos) << e.what();
    }
    proxy.mode = TrickleProxy::kPass;  // the rest of the cut replies arrives at once
    in_step();
    proxy.garbage = true;  // a reply that is not the protocol
    try {
      (void)r.run1({"GET", "b"});
      ADD_FAILURE() << "a reply that does not parse was accepted";
    } catch (const detail::RedisDown& e) {
      EXPECT_NE(std::string(e.what()).find("does not parse"), std::string::npos) << e.what();
    }
    in_step();
  }
}

// Redis Cluster: a refresh of the slot map asks its nodes at once, so a
// frozen seed costs nothing when another answers.
TEST(StoreRedisCluster, AFrozenSeedDoesNotHoldTheMapRefresh) {
  RedisCluster cl(tmp("frozen-seed"));
  // A key that node 1 holds.
  std::string key;
  for (int i = 0; key.empty(); ++i) {
    const std::string k = std::string("k") + std::to_string(i);
    if (cl.nodes[1]->cmd({"SET", k, "v"}).ok()) key = k;
  }
  detail::RedisOptions ro;
  ro.cluster = {cl.nodes[0]->hostport(), cl.nodes[1]->hostport()};
  ro.timeout_ms = kLookupMs;
  detail::Redis r(ro);
  cl.nodes[0]->freeze();  // briefly: the cluster marks a node failing after 5 s
  const auto t0 = Clock::now();
  const auto v = r.run1({"GET", key});
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  cl.nodes[0]->thaw();
  EXPECT_EQ(v.str, "v");
  EXPECT_LT(ms, kLookupMs);
  EXPECT_EQ(r.map_refreshes(), 1u);
}

// A host name is resolved within the deadline; a name that does not
// resolve and an address that does not answer cost a take no more than
// one.
TEST(StoreRedis, HostNamesAndDeadHostsKeepTheBound) {
  RedisServer redis(tmp("names"));
  StoreOptions o = small();
  o.redis_url = "redis://localhost:" + std::to_string(redis.port());
  o.redis_lookup_timeout_ms = kLookupMs;
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  ASSERT_TRUE(a.stats().redis_up) << a.stats().redis_error;
  const auto p = seq(1000, 300);
  a.put(p, prompt_capture(p));
  auto m = b.take({}, cat(p, seq(7, 3)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  // A name that does not exist, and an address nothing should answer at
  // (unroutable; or answered by a sandbox's interceptor that never speaks
  // Redis: the same bound).
  for (const std::string url : {"redis://redis.invalid:6379", "redis://10.255.255.1:6379"}) {
    o.redis_url = url;
    o.redis_timeout_ms = 300;
    o.redis_retry_ms = 100;
    const auto t0 = Clock::now();
    PromptStore s(cal(), lowrank_geometry(), o);
    const double open_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const StoreStats st = s.stats();
    EXPECT_FALSE(st.redis_up) << url;
    EXPECT_NE(st.redis_error.find(url.substr(8, url.rfind(':') - 8)), std::string::npos) << st.redis_error;
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    const Timed t = timed_take(s, cat(p, seq(7, 3)));  // no network: the probes ask, on the tier's thread
    EXPECT_FALSE(t.m);
    EXPECT_LT(t.ms, kLookupMs / 2) << url;
    std::printf("[ measured ] %s: store opened in %.1f ms (a 300 ms write deadline), take %.1f ms: %s\n", url.c_str(), open_ms, t.ms,
                s.stats().redis_error.c_str());
  }
}

// The client's key slots are the servers'; and AUTH reaches every node of a
// cluster that requires a password (requirepass, masterauth), given apart
// from the seeds (one cluster for both: starting one costs ~2 s).
TEST(StoreRedisCluster, KeySlotsMatchTheServersAndAuthReachesEveryNode) {
  RedisCluster cl(tmp("slots"), {}, "cl-s3cret");
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) {
    std::string k = "kvtc:" + std::to_string(rng());
    if (i % 3 == 0) k += "{tag" + std::to_string(i % 7) + "}x";
    if (i % 10 == 0) k += "{}";
    EXPECT_EQ(detail::Redis::key_slot(k), cl.nodes[0]->cmd({"CLUSTER", "KEYSLOT", k}).integer) << k;
  }
  StoreOptions o = small();
  o.redis_cluster = {cl.nodes[0]->hostport()};
  o.redis_password = "cl-s3cret";
  PromptStore a(cal(), lowrank_geometry(), o), b(cal(), lowrank_geometry(), o);
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 3; ++i) {
    ps.push_back(seq(1000 * (i + 1), 300));
    a.put(ps.back(), prompt_capture(ps.back()));
  }
  EXPECT_TRUE(a.stats().redis_up) << a.stats().redis_error;
  for (auto& n : cl.nodes) EXPECT_GT(n->cmd({"DBSIZE"}).integer, 0);  // every master was written
  for (const auto& p : ps) {
    auto m = b.take({}, p);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, 300u);
  }
  o.redis_password = "wrong";
  PromptStore c(cal(), lowrank_geometry(), o);
  EXPECT_FALSE(c.stats().redis_up);
  EXPECT_NE(c.stats().redis_error.find("WRONGPASS"), std::string::npos) << c.stats().redis_error;
  EXPECT_FALSE(c.take({}, ps[0]));
}

TEST(StoreRedisCluster, ReplicasShareAClusterThroughMigrations) {
  RedisCluster cl(tmp("cluster"));
  StoreOptions o = small();
  o.redis_cluster = {cl.nodes[0]->hostport()};  // one seed: the client learns the rest
  PromptStore a(cal(), lowrank_geometry(), o);
  o.redis_cluster = {cl.nodes[2]->hostport(), cl.nodes[1]->hostport()};
  PromptStore b(cal(), lowrank_geometry(), o);
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 6; ++i) {
    ps.push_back(seq(1000 * (i + 1), 300 + 20 * i));
    a.put(ps.back(), prompt_capture(ps.back()));
  }
  EXPECT_TRUE(a.stats().redis_up) << a.stats().redis_error;
  // The keys spread over all three masters.
  for (auto& n : cl.nodes) EXPECT_GT(n->cmd({"DBSIZE"}).integer, 0);
  auto m = b.take({}, cat(ps[0], seq(3, 5)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "redis");
  EXPECT_TRUE(matches_prefix(m->cache, whole_roundtrip(ps[0], o), uint32_t(ps[0].size())));

  // Move the slot of ps[1]'s first chunk to another master, as a resharding
  // does: first half-way (ASK), then for good (MOVED).
  const std::string key = chunk_key(a, ps[1], 0, 64);
  const long long slot = cl.nodes[0]->cmd({"CLUSTER", "KEYSLOT", key}).integer;
  int src = -1;
  for (int i = 0; i < 3; ++i)
    if (cl.nodes[size_t(i)]->cmd({"CLUSTER", "COUNTKEYSINSLOT", std::to_string(slot)}).integer > 0) src = i;
  ASSERT_GE(src, 0);
  const int dst = (src + 1) % 3;
  const std::string src_id = cl.nodes[size_t(src)]->cmd({"CLUSTER", "MYID"}).str, dst_id = cl.nodes[size_t(dst)]->cmd({"CLUSTER", "MYID"}).str;
  ASSERT_TRUE(cl.nodes[size_t(dst)]->cmd({"CLUSTER", "SETSLOT", std::to_string(slot), "IMPORTING", src_id}).ok());
  ASSERT_TRUE(cl.nodes[size_t(src)]->cmd({"CLUSTER", "SETSLOT", std::to_string(slot), "MIGRATING", dst_id}).ok());
  const auto mig = cl.nodes[size_t(src)]->cmd({"MIGRATE", "127.0.0.1", std::to_string(cl.nodes[size_t(dst)]->port()), "", "0", "5000", "KEYS", key});
  ASSERT_TRUE(mig.ok()) << mig.str;
  PromptStore b2(cal(), lowrank_geometry(), o);  // a replica with a fresh slot map
  m = b2.take({}, cat(ps[1], seq(3, 5)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, ps[1].size());
  EXPECT_GE(b2.stats().redis_redirects, 1u);  // ASK followed
  for (auto& n : cl.nodes) ASSERT_TRUE(n->cmd({"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", dst_id}).ok());
  const uint64_t before = b.stats().redis_redirects;
  m = b.take({}, cat(ps[1], seq(3, 5)));  // b's map is stale: MOVED, refreshed
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, ps[1].size());
  EXPECT_TRUE(matches_prefix(m->cache, whole_roundtrip(ps[1], o), uint32_t(ps[1].size())));
  EXPECT_GT(b.stats().redis_redirects, before);

  // A master down: a miss for what it held, and the store keeps serving.
  cl.nodes[1]->stop();
  PromptStore b3(cal(), lowrank_geometry(), o);
  for (const auto& p : ps) (void)b3.take({}, p);  // no throw, no hang
  EXPECT_GE(b3.stats().redis_errors, 1u);
}

// Redis 7 with cluster-preferred-endpoint-type unknown-endpoint names no
// host in its redirects ("MOVED 1234 :7001": the client is to use the
// address it reached the sender at). Slots move between masters
// (redis-cli --cluster reshard) while replicas take and put: every take is
// a miss or a correct prefix, never a wrong value (a reply read for another
// command would fail its checksum: corrupt_dropped), and once the slots
// have moved every prompt restores whole through the new map.
TEST(StoreRedisCluster, ReshardingUnderTrafficWithHostlessRedirects) {
  RedisCluster cl(tmp("unknown-endpoint"), {"--cluster-preferred-endpoint-type", "unknown-endpoint"});
  for (int i = 0;; ++i) {  // the mode is on: a redirect without its host
    const auto r = cl.nodes[0]->cmd({"GET", std::string("k") + std::to_string(i)});
    if (r.ok()) continue;
    ASSERT_EQ(r.str.rfind("MOVED ", 0), 0u) << r.str;
    ASSERT_NE(r.str.find(" :"), std::string::npos) << r.str;
    break;
  }
  StoreOptions o = small();
  o.redis_cluster = {cl.nodes[0]->hostport()};
  PromptStore a(cal(), lowrank_geometry(), o);  // the writer
  o.redis_cluster = {cl.nodes[2]->hostport()};
  o.ram_bytes = 1;  // no entry fits: every take of the reader asks Redis
  PromptStore b(cal(), lowrank_geometry(), o);
  std::vector<std::vector<int32_t>> ps;
  std::vector<KvCapture> refs;
  auto put = [&](std::vector<int32_t> p) {
    a.put(p, prompt_capture(p));
    refs.push_back(whole_roundtrip(p, o));
    ps.push_back(std::move(p));
  };
  for (int i = 0; i < 8; ++i) put(seq(1000 * (i + 1), 300 + 10 * size_t(i)));
  for (const auto& p : ps) ASSERT_TRUE(b.take({}, cat(p, seq(3, 3))));  // b's map, soon stale
  const std::string ids[2] = {cl.nodes[0]->cmd({"CLUSTER", "MYID"}).str, cl.nodes[1]->cmd({"CLUSTER", "MYID"}).str};

  size_t takes = 0, hits = 0;
  const fs::path log = tmp("reshard.log");
  for (int move = 0; move < 2; ++move) {  // node 0's slots to node 1, then some back
    const pid_t cli =
        kvtc::testing::spawn({"sh", "-c", "\"$0\" \"$@\" >>" + log.string() + " 2>&1", "redis-cli", "--cluster", "reshard", cl.nodes[0]->hostport(),
                              "--cluster-from", ids[move], "--cluster-to", ids[1 - move], "--cluster-slots", "1500", "--cluster-yes"});
    int status = 0;
    for (int round = 0; ::waitpid(cli, &status, WNOHANG) == 0; ++round) {
      for (size_t i = 0; i < ps.size(); ++i) {
        auto m = b.take({}, cat(ps[i], seq(3, 3)));
        ++takes;
        if (!m) continue;
        ++hits;
        ASSERT_LE(m->common_prefix, ps[i].size());
        ASSERT_TRUE(matches_prefix(m->cache, refs[i], m->common_prefix));
      }
      if (round % 4 == 0 && ps.size() < 40) put(seq(100000 + 1000 * int32_t(ps.size()), 200));  // writes meet the moves too
    }
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "redis-cli --cluster reshard failed; see " << log;
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    auto m = b.take({}, cat(ps[i], seq(3, 3)));
    ASSERT_TRUE(m) << i;
    EXPECT_EQ(m->common_prefix, ps[i].size());
    EXPECT_TRUE(matches_prefix(m->cache, refs[i], m->common_prefix));
  }
  const StoreStats sa = a.stats(), sb = b.stats();
  std::printf(
      "[ measured ] resharding 2 x 1500 slots: %zu takes during it, %zu hits; reader: %llu redirects, %llu errors; writer: %llu redirects, %llu "
      "errors\n",
      takes, hits, (unsigned long long)sb.redis_redirects, (unsigned long long)sb.redis_errors, (unsigned long long)sa.redis_redirects,
      (unsigned long long)sa.redis_errors);
  EXPECT_GT(sb.redis_redirects, 0u);
  EXPECT_EQ(sb.corrupt_dropped, 0u);
  EXPECT_EQ(sa.redis_entries_written, ps.size());
  fs::remove(log);
}

// ---- secrets (docs/store.md "Secrets") ---------------------------------------

namespace {

std::string entry_key(const PromptStore& s, const std::vector<int32_t>& t, size_t m, uint32_t C, std::span<const uint8_t> secret = {}) {
  return chain_link('e', m ? chain_key(s, t, m - 1, C, secret) : chain_root(s, secret), std::span(t).subspan(m * C), secret);
}
// A command on database `db` of `r`.
detail::RedisReply cmd_db(const RedisServer& r, int db, const detail::RedisCommand& c) {
  detail::RedisOptions o;
  o.url = r.url() + "/" + std::to_string(db);
  return detail::Redis(o).run1(c);
}
// Every value of database `db` by key (an index hash's: each field's value, under "key field").
std::map<std::string, std::string> values_of(const RedisServer& r, int db) {
  std::map<std::string, std::string> out;
  for (const auto& k : cmd_db(r, db, {"KEYS", "kvtc:*"}).elements) {
    if (cmd_db(r, db, {"TYPE", k.str}).str == "hash") {
      const auto h = cmd_db(r, db, {"HGETALL", k.str}).elements;
      for (size_t i = 0; i + 1 < h.size(); i += 2) out[k.str + " " + h[i].str] = h[i + 1].str;
    } else {
      out[k.str] = cmd_db(r, db, {"GET", k.str}).str;
    }
  }
  return out;
}
bool holds_tokens(const std::string& b, const std::vector<int32_t>& t) {
  for (size_t i = 0; i + 8 <= t.size(); ++i) {
    std::string run;
    for (size_t j = i; j < i + 8; ++j)
      for (int k = 0; k < 4; ++k) run.push_back(char(uint32_t(t[j]) >> (8 * k)));
    if (b.find(run) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

// Values written without the secret, with another, or moved to another key
// or index field are never served: each is deleted, counted as foreign,
// never decoded, and the match ends before it.
TEST(StoreRedis, ForeignValuesAreNeverServed) {
  RedisServer redis(tmp("foreign"));
  const std::vector<uint8_t> sa = secret_of(3);
  const StoreOptions ou = on(redis), op = with_secret(on(redis), sa, false), o2 = with_secret(on(redis), secret_of(4), false);
  const auto p = seq(1000, 300), q = seq(5000, 300);  // 4 chunks and a tail each
  const KvCapture ref = whole_roundtrip(p, ou);
  const PromptStore keyer(cal(), lowrank_geometry(), op), ukeyer(cal(), lowrank_geometry(), ou);
  const std::string ns = "kvtc:" + keyer.fingerprint().substr(0, 16) + ":", uns = "kvtc:" + ukeyer.fingerprint().substr(0, 16) + ":";
  auto ck = [&](const std::vector<int32_t>& t, size_t i) { return ns + "c:" + chain_key(keyer, t, i, 64, sa); };
  auto ek = [&](const std::vector<int32_t>& t) { return entry_key(keyer, t, 4, 64, sa); };
  auto xk = [&](const std::vector<int32_t>& t) { return ns + "x:" + chain_key(keyer, t, 3, 64, sa); };
  // Redis emptied, p put by a store without the secret and one with it (fresh stores: their RAM does not hold it).
  auto fill = [&](const std::vector<std::vector<int32_t>>& ps) {
    redis.cmd({"FLUSHALL"});
    PromptStore u(cal(), lowrank_geometry(), ou), w(cal(), lowrank_geometry(), op);
    u.put(p, prompt_capture(p));
    for (const auto& x : ps) w.put(x, prompt_capture(x));
    ASSERT_EQ(redis.cmd({"EXISTS", ns + "e:" + ek(p)}).integer, 1);
  };
  // A replica with the secret and an empty RAM takes p.
  auto take = [&](const std::vector<int32_t>& t, uint64_t foreign) -> uint32_t {
    PromptStore r(cal(), lowrank_geometry(), op);
    auto m = r.take({}, cat(t, seq(3, 5)));
    const StoreStats st = r.stats();
    EXPECT_EQ(st.foreign_dropped, foreign);
    EXPECT_EQ(st.tiers.back().foreign_dropped, foreign);
    EXPECT_EQ(st.corrupt_dropped, 0u);  // nothing foreign was decoded
    if (m) {
      EXPECT_TRUE(matches_prefix(m->cache, t == p ? ref : whole_roundtrip(t, ou), m->common_prefix));
    }
    return m ? m->common_prefix : 0;
  };
  // 1. The unsealed entry at the sealed entry's key: dropped with its index
  // field; the chunks (sealed) still restore.
  fill({p});
  redis.cmd({"SET", ns + "e:" + ek(p), redis.cmd({"GET", uns + "e:" + entry_key(ukeyer, p, 4, 64)}).str});
  EXPECT_EQ(take(p, 1), 256u);
  EXPECT_EQ(redis.cmd({"EXISTS", ns + "e:" + ek(p)}).integer, 0);
  EXPECT_EQ(redis.cmd({"HEXISTS", xk(p), ek(p)}).integer, 0);
  // 2. A valid unsealed container of the same tokens at the sealed chunk 1's key: nothing restored.
  fill({p});
  redis.cmd({"SET", ck(p, 0), redis.cmd({"GET", uns + "c:" + chain_key(ukeyer, p, 0, 64)}).str});
  EXPECT_EQ(take(p, 1), 0u);
  EXPECT_EQ(redis.cmd({"EXISTS", ck(p, 0)}).integer, 0);
  // 3. The unsealed index value (which holds tokens) at the sealed index's field:
  // the field is dropped; the run of chunks alone restores.
  fill({p});
  redis.cmd({"HSET", xk(p), ek(p), redis.cmd({"HGET", uns + "x:" + chain_key(ukeyer, p, 3, 64), entry_key(ukeyer, p, 4, 64)}).str});
  EXPECT_EQ(take(p, 1), 256u);
  EXPECT_EQ(redis.cmd({"HEXISTS", xk(p), ek(p)}).integer, 0);
  // 4. Another secret's entry of p at this one's key.
  fill({p});
  {
    PromptStore w2(cal(), lowrank_geometry(), o2);
    w2.put(p, prompt_capture(p));
    const std::string ns2 = "kvtc:" + w2.fingerprint().substr(0, 16) + ":";
    redis.cmd({"SET", ns + "e:" + ek(p), redis.cmd({"GET", ns2 + "e:" + entry_key(w2, p, 4, 64, secret_of(4))}).str});
  }
  EXPECT_EQ(take(p, 1), 256u);
  // 5. Sealed with this secret, moved: q's chunk 2 at p's chunk 2 (p keeps
  // its chunk 1), then q's index value under p's field.
  fill({p, q});
  redis.cmd({"SET", ck(p, 1), redis.cmd({"GET", ck(q, 1)}).str});
  EXPECT_EQ(take(p, 1), 64u);
  EXPECT_EQ(take(q, 0), 300u);
  fill({p, q});
  redis.cmd({"HSET", xk(p), ek(p), redis.cmd({"HGET", xk(q), ek(q)}).str});
  EXPECT_EQ(take(p, 1), 256u);
  EXPECT_EQ(take(q, 0), 300u);
}

// With encrypt, no value in Redis holds the prompt's tokens (with
// authentication alone the entry and the index do: the control); the same
// prompt put into two databases gives two ciphertexts under the same keys;
// a replica with the secret restores what a store without one restores.
TEST(StoreRedis, EncryptedValuesHoldNoTokensAndRestoreTheSame) {
  RedisServer redis(tmp("encrypted"));
  const auto p = seq(70000, 300);
  std::vector<std::optional<PromptStore::Match>> got;
  for (int db = 0; db < 4; ++db) {  // 0: no secret; 1: authenticated; 2, 3: encrypted
    StoreOptions o = small();
    o.redis_url = redis.url() + "/" + std::to_string(db);
    if (db) o = with_secret(o, secret_of(9), db >= 2);
    {
      PromptStore w(cal(), lowrank_geometry(), o);
      w.put(p, prompt_capture(p));
      EXPECT_TRUE(w.stats().redis_up) << w.stats().redis_error;
    }
    PromptStore r(cal(), lowrank_geometry(), o);
    got.push_back(r.take({}, cat(p, seq(3, 5))));
    ASSERT_TRUE(got.back());
    EXPECT_STREQ(got.back()->tier, "redis");
    EXPECT_EQ(got.back()->common_prefix, 300u);
  }
  for (int db = 1; db < 4; ++db) {
    EXPECT_EQ(got[db]->cache.blocks[0].k, got[0]->cache.blocks[0].k);
    EXPECT_EQ(got[db]->cache.blocks[0].v, got[0]->cache.blocks[0].v);
  }
  const auto plain = values_of(redis, 1), e2 = values_of(redis, 2), e3 = values_of(redis, 3);
  int control = 0;
  for (const auto& [k, v] : plain) control += holds_tokens(v, p);
  EXPECT_GE(control, 2) << "the check finds the tokens in the authenticated store's entry and index value";
  ASSERT_EQ(e2.size(), 4u + 1u + 1u);  // chunks, the entry, the index field
  for (const auto& [k, v] : e2) {
    EXPECT_FALSE(holds_tokens(v, p)) << k;
    ASSERT_TRUE(e3.count(k)) << k;
    EXPECT_NE(e3.at(k), v) << k;
    EXPECT_NE(e3.at(k).substr(0, 12), v.substr(0, 12)) << k << ": a nonce repeated";
  }
}

// ---- one calibration for a fleet (docs/store.md "Shared calibration") ----------

// The first publish wins (SET NX) and every later one gets that one back;
// the key and value follow the spec (K_chain HMAC, sealed kind 'k'); another
// secret reads nothing; a changed byte is refused, never returned; without
// a secret nothing is shared.
TEST(StoreRedis, OneSharedCalibrationTheFirstPublished) {
  RedisServer redis(tmp("shared-calib"));
  StoreOptions o = on(redis);
  o.secret = secret_of(7);
  o.redis_ttl_s = 600;
  std::vector<std::string> logged;
  o.log = [&](const std::string& s) { logged.push_back(s); };
  const std::string sha = lowrank_geometry().model_sha256;
  EXPECT_FALSE(fetch_shared_calibration(o, sha));  // none yet
  const Calibration first = cal();
  FitOptions fo;
  fo.ratios = {4};
  const Calibration other = fit_calibration({lowrank_capture(300, 77)}, {lowrank_capture(100, 78)}, fo);
  ASSERT_NE(first.id, other.id);
  auto w1 = publish_shared_calibration(o, sha, first);
  ASSERT_TRUE(w1);
  EXPECT_EQ(w1->id, first.id);
  auto w2 = publish_shared_calibration(o, sha, other);  // lost the race: gets the first back
  ASSERT_TRUE(w2);
  EXPECT_EQ(w2->id, first.id);
  auto got = fetch_shared_calibration(o, sha);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->id, first.id);
  EXPECT_EQ(got->blocks[0][0].tables.size(), first.blocks[0][0].tables.size());
  // The key: kvtc:calib:1: + 32 hex of HMAC-SHA256(K_chain, "kvtc shared calibration 1\n" sha "\n" settings).
  const std::string key = shared_calibration_key(o, sha);
  const std::vector<uint8_t> kc = store::hkdf_sha256(o.secret, std::span(reinterpret_cast<const uint8_t*>("kvtc-store-secret/1"), 19),
                                                     std::span(reinterpret_cast<const uint8_t*>("kvtc key chain"), 14), 32);
  const std::string what = "kvtc shared calibration 1\n" + sha + "\n" + o.kv_settings.text();
  const std::vector<uint8_t> h = store::hmac_sha256(kc, std::span(reinterpret_cast<const uint8_t*>(what.data()), what.size()));
  EXPECT_EQ(key, "kvtc:calib:1:" + store::hex(std::span(h).first(16)));
  const auto ttl = redis.cmd({"TTL", key});
  EXPECT_GT(ttl.integer, 0);
  EXPECT_LE(ttl.integer, 600);
  // Another secret: another key, nothing there.
  StoreOptions o2 = o;
  o2.secret = secret_of(99);
  EXPECT_NE(shared_calibration_key(o2, sha), key);
  EXPECT_FALSE(fetch_shared_calibration(o2, sha));
  // A flipped byte: refused (logged), not returned.
  std::string v = redis.cmd({"GET", key}).str;
  v[v.size() / 2] = char(v[v.size() / 2] ^ 0x20);
  redis.cmd({"SET", key, v});
  logged.clear();
  EXPECT_FALSE(fetch_shared_calibration(o, sha));
  ASSERT_FALSE(logged.empty());
  EXPECT_NE(logged.back().find("not used"), std::string::npos) << logged.back();
  // No secret: refused outright.
  StoreOptions o3 = on(redis);
  EXPECT_THROW(fetch_shared_calibration(o3, sha), Error);
  EXPECT_THROW(publish_shared_calibration(o3, sha, first), Error);
}
