// The disk tier (docs/store.md "Disk"): write-through files under
// disk_dir/<compat>/ — chunks/<key>.kvtc and entries/<key>.kvse — that
// survive restarts. Every file is written to a temporary name and renamed,
// chunks before the entry that names them (data before index), so a crash
// leaves at worst chunk files no entry names, deleted at the next start.
// The index (entries in LRU order, chunk reference counts) is in memory,
// read back from the entry files at start; file I/O runs outside the lock.
// A write that fails disables the tier for the rest of the run.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <list>
#include <mutex>
#include <unordered_map>

#include "kvtc/error.h"
#include "kvtc/files.h"
#include "store/tier.h"

namespace kvtc::store {
namespace {

namespace fs = std::filesystem;

class DiskTier final : public Tier {
 public:
  explicit DiskTier(const TierContext& ctx) : ctx_(ctx) { open(); }
  ~DiskTier() override {
    if (lock_fd_ >= 0) ::close(lock_fd_);
  }

  const char* name() const override { return "disk"; }

  std::vector<Candidate> lookup(std::span<const int32_t> tokens) override {
    std::lock_guard<std::mutex> g(mu_);
    return candidates_in(lru_, tokens);
  }

  // Reads the entry file (the tail) and the chunk files the match needs.
  std::optional<Fetched> fetch(std::span<const int32_t>, const Candidate& c, uint32_t n) override {
    Fetched f;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = find(c.entry);
      if (it == lru_.end()) return std::nullopt;
      f.piece = *it;
      lru_.splice(lru_.end(), lru_, it);  // most recently used
    }
    const uint32_t C = ctx_.scheme->chunk_tokens(), m = uint32_t(f.piece.chunks.size());
    const std::string ep = entry_path(f.piece.key).string();
    try {
      // The entry file holds the tail; it is read even when the match ends
      // in the chunks, as its checks vouch for the index's chunk keys.
      auto tail = std::make_shared<Bytes>();
      (void)ctx_.scheme->parse_entry(read_file(ep), ep, tail.get());
      f.tail = std::move(tail);
    } catch (const std::exception& x) {
      if (!indexed(f.piece.key)) return std::nullopt;  // evicted while we read
      // Dropping the entry releases its chunk files too: nothing is left to restore.
      drop(f.piece.key, std::string("kvtc store: dropped a damaged entry (recomputing instead): ") + x.what());
      f.n = 0;
      return f;
    }
    const uint32_t need = std::min((n + C - 1) / C, m);
    for (uint32_t i = 0; i < need; ++i) {
      try {
        f.chunks.push_back(std::make_shared<const Bytes>(read_file(chunk_path(f.piece.chunks[i]).string())));
      } catch (const std::exception& x) {
        if (!indexed(f.piece.key)) return std::nullopt;  // evicted while we read
        (void)drop_damaged(f, i, x.what());              // unreadable: it and every entry naming it go
        n = i * C;
        break;
      }
    }
    f.n = n;
    f.whole = f.chunks.size() == m;  // and the tail: the whole entry, worth keeping in RAM
    std::error_code ec;
    fs::last_write_time(ep, fs::file_time_type::clock::now(), ec);  // LRU order across restarts
    return f;
  }

  bool drop_damaged(const Fetched& f, size_t i, const std::string& why) override {
    const bool is_tail = i == f.piece.chunks.size();
    std::lock_guard<std::mutex> g(mu_);
    bool dropped = false;
    for (auto it = lru_.begin(); it != lru_.end();) {
      const bool hit = is_tail ? it->key == f.piece.key : std::find(it->chunks.begin(), it->chunks.end(), f.piece.chunks[i]) != it->chunks.end();
      it = hit ? erase(it) : std::next(it);
      dropped = dropped || hit;
    }
    if (!is_tail) {
      std::error_code ec;
      fs::remove(chunk_path(f.piece.chunks[i]), ec);
    }
    if (dropped) {
      ++corrupt_;
      ctx_.log("kvtc store: dropped a damaged disk " + std::string(is_tail ? "entry" : "chunk") + " (recomputing instead): " + why);
    }
    return dropped;
  }

  bool holds(std::span<const int32_t> tokens) const override {
    std::lock_guard<std::mutex> g(mu_);
    return any_holds(lru_, tokens);
  }

