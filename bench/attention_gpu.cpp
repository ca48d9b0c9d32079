// keel-bench-attention: causal attention forward + backward on the GPU at
// GPT-2 124M's shape (batch 8, 12 heads, T 1024, head 64), the tensor-core
// kernels (bf16 GEMM inputs, on qkv, output and dqkv kept as bf16, as a
// training step keeps them) against the float32 ones, side by side in one
// run. FLOPs as issue 27 counts them: 4·B·H·T²·d/2 forward (the causal
// half of two T x T x d products) and 2.5 times that backward. Prints one
// JSON object; scripts/gpu-check puts it beside torch's SDPA at the same
// shape (bench/torch_gpt2_gpu.py).
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
using keel::trainer::Backend;
using keel::trainer::DType;
using keel::trainer::cuda::CudaBackend;

struct Shape {
  int B, NH, T, d;
  int C() const { return NH * d; }
  double forward_flops() const { return 4.0 * B * NH * static_cast<double>(T) * T * d / 2.0; }
};

// Milliseconds per forward and per backward, the mean over `iterations`
// after `warmup`, timed by events on the backend's stream.
nlohmann::json measure(DType precision, const Shape& s, int warmup, int iterations) {
  CudaBackend gpu(0, precision);
  const size_t n = static_cast<size_t>(s.B) * s.T, C = static_cast<size_t>(s.C());
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  auto device_array = [&](size_t count, bool random) {
    std::vector<float> host(count, 0.0f);
    if (random) {
      for (float& x : host) x = uniform(rng);
    }
    auto* ptr = static_cast<float*>(gpu.alloc(count * sizeof(float)));
    gpu.copy_from_host(ptr, host.data(), count * sizeof(float));
    return ptr;
  };
  float* qkv = device_array(n * 3 * C, true);
  float* out = device_array(n * C, false);
  float* lse = device_array(static_cast<size_t>(s.B) * s.NH * s.T, false);
  float* dout = device_array(n * C, true);
  float* dqkv = device_array(n * 3 * C, false);
  // With bf16 GEMM inputs, qkv, the output and dqkv as the trainer keeps
  // them without CP (Gpt::lay_out): bf16, so the kernels take the path a
  // training step takes (tiles copied by cp.async, dqkv written over).
  const DType kept = precision;
  auto as_kept = [&](float* f32, size_t count) -> void* {
    if (kept == DType::kF32) return f32;
    void* copy = gpu.alloc(count * keel::trainer::dtype_bytes(kept));
    gpu.round_to_bf16(static_cast<keel::trainer::bf16*>(copy), f32, count);
    return copy;
  };
  void* qkv_kept = as_kept(qkv, n * 3 * C);
  void* out_kept = as_kept(out, n * C);
  void* dqkv_kept = as_kept(dqkv, n * 3 * C);
  const keel::trainer::Buffer out_buffer(out_kept, kept);
  const auto in = Backend::self_attention(keel::trainer::ConstBuffer(qkv_kept, kept), s.B, s.T, s.C(), s.NH);
  cudaEvent_t start, forwarded, done;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&forwarded), "cudaEventCreate");
  check(cudaEventCreate(&done), "cudaEventCreate");
  float forward_ms = 0, backward_ms = 0;
  for (int i = 0; i < warmup + iterations; ++i) {
    check(cudaEventRecord(start, gpu.stream()), "cudaEventRecord");
    gpu.attention_forward(out_buffer, lse, in);
    check(cudaEventRecord(forwarded, gpu.stream()), "cudaEventRecord");
    gpu.attention_backward(Backend::self_attention_grads(keel::trainer::Buffer(dqkv_kept, kept), s.C()), dout,
                           out_buffer, lse, in);
    check(cudaEventRecord(done, gpu.stream()), "cudaEventRecord");
    check(cudaEventSynchronize(done), "cudaEventSynchronize");
    if (i < warmup) continue;
    float f = 0, b = 0;
    check(cudaEventElapsedTime(&f, start, forwarded), "cudaEventElapsedTime");
    check(cudaEventElapsedTime(&b, forwarded, done), "cudaEventElapsedTime");
    forward_ms += f / iterations;
    backward_ms += b / iterations;
  }
  for (float* ptr : {qkv, out, lse, dout, dqkv}) gpu.free(ptr);
  if (kept != DType::kF32) {
    for (void* ptr : {qkv_kept, out_kept, dqkv_kept}) gpu.free(ptr);
  }
  const double flops = s.forward_flops();
  return {{"precision", keel::trainer::dtype_name(precision)},
          {"forward_ms", forward_ms},
          {"backward_ms", backward_ms},
          {"forward_tflops", flops / (forward_ms * 1e-3) / 1e12},
          {"backward_tflops", 2.5 * flops / (backward_ms * 1e-3) / 1e12},
          {"tflops", 3.5 * flops / ((forward_ms + backward_ms) * 1e-3) / 1e12}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Causal attention forward + backward on the GPU: tensor cores (bf16) against float32"};
  Shape s{8, 12, 1024, 64};
  int warmup = 3, iterations = 20;
  app.add_option("--batch", s.B, "sequences")->capture_default_str();
  app.add_option("--heads", s.NH, "attention heads")->capture_default_str();
  app.add_option("--seq-len", s.T, "positions")->capture_default_str();
  app.add_option("--head-dim", s.d, "channels per head")->capture_default_str();
  app.add_option("--iterations", iterations, "timed forward + backward passes")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::string why;
  if (!keel::trainer::cuda::device_available(&why)) {
    std::fprintf(stderr, "keel-bench-attention: no usable CUDA device: %s\n", why.c_str());
    return 1;
  }
  const nlohmann::json tensor_cores = measure(DType::kBF16, s, warmup, iterations);
  const nlohmann::json float32 = measure(DType::kF32, s, 1, 3);
  auto pass_ms = [](const nlohmann::json& m) {
    return m["forward_ms"].get<double>() + m["backward_ms"].get<double>();
  };
  const nlohmann::json result = {
      {"bench", "keel_attention"},
      {"shape", {{"batch", s.B}, {"heads", s.NH}, {"seq_len", s.T}, {"head_dim", s.d}}},
      {"forward_flops", s.forward_flops()},
      {"bf16", tensor_cores},
      {"fp32", float32},
      {"bf16_speedup_over_fp32", pass_ms(float32) / pass_ms(tensor_cores)}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
