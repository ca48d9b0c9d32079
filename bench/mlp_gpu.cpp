// keel-bench-mlp: the MLP's GELU on the GPU at GPT-2 124M's shape (8192
// tokens, C 768, hidden 3072, bf16 GEMM inputs), fused into cuBLASLt's
// epilogues (matmul_gelu_forward's GELU_AUX_BIAS, matmul_backward_through_
// gelu's DGELU) against the separate kernels they replace, side by side in
// one run. The H200 profile of c6a9a61 showed cuBLASLt running the fused
// forward's epilogue as a kernel of its own (cublasLt::globalKernel, about
// 0.19 ms a layer): this says which way is faster. Prints one JSON object.
#include "bench/gpu_timing.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/cuda/cuda_backend.h"

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using keel::bench::check;
using keel::bench::time_ms;
using keel::trainer::DType;
using keel::trainer::cuda::CudaBackend;

nlohmann::json compare(double fused_ms, double separate_ms) {
  return {{"fused_ms", fused_ms}, {"separate_ms", separate_ms}, {"fused_speedup", separate_ms / fused_ms}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The MLP's GELU on the GPU: fused into cuBLASLt's epilogues against separate kernels"};
  int N = 8192, C = 768, H = 3072, warmup = 5, iterations = 50;
  app.add_option("--tokens", N, "rows (batch x sequence)")->capture_default_str();
  app.add_option("--channels", C, "model width")->capture_default_str();
  app.add_option("--hidden", H, "MLP width")->capture_default_str();
  app.add_option("--iterations", iterations, "timed passes of each")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::string why;
  if (!keel::trainer::cuda::device_available(&why)) {
    std::fprintf(stderr, "keel-bench-mlp: no usable CUDA device: %s\n", why.c_str());
    return 1;
  }
  CudaBackend gpu(0, DType::kBF16);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  auto device_array = [&](size_t count) {
    std::vector<float> host(count);
    for (float& x : host) x = uniform(rng);
    auto* ptr = static_cast<float*>(gpu.alloc(count * sizeof(float)));
    gpu.copy_from_host(ptr, host.data(), count * sizeof(float));
    return ptr;
  };
  const size_t n = static_cast<size_t>(N);
  float* inp = device_array(n * C);
  float* w_fc = device_array(static_cast<size_t>(H) * C);
  float* b_fc = device_array(H);
  float* pre = device_array(n * H);
  float* hidden = device_array(n * H);  // GELU(pre), the projection's input
  float* w_proj = device_array(static_cast<size_t>(C) * H);
  float* dout = device_array(n * C);
  float* dpre = device_array(n * H);
  float* dhidden = device_array(n * H);
  float* dw_proj = device_array(static_cast<size_t>(C) * H);
  float* db_proj = device_array(C);

  const double forward_fused = time_ms(
      gpu.stream(), [&] { gpu.matmul_gelu_forward(hidden, pre, inp, w_fc, b_fc, N, C, H); }, warmup, iterations);
  const double forward_separate = time_ms(
      gpu.stream(),
      [&] {
        gpu.matmul_forward(pre, inp, w_fc, b_fc, N, C, H);
        gpu.gelu_forward(hidden, pre, n * H);
      },
      warmup, iterations);
  const double backward_fused = time_ms(
      gpu.stream(),
      [&] { gpu.matmul_backward_through_gelu(dpre, dw_proj, db_proj, dout, hidden, w_proj, pre, N, H, C); }, warmup,
      iterations);
  // What matmul_backward_through_gelu does where cuBLASLt offers no DGELU.
  const double backward_separate = time_ms(
      gpu.stream(),
      [&] {
        gpu.zero(dhidden, n * H * sizeof(float));
        gpu.matmul_backward(dhidden, dw_proj, db_proj, dout, hidden, w_proj, N, H, C);
        gpu.zero(dpre, n * H * sizeof(float));
        gpu.gelu_backward(dpre, pre, dhidden, n * H);
      },
      warmup, iterations);
  for (float* ptr : {inp, w_fc, b_fc, pre, hidden, w_proj, dout, dpre, dhidden, dw_proj, db_proj}) gpu.free(ptr);

  const nlohmann::json result = {{"bench", "keel_mlp_gelu"},
                                 {"shape", {{"tokens", N}, {"channels", C}, {"hidden", H}}},
                                 {"gemm_inputs", "bf16"},
                                 {"forward", compare(forward_fused, forward_separate)},
                                 {"backward", compare(backward_fused, backward_separate)}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
