#include "store/pieces.h"

#include <algorithm>
#include <cstring>

#include "core/capture_io.h"
#include "kvtc/error.h"

namespace kvtc::store {

PieceCodec::PieceCodec(const Calibration& cal, const CacheGeometry& g, const StoreOptions& opt, const AllocationSet& alloc, uint32_t chunk_tokens)
    : cal_(cal), geom_(g), alloc_(alloc), opt_(opt), C_(chunk_tokens) {}

CompressOptions PieceCodec::copt(uint32_t sink, uint32_t window) const {
  CompressOptions o;
  o.sink = sink;
  o.window = opt_.raw ? 1u << 30 : window;  // raw: every token in the raw window
  o.chunk_tokens = C_;
  o.deflate_level = opt_.raw ? 0 : opt_.deflate_level;
  o.precision = opt_.precision;
  o.threads = 1;  // the store runs pieces in parallel instead
  return o;
}

const KvCapture& PieceCodec::checked_capture(std::span<const int32_t> tokens, const std::vector<uint8_t>& blob, const KvCapture& cap,
                                             KvCapture& owned) const {
  if (!blob.empty()) owned = capture_from_state(blob, geom_, "kvtc store: put_state");
  const KvCapture& c = blob.empty() ? cap : owned;
  require(c.blocks.size() == 1, "kvtc store: a single-block cache expected");
  const KvBlock& b = c.blocks[0];
  const size_t n = tokens.size();
  require(b.n_tokens() == n, "kvtc store: the cache holds " + std::to_string(b.n_tokens()) + " tokens, the prompt " + std::to_string(n));
  for (size_t t = 0; t < n; ++t)
    require(b.pos[t] == int32_t(t), "kvtc store: token " + std::to_string(t) + " sits at position " + std::to_string(b.pos[t]) +
                                        "; the store keeps prompts at positions 0..n-1");
  return c;
}

Bytes PieceCodec::code_chunk(const KvCapture& c, std::span<const int32_t> tokens, uint32_t i) const {
  return compress(slice(c, i * C_, (i + 1) * C_, tokens), cal_, alloc_, copt(i == 0 ? opt_.sink : 0, 0));
}

Bytes PieceCodec::code_tail(const KvCapture& c, std::span<const int32_t> tokens, uint32_t m) const {
  return compress(slice(c, m * C_, uint32_t(tokens.size()), tokens), cal_, alloc_, copt(m == 0 ? opt_.sink : 0, opt_.window));
}

KvCapture PieceCodec::decode_piece(const Piece& p, std::span<const uint8_t> bytes, uint32_t i, const std::string& origin) const {
  const uint32_t m = uint32_t(p.chunks.size());
  const bool is_tail = i == m;
  const std::string where = origin + (is_tail ? " tail" : " chunk " + std::to_string(i));
  DecompressOptions dopt;
  dopt.threads = 1;
  dopt.precision = opt_.precision;
  KvCapture c = decompress(bytes, cal_, where, dopt);
  const uint32_t t0 = i * C_, t1 = is_tail ? uint32_t(p.tokens.size()) : t0 + C_;
  require(c.blocks.size() == 1 && c.blocks[0].n_tokens() == t1 - t0 && c.tokens.size() == t1 - t0,
          where + ": holds " + std::to_string(c.blocks.empty() ? 0 : c.blocks[0].n_tokens()) + " tokens, expected " + std::to_string(t1 - t0));
  for (uint32_t t = t0; t < t1; ++t)
    require(c.blocks[0].pos[t - t0] == int32_t(t) && c.tokens[t - t0] == p.tokens[t],
            where + ": token " + std::to_string(t) + " differs from its key's");
  return c;
}

KvCapture slice(const KvCapture& c, uint32_t t0, uint32_t t1, std::span<const int32_t> ids) {
  const KvBlock& s = c.blocks[0];
  KvCapture o;
  o.model_sha256 = c.model_sha256;
  KvBlock b;
  static_cast<BlockGeometry&>(b) = s.geometry();
  b.pos.assign(s.pos.begin() + t0, s.pos.begin() + t1);
  const size_t n = t1 - t0, hd = s.head_dim, rows = size_t(s.n_layer()) * s.n_head_kv;
  b.k.resize(rows * n * hd);
  b.v.resize(rows * n * hd);
  for (size_t r = 0; r < rows; ++r) {
    const size_t from = (r * s.n_tokens() + t0) * hd, to = r * n * hd;
    std::memcpy(b.k.data() + to, s.k.data() + from, n * hd * 2);
    std::memcpy(b.v.data() + to, s.v.data() + from, n * hd * 2);
  }
  o.blocks.push_back(std::move(b));
  o.tokens.assign(ids.begin() + t0, ids.begin() + t1);
  return o;
}

KvCapture join(const std::vector<KvCapture>& parts, uint32_t n) {
  const KvBlock& g = parts.at(0).blocks[0];
  KvCapture o;
  o.model_sha256 = parts[0].model_sha256;
  KvBlock b;
  static_cast<BlockGeometry&>(b) = g.geometry();
  b.pos.reserve(n);
  for (const KvCapture& p : parts) {
    const size_t take = std::min<size_t>(p.blocks[0].n_tokens(), n - b.pos.size());
    b.pos.insert(b.pos.end(), p.blocks[0].pos.begin(), p.blocks[0].pos.begin() + take);
    o.tokens.insert(o.tokens.end(), p.tokens.begin(), p.tokens.begin() + take);
  }
  require(b.pos.size() == n, "store: the pieces hold fewer tokens than the match");
  const size_t hd = g.head_dim, rows = size_t(g.n_layer()) * g.n_head_kv;
  b.k.resize(rows * n * hd);
  b.v.resize(rows * n * hd);
  size_t at = 0;
  for (const KvCapture& p : parts) {
    const KvBlock& s = p.blocks[0];
    const size_t take = std::min<size_t>(s.n_tokens(), n - at);
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(b.k.data() + (r * n + at) * hd, s.k.data() + r * s.n_tokens() * hd, take * hd * 2);
      std::memcpy(b.v.data() + (r * n + at) * hd, s.v.data() + r * s.n_tokens() * hd, take * hd * 2);
    }
    at += take;
    if (at == n) break;
  }
  o.blocks.push_back(std::move(b));
  return o;
}

std::vector<uint8_t> join_state(const std::vector<KvCapture>& parts, uint32_t n, const StateLayout& to) {
  std::vector<BlockRun> runs;
  uint32_t at = 0;
  for (const KvCapture& p : parts) {
    if (at == n) break;
    const uint32_t take = std::min(p.blocks.at(0).n_tokens(), n - at);
    runs.push_back({&p.blocks[0], 0, take});
    at += take;
  }
  require(at == n, "store: the pieces hold fewer tokens than the match");
  return state_from_runs(runs, to);
}

}  // namespace kvtc::store
