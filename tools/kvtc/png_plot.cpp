// kvtc: PNG plots (see png_plot.h).
#include "png_plot.h"

#include <libdeflate.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "kvtc/error.h"
#include "kvtc/util.h"

namespace kvtc::plot {

namespace {

// 5x8 glyphs: rows 0-6 hold capitals and digits (baseline under row 6),
// row 7 the descenders of g, j, p, q, y and the comma.
struct Glyph {
  char c;
  const char* rows[8];
};

// clang-format off
constexpr Glyph kFont[] = {
  {' ', {"     ","     ","     ","     ","     ","     ","     ","     "}},
  {'0', {" ### ","#   #","#  ##","# # #","##  #","#   #"," ### ","     "}},
  {'1', {"  #  "," ##  ","  #  ","  #  ","  #  ","  #  "," ### ","     "}},
  {'2', {" ### ","#   #","    #","   # ","  #  "," #   ","#####","     "}},
  {'3', {"#####","   # ","  #  ","   # ","    #","#   #"," ### ","     "}},
  {'4', {"   # ","  ## "," # # ","#  # ","#####","   # ","   # ","     "}},
  {'5', {"#####","#    ","#### ","    #","    #","#   #"," ### ","     "}},
  {'6', {"  ## "," #   ","#    ","#### ","#   #","#   #"," ### ","     "}},
  {'7', {"#####","    #","   # ","  #  "," #   "," #   "," #   ","     "}},
  {'8', {" ### ","#   #","#   #"," ### ","#   #","#   #"," ### ","     "}},
  {'9', {" ### ","#   #","#   #"," ####","    #","   # "," ##  ","     "}},
  {'A', {" ### ","#   #","#   #","#####","#   #","#   #","#   #","     "}},
  {'B', {"#### ","#   #","#   #","#### ","#   #","#   #","#### ","     "}},
  {'C', {" ### ","#   #","#    ","#    ","#    ","#   #"," ### ","     "}},
  {'D', {"#### ","#   #","#   #","#   #","#   #","#   #","#### ","     "}},
  {'E', {"#####","#    ","#    ","#### ","#    ","#    ","#####","     "}},
  {'F', {"#####","#    ","#    ","#### ","#    ","#    ","#    ","     "}},
  {'G', {" ### ","#   #","#    ","# ###","#   #","#   #"," ####","     "}},
  {'H', {"#   #","#   #","#   #","#####","#   #","#   #","#   #","     "}},
  {'I', {" ### ","  #  ","  #  ","  #  ","  #  ","  #  "," ### ","     "}},
  {'J', {"  ###","   # ","   # ","   # ","   # ","#  # "," ##  ","     "}},
  {'K', {"#   #","#  # ","# #  ","##   ","# #  ","#  # ","#   #","     "}},
  {'L', {"#    ","#    ","#    ","#    ","#    ","#    ","#####","     "}},
  {'M', {"#   #","## ##","# # #","# # #","#   #","#   #","#   #","     "}},
  {'N', {"#   #","#   #","##  #","# # #","#  ##","#   #","#   #","     "}},
  {'O', {" ### ","#   #","#   #","#   #","#   #","#   #"," ### ","     "}},
  {'P', {"#### ","#   #","#   #","#### ","#    ","#    ","#    ","     "}},
  {'Q', {" ### ","#   #","#   #","#   #","# # #","#  # "," ## #","     "}},
  {'R', {"#### ","#   #","#   #","#### ","# #  ","#  # ","#   #","     "}},
  {'S', {" ####","#    ","#    "," ### ","    #","    #","#### ","     "}},
  {'T', {"#####","  #  ","  #  ","  #  ","  #  ","  #  ","  #  ","     "}},
  {'U', {"#   #","#   #","#   #","#   #","#   #","#   #"," ### ","     "}},
  {'V', {"#   #","#   #","#   #","#   #","#   #"," # # ","  #  ","     "}},
  {'W', {"#   #","#   #","#   #","# # #","# # #","# # #"," # # ","     "}},
  {'X', {"#   #","#   #"," # # ","  #  "," # # ","#   #","#   #","     "}},
  {'Y', {"#   #","#   #"," # # ","  #  ","  #  ","  #  ","  #  ","     "}},
  {'Z', {"#####","    #","   # ","  #  "," #   ","#    ","#####","     "}},
  {'a', {"     ","     "," ### ","    #"," ####","#   #"," ####","     "}},
  {'b', {"#    ","#    ","# ## ","##  #","#   #","#   #","#### ","     "}},
  {'c', {"     ","     "," ### ","#    ","#    ","#   #"," ### ","     "}},
  {'d', {"    #","    #"," ## #","#  ##","#   #","#   #"," ####","     "}},
  {'e', {"     ","     "," ### ","#   #","#####","#    "," ### ","     "}},
  {'f', {"  ## "," #  #"," #   ","###  "," #   "," #   "," #   ","     "}},
  {'g', {"     ","     "," ####","#   #","#   #"," ####","    #"," ### "}},
  {'h', {"#    ","#    ","# ## ","##  #","#   #","#   #","#   #","     "}},
  {'i', {"  #  ","     "," ##  ","  #  ","  #  ","  #  "," ### ","     "}},
  {'j', {"   # ","     ","  ## ","   # ","   # ","   # ","#  # "," ##  "}},
  {'k', {"#    ","#    ","#  # ","# #  ","##   ","# #  ","#  # ","     "}},
  {'l', {" ##  ","  #  ","  #  ","  #  ","  #  ","  #  "," ### ","     "}},
  {'m', {"     ","     ","## # ","# # #","# # #","#   #","#   #","     "}},
  {'n', {"     ","     ","# ## ","##  #","#   #","#   #","#   #","     "}},
  {'o', {"     ","     "," ### ","#   #","#   #","#   #"," ### ","     "}},
  {'p', {"     ","     ","#### ","#   #","#   #","#### ","#    ","#    "}},
  {'q', {"     ","     "," ####","#   #","#   #"," ####","    #","    #"}},
  {'r', {"     ","     ","# ## ","##  #","#    ","#    ","#    ","     "}},
  {'s', {"     ","     "," ####","#    "," ### ","    #","#### ","     "}},
  {'t', {" #   "," #   ","###  "," #   "," #   "," #  #","  ## ","     "}},
  {'u', {"     ","     ","#   #","#   #","#   #","#  ##"," ## #","     "}},
  {'v', {"     ","     ","#   #","#   #","#   #"," # # ","  #  ","     "}},
  {'w', {"     ","     ","#   #","#   #","# # #","# # #"," # # ","     "}},
  {'x', {"     ","     ","#   #"," # # ","  #  "," # # ","#   #","     "}},
  {'y', {"     ","     ","#   #","#   #","#   #"," ####","    #"," ### "}},
  {'z', {"     ","     ","#####","   # ","  #  "," #   ","#####","     "}},
  {'.', {"     ","     ","     ","     ","     "," ##  "," ##  ","     "}},
  {',', {"     ","     ","     ","     ","     "," ##  ","  #  "," #   "}},
  {'-', {"     ","     ","     "," ### ","     ","     ","     ","     "}},
  {'+', {"     ","  #  ","  #  ","#####","  #  ","  #  ","     ","     "}},
  {'=', {"     ","     ","#####","     ","#####","     ","     ","     "}},
  {'%', {"##   ","##  #","   # ","  #  "," #   ","#  ##","   ##","     "}},
  {'(', {"   # ","  #  "," #   "," #   "," #   ","  #  ","   # ","     "}},
  {')', {" #   ","  #  ","   # ","   # ","   # ","  #  "," #   ","     "}},
  {'[', {" ### "," #   "," #   "," #   "," #   "," #   "," ### ","     "}},
  {']', {" ### ","   # ","   # ","   # ","   # ","   # "," ### ","     "}},
  {':', {"     "," ##  "," ##  ","     "," ##  "," ##  ","     ","     "}},
  {';', {"     "," ##  "," ##  ","     "," ##  ","  #  "," #   ","     "}},
  {'/', {"     ","    #","   # ","  #  "," #   ","#    ","     ","     "}},
  {'_', {"     ","     ","     ","     ","     ","     ","     ","#####"}},
  {'|', {"  #  ","  #  ","  #  ","  #  ","  #  ","  #  ","  #  ","     "}},
  {'<', {"   # ","  #  "," #   ","#    "," #   ","  #  ","   # ","     "}},
  {'>', {" #   ","  #  ","   # ","    #","   # ","  #  "," #   ","     "}},
  {'*', {"     ","  #  ","# # #"," ### ","# # #","  #  ","     ","     "}},
  {'#', {" # # "," # # ","#####"," # # ","#####"," # # "," # # ","     "}},
  {'?', {" ### ","#   #","    #","   # ","  #  ","     ","  #  ","     "}},
  {'!', {"  #  ","  #  ","  #  ","  #  ","  #  ","     ","  #  ","     "}},
  {'\'', {"  #  ","  #  "," #   ","     ","     ","     ","     ","     "}},
  {'"', {" # # "," # # ","     ","     ","     ","     ","     ","     "}},
  {'^', {"  #  "," # # ","#   #","     ","     ","     ","     ","     "}},
  {'~', {"     ","     "," #   ","# # #","   # ","     ","     ","     "}},
  {'&', {" ##  ","#  # ","# #  "," #   ","# # #","#  # "," ## #","     "}},
};
// clang-format on

// Unknown characters: a box.
constexpr Glyph kBox = {'?', {"#####", "#   #", "#   #", "#   #", "#   #", "#   #", "#####", "     "}};

const Glyph& glyph(char ch) {
  static const std::array<const Glyph*, 128> table = [] {
    std::array<const Glyph*, 128> t{};
    for (const Glyph& g : kFont) t[size_t(uint8_t(g.c))] = &g;
    return t;
  }();
  const uint8_t u = uint8_t(ch);
  return u < 128 && table[u] ? *table[u] : kBox;
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

void put_be32(std::vector<uint8_t>& o, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) o.push_back(uint8_t(v >> s));
}

void put_chunk(std::vector<uint8_t>& o, const char type[4], const uint8_t* data, size_t n) {
  put_be32(o, uint32_t(n));
  const size_t at = o.size();
  o.insert(o.end(), type, type + 4);
  if (n) o.insert(o.end(), data, data + n);
  const uint32_t crc = libdeflate_crc32(0, o.data() + at, n + 4);
  put_be32(o, crc);
}

// "Nice" step near range / target (1, 2, 2.5 or 5 times a power of ten).
double nice_step(double range, int target) {
  if (!(range > 0)) return 1;
  const double raw = range / target, p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

}  // namespace

Rgb series_color(size_t i) {
  static const Rgb pal[] = {{31, 119, 180}, {255, 127, 14},  {44, 160, 44},   {214, 39, 40},  {148, 103, 189},
                            {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};
  return pal[i % (sizeof pal / sizeof pal[0])];
}

Rgb viridis(double t) {
  // Samples of matplotlib's viridis at t = 0, 1/8, ..., 1.
  static const double cm[9][3] = {{68, 1, 84},    {71, 44, 122}, {59, 81, 139},  {44, 113, 142}, {33, 144, 141},
                                  {39, 173, 129}, {92, 200, 99}, {170, 220, 50}, {253, 231, 37}};
  if (!(t >= 0)) t = 0;  // also NaN
  if (t > 1) t = 1;
  const double f = t * 8;
  const int i = std::min(7, int(f));
  const double u = f - i;
  Rgb c;
  c.r = uint8_t(std::lround(cm[i][0] + u * (cm[i + 1][0] - cm[i][0])));
  c.g = uint8_t(std::lround(cm[i][1] + u * (cm[i + 1][1] - cm[i][1])));
  c.b = uint8_t(std::lround(cm[i][2] + u * (cm[i + 1][2] - cm[i][2])));
  return c;
}

Canvas::Canvas(int width, int height, Rgb bg) : w_(width), h_(height) {
  require(width > 0 && height > 0 && width <= 16384 && height <= 16384, "plot: canvas size out of range");
  px_.resize(size_t(w_) * h_ * 3);
  for (size_t i = 0; i < px_.size(); i += 3) {
    px_[i] = bg.r;
    px_[i + 1] = bg.g;
    px_[i + 2] = bg.b;
  }
}

void Canvas::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
  uint8_t* p = &px_[(size_t(y) * w_ + x) * 3];
  p[0] = c.r;
  p[1] = c.g;
  p[2] = c.b;
}

Rgb Canvas::get(int x, int y) const {
  if (x < 0 || y < 0 || x >= w_ || y >= h_) return {};
  const uint8_t* p = &px_[(size_t(y) * w_ + x) * 3];
  return {p[0], p[1], p[2]};
}

void Canvas::fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
  x0 = std::max(x0, 0), y0 = std::max(y0, 0), x1 = std::min(x1, w_), y1 = std::min(y1, h_);
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) set(x, y, c);
}

