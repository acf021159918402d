// The prompt store (include/kvtc/store.h) on synthetic caches — synthetic on
// purpose: these test the store's rules, keys, tiers and faults, not a
// model (tests/test_server.py runs it inside llama-server on a real one).
// The synthetic "model" gives every token a cache that depends on its id
// and position only (tests/synthetic.h), so prompts with a common prefix
// share its cache exactly, as the chunk keys assume.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "kvtc/kvtc.h"
#include "synthetic.h"

using namespace kvtc;
namespace fs = std::filesystem;

namespace {

const Calibration& cal() {
  static const Calibration c = fitted();
  return c;
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) : path(fs::temp_directory_path() / ("kvtc-test-store-" + std::to_string(::getpid()) + "-" + name)) {
    fs::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Small pieces so that short prompts span several chunks: 64-token chunks,
// a 4-token sink, a 32-token window, ratio 8, f32 arithmetic (exact
// comparisons with the codec), the DP's pieces: its per-token quantizers
// code a piece as the whole prompt's container codes those tokens, which
// the tests compare exactly (whole_roundtrip); the entropy-coded default
// rate-controls each piece on its own (EntropyCodedPieces tests it, and the
// server tests run it on a real model).
StoreOptions small(bool async = false) {
  StoreOptions o;
  o.entropy_coded = false;
  o.window_bits = 16;
  o.ratio = 8;
  o.chunk_tokens = 64;
  o.sink = 4;
  o.window = 32;
  o.precision = Precision::kF32;
  o.async = async;
  o.threads = 2;
  return o;
}

KvCapture whole_roundtrip(const std::vector<int32_t>& tokens, const StoreOptions& o) {
  return kvtc::whole_roundtrip(tokens, o, cal());
}

void expect_prefix_of(const KvCapture& got, const KvCapture& full, uint32_t n) {
  ASSERT_TRUE(matches_prefix(got, full, n));
}

void flip_byte(const fs::path& p, size_t at) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x5a);
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
}

std::vector<fs::path> files_in(const fs::path& dir, const std::string& ext) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& d : fs::recursive_directory_iterator(dir, ec))
    if (d.path().extension() == ext) out.push_back(d.path());
  return out;
}

// The entry key of a prompt with m full chunks of C tokens (docs/store.md
// "Keys"): names its file, entries/<key>.kvse.
std::string entry_key(const PromptStore& s, const std::vector<int32_t>& t, size_t m, uint32_t C, std::span<const uint8_t> secret = {}) {
  const std::string h = m ? chain_key(s, t, m - 1, C, secret) : chain_root(s, secret);
  return chain_link('e', h, std::span(t).subspan(m * C), secret);
}

uint64_t bytes_in(const fs::path& dir) {
  uint64_t n = 0;
  for (const auto& f : files_in(dir, ".kvtc")) n += fs::file_size(f);
  for (const auto& f : files_in(dir, ".kvse")) n += fs::file_size(f);
  return n;
}

}  // namespace

TEST(Store, RestoresWhatTheCodecRestoresForTheWholePrompt) {
  const StoreOptions o = small();
  PromptStore s(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300);  // 4 chunks (256 tokens) + a tail of 44 (12 coded, 32 raw)
  s.put(p, prompt_capture(p));
  const KvCapture ref = whole_roundtrip(p, o);

  // The same prompt again plus a question: all 300 tokens come back.
  auto m = s.take({}, cat(p, seq(5, 20)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "ram");
  EXPECT_EQ(m->common_prefix, 300u);
  EXPECT_EQ(m->tokens, p);
  expect_prefix_of(m->cache, ref, 300);

  // A prompt that leaves it after 130 tokens (43% of it): exactly those.
  m = s.take({}, cat(seq(1000, 130), seq(7, 100)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 130u);
  expect_prefix_of(m->cache, ref, 130);

  const StoreStats st = s.stats();
  EXPECT_EQ(st.puts, 1u);
  EXPECT_EQ(st.entries, 1u);
  EXPECT_EQ(st.chunks, 4u);
  EXPECT_EQ(st.hits_ram, 2u);
  EXPECT_EQ(st.tokens_restored, 430u);
  EXPECT_GT(st.ram_bytes, 0u);
  EXPECT_LT(st.ram_bytes, prompt_capture(p).f16_bytes() / 2);  // compressed (ratio 8 on the coded tokens)
}

TEST(Store, ShortPromptsAndTailsOnly) {
  const StoreOptions o = small();
  PromptStore s(cal(), lowrank_geometry(), o);
  for (size_t n : {1u, 4u, 20u, 36u, 95u, 96u, 97u}) {  // sink only, window only, a chunk's edge
    const auto p = seq(int32_t(20000 + 1000 * n), n);
    s.put(p, prompt_capture(p));
    auto m = s.take({}, p);
    ASSERT_TRUE(m) << n;
    expect_prefix_of(m->cache, whole_roundtrip(p, o), uint32_t(n));
  }
}

TEST(Store, FollowsLlamaServersSelectionRules) {
  PromptStore s(cal(), lowrank_geometry(), small());
  const auto a = seq(1000, 200);
  s.put(a, prompt_capture(a));
  // Keeps less than 25% of the entry: not a candidate.
  EXPECT_FALSE(s.take({}, cat(seq(1000, 40), seq(9, 10))));
  // The slot's own prompt keeps as much and is as similar: no better.
  EXPECT_FALSE(s.take(seq(1000, 150), cat(seq(1000, 150), seq(9, 10))));
  // The slot holds something else: the entry wins.
  auto m = s.take(seq(50, 100), cat(seq(1000, 150), seq(9, 10)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 150u);
  // Entries are not consumed by a take (the store outlives the slot).
  EXPECT_TRUE(s.take({}, a));
  EXPECT_EQ(s.stats().misses, 2u);
}

TEST(Store, SharedPrefixesAreStoredOnce) {
  // Ten chats with the same 256-token system prompt (4 chunks) and their
  // own 100 tokens: 4 shared chunks + 1 own chunk each + 10 tails.
  PromptStore s(cal(), lowrank_geometry(), small());
  const auto sys = seq(1000, 256);
  uint64_t one_entry = 0;
  for (int i = 0; i < 10; ++i) {
    const auto p = cat(sys, seq(100000 * (i + 1), 100));
    s.put(p, prompt_capture(p));
    if (i == 0) one_entry = s.stats().ram_bytes;
  }
  const StoreStats st = s.stats();
  EXPECT_EQ(st.entries, 10u);
  EXPECT_EQ(st.chunks, 14u);
  EXPECT_EQ(st.chunks_written, 14u);
  EXPECT_EQ(st.chunks_shared, 36u);
  EXPECT_LT(st.ram_bytes, 10 * one_entry * 6 / 10);  // well under ten copies
  // Every chat still restores its own prompt.
  for (int i = 0; i < 10; ++i) {
    const auto p = cat(sys, seq(100000 * (i + 1), 100));
    auto m = s.take({}, p);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, 356u);
    expect_prefix_of(m->cache, whole_roundtrip(p, small()), 356);
  }
}

TEST(Store, ContainedPromptsAreDroppedAndNotStoredTwice) {
  PromptStore s(cal(), lowrank_geometry(), small());
  const auto t1 = seq(1000, 150), t2 = cat(t1, seq(5000, 100));
  s.put(t1, prompt_capture(t1));
  EXPECT_FALSE(s.wants(seq(1000, 100)));  // held by t1
  EXPECT_TRUE(s.wants(t2));
  s.put(t2, prompt_capture(t2));  // turn 2 contains turn 1: turn 1 goes
  StoreStats st = s.stats();
  EXPECT_EQ(st.entries, 1u);
  s.put(t1, prompt_capture(t1));  // already inside t2
  st = s.stats();
  EXPECT_EQ(st.entries, 1u);
  EXPECT_EQ(st.puts, 2u);
  EXPECT_EQ(st.puts_contained, 1u);
}

TEST(Store, RamBudgetEvictsTheLeastRecentlyUsed) {
  StoreOptions o = small();
  PromptStore probe(cal(), lowrank_geometry(), o);
  const auto p0 = seq(1 << 20, 300);
  probe.put(p0, prompt_capture(p0));
  const uint64_t one = probe.stats().ram_bytes;
  o.ram_bytes = one * 3 + one / 2;  // room for three
  PromptStore s(cal(), lowrank_geometry(), o);
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 5; ++i) ps.push_back(seq((i + 1) << 20, 300));
  for (int i = 0; i < 3; ++i) s.put(ps[i], prompt_capture(ps[i]));
  ASSERT_TRUE(s.take({}, ps[0]));  // ps[0] is now the most recently used
  for (int i = 3; i < 5; ++i) s.put(ps[i], prompt_capture(ps[i]));
  const StoreStats st = s.stats();
  EXPECT_EQ(st.entries, 3u);
  EXPECT_LE(st.ram_bytes, o.ram_bytes);
  EXPECT_TRUE(s.take({}, ps[0]));
  EXPECT_FALSE(s.take({}, ps[1]));
  EXPECT_FALSE(s.take({}, ps[2]));
  EXPECT_TRUE(s.take({}, ps[4]));
  // An entry bigger than the whole budget is not kept (and evicts nothing).
  o.ram_bytes = one / 2;
  PromptStore tiny(cal(), lowrank_geometry(), o);
  tiny.put(ps[0], prompt_capture(ps[0]));
  EXPECT_EQ(tiny.stats().entries, 0u);
}

TEST(Store, DiskTierSurvivesARestart) {
  TempDir dir("restart");
  StoreOptions o = small(/*async=*/true);
  o.disk_dir = dir.path.string();
  const auto sys = seq(1000, 256);
  const auto a = cat(sys, seq(7000, 100)), b = cat(sys, seq(8000, 120));
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(a, prompt_capture(a));
    s.put(b, prompt_capture(b));
    s.flush();
    const StoreStats st = s.stats();
    EXPECT_TRUE(st.disk_enabled) << st.disk_error;
    EXPECT_EQ(st.disk_entries, 2u);
    EXPECT_EQ(st.disk_chunks, 4u + 1u + 1u);  // the 4 shared, one own each
    EXPECT_EQ(files_in(dir.path, ".kvtc").size(), 6u);
    EXPECT_EQ(files_in(dir.path, ".kvse").size(), 2u);
  }
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();  // the disk tier's files are read back in the background: wait for them
  StoreStats st = s.stats();
  EXPECT_EQ(st.entries, 0u);  // RAM starts empty
  EXPECT_EQ(st.disk_entries, 2u);
  auto m = s.take({}, cat(b, seq(3, 5)));
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "disk");
  expect_prefix_of(m->cache, whole_roundtrip(b, o), uint32_t(b.size()));
  m = s.take({}, b);  // promoted to RAM by the first take
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "ram");
  st = s.stats();
  EXPECT_EQ(st.hits_disk, 1u);
  EXPECT_EQ(st.hits_ram, 1u);
}

