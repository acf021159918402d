// A calibration learned from the prompts served (kvtc/store.h
// CalibrationLearner; docs/server.md "A calibration learned from the prompts
// served"): kvtc-server's --kvtc-calib auto and the Python KvtcCache("auto").
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/capture_io.h"  // require_rope_supported
#include "kvtc/error.h"
#include "kvtc/store.h"

namespace kvtc {

namespace {

using Clock = std::chrono::steady_clock;

double thread_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) / 1e6;
}

void say(const LearnerOptions& o, bool warning, const std::string& s) {
  if (o.log) o.log(warning, "kvtc: calibration learned from the prompts served: " + s);
}

std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

// The fleet's calibration (nullopt: none yet, Redis failed, or not this model's).
std::optional<Calibration> fetch_fleet(const CacheGeometry& g, const LearnerOptions& o) {
  std::optional<Calibration> c = fetch_shared_calibration(o.fleet, g.model_sha256);
  if (c && !calibration_fits(*c, g)) {
    say(o, true, "the calibration in Redis is not this model's; not used");
    c.reset();
  }
  return c;
}

// Offers `c` to the fleet (SET NX: the first replica's wins). Returns the
// fleet's calibration when another replica's won, else nullopt; `published`:
// `c` is the fleet's now (false also when Redis failed).
std::optional<Calibration> offer_to_fleet(const CacheGeometry& g, const LearnerOptions& o, const Calibration& c, bool* published = nullptr) {
  std::optional<Calibration> w = publish_shared_calibration(o.fleet, g.model_sha256, c);
  if (published) *published = w && w->id == c.id;
  if (w && w->id != c.id && calibration_fits(*w, g)) return w;
  return std::nullopt;
}

// Writes `c` to `file` (atomically) unless it holds it already.
void keep_locally(const std::string& file, const Calibration& c) {
  if (file.empty()) return;
  try {
    if (std::filesystem::exists(file) && calibration_load(file, /*decoder_only=*/true).id == c.id) return;
  } catch (const std::exception&) {
    // damaged: replaced below
  }
  std::filesystem::create_directories(std::filesystem::path(file).parent_path());
  calibration_save(file, c);  // a temporary file, then rename
}

template <typename V>
void wipe(V& v) {
  if (!v.empty()) explicit_bzero(v.data(), v.size());
  v.clear();
}

}  // namespace

void LearnerOptions::wipe_secrets() {
  wipe(fleet.secret);
  wipe(fleet.redis_password);
}

std::string learned_calibration_file(const std::string& disk_dir, const std::string& model_sha256) {
  require(model_sha256.size() >= 16, "learned_calibration_file: a model SHA-256 is expected, got '" + model_sha256 + "'");
  return (std::filesystem::path(disk_dir) / ("calibration-auto-" + model_sha256.substr(0, 16) + ".safetensors")).string();
}

bool learner_shares(const StoreOptions& o) {
  return (!o.redis_url.empty() || !o.redis_cluster.empty()) && !o.secret.empty();
}

bool calibration_fits(const Calibration& c, const CacheGeometry& g) {
  return c.geometry.model_sha256 == g.model_sha256 && c.blocks.size() == g.blocks.size() && !c.blocks.empty() &&
         c.blocks[0][0].p == g.blocks[0].features();
}

std::optional<Calibration> find_learned_calibration(const CacheGeometry& g, const LearnerOptions& o, std::string* from) {
  const bool share = learner_shares(o.fleet);
  std::optional<Calibration> cal;
  std::string where = o.file;
  if (!share && (!o.fleet.redis_url.empty() || !o.fleet.redis_cluster.empty()))
    say(o, true,
        "without a secret (--kvtc-secret-file, secret_file) the calibration is not shared through Redis (a value anybody who can write "
        "there could set would choose every replica's); each replica learns its own, and they share no prompts");
  if (share && (cal = fetch_fleet(g, o))) {
    where = "Redis (the fleet's)";
    keep_locally(o.file, *cal);
  }
  if (!cal && !o.file.empty() && std::filesystem::exists(o.file)) {
    try {
      cal = calibration_load(o.file);
      if (!calibration_fits(*cal, g)) throw Error(o.file + ": fitted for another model or cache geometry");
    } catch (const std::exception& e) {
      say(o, true, std::string("not using the learned calibration: ") + e.what() + "; learning a new one (it will replace the file)");
      cal.reset();
    }
  }
  if (cal && share && where == o.file) {
    // Learned here before; the fleet has none yet: it is offered (the
    // first replica's wins, this one takes that one if it lost).
    if (std::optional<Calibration> w = offer_to_fleet(g, o, *cal)) {
      cal = std::move(w);
      where = "Redis (the fleet's)";
      keep_locally(o.file, *cal);
    }
  }
  if (from) *from = cal ? where : "";
  return cal;
}

