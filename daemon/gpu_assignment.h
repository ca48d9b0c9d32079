// Which GPU each local rank of a `train.device = "cuda"` job gets
// (docs/architecture.md "Daemon"). One rank per GPU: NCCL refuses two ranks
// of a group on one device, and two ranks sharing one would halve each.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

// The GPUs this node lends to its ranks, as CUDA device names the ranks'
// CUDA_VISIBLE_DEVICES can carry.
struct NodeGpus {
  std::vector<std::string> devices;
  std::string source;  // where the list came from, for messages
};

// `visible` is keeld's own CUDA_VISIBLE_DEVICES (nullopt: unset): when set,
// its entries are the node's GPUs, in order (systemd or a scheduler may
// hand keeld a subset). Otherwise one GPU per /dev/nvidiaN device node of
// `dev` (the NVIDIA driver makes one per GPU, and a container sees only
// those it was given), named by CUDA's ordinals 0..n-1: CUDA numbers the
// devices it can open from 0, not by their node numbers.
NodeGpus node_gpus(const std::optional<std::string>& visible, const std::filesystem::path& dev = "/dev");

// The device of each of `local_ranks` ranks (local rank r gets entry r).
// Error(kBadConfig) when the node has fewer GPUs than ranks, saying how
// many the job asks for, how many there are and what to change.
std::vector<std::string> assign_gpus(const NodeGpus& gpus, int local_ranks);

}  // namespace keel::daemon
