#include "core/state_blob.h"

#include <cstring>

#include "core/util.h"
#include "kvtc/error.h"

namespace kvtc {

uint32_t ggml_elem_size(int32_t type) {
  switch (type) {
    case kGgmlTypeF32: return 4;
    case kGgmlTypeF16:
    case kGgmlTypeBF16: return 2;
    default: return 0;
  }
}

namespace {

// Sanity limits that keep a corrupt count from turning into a huge
// allocation: far above any real cache (1M cells, 4096 layers, 64 seqs per
// cell), far below what would exhaust memory.
constexpr uint32_t kMaxStreams = 4096;
constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxSeqPerCell = 4096;

class Reader {
 public:
  Reader(std::span<const uint8_t> b, const std::string& origin) : b_(b), origin_(origin) {}
  size_t off() const { return off_; }
  size_t left() const { return b_.size() - off_; }
  bool done() const { return off_ == b_.size(); }
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw Error(origin_ + ": llama.cpp state blob, field '" + field + "' at byte " + std::to_string(off_) + ": " + what);
  }
  template <typename T>
  T get(const std::string& field) {
    if (left() < sizeof(T)) fail(field, "truncated (needs " + std::to_string(sizeof(T)) + " bytes, " + std::to_string(left()) + " left)");
    T v;
    std::memcpy(&v, b_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  const uint8_t* take(uint64_t n, const std::string& field) {
    if (n > left()) fail(field, "truncated (needs " + std::to_string(n) + " bytes, " + std::to_string(left()) + " left)");
    const uint8_t* p = b_.data() + off_;
    off_ += n;
    return p;
  }

 private:
  std::span<const uint8_t> b_;
  const std::string& origin_;
  size_t off_ = 0;
};

// Appends to `out`, or with count_only only counts the bytes (the first of
// seq_blob_write's two passes).
class Writer {
 public:
  explicit Writer(bool count_only = false) : count_only_(count_only) {}
  template <typename T>
  void put(T v) {
    bytes(reinterpret_cast<const uint8_t*>(&v), sizeof(T));
  }
  void bytes(const uint8_t* p, size_t n) {
    size_ += n;
    if (!count_only_) out.insert(out.end(), p, p + n);
  }
  // n more bytes for the caller to fill; null when only counting.
  uint8_t* grow(size_t n) {
    size_ += n;
    if (count_only_) return nullptr;
    out.resize(size_);
    return out.data() + size_ - n;
  }
  size_t size() const { return size_; }
  std::vector<uint8_t> out;

 private:
  bool count_only_;
  size_t size_ = 0;
};

BlobStream parse_stream(Reader& r, bool mrope, const std::string& where) {
  BlobStream s;
  s.cell_count = r.get<uint32_t>(where + ".cell_count");
  if (s.cell_count == 0) return s;
  // Each cell takes at least 8 bytes; reject counts the blob cannot hold
  // before reserving memory for them.
  if (uint64_t(s.cell_count) * 8 > r.left())
    r.fail(where + ".cell_count", std::to_string(s.cell_count) + " cells cannot fit in the " + std::to_string(r.left()) + " bytes left");
  s.pos.resize(s.cell_count);
  s.seq_ids.resize(s.cell_count);
  if (mrope) s.ext.resize(s.cell_count);
  for (uint32_t i = 0; i < s.cell_count; ++i) {
    const std::string cell = where + ".cell[" + std::to_string(i) + "]";
    s.pos[i] = r.get<int32_t>(cell + ".pos");
    uint32_t n_seq = r.get<uint32_t>(cell + ".n_seq_id");
    if (n_seq > kMaxSeqPerCell) r.fail(cell + ".n_seq_id", std::to_string(n_seq) + " exceeds the limit " + std::to_string(kMaxSeqPerCell));
    if (mrope) {
      int32_t x = r.get<int32_t>(cell + ".x");
      int32_t y = r.get<int32_t>(cell + ".y");
      s.ext[i] = {x, y};
    }
    if (uint64_t(n_seq) * 4 > r.left()) r.fail(cell + ".seq_id", "truncated");
    s.seq_ids[i].resize(n_seq);
    for (uint32_t j = 0; j < n_seq; ++j) s.seq_ids[i][j] = r.get<int32_t>(cell + ".seq_id");
  }
  s.v_trans = r.get<uint32_t>(where + ".v_trans");
  if (s.v_trans > 1) r.fail(where + ".v_trans", "expected 0 or 1, found " + std::to_string(s.v_trans));
  uint32_t n_layer = r.get<uint32_t>(where + ".n_layer");
  if (n_layer == 0 || n_layer > kMaxLayers)
    r.fail(where + ".n_layer", "expected 1.." + std::to_string(kMaxLayers) + ", found " + std::to_string(n_layer));
  s.k.resize(n_layer);
  for (uint32_t l = 0; l < n_layer; ++l) {
    const std::string f = where + ".k[" + std::to_string(l) + "]";
    BlobLayer& L = s.k[l];
    L.type = r.get<int32_t>(f + ".type");
    L.row_size = r.get<uint64_t>(f + ".row_size");
    if (L.row_size == 0 || L.row_size > r.left() / s.cell_count)
      r.fail(f + ".row_size", std::to_string(L.row_size) + " x " + std::to_string(s.cell_count) + " cells exceeds the bytes left");
    const uint8_t* p = r.take(L.row_size * s.cell_count, f + ".data");
    L.rows.assign(p, p + L.row_size * s.cell_count);
  }
  s.v.resize(n_layer);
  for (uint32_t l = 0; l < n_layer; ++l) {
    const std::string f = where + ".v[" + std::to_string(l) + "]";
    BlobLayer& L = s.v[l];
    L.type = r.get<int32_t>(f + ".type");
    if (!s.v_trans) {
      L.row_size = r.get<uint64_t>(f + ".row_size");
      if (L.row_size == 0 || L.row_size > r.left() / s.cell_count)
        r.fail(f + ".row_size", std::to_string(L.row_size) + " x " + std::to_string(s.cell_count) + " cells exceeds the bytes left");
      const uint8_t* p = r.take(L.row_size * s.cell_count, f + ".data");
      L.rows.assign(p, p + L.row_size * s.cell_count);
    } else {
      uint32_t el = r.get<uint32_t>(f + ".elem_size");
      uint32_t n_embd = r.get<uint32_t>(f + ".n_embd_v_gqa");
      if (el == 0 || el != ggml_elem_size(L.type))
        r.fail(f + ".elem_size",
               "found " + std::to_string(el) + " for ggml type " + std::to_string(L.type) + " (a transposed V needs F32, F16 or BF16)");
      if (n_embd == 0 || uint64_t(n_embd) * el > r.left() / s.cell_count)
        r.fail(f + ".n_embd_v_gqa", std::to_string(n_embd) + " columns exceed the bytes left");
      L.row_size = uint64_t(n_embd) * el;
      const uint8_t* p = r.take(L.row_size * s.cell_count, f + ".data");
      // Un-transpose: the blob holds, for each dimension j, all cells' values.
      L.rows.resize(L.row_size * s.cell_count);
      for (uint32_t j = 0; j < n_embd; ++j)
        for (uint32_t c = 0; c < s.cell_count; ++c) std::memcpy(&L.rows[c * L.row_size + j * el], p + (uint64_t(j) * s.cell_count + c) * el, el);
    }
  }
  return s;
}

}  // namespace

SeqBlob seq_blob_parse(std::span<const uint8_t> bytes, bool mrope, const std::string& origin) {
  Reader r(bytes, origin);
  uint32_t magic = r.get<uint32_t>("magic");
  if (magic != kSeqBlobMagic) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "expected 0x%08x, found 0x%08x", kSeqBlobMagic, magic);
    r.fail("magic", std::string(buf) + " (not a llama_state_seq_get_data blob of llama.cpp >= 2026-05)");
  }
  SeqBlob blob;
  blob.seq_id = r.get<int32_t>("seq_id");
  while (!r.done()) {
    const std::string bw = "block[" + std::to_string(blob.blocks.size()) + "]";
    if (blob.blocks.size() >= 8) r.fail(bw, "more than 8 cache blocks (trailing bytes?)");
    uint32_t n_stream = r.get<uint32_t>(bw + ".n_stream");
    if (n_stream == 0 || n_stream > kMaxStreams)
      r.fail(bw + ".n_stream", "expected 1.." + std::to_string(kMaxStreams) + ", found " + std::to_string(n_stream));
    if (uint64_t(n_stream) * 4 > r.left()) r.fail(bw + ".n_stream", std::to_string(n_stream) + " streams cannot fit in the bytes left");
    BlobBlock b;
    b.streams.reserve(n_stream);
    for (uint32_t s = 0; s < n_stream; ++s) b.streams.push_back(parse_stream(r, mrope, bw + ".stream[" + std::to_string(s) + "]"));
    blob.blocks.push_back(std::move(b));
  }
  if (blob.blocks.empty()) r.fail("block[0]", "the blob holds no cache block");
  return blob;
}