TEST(Store, DiskBudgetIsEnforced) {
  TempDir dir("budget");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  uint64_t one = 0;
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    const auto p = seq(1 << 22, 300);
    s.put(p, prompt_capture(p));
    one = s.stats().disk_bytes;
  }
  fs::remove_all(dir.path);
  o.disk_bytes = one * 2 + one / 2;
  PromptStore s(cal(), lowrank_geometry(), o);
  for (int i = 0; i < 6; ++i) {
    const auto p = seq((i + 1) << 22, 300);
    s.put(p, prompt_capture(p));
  }
  const StoreStats st = s.stats();
  EXPECT_EQ(st.disk_entries, 2u);
  EXPECT_LE(st.disk_bytes, o.disk_bytes);
  uint64_t on_disk = 0;
  for (const auto& f : files_in(dir.path, ".kvtc")) on_disk += fs::file_size(f);
  for (const auto& f : files_in(dir.path, ".kvse")) on_disk += fs::file_size(f);
  EXPECT_EQ(on_disk, st.disk_bytes);
}

TEST(Store, DamagedFilesAreDroppedNeverServed) {
  TempDir dir("damage");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const auto a = seq(1000, 300), b = seq(90000, 300), c = seq(50000, 300);
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    for (const auto& p : {a, b, c}) s.put(p, prompt_capture(p));
  }
  std::vector<std::string> logs;
  o.log = [&](const std::string& s) { logs.push_back(s); };
  // Entry file of a: a flipped byte; entry file of b: truncated.
  const auto entries = files_in(dir.path, ".kvse");
  ASSERT_EQ(entries.size(), 3u);
  // Files are named by key; damage two of the three, whichever they are.
  flip_byte(entries[0], fs::file_size(entries[0]) - 10);
  fs::resize_file(entries[1], fs::file_size(entries[1]) / 2);
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    const StoreStats st = s.stats();
    EXPECT_EQ(st.disk_entries, 1u);
    EXPECT_EQ(st.corrupt_dropped, 2u);
    int served = 0;
    for (const auto& p : {a, b, c}) {
      auto m = s.take({}, p);
      if (!m) continue;
      ++served;
      expect_prefix_of(m->cache, whole_roundtrip(p, o), 300);
    }
    EXPECT_EQ(served, 1);
  }
  EXPECT_EQ(files_in(dir.path, ".kvse").size(), 1u);
  bool named = false;
  for (const auto& l : logs) named = named || (l.find(".kvse") != std::string::npos && l.find("checksum") != std::string::npos);
  EXPECT_TRUE(named) << "the log names the file and the check";

  // A damaged chunk file: found when a take decodes it; a miss, dropped.
  for (const auto& f : files_in(dir.path, ".kvtc")) flip_byte(f, fs::file_size(f) / 2);
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  ASSERT_EQ(s.stats().disk_entries, 1u);
  int served = 0;
  for (const auto& p : {a, b, c}) served += bool(s.take({}, p));
  EXPECT_EQ(served, 0);
  const StoreStats st = s.stats();
  EXPECT_EQ(st.disk_entries, 0u);
  EXPECT_EQ(st.corrupt_dropped, 1u);
  EXPECT_EQ(files_in(dir.path, ".kvse").size(), 0u);
}

TEST(Store, AnUnwritableDiskLeavesTheRamTierServing) {
  // The directory cannot be created (a file is in the way): disabled at start.
  TempDir dir("unwritable");
  fs::create_directories(dir.path);
  std::ofstream(dir.path / "file") << "x";
  StoreOptions o = small();
  o.disk_dir = (dir.path / "file").string();
  std::vector<std::string> logs;
  o.log = [&](const std::string& s) { logs.push_back(s); };
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    StoreStats st = s.stats();
    EXPECT_FALSE(st.disk_enabled);
    EXPECT_NE(st.disk_error.find("file"), std::string::npos) << st.disk_error;
    const auto p = seq(1000, 300);
    s.put(p, prompt_capture(p));
    EXPECT_TRUE(s.take({}, p));
    EXPECT_FALSE(logs.empty());
  }
  // Writes fail mid-way (RLIMIT_FSIZE: the kernel refuses bytes past the
  // limit with EFBIG, as a full disk refuses them with ENOSPC).
  o.disk_dir = (dir.path / "store").string();
  PromptStore s(cal(), lowrank_geometry(), o);
  ASSERT_TRUE(s.stats().disk_enabled);
  struct rlimit old {};
  ::getrlimit(RLIMIT_FSIZE, &old);
  auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = 4096;
  ::setrlimit(RLIMIT_FSIZE, &lim);
  const auto p = seq(1000, 300), q = seq(9000, 300);
  s.put(p, prompt_capture(p));
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  StoreStats st = s.stats();
  EXPECT_FALSE(st.disk_enabled);
  EXPECT_NE(st.disk_error.find("write failed"), std::string::npos) << st.disk_error;
  EXPECT_EQ(st.disk_entries, 0u);
  EXPECT_EQ(st.entries, 1u);
  s.put(q, prompt_capture(q));
  EXPECT_TRUE(s.take({}, p));
  EXPECT_TRUE(s.take({}, q));
  // No partial file is left behind.
  EXPECT_EQ(files_in(dir.path / "store", ".kvse").size(), 0u);
  EXPECT_EQ(files_in(dir.path / "store", ".kvtc").size(), 0u);
}

TEST(Store, OneProcessPerDirectory) {
  TempDir dir("lock");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  PromptStore a(cal(), lowrank_geometry(), o);
  PromptStore b(cal(), lowrank_geometry(), o);
  EXPECT_TRUE(a.stats().disk_enabled);
  EXPECT_FALSE(b.stats().disk_enabled);
  EXPECT_NE(b.stats().disk_error.find("another process"), std::string::npos) << b.stats().disk_error;
}

TEST(Store, OtherCalibrationsAndSettingsNeverMix) {
  TempDir dir("compat");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const auto p = seq(1000, 300);
  std::string fp;
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(p, prompt_capture(p));
    fp = s.fingerprint();
  }
  FitOptions f;
  f.ratios = {8};
  const Calibration other = fit_calibration({lowrank_capture(300, 60), lowrank_capture(300, 61)}, {lowrank_capture(200, 62)}, f);
  {
    PromptStore s(other, lowrank_geometry(), o);
    s.flush();
    EXPECT_NE(s.fingerprint(), fp);
    EXPECT_EQ(s.stats().disk_entries, 0u);
    EXPECT_FALSE(s.take({}, p));
  }
  o.ratio = 4;
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    EXPECT_EQ(s.stats().disk_entries, 0u);
  }
  o.ratio = 8;
  // Every setting a context resolves its RoPE to (KvSettings) is in the
  // salt: a store of another base, scale or YaRN parameter is another store.
  KvSettings ks;
  ks.rope_freq_base = 10000;
  ks.rope_freq_scale = 1;
  ks.n_ctx_orig_yarn = 8192;
  ks.yarn_ext_factor = 0;
  ks.yarn_attn_factor = 1;
  ks.yarn_beta_fast = 32;
  ks.yarn_beta_slow = 1;
  EXPECT_EQ(ks.text(),
            "rope_freq_base=10000;rope_freq_scale=1;n_ctx_orig_yarn=8192;yarn_ext_factor=0;yarn_attn_factor=1;yarn_beta_fast=32;yarn_beta_slow=1");
  EXPECT_EQ(KvSettings{}.text(), "");
  std::set<std::string> salts = {fp};
  for (int field = 0; field < 8; ++field) {
    StoreOptions k = o;
    k.kv_settings = ks;
    if (field == 1) k.kv_settings.rope_freq_base = 20000;
    if (field == 2) k.kv_settings.rope_freq_scale = 0.5f;
    if (field == 3) k.kv_settings.n_ctx_orig_yarn = 4096;
    if (field == 4) k.kv_settings.yarn_ext_factor = 1;
    if (field == 5) k.kv_settings.yarn_attn_factor = 1.1f;
    if (field == 6) k.kv_settings.yarn_beta_fast = 16;
    if (field == 7) k.kv_settings.yarn_beta_slow = 2;
    PromptStore s(cal(), lowrank_geometry(), k);
    EXPECT_TRUE(salts.insert(s.fingerprint()).second) << "field " << field;
    EXPECT_EQ(s.stats().disk_entries, 0u);
    EXPECT_FALSE(s.take({}, p));
  }
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  EXPECT_EQ(s.fingerprint(), fp);
  EXPECT_EQ(s.stats().disk_entries, 1u);
}

// Tenants (docs/store.md "Tenants"): the same prompt stored for tenant A is
// never restored, contained or shared by tenant B or by tenant "" — queued,
// in RAM, and on disk after a restart — and is restored for A.
TEST(Store, TenantsNeverShareAPromptInAnyTier) {
  TempDir dir("tenants");
  StoreOptions o = small(/*async=*/true);
  o.disk_dir = dir.path.string();
  const auto p = seq(1000, 300);  // 4 chunks of 64 + a 44-token tail
  const auto next = cat(p, seq(5, 20));
  const std::string A = "tenant-a", B = std::string("tenant-b\0\xff", 10);  // any bytes
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(p, prompt_capture(p), A);
    // Queued or coded by now: either way B and "" find nothing of A's.
    EXPECT_FALSE(s.take({}, next, B));
    EXPECT_FALSE(s.take({}, next));
    s.flush();
    EXPECT_FALSE(s.take({}, next, B));
    EXPECT_FALSE(s.take({}, next));
    auto m = s.take({}, next, A);
    ASSERT_TRUE(m);
    EXPECT_STREQ(m->tier, "ram");
    EXPECT_EQ(m->common_prefix, 300u);
    EXPECT_FALSE(s.wants(p, A));  // A holds it; B and "" do not
    EXPECT_TRUE(s.wants(p, B));
    EXPECT_TRUE(s.wants(p));
    // B stores the same prompt, then a longer one: its own chunks (none
    // shared with A's), and A's entry is not dropped as contained in B's.
    s.put(p, prompt_capture(p), B);
    s.put(next, prompt_capture(next), B);
    s.flush();
    StoreStats st = s.stats();
    EXPECT_EQ(st.chunks_shared, 4u);  // B's second put shares B's first's 4 chunks, nothing of A's
    EXPECT_EQ(st.entries, 2u);        // A's p, B's next (B's p is contained in it)
    EXPECT_EQ(st.chunks, 4u + 4u);
    // Keys and files follow the spec: A's chain starts at SHA-256('t' ‖
    // salt ‖ "tenant-a"); the entry names that root in its header.
    const fs::path root = dir.path / s.fingerprint().substr(0, 16);
    EXPECT_TRUE(fs::exists(root / "chunks" / (chain_key_from(tenant_root(s, A), p, 3, 64) + ".kvtc")));
    EXPECT_TRUE(fs::exists(root / "chunks" / (chain_key_from(tenant_root(s, B), p, 3, 64) + ".kvtc")));
    EXPECT_FALSE(fs::exists(root / "chunks" / (chain_key(s, p, 0, 64) + ".kvtc")));  // tenant "": nothing stored
    for (const auto& f : files_in(root, ".kvse")) {
      std::ifstream in(f, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      EXPECT_NE(bytes.find("\"tenant_root\":\""), std::string::npos) << f;
    }
  }
  // A restart: the disk tier reads the roots back from the entry files.
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  EXPECT_EQ(s.stats().disk_entries, 2u);
  EXPECT_FALSE(s.take({}, cat(next, seq(9, 3))));
  EXPECT_FALSE(s.take({}, cat(next, seq(9, 3)), "tenant-c"));
  auto m = s.take({}, cat(next, seq(9, 3)), A);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "disk");
  EXPECT_EQ(m->common_prefix, 300u);  // A's prompt, not B's longer one
  expect_prefix_of(m->cache, whole_roundtrip(p, o), 300);
  m = s.take({}, cat(next, seq(9, 3)), B);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "disk");
  EXPECT_EQ(m->common_prefix, 320u);
  // Tenant "" is the store as without tenants: its entry file has no
  // tenant_root field (existing stores and their golden keys unchanged).
  s.put(p, prompt_capture(p));
  s.flush();
  const fs::path e = dir.path / s.fingerprint().substr(0, 16) / "entries" / (entry_key(s, p, 4, 64) + ".kvse");
  ASSERT_TRUE(fs::exists(e));
  std::ifstream in(e, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes.find("tenant_root"), std::string::npos);
  EXPECT_TRUE(s.take({}, next));
}

