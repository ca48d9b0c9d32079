// keel-bench-gemm: GPT-2 124M's GEMMs (batch 8 x 1024 tokens) four ways,
// side by side in one run:
//   model       CudaBackend's matmuls on the operands the trainer hands them
//               now with bf16 GEMM inputs: the weights' bf16 copy
//               (ZeroStorage), the activations kept as bf16, each output in
//               the type the model keeps it and each output gradient in the
//               type it has (the residual stream's and qkv's float32,
//               rounded by the backend; fc's and the logits' bf16), the
//               MLP's projection taken on through GELU's derivative into a
//               bf16 dpre as Gpt's backward does;
//   backend     the same matmuls on float32 operands only: each rounded
//               into a bf16 copy by a kernel of keel's, then a bf16 GEMM
//               (how the trainer ran them before its arrays became bf16);
//   cublas_fast the same float32 operands given to cuBLASLt with
//               CUBLAS_COMPUTE_32F_FAST_16BF, which rounds them itself;
//   bf16_only   the bf16 GEMM alone on operands rounded beforehand: what
//               either way costs at best.
// The H200 profile of c6a9a61 had keel's rounding kernel at 5.3 ms of a
// 45 ms step: this says whether cuBLASLt's own rounding removes it. Prints
// one JSON object.
#include "bench/gpu_timing.h"
#include "trainer/kernels/cuda/cublaslt_gemm.h"
#include "trainer/kernels/cuda/cuda_backend.h"
#include "trainer/kernels/dtype.h"

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using keel::bench::check;
using keel::bench::time_ms;
using keel::trainer::DType;
using keel::trainer::cuda::CublasLtGemm;
using keel::trainer::cuda::CudaBackend;
using keel::trainer::cuda::GemmInputs;

// A linear layer's operands, float32 and rounded to bf16, on the device.
struct Linear {
  int N, C, OC;
  float *x = nullptr, *w = nullptr, *bias = nullptr, *out = nullptr, *dout = nullptr, *dx = nullptr, *dw = nullptr;
  void *x16 = nullptr, *w16 = nullptr, *dout16 = nullptr, *out16 = nullptr, *dx16 = nullptr;
};

// What the model keeps a linear's output and output gradient as (Gpt, docs/architecture.md "Dtypes").
struct Kept {
  bool out_bf16;      // qkv, the MLP's pre-activation and the logits are kept as bf16
  bool dout_bf16;     // the pre-activation's gradient and the logits' are bf16
  bool through_gelu;  // the MLP's projection: its input gradient goes on through GELU into a bf16 dpre
};

class Operands {
 public:
  explicit Operands(CudaBackend& gpu) : gpu_(gpu) {}
  ~Operands() {
    for (void* ptr : owned_) gpu_.free(ptr);
  }
  float* f32(const std::vector<float>& host) {
    return static_cast<float*>(upload(host.data(), host.size() * sizeof(float)));
  }
  void* bf16(const std::vector<float>& host) {
    std::vector<keel::trainer::bf16> rounded(host.size());
    for (size_t i = 0; i < host.size(); ++i) rounded[i] = keel::trainer::to_bf16(host[i]);
    return upload(rounded.data(), rounded.size() * sizeof(keel::trainer::bf16));
  }
  float* zeros(size_t count) {
    auto* ptr = static_cast<float*>(upload(nullptr, count * sizeof(float)));
    gpu_.zero(ptr, count * sizeof(float));
    return ptr;
  }
  std::vector<float> random(size_t count) {
    std::vector<float> host(count);
    for (float& v : host) v = uniform_(rng_);
    return host;
  }
  Linear linear(int N, int C, int OC) {
    const size_t n = static_cast<size_t>(N);
    const auto x = random(n * C), w = random(static_cast<size_t>(OC) * C), dout = random(n * OC);
    Linear l{N, C, OC};
    l.x = f32(x);
    l.w = f32(w);
    l.dout = f32(dout);
    l.x16 = bf16(x);
    l.w16 = bf16(w);
    l.dout16 = bf16(dout);
    l.bias = f32(random(OC));
    l.out = zeros(n * OC);
    l.out16 = upload(nullptr, n * OC * sizeof(keel::trainer::bf16));
    l.dx16 = upload(nullptr, n * C * sizeof(keel::trainer::bf16));
    l.dx = zeros(n * C);
    l.dw = zeros(static_cast<size_t>(OC) * C);
    return l;
  }

