#include "store/queue.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "kvtc/error.h"

namespace kvtc::store {

PutQueue::PutQueue(const TierContext& ctx, Coder code)
    : ctx_(ctx),
      code_(std::move(code)),
      // The default follows the RAM budget (what the operator gave prompts),
      // and is at least the old fixed 1 GiB.
      budget_(ctx.opt.max_pending_bytes ? ctx.opt.max_pending_bytes : std::max<uint64_t>(1ull << 30, ctx.opt.ram_bytes)) {
  if (ctx_.opt.async) worker_ = std::thread([this] { run(); });
}

PutQueue::~PutQueue() {
  stop();
}

void PutQueue::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  cv_work_.notify_all();
  if (worker_.joinable()) worker_.join();
}

bool PutQueue::push(std::shared_ptr<Pending> q) {
  if (!ctx_.opt.async) {
    code_(*q);
    return true;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (bytes_ + q->bytes > budget_) {
      ctx_.log("kvtc store: put skipped: " + std::to_string(q->bytes) + " raw bytes, and " + std::to_string(bytes_) +
               " already wait to be compressed (max_pending_bytes " + std::to_string(budget_) + ")");
      return false;
    }
    q->seq = next_seq_++;
    bytes_ += q->bytes;
    queue_.push_back(std::move(q));
  }
  cv_work_.notify_one();
  return true;
}

bool PutQueue::fits(uint64_t bytes) const {
  if (!ctx_.opt.async) return true;
  std::lock_guard<std::mutex> g(mu_);
  return bytes_ + bytes <= budget_;
}

namespace {

// A buffer grown (or shrunk) to `bytes`. A new one reserves half as much
// again (address space only; a page costs only once written), so that the
// next turn of a conversation, a few hundred tokens longer, still fits it;
// a kept one shrinks without writing, or writes (faults) only what it grows by.
void fit(Bytes& b, size_t bytes) {
  if (b.capacity() < bytes) b.reserve(bytes + bytes / 2);
  b.resize(bytes);
}

}  // namespace

size_t PutQueue::spare_for(size_t bytes) const {
  // spare_ is sorted by capacity, largest first: the last one with room is
  // the smallest that fits.
  for (size_t i = spare_.size(); i-- > 0;)
    if (spare_[i].capacity() >= bytes) return i;
  return spare_.size();
}

Bytes PutQueue::buffer(size_t bytes, bool* was_kept) {
  Bytes b;
  {
    std::lock_guard<std::mutex> g(mu_);
    const size_t i = spare_for(bytes);
    const bool kept = i < spare_.size();
    if (kept) {
      b = std::move(spare_[i]);
      spare_.erase(spare_.begin() + std::ptrdiff_t(i));
    }
    ++(kept ? reused_ : fresh_);
    if (was_kept) *was_kept = kept;
  }
  fit(b, bytes);  // outside the lock
  return b;
}

Bytes PutQueue::keep(Bytes b) {
  spare_.push_back(std::move(b));
  std::sort(spare_.begin(), spare_.end(), [](const Bytes& x, const Bytes& y) { return x.capacity() > y.capacity(); });
  Bytes dropped;
  if (spare_.size() > size_t(std::max(0, ctx_.opt.spare_state_buffers))) {
    dropped = std::move(spare_.back());
    spare_.pop_back();
  }
  return dropped;
}

void PutQueue::prepare(size_t bytes) {
  if (!ctx_.opt.async || ctx_.opt.spare_state_buffers <= 0 || bytes == 0) return;
  Bytes b;
  {
    std::lock_guard<std::mutex> g(mu_);
    // The one buffer() would hand out: ready when written that far already;
    // else it grows here, outside the lock.
    const size_t i = spare_for(bytes);
    if (i < spare_.size()) {
      if (spare_[i].size() >= bytes) return;
      b = std::move(spare_[i]);
      spare_.erase(spare_.begin() + std::ptrdiff_t(i));
    }
  }
  fit(b, bytes);  // written: its pages are mapped now, on the caller's thread
  Bytes dropped;  // freed after the lock
  {
    std::lock_guard<std::mutex> g(mu_);
    ++prepared_;
    dropped = keep(std::move(b));
  }
}

