// keel-oracle-dump: writes keel's initial model, one forward/backward and a
// short training run as .npy files, so tests/python/test_pytorch_oracle.py
// can rebuild the same model in PyTorch and compare.
#include "common/config.h"
#include "common/error.h"
#include "trainer/data/batches.h"
#include "trainer/data/dataset.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/train/blas_core_start.h"
#include "trainer/train/train_loop.h"
#include "tests/support/npy.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

namespace fs = std::filesystem;
using keel::test::write_npy;

namespace {

std::vector<float> download(keel::trainer::Backend& backend, const float* src, size_t count) {
  std::vector<float> host(count);
  backend.copy_to_host(host.data(), src, count * sizeof(float));
  return host;
}

void dump_tensors(keel::trainer::Gpt& model, const float* buffer, const fs::path& dir) {
  fs::create_directories(dir);
  auto host = download(model.backend(), buffer, model.table().total());
  for (const auto& spec : model.table().specs()) write_npy(dir / (spec.name + ".npy"), host.data() + spec.offset, spec.shape);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-oracle-dump: export a model and a short run for the PyTorch oracle"};
  std::string config_path, out_dir;
  std::vector<std::string> overrides;
  int64_t steps = 10;
  app.add_option("--config", config_path)->required();
  app.add_option("--set", overrides);
  app.add_option("--out", out_dir)->required();
  app.add_option("--steps", steps);
  CLI11_PARSE(app, argc, argv);

  try {
    auto config = keel::common::Config::load(config_path, overrides);
    // The oracle holds the kernels keel-trainer runs, on the core it runs.
    const auto blas = keel::trainer::settle_blas_core(config.train.blas_core, argv);
    keel::trainer::CpuBackend backend(static_cast<int>(config.train.threads));
    keel::trainer::prove_blas_core(blas, backend, false, argv);
    const fs::path out(out_dir);
    fs::create_directories(out);
    const int B = static_cast<int>(config.train.batch_size), T = static_cast<int>(config.model.seq_len);

    // The check batch runs as one microbatch of the whole global batch.
    auto check_config = config;
    check_config.parallel.micro_batches = 1;
    keel::trainer::TrainLoop check(check_config, backend);
    keel::trainer::Gpt& model = check.model();
    dump_tensors(model, check.storage().params(), out / "init");

    std::vector<int32_t> inputs(static_cast<size_t>(B) * T), targets(inputs.size());
    const auto data = keel::trainer::DataMix::open(config.data.train_sources(), config.model.vocab_size, T + 1);
    keel::trainer::fill_train_batch(data, static_cast<uint64_t>(config.job.seed), 0, B, T, 0, B, inputs.data(), targets.data());
    write_npy(out / "check_inputs.npy", inputs.data(), {B, T});
    write_npy(out / "check_targets.npy", targets.data(), {B, T});
    check.storage().zero_gradients();
    model.forward(inputs.data(), targets.data(), B);
    const float loss = model.loss();
    float aux = model.aux_loss();
    auto logits = download(backend, model.logits().f32(), static_cast<size_t>(B) * T * config.model.padded_vocab());
    write_npy(out / "check_logits.npy", logits.data(), {B, T, config.model.padded_vocab()});
    write_npy(out / "check_loss.npy", &loss, {1});
    write_npy(out / "check_aux_loss.npy", &aux, {1});
    model.backward(1.0f);
    dump_tensors(model, check.storage().grads(), out / "check_grads");

    // A fresh loop from the same seed trains with the configured microbatches.
    keel::trainer::TrainLoop loop(config, backend);
    std::vector<int32_t> all_inputs, all_targets;
    std::vector<float> losses, lrs, norms;
    for (int64_t s = 0; s < steps; ++s) {
      keel::trainer::fill_train_batch(data, static_cast<uint64_t>(config.job.seed), s, B, T, 0, B, inputs.data(), targets.data());
      all_inputs.insert(all_inputs.end(), inputs.begin(), inputs.end());
      all_targets.insert(all_targets.end(), targets.begin(), targets.end());
      auto stats = loop.train_step(s);
      losses.push_back(stats.loss);
      lrs.push_back(static_cast<float>(stats.lr));
      norms.push_back(stats.grad_norm);
    }
    write_npy(out / "train_inputs.npy", all_inputs.data(), {steps, B, T});
    write_npy(out / "train_targets.npy", all_targets.data(), {steps, B, T});
    write_npy(out / "train_losses.npy", losses.data(), {steps});
    write_npy(out / "train_lrs.npy", lrs.data(), {steps});
    write_npy(out / "train_grad_norms.npy", norms.data(), {steps});

    nlohmann::json meta = {{"config", config.to_json()}, {"padded_vocab", config.model.padded_vocab()}, {"steps", steps}};
    for (const auto& spec : model.table().specs()) meta["param_names"].push_back(spec.name);
    std::ofstream(out / "meta.json") << meta.dump(2) << "\n";
    return 0;
  } catch (const keel::common::Error& e) {
    std::cerr << "keel-oracle-dump: " << e.what() << std::endl;
    return keel::common::exit_code(e.code());
  }
}
