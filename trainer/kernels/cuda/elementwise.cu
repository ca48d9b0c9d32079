// Elementwise kernels and AdamW. Each is memory-bound, so a grid-stride loop
// with coalesced 16-byte accesses (launch.cuh's map) and just enough blocks
// to fill the device is all the speed there is to get. The math is
// cpu_backend.cpp's (AdamW's, GELU's and SwiGLU's shared with it:
// adamw_step.h, gelu.h, swiglu.h) so the tests can compare the two elementwise.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/adamw_step.h"
#include "trainer/kernels/cuda/launch.cuh"
#include "trainer/kernels/gelu.h"
#include "trainer/kernels/swiglu.h"

#include <cuda_bf16.h>

#include <type_traits>

namespace keel::trainer::cuda {
namespace {

// expf clamped as the CPU's exp clamps its argument (gelu.h).
struct ClampedExp {
  __device__ float operator()(float x) const { return expf(fminf(fmaxf(x, -87.0f), 88.0f)); }
};

// The per-element functions map() applies (launch.cuh).
struct Gelu {
  __device__ float operator()(float x) const { return gelu(x, ClampedExp{}); }
};
// dinp + GELU'(x) dout: the gradient added to dinp.
struct GeluGradAdded {
  __device__ float operator()(float dinp, float x, float dout) const { return dinp + gelu_grad(x, ClampedExp{}) * dout; }
};
struct GeluGradTimes {
  __device__ float operator()(float grad, float x) const { return gelu_grad(x, ClampedExp{}) * grad; }
};
struct Identity {
  __device__ float operator()(float x) const { return x; }
};
// Identity into a bf16 output: a functor of its own so that a profile's
// kernel names tell the rounding apart from the widening.
struct RoundToBf16 {
  __device__ float operator()(float x) const { return x; }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Element i of the rows x cols block: row i / cols, column i % cols.
__global__ void accumulate_columns_kernel(float* dst, int dst_ld, const float* src, int src_ld, int cols, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t r = i / static_cast<size_t>(cols), c = i % static_cast<size_t>(cols);
    dst[r * dst_ld + c] += src[r * src_ld + c];
  }
}

// SwiGLU over rows of [gate | up]: element i of the [N, F] output.
template <typename O, typename I>
__global__ void swiglu_forward_kernel(O* out, const I* inp, int F, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t gate = i / F * 2 * F + i % F;
    store(out + i, swiglu(load(inp + gate), load(inp + gate + F), ClampedExp{}));
  }
}
template <typename G, typename I>
__global__ void swiglu_backward_kernel(G* dinp, const I* inp, const float* dout, int F, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t gate = i / F * 2 * F + i % F;
    float dgate = 0.0f, dup = 0.0f;
    swiglu_grad(load(inp + gate), load(inp + gate + F), dout[i], ClampedExp{}, &dgate, &dup);
    store(dinp + gate, dgate);
    store(dinp + gate + F, dup);
  }
}

// AdamW over up to kMax tensors a launch, passed by value (kernel
// parameters, about 2 KB): a block updates one chunk of kChunk elements
// of its tensor.
struct AdamwBatch {
  static constexpr int kMax = 24;
  static constexpr size_t kChunk = size_t{1} << 14;
  AdamwTensor tensors[kMax];
  AdamwStep steps[kMax];
  BlockSplit<kMax> split;
};

__global__ void adamw_kernel(AdamwBatch batch) {
  const int s = batch.split.span();
  const AdamwTensor& x = batch.tensors[s];
  const size_t begin = batch.split.chunk(s) * AdamwBatch::kChunk;
  const size_t end = min(x.n, begin + AdamwBatch::kChunk);
  auto* copy = reinterpret_cast<__nv_bfloat16*>(x.copy);
  for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float p = batch.steps[s].apply(x.params, x.grads, x.m, x.v, i);
    if (copy != nullptr) copy[i] = __float2bfloat16_rn(p);
  }
}

}  // namespace

void CudaBackend::gelu_forward(Buffer out, ConstBuffer inp, size_t n) {
  with_type<__nv_bfloat16>(out, [&](auto* to) {
    with_type<__nv_bfloat16>(inp, [&](const auto* from) { map("gelu_forward", stream(), Gelu{}, n, to, from); });
  });
}

