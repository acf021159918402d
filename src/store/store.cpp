// The prompt store (include/kvtc/store.h, docs/store.md): a RAM tier and a
// disk tier of compressed prompt caches made of shared, hash-chained chunks.
//
// Locking: one mutex (mu_) guards every index (RAM entries and chunks, the
// queue, the disk index, the statistics). Coding, decoding and file I/O run
// outside it on immutable data: a RAM chunk is a shared_ptr to const bytes,
// a queued put is a shared_ptr to a const raw state, so a take() that
// copied the pointers under the lock decodes without it while the worker
// stores the next put.
#include "kvtc/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "core/parallel.h"
#include "core/util.h"
#include "format/container.h"
#include "format/plan.h"
#include "kvtc/error.h"
#include "kvtc/files.h"
#include "store/redis.h"

namespace kvtc {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;
using BytesPtr = std::shared_ptr<const Bytes>;
using Clock = std::chrono::steady_clock;

constexpr char kEntryMagic[4] = {'K', 'V', 'S', 'E'};
constexpr uint32_t kEntryVersion = 1;
constexpr size_t kEntryHeaderBytes = 20;  // magic, version, json length, xxh64
constexpr const char* kStoreScheme = "kvtc-store/1";

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void put32(Bytes& o, uint32_t v) {
  for (int i = 0; i < 4; ++i) o.push_back(uint8_t(v >> (8 * i)));
}
void put64(Bytes& o, uint64_t v) {
  for (int i = 0; i < 8; ++i) o.push_back(uint8_t(v >> (8 * i)));
}
uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// One link of the key chain (docs/store.md "Keys"): SHA-256 over a domain
// byte ('c' chunk, 'e' entry), the parent's 64 hex digits and the tokens as
// little-endian int32.
std::string link(char domain, const std::string& parent, std::span<const int32_t> tokens) {
  Bytes b;
  b.reserve(1 + parent.size() + tokens.size() * 4);
  b.push_back(uint8_t(domain));
  b.insert(b.end(), parent.begin(), parent.end());
  for (int32_t t : tokens) put32(b, uint32_t(t));
  return sha256_bytes(b);
}

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// Tokens [t0, t1) of a single-block capture, with their ids from `ids`
// (the whole prompt's).
KvCapture slice(const KvCapture& c, uint32_t t0, uint32_t t1, std::span<const int32_t> ids) {
  const KvBlock& s = c.blocks[0];
  KvCapture o;
  o.model_sha256 = c.model_sha256;
  KvBlock b;
  static_cast<BlockGeometry&>(b) = s.geometry();
  b.pos.assign(s.pos.begin() + t0, s.pos.begin() + t1);
  const size_t n = t1 - t0, hd = s.head_dim, rows = size_t(s.n_layer()) * s.n_head_kv;
  b.k.resize(rows * n * hd);
  b.v.resize(rows * n * hd);
  for (size_t r = 0; r < rows; ++r) {
    const size_t from = (r * s.n_tokens() + t0) * hd, to = r * n * hd;
    std::memcpy(b.k.data() + to, s.k.data() + from, n * hd * 2);
    std::memcpy(b.v.data() + to, s.v.data() + from, n * hd * 2);
  }
  o.blocks.push_back(std::move(b));
  o.tokens.assign(ids.begin() + t0, ids.begin() + t1);
  return o;
}

// Pieces (their first tokens in order) joined into one capture of their
// first n tokens.
KvCapture join(const std::vector<KvCapture>& parts, uint32_t n) {
  const KvBlock& g = parts.at(0).blocks[0];
  KvCapture o;
  o.model_sha256 = parts[0].model_sha256;
  KvBlock b;
  static_cast<BlockGeometry&>(b) = g.geometry();
  b.pos.reserve(n);
  for (const KvCapture& p : parts) {
    const size_t take = std::min<size_t>(p.blocks[0].n_tokens(), n - b.pos.size());
    b.pos.insert(b.pos.end(), p.blocks[0].pos.begin(), p.blocks[0].pos.begin() + take);
    o.tokens.insert(o.tokens.end(), p.tokens.begin(), p.tokens.begin() + take);
  }
  require(b.pos.size() == n, "store: the pieces hold fewer tokens than the match");
  const size_t hd = g.head_dim, rows = size_t(g.n_layer()) * g.n_head_kv;
  b.k.resize(rows * n * hd);
  b.v.resize(rows * n * hd);
  size_t at = 0;
  for (const KvCapture& p : parts) {
    const KvBlock& s = p.blocks[0];
    const size_t take = std::min<size_t>(s.n_tokens(), n - at);
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(b.k.data() + (r * n + at) * hd, s.k.data() + r * s.n_tokens() * hd, take * hd * 2);
      std::memcpy(b.v.data() + (r * n + at) * hd, s.v.data() + r * s.n_tokens() * hd, take * hd * 2);
    }
    at += take;
    if (at == n) break;
  }
  o.blocks.push_back(std::move(b));
  return o;
}

}  // namespace

struct PromptStore::Impl {
  // ---- settings (immutable after construction) ----
  Calibration cal;
  CacheGeometry geom;
  StoreOptions opt;
  AllocationSet alloc;
  std::string salt;    // the chain's root (docs/store.md "Keys")
  std::string compat;  // first 16 hex digits of the salt: the store's directory
  uint32_t C = 0;
  std::string ratio_str;
  uint32_t container_version = 1;  // of the pieces: 2 when entropy-coded

  // ---- the RAM tier ----
  struct Piece {  // what a stored entry is made of
    std::string key;
    std::vector<int32_t> tokens;
    std::vector<std::string> chunks;  // keys of chunks 1..m
  };
  struct RamEntry : Piece {
    BytesPtr tail;
    uint64_t bytes = 0;  // tail + 4 bytes per token
  };
  struct RamChunk {
    BytesPtr bytes;
    uint32_t refs = 0;
  };
  std::list<RamEntry> ram;  // least recently used first
  std::unordered_map<std::string, RamChunk> ram_chunks;
  uint64_t ram_bytes = 0;

  // ---- the queue of puts ----
  struct Pending {
    std::vector<int32_t> tokens;
    Bytes blob;     // a state blob (put_state) ...
    KvCapture cap;  // ... or a capture (put)
    uint64_t bytes = 0;
  };
  using PendingPtr = std::shared_ptr<const Pending>;
  std::deque<PendingPtr> queue;  // the front one is being stored while busy
  bool busy = false;

  // ---- the disk tier ----
  struct DiskEntry : Piece {
    uint64_t file_bytes = 0;
  };
  struct DiskChunk {
    uint32_t refs = 0;
    uint64_t bytes = 0;
  };
  std::list<DiskEntry> disk;  // least recently used first
  std::unordered_map<std::string, DiskChunk> disk_chunks;
  uint64_t disk_bytes = 0;
  bool disk_on = false;
  std::string disk_error;
  fs::path root;  // disk_dir/<compat>
  int lock_fd = -1;

  StoreStats st;
  mutable std::mutex mu;
  std::condition_variable cv_work, cv_idle;
  int takers = 0;                    // take() calls decoding now (under mu)
  std::condition_variable cv_takes;  // the worker waits on it between pieces
  bool stopping = false;
  std::thread worker;