namespace {
void write_blob(const SeqBlob& blob, Writer& w) {
  w.put<uint32_t>(kSeqBlobMagic);
  w.put<int32_t>(blob.seq_id);
  for (const BlobBlock& b : blob.blocks) {
    w.put<uint32_t>(uint32_t(b.streams.size()));
    for (const BlobStream& s : b.streams) {
      w.put<uint32_t>(s.cell_count);
      if (s.cell_count == 0) continue;
      require(s.pos.size() == s.cell_count && s.seq_ids.size() == s.cell_count && (s.ext.empty() || s.ext.size() == s.cell_count),
              "seq_blob_write: cell arrays do not match cell_count");
      require(s.k.size() == s.v.size() && !s.k.empty(), "seq_blob_write: K and V layer counts differ");
      for (uint32_t i = 0; i < s.cell_count; ++i) {
        w.put<int32_t>(s.pos[i]);
        w.put<uint32_t>(uint32_t(s.seq_ids[i].size()));
        if (!s.ext.empty()) {
          w.put<int32_t>(s.ext[i].first);
          w.put<int32_t>(s.ext[i].second);
        }
        for (int32_t id : s.seq_ids[i]) w.put<int32_t>(id);
      }
      w.put<uint32_t>(s.v_trans);
      w.put<uint32_t>(uint32_t(s.k.size()));
      for (const BlobLayer& L : s.k) {
        require(L.rows.size() == L.row_size * s.cell_count, "seq_blob_write: K layer size does not match row_size x cell_count");
        w.put<int32_t>(L.type);
        w.put<uint64_t>(L.row_size);
        w.bytes(L.rows.data(), L.rows.size());
      }
      for (const BlobLayer& L : s.v) {
        require(L.rows.size() == L.row_size * s.cell_count, "seq_blob_write: V layer size does not match row_size x cell_count");
        w.put<int32_t>(L.type);
        if (!s.v_trans) {
          w.put<uint64_t>(L.row_size);
          w.bytes(L.rows.data(), L.rows.size());
        } else {
          uint32_t el = ggml_elem_size(L.type);
          require(el != 0 && L.row_size % el == 0, "seq_blob_write: transposed V needs an F32, F16 or BF16 layer");
          uint32_t n_embd = uint32_t(L.row_size / el);
          w.put<uint32_t>(el);
          w.put<uint32_t>(n_embd);
          uint8_t* dst = w.grow(L.rows.size());
          if (dst)
            for (uint32_t j = 0; j < n_embd; ++j)
              for (uint32_t c = 0; c < s.cell_count; ++c)
                std::memcpy(dst + (uint64_t(j) * s.cell_count + c) * el, &L.rows[c * L.row_size + uint64_t(j) * el], el);
        }
      }
    }
  }
}
}  // namespace

std::vector<uint8_t> seq_blob_write(const SeqBlob& blob) {
  // Sized first, then written once into memory asked for huge pages: grown
  // by insert, an 8K-token SmolLM2 state (189 MB) was copied again at every
  // doubling and faulted in 4 KiB pages (~1 GB/s on a KVM EPYC).
  Writer count(true);
  write_blob(blob, count);
  Writer w;
  reserve_huge_pages(w.out, count.size());
  write_blob(blob, w);
  return std::move(w.out);
}

}  // namespace kvtc
