#include "common/layout_check.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

namespace keel::common {
namespace {

// Far above any real degree, yet low enough that products of up to four
// degrees fit in int64 and a typo such as dp=100000000 earns a sentence
// instead of an overflow.
constexpr int64_t kMaxDegree = 32768;

// n_layer blocks over pp stages, the earlier stages taking the remainder.
std::vector<int64_t> even_split(int64_t pp, int64_t n_layer) {
  std::vector<int64_t> counts;
  for (int64_t s = 0; s < pp; ++s) counts.push_back(n_layer / pp + (s < n_layer % pp ? 1 : 0));
  return counts;
}

// Pipeline stages, virtual ones with interleaving: what pp_layers counts.
int64_t virtual_stages(const ParallelConfig& p) { return p.pp * p.pp_virtual; }

// parallel.pp_layers as numbers, or the sentence saying why it is not a
// list of one positive block count per (virtual) stage that add up to n_layer.
std::vector<int64_t> parse_pp_layers(const Config& config, std::string* problem) {
  const ParallelConfig& p = config.parallel;
  const int64_t n_layer = config.model.n_layer, stages = virtual_stages(p);
  std::vector<int64_t> counts;
  const std::string example = fmt::format("\"{}\"", fmt::join(even_split(stages, n_layer), ","));
  size_t at = 0;
  while (at <= p.pp_layers.size()) {
    const size_t comma = std::min(p.pp_layers.find(',', at), p.pp_layers.size());
    const std::string item = p.pp_layers.substr(at, comma - at);
    int64_t value = 0;
    size_t used = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || value < 1) {
      *problem = fmt::format(
          "pp_layers=\"{}\" is not a comma-separated list of positive block counts: write one count per stage, such "
          "as {}, or leave it empty for an even split",
          p.pp_layers, example);
      return {};
    }
    counts.push_back(value);
    at = comma + 1;
  }
  int64_t total = 0;
  for (int64_t count : counts) total += count;
  if (static_cast<int64_t>(counts.size()) != stages || total != n_layer) {
    const std::string layout =
        p.pp_virtual > 1 ? fmt::format("pp*pp_virtual = {} virtual stages", stages) : fmt::format("pp={} stages", p.pp);
    *problem = fmt::format(
        "pp_layers=\"{}\" gives {} stages {} blocks but the layout has {} and the model n_layer={} blocks: "
        "write {} counts that add up to {}, or leave it empty for an even split",
        p.pp_layers, counts.size(), total, layout, n_layer, stages, n_layer);
    return {};
  }
  return counts;
}

}  // namespace

std::vector<int64_t> stage_layers(const Config& config) {
  const int64_t stages = virtual_stages(config.parallel), n_layer = config.model.n_layer;
  if (config.parallel.pp_layers.empty()) return even_split(stages, n_layer);
  std::string problem;
  auto counts = parse_pp_layers(config, &problem);
  if (!problem.empty()) throw Error(ErrorCode::kBadConfig, "invalid parallel layout: " + problem);
  return counts;
}