TEST(Store, AsyncPutsAreServedWhileQueued) {
  StoreOptions o = small(/*async=*/true);
  PromptStore s(cal(), lowrank_geometry(), o);
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 8; ++i) ps.push_back(seq((i + 1) << 20, 600));
  for (const auto& p : ps) s.put(p, prompt_capture(p));
  // Whatever the worker has reached: a queued put comes back raw, a stored
  // one decoded.
  for (const auto& p : ps) {
    auto m = s.take({}, p);
    ASSERT_TRUE(m);
    const std::string tier = m->tier;
    EXPECT_TRUE(tier == "pending" || tier == "ram") << tier;
    expect_prefix_of(m->cache, tier == "pending" ? prompt_capture(p) : whole_roundtrip(p, o), 600);
  }
  s.flush();
  const StoreStats st = s.stats();
  EXPECT_EQ(st.pending, 0u);
  EXPECT_EQ(st.pending_bytes, 0u);
  EXPECT_EQ(st.puts, 8u);
  EXPECT_EQ(st.hits_pending + st.hits_ram, 8u);
}

TEST(Store, StateBlobsInCapturesOut) {
  PromptStore s(cal(), lowrank_geometry(), small(true));
  const auto p = seq(1000, 300);
  const auto blob = state_from_capture(prompt_capture(p), {});
  s.put_state(p, blob);
  s.flush();
  auto m = s.take({}, p);
  ASSERT_TRUE(m);
  expect_prefix_of(m->cache, whole_roundtrip(p, small()), 300);
  // And back into a blob a llama.cpp context accepts.
  EXPECT_FALSE(state_from_capture(m->cache, {}).empty());
}

// A coded put_state's buffer is handed out again (its pages mapped: what
// keeps a save's copy from paying a page fault per 4 KiB), the smallest one
// with room, at most spare_state_buffers of them; what it restores is what
// the blob held, whatever the buffer held before.
TEST(Store, CodedStatesBuffersAreReused) {
  StoreOptions o = small(true);
  PromptStore s(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 300), q = seq(2000, 200);
  const auto blob = state_from_capture(prompt_capture(p), {});
  std::vector<uint8_t> b = s.state_buffer(blob.size());
  EXPECT_EQ(b.size(), blob.size());
  std::copy(blob.begin(), blob.end(), b.begin());
  const uint8_t* where = b.data();
  s.put_state(p, std::move(b));
  s.flush();
  StoreStats st = s.stats();
  EXPECT_EQ(st.buffers_new, 1u);
  EXPECT_EQ(st.spare_buffers, 1u);
  EXPECT_EQ(st.spare_bytes, blob.size());
  // A smaller state gets the kept buffer, shrunk.
  const auto qb = state_from_capture(prompt_capture(q), {});
  ASSERT_LT(qb.size(), blob.size());
  std::vector<uint8_t> c = s.state_buffer(qb.size());
  EXPECT_EQ(c.data(), where);
  EXPECT_EQ(c.size(), qb.size());
  st = s.stats();
  EXPECT_EQ(st.buffers_reused, 1u);
  EXPECT_EQ(st.spare_buffers, 0u);
  std::copy(qb.begin(), qb.end(), c.begin());
  s.put_state(q, std::move(c));
  s.flush();
  auto m = s.take({}, q);
  ASSERT_TRUE(m);
  expect_prefix_of(m->cache, whole_roundtrip(q, small()), 200);
  // A new buffer reserves half as much again: a state a little longer
  // (the next turn) fits the kept one; one past that is new.
  bool kept = false;
  std::vector<uint8_t> d = s.state_buffer(blob.size() + 1, &kept);
  EXPECT_TRUE(kept);
  EXPECT_EQ(d.data(), where);
  std::vector<uint8_t> e = s.state_buffer(2 * blob.size(), &kept);
  EXPECT_FALSE(kept);
  EXPECT_EQ(s.stats().buffers_new, 2u);
  EXPECT_EQ(s.stats().buffers_reused, 2u);
  // Readied ahead (a request's thread, before the loop saves): written
  // once, then handed out kept; nothing new while one kept has room.
  {
    PromptStore r(cal(), lowrank_geometry(), o);
    r.prepare_state_buffer(1000);
    r.prepare_state_buffer(600);  // fits the one made
    EXPECT_EQ(r.stats().buffers_prepared, 1u);
    EXPECT_EQ(r.stats().spare_buffers, 1u);
    EXPECT_EQ(r.stats().spare_bytes, 1000u);
    r.prepare_state_buffer(1400);  // within its 1.5x: the same buffer, written further
    EXPECT_EQ(r.stats().buffers_prepared, 2u);
    EXPECT_EQ(r.stats().spare_buffers, 1u);
    EXPECT_EQ(r.stats().spare_bytes, 1400u);
    std::vector<uint8_t> f = r.state_buffer(1200, &kept);
    EXPECT_TRUE(kept);
    EXPECT_EQ(r.stats().buffers_new, 0u);
    EXPECT_EQ(r.stats().spare_buffers, 0u);
  }
  // None kept when asked so.
  o.spare_state_buffers = 0;
  PromptStore z(cal(), lowrank_geometry(), o);
  z.put_state(p, blob);
  z.flush();
  EXPECT_EQ(z.stats().spare_buffers, 0u);
  EXPECT_EQ(z.stats().spare_bytes, 0u);
  z.prepare_state_buffer(1000);
  EXPECT_EQ(z.stats().buffers_prepared, 0u);
}

// take_state writes the llama.cpp state straight from the decoded pieces;
// it must be byte for byte what state_from_capture makes of take()'s cache,
// for every tier a match can come from and every layout a context can have
// (V transposed or not, one stream or one per sequence, any slot).
TEST(Store, TakeStateIsTheStateOfTheMatch) {
  TempDir dir("take-state");
  StoreOptions o = small(true);
  o.disk_dir = dir.path.string();
  const auto a = seq(1000, 300), b = seq(50000, 200);
  const std::vector<StateLayout> layouts = {{}, {{1}, 1, 0}, {{4}, 0, 2}, {{4}, 1, 3}, {{2}, 1, 5}};
  auto same = [&](PromptStore& s, const std::vector<int32_t>& cur, const std::vector<int32_t>& tok, const char* tier, uint32_t n) {
    for (const StateLayout& to : layouts) {
      auto ms = s.take_state(cur, tok, to);
      auto m = s.take(cur, tok);
      ASSERT_TRUE(m && ms);
      EXPECT_STREQ(ms->tier, tier);
      EXPECT_EQ(ms->common_prefix, n);
      EXPECT_EQ(ms->tokens, m->tokens);
      EXPECT_EQ(ms->state, state_from_capture(m->cache, to)) << tier << " v_trans " << to.v_trans << " seq " << to.seq_id;
    }
  };
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(a, prompt_capture(a));
    s.flush();
    same(s, {}, cat(a, seq(7, 20)), "ram", 300);               // the tail too
    same(s, {}, cat(seq(1000, 150), seq(9, 40)), "ram", 150);  // a prefix ending inside a chunk
  }
  for (const StateLayout& to : layouts) {  // the disk tier read back (a take promotes the entry to RAM: a new store each time)
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    auto ms = s.take_state({}, a, to);
    auto m = s.take({}, a);
    ASSERT_TRUE(m && ms);
    EXPECT_STREQ(ms->tier, "disk");
    EXPECT_EQ(ms->state, state_from_capture(m->cache, to));
  }
  // A queued put, restored from its raw state: it waits behind a large one
  // (when the worker was quicker, the match comes from RAM, compared above).
  StoreOptions q = small(true);
  q.threads = 1;
  PromptStore s(cal(), lowrank_geometry(), q);
  const auto big = seq(90000, 2000);
  s.put(big, prompt_capture(big));
  s.put(b, prompt_capture(b));
  auto m = s.take({}, b);
  auto ms = s.take_state({}, b, layouts[1]);
  ASSERT_TRUE(m && ms);
  EXPECT_STREQ(ms->tier, "pending");
  EXPECT_EQ(ms->state, state_from_capture(m->cache, layouts[1]));
}

// A piece that fails its checks ends the match before it, in every tier: a
// damaged middle chunk file gives the chunks before it (and is dropped with
// every entry naming it), never the damaged bytes.
TEST(Store, ADamagedChunkShortensTheMatch) {
  TempDir dir("damaged-chunk");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const auto p = seq(1000, 300);  // 4 chunks of 64 and a 44-token tail
  fs::path f;
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(p, prompt_capture(p));
    f = dir.path / s.fingerprint().substr(0, 16) / "chunks" / (chain_key(s, p, 2, 64) + ".kvtc");
  }
  ASSERT_TRUE(fs::exists(f)) << f;
  flip_byte(f, fs::file_size(f) / 2);
  std::vector<std::string> logs;
  o.log = [&](const std::string& x) { logs.push_back(x); };
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  auto m = s.take({}, p);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "disk");
  EXPECT_EQ(m->common_prefix, 128u);
  expect_prefix_of(m->cache, whole_roundtrip(p, o), 128);
  const StoreStats st = s.stats();
  EXPECT_EQ(st.corrupt_dropped, 1u);
  EXPECT_EQ(st.disk_entries, 0u);  // the entry named the chunk: gone with it
  EXPECT_FALSE(fs::exists(f));
  bool named = false;
  for (const auto& l : logs) named = named || l.find("chunk 2") != std::string::npos;
  EXPECT_TRUE(named) << "the log names the piece";
}

