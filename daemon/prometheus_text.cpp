#include "daemon/prometheus_text.h"

#include "common/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>

namespace keel::daemon {
namespace {

using common::Error;
using common::ErrorCode;

bool valid_name(std::string_view name, bool allow_colon) {
  auto head = [&](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':'); };
  auto tail = [&](char c) { return head(c) || (c >= '0' && c <= '9'); };
  return !name.empty() && head(name.front()) && std::all_of(name.begin() + 1, name.end(), tail);
}

// HELP text escapes backslash and newline; label values also escape the
// double quote that would otherwise end them.
std::string escaped(std::string_view text, bool quote) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

std::string prometheus_number(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  std::array<char, 32> buffer{};
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  return std::string(buffer.data(), result.ptr);
}

void PrometheusText::gauge(std::string_view name, std::string_view help, double value,
                           const PrometheusLabels& labels) {
  add("gauge", name, help, value, labels);
}

void PrometheusText::counter(std::string_view name, std::string_view help, double value,
                             const PrometheusLabels& labels) {
  add("counter", name, help, value, labels);
}

void PrometheusText::add(std::string_view type, std::string_view name, std::string_view help, double value,
                         const PrometheusLabels& labels) {
  // Bad names are bugs in keeld's own metric table, not operator input: a
  // page Prometheus cannot parse loses every metric, so refuse loudly, and
  // before anything is added.
  if (!valid_name(name, true)) throw Error(ErrorCode::kInternal, fmt::format("invalid Prometheus metric name '{}'", name));
  std::string line(name);
  if (!labels.empty()) {
    line.push_back('{');
    for (std::size_t i = 0; i < labels.size(); ++i) {
      const auto& [label, label_value] = labels[i];
      if (!valid_name(label, false) || label.starts_with("__")) {
        throw Error(ErrorCode::kInternal, fmt::format("invalid Prometheus label name '{}' on '{}'", label, name));
      }
      line += fmt::format("{}{}=\"{}\"", i ? "," : "", label, escaped(label_value, true));
    }
    line.push_back('}');
  }

  auto family = std::find_if(families_.begin(), families_.end(), [&](const Family& f) { return f.name == name; });
  if (family == families_.end()) {
    family = families_.insert(families_.end(), Family{std::string(name), std::string(type), {}});
    family->text = fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, escaped(help, false), name, type);
  } else if (family->type != type) {
    throw Error(ErrorCode::kInternal,
                fmt::format("Prometheus metric '{}' used as both {} and {}", name, family->type, type));
  }
  family->text += fmt::format("{} {}\n", line, prometheus_number(value));
}

std::string PrometheusText::str() const {
  std::string out;
  for (const Family& family : families_) out += family.text;
  return out;
}

}  // namespace keel::daemon
