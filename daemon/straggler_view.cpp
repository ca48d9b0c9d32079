#include "daemon/straggler_view.h"

#include "common/atomic_file.h"
#include "common/error.h"

#include <cairo.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {
namespace {

// The report, checked once, so the views below never meet a wrong type.
struct Report {
  struct Rank {
    int rank = 0;
    std::optional<double> median_ms;
    double score = 0;
    double slowdown = 0;
    double cpu_wait_share = 0;
    double stalled_share = 0;
    double evidence = 0;
    double host_evidence = 0;
    double stall_evidence = 0;
    bool flagged = false;
    std::string cause;  // empty unless flagged
  };
  int64_t window = 0;
  double threshold = 0;
  int64_t false_alarm_steps = 0;
  double sync_tax = 1;
  std::optional<double> noise, decision_interval;
  std::vector<Rank> ranks;
  std::vector<int64_t> steps;
  std::vector<std::vector<std::optional<double>>> compute_ms;  // [rank][step]
};

std::optional<double> optional_number(const nlohmann::json& j) {
  return j.is_null() ? std::nullopt : std::optional(j.get<double>());
}

Report parse(const nlohmann::json& j) {
  try {
    Report r;
    r.window = j.at("window").get<int64_t>();
    r.threshold = j.at("threshold").get<double>();
    r.false_alarm_steps = j.at("false_alarm_steps").get<int64_t>();
    r.sync_tax = j.at("sync_tax").get<double>();
    r.noise = optional_number(j.at("noise"));
    r.decision_interval = optional_number(j.at("decision_interval"));
    for (const auto& rank : j.at("ranks")) {
      r.ranks.push_back({rank.at("rank").get<int>(), optional_number(rank.at("median_compute_ms")),
                         rank.at("score").get<double>(), rank.at("slowdown").get<double>(),
                         rank.at("cpu_wait_share").get<double>(), rank.at("stalled_share").get<double>(),
                         rank.at("evidence").get<double>(), rank.at("host_evidence").get<double>(),
                         rank.at("stall_evidence").get<double>(), rank.at("flagged").get<bool>(),
                         rank.at("cause").is_null() ? std::string() : rank.at("cause").get<std::string>()});
    }
    r.steps = j.at("steps").get<std::vector<int64_t>>();
    for (const auto& row : j.at("compute_ms")) {
      auto& out = r.compute_ms.emplace_back();
      for (const auto& ms : row) out.push_back(optional_number(ms));
      if (out.size() != r.steps.size()) {
        throw std::invalid_argument("a compute_ms row does not have one entry per step");
      }
    }
    if (r.compute_ms.size() != r.ranks.size()) throw std::invalid_argument("compute_ms does not have one row per rank");
    return r;
  } catch (const std::exception& e) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("keeld's straggler report is not what this keelctl reads ({}): {}", e.what(),
                                    j.dump().substr(0, 200)));
  }
}

struct Rgb {
  double r, g, b;
};

// Dark blue (fast) through teal and green to yellow (slow); readable in
// grey and by the colour-blind.
Rgb colour(double t) {
  static constexpr std::array<Rgb, 5> kStops = {{{0.267, 0.005, 0.329},
                                                 {0.231, 0.322, 0.545},
                                                 {0.129, 0.569, 0.549},
                                                 {0.369, 0.788, 0.384},
                                                 {0.993, 0.906, 0.144}}};
  t = std::clamp(t, 0.0, 1.0) * (kStops.size() - 1);
  const size_t i = std::min(static_cast<size_t>(t), kStops.size() - 2);
  const double f = t - static_cast<double>(i);
  const Rgb& a = kStops[i];
  const Rgb& b = kStops[i + 1];
  return {a.r + f * (b.r - a.r), a.g + f * (b.g - a.g), a.b + f * (b.b - a.b)};
}
constexpr Rgb kUnseen = {0.85, 0.85, 0.85};
constexpr Rgb kFlagged = {0.85, 0.1, 0.1};

// The heat map binned to at most `cols` x `rows` cells: steps by their
// mean, ranks by their maximum.
struct Binned {
  size_t cols = 0, rows = 0;
  std::vector<std::optional<double>> cells;  // row-major
  double lo = 0, hi = 1;                     // the colour scale
};