// Every tier reports itself, in lookup order, with the hits it served.
TEST(Store, StatsListTheTiersInOrder) {
  TempDir dir("tiers");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const auto p = seq(1000, 300);
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(p, prompt_capture(p));
    ASSERT_TRUE(s.take({}, p));
    const StoreStats st = s.stats();
    ASSERT_EQ(st.tiers.size(), 3u);
    EXPECT_EQ(st.tiers[0].name, "ram");
    EXPECT_EQ(st.tiers[1].name, "pending");
    EXPECT_EQ(st.tiers[2].name, "disk");
    EXPECT_EQ(st.tiers[0].hits, 1u);
    EXPECT_EQ(st.tiers[0].entries, st.entries);
    EXPECT_EQ(st.tiers[0].bytes, st.ram_bytes);
    EXPECT_EQ(st.tiers[2].bytes, st.disk_bytes);
    EXPECT_TRUE(st.tiers[2].enabled);
  }
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  ASSERT_TRUE(s.take({}, p));
  ASSERT_TRUE(s.take({}, p));  // promoted: RAM's now
  const StoreStats st = s.stats();
  EXPECT_EQ(st.tiers[2].hits, 1u);
  EXPECT_EQ(st.hits_disk, 1u);
  EXPECT_EQ(st.tiers[0].hits, 1u);
  EXPECT_EQ(st.hits_ram, 1u);
}

TEST(Store, BadInputIsRefusedOrSkipped) {
  // Construction: another model's calibration, an iSWA cache with a one-block calibration, bad options.
  CacheGeometry other = lowrank_geometry();
  other.model_sha256 = "another-model";
  EXPECT_NE(error_of([&] { PromptStore s(cal(), other, small()); }).find("wrong calibration"), std::string::npos);
  CacheGeometry iswa = lowrank_geometry();
  iswa.blocks.push_back(iswa.blocks[0]);
  iswa.blocks[1].sliding_window = 512;
  // (an iSWA cache needs a calibration of both blocks: SlidingWindow* below)
  EXPECT_NE(error_of([&] { PromptStore s(cal(), iswa, small()); }).find("has 2 block(s), the calibration 1"), std::string::npos);
  StoreOptions bad = small();
  bad.chunk_tokens = 100;
  EXPECT_NE(error_of([&] { PromptStore s(cal(), lowrank_geometry(), bad); }).find("chunk_tokens"), std::string::npos);

  // Puts: logged and skipped, never thrown, never stored wrong.
  std::vector<std::string> logs;
  StoreOptions o = small();
  o.log = [&](const std::string& s) { logs.push_back(s); };
  PromptStore s(cal(), lowrank_geometry(), o);
  const auto p = seq(1000, 100);
  KvCapture shifted = prompt_capture(p);
  for (auto& x : shifted.blocks[0].pos) x += 7;
  s.put(p, shifted);                        // positions not 0..n-1
  s.put(seq(1000, 90), prompt_capture(p));  // token count differs
  s.put_state(p, {1, 2, 3});                // not a state blob
  const StoreStats st = s.stats();
  EXPECT_EQ(st.puts_skipped, 3u);
  EXPECT_EQ(st.entries, 0u);
  EXPECT_EQ(logs.size(), 3u);
  EXPECT_FALSE(s.take({}, p));
}

// The comparison above forgives the GEMM's rounding, not a misplaced token:
// two tokens' values swapped, or one token's from another prompt, fail it; a
// value one f16 step off passes.
TEST(Store, TheWholePromptComparisonCatchesMisplacedTokens) {
  const StoreOptions o = small();
  const auto p = seq(1000, 300);
  const KvCapture ref = whole_roundtrip(p, o);
  ASSERT_TRUE(matches_prefix(ref, ref, 300));
  KvCapture c = whole_roundtrip(p, o);
  KvBlock& b = c.blocks.at(0);
  b.k[b.index(1, 1, 136, 0)] ^= 1;  // one f16 step
  EXPECT_TRUE(matches_prefix(c, ref, 300));
  for (uint32_t d = 0; d < b.head_dim; ++d) std::swap(b.v[b.index(0, 1, 70, d)], b.v[b.index(0, 1, 71, d)]);
  EXPECT_FALSE(matches_prefix(c, ref, 300));
  KvCapture other = whole_roundtrip(cat(seq(1000, 200), seq(5000, 100)), o);
  EXPECT_FALSE(matches_prefix(other, ref, 300));
}

TEST(Store, RawModeKeepsTheCacheExactly) {
  // StoreOptions::raw (kvtc-server --kvtc-raw, the benchmarks' baseline):
  // the same pieces and keys, every token raw f16.
  StoreOptions o = small();
  o.raw = true;
  PromptStore s(cal(), lowrank_geometry(), o);
  PromptStore coded(cal(), lowrank_geometry(), small());
  EXPECT_NE(s.fingerprint(), coded.fingerprint());
  const auto p = seq(1000, 300);
  const KvCapture in = prompt_capture(p);
  s.put(p, in);
  auto m = s.take({}, cat(p, seq(3, 3)));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->common_prefix, 300u);
  expect_prefix_of(m->cache, in, 300);
  EXPECT_GT(s.stats().ram_bytes, in.f16_bytes());  // raw, with headers
}

TEST(Store, EntropyCodedPieces) {
  // StoreOptions::entropy_coded (the default; kvtc-server --kvtc-dp turns it
  // off): the same pieces and keys in container version 2, its own
  // fingerprint; each piece is rate-controlled to the ratio, so the store
  // holds about f16 / ratio of the coded tokens and restores them about as
  // closely as the DP does. raw wins over it (a raw store's fingerprint).
  ASSERT_TRUE(StoreOptions{}.entropy_coded);  // the default
  StoreOptions o = small(), odp = small();
  o.entropy_coded = true;
  odp.entropy_coded = false;
  PromptStore s(cal(), lowrank_geometry(), o);
  PromptStore dp(cal(), lowrank_geometry(), odp);
  EXPECT_NE(s.fingerprint(), dp.fingerprint());
  o.raw = true;
  odp.raw = true;
  EXPECT_EQ(PromptStore(cal(), lowrank_geometry(), o).fingerprint(), PromptStore(cal(), lowrank_geometry(), odp).fingerprint());
  o.raw = false;
  const auto p = seq(1000, 300);
  const KvCapture in = prompt_capture(p);
  s.put(p, in);
  dp.put(p, in);
  auto m = s.take({}, cat(p, seq(3, 3)));
  auto md = dp.take({}, cat(p, seq(3, 3)));
  ASSERT_TRUE(m && md);
  EXPECT_EQ(m->common_prefix, 300u);
  const ReconError e = reconstruction_error(in, m->cache, 4, 32), ed = reconstruction_error(in, md->cache, 4, 32);
  EXPECT_GT(e.k + e.v, 0.0);
  EXPECT_LT(e.k, 2 * ed.k + 1e-4);
  EXPECT_LT(e.v, 2 * ed.v + 1e-4);
  // Within 25% of the DP store's bytes (ecsq meets the ratio on the coded
  // tokens; the DP's DEFLATE goes past it, by ~13% on real caches).
  EXPECT_LT(double(s.stats().ram_bytes), 1.25 * double(dp.stats().ram_bytes));
  EXPECT_LT(s.stats().ram_bytes, in.f16_bytes() / 2);
}

TEST(Store, EightBitWindowPieces) {
  // StoreOptions::window_bits 8 (the default; kvtc-server --kvtc-window-bits): the
  // tail's raw window in raw8 sections (container version 3, or 4 with a
  // window_bits salt line when entropy-coded), so another salt; the
  // chunks decode to the same values, the window within its quantization's
  // error, in fewer bytes. A raw store stays f16 (the exact baseline).
  ASSERT_EQ(StoreOptions{}.window_bits, 8u);  // the default (bench/results/window8.md)
  StoreOptions o8 = small(), o16 = small();
  o8.window_bits = 8;
  PromptStore s8(cal(), lowrank_geometry(), o8), s16(cal(), lowrank_geometry(), o16);
  EXPECT_NE(s8.fingerprint(), s16.fingerprint());
  o8.raw = o16.raw = true;
  EXPECT_EQ(PromptStore(cal(), lowrank_geometry(), o8).fingerprint(), PromptStore(cal(), lowrank_geometry(), o16).fingerprint());
  const auto p = seq(1000, 300);  // 4 chunks of 64 and a 44-token tail holding the 32-token window
  const KvCapture in = prompt_capture(p);
  s8.put(p, in);
  s16.put(p, in);
  auto a = s8.take({}, cat(p, seq(3, 3)));
  auto b = s16.take({}, cat(p, seq(3, 3)));
  ASSERT_TRUE(a && b);
  ASSERT_EQ(a->common_prefix, 300u);
  const KvBlock &x = a->cache.blocks[0], &y = b->cache.blocks[0];
  size_t same = 0, differ = 0;
  for (uint32_t l = 0; l < x.n_layer(); ++l)
    for (uint32_t h = 0; h < x.n_head_kv; ++h)
      for (uint32_t t = 0; t < 300; ++t)
        for (uint32_t d = 0; d < x.head_dim; ++d) {
          const bool eq = x.k[x.index(l, h, t, d)] == y.k[y.index(l, h, t, d)] && x.v[x.index(l, h, t, d)] == y.v[y.index(l, h, t, d)];
          if (t < 300 - 32) {
            ASSERT_TRUE(eq) << "token " << t << " (coded or sink) differs between the 8- and 16-bit-window stores";
            ++same;
          } else {
            differ += !eq;
          }
        }
  EXPECT_GT(differ, 0u) << "the window is not quantized";
  const ReconError w8 = reconstruction_error(in, a->cache, 300 - 32, 0), w16 = reconstruction_error(in, b->cache, 300 - 32, 0);
  EXPECT_EQ(w16.k + w16.v, 0.0);  // f16 window: exact
  EXPECT_GT(w8.k + w8.v, 0.0);
  EXPECT_LT(w8.k, 1e-4);  // int8 with a scale per group: ~1e-5 relative squared error
  EXPECT_LT(w8.v, 1e-4);
  EXPECT_LT(s8.stats().ram_bytes, s16.stats().ram_bytes);
  StoreOptions bad = small();
  bad.window_bits = 12;
  EXPECT_THROW(PromptStore(cal(), lowrank_geometry(), bad), Error);
}

