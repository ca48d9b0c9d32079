// Which OpenBLAS kernels the CPU backend's GEMMs run on (docs/architecture.md
// "Kernels": BLAS core). Pure, without OpenBLAS, so that the config check
// names a bad core before any rank starts. Debian's OpenBLAS carries kernels for every x86-64
// generation and picks one when it loads, from CPUID; a CPU newer than the
// library's table gets its oldest, generic kernels ("Prescott"): on an
// AVX-512 Xeon, 32 instead of 232 GFLOP/s of sgemm, 3.5x the trainer's step
// time, and nothing said. OPENBLAS_CORETYPE, read at load time, forces a
// core. This file is the decision, as data; trainer/train/blas_core_start.h
// acts on it.
#pragma once

#include <string>
#include <string_view>

namespace keel::common {

// The x86-64 features OpenBLAS's kernel generations need, of this process's
// CPU as the compiler's runtime (__builtin_cpu_supports) reports them,
// operating-system support for the wide registers included.
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  static CpuFeatures of_this_cpu();  // all false off x86-64
};

// OpenBLAS's x86-64 kernel generations, oldest first. kOlder is every core
// before AVX2 (Prescott, Nehalem, Sandybridge, ...) and any name not known.
enum class KernelGeneration { kOlder, kAvx2, kAvx512, kAvx512Bf16 };

const char* generation_name(KernelGeneration generation);  // "pre-AVX2", "AVX2", "AVX-512", "AVX-512 BF16"
KernelGeneration generation_of_core(std::string_view core);
KernelGeneration generation_of_cpu(const CpuFeatures& cpu);
// The core keel asks for to run a generation: "Haswell", "SkylakeX",
// "Cooperlake"; empty for kOlder (the library's choice is as good).
std::string core_of_generation(KernelGeneration generation);

// Whether OPENBLAS_CORETYPE accepts `name` on x86-64 (OpenBLAS compares
// case-insensitively; an unknown name is ignored with a warning, so keel
// refuses it in the config instead).
bool is_openblas_core(std::string_view name);
bool same_core(std::string_view a, std::string_view b);  // case-insensitive

// What to do about the core at start.
struct BlasCoreDecision {
  // A core to re-execute with, OPENBLAS_CORETYPE set to it; empty: run on
  // the core loaded.
  std::string reexec_with;
  // The core that runs then is older than the CPU supports: a sentence for
  // the log that says whose choice it is and what to change.
  std::string warning;
  // The config cannot run on this CPU (a core newer than it): kBadConfig.
  std::string error;
};

// `setting` is train.blas_core: "auto" (the newest generation the CPU runs,
// when the library's is older), "library" (the library's choice) or a core
// name; `operator_core` is OPENBLAS_CORETYPE as the operator left it
// (nullptr: unset), always respected; `loaded_core` is the core OpenBLAS
// runs now (openblas_get_corename()).
BlasCoreDecision decide_blas_core(std::string_view setting, const char* operator_core, std::string_view loaded_core,
                                  const CpuFeatures& cpu);

}  // namespace keel::common
