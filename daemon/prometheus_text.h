// Prometheus text exposition format (version 0.0.4), just what keeld's
// /metrics page needs: gauges and counters with labels. Samples of one
// metric are kept together under a single # HELP / # TYPE pair however the
// calls interleave, because Prometheus rejects a family split in two.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::daemon {

using PrometheusLabels = std::vector<std::pair<std::string, std::string>>;

class PrometheusText {
 public:
  void gauge(std::string_view name, std::string_view help, double value, const PrometheusLabels& labels = {});
  void counter(std::string_view name, std::string_view help, double value, const PrometheusLabels& labels = {});

  std::string str() const;

 private:
  struct Family {
    std::string name;
    std::string type;
    std::string text;  // # HELP, # TYPE and every sample line so far
  };

  void add(std::string_view type, std::string_view name, std::string_view help, double value,
           const PrometheusLabels& labels);

  std::vector<Family> families_;  // in order of first use
};

// A value as Prometheus parses it: shortest round-trip decimal, and NaN,
// +Inf, -Inf spelled the way Go's ParseFloat accepts them.
std::string prometheus_number(double value);

}  // namespace keel::daemon
