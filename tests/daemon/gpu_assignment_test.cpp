// Which GPU each rank of a CUDA job gets: the node's GPUs from keeld's
// CUDA_VISIBLE_DEVICES or the NVIDIA device nodes, one per rank (the
// variable each rank is started with: rank_set_test.cpp).
#include "common/error.h"
#include "daemon/gpu_assignment.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using keel::common::Error;
using keel::common::ErrorCode;
using keel::daemon::assign_gpus;
using keel::daemon::node_gpus;
using keel::daemon::NodeGpus;

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("keeld's CUDA_VISIBLE_DEVICES lists the node's GPUs in its order") {
    struct Case {
      std::string visible;
      std::vector<std::string> devices;
    };
    const std::vector<Case> cases = {
        {"0,2,3", {"0", "2", "3"}},
        {" 5 , 1 ", {"5", "1"}},
        {"GPU-8a1b,GPU-77c0", {"GPU-8a1b", "GPU-77c0"}},
        {"", {}},  // set but empty: CUDA shows no device
        {",,", {}},
    };
    for (const auto& c : cases) {
      CAPTURE(c.visible);
      const NodeGpus gpus = node_gpus(c.visible, "/nonexistent");
      CHECK(gpus.devices == c.devices);
      CHECK(gpus.source.find("CUDA_VISIBLE_DEVICES") != std::string::npos);
    }
  }

  TEST_CASE("without CUDA_VISIBLE_DEVICES each nvidiaN device node is a GPU numbered as CUDA numbers it from 0") {
    keel::test::TempDir dev;
    for (const char* name :
         {"nvidia10", "nvidia0", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null", "nvidia3x"}) {
      dev.write(name, "");
    }
    std::filesystem::create_directory(dev / "nvidia-caps");
    // A container given nvidia0, nvidia2 and nvidia10 sees CUDA devices 0, 1 and 2.
    CHECK(node_gpus(std::nullopt, dev.path()).devices == std::vector<std::string>{"0", "1", "2"});
    CHECK(node_gpus(std::nullopt, dev / "missing").devices.empty());
  }

  TEST_CASE("each rank gets its own GPU and a node with too few refuses the job saying what to change") {
    const NodeGpus four{{"0", "1", "2", "3"}, "test"};
    CHECK(assign_gpus(four, 2) == std::vector<std::string>{"0", "1"});
    CHECK(assign_gpus(four, 4) == four.devices);
    for (const NodeGpus& few : {NodeGpus{{"4"}, "keeld's CUDA_VISIBLE_DEVICES=\"4\""}, NodeGpus{{}, "/dev"}}) {
      CAPTURE(few.source);
      try {
        assign_gpus(few, 2);
        FAIL("two ranks were given " << few.devices.size() << " GPUs");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kBadConfig);
        const std::string message = e.what();
        CHECK(message.find("2 ranks") != std::string::npos);
        CHECK(message.find(few.source) != std::string::npos);
        CHECK(message.find("train.device = \"cpu\"") != std::string::npos);
      }
    }
  }
}