Binned bin(const Report& r, size_t max_cols, size_t max_rows) {
  Binned b;
  b.cols = std::min(r.steps.size(), max_cols);
  b.rows = std::min(r.ranks.size(), max_rows);
  b.cells.resize(b.cols * b.rows);
  std::vector<double> seen;
  for (size_t row = 0; row < b.rows; ++row) {
    const size_t rank_begin = row * r.ranks.size() / b.rows, rank_end = (row + 1) * r.ranks.size() / b.rows;
    for (size_t col = 0; col < b.cols; ++col) {
      const size_t step_begin = col * r.steps.size() / b.cols, step_end = (col + 1) * r.steps.size() / b.cols;
      std::optional<double> cell;
      for (size_t rank = rank_begin; rank < rank_end; ++rank) {
        double sum = 0;
        int n = 0;
        for (size_t s = step_begin; s < step_end; ++s) {
          if (const auto& ms = r.compute_ms[rank][s]) {
            sum += *ms;
            ++n;
          }
        }
        if (n > 0) cell = std::max(cell.value_or(-INFINITY), sum / n);
      }
      b.cells[row * b.cols + col] = cell;
      if (cell) seen.push_back(*cell);
    }
  }
  if (!seen.empty()) {
    // The 2nd to 98th percentile: one preempted step does not wash the
    // rest of the map into one colour.
    std::sort(seen.begin(), seen.end());
    b.lo = seen[seen.size() * 2 / 100];
    b.hi = seen[seen.size() * 98 / 100];
    if (!(b.hi > b.lo)) b.hi = b.lo + std::max(1e-3, std::abs(b.lo) * 0.01);
  }
  return b;
}

void set(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r, c.g, c.b); }

// Draws `text` with its anchor at (x, y): `ax`, `ay` in [0, 1] place the
// anchor from the text's left/top (0) to its right/bottom (1).
void label(cairo_t* cr, const std::string& text, double x, double y, double ax, double ay) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, text.c_str(), &e);
  cairo_move_to(cr, x - e.x_bearing - ax * e.width, y - e.y_bearing - ay * e.height);
  cairo_show_text(cr, text.c_str());
}

std::string ms_text(double ms) { return ms >= 100 ? fmt::format("{:.0f}", ms) : fmt::format("{:.3g}", ms); }

