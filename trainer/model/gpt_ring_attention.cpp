// Gpt's attention (docs/architecture.md "Context parallelism"): one
// kernel call without context parallelism, else the ring that passes each
// rank's keys and values around the CP group.
#include "trainer/model/gpt.h"
#include "trainer/model/gpt_state.h"

#include "common/error.h"

#include <functional>
#include <initializer_list>

namespace keel::trainer {

void Gpt::visible_pairs(const float* qkv, const float* held, bool packed, int owner, int B,
                        const std::function<void(int, int, const Backend::AttentionInputs&)>& visit) {
  const Sizes z = sizes();
  const int Tc = context_.chunk_len(), rank = context_.rank;
  const size_t rows = static_cast<size_t>(B) * Tc;
  const int ld_kv = packed ? 2 * z.KVl : z.W, k_at = packed ? 0 : z.Cl;
  for (int qc = 0; qc < 2; ++qc) {
    for (int kc = 0; kc < 2; ++kc) {
      if (causal_mask(context_.global_chunk(qc, rank), context_.global_chunk(kc, owner)) == ChunkMask::kNone) continue;
      const float* keys = held + kc * rows * ld_kv + k_at;
      visit(qc, kc,
            {qkv + qc * rows * z.W, keys, keys + z.KVl, z.W, ld_kv, B, Tc, Tc, z.Cl, z.NHl, context_.start(qc, rank),
             context_.start(kc, owner), DType::kF32, z.KVHl});
    }
  }
}

const float* Gpt::packed_keys(const float* qkv, int B) {
  const Sizes z = sizes();
  const int rows = B * context_.local_len();
  float* kv = scratch_->ring[0].data();
  backend_.copy_columns(kv, 2 * z.KVl, qkv + z.Cl, z.W, rows, 2 * z.KVl);
  return kv;
}

namespace {

// The ring passes float32 keys, merges float32 outputs and sums float32
// gradients: Gpt::lay_out keeps qkv, attention's output and dqkv so under CP.
void require_float32(std::initializer_list<DType> arrays) {
  for (DType dtype : arrays) {
    if (dtype != DType::kF32) {
      throw common::Error(common::ErrorCode::kInternal, "a bf16 qkv, attention output or dqkv for ring attention");
    }
  }
}

}  // namespace

void Gpt::attend(ConstBuffer qkv_buffer, Buffer out_buffer, float* lse, int B) {
  const Sizes z = sizes();
  const int Cl = z.Cl, NHl = z.NHl;
  Backend& k = backend_;
  if (cp_ == nullptr) {
    k.attention_forward(out_buffer, lse, Backend::self_attention(qkv_buffer, B, context_.local_len(), Cl, NHl, z.KVHl));
    return;
  }
  require_float32({qkv_buffer.dtype, out_buffer.dtype});
  const float* qkv = qkv_buffer.f32();
  auto* out = static_cast<float*>(out_buffer.data);
  // Ring attention: step t holds the k and v of CP rank r - t and passes
  // them on to r + 1. Each local query chunk computes its first chunk of
  // keys in place (its own diagonal, at step 0, from its qkv rows) and
  // merges every later one (online softmax); chunk pairs the causal mask
  // hides are skipped, which is where causal load balancing evens the
  // ranks out. Only k and v travel, packed as [rows, 2KVl].
  Scratch& x = *scratch_;
  const int Tc = context_.chunk_len(), cp = context_.cp, rank = context_.rank;
  const size_t rows = static_cast<size_t>(B) * Tc, numel = 2 * rows * 2 * static_cast<size_t>(z.KVl);
  bool started[2] = {false, false};
  const float* held = qkv;
  for (int step = 0; step < cp; ++step) {
    if (step > 0) {
      if (step == 1) held = packed_keys(qkv, B);
      float* next = x.ring[step % 2].data();
      cp_->exchange({{held, numel, (rank + 1) % cp}}, {{next, numel, (rank + cp - 1) % cp}});
      held = next;
    }
    visible_pairs(qkv, held, step > 0, (rank + cp - step) % cp, B,
                  [&](int qc, int, const Backend::AttentionInputs& in) {
                    float* chunk_out = out + qc * rows * Cl;
                    float* chunk_lse = lse + qc * rows * NHl;
                    if (!started[qc]) {
                      k.attention_forward(chunk_out, chunk_lse, in);
                      started[qc] = true;
                    } else {
                      k.attention_forward(x.part_out.data(), x.part_lse.data(), in);
                      k.attention_merge(chunk_out, chunk_lse, x.part_out.data(), x.part_lse.data(), B, Tc, Cl, NHl);
                    }
                  });
  }
}

void Gpt::attend_backward(ConstBuffer qkv_buffer, ConstBuffer out_buffer, const float* lse, int B) {
  const Sizes z = sizes();
  const int Cl = z.Cl, NHl = z.NHl, W = z.W, KVl = z.KVl;
  Backend& k = backend_;
  Scratch& x = *scratch_;
  const Buffer dqkv_buffer = x.dqkv.buffer();
  const size_t dqkv_numel = x.dqkv.size();
  if (cp_ == nullptr) {
    // float32 gradients are added to, bf16 ones overwritten.
    if (dqkv_buffer.dtype == DType::kF32) k.zero(dqkv_buffer.data, dqkv_numel * sizeof(float));
    k.attention_backward(Backend::self_attention_grads(dqkv_buffer, Cl, KVl), x.datty.data(), out_buffer, lse,
                         Backend::self_attention(qkv_buffer, B, context_.local_len(), Cl, NHl, z.KVHl));
    return;
  }
  require_float32({qkv_buffer.dtype, out_buffer.dtype, dqkv_buffer.dtype});
  const float* qkv = qkv_buffer.f32();
  const float* out = out_buffer.f32();
  auto* dqkv = static_cast<float*>(dqkv_buffer.data);
  k.zero(dqkv, dqkv_numel * sizeof(float));
  // The ring again. At step 0 this rank's own keys' gradients go straight
  // into dqkv; from step 1 each rank's packed k and v travel with an
  // accumulator of their gradients, which starts at zero where they first
  // arrive, gathers every other rank's share, and comes home in one last
  // step.
  const int Tc = context_.chunk_len(), cp = context_.cp, rank = context_.rank;
  const size_t rows = static_cast<size_t>(B) * Tc, numel = 2 * rows * 2 * static_cast<size_t>(KVl);
  const float* held = qkv;
  float* held_grads = nullptr;
  const int to = (rank + 1) % cp, from = (rank + cp - 1) % cp;
  for (int step = 0; step < cp; ++step) {
    if (step > 0) {
      float* next = x.ring[step % 2].data();
      float* next_grads = x.ring_grads[step % 2].data();
      if (step == 1) {
        cp_->exchange({{packed_keys(qkv, B), numel, to}}, {{next, numel, from}});
        k.zero(next_grads, numel * sizeof(float));
      } else {
        cp_->exchange({{held, numel, to}, {held_grads, numel, to}}, {{next, numel, from}, {next_grads, numel, from}});
      }
      held = next;
      held_grads = next_grads;
    }
    visible_pairs(
        qkv, held, step > 0, (rank + cp - step) % cp, B, [&](int qc, int kc, const Backend::AttentionInputs& in) {
          float* key_grads = step == 0 ? dqkv + kc * rows * W + Cl : held_grads + kc * rows * 2 * KVl;
          k.attention_backward({dqkv + qc * rows * W, key_grads, key_grads + KVl},
                               x.datty.data() + qc * rows * Cl, out + qc * rows * Cl, lse + qc * rows * NHl, in);
        });
  }
  // Step cp - 1 held rank r + 1's gradients: they go home.
  float* home = x.ring_grads[cp % 2].data();
  cp_->exchange({{held_grads, numel, to}}, {{home, numel, from}});
  k.accumulate_columns(dqkv + Cl, W, home, 2 * KVl, static_cast<int>(2 * rows), 2 * KVl);
}

}  // namespace keel::trainer
