// Internal: the codec's thread pool (OpenMP) and stage clocks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kvtc/codec.h"

namespace kvtc::detail {

// 0 -> all hardware threads; never more than n_jobs.
int resolve_threads(int requested, size_t n_jobs);

// Runs f(i) for i in [0, n) on `threads` threads. The exception of the
// lowest i whose f threw is rethrown once all have stopped (as a serial
// loop would; later indices are skipped once one has failed). While more than one
// thread runs, OpenBLAS is held to one thread per call: two cores running
// two chunk GEMMs beat one GEMM split two ways plus idle quantization, and
// nested pools would oversubscribe.
void parallel_for(size_t n, int threads, const std::function<void(size_t)>& f);

// Buffers that parallel_for's jobs reuse instead of allocating per job:
// take() a free one (a new T when none is), give() it back when the job
// ends. At most as many are made as jobs run at once; they are freed with
// the pool. Why: a job's buffers are MBs (an 8K SmolLM2 decode: 64 jobs of
// ~8 MB each), and zero-filling them again per job cost ~40 of ~1,000
// thread-ms there. Thread-safe.
template <class T>
class ScratchPool {
 public:
  std::unique_ptr<T> take() {
    std::lock_guard<std::mutex> g(mu_);
    if (free_.empty()) return std::make_unique<T>();
    std::unique_ptr<T> t = std::move(free_.back());
    free_.pop_back();
    return t;
  }
  void give(std::unique_ptr<T> t) {
    std::lock_guard<std::mutex> g(mu_);
    free_.push_back(std::move(t));
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<T>> free_;
};

enum Stage { kGather, kCenter, kProject, kQuant, kEntropy, kNumStages };

// Nanoseconds per stage, added from any thread.
struct StageClock {
  std::atomic<int64_t> ns[kNumStages] = {};
  void add(Stage s, std::chrono::steady_clock::time_point t0) {
    ns[s] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
  // Writes the stage times and the thread count into *out (no-op for null).
  void export_to(CodecStats* out, int threads) const;
};

// Times one scope into a stage (no-op without a clock).
class StageTimer {
 public:
  StageTimer(StageClock* c, Stage s) : c_(c), s_(s), t0_(std::chrono::steady_clock::now()) {}
  ~StageTimer() {
    if (c_) c_->add(s_, t0_);
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  StageClock* c_;
  Stage s_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace kvtc::detail