void draw(cairo_t* cr, const Report& r) {
  constexpr double left = kStragglerMapLeft, right = kStragglerMapRight, top = kStragglerMapTop,
                   bottom = kStragglerMapBottom;
  set(cr, {1, 1, 1});
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
  cairo_set_font_size(cr, 16);
  set(cr, {0, 0, 0});
  std::vector<std::string> flagged;
  for (const auto& rank : r.ranks) {
    if (rank.flagged) flagged.push_back(std::to_string(rank.rank));
  }
  label(cr,
        fmt::format("Compute time per step and rank: sync tax {:.3f}, {}", r.sync_tax,
                    flagged.empty() ? std::string("no rank flagged")
                                    : fmt::format("flagged: rank {}", fmt::join(flagged, ", "))),
        kStragglerPlotWidth / 2.0, 18, 0.5, 0.5);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 12);
  label(cr, "step", (left + right) / 2, kStragglerPlotHeight - 12, 0.5, 1);
  cairo_save(cr);
  cairo_translate(cr, 16, (top + bottom) / 2);
  cairo_rotate(cr, -M_PI / 2);
  label(cr, "rank", 0, 0, 0.5, 0);
  cairo_restore(cr);

  if (r.steps.empty() || r.ranks.empty()) {
    set(cr, kUnseen);
    cairo_rectangle(cr, left, top, right - left, bottom - top);
    cairo_fill(cr);
    set(cr, {0, 0, 0});
    label(cr, "no step timed yet", (left + right) / 2, (top + bottom) / 2, 0.5, 0.5);
    return;
  }

  const Binned b = bin(r, static_cast<size_t>(right - left), static_cast<size_t>(bottom - top));
  const double cell_w = (right - left) / static_cast<double>(b.cols);
  const double cell_h = (bottom - top) / static_cast<double>(b.rows);
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);
  for (size_t row = 0; row < b.rows; ++row) {
    for (size_t col = 0; col < b.cols; ++col) {
      const auto& cell = b.cells[row * b.cols + col];
      set(cr, cell ? colour((*cell - b.lo) / (b.hi - b.lo)) : kUnseen);
      // Whole pixels, so neighbouring cells neither overlap nor leave seams.
      const double x0 = std::round(left + col * cell_w), x1 = std::round(left + (col + 1) * cell_w);
      const double y0 = std::round(top + row * cell_h), y1 = std::round(top + (row + 1) * cell_h);
      cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
      cairo_fill(cr);
    }
  }
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_DEFAULT);

  // Rank ticks (every rank when they fit, else about 16); flagged ranks
  // get a red label, a marker and an outline just outside their row, so a
  // row one pixel high still shows its colour.
  const size_t ranks = r.ranks.size();
  const size_t rank_every = std::max<size_t>(1, (ranks + 15) / 16);
  auto row_mid = [&](size_t i) {
    return top + (bottom - top) * (static_cast<double>(i) + 0.5) / static_cast<double>(ranks);
  };
  std::vector<double> flagged_mids;
  for (size_t i = 0; i < ranks; ++i) {
    if (!r.ranks[i].flagged) continue;
    const double half = (bottom - top) / static_cast<double>(ranks) / 2, mid = row_mid(i);
    flagged_mids.push_back(mid);
    set(cr, kFlagged);
    cairo_set_line_width(cr, 2);
    cairo_rectangle(cr, left - 1, mid - half - 1, right - left + 2, 2 * half + 2);
    cairo_stroke(cr);
    cairo_move_to(cr, left - 24, mid);
    cairo_line_to(cr, left - 34, mid - 6);
    cairo_line_to(cr, left - 34, mid + 6);
    cairo_close_path(cr);
    cairo_fill(cr);
    label(cr, std::to_string(r.ranks[i].rank), left - 6, mid, 1, 0.5);
  }
  set(cr, {0, 0, 0});
  for (size_t i = 0; i < ranks; i += rank_every) {
    const double mid = row_mid(i);
    const bool crowded = std::any_of(flagged_mids.begin(), flagged_mids.end(),
                                     [&](double m) { return std::abs(m - mid) < 14; });
    if (!crowded) label(cr, std::to_string(r.ranks[i].rank), left - 6, mid, 1, 0.5);
  }

  // Step ticks at round steps (1, 2 or 5 x 10^k apart, about 8 of them)
  // where the map has that step.
  set(cr, {0, 0, 0});
  cairo_set_line_width(cr, 1);
  const size_t steps = r.steps.size();
  const double span = static_cast<double>(std::max<int64_t>(1, r.steps.back() - r.steps.front()));
  const double magnitude = std::pow(10, std::floor(std::log10(span / 8)));
  int64_t every = 1;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    every = std::max<int64_t>(1, static_cast<int64_t>(m * magnitude));
    if (span / static_cast<double>(every) <= 8) break;
  }
  for (int64_t tick = (r.steps.front() + every - 1) / every * every; tick <= r.steps.back(); tick += every) {
    const auto it = std::lower_bound(r.steps.begin(), r.steps.end(), tick);
    if (it == r.steps.end() || *it != tick) continue;
    const double i = static_cast<double>(it - r.steps.begin());
    const double x = left + (right - left) * (i + 0.5) / static_cast<double>(steps);
    cairo_move_to(cr, x, bottom);
    cairo_line_to(cr, x, bottom + 5);
    cairo_stroke(cr);
    label(cr, std::to_string(tick), x, bottom + 8, 0.5, 0);
  }
  cairo_rectangle(cr, left, top, right - left, bottom - top);
  cairo_stroke(cr);

  // The scale bar: yellow (slow) on top.
  constexpr double bar_left = right + 40, bar_w = 20;
  for (int y = static_cast<int>(top); y < static_cast<int>(bottom); ++y) {
    set(cr, colour(1 - (y - top) / (bottom - top)));
    cairo_rectangle(cr, bar_left, y, bar_w, 1);
    cairo_fill(cr);
  }
  set(cr, {0, 0, 0});
  cairo_rectangle(cr, bar_left, top, bar_w, bottom - top);
  cairo_stroke(cr);
  label(cr, "compute ms", bar_left + bar_w / 2, top - 8, 0.5, 1);
  for (int t = 0; t <= 4; ++t) {
    const double y = bottom - (bottom - top) * t / 4.0;
    cairo_move_to(cr, bar_left + bar_w, y);
    cairo_line_to(cr, bar_left + bar_w + 4, y);
    cairo_stroke(cr);
    label(cr, ms_text(b.lo + (b.hi - b.lo) * t / 4.0), bar_left + bar_w + 7, y, 0, 0.5);
  }
}

