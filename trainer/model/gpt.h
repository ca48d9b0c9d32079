// GPT-2 (DESIGN §3.1) with optional dropless top-k MoE blocks, written out
// layer by layer: forward() keeps every activation backward() needs, and
// backward() walks the same layers in reverse. There is no autograd.
#pragma once

#include "common/config.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/backend_array.h"
#include "trainer/model/parameters.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace keel::trainer {

class Gpt {
 public:
  // Allocates parameters, gradients and activations for batches of up to
  // max_batch sequences of config.seq_len tokens. Parameters start at zero:
  // call init() or load them.
  Gpt(const common::ModelConfig& config, Backend& backend, int max_batch);
  ~Gpt();

  const common::ModelConfig& config() const { return config_; }
  const ParameterTable& table() const { return table_; }
  Backend& backend() { return backend_; }

  // Flat buffers in backend memory, table().total() floats each.
  float* params() { return params_.data(); }
  float* grads() { return grads_.data(); }

  // Draws the initial model from the counter RNG (see init_parameters).
  void init(uint64_t seed);

  // Runs B sequences (host tokens, [B, seq_len] each) and returns the mean
  // cross-entropy. aux_loss() then holds the MoE load-balancing loss.
  float forward(const int32_t* inputs, const int32_t* targets, int B);
  float aux_loss() const { return aux_loss_; }

  // Accumulates the gradient of loss_scale * (cross-entropy + aux loss) of
  // the last forward() into grads(). Overwrites logits().
  void backward(float loss_scale);

  // [B, seq_len, padded_vocab] after forward(), in backend memory.
  const float* logits() const;

  void zero_grads() { grads_.zero(); }

 private:
  struct Activations;
  struct MoeLayer;

  void moe_forward(int layer, const float* inp, float* out, int N);
  void moe_backward(int layer, float* dinp, const float* dout, float loss_scale, int N);

  common::ModelConfig config_;
  Backend& backend_;
  ParameterTable table_;
  int max_batch_;
  BackendArray<float> params_;
  BackendArray<float> grads_;
  std::unique_ptr<Activations> acts_;
  int batch_ = 0;  // B of the last forward()
  float aux_loss_ = 0.0f;
};

}  // namespace keel::trainer