// The system refusing a read (EMFILE, EACCES, EIO) is not the file's fault:
// a miss this time, the files kept and counted, logged once per kind; a hit
// again once the fault is gone. Injected with RLIMIT_NOFILE (every open
// fails with EMFILE; chmod 000 denies nothing to root, which these tests
// may run as) and, for the start-up scan, a directory in place of the entry
// file (EISDIR).
TEST(Store, AnUnreadableDiskFileIsKeptNotDropped) {
  TempDir dir("unreadable");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const auto p = seq(1000, 300);  // 4 chunks and a tail
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(p, prompt_capture(p));
  }
  std::vector<std::string> logs;
  o.log = [&](const std::string& x) { logs.push_back(x); };
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    ASSERT_EQ(s.stats().disk_entries, 1u);
    struct rlimit old {};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
    const int lowest = ::open("/dev/null", O_RDONLY);  // the lowest free descriptor
    ASSERT_GE(lowest, 0);
    ::close(lowest);
    struct rlimit lim = old;
    lim.rlim_cur = rlim_t(lowest);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
    const bool first = bool(s.take({}, p)), second = bool(s.take({}, p));
    ::setrlimit(RLIMIT_NOFILE, &old);
    EXPECT_FALSE(first);
    EXPECT_FALSE(second);
    const StoreStats st = s.stats();
    EXPECT_EQ(st.disk_io_errors, 2u);
    EXPECT_EQ(st.corrupt_dropped, 0u);
    EXPECT_EQ(st.disk_entries, 1u);
    EXPECT_EQ(st.tiers[2].io_errors, 2u);
    EXPECT_EQ(files_in(dir.path, ".kvse").size(), 1u);
    EXPECT_EQ(files_in(dir.path, ".kvtc").size(), 4u);
    int named = 0;
    for (const auto& l : logs) named += l.find(".kvse") != std::string::npos && l.find(std::strerror(EMFILE)) != std::string::npos;
    EXPECT_EQ(named, 1) << "logged once for the kind, naming the file and the reason";
    auto m = s.take({}, p);  // the fault is gone
    ASSERT_TRUE(m);
    EXPECT_STREQ(m->tier, "disk");
    EXPECT_EQ(m->common_prefix, 300u);
    expect_prefix_of(m->cache, whole_roundtrip(p, o), 300);
  }
  // At start: the scan cannot read the entry (a directory in its place); the
  // entry file's data and the chunks it names stay where they are.
  const fs::path ef = files_in(dir.path, ".kvse").at(0), aside = dir.path / "aside";
  fs::rename(ef, aside);
  fs::create_directory(ef);
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    const StoreStats st = s.stats();
    EXPECT_EQ(st.disk_entries, 0u);
    EXPECT_EQ(st.disk_io_errors, 1u);
    EXPECT_EQ(st.corrupt_dropped, 0u);
    EXPECT_TRUE(fs::is_directory(ef));
    EXPECT_EQ(files_in(dir.path, ".kvtc").size(), 4u) << "the chunks of an entry the scan could not read are not orphans";
    EXPECT_FALSE(s.take({}, p));
  }
  fs::remove(ef);
  fs::rename(aside, ef);
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  auto m = s.take({}, p);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "disk");
  EXPECT_EQ(m->common_prefix, 300u);
}

// A chunk file removed from outside loses nothing else: a take restores the
// chunks before it, the entry stays, and the next put through that chunk
// writes it again — after which the entry restores whole. Both ways it is
// found: by a take (the index believed it present) and by the scan.
TEST(Store, AChunkFileRemovedFromOutsideIsWrittenAgain) {
  TempDir dir("removed-chunk");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const auto p = seq(1000, 300);                        // 4 chunks of 64 and a 44-token tail
  const auto q = cat(seq(1000, 192), seq(70000, 150));  // shares p's first 3 chunks; one of its own
  fs::path f;
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.put(p, prompt_capture(p));
    f = dir.path / s.fingerprint().substr(0, 16) / "chunks" / (chain_key(s, p, 2, 64) + ".kvtc");
  }
  ASSERT_TRUE(fs::exists(f)) << f;
  std::vector<std::string> logs;
  o.log = [&](const std::string& x) { logs.push_back(x); };
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    fs::remove(f);  // after the scan: the index names it
    for (int i = 0; i < 2; ++i) {
      auto m = s.take({}, p);
      ASSERT_TRUE(m) << i;
      EXPECT_STREQ(m->tier, "disk");
      EXPECT_EQ(m->common_prefix, 128u) << i;  // chunks 1 and 2
      expect_prefix_of(m->cache, whole_roundtrip(p, o), 128);
    }
    StoreStats st = s.stats();
    EXPECT_EQ(st.disk_missing, 1u);
    EXPECT_EQ(st.corrupt_dropped, 0u);
    EXPECT_EQ(st.disk_io_errors, 0u);
    EXPECT_EQ(st.disk_entries, 1u);  // kept: its tail and chunk 4 are good
    EXPECT_EQ(st.disk_chunks, 3u);
    EXPECT_EQ(files_in(dir.path, ".kvtc").size(), 3u);
    EXPECT_TRUE(s.wants(p)) << "the disk tier no longer holds all of p";
    s.put(q, prompt_capture(q));  // through chunk 3: written again
    EXPECT_TRUE(fs::exists(f));
    st = s.stats();
    EXPECT_EQ(st.disk_entries, 2u);
    EXPECT_EQ(st.disk_chunks, 5u);
    EXPECT_EQ(st.disk_bytes, bytes_in(dir.path));
  }
  bool named = false;
  for (const auto& l : logs) named = named || l.find(f.filename().string()) != std::string::npos;
  EXPECT_TRUE(named) << "the log names the missing file";
  {
    PromptStore s(cal(), lowrank_geometry(), o);  // p is whole again
    s.flush();
    auto m = s.take({}, p);
    ASSERT_TRUE(m);
    EXPECT_STREQ(m->tier, "disk");
    EXPECT_EQ(m->common_prefix, 300u);
    expect_prefix_of(m->cache, whole_roundtrip(p, o), 300);
  }
  // Gone before a start: the scan keeps the entry and marks the chunk; a
  // put of p itself (wanted again) rewrites it.
  fs::remove(f);
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    StoreStats st = s.stats();
    EXPECT_EQ(st.disk_entries, 2u);
    EXPECT_EQ(st.disk_missing, 1u);
    auto m = s.take({}, p);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, 128u);
    ASSERT_TRUE(s.wants(p));
    s.put(p, prompt_capture(p));
    EXPECT_TRUE(fs::exists(f));
    st = s.stats();
    EXPECT_EQ(st.disk_entries, 2u);
    EXPECT_EQ(st.disk_bytes, bytes_in(dir.path));
  }
  PromptStore s(cal(), lowrank_geometry(), o);
  s.flush();
  for (const auto& t : {p, q}) {
    auto m = s.take({}, t);
    ASSERT_TRUE(m);
    EXPECT_STREQ(m->tier, "disk");
    EXPECT_EQ(m->common_prefix, t.size());
  }
}

