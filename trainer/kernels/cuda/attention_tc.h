// Causal attention on tensor cores (attention_tc.cu): the bf16 path of
// CudaBackend::attention_forward and attention_backward, with the
// contracts of backend_kernels.def. Internal to trainer/kernels/cuda.
#pragma once

#include "trainer/kernels/backend.h"

#include <cuda_runtime.h>

#include <cstddef>

namespace keel::trainer::cuda {

// Whether the tensor-core kernels take these views: head dimension 64 or
// 128, rows of whole 16-byte vectors on 16-byte boundaries, at most 65535
// (batch, head) pairs. Otherwise the float32 kernels of attention.cu serve.
bool tensor_core_attention_fits(const Backend::AttentionInputs& in);

void tensor_core_attention_forward(cudaStream_t stream, Buffer out, float* lse, const Backend::AttentionInputs& in);

// scratch: device memory of tensor_core_attention_scratch_bytes(in), at
// least 16-byte aligned (the rows' statistics and dO as bf16).
size_t tensor_core_attention_scratch_bytes(const Backend::AttentionInputs& in);
void tensor_core_attention_backward(cudaStream_t stream, const Backend::AttentionGrads& grads, const float* dout,
                                    ConstBuffer out, const float* lse, const Backend::AttentionInputs& in,
                                    void* scratch);

}  // namespace keel::trainer::cuda
