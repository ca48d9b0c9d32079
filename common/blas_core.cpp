#include "common/blas_core.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>

namespace keel::common {
namespace {

// OpenBLAS's x86-64 core names (driver/others/dynamic.c), the spelling
// openblas_get_corename() returns.
constexpr std::array<std::string_view, 26> kCores = {
    "Katmai",     "Coppermine",  "Northwood", "Prescott",   "Banias",       "Atom",       "Core2",
    "Penryn",     "Dunnington",  "Nehalem",   "Athlon",     "Opteron",      "Opteron_SSE3", "Barcelona",
    "Nano",       "Sandybridge", "Bobcat",    "Bulldozer",  "Piledriver",   "Haswell",    "Steamroller",
    "Excavator",  "Zen",         "SkylakeX",  "Cooperlake", "SapphireRapids"};

}  // namespace

CpuFeatures CpuFeatures::of_this_cpu() {
  CpuFeatures cpu;
#if defined(__x86_64__)
  __builtin_cpu_init();
  cpu.avx2 = __builtin_cpu_supports("avx2");
  cpu.fma = __builtin_cpu_supports("fma");
  cpu.avx512f = __builtin_cpu_supports("avx512f");
  cpu.avx512bw = __builtin_cpu_supports("avx512bw");
  cpu.avx512dq = __builtin_cpu_supports("avx512dq");
  cpu.avx512vl = __builtin_cpu_supports("avx512vl");
  cpu.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
  return cpu;
}

const char* generation_name(KernelGeneration generation) {
  switch (generation) {
    case KernelGeneration::kAvx2: return "AVX2";
    case KernelGeneration::kAvx512: return "AVX-512";
    case KernelGeneration::kAvx512Bf16: return "AVX-512 BF16";
    case KernelGeneration::kOlder: break;
  }
  return "pre-AVX2";
}

bool same_core(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

bool is_openblas_core(std::string_view name) {
  return std::any_of(kCores.begin(), kCores.end(), [name](std::string_view core) { return same_core(core, name); });
}

// Excavator and Zen 1 have AVX2 too, but OpenBLAS gives Excavator the
// Piledriver kernels; Zen runs Haswell's.
KernelGeneration generation_of_core(std::string_view core) {
  if (same_core(core, "Cooperlake") || same_core(core, "SapphireRapids")) return KernelGeneration::kAvx512Bf16;
  if (same_core(core, "SkylakeX")) return KernelGeneration::kAvx512;
  if (same_core(core, "Haswell") || same_core(core, "Zen")) return KernelGeneration::kAvx2;
  return KernelGeneration::kOlder;
}

// What each core's kernels execute: SkylakeX's use AVX-512 F, BW, DQ and VL,
// Cooperlake's add the BF16 dot products.
KernelGeneration generation_of_cpu(const CpuFeatures& cpu) {
  const bool avx512 = cpu.avx512f && cpu.avx512bw && cpu.avx512dq && cpu.avx512vl && cpu.avx2 && cpu.fma;
  if (avx512 && cpu.avx512bf16) return KernelGeneration::kAvx512Bf16;
  if (avx512) return KernelGeneration::kAvx512;
  if (cpu.avx2 && cpu.fma) return KernelGeneration::kAvx2;
  return KernelGeneration::kOlder;
}

std::string core_of_generation(KernelGeneration generation) {
  switch (generation) {
    case KernelGeneration::kAvx2: return "Haswell";
    case KernelGeneration::kAvx512: return "SkylakeX";
    case KernelGeneration::kAvx512Bf16: return "Cooperlake";
    case KernelGeneration::kOlder: break;
  }
  return "";
}

BlasCoreDecision decide_blas_core(std::string_view setting, const char* operator_core, std::string_view loaded_core,
                                  const CpuFeatures& cpu) {
  BlasCoreDecision decision;
  const KernelGeneration supported = generation_of_cpu(cpu);
  const auto older_than_cpu = [&](std::string_view core, const std::string& whose, const std::string& change) {
    if (generation_of_core(core) >= supported) return std::string();
    return fmt::format(
        "OpenBLAS runs its {} kernels ({}) on a CPU that runs {} ({}): {}, so the CPU backend's GEMMs run several "
        "times slower than they could; {}",
        core, generation_name(generation_of_core(core)), core_of_generation(supported), generation_name(supported),
        whose, change);
  };
  if (operator_core != nullptr) {
    decision.warning = older_than_cpu(loaded_core, fmt::format("OPENBLAS_CORETYPE={} chose them", operator_core),
                                      "keel respects the variable: unset it to let train.blas_core = \"auto\" choose");
    return decision;
  }
  if (setting == "library") {
    decision.warning = older_than_cpu(loaded_core, "train.blas_core = \"library\" keeps the library's choice",
                                      "set train.blas_core = \"auto\" to run the CPU's own");
    return decision;
  }
  if (setting == "auto") {
    if (generation_of_core(loaded_core) < supported) decision.reexec_with = core_of_generation(supported);
    return decision;
  }
  if (generation_of_core(setting) > supported) {
    decision.error = fmt::format(
        "train.blas_core = \"{}\" needs {} instructions, which this CPU does not run (it runs {}): name an older "
        "core or set \"auto\"",
        setting, generation_name(generation_of_core(setting)), generation_name(supported));
    return decision;
  }
  if (!same_core(setting, loaded_core)) decision.reexec_with = std::string(setting);
  decision.warning = older_than_cpu(setting, fmt::format("train.blas_core = \"{}\" chose them", setting),
                                    "set train.blas_core = \"auto\"");
  return decision;
}

}  // namespace keel::common