void PutQueue::flush() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_idle_.wait(lk, [&] { return queue_.empty() && !busy_; });
}

void PutQueue::run() {
  if (ctx_.opt.worker_nice > 0) (void)::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), ctx_.opt.worker_nice);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_work_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued is coded
    busy_ = true;
    std::shared_ptr<Pending> q = queue_.front();
    lk.unlock();
    code_(*q);
    lk.lock();
    queue_.pop_front();
    bytes_ -= q->bytes;
    busy_ = false;
    // Its buffer is kept for the next save (unless a take's fetch still
    // reads it): the largest ones, at most spare_state_buffers.
    Bytes dropped;  // freed (unmapped: milliseconds for tens of MiB) after the lock
    if (q.use_count() == 1 && !q->blob.empty() && ctx_.opt.spare_state_buffers > 0) dropped = keep(std::move(q->blob));
    cv_idle_.notify_all();
    if (!dropped.empty()) {
      lk.unlock();
      dropped = Bytes();
      lk.lock();
    }
  }
}

PutQueue::Taking::Taking(PutQueue& q) : q_(q) {
  std::lock_guard<std::mutex> g(q_.mu_);
  ++q_.takers_;
}

PutQueue::Taking::~Taking() {
  {
    std::lock_guard<std::mutex> g(q_.mu_);
    --q_.takers_;
  }
  q_.cv_takes_.notify_all();
}

void PutQueue::yield_to_takes() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_takes_.wait(lk, [&] { return takers_ == 0; });
}

std::vector<Candidate> PutQueue::lookup(std::span<const int32_t> tokens, const std::string& root) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Candidate> out;
  for (const auto& q : queue_) {
    if (q->root != root) continue;  // another tenant's
    const size_t lcp = common_prefix(q->tokens, tokens);
    if (lcp) out.push_back({lcp, float(lcp) / float(q->tokens.size()), std::to_string(q->seq), 0, 0, 0, q->tokens.size()});
  }
  return out;
}

std::optional<Fetched> PutQueue::fetch(std::span<const int32_t>, const std::string& root, const Candidate& c, uint32_t n) {
  std::shared_ptr<const Pending> q;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& p : queue_)
      if (std::to_string(p->seq) == c.entry && p->root == root) q = p;
  }
  if (!q) return std::nullopt;  // coded meanwhile: in the other tiers now
  Fetched f;
  f.piece.tokens = q->tokens;
  f.piece.root = q->root;
  f.n = n;
  // The raw state, exact; a blob is parsed here, outside the lock.
  f.raw = q->blob.empty() ? std::shared_ptr<const KvCapture>(q, &q->cap)
                          : std::make_shared<const KvCapture>(capture_from_state(q->blob, ctx_.codec->geometry(), "kvtc store: pending put"));
  require(f.raw->blocks.size() == ctx_.codec->geometry().blocks.size() && f.raw->blocks[0].n_tokens() >= n,
          "kvtc store: the pending put holds too few tokens or blocks");
  return f;
}

bool PutQueue::holds(std::span<const int32_t> tokens, const std::string& root) const {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& q : queue_)
    if (q->root == root && ctx_.codec->serves(q->tokens, tokens)) return true;
  return false;
}

void PutQueue::add_stats(StoreStats& s) const {
  std::lock_guard<std::mutex> g(mu_);
  s.pending = queue_.size();
  s.pending_bytes = bytes_;
  s.pending_budget = ctx_.opt.async ? budget_ : 0;
  s.spare_buffers = spare_.size();
  for (const Bytes& b : spare_) s.spare_bytes += b.size();  // what was written (mapped); the rest is address space
  s.buffers_reused = reused_;
  s.buffers_new = fresh_;
  s.buffers_prepared = prepared_;
  TierStats t;
  t.name = name();
  t.entries = queue_.size();
  t.bytes = bytes_;
  s.tiers.push_back(std::move(t));
}

}  // namespace kvtc::store
