// What every benchmark's JSON carries as "blas": the BLAS core keel-trainer
// runs on this machine and the GEMM ceiling measured on it
// (`keel-trainer --blas-report`, trainer/train/blas_core_start.h), so that a
// tokens/s figure is read against the kernels it ran on: the same binary is
// 3.5x apart on one CPU between OpenBLAS's generic and AVX-512 kernels.
#pragma once

#include "bench/bench_model.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace keel::bench {

// The bench model's config with train.threads = `threads` (0: every core)
// and `sets` (e.g. "train.blas_core=library").
inline nlohmann::json blas_ceiling(int threads, const std::vector<std::string>& sets = {}) {
  test::TempDir dir;
  const auto config = dir.write("blas.toml", kBenchModel);
  std::vector<std::string> argv = {test::keel_binary("keel-trainer").string(), "--config", config.string(),
                                   "--blas-report", "--set", "train.threads=" + std::to_string(threads)};
  for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
  const auto result = test::run_process(argv, {{"SPDLOG_LEVEL", "warn"}});
  if (result.exit_code != 0) return {{"error", result.output}};
  return test::last_json_line(result.output);
}

}  // namespace keel::bench