  void log(const std::string& s) const {
    if (opt.log) opt.log(s);
  }

  // ---------------------------------------------------------------- keys
  std::vector<std::string> chunk_keys(std::span<const int32_t> tokens, uint32_t m) const {
    std::vector<std::string> keys;
    std::string h = salt;
    for (uint32_t i = 0; i < m; ++i) keys.push_back(h = link('c', h, tokens.subspan(size_t(i) * C, C)));
    return keys;
  }
  std::string entry_key(std::span<const int32_t> tokens, const std::vector<std::string>& chunks) const {
    const size_t m = chunks.size();
    return link('e', m ? chunks.back() : salt, tokens.subspan(m * C));
  }
  // Full chunks of an n-token prompt: those that end at or before the raw
  // window, so a chunk never holds a token the tail keeps raw.
  uint32_t full_chunks(size_t n) const { return n > opt.window ? uint32_t((n - opt.window) / C) : 0; }

  CompressOptions copt(uint32_t sink, uint32_t window) const {
    CompressOptions o;
    o.sink = sink;
    o.window = opt.raw ? 1u << 30 : window;  // raw: every token in the raw window
    o.chunk_tokens = C;
    o.deflate_level = opt.raw ? 0 : opt.deflate_level;
    o.precision = opt.precision;
    o.threads = 1;  // the store runs pieces in parallel instead
    return o;
  }