void Canvas::rect_outline(int x0, int y0, int x1, int y1, Rgb c) {
  line(x0, y0, x1 - 1, y0, c);
  line(x0, y1 - 1, x1 - 1, y1 - 1, c);
  line(x0, y0, x0, y1 - 1, c);
  line(x1 - 1, y0, x1 - 1, y1 - 1, c);
}

void Canvas::line(int x0, int y0, int x1, int y1, Rgb c, int thickness) {
  // Bresenham with a square brush.
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  const int lo = -(thickness - 1) / 2, hi = thickness / 2;
  int err = dx + dy;
  for (int guard = 0; guard < 100000; ++guard) {
    for (int a = lo; a <= hi; ++a)
      for (int b = lo; b <= hi; ++b) set(x0 + a, y0 + b, c);
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) err += dy, x0 += sx;
    if (e2 <= dx) err += dx, y0 += sy;
  }
}

int Canvas::text_width(const std::string& s, int scale) {
  return s.empty() ? 0 : (int(s.size()) * 6 - 1) * scale;
}

void Canvas::text(int x, int y, const std::string& s, Rgb c, int scale, Align align) {
  const int w = text_width(s, scale);
  if (align == Align::kCenter) x -= w / 2;
  if (align == Align::kRight) x -= w;
  for (size_t i = 0; i < s.size(); ++i) {
    const Glyph& g = glyph(s[i]);
    for (int r = 0; r < 8; ++r)
      for (int k = 0; k < 5; ++k)
        if (g.rows[r][k] == '#') fill_rect(x + (int(i) * 6 + k) * scale, y + r * scale, x + (int(i) * 6 + k + 1) * scale, y + (r + 1) * scale, c);
  }
}

