#include "store/pieces.h"

#include <algorithm>
#include <cstring>

#include "core/capture_io.h"
#include "kvtc/error.h"

namespace kvtc::store {

PieceCodec::PieceCodec(const Calibration& cal, const CacheGeometry& g, const StoreOptions& opt, const AllocationSet& alloc, uint32_t chunk_tokens)
    : cal_(cal), geom_(g), alloc_(alloc), opt_(opt), C_(chunk_tokens) {
  require(!g.blocks.empty() && g.blocks.size() <= 2, "kvtc store: expected 1 or 2 cache blocks");
  if (g.blocks.size() == 2) {
    n_swa_ = g.blocks[1].sliding_window;
    require(n_swa_ > 0, "kvtc store: the second cache block has no sliding window (n_swa 0); expected an iSWA model's");
    // A chunk holds block 0 alone (a container block holds >= 1 token):
    // coded and decoded with the calibration's block 0 under its id.
    cal0_ = cal;
    cal0_.blocks.resize(1);
    cal0_.geometry.blocks.resize(1);
    alloc0_ = AllocationSet(alloc.begin(), alloc.begin() + 1);
  }
}

bool PieceCodec::serves(std::span<const int32_t> stored, std::span<const int32_t> tokens) const {
  return common_prefix(stored, tokens) == tokens.size() && (n_swa_ == 0 || stored.size() == tokens.size());
}

CompressOptions PieceCodec::copt(uint32_t sink, uint32_t window) const {
  CompressOptions o;
  o.sink = sink;
  o.window = opt_.raw ? 1u << 30 : window;  // raw: every token in the raw window
  o.chunk_tokens = C_;
  o.deflate_level = opt_.raw ? 0 : opt_.deflate_level;
  o.window_bits = opt_.raw ? 16 : opt_.window_bits;  // raw: the exact baseline
  o.precision = opt_.precision;
  o.threads = 1;  // the store runs pieces in parallel instead
  return o;
}

const KvCapture& PieceCodec::checked_capture(std::span<const int32_t> tokens, const std::vector<uint8_t>& blob, const KvCapture& cap,
                                             KvCapture& owned) const {
  if (!blob.empty()) owned = capture_from_state(blob, geom_, "kvtc store: put_state");
  const KvCapture& c = blob.empty() ? cap : owned;
  require(c.blocks.size() == geom_.blocks.size(),
          "kvtc store: a cache of " + std::to_string(geom_.blocks.size()) + " block(s) expected, got " + std::to_string(c.blocks.size()));
  const KvBlock& b = c.blocks[0];
  const size_t n = tokens.size();
  require(b.n_tokens() == n, "kvtc store: the cache holds " + std::to_string(b.n_tokens()) + " tokens, the prompt " + std::to_string(n));
  for (size_t t = 0; t < n; ++t)
    if (b.pos[t] != int32_t(t))
      throw Error("kvtc store: token " + std::to_string(t) + " sits at position " + std::to_string(b.pos[t]) +
                  "; the store keeps prompts at positions 0..n-1");
  if (n_swa_) (void)window_cells(c.blocks[1], uint32_t(n), n_swa_, "kvtc store: the put's sliding-window block");  // code_tail copies it
  return c;
}

Bytes PieceCodec::code_chunk(const KvCapture& c, std::span<const int32_t> tokens, uint32_t i) const {
  return compress(slice(c, i * C_, (i + 1) * C_, tokens), n_swa_ ? cal0_ : cal_, n_swa_ ? alloc0_ : alloc_, copt(i == 0 ? opt_.sink : 0, 0));
}

Bytes PieceCodec::code_tail(const KvCapture& c, std::span<const int32_t> tokens, uint32_t m) const {
  const uint32_t n = uint32_t(tokens.size());
  KvCapture t = slice(c, m * C_, n, tokens);
  // The window's state at n, coded with block 1's own calibration; its
  // last `window` tokens raw like block 0's.
  if (n_swa_) t.blocks.push_back(window_of(c.blocks[1], n, n_swa_, "kvtc store: the put's sliding-window block"));
  return compress(t, cal_, alloc_, copt(m == 0 ? opt_.sink : 0, opt_.window));
}

KvCapture PieceCodec::decode_piece(const Piece& p, std::span<const uint8_t> bytes, uint32_t i, const std::string& origin) const {
  const uint32_t m = uint32_t(p.chunks.size());
  const bool is_tail = i == m;
  const std::string where = origin + (is_tail ? " tail" : " chunk " + std::to_string(i));
  DecompressOptions dopt;
  dopt.threads = 1;
  dopt.precision = opt_.precision;
  KvCapture c = decompress(bytes, n_swa_ && !is_tail ? cal0_ : cal_, where, dopt);
  const uint32_t t0 = i * C_, t1 = is_tail ? uint32_t(p.tokens.size()) : t0 + C_;
  const size_t blocks = is_tail ? geom_.blocks.size() : 1;
  require(c.blocks.size() == blocks && c.blocks[0].n_tokens() == t1 - t0 && c.tokens.size() == t1 - t0,
          where + ": holds " + std::to_string(c.blocks.empty() ? 0 : c.blocks[0].n_tokens()) + " tokens in " + std::to_string(c.blocks.size()) +
              " block(s), expected " + std::to_string(t1 - t0) + " in " + std::to_string(blocks));
  for (uint32_t t = t0; t < t1; ++t)
    require(c.blocks[0].pos[t - t0] == int32_t(t) && c.tokens[t - t0] == p.tokens[t],
            where + ": token " + std::to_string(t) + " differs from its key's");
  if (n_swa_ && is_tail) {
    // The tail's window block: the window at the prompt's end, in position order, exactly.
    const KvBlock& w = c.blocks[1];
    const uint32_t n = uint32_t(p.tokens.size()), w0 = n > n_swa_ ? n - n_swa_ : 0, w1 = n;
    require(w.n_tokens() == w1 - w0,
            where + ": the sliding-window block holds " + std::to_string(w.n_tokens()) + " tokens, expected " + std::to_string(w1 - w0));
    for (uint32_t i = 0; i < w1 - w0; ++i)
      require(w.pos[i] == int32_t(w0 + i), where + ": the sliding-window block's token " + std::to_string(i) + " sits at position " +
                                               std::to_string(w.pos[i]) + ", expected " + std::to_string(w0 + i));
  }
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

std::vector<int64_t> window_cells(const KvBlock& s, uint32_t n, uint32_t n_swa, const std::string& origin) {
  const uint32_t w0 = n > n_swa ? n - n_swa : 0, w = n - w0;
  // Cell order is llama.cpp's (a ring for the window): find each position's cell.
  std::vector<int64_t> at(w, -1);
  for (uint32_t t = 0; t < s.n_tokens(); ++t) {
    const int64_t p = s.pos[t];
    if (p >= int64_t(w0) && p < int64_t(n)) {
      require(at[size_t(p - w0)] < 0, origin + ": position " + std::to_string(p) + " is held twice");
      at[size_t(p - w0)] = t;
    }
  }
  for (uint32_t i = 0; i < w; ++i)
    require(at[i] >= 0, origin + ": position " + std::to_string(w0 + i) + " of the window [" + std::to_string(w0) + ", " + std::to_string(n) +
                            ") is missing (n_swa " + std::to_string(n_swa) + ")");
  return at;
}

KvBlock window_of(const KvBlock& s, uint32_t n, uint32_t n_swa, const std::string& origin) {
  const std::vector<int64_t> at = window_cells(s, n, n_swa, origin);
  const uint32_t w = uint32_t(at.size()), w0 = n - w;
  KvBlock b;
  static_cast<BlockGeometry&>(b) = s.geometry();
  b.pos.resize(w);
  const size_t hd = s.head_dim, rows = size_t(s.n_layer()) * s.n_head_kv;
  b.k.resize(rows * w * hd);
  b.v.resize(rows * w * hd);
  for (uint32_t i = 0; i < w; ++i) {
    b.pos[i] = int32_t(w0 + i);
    for (size_t r = 0; r < rows; ++r) {
      const size_t from = (r * s.n_tokens() + size_t(at[i])) * hd, to = (r * w + i) * hd;
      std::memcpy(b.k.data() + to, s.k.data() + from, hd * 2);
      std::memcpy(b.v.data() + to, s.v.data() + from, hd * 2);
    }
  }
  return b;
}

KvCapture prefix_of(const KvCapture& c, uint32_t n, uint32_t n_swa, std::span<const int32_t> ids) {
  KvCapture o = slice(c, 0, n, ids);
  if (n_swa) o.blocks.push_back(window_of(c.blocks.at(1), n, n_swa, "kvtc store: a pending put's sliding-window block"));
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
  if (parts.back().blocks.size() > 1) {
    // The window at n: the tail's, which must be the last piece and end at n.
    const KvCapture& tail = parts.back();
    const KvBlock& w = tail.blocks.at(1);
    require(!tail.blocks[0].pos.empty() && tail.blocks[0].pos.back() == int32_t(n) - 1 && !w.pos.empty() && w.pos.back() == int32_t(n) - 1,
            "store: a sliding-window model's match must end with its prompt's tail");
    o.blocks.push_back(w);
  }
  return o;
}

std::vector<uint8_t> join_state(const std::vector<KvCapture>& parts, uint32_t n, const StateLayout& to) {
  // Two blocks: through a joined capture (one more copy of block 0: 3 MiB
  // per 1K tokens on Gemma 3 270M).
  if (!parts.empty() && parts.back().blocks.size() > 1) return state_from_capture(join(parts, n), to);
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