// The start-up scan runs in the background: the constructor returns with
// the entry files listed, not read; takes meanwhile see what is verified;
// puts go on; the budget holds at the end (the scan goes newest first, so
// what does not fit is the oldest, deleted unread). Made deterministic with
// a FIFO named like the newest entry file: reading it blocks the scan until
// the test writes to it (or 5 s pass: a scan inside the constructor would
// otherwise never return).
TEST(Store, TheDiskScanRunsInTheBackground) {
  TempDir dir("scan");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 6; ++i) ps.push_back(seq((i + 1) << 20, 300));
  uint64_t one = 0;
  fs::path entries;
  const auto base = fs::file_time_type::clock::now() - std::chrono::hours(2);
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    for (const auto& p : ps) s.put(p, prompt_capture(p));
    one = s.stats().disk_bytes / ps.size();
    entries = dir.path / s.fingerprint().substr(0, 16) / "entries";
    for (size_t i = 0; i < ps.size(); ++i)  // ps[5] the newest
      fs::last_write_time(entries / (entry_key(s, ps[i], 4, 64) + ".kvse"), base + std::chrono::minutes(i));
  }
  const fs::path fifo = entries / (std::string(64, 'f') + ".kvse");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0) << std::strerror(errno);
  fs::last_write_time(fifo, base + std::chrono::hours(1));  // newer than all: read first
  std::promise<void> go;
  std::thread writer([&, ready = go.get_future()] {
    (void)ready.wait_for(std::chrono::seconds(5));
    for (int i = 0; i < 10000; ++i) {  // until the scan has it open for reading (ENXIO before)
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) {
        (void)!::write(fd, "garbage", 7);
        ::close(fd);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  o.disk_bytes = one * 3 + one / 2;  // room for three
  const auto t0 = std::chrono::steady_clock::now();
  PromptStore s(cal(), lowrank_geometry(), o);
  const double ctor_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  StoreStats st = s.stats();
  EXPECT_LT(ctor_ms, 1000);
  EXPECT_EQ(st.disk_scan_pending, 7u);  // all listed, none verified
  EXPECT_EQ(st.tiers[2].scan_pending, 7u);
  EXPECT_EQ(st.disk_entries, 0u);
  EXPECT_FALSE(s.take({}, ps[5]));  // not verified yet: a miss, not a wait
  const auto fresh = seq(9 << 20, 300);
  s.put(fresh, prompt_capture(fresh));  // puts go on meanwhile
  EXPECT_EQ(s.stats().disk_entries, 1u);
  go.set_value();
  s.flush();  // waits for the scan
  writer.join();
  st = s.stats();
  EXPECT_EQ(st.disk_scan_pending, 0u);
  EXPECT_EQ(st.corrupt_dropped, 1u);  // the FIFO's bytes are no entry file
  EXPECT_FALSE(fs::exists(fifo));
  // The put and the two newest fit; the three oldest went, unread.
  EXPECT_EQ(st.disk_entries, 3u);
  EXPECT_LE(st.disk_bytes, o.disk_bytes);
  EXPECT_EQ(st.disk_bytes, bytes_in(dir.path)) << "their chunk files went too";
  EXPECT_EQ(files_in(dir.path, ".kvse").size(), 3u);
  for (size_t i = 0; i < ps.size(); ++i) {
    auto m = s.take({}, ps[i]);
    EXPECT_EQ(bool(m), i >= 4) << i;
    if (m) {
      EXPECT_STREQ(m->tier, "disk");
    }
  }
}

// The queue of puts holds at most max_pending_bytes of raw state; a caller
// asks wants(tokens, bytes) before copying a state, so that a state the
// queue would skip is never copied (kvtc-server copies a slot's state only
// after this answer). The default follows the RAM budget, at least 1 GiB.
TEST(Store, ThePendingBudgetIsAskedBeforeCopying) {
  const auto p = seq(1000, 300);
  const uint64_t raw = prompt_capture(p).f16_bytes();  // 300 tokens x 256 bytes
  std::vector<std::string> logs;
  StoreOptions o = small(/*async=*/true);
  o.max_pending_bytes = raw - 1;
  o.log = [&](const std::string& x) { logs.push_back(x); };
  {
    PromptStore s(cal(), lowrank_geometry(), o);
    EXPECT_EQ(s.stats().pending_budget, raw - 1);
    EXPECT_TRUE(s.wants(p));
    EXPECT_FALSE(s.wants(p, raw));  // one byte over the whole budget
    EXPECT_TRUE(s.wants(p, raw / 2));
    const StoreStats st = s.stats();
    EXPECT_EQ(st.puts_skipped, 1u);
    EXPECT_EQ(st.pending, 0u);
    ASSERT_EQ(logs.size(), 1u);
    EXPECT_NE(logs[0].find(std::to_string(raw) + " raw bytes"), std::string::npos) << logs[0];
    EXPECT_NE(logs[0].find("max_pending_bytes " + std::to_string(raw - 1)), std::string::npos) << logs[0];
    // What wants() refuses, put() would have skipped after the copy.
    s.put(p, prompt_capture(p));
    s.flush();
    EXPECT_EQ(s.stats().puts_skipped, 2u);
    EXPECT_EQ(s.stats().puts, 0u);
  }
  // Default: max(1 GiB, ram_bytes).
  StoreOptions d = small(/*async=*/true);
  PromptStore a(cal(), lowrank_geometry(), d);
  EXPECT_EQ(a.stats().pending_budget, 1ull << 30);
  EXPECT_FALSE(a.wants(p, 2ull << 30));
  d.ram_bytes = 3ull << 30;
  PromptStore b(cal(), lowrank_geometry(), d);
  EXPECT_EQ(b.stats().pending_budget, 3ull << 30);
  EXPECT_TRUE(b.wants(p, 2ull << 30));
  // Without a queue (puts coded in put itself) nothing waits: any size.
  PromptStore c(cal(), lowrank_geometry(), small(/*async=*/false));
  EXPECT_EQ(c.stats().pending_budget, 0u);
  EXPECT_TRUE(c.wants(p, 1ull << 40));
  // A prompt held already is not wanted, whatever its size.
  c.put(p, prompt_capture(p));
  EXPECT_FALSE(c.wants(p, 1));
}

// ---- secrets (docs/store.md "Secrets") ---------------------------------------

namespace {

std::vector<uint8_t> from_hex(const std::string& h) {
  std::vector<uint8_t> b;
  for (size_t i = 0; i + 1 < h.size(); i += 2) b.push_back(uint8_t(std::stoi(h.substr(i, 2), nullptr, 16)));
  return b;
}
std::span<const uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}
// Whether `b` holds any run of 8 consecutive tokens of `t` as int32 LE (a
// prompt's tokens as an entry file or an index value keeps them).
bool holds_tokens(const std::vector<uint8_t>& b, const std::vector<int32_t>& t) {
  for (size_t i = 0; i + 8 <= t.size(); ++i) {
    std::vector<uint8_t> run;
    for (size_t j = i; j < i + 8; ++j)
      for (int k = 0; k < 4; ++k) run.push_back(uint8_t(uint32_t(t[j]) >> (8 * k)));
    if (std::search(b.begin(), b.end(), run.begin(), run.end()) != b.end()) return true;
  }
  return false;
}
void copy_over(const fs::path& from, const fs::path& to) {
  fs::copy_file(from, to, fs::copy_options::overwrite_existing);
}

}  // namespace

// The formats as docs/store.md writes them, checked against values computed
// apart from this code: HKDF against RFC 5869's test case 1, the derived
// keys and a sealed value against Python's hmac/hashlib (the snippet in
// docs/store.md "Secrets" computes them), the AES-256-GCM layout by
// decrypting with OpenSSL from the documented offsets.
TEST(Store, SecretsFormatsAreTheDocumentedOnes) {
  using namespace kvtc::store;
  EXPECT_EQ(store::hex(hkdf_sha256(std::vector<uint8_t>(22, 0x0b), secret_of(0, 13), secret_of(0xf0, 10), 42)),
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865");
  const std::vector<uint8_t> secret = secret_of(0);  // bytes 0..31
  const Sealer auth(secret, false), enc(secret, true), off({}, false);
  EXPECT_EQ(auth.key_id(), "cfea644b06e04649");
  EXPECT_EQ(auth.protection(), "hmac-sha256;key=cfea644b06e04649");
  EXPECT_EQ(enc.protection(), "aes-256-gcm;key=cfea644b06e04649");
  EXPECT_EQ(store::hex(auth.chain_key()), "980da781067fd9aad067cb9837250442e16c2db9985f635e9695c5b0de028299");
  EXPECT_FALSE(off.on());
  // HMAC mode: plain | HMAC-SHA256(K_auth, "kvtc-seal/1" | kind | u16 LE key length | key | trailer | plain) | trailer.
  const std::string plain = "hello, kvtc", key(64, 'k');
  const std::vector<uint8_t> sealed = auth.seal(kSealChunk, key, bytes_of(plain));
  EXPECT_EQ(store::hex(sealed), "68656c6c6f2c206b767463eecc4a801a4a526f50c4979c100b3ab861f8b3d00892cac420f754a9c4dca7c04b56534c01010000");
  EXPECT_EQ(auth.opened(kSealChunk, key, sealed, "v"), std::vector<uint8_t>(plain.begin(), plain.end()));
  // AES-256-GCM: nonce (12) | ciphertext | tag (16) | trailer, the AAD the
  // HMAC mode's data without the plain bytes, K_enc derived with "kvtc encryption".
  const std::vector<uint8_t> c1 = enc.seal(kSealEntry, key, bytes_of(plain)), c2 = enc.seal(kSealEntry, key, bytes_of(plain));
  ASSERT_EQ(c1.size(), plain.size() + 12 + 16 + 8);
  EXPECT_NE(std::vector<uint8_t>(c1.begin(), c1.begin() + 12), std::vector<uint8_t>(c2.begin(), c2.begin() + 12));  // a new nonce each time
  EXPECT_EQ(store::hex(std::span(c1).last(8)), "4b56534c01020000");
  {
    const std::vector<uint8_t> k_enc = from_hex("3917454920a8e4bc36e46a6a48fb694be2682e59a529a424facac3411fbabec8");
    const std::string domain = "kvtc-seal/1e";  // the domain tag, then the kind
    std::vector<uint8_t> aad(domain.begin(), domain.end());
    aad.insert(aad.end(), {64, 0});
    aad.insert(aad.end(), key.begin(), key.end());
    aad.insert(aad.end(), c1.end() - 8, c1.end());
    EVP_CIPHER_CTX* x = EVP_CIPHER_CTX_new();
    std::vector<uint8_t> out(plain.size());
    int len = 0;
    ASSERT_EQ(EVP_DecryptInit_ex(x, EVP_aes_256_gcm(), nullptr, k_enc.data(), c1.data()), 1);
    ASSERT_EQ(EVP_DecryptUpdate(x, nullptr, &len, aad.data(), int(aad.size())), 1);
    ASSERT_EQ(EVP_DecryptUpdate(x, out.data(), &len, c1.data() + 12, int(plain.size())), 1);
    std::vector<uint8_t> tag(c1.end() - 24, c1.end() - 8);
    ASSERT_EQ(EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, 16, tag.data()), 1);
    EXPECT_EQ(EVP_DecryptFinal_ex(x, out.data(), &len), 1);
    EVP_CIPHER_CTX_free(x);
    EXPECT_EQ(std::string(out.begin(), out.end()), plain);
  }
  // What does not open: another kind, another key, another secret or mode,
  // a flipped bit, a missing trailer, plain bytes.
  const Sealer other(secret_of(1), false);
  auto foreign = [](const Sealer& s, char kind, const std::string& k, std::vector<uint8_t> v) {
    try {
      s.open(kind, k, v, "value");
    } catch (const ForeignValue& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(foreign(auth, kSealEntry, key, sealed).find("tag mismatch"), std::string::npos);
  EXPECT_NE(foreign(auth, kSealChunk, std::string(64, 'j'), sealed), "");
  EXPECT_NE(foreign(other, kSealChunk, key, sealed), "");
  EXPECT_NE(foreign(enc, kSealChunk, key, sealed).find("mode 1, expected 2"), std::string::npos);
  EXPECT_NE(foreign(enc, kSealEntry, std::string(64, 'j'), c1), "");
  std::vector<uint8_t> flipped = c1;
  flipped[14] ^= 1;
  EXPECT_NE(foreign(enc, kSealEntry, key, flipped), "");
  EXPECT_NE(foreign(auth, kSealChunk, key, std::vector<uint8_t>(sealed.begin(), sealed.end() - 8)).find("not sealed"), std::string::npos);
  EXPECT_NE(foreign(auth, kSealChunk, key, std::vector<uint8_t>(plain.begin(), plain.end())).find("not sealed"), std::string::npos);
  EXPECT_EQ(foreign(auth, kSealChunk, key, sealed), "");
}

// Without a secret the salt is version 2's text, unchanged; a secret adds
// its protection line (another store per secret and mode) and keys the
// chain, whose keys are the documented HMACs.
TEST(Store, ASecretNamesItsOwnStoreAndKeysItsChain) {
  TempDir dir("secret-salt");
  StoreOptions o = small();
  o.disk_dir = dir.path.string();
  const std::string text = "kvtc-store/2\nmodel_sha256=synthetic-lowrank\ncalibration_id=" + cal().id +
                           "\ncontainer_version=1\nchunk_tokens=64\nratio=8\nsink=4\nwindow=32\nkv_settings=\n";
  const std::vector<uint8_t> a = secret_of(0), b = secret_of(1);
  PromptStore plain(cal(), lowrank_geometry(), o);
  EXPECT_EQ(plain.fingerprint(), sha256_bytes(bytes_of(text)));
  EXPECT_EQ(plain.protection(), "");
  PromptStore sa(cal(), lowrank_geometry(), with_secret(o, a, false));
  EXPECT_EQ(sa.fingerprint(), sha256_bytes(bytes_of(text + "protection=hmac-sha256;key=cfea644b06e04649\n")));
  PromptStore se(cal(), lowrank_geometry(), with_secret(o, a, true));
  EXPECT_EQ(se.fingerprint(), sha256_bytes(bytes_of(text + "protection=aes-256-gcm;key=cfea644b06e04649\n")));
  PromptStore sb(cal(), lowrank_geometry(), with_secret(o, b, false));
  EXPECT_EQ(std::set<std::string>({plain.fingerprint(), sa.fingerprint(), se.fingerprint(), sb.fingerprint()}).size(), 4u);
  // The chain: a prompt of 2 chunks and a tail names its files by the keyed chain.
  const auto p = seq(1000, 200);
  sa.put(p, prompt_capture(p));
  const fs::path root = dir.path / sa.fingerprint().substr(0, 16);
  EXPECT_TRUE(fs::exists(root / "chunks" / (chain_key(sa, p, 1, 64, a) + ".kvtc")));
  EXPECT_TRUE(fs::exists(root / "entries" / (entry_key(sa, p, 2, 64, a) + ".kvse")));
  EXPECT_FALSE(fs::exists(root / "chunks" / (chain_key(sa, p, 1, 64) + ".kvtc")));  // the unkeyed chain names nothing
  // A tenant's root is keyed as the links are (docs/store.md "Tenants"):
  // HMAC-SHA256(K_chain, 't' | c_0 | tenant); its chain names its files.
  sa.put(p, prompt_capture(p), "tenant-a");
  EXPECT_TRUE(fs::exists(root / "chunks" / (chain_key_from(tenant_root(sa, "tenant-a", a), p, 1, 64, a) + ".kvtc")));
  EXPECT_FALSE(fs::exists(root / "chunks" / (chain_key_from(tenant_root(sa, "tenant-a"), p, 1, 64, a) + ".kvtc")));  // an unkeyed tenant root
  std::ifstream js(root / "store.json");
  EXPECT_NE(std::string(std::istreambuf_iterator<char>(js), {}).find("\"protection\": \"hmac-sha256;key=cfea644b06e04649\""), std::string::npos);
  // Refused: a short secret, encrypt without one.
  EXPECT_NE(error_of([&] { PromptStore(cal(), lowrank_geometry(), with_secret(o, secret_of(0, 31), false)); }).find("31 bytes, expected at least 32"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PromptStore(cal(), lowrank_geometry(), with_secret(o, {}, true)); }).find("encrypt needs a secret"), std::string::npos);
  // The secret file: refused when short or empty, naming the file; a warning when others can read it.
  const fs::path f = dir.path / "secret";
  { std::ofstream(f, std::ios::binary) << std::string(31, 'x'); }
  EXPECT_NE(error_of([&] { (void)read_store_secret(f.string()); }).find(f.string() + ": the secret file holds 31 bytes, expected at least 32"),
            std::string::npos);
  { std::ofstream(f, std::ios::binary) << std::string(32, 'x'); }
  fs::permissions(f, fs::perms::owner_read | fs::perms::owner_write);
  std::string warning = "?";
  EXPECT_EQ(read_store_secret(f.string(), &warning).size(), 32u);
  EXPECT_EQ(warning, "");
  fs::permissions(f, fs::perms::others_read, fs::perm_options::add);
  (void)read_store_secret(f.string(), &warning);
  EXPECT_NE(warning.find("readable by others"), std::string::npos) << warning;
  EXPECT_NE(error_of([&] { (void)read_store_secret((dir.path / "none").string()); }).find("none"), std::string::npos);
}

// A store with a secret restores what it wrote, after a restart (RAM
// empty: from disk), exactly what a store without one restores: sealing
// changes the files, not the pieces.
TEST(Store, ASealedDiskTierRestoresWhatItWrote) {
  const auto p = seq(1000, 300), q = cat(seq(1000, 200), seq(4000, 90));
  std::vector<std::optional<PromptStore::Match>> got;
  for (int mode = 0; mode < 3; ++mode) {  // none, hmac, aes
    TempDir dir("sealed-restart-" + std::to_string(mode));
    StoreOptions o = small();
    o.disk_dir = dir.path.string();
    if (mode) o = with_secret(o, secret_of(7), mode == 2);
    {
      PromptStore s(cal(), lowrank_geometry(), o);
      s.put(p, prompt_capture(p));
      s.put(q, prompt_capture(q));
      EXPECT_EQ(s.stats().disk_bytes, bytes_in(dir.path));
    }
    PromptStore s(cal(), lowrank_geometry(), o);
    s.flush();
    EXPECT_EQ(s.stats().disk_entries, 2u);
    got.push_back(s.take({}, cat(p, seq(5, 10))));
    ASSERT_TRUE(got.back());
    EXPECT_STREQ(got.back()->tier, "disk");
    auto m = s.take({}, q);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, q.size());
    EXPECT_EQ(s.stats().foreign_dropped + s.stats().corrupt_dropped, 0u);
  }
  expect_prefix_of(got[0]->cache, whole_roundtrip(p, small()), 300);
  for (int mode = 1; mode < 3; ++mode) {
    EXPECT_EQ(got[mode]->tokens, got[0]->tokens);
    EXPECT_EQ(got[mode]->cache.blocks[0].k, got[0]->cache.blocks[0].k);
    EXPECT_EQ(got[mode]->cache.blocks[0].v, got[0]->cache.blocks[0].v);
  }
}

// Files written without the secret, with another, or moved to another
// name are never served: a miss (or the pieces before them), deleted,
// counted as foreign; never decoded (corrupt_dropped stays 0: a valid
// unsealed container of the same tokens would decode fine).
TEST(Store, ForeignDiskFilesAreNeverServed) {
  TempDir du("foreign-plain"), dp("foreign-sealed"), d2("foreign-other");
  StoreOptions o = small();
  // One chunk (64 tokens) and a tail each: the chunk file is the only one.
  const auto p = seq(1000, 100), q = seq(5000, 110);
  const std::vector<uint8_t> a = secret_of(3);
  StoreOptions ou = o, op = with_secret(o, a, false), o2 = with_secret(o, secret_of(4), false);
  ou.disk_dir = du.path.string();
  op.disk_dir = dp.path.string();
  o2.disk_dir = d2.path.string();
  std::vector<std::string> logs;
  op.log = [&](const std::string& l) { logs.push_back(l); };
  for (auto* x : {&ou, &o2}) {
    PromptStore s(cal(), lowrank_geometry(), *x);
    s.put(p, prompt_capture(p));
  }
  const fs::path u_entry = files_in(du.path, ".kvse").at(0), u_chunk = files_in(du.path, ".kvtc").at(0);
  const fs::path other_entry = files_in(d2.path, ".kvse").at(0);
  auto put = [&](const std::vector<std::vector<int32_t>>& ps) {
    PromptStore s(cal(), lowrank_geometry(), op);
    s.flush();
    for (const auto& x : ps) s.put(x, prompt_capture(x));
  };
  // A new process on the sealed directory (RAM empty): what it serves, and its figures.
  auto reopen = [&] {
    auto s = std::make_unique<PromptStore>(cal(), lowrank_geometry(), op);
    s->flush();
    return s;
  };
  // The sealed store's file names, from the spec (a store without a disk tier has the same salt).
  StoreOptions ok = op;
  ok.disk_dir.clear();
  const PromptStore keyer(cal(), lowrank_geometry(), ok);
  const fs::path root = dp.path / keyer.fingerprint().substr(0, 16);
  const fs::path pe = root / "entries" / (entry_key(keyer, p, 1, 64, a) + ".kvse");
  const fs::path pc = root / "chunks" / (chain_key(keyer, p, 0, 64, a) + ".kvtc");

  // 1. The unsealed entry and chunk at the sealed names: dropped by the scan.
  put({p});
  ASSERT_TRUE(fs::exists(pe) && fs::exists(pc));
  copy_over(u_entry, pe);
  copy_over(u_chunk, pc);
  {
    auto s = reopen();
    EXPECT_FALSE(s->take({}, p));
    const StoreStats st = s->stats();
    EXPECT_EQ(st.foreign_dropped, 1u);
    EXPECT_EQ(st.tiers[2].foreign_dropped, 1u);
    EXPECT_EQ(st.corrupt_dropped, 0u);
    EXPECT_EQ(st.disk_entries, 0u);
    EXPECT_FALSE(fs::exists(pe));
    EXPECT_FALSE(fs::exists(pc));  // named by no entry: swept
  }
  bool named = false;
  for (const auto& l : logs) named = named || (l.find(pe.string()) != std::string::npos && l.find("not sealed") != std::string::npos);
  EXPECT_TRUE(named) << "the log names the file and why";
  // 2. A valid unsealed container (the same tokens' chunk) at a sealed chunk's name.
  put({p});
  copy_over(u_chunk, pc);
  {
    auto s = reopen();
    EXPECT_EQ(s->stats().disk_entries, 1u);  // the entry is sealed: it opens
    EXPECT_FALSE(s->take({}, p));            // its chunk does not
    EXPECT_EQ(s->stats().foreign_dropped, 1u);
    EXPECT_EQ(s->stats().corrupt_dropped, 0u);
    EXPECT_EQ(s->stats().disk_entries, 0u);
    EXPECT_FALSE(fs::exists(pc));
    EXPECT_FALSE(fs::exists(pe));
  }
  // 3. Another secret's entry of the same prompt at this one's name.
  put({p});
  copy_over(other_entry, pe);
  {
    auto s = reopen();
    EXPECT_FALSE(s->take({}, p));
    EXPECT_EQ(s->stats().foreign_dropped, 1u);
  }
  // 4. Sealed with this secret, moved to another key: q's entry file over
  // p's, then q's chunk file over p's.
  put({p, q});
  const fs::path qe = root / "entries" / (entry_key(keyer, q, 1, 64, a) + ".kvse");
  const fs::path qc = root / "chunks" / (chain_key(keyer, q, 0, 64, a) + ".kvtc");
  copy_over(qe, pe);
  {
    auto s = reopen();
    EXPECT_EQ(s->stats().foreign_dropped, 1u);
    EXPECT_FALSE(s->take({}, p));
    auto m = s->take({}, q);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->tokens, q);
  }
  put({p});
  copy_over(qc, pc);
  {
    auto s = reopen();
    EXPECT_EQ(s->stats().disk_entries, 2u);
    EXPECT_FALSE(s->take({}, p));
    EXPECT_EQ(s->stats().foreign_dropped, 1u);
    EXPECT_EQ(s->stats().corrupt_dropped, 0u);
    EXPECT_TRUE(s->take({}, q));
  }
}

