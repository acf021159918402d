// kvtc: the text corpus (docs/corpus.md) — the programs' reader of its
// manifest.json (the bench scripts' is bench/corpus.py, the same selection
// as Corpus::docs), and the seeded choice of documents and token windows
// that calibration, evaluation and the benchmarks share. Part of kvtc_llama
// (windows are tokenized by a Model).
// Thread safety: a Corpus is a read-only value after load; a WindowReader
// is used by one thread.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace kvtc {

class Model;

struct CorpusDoc {
  std::string id;       // stable name (package/path)
  std::string kind;     // "prose", "docs", "code" or "math"
  std::string split;    // "calib" or "eval"
  std::string path;     // the text file, under the corpus root
  uint64_t tokens = 0;  // under the default model's tokenizer (manifest)
};

class Corpus {
 public:
  // Reads root/manifest.json; Error names the file (and says `make corpus`).
  static Corpus load(const std::string& root);
  const std::string& root() const { return root_; }
  std::string manifest_path() const { return root_ + "/manifest.json"; }
  // Documents of `split` of the given kinds (empty: all) holding at least
  // min_tokens tokens, in manifest order.
  std::vector<CorpusDoc> docs(const std::string& split, const std::vector<std::string>& kinds = {}, uint64_t min_tokens = 0) const;

 private:
  std::string root_;
  std::vector<CorpusDoc> docs_;
};

// A document's text; Error names the file.
std::string corpus_text(const CorpusDoc& d);
// The calibration order: by SHA-256 of the id (a stable shuffle that
// interleaves kinds and sources).
void order_by_id_hash(std::vector<CorpusDoc>& docs);
// std::shuffle with the caller's generator (the same seed gives the same
// order with every standard library that implements mt19937_64).
void shuffle_docs(std::vector<CorpusDoc>& docs, std::mt19937_64& rng);

// Token windows of real text, one per document: the document is tokenized,
// a window of `len` tokens starts at an offset drawn from `rng`, and a
// window that does not start the document gets the model's BOS as its
// first token (a real session starts with BOS). Documents shorter than a
// window once tokenized are skipped.
struct TextWindow {
  CorpusDoc doc;
  uint32_t offset = 0;  // first token taken from the document
  std::vector<int32_t> tokens;
};
class WindowReader {
 public:
  // docs in the order to take them; rng is the caller's (it may also have
  // shuffled docs) and must outlive the reader.
  WindowReader(const Model& m, std::vector<CorpusDoc> docs, std::mt19937_64& rng);
  // The next document's window of len tokens; nullopt when none is left.
  std::optional<TextWindow> next(uint32_t len);

 private:
  const Model& m_;
  std::vector<CorpusDoc> docs_;
  std::mt19937_64& rng_;
  size_t at_ = 0;
  std::vector<int32_t> bos_;
};

}  // namespace kvtc
