// keel-bench-mlp: the MLP on the GPU at GPT-2 124M's shape (8192 tokens,
// C 768, hidden 3072, bf16 GEMM inputs), side by side in one run:
//   forward   the pre-activation and GELU's output kept as bf16 (the
//             projection's GEMM takes the output as it is), against
//             float32, which that GEMM rounds into a copy first (what the
//             trainer did before);
//   backward  the projection's backward through GELU as the backend runs
//             it (the GEMM written over dpre, GELU' applied in place)
//             against accumulating steps into zeroed buffers.
// Before, the GELU and its derivative were cuBLASLt's GELU_AUX_BIAS and
// DGELU epilogues: this bench measured them against separate kernels on
// the H200 (forward 0.176 vs 0.193 ms a layer, backward 0.479 vs 0.485),
// cuBLASLt ran each as a kernel of its own, which is why both are keel's
// kernels now. Prints one JSON object.
#include "bench/gpu_timing.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/cuda/cuda_backend.h"

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

namespace {

using keel::bench::time_ms;
using keel::trainer::DType;
using keel::trainer::cuda::CudaBackend;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The MLP on the GPU: GELU's output in bf16 against float32, and its backward two ways"};
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
  auto* hidden16 = static_cast<keel::trainer::bf16*>(gpu.alloc(n * H * sizeof(keel::trainer::bf16)));
  auto* pre16 = static_cast<keel::trainer::bf16*>(gpu.alloc(n * H * sizeof(keel::trainer::bf16)));
  float* w_proj = device_array(static_cast<size_t>(C) * H);
  float* out = device_array(n * C);
  float* dout = device_array(n * C);
  float* dpre = device_array(n * H);
  float* dhidden = device_array(n * H);
  float* dw_proj = device_array(static_cast<size_t>(C) * H);
  float* db_proj = device_array(C);

  // The MLP's forward as the trainer runs it (the pre-activation and GELU's
  // output kept as bf16, which the projection takes as it is), then all in
  // float32 (which the projection's GEMM rounds).
  auto forward = [&](keel::trainer::Buffer gelu_out, keel::trainer::Buffer kept_pre) {
    return time_ms(
        gpu.stream(),
        [&] {
          gpu.matmul_forward(kept_pre, inp, w_fc, b_fc, N, C, H);
          gpu.gelu_forward(gelu_out, kept_pre, n * H);
          gpu.matmul_forward(out, gelu_out, w_proj, nullptr, N, H, C);
        },
        warmup, iterations);
  };
  const double forward_bf16 = forward(hidden16, pre16), forward_f32 = forward(hidden, pre);
  // The projection's backward, GELU's output remade as the trainer does:
  // as the backend runs it, then in steps that accumulate into zeroed
  // buffers (what it did where cuBLASLt offered no DGELU).
  const double backward_backend = time_ms(
      gpu.stream(),
      [&] {
        gpu.gelu_forward(hidden16, pre16, n * H);
        gpu.matmul_backward_through_gelu(dpre, dw_proj, db_proj, dout, hidden16, w_proj, pre16, N, H, C);
      },
      warmup, iterations);
  const double backward_accumulating = time_ms(
      gpu.stream(),
      [&] {
        gpu.gelu_forward(hidden16, pre16, n * H);
        gpu.zero(dhidden, n * H * sizeof(float));
        gpu.matmul_backward(dhidden, keel::trainer::Into::kWrite, dw_proj, db_proj, dout, hidden16, w_proj, N, H, C);
        gpu.zero(dpre, n * H * sizeof(float));
        gpu.gelu_backward(dpre, pre16, dhidden, n * H);
      },
      warmup, iterations);
  for (void* ptr : std::initializer_list<void*>{inp, w_fc, b_fc, pre, pre16, hidden, hidden16, w_proj, out, dout, dpre,
                                                dhidden, dw_proj, db_proj}) {
    gpu.free(ptr);
  }

  const nlohmann::json result = {
      {"bench", "keel_mlp"},
      {"shape", {{"tokens", N}, {"channels", C}, {"hidden", H}}},
      {"gemm_inputs", "bf16"},
      {"forward",
       {{"gelu_bf16_ms", forward_bf16}, {"gelu_f32_ms", forward_f32}, {"bf16_speedup", forward_f32 / forward_bf16}}},
      {"backward",
       {{"backend_ms", backward_backend},
        {"accumulating_ms", backward_accumulating},
        {"backend_speedup", backward_accumulating / backward_backend}}}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
