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

  // The cache of a put, checked: one block of the store's geometry holding
  // exactly `tokens` at positions 0..n-1: `cap`, or the state blob parsed
  // into `owned` when there is one.
  const KvCapture& checked_capture(std::span<const int32_t> tokens, const std::vector<uint8_t>& blob, const KvCapture& cap, KvCapture& owned) const;
  // Chunk i (tokens [iC, (i+1)C), the sink raw in chunk 0) and the tail
  // (tokens [mC, n), its last `window` raw, the sink raw when m = 0) of a
  // checked prompt cache, as .kvtc containers; single-threaded.
  Bytes code_chunk(const KvCapture& c, std::span<const int32_t> tokens, uint32_t i) const;
  Bytes code_tail(const KvCapture& c, std::span<const int32_t> tokens, uint32_t m) const;
  // Decodes piece i of `p` (chunk i, or the tail when i is the number of
  // chunks) and checks that it holds the tokens and positions its key
  // promises; Error names `origin` and the piece.
  KvCapture decode_piece(const Piece& p, std::span<const uint8_t> bytes, uint32_t i, const std::string& origin) const;

  const CacheGeometry& geometry() const { return geom_; }

 private:
  CompressOptions copt(uint32_t sink, uint32_t window) const;
  Calibration cal_;
  CacheGeometry geom_;
  AllocationSet alloc_;
  StoreOptions opt_;
  uint32_t C_;
};

// Tokens [t0, t1) of a single-block capture, with their ids from `ids` (the
// whole prompt's).
KvCapture slice(const KvCapture& c, uint32_t t0, uint32_t t1, std::span<const int32_t> ids);
// Decoded pieces (each starting where the previous one ends) joined into
// one capture of their first n tokens.
KvCapture join(const std::vector<KvCapture>& parts, uint32_t n);
// The same n tokens as a llama.cpp sequence state for layout `to`, written
// straight from the pieces (core/capture_io.h state_from_runs).
std::vector<uint8_t> join_state(const std::vector<KvCapture>& parts, uint32_t n, const StateLayout& to);

}  // namespace kvtc::store