void Canvas::text_vertical(int x, int y_center, const std::string& s, Rgb c, int scale) {
  // Glyph pixel (gx, gy) of the horizontal text goes to (x + gy, y0 - gx).
  const int y0 = y_center + text_width(s, scale) / 2;
  for (size_t i = 0; i < s.size(); ++i) {
    const Glyph& g = glyph(s[i]);
    for (int r = 0; r < 8; ++r)
      for (int k = 0; k < 5; ++k)
        if (g.rows[r][k] == '#') {
          const int gx = int(i) * 6 + k;
          fill_rect(x + r * scale, y0 - (gx + 1) * scale, x + (r + 1) * scale, y0 - gx * scale, c);
        }
  }
}

std::vector<uint8_t> Canvas::encode_png(int level) const {
  // Raw scanlines, each with filter type 0 (None).
  const size_t stride = size_t(w_) * 3;
  std::vector<uint8_t> raw((stride + 1) * h_);
  for (int y = 0; y < h_; ++y) {
    raw[y * (stride + 1)] = 0;
    std::memcpy(&raw[y * (stride + 1) + 1], &px_[y * stride], stride);
  }
  libdeflate_compressor* comp = libdeflate_alloc_compressor(level);
  require(comp != nullptr, "plot: cannot allocate a DEFLATE compressor");
  std::vector<uint8_t> z(libdeflate_zlib_compress_bound(comp, raw.size()));
  const size_t zn = libdeflate_zlib_compress(comp, raw.data(), raw.size(), z.data(), z.size());
  libdeflate_free_compressor(comp);
  require(zn > 0, "plot: DEFLATE failed");
  std::vector<uint8_t> o = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, uint32_t(w_));
  put_be32(ihdr, uint32_t(h_));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit, RGB, deflate, filter method 0, no interlace
  put_chunk(o, "IHDR", ihdr.data(), ihdr.size());
  put_chunk(o, "IDAT", z.data(), zn);
  put_chunk(o, "IEND", nullptr, 0);
  return o;
}

