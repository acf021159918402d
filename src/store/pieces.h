// Internal: the prompt store's pieces and the codec — a prompt's cache cut
// into chunks and a tail and coded (docs/store.md "Pieces"), pieces decoded
// and checked against their keys, and decoded pieces assembled into what a
// take returns (a capture, or a llama.cpp state blob written in one copy).
// Thread safety: a PieceCodec is immutable after construction; every
// member is reentrant.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvtc/store.h"
#include "store/keys.h"

namespace kvtc::store {

class PieceCodec {
 public:
  PieceCodec(const Calibration& cal, const CacheGeometry& g, const StoreOptions& opt, const AllocationSet& alloc, uint32_t chunk_tokens);

  // The cache of a put, checked: block 0 of the store's geometry holding
  // exactly `tokens` at positions 0..n-1 (and for a sliding-window model
  // block 1 holding at least the window, positions [n - n_swa, n)): `cap`,
  // or the state blob parsed into `owned` when there is one.
  const KvCapture& checked_capture(std::span<const int32_t> tokens, const std::vector<uint8_t>& blob, const KvCapture& cap, KvCapture& owned) const;
  // Chunk i (tokens [iC, (i+1)C), the sink raw in chunk 0) and the tail
  // (tokens [mC, n), its last `window` raw, the sink raw when m = 0) of a
  // checked prompt cache, as .kvtc containers; single-threaded. For a
  // sliding-window model a chunk holds block 0 alone and the tail also
  // the window (docs/store.md "Sliding-window models").
  Bytes code_chunk(const KvCapture& c, std::span<const int32_t> tokens, uint32_t i) const;
  Bytes code_tail(const KvCapture& c, std::span<const int32_t> tokens, uint32_t m) const;
  // Decodes piece i of `p` (chunk i, or the tail when i is the number of
  // chunks) and checks that it holds the tokens and positions its key
  // promises; Error names `origin` and the piece.
  KvCapture decode_piece(const Piece& p, std::span<const uint8_t> bytes, uint32_t i, const std::string& origin) const;

  const CacheGeometry& geometry() const { return geom_; }
  // The sliding-window block's window in tokens; 0 for a single-block cache.
  uint32_t n_swa() const { return n_swa_; }
  // Whether a stored prompt of `whole` tokens can restore its first `lcp`:
  // always for a single-block cache; for a sliding-window model only the
  // whole prompt (its tail holds the window at its end, nowhere else).
  bool restorable(size_t lcp, size_t whole) const { return n_swa_ == 0 || (lcp == whole && whole > 0); }
  // Whether a put of `tokens` adds nothing to a stored prompt `stored` of
  // the same tenant: it restores all of them (a prefix, or for a
  // sliding-window model the same prompt only).
  bool serves(std::span<const int32_t> stored, std::span<const int32_t> tokens) const;

 private:
  CompressOptions copt(uint32_t sink, uint32_t window) const;
  Calibration cal_;
  CacheGeometry geom_;
  AllocationSet alloc_;
  StoreOptions opt_;
  uint32_t C_;
  uint32_t n_swa_ = 0;
  Calibration cal0_;  // sliding-window models: block 0 of cal_ (its id), for the chunks
  AllocationSet alloc0_;
};

// Tokens [t0, t1) of block 0 of a capture, with their ids from `ids` (the
// whole prompt's): one block.
KvCapture slice(const KvCapture& c, uint32_t t0, uint32_t t1, std::span<const int32_t> ids);
// The cell of each window position [max(0, n - n_swa), n) of a
// sliding-window block, in position order (what window_of copies); Error
// naming `origin` when a position is missing or held twice.
std::vector<int64_t> window_cells(const KvBlock& b, uint32_t n, uint32_t n_swa, const std::string& origin);
// The window of a sliding-window block at a prompt of n tokens: its cells
// at positions [max(0, n - n_swa), n) in position order (a state holds them
// in llama.cpp's cell order); Error naming `origin` when one is missing.
KvBlock window_of(const KvBlock& b, uint32_t n, uint32_t n_swa, const std::string& origin);
// The first n tokens of a capture restored whole: block 0's [0, n) and,
// for a sliding-window model, block 1's window at n.
KvCapture prefix_of(const KvCapture& c, uint32_t n, uint32_t n_swa, std::span<const int32_t> ids);
// Decoded pieces (each starting where the previous one ends) joined into
// one capture of their first n tokens; a sliding-window block 1 comes from
// the last piece (the tail), which must then be part of the match.
KvCapture join(const std::vector<KvCapture>& parts, uint32_t n);
// The same n tokens as a llama.cpp sequence state for layout `to`, written
// straight from the pieces (core/capture_io.h state_from_runs; for a
// sliding-window model through join).
std::vector<uint8_t> join_state(const std::vector<KvCapture>& parts, uint32_t n, const StateLayout& to);

}  // namespace kvtc::store