 private:
  void* upload(const void* host, size_t bytes) {
    void* ptr = gpu_.alloc(bytes);
    if (host != nullptr) gpu_.copy_from_host(ptr, host, bytes);
    owned_.push_back(ptr);
    return ptr;
  }
  CudaBackend& gpu_;
  std::vector<void*> owned_;
  std::mt19937 rng_{1};
  std::uniform_real_distribution<float> uniform_{-1.0f, 1.0f};
};

// The GEMMs of matmul.cu's matmul_forward and matmul_backward (dinp and
// dweight), in cuBLAS's column-major terms.
void forward(CublasLtGemm& gemm, cudaStream_t s, GemmInputs in, const Linear& l, const void* x, const void* w) {
  gemm.run(s, true, false, l.OC, l.N, l.C, in, w, l.C, x, l.C, 0.0f, l.out, l.OC, l.bias);
}
void backward(CublasLtGemm& gemm, cudaStream_t s, GemmInputs in, const Linear& l, const void* x, const void* w,
              const void* dout) {
  gemm.run(s, false, false, l.C, l.N, l.OC, in, w, l.C, dout, l.OC, 1.0f, l.dx, l.C, nullptr);
  gemm.run(s, false, true, l.C, l.OC, l.N, in, x, l.C, dout, l.OC, 1.0f, l.dw, l.C, nullptr);
}

