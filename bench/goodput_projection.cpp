// keel-bench-goodput: the share of wall time a synchronous run keeps for
// training (goodput) from 1k to 100k GPUs, with disk checkpoints only and
// with in-memory snapshots, projected from keel's measured restart and
// stall figures (keel-bench-keeld's summary) and a failure mix (Llama 3's
// by default). Prints the inputs, each with where it comes from, and the
// table as one JSON object, and draws the table as a PNG.
#include <cairo.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/goodput_model.h"

namespace {

// Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions
// in 54 days on 16,384 H100s; 58.7% GPU-related (faulty GPU, HBM3, SRAM,
// GPU system processor, ...), which take the node out of the job; 41.3%
// software errors, network cables and adapters, after which the node and
// its keeld go on.
constexpr double kLlama3FailuresPerGpuHour = 419.0 / (54.0 * 24.0 * 16384.0);
constexpr double kLlama3NodeSurvivesShare = 0.413;

const std::vector<double> kGpus = {1000, 2000, 4000, 8000, 16384, 32000, 64000, 100000};

// The summary line keel-bench-keeld printed, from a file of its output.
nlohmann::json restart_summary(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  nlohmann::json found;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("bench", "") == "keeld_restart_summary") found = j;
  }
  if (found.is_null()) throw std::runtime_error(path + " holds no keeld_restart_summary line of keel-bench-keeld");
  return found;
}

void label(cairo_t* cr, const std::string& text, double x, double y, double ax, double ay) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, text.c_str(), &e);
  cairo_move_to(cr, x - e.x_bearing - ax * e.width, y - e.y_bearing - ay * e.height);
  cairo_show_text(cr, text.c_str());
}

