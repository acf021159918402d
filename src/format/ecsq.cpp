#include "format/ecsq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvtc/error.h"

namespace kvtc::container {

namespace {

constexpr uint32_t kScaleBits = 12, kTotal = 1u << kScaleBits, kNSym = 64, kEsc = 63;
constexpr uint32_t kRoundTables = 74, kTables = 82;  // 74 round tables, then 8 floor tables
constexpr uint32_t kFirstFloorId = 75, kLastId = 234, kMaxShift = 20;
constexpr uint32_t kRansL = 1u << 23;  // states live in [2^23, 2^31)
constexpr int32_t kMaxCode = 1 << 24;  // |q| is clamped here (an escape then needs 25 bits at most)

const uint16_t kFreq[kTables][kNSym] = {
#include "format/ecsq_tables.inc"
};

struct Tables {
  uint16_t cum[kTables][kNSym + 1];
  uint8_t lut[kTables][kTotal];  // slot -> symbol
  uint32_t fc[kTables][kNSym];   // frequency | cumulative frequency << 16 (one load per decoded symbol)
  float cost[kTables][kNSym];    // bits of symbol u coded directly; +inf where it must be escaped
  float esc[kTables];            // bits of the escape symbol alone
};

const Tables& tables() {
  static const Tables* t = [] {
    auto* T = new Tables;
    for (uint32_t k = 0; k < kTables; ++k) {
      T->cum[k][0] = 0;
      for (uint32_t u = 0; u < kNSym; ++u) {
        T->cum[k][u + 1] = uint16_t(T->cum[k][u] + kFreq[k][u]);
        T->fc[k][u] = uint32_t(kFreq[k][u]) | uint32_t(T->cum[k][u]) << 16;
        for (uint32_t s = T->cum[k][u]; s < T->cum[k][u + 1]; ++s) T->lut[k][s] = uint8_t(u);
        T->cost[k][u] = kFreq[k][u] && u != kEsc ? float(kScaleBits - std::log2(double(kFreq[k][u]))) : std::numeric_limits<float>::infinity();
      }
      T->esc[k] = float(kScaleBits - std::log2(double(kFreq[k][kEsc])));
    }
    return T;
  }();
  return *t;
}

// Table id -> (table index, shift); id 0 (all zero) and ids past kLastId
// are not tables.
inline uint32_t id_table(uint32_t id) {
  return id < kFirstFloorId ? id - 1 : kRoundTables + (id - kFirstFloorId) % 8;
}
inline uint32_t id_shift(uint32_t id) {
  return id < kFirstFloorId ? 0 : 1 + (id - kFirstFloorId) / 8;
}

inline uint32_t zigzag(int32_t h) {
  return h >= 0 ? uint32_t(h) * 2 : uint32_t(-(h + 1)) * 2 + 1;
}
inline int32_t unzigzag(uint32_t u) {
  return (u & 1) ? -int32_t(u >> 1) - 1 : int32_t(u >> 1);
}
// floor(log2(v)) for v >= 1.
inline uint32_t ilog2(uint32_t v) {
  return 31u - uint32_t(__builtin_clz(v));
}
// Bits of an escaped value u: the escape symbol, 5 bits of length, the
// length's bits of u + 1 below its leading one.
inline float escaped_extra_bits(uint32_t u) {
  return float(5 + ilog2(u + 1));
}

inline int32_t quantize(float x, float inv_step, float rounding) {
  const float a = std::fabs(x) * inv_step + rounding;
  const int32_t m = a >= float(kMaxCode) ? kMaxCode : int32_t(a);
  return x < 0 ? -m : m;
}

// The choice for one component's codes q[0..n): table id and its cost in bits.
struct Choice {
  uint32_t id = 0;
  double bits = 0;
};

Choice choose_table(const int32_t* q, uint32_t n) {
  const Tables& T = tables();
  double sq = 0;
  bool any = false;
  for (uint32_t t = 0; t < n; ++t) {
    any |= q[t] != 0;
    sq += double(q[t]) * q[t];
  }
  if (!any) return {};
  const double rms = std::sqrt(sq / n);
  // Candidate shifts: 0 while the codes are small, else the ones that bring
  // the high part's spread near the floor tables' 4..8.
  uint32_t shifts[3];
  int ns = 0;
  if (rms < 16) shifts[ns++] = 0;
  if (rms >= 4) {
    const uint32_t bb = std::min<uint32_t>(kMaxShift, std::max<uint32_t>(1, uint32_t(std::floor(std::log2(rms / 4)))));
    shifts[ns++] = bb;
    if (bb + 1 <= kMaxShift) shifts[ns++] = bb + 1;
  }
  Choice best{0, std::numeric_limits<double>::infinity()};
  uint32_t hist[kNSym];
  std::vector<uint32_t> big;  // values >= 63, escaped everywhere
  for (int si = 0; si < ns; ++si) {
    const uint32_t b = shifts[si];
    std::memset(hist, 0, sizeof hist);
    big.clear();
    uint32_t umax = 0;
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t u = zigzag(q[t] >> b);
      if (u < kEsc) {
        ++hist[u];
        umax = std::max(umax, u);
      } else {
        big.push_back(u);
      }
    }
    double big_extra = double(b) * n;
    for (uint32_t u : big) big_extra += escaped_extra_bits(u);
    auto try_table = [&](uint32_t k, uint32_t id) {
      double c = big_extra + double(T.esc[k]) * big.size();
      for (uint32_t u = 0; u <= umax; ++u)
        if (hist[u]) c += double(hist[u]) * (std::isinf(T.cost[k][u]) ? double(T.esc[k]) + escaped_extra_bits(u) : double(T.cost[k][u]));
      if (c < best.bits) best = {id, c};
    };
    if (b == 0) {
      // Round tables near the codes' spread (s = 2^(i/4), i = -24..12).
      const int i0 = int(std::lround(4 * std::log2(std::max(rms, 1e-3))));
      for (int shape = 0; shape < 2; ++shape)
        for (int i = std::max(-24, i0 - 4); i <= std::min(12, i0 + 4); ++i) {
          const uint32_t k = uint32_t(shape * 37 + (i + 24));
          try_table(k, k + 1);
        }
    } else {
      for (uint32_t f = 0; f < 8; ++f) try_table(kRoundTables + f, kFirstFloorId + (b - 1) * 8 + f);
    }
  }
  return best;
}

// Codes of the chunk, component-major: q[j * n + t].
std::vector<int32_t> quantize_chunk(const float* d, uint32_t n, uint32_t ld, uint32_t ru, const EcsqParams& p) {
  std::vector<int32_t> q(size_t(n) * ru);
  const float inv = 1.0f / p.step;
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < ru; ++j) q[size_t(j) * n + t] = quantize(d[size_t(t) * ld + j], inv, p.rounding);
  return q;
}

