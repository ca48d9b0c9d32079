// The model's tensors (docs/architecture.md "Model"): names, PyTorch [out, in] shapes, how
// each is initialised, how tensor parallelism splits it, and where this
// rank's part of it sits in the flat parameter buffer.
//
// With tp > 1 a rank holds a local tensor per global one (docs/architecture.md "Parallel layout and communication"):
// column-parallel weights and biases keep a slice of the output rows,
// row-parallel weights a slice of the input columns, the token embedding a
// slice of the vocabulary rows, and everything else is replicated. The local
// tensor is always a stack of rectangular blocks of the global tensor, so
// checkpoints and tests can place every element.
#pragma once

#include "common/config.h"
#include "trainer/params/model_parts.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace keel::trainer {

enum class InitKind { kNormal, kZeros, kOnes };

// The offset of a tensor the model does not have (a bias of Llama's).
constexpr size_t kNoTensor = SIZE_MAX;

enum class TpSplit {
  kReplicated,  // every TP rank holds the whole tensor
  kRows,        // rank r holds rows [r, r + 1) * rows / tp: column-parallel outputs, vocabulary rows
  kColumns,     // rank r holds columns [r, r + 1) * cols / tp: row-parallel inputs
  kQkvRows,     // the q, k and v thirds of the rows are each split like kRows (whole heads per rank)
};

// Rows [local_row, local_row + rows) of a local tensor are the global
// block at (row, col) of that size; 1-D tensors have cols = 1.
struct GlobalBlock {
  int64_t local_row = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row = 0;
  int64_t col = 0;
};

// Blocks [begin, end) of the model.
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// The part of the model one pipeline stage runs (docs/architecture.md
// "Pipeline parallelism"): its chunks of blocks, the embedding on the
// first stage and the head (final norm, LM head, tied to the token
// embedding or not, loss) on the last. Without interleaving a stage has one
// chunk; with it, chunk j is virtual stage j * count + index, the
// embedding belongs to the first stage's chunk 0 and the head to the last
// stage's last chunk. One stage alone is the whole model.
struct ModelStage {
  int index = 0;
  int count = 1;
  std::vector<LayerRange> chunks;

  bool first() const { return index == 0; }
  bool last() const { return index == count - 1; }
  // Whether chunk j takes the tokens (virtual stage 0) or scores the loss (the last one).
  bool embeds(int chunk) const { return first() && chunk == 0; }
  bool scores(int chunk) const { return last() && chunk + 1 == static_cast<int>(chunks.size()); }
  // Whether a pass through chunk j reads the batch's tokens (inputs or targets).
  bool reads_tokens(int chunk) const { return embeds(chunk) || scores(chunk); }
  // The stage's blocks, chunk after chunk: local block b is global layer(b).
  int64_t layers() const;
  int64_t layer(int64_t block) const;
  // The local block that is global layer `layer`; -1 when another stage runs it.
  int64_t block_of(int64_t layer) const;
  // Chunk j's first local block and its number of blocks.
  int64_t chunk_begin(int chunk) const;
  int64_t chunk_blocks(int chunk) const {
    return chunks[static_cast<size_t>(chunk)].end - chunks[static_cast<size_t>(chunk)].begin;
  }
  static ModelStage whole(const common::ModelConfig& model) { return {0, 1, {{0, model.n_layer}}}; }
  // Stage `index` of `stages`, virtual stage v running layers_per_virtual_stage[v]
  // blocks (stages entries without interleaving).
  static ModelStage of(const std::vector<int64_t>& layers_per_virtual_stage, int index, int stages);
};

struct ParamSpec {
  std::string name;                   // its saved name (ModelParts::name), e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> global_shape;  // PyTorch layout
  std::vector<int64_t> shape;         // this rank's local tensor
  TpSplit split = TpSplit::kReplicated;
  int tp_rank = 0;
  int tp_size = 1;
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;  // for kNormal
  size_t offset = 0;       // first element in the flat buffer
  size_t numel = 0;        // of the local tensor
  // Its gradient on one TP rank covers that rank's sequence shard only and
  // must be summed over the TP group (the norms, under sequence parallelism).
  bool grad_partial_over_tp = false;
  // The last stage's copy of the token embedding, which its LM head reads
  // while the first stage embeds with the original: the two gradients are
  // summed so both copies stay equal, and only the first stage's is saved
  // and counted in the gradient norm.
  bool tied_copy = false;
  // One of this EP rank's experts (docs/architecture.md "Expert
  // parallelism"): the ranks of its expert-DP group hold the same one, so
  // its gradient sums over that group where every other tensor's sums
  // over dp x cp.
  bool expert = false;
  ModelParts::Role role = ModelParts::Role::kTokenEmbedding;
  // Where ModelParts::name placed it: its block and expert (-1: none), so
  // another naming of the same role (interop/hf_names.h) can place it too.
  int64_t layer = -1;
  int64_t expert_index = -1;
  // Whether it continues the tensor before it in the flat buffer with no
  // gap: this rank's rows of both are one matrix to the GEMM that
  // multiplies them (Llama's k_proj and v_proj after q_proj, up_proj after
  // gate_proj).
  bool packed = false;