  // ---------------------------------------------------------------- RAM tier
  void ram_unref(const std::vector<std::string>& chunks) {
    for (const std::string& k : chunks) {
      auto it = ram_chunks.find(k);
      if (it == ram_chunks.end()) continue;
      if (--it->second.refs == 0) {
        ram_bytes -= it->second.bytes->size();
        ram_chunks.erase(it);
      }
    }
  }
  std::list<RamEntry>::iterator ram_erase(std::list<RamEntry>::iterator it) {
    ram_unref(it->chunks);
    ram_bytes -= it->bytes;
    return ram.erase(it);
  }
  // Bytes a new entry would add to the RAM tier (chunks it shares cost nothing).
  uint64_t ram_cost(const RamEntry& e, const std::vector<BytesPtr>& chunk_bytes) const {
    uint64_t b = e.bytes;
    for (size_t i = 0; i < e.chunks.size(); ++i)
      if (!ram_chunks.count(e.chunks[i])) b += chunk_bytes[i]->size();
    return b;
  }
  // Inserts (most recently used), dropping entries the new one contains and
  // the oldest ones past the budget. Under mu.
  void ram_insert(RamEntry e, const std::vector<BytesPtr>& chunk_bytes) {
    for (auto it = ram.begin(); it != ram.end();) it = common_prefix(it->tokens, e.tokens) == it->tokens.size() ? ram_erase(it) : std::next(it);
    const uint64_t cost = ram_cost(e, chunk_bytes);
    if (opt.ram_bytes && cost > opt.ram_bytes) {
      log("kvtc store: a " + std::to_string(e.tokens.size()) + "-token prompt takes " + std::to_string(cost) +
          " bytes, more than the RAM budget; not kept in RAM");
      return;
    }
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      RamChunk& c = ram_chunks[e.chunks[i]];
      if (!c.bytes) {
        c.bytes = chunk_bytes[i];
        ram_bytes += c.bytes->size();
      }
      ++c.refs;
    }
    ram_bytes += e.bytes;
    ram.push_back(std::move(e));
    // Evict the oldest others; the new entry stays (cost <= budget).
    while (opt.ram_bytes && ram_bytes > opt.ram_bytes && ram.size() > 1) ram_erase(ram.begin());
  }

  // ---------------------------------------------------------------- disk tier
  fs::path chunk_path(const std::string& k) const { return root / "chunks" / (k + ".kvtc"); }
  fs::path entry_path(const std::string& k) const { return root / "entries" / (k + ".kvse"); }

  void disable_disk(const std::string& why) {  // under mu
    if (!disk_on && !disk_error.empty()) return;
    disk_on = false;
    disk_error = why;
    log("kvtc store: disk tier disabled: " + why + " (serving from RAM only)");
  }

  nlohmann::json fingerprint() const {
    return {{"scheme", kStoreScheme},
            {"salt", salt},
            {"model_sha256", geom.model_sha256},
            {"calibration_id", cal.id},
            {"container_version", container_version},
            {"chunk_tokens", C},
            {"ratio", ratio_str},
            {"sink", opt.sink},
            {"window", opt.window}};
  }

  Bytes entry_file(const Piece& e, const Bytes& tail) const {
    nlohmann::json j = fingerprint();
    j["format"] = "kvtc-store-entry";
    j["version"] = kEntryVersion;
    j["key"] = e.key;
    j["n_tokens"] = e.tokens.size();
    j["chunks"] = e.chunks;
    j["tail_bytes"] = tail.size();
    const std::string js = j.dump();
    Bytes body(js.begin(), js.end());
    for (int32_t t : e.tokens) put32(body, uint32_t(t));
    body.insert(body.end(), tail.begin(), tail.end());
    Bytes o(kEntryMagic, kEntryMagic + 4);
    put32(o, kEntryVersion);
    put32(o, uint32_t(js.size()));
    put64(o, container::xxh64(body.data(), body.size()));
    o.insert(o.end(), body.begin(), body.end());
    return o;
  }

  // Parses an entry file; Error names the file and what is wrong. `tail`
  // receives the tail container when given.
  Piece parse_entry(const Bytes& f, const std::string& path, Bytes* tail) const {
    require(f.size() >= kEntryHeaderBytes && std::memcmp(f.data(), kEntryMagic, 4) == 0, path + ": not a kvtc store entry (magic)");
    require(get32(f.data() + 4) == kEntryVersion,
            path + ": entry version " + std::to_string(get32(f.data() + 4)) + ", expected " + std::to_string(kEntryVersion));
    const uint32_t jl = get32(f.data() + 8);
    require(jl <= f.size() - kEntryHeaderBytes, path + ": header length past the end (truncated file)");
    require(container::xxh64(f.data() + kEntryHeaderBytes, f.size() - kEntryHeaderBytes) == get64(f.data() + 12),
            path + ": checksum mismatch (corrupted or truncated file)");
    Piece e;
    uint64_t tail_bytes = 0;
    try {
      const auto j = nlohmann::json::parse(f.begin() + kEntryHeaderBytes, f.begin() + kEntryHeaderBytes + jl);
      require(j.at("salt") == salt, "salt: written by another model, calibration or setting");
      e.key = j.at("key").get<std::string>();
      const uint64_t n = j.at("n_tokens").get<uint64_t>();
      e.chunks = j.at("chunks").get<std::vector<std::string>>();
      tail_bytes = j.at("tail_bytes").get<uint64_t>();
      require(n <= (1u << 24) && f.size() - kEntryHeaderBytes - jl == n * 4 + tail_bytes, "n_tokens, tail_bytes: do not match the file size");
      const uint8_t* p = f.data() + kEntryHeaderBytes + jl;
      for (uint64_t i = 0; i < n; ++i) e.tokens.push_back(int32_t(get32(p + 4 * i)));
    } catch (const nlohmann::json::exception& x) {
      throw Error(path + ": bad header: " + x.what());
    } catch (const Error& x) {
      throw Error(path + ": " + x.what());
    }
    require(e.chunks.size() == full_chunks(e.tokens.size()) && chunk_keys(e.tokens, uint32_t(e.chunks.size())) == e.chunks &&
                entry_key(e.tokens, e.chunks) == e.key,
            path + ": the keys do not match the tokens");
    if (tail) tail->assign(f.end() - tail_bytes, f.end());
    return e;
  }

  void disk_unref(const std::vector<std::string>& chunks) {  // under mu
    for (const std::string& k : chunks) {
      auto it = disk_chunks.find(k);
      if (it == disk_chunks.end()) continue;
      if (--it->second.refs == 0) {
        disk_bytes -= it->second.bytes;
        std::error_code ec;
        fs::remove(chunk_path(k), ec);
        disk_chunks.erase(it);
      }
    }
  }
  std::list<DiskEntry>::iterator disk_erase(std::list<DiskEntry>::iterator it) {  // under mu
    std::error_code ec;
    fs::remove(entry_path(it->key), ec);  // the index goes before the data it points to
    disk_bytes -= it->file_bytes;
    disk_unref(it->chunks);
    return disk.erase(it);
  }

  // Opens disk_dir/<compat>, takes its lock, writes store.json (which tells
  // whether the directory is writable) and reads the entries back.
  void open_disk() {
    root = fs::path(opt.disk_dir) / compat;
    try {
      std::error_code ec;
      fs::create_directories(root / "chunks", ec);
      if (!ec) fs::create_directories(root / "entries", ec);
      require(!ec, root.string() + ": cannot create the store directory: " + ec.message());
      const std::string lock = (root / "lock").string();
      lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      require(lock_fd >= 0, lock + ": cannot open: " + std::strerror(errno));
      require(::flock(lock_fd, LOCK_EX | LOCK_NB) == 0, lock + ": held by another process (one server per store directory)");
      const std::string js = fingerprint().dump(2) + "\n";
      write_file_atomic((root / "store.json").string(), std::span(reinterpret_cast<const uint8_t*>(js.data()), js.size()));
      disk_on = true;
    } catch (const std::exception& x) {
      disable_disk(x.what());
      return;
    }
    scan_disk();
  }

  void scan_disk() {
    struct Found {
      DiskEntry e;
      fs::file_time_type t;
    };
    std::vector<Found> found;
    std::error_code ec;
    for (const auto& de : fs::directory_iterator(root / "entries", ec)) {
      const std::string path = de.path().string(), name = de.path().filename().string();
      if (name.rfind(".", 0) == 0) {  // a temporary file left by a crash
        fs::remove(de.path(), ec);
        continue;
      }
      try {
        const Bytes f = read_file(path);
        DiskEntry e;
        static_cast<Piece&>(e) = parse_entry(f, path, nullptr);
        require(name == e.key + ".kvse", path + ": the file name is not the entry's key");
        e.file_bytes = f.size();
        found.push_back({std::move(e), fs::last_write_time(de.path(), ec)});
      } catch (const std::exception& x) {
        ++st.corrupt_dropped;
        log("kvtc store: dropped " + path + ": " + x.what());
        fs::remove(de.path(), ec);
      }
    }
    std::unordered_map<std::string, uint64_t> sizes;
    for (const auto& de : fs::directory_iterator(root / "chunks", ec)) {
      const std::string name = de.path().filename().string();
      if (name.size() == 64 + 5 && name.substr(64) == ".kvtc")
        sizes[name.substr(0, 64)] = de.file_size(ec);
      else
        fs::remove(de.path(), ec);  // temporaries
    }
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.t < b.t; });
    for (Found& f : found) {
      bool complete = true;
      for (const std::string& k : f.e.chunks) complete = complete && sizes.count(k);
      if (!complete) {
        ++st.corrupt_dropped;
        log("kvtc store: dropped " + entry_path(f.e.key).string() + ": a chunk file is missing");
        fs::remove(entry_path(f.e.key), ec);
        continue;
      }
      for (const std::string& k : f.e.chunks) {
        DiskChunk& c = disk_chunks[k];
        if (c.refs++ == 0) disk_bytes += c.bytes = sizes[k];
      }
      disk_bytes += f.e.file_bytes;
      disk.push_back(std::move(f.e));
    }
    for (const auto& [k, b] : sizes)  // chunks no entry names (a crash between chunk and entry)
      if (!disk_chunks.count(k)) fs::remove(chunk_path(k), ec);
    while (opt.disk_bytes && disk_bytes > opt.disk_bytes && !disk.empty()) disk_erase(disk.begin());
  }

  // Writes a stored put to disk: chunks not there yet, then the entry file
  // (data before index). Outside mu except for the index updates.
  void disk_store(const Piece& p, const std::vector<BytesPtr>& chunk_bytes, const Bytes& ef) {
    std::vector<size_t> fresh;
    uint64_t need = ef.size();
    {
      std::lock_guard<std::mutex> g(mu);
      if (!disk_on) return;
      for (size_t i = 0; i < p.chunks.size(); ++i)
        if (!disk_chunks.count(p.chunks[i])) {
          fresh.push_back(i);
          need += chunk_bytes[i]->size();
        }
      if (opt.disk_bytes && need > opt.disk_bytes) {
        log("kvtc store: a " + std::to_string(p.tokens.size()) + "-token prompt takes " + std::to_string(need) +
            " bytes, more than the disk budget; not written");
        return;
      }
      // Room first: the oldest entries that the new one does not need.
      while (opt.disk_bytes && disk_bytes + need > opt.disk_bytes && !disk.empty()) disk_erase(disk.begin());
      // Chunks this entry shares with the ones just evicted are gone now.
      fresh.clear();
      need = ef.size();
      for (size_t i = 0; i < p.chunks.size(); ++i)
        if (!disk_chunks.count(p.chunks[i])) {
          fresh.push_back(i);
          need += chunk_bytes[i]->size();
        }
      // Claim the chunks so that no eviction removes them while we write.
      for (const std::string& k : p.chunks) ++disk_chunks[k].refs;
    }
    std::string failed;
    for (size_t i : fresh) {
      try {
        write_file_atomic(chunk_path(p.chunks[i]).string(), *chunk_bytes[i]);
      } catch (const std::exception& x) {
        failed = x.what();
        break;
      }
    }
    if (failed.empty()) {
      try {
        write_file_atomic(entry_path(p.key).string(), ef);
      } catch (const std::exception& x) {
        failed = x.what();
      }
    }
    std::lock_guard<std::mutex> g(mu);
    for (size_t i : fresh) disk_chunks[p.chunks[i]].bytes = chunk_bytes[i]->size();
    for (size_t i : fresh) disk_bytes += chunk_bytes[i]->size();
    if (!failed.empty()) {
      disk_unref(p.chunks);  // removes the fresh chunk files again
      disable_disk(failed);
      return;
    }
    // Entries the new one contains, and an older copy of it, go.
    for (auto it = disk.begin(); it != disk.end();) it = common_prefix(it->tokens, p.tokens) == it->tokens.size() ? disk_erase(it) : std::next(it);
    DiskEntry e;
    static_cast<Piece&>(e) = p;
    e.file_bytes = ef.size();
    disk_bytes += e.file_bytes;
    disk.push_back(std::move(e));
  }

  // ---------------------------------------------------------------- Redis tier
  // Keys (docs/store.md "Redis"): kvtc:<compat>:c:<chunk key> a chunk
  // container, kvtc:<compat>:e:<entry key> an entry file, and the index
  // kvtc:<compat>:x:<c_j>, a hash from the key of every entry whose last
  // full chunk is c_j (c_0: the salt) to its tokens after that chunk. Two
  // connections: a take never waits behind the worker's writes.
  std::unique_ptr<detail::Redis> rd_take, rd_put;
  std::mutex rd_take_mu, rd_put_mu;  // one exchange at a time on each
  bool rd_up = false;                // under mu
  std::string rd_error, rd_where;    // under mu

  std::string rkey(char kind, const std::string& k) const { return "kvtc:" + compat + ":" + kind + ":" + k; }
  const std::string& level_key(const std::vector<std::string>& chunks, size_t j) const { return j == 0 ? salt : chunks[j - 1]; }
  // An index value: u64 LE write time (ms since the Unix epoch), then the
  // entry's tokens after its last full chunk (int32 LE).
  static std::string index_value(std::span<const int32_t> t) {
    std::string s;
    s.reserve(8 + 4 * t.size());
    const uint64_t now = uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
    for (int i = 0; i < 8; ++i) s.push_back(char(now >> (8 * i)));
    for (int32_t x : t)
      for (int i = 0; i < 4; ++i) s.push_back(char(uint32_t(x) >> (8 * i)));
    return s;
  }
  static bool index_value_ok(const std::string& v) { return v.size() >= 8 && (v.size() - 8) % 4 == 0; }
  static size_t index_tokens(const std::string& v) { return (v.size() - 8) / 4; }
  static uint64_t index_time(const std::string& v) { return get64(reinterpret_cast<const uint8_t*>(v.data())); }
  // How many leading tokens of `t` the index value `v` matches.
  static size_t value_prefix(const std::string& v, std::span<const int32_t> t) {
    const size_t n = std::min(index_tokens(v), t.size());
    size_t i = 0;
    while (i < n && int32_t(get32(reinterpret_cast<const uint8_t*>(v.data()) + 8 + 4 * i)) == t[i]) ++i;
    return i;
  }
  // Fields one index hash keeps at most: a lookup reads every field of the
  // levels it visits (up to ~1.5 KB each at chunk 256 + window 128), so a
  // chunk that thousands of short chats share (a system prompt) must not
  // make every lookup read megabytes. The oldest go first; their entries
  // stay reachable through their chunks until LRU evicts them.
  static constexpr size_t kIndexFieldsMax = 32;

  void redis_fine() {  // under mu
    if (!rd_up && !rd_error.empty()) log("kvtc store: Redis " + rd_where + " reachable again");
    rd_up = true;
  }
  void redis_failed(const std::string& why) {  // under mu
    ++st.redis_errors;
    if (rd_up || rd_error != why) log("kvtc store: Redis unavailable (recomputing instead): " + why);
    rd_up = false;
    rd_error = why;
  }
  // Fails on an error reply (OOM under maxmemory-policy noeviction, WRONGTYPE).
  static void check(const std::vector<detail::RedisReply>& r, const char* what) {
    for (const auto& x : r)
      if (!x.ok()) throw detail::RedisError(std::string(what) + ": " + x.str);
  }

  void open_redis() {
    detail::RedisOptions ro;
    ro.url = opt.redis_url;
    ro.cluster = opt.redis_cluster;
    ro.connect_timeout_ms = opt.redis_connect_timeout_ms;
    ro.timeout_ms = opt.redis_timeout_ms;
    ro.retry_ms = opt.redis_retry_ms;
    rd_take = std::make_unique<detail::Redis>(ro);  // Error on a malformed URL: refused at start
    rd_put = std::make_unique<detail::Redis>(ro);
    rd_where = rd_take->describe();
    try {
      check(rd_take->run({{"PING"}}), "PING");
      std::lock_guard<std::mutex> g(mu);
      redis_fine();
    } catch (const std::exception& x) {  // not fatal: the store retries later
      std::lock_guard<std::mutex> g(mu);
      redis_failed(x.what());
    }
  }

  // Writes a stored put to Redis: the chunks it lacks, then the entry, then
  // the index (data before index; a reader treats a dangling index or a
  // missing chunk as a shorter match), and drops the entries this prompt
  // contains. Worker thread; failures are counted and logged, never thrown.
  void redis_store(const Piece& p, const std::vector<BytesPtr>& chunk_bytes, const Bytes& ef) {
    if (!rd_put) return;
    std::lock_guard<std::mutex> rg(rd_put_mu);
    const auto t0 = Clock::now();
    const size_t m = p.chunks.size(), n = p.tokens.size();
    uint64_t chunks = 0, bytes = 0, dropped = 0;
    try {
      // 1: which chunks are there (TOUCH refreshes their LRU clock too), and
      // the entries that may be prefixes of this prompt.
      std::vector<detail::RedisCommand> q;
      for (size_t i = 0; i < m; ++i) q.push_back({"TOUCH", rkey('c', p.chunks[i])});
      for (size_t j = 0; j <= m; ++j) q.push_back({"HGETALL", rkey('x', level_key(p.chunks, j))});
      const auto r = rd_put->run(q);
      check(std::vector<detail::RedisReply>(r.begin(), r.begin() + std::ptrdiff_t(m)), "TOUCH");
      // 2: the missing chunks.
      q.clear();
      for (size_t i = 0; i < m; ++i)
        if (r[i].integer == 0) {
          q.push_back({"SET", rkey('c', p.chunks[i]), std::string(chunk_bytes[i]->begin(), chunk_bytes[i]->end())});
          bytes += chunk_bytes[i]->size();
          ++chunks;
        }
      check(rd_put->run(q), "SET chunk");
      // 3: the entry.
      check(rd_put->run({{"SET", rkey('e', p.key), std::string(ef.begin(), ef.end())}}), "SET entry");
      bytes += ef.size();
      // 4: the index; then the entries this one contains go.
      q.clear();
      if (!r[2 * m].ok()) q.push_back({"DEL", rkey('x', level_key(p.chunks, m))});  // not a hash (not ours): replaced
      q.push_back({"HSET", rkey('x', level_key(p.chunks, m)), p.key, index_value(std::span(p.tokens).subspan(m * C))});
      for (size_t j = 0; j <= m; ++j) {
        const auto& h = r[m + j].elements;
        const auto rest = std::span(p.tokens).subspan(j * C);
        std::vector<std::pair<uint64_t, std::string>> kept;  // (time, key) of the fields that stay
        for (size_t f = 0; f + 1 < h.size(); f += 2) {
          const std::string &key = h[f].str, &v = h[f + 1].str;
          if (key == p.key) continue;
          if (!index_value_ok(v)) {  // not ours: cleared
            q.push_back({"HDEL", rkey('x', level_key(p.chunks, j)), key});
            continue;
          }
          if (index_tokens(v) <= rest.size() && value_prefix(v, rest) == index_tokens(v)) {
            q.push_back({"HDEL", rkey('x', level_key(p.chunks, j)), key});
            q.push_back({"DEL", rkey('e', key)});
            ++dropped;
            continue;
          }
          kept.emplace_back(index_time(v), key);
        }
        if (j == m && kept.size() + 1 > kIndexFieldsMax) {  // the new field counts
          std::sort(kept.begin(), kept.end());
          for (size_t i = 0; i + kIndexFieldsMax < kept.size() + 1; ++i) q.push_back({"HDEL", rkey('x', level_key(p.chunks, j)), kept[i].second});
        }
      }
      check(rd_put->run(q), "HSET index");
      std::lock_guard<std::mutex> g(mu);
      redis_fine();
      st.redis_chunks_written += chunks;
      ++st.redis_entries_written;
      st.redis_entries_dropped += dropped;
      st.redis_bytes_written += bytes;
      st.redis_write_ms += ms_since(t0);
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu);
      redis_failed(std::string("writing a ") + std::to_string(n) + "-token prompt: " + x.what());
      st.redis_write_ms += ms_since(t0);
    }
  }

  // A Redis match for `tokens` that restores more than `lcp_local` tokens
  // and beats the slot's own prompt (keep_bar, sim_bar) by llama-server's
  // rules; nullopt when there is none or Redis fails. Caller's thread,
  // outside mu.
  std::optional<Match> redis_take(std::span<const int32_t> tokens, float keep_bar, float sim_bar, size_t lcp_local) {
    std::lock_guard<std::mutex> rg(rd_take_mu);
    const auto t0 = Clock::now();
    const size_t K = tokens.size() / C;
    const std::vector<std::string> keys = chunk_keys(tokens, uint32_t(K));
    uint64_t read = 0, missing = 0, corrupt = 0;
    std::vector<detail::RedisCommand> drop;  // damaged or dangling values
    auto account = [&](bool ok, const std::string& err) {
      if (!drop.empty()) {
        try {
          (void)rd_take->run(drop);
        } catch (const std::exception&) {
        }
      }
      std::lock_guard<std::mutex> g(mu);
      ++st.redis_lookups;
      st.redis_bytes_read += read;
      st.redis_missing += missing;
      st.corrupt_dropped += corrupt;
      st.redis_lookup_ms += ms_since(t0);
      st.redis_redirects = rd_take->redirects() + rd_put->redirects();
      if (ok)
        redis_fine();
      else
        redis_failed(err);
    };
    try {
      // Round trip 1: which chunks of the prompt are stored, and the entries
      // hanging off each of them.
      std::vector<detail::RedisCommand> q;
      for (size_t i = 0; i < K; ++i) q.push_back({"EXISTS", rkey('c', keys[i])});
      for (size_t j = 0; j <= K; ++j) q.push_back({"HGETALL", rkey('x', level_key(keys, j))});
      const auto r = rd_take->run(q);
      // EXISTS cannot fail but for the connection (NOAUTH, LOADING): Redis
      // is not usable. An index of the wrong type reads as empty.
      check(std::vector<detail::RedisReply>(r.begin(), r.begin() + std::ptrdiff_t(K)), "EXISTS");
      size_t run = 0;
      while (run < K && r[run].integer == 1) ++run;
      // The candidate that restores the most: chunks alone, or an entry
      // (whose tail may add up to window + chunk_tokens tokens).
      size_t best_lcp = run * C, best_level = run;
      float best_keep = 1.0f;  // chunks alone are kept whole
      std::string best_entry;
      for (size_t j = 0; j <= run; ++j) {
        const auto& h = r[K + j].elements;
        const auto rest = tokens.subspan(j * C);
        for (size_t f = 0; f + 1 < h.size(); f += 2) {
          const std::string& v = h[f + 1].str;
          if (!index_value_ok(v)) continue;
          const size_t lcp = j * C + value_prefix(v, rest), whole = j * C + index_tokens(v);
          const float keep = float(lcp) / float(whole);
          if (lcp > best_lcp && keep >= 0.25f) {
            best_lcp = lcp;
            best_level = j;
            best_keep = keep;
            best_entry = h[f].str;
          }
        }
      }
      if (best_lcp <= lcp_local || !(keep_bar < best_keep && sim_bar < float(best_lcp) / float(tokens.size()))) {
        account(true, "");
        return std::nullopt;
      }
      // Round trip 2: the chunks the match needs, and the entry when its
      // tail is.
      size_t n = best_lcp;
      const bool want_tail = !best_entry.empty() && n > best_level * C;
      const size_t need = std::min((n + C - 1) / C, best_level);
      q.clear();
      for (size_t i = 0; i < need; ++i) q.push_back({"GET", rkey('c', keys[i])});
      if (want_tail) q.push_back({"GET", rkey('e', best_entry)});
      auto g2 = rd_take->run(q);
      const double round_trips_ms = ms_since(t0);  // both round trips, before any decoding
      for (size_t i = 0; i < g2.size(); ++i) {
        read += g2[i].str.size();
        if (g2[i].type != detail::RedisReply::Type::kString && g2[i].type != detail::RedisReply::Type::kNil) {
          // Not ours (WRONGTYPE): a miss; the key is cleared for the next writer.
          log("kvtc store: dropped a Redis value that is not a string: " + q[i][1] + ": " + g2[i].str);
          drop.push_back({"DEL", q[i][1]});
          g2[i] = detail::RedisReply{};
        }
      }
      size_t have = 0;  // leading chunks fetched
      while (have < need && g2[have].type == detail::RedisReply::Type::kString) ++have;
      if (have < need) {
        ++missing;  // evicted: a shorter match
        n = std::min(n, have * C);
      }
      Piece p;
      p.tokens.assign(tokens.begin(), tokens.end());
      p.chunks.assign(keys.begin(), keys.begin() + have);
      BytesPtr tail;
      if (want_tail && n > best_level * C) {
        const auto& e = g2.back();
        const std::string where = "redis " + rkey('e', best_entry);
        if (e.type != detail::RedisReply::Type::kString) {
          ++missing;
          drop.push_back({"HDEL", rkey('x', level_key(keys, best_level)), best_entry});
          n = best_level * C;
        } else {
          try {
            auto tb = std::make_shared<Bytes>();
            p = parse_entry(Bytes(e.str.begin(), e.str.end()), where, tb.get());
            require(p.chunks.size() == best_level && p.key == best_entry, where + ": not the entry its index names");
            tail = std::move(tb);
          } catch (const std::exception& x) {
            ++corrupt;
            log(std::string("kvtc store: dropped a damaged Redis entry: ") + x.what());
            drop.push_back({"HDEL", rkey('x', level_key(keys, best_level)), best_entry});
            drop.push_back({"DEL", rkey('e', best_entry)});
            p.tokens.assign(tokens.begin(), tokens.end());
            p.chunks.assign(keys.begin(), keys.begin() + have);
            n = best_level * C;
          }
        }
      }
      // Decode; a piece that fails its checks ends the match before it.
      const uint32_t m = uint32_t(p.chunks.size());
      if (!tail) n = std::min<size_t>(n, size_t(m) * C);
      const size_t pieces = std::min<size_t>((n + C - 1) / C, m + (tail ? 1 : 0));
      std::vector<KvCapture> parts(pieces);
      std::vector<std::string> errs(pieces);
      detail::parallel_for(pieces, opt.restore_threads, [&](size_t i) {
        try {
          const auto b = i == m ? std::span<const uint8_t>(*tail) : std::span(reinterpret_cast<const uint8_t*>(g2[i].str.data()), g2[i].str.size());
          parts[i] = decode_piece(p, b, uint32_t(i), "kvtc store: redis " + (i == m ? rkey('e', best_entry) : rkey('c', keys[i])));
        } catch (const std::exception& x) {
          errs[i] = x.what();
        }
      });
      for (size_t i = 0; i < pieces; ++i) {
        if (errs[i].empty()) continue;
        ++corrupt;
        log("kvtc store: dropped a damaged Redis value: " + errs[i]);
        if (i == m) {
          drop.push_back({"HDEL", rkey('x', level_key(keys, best_level)), best_entry});
          drop.push_back({"DEL", rkey('e', best_entry)});
        } else {
          drop.push_back({"DEL", rkey('c', keys[i])});
        }
        n = std::min(n, i * C);  // and every damaged piece goes, so that the next writer replaces it
      }
      if (n == 0 || n <= lcp_local || !(sim_bar < float(n) / float(tokens.size()))) {
        account(true, "");
        return std::nullopt;
      }
      parts.resize(std::min(pieces, (n + C - 1) / C));  // n only shrinks
      Match out;
      out.cache = join(parts, uint32_t(n));
      out.tokens = out.cache.tokens;
      out.common_prefix = uint32_t(n);
      out.tier = "redis";
      out.redis_ms = round_trips_ms;
      out.redis_bytes = read;
      // The whole entry came: keep it in RAM too.
      if (tail && have == m && pieces == m + 1 && n == best_lcp) {
        RamEntry e;
        static_cast<Piece&>(e) = p;
        e.tail = tail;
        e.bytes = tail->size() + 4 * e.tokens.size();
        std::vector<BytesPtr> cb;
        for (size_t i = 0; i < m; ++i) cb.push_back(std::make_shared<const Bytes>(g2[i].str.begin(), g2[i].str.end()));
        std::lock_guard<std::mutex> g(mu);
        ram_insert(std::move(e), cb);
      }
      account(true, "");
      return out;
    } catch (const detail::RedisError& x) {
      account(false, x.what());
      return std::nullopt;
    }
  }

  // ---------------------------------------------------------------- storing
  // Codes one queued put and files it in both tiers. Worker thread (or the
  // caller's when not async); errors are logged, never thrown.
  void store(const Pending& q) {
    const auto t0 = Clock::now();
    try {
      KvCapture owned;
      const KvCapture* c = &q.cap;
      if (!q.blob.empty()) {
        owned = capture_from_state(q.blob, geom, "kvtc store: put_state");
        c = &owned;
      }
      require(c->blocks.size() == 1, "kvtc store: a single-block cache expected");
      const KvBlock& b = c->blocks[0];
      const size_t n = q.tokens.size();
      require(b.n_tokens() == n, "kvtc store: the cache holds " + std::to_string(b.n_tokens()) + " tokens, the prompt " + std::to_string(n));
      for (size_t t = 0; t < n; ++t)
        require(b.pos[t] == int32_t(t), "kvtc store: token " + std::to_string(t) + " sits at position " + std::to_string(b.pos[t]) +
                                            "; the store keeps prompts at positions 0..n-1");
      container::check_geometry(geom, cal, "kvtc store");

      Piece p;
      const uint32_t m = full_chunks(n);
      p.tokens = q.tokens;
      p.chunks = chunk_keys(p.tokens, m);
      p.key = entry_key(p.tokens, p.chunks);

      // Chunks stored already (RAM) are shared; the rest are coded here.
      std::vector<BytesPtr> chunk_bytes(m);
      std::vector<size_t> todo;
      {
        std::lock_guard<std::mutex> g(mu);
        for (uint32_t i = 0; i < m; ++i) {
          auto it = ram_chunks.find(p.chunks[i]);
          if (it != ram_chunks.end())
            chunk_bytes[i] = it->second.bytes;
          else
            todo.push_back(i);
        }
        st.chunks_shared += m - todo.size();
      }
      Bytes tail;
      const uint32_t tail_t0 = m * C;
      const uint32_t tail_sink = m == 0 ? opt.sink : 0;
      detail::parallel_for(todo.size() + 1, opt.threads, [&](size_t j) {
        {  // a restore in progress goes first
          std::unique_lock<std::mutex> lk(mu);
          cv_takes.wait(lk, [&] { return takers == 0; });
        }
        if (j == todo.size()) {
          tail = compress(slice(*c, tail_t0, uint32_t(n), q.tokens), cal, alloc, copt(tail_sink, opt.window));
          return;
        }
        const uint32_t i = uint32_t(todo[j]);
        chunk_bytes[i] = std::make_shared<const Bytes>(compress(slice(*c, i * C, (i + 1) * C, q.tokens), cal, alloc, copt(i == 0 ? opt.sink : 0, 0)));
      });
      if (!opt.disk_dir.empty() || rd_put) {  // the entry file: the same bytes on disk and in Redis
        const Bytes ef = entry_file(p, tail);
        disk_store(p, chunk_bytes, ef);
        redis_store(p, chunk_bytes, ef);
      }
      RamEntry e;
      static_cast<Piece&>(e) = p;
      e.tail = std::make_shared<const Bytes>(std::move(tail));
      e.bytes = e.tail->size() + 4 * e.tokens.size();
      std::lock_guard<std::mutex> g(mu);
      st.chunks_written += todo.size();
      ++st.puts;
      ram_insert(std::move(e), chunk_bytes);
      st.save_ms += ms_since(t0);
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu);
      ++st.puts_skipped;
      st.save_ms += ms_since(t0);
      log(std::string("kvtc store: put not stored: ") + x.what());
    }
  }

  void run() {
    if (opt.worker_nice > 0) (void)::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), opt.worker_nice);
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv_work.wait(lk, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping, and everything queued is stored
      busy = true;
      PendingPtr q = queue.front();
      lk.unlock();
      store(*q);
      lk.lock();
      queue.pop_front();
      st.pending_bytes -= q->bytes;
      busy = false;
      cv_idle.notify_all();
    }
  }

  // Under mu: is `tokens` wholly inside a stored or queued prompt?
  bool contained(std::span<const int32_t> tokens) const {
    for (const auto& e : ram)
      if (common_prefix(e.tokens, tokens) == tokens.size()) return true;
    for (const auto& q : queue)
      if (common_prefix(q->tokens, tokens) == tokens.size()) return true;
    for (const auto& e : disk)
      if (common_prefix(e.tokens, tokens) == tokens.size()) return true;
    return false;
  }

  void enqueue(std::shared_ptr<Pending> q) {
    {
      std::unique_lock<std::mutex> lk(mu);
      if (q->tokens.empty() || contained(q->tokens)) {
        ++st.puts_contained;
        return;
      }
      if (opt.async && st.pending_bytes + q->bytes > opt.max_pending_bytes) {
        ++st.puts_skipped;
        log("kvtc store: put skipped: " + std::to_string(st.pending_bytes) + " bytes already wait to be compressed (max_pending_bytes " +
            std::to_string(opt.max_pending_bytes) + ")");
        return;
      }
      if (!opt.async) {
        lk.unlock();
        store(*q);
        return;
      }
      st.pending_bytes += q->bytes;
      queue.push_back(std::move(q));
    }
    cv_work.notify_one();
  }

  // ---------------------------------------------------------------- taking
  // Decodes piece i of an entry (chunk i, or the tail when i is the number
  // of chunks); checks that it holds the tokens and positions its key
  // promises.
  KvCapture decode_piece(const Piece& p, std::span<const uint8_t> bytes, uint32_t i, const std::string& origin) const {
    const uint32_t m = uint32_t(p.chunks.size());
    const bool is_tail = i == m;
    const std::string where = origin + (is_tail ? " tail" : " chunk " + std::to_string(i));
    DecompressOptions dopt;
    dopt.threads = 1;
    dopt.precision = opt.precision;
    KvCapture c = decompress(bytes, cal, where, dopt);
    const uint32_t t0 = i * C, t1 = is_tail ? uint32_t(p.tokens.size()) : t0 + C;
    require(c.blocks.size() == 1 && c.blocks[0].n_tokens() == t1 - t0 && c.tokens.size() == t1 - t0,
            where + ": holds " + std::to_string(c.blocks.empty() ? 0 : c.blocks[0].n_tokens()) + " tokens, expected " + std::to_string(t1 - t0));
    for (uint32_t t = t0; t < t1; ++t)
      require(c.blocks[0].pos[t - t0] == int32_t(t) && c.tokens[t - t0] == p.tokens[t],
              where + ": token " + std::to_string(t) + " differs from its key's");
    return c;
  }
  // Decodes the pieces that hold the first n tokens of an entry.
  KvCapture decode(const Piece& p, const std::vector<BytesPtr>& chunk_bytes, const BytesPtr& tail, uint32_t n, const std::string& origin) const {
    const uint32_t m = uint32_t(p.chunks.size());
    const uint32_t pieces = std::min<uint32_t>((n + C - 1) / C, m + 1);
    std::vector<KvCapture> parts(pieces);
    detail::parallel_for(pieces, opt.restore_threads,
                         [&](size_t i) { parts[i] = decode_piece(p, i == m ? *tail : *chunk_bytes[i], uint32_t(i), origin); });
    return join(parts, n);
  }
};