void check_params(const EcsqParams& p) {
  require(std::isfinite(p.step) && p.step > 0, "entropy coding: the quantizer step must be positive and finite");
  require(p.rounding >= 0 && p.rounding <= 0.5f, "entropy coding: rounding must be in [0, 0.5]");
}

// ---- rANS (docs/format.md "rANS"): 4 states, 12-bit frequencies, bytes.
struct Event {
  uint16_t start, freq;
};

void put_u32(std::vector<uint8_t>& o, uint32_t v) {
  for (int i = 0; i < 4; ++i) o.push_back(uint8_t(v >> (8 * i)));
}
uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// Appends the bypass pieces of a k-bit value (k <= 25), most significant
// piece first, each at most 12 bits.
void bypass(std::vector<Event>& ev, uint32_t v, uint32_t k) {
  while (k > 0) {
    const uint32_t w = (k - 1) % kScaleBits + 1;  // the top piece takes the remainder
    k -= w;
    const uint32_t piece = (v >> k) & ((1u << w) - 1);
    ev.push_back({uint16_t(piece << (kScaleBits - w)), uint16_t(1u << (kScaleBits - w))});
  }
}

}  // namespace

const uint16_t* ecsq_table(uint32_t index) {
  require(index < kTables, "ecsq_table: no such table");
  return kFreq[index];
}
uint32_t ecsq_table_count() {
  return kTables;
}

double ecsq_estimate_bytes(const float* d, uint32_t n, uint32_t ld, uint32_t ru, const EcsqParams& p, uint32_t* last_nonzero) {
  check_params(p);
  const std::vector<int32_t> q = quantize_chunk(d, n, ld, ru, p);
  double bits = 0;
  for (uint32_t j = 0; j < ru; ++j) {
    const Choice c = choose_table(&q[size_t(j) * n], n);
    bits += c.bits;
    if (c.id && last_nonzero) *last_nonzero = std::max(*last_nonzero, j + 1);
  }
  return double(ecsq_fixed_bytes(ru)) + bits / 8;
}

