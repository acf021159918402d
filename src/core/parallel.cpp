#include "core/parallel.h"

#include <omp.h>

#include <exception>
#include <mutex>
#include <thread>

extern "C" {
// OpenBLAS's thread control; weak so that another BLAS still links.
void openblas_set_num_threads(int) __attribute__((weak));
int openblas_get_num_threads(void) __attribute__((weak));
}

namespace kvtc::detail {

namespace {

// OpenBLAS's thread count is one per process. Regions that overlap (a
// server's compression worker beside a restore) hold it to 1 together: the
// first in saves it, the last out gives it back. Saving and restoring it per
// region left it at 1 for good when a region read the 1 another had set
// (Parallel.ConcurrentRegionsGiveOpenBlasItsThreadsBack: 2 runs in 3).
// BLAS calls outside a region that overlap one (a calibration's fit on
// another thread) still run on one thread meanwhile.
std::mutex g_blas_mu;
int g_blas_holders = 0;
int g_blas_saved = 0;

struct BlasHeldToOne {
  BlasHeldToOne() {
    if (!openblas_set_num_threads) return;
    std::lock_guard<std::mutex> g(g_blas_mu);
    if (g_blas_holders++ == 0) {
      g_blas_saved = openblas_get_num_threads ? openblas_get_num_threads() : 0;
      openblas_set_num_threads(1);
    }
  }
  ~BlasHeldToOne() {
    if (!openblas_set_num_threads) return;
    std::lock_guard<std::mutex> g(g_blas_mu);
    if (--g_blas_holders == 0 && g_blas_saved > 0) openblas_set_num_threads(g_blas_saved);
  }
};

}  // namespace

int resolve_threads(int requested, size_t n_jobs) {
  int t = requested > 0 ? requested : int(std::max(1u, std::thread::hardware_concurrency()));
  if (n_jobs < size_t(t)) t = int(std::max<size_t>(1, n_jobs));
  return t;
}

void parallel_for(size_t n, int threads, const std::function<void(size_t)>& f) {
  if (threads <= 1 || n <= 1) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  // The exception of the lowest failing i, as the serial loop would throw:
  // indices past it are skipped, those before it still run (one may fail
  // first), so which error a caller sees does not depend on the timing.
  std::exception_ptr err;
  size_t err_i = n;
  {
    const BlasHeldToOne held;
    std::mutex mu;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (size_t i = 0; i < n; ++i) {
      {
        std::lock_guard<std::mutex> lk(mu);
        if (i > err_i) continue;
      }
      try {
        f(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (i < err_i) {
          err_i = i;
          err = std::current_exception();
        }
      }
    }
  }
  if (err) std::rethrow_exception(err);
}

void StageClock::export_to(CodecStats* out, int threads) const {
  if (!out) return;
  out->gather_ms = double(ns[kGather]) / 1e6;
  out->center_ms = double(ns[kCenter]) / 1e6;
  out->project_ms = double(ns[kProject]) / 1e6;
  out->quant_ms = double(ns[kQuant]) / 1e6;
  out->entropy_ms = double(ns[kEntropy]) / 1e6;
  out->threads = threads;
}

}  // namespace kvtc::detail