  // AdamW decays 2-D tensors only (weights and embeddings, not biases or norms).
  bool weight_decay() const { return shape.size() == 2; }
  int64_t rows() const { return shape[0]; }
  int64_t row_numel() const { return static_cast<int64_t>(numel) / shape[0]; }
  // The global blocks that local rows [row_begin, row_end) hold, in row order.
  std::vector<GlobalBlock> global_blocks(int64_t row_begin, int64_t row_end) const;
};

class ParameterTable {
 public:
  // Every tensor of pipeline stage `stage` of the model described by `model`,
  // in a fixed order, as TP rank `tp_rank` of `tp_size` and EP rank
  // `ep_rank` of `ep_size` hold it: the MoE blocks keep experts
  // [ep_rank, ep_rank + 1) * n_expert / ep_size under their global names.
  // Callers validate the layout first (tp divides n_head, n_embd and the
  // padded vocabulary, ep divides n_expert).
  ParameterTable(const common::ModelConfig& model, int tp_rank, int tp_size, const ModelStage& stage, int ep_rank = 0,
                 int ep_size = 1);
  // The whole model.
  explicit ParameterTable(const common::ModelConfig& model, int tp_rank = 0, int tp_size = 1)
      : ParameterTable(model, tp_rank, tp_size, ModelStage::whole(model)) {}

  const ModelStage& stage() const { return stage_; }
  const ModelParts& parts() const { return parts_; }
  // The experts of each MoE block this rank holds: [expert_begin(), + local_experts()).
  int64_t expert_begin() const { return expert_begin_; }
  int64_t local_experts() const { return local_experts_; }

  const std::vector<ParamSpec>& specs() const { return specs_; }
  // Floats in the flat buffer, alignment gaps between tensors included.
  size_t total() const { return total_; }
  // Elements this rank holds, gaps excluded.
  size_t parameter_count() const;
  // Throws std::out_of_range naming the tensor when there is none.
  const ParamSpec& find(const std::string& name) const;
  // The token embedding where a pipeline ties the LM head to it across its
  // first and last stage (the original on the first, the copy on the
  // last); none on other stages, with one stage or with an untied head.
  std::optional<size_t> tied_embedding() const;

  // The model runs in units, each a run of consecutive tensors and of the
  // flat buffer: unit 0 holds the stage's ends (the embeddings on the first
  // stage, the final norm and the LM head on the last; empty on a
  // middle stage), unit 1 + i the stage's i-th block. ZeRO-3 gathers and
  // ZeRO-2 reduces one unit at a time.
  int unit_count() const { return static_cast<int>(unit_first_tensor_.size()) - 1; }
  size_t unit_first_tensor(int unit) const { return unit_first_tensor_[unit]; }
  size_t unit_end_tensor(int unit) const { return unit_first_tensor_[unit + 1]; }
  // The unit's floats in the flat buffer: [unit_begin, unit_end).
  size_t unit_begin(int unit) const { return specs_[unit_first_tensor(unit)].offset; }
  size_t unit_end(int unit) const;

 private:
  void add(ModelParts::Role role, int64_t layer, int64_t expert, std::vector<int64_t> shape, TpSplit split,
           InitKind init, float init_std = 0.02f, bool packed = false);
  ModelParts parts_;
  int tp_rank_;
  int tp_size_;
  ModelStage stage_;
  int64_t expert_begin_ = 0;
  int64_t local_experts_ = 0;
  std::vector<ParamSpec> specs_;
  std::vector<size_t> unit_first_tensor_;
  size_t total_ = 0;
};

// Fills `out` (host memory, table.total() floats) with this rank's part of
// the initial model: element (r, c) of global tensor `name` is N(0, std)
// drawn from the counter RNG keyed by (seed, name) at counter r * cols + c,
// so every layout draws the same global model.
void init_parameters(const ParameterTable& table, uint64_t seed, float* out);

}  // namespace keel::trainer
