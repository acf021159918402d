// The RAM tier (docs/store.md "Tiers"): entries (tokens, chunk keys, the
// tail) in least-recently-used order and chunks in a map with reference
// counts, so a chunk that twenty prompts share is held once. Its budget
// (StoreOptions::ram_bytes) counts unique chunks, tails and 4 bytes per
// token. Lookups compare tokens under the lock; pieces are shared_ptrs to
// const bytes, so a take decodes them after the lock is released.
#include <algorithm>
#include <list>
#include <mutex>
#include <unordered_map>

#include "store/tier.h"

namespace kvtc::store {
namespace {

class RamTier final : public Tier {
 public:
  explicit RamTier(const TierContext& ctx) : ctx_(ctx) {}

  const char* name() const override { return "ram"; }

  std::vector<Candidate> lookup(std::span<const int32_t> tokens, const std::string& root) override {
    std::lock_guard<std::mutex> g(mu_);
    return candidates_in(lru_, tokens, root);
  }

  std::optional<Fetched> fetch(std::span<const int32_t>, const std::string& root, const Candidate& c, uint32_t n) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = find(c.entry);
    if (it == lru_.end() || it->root != root) return std::nullopt;
    Fetched f;
    f.piece = *it;
    const uint32_t C = ctx_.scheme->chunk_tokens(), m = uint32_t(it->chunks.size());
    const uint32_t need = std::min((n + C - 1) / C, m);
    for (uint32_t i = 0; i < need; ++i) f.chunks.push_back(chunks_.at(it->chunks[i]).bytes);
    if (n > m * C) f.tail = it->tail;
    f.n = n;
    lru_.splice(lru_.end(), lru_, it);  // most recently used
    return f;
  }

  bool drop_damaged(const Fetched& f, size_t i, const std::string& why) override {
    std::lock_guard<std::mutex> g(mu_);
    bool dropped = false;
    for (auto it = lru_.begin(); it != lru_.end();) {
      const bool hit = i == f.piece.chunks.size() ? it->key == f.piece.key
                                                  : std::find(it->chunks.begin(), it->chunks.end(), f.piece.chunks[i]) != it->chunks.end();
      it = hit ? erase(it) : std::next(it);
      dropped = dropped || hit;
    }
    if (dropped) {
      ++corrupt_;
      ctx_.log("kvtc store: dropped a damaged entry (recomputing instead): " + why);
    }
    return dropped;
  }

  bool holds(std::span<const int32_t> tokens, const std::string& root) const override {
    std::lock_guard<std::mutex> g(mu_);
    return any_holds(lru_, *ctx_.codec, tokens, root);
  }

  BytesPtr chunk(const std::string& key) const override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = chunks_.find(key);
    return it == chunks_.end() ? nullptr : it->second.bytes;
  }

  // Inserts (most recently used), dropping entries of its tenant the new one
  // contains and the oldest ones (of any tenant: one budget) past the budget.
  void put(const Coded& c) override {
    Entry e;
    static_cast<Piece&>(e) = c.piece;
    e.tail = c.tail;
    e.bytes = c.tail->size() + 4 * e.tokens.size();
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = lru_.begin(); it != lru_.end();) it = it->root == e.root && ctx_.codec->serves(e.tokens, it->tokens) ? erase(it) : std::next(it);
    uint64_t cost = e.bytes;  // chunks it shares cost nothing
    for (size_t i = 0; i < e.chunks.size(); ++i)
      if (!chunks_.count(e.chunks[i])) cost += c.chunks[i]->size();
    const uint64_t budget = ctx_.opt.ram_bytes;
    if (budget && cost > budget) {
      ctx_.log("kvtc store: a " + std::to_string(e.tokens.size()) + "-token prompt takes " + std::to_string(cost) +
               " bytes, more than the RAM budget; not kept in RAM");
      return;
    }
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      Chunk& k = chunks_[e.chunks[i]];
      if (!k.bytes) {
        k.bytes = c.chunks[i];
        bytes_ += k.bytes->size();
      }
      ++k.refs;
    }
    bytes_ += e.bytes;
    lru_.push_back(std::move(e));
    // Evict the oldest others; the new entry stays (cost <= budget).
    while (budget && bytes_ > budget && lru_.size() > 1) erase(lru_.begin());
  }

  void add_stats(StoreStats& s) const override {
    std::lock_guard<std::mutex> g(mu_);
    s.entries = lru_.size();
    s.chunks = chunks_.size();
    s.ram_bytes = bytes_;
    TierStats t;
    t.name = name();
    t.entries = lru_.size();
    t.chunks = chunks_.size();
    t.bytes = bytes_;
    t.corrupt_dropped = corrupt_;
    s.corrupt_dropped += corrupt_;
    s.tiers.push_back(std::move(t));
  }

 private:
  struct Entry : Piece {
    BytesPtr tail;
    uint64_t bytes = 0;  // tail + 4 bytes per token
  };
  struct Chunk {
    BytesPtr bytes;
    uint32_t refs = 0;
  };

  std::list<Entry>::iterator find(const std::string& key) {
    return std::find_if(lru_.begin(), lru_.end(), [&](const Entry& e) { return e.key == key; });
  }
  std::list<Entry>::iterator erase(std::list<Entry>::iterator it) {  // under mu_
    for (const std::string& k : it->chunks) {
      auto c = chunks_.find(k);
      if (c == chunks_.end()) continue;
      if (--c->second.refs == 0) {
        bytes_ -= c->second.bytes->size();
        chunks_.erase(c);
      }
    }
    bytes_ -= it->bytes;
    return lru_.erase(it);
  }

  TierContext ctx_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // least recently used first
  std::unordered_map<std::string, Chunk> chunks_;
  uint64_t bytes_ = 0;
  uint64_t corrupt_ = 0;
};

}  // namespace

std::unique_ptr<Tier> make_ram_tier(const TierContext& ctx) {
  return std::make_unique<RamTier>(ctx);
}

}  // namespace kvtc::store
