// `keelctl inject` (docs/architecture.md "Daemon"): a fault for a running
// job, as the operator asks for it and as keeld writes it to the rank's
// board (health::FaultRequest), where the rank takes it as the [faults]
// keys of the same names. Checked twice: what needs no job (the kind, the
// options it takes, their ranges) by keelctl before it sends and by keeld
// when it parses, and what needs the job (the rank, the group, the step)
// by keeld.
#pragma once

#include "common/config.h"
#include "health/progress_board.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace keel::daemon {

struct FaultSpec {
  std::string kind;
  int64_t rank = 0;
  std::optional<int64_t> step;
  std::optional<double> factor;
  std::optional<int64_t> bit;
  std::optional<std::string> target;
  std::optional<std::string> group;
  std::optional<std::string> tensor;

  // Every field once, with its name (the request's JSON field, keelctl's
  // --option; kind is keelctl's argument) and what it means: this one list
  // drives the request's parsing and its line, the event and keelctl's
  // options.
  template <class V> void visit(V& v) {
    v("kind", kind, "crash | hang | slow | bitflip | nan");
    v("rank", rank, "the rank (default 0)");
    v("step", step, "the step it fires at (default: the rank's next step)");
    v("factor", factor, "slow: the rank's compute takes this many times as long (more than 1)");
    v("bit", bit, "bitflip: the bit of one float32, 0-22 mantissa (default 22, silent), 23-30 exponent, 31 sign");
    v("target", target,
      "bitflip: param | exp_avg | exp_avg_sq | grad | activation (default param); nan: gradient | loss (default "
      "gradient)");
    v("group", group, "hang: the mesh axis of the collective it stops in (default dp)");
    v("tensor", tensor, "bitflip: the tensor, e.g. h.0.mlp.c_fc.weight (default: one the rank picks)");
  }
};

// Sets the field named `key` from a request's `value`: false when no field
// has that name, std::invalid_argument naming the field when `value` has
// the wrong type.
bool set_fault_field(FaultSpec& spec, const std::string& key, const nlohmann::json& value);
// {"kind", "rank"} plus each option given: the fields of an inject request.
nlohmann::json fault_json(const FaultSpec& spec);

// What is wrong with `spec` on its own, in terms of keelctl's options;
// empty when nothing is.
std::string fault_spec_problem(const FaultSpec& spec);

// A fault that this job cannot take (std::invalid_argument's message says why).
class FaultRefused : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The board request for a spec without problems, checked against the job:
// the rank exists (`world` ranks), a hang's group is an axis of more than
// one rank in `parallel`, and the step has not passed (`steps_done`: the
// rank's, -1 when unknown). Throws FaultRefused.
health::FaultRequest fault_request(const FaultSpec& spec, int world, const common::ParallelConfig& parallel,
                                   int64_t steps_done);

}  // namespace keel::daemon