// With encrypt, no file holds the prompt's tokens (an entry file without
// it does: the control), and the same prompt put by two stores gives two
// ciphertexts (a nonce per value), where authentication alone gives the
// same bytes.
TEST(Store, EncryptedFilesHoldNoTokensAndNeverRepeat) {
  const auto p = seq(70000, 300);
  std::vector<std::map<std::string, std::vector<uint8_t>>> files;  // by name, per store
  for (int i = 0; i < 4; ++i) {                                    // 0, 1: authenticated; 2, 3: encrypted
    TempDir dir("no-tokens-" + std::to_string(i));
    StoreOptions o = with_secret(small(), secret_of(9), i >= 2);
    o.disk_dir = dir.path.string();
    {
      PromptStore s(cal(), lowrank_geometry(), o);
      s.put(p, prompt_capture(p));
    }
    files.emplace_back();
    for (const char* ext : {".kvtc", ".kvse"})
      for (const auto& f : files_in(dir.path, ext)) files.back()[f.filename().string()] = read_file(f.string());
    ASSERT_EQ(files.back().size(), 4u + 1u);
  }
  bool control = false;
  for (const auto& [name, b] : files[0]) control = control || holds_tokens(b, p);
  EXPECT_TRUE(control) << "the check finds the tokens in an authenticated-only store's files";
  for (const auto& [name, b] : files[2]) EXPECT_FALSE(holds_tokens(b, p)) << name;
  for (const auto& [name, b] : files[0]) {
    ASSERT_TRUE(files[1].count(name)) << name;  // the same secret and mode: the same keys
    EXPECT_EQ(files[1].at(name), b) << name;    // HMAC: deterministic
  }
  for (const auto& [name, b] : files[2]) {
    ASSERT_TRUE(files[3].count(name)) << name;
    EXPECT_NE(files[3].at(name), b) << name;
    EXPECT_NE(std::vector<uint8_t>(files[3].at(name).begin(), files[3].at(name).begin() + 12), std::vector<uint8_t>(b.begin(), b.begin() + 12))
        << name << ": a nonce repeated";
  }
}

