// Internal: a tier of the prompt store (docs/store.md "Tiers"). The store
// (store.cpp) keeps llama-server's lookup rules and walks its tiers in
// order — RAM, the queue of puts, disk, then the remote ones (Redis) — and
// each tier only answers four questions: which of its stored prompts could
// serve a new prompt (lookup), the bytes of one of them (fetch), what to do
// with a piece that failed its checks (drop_damaged), and how to keep a
// newly coded prompt (put). Adding a tier is one file implementing this
// interface plus one line in PromptStore's constructor (docs/store.md
// "Adding a tier").
//
// Thread safety: every member may be called from any thread (the store's
// caller threads take, its worker puts); each tier has its own lock and
// does its I/O outside it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/timing.h"
#include "kvtc/store.h"
#include "store/keys.h"
#include "store/pieces.h"
#include "store/seal.h"

namespace kvtc::store {

// A stored prompt a tier could restore for a new prompt.
struct Candidate {
  size_t lcp = 0;      // leading tokens of the new prompt it restores
  float keep = 0;      // lcp / tokens of the stored prompt (1 for a run of chunks alone)
  std::string entry;   // the entry's key; empty: a run of chunks alone (a remote tier's)
  size_t level = 0;    // remote tiers: full chunks of the new prompt before the entry's own tokens
  double ms = 0;       // time the lookup spent in round trips (remote tiers)
  uint64_t bytes = 0;  // remote tiers: at most this many bytes to fetch (the fetch's deadline allows for them)
  size_t whole = 0;    // tokens of the stored prompt; 0 for a run of chunks alone
};

// The bytes a tier hands over for the first n tokens of a candidate:
// leading chunks and perhaps the tail, to be decoded by the store, or the
// cache itself, uncoded (the queue of puts).
struct Fetched {
  Piece piece;                           // the entry (tokens and chunk keys), or the new prompt's for chunks alone
  std::vector<BytesPtr> chunks;          // chunks [0, chunks.size()), all non-null
  BytesPtr tail;                         // the tail: always set when n reaches past the chunks
  uint32_t n = 0;                        // tokens the pieces hold of the match: the candidate's lcp, or fewer when a piece was gone
  std::shared_ptr<const KvCapture> raw;  // instead of pieces: the cache of piece.tokens, uncoded
  bool whole = false;                    // every piece of the entry came: worth keeping in the RAM tier
  double ms = 0;                         // remote tiers: time in round trips
  uint64_t bytes = 0;                    // remote tiers: bytes read
};

// A coded prompt, as the tiers keep it.
struct Coded {
  Piece piece;
  std::vector<BytesPtr> chunks;  // [piece.chunks.size()]
  BytesPtr tail;
  BytesPtr entry_file;  // the .kvse bytes (the same on disk and in Redis); null when only the RAM tier is given it
};

// What every tier has: its settings, how it logs.
struct TierContext {
  const Scheme* scheme = nullptr;
  const PieceCodec* codec = nullptr;
  // Seals what a tier keeps outside the process (disk, Redis) and opens it
  // again (store/seal.h); off without a secret. Never null.
  const Sealer* seal = nullptr;
  StoreOptions opt;  // without the secret (the sealer holds the keys derived from it)
  void log(const std::string& s) const {
    if (opt.log) opt.log(s);
  }
};

class Tier {
 public:
  virtual ~Tier() = default;
  virtual const char* name() const = 0;  // "ram", "pending", "disk", "redis": the tier of a Match and a hit
  // A remote tier costs round trips: the store asks it only when the tiers
  // before it hold less than the whole prompt.
  virtual bool remote() const { return false; }

  // Every stored prompt of the key chain from `root` (the lookup's tenant:
  // Scheme::tenant_root) sharing a prefix with `tokens` (lcp > 0), in the
  // tier's order (least recently used first for the LRU tiers: a tie goes
  // to the first). Another root's prompts are never candidates, and cost a
  // lookup no more than comparing their roots (docs/store.md "Tenants"). A
  // remote tier that fails returns none.
  virtual std::vector<Candidate> lookup(std::span<const int32_t> tokens, const std::string& root) = 0;
  // The pieces of candidate `c` (found for `root`) covering the first n <=
  // c.lcp tokens of `tokens`; nullopt when the entry went meanwhile
  // (evicted). A piece that is missing or an entry that fails its checks
  // shortens the match (and is dropped and counted by the tier).
  virtual std::optional<Fetched> fetch(std::span<const int32_t> tokens, const std::string& root, const Candidate& c, uint32_t n) = 0;
  // Piece i of `f` (chunk i, or the tail when i == chunks in the entry)
  // failed to decode or its checks: drop it and whatever names it, count it
  // (StoreStats::corrupt_dropped) and log `why`. False when it was gone
  // already (an earlier piece's drop took it along).
  virtual bool drop_damaged(const Fetched& f, size_t i, const std::string& why) = 0;

  // Whether it holds all of `tokens` on the chain from `root`: a put of them adds nothing (local tiers).
  virtual bool holds(std::span<const int32_t>, const std::string&) const { return false; }
  // The bytes of a chunk it holds in memory, shared by a put instead of
  // coding it again; null when it has none.
  virtual BytesPtr chunk(const std::string&) const { return nullptr; }
  // Keeps a coded prompt (the worker's thread); failures are logged and
  // counted by the tier, never thrown.
  virtual void put(const Coded& c) = 0;
  // Adds its figures: its named fields of StoreStats and one TierStats.
  virtual void add_stats(StoreStats& s) const = 0;
  // Returns once the tier's start-up work is done (the disk tier's scan of
  // its files, which runs in the background: the tier serves meanwhile).
  virtual void wait_ready() {}
};

// What the tiers that index their entries in memory (RAM, disk) answer for
// lookup and holds: `entries` is a list of Piece-derived entries in LRU
// order. Only entries of `root` are compared token by token; another
// tenant's cost one comparison of 64 hex digits each, whatever its tokens.
template <class Entries>
std::vector<Candidate> candidates_in(const Entries& entries, std::span<const int32_t> tokens, const std::string& root) {
  std::vector<Candidate> out;
  for (const Piece& e : entries) {
    if (e.root != root) continue;
    const size_t lcp = common_prefix(e.tokens, tokens);
    if (lcp) out.push_back({lcp, float(lcp) / float(e.tokens.size()), e.key, 0, 0, 0, e.tokens.size()});
  }
  return out;
}
template <class Entries>
bool any_holds(const Entries& entries, const PieceCodec& codec, std::span<const int32_t> tokens, const std::string& root) {
  for (const Piece& e : entries)
    if (e.root == root && codec.serves(e.tokens, tokens)) return true;
  return false;
}

std::unique_ptr<Tier> make_ram_tier(const TierContext& ctx);
std::unique_ptr<Tier> make_disk_tier(const TierContext& ctx);   // opens opt.disk_dir; its files are verified in the background
std::unique_ptr<Tier> make_redis_tier(const TierContext& ctx);  // Error on a malformed URL; a Redis that is down is not an error

}  // namespace kvtc::store
