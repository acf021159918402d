#include "format/ecsq.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>

#include "core/util.h"
#include "kvtc/error.h"

namespace kvtc::container {

namespace {

constexpr uint32_t kScaleBits = 12, kTotal = 1u << kScaleBits, kNSym = 64, kEsc = 63;
constexpr uint32_t kRoundTables = 74, kTables = 82;  // 74 round tables, then 8 floor tables
constexpr uint32_t kFirstFloorId = 75, kLastId = 234, kMaxShift = 20;
constexpr uint32_t kRansL = 1u << 23;         // kLanes4: states live in [2^23, 2^31)
constexpr uint32_t kWordL = 1u << 16;         // kLanes32: states live in [2^16, 2^32)
constexpr uint32_t kNLanes = kEcsqWideLanes;  // token t uses state t mod kNLanes
constexpr int32_t kMaxCode = 1 << 24;         // |q| is clamped here (an escape then needs 25 bits at most)
constexpr uint32_t kCostLanes = 16;           // tables choose_table sums at once (the most it tries of one shape: 9)

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
  // costx transposed, [u][table], zero past the last table: choose_table
  // sums the candidate tables side by side (each still bin by bin, in the
  // same order as one table alone).
  double costxt[kNSym][kTables + kCostLanes];
  // The decoder's one load per symbol: slot -> freq | (slot - cum) << 13 |
  // symbol << 25 (12 + 12 + 6 bits; a frequency is at most 4095 as the
  // escape's is never 0). 82 x 16 KB; a chunk's components use a handful.
  uint32_t dec[kTables][kTotal];
  // The encoder's one load per symbol: u -> cum | freq << 16 of the symbol
  // it codes (u itself, or the escape where u has no frequency; [kEsc] is
  // the escape's, for every u >= 63).
  uint32_t enc[kTables][kNSym];
};

const Tables& tables() {
  static const Tables* t = [] {
    auto* T = new Tables{};
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
      for (uint32_t u = 0; u < kNSym; ++u) T->costxt[u][k] = T->costx[k][u];
      for (uint32_t u = 0; u < kNSym; ++u) {
        const uint32_t v = u != kEsc && kFreq[k][u] ? u : kEsc;
        T->enc[k][u] = uint32_t(T->cum[k][v]) | uint32_t(kFreq[k][v]) << 16;
      }
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

// Without a branch: the codes' signs are a coin toss, and the compare
// compiled to a jump cost a misprediction on ~half the tokens of every
// histogram and event pass (~1/3 of choose_table's time at 16x).
inline uint32_t zigzag(int32_t h) {
  return uint32_t(h) << 1 ^ uint32_t(h >> 31);
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

// The sum of q[t]^2, exact (|q| <= 2^24, n <= 2^15 a call: under 2^64).
uint64_t sum_squares(const int32_t* q, uint32_t n) {
  uint64_t s = 0;
  for (uint32_t t = 0; t < n; ++t) {
    const uint32_t a = q[t] < 0 ? uint32_t(-q[t]) : uint32_t(q[t]);
    s += uint64_t(a) * a;
  }
  return s;
}

#if defined(__x86_64__)
#pragma GCC diagnostic push
// GCC 12's AVX-512 integer intrinsics pass an _mm512_undefined_epi32() it
// then warns about (as for the decoder's kernels below).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// choose_table's two sums in AVX-512, the same numbers as its loops: the
// squares as exact integers (|q| <= 2^24, n <= 2^15 a call), and the
// candidate tables' costs, each table's lane bin by bin (mul then add: the
// build never fuses them, -ffp-contract=off).
__attribute__((target("avx512f"))) uint64_t sum_squares_avx512(const int32_t* q, uint32_t n) {
  __m512i acc = _mm512_setzero_si512();
  uint32_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512i v = _mm512_loadu_si512(q + t);
    const __m512i a = _mm512_max_epi32(v, _mm512_sub_epi32(_mm512_setzero_si512(), v));  // (GCC 12's abs warns)
    const __m512i hi = _mm512_srli_epi64(a, 32);
    acc = _mm512_add_epi64(acc, _mm512_add_epi64(_mm512_mul_epu32(a, a), _mm512_mul_epu32(hi, hi)));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, acc);
  uint64_t s = sum_squares(q + t, n - t);
  for (uint64_t l : lanes) s += l;
  return s;
}
__attribute__((target("avx512f"))) void table_costs_avx512(const double* hf, uint32_t umax, const double (*cxt)[kTables + kCostLanes], uint32_t k0,
                                                           double* c) {
  static_assert(kCostLanes == 16, "two vectors of 8 doubles");
  __m512d c0 = _mm512_loadu_pd(c), c1 = _mm512_loadu_pd(c + 8);
  for (uint32_t u = 0; u <= umax; ++u) {
    const __m512d h = _mm512_set1_pd(hf[u]);
    c0 = _mm512_add_pd(c0, _mm512_mul_pd(h, _mm512_loadu_pd(&cxt[u][k0])));
    c1 = _mm512_add_pd(c1, _mm512_mul_pd(h, _mm512_loadu_pd(&cxt[u][k0 + 8])));
  }
  _mm512_storeu_pd(c, c0);
  _mm512_storeu_pd(c + 8, c1);
}
#pragma GCC diagnostic pop
#endif

// quick: round tables within one quarter-octave of the codes' spread (3 per
// shape, the shifted ones all 8) instead of two: rate control's coarse
// search, which the exact estimates after it correct.
Choice choose_table(const int32_t* q, uint32_t n, bool quick = false) {
  const Tables& T = tables();
  // The sum of squares in integers (vectorised; a double sum waited 4
  // cycles a token on the last add): exact, so the same double as the sum
  // token by token gave wherever that one was exact (under 2^53). Blocks
  // of 2^15 tokens keep a u64 from overflowing (|q| <= 2^24).
#if defined(__x86_64__)
  const bool avx512 = vector_kernels() && cpu_features().avx512f;
#endif
  double sq = 0;
  for (uint32_t t0 = 0; t0 < n; t0 += 1u << 15) {
    const uint32_t m = std::min(n - t0, 1u << 15);
#if defined(__x86_64__)
    sq += double(avx512 ? sum_squares_avx512(q + t0, m) : sum_squares(q + t0, m));
#else
    sq += double(sum_squares(q + t0, m));
#endif
  }
  if (sq == 0) return {};
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
    // The costs of tables k0 .. k0 + w - 1 (ids id0 + i), tried in that
    // order. No branch per bin: an empty bin adds an exact 0; each table's
    // sum runs bin by bin in the same order as it always did (the lanes only
    // put kCostLanes tables side by side), so the choice is the same.
    auto try_tables = [&](uint32_t k0, uint32_t w, uint32_t id0) {
      double c[kCostLanes];
      for (uint32_t i = 0; i < kCostLanes; ++i) c[i] = big_extra + double(k0 + i < kTables ? T.esc[k0 + i] : 0.0f) * double(big.size());
#if defined(__x86_64__)
      if (avx512) {
        table_costs_avx512(hf, umax, T.costxt, k0, c);
      } else
#endif
        for (uint32_t u = 0; u <= umax; ++u) {
          const double h = hf[u];
          const double* cx = &T.costxt[u][k0];
          for (uint32_t i = 0; i < kCostLanes; ++i) c[i] += h * cx[i];  // vectorised
        }
      for (uint32_t i = 0; i < w; ++i)
        if (c[i] < best.bits) best = {id0 + i, c[i]};
    };
    if (b == 0) {
      // Round tables near the codes' spread (s = 2^(i/4), i = -24..12).
      const int i0 = int(std::lround(4 * std::log2(std::max(rms, 1e-3)))), w = quick ? 1 : 4;
      const int lo = std::max(-24, i0 - w), hi = std::min(12, i0 + w);
      if (lo <= hi)
        for (int shape = 0; shape < 2; ++shape) {
          const uint32_t k0 = uint32_t(shape * 37 + (lo + 24));
          try_tables(k0, uint32_t(hi - lo + 1), k0 + 1);
        }
    } else {
      try_tables(kRoundTables, 8, kFirstFloorId + (b - 1) * 8);
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

// An escaped value u's bypass fields (docs/format.md "Codes") to put(value,
// bits): its length in 5 bits, then u + 1 below its leading one.
template <class Put>
inline void put_escape(uint32_t u, Put&& put) {
  const uint32_t nb = ilog2(u + 1);
  put(nb, 5);
  put((u + 1) & ((1u << nb) - 1), nb);
}

// The events of the codes (docs/format.md "Codes"), component by component,
// token by token: each symbol into ev, each bypass field (value, bits) to
// put (kLanes4 codes them as events in ev too; kLanes32, encode_lanes32,
// takes the same fields as plain bits).
template <class Put>
void code_events(const int32_t* q, uint32_t n, uint32_t ru, const uint8_t* ids, std::vector<Event>& ev, Put put) {
  const Tables& T = tables();
  ev.reserve(size_t(n) * ru);
  for (uint32_t j = 0; j < ru; ++j) {
    const int32_t* qc = &q[size_t(j) * n];
    const uint32_t id = ids[j];
    if (!id) continue;
    const uint32_t k = id_table(id), b = id_shift(id);
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t u = zigzag(qc[t] >> b);
      if (u < kEsc && kFreq[k][u]) {
        ev.push_back({T.cum[k][u], kFreq[k][u]});
      } else {
        ev.push_back({T.cum[k][kEsc], kFreq[k][kEsc]});
        put_escape(u, put);
      }
      if (b) put(uint32_t(qc[t]) & ((1u << b) - 1), b);
    }
  }
}

// kLanes4 (docs/format.md "rANS"): every event, symbols and bypass pieces,
// through 4 states in turn over one byte stream.
void encode_lanes4(const int32_t* q, uint32_t n, uint32_t ru, const uint8_t* ids, std::vector<uint8_t>& out) {
  std::vector<Event> ev;
  code_events(q, n, ru, ids, ev, [&ev](uint32_t v, uint32_t k) { bypass(ev, v, k); });
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
}

// Bypass bits of kLanes32, LSB-first: a k-bit value's bit i is the stream's
// bit (at + i), bit b of the stream in byte b / 8 at bit b % 8. No branch
// per field: between fields the accumulator holds < 8 bits, a field adds
// <= 25, and its 8 bytes are stored whole at the write position (the buffer
// keeps 8 spare); a loop of byte pushes mispredicted on most shifted
// tokens (1-3 bits each).
struct BitWriter {
  std::vector<uint8_t> buf;
  size_t pos = 0;  // whole bytes written
  uint64_t acc = 0;
  uint32_t bits = 0;
  // Room for `fields` more fields of <= 25 bits (more bytes are never needed).
  void reserve(size_t fields) {
    const size_t need = pos + fields * 4 + 8;
    if (buf.size() < need) buf.resize(std::max(need, 2 * buf.size()));
  }
  void put(uint32_t v, uint32_t k) {  // k <= 25, v < 2^k
    acc |= uint64_t(v) << bits;
    bits += k;
    static_assert(std::endian::native == std::endian::little, "BitWriter stores its accumulator's bytes LSB first");
    std::memcpy(&buf[pos], &acc, 8);
    pos += bits >> 3;
    acc >>= bits & ~7u;
    bits &= 7;
  }
  size_t finish() {  // the stream's bytes, the last padded with zero bits
    return pos + (bits ? 1 : 0);
  }
};

// kLanes32: token t of a component uses state t % 32; one symbol per token
// through rANS over 16-bit words, the escapes' and shifts' bits in the bit
// stream, component by component, token by token. The symbols go straight
// from the codes into the states, backwards (rANS is last-in first-out),
// one table load each (Tables::enc) and no branch; the bits in a forward
// pass of their own. (Through a vector of events, with a branch per
// renormalisation, this took ~45 ns a code.)
void encode_lanes32(const int32_t* q, uint32_t n, uint32_t ru, const uint8_t* ids, std::vector<uint8_t>& out) {
  const Tables& T = tables();
  BitWriter bw;
  size_t coded = 0;
  for (uint32_t j = 0; j < ru; ++j) {
    if (!ids[j]) continue;
    ++coded;
    const int32_t* qc = &q[size_t(j) * n];
    const uint32_t k = id_table(ids[j]), b = id_shift(ids[j]);
    const uint32_t* enc = T.enc[k];
    const uint32_t esc = enc[kEsc];
    if (b) bw.reserve(n);
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t u = zigzag(qc[t] >> b);
      if (enc[std::min(u, kEsc)] == esc) [[unlikely]] {
        bw.reserve(2 + (b ? n - t : 0));
        put_escape(u, [&bw](uint32_t v, uint32_t k) { bw.put(v, k); });
      }
      if (b) bw.put(uint32_t(qc[t]) & ((1u << b) - 1), b);
    }
  }
  uint32_t x[kNLanes];
  std::fill(x, x + kNLanes, kWordL);
  const uint64_t* rcp = reciprocals();
  std::vector<uint16_t> rev(coded * n + 1);
  size_t pos = 0;
  static_assert((kNLanes & (kNLanes - 1)) == 0, "the lane is t mod a power of two");
  for (uint32_t j = ru; j-- > 0;) {
    if (!ids[j]) continue;
    const int32_t* qc = &q[size_t(j) * n];
    const uint32_t b = id_shift(ids[j]);
    const uint32_t* enc = T.enc[id_table(ids[j])];
    for (uint32_t t = n; t-- > 0;) {
      uint32_t& s = x[t & (kNLanes - 1)];
      const uint32_t e = enc[std::min(zigzag(qc[t] >> b), kEsc)];
      const uint32_t f = e >> 16;
      // One word at most: s < 2^32 leaves s >> 16 < 2^16 <= 2^20 f.
      const uint32_t c = s >= f << 20;
      rev[pos] = uint16_t(s);
      pos += c;
      s = c ? s >> 16 : s;
      // s < 2^20 f now, so (s M) >> 44 with M = ceil(2^44 / f) is exact (the
      // error s (M - 2^44 / f) / 2^44 < 2^-12 <= 1 / f), in 128 bits: s M
      // reaches 2^64.
      const uint32_t qt = uint32_t((unsigned __int128)s * rcp[f] >> 44);
      s = (qt << kScaleBits) + (s - qt * f) + (e & 0xffff);
    }
  }
  const size_t nbits = bw.finish(), at = out.size();
  out.resize(at + 4 * kNLanes + 4 + 2 * pos + nbits);
  uint8_t* o = out.data() + at;
  for (uint32_t l = 0; l < kNLanes; ++l, o += 4) std::memcpy(o, &x[l], 4);
  const uint32_t words = uint32_t(pos);
  std::memcpy(o, &words, 4);
  o += 4;
  for (size_t i = pos; i-- > 0; o += 2) o[0] = uint8_t(rev[i]), o[1] = uint8_t(rev[i] >> 8);
  if (nbits) std::memcpy(o, bw.buf.data(), nbits);
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
  return double(ecsq_fixed_bytes(ru, p.layout)) + bits / 8;
}

std::vector<uint8_t> ecsq_encode_chunk(const float* d, uint32_t n, uint32_t ru, const EcsqParams& p, const uint8_t* chosen) {
  check_params(p);
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
#if defined(__x86_64__)
    // The same 8 lanes in SSE2 (the compiler left this loop scalar: ~1/4
    // of the chunk encoder's time): each lane's sum in the same order.
    {
      __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
      __m128i c0 = _mm_setzero_si128(), c1 = _mm_setzero_si128();
      const __m128 vinv = _mm_set1_ps(inv), magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
      const __m128i vmax = _mm_set1_epi32(kMaxCode), zero = _mm_setzero_si128();
      auto lane4 = [&](const int32_t* qp, const float* dp, __m128& acc4, __m128i& cnt4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp));
        const __m128i sign = _mm_srai_epi32(v, 31);
        const __m128i a = _mm_sub_epi32(_mm_xor_si128(v, sign), sign);
        const __m128i ok = _mm_andnot_si128(_mm_cmpeq_epi32(a, zero), _mm_cmplt_epi32(a, vmax));
        const __m128 term = _mm_sub_ps(_mm_cvtepi32_ps(a), _mm_mul_ps(_mm_and_ps(_mm_loadu_ps(dp), magnitude), vinv));
        acc4 = _mm_add_ps(acc4, _mm_and_ps(term, _mm_castsi128_ps(ok)));
        cnt4 = _mm_sub_epi32(cnt4, ok);  // ok is -1 per lane
      };
      for (; t + 8 <= n; t += 8) {
        lane4(qc + t, dc + t, a0, c0);
        lane4(qc + t + 4, dc + t + 4, a1, c1);
      }
      _mm_storeu_ps(acc, a0);
      _mm_storeu_ps(acc + 4, a1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cnt), c0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cnt + 4), c1);
    }
