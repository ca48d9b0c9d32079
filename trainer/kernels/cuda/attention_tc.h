// Causal attention on tensor cores (attention_tc.cu): the bf16 path of
// CudaBackend::attention_forward and attention_backward, with the
// contracts of backend_kernels.def. Internal to trainer/kernels/cuda.
#pragma once

#include "trainer/kernels/backend.h"

#include <cuda_runtime.h>

namespace keel::trainer::cuda {

// Whether the tensor-core kernels take these views: head dimension 64 or
// 128, rows of whole float4s on 16-byte boundaries (and dout's, when
// given), at most 65535 (batch, head) pairs. Otherwise the float32
// kernels of attention.cu serve.
bool tensor_core_attention_fits(const Backend::AttentionInputs& in, const float* dout = nullptr);

void tensor_core_attention_forward(cudaStream_t stream, Buffer out, float* lse, const Backend::AttentionInputs& in);

// row_dots: device scratch of B * NH * Tq floats (D_t = dO_t . O_t).
void tensor_core_attention_backward(cudaStream_t stream, const Backend::AttentionGrads& grads, const float* dout,
                                    ConstBuffer out, const float* lse, const Backend::AttentionInputs& in,
                                    float* row_dots);

}  // namespace keel::trainer::cuda