struct CalibrationLearner::Impl {
  CacheGeometry geom;
  LearnerOptions opt;
  mutable std::mutex mu;  // everything below
  std::condition_variable cv;
  bool stop = false, has_job = false, reserved = false;
  std::vector<uint8_t> blob, spare;  // the job's state; the buffer kept for the next copy
  std::vector<int32_t> tokens;
  LearnerStatus st;
  double row_ms = 0;  // learning's decayed CPU cost per row
  std::shared_ptr<const Calibration> cal;
  std::thread th;

  void fail(const std::string& why) {
    say(opt, true, "learning stopped (" + why + "); prompts stay raw");
    std::lock_guard<std::mutex> g(mu);
    st.state = "failed";
    st.error = why;
  }
  void run();
};

void CalibrationLearner::Impl::run() {
  (void)::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), 19);  // below inference and the store's worker (10)
  std::unique_ptr<OnlineCalibrator> oc;
  try {
    require(geom.blocks.size() == 1, "sliding-window (iSWA) models are not learned from yet: their cache has two blocks");
    OnlineCalibrationOptions o;
    o.fit_tokens = opt.tokens;
    o.fit.ratios = {8, 16, 32, 64};
    // Components past the rows learned carry no variance: fewer tokens than
    // features (a small token target) fit through the Gram matrix (1,404
    // tokens of SmolLM2: seconds, where the full eigensolver of the 5,760 x
    // 5,760 covariance took 51 s at nice 19).
    o.fit.rank_max = uint32_t(std::min<uint64_t>(geom.blocks[0].features(), o.fit_tokens - 1));
    // The store codes at opt.ratio: its table too, unless it is one of these.
    if (std::find(o.fit.ratios.begin(), o.fit.ratios.end(), opt.ratio) == o.fit.ratios.end()) o.fit.ratios.push_back(opt.ratio);
    oc = std::make_unique<OnlineCalibrator>(geom, o);
    std::lock_guard<std::mutex> g(mu);
    st.fit_target = oc->fit_target();
    st.held_target = oc->heldout_target();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  const bool share = learner_shares(opt.fleet);
  std::optional<Calibration> fleet;  // another replica's, published while this one learned
  auto next_poll = Clock::now() + std::chrono::seconds(10);
  for (;;) {
    std::vector<uint8_t> state;
    std::vector<int32_t> toks;
    uint32_t stride = 1;
    {
      std::unique_lock<std::mutex> lk(mu);
      if (share)
        cv.wait_until(lk, next_poll, [&] { return stop || has_job; });
      else
        cv.wait(lk, [&] { return stop || has_job; });
      if (stop) return;
      if (!has_job) {  // time to look in Redis: a replica that finished first published its calibration there
        lk.unlock();
        next_poll = Clock::now() + std::chrono::seconds(10);
        if ((fleet = fetch_fleet(geom, opt))) break;
        continue;
      }
      state = std::move(blob);
      toks = std::move(tokens);
      stride = st.stride;
    }
    const double c0 = thread_cpu_ms();
    uint64_t rows = 0;
    std::string refused;
    try {
      std::span<const uint8_t> s(state);
      ContextState cs;
      if (is_context_state(s)) {  // llama-cpp-python's LlamaState: the context's whole state
        cs = context_state_split(s, "a prompt's state");
        s = cs.seq_blob;
      }
      rows = oc->add(capture_from_state(s, geom, "a prompt's state"), toks, stride);
    } catch (const std::exception& e) {
      refused = e.what();  // a shifted slot's cache, say: not a prompt's
    }
    const double ms = thread_cpu_ms() - c0;
    const double prefill = opt.prefill_ms_per_token ? opt.prefill_ms_per_token() : 0;
    const bool enough = oc->enough();
    {
      std::lock_guard<std::mutex> g(mu);
      spare = std::move(state);  // its pages stay mapped for the next copy
      has_job = false;
      ++st.samples;
      if (!refused.empty()) ++st.refused;
      st.cpu_ms += ms;
      st.seen = oc->seen_tokens();
      st.fresh = oc->new_tokens();
      st.fit = oc->fit_tokens();
      st.held = oc->heldout_tokens();
      // Every stride-th new token is learned so that learning costs at most
      // opt.share of the prefill of the tokens it learns from: learning a
      // row costs ~2 p^2 flops for K and V (SmolLM2, p = 5,760: ~0.7 ms on
      // one EPYC core) where prefill costs ~3 ms per token on 2.
      if (rows > 0) row_ms = row_ms > 0 ? 0.75 * row_ms + 0.25 * ms / double(rows) : ms / double(rows);
      if (row_ms > 0 && prefill > 0) st.stride = uint32_t(std::clamp(std::ceil(row_ms / (opt.share * prefill)), 1.0, 4096.0));
      if (enough) st.state = "fitting";
    }
    if (!refused.empty()) say(opt, true, "a sample not learned from: " + refused);
    if (enough) break;
  }
  try {
    Calibration c;
    double fit_s = 0;
    std::string how;
    if (fleet) {
      c = std::move(*fleet);
      oc.reset();
      how = "adopted from Redis (another replica's)";
    } else {
      say(opt, false,
          std::to_string(oc->fit_tokens()) + " tokens learned (" + std::to_string(oc->heldout_tokens()) + " held out); fitting in the background");
      const auto t0 = Clock::now();
      c = oc->finish();
      oc.reset();  // the covariances' memory
      fit_s = std::chrono::duration<double>(Clock::now() - t0).count();
      how = fmt("fitted in %.1f s", fit_s);
      if (share) {
        // SET NX: the first replica's is the fleet's; a later one takes it
        // instead of its own, so every replica keys the same store.
        bool published = false;
        if (std::optional<Calibration> w = offer_to_fleet(geom, opt, c, &published)) {
          how += ", then " + w->id.substr(0, 16) + " taken instead (published first by another replica)";
          c = std::move(*w);
        } else if (published) {
          how += ", published to Redis for the other replicas";
        }
      }
    }
    {
      std::lock_guard<std::mutex> g(mu);
      opt.wipe_secrets();  // published: no copy of the secret stays here
    }
    keep_locally(opt.file, c);
    auto shared = std::make_shared<const Calibration>(std::move(c));
    const std::string name = opt.file.empty() ? "the calibration learned (kept in memory only)" : opt.file;
    if (opt.on_ready) opt.on_ready(*shared, name);
    say(opt, false,
        "calibration " + shared->id.substr(0, 16) + " " + how + (opt.file.empty() ? " (no disk tier: not written)" : ", written to " + opt.file));
    std::lock_guard<std::mutex> g(mu);
    st.fit_s = fit_s;
    st.file = opt.file;
    st.calib_id = shared->id;
    cal = std::move(shared);
    st.state = "ready";
  } catch (const std::exception& e) {
    fail(std::string("the fit failed: ") + e.what());
  }
}

