#include "daemon/gpu_assignment.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <system_error>

namespace keel::daemon {
namespace {

// "nvidia3" -> 3; nvidiactl, nvidia-uvm and the like are not GPUs.
std::optional<int> gpu_index(const std::string& name) {
  constexpr std::string_view kPrefix = "nvidia";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  int index = 0;
  const char* first = name.data() + kPrefix.size();
  const char* last = name.data() + name.size();
  const auto [end, error] = std::from_chars(first, last, index);
  if (error != std::errc() || end != last) return std::nullopt;
  return index;
}

}  // namespace

NodeGpus node_gpus(const std::optional<std::string>& visible, const std::filesystem::path& dev) {
  NodeGpus gpus;
  if (visible) {
    gpus.source = fmt::format("keeld's CUDA_VISIBLE_DEVICES=\"{}\"", *visible);
    size_t begin = 0;
    while (begin <= visible->size()) {
      const size_t comma = std::min(visible->find(',', begin), visible->size());
      std::string entry = visible->substr(begin, comma - begin);
      entry.erase(0, entry.find_first_not_of(' '));
      entry.erase(entry.find_last_not_of(' ') + 1);
      if (!entry.empty()) gpus.devices.push_back(entry);
      begin = comma + 1;
    }
    return gpus;
  }
  gpus.source = fmt::format("the NVIDIA device nodes in {}", dev.string());
  size_t count = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dev, error)) {
    if (gpu_index(entry.path().filename().string())) ++count;
  }
  for (size_t ordinal = 0; ordinal < count; ++ordinal) gpus.devices.push_back(std::to_string(ordinal));
  return gpus;
}

std::vector<std::string> assign_gpus(const NodeGpus& gpus, int local_ranks) {
  if (static_cast<int>(gpus.devices.size()) < local_ranks) {
    throw common::Error(
        common::ErrorCode::kBadConfig,
        fmt::format("train.device = \"cuda\" needs one GPU per rank: the layout puts {} ranks on this node, which "
                    "has {} GPU{} ({}{}); lower parallel.dp/tp/pp/cp, run on a node with more GPUs, or set "
                    "train.device = \"cpu\"",
                    local_ranks, gpus.devices.size(), gpus.devices.size() == 1 ? "" : "s", gpus.source,
                    gpus.devices.empty() ? "" : fmt::format(": {}", fmt::join(gpus.devices, ","))));
  }
  return {gpus.devices.begin(), gpus.devices.begin() + local_ranks};
}

}  // namespace keel::daemon
