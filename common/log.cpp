#include "common/log.h"

#include <spdlog/cfg/env.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <atomic>
#include <mutex>

namespace keel::common {
namespace {

std::atomic<int> g_rank{0};
std::atomic<int64_t> g_step{-1};
std::once_flag g_init_once;

// %k: rank ("-" for keeld, which is no rank), %q: step ("-" before the first step). Letters spdlog itself
// does not use, so its own time flags keep working.
class RankFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    const int rank = g_rank.load(std::memory_order_relaxed);
    if (rank < 0) {
      dest.push_back('-');
    } else {
      fmt::format_to(std::back_inserter(dest), "{}", rank);
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<RankFlag>(); }
};

class StepFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    int64_t step = g_step.load(std::memory_order_relaxed);
    if (step < 0) {
      dest.push_back('-');
    } else {
      fmt::format_to(std::back_inserter(dest), "{}", step);
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<StepFlag>(); }
};

std::unique_ptr<spdlog::formatter> make_formatter() {
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<RankFlag>('k').add_flag<StepFlag>('q');
  formatter->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ [%n] rank=%k step=%q %v");
  return formatter;
}

}  // namespace

void init_logging(int rank) {
  g_rank.store(rank);
  std::call_once(g_init_once, [] {
    // Logs go to stderr so that stdout stays free for machine-readable output.
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto default_logger = std::make_shared<spdlog::logger>("keel", sink);
    spdlog::set_default_logger(default_logger);
    // The registry hands this formatter to every logger it initialises.
    spdlog::set_formatter(make_formatter());
    spdlog::cfg::load_env_levels();
  });
}

std::shared_ptr<spdlog::logger> logger(const std::string& module) {
  init_logging(g_rank.load());
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto existing = spdlog::get(module)) return existing;
  auto created = spdlog::default_logger()->clone(module);
  // load_env_levels only configured loggers that existed then; apply the
  // per-module level from SPDLOG_LEVEL to this one too.
  spdlog::initialize_logger(created);
  return created;
}

void set_log_step(int64_t step) { g_step.store(step, std::memory_order_relaxed); }

}  // namespace keel::common
