// The disk tier (docs/store.md "Disk"): write-through files under
// disk_dir/<compat>/ — chunks/<key>.kvtc and entries/<key>.kvse — that
// survive restarts. Every file is written to a temporary name and renamed,
// chunks before the entry that names them (data before index), each
// directory fsynced after its renames, so a crash leaves at worst chunk
// files no entry names, deleted by the next start's scan. The index
// (entries in LRU order, chunk reference counts) is in memory; file I/O runs
// outside the lock.
//
// What deletes a file: only its bytes — a checksum, format or key check
// that fails (here, or when the store decodes a piece: drop_damaged). What
// keeps it: the system refusing the I/O (EACCES, EMFILE, EIO, ENOMEM ...):
// counted, logged once per kind, a miss this time. A file the index names
// that is gone (removed from outside) is forgotten: an entry with its
// chunks, or a chunk alone, marked missing — the entries naming it restore
// the chunks before it until the next put through that chunk rewrites it.
// A write that fails disables the tier for the rest of the run.
//
// With a secret (store/seal.h) every file is sealed for its kind and key
// (the key its name gives): one that does not open — written without the
// secret, with another, or moved from another name — is foreign, deleted
// like a damaged one (foreign_dropped) and never decoded.
//
// Start-up: the constructor takes the directory's lock and lists the entry
// files; a background thread verifies them (checksum, salt, keys), newest
// first, and indexes each as it is verified, so the store serves at once
// and older entries become hits as the scan reaches them.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <list>
#include <mutex>
#include <new>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/util.h"
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
    stop_scan_ = true;  // the scan ends after the file it is reading
    if (scanner_.joinable()) scanner_.join();
    if (lock_fd_ >= 0) ::close(lock_fd_);
  }

  const char* name() const override { return "disk"; }

  std::vector<Candidate> lookup(std::span<const int32_t> tokens, const std::string& root) override {
    std::lock_guard<std::mutex> g(mu_);
    if (!missing_now_) return candidates_in(lru_, tokens, root);
    // Some chunk files are known gone: an entry naming one restores only
    // the chunks before it, and is a candidate for that much.
    std::vector<Candidate> out;
    for (const Entry& e : lru_) {
      if (e.root != root) continue;
      const size_t lcp = std::min(common_prefix(e.tokens, tokens), usable(e));
      if (lcp) out.push_back({lcp, float(lcp) / float(e.tokens.size()), e.key, 0, 0, 0, e.tokens.size()});
    }
    return out;
  }

  // Reads the entry file (the tail) and the chunk files the match needs.
  std::optional<Fetched> fetch(std::span<const int32_t>, const std::string& root, const Candidate& c, uint32_t n) override {
    Fetched f;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = find(c.entry);
      if (it == lru_.end() || it->root != root) return std::nullopt;
      f.piece = *it;
      n = uint32_t(std::min<size_t>(n, usable(*it)));  // a chunk marked missing since the lookup
      lru_.splice(lru_.end(), lru_, it);               // most recently used
    }
    if (n == 0) return f;  // a miss for this candidate
    const uint32_t C = ctx_.scheme->chunk_tokens(), m = uint32_t(f.piece.chunks.size());
    const std::string ep = entry_path(f.piece.key).string();
    try {
      // The entry file holds the tail; it is read even when the match ends
      // in the chunks, as its checks vouch for the index's chunk keys.
      auto tail = std::make_shared<Bytes>();
      const Piece got = ctx_.scheme->parse_entry(ctx_.seal->opened(kSealEntry, f.piece.key, read_file(ep), ep), ep, tail.get());
      require(got.key == f.piece.key && got.root == f.piece.root, ep + ": not the entry (key, tenant root) its name and the index say");
      f.tail = std::move(tail);
    } catch (const ForeignValue& x) {
      if (!indexed(f.piece.key)) return std::nullopt;
      drop(f.piece.key, std::string("kvtc store: dropped a foreign disk entry (recomputing instead): ") + x.what(), /*foreign=*/true);
      return f;
    } catch (const IoError& x) {
      if (!indexed(f.piece.key)) return std::nullopt;  // evicted while we read
      if (x.code() == ENOENT)
        forget_entry(f.piece.key, x.what());
      else
        io_error(x.code(), x.what());
      return f;  // n = 0: a miss; the entry stays unless its file is gone
    } catch (const Error& x) {
      if (!indexed(f.piece.key)) return std::nullopt;
      // Dropping the entry releases its chunk files too: nothing is left to restore.
      drop(f.piece.key, std::string("kvtc store: dropped a damaged entry (recomputing instead): ") + x.what());
      return f;
    } catch (const std::exception& x) {  // bad_alloc and the like: not the file's fault
      if (!indexed(f.piece.key)) return std::nullopt;
      io_error(kNoErrno, ep + ": " + x.what());
      return f;
    }
    const uint32_t need = std::min((n + C - 1) / C, m);
    for (uint32_t i = 0; i < need; ++i) {
      const std::string cp = chunk_path(f.piece.chunks[i]).string();
      std::string failed;
      int code = kNoErrno;
      try {
        f.chunks.push_back(std::make_shared<const Bytes>(ctx_.seal->opened(kSealChunk, f.piece.chunks[i], read_file(cp), cp)));
        continue;
      } catch (const ForeignValue& x) {
        // Like a damaged chunk: the file goes, and every entry naming it.
        if (!indexed(f.piece.key)) return std::nullopt;
        (void)drop_piece(f.piece, i, x.what(), /*foreign=*/true);
        n = i * C;
        break;
      } catch (const IoError& x) {
        failed = x.what();
        code = x.code();
      } catch (const std::exception& x) {
        failed = cp + ": " + x.what();
      }
      if (!indexed(f.piece.key)) return std::nullopt;  // evicted while we read (its chunks went with it)
      if (code == ENOENT)
        forget_chunk(f.piece.chunks[i], failed);
      else
        io_error(code, failed);
      n = i * C;  // the chunks before it
      break;
    }
    f.n = n;
    f.whole = f.chunks.size() == m;  // and the tail: the whole entry, worth keeping in RAM
    std::error_code ec;
    if (n) fs::last_write_time(ep, fs::file_time_type::clock::now(), ec);  // LRU order across restarts
    return f;
  }

  bool drop_damaged(const Fetched& f, size_t i, const std::string& why) override { return drop_piece(f.piece, i, why, /*foreign=*/false); }

  // An entry lacking a chunk the tokens need does not hold them: a put of
  // them must go ahead, to rewrite that chunk.
  bool holds(std::span<const int32_t> tokens, const std::string& root) const override {
    std::lock_guard<std::mutex> g(mu_);
    if (!missing_now_) return any_holds(lru_, *ctx_.codec, tokens, root);
    for (const Entry& e : lru_)
      if (e.root == root && ctx_.codec->serves(e.tokens, tokens) && usable(e) >= tokens.size()) return true;
    return false;
  }

  // Chunks not there yet (or marked missing), then the entry file; the
  // oldest entries go first when over budget.
  void put(const Coded& c) override {
    const Piece& p = c.piece;
    const Bytes ef_own = c.entry_file ? Bytes() : ctx_.scheme->entry_file(p, *c.tail);
    const Bytes& ef_plain = c.entry_file ? *c.entry_file : ef_own;
    const Sealer& seal = *ctx_.seal;
    const Bytes ef_sealed = seal.on() ? seal.seal(kSealEntry, p.key, ef_plain) : Bytes();
    const Bytes& ef = seal.on() ? ef_sealed : ef_plain;
    const uint64_t ovh = seal.overhead();  // a chunk file's bytes: its container's and the seal's
    std::vector<size_t> fresh;
    const uint64_t budget = ctx_.opt.disk_bytes;
    auto missing = [&] {  // under mu_: the chunks to write, and the bytes the entry needs
      fresh.clear();
      uint64_t need = ef.size();
      for (size_t i = 0; i < p.chunks.size(); ++i) {
        auto it = chunks_.find(p.chunks[i]);
        if (it == chunks_.end() || it->second.missing) {
          fresh.push_back(i);
          need += c.chunks[i]->size() + ovh;
        }
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
      // The files the scan has not verified yet are older than every entry
      // indexed (it goes newest first): when room is needed they go first,
      // deleted unread as the scan reaches them.
      if (budget && bytes_ + need > budget && scan_pending_) scan_full_ = true;
      // Room first: the oldest entries that the new one does not need.
      while (budget && bytes_ + need > budget && !lru_.empty()) erase(lru_.begin());
      // Chunks this entry shares with the ones just evicted are gone now.
      (void)missing();
      // Claim the chunks so that no eviction removes them while we write,
      // and the entry's name so that the scan leaves its file alone.
      for (const std::string& k : p.chunks) ++chunks_[k].refs;
      writing_.insert(p.key);
    }
    std::string failed;
    size_t written = 0;
    try {
      for (size_t i : fresh) {
        const std::string cp = chunk_path(p.chunks[i]).string();
        if (seal.on())
          write_file_atomic(cp, seal.seal(kSealChunk, p.chunks[i], *c.chunks[i]), /*sync_dir=*/false);
        else
          write_file_atomic(cp, *c.chunks[i], /*sync_dir=*/false);
        ++written;
      }
      // One fsync of chunks/ for them all, before the entry that names them.
      if (!fresh.empty()) sync_directory((root_ / "chunks").string(), chunk_path(p.chunks[fresh.back()]).string());
      write_file_atomic(entry_path(p.key).string(), ef, /*sync_dir=*/true);
    } catch (const std::exception& x) {
      failed = x.what();
    }
    std::lock_guard<std::mutex> g(mu_);
    writing_.erase(p.key);
    for (size_t j = 0; j < fresh.size(); ++j) {
      Chunk& ch = chunks_[p.chunks[fresh[j]]];
      if (j < written) {
        if (ch.missing) {  // rewritten: the entries naming it are whole again
          ch.missing = false;
          --missing_now_;
        }
        if (!ch.bytes) bytes_ += ch.bytes = c.chunks[fresh[j]]->size() + ovh;
      } else if (!ch.missing) {  // never written: for whoever else names it (the scan), it is missing
        ch.missing = true;
        ++missing_now_;
      }
    }
    if (!failed.empty()) {
      unref(p.chunks);  // removes the fresh chunk files again
      disable(failed);
      return;
    }
    // Entries of its tenant the new one contains, and an older copy of it
    // (whose file the new one just replaced: kept), go.
    for (auto it = lru_.begin(); it != lru_.end();)
      it = it->root == p.root && ctx_.codec->serves(p.tokens, it->tokens) ? erase(it, it->key != p.key) : std::next(it);
    Entry e;
    static_cast<Piece&>(e) = p;
    e.file_bytes = ef.size();
    e.put_here = true;
    bytes_ += e.file_bytes;
    lru_.push_back(std::move(e));
  }

  void wait_ready() override {
    std::unique_lock<std::mutex> lk(mu_);
    scan_cv_.wait(lk, [&] { return scan_done_; });
  }

  void add_stats(StoreStats& s) const override {
    std::lock_guard<std::mutex> g(mu_);
    s.disk_entries = lru_.size();
    s.disk_chunks = chunks_.size() - missing_now_;
    s.disk_bytes = bytes_;
    s.disk_enabled = on_;
    s.disk_error = error_;
    s.disk_io_errors = io_errors_;
    s.disk_missing = missing_total_;
    s.disk_scan_pending = scan_pending_;
    s.disk_scan_ms = scan_done_ ? scan_ms_ : ms_since(scan_t0_);
    s.corrupt_dropped += corrupt_;
    s.foreign_dropped += foreign_;
    TierStats t;
    t.name = name();
    t.enabled = on_;
    t.error = error_;
    t.entries = lru_.size();
    t.chunks = s.disk_chunks;
    t.bytes = bytes_;
    t.corrupt_dropped = corrupt_;
    t.foreign_dropped = foreign_;
    t.io_errors = io_errors_;
    t.missing = missing_total_;
    t.scan_pending = scan_pending_;
    s.tiers.push_back(std::move(t));
  }

 private:
  static constexpr int kNoErrno = -1;  // an I/O failure without an errno (bad_alloc): its own kind

  struct Entry : Piece {
    uint64_t file_bytes = 0;
    bool put_here = false;  // put by this process (the scan drops older entries it contains)
  };
  struct Chunk {
    uint32_t refs = 0;
    uint64_t bytes = 0;    // counted in bytes_; 0 while missing
    bool missing = false;  // its file is gone: the next put naming it rewrites it
  };

  fs::path chunk_path(const std::string& k) const { return root_ / "chunks" / (k + ".kvtc"); }
  fs::path entry_path(const std::string& k) const { return root_ / "entries" / (k + ".kvse"); }

  std::list<Entry>::iterator find(const std::string& key) {  // under mu_
    return std::find_if(lru_.begin(), lru_.end(), [&](const Entry& e) { return e.key == key; });
  }
  bool indexed(const std::string& key) {
    std::lock_guard<std::mutex> g(mu_);
    return find(key) != lru_.end();
  }
  // Leading tokens of e it can restore: all of them, or the chunks before
  // the first one marked missing. Under mu_.
  size_t usable(const Entry& e) const {
    if (!missing_now_) return e.tokens.size();
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      auto it = chunks_.find(e.chunks[i]);
      if (it != chunks_.end() && it->second.missing) return i * ctx_.scheme->chunk_tokens();
    }
    return e.tokens.size();
  }

  void drop(const std::string& key, const std::string& why, bool foreign = false) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = find(key);
    if (it == lru_.end()) return;
    erase(it);
    ++(foreign ? foreign_ : corrupt_);
    ctx_.log(why);
  }
  // Piece i of entry `e` (chunk i, or the tail when i is its number of
  // chunks) failed its checks (damaged) or did not open (foreign): the
  // entries naming it go, and a chunk's file.
  bool drop_piece(const Piece& e, size_t i, const std::string& why, bool foreign) {
    const bool is_tail = i == e.chunks.size();
    std::lock_guard<std::mutex> g(mu_);
    bool dropped = false;
    for (auto it = lru_.begin(); it != lru_.end();) {
      const bool hit = is_tail ? it->key == e.key : std::find(it->chunks.begin(), it->chunks.end(), e.chunks[i]) != it->chunks.end();
      it = hit ? erase(it) : std::next(it);
      dropped = dropped || hit;
    }
    if (!is_tail) {
      std::error_code ec;
      fs::remove(chunk_path(e.chunks[i]), ec);
    }
    if (dropped) {
      ++(foreign ? foreign_ : corrupt_);
      ctx_.log("kvtc store: dropped a " + std::string(foreign ? "foreign" : "damaged") + " disk " + (is_tail ? "entry" : "chunk") +
               " (recomputing instead): " + why);
    }
    return dropped;
  }

  // An I/O failure (not the bytes' fault): counted, and logged the first
  // time for each errno, so that a failing disk does not flood the log.
  void io_error(int code, const std::string& what) {
    std::lock_guard<std::mutex> g(mu_);
    io_error_locked(code, what);
  }
  void io_error_locked(int code, const std::string& what) {
    ++io_errors_;
    if (io_logged_.insert(code).second)
      ctx_.log("kvtc store: a disk read failed; the file is kept, a miss this time (" + what +
               "; further failures of this kind are only counted: disk_io_errors)");
  }
  // A file the index names was gone (removed from outside).
  void note_missing(const std::string& what) {  // under mu_
    ++missing_total_;
    if (io_logged_.insert(ENOENT).second)
      ctx_.log("kvtc store: a disk file the index names is gone (" + what +
               "); its entries restore what comes before it until a put rewrites it (further ones are only counted: disk_missing)");
  }
  // The entry file is gone: its chunks are reachable through nothing else.
  void forget_entry(const std::string& key, const std::string& what) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = find(key);
    if (it == lru_.end()) return;
    erase(it);
    note_missing(what);
  }
  // The chunk file is gone: the entries naming it keep everything else;
  // the next put through that chunk writes it again (put(): missing()).
  void forget_chunk(const std::string& key, const std::string& what) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = chunks_.find(key);
    if (it == chunks_.end() || it->second.missing) return;
    bytes_ -= it->second.bytes;
    it->second.bytes = 0;
    it->second.missing = true;
    ++missing_now_;
    note_missing(what);
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
        if (it->second.missing) --missing_now_;
        bytes_ -= it->second.bytes;
        std::error_code ec;
        fs::remove(chunk_path(k), ec);
        chunks_.erase(it);
      }
    }
  }
  // Drops an entry from the index and its file (unless a put just wrote a
  // new copy under the same name), and releases its chunks.
  std::list<Entry>::iterator erase(std::list<Entry>::iterator it, bool remove_file = true) {  // under mu_
    std::error_code ec;
    if (remove_file) fs::remove(entry_path(it->key), ec);  // the index goes before the data it points to
    bytes_ -= it->file_bytes;
    unref(it->chunks);
    return lru_.erase(it);
  }

  // Opens disk_dir/<compat>, takes its lock, writes store.json (which tells
  // whether the directory is writable), lists the entry files and starts
  // the scan that reads them back.
  void open() {
    scan_t0_ = std::chrono::steady_clock::now();
    started_ = fs::file_time_type::clock::now();
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
      scan_done_ = true;
      return;
    }
    listed_ = list_entries();
    {
      std::lock_guard<std::mutex> g(mu_);
      scan_pending_ = listed_.size();
    }
    try {
      scanner_ = std::thread([this] { scan(); });
    } catch (const std::system_error& x) {  // no thread to be had (EAGAIN): scan here, as before
      ctx_.log(std::string("kvtc store: disk tier: no thread for the background scan (") + x.what() + "); scanning before serving");
      scan();
    }
  }

  struct Listed {
    fs::path path;
    fs::file_time_type t;
  };
  // The entry files, newest first; temporaries left by a crash are removed
  // (no put runs yet). A directory that cannot be listed keeps every chunk.
  std::vector<Listed> list_entries() {
    std::vector<Listed> out;
    std::error_code ec;
    fs::directory_iterator it(root_ / "entries", ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      std::error_code e2;
      if (name.rfind(".", 0) == 0) {
        fs::remove(it->path(), e2);
        continue;
      }
      const fs::file_time_type t = it->last_write_time(e2);
      out.push_back({it->path(), e2 ? fs::file_time_type::min() : t});
    }
    if (ec) {
      std::lock_guard<std::mutex> g(mu_);
      scan_unreadable_ = true;
      io_error_locked(ec.value(), (root_ / "entries").string() + ": cannot list: " + ec.message());
    }
    std::sort(out.begin(), out.end(), [](const Listed& a, const Listed& b) { return a.t > b.t; });
    return out;
  }

  // The start-up scan (its own thread, at the worker's priority): every
  // listed entry file, newest first, verified and indexed one at a time.
  void scan() {
    const std::vector<Listed>& files = listed_;
    if (ctx_.opt.worker_nice > 0) (void)::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), ctx_.opt.worker_nice);
    uint64_t read = 0, damaged = 0, foreign = 0, unreadable = 0, over = 0;
    for (const Listed& l : files) {
      if (stop_scan_) break;
      const std::string path = l.path.string(), name = l.path.filename().string();
      const std::string key = name.size() > 5 ? name.substr(0, name.size() - 5) : name;
      enum { kOk, kDamaged, kForeign, kUnreadable, kGone, kUnread } got = kOk;
      {
        std::lock_guard<std::mutex> g(mu_);
        if (scan_full_) got = kUnread;
      }
      Entry e;
      std::string why;
      int code = kNoErrno;
      if (got == kOk) {
        try {
          Bytes f = read_file(path);
          e.file_bytes = f.size();
          // Sealed for the key its name gives: a sealed entry renamed does not open.
          ctx_.seal->open(kSealEntry, key, f, path);
          static_cast<Piece&>(e) = ctx_.scheme->parse_entry(f, path, nullptr);
          require(name == e.key + ".kvse", path + ": the file name is not the entry's key");
        } catch (const ForeignValue& x) {
          got = kForeign;
          why = x.what();
        } catch (const IoError& x) {
          got = x.code() == ENOENT ? kGone : kUnreadable;
          why = x.what();
          code = x.code();
        } catch (const Error& x) {
          got = kDamaged;
          why = x.what();
        } catch (const std::exception& x) {  // bad_alloc and the like: not the file's fault
          got = kUnreadable;
          why = path + ": " + x.what();
        }
      }
      std::lock_guard<std::mutex> g(mu_);
      --scan_pending_;
      // A put of this very prompt during the scan wrote a newer copy of the
      // file (or is writing it): that one stays, and is indexed already.
      const bool put_again = writing_.count(key) || find(key) != lru_.end();
      std::error_code ec;
      switch (got) {
        case kGone: continue;  // removed meanwhile: nothing to do
        case kUnreadable:
          ++unreadable;
          scan_unreadable_ = true;  // its chunks must not be swept as orphans
          io_error_locked(code, why);
          continue;
        case kDamaged:
          if (put_again) continue;
          ++damaged;
          ++corrupt_;
          ctx_.log("kvtc store: dropped " + path + ": " + why);
          fs::remove(l.path, ec);
          continue;
        case kForeign:  // as a damaged file: deleted, never decoded
          if (put_again) continue;
          ++foreign;
          ++foreign_;
          ctx_.log("kvtc store: dropped " + why);
          fs::remove(l.path, ec);
          continue;
        case kOk:
          if (put_again) continue;
          if (contained_in_a_put(e)) {  // what the put of the newer prompt would have dropped
            fs::remove(l.path, ec);
            continue;
          }
          if (admit(std::move(e))) {
            ++read;
            continue;
          }
          scan_full_ = true;
          [[fallthrough]];
        case kUnread:  // older than every indexed entry and past the budget: it would be evicted first
          if (put_again) continue;
          ++over;
          fs::remove(l.path, ec);
          continue;
      }
    }
    const bool found = !files.empty();
    std::vector<Listed>().swap(listed_);  // its paths: ~100 bytes per entry file
    bool sweep = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      sweep = !stop_scan_ && !scan_unreadable_;
    }
    if (sweep) sweep_chunks();
    std::lock_guard<std::mutex> g(mu_);
    if (!stop_scan_) {
      const uint64_t budget = ctx_.opt.disk_bytes;  // puts during the scan may have gone past it
      while (budget && bytes_ > budget && !lru_.empty()) erase(lru_.begin());
      scan_ms_ = ms_since(scan_t0_);
      if (found)
        ctx_.log("kvtc store: disk tier: " + std::to_string(read) + " prompts read back in " + std::to_string(int64_t(scan_ms_)) + " ms (" +
                 std::to_string(damaged) + " damaged and dropped, " + (foreign ? std::to_string(foreign) + " foreign and dropped, " : "") +
                 std::to_string(unreadable) + " unreadable and kept, " + std::to_string(over) + " past the budget and dropped)");
    }
    scan_pending_ = 0;
    scan_done_ = true;
    scan_cv_.notify_all();
  }

  bool contained_in_a_put(const Entry& e) const {  // under mu_
    for (const Entry& x : lru_)
      if (x.put_here && x.root == e.root && ctx_.codec->serves(x.tokens, e.tokens)) return true;
    return false;
  }

  // Indexes a verified entry as the least recently used (the scan goes
  // newest first; a chunk file missing is marked so); false when it does
  // not fit the budget. Under mu_: a chunk is looked up on disk only when
  // no entry holds it yet, and no eviction runs meanwhile.
  bool admit(Entry e) {
    std::vector<std::pair<const std::string*, int64_t>> sizes;  // chunks not indexed: their file size, -1 when missing
    uint64_t need = e.file_bytes;
    for (const std::string& k : e.chunks) {
      if (chunks_.count(k)) continue;
      std::error_code ec;
      const uintmax_t b = fs::file_size(chunk_path(k), ec);
      sizes.push_back({&k, ec ? -1 : int64_t(b)});
      if (!ec) need += b;
    }
    const uint64_t budget = ctx_.opt.disk_bytes;
    if (budget && bytes_ + need > budget) return false;
    for (const auto& [k, b] : sizes) {  // chunk keys are chained: distinct within an entry
      Chunk& c = chunks_[*k];
      if (b < 0) {
        c.missing = true;
        ++missing_now_;
        note_missing(entry_path(e.key).string() + ": chunk " + chunk_path(*k).string());
      } else {
        bytes_ += c.bytes = uint64_t(b);
      }
    }
    for (const std::string& k : e.chunks) ++chunks_[k].refs;
    bytes_ += e.file_bytes;
    lru_.push_front(std::move(e));
    return true;
  }

  // Chunk files no entry names (a crash between a chunk and its entry, or
  // entries dropped by the scan) go, and temporaries older than this start
  // (a put's own are newer). The directory is listed outside the lock (a
  // large tier holds 100,000s of chunks); each name is checked and removed
  // under it, in batches, so that no put claims a chunk between the check
  // and the removal, and takes wait for one batch at most.
  void sweep_chunks() {
    std::vector<std::string> keys;
    std::error_code ec;
    fs::directory_iterator it(root_ / "chunks", ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      std::error_code e2;
      if (name.size() == 64 + 5 && name.substr(64) == ".kvtc")
        keys.push_back(name.substr(0, 64));
      else if (name.rfind(".", 0) == 0 && it->last_write_time(e2) < started_ && !e2)
        fs::remove(it->path(), e2);
    }
    constexpr size_t kBatch = 256;
    for (size_t at = 0; at < keys.size() && !stop_scan_; at += kBatch) {
      std::lock_guard<std::mutex> g(mu_);
      for (size_t i = at; i < std::min(keys.size(), at + kBatch); ++i)
        if (!chunks_.count(keys[i])) fs::remove(chunk_path(keys[i]), ec);
    }
  }

  TierContext ctx_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // least recently used first
  std::unordered_map<std::string, Chunk> chunks_;
  std::unordered_set<std::string> writing_;  // entry keys a put is writing now
  uint64_t bytes_ = 0;
  bool on_ = false;
  std::string error_;
  uint64_t corrupt_ = 0, foreign_ = 0, io_errors_ = 0;
  uint64_t missing_total_ = 0;  // files the index named found gone
  uint64_t missing_now_ = 0;    // chunks marked missing now
  std::set<int> io_logged_;     // errno values logged once
  // The start-up scan.
  std::condition_variable scan_cv_;
  uint64_t scan_pending_ = 0;     // listed entry files not handled yet
  bool scan_done_ = false;        // it ended (or there was none)
  bool scan_full_ = false;        // the budget is full: the files left are the oldest and go unread
  bool scan_unreadable_ = false;  // an entry file could not be read: its chunks are not orphans
  double scan_ms_ = 0;
  std::chrono::steady_clock::time_point scan_t0_;
  std::vector<Listed> listed_;  // the entry files found at start: the scan's own after it starts
  fs::file_time_type started_;
  std::atomic<bool> stop_scan_{false};
  std::thread scanner_;
  fs::path root_;
  int lock_fd_ = -1;
};

}  // namespace

std::unique_ptr<Tier> make_disk_tier(const TierContext& ctx) {
  return std::make_unique<DiskTier>(ctx);
}

}  // namespace kvtc::store