  // Chunks not there yet, then the entry file; the oldest entries go first
  // when over budget.
  void put(const Coded& c) override {
    const Piece& p = c.piece;
    const Bytes ef_own = c.entry_file ? Bytes() : ctx_.scheme->entry_file(p, *c.tail);
    const Bytes& ef = c.entry_file ? *c.entry_file : ef_own;
    std::vector<size_t> fresh;
    const uint64_t budget = ctx_.opt.disk_bytes;
    auto missing = [&] {  // under mu_: the chunks this tier lacks, and the bytes the entry needs
      fresh.clear();
      uint64_t need = ef.size();
      for (size_t i = 0; i < p.chunks.size(); ++i)
        if (!chunks_.count(p.chunks[i])) {
          fresh.push_back(i);
          need += c.chunks[i]->size();
        }
      return need;
    };
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!on_) return;
      const uint64_t need = missing();
      if (budget && need > budget) {
        ctx_.log("kvtc store: a " + std::to_string(p.tokens.size()) + "-token prompt takes " + std::to_string(need) +
                 " bytes, more than the disk budget; not written");
        return;
      }
      // Room first: the oldest entries that the new one does not need.
      while (budget && bytes_ + need > budget && !lru_.empty()) erase(lru_.begin());
      // Chunks this entry shares with the ones just evicted are gone now.
      (void)missing();
      // Claim the chunks so that no eviction removes them while we write.
      for (const std::string& k : p.chunks) ++chunks_[k].refs;
    }
    std::string failed;
    for (size_t i : fresh) {
      try {
        write_file_atomic(chunk_path(p.chunks[i]).string(), *c.chunks[i]);
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
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i : fresh) {
      chunks_[p.chunks[i]].bytes = c.chunks[i]->size();
      bytes_ += c.chunks[i]->size();
    }
    if (!failed.empty()) {
      unref(p.chunks);  // removes the fresh chunk files again
      disable(failed);
      return;
    }
    // Entries the new one contains, and an older copy of it, go.
    for (auto it = lru_.begin(); it != lru_.end();) it = common_prefix(it->tokens, p.tokens) == it->tokens.size() ? erase(it) : std::next(it);
    Entry e;
    static_cast<Piece&>(e) = p;
    e.file_bytes = ef.size();
    bytes_ += e.file_bytes;
    lru_.push_back(std::move(e));
  }

  void add_stats(StoreStats& s) const override {
    std::lock_guard<std::mutex> g(mu_);
    s.disk_entries = lru_.size();
    s.disk_chunks = chunks_.size();
    s.disk_bytes = bytes_;
    s.disk_enabled = on_;
    s.disk_error = error_;
    s.corrupt_dropped += corrupt_;
    TierStats t;
    t.name = name();
    t.enabled = on_;
    t.error = error_;
    t.entries = lru_.size();
    t.chunks = chunks_.size();
    t.bytes = bytes_;
    t.corrupt_dropped = corrupt_;
    s.tiers.push_back(std::move(t));
  }

 private:
  struct Entry : Piece {
    uint64_t file_bytes = 0;
  };
  struct Chunk {
    uint32_t refs = 0;
    uint64_t bytes = 0;
  };

  fs::path chunk_path(const std::string& k) const { return root_ / "chunks" / (k + ".kvtc"); }
  fs::path entry_path(const std::string& k) const { return root_ / "entries" / (k + ".kvse"); }

