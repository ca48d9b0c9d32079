// Hugging Face models out and in (docs/architecture.md "Outside formats"):
// a checkpoint of any layout becomes config.json and safetensors that an
// independent reader (tests/python/eval_hf_export.py: the header parsed by
// hand, a PyTorch model of Hugging Face's conventions) scores as keel
// does, and that another layout imports bit for bit as its step 0; bf16
// and sharded exports hold what they say; keelctl export and the import
// refuse bad input with a sentence and an exit code and change nothing.
#include "checkpoint/catalog.h"
#include "checkpoint/paths.h"
#include "interop/hf_export.h"
#include "interop/hf_names.h"
#include "interop/safetensors.h"
#include "tests/support/process.h"
#include "tests/trainer/trainer_runs.h"
#include "trainer/kernels/dtype.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <set>

namespace {

namespace fs = std::filesystem;
using keel::test::Layout;
using keel::test::TrainerRuns;

// Four steps, a checkpoint at the last. vocab_size 300 pads to 384 rows,
// which the export drops.
std::vector<std::string> four_steps(std::vector<std::string> sets) {
  sets.insert(sets.end(), {"train.steps=4", "train.val_every=0", "checkpoint.every_steps=4", "model.vocab_size=300"});
  return sets;
}

const std::vector<std::string> kLlama = {"model.arch=llama",       "model.n_kv_head=2",
                                         "model.tie_embeddings=false", "model.rope_theta=10000",
                                         "model.rope_scaling_factor=8", "model.rope_original_context=16"};

fs::path checkpoint_of(const TrainerRuns& f, const std::string& run, int64_t step) {
  return keel::checkpoint::step_dir(f.dir() / run / "checkpoints", step);
}

double loss_of(const std::string& output) { return keel::test::last_json_line(output).at("loss").get<double>(); }

// keelctl --json's document, after any progress lines.
nlohmann::json json_document(const std::string& output) {
  const size_t at = output.find("{\n");
  REQUIRE(at != std::string::npos);
  return nlohmann::json::parse(output.substr(at));
}

// Each exported tensor is keel's, transposed where Hugging Face stores
// [in, out], its padded vocabulary rows dropped; `round` is what the
// export's dtype does to a value.
void require_tensors_match(const fs::path& export_dir, const fs::path& checkpoint, const keel::common::ModelConfig& model,
                           float (*round)(float)) {
  const auto keel_tensors = keel::test::all_tensors(checkpoint);
  std::map<std::string, std::unique_ptr<keel::interop::SafetensorsFile>> files;
  std::map<std::string, std::string> where;
  if (fs::exists(export_dir / "model.safetensors.index.json")) {
    std::ifstream in(export_dir / "model.safetensors.index.json");
    const auto index = nlohmann::json::parse(in);
    for (const auto& [name, file] : index.at("weight_map").items()) where[name] = file;
  }
  const auto hf = keel::interop::hf_tensors(model);
  size_t stored = 0;
  for (const auto& t : hf) {
    CAPTURE(t.name);
    const std::string file = where.empty() ? "model.safetensors" : where.at(t.name);
    auto& open = files[file];
    if (!open) {
      open = std::make_unique<keel::interop::SafetensorsFile>(export_dir / file);
      stored += open->tensors().size();
    }
    const auto* entry = open->find(t.name);
    REQUIRE(entry != nullptr);
    REQUIRE(entry->shape == t.shape);
    std::vector<float> values(static_cast<size_t>(entry->numel()));
    open->read(*entry, values.data());
    const auto& keel = keel_tensors.at("/model/" + t.keel_name);
    const int64_t cols = t.keel_shape.size() == 2 ? t.keel_shape[1] : 1;
    size_t differ = 0;
    for (int64_t r = 0; r < t.rows(); ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float want = round(keel[static_cast<size_t>(r * cols + c)]);
        const float got = values[static_cast<size_t>(t.transposed ? c * t.rows() + r : r * cols + c)];
        differ += std::memcmp(&want, &got, sizeof(float)) != 0;
      }
    }
    CHECK(differ == 0);
  }
  CHECK(stored == hf.size());  // nothing but the model
}

