#include "daemon/fault_request.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace keel::daemon {
namespace {

// Each kind and the options it takes.
struct KindRule {
  std::string_view name;
  health::FaultKind kind;
  bool factor, bit, group, tensor;
  std::vector<std::string_view> targets;  // the first is the default; empty: --target does not apply
};

const std::vector<KindRule>& kind_rules() {
  static const std::vector<KindRule> rules = {
      {"crash", health::FaultKind::kCrash, false, false, false, false, {}},
      {"hang", health::FaultKind::kHang, false, false, true, false, {}},
      {"slow", health::FaultKind::kSlow, true, false, false, false, {}},
      {"bitflip", health::FaultKind::kBitflip, false, true, false, true,
       {"param", "exp_avg", "exp_avg_sq", "grad", "activation"}},
      {"nan", health::FaultKind::kNan, false, false, false, false, {"gradient", "loss"}},
  };
  return rules;
}

const KindRule* rule_of(const std::string& kind) {
  for (const auto& r : kind_rules()) {
    if (r.name == kind) return &r;
  }
  return nullptr;
}

using Takes = bool (*)(const KindRule&);

// Which kinds take an option, for the sentence that refuses it elsewhere.
std::string kinds_taking(Takes takes) {
  std::vector<std::string_view> names;
  for (const auto& r : kind_rules()) {
    if (takes(r)) names.push_back(r.name);
  }
  return fmt::format("{}", fmt::join(names, " and "));
}

// Copies `text` into a fixed field of the board, NUL-terminated (the
// lengths were checked before).
template <size_t N> void copy_into(char (&field)[N], const std::string& text) {
  std::memset(field, 0, N);
  std::memcpy(field, text.data(), std::min(text.size(), N - 1));
}

// The mesh axes of `parallel` whose groups hold more than one rank (the
// trainer's mesh: tp, cp, dp, pp, ep, expert_dp, dp_cp). expert_dp and
// dp_cp are other names of dp unless ep or cp split it.
std::vector<std::string> axes_to_hang_in(const common::ParallelConfig& p) {
  std::vector<std::string> out;
  const std::pair<std::string, int64_t> axes[] = {
      {"dp", p.dp},
      {"tp", p.tp},
      {"pp", p.pp},
      {"cp", p.cp},
      {"ep", p.ep},
      {"expert_dp", p.ep > 1 ? p.dp * p.cp / p.ep : 1},
      {"dp_cp", p.cp > 1 ? p.dp * p.cp : 1},
  };
  for (const auto& [axis, size] : axes) {
    if (size > 1) out.push_back(axis);
  }
  return out;
}

template <class T> void read_value(T& field, const char* name, const nlohmann::json& value) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (!value.is_string()) throw std::invalid_argument(fmt::format("\"{}\" must be a string", name));
  } else if constexpr (std::is_integral_v<T>) {
    if (!value.is_number_integer()) throw std::invalid_argument(fmt::format("\"{}\" must be an integer", name));
  } else {
    if (!value.is_number()) throw std::invalid_argument(fmt::format("\"{}\" must be a number", name));
  }
  field = value.get<T>();
}

template <class T> void read_value(std::optional<T>& field, const char* name, const nlohmann::json& value) {
  read_value(field.emplace(), name, value);
}

struct FieldReader {
  const std::string& key;
  const nlohmann::json& value;
  bool found = false;
  template <class T> void operator()(const char* name, T& field, const char*) {
    if (key != name) return;
    found = true;
    read_value(field, name, value);
  }
};

struct FieldWriter {
  nlohmann::json out = nlohmann::json::object();
  template <class T> void operator()(const char* name, const T& field, const char*) { out[name] = field; }
  template <class T> void operator()(const char* name, const std::optional<T>& field, const char*) {
    if (field) out[name] = *field;
  }
};

}  // namespace

bool set_fault_field(FaultSpec& spec, const std::string& key, const nlohmann::json& value) {
  FieldReader reader{key, value};
  spec.visit(reader);
  return reader.found;
}

nlohmann::json fault_json(const FaultSpec& spec) {
  FieldWriter writer;
  FaultSpec copy = spec;  // visit() is shared with the readers, which need a mutable spec
  copy.visit(writer);
  return writer.out;
}