nlohmann::json measure(CudaBackend& gpu, CublasLtGemm& gemm, const Linear& l, Kept kept, int warmup, int iterations) {
  using keel::trainer::Buffer;
  using keel::trainer::ConstBuffer;
  const cudaStream_t s = gpu.stream();
  auto four_ways = [&](const std::function<void()>& model, const std::function<void()>& backend,
                       const std::function<void()>& fast, const std::function<void()>& bf16_only, double flops) {
    const double model_ms = time_ms(s, model, warmup, iterations);
    const double backend_ms = time_ms(s, backend, warmup, iterations);
    const double fast_ms = time_ms(s, fast, warmup, iterations);
    const double bf16_ms = time_ms(s, bf16_only, warmup, iterations);
    return nlohmann::json{{"model_ms", model_ms},
                          {"backend_ms", backend_ms},
                          {"cublas_fast_ms", fast_ms},
                          {"bf16_only_ms", bf16_ms},
                          {"cublas_fast_speedup", backend_ms / fast_ms},
                          {"bf16_only_tflops", flops / (bf16_ms * 1e-3) / 1e12},
                          {"cublas_fast_tflops", flops / (fast_ms * 1e-3) / 1e12}};
  };
  const double flops = 2.0 * l.N * l.C * l.OC;
  const ConstBuffer x16(l.x16, DType::kBF16), w16(l.w16, DType::kBF16);
  const Buffer out = kept.out_bf16 ? Buffer(l.out16, DType::kBF16) : Buffer(l.out);
  const ConstBuffer dout = kept.dout_bf16 ? ConstBuffer(l.dout16, DType::kBF16) : ConstBuffer(l.dout);
  return {{"shape", {{"N", l.N}, {"C", l.C}, {"OC", l.OC}}},
          {"forward", four_ways([&] { gpu.matmul_forward(out, x16, w16, l.bias, l.N, l.C, l.OC); },
                                [&] { gpu.matmul_forward(l.out, l.x, l.w, l.bias, l.N, l.C, l.OC); },
                                [&] { forward(gemm, s, GemmInputs::kF32RoundedToBF16, l, l.x, l.w); },
                                [&] { forward(gemm, s, GemmInputs::kBF16, l, l.x16, l.w16); }, flops)},
          {"backward", four_ways(
                           [&] {
                             // The input x16 stands for GELU's output and for the pre-activation it came from.
                             if (kept.through_gelu) {
                               gpu.matmul_backward_through_gelu(Buffer(l.dx16, DType::kBF16), l.dw, nullptr, dout, x16,
                                                                w16, x16, l.N, l.C, l.OC);
                             } else {
                               gpu.matmul_backward(l.dx, keel::trainer::Into::kWrite, l.dw, nullptr, dout, x16, w16, l.N, l.C, l.OC);
                             }
                           },
                           [&] { gpu.matmul_backward(l.dx, keel::trainer::Into::kWrite, l.dw, nullptr, l.dout, l.x, l.w, l.N, l.C, l.OC); },
                           [&] { backward(gemm, s, GemmInputs::kF32RoundedToBF16, l, l.x, l.w, l.dout); },
                           [&] { backward(gemm, s, GemmInputs::kBF16, l, l.x16, l.w16, l.dout16); }, 2 * flops)}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT-2 124M's GEMMs: keel's bf16 copies against cuBLASLt's own rounding (COMPUTE_32F_FAST_16BF)"};
  int tokens = 8192, warmup = 3, iterations = 20;
  app.add_option("--tokens", tokens, "rows (batch x sequence)")->capture_default_str();
  app.add_option("--iterations", iterations, "timed passes of each")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::string why;
  if (!keel::trainer::cuda::device_available(&why)) {
    std::fprintf(stderr, "keel-bench-gemm: no usable CUDA device: %s\n", why.c_str());
    return 1;
  }
  CudaBackend gpu(0, DType::kBF16);
  CublasLtGemm gemm;
  nlohmann::json layers = nlohmann::json::object();
  double model_ms = 0, backend_ms = 0, fast_ms = 0, bf16_ms = 0;
  // Per block: qkv, attention projection, MLP up, MLP down; then the
  // classifier over the padded vocabulary (once per step).
  const struct {
    const char* name;
    int C, OC, per_step;
    Kept kept;
  } shapes[] = {{"qkv", 768, 2304, 12, {true, false, false}},
                {"attention_proj", 768, 768, 12, {false, false, false}},
                {"mlp_fc", 768, 3072, 12, {true, true, false}},
                {"mlp_proj", 3072, 768, 12, {false, false, true}},
                {"classifier", 768, 50304, 1, {true, true, false}}};
  for (const auto& shape : shapes) {
    nlohmann::json m;
    {
      Operands operands(gpu);
      m = measure(gpu, gemm, operands.linear(tokens, shape.C, shape.OC), shape.kept, warmup, iterations);
      check(cudaStreamSynchronize(gpu.stream()), "cudaStreamSynchronize");
    }
    for (const char* pass : {"forward", "backward"}) {
      model_ms += shape.per_step * m[pass]["model_ms"].get<double>();
      backend_ms += shape.per_step * m[pass]["backend_ms"].get<double>();
      fast_ms += shape.per_step * m[pass]["cublas_fast_ms"].get<double>();
      bf16_ms += shape.per_step * m[pass]["bf16_only_ms"].get<double>();
    }
    layers[shape.name] = m;
  }
  const nlohmann::json result = {{"bench", "keel_gemm"},
                                 {"tokens", tokens},
                                 {"shapes", layers},
                                 {"step_ms",
                                  {{"model", model_ms},
                                   {"backend", backend_ms},
                                   {"cublas_fast", fast_ms},
                                   {"bf16_only", bf16_ms},
                                   {"cublas_fast_speedup", backend_ms / fast_ms}}}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