float exact(float v) { return v; }

// A model directory's tensors, by name, as float32.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
std::map<std::string, Tensor> read_model(const fs::path& dir) {
  const keel::interop::SafetensorsFile file(dir / "model.safetensors");
  std::map<std::string, Tensor> out;
  for (const auto& t : file.tensors()) {
    auto& kept = out[t.name];
    kept.shape = t.shape;
    kept.values.resize(static_cast<size_t>(t.numel()));
    file.read(t, kept.values.data());
  }
  return out;
}

// Writes `tensors` as DIR/model.safetensors with config.json beside it.
void write_model(const fs::path& dir, const std::map<std::string, Tensor>& tensors) {
  fs::create_directories(dir);
  std::vector<keel::interop::TensorToWrite> names;
  std::vector<const Tensor*> values;
  for (const auto& [name, t] : tensors) {
    names.push_back({name, t.shape});
    values.push_back(&t);
  }
  keel::interop::write_safetensors(dir / "model.safetensors", names, keel::interop::TensorDtype::kF32,
                                   [&](size_t i, float* dst) { std::copy(values[i]->values.begin(), values[i]->values.end(), dst); });
  std::ofstream(dir / "config.json") << "{}";
}

keel::test::ProcessResult keelctl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {keel::test::keel_binary("keelctl").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  return keel::test::run_process(argv);
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE(
      "GPT-2 and Llama checkpoints of a TP2 x PP2 run export to files an independent reader scores as keel does and a "
      "DP2 run imports bit for bit") {
    struct Family {
      const char* name;
      std::vector<std::string> sets;
      const char* architecture;
    };
    for (const Family& family : {Family{"gpt2", {}, "GPT2LMHeadModel"}, Family{"llama", kLlama, "LlamaForCausalLM"}}) {
      INFO(family.name);
      TrainerRuns f;
      const auto sets = four_steps(family.sets);
      f.run(Layout{.tp = 2, .micro_batches = 2, .pp = 2}, family.name, sets);
      const fs::path checkpoint = checkpoint_of(f, family.name, 4);
      const fs::path out = f.dir() / "export";
      const auto exported = keelctl({"export", (f.dir() / family.name / "checkpoints").string(), "--out", out.string(),
                                     "--json"});
      INFO(exported.output);
      REQUIRE(exported.exit_code == 0);
      const auto report = json_document(exported.output);
      CHECK(report.at("step") == 4);
      CHECK(report.at("files") == nlohmann::json{"model.safetensors", "config.json"});
      CHECK(report.at("checkpoint") == checkpoint.string());

      const auto model = f.config(sets).model;
      require_tensors_match(out, checkpoint, model, exact);
      std::ifstream in(out / "config.json");
      const auto config = nlohmann::json::parse(in);
      CHECK(config.at("architectures") == nlohmann::json{family.architecture});
      CHECK(config.at("vocab_size") == 300);
      CHECK(config.at("torch_dtype") == "float32");

      // The same tokens through keel and through the independent reader.
      const std::string data = (f.dir() / "train.bin").string();
      const auto keel_eval = f.run(Layout{}, std::string("eval_") + family.name, sets,
                                   {"--eval", checkpoint.string(), "--eval-data", data, "--eval-sequences", "16"});
      const auto reader = keel::test::run_process(
          {KEEL_SYSTEM_PYTHON, std::string(KEEL_TESTS_DIR) + "/python/eval_hf_export.py", out.string(), data, "16"});
      INFO(reader.output);
      REQUIRE(reader.exit_code == 0);
      const double want = loss_of(keel_eval.outputs[0]);
      CHECK(std::fabs(loss_of(reader.output) - want) <= 1e-5 * want);

      // Imported as step 0 of a DP2 run: the same weights, the padded
      // vocabulary rows zero, the optimizer fresh, the same loss.
      f.run(Layout{.dp = 2}, "imported", sets, {"--init-from", "hf:" + out.string(), "--stop-after", "0"});
      const fs::path start = checkpoint_of(f, "imported", 0);
      const auto original = keel::test::all_tensors(checkpoint);
      std::map<std::string, size_t> kept_of;  // elements before the padded vocabulary rows
      for (const auto& t : keel::interop::hf_tensors(model)) {
        kept_of["/model/" + t.keel_name] = static_cast<size_t>(t.rows() * (t.keel_shape.size() == 2 ? t.keel_shape[1] : 1));
      }
      for (const auto& [name, values] : keel::test::all_tensors(start)) {
        CAPTURE(name);
        if (name.starts_with("/optim/")) {
          CHECK(std::all_of(values.begin(), values.end(), [](float v) { return v == 0.0f; }));
          continue;
        }
        const auto& was = original.at(name);
        REQUIRE(was.size() == values.size());
        const size_t kept = kept_of.at(name);
        CHECK(std::memcmp(values.data(), was.data(), kept * sizeof(float)) == 0);
        CHECK(std::all_of(values.begin() + static_cast<std::ptrdiff_t>(kept), values.end(),
                          [](float v) { return v == 0.0f; }));
      }
      const auto imported_eval = f.run(Layout{}, std::string("eval_imported_") + family.name, sets,
                                       {"--eval", start.string(), "--eval-data", data, "--eval-sequences", "16"});
      CHECK(loss_of(imported_eval.outputs[0]) == want);
    }
  }

  TEST_CASE("a bf16 export past its shard size is split as Hugging Face splits it with every weight rounded to nearest even") {
    TrainerRuns f;
    const auto sets = four_steps(kLlama);
    f.run(Layout{}, "run", sets);
    const fs::path out = f.dir() / "export";
    std::vector<keel::interop::HfExportProgress> progress;
    const auto report = keel::interop::export_hf({checkpoint_of(f, "run", 4), out, keel::interop::TensorDtype::kBF16,
                                                  40'000, [&](const auto& p) { progress.push_back(p); }});
    const auto model = f.config(sets).model;
    const auto hf = keel::interop::hf_tensors(model);
    REQUIRE(report.files.size() > 3);
    CHECK(report.files[0] == fmt::format("model-00001-of-{:05d}.safetensors", report.files.size() - 2));
    CHECK(report.files.back() == "config.json");
    std::ifstream in(out / "model.safetensors.index.json");
    const auto index = nlohmann::json::parse(in);
    CHECK(index.at("weight_map").size() == hf.size());
    uint64_t data_bytes = 0;
    for (const auto& t : hf) data_bytes += 2 * static_cast<uint64_t>(keel::interop::TensorToWrite{t.name, t.shape}.numel());
    CHECK(index.at("metadata").at("total_size") == data_bytes);
    for (size_t k = 0; k + 2 < report.files.size(); ++k) {
      const keel::interop::SafetensorsFile shard(out / report.files[k]);
      uint64_t bytes = 0;
      for (const auto& t : shard.tensors()) bytes += t.end - t.begin;
      CHECK((bytes <= 40'000 || shard.tensors().size() == 1));  // a tensor past the limit alone
    }
    require_tensors_match(out, checkpoint_of(f, "run", 4), model, keel::trainer::bf16_rounded);
    std::ifstream config_in(out / "config.json");
    const auto config = nlohmann::json::parse(config_in);
    CHECK(config.at("torch_dtype") == "bfloat16");
    CHECK(config.at("num_key_value_heads") == 2);
    CHECK(config.at("rope_scaling") == nlohmann::json{{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                                      {"high_freq_factor", 4.0},
                                                      {"original_max_position_embeddings", 16}});
    REQUIRE(progress.size() == hf.size());
    CHECK(progress.back().bytes_done == progress.back().bytes);
    CHECK(progress.back().bytes == data_bytes);

    // The same from keel-trainer, for scripts: the run's newest checkpoint, in one file.
    std::vector<std::string> argv = {keel::test::keel_binary("keel-trainer").string(), "--config",
                                     (f.dir() / "run.toml").string(), "--set", "job.run_dir=" + (f.dir() / "run").string()};
    for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
    argv.insert(argv.end(), {"--export-hf", (f.dir() / "from_trainer").string(), "--export-dtype", "bf16"});
    const auto trainer = keel::test::run_process(argv);
    INFO(trainer.output);
    REQUIRE(trainer.exit_code == 0);
    CHECK(keel::test::last_json_line(trainer.output).at("files") == nlohmann::json{"model.safetensors", "config.json"});
    require_tensors_match(f.dir() / "from_trainer", checkpoint_of(f, "run", 4), model, keel::trainer::bf16_rounded);
  }

  TEST_CASE("keelctl export refuses a bad request with a sentence and an exit code and leaves no partial export") {
    TrainerRuns f;
    f.run(Layout{}, "run", four_steps({}));
    f.run(Layout{}, "moe", four_steps({"model.n_expert=2", "model.top_k=1"}));
    const fs::path checkpoint = checkpoint_of(f, "run", 4);
    // A copy whose rank file lost a byte in the middle.
    const fs::path damaged = f.dir() / "damaged" / "step_00000004";
    fs::create_directories(damaged.parent_path());
    fs::copy(checkpoint, damaged);
    for (const auto& file : fs::directory_iterator(damaged)) {
      if (file.path().filename().string().starts_with("rank")) {
        std::fstream io(file.path(), std::ios::in | std::ios::out | std::ios::binary);
        io.seekp(static_cast<std::streamoff>(fs::file_size(file.path()) / 2));
        io.put('\x5a');
      }
    }
    const fs::path taken = f.dir() / "taken";
    fs::create_directories(taken);
    std::ofstream(taken / "keep.txt") << "an operator's file";
    fs::create_directories(f.dir() / "empty");

    struct Row {
      const char* what;
      std::vector<std::string> args;
      int exit_code;
      const char* said;
    };
    const std::string out = (f.dir() / "out").string();
    const Row rows[] = {
        {"an --out that exists", {"export", checkpoint.string(), "--out", taken.string()}, 2, "exists: an export writes a new directory"},
        {"a directory with no checkpoint", {"export", (f.dir() / "empty").string(), "--out", out}, 2,
         "neither a checkpoint"},
        {"a checkpoint that does not verify", {"export", damaged.string(), "--out", out}, 1, "does not verify"},
        {"a model with expert layers", {"export", checkpoint_of(f, "moe", 4).string(), "--out", out}, 2, "expert layers"},
        {"a dtype keel does not write", {"export", checkpoint.string(), "--out", out, "--dtype", "fp16"}, 2, "fp16"},
        {"a format keel does not write", {"export", checkpoint.string(), "--out", out, "--format", "gguf"}, 2, "gguf"},
        {"no --out", {"export", checkpoint.string()}, 2, "--out"},
    };
    for (const Row& row : rows) {
      INFO(row.what);
      const auto result = keelctl(row.args);
      INFO(result.output);
      CHECK(result.exit_code == row.exit_code);
      CHECK(result.output.find(row.said) != std::string::npos);
      CHECK_FALSE(fs::exists(out));
      CHECK_FALSE(fs::exists(f.dir() / ".out.partial"));
    }
    CHECK(fs::directory_iterator(taken) != fs::directory_iterator());
    std::ifstream kept(taken / "keep.txt");
    CHECK(std::string(std::istreambuf_iterator<char>(kept), {}) == "an operator's file");
  }

  TEST_CASE("weights that do not fit the model are refused before training with the tensor and both shapes") {
    TrainerRuns f;
    const auto sets = four_steps({});
    f.run(Layout{}, "run", sets);
    const fs::path good = f.dir() / "hf";
    keel::interop::export_hf({checkpoint_of(f, "run", 4), good});
    const auto tensors = read_model(good);
    auto edited = [&](const std::string& name, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
      auto copy = tensors;
      edit(copy);
      write_model(f.dir() / name, copy);
      return "hf:" + (f.dir() / name).string();
    };
    struct Row {
      const char* what;
      std::string init_from;
      int exit_code;
      const char* said;
    };
    fs::create_directories(f.dir() / "empty");
    fs::create_directories(f.dir() / "truncated");
    fs::copy(good / "config.json", f.dir() / "truncated");
    fs::copy(good / "model.safetensors", f.dir() / "truncated");
    fs::resize_file(f.dir() / "truncated" / "model.safetensors", fs::file_size(good / "model.safetensors") / 2);
    const Row rows[] = {
        {"a tensor of another shape",
         edited("narrow", [](auto& t) { t["transformer.wpe.weight"].shape = {16, 64}; }), 2,
         "transformer.wpe.weight has shape [16, 64] where this model's is [32, 32]"},
        {"a missing tensor", edited("missing", [](auto& t) { t.erase("transformer.ln_f.bias"); }), 2,
         "transformer.ln_f.bias of shape [32] is missing"},
        {"a tensor the model lacks",
         edited("extra", [](auto& t) { t["transformer.h.9.ln_1.weight"] = t["transformer.h.0.ln_1.weight"]; }), 2,
         "transformer.h.9.ln_1.weight (in model.safetensors) is not a tensor of this model"},
        {"a directory with no safetensors", "hf:" + (f.dir() / "empty").string(), 2, "holds neither model.safetensors"},
        {"a truncated file", "hf:" + (f.dir() / "truncated").string(), 3, "past the end of the data"},
        {"hf: and no directory", "hf:", 2, "names no directory"},
    };
    for (const Row& row : rows) {
      INFO(row.what);
      const std::string run = std::string("refused_") + std::to_string(&row - rows);
      const auto result = f.run(Layout{}, run, sets, {"--init-from", row.init_from}, row.exit_code);
      CHECK(result.outputs[0].find(row.said) != std::string::npos);
      CHECK(keel::checkpoint::committed(f.dir() / run / "checkpoints").empty());
      CHECK_FALSE(fs::exists(f.dir() / run / "metrics.jsonl"));
    }

    // What a bare GPT2Model saves (no `transformer.` prefix, the causal
    // mask buffers beside the weights) imports as GPT2LMHeadModel's does.
    const std::string bare = edited("bare", [](auto& t) {
      std::map<std::string, Tensor> renamed;
      for (auto& [name, value] : t) renamed[name.substr(std::string("transformer.").size())] = std::move(value);
      renamed["h.0.attn.bias"] = Tensor{{1, 1, 32, 32}, std::vector<float>(32 * 32, 1.0f)};
      t = std::move(renamed);
    });
    f.run(Layout{}, "bare", sets, {"--init-from", bare, "--stop-after", "0"});
    f.run(Layout{}, "prefixed", sets, {"--init-from", "hf:" + good.string(), "--stop-after", "0"});
    CHECK(keel::test::all_tensors(checkpoint_of(f, "bare", 0)) == keel::test::all_tensors(checkpoint_of(f, "prefixed", 0)));
  }

  TEST_CASE("a run started from imported weights resumes from its own checkpoints and never imports again") {
    TrainerRuns f;
    auto sets = four_steps(kLlama);
    f.run(Layout{}, "run", sets);
    const fs::path hf = f.dir() / "hf";
    keel::interop::export_hf({checkpoint_of(f, "run", 4), hf});
    sets.push_back("checkpoint.every_steps=2");
    const std::vector<std::string> from_hf = {"--init-from", "hf:" + hf.string()};
    const auto whole = f.run(Layout{.dp = 2}, "whole", sets, from_hf);
    auto stopped = from_hf;
    stopped.insert(stopped.end(), {"--stop-after", "2"});
    f.run(Layout{.dp = 2}, "resumed", sets, stopped, 14);
    const auto resumed = f.run(Layout{.dp = 2}, "resumed", sets, from_hf);
    std::vector<std::string> starts;
    for (const auto& e : keel::test::events(f.dir() / "resumed")) {
      if (e.at("kind") == "state_restored") starts.push_back(e.at("from").get<std::string>() + "@" + e.at("step").dump());
    }
    CHECK(starts == std::vector<std::string>{"hf@0", "disk@2"});
    CHECK(resumed.exact == whole.exact);  // steps 0-1 then 2-3, bit-identical to the run that never stopped
  }
}