#endif
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
  out.reserve(ecsq_fixed_bytes(ru, p.layout) + size_t(n) * ru / 2);
  uint32_t bits;
  std::memcpy(&bits, &p.step, 4);
  put_u32(out, bits);
  std::memcpy(&bits, &offset, 4);
  put_u32(out, bits);
  std::vector<uint8_t> ids(ru);
  for (uint32_t j = 0; j < ru; ++j) ids[j] = uint8_t(chosen ? chosen[j] : choose_table(&q[size_t(j) * n], n).id);
  out.insert(out.end(), ids.begin(), ids.end());
  if (p.layout == EcsqLayout::kLanes32)
    encode_lanes32(q.data(), n, ru, ids.data(), out);
  else
    encode_lanes4(q.data(), n, ru, ids.data(), out);
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
// The values of a payload's codes, for both layouts' decoders: dq[u] that
// of unshifted symbol u (the escape's a placeholder), checked(c) that of any
// code, an Error beyond 2^24 steps.
template <class T, class Value>
struct CodeValues {
  Value value;
  const std::string& where;
  T dq[kNSym];
  CodeValues(Value v, const std::string& w) : value(v), where(w) {
    dq[kEsc] = 0;
    for (uint32_t u = 0; u < kEsc; ++u) dq[u] = value(unzigzag(u));
  }
  T checked(int64_t c) const {
    if (c < -kMaxCode || c > kMaxCode) throw Error(where + ": code out of range (corrupt chunk)");
    return value(int32_t(c));
  }
};

