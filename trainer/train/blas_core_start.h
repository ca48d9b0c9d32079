// Acting on the BLAS core decision at keel-trainer's start
// (docs/architecture.md "Kernels": BLAS core). OpenBLAS reads
// OPENBLAS_CORETYPE once, when it loads, before main: the only way to run
// another core is to execute the program again with the variable set. Both
// steps happen before the rank joins any group, so its peers never see the
// first image.
//
// Two variables tell the new image what happened before it; keel sets them,
// an operator never does:
//   KEEL_BLAS_LIBRARY_CORE   the core OpenBLAS chose by itself; set when
//                            keel re-executed with OPENBLAS_CORETYPE of its
//                            own choice (so that variable is not the
//                            operator's);
//   KEEL_BLAS_REJECTED_CORE  keel's choice, which failed the known-answer
//                            test; OPENBLAS_CORETYPE is unset again and
//                            nothing more is tried.
#pragma once

#include "trainer/kernels/backend.h"

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>

namespace keel::trainer {

struct BlasCore {
  std::string core;          // the core OpenBLAS runs (openblas_get_corename())
  std::string library_core;  // the one it chose by itself
  std::string cpu_core;      // the newest this CPU runs ("" when no newer generation than pre-AVX2)
  // Whose choice `core` is: "library", "operator" (OPENBLAS_CORETYPE),
  // "auto" or "config" (train.blas_core), "fallback" (keel's choice failed
  // the known-answer test; the library's runs).
  std::string chosen_by;
  std::string rejected_core;  // with "fallback": the core that failed

  // Whether keel chose `core` ("auto", "config"), so it must be proved.
  bool keel_chose() const { return chosen_by == "auto" || chosen_by == "config"; }
  nlohmann::json to_json() const;
};

// Right after the config is read. May not return: re-executes this program
// (argv, the environment plus OPENBLAS_CORETYPE) when `setting`
// (train.blas_core) asks for another core than the one loaded. Logs the
// core in use, and a warning when it is older than the CPU runs.
// Error(kBadConfig) when `setting` names a core this CPU cannot run.
BlasCore settle_blas_core(const std::string& setting, char** argv);

// Once the CPU backend exists, before any group is joined, when
// blas.keel_chose(): the known-answer kernel test must pass under the core
// bit for bit.
// Otherwise logs an error naming both cores and re-executes with the
// library's own (does not return); speed is never bought with a wrong
// result. `inject_failure` (faults.bitflip_target = "blas_core" on this
// rank) flips one bit of one GEMM output of the test.
void prove_blas_core(const BlasCore& blas, Backend& backend, bool inject_failure, char** argv);

// What `keel-trainer --blas-report` prints and every bench carries: `blas`
// (BlasCore::to_json, null off the cpu device) and `gemm`, the GEMM
// ceiling, a 1024^3 matmul_forward through `backend` as the model's GEMMs
// run (the backend's threads, fp32 or bf16 inputs as configured): m, k,
// n, threads, gflops.
nlohmann::json blas_report(const std::optional<BlasCore>& blas, Backend& backend);

}  // namespace keel::trainer