cairo_status_t append(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

}  // namespace

void print_stragglers(const nlohmann::json& report, std::ostream& out) {
  const Report r = parse(report);
  out << fmt::format("{:<5} {:>17} {:>7} {:>9} {:>9} {:>8} {:>8} {:>13} {:>14}  {}\n", "rank", "median compute ms",
                     "score", "slowdown", "CPU wait", "stalled", "evidence", "host evidence", "stall evidence",
                     "flagged");
  for (const auto& rank : r.ranks) {
    out << fmt::format("{:<5} {:>17} {:>+7.3f} {:>+8.1f}% {:>8.1f}% {:>7.1f}% {:>7.0f}% {:>12.0f}% {:>13.0f}%  {}\n",
                       rank.rank, rank.median_ms ? fmt::format("{:.2f}", *rank.median_ms) : std::string("-"),
                       rank.score, 100 * rank.slowdown, 100 * rank.cpu_wait_share, 100 * rank.stalled_share,
                       100 * rank.evidence, 100 * rank.host_evidence, 100 * rank.stall_evidence,
                       rank.flagged ? fmt::format("yes ({})", rank.cause == "host" ? "host contention" : rank.cause)
                                    : std::string("-"));
  }
  out << fmt::format("sync tax {:.3f} (the slowest rank's compute over the median rank's, mean over steps)\n",
                     r.sync_tax);
  out << fmt::format(
      "a rank is flagged when its evidence reaches 100%: its compute, step by step, runs over the median rank's by "
      "more than {:.0f}% and by more than noise alone would in {} steps; slowdown is its compute over its stage's "
      "normal level, lately\n"
      "host evidence gathers the same on compute + CPU wait (the time it was runnable but waited for a core): a rank "
      "flagged by it alone, or waiting for a CPU more than the others by more than its slowdown, is slowed by its host "
      "(host contention), not by its own compute\n"
      "stall evidence gathers the part of its compute it was neither running nor waiting for a CPU (stalled: "
      "stopped, throttled or blocked in the kernel) against the other ranks': a rank flagged by it, or whose stalls "
      "explain its slowdown, is stalled by its host\n",
      100 * r.threshold, r.false_alarm_steps);
  if (!r.noise) {
    out << "the noise is not learned yet (it takes 20 steps every rank timed)\n";
  } else if (!r.decision_interval) {
    out << fmt::format(
        "per-step noise {:.1f}% drowns the threshold: no rank can be flagged; raise health.straggler_threshold\n",
        100 * *r.noise);
  } else {
    out << fmt::format("per-step noise {:.1f}%\n", 100 * *r.noise);
  }
}

void plot_stragglers(const nlohmann::json& report, const std::filesystem::path& png) {
  const Report r = parse(report);
  const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, kStragglerPlotWidth, kStragglerPlotHeight),
      cairo_surface_destroy);
  {
    const std::unique_ptr<cairo_t, decltype(&cairo_destroy)> cr(cairo_create(surface.get()), cairo_destroy);
    draw(cr.get(), r);
    if (const cairo_status_t status = cairo_status(cr.get()); status != CAIRO_STATUS_SUCCESS) {
      throw common::Error(common::ErrorCode::kInternal,
                          fmt::format("drawing the straggler plot failed: {}", cairo_status_to_string(status)));
    }
  }
  std::string bytes;
  const cairo_status_t status = cairo_surface_write_to_png_stream(surface.get(), append, &bytes);
  if (status != CAIRO_STATUS_SUCCESS) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("encoding the straggler plot as PNG failed: {}", cairo_status_to_string(status)));
  }
  common::write_file_atomically(png, bytes, 0644, common::ErrorCode::kBadConfig);
}

}  // namespace keel::daemon