PromptStore::PromptStore(const Calibration& cal, const CacheGeometry& g, const StoreOptions& opt) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  require(g.blocks.size() == 1, "kvtc store: the model keeps " + std::to_string(g.blocks.size()) +
                                    " cache blocks (sliding-window layers); the store takes single-block caches only");
  container::check_geometry(g, cal, "kvtc store");
  require(opt.chunk_tokens >= 16 && opt.chunk_tokens % 16 == 0 && opt.chunk_tokens <= 65536,
          "kvtc store: chunk_tokens must be a multiple of 16 in [16, 65536], got " + std::to_string(opt.chunk_tokens));
  require(opt.sink <= opt.chunk_tokens, "kvtc store: sink must not exceed chunk_tokens");
  require(opt.ratio >= 1 && opt.ratio <= 4096, "kvtc store: ratio must be in [1, 4096]");
  require(opt.deflate_level >= 0 && opt.deflate_level <= 12, "kvtc store: deflate_level must be 0..12");
  I.cal = cal;
  I.geom = g;
  I.opt = opt;
  I.C = opt.chunk_tokens;
  require(!(opt.raw && opt.entropy_coded), "kvtc store: raw and entropy_coded exclude each other");
  I.ratio_str = opt.raw ? "raw" : ratio_key(opt.ratio) + (opt.entropy_coded ? "-ecsq" : "");
  I.alloc = opt.entropy_coded ? ecsq_allocation_set(cal, opt.ratio) : allocation_set(cal, opt.ratio);
  I.container_version = container::container_version(I.alloc);
  const std::string fp = std::string(kStoreScheme) + "\nmodel_sha256=" + g.model_sha256 + "\ncalibration_id=" + cal.id +
                         "\ncontainer_version=" + std::to_string(I.container_version) + "\nchunk_tokens=" + std::to_string(I.C) +
                         "\nratio=" + I.ratio_str + "\nsink=" + std::to_string(opt.sink) + "\nwindow=" + std::to_string(opt.window) + "\n";
  I.salt = sha256_bytes(std::span(reinterpret_cast<const uint8_t*>(fp.data()), fp.size()));
  I.compat = I.salt.substr(0, 16);
  if (!opt.disk_dir.empty()) I.open_disk();
  if (!opt.redis_url.empty() || !opt.redis_cluster.empty()) I.open_redis();
  if (opt.async) I.worker = std::thread([this] { impl_->run(); });
}

