// The first CUDA kernels of the kernel interface (docs/architecture.md "Kernels"): GELU, the
// residual accumulate and AdamW, with the CPU backend's math so the two can
// be held against each other. Free functions on device pointers and a stream;
// the CUDA backend class wraps them when it arrives. A failed launch throws
// keel::common::Error with ErrorCode::kInternal. Plain C++ can include this
// header: it needs only the CUDA runtime API's types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace keel::trainer::cuda {

// Whether a CUDA device can be used; when not, *why (if non-null) says why.
bool device_available(std::string* why);

// out = gelu(inp), tanh form.
void gelu_forward(float* out, const float* inp, size_t n, cudaStream_t stream);
// dinp += gelu'(inp) * dout.
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n, cudaStream_t stream);
// dst += src.
void accumulate(float* dst, const float* src, size_t n, cudaStream_t stream);
// One AdamW step, as Backend::adamw_update.
void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, float grad_scale, int64_t t, cudaStream_t stream);

}  // namespace keel::trainer::cuda