// kLanes4: every event through 4 states in turn (docs/format.md "rANS").
template <class T, class Value>
void decode_lanes4(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, T* cm, const std::string& where, Value value) {
  const Tables& T_ = tables();
  const uint8_t* ids = buf + 8;
  uint32_t x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = get_u32(buf + 8 + ru + 4 * i);
    require(x[i] >= kRansL && x[i] < (kRansL << 8), where + ": rANS state out of range (corrupt chunk)");
  }
  const uint8_t* p = buf + ecsq_fixed_bytes(ru, EcsqLayout::kLanes4);
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
  const CodeValues<T, Value> cv(value, where);
  const T* dq = cv.dq;
  auto checked = [&cv](int64_t c) { return cv.checked(c); };
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

// ---- kLanes32's symbol kernels: tokens t..n of one component (dec: its
// table's Tables::dec) from the 32 states xs, words from *pw up to wend,
// the symbols into sym[t..n) (room for n rounded up to 32). They return
// whether a symbol was the escape. They give the same symbols, states and
// errors: the vector kernels decode 32 lanes (2 x 16 or 4 x 8), then read the
// words of the lanes whose state fell under 2^16 in lane order, which is
// the order the scalar kernel reads them in token by token (a lane's
// decode depends on no other lane's word).

[[noreturn]] void words_end_early(const std::string& where) {
  throw Error(where + ": rANS words end early (corrupt chunk)");
}