std::vector<std::string> layout_problems(const Config& config, int64_t world_size) {
  const ParallelConfig& p = config.parallel;
  const ModelConfig& m = config.model;
  std::vector<std::string> problems;

  bool degrees_in_range = true;
  for (auto [key, value] : {std::pair{"dp", p.dp},
                            {"tp", p.tp},
                            {"pp", p.pp},
                            {"cp", p.cp},
                            {"ep", p.ep},
                            {"micro_batches", p.micro_batches},
                            {"pp_virtual", p.pp_virtual}}) {
    if (value < 1) {
      problems.push_back(fmt::format("{}={} must be at least 1", key, value));
      degrees_in_range = false;
    } else if (value > kMaxDegree) {
      problems.push_back(fmt::format("{}={} exceeds {}, the largest value keel accepts: use a smaller one", key, value,
                                     kMaxDegree));
      degrees_in_range = false;
    }
  }
  if (p.zero < 0 || p.zero > 3) {
    problems.push_back(fmt::format(
        "zero={} is not a ZeRO stage: use 0 (off), 1 (shard optimizer state), 2 (also gradients) or 3 (also "
        "parameters)",
        p.zero));
  }
  // Every check below divides by or multiplies degrees.
  if (!degrees_in_range) return problems;

  const int64_t product = p.dp * p.tp * p.pp * p.cp;
  if (product != world_size) {
    problems.push_back(fmt::format(
        "dp*tp*pp*cp = {}*{}*{}*{} = {} but the world has {} ranks: make the product of the degrees {} or run {} ranks",
        p.dp, p.tp, p.pp, p.cp, product, world_size, world_size, product));
  }

  if (m.n_head % p.tp != 0) {
    problems.push_back(fmt::format(
        "tp={} does not divide n_head={}: each TP rank holds whole attention heads, so choose a tp that divides {}",
        p.tp, m.n_head, m.n_head));
  }
  if (m.kv_heads() % p.tp != 0) {
    problems.push_back(fmt::format(
        "tp={} does not divide n_kv_head={}: each TP rank holds whole key/value heads with the query heads they "
        "serve, so choose a tp that divides {} (or more key/value heads)",
        p.tp, m.kv_heads(), m.kv_heads()));
  }
  if (m.llama() && m.mlp_width() % p.tp != 0) {
    problems.push_back(fmt::format(
        "tp={} does not divide the SwiGLU width {} (model.ffn_hidden): TP splits the gate and up projections' "
        "outputs across ranks, so choose a tp that divides {} or another ffn_hidden",
        p.tp, m.mlp_width(), m.mlp_width()));
  }
  // GPT-2's MLP width 4*n_embd is divisible whenever n_embd is, so n_embd is
  // the one to name.
  if (m.n_embd % p.tp != 0) {
    problems.push_back(fmt::format(
        "tp={} does not divide n_embd={}: TP splits the attention width n_embd and the MLP width 4*n_embd across "
        "ranks, so choose a tp that divides {}",
        p.tp, m.n_embd, m.n_embd));
  }
  if (m.padded_vocab() % p.tp != 0) {
    problems.push_back(fmt::format(
        "tp={} does not divide the padded vocabulary {} (vocab_size={} rounded up to a multiple of 128): the "
        "embedding and the cross-entropy are split by vocabulary rows, so choose a tp that divides {}",
        p.tp, m.padded_vocab(), m.vocab_size, m.padded_vocab()));
  }

  if (p.pp > m.n_layer) {
    problems.push_back(fmt::format(
        "pp={} exceeds n_layer={}: every pipeline stage needs at least one block, so use pp <= {}", p.pp, m.n_layer,
        m.n_layer));
  }
  if (p.pp_virtual > 1) {
    if (p.pp < 2) {
      problems.push_back(fmt::format(
          "pp_virtual={} needs a pipeline: interleaving splits each of pp >= 2 stages into chunks, so set pp >= 2 or "
          "pp_virtual=1",
          p.pp_virtual));
    } else if (p.micro_batches % p.pp != 0) {
      problems.push_back(fmt::format(
          "micro_batches={} is not a multiple of pp={}: interleaved 1F1B runs microbatches in groups of pp through "
          "each chunk, so use a multiple of {} or pp_virtual=1",
          p.micro_batches, p.pp, p.pp));
    }
    if (p.pp <= m.n_layer && virtual_stages(p) > m.n_layer) {
      problems.push_back(fmt::format(
          "pp*pp_virtual = {} exceeds n_layer={}: every virtual stage needs at least one block, so use a pp_virtual "
          "of at most {}",
          virtual_stages(p), m.n_layer, m.n_layer / p.pp));
    }
  }
  if (p.pp_schedule != "1f1b" && p.pp_schedule != "zb-h1") {
    problems.push_back(fmt::format("pp_schedule=\"{}\" is not a schedule: use \"1f1b\" or \"zb-h1\"", p.pp_schedule));
  } else if (p.pp_schedule == "zb-h1") {
    if (p.pp < 2) {
      problems.push_back(
          "pp_schedule=\"zb-h1\" needs a pipeline: with one stage there is no bubble to fill and splitting the "
          "backward only costs memory, so set pp >= 2 or pp_schedule=\"1f1b\"");
    }
    if (p.pp_virtual > 1) {
      problems.push_back(
          fmt::format("pp_schedule=\"zb-h1\" splits plain 1F1B's backwards, not interleaved ones: set pp_virtual=1 or "
                      "pp_schedule=\"1f1b\" (pp_virtual={})",
                      p.pp_virtual));
    }
  }
  if (!p.pp_layers.empty() && virtual_stages(p) <= m.n_layer) {
    std::string problem;
    parse_pp_layers(config, &problem);
    if (!problem.empty()) problems.push_back(problem);
  }
  if (p.pp > 1 && p.micro_batches < p.pp) {
    problems.push_back(fmt::format(
        "micro_batches={} is fewer than pp={}: 1F1B needs at least pp microbatches to fill the pipeline, so use "
        "micro_batches >= {}",
        p.micro_batches, p.pp, p.pp));
  }

  if (p.cp > 1 && m.seq_len % (2 * p.cp) != 0) {
    problems.push_back(fmt::format(
        "2*cp = {} does not divide seq_len={} (cp={}): causal load balancing splits the sequence into 2*cp chunks, "
        "so choose a cp for which 2*cp divides {}",
        2 * p.cp, m.seq_len, p.cp, m.seq_len));
  }

  if ((p.dp * p.cp) % p.ep != 0) {
    problems.push_back(fmt::format(
        "ep={} does not divide dp*cp = {}*{} = {}: EP groups are carved out of the dp*cp ranks of each pipeline "
        "stage and TP slice, so choose an ep that divides {}",
        p.ep, p.dp, p.cp, p.dp * p.cp, p.dp * p.cp));
  }
  if (p.ep > 1 && m.n_expert == 0) {
    problems.push_back(
        fmt::format("ep={} needs a MoE model but n_expert=0: set model.n_expert or use ep=1", p.ep));
  }
  if (m.n_expert % p.ep != 0) {
    problems.push_back(fmt::format(
        "n_expert={} is not divisible by ep={}: every EP rank holds the same number of whole experts, so choose an "
        "ep that divides {}",
        m.n_expert, p.ep, m.n_expert));
  }

  // Sequence parallelism gives every TP rank an equal run of a CP rank's
  // positions of a microbatch.
  if (config.train.batch_size % (p.dp * p.micro_batches) == 0 && m.seq_len % p.cp == 0) {
    const int64_t positions = config.train.batch_size / (p.dp * p.micro_batches) * (m.seq_len / p.cp);
    if (positions % p.tp != 0) {
      problems.push_back(fmt::format(
          "tp={} does not divide the {} positions a rank holds of a microbatch (batch_size/(dp*micro_batches) * "
          "seq_len/cp = {}/({}*{}) * {}/{}): sequence parallelism splits them evenly over the TP ranks, so make that "
          "product a multiple of {}",
          p.tp, positions, config.train.batch_size, p.dp, p.micro_batches, m.seq_len, p.cp, p.tp));
    }
  }
  if (config.train.batch_size % (p.dp * p.micro_batches) != 0) {
    problems.push_back(fmt::format(
        "batch_size={} is not divisible by dp*micro_batches = {}*{} = {}: every DP rank and microbatch takes an "
        "equal slice, so use a batch_size that is a multiple of {}",
        config.train.batch_size, p.dp, p.micro_batches, p.dp * p.micro_batches, p.dp * p.micro_batches));
  }
  return problems;
}

void validate_layout(const Config& config, int64_t world_size) {
  auto problems = layout_problems(config, world_size);
  // Each sentence keeps to commas and colons, so "; " separates problems.
  if (!problems.empty()) {
    throw Error(ErrorCode::kBadConfig, fmt::format("invalid parallel layout: {}", fmt::join(problems, "; ")));
  }
}

}  // namespace keel::common
