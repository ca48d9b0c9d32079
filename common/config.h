// The run configuration: one TOML file (DESIGN §9) plus `--set
// section.key=value` overrides. Every section is a struct with in-class
// defaults; each struct lists its fields once, in visit(), and that one list
// drives parsing, overrides, printing and JSON export.
//
// Everything is checked before anything starts: unknown sections and keys,
// wrong types and inconsistent values raise Error(kBadConfig) with the file,
// line and a sentence that says what to change.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace keel::common {

struct JobConfig {
  std::string name = "keel";        // run name, shown in logs and metrics
  std::string run_dir = "runs/keel"; // metrics, events, checkpoints; relative to the config file
  int64_t seed = 1337;              // seeds the initial model and the batch order

  template <class V> void visit(V& v) {
    v("name", name);
    v("run_dir", run_dir);
    v("seed", seed);
  }
};

struct ModelConfig {
  int64_t vocab_size = 256;      // tokenizer vocabulary (256 bytes; 50257 for GPT-2); padded to a multiple of 128
  int64_t seq_len = 256;         // context length T (rows of wpe)
  int64_t n_layer = 4;           // transformer blocks
  int64_t n_head = 4;            // attention heads; must divide n_embd
  int64_t n_embd = 256;          // model width C
  int64_t n_expert = 0;          // experts per MoE layer; 0 = dense MLP everywhere
  int64_t top_k = 2;             // experts each token is routed to (MoE only)
  int64_t moe_every = 1;         // block i is MoE when (i + 1) % moe_every == 0 (MoE only)
  double aux_loss_coef = 0.01;   // Switch load-balancing loss coefficient (MoE only)

  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int64_t head_dim() const { return n_embd / n_head; }
  bool is_moe_layer(int64_t layer) const { return n_expert > 0 && (layer + 1) % moe_every == 0; }

  template <class V> void visit(V& v) {
    v("vocab_size", vocab_size);
    v("seq_len", seq_len);
    v("n_layer", n_layer);
    v("n_head", n_head);
    v("n_embd", n_embd);
    v("n_expert", n_expert);
    v("top_k", top_k);
    v("moe_every", moe_every);
    v("aux_loss_coef", aux_loss_coef);
  }
};

struct DataConfig {
  std::string train = "";  // glob of llm.c token shards for training; relative to the config file
  std::string val = "";    // glob of validation shards; empty = no validation

  template <class V> void visit(V& v) {
    v("train", train);
    v("val", val);
  }
};

struct ParallelConfig {
  int64_t dp = 1;              // data-parallel degree
  int64_t tp = 1;              // tensor-parallel degree
  int64_t pp = 1;              // pipeline-parallel degree
  int64_t cp = 1;              // context-parallel degree
  int64_t ep = 1;              // expert-parallel degree (carved out of dp x cp)
  int64_t zero = 0;            // ZeRO stage 0-3
  int64_t micro_batches = 1;   // gradient-accumulation microbatches per step and DP rank
  double timeout_s = 120;      // rendezvous and per-collective timeout; a rank past it exits 10 or 12

  template <class V> void visit(V& v) {
    v("dp", dp);
    v("tp", tp);
    v("pp", pp);
    v("cp", cp);
    v("ep", ep);
    v("zero", zero);
    v("micro_batches", micro_batches);
    v("timeout_s", timeout_s);
  }
};

struct TrainConfig {
  int64_t steps = 1000;          // optimizer steps
  int64_t batch_size = 8;        // global batch, in sequences of seq_len tokens
  double lr = 6e-4;              // peak learning rate
  double min_lr_ratio = 0.1;     // cosine decays to lr * min_lr_ratio at the last step
  int64_t warmup_steps = 100;    // linear warmup from lr/warmup_steps to lr
  double weight_decay = 0.1;     // decoupled AdamW decay, 2-D weights only
  double beta1 = 0.9;            // AdamW first-moment decay
  double beta2 = 0.95;           // AdamW second-moment decay
  double eps = 1e-8;             // AdamW denominator epsilon
  double grad_clip = 1.0;        // global gradient-norm clip; 0 disables
  int64_t val_every = 100;       // validate every N steps and after the last; 0 = never
  int64_t val_batches = 8;       // batches of batch_size sequences per validation pass
  int64_t log_every = 10;        // progress line every N steps
  int64_t threads = 0;           // CPU threads for kernels; 0 = all cores

  template <class V> void visit(V& v) {
    v("steps", steps);
    v("batch_size", batch_size);
    v("lr", lr);
    v("min_lr_ratio", min_lr_ratio);
    v("warmup_steps", warmup_steps);
    v("weight_decay", weight_decay);
    v("beta1", beta1);
    v("beta2", beta2);
    v("eps", eps);
    v("grad_clip", grad_clip);
    v("val_every", val_every);
    v("val_batches", val_batches);
    v("log_every", log_every);
    v("threads", threads);
  }
};

struct CheckpointConfig {
  std::string dir = "";        // where checkpoints go; empty = run_dir/checkpoints; relative to the config file
  int64_t every_steps = 0;     // save after every N steps; 0 = not by step count
  double every_seconds = 0;    // save when N seconds have passed since the last save; 0 = not by time
  int64_t keep = 3;            // newest committed checkpoints kept
  int64_t keep_every = 0;      // also keep every checkpoint whose step is a multiple of N; 0 = none
  std::string verify = "full"; // checksums checked before a checkpoint is loaded: full | off
  bool o_direct = true;        // bulk writes bypass the page cache where the filesystem allows it
  double timeout_s = 600;      // how long rank 0 waits for every rank's file before abandoning a save

  template <class V> void visit(V& v) {
    v("dir", dir);
    v("every_steps", every_steps);
    v("every_seconds", every_seconds);
    v("keep", keep);
    v("keep_every", keep_every);
    v("verify", verify);
    v("o_direct", o_direct);
    v("timeout_s", timeout_s);
  }
};

class Config {
 public:
  JobConfig job;
  ModelConfig model;
  DataConfig data;
  ParallelConfig parallel;
  TrainConfig train;
  CheckpointConfig checkpoint;

  // checkpoint.dir, or run_dir/checkpoints when it is empty.
  std::filesystem::path checkpoint_dir() const;

  template <class V> void visit(V& v) {
    v.section("job", job);
    v.section("model", model);
    v.section("data", data);
    v.section("parallel", parallel);
    v.section("train", train);
    v.section("checkpoint", checkpoint);
  }

  // Parses `path`, applies `overrides` ("section.key=value", the value in
  // TOML syntax or a bare string), resolves relative paths against the
  // config file's directory and validates. Throws Error(kBadConfig).
  static Config load(const std::filesystem::path& path, const std::vector<std::string>& overrides = {});

  // Same, from TOML text; `source_name` names it in errors and relative
  // paths resolve against `base_dir`.
  static Config parse(std::string_view toml_text, const std::string& source_name,
                      const std::filesystem::path& base_dir,
                      const std::vector<std::string>& overrides = {});

  // Checks consistency across fields; load() and parse() already call it.
  void validate() const;

  // The resolved configuration, every field included.
  std::string to_toml() const;
  nlohmann::json to_json() const;

  // Where "section.key" got its value: "file.toml:12", "--set" or "default".
  std::string origin(const std::string& dotted_key) const;

 private:
  std::map<std::string, std::string> origins_;
};

}  // namespace keel::common