bool rans32_scalar(const uint32_t* dec, uint32_t* xs, const uint8_t** pw, const uint8_t* wend, uint32_t t, uint32_t n, uint8_t* sym,
                   const std::string& where) {
  const uint8_t* p = *pw;
  bool esc = false;
  for (; t < n; ++t) {
    uint32_t& x = xs[t % kNLanes];
    const uint32_t e = dec[x & (kTotal - 1)];
    x = (e & 0x1fff) * (x >> kScaleBits) + ((e >> 13) & 0xfff);
    if (x < kWordL) {
      if (wend - p < 2) words_end_early(where);
      x = x << 16 | uint32_t(p[0]) | uint32_t(p[1]) << 8;
      p += 2;
    }
    const uint32_t u = e >> 25;
    sym[t] = uint8_t(u);
    esc |= u == kEsc;
  }
  *pw = p;
  return esc;
}

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics warn of their own _mm512_undefined_epi32()
// (GCC bug 105593), once per use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// kNLanes tokens a step, as kNLanes / 16 vectors of 16 lanes (their
// gathers in flight together: with one vector of 16 states, each step
// waited on the last one's chain of gather, multiply and renormalisation,
// and a chunk decoded 1.3x slower in a standalone loop), while 2 kNLanes bytes
// remain (the most words a step takes, each vector's 16 loaded whole); the
// scalar kernel for the rest.
__attribute__((target("avx512f,avx512bw,avx512vl"))) bool rans32_avx512(const uint32_t* dec, uint32_t* xs, const uint8_t** pw, const uint8_t* wend,
                                                                        uint32_t n, uint8_t* sym, const std::string& where) {
  constexpr uint32_t G = kNLanes / 16;
  __m512i x[G];
  for (uint32_t g = 0; g < G; ++g) x[g] = _mm512_loadu_si512(xs + 16 * g);
  const __m512i m12 = _mm512_set1_epi32(kTotal - 1), m13 = _mm512_set1_epi32(0x1fff), lo = _mm512_set1_epi32(int(kWordL)),
                esc_u = _mm512_set1_epi32(kEsc);
  const uint8_t* p = *pw;
  __mmask16 esc = 0;
  uint32_t t = 0;
  for (; t < n && wend - p >= ptrdiff_t(2 * kNLanes); t += kNLanes) {
    __mmask16 act[G];
    for (uint32_t g = 0; g < G; ++g) {
      const int64_t rem = int64_t(n) - t - 16 * g;
      act[g] = rem >= 16 ? __mmask16(0xffff) : rem <= 0 ? __mmask16(0) : __mmask16((1u << rem) - 1);
      const __m512i e = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), act[g], _mm512_and_si512(x[g], m12), dec, 4);
      const __m512i xn = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_and_si512(e, m13), _mm512_srli_epi32(x[g], kScaleBits)),
                                          _mm512_and_si512(_mm512_srli_epi32(e, 13), m12));
      x[g] = _mm512_mask_mov_epi32(x[g], act[g], xn);
      const __m512i u = _mm512_srli_epi32(e, 25);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sym + t + 16 * g), _mm512_cvtepi32_epi8(u));  // sym has room up to a whole step
      esc |= _mm512_mask_cmpeq_epi32_mask(act[g], u, esc_u);
    }
    for (uint32_t g = 0; g < G; ++g) {  // lanes 16 g.. read after the lanes below
      const __mmask16 m = _mm512_mask_cmplt_epu32_mask(act[g], x[g], lo);
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      x[g] = _mm512_mask_or_epi32(x[g], m, _mm512_slli_epi32(x[g], 16), _mm512_maskz_expand_epi32(m, w));
      p += 2 * std::popcount(uint32_t(m));
    }
  }
  for (uint32_t g = 0; g < G; ++g) _mm512_storeu_si512(xs + 16 * g, x[g]);
  *pw = p;
  const bool tail = rans32_scalar(dec, xs, pw, wend, t, n, sym, where);
  return tail || esc;
}

