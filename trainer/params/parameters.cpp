#include "trainer/params/parameters.h"

#include "common/counter_rng.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace keel::trainer {

std::vector<GlobalBlock> ParamSpec::global_blocks(int64_t row_begin, int64_t row_end) const {
  const int64_t local_rows = rows(), cols = row_numel();
  std::vector<GlobalBlock> blocks;
  auto add = [&](int64_t first, int64_t last, int64_t global_row, int64_t global_col) {
    first = std::max(first, row_begin);
    last = std::min(last, row_end);
    if (first >= last) return;
    // Blocks that continue each other in the global tensor too (q, k and v
    // of a single TP rank) are one block.
    if (!blocks.empty() && blocks.back().col == global_col &&
        blocks.back().row + blocks.back().rows == global_row + first) {
      blocks.back().rows += last - first;
      return;
    }
    blocks.push_back(GlobalBlock{first, last - first, cols, global_row + first, global_col});
  };
  switch (split) {
    case TpSplit::kReplicated:
      add(0, local_rows, 0, 0);
      break;
    case TpSplit::kRows:
      add(0, local_rows, tp_rank * local_rows, 0);
      break;
    case TpSplit::kColumns:
      add(0, local_rows, 0, tp_rank * cols);
      break;
    case TpSplit::kQkvRows: {
      // Local third j (whole heads of q, k or v) sits in global third j.
      const int64_t third = local_rows / 3, global_third = global_shape[0] / 3;
      for (int64_t j = 0; j < 3; ++j) add(j * third, (j + 1) * third, j * global_third + tp_rank * third - j * third, 0);
      break;
    }
  }
  return blocks;
}

ModelStage ModelStage::of(const std::vector<int64_t>& layers_per_virtual_stage, int index, int stages) {
  ModelStage stage{index, stages, {}};
  int64_t begin = 0;
  for (size_t v = 0; v < layers_per_virtual_stage.size(); ++v) {
    const int64_t end = begin + layers_per_virtual_stage[v];
    if (static_cast<int>(v) % stages == index) stage.chunks.push_back({begin, end});
    begin = end;
  }
  return stage;
}

int64_t ModelStage::layers() const {
  int64_t total = 0;
  for (const LayerRange& chunk : chunks) total += chunk.end - chunk.begin;
  return total;
}

int64_t ModelStage::layer(int64_t block) const {
  for (const LayerRange& chunk : chunks) {
    if (block < chunk.end - chunk.begin) return chunk.begin + block;
    block -= chunk.end - chunk.begin;
  }
  throw std::out_of_range("block " + std::to_string(block) + " beyond the stage's");
}

int64_t ModelStage::block_of(int64_t layer) const {
  int64_t block = 0;
  for (const LayerRange& chunk : chunks) {
    if (layer >= chunk.begin && layer < chunk.end) return block + layer - chunk.begin;
    block += chunk.end - chunk.begin;
  }
  return -1;
}

int64_t ModelStage::chunk_begin(int chunk) const {
  int64_t block = 0;
  for (int j = 0; j < chunk; ++j) block += chunk_blocks(j);
  return block;
}

