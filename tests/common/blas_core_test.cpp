// The BLAS core decision (common/blas_core.h) as a table: which core keel
// asks OpenBLAS for, for every setting, operator variable, loaded core and
// CPU, and what it says about it.
#include "common/blas_core.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace {

using keel::common::CpuFeatures;
using keel::common::KernelGeneration;

CpuFeatures avx2_cpu() {
  CpuFeatures cpu;
  cpu.avx2 = cpu.fma = true;
  return cpu;
}

CpuFeatures avx512_cpu() {
  CpuFeatures cpu = avx2_cpu();
  cpu.avx512f = cpu.avx512bw = cpu.avx512dq = cpu.avx512vl = true;
  return cpu;
}

CpuFeatures avx512_bf16_cpu() {
  CpuFeatures cpu = avx512_cpu();
  cpu.avx512bf16 = true;
  return cpu;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("each CPU runs the newest kernel generation whose every feature it has") {
    CHECK(keel::common::generation_of_cpu(CpuFeatures{}) == KernelGeneration::kOlder);
    CHECK(keel::common::generation_of_cpu(avx2_cpu()) == KernelGeneration::kAvx2);
    CHECK(keel::common::generation_of_cpu(avx512_cpu()) == KernelGeneration::kAvx512);
    CHECK(keel::common::generation_of_cpu(avx512_bf16_cpu()) == KernelGeneration::kAvx512Bf16);
    CpuFeatures no_fma = avx2_cpu();
    no_fma.fma = false;
    CHECK(keel::common::generation_of_cpu(no_fma) == KernelGeneration::kOlder);
    // AVX-512 F alone (Knights Landing) lacks what SkylakeX's kernels run.
    CpuFeatures foundation_only = avx2_cpu();
    foundation_only.avx512f = true;
    CHECK(keel::common::generation_of_cpu(foundation_only) == KernelGeneration::kAvx2);
    CHECK(keel::common::core_of_generation(KernelGeneration::kOlder).empty());
  }

  TEST_CASE("core names are OpenBLAS's - compared without case - and sorted into generations") {
    CHECK(keel::common::is_openblas_core("Prescott"));
    CHECK(keel::common::is_openblas_core("skylakex"));
    CHECK(keel::common::is_openblas_core("COOPERLAKE"));
    CHECK_FALSE(keel::common::is_openblas_core("Skylake"));
    CHECK_FALSE(keel::common::is_openblas_core("auto"));
    CHECK_FALSE(keel::common::is_openblas_core(""));
    CHECK(keel::common::generation_of_core("Prescott") == KernelGeneration::kOlder);
    CHECK(keel::common::generation_of_core("Sandybridge") == KernelGeneration::kOlder);
    CHECK(keel::common::generation_of_core("Zen") == KernelGeneration::kAvx2);
    CHECK(keel::common::generation_of_core("haswell") == KernelGeneration::kAvx2);
    CHECK(keel::common::generation_of_core("SkylakeX") == KernelGeneration::kAvx512);
    CHECK(keel::common::generation_of_core("SapphireRapids") == KernelGeneration::kAvx512Bf16);
    CHECK(keel::common::generation_of_core("something new") == KernelGeneration::kOlder);
  }

  TEST_CASE("the decision for every setting - operator variable - loaded core and CPU") {
    struct Row {
      const char* name;
      const char* setting;
      const char* operator_core;  // OPENBLAS_CORETYPE; nullptr: unset
      const char* loaded;
      CpuFeatures cpu;
      const char* reexec_with;
      const char* warning_has;  // "" = no warning
      const char* error_has;    // "" = no error
    };
    const std::vector<Row> rows = {
        {"auto moves generic kernels on an AVX-512 BF16 CPU to Cooperlake", "auto", nullptr, "Prescott",
         avx512_bf16_cpu(), "Cooperlake", "", ""},
        {"auto moves generic kernels on an AVX-512 CPU to SkylakeX", "auto", nullptr, "Prescott", avx512_cpu(),
         "SkylakeX", "", ""},
        {"auto moves Haswell on an AVX-512 CPU to SkylakeX", "auto", nullptr, "Haswell", avx512_cpu(), "SkylakeX", "",
         ""},
        {"auto moves generic kernels on an AVX2 CPU to Haswell", "auto", nullptr, "Prescott", avx2_cpu(), "Haswell",
         "", ""},
        {"auto keeps the library's core when it matches the CPU", "auto", nullptr, "Cooperlake", avx512_bf16_cpu(), "",
         "", ""},
        {"auto keeps a core newer than it would pick", "auto", nullptr, "SapphireRapids", avx512_bf16_cpu(), "", "",
         ""},
        {"auto changes nothing on a CPU without AVX2", "auto", nullptr, "Nehalem", CpuFeatures{}, "", "", ""},
        {"the operator's variable is respected, and an old core is named", "auto", "Prescott", "Prescott",
         avx512_bf16_cpu(), "", "OPENBLAS_CORETYPE=Prescott chose them", ""},
        {"the operator's variable is respected over a named core", "SkylakeX", "Haswell", "Haswell", avx512_cpu(), "",
         "OPENBLAS_CORETYPE=Haswell", ""},
        {"the operator's current core draws no warning", "auto", "Cooperlake", "Cooperlake", avx512_bf16_cpu(), "",
         "", ""},
        {"library never re-executes, and says the core is old", "library", nullptr, "Prescott", avx512_cpu(), "",
         "train.blas_core = \"library\"", ""},
        {"library on a matching core says nothing", "library", nullptr, "SkylakeX", avx512_cpu(), "", "", ""},
        {"a named older core re-executes and says it is old", "Prescott", nullptr, "Cooperlake", avx512_bf16_cpu(),
         "Prescott", "train.blas_core = \"Prescott\" chose them", ""},
        {"a named core already loaded does not re-execute", "prescott", nullptr, "Prescott", avx512_bf16_cpu(), "",
         "train.blas_core = \"prescott\"", ""},
        {"a named core of the CPU's generation draws no warning", "SkylakeX", nullptr, "Prescott", avx512_cpu(),
         "SkylakeX", "", ""},
        {"a named core newer than the CPU is refused", "SkylakeX", nullptr, "Haswell", avx2_cpu(), "", "",
         "needs AVX-512 instructions, which this CPU does not run"},
    };
    for (const auto& row : rows) {
      CAPTURE(row.name);
      const auto decision = keel::common::decide_blas_core(row.setting, row.operator_core, row.loaded, row.cpu);
      CHECK(decision.reexec_with == row.reexec_with);
      if (std::string(row.warning_has).empty()) {
        CHECK(decision.warning.empty());
      } else {
        CHECK(decision.warning.find(row.warning_has) != std::string::npos);
      }
      if (std::string(row.error_has).empty()) {
        CHECK(decision.error.empty());
      } else {
        CHECK(decision.error.find(row.error_has) != std::string::npos);
      }
    }
  }

  TEST_CASE("a warning names the core in use - the CPU's own and what to change") {
    const auto decision = keel::common::decide_blas_core("library", nullptr, "Prescott", avx512_bf16_cpu());
    CHECK(decision.warning.find("Prescott kernels (pre-AVX2)") != std::string::npos);
    CHECK(decision.warning.find("runs Cooperlake (AVX-512 BF16)") != std::string::npos);
    CHECK(decision.warning.find("set train.blas_core = \"auto\"") != std::string::npos);
  }
}