std::vector<uint8_t> ecsq_encode_chunk(const float* d, uint32_t n, uint32_t ld, uint32_t ru, const EcsqParams& p) {
  check_params(p);
  const Tables& T = tables();
  const std::vector<int32_t> q = quantize_chunk(d, n, ld, ru, p);
  // Reconstruction offset: the mean of |q| - |d| / step over nonzero codes
  // (the least-squares reconstruction point (|q| - offset) step).
  double off_sum = 0;
  uint64_t off_n = 0;
  const float inv = 1.0f / p.step;
  for (uint32_t j = 0; j < ru; ++j)
    for (uint32_t t = 0; t < n; ++t) {
      const int32_t c = q[size_t(j) * n + t];
      if (c != 0 && std::abs(c) < kMaxCode) {
        off_sum += double(std::abs(c)) - double(std::fabs(d[size_t(t) * ld + j]) * inv);
        ++off_n;
      }
    }
  const float offset = off_n ? float(std::clamp(off_sum / double(off_n), -0.5, 0.5)) : 0.0f;
  std::vector<uint8_t> out;
  out.reserve(ecsq_fixed_bytes(ru) + size_t(n) * ru / 2);
  uint32_t bits;
  std::memcpy(&bits, &p.step, 4);
  put_u32(out, bits);
  std::memcpy(&bits, &offset, 4);
  put_u32(out, bits);
  std::vector<uint8_t> ids(ru);
  std::vector<Event> ev;
  ev.reserve(size_t(n) * ru);
  for (uint32_t j = 0; j < ru; ++j) {
    const int32_t* qc = &q[size_t(j) * n];
    const uint32_t id = choose_table(qc, n).id;
    ids[j] = uint8_t(id);
    if (!id) continue;
    const uint32_t k = id_table(id), b = id_shift(id);
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t u = zigzag(qc[t] >> b);
      if (u < kEsc && kFreq[k][u]) {
        ev.push_back({T.cum[k][u], kFreq[k][u]});
      } else {
        ev.push_back({T.cum[k][kEsc], kFreq[k][kEsc]});
        const uint32_t nb = ilog2(u + 1);
        bypass(ev, nb, 5);
        bypass(ev, (u + 1) & ((1u << nb) - 1), nb);
      }
      if (b) bypass(ev, uint32_t(qc[t]) & ((1u << b) - 1), b);
    }
  }
  out.insert(out.end(), ids.begin(), ids.end());
  // Encode backwards (rANS is last-in first-out); event i uses state i % 4.
  uint32_t x[4] = {kRansL, kRansL, kRansL, kRansL};
  std::vector<uint8_t> rev;
  rev.reserve(ev.size() / 2 + 16);
  for (size_t i = ev.size(); i-- > 0;) {
    uint32_t& s = x[i & 3];
    const uint32_t f = ev[i].freq;
    const uint32_t x_max = ((kRansL >> kScaleBits) << 8) * f;
    while (s >= x_max) {
      rev.push_back(uint8_t(s));
      s >>= 8;
    }
    s = ((s / f) << kScaleBits) + (s % f) + ev[i].start;
  }
  for (uint32_t s : x) put_u32(out, s);
  out.insert(out.end(), rev.rbegin(), rev.rend());
  return out;
}

float ecsq_chunk_step(const uint8_t* buf, size_t len, const std::string& where) {
  require(len >= 8, where + ": entropy-coded chunk shorter than its step and offset");
  const uint32_t bits = get_u32(buf);
  float step;
  std::memcpy(&step, &bits, 4);
  require(std::isfinite(step) && step > 0, where + ": entropy-coded chunk step is not positive and finite");
  return step;
}

