// Internal: the prompt store's queue of puts and the worker thread that
// codes them (docs/store.md "Queue"). put() copies the raw state here and
// returns; the worker hands each queued put to the store's coder, one at a
// time, at a lower priority (StoreOptions::worker_nice) and pausing between
// pieces while a take decodes, so restores and the caller's own work come
// first. The queue is also a tier ("pending"): a take may match a queued
// put and restore it from its raw state, exactly.
// Thread safety: every member may be called from any thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "store/tier.h"

namespace kvtc::store {

struct Pending {
  std::vector<int32_t> tokens;
  std::string root;  // its tenant's key chain (Scheme::tenant_root)
  Bytes blob;        // a state blob (put_state) ...
  KvCapture cap;     // ... or a capture (put)
  uint64_t bytes = 0;
  uint64_t seq = 0;  // set by push(): names it in a Candidate
};

class PutQueue final : public Tier {
 public:
  using Coder = std::function<void(const Pending&)>;
  // Starts the worker when opt.async; `code` files one put in the tiers.
  PutQueue(const TierContext& ctx, Coder code);
  ~PutQueue() override;  // stop() first

  // Queues a put (async), or codes it at once on the caller's thread. False
  // when it does not fit the budget (the put is skipped).
  bool push(std::shared_ptr<Pending> q);
  // Whether a put of `bytes` would be queued now (always when not async).
  bool fits(uint64_t bytes) const;
  uint64_t budget() const { return budget_; }
  // PromptStore::state_buffer: a kept buffer of a coded put with room for
  // `bytes` (the smallest such), else a new one; resized to `bytes`.
  Bytes buffer(size_t bytes, bool* kept = nullptr);
  // PromptStore::prepare_state_buffer: a new kept buffer for `bytes`,
  // written, unless one with room is kept already.
  void prepare(size_t bytes);
  void flush();  // until every queued put is coded
  void stop();   // codes what is queued, then ends the worker; idempotent

  // Held by a take while it restores: the worker waits between pieces.
  class Taking {
   public:
    explicit Taking(PutQueue& q);
    ~Taking();
    Taking(const Taking&) = delete;
    Taking& operator=(const Taking&) = delete;

   private:
    PutQueue& q_;
  };
  // The coder's pause point between pieces: returns once no take restores.
  void yield_to_takes();

  const char* name() const override { return "pending"; }
  std::vector<Candidate> lookup(std::span<const int32_t> tokens, const std::string& root) override;
  std::optional<Fetched> fetch(std::span<const int32_t> tokens, const std::string& root, const Candidate& c, uint32_t n) override;
  bool drop_damaged(const Fetched&, size_t, const std::string&) override { return false; }  // raw states have no pieces
  bool holds(std::span<const int32_t> tokens, const std::string& root) const override;
  void put(const Coded&) override {}  // filled by push(), not by the coder
  void add_stats(StoreStats& s) const override;

 private:
  void run();

  TierContext ctx_;
  Coder code_;
  uint64_t budget_;  // max_pending_bytes, or its default
  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_idle_, cv_takes_;
  std::deque<std::shared_ptr<Pending>> queue_;  // the front one is being coded while busy_
  uint64_t bytes_ = 0;
  uint64_t next_seq_ = 1;
  std::vector<Bytes> spare_;  // coded puts' state buffers (size == what they held), at most opt.spare_state_buffers
  uint64_t reused_ = 0, fresh_ = 0, prepared_ = 0;
  // Under mu_: b joins the kept buffers (largest capacities kept); returns
  // the one that no longer fits their number, to be freed outside the lock.
  Bytes keep(Bytes b);
  // Under mu_: the index in spare_ of the smallest kept buffer with room for
  // `bytes`, or spare_.size() when none has.
  size_t spare_for(size_t bytes) const;
  bool busy_ = false, stopping_ = false;
  int takers_ = 0;
  std::thread worker_;
};

}  // namespace kvtc::store
