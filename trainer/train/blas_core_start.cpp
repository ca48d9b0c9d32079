#include "trainer/train/blas_core_start.h"

#include "common/blas_core.h"
#include "common/error.h"
#include "common/log.h"
#include "trainer/kernels/backend_array.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/kernels/known_answer.h"
#include "trainer/train/fault_hooks.h"

#include <cblas.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace keel::trainer {
namespace {

using common::BlasCoreDecision;
using common::CpuFeatures;

constexpr const char* kCoreType = "OPENBLAS_CORETYPE";
constexpr const char* kLibraryCore = "KEEL_BLAS_LIBRARY_CORE";
constexpr const char* kRejectedCore = "KEEL_BLAS_REJECTED_CORE";

std::string loaded_blas_core() {
  const char* name = openblas_get_corename();
  return name != nullptr ? std::string(name) : std::string();
}

// Replaces this process's image with the same program and arguments; the
// environment is this process's, as changed by the caller. Returns only
// when exec fails, with the reason.
std::string reexecute(char** argv) {
  std::fflush(nullptr);
  execv("/proc/self/exe", argv);
  return std::strerror(errno);
}

}  // namespace

nlohmann::json BlasCore::to_json() const {
  nlohmann::json out = {
      {"core", core}, {"library_core", library_core}, {"cpu_core", cpu_core}, {"chosen_by", chosen_by}};
  if (!rejected_core.empty()) out["rejected_core"] = rejected_core;
  return out;
}

BlasCore settle_blas_core(const std::string& setting, char** argv) {
  auto log = common::logger("blas");
  const CpuFeatures cpu = CpuFeatures::of_this_cpu();
  BlasCore blas;
  blas.core = loaded_blas_core();
  blas.cpu_core = common::core_of_generation(common::generation_of_cpu(cpu));
  const char* library_core = std::getenv(kLibraryCore);
  const char* rejected = std::getenv(kRejectedCore);
  blas.library_core = library_core != nullptr ? library_core : blas.core;
  // OpenBLAS read its variable when it loaded; what keel set for this image
  // must not reach the processes it starts (a test's keel-trainer children
  // decide for themselves).
  const auto forget_own_variables = [&] {
    if (library_core != nullptr) unsetenv(kCoreType);
    unsetenv(kLibraryCore);
    unsetenv(kRejectedCore);
  };

  if (rejected != nullptr) {
    blas.chosen_by = "fallback";
    blas.rejected_core = rejected;
    forget_own_variables();
    log->error("BLAS core {} failed the known-answer kernel test; running the library's own choice, {}",
               blas.rejected_core, blas.core);
    return blas;
  }
  // Once keel has re-executed, OPENBLAS_CORETYPE is keel's, not the operator's.
  const char* operator_core = library_core == nullptr ? std::getenv(kCoreType) : nullptr;
  const BlasCoreDecision decision = common::decide_blas_core(setting, operator_core, blas.core, cpu);
  if (!decision.error.empty()) throw common::Error(common::ErrorCode::kBadConfig, decision.error);
  if (!decision.reexec_with.empty() && library_core == nullptr) {
    log->info("BLAS core: OpenBLAS chose {}; re-executing with OPENBLAS_CORETYPE={} (train.blas_core = \"{}\")",
              blas.core, decision.reexec_with, setting);
    setenv(kLibraryCore, blas.core.c_str(), 1);
    setenv(kCoreType, decision.reexec_with.c_str(), 1);
    const std::string why = reexecute(argv);
    unsetenv(kLibraryCore);
    unsetenv(kCoreType);
    log->warn("could not re-execute with OPENBLAS_CORETYPE={} ({}); going on with {}", decision.reexec_with, why,
              blas.core);
  } else if (!decision.reexec_with.empty()) {
    // Re-executed, and OpenBLAS still runs another core: it does not know
    // the name or refused it for this CPU. Its own choice stands.
    log->warn("OpenBLAS runs {} although keel asked for {}; going on with it", blas.core, decision.reexec_with);
  }
  forget_own_variables();
  blas.chosen_by = operator_core != nullptr ? "operator"
                   : library_core == nullptr ? "library"
                   : setting == "auto"       ? "auto"
                                             : "config";
  if (!decision.warning.empty()) log->warn("{}", decision.warning);
  log->info("BLAS core {} (chosen by {}; OpenBLAS's own choice {}; this CPU runs {})", blas.core, blas.chosen_by,
            blas.library_core, blas.cpu_core.empty() ? "no newer generation" : blas.cpu_core);
  return blas;
}

void prove_blas_core(const BlasCore& blas, Backend& backend, bool inject_failure, char** argv) {
  if (!blas.keel_chose()) return;
  GemmBitFlip flipped(backend);
  const KnownAnswers answers = test_known_answers(inject_failure ? flipped : backend);
  if (answers.failed_kernel.empty()) {
    common::logger("blas")->info("BLAS core {} passed the known-answer kernel test", blas.core);
    return;
  }
  common::logger("blas")->error(
      "BLAS core {} gave a wrong result in the known-answer kernel test ({}); falling back to OpenBLAS's own choice, "
      "{}: set train.blas_core = \"library\" to skip this test",
      blas.core, answers.failed_kernel, blas.library_core);
  // settle_blas_core took keel's OPENBLAS_CORETYPE out of the environment,
  // so the next image loads the library's own core.
  setenv(kRejectedCore, blas.core.c_str(), 1);
  const std::string why = reexecute(argv);
  // A run must not go on under a core that computes wrong numbers.
  throw common::Error(common::ErrorCode::kInternal,
                      fmt::format("could not re-execute with OpenBLAS's own BLAS core after {} failed the "
                                  "known-answer kernel test: {}",
                                  blas.core, why));
}

nlohmann::json blas_report(const std::optional<BlasCore>& blas, Backend& backend) {
  constexpr int kSide = 1024;
  constexpr size_t kFloats = static_cast<size_t>(kSide) * kSide;
  BackendArray<float> a(backend, kFloats), w(backend, kFloats), out(backend, kFloats);
  const std::vector<float> ones(kFloats, 0.5f);
  backend.copy_from_host(a.data(), ones.data(), kFloats * sizeof(float));
  backend.copy_from_host(w.data(), ones.data(), kFloats * sizeof(float));
  const auto gemm = [&] { backend.matmul_forward(out.data(), a.data(), w.data(), nullptr, kSide, kSide, kSide); };
  gemm();  // first touch, packing buffers, thread start-up
  backend.compute_stream().synchronize();
  // At least half a second and 3 GEMMs, so a fast machine's figure is no
  // single sample.
  int runs = 0;
  const auto start = std::chrono::steady_clock::now();
  double seconds = 0;
  while (runs < 3 || seconds < 0.5) {
    gemm();
    backend.compute_stream().synchronize();
    ++runs;
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double flops = 2.0 * kSide * kSide * kSide * runs;
  nlohmann::json gemm_json = {{"m", kSide}, {"k", kSide}, {"n", kSide}, {"runs", runs}, {"gflops", flops / seconds / 1e9}};
  if (const auto* cpu = dynamic_cast<const CpuBackend*>(&backend)) gemm_json["threads"] = cpu->threads();
  gemm_json["backend"] = backend.name();
  return {{"blas", blas ? blas->to_json() : nlohmann::json(nullptr)}, {"gemm", gemm_json}};
}

}  // namespace keel::trainer
