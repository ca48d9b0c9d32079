#include "common/config.h"
#include "common/error.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

using keel::common::Config;
using keel::common::Error;
using keel::common::ErrorCode;

namespace {

const char* kMinimal = R"(
[job]
name = "t"
run_dir = "runs/t"
[data]
train = "data/train_*.bin"
)";

std::string parse_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    Config::parse(text, "cfg.toml", "/base", overrides);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kBadConfig);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a minimal config takes every default and resolves paths against the config file") {
    Config c = Config::parse(kMinimal, "cfg.toml", "/base");
    CHECK(c.model.n_layer == 4);
    CHECK(c.train.lr == doctest::Approx(6e-4));
    CHECK(c.job.run_dir == "/base/runs/t");
    CHECK(c.data.train == std::vector<std::string>{"/base/data/train_*.bin"});
    CHECK(c.origin("job.name") == "cfg.toml:3");
    CHECK(c.origin("model.n_layer") == "default");
  }

  TEST_CASE("--set overrides keys the file sets and keys it does not") {
    Config c = Config::parse(kMinimal, "cfg.toml", "/base",
                             {"job.name=other", "train.lr=1e-3", "model.n_layer=2", "train.warmup_steps=0",
                              "job.seed=7"});
    CHECK(c.job.name == "other");
    CHECK(c.train.lr == doctest::Approx(1e-3));
    CHECK(c.model.n_layer == 2);
    CHECK(c.job.seed == 7);
    CHECK(c.origin("train.lr") == "--set train.lr=1e-3");
  }

  TEST_CASE("a quoted and a bare string override mean the same") {
    Config a = Config::parse(kMinimal, "cfg.toml", "/base", {"job.name=\"x y\""});
    Config b = Config::parse(kMinimal, "cfg.toml", "/base", {"job.name=x y"});
    CHECK(a.job.name == "x y");
    CHECK(b.job.name == "x y");
  }

  TEST_CASE("the resolved config printed as TOML parses back to the same config") {
    Config c = Config::parse(kMinimal, "cfg.toml", "/base", {"model.n_expert=4", "train.lr=0.5"});
    Config back = Config::parse(c.to_toml(), "resolved.toml", "/elsewhere");
    CHECK(back.to_json() == c.to_json());
  }

  TEST_CASE("integers are accepted where a float is expected but not the other way round") {
    CHECK(Config::parse(std::string(kMinimal) + "[train]\nlr = 1\n", "cfg.toml", "/base").train.lr == 1.0);
    CHECK(parse_error(std::string(kMinimal) + "[train]\nsteps = 1.5\n").find("steps must be an integer") !=
          std::string::npos);
  }

  TEST_CASE("malformed configs are rejected with the file and line and what to change") {
    struct Row {
      const char* name;
      std::string text;
      std::vector<std::string> overrides;
      const char* expected;
    };
    const std::string m = kMinimal;
    const Row rows[] = {
        {"not TOML", "[job\nname=1", {}, "cfg.toml:1: not valid TOML"},
        {"unknown section", m + "[modle]\nn_layer = 2\n", {}, "unknown section [modle]"},
        {"unknown key", m + "[model]\nn_layers = 2\n", {}, "cfg.toml:8: unknown key 'n_layers' in [model]"},
        {"wrong type", m + "[model]\nn_layer = \"four\"\n", {}, "n_layer must be an integer, not a string"},
        {"section not a table", "job = 3\n", {}, "[job] must be a table"},
        {"heads do not divide width", m + "[model]\nn_head = 3\n", {}, "n_head=3 does not divide n_embd=256"},
        {"vocab too large", m + "[model]\nvocab_size = 2000000000\n", {}, "token ids are int32"},
        {"zero layers", m + "[model]\nn_layer = 0\n", {}, "model.n_layer): must be at least 1"},
        {"top_k above experts", m + "[model]\nn_expert = 2\ntop_k = 3\n", {}, "top_k): must be in [1, n_expert=2]"},
        {"negative lr", m + "[train]\nlr = -1.0\n", {}, "lr): must be positive"},
        {"batch not divisible", m + "[train]\nbatch_size = 6\n[parallel]\nmicro_batches = 4\n", {},
         "batch_size=6 must be divisible by dp x micro_batches"},
        {"zero stage", m + "[parallel]\nzero = 4\n", {}, "ZeRO stage 0-3"},
        {"bit outside a float32", m, {"faults.bitflip_bit=32"}, "must be a bit of a float32, 0-31"},
        {"unknown checkpoint fault", m, {"faults.checkpoint_fault=flaky"}, "must be \"write_error\""},
        {"unknown slowed phase", m, {"faults.slow_phase=data"}, "must be \"compute\", \"checkpoint\" or \"validation\""},
        {"negative stall", m, {"faults.slow_stall_s=-1"}, "slow_stall_s): must be a number of seconds, 0 or more"},
        {"slowed checkpoint given a factor", m, {"faults.slow_phase=checkpoint", "faults.slow_factor=3"},
         "slows compute only; a slowed checkpoint stalls for faults.slow_stall_s instead"},
        {"hang ceiling under the floor", m, {"health.hang_timeout_ceiling_s=1"}, "must be at least hang_timeout_floor_s"},
        {"unknown sdc policy", m, {"health.sdc_policy=ignore"}, "must be \"warn\", \"restart\" or \"exclude\""},
        {"unknown spike policy", m, {"health.spike_policy=retry"}, "must be \"apply\" or \"skip\" (got \"retry\")"},
        {"a loss spike that shrinks nothing", m, {"faults.loss_spike_factor=0"},
         "faults.loss_spike_factor): must be a positive number (got 0)"},
        {"a loss spike at an impossible step", m, {"faults.loss_spike_step=-2"}, "faults.loss_spike_step"},
        {"straggler false alarms too frequent", m, {"health.straggler_false_alarm_steps=10"},
         "health.straggler_false_alarm_steps): must be at least 1000"},
        {"the straggler window count of before the CUSUM", m + "[health]\nstraggler_windows = 3\n", {},
         "unknown key 'straggler_windows' in [health]"},
        {"unknown device", m, {"train.device=gpu"}, "train.device): must be \"cpu\" or \"cuda\" (got \"gpu\")"},
        {"unknown precision", m, {"train.precision=fp16"}, "must be \"auto\", \"fp32\" or \"bf16\" (got \"fp16\")"},
        {"a BLAS core OpenBLAS does not know", m, {"train.blas_core=Skylake"},
         "train.blas_core): must be \"auto\", \"library\" or an OpenBLAS x86-64 core"},
        {"a BLAS core fault that is no target", m, {"faults.bitflip_target=blas"}, "or \"blas_core\" (got \"blas\")"},
        {"heads too wide for the GPU", m, {"train.device=cuda", "model.n_embd=1024", "model.n_head=2"},
         "the CUDA attention takes at most 256"},
        {"overlap that is not a boolean", m + "[parallel]\noverlap_comm = 1\n", {}, "true or false"},
        {"warmup longer than run", m + "[train]\nsteps = 10\nwarmup_steps = 20\n", {}, "warmup_steps=20 exceeds steps=10"},
        {"no training data", "[job]\nname = \"x\"\n", {}, "data.train): must name the training shards"},
        {"an empty blend", "[data]\ntrain = []\n", {}, "data.train): must name the training shards"},
        {"blend weights that do not add up", "[data]\ntrain = [\"0.7 a/x\", \"0.2 b/y\"]\n", {},
         "the weights add up to 0.9, not 1"},
        {"a blend source without a weight", "[data]\ntrain = [\"0.7 a/x\", \"b/y\"]\n", {},
         "has no weight: in a blend every source is \"WEIGHT PATH\""},
        {"a negative blend weight", "[data]\ntrain = [\"1.5 a/x\", \"-0.5 b/y\"]\n", {}, "weights are positive"},
        {"a blend entry that is not a string", "[data]\ntrain = [\"1 a/x\", 2]\n", {},
         "train must be a string or a list of strings"},
        {"a weight with no path", "[data]\ntrain = [\"0.5 \", \"0.5 b/y\"]\n", {}, "an entry names no data"},
        {"one node given fewer ranks than its layout", m, {"daemon.ranks=2"}, "set cluster.etcd to run the job on"},
        {"a cluster store that is not etcd", m, {"cluster.etcd=tcp://h:1", "daemon.ranks=1"},
         "cluster.etcd): must be an etcd address with the job's prefix"},
        {"a cluster without ranks per node", m, {"cluster.etcd=etcd://h:1/keel/t"},
         "must name the ranks each node runs"},
        {"ranks per node that split no layout", m + "[parallel]\ndp = 3\n[train]\nbatch_size = 6\n",
         {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=2"}, "does not divide the layout's dp x tp x pp x cp = 3"},
        {"max nodes that disagree with the layout", m + "[parallel]\ndp = 4\n",
         {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=2", "cluster.max_nodes=3"}, "set max_nodes = 2 or 0"},
        {"min nodes above the full layout", m + "[parallel]\ndp = 4\n",
         {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=2", "cluster.min_nodes=3"},
         "min_nodes=3 exceeds the 2 nodes of the full layout"},
        {"a lease etcd would not grant", m, {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=1", "cluster.lease_ttl_s=1"},
         "at least 2 s, etcd's shortest lease"},
        {"TLS files in the etcd address", m, {"cluster.etcd=etcd://h:1/keel/t?ca=/ca.pem", "daemon.ranks=1"},
         "name etcd's TLS files with cluster.tls_ca_file"},
        {"a client certificate without its key", m,
         {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=1", "cluster.tls_ca_file=/ca.pem",
          "cluster.tls_cert_file=/node.pem"},
         "cluster.tls_key_file): a client certificate goes with its key"},
        {"a client certificate without etcd's CA", m,
         {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=1", "cluster.tls_cert_file=/node.pem",
          "cluster.tls_key_file=/node.key"},
         "cluster.tls_ca_file): must name the CA of etcd's certificates"},
        {"no in-memory snapshot kept", m, {"checkpoint.memory_keep=0"}, "checkpoint.memory_keep"},
        {"more in-memory snapshots than an area holds", m, {"checkpoint.memory_keep=62"},
         "(checkpoint.memory_keep): must be 1 to 61"},
        {"a snapshot interval below -1 (auto)", m, {"checkpoint.memory_every_steps=-2"},
         "checkpoint.memory_every_steps"},
        {"no stall allowed to snapshots", m, {"checkpoint.memory_stall_budget=0"}, "checkpoint.memory_stall_budget"},
        {"every step's time allowed to snapshots", m, {"checkpoint.memory_stall_budget=1"},
         "must be above 0 and below 1"},
        {"a negative pace for the buddy copies", m, {"checkpoint.memory_buddy_mb_per_s=-1"},
         "checkpoint.memory_buddy_mb_per_s): must be 0 (unpaced) or a positive rate"},
        {"a snapshot port past TCP's", m, {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=1", "cluster.snapshot_port=70000"},
         "cluster.snapshot_port): must be a TCP port"},
        {"an unknown model family", m, {"model.arch=mistral"}, "model.arch): must be \"gpt2\" or \"llama\""},
        {"key/value heads that split no query heads", m, {"model.arch=llama", "model.n_kv_head=3"},
         "(model.n_kv_head): n_kv_head=3 does not divide n_head=4"},
        {"an odd head size under rotary positions", m,
         {"model.arch=llama", "model.n_embd=12", "model.n_head=4"}, "(model.n_head): gives heads of n_embd / n_head = 3"},
        {"a rope scaling that shrinks", m, {"model.arch=llama", "model.rope_scaling_factor=0.5"},
         "(model.rope_scaling_factor): must be at least 1"},
        {"a rope band upside down", m, {"model.arch=llama", "model.rope_low_freq_factor=4", "model.rope_high_freq_factor=2"},
         "(model.rope_high_freq_factor): must exceed rope_low_freq_factor"},
        {"a negative rotary base", m, {"model.arch=llama", "model.rope_theta=-1"}, "(model.rope_theta): must be positive"},
        {"an RMSNorm epsilon of 1", m, {"model.arch=llama", "model.norm_eps=1"}, "(model.norm_eps): must be in (0, 1)"},
        {"a negative SwiGLU width", m, {"model.arch=llama", "model.ffn_hidden=-8"}, "(model.ffn_hidden): must be at least 0"},
        {"key/value heads for GPT-2", m, {"model.n_kv_head=2"},
         "(model.n_kv_head): applies to Llama models only; set model.arch = \"llama\""},
        {"a rotary base for GPT-2", m + "[model]\nrope_theta = 10000.0\n", {}, "cfg.toml:8 (model.rope_theta): applies to Llama"},
        {"a SwiGLU width for GPT-2", m, {"model.ffn_hidden=1024"}, "(model.ffn_hidden): applies to Llama models only"},
        {"override without =", m, {"train.lr"}, "expected section.key=value"},
        {"override of unknown key", m, {"train.learning_rate=1"}, "unknown key 'learning_rate' in [train]"},
        {"override of wrong type", m, {"train.steps=many"}, "train.steps must be an integer"},
        {"override of unknown section", m, {"optim.lr=1"}, "unknown section [optim]"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      std::string message = parse_error(row.text, row.overrides);
      CAPTURE(message);
      CHECK(message.find(row.expected) != std::string::npos);
    }
  }

  TEST_CASE("a cluster's node counts default to the full layout over the ranks per node") {
    Config one = Config::parse(kMinimal, "cfg.toml", "/base");
    CHECK(!one.multi_node());
    CHECK(one.max_nodes() == 1);
    Config c = Config::parse(std::string(kMinimal) + "[parallel]\ndp = 3\ntp = 2\n[train]\nbatch_size = 12\n",
                             "cfg.toml", "/base",
                             {"cluster.etcd=etcd://h:1/keel/t", "daemon.ranks=2", "cluster.credential_file=etcd.pw"});
    CHECK(c.multi_node());
    CHECK(c.max_nodes() == 3);
    CHECK(c.min_nodes() == 3);
    CHECK(c.cluster.credential_file == (std::filesystem::current_path() / "etcd.pw").string());
    Config tls = Config::parse(c.to_toml(), "r.toml", "/x",
                               {"cluster.tls_ca_file=pki/ca.pem", "cluster.tls_cert_file=/etc/keel/node.pem",
                                "cluster.tls_key_file=/etc/keel/node.key"});
    CHECK(tls.cluster.tls_ca_file == (std::filesystem::current_path() / "pki/ca.pem").string());
    CHECK(tls.cluster.tls_key_file == "/etc/keel/node.key");
    CHECK(Config::parse(c.to_toml(), "r.toml", "/x", {"cluster.min_nodes=2"}).min_nodes() == 2);
  }

  TEST_CASE("a missing config file is a config error naming the path") {
    try {
      Config::load("/nonexistent/keel.toml");
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kBadConfig);
      CHECK(std::string(e.what()).find("/nonexistent/keel.toml") != std::string::npos);
    }
  }

  TEST_CASE("load resolves relative paths against the directory of the file") {
    keel::test::TempDir dir;
    auto path = dir.write("sub/run.toml", kMinimal);
    Config c = Config::load(path);
    CHECK(c.job.run_dir == (dir.path() / "sub/runs/t").string());
  }
}