PromptStore::~PromptStore() {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv_work.notify_all();
  if (impl_->worker.joinable()) impl_->worker.join();
  if (impl_->lock_fd >= 0) ::close(impl_->lock_fd);
}

const std::string& PromptStore::fingerprint() const {
  return impl_->salt;
}

bool PromptStore::wants(std::span<const int32_t> tokens) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return !tokens.empty() && !impl_->contained(tokens);
}

void PromptStore::put_state(std::vector<int32_t> tokens, std::vector<uint8_t> blob) {
  auto q = std::make_shared<Impl::Pending>();
  q->tokens = std::move(tokens);
  q->blob = std::move(blob);
  q->bytes = q->blob.size();
  impl_->enqueue(std::move(q));
}

void PromptStore::put(std::vector<int32_t> tokens, KvCapture cache) {
  auto q = std::make_shared<Impl::Pending>();
  q->tokens = std::move(tokens);
  q->cap = std::move(cache);
  q->bytes = q->cap.f16_bytes();
  impl_->enqueue(std::move(q));
}

std::optional<PromptStore::Match> PromptStore::take(std::span<const int32_t> current, std::span<const int32_t> tokens) {
  Impl& I = *impl_;
  const auto t0 = Clock::now();
  if (tokens.empty()) return std::nullopt;
  // llama-server's rules (server_prompt_cache::load): the slot's own prompt
  // sets the bar; a candidate must keep >= 25% of itself and beat the bar
  // on both the kept share and the similarity; the first (oldest) wins ties.
  const size_t lcp_cur = common_prefix(current, tokens);
  const float keep_bar = current.empty() ? -1.0f : float(lcp_cur) / float(current.size());
  const float sim_bar = float(lcp_cur) / float(tokens.size());
  float keep_best = keep_bar, sim_best = sim_bar;
  enum class From { kNone, kRam, kPending, kDisk } from = From::kNone;
  Impl::Piece best;
  size_t lcp_best = 0;
  std::vector<BytesPtr> chunk_bytes;
  BytesPtr tail;
  Impl::PendingPtr pend;
  {
    std::lock_guard<std::mutex> g(I.mu);
    auto consider = [&](std::span<const int32_t> cand, From f) {
      const size_t lcp = common_prefix(cand, tokens);
      const float keep = float(lcp) / float(cand.size()), sim = float(lcp) / float(tokens.size());
      if (keep < 0.25f || !(keep_best < keep && sim_best < sim)) return false;
      keep_best = keep;
      sim_best = sim;
      lcp_best = lcp;
      from = f;
      return true;
    };
    std::list<Impl::RamEntry>::iterator ram_it = I.ram.end();
    std::list<Impl::DiskEntry>::iterator disk_it = I.disk.end();
    // RAM first: the disk tier holds copies of the RAM entries, and a tie
    // goes to the first candidate.
    for (auto it = I.ram.begin(); it != I.ram.end(); ++it)
      if (consider(it->tokens, From::kRam)) ram_it = it;
    for (const auto& q : I.queue)
      if (consider(q->tokens, From::kPending)) pend = q;
    for (auto it = I.disk.begin(); it != I.disk.end(); ++it)
      if (consider(it->tokens, From::kDisk)) disk_it = it;
    if (from == From::kRam) {
      best = *ram_it;
      for (const std::string& k : ram_it->chunks) chunk_bytes.push_back(I.ram_chunks.at(k).bytes);
      tail = ram_it->tail;
      I.ram.splice(I.ram.end(), I.ram, ram_it);  // most recently used
    } else if (from == From::kDisk) {
      best = *disk_it;
      I.disk.splice(I.disk.end(), I.disk, disk_it);
    }
  }
  struct Taking {  // holds the worker between pieces while this take decodes
    Impl& I;
    explicit Taking(Impl& i) : I(i) {
      std::lock_guard<std::mutex> g(I.mu);
      ++I.takers;
    }
    ~Taking() {
      {
        std::lock_guard<std::mutex> g(I.mu);
        --I.takers;
      }
      I.cv_takes.notify_all();
    }
  };
  // The shared tier, when the local ones hold less than the whole prompt:
  // another replica may have stored more of this conversation.
  if (I.rd_take && lcp_best < tokens.size()) {
    Taking taking(I);
    if (auto m = I.redis_take(tokens, keep_bar, sim_bar, lcp_best)) {
      std::lock_guard<std::mutex> g(I.mu);
      ++I.st.hits_redis;
      I.st.tokens_restored += m->common_prefix;
      I.st.restore_ms += ms_since(t0);
      return m;
    }
  }
  if (from == From::kNone) {
    std::lock_guard<std::mutex> g(I.mu);
    ++I.st.misses;
    return std::nullopt;
  }
  // The match holds exactly the common prefix: llama-server keeps no more
  // of a restored prompt (it removes the cells past the common prefix).
  const uint32_t n = uint32_t(lcp_best);
  const char* tier = from == From::kRam ? "ram" : from == From::kPending ? "pending" : "disk";
  try {
    Taking taking(I);
    Match out;
    out.common_prefix = n;
    out.tier = tier;
    if (from == From::kPending) {
      KvCapture owned;
      const KvCapture* full = &pend->cap;
      if (!pend->blob.empty()) {
        owned = capture_from_state(pend->blob, I.geom, "kvtc store: pending put");
        full = &owned;
      }
      require(full->blocks.size() == 1 && full->blocks[0].n_tokens() >= n, "kvtc store: the pending put holds too few tokens");
      out.cache = slice(*full, 0, n, tokens);
    } else {
      if (from == From::kDisk) {
        const std::string ep = I.entry_path(best.key).string();
        const Bytes f = read_file(ep);
        auto tb = std::make_shared<Bytes>();
        (void)I.parse_entry(f, ep, tb.get());
        tail = std::move(tb);
        const uint32_t need = std::min<uint32_t>((n + I.C - 1) / I.C, uint32_t(best.chunks.size()));
        for (uint32_t i = 0; i < best.chunks.size(); ++i)
          chunk_bytes.push_back(i < need ? std::make_shared<const Bytes>(read_file(I.chunk_path(best.chunks[i]).string())) : nullptr);
      }
      out.cache = I.decode(best, chunk_bytes, tail, n, std::string("kvtc store: ") + tier + " entry " + best.key.substr(0, 16));
    }
    out.tokens = out.cache.tokens;
    std::lock_guard<std::mutex> g(I.mu);
    (from == From::kRam ? I.st.hits_ram : from == From::kPending ? I.st.hits_pending : I.st.hits_disk) += 1;
    I.st.tokens_restored += n;
    I.st.restore_ms += ms_since(t0);
    if (from == From::kDisk) {
      std::error_code ec;
      fs::last_write_time(I.entry_path(best.key), fs::file_time_type::clock::now(), ec);  // LRU order across restarts
      // Promote to RAM when every chunk was read (a short match reads fewer).
      bool all = true;
      for (const BytesPtr& b : chunk_bytes) all = all && b;
      if (all) {
        Impl::RamEntry e;
        static_cast<Impl::Piece&>(e) = best;
        e.tail = tail;
        e.bytes = tail->size() + 4 * e.tokens.size();
        I.ram_insert(std::move(e), chunk_bytes);
      }
    }
    return out;
  } catch (const std::exception& x) {
    // A damaged entry is a miss: dropped, logged, counted; the caller recomputes.
    std::lock_guard<std::mutex> g(I.mu);
    ++I.st.misses;
    ++I.st.corrupt_dropped;
    I.st.restore_ms += ms_since(t0);
    I.log(std::string("kvtc store: dropped a damaged entry (recomputing instead): ") + x.what());
    if (from == From::kRam) {
      for (auto it = I.ram.begin(); it != I.ram.end(); ++it)
        if (it->key == best.key) {
          I.ram_erase(it);
          break;
        }
    } else if (from == From::kDisk) {
      for (auto it = I.disk.begin(); it != I.disk.end(); ++it)
        if (it->key == best.key) {
          I.disk_erase(it);
          break;
        }
      // A damaged chunk file takes every entry that uses it along.
      for (size_t i = 0; i < chunk_bytes.size(); ++i) {
        if (!chunk_bytes[i]) continue;
        try {
          (void)inspect(*chunk_bytes[i], I.chunk_path(best.chunks[i]).string());
        } catch (const std::exception&) {
          for (auto it = I.disk.begin(); it != I.disk.end();)
            it = std::find(it->chunks.begin(), it->chunks.end(), best.chunks[i]) != it->chunks.end() ? I.disk_erase(it) : std::next(it);
          std::error_code ec;
          fs::remove(I.chunk_path(best.chunks[i]), ec);
        }
      }
    }
    return std::nullopt;
  }
}

void PromptStore::flush() {
  std::unique_lock<std::mutex> lk(impl_->mu);
  impl_->cv_idle.wait(lk, [&] { return impl_->queue.empty() && !impl_->busy; });
}

StoreStats PromptStore::stats() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  StoreStats s = impl_->st;
  s.entries = impl_->ram.size();
  s.chunks = impl_->ram_chunks.size();
  s.ram_bytes = impl_->ram_bytes;
  s.disk_entries = impl_->disk.size();
  s.disk_chunks = impl_->disk_chunks.size();
  s.disk_bytes = impl_->disk_bytes;
  s.disk_enabled = impl_->disk_on;
  s.disk_error = impl_->disk_error;
  s.pending = impl_->queue.size();
  s.redis_enabled = bool(impl_->rd_take);
  s.redis_up = impl_->rd_up;
  s.redis_error = impl_->rd_error;
  s.redis_where = impl_->rd_where;
  return s;
}

}  // namespace kvtc
