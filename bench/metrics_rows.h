// Reading a run's metrics.jsonl back for a benchmark.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace keel::bench {

// The step records after the first `warmup`, which are left out of timings.
inline std::vector<nlohmann::json> timed_rows(const std::filesystem::path& metrics, int warmup) {
  std::ifstream in(metrics);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  if (static_cast<int>(rows.size()) <= warmup) throw std::runtime_error("too few steps in " + metrics.string());
  rows.erase(rows.begin(), rows.begin() + warmup);
  return rows;
}

// Tokens per second over the timed steps, from their step_ms.
inline double tokens_per_s(const std::vector<nlohmann::json>& rows, double tokens_per_step) {
  double seconds = 0;
  for (const auto& row : rows) seconds += row.at("step_ms").get<double>() / 1e3;
  return tokens_per_step * static_cast<double>(rows.size()) / seconds;
}

}  // namespace keel::bench
