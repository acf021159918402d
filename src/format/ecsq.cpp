#include "format/ecsq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
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

// floor(log2(v)) for v >= 1.
inline uint32_t ilog2(uint32_t v) {
  return 31u - uint32_t(__builtin_clz(v));
}
// Bits of an escaped value u: the escape symbol, 5 bits of length, the
// length's bits of u + 1 below its leading one.
inline float escaped_extra_bits(uint32_t u) {
  return float(5 + ilog2(u + 1));
}

struct Tables {
  uint16_t cum[kTables][kNSym + 1];
  uint8_t lut[kTables][kTotal];  // slot -> symbol
  float cost[kTables][kNSym];    // bits of symbol u coded directly; +inf where it must be escaped
  float esc[kTables];            // bits of the escape symbol alone
  double costx[kTables][kNSym];  // bits of symbol u < 63 either way: coded, or escaped (escape, length, value)
  // The decoder's one load per symbol: slot -> freq | (slot - cum) << 13 |
  // symbol << 25 (12 + 12 + 6 bits; a frequency is at most 4095 as the
  // escape's is never 0). 82 x 16 KB; a chunk's components use a handful.
  uint32_t dec[kTables][kTotal];
};

const Tables& tables() {
  static const Tables* t = [] {
    auto* T = new Tables;
    for (uint32_t k = 0; k < kTables; ++k) {
      T->cum[k][0] = 0;
      for (uint32_t u = 0; u < kNSym; ++u) {
        T->cum[k][u + 1] = uint16_t(T->cum[k][u] + kFreq[k][u]);
        for (uint32_t s = T->cum[k][u]; s < T->cum[k][u + 1]; ++s) T->lut[k][s] = uint8_t(u);
        T->cost[k][u] = kFreq[k][u] && u != kEsc ? float(kScaleBits - std::log2(double(kFreq[k][u]))) : std::numeric_limits<float>::infinity();
      }
      T->esc[k] = float(kScaleBits - std::log2(double(kFreq[k][kEsc])));
      for (uint32_t u = 0; u < kNSym; ++u)
        T->costx[k][u] = std::isinf(T->cost[k][u]) ? double(T->esc[k]) + double(escaped_extra_bits(u)) : double(T->cost[k][u]);
      for (uint32_t slot = 0; slot < kTotal; ++slot) {
        const uint32_t u = T->lut[k][slot];
        T->dec[k][slot] = uint32_t(kFreq[k][u]) | (slot - T->cum[k][u]) << 13 | u << 25;
      }
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

// quick: round tables within one quarter-octave of the codes' spread (3 per
// shape, the shifted ones all 8) instead of two: rate control's coarse
// search, which the exact estimates after it correct.
Choice choose_table(const int32_t* q, uint32_t n, bool quick = false) {
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
  thread_local std::vector<uint32_t> big;  // values >= 63, escaped everywhere
  for (int si = 0; si < ns; ++si) {
    const uint32_t b = shifts[si];
    // Four histograms summed after: most codes fall in one bin, and one
    // histogram would make each increment wait for the previous one's store.
    uint32_t h4[4][kNSym] = {};
    big.clear();
    uint32_t umax = 0, t = 0;
    for (; t + 4 <= n; t += 4) {
      const uint32_t u0 = zigzag(q[t] >> b), u1 = zigzag(q[t + 1] >> b), u2 = zigzag(q[t + 2] >> b), u3 = zigzag(q[t + 3] >> b);
      if ((u0 | u1 | u2 | u3) < kEsc) {
        ++h4[0][u0], ++h4[1][u1], ++h4[2][u2], ++h4[3][u3];
        umax = std::max(umax, std::max(std::max(u0, u1), std::max(u2, u3)));
        continue;
      }
      for (uint32_t u : {u0, u1, u2, u3})
        if (u < kEsc) {
          ++h4[0][u];
          umax = std::max(umax, u);
        } else {
          big.push_back(u);
        }
    }
    for (; t < n; ++t) {
      const uint32_t u = zigzag(q[t] >> b);
      if (u < kEsc) {
        ++h4[0][u];
        umax = std::max(umax, u);
      } else {
        big.push_back(u);
      }
    }
    for (uint32_t u = 0; u < kNSym; ++u) hist[u] = h4[0][u] + h4[1][u] + h4[2][u] + h4[3][u];
    double big_extra = double(b) * n;
    for (uint32_t u : big) big_extra += escaped_extra_bits(u);
    double hf[kNSym];
    for (uint32_t u = 0; u <= umax; ++u) hf[u] = double(hist[u]);
    auto try_table = [&](uint32_t k, uint32_t id) {
      // No branch per bin: an empty bin adds an exact 0 (the sum, in the
      // same order, is the one the choice always compared).
      const double* cx = T.costx[k];
      double c = big_extra + double(T.esc[k]) * big.size();
      for (uint32_t u = 0; u <= umax; ++u) c += hf[u] * cx[u];
      if (c < best.bits) best = {id, c};
    };
    if (b == 0) {
      // Round tables near the codes' spread (s = 2^(i/4), i = -24..12).
      const int i0 = int(std::lround(4 * std::log2(std::max(rms, 1e-3)))), w = quick ? 1 : 4;
      for (int shape = 0; shape < 2; ++shape)
        for (int i = std::max(-24, i0 - w); i <= std::min(12, i0 + w); ++i) {
          const uint32_t k = uint32_t(shape * 37 + (i + 24));
          try_table(k, k + 1);
        }
    } else {
      for (uint32_t f = 0; f < 8; ++f) try_table(kRoundTables + f, kFirstFloorId + (b - 1) * 8 + f);
    }
  }
  return best;
}

// Codes of one component: q[i] for the coefficients d[i * stride], i < m.
void quantize_row(const float* d, uint32_t m, uint32_t stride, float inv, float rounding, int32_t* q) {
  if (stride == 1) {
    for (uint32_t i = 0; i < m; ++i) q[i] = quantize(d[i], inv, rounding);  // vectorised
    return;
  }
  for (uint32_t i = 0; i < m; ++i) q[i] = quantize(d[size_t(i) * stride], inv, rounding);
}

void check_params(const EcsqParams& p) {
  require(std::isfinite(p.step) && p.step > 0, "entropy coding: the quantizer step must be positive and finite");
  require(p.rounding >= 0 && p.rounding <= 0.5f, "entropy coding: rounding must be in [0, 0.5]");
}

// ---- rANS (docs/format.md "rANS"): 4 states, 12-bit frequencies, bytes.
struct Event {
  uint16_t start, freq;
};
// ceil(2^44 / f) for f = 1..4096: the encoder's division by a multiply.
const uint64_t* reciprocals() {
  static const std::vector<uint64_t> r = [] {
    std::vector<uint64_t> v(kTotal + 1, 0);
    for (uint64_t f = 1; f <= kTotal; ++f) v[f] = ((uint64_t(1) << 44) + f - 1) / f;
    return v;
  }();
  return r.data();
}

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

// The unshifted symbols of one component, tokens t..n, while at least 2
// bytes remain: the four states in registers (st[r]: the state of the r-th
// next event; event i uses state i % 4), one table load per symbol (dec:
// Tables::dec of the component's table) and renormalisation without a
// branch (a state is >= freq * 2^11 after a step: 2 bytes at most). The
// array-indexed loop with branches decoded ~225 M symbols/s per core on
// this Xeon; see bench/results/entropy.md for this one. Stops after an
// escape symbol (*esc set, its bypass bits unread) and returns the next
// token. dq[63], the escape's entry, is a placeholder.
template <class T>
uint32_t decode_run(const uint32_t* dec, const T* dq, uint32_t* st, const uint8_t** pp, const uint8_t* end, T* col, uint32_t t, uint32_t n,
                    bool* esc) {
  uint32_t a0 = st[0], a1 = st[1], a2 = st[2], a3 = st[3];
  const uint8_t* p = *pp;
  while (t < n && end - p >= 2) {
    const uint32_t e = dec[a0 & (kTotal - 1)];
    const uint32_t x = (e & 0x1fff) * (a0 >> kScaleBits) + ((e >> 13) & 0xfff);
    // The bytes this state takes follow from x alone ((x << 8 | byte) <
    // 2^23 iff x < 2^15), so the stream pointer's chain is one add per
    // symbol: taking the second byte's count from the first byte's result
    // made the pointer wait for each load (~8 cycles a symbol here).
    const uint32_t c1 = x < kRansL, c2 = x < (kRansL >> 8);
    const uint32_t s1 = x << 8 | p[0], s2 = s1 << 8 | p[1];
    const uint32_t s = c2 ? s2 : c1 ? s1 : x;
    p += c1 + c2;
    a0 = a1, a1 = a2, a2 = a3, a3 = s;
    const uint32_t u = e >> 25;
    col[t++] = dq[u];
    if (u == kEsc) {
      *esc = true;
      break;
    }
  }
  st[0] = a0, st[1] = a1, st[2] = a2, st[3] = a3;
  *pp = p;
  return t;
}

}  // namespace

const uint16_t* ecsq_table(uint32_t index) {
  require(index < kTables, "ecsq_table: no such table");
  return kFreq[index];
}
uint32_t ecsq_table_count() {
  return kTables;
}

double ecsq_estimate_bytes(const float* d, uint32_t n, uint32_t ru, const EcsqParams& p, uint32_t stride, uint32_t* last_nonzero, bool quick,
                           uint8_t* ids) {
  check_params(p);
  require(stride >= 1, "ecsq_estimate_bytes: stride must be >= 1");
  const uint32_t m = std::max(1u, n / stride);
  thread_local std::vector<int32_t> q;
  q.resize(m);
  const float inv = 1.0f / p.step;
  double bits = 0;
  for (uint32_t j = 0; j < ru; ++j) {
    quantize_row(d + size_t(j) * n, m, stride, inv, p.rounding, q.data());
    const Choice c = choose_table(q.data(), m, quick);
    if (ids) ids[j] = uint8_t(c.id);
    bits += c.bits;
    if (c.id && last_nonzero) *last_nonzero = std::max(*last_nonzero, j + 1);
  }
  return double(ecsq_fixed_bytes(ru)) + bits / 8;
}

std::vector<uint8_t> ecsq_encode_chunk(const float* d, uint32_t n, uint32_t ru, const EcsqParams& p, const uint8_t* chosen) {
  check_params(p);
  const Tables& T = tables();
  std::vector<int32_t> q(size_t(n) * ru);
  for (uint32_t j = 0; j < ru; ++j) quantize_row(d + size_t(j) * n, n, 1, 1.0f / p.step, p.rounding, &q[size_t(j) * n]);
  // Reconstruction offset: the mean of |q| - |d| / step over nonzero codes
  // (the least-squares reconstruction point (|q| - offset) step).
  // Per component in 8 float lanes without a branch (vectorised; each term
  // is in [-0.5, 1) and a lane sums n / 8 of them), then in double.
  double off_sum = 0;
  uint64_t off_n = 0;
  const float inv = 1.0f / p.step;
  for (uint32_t j = 0; j < ru; ++j) {
    const int32_t* qc = &q[size_t(j) * n];
    const float* dc = d + size_t(j) * n;
    float acc[8] = {};
    uint32_t cnt[8] = {};
    uint32_t t = 0;
    for (; t + 8 <= n; t += 8)
      for (uint32_t l = 0; l < 8; ++l) {
        const int32_t a = qc[t + l] < 0 ? -qc[t + l] : qc[t + l];
        const bool ok = a != 0 && a < kMaxCode;
        acc[l] += ok ? float(a) - std::fabs(dc[t + l]) * inv : 0.0f;
        cnt[l] += ok;
      }
    for (; t < n; ++t) {
      const int32_t a = qc[t] < 0 ? -qc[t] : qc[t];
      const bool ok = a != 0 && a < kMaxCode;
      acc[t % 8] += ok ? float(a) - std::fabs(dc[t]) * inv : 0.0f;
      cnt[t % 8] += ok;
    }
    for (uint32_t l = 0; l < 8; ++l) off_sum += double(acc[l]), off_n += cnt[l];
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
    const uint32_t id = chosen ? chosen[j] : choose_table(qc, n).id;
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
  const uint64_t* rcp = reciprocals();
  // Renormalisation without a branch: s < 2^31 and x_max >= 2^19, so a
  // state gives 2 bytes at most (the second only if the first).
  std::vector<uint8_t> rev(2 * ev.size() + 2);
  size_t pos = 0;
  for (size_t i = ev.size(); i-- > 0;) {
    uint32_t& s = x[i & 3];
    const uint32_t f = ev[i].freq;
    const uint32_t x_max = ((kRansL >> kScaleBits) << 8) * f;
    const uint32_t nb = uint32_t(s >= x_max) + uint32_t((s >> 8) >= x_max);
    rev[pos] = uint8_t(s);
    rev[pos + 1] = uint8_t(s >> 8);
    pos += nb;
    s >>= 8 * nb;
    // s / f by a multiply: with M = ceil(2^44 / f), (s M) >> 44 is exact for
    // s < 2^31 and f <= 4096 (the error term s (M - 2^44 / f) / 2^44 < 2^-13
    // stays under the 1 / f a fraction needs to reach the next integer). A
    // division was ~1/3 of the encoder's rANS time.
    const uint32_t qt = uint32_t((uint64_t(s) * rcp[f]) >> 44);
    s = (qt << kScaleBits) + (s - qt * f) + ev[i].start;
  }
  for (uint32_t s : x) put_u32(out, s);
  out.insert(out.end(), std::make_reverse_iterator(rev.begin() + ptrdiff_t(pos)), rev.rend());
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

float ecsq_chunk_offset(const uint8_t* buf, size_t len, const std::string& where) {
  require(len >= 8, where + ": entropy-coded chunk shorter than its step and offset");
  float offset;
  const uint32_t ob = get_u32(buf + 4);
  std::memcpy(&offset, &ob, 4);
  require(offset >= -0.5f && offset <= 0.5f, where + ": entropy-coded chunk reconstruction offset outside [-0.5, 0.5]");
  return offset;
}

namespace {
// Decodes a payload component by component into cm[j * n + t] (the
// stream's order), each code c as value(c): its float reconstruction
// sign(c) (|c| - offset) step, or c itself. Every read is bounds-checked.
template <class T, class Value>
void decode_components(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, T* cm, const std::string& where, Value value) {
  const Tables& T_ = tables();
  require(len >= ecsq_fixed_bytes(ru),
          where + ": entropy-coded chunk of " + std::to_string(len) + " bytes, at least " + std::to_string(ecsq_fixed_bytes(ru)) + " expected");
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
    const uint32_t slot = s & (kTotal - 1), u = T_.lut[k][slot];
    s = kFreq[k][u] * (s >> kScaleBits) + slot - T_.cum[k][u];
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
  auto checked = [&](int64_t c) -> T {
    if (c < -kMaxCode || c > kMaxCode) throw Error(where + ": code out of range (corrupt chunk)");
    return value(int32_t(c));
  };
  T dq[kNSym];  // the value of unshifted symbol u (the escape's: a placeholder)
  dq[kEsc] = 0;
  for (uint32_t u = 0; u < kEsc; ++u) dq[u] = value(unzigzag(u));
  for (uint32_t j = 0; j < ru; ++j) {
    const uint32_t id = ids[j];
    T* col = &cm[size_t(j) * n];
    if (!id) {
      std::fill(col, col + n, T(0));
      continue;
    }
    const uint32_t k = id_table(id), b = id_shift(id);
    if (b == 0) {
      // The common case, unshifted: decode_run() while it can, the general
      // path for an escape and the stream's last byte.
      uint32_t t = 0;
      while (t < n) {
        uint32_t st[4] = {x[i & 3], x[(i + 1) & 3], x[(i + 2) & 3], x[(i + 3) & 3]};
        bool esc = false;
        const uint32_t t1 = decode_run(T_.dec[k], dq, st, &p, end, col, t, n, &esc);
        i += t1 - t;
        for (uint32_t r = 0; r < 4; ++r) x[(i + r) & 3] = st[r];
        t = t1;
        if (esc) {  // the run stopped after an escape symbol: its bypass bits
          col[t - 1] = checked(unzigzag(escaped()));
          continue;
        }
        if (t == n) break;
        const uint32_t u = sym(k);  // within 2 bytes of the end
        col[t++] = u != kEsc ? dq[u] : checked(unzigzag(escaped()));
      }
      continue;
    }
    for (uint32_t t = 0; t < n; ++t) {
      uint32_t u = sym(k);
      if (u == kEsc) u = escaped();
      int64_t c = unzigzag(u);
      if (b) c = c * (int64_t(1) << b) + bits_of(b);
      col[t] = checked(c);
    }
  }
  require(p == end, where + ": " + std::to_string(end - p) + " bytes after the rANS data (corrupt chunk)");
  for (uint32_t s : x) require(s == kRansL, where + ": rANS states do not return to their start (corrupt chunk)");
}
}  // namespace

void ecsq_decode_chunk(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, float* d, const std::string& where, bool component_major) {
  require(len >= ecsq_fixed_bytes(ru),
          where + ": entropy-coded chunk of " + std::to_string(len) + " bytes, at least " + std::to_string(ecsq_fixed_bytes(ru)) + " expected");
  const float step = ecsq_chunk_step(buf, len, where);
  const float offset = ecsq_chunk_offset(buf, len, where);
  // Decoded component-major (the stream's order), then transposed in tiles
  // if d is token-major: writing d column by column directly misses the
  // cache on every value (a row of 3,000 components is 12 KB). The transpose
  // was 22% of this function's time: the codec's decoder takes d
  // component-major. (Token-major through a 16-component block kept in L1
  // and an AVX-512 16 x 16 transpose was tried: the GEMM then ran ~5%
  // faster on SmolLM2 but 11% slower on Qwen2.5, and this stage 60%
  // slower there: component-major decodes 12% faster in all on Qwen.)
  std::vector<float> tmp;
  float* cm = d;
  if (!component_major) {
    tmp.resize(size_t(n) * ru);
    cm = tmp.data();
  }
  decode_components(buf, len, n, ru, cm, where, [step, offset](int32_t c) { return ecsq_value(c, step, offset); });
  constexpr uint32_t kTile = 32;
  if (!component_major)
    for (uint32_t t0 = 0; t0 < n; t0 += kTile)
      for (uint32_t j0 = 0; j0 < ru; j0 += kTile)
        for (uint32_t t = t0; t < std::min(n, t0 + kTile); ++t)
          for (uint32_t j = j0; j < std::min(ru, j0 + kTile); ++j) d[size_t(t) * ru + j] = cm[size_t(j) * n + t];
}

void ecsq_decode_codes(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, int32_t* codes, const std::string& where) {
  decode_components(buf, len, n, ru, codes, where, [](int32_t c) { return c; });
}

}  // namespace kvtc::container
