#include "daemon/straggler_view.h"

#include "common/error.h"
#include "health/straggler_monitor.h"
#include "tests/health/synthetic_boards.h"
#include "tests/support/temp_dir.h"

#include <cairo.h>
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>

namespace keel::daemon {
namespace {

// What keeld would reply after 200 steps of 4 ranks, rank 2 computing 30%
// longer than the others.
nlohmann::json slow_rank_report() {
  test::SyntheticJob job(4);
  health::StragglerMonitor monitor(common::HealthConfig{});
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> noise(0.98, 1.02);
  for (int64_t step = 0; step < 200; ++step) {
    for (int r = 0; r < 4; ++r) job.time_step(r, step, static_cast<float>((r == 2 ? 130 : 100) * noise(rng)), 20);
    monitor.observe(job.samples(), 0);
  }
  return monitor.report();
}

struct Pixel {
  int r, g, b;
  bool operator==(const Pixel&) const = default;
};

struct Png {
  std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface;
  explicit Png(const std::filesystem::path& path)
      : surface(cairo_image_surface_create_from_png(path.c_str()), cairo_surface_destroy) {}
  bool ok() const { return cairo_surface_status(surface.get()) == CAIRO_STATUS_SUCCESS; }
  int width() const { return cairo_image_surface_get_width(surface.get()); }
  int height() const { return cairo_image_surface_get_height(surface.get()); }
  Pixel at(int x, int y) const {
    cairo_surface_flush(surface.get());
    const unsigned char* row = cairo_image_surface_get_data(surface.get()) +
                               static_cast<ptrdiff_t>(y) * cairo_image_surface_get_stride(surface.get());
    uint32_t px;
    std::memcpy(&px, row + 4 * x, 4);
    return {static_cast<int>((px >> 16) & 0xff), static_cast<int>((px >> 8) & 0xff), static_cast<int>(px & 0xff)};
  }
};

// The centre of rank `rank`'s row of `ranks`, half way along the steps.
std::pair<int, int> row_centre(int rank, int ranks) {
  const double row_h = static_cast<double>(kStragglerMapBottom - kStragglerMapTop) / ranks;
  return {(kStragglerMapLeft + kStragglerMapRight) / 2, static_cast<int>(kStragglerMapTop + (rank + 0.5) * row_h)};
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the straggler plot is a PNG that shows the slow rank in its own colour") {
    test::TempDir dir;
    const auto report = slow_rank_report();
    REQUIRE(report["ranks"][2]["flagged"] == true);
    const auto path = dir / "stragglers.png";
    plot_stragglers(report, path);

    std::ifstream in(path, std::ios::binary);
    std::string magic(8, '\0');
    in.read(magic.data(), 8);
    CHECK(magic == "\x89PNG\r\n\x1a\n");
    const Png png(path);
    REQUIRE(png.ok());
    CHECK(png.width() == kStragglerPlotWidth);
    CHECK(png.height() == kStragglerPlotHeight);
    const auto [x, y_slow] = row_centre(2, 4);
    const auto y_normal = row_centre(0, 4).second;
    const Pixel slow = png.at(x, y_slow), normal = png.at(x, y_normal);
    CAPTURE(slow.r);
    CAPTURE(slow.g);
    CAPTURE(slow.b);
    CAPTURE(normal.r);
    CAPTURE(normal.g);
    CAPTURE(normal.b);
    CHECK_FALSE(slow == normal);
    // Slow is yellow, the rest the dark end of the scale.
    CHECK(slow.r + slow.g > normal.r + normal.g + 200);
  }

  TEST_CASE("a plot with no step yet says so") {
    test::TempDir dir;
    health::StragglerMonitor monitor(common::HealthConfig{});
    plot_stragglers(monitor.report(), dir / "empty.png");
    const Png png(dir / "empty.png");
    REQUIRE(png.ok());
    CHECK(png.width() == kStragglerPlotWidth);
  }

