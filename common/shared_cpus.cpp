#include "common/shared_cpus.h"

#include "common/log.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <set>

namespace keel::common {
namespace {

std::optional<int> parse_cpu(std::string_view text) {
  int cpu = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), cpu);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || cpu < 0 || cpu >= CPU_SETSIZE) {
    return std::nullopt;
  }
  return cpu;
}

void warn_once(const std::string& why) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  logger("comm")->warn("{}: communication threads stay on the rank's own CPUs", why);
}

}  // namespace

std::optional<std::vector<int>> parse_cpu_list(std::string_view list) {
  std::set<int> cpus;
  while (!list.empty()) {
    const size_t comma = list.find(',');
    const std::string_view item = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    if (comma != std::string_view::npos && list.empty()) return std::nullopt;  // a trailing comma
    const size_t dash = item.find('-');
    const auto first = parse_cpu(item.substr(0, dash));
    const auto last = dash == std::string_view::npos ? first : parse_cpu(item.substr(dash + 1));
    if (!first || !last || *last < *first) return std::nullopt;
    for (int cpu = *first; cpu <= *last; ++cpu) cpus.insert(cpu);
  }
  if (cpus.empty()) return std::nullopt;
  return std::vector<int>(cpus.begin(), cpus.end());
}

std::string format_cpu_list(const std::vector<int>& cpus) { return fmt::format("{}", fmt::join(cpus, ",")); }

SharedCpuScope::SharedCpuScope() {
  const char* value = std::getenv(kSharedCpusVariable);
  if (value == nullptr) return;
  const auto cpus = parse_cpu_list(value);
  if (!cpus) {
    warn_once(fmt::format("{}='{}' is no CPU list", kSharedCpusVariable, value));
    return;
  }
  cpu_set_t own, shared;
  if (sched_getaffinity(0, sizeof(own), &own) != 0) return;
  CPU_ZERO(&shared);
  for (const int cpu : *cpus) CPU_SET(cpu, &shared);
  if (sched_setaffinity(0, sizeof(shared), &shared) != 0) {
    warn_once(fmt::format("cannot run on {}={}: {}", kSharedCpusVariable, value, std::strerror(errno)));
    return;
  }
  own_ = own;
}

SharedCpuScope::~SharedCpuScope() {
  if (own_) sched_setaffinity(0, sizeof(*own_), &*own_);
}

}  // namespace keel::common