// AVX2: the lanes as vectors of 8; a lane's word found through a table of
// the 256 masks (for lane l, the number of lanes below it that read one).
const uint32_t (*expand8_table())[8] {
  static const auto* tab = [] {
    auto* v = new uint32_t[256][8];
    for (uint32_t m = 0; m < 256; ++m)
      for (uint32_t l = 0; l < 8; ++l) v[m][l] = uint32_t(std::popcount(m & ((1u << l) - 1)));
    return v;
  }();
  return tab;
}

__attribute__((target("avx2"))) inline __m256i rans8_step(__m256i x, __m256i act, const uint32_t* dec, __m256i* u) {
  const __m256i m12 = _mm256_set1_epi32(kTotal - 1), m13 = _mm256_set1_epi32(0x1fff);
  const __m256i e = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(dec), _mm256_and_si256(x, m12), act, 4);
  const __m256i xn = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_and_si256(e, m13), _mm256_srli_epi32(x, kScaleBits)),
                                      _mm256_and_si256(_mm256_srli_epi32(e, 13), m12));
  *u = _mm256_srli_epi32(e, 25);
  return _mm256_blendv_epi8(x, xn, act);
}

__attribute__((target("avx2"))) inline __m256i rans8_renorm(__m256i x, __m256i act, const uint8_t** pp, const uint32_t (*tab)[8]) {
  const __m256i need = _mm256_and_si256(act, _mm256_cmpeq_epi32(_mm256_srli_epi32(x, 16), _mm256_setzero_si256()));
  const uint32_t m = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(*pp)));
  const __m256i wx = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tab[m])));
  *pp += 2 * std::popcount(m);
  return _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), wx), need);
}