ParameterTable::ParameterTable(const common::ModelConfig& m, int tp_rank, int tp_size, const ModelStage& stage,
                               int ep_rank, int ep_size)
    : parts_(ModelParts::of(m)),
      tp_rank_(tp_rank),
      tp_size_(tp_size),
      stage_(stage),
      expert_begin_(ep_rank * m.n_expert / ep_size),
      local_experts_(m.n_expert / ep_size) {
  using Role = ModelParts::Role;
  const int64_t C = m.n_embd, F = parts_.mlp_width, head_dim = parts_.head_dim;
  const float out_std =
      parts_.depth_scaled_init ? 0.02f / std::sqrt(2.0f * static_cast<float>(m.n_layer)) : 0.02f;
  // Megatron's pairs: the first linear splits its outputs, the second its
  // inputs, so the activation between them never leaves the rank. Without
  // biases (Llama) only the weights are tensors.
  auto column_parallel = [&](Role weight, Role bias, int64_t layer, int64_t expert, int64_t out, int64_t in,
                             TpSplit split) {
    add(weight, layer, expert, {out, in}, split, InitKind::kNormal);
    if (parts_.biases) add(bias, layer, expert, {out}, split, InitKind::kZeros);
  };
  auto row_parallel = [&](Role weight, Role bias, int64_t layer, int64_t expert, int64_t out, int64_t in) {
    add(weight, layer, expert, {out, in}, TpSplit::kColumns, InitKind::kNormal, out_std);
    if (parts_.biases) add(bias, layer, expert, {out}, TpSplit::kReplicated, InitKind::kZeros);
  };
  auto norm = [&](Role weight, Role bias, int64_t layer) {
    const size_t first = specs_.size();
    add(weight, layer, -1, {C}, TpSplit::kReplicated, InitKind::kOnes);
    if (parts_.norm == ModelParts::Norm::kLayerNorm) add(bias, layer, -1, {C}, TpSplit::kReplicated, InitKind::kZeros);
    // Under sequence parallelism each TP rank normalises its own positions.
    for (size_t t = first; t < specs_.size(); ++t) specs_[t].grad_partial_over_tp = tp_size > 1;
  };
  // The MLP, or one expert of it: GELU's fc and proj, or SwiGLU's gate and
  // up (one GEMM) and down.
  auto mlp = [&](int64_t layer, int64_t expert) {
    const size_t first = specs_.size();
    column_parallel(Role::kMlpIn, Role::kMlpInBias, layer, expert, F, C, TpSplit::kRows);
    if (parts_.mlp == ModelParts::Mlp::kSwiGlu) {
      add(Role::kMlpUp, layer, expert, {F, C}, TpSplit::kRows, InitKind::kNormal, 0.02f, true);
    }
    row_parallel(Role::kMlpOut, Role::kMlpOutBias, layer, expert, C, F);
    for (size_t t = first; t < specs_.size(); ++t) specs_[t].expert = expert >= 0;
  };

  unit_first_tensor_.push_back(0);
  auto token_embedding = [&] {
    add(Role::kTokenEmbedding, -1, -1, {m.padded_vocab(), C}, TpSplit::kRows, InitKind::kNormal);
  };
  if (stage.first()) {
    token_embedding();
    if (parts_.positions == ModelParts::Positions::kLearned) {
      add(Role::kPositionEmbedding, -1, -1, {m.seq_len, C}, TpSplit::kReplicated, InitKind::kNormal);
    }
  }
  if (stage.last()) {
    norm(Role::kFinalNorm, Role::kFinalNormBias, -1);
    if (!parts_.tied_head) {
      add(Role::kHead, -1, -1, {m.padded_vocab(), C}, TpSplit::kRows, InitKind::kNormal);
    } else if (!stage.first()) {
      token_embedding();
      specs_.back().tied_copy = true;
    }
  }
  for (int64_t b = 0; b < stage.layers(); ++b) {
    const int64_t i = stage.layer(b);
    unit_first_tensor_.push_back(specs_.size());
    norm(Role::kNorm1, Role::kNorm1Bias, i);
    if (parts_.kv_heads == parts_.heads && parts_.biases) {
      // GPT-2's one tensor: its q, k and v thirds each split by whole heads.
      column_parallel(Role::kQkv, Role::kQkvBias, i, -1, 3 * C, C, TpSplit::kQkvRows);
    } else {
      // Grouped-query attention's three tensors, packed into one matrix
      // (each TP rank's heads of each; docs/research/llama3.md section 3).
      column_parallel(Role::kQkv, Role::kQkvBias, i, -1, parts_.heads * head_dim, C, TpSplit::kRows);
      for (Role kv : {Role::kKeys, Role::kValues}) {
        add(kv, i, -1, {parts_.kv_heads * head_dim, C}, TpSplit::kRows, InitKind::kNormal, 0.02f, true);
      }
    }
    row_parallel(Role::kAttentionOut, Role::kAttentionOutBias, i, -1, C, C);
    norm(Role::kNorm2, Role::kNorm2Bias, i);
    if (m.is_moe_layer(i)) {
      add(Role::kRouter, i, -1, {m.n_expert, C}, TpSplit::kReplicated, InitKind::kNormal);
      for (int64_t e = expert_begin_; e < expert_begin_ + local_experts_; ++e) mlp(i, e);
    } else {
      mlp(i, -1);
    }
  }
  unit_first_tensor_.push_back(specs_.size());
}