void Canvas::save_png(const std::string& path) const {
  const std::vector<uint8_t> b = encode_png();
  write_file_atomic(path, b);
}

std::string tick_label(double v, double step) {
  if (std::fabs(v) < step * 1e-9) v = 0;
  char b[64];
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-4)) {
    std::snprintf(b, sizeof b, "%.3g", v);
    return b;
  }
  int dec = 0;
  if (step < 1) dec = std::min(8, int(std::ceil(-std::log10(step) - 1e-9)));
  // A step like 0.25 needs one more decimal than its order of magnitude.
  const double scaled = step * std::pow(10.0, dec);
  if (std::fabs(scaled - std::round(scaled)) > 1e-6) ++dec;
  std::snprintf(b, sizeof b, "%.*f", dec, v);
  return b;
}

void draw_line_plot(Canvas& c, const Rect& r, const LinePlot& p) {
  const int fs = 2;  // font scale
  const int th = Canvas::text_height(fs);
  // Data range.
  double xlo = p.x_min, xhi = p.x_max, ylo = p.y_min, yhi = p.y_max;
  double dxlo = INFINITY, dxhi = -INFINITY, dylo = INFINITY, dyhi = -INFINITY;
  for (const Series& s : p.series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      if ((p.log_x && s.x[i] <= 0) || (p.log_y && s.y[i] <= 0)) continue;
      dxlo = std::min(dxlo, s.x[i]), dxhi = std::max(dxhi, s.x[i]);
      dylo = std::min(dylo, s.y[i]), dyhi = std::max(dyhi, s.y[i]);
    }
  if (!std::isfinite(dxlo)) dxlo = p.log_x ? 1 : 0, dxhi = p.log_x ? 10 : 1, dylo = p.log_y ? 1 : 0, dyhi = p.log_y ? 10 : 1;
  auto widen = [](double& lo, double& hi, bool log) {
    if (hi > lo) return;
    if (log)
      lo /= 2, hi *= 2;
    else
      lo -= lo == 0 ? 1 : std::fabs(lo) * 0.1, hi += hi == 0 ? 1 : std::fabs(hi) * 0.1;
  };
  const bool auto_x = std::isnan(xlo) || std::isnan(xhi), auto_y = std::isnan(ylo) || std::isnan(yhi);
  if (std::isnan(xlo)) xlo = dxlo;
  if (std::isnan(xhi)) xhi = dxhi;
  if (std::isnan(ylo)) ylo = dylo;
  if (std::isnan(yhi)) yhi = dyhi;
  widen(xlo, xhi, p.log_x);
  widen(ylo, yhi, p.log_y);
  // Log axes: pad by a tenth of a decade; linear: round out to the step.
  double xstep = 0, ystep = 0;
  if (p.log_x) {
    if (auto_x) xlo /= 1.26, xhi *= 1.26;
  } else {
    xstep = nice_step(xhi - xlo, 6);
    if (auto_x) xlo = std::floor(xlo / xstep + 1e-9) * xstep, xhi = std::ceil(xhi / xstep - 1e-9) * xstep;
  }
  if (p.log_y) {
    if (auto_y) ylo /= 1.26, yhi *= 1.26;
  } else {
    ystep = nice_step(yhi - ylo, 6);
    if (auto_y) ylo = std::floor(ylo / ystep + 1e-9) * ystep, yhi = std::ceil(yhi / ystep - 1e-9) * ystep;
  }
  auto fx = [&](double v) { return p.log_x ? (std::log(v) - std::log(xlo)) / (std::log(xhi) - std::log(xlo)) : (v - xlo) / (xhi - xlo); };
  auto fy = [&](double v) { return p.log_y ? (std::log(v) - std::log(ylo)) / (std::log(yhi) - std::log(ylo)) : (v - ylo) / (yhi - ylo); };

  // Ticks.
  auto make_ticks = [](double lo, double hi, bool log, double step, const std::vector<std::pair<double, std::string>>& given) {
    std::vector<std::pair<double, std::string>> t;
    if (!given.empty()) {
      for (const auto& g : given)
        if (g.first >= lo * (1 - 1e-9) && g.first <= hi * (1 + 1e-9) + (log ? 0 : 1e-12)) t.push_back(g);
      return t;
    }
    if (log) {
      const int e0 = int(std::floor(std::log10(lo))), e1 = int(std::ceil(std::log10(hi)));
      const bool few = e1 - e0 <= 3;
      for (int e = e0; e <= e1; ++e)
        for (double m : few ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
          const double v = m * std::pow(10.0, e);
          if (v >= lo && v <= hi) t.push_back({v, tick_label(v, std::pow(10.0, e))});
        }
      return t;
    }
    for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) t.push_back({v, tick_label(v, step)});
    return t;
  };
  const auto xt = make_ticks(xlo, xhi, p.log_x, xstep, p.x_ticks);
  const auto yt = make_ticks(ylo, yhi, p.log_y, ystep, p.y_ticks);

  int ylab_w = 0;
  for (const auto& t : yt) ylab_w = std::max(ylab_w, Canvas::text_width(t.second, fs));
  const int left = r.x + 10 + (p.ylabel.empty() ? 0 : th + 10) + ylab_w + 8;
  const int top = r.y + 10 + (p.title.empty() ? 0 : th + 12);
  const int right = r.x + r.w - 20;
  const int bottom = r.y + r.h - 10 - (p.xlabel.empty() ? 0 : th + 10) - th - 10;
  require(right - left > 20 && bottom - top > 20, "plot: panel too small");
  auto px = [&](double v) { return left + int(std::lround(fx(v) * (right - left))); };
  auto py = [&](double v) { return bottom - int(std::lround(fy(v) * (bottom - top))); };

  if (!p.title.empty()) c.text((left + right) / 2, r.y + 10, p.title, kBlack, fs, Align::kCenter);
  // Grid, ticks and labels.
  for (const auto& t : xt) {
    const int x = px(t.first);
    c.line(x, top, x, bottom, kLightGrey);
    c.line(x, bottom, x, bottom + 5, kBlack);
    c.text(x, bottom + 9, t.second, kBlack, fs, Align::kCenter);
  }
  for (const auto& t : yt) {
    const int y = py(t.first);
    c.line(left, y, right, y, kLightGrey);
    c.line(left - 5, y, left, y, kBlack);
    c.text(left - 8, y - th / 2 + fs, t.second, kBlack, fs, Align::kRight);
  }
  c.rect_outline(left, top, right + 1, bottom + 1, kBlack);
  if (!p.xlabel.empty()) c.text((left + right) / 2, bottom + 9 + th + 10, p.xlabel, kBlack, fs, Align::kCenter);
  if (!p.ylabel.empty()) c.text_vertical(r.x + 10, (top + bottom) / 2, p.ylabel, kBlack, fs);

  // Series: lines between consecutive finite points, then markers.
  for (const Series& s : p.series) {
    bool have = false;
    int lx = 0, ly = 0;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      const bool ok = std::isfinite(s.x[i]) && std::isfinite(s.y[i]) && !(p.log_x && s.x[i] <= 0) && !(p.log_y && s.y[i] <= 0);
      if (!ok) {
        have = false;
        continue;
      }
      const int x = px(s.x[i]), y = py(s.y[i]);
      if (have) c.line(lx, ly, x, y, s.color, 2);
      have = true, lx = x, ly = y;
    }
    if (s.markers)
      for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
        if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (p.log_x && s.x[i] <= 0) || (p.log_y && s.y[i] <= 0)) continue;
        const int x = px(s.x[i]), y = py(s.y[i]);
        c.fill_rect(x - 3, y - 3, x + 4, y + 4, s.color);
      }
  }

  // Legend.
  if (p.legend != LinePlot::Legend::kNone && !p.series.empty()) {
    int lw = 0;
    for (const Series& s : p.series) lw = std::max(lw, Canvas::text_width(s.label, fs));
    const int bw = lw + 50, bh = int(p.series.size()) * (th + 8) + 10;
    auto box = [&](LinePlot::Legend l) {
      const bool at_left = l == LinePlot::Legend::kTopLeft || l == LinePlot::Legend::kBottomLeft;
      const bool at_top = l == LinePlot::Legend::kTopLeft || l == LinePlot::Legend::kTopRight;
      return std::pair<int, int>{at_left ? left + 10 : right - 10 - bw, at_top ? top + 10 : bottom - 10 - bh};
    };
    LinePlot::Legend where = p.legend;
    if (where == LinePlot::Legend::kAuto) {
      // Points along every drawn segment, about 2 px apart.
      std::vector<std::pair<int, int>> pts;
      for (const Series& s : p.series) {
        bool have = false;
        int lx = 0, ly = 0;
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
          if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (p.log_x && s.x[i] <= 0) || (p.log_y && s.y[i] <= 0)) {
            have = false;
            continue;
          }
          const int x = px(s.x[i]), y = py(s.y[i]);
          const int n = have ? std::max(1, std::max(std::abs(x - lx), std::abs(y - ly)) / 2) : 0;
          for (int k = 0; k <= n; ++k) pts.push_back({lx + (x - lx) * k / std::max(1, n), ly + (y - ly) * k / std::max(1, n)});
          if (!have) pts.push_back({x, y});
          have = true, lx = x, ly = y;
        }
      }
      size_t best = SIZE_MAX;
      for (LinePlot::Legend l :
           {LinePlot::Legend::kTopRight, LinePlot::Legend::kTopLeft, LinePlot::Legend::kBottomRight, LinePlot::Legend::kBottomLeft}) {
        const auto [x0, y0] = box(l);
        size_t n = 0;
        for (const auto& [x, y] : pts) n += x >= x0 - 6 && x < x0 + bw + 6 && y >= y0 - 6 && y < y0 + bh + 6;
        if (n < best) best = n, where = l;
      }
    }
    const auto [bx, by] = box(where);
    c.fill_rect(bx, by, bx + bw, by + bh, kWhite);
    c.rect_outline(bx, by, bx + bw, by + bh, kGrey);
    for (size_t i = 0; i < p.series.size(); ++i) {
      const int y = by + 9 + int(i) * (th + 8) + th / 2;
      c.line(bx + 8, y, bx + 34, y, p.series[i].color, 2);
      if (p.series[i].markers) c.fill_rect(bx + 18, y - 3, bx + 25, y + 4, p.series[i].color);
      c.text(bx + 42, y - th / 2 + fs, p.series[i].label, kBlack, fs);
    }
  }
}