__attribute__((target("avx2"))) bool rans32_avx2(const uint32_t* dec, uint32_t* xs, const uint8_t** pw, const uint8_t* wend, uint32_t n, uint8_t* sym,
                                                 const std::string& where) {
  constexpr uint32_t G = kNLanes / 8;
  const uint32_t(*tab)[8] = expand8_table();
  __m256i x[G];
  for (uint32_t g = 0; g < G; ++g) x[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 8 * g));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i esc_u = _mm256_set1_epi32(kEsc);
  const uint8_t* p = *pw;
  __m256i esc = _mm256_setzero_si256();
  uint32_t t = 0;
  for (; t < n && wend - p >= ptrdiff_t(2 * kNLanes); t += kNLanes) {
    __m256i act[G], u[G];
    for (uint32_t g = 0; g < G; ++g) {
      act[g] = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(8, std::max<int64_t>(0, int64_t(n) - t - 8 * g)))), lane);
      x[g] = rans8_step(x[g], act[g], dec, &u[g]);
      esc = _mm256_or_si256(esc, _mm256_and_si256(act[g], _mm256_cmpeq_epi32(u[g], esc_u)));
    }
    for (uint32_t g = 0; g < G; g += 2) {
      // 16 symbols < 64 to bytes in lane order (sym has room up to a whole step).
      const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(u[g], u[g + 1]), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sym + t + 8 * g), _mm_packus_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)));
    }
    for (uint32_t g = 0; g < G; ++g) x[g] = rans8_renorm(x[g], act[g], &p, tab);  // in lane order
  }
  for (uint32_t g = 0; g < G; ++g) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs + 8 * g), x[g]);
  *pw = p;
  const bool tail = rans32_scalar(dec, xs, pw, wend, t, n, sym, where);
  return tail || !_mm256_testz_si256(esc, esc);
}

// col[t] = dq[sym[t]] for t < n (4-byte T): the 64 entries in 4 registers,
// 16 tokens a step.
__attribute__((target("avx512f"))) void symbols_to_values_avx512(const uint8_t* sym, uint32_t n, const uint32_t* dq, uint32_t* col) {
  const __m512i d0 = _mm512_loadu_si512(dq), d1 = _mm512_loadu_si512(dq + 16), d2 = _mm512_loadu_si512(dq + 32), d3 = _mm512_loadu_si512(dq + 48);
  const __m512i hi_bit = _mm512_set1_epi32(32);
  uint32_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sym + t)));
    const __m512i a = _mm512_permutex2var_epi32(d0, idx, d1), b = _mm512_permutex2var_epi32(d2, idx, d3);
    _mm512_storeu_si512(col + t, _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, hi_bit), a, b));
  }
  for (; t < n; ++t) col[t] = dq[sym[t]];
}

