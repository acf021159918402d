// kvtc: a small PNG plotter for the analysis figures — an RGB canvas, a
// built-in 5x7 bitmap font (digits, ASCII letters and common punctuation),
// line plots with axes, ticks and a legend, and heatmaps with a colour
// scale. Encoded as 8-bit RGB PNG with libdeflate (zlib stream, CRC-32).
// No anti-aliasing: enough for figures in a results page, nothing more.
// Thread safety: plain values; a Canvas is not shared between threads.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvtc::plot {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};
constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kBlack{0, 0, 0};
constexpr Rgb kGrey{128, 128, 128};
constexpr Rgb kLightGrey{225, 225, 225};
// A qualitative palette for line series (Tableau 10 order).
Rgb series_color(size_t i);
// Viridis, t in [0, 1] (clamped).
Rgb viridis(double t);

enum class Align { kLeft, kCenter, kRight };

class Canvas {
 public:
  Canvas(int width, int height, Rgb background = kWhite);
  int width() const { return w_; }
  int height() const { return h_; }
  void set(int x, int y, Rgb c);  // clipped
  Rgb get(int x, int y) const;
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c);  // [x0, x1) x [y0, y1)
  void rect_outline(int x0, int y0, int x1, int y1, Rgb c);
  void line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
  // Text with its top at y; x is the left edge, centre or right edge by
  // align. Glyphs are 5x7 (8 with descenders), advance 6, times scale.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 1, Align align = Align::kLeft);
  // The same rotated 90 degrees counter-clockwise (reads bottom to top);
  // (x, y) is the left edge of the text's top and its vertical centre.
  void text_vertical(int x, int y_center, const std::string& s, Rgb c, int scale = 1);
  static int text_width(const std::string& s, int scale = 1);
  static int text_height(int scale = 1) { return 8 * scale; }

  std::vector<uint8_t> encode_png(int deflate_level = 9) const;
  void save_png(const std::string& path) const;  // atomic (write_file_atomic)

 private:
  int w_, h_;
  std::vector<uint8_t> px_;  // RGB, row-major
};

// A rectangle on the canvas to draw one figure panel into.
struct Rect {
  int x = 0, y = 0, w = 0, h = 0;
};

struct Series {
  std::string label;
  std::vector<double> x, y;  // points; NaN y values are skipped (gaps)
  Rgb color{31, 119, 180};
  bool markers = true;
};

struct LinePlot {
  std::string title, xlabel, ylabel;
  std::vector<Series> series;
  bool log_x = false, log_y = false;
  // Axis range; NaN: from the data (linear axes get "nice" rounded ends).
  double x_min = 0.0 / 0.0, x_max = 0.0 / 0.0, y_min = 0.0 / 0.0, y_max = 0.0 / 0.0;
  // Explicit ticks (value, label); empty: automatic.
  std::vector<std::pair<double, std::string>> x_ticks, y_ticks;
  // kAuto: the corner whose box covers the fewest points of the lines.
  enum class Legend { kAuto, kTopLeft, kTopRight, kBottomLeft, kBottomRight, kNone } legend = Legend::kAuto;
};
void draw_line_plot(Canvas& c, const Rect& r, const LinePlot& p);

struct Heatmap {
  std::string title;
  int rows = 0, cols = 0;
  std::vector<double> values;                 // [rows][cols]; NaN drawn grey
  double vmin = 0.0 / 0.0, vmax = 0.0 / 0.0;  // NaN: from the data
  // Labels per row / column; empty strings are skipped (label every k-th).
  std::vector<std::string> row_labels, col_labels;
  std::string row_title, col_title;
  // Print each value in its cell with this printf format (e.g. "%.3f");
  // empty: no numbers.
  std::string annotate;
  bool colorbar = true;
  int font_scale = 2;
};
void draw_heatmap(Canvas& c, const Rect& r, const Heatmap& h);

// Tick label of a value on an axis whose ticks are `step` apart.
std::string tick_label(double v, double step);

}  // namespace kvtc::plot