CalibrationLearner::CalibrationLearner(const CacheGeometry& g, LearnerOptions o) : impl_(std::make_unique<Impl>()) {
  require(!g.blocks.empty() && !g.model_sha256.empty(), "CalibrationLearner: a model's geometry (blocks, model_sha256) is expected");
  require(o.tokens >= 64, "CalibrationLearner: tokens " + std::to_string(o.tokens) + ": at least 64 (one run) are expected");
  require(o.share > 0 && std::isfinite(o.share), "CalibrationLearner: share " + fmt("%g", o.share) + ": a positive number is expected");
  // Said once, here: else every sample would be refused for it and the
  // learner would learn forever.
  for (size_t b = 0; b < g.blocks.size(); ++b) require_rope_supported(g.blocks[b].rope, "CalibrationLearner: block " + std::to_string(b));
  impl_->geom = g;
  impl_->opt = std::move(o);
  impl_->st.state = "learning";
  impl_->th = std::thread([p = impl_.get()] { p->run(); });
}

CalibrationLearner::~CalibrationLearner() {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->th.joinable()) impl_->th.join();  // a fit under way finishes first (CalibrationFitter::finish has no cancel)
  impl_->opt.wipe_secrets();
}

std::optional<std::vector<uint8_t>> CalibrationLearner::begin(size_t n_tokens) {
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->st.state != "learning" || n_tokens < 64) return std::nullopt;  // less than one run: nothing to learn
  if (impl_->has_job || impl_->reserved) {
    ++impl_->st.busy;  // the previous one is still being learned from
    return std::nullopt;
  }
  impl_->reserved = true;
  return std::move(impl_->spare);
}

void CalibrationLearner::submit(std::vector<uint8_t>&& state, std::vector<int32_t>&& tokens, double copy_ms) {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->reserved = false;
    impl_->st.loop_ms += copy_ms;
    impl_->st.loop_max_ms = std::max(impl_->st.loop_max_ms, copy_ms);
    if (state.empty() || impl_->st.state != "learning") {
      impl_->spare = std::move(state);
      return;
    }
    impl_->blob = std::move(state);
    impl_->tokens = std::move(tokens);
    impl_->has_job = true;
  }
  impl_->cv.notify_one();
}

std::shared_ptr<const Calibration> CalibrationLearner::calibration() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->cal;
}

void CalibrationLearner::mark_live(uint64_t moved) {
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->st.state == "ready") impl_->st.state = "live";
  impl_->st.moved = moved;
}

LearnerStatus CalibrationLearner::status() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->st;
}

}  // namespace kvtc