#pragma GCC diagnostic pop
#endif

std::atomic<uint32_t> g_rans32{uint32_t(Rans32Kernel::kAuto)};

Rans32Kernel best_rans32() {
  const CpuFeatures& c = cpu_features();
  return c.avx512f && c.avx512bw && c.avx512vl ? Rans32Kernel::kAvx512 : c.avx2 ? Rans32Kernel::kAvx2 : Rans32Kernel::kScalar;
}

template <class T>
void symbols_to_values(const uint8_t* sym, uint32_t n, const T* dq, T* col, bool vec) {
  static_assert(sizeof(T) == 4);
#if defined(__x86_64__)
  if (vec) return symbols_to_values_avx512(sym, n, reinterpret_cast<const uint32_t*>(dq), reinterpret_cast<uint32_t*>(col));
#endif
  for (uint32_t t = 0; t < n; ++t) col[t] = dq[sym[t]];
}

// The bypass bits of kLanes32 (BitWriter's order), every read bounds-checked.
// acc holds `bits` unread bits (and above them, from a refill's last byte,
// more of the stream's own bits, read again by the next refill).
struct BitReader {
  const uint8_t *p, *end;
  const std::string& where;
  uint64_t acc = 0;
  uint32_t bits = 0;
  uint32_t get(uint32_t k) {  // k <= 25
    if (bits < k) refill(k);
    const uint32_t v = uint32_t(acc & ((uint64_t(1) << k) - 1));
    acc >>= k;
    bits -= k;
    return v;
  }
  void refill(uint32_t k) {
    if (end - p >= 8) {  // whole bytes up to 56..63 bits, one load
      uint64_t w;
      std::memcpy(&w, p, 8);
      acc |= w << bits;
      const uint32_t take = (63 - bits) >> 3;
      p += take;
      bits += 8 * take;
      return;
    }
    for (; bits < k; bits += 8) {
      if (p == end) throw Error(where + ": bypass bits end early (corrupt chunk)");
      acc |= uint64_t(*p++) << bits;
    }
  }
  // Every byte read, and what is left of the last one zero.
  bool at_end() const { return p == end && bits < 8 && acc == 0; }
};

// kLanes32 (docs/format.md "Entropy-coded chunks"): per component, its
// symbols by the kernel ecsq_rans32_kernel() picks, then the values: dq's
// directly when no symbol is escaped and nothing is shifted (nearly every
// component), else token by token with the bypass bits.
template <class T, class Value>
void decode_lanes32(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, T* cm, const std::string& where, Value value) {
  const Tables& T_ = tables();
  const size_t fixed = ecsq_fixed_bytes(ru, EcsqLayout::kLanes32);
  const uint8_t* ids = buf + 8;
  uint32_t x[kNLanes];
  for (uint32_t i = 0; i < kNLanes; ++i) {
    x[i] = get_u32(buf + 8 + ru + 4 * i);
    require(x[i] >= kWordL, where + ": rANS state out of range (corrupt chunk)");
  }
  const uint32_t nwords = get_u32(buf + 8 + ru + 4 * kNLanes);
  require(nwords <= (len - fixed) / 2, where + ": " + std::to_string(nwords) + " rANS words declared, the payload holds " +
                                           std::to_string((len - fixed) / 2) + " at most (corrupt chunk)");
  const uint8_t* w = buf + fixed;
  const uint8_t* const wend = w + 2 * size_t(nwords);
  BitReader br{wend, buf + len, where};
  const CodeValues<T, Value> cv(value, where);
  const T* dq = cv.dq;
  auto checked = [&cv](int64_t c) { return cv.checked(c); };
  thread_local std::vector<uint8_t> sym;
  sym.resize((size_t(n) + kNLanes - 1) / kNLanes * kNLanes);
  const Rans32Kernel kern = ecsq_rans32_kernel();
  const bool vec = vector_kernels() && cpu_features().avx512f;
  for (uint32_t j = 0; j < ru; ++j) {
    const uint32_t id = ids[j];
    T* col = &cm[size_t(j) * n];
    if (!id) {
      std::fill(col, col + n, T(0));
      continue;
    }
    const uint32_t* dec = T_.dec[id_table(id)];
    const uint32_t b = id_shift(id);
#if defined(__x86_64__)
    const bool esc = kern == Rans32Kernel::kAvx512 ? rans32_avx512(dec, x, &w, wend, n, sym.data(), where)
                     : kern == Rans32Kernel::kAvx2 ? rans32_avx2(dec, x, &w, wend, n, sym.data(), where)
                                                   : rans32_scalar(dec, x, &w, wend, 0, n, sym.data(), where);
#else
    const bool esc = rans32_scalar(dec, x, &w, wend, 0, n, sym.data(), where);
#endif
    if (!esc && b == 0) {
      symbols_to_values(sym.data(), n, dq, col, vec);
      continue;
    }
    if (!esc) {  // shifted: b bits a token (the strong components, ~1/5 at 16x)
      for (uint32_t t = 0; t < n; ++t) col[t] = checked(int64_t(unzigzag(sym[t])) * (int64_t(1) << b) + br.get(b));
      continue;
    }
    for (uint32_t t = 0; t < n; ++t) {
      uint32_t u = sym[t];
      if (u == kEsc) {  // 5 bits of length L, then L bits of u + 1 below its leading one
        const uint32_t nb = br.get(5);
        if (nb > 25) throw Error(where + ": escaped code longer than 25 bits (corrupt chunk)");
        u = ((1u << nb) | br.get(nb)) - 1;
      }
      int64_t c = unzigzag(u);
      if (b) c = c * (int64_t(1) << b) + br.get(b);
      col[t] = checked(c);
    }
  }
  require(w == wend, where + ": " + std::to_string((wend - w) / 2) + " rANS words left unread (corrupt chunk)");
  require(br.at_end(),
          where + ": " + std::to_string(br.end - br.p + br.bits / 8) + " bytes or nonzero padding after the bypass bits (corrupt chunk)");
  for (uint32_t s : x) require(s == kWordL, where + ": rANS states do not return to their start (corrupt chunk)");
}