// Sliding-window (iSWA) models (docs/store.md "Sliding-window models",
// design E): block 0 in shared chunks as for any model, the window's state
// in the tail. A stored prompt restores itself whole — and so any longer
// prompt it begins, a conversation's next turn — and never a shorter
// prefix of a prompt longer than the window, whose window state at that
// prefix the store does not hold. Synthetic two-block caches on purpose
// (tests/synthetic.h); tests/test_server.py runs Gemma 3.
namespace {

constexpr uint32_t kSwa = 48;
// The window block's error per token row at ratio 8 (measured: up to 0.07;
// a row from another position or token is off by about its norm, 1.4).
constexpr double kWindowTol = 0.15;

const Calibration& swa_cal() {
  static const Calibration c = swa_fitted(kSwa);
  return c;
}

// What the codec gives for block 0 of a whole prompt with the store's
// settings: swa_cal()'s block 0, as the store codes its chunks.
KvCapture swa_whole_roundtrip(const std::vector<int32_t>& tokens, const StoreOptions& o) {
  Calibration c0 = swa_cal();
  c0.blocks.resize(1);
  c0.geometry.blocks.resize(1);
  KvCapture c = swa_capture(tokens, kSwa);
  c.blocks.resize(1);
  CompressOptions co;
  co.sink = o.sink;
  co.window = o.window;
  co.precision = o.precision;
  DecompressOptions d;
  d.precision = o.precision;
  const double global = global_ratio_of(swa_geometry(kSwa), o);  // min(ratio, 4) by default
  return decompress(compress(c, c0, allocation_set(c0, global), co), c0, "whole", d);
}

// Block b of a capture, alone (for the single-block comparisons).
KvCapture block_of(const KvCapture& c, size_t b) {
  KvCapture o;
  o.model_sha256 = c.model_sha256;
  o.tokens = c.tokens;
  o.blocks.push_back(c.blocks.at(b));
  return o;
}

// Block 1 of `got` is the window at n of `original` (any cell order): the
// positions in order, its last `raw` tokens bit for bit, the rest within
// `tol` relative error per token row.
::testing::AssertionResult window_matches(const KvCapture& got, const KvCapture& original, uint32_t n, uint32_t raw, double tol) {
  if (got.blocks.size() != 2) return ::testing::AssertionFailure() << got.blocks.size() << " blocks, expected 2";
  const KvBlock& a = got.blocks[1];
  const uint32_t w0 = n > kSwa ? n - kSwa : 0;
  if (a.n_tokens() != n - w0) return ::testing::AssertionFailure() << "window of " << a.n_tokens() << " tokens, expected " << n - w0;
  const KvBlock& o = original.blocks.at(1);
  for (uint32_t i = 0; i < a.n_tokens(); ++i) {
    if (a.pos[i] != int32_t(w0 + i)) return ::testing::AssertionFailure() << "window token " << i << " at position " << a.pos[i];
    uint32_t j = 0;
    while (j < o.n_tokens() && o.pos[j] != a.pos[i]) ++j;
    if (j == o.n_tokens()) return ::testing::AssertionFailure() << "position " << a.pos[i] << " not in the original";
    for (int kv = 0; kv < 2; ++kv) {
      const auto A = feature_rows(a, kv == 0, false, i, i + 1), O = feature_rows(o, kv == 0, false, j, j + 1);
      double d = 0, x = 0;
      for (size_t f = 0; f < A.size(); ++f) d += (A[f] - O[f]) * (A[f] - O[f]), x += O[f] * O[f];
      const bool in_raw = i + raw >= a.n_tokens();
      if (in_raw ? d != 0 : d > tol * tol * x)
        return ::testing::AssertionFailure() << "position " << a.pos[i] << (kv ? " V" : " K") << ": relative error " << std::sqrt(d / x)
                                             << (in_raw ? " in the raw window" : "");
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(Store, SlidingWindowPromptsAreRestoredWholeOrNotAtAll) {
  TempDir dir("swa");
  StoreOptions o = small(/*async=*/true);
  o.disk_dir = dir.path.string();
  const CacheGeometry g = swa_geometry(kSwa);
  const auto a = seq(1000, 200);              // longer than the window (48): chunks 0-1 (64 tokens), a 72-token tail
  const auto longer = cat(a, seq(3000, 60));  // a's next turn
  const auto shorter = seq(5000, 40);         // within the window
  {
    PromptStore s(swa_cal(), g, o);
    s.put(a, swa_capture(a, kSwa, /*rotate=*/17));  // the window's cells in a ring's order, as a state holds them
    s.put(shorter, swa_capture(shorter, kSwa, 5));
    s.flush();
    ASSERT_EQ(s.stats().puts, 2u) << "puts skipped: " << s.stats().puts_skipped;

    // The whole prompt, and the next turn that extends it.
    for (const auto& want : {a, cat(a, seq(9, 5))}) {
      auto m = s.take({}, want);
      ASSERT_TRUE(m);
      EXPECT_EQ(m->common_prefix, a.size());
      EXPECT_TRUE(matches_prefix(block_of(m->cache, 0), swa_whole_roundtrip(a, o), uint32_t(a.size())));
      EXPECT_TRUE(window_matches(m->cache, swa_capture(a, kSwa), uint32_t(a.size()), o.window, kWindowTol));
    }
    // A shorter prefix of it (a regenerated turn): its window state is not
    // held, so nothing is restored, and a put of it is wanted.
    const auto cut = cat(seq(1000, 150), seq(9, 30));
    EXPECT_FALSE(s.take({}, cut));
    EXPECT_TRUE(s.wants(std::vector<int32_t>(a.begin(), a.begin() + 150)));
    EXPECT_FALSE(s.wants(a));
    // Within the window, the same rule: whole only.
    auto m = s.take({}, cat(shorter, seq(9, 3)));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, shorter.size());
    EXPECT_TRUE(window_matches(m->cache, swa_capture(shorter, kSwa), uint32_t(shorter.size()), o.window, kWindowTol));
    EXPECT_FALSE(s.take({}, cat(seq(5000, 30), seq(9, 3))));

    // The next turn is stored beside a (sharing its chunks), not over it:
    // a stays the entry a regenerated next turn restores.
    s.put(longer, swa_capture(longer, kSwa, 3));
    s.flush();
    EXPECT_EQ(s.stats().entries, 3u);
    EXPECT_EQ(s.stats().chunks_shared, 2u);
    m = s.take({}, cat(a, seq(4000, 10)));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->common_prefix, a.size());

    // The state a restore writes: both blocks, the window in position order.
    const StateLayout to{{1, 1}, 0, 2};
    auto ms = s.take_state({}, longer, to);
    ASSERT_TRUE(ms);
    EXPECT_EQ(ms->common_prefix, longer.size());
    m = s.take({}, longer);
    ASSERT_TRUE(m);
    EXPECT_EQ(ms->state, state_from_capture(m->cache, to));
    const KvCapture back = capture_from_state(ms->state, g, "test");
    ASSERT_EQ(back.blocks.size(), 2u);
    EXPECT_EQ(back.blocks[1].pos.front(), int32_t(longer.size() - kSwa));
    EXPECT_EQ(back.blocks[1].pos.back(), int32_t(longer.size() - 1));
  }
  // Read back from disk after a restart.
  PromptStore s(swa_cal(), g, o);
  s.flush();
  EXPECT_EQ(s.stats().disk_entries, 3u);
  auto m = s.take({}, longer);
  ASSERT_TRUE(m);
  EXPECT_STREQ(m->tier, "disk");
  EXPECT_EQ(m->common_prefix, longer.size());
  EXPECT_TRUE(window_matches(m->cache, swa_capture(longer, kSwa), uint32_t(longer.size()), o.window, kWindowTol));
}

TEST(Store, SlidingWindowPutsAndSettingsAreChecked) {
  const CacheGeometry g = swa_geometry(kSwa);
  const auto a = seq(1000, 200);
  // A queued put is restored from its raw state: the window exactly.
  {
    StoreOptions q = small(true);
    q.threads = 1;
    PromptStore s(swa_cal(), g, q);
    const auto big = seq(90000, 2000);
    s.put(big, swa_capture(big, kSwa));
    s.put(a, swa_capture(a, kSwa, 11));
    auto m = s.take({}, a);
    ASSERT_TRUE(m);
    if (std::string(m->tier) == "pending") {  // else coded already (a worker quicker than this take): compared above
      EXPECT_TRUE(window_matches(m->cache, swa_capture(a, kSwa), uint32_t(a.size()), kSwa, 0));
    }
    EXPECT_FALSE(s.take({}, std::vector<int32_t>(a.begin(), a.begin() + 100)));
  }
  // A window missing a position: not stored (logged), never restored.
  {
    PromptStore s(swa_cal(), g, small());
    KvCapture c = swa_capture(a, kSwa);
    c.blocks[1].pos[3] = c.blocks[1].pos[4];
    s.put(a, std::move(c));
    EXPECT_EQ(s.stats().puts_skipped, 1u);
    EXPECT_FALSE(s.take({}, a));
  }
  // The global layers at their own ratio (by default min(ratio, 4)): coded
  // closer to the original than at the window's ratio, in more bytes, under
  // another salt; refused for a single-block model.
  {
    StoreOptions o = small();
    EXPECT_EQ(global_ratio_of(g, o), 4);
    EXPECT_EQ(global_ratio_of(lowrank_geometry(), o), 0);
    o.global_ratio = o.ratio;
    PromptStore s8(swa_cal(), g, o);
    o.global_ratio = 0;
    PromptStore s4(swa_cal(), g, o);
    EXPECT_NE(s8.fingerprint(), s4.fingerprint());
    const auto b = seq(3000, 300);
    const KvCapture original = swa_capture(b, kSwa);
    double err[2];
    uint64_t bytes[2];
    int i = 0;
    for (PromptStore* s : {&s8, &s4}) {
      s->put(b, swa_capture(b, kSwa));
      auto m = s->take({}, b);
      ASSERT_TRUE(m);
      const ReconError e = reconstruction_error(block_of(original, 0), block_of(m->cache, 0), o.sink, o.window);
      err[i] = e.k + e.v;
      bytes[i++] = s->stats().ram_bytes;
    }
    EXPECT_LT(err[1], 0.5 * err[0]) << err[0] << " " << err[1];
    EXPECT_GT(bytes[1], bytes[0]);
    o.global_ratio = 4;
    EXPECT_NE(error_of([&] { PromptStore x(cal(), lowrank_geometry(), o); }).find("global_ratio is for sliding-window"), std::string::npos);
  }
  // Another store: the window is part of the salt; an iSWA store's pieces
  // are DP-coded whatever entropy_coded says (the same store either way).
  {
    PromptStore s1(swa_cal(), g, small());
    StoreOptions o = small();
    EXPECT_NE(s1.fingerprint(), PromptStore(cal(), lowrank_geometry(), o).fingerprint());
    o.entropy_coded = !o.entropy_coded;
    EXPECT_EQ(PromptStore(swa_cal(), g, o).fingerprint(), s1.fingerprint());
  }
}