void CudaBackend::swiglu_forward(Buffer out, ConstBuffer inp, int N, int F) {
  with_type<__nv_bfloat16>(out, [&](auto* to) {
    with_type<__nv_bfloat16>(inp, [&](const auto* from) {
      using O = std::remove_pointer_t<decltype(to)>;
      using I = std::remove_const_t<std::remove_pointer_t<decltype(from)>>;
      launch("swiglu_forward", swiglu_forward_kernel<O, I>, static_cast<size_t>(N) * F, stream(), to, from, F);
    });
  });
}

void CudaBackend::swiglu_backward(Buffer dinp, ConstBuffer inp, const float* dout, int N, int F) {
  with_type<__nv_bfloat16>(dinp, [&](auto* to) {
    with_type<__nv_bfloat16>(inp, [&](const auto* from) {
      using G = std::remove_pointer_t<decltype(to)>;
      using I = std::remove_const_t<std::remove_pointer_t<decltype(from)>>;
      launch("swiglu_backward", swiglu_backward_kernel<G, I>, static_cast<size_t>(N) * F, stream(), to, from, dout,
             F);
    });
  });
}

void CudaBackend::gelu_backward(float* dinp, ConstBuffer inp, const float* dout, size_t n) {
  with_type<__nv_bfloat16>(inp, [&](const auto* from) {
    map("gelu_backward", stream(), GeluGradAdded{}, n, dinp, static_cast<const float*>(dinp), from, dout);
  });
}

// out may be grad (map_kernel's aliasing rule).
void CudaBackend::gelu_derivative_times(Buffer out, const float* grad, ConstBuffer pre, size_t n) {
  with_type<__nv_bfloat16>(out, [&](auto* to) {
    with_type<__nv_bfloat16>(pre, [&](const auto* from) {
      map("gelu_derivative_times", stream(), GeluGradTimes{}, n, to, grad, from);
    });
  });
}

void CudaBackend::round_to_bf16(bf16* out, const float* in, size_t n) {
  map("round_to_bf16", stream(), RoundToBf16{}, n, reinterpret_cast<__nv_bfloat16*>(out), in);
}

void CudaBackend::widen_from_bf16(float* out, const bf16* in, size_t n) {
  map("widen_from_bf16", stream(), Identity{}, n, out, reinterpret_cast<const __nv_bfloat16*>(in));
}

void CudaBackend::accumulate(float* dst, const float* src, size_t n) {
  map("accumulate", stream(), Sum{}, n, dst, static_cast<const float*>(dst), src);
}

void CudaBackend::copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) {
  if (rows == 0 || cols == 0) return;
  check(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_ld) * sizeof(float), src,
                          static_cast<size_t>(src_ld) * sizeof(float), static_cast<size_t>(cols) * sizeof(float),
                          static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream()),
        "cudaMemcpy2DAsync on device");
}

void CudaBackend::accumulate_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) {
  launch("accumulate_columns", accumulate_columns_kernel, static_cast<size_t>(rows) * static_cast<size_t>(cols),
         stream(), dst, dst_ld, src, src_ld, cols);
}

void CudaBackend::adamw_update(const std::vector<AdamwTensor>& tensors, float lr, float beta1, float beta2, float eps,
                               float grad_scale, int64_t t) {
  for (size_t next = 0; next < tensors.size();) {
    AdamwBatch batch{};
    for (; next < tensors.size() && !batch.split.full(); ++next) {
      const AdamwTensor& x = tensors[next];
      const int s = batch.split.count;
      batch.tensors[s] = x;
      batch.steps[s] = AdamwStep::at(lr, beta1, beta2, eps, x.weight_decay, grad_scale, t);
      batch.split.add((x.n + AdamwBatch::kChunk - 1) / AdamwBatch::kChunk);
    }
    if (batch.split.blocks() == 0) continue;
    adamw_kernel<<<batch.split.blocks(), kThreads, 0, stream()>>>(batch);
    check_launch("adamw_update");
  }
}

}  // namespace keel::trainer::cuda