  TEST_CASE("the straggler table lists every rank with its score and the sync tax") {
    std::ostringstream out;
    print_stragglers(slow_rank_report(), out);
    const std::string text = out.str();
    INFO(text);
    CHECK(text.find("rank  median compute ms   score  slowdown  CPU wait  stalled evidence host evidence stall evidence  "
                    "flagged") == 0);
    CHECK(text.find("\n2     ") != std::string::npos);
    const std::string rank2 = text.substr(text.find("\n2     ") + 1, text.find('\n', text.find("\n2     ") + 1) -
                                                                        text.find("\n2     ") - 1);
    CHECK(rank2.find("yes (compute)") != std::string::npos);
    CHECK(rank2.find("+0.") != std::string::npos);
    CHECK(rank2.find("100%") != std::string::npos);
    CHECK(text.find("sync tax 1.") != std::string::npos);
    CHECK(text.find("by more than 4% and by more than noise alone would in 1000000 steps") != std::string::npos);
    CHECK(text.find("per-step noise 1.") != std::string::npos);
  }

  TEST_CASE("a rank stopped on some of its steps shows its stalls beside its score and the cause") {
    // Rank 1 of 2 is stopped from step 30 for as long as it works, one
    // step in four: its board counts the stops as stalls.
    test::SyntheticJob job(2);
    health::StragglerMonitor monitor(common::HealthConfig{});
    for (int64_t step = 0; step < 120; ++step) {
      const bool stopped = step >= 30 && step % 4 == 0;
      job.time_step(0, step, 100);
      job.time_step(1, step, stopped ? 200 : 100, 0, 0, 0, 0, stopped ? 100 : 0);
      monitor.observe(job.samples(), 0);
    }
    std::ostringstream out;
    print_stragglers(monitor.report(), out);
    const std::string text = out.str();
    INFO(text);
    const size_t at = text.find("\n1     ") + 1;
    const std::string rank1 = text.substr(at, text.find('\n', at) - at);
    CHECK(rank1.find("yes (stalled)") != std::string::npos);
    // Its stalls over its compute, averaged over about a window (alpha
    // 0.1): a half every fourth step, 0.145 right after one, 0.106 after
    // the three normal steps since.
    CHECK(rank1.find("   10.6%") != std::string::npos);
    CHECK(text.find("stall evidence gathers") != std::string::npos);
  }

  TEST_CASE("a plot that cannot be written is a clear error naming the file") {
    test::TempDir dir;
    const auto report = slow_rank_report();
    struct Case {
      const char* what;
      std::filesystem::path path;
    };
    const Case cases[] = {
        {"a directory that does not exist", dir / "missing" / "plot.png"},
        {"a path that is a directory", dir.path()},
    };
    for (const auto& c : cases) {
      CAPTURE(c.what);
      try {
        plot_stragglers(report, c.path);
        FAIL("no error");
      } catch (const common::Error& e) {
        CHECK(e.code() == common::ErrorCode::kBadConfig);
        CHECK(std::string(e.what()).find(c.path.string()) != std::string::npos);
      }
    }
  }

  TEST_CASE("a straggler report of the wrong shape is an error and no crash") {
    test::TempDir dir;
    auto with = [](const char* key, nlohmann::json value) {
      auto report = slow_rank_report();
      report[key] = std::move(value);
      return report;
    };
    struct Case {
      const char* what;
      nlohmann::json report;
    };
    const Case cases[] = {
        {"not an object", nlohmann::json::array()},
        {"no ranks", [] {
           auto r = slow_rank_report();
           r.erase("ranks");
           return r;
         }()},
        {"a score that is text", with("ranks", nlohmann::json::array({{{"rank", 0},
                                                                       {"median_compute_ms", 1.0},
                                                                       {"score", "high"},
                                                                       {"evidence", 0.5},
                                                                       {"flagged", false}}}))},
        {"no evidence", with("ranks", nlohmann::json::array({{{"rank", 0},
                                                              {"median_compute_ms", 1.0},
                                                              {"score", 0.1},
                                                              {"flagged", false}}}))},
        {"a noise that is text", with("noise", "loud")},
        {"fewer compute rows than ranks", with("compute_ms", nlohmann::json::array())},
        {"a row shorter than the steps", with("steps", nlohmann::json::array({1, 2, 3}))},
    };
    for (const auto& c : cases) {
      CAPTURE(c.what);
      std::ostringstream out;
      CHECK_THROWS_AS(print_stragglers(c.report, out), common::Error);
      try {
        plot_stragglers(c.report, dir / "bad.png");
        FAIL("no error");
      } catch (const common::Error& e) {
        CHECK(e.code() == common::ErrorCode::kInternal);
        CHECK(std::string(e.what()).find("straggler report") != std::string::npos);
      }
      CHECK_FALSE(std::filesystem::exists(dir / "bad.png"));
    }
  }
}

}  // namespace keel::daemon
