// keel-bench-checkpoint: checkpoint save and load throughput against fio on
// the same disk, and the training stall per checkpoint against a plain
// memcpy of the same bytes (docs/architecture.md "Checkpoints"). One JSON object per figure, then a
// summary with the three ratios and their targets.
//
// The state is `--gib` GiB of float32 in 32 MiB tensors, saved by one rank
// through the real Checkpointer (HDF5 skeleton, io_uring O_DIRECT bulk
// writes, fsync, index.h5, manifest, rename, every fsync of the commit) and
// loaded back through CheckpointReader. fio writes and reads the same
// number of bytes with io_uring, O_DIRECT, 1 MiB blocks and queue depth 16
// (end_fsync for the write). Page caches are dropped for the files before
// every read.
#include "bench/blas_ceiling.h"
#include "checkpoint/checkpointer.h"
#include "checkpoint/manifest.h"
#include "checkpoint/parallel_copy.h"
#include "common/clock.h"
#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "tests/support/process.h"

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <fstream>
#include <iostream>
#include <thread>

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

using keel::common::seconds_since;

void drop_cache(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// fio's bandwidth in bytes/s for one job (rw = write or read).
double fio(const fs::path& file, const std::string& rw, uint64_t bytes) {
  std::vector<std::string> args = {"fio", "--name=keel-bench", "--filename=" + file.string(), "--rw=" + rw,
                                   "--bs=1M", "--iodepth=16", "--ioengine=io_uring", "--direct=1",
                                   "--size=" + std::to_string(bytes), "--output-format=json"};
  if (rw == "write") args.push_back("--end_fsync=1");
  const auto result = keel::test::run_process(args, {}, 1800);
  if (result.exit_code != 0) throw std::runtime_error("fio failed: " + result.output);
  const auto json = nlohmann::json::parse(result.output.substr(result.output.find('{')));
  return json.at("jobs").at(0).at(rw).at("bw_bytes").get<double>();
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("model name")) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-checkpoint: checkpoint save/load throughput against fio, and the training stall"};
  double gib = 2.0;
  std::string dir = "bench-checkpoint";
  bool keep = false;
  int rounds = 5;
  app.add_option("--gib", gib, "state size in GiB (at least 2 for the design figures)");
  app.add_option("--dir", dir, "a directory on the disk to measure (created, then removed)");
  app.add_flag("--keep", keep, "leave the files behind");
  app.add_option("--rounds", rounds, "alternating keel / fio rounds; figures are medians")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  const fs::path root = fs::absolute(dir);
  fs::create_directories(root);
  constexpr size_t kTensorFloats = size_t{8} << 20;  // 32 MiB
  const size_t tensors = std::max<size_t>(1, static_cast<size_t>(gib * 1024 / 32));
  const uint64_t bytes = tensors * kTensorFloats * sizeof(float);

  // The "training state" and a second buffer for the memcpy reference and
  // the load, both touched so page faults stay out of the timings.
  // the load. The load target is page-aligned, as a pinned staging buffer
  // for a GPU is, so O_DIRECT reads land in it without a bounce copy.
  std::vector<float> state(tensors * kTensorFloats);
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<float>(i % 1000003) * 1e-3f;
  std::unique_ptr<float, decltype(&std::free)> target_buffer(
      static_cast<float*>(std::aligned_alloc(4096, bytes)), &std::free);
  float* target = target_buffer.get();
  std::memset(target, 0, bytes);

  std::vector<keel::checkpoint::Piece> pieces;
  for (size_t t = 0; t < tensors; ++t) {
    pieces.push_back({"model", "t" + std::to_string(t), {static_cast<int64_t>(kTensorFloats / 1024), 1024}, 0, 0,
                      static_cast<int64_t>(kTensorFloats / 1024), 1024});
  }
  keel::checkpoint::CheckpointerOptions options;
  options.root = root / "keel";
  options.run_dir = root;
  options.keep = 100;  // retention (deleting old files) is not part of a save
  options.layout = {{"world_size", 1}};
  fs::create_directories(options.root);
  keel::checkpoint::Checkpointer checkpointer(options, nullptr);

  auto save = [&](int64_t step, double& stall_s, double& save_s) {
    const auto start = Clock::now();
    auto staging = checkpointer.stage(pieces);
    std::vector<keel::checkpoint::CopyJob> copies;
    for (size_t t = 0; t < tensors; ++t) copies.push_back({staging[t], state.data() + t * kTensorFloats, kTensorFloats * 4});
    keel::checkpoint::parallel_copy(copies);
    checkpointer.save_async(step, 0);
    stall_s = seconds_since(start);
    const auto written = Clock::now();
    if (!checkpointer.wait()) throw std::runtime_error("the checkpoint save failed; see the log");
    save_s = seconds_since(written);
  };
  double stall_s = 0, save_s = 0;
  save(1, stall_s, save_s);  // first save: allocates and registers the staging buffer

  // Rounds alternate keel and fio so that drifts of a shared disk hit both;
  // each figure is the median over the rounds.
  std::vector<double> saves, loads, stalls, memcpys, fio_writes, fio_reads;
  bool intact = true;
  const fs::path fio_file = root / "fio.dat";
  for (int round = 0; round < rounds; ++round) {
    save(2 + round, stall_s, save_s);
    saves.push_back(save_s);
    stalls.push_back(stall_s);
    // The reference is the best of three plain copies, the strictest one.
    double best_copy = 1e30;
    for (int i = 0; i < 3; ++i) {
      const auto copy_start = Clock::now();
      std::memcpy(target, state.data(), bytes);
      best_copy = std::min(best_copy, seconds_since(copy_start));
    }
    memcpys.push_back(best_copy);
    // A fresh file, as every checkpoint is: overwriting blocks fio had
    // already allocated would spare it the allocation a save pays.
    fs::remove(fio_file);
    fio_writes.push_back(fio(fio_file, "write", bytes));

    const fs::path ckpt = keel::checkpoint::step_dir(options.root, 2 + round);
    for (const auto& f : fs::directory_iterator(ckpt)) drop_cache(f.path());
    std::memset(target, 0, bytes);
    const auto start = Clock::now();
    {
      keel::checkpoint::CheckpointReader reader(ckpt);
      std::vector<keel::checkpoint::CheckpointReader::Request> requests;
      for (size_t t = 0; t < tensors; ++t) {
        requests.push_back({"/model/t" + std::to_string(t), 0, 0, static_cast<int64_t>(kTensorFloats / 1024), 1024,
                            target + t * kTensorFloats});
      }
      reader.read_all(requests);
    }
    loads.push_back(seconds_since(start));
    intact = intact && std::memcmp(target, state.data(), bytes) == 0;
    drop_cache(fio_file);
    fio_reads.push_back(fio(fio_file, "read", bytes));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  save_s = median(saves);
  stall_s = median(stalls);
  const double load_s = median(loads), memcpy_s = median(memcpys);
  const double fio_write = median(fio_writes), fio_read = median(fio_reads);
  // Ratios per round (keel against the fio run next to it), then the median.
  std::vector<double> save_ratios, load_ratios, stall_ratios;
  for (int r = 0; r < rounds; ++r) {
    save_ratios.push_back(bytes / saves[r] / fio_writes[r]);
    load_ratios.push_back(bytes / loads[r] / fio_reads[r]);
    stall_ratios.push_back(stalls[r] / memcpys[r]);
  }
  const double save_bw = bytes / save_s, load_bw = bytes / load_s;
  const nlohmann::json machine = {{"cpu", cpu_model()}, {"cores", std::thread::hardware_concurrency()},
                                  {"dir", "bench directory on the measured disk"}};
  std::cout << nlohmann::json{{"bench", "checkpoint_io"}, {"figure", "save"}, {"rounds", rounds}, {"bytes", bytes}, {"seconds", save_s},
                              {"bytes_per_s", save_bw}, {"fio_bytes_per_s", fio_write}}.dump()
            << "\n"
            << nlohmann::json{{"bench", "checkpoint_io"}, {"figure", "load"}, {"bytes", bytes}, {"seconds", load_s},
                              {"bytes_per_s", load_bw}, {"fio_bytes_per_s", fio_read}, {"bit_exact", intact}}.dump()
            << "\n"
            << nlohmann::json{{"bench", "checkpoint_io"}, {"figure", "stall"}, {"bytes", bytes}, {"seconds", stall_s},
                              {"memcpy_seconds", memcpy_s}}.dump()
            << "\n"
            << nlohmann::json{{"bench", "checkpoint_io"},
                              {"summary", true},
                              {"state_bytes", bytes},
                              {"save_ratio_vs_fio", median(save_ratios)},
                              {"save_target", ">= 0.9"},
                              {"load_ratio_vs_fio", median(load_ratios)},
                              {"load_target", ">= 0.9"},
                              {"stall_ratio_vs_memcpy", median(stall_ratios)},
                              {"ratios_by_round", {{"save", save_ratios}, {"load", load_ratios}, {"stall", stall_ratios}}},
                              {"stall_target", "<= 1.5"},
                              {"blas", keel::bench::blas_ceiling(0)},
                              {"machine", machine}}.dump()
            << std::endl;
  if (!keep) fs::remove_all(root);
  return intact ? 0 : 1;
}