void draw_heatmap(Canvas& c, const Rect& r, const Heatmap& h) {
  require(h.rows > 0 && h.cols > 0 && h.values.size() == size_t(h.rows) * h.cols, "plot: heatmap values do not match rows x cols");
  const int fs = h.font_scale, th = Canvas::text_height(fs);
  double lo = h.vmin, hi = h.vmax;
  if (std::isnan(lo) || std::isnan(hi)) {
    double a = INFINITY, b = -INFINITY;
    for (double v : h.values)
      if (std::isfinite(v)) a = std::min(a, v), b = std::max(b, v);
    if (!std::isfinite(a)) a = 0, b = 1;
    if (std::isnan(lo)) lo = a;
    if (std::isnan(hi)) hi = b;
  }
  if (!(hi > lo)) hi = lo + 1;
  int rl_w = 0;
  for (const auto& s : h.row_labels) rl_w = std::max(rl_w, Canvas::text_width(s, fs));
  const int cbar_w = h.colorbar ? 20 : 0;
  // Colour bar tick labels.
  const double cstep = nice_step(hi - lo, 5);
  std::vector<std::pair<double, std::string>> ct;
  if (h.colorbar)
    for (double v = std::ceil(lo / cstep - 1e-9) * cstep; v <= hi + cstep * 1e-9; v += cstep) ct.push_back({v, tick_label(v, cstep)});
  int ct_w = 0;
  for (const auto& t : ct) ct_w = std::max(ct_w, Canvas::text_width(t.second, fs));
  const int left = r.x + 10 + (h.row_title.empty() ? 0 : th + 8) + rl_w + 6;
  const int top = r.y + 10 + (h.title.empty() ? 0 : th + 10);
  const int right_limit = r.x + r.w - 10 - (h.colorbar ? cbar_w + 16 + 8 + ct_w : 0);
  const int bottom_limit = r.y + r.h - 10 - (h.col_title.empty() ? 0 : th + 8) - th - 8;
  // Square-ish cells of whole pixels.
  const int cw = std::max(1, (right_limit - left) / h.cols), ch = std::max(1, (bottom_limit - top) / h.rows);
  const int cell = std::min(cw, ch);
  const int cellw = h.annotate.empty() ? cell : cw, cellh = h.annotate.empty() ? cell : ch;
  const int right = left + cellw * h.cols, bottom = top + cellh * h.rows;
  if (!h.title.empty()) c.text((left + right) / 2, r.y + 10, h.title, kBlack, fs, Align::kCenter);
  for (int i = 0; i < h.rows; ++i)
    for (int j = 0; j < h.cols; ++j) {
      const double v = h.values[size_t(i) * h.cols + j];
      const Rgb col = std::isfinite(v) ? viridis((v - lo) / (hi - lo)) : kGrey;
      const int x0 = left + j * cellw, y0 = top + i * cellh;
      c.fill_rect(x0, y0, x0 + cellw, y0 + cellh, col);
      if (!h.annotate.empty() && std::isfinite(v)) {
        char b[64];
        std::snprintf(b, sizeof b, h.annotate.c_str(), v);
        const double lum = 0.299 * col.r + 0.587 * col.g + 0.114 * col.b;
        c.text(x0 + cellw / 2, y0 + cellh / 2 - th / 2 + fs, b, lum > 128 ? kBlack : kWhite, fs, Align::kCenter);
      }
    }
  if (!h.annotate.empty()) {
    for (int i = 1; i < h.rows; ++i) c.line(left, top + i * cellh, right - 1, top + i * cellh, kWhite);
    for (int j = 1; j < h.cols; ++j) c.line(left + j * cellw, top, left + j * cellw, bottom - 1, kWhite);
  }
  c.rect_outline(left - 1, top - 1, right + 1, bottom + 1, kBlack);
  for (int i = 0; i < h.rows && i < int(h.row_labels.size()); ++i)
    if (!h.row_labels[i].empty()) {
      const int y = top + i * cellh + cellh / 2;
      c.line(left - 5, y, left - 2, y, kBlack);
      c.text(left - 7, y - th / 2 + fs, h.row_labels[i], kBlack, fs, Align::kRight);
    }
  for (int j = 0; j < h.cols && j < int(h.col_labels.size()); ++j)
    if (!h.col_labels[j].empty()) {
      const int x = left + j * cellw + cellw / 2;
      c.line(x, bottom + 1, x, bottom + 4, kBlack);
      c.text(x, bottom + 7, h.col_labels[j], kBlack, fs, Align::kCenter);
    }
  if (!h.col_title.empty()) c.text((left + right) / 2, bottom + 7 + th + 8, h.col_title, kBlack, fs, Align::kCenter);
  if (!h.row_title.empty()) c.text_vertical(r.x + 10, (top + bottom) / 2, h.row_title, kBlack, fs);
  if (h.colorbar) {
    const int bx = right + 16, by0 = top, by1 = bottom;
    for (int y = by0; y < by1; ++y) {
      const double t = 1.0 - double(y - by0) / std::max(1, by1 - by0 - 1);
      c.line(bx, y, bx + cbar_w - 1, y, viridis(t));
    }
    c.rect_outline(bx - 1, by0 - 1, bx + cbar_w + 1, by1 + 1, kBlack);
    for (const auto& t : ct) {
      const int y = by1 - 1 - int(std::lround((t.first - lo) / (hi - lo) * (by1 - by0 - 1)));
      c.line(bx + cbar_w, y, bx + cbar_w + 4, y, kBlack);
      c.text(bx + cbar_w + 8, y - th / 2 + fs, t.second, kBlack, fs);
    }
  }
}

}  // namespace kvtc::plot