// Goodput against GPUs (log scale), one line per way of saving state.
void plot(const std::vector<keel::bench::Goodput>& rows, const std::string& title, const std::string& png) {
  constexpr int kWidth = 900, kHeight = 560;
  const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, kWidth, kHeight), cairo_surface_destroy);
  const std::unique_ptr<cairo_t, decltype(&cairo_destroy)> owner(cairo_create(surface.get()), cairo_destroy);
  cairo_t* cr = owner.get();
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  const double left = 80, right = kWidth - 30, top = 60, bottom = kHeight - 70;
  const double lo = std::log10(kGpus.front()), hi = std::log10(kGpus.back());
  auto x_of = [&](double gpus) { return left + (std::log10(gpus) - lo) / (hi - lo) * (right - left); };
  auto y_of = [&](double goodput) { return bottom - goodput * (bottom - top); };
  cairo_set_source_rgb(cr, 0, 0, 0);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
  cairo_set_font_size(cr, 16);
  label(cr, title, kWidth / 2.0, 24, 0.5, 0.5);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 12);
  cairo_set_line_width(cr, 1);
  for (int tenth = 0; tenth <= 10; tenth += 2) {
    const double y = y_of(tenth / 10.0);
    cairo_set_source_rgb(cr, 0.85, 0.85, 0.85);
    cairo_move_to(cr, left, y);
    cairo_line_to(cr, right, y);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0, 0, 0);
    label(cr, std::to_string(tenth * 10) + "%", left - 8, y, 1, 0.5);
  }
  for (double gpus : kGpus) {
    const double x = x_of(gpus);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_move_to(cr, x, bottom);
    cairo_line_to(cr, x, bottom + 5);
    cairo_stroke(cr);
    label(cr, gpus >= 1000 ? std::to_string(static_cast<int>(std::lround(gpus / 1000))) + "k" : std::to_string(gpus), x,
          bottom + 10, 0.5, 0);
  }
  cairo_rectangle(cr, left, top, right - left, bottom - top);
  cairo_stroke(cr);
  label(cr, "GPUs (log scale)", (left + right) / 2, kHeight - 30, 0.5, 0);
  cairo_save(cr);
  cairo_translate(cr, 20, (top + bottom) / 2);
  cairo_rotate(cr, -M_PI / 2);
  label(cr, "goodput: share of wall time kept for training", 0, 0, 0.5, 0.5);
  cairo_restore(cr);
  struct Line {
    const char* name;
    double r, g, b;
    double keel::bench::Goodput::*value;
  };
  const Line lines[] = {{"disk checkpoints only", 0.80, 0.25, 0.20, &keel::bench::Goodput::disk_only},
                        {"with in-memory snapshots", 0.15, 0.40, 0.80, &keel::bench::Goodput::with_snapshots}};
  for (size_t l = 0; l < 2; ++l) {
    const Line& line = lines[l];
    cairo_set_source_rgb(cr, line.r, line.g, line.b);
    cairo_set_line_width(cr, 2.5);
    for (size_t i = 0; i < kGpus.size(); ++i) {
      const double x = x_of(kGpus[i]), y = y_of(rows[i].*line.value);
      if (i == 0) {
        cairo_move_to(cr, x, y);
      } else {
        cairo_line_to(cr, x, y);
      }
    }
    cairo_stroke(cr);
    const double ly = bottom - 40 - 20.0 * static_cast<double>(l);
    cairo_move_to(cr, left + 20, ly);
    cairo_line_to(cr, left + 50, ly);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0, 0, 0);
    label(cr, line.name, left + 58, ly, 0, 0.5);
  }
  if (cairo_surface_write_to_png(surface.get(), png.c_str()) != CAIRO_STATUS_SUCCESS) {
    throw std::runtime_error("cannot write " + png);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-goodput: projected goodput against cluster size, disk checkpoints against snapshots"};
  std::string restarts, model = "1.1GB", png = "goodput.png";
  double checkpoint_every_min = 30, rate = kLlama3FailuresPerGpuHour, memory_share = kLlama3NodeSurvivesShare;
  double step_s = 0;
  app.add_option("--restarts", restarts, "a file of keel-bench-keeld's output (its keeld_restart_summary line)")
      ->required();
  app.add_option("--model", model, "which model of that summary: quickstart or 1.1GB");
  app.add_option("--step-s", step_s, "the step time at scale (default: measured with the model)");
  app.add_option("--checkpoint-every-min", checkpoint_every_min, "the disk checkpoint interval");
  app.add_option("--failures-per-gpu-hour", rate, "the failure rate (default: Llama 3's)");
  app.add_option("--memory-share", memory_share,
                 "of failures, those after which the node's keeld lives (default: Llama 3's non-GPU share)");
  app.add_option("--plot", png, "the PNG to draw");
  CLI11_PARSE(app, argc, argv);
  try {
    const auto summary = restart_summary(restarts);
    if (!summary.contains(model)) throw std::runtime_error("the summary has no model " + model);
    const auto& m = summary.at(model);
    keel::bench::GoodputInputs in;
    in.failures_per_gpu_hour = rate;
    in.memory_share = memory_share;
    in.restart_disk_s = m.at("median_restart_s").at("disk");
    in.restart_memory_s = m.at("median_restart_s").at("memory");
    in.step_s = step_s > 0 ? step_s : m.at("step_s").get<double>();
    in.checkpoint_every_s = checkpoint_every_min * 60;
    in.snapshot_every_steps = m.at("snapshot_every_steps");
    in.snapshot_stall_share = m.at("snapshot_stall_share");
    // A disk save stalls training for the same copy a snapshot makes
    // (without its hash): taken as one snapshot's stall.
    in.checkpoint_stall_s = in.snapshot_stall_share * in.snapshot_every_steps * in.step_s;
    const std::string source = "keel-bench-keeld " + model + " (" + restarts + ")";
    nlohmann::json inputs = {
        {"failures_per_gpu_hour",
         {{"value", in.failures_per_gpu_hour},
          {"from", rate == kLlama3FailuresPerGpuHour ? "Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs"
                                                     : "--failures-per-gpu-hour"}}},
        {"memory_share",
         {{"value", in.memory_share},
          {"from", memory_share == kLlama3NodeSurvivesShare
                       ? "Llama 3: 41.3% software, network cable and adapter failures; the GPU-related 58.7% take "
                         "the node, and its snapshots, out (no buddy copy yet)"
                       : "--memory-share"}}},
        {"detect_s", {{"value", in.detect_s}, {"from", "in the restart figures: keeld reaps a crashed rank at once"}}},
        {"restart_disk_s", {{"value", in.restart_disk_s}, {"from", source + ": median kill -9 to first step, disk"}}},
        {"restart_memory_s",
         {{"value", in.restart_memory_s}, {"from", source + ": median kill -9 to first step, memory"}}},
        {"step_s", {{"value", in.step_s}, {"from", step_s > 0 ? "--step-s" : source + ": its step time"}}},
        {"checkpoint_every_s", {{"value", in.checkpoint_every_s}, {"from", "--checkpoint-every-min"}}},
        {"checkpoint_stall_s", {{"value", in.checkpoint_stall_s}, {"from", source + ": one snapshot's stall"}}},
        {"snapshot_every_steps",
         {{"value", in.snapshot_every_steps}, {"from", source + ": the default interval (stall budget 2%)"}}},
        {"snapshot_stall_share", {{"value", in.snapshot_stall_share}, {"from", source}}}};
    std::vector<keel::bench::Goodput> rows;
    nlohmann::json table = nlohmann::json::array();
    for (double gpus : kGpus) {
      rows.push_back(keel::bench::project_goodput(in, gpus));
      table.push_back({{"gpus", gpus},
                       {"failures_per_day", in.failures_per_gpu_hour * gpus * 24},
                       {"goodput_disk_only", rows.back().disk_only},
                       {"goodput_with_snapshots", rows.back().with_snapshots}});
    }
    plot(rows,
         fmt::format("keel goodput, projected: checkpoints every {:g} min, {:.2g} failures per GPU-hour",
                     checkpoint_every_min, in.failures_per_gpu_hour),
         png);
    std::cout
        << nlohmann::json{{"bench", "goodput_projection"}, {"inputs", inputs}, {"table", table}, {"plot", png}}.dump()
        << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "keel-bench-goodput: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