std::string fault_spec_problem(const FaultSpec& spec) {
  const KindRule* rule = rule_of(spec.kind);
  if (rule == nullptr) {
    std::vector<std::string_view> names;
    for (const auto& r : kind_rules()) names.push_back(r.name);
    return fmt::format("unknown fault \"{}\"; faults: {}", spec.kind, fmt::join(names, ", "));
  }
  if (spec.rank < 0) return fmt::format("--rank must be a rank, 0 or more (got {})", spec.rank);
  if (spec.step && *spec.step < 0) {
    return fmt::format("--step must be 0 or more; leave it out for the rank's next step (got {})", *spec.step);
  }
  struct Option {
    const char* flag;
    bool given;
    Takes takes;
  };
  const Option options[] = {
      {"--factor", spec.factor.has_value(), [](const KindRule& r) { return r.factor; }},
      {"--bit", spec.bit.has_value(), [](const KindRule& r) { return r.bit; }},
      {"--target", spec.target.has_value(), [](const KindRule& r) { return !r.targets.empty(); }},
      {"--group", spec.group.has_value(), [](const KindRule& r) { return r.group; }},
      {"--tensor", spec.tensor.has_value(), [](const KindRule& r) { return r.tensor; }},
  };
  for (const auto& o : options) {
    if (o.given && !o.takes(*rule)) return fmt::format("{} applies to {} only", o.flag, kinds_taking(o.takes));
  }
  if (rule->factor && !spec.factor) {
    return fmt::format("{} needs --factor: how many times as long the rank's compute takes (more than 1)", spec.kind);
  }
  if (spec.factor && !(std::isfinite(*spec.factor) && *spec.factor > 1)) {
    return fmt::format("--factor must be a number more than 1 (got {})", *spec.factor);
  }
  if (spec.bit && (*spec.bit < 0 || *spec.bit > 31)) {
    return fmt::format("--bit must be a bit of a float32, 0-31: 0-22 mantissa, 23-30 exponent, 31 sign (got {})",
                       *spec.bit);
  }
  if (spec.target && std::find(rule->targets.begin(), rule->targets.end(), *spec.target) == rule->targets.end()) {
    return fmt::format("--target of {} must be one of {} (got \"{}\")", spec.kind, fmt::join(rule->targets, ", "),
                       *spec.target);
  }
  if (spec.group && (spec.group->empty() || spec.group->size() >= sizeof(health::FaultRequest::group))) {
    return fmt::format("--group must name a mesh axis such as dp or tp, at most {} characters",
                       sizeof(health::FaultRequest::group) - 1);
  }
  if (spec.tensor && (spec.tensor->empty() || spec.tensor->size() >= sizeof(health::FaultRequest::tensor))) {
    return fmt::format("--tensor must name a tensor such as h.0.mlp.c_fc.weight, at most {} characters",
                       sizeof(health::FaultRequest::tensor) - 1);
  }
  return "";
}

health::FaultRequest fault_request(const FaultSpec& spec, int world, const common::ParallelConfig& parallel,
                                   int64_t steps_done) {
  if (const std::string problem = fault_spec_problem(spec); !problem.empty()) throw FaultRefused(problem);
  if (spec.rank >= world) {
    throw FaultRefused(fmt::format("rank {} is not a rank of this job: it has {} ranks, 0-{}", spec.rank, world,
                                   world - 1));
  }
  if (spec.step && steps_done >= 0 && *spec.step < steps_done) {
    throw FaultRefused(fmt::format("rank {} has done {} steps: step {} has passed (leave --step out for its next step)",
                                   spec.rank, steps_done, *spec.step));
  }
  const KindRule& rule = *rule_of(spec.kind);
  health::FaultRequest request;
  request.kind = static_cast<uint32_t>(rule.kind);
  request.step = spec.step.value_or(-1);
  request.factor = spec.factor.value_or(1.0);
  request.bit = static_cast<int32_t>(spec.bit.value_or(request.bit));
  if (!rule.targets.empty()) copy_into(request.target, spec.target.value_or(std::string(rule.targets.front())));
  if (rule.group) {
    const std::string group = spec.group.value_or("dp");
    const auto present = axes_to_hang_in(parallel);
    if (std::find(present.begin(), present.end(), group) == present.end()) {
      throw FaultRefused(fmt::format("this layout has no \"{}\" group of more than one rank to hang in; groups: {}",
                                     group, present.empty() ? std::string("none") : fmt::format("{}", fmt::join(present, ", "))));
    }
    copy_into(request.group, group);
  }
  if (spec.tensor) copy_into(request.tensor, *spec.tensor);
  return request;
}

}  // namespace keel::daemon
