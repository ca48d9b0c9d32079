#include "trainer/parallel/mesh.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <utility>

namespace keel::trainer {

using common::Error;
using common::ErrorCode;

namespace {

// Far above any real degree, yet low enough that products of up to four
// degrees fit in int64 and a typo such as dp=100000000 earns a sentence
// instead of an overflow.
constexpr int64_t kMaxDegree = 32768;

// An axis as data: how big its groups are, where a rank sits in its group,
// and who sits at another position of that group. all_groups() and the
// mesh's own groups are derived from this table alone.
struct AxisRule {
  const char* name;
  int (*size)(const Layout&);
  int (*position)(const Layout&, const Coords&);
  Coords (*member)(const Layout&, Coords, int position);
};

// An axis that is one coordinate of the grid.
template <int Coords::*kCoord, int Layout::*kDegree>
constexpr AxisRule grid_axis(const char* name) {
  return {name, [](const Layout& l) { return l.*kDegree; }, [](const Layout&, const Coords& c) { return c.*kCoord; },
          [](const Layout&, Coords c, int position) {
            c.*kCoord = position;
            return c;
          }};
}

// The (dp, cp) pair flattened into the slot EP groups are cut from.
int slot_of(const Layout& l, const Coords& c) { return c.dp * l.cp + c.cp; }
Coords at_slot(const Layout& l, Coords c, int slot) {
  c.dp = slot / l.cp;
  c.cp = slot % l.cp;
  return c;
}

// Indexed by Axis.
constexpr std::array<AxisRule, kAxisCount> kRules = {{
    grid_axis<&Coords::tp, &Layout::tp>("tp"),
    grid_axis<&Coords::cp, &Layout::cp>("cp"),
    grid_axis<&Coords::dp, &Layout::dp>("dp"),
    grid_axis<&Coords::pp, &Layout::pp>("pp"),
    {"ep", [](const Layout& l) { return l.ep; }, [](const Layout& l, const Coords& c) { return slot_of(l, c) % l.ep; },
     [](const Layout& l, Coords c, int position) { return at_slot(l, c, slot_of(l, c) / l.ep * l.ep + position); }},
    {"expert_dp", [](const Layout& l) { return l.dp * l.cp / l.ep; },
     [](const Layout& l, const Coords& c) { return slot_of(l, c) / l.ep; },
     [](const Layout& l, Coords c, int position) { return at_slot(l, c, position * l.ep + slot_of(l, c) % l.ep); }},
    {"dp_cp", [](const Layout& l) { return l.dp * l.cp; }, slot_of, at_slot},
}};

const AxisRule& rule(Axis axis) { return kRules[static_cast<size_t>(axis)]; }

}  // namespace

Layout Layout::from(const common::ParallelConfig& parallel) {
  return {.dp = static_cast<int>(parallel.dp),
          .tp = static_cast<int>(parallel.tp),
          .pp = static_cast<int>(parallel.pp),
          .cp = static_cast<int>(parallel.cp),
          .ep = static_cast<int>(parallel.ep),
          .zero = static_cast<int>(parallel.zero),
          .micro_batches = static_cast<int>(parallel.micro_batches)};
}

std::vector<std::string> layout_problems(const common::Config& config, int world_size) {
  const common::ParallelConfig& p = config.parallel;
  const common::ModelConfig& m = config.model;
  std::vector<std::string> problems;

  bool degrees_in_range = true;
  for (auto [key, value] : {std::pair{"dp", p.dp}, {"tp", p.tp}, {"pp", p.pp}, {"cp", p.cp}, {"ep", p.ep},
                            {"micro_batches", p.micro_batches}}) {
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
  // The MLP width 4*n_embd is divisible whenever n_embd is, so n_embd is the
  // one to name.
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

  // Sequence parallelism gives every TP rank an equal run of a
  // microbatch's positions.
  if (config.train.batch_size % (p.dp * p.micro_batches) == 0) {
    const int64_t positions = config.train.batch_size / (p.dp * p.micro_batches) * m.seq_len;
    if (positions % p.tp != 0) {
      problems.push_back(fmt::format(
          "tp={} does not divide the {} positions of a microbatch (batch_size/(dp*micro_batches) * seq_len = "
          "{}/({}*{}) * {}): sequence parallelism splits them evenly over the TP ranks, so make that product a "
          "multiple of {}",
          p.tp, positions, config.train.batch_size, p.dp, p.micro_batches, m.seq_len, p.tp));
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

void validate_layout(const common::Config& config, int world_size) {
  const auto problems = layout_problems(config, world_size);
  // Each sentence keeps to commas and colons, so "; " separates problems.
  if (!problems.empty()) {
    throw Error(ErrorCode::kBadConfig, fmt::format("invalid parallel layout: {}", fmt::join(problems, "; ")));
  }
}

const char* axis_name(Axis axis) { return rule(axis).name; }

Mesh::Mesh(Layout layout, int rank) : layout_(layout), rank_(rank) {
  const Layout& l = layout_;
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.cp < 1 || l.ep < 1 || (l.dp * l.cp) % l.ep != 0) {
    throw Error(ErrorCode::kInternal,
                fmt::format("mesh built from an unvalidated layout dp={} tp={} pp={} cp={} ep={}: run validate_layout "
                            "first",
                            l.dp, l.tp, l.pp, l.cp, l.ep));
  }
  if (rank < 0 || rank >= l.world_size()) {
    throw Error(ErrorCode::kInternal, fmt::format("rank {} lies outside a world of {} ranks", rank, l.world_size()));
  }
  coords_ = coords_of(l, rank);
  for (Axis axis : kAxes) {
    for (Group& group : all_groups(axis)) {
      if (group.index_in_group >= 0) groups_[static_cast<size_t>(axis)] = std::move(group);
    }
  }
}

std::vector<Group> Mesh::all_groups(Axis axis) const {
  const AxisRule& r = rule(axis);
  const int size = r.size(layout_);
  std::vector<Group> groups;
  // Ranks within a group ascend with position, so position 0 is the lowest
  // rank and walking the world in rank order meets groups in name order.
  for (int leader = 0; leader < layout_.world_size(); ++leader) {
    const Coords c = coords_of(layout_, leader);
    if (r.position(layout_, c) != 0) continue;
    Group group{fmt::format("{}.{}", r.name, groups.size()), {}, -1};
    for (int position = 0; position < size; ++position) {
      const int member = rank_of(layout_, r.member(layout_, c, position));
      if (member == rank_) group.index_in_group = position;
      group.ranks.push_back(member);
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

Coords Mesh::coords_of(const Layout& l, int rank) {
  Coords c;
  c.tp = rank % l.tp;
  rank /= l.tp;
  c.cp = rank % l.cp;
  rank /= l.cp;
  c.dp = rank % l.dp;
  c.pp = rank / l.dp;
  return c;
}

int Mesh::rank_of(const Layout& l, Coords c) { return ((c.pp * l.dp + c.dp) * l.cp + c.cp) * l.tp + c.tp; }

}  // namespace keel::trainer
