// The trainer tests run on the BLAS core keel-trainer runs on this machine
// (trainer/train/blas_core_start.h), proved the same way: a kernel computed
// here and one computed by a keel-trainer child use the same GEMM kernels,
// so results compared bit for bit across the two are comparable at all.
#define DOCTEST_CONFIG_IMPLEMENT
#include "trainer/kernels/cpu_backend.h"
#include "trainer/train/blas_core_start.h"

#include <doctest/doctest.h>
#include <omp.h>

int main(int argc, char** argv) {
  const auto blas = keel::trainer::settle_blas_core("auto", argv);
  if (blas.keel_chose()) {
    // A CpuBackend sets the process's OpenMP thread count; the tests start
    // from the machine's own.
    const int threads = omp_get_max_threads();
    {
      keel::trainer::CpuBackend cpu(1);
      keel::trainer::prove_blas_core(blas, cpu, false, argv);
    }
    omp_set_num_threads(threads);
  }
  return doctest::Context(argc, argv).run();
}