  std::list<Entry>::iterator find(const std::string& key) {
    return std::find_if(lru_.begin(), lru_.end(), [&](const Entry& e) { return e.key == key; });
  }
  bool indexed(const std::string& key) {
    std::lock_guard<std::mutex> g(mu_);
    return find(key) != lru_.end();
  }
  void drop(const std::string& key, const std::string& why) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = find(key);
    if (it == lru_.end()) return;
    erase(it);
    ++corrupt_;
    ctx_.log(why);
  }

  void disable(const std::string& why) {  // under mu_
    if (!on_ && !error_.empty()) return;
    on_ = false;
    error_ = why;
    ctx_.log("kvtc store: disk tier disabled: " + why + " (serving from RAM only)");
  }

  void unref(const std::vector<std::string>& chunks) {  // under mu_
    for (const std::string& k : chunks) {
      auto it = chunks_.find(k);
      if (it == chunks_.end()) continue;
      if (--it->second.refs == 0) {
        bytes_ -= it->second.bytes;
        std::error_code ec;
        fs::remove(chunk_path(k), ec);
        chunks_.erase(it);
      }
    }
  }
  std::list<Entry>::iterator erase(std::list<Entry>::iterator it) {  // under mu_
    std::error_code ec;
    fs::remove(entry_path(it->key), ec);  // the index goes before the data it points to
    bytes_ -= it->file_bytes;
    unref(it->chunks);
    return lru_.erase(it);
  }

  // Opens disk_dir/<compat>, takes its lock, writes store.json (which tells
  // whether the directory is writable) and reads the entries back.
  void open() {
    root_ = fs::path(ctx_.opt.disk_dir) / ctx_.scheme->compat();
    try {
      std::error_code ec;
      fs::create_directories(root_ / "chunks", ec);
      if (!ec) fs::create_directories(root_ / "entries", ec);
      require(!ec, root_.string() + ": cannot create the store directory: " + ec.message());
      const std::string lock = (root_ / "lock").string();
      lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      require(lock_fd_ >= 0, lock + ": cannot open: " + std::strerror(errno));
      require(::flock(lock_fd_, LOCK_EX | LOCK_NB) == 0, lock + ": held by another process (one server per store directory)");
      const std::string js = ctx_.scheme->fingerprint_json(2) + "\n";
      write_file_atomic((root_ / "store.json").string(), std::span(reinterpret_cast<const uint8_t*>(js.data()), js.size()));
      on_ = true;
    } catch (const std::exception& x) {
      std::lock_guard<std::mutex> g(mu_);
      disable(x.what());
      return;
    }
    scan();
  }

  void scan() {
    std::lock_guard<std::mutex> g(mu_);
    struct Found {
      Entry e;
      fs::file_time_type t;
    };
    std::vector<Found> found;
    std::error_code ec;
    for (const auto& de : fs::directory_iterator(root_ / "entries", ec)) {
      const std::string path = de.path().string(), name = de.path().filename().string();
      if (name.rfind(".", 0) == 0) {  // a temporary file left by a crash
        fs::remove(de.path(), ec);
        continue;
      }
      try {
        const Bytes f = read_file(path);
        Entry e;
        static_cast<Piece&>(e) = ctx_.scheme->parse_entry(f, path, nullptr);
        require(name == e.key + ".kvse", path + ": the file name is not the entry's key");
        e.file_bytes = f.size();
        found.push_back({std::move(e), fs::last_write_time(de.path(), ec)});
      } catch (const std::exception& x) {
        ++corrupt_;
        ctx_.log("kvtc store: dropped " + path + ": " + x.what());
        fs::remove(de.path(), ec);
      }
    }
    std::unordered_map<std::string, uint64_t> sizes;
    for (const auto& de : fs::directory_iterator(root_ / "chunks", ec)) {
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
        ++corrupt_;
        ctx_.log("kvtc store: dropped " + entry_path(f.e.key).string() + ": a chunk file is missing");
        fs::remove(entry_path(f.e.key), ec);
        continue;
      }
      for (const std::string& k : f.e.chunks) {
        Chunk& c = chunks_[k];
        if (c.refs++ == 0) bytes_ += c.bytes = sizes[k];
      }
      bytes_ += f.e.file_bytes;
      lru_.push_back(std::move(f.e));
    }
    for (const auto& [k, b] : sizes)  // chunks no entry names (a crash between chunk and entry)
      if (!chunks_.count(k)) fs::remove(chunk_path(k), ec);
    const uint64_t budget = ctx_.opt.disk_bytes;
    while (budget && bytes_ > budget && !lru_.empty()) erase(lru_.begin());
  }

  TierContext ctx_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // least recently used first
  std::unordered_map<std::string, Chunk> chunks_;
  uint64_t bytes_ = 0;
  bool on_ = false;
  std::string error_;
  uint64_t corrupt_ = 0;
  fs::path root_;
  int lock_fd_ = -1;
};

}  // namespace

std::unique_ptr<Tier> make_disk_tier(const TierContext& ctx) {
  return std::make_unique<DiskTier>(ctx);
}

}  // namespace kvtc::store
