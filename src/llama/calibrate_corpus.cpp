// calibrate_from_corpus (kvtc/llama.h): the route of `kvtc calibrate` —
// real caches of the calibration split, prefilled by llama.cpp, streamed
// into a CalibrationFitter.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "kvtc/calibration.h"
#include "kvtc/corpus.h"
#include "kvtc/error.h"
#include "kvtc/files.h"
#include "kvtc/llama.h"

namespace kvtc {

Calibration calibrate_from_corpus(const CorpusCalibrateOptions& opt, const ProgressFn& progress) {
  auto model = Model::load(opt.model_path);
  const ModelInfo& mi = model->info();
  const Corpus corpus = Corpus::load(opt.corpus_dir);
  std::vector<CorpusDoc> docs = corpus.docs("calib", opt.kinds);
  require(!docs.empty(), corpus.manifest_path() + ": no calibration documents" + (opt.kinds.empty() ? std::string() : " of the kinds asked for"));
  // Interleave kinds and sources: order by a hash of the id (stable).
  order_by_id_hash(docs);
  SessionOptions so;
  so.n_ctx = opt.max_doc_tokens ? std::min(opt.max_doc_tokens, mi.n_ctx_train) : mi.n_ctx_train;
  so.n_threads = opt.threads;
  so.rope = opt.rope;
  Session s(*model, so);
  CalibrationFitter fitter(s.geometry(), opt.fit);  // the context's RoPE, as the captures'
  const uint32_t skip = opt.fit.skip_sinks;
  std::map<std::string, std::string> capture_meta;
  uint64_t docs_fit = 0, docs_held = 0;
  for (size_t di = 0; di < docs.size() && (fitter.fit_tokens() < opt.n_tokens || fitter.heldout_tokens() < opt.heldout_tokens); ++di) {
    const uint64_t fit = fitter.fit_tokens(), held = fitter.heldout_tokens();
    // Every 8th document goes to the held-out set until it is full.
    const bool to_held = held < opt.heldout_tokens && (di % 8 == 7 || fit >= opt.n_tokens);
    if (!to_held && fit >= opt.n_tokens) continue;
    std::vector<int32_t> toks = model->tokenize(corpus_text(docs[di]));
    const uint64_t want = to_held ? opt.heldout_tokens - held : opt.n_tokens - fit;
    const size_t n = std::min<size_t>({toks.size(), size_t(s.n_ctx()), size_t(want + skip)});
    if (n <= skip + 1) continue;
    toks.resize(n);
    s.clear();
    s.decode(toks, 0);
    const KvCapture c = s.capture();
    if (capture_meta.empty()) capture_meta = c.meta;
    const uint64_t total = opt.n_tokens + opt.heldout_tokens;
    const auto done = [&] { return std::min(fitter.fit_tokens(), opt.n_tokens) + std::min(fitter.heldout_tokens(), opt.heldout_tokens); };
    // Two stages per document so a caller can time them apart: the model's
    // prefill, then streaming the capture into the covariances.
    if (progress) progress("prefill", done(), total);
    if (to_held) {
      fitter.add_heldout(c);
      ++docs_held;
    } else {
      fitter.add(c);
      ++docs_fit;
    }
    if (progress) progress("stream", done(), total);
  }
  require(fitter.fit_tokens() >= 2 && fitter.heldout_tokens() > 0, "calibrate: the corpus yielded " + std::to_string(fitter.fit_tokens()) +
                                                                       " fit and " + std::to_string(fitter.heldout_tokens()) +
                                                                       " held-out tokens; need more text");
  Calibration cal = fitter.finish(progress);
  // Provenance from the captures (the geometry itself is typed).
  for (const char* k : {"arch", "model_name", "llama_cpp_commit", "n_layer", "rope_scaling_type", "rope_scaling_factor", "rope_scaling_orig_ctx"})
    if (capture_meta.count(k)) cal.meta[k] = capture_meta.at(k);
  cal.meta["calib_documents"] = std::to_string(docs_fit);
  cal.meta["heldout_documents"] = std::to_string(docs_held);
  cal.meta["calib_n_ctx"] = std::to_string(s.n_ctx());
  cal.meta["corpus_manifest_sha256"] = sha256_file(corpus.manifest_path());
  if (!opt.kinds.empty()) cal.meta["calib_kinds"] = nlohmann::json(opt.kinds).dump();
  return cal;
}

}  // namespace kvtc
