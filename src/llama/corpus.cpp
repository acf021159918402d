// The corpus manifest reader and the seeded document / window choice
// (kvtc/corpus.h), shared by calibration, evaluation and the benchmarks.
#include "kvtc/corpus.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/util.h"
#include "kvtc/error.h"
#include "kvtc/llama.h"

namespace kvtc {

Corpus Corpus::load(const std::string& root) {
  Corpus c;
  c.root_ = root;
  const std::string path = c.manifest_path();
  std::ifstream f(path);
  require(f.good(), path + ": cannot open (run `make corpus`)");
  try {
    const nlohmann::json m = nlohmann::json::parse(f);
    for (const auto& d : m.at("documents"))
      c.docs_.push_back({d.at("id").get<std::string>(), d.at("kind").get<std::string>(), d.at("split").get<std::string>(),
                         root + "/" + d.at("file").get<std::string>(), d.at("tokens").get<uint64_t>()});
  } catch (const std::exception& e) {
    throw Error(path + ": not a corpus manifest (" + e.what() + ")");
  }
  return c;
}

std::vector<CorpusDoc> Corpus::docs(const std::string& split, const std::vector<std::string>& kinds, uint64_t min_tokens) const {
  std::vector<CorpusDoc> out;
  for (const CorpusDoc& d : docs_)
    if (d.split == split && d.tokens >= min_tokens && (kinds.empty() || std::find(kinds.begin(), kinds.end(), d.kind) != kinds.end()))
      out.push_back(d);
  return out;
}

std::string corpus_text(const CorpusDoc& d) {
  const std::vector<uint8_t> raw = read_file(d.path);
  return std::string(raw.begin(), raw.end());
}

void order_by_id_hash(std::vector<CorpusDoc>& docs) {
  std::vector<std::pair<std::string, CorpusDoc>> keyed;
  for (CorpusDoc& d : docs) keyed.push_back({sha256_bytes({reinterpret_cast<const uint8_t*>(d.id.data()), d.id.size()}), std::move(d)});
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  docs.clear();
  for (auto& [k, d] : keyed) docs.push_back(std::move(d));
}

void shuffle_docs(std::vector<CorpusDoc>& docs, std::mt19937_64& rng) {
  std::shuffle(docs.begin(), docs.end(), rng);
}

WindowReader::WindowReader(const Model& m, std::vector<CorpusDoc> docs, std::mt19937_64& rng)
    : m_(m), docs_(std::move(docs)), rng_(rng), bos_(m.tokenize("")) {}

std::optional<TextWindow> WindowReader::next(uint32_t len) {
  while (at_ < docs_.size()) {
    const CorpusDoc& d = docs_[at_++];
    std::vector<int32_t> t = m_.tokenize(corpus_text(d));
    if (t.size() < len) continue;
    const size_t off = t.size() > len ? size_t(rng_() % (t.size() - len + 1)) : 0;
    TextWindow w;
    w.doc = d;
    w.offset = uint32_t(off);
    w.tokens.assign(t.begin() + off, t.begin() + off + len);
    if (off > 0 && !bos_.empty()) w.tokens.front() = bos_.front();  // a real session starts with BOS
    return w;
  }
  return std::nullopt;
}

}  // namespace kvtc