void ParameterTable::add(ModelParts::Role role, int64_t layer, int64_t expert, std::vector<int64_t> shape,
                         TpSplit split, InitKind init, float init_std, bool packed) {
  std::string name = parts_.name(role, layer, expert);
  std::vector<int64_t> local = shape;
  const size_t dim = split == TpSplit::kColumns ? 1 : 0;
  if (split != TpSplit::kReplicated) {
    // kQkvRows splits each third: whole heads per rank.
    const int64_t parts = split == TpSplit::kQkvRows ? 3 * tp_size_ : tp_size_;
    if (local[dim] % parts != 0) {
      throw std::invalid_argument(name + ": dim " + std::to_string(dim) + " of " + std::to_string(local[dim]) +
                                  " does not split over " + std::to_string(tp_size_) + " TP ranks");
    }
    local[dim] /= tp_size_;
  }
  size_t numel = 1;
  for (int64_t d : local) numel *= static_cast<size_t>(d);
  // A packed tensor takes the alignment gap after the one before it.
  if (packed) total_ = specs_.back().offset + specs_.back().numel;
  ParamSpec spec{std::move(name), std::move(shape), std::move(local), split, tp_rank_, tp_size_, init, init_std,
                 total_, numel};
  spec.role = role;
  spec.layer = layer;
  spec.expert_index = expert;
  spec.packed = packed;
  specs_.push_back(std::move(spec));
  // Every other tensor starts on a 16-float boundary so kernels see aligned rows.
  total_ += (numel + 15) / 16 * 16;
}

size_t ParameterTable::unit_end(int unit) const {
  return unit + 1 < unit_count() ? unit_begin(unit + 1) : total_;
}

const ParamSpec& ParameterTable::find(const std::string& name) const {
  for (const auto& spec : specs_) {
    if (spec.name == name) return spec;
  }
  throw std::out_of_range("the model has no tensor named '" + name + "'");
}

std::optional<size_t> ParameterTable::tied_embedding() const {
  if (!parts_.tied_head || stage_.count == 1 || (!stage_.first() && !stage_.last())) return std::nullopt;
  for (size_t t = 0; t < specs_.size(); ++t) {
    if (specs_[t].role == ModelParts::Role::kTokenEmbedding) return t;
  }
  return std::nullopt;
}

size_t ParameterTable::parameter_count() const {
  size_t count = 0;
  for (const auto& spec : specs_) count += spec.numel;
  return count;
}

void init_parameters(const ParameterTable& table, uint64_t seed, float* out) {
  for (const auto& spec : table.specs()) {
    float* p = out + spec.offset;
    switch (spec.init) {
      case InitKind::kZeros:
        std::fill(p, p + spec.numel, 0.0f);
        break;
      case InitKind::kOnes:
        std::fill(p, p + spec.numel, 1.0f);
        break;
      case InitKind::kNormal: {
        const uint64_t key = common::stream_key(seed, spec.name);
        const int64_t global_cols = spec.global_shape.size() == 2 ? spec.global_shape[1] : 1;
        for (const GlobalBlock& b : spec.global_blocks(0, spec.rows())) {
#pragma omp parallel for schedule(static)
          for (int64_t r = 0; r < b.rows; ++r) {
            float* row = p + (b.local_row + r) * b.cols;
            const uint64_t first = static_cast<uint64_t>((b.row + r) * global_cols + b.col);
            for (int64_t c = 0; c < b.cols; ++c) {
              row[c] = static_cast<float>(spec.init_std * common::counter_normal(key, first + c));
            }
          }
        }
        break;
      }
    }
  }
}

}  // namespace keel::trainer