void ecsq_decode_chunk(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, float* d, const std::string& where) {
  const Tables& T = tables();
  require(len >= ecsq_fixed_bytes(ru),
          where + ": entropy-coded chunk of " + std::to_string(len) + " bytes, at least " + std::to_string(ecsq_fixed_bytes(ru)) + " expected");
  const float step = ecsq_chunk_step(buf, len, where);
  float offset;
  const uint32_t ob = get_u32(buf + 4);
  std::memcpy(&offset, &ob, 4);
  require(offset >= -0.5f && offset <= 0.5f, where + ": entropy-coded chunk reconstruction offset outside [-0.5, 0.5]");
  const uint8_t* ids = buf + 8;
  for (uint32_t j = 0; j < ru; ++j)
    if (ids[j] > kLastId)
      throw Error(where + ": table id " + std::to_string(ids[j]) + " of component " + std::to_string(j) + " (at most " + std::to_string(kLastId) +
                  " expected)");
  uint32_t x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = get_u32(buf + 8 + ru + 4 * i);
    require(x[i] >= kRansL && x[i] < (kRansL << 8), where + ": rANS state out of range (corrupt chunk)");
  }
  const uint8_t* p = buf + ecsq_fixed_bytes(ru);
  const uint8_t* const end = buf + len;
  uint64_t i = 0;  // event index
  // Decodes one table symbol (k >= 0) or a bypass piece of w bits.
  // (Checks in the loops throw directly: require() would build its message
  // for every symbol.)
  auto renorm = [&](uint32_t& s) {
    while (s < kRansL) {
      if (p >= end) throw Error(where + ": rANS data ends early (corrupt chunk)");
      s = (s << 8) | *p++;
    }
  };
  auto sym = [&](uint32_t k) -> uint32_t {
    uint32_t& s = x[i++ & 3];
    const uint32_t slot = s & (kTotal - 1), u = T.lut[k][slot];
    s = kFreq[k][u] * (s >> kScaleBits) + slot - T.cum[k][u];
    renorm(s);
    return u;
  };
  auto piece = [&](uint32_t w) -> uint32_t {
    uint32_t& s = x[i++ & 3];
    const uint32_t slot = s & (kTotal - 1), v = slot >> (kScaleBits - w);
    s = (1u << (kScaleBits - w)) * (s >> kScaleBits) + slot - (v << (kScaleBits - w));
    renorm(s);
    return v;
  };
  auto bits_of = [&](uint32_t k) -> uint32_t {
    uint32_t v = 0;
    while (k > 0) {
      const uint32_t w = (k - 1) % kScaleBits + 1;
      k -= w;
      v = (v << w) | piece(w);
    }
    return v;
  };
  // The value after an escape symbol: 5 bits of length L, then L bits of u + 1.
  auto escaped = [&]() -> uint32_t {
    const uint32_t nb = bits_of(5);
    if (nb > 25) throw Error(where + ": escaped code longer than 25 bits (corrupt chunk)");
    return ((1u << nb) | bits_of(nb)) - 1;
  };
  // Decoded component-major (the stream's order), then transposed in tiles:
  // writing d column by column directly misses the cache on every value
  // (a row of 3,000 components is 12 KB).
  std::vector<float> cm(size_t(n) * ru);
  float dq[kEsc];  // the reconstruction of unshifted symbol u
  for (uint32_t u = 0; u < kEsc; ++u) {
    const int32_t c = unzigzag(u);
    const float a = c == 0 ? 0.0f : (float(c < 0 ? -c : c) - offset) * step;
    dq[u] = c < 0 ? -a : a;
  }
  for (uint32_t j = 0; j < ru; ++j) {
    const uint32_t id = ids[j];
    float* col = &cm[size_t(j) * n];
    if (!id) {
      std::fill(col, col + n, 0.0f);
      continue;
    }
    const uint32_t k = id_table(id), b = id_shift(id);
    if (b == 0) {
      // The common case, unshifted: one table load per symbol and the
      // reconstruction from a 63-entry table; escapes take the general path.
      const uint8_t* lut = T.lut[k];
      const uint32_t* fc = T.fc[k];
      for (uint32_t t = 0; t < n; ++t) {
        uint32_t& s = x[i++ & 3];
        const uint32_t slot = s & (kTotal - 1), u = lut[slot], e = fc[u];
        s = (e & 0xffff) * (s >> kScaleBits) + slot - (e >> 16);
        renorm(s);
        if (u != kEsc) {
          col[t] = dq[u];
          continue;
        }
        const int64_t c = unzigzag(escaped());
        if (c < -kMaxCode || c > kMaxCode) throw Error(where + ": code out of range (corrupt chunk)");
        const float a = c == 0 ? 0.0f : (float(c < 0 ? -c : c) - offset) * step;
        col[t] = c < 0 ? -a : a;
      }
      continue;
    }
    for (uint32_t t = 0; t < n; ++t) {
      uint32_t u = sym(k);
      if (u == kEsc) u = escaped();
      int64_t c = unzigzag(u);
      if (b) c = c * (int64_t(1) << b) + bits_of(b);
      if (c < -kMaxCode || c > kMaxCode) throw Error(where + ": code out of range (corrupt chunk)");
      const float a = c == 0 ? 0.0f : (float(c < 0 ? -c : c) - offset) * step;
      col[t] = c < 0 ? -a : a;
    }
  }
  constexpr uint32_t kTile = 32;
  for (uint32_t t0 = 0; t0 < n; t0 += kTile)
    for (uint32_t j0 = 0; j0 < ru; j0 += kTile)
      for (uint32_t t = t0; t < std::min(n, t0 + kTile); ++t)
        for (uint32_t j = j0; j < std::min(ru, j0 + kTile); ++j) d[size_t(t) * ru + j] = cm[size_t(j) * n + t];
  require(p == end, where + ": " + std::to_string(end - p) + " bytes after the rANS data (corrupt chunk)");
  for (uint32_t s : x) require(s == kRansL, where + ": rANS states do not return to their start (corrupt chunk)");
}

}  // namespace kvtc::container