template <class T, class Value>
void decode_components(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, EcsqLayout layout, T* cm, const std::string& where, Value value) {
  require(len >= ecsq_fixed_bytes(ru, layout), where + ": entropy-coded chunk of " + std::to_string(len) + " bytes, at least " +
                                                   std::to_string(ecsq_fixed_bytes(ru, layout)) + " expected");
  for (uint32_t j = 0; j < ru; ++j)
    if (buf[8 + j] > kLastId)
      throw Error(where + ": table id " + std::to_string(buf[8 + j]) + " of component " + std::to_string(j) + " (at most " + std::to_string(kLastId) +
                  " expected)");
  if (layout == EcsqLayout::kLanes32)
    decode_lanes32(buf, len, n, ru, cm, where, value);
  else
    decode_lanes4(buf, len, n, ru, cm, where, value);
}
}  // namespace

void ecsq_decode_chunk(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, EcsqLayout layout, float* d, const std::string& where,
                       bool component_major) {
  require(len >= ecsq_fixed_bytes(ru, layout), where + ": entropy-coded chunk of " + std::to_string(len) + " bytes, at least " +
                                                   std::to_string(ecsq_fixed_bytes(ru, layout)) + " expected");
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
  decode_components(buf, len, n, ru, layout, cm, where, [step, offset](int32_t c) { return ecsq_value(c, step, offset); });
  constexpr uint32_t kTile = 32;
  if (!component_major)
    for (uint32_t t0 = 0; t0 < n; t0 += kTile)
      for (uint32_t j0 = 0; j0 < ru; j0 += kTile)
        for (uint32_t t = t0; t < std::min(n, t0 + kTile); ++t)
          for (uint32_t j = j0; j < std::min(ru, j0 + kTile); ++j) d[size_t(t) * ru + j] = cm[size_t(j) * n + t];
}

void ecsq_decode_codes(const uint8_t* buf, size_t len, uint32_t n, uint32_t ru, EcsqLayout layout, int32_t* codes, const std::string& where) {
  decode_components(buf, len, n, ru, layout, codes, where, [](int32_t c) { return c; });
}

void ecsq_set_rans32_kernel(Rans32Kernel k) {
  const CpuFeatures& c = cpu_features();
  require(k != Rans32Kernel::kAvx2 || c.avx2, "ecsq_set_rans32_kernel: this CPU has no AVX2");
  require(k != Rans32Kernel::kAvx512 || best_rans32() == Rans32Kernel::kAvx512, "ecsq_set_rans32_kernel: this CPU has no AVX-512 F/BW/VL");
  g_rans32 = uint32_t(k);
}

Rans32Kernel ecsq_rans32_kernel() {
  const auto k = Rans32Kernel(g_rans32.load());
  if (k != Rans32Kernel::kAuto) return k;
  static const Rans32Kernel best = best_rans32();
  return vector_kernels() ? best : Rans32Kernel::kScalar;
}

}  // namespace kvtc::container
