// The run configuration: one TOML file (docs/architecture.md "Errors, logging, config") plus `--set
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

// The model (docs/architecture.md "Model"). `arch` names a family, whose
// settings of the model's parts the keys below it refine: "gpt2" (LayerNorm,
// learned positions, GELU MLP, biases) or "llama" (RMSNorm, rotary
// positions, SwiGLU MLP, no biases). Keys that only refine Llama are 0
// ("the family's") under GPT-2, where any other value is refused.
struct ModelConfig {
  std::string arch = "gpt2";     // "gpt2" | "llama"
  int64_t vocab_size = 256;      // tokenizer vocabulary (256 bytes; 50257 for GPT-2); padded to a multiple of 128
  int64_t seq_len = 256;         // context length T (rows of wpe under GPT-2)
  int64_t n_layer = 4;           // transformer blocks
  int64_t n_head = 4;            // attention (query) heads; must divide n_embd
  int64_t n_embd = 256;          // model width C
  int64_t n_expert = 0;          // experts per MoE layer; 0 = dense MLP everywhere
  int64_t top_k = 2;             // experts each token is routed to (MoE only)
  int64_t moe_every = 1;         // block i is MoE when (i + 1) % moe_every == 0 (MoE only)
  double aux_loss_coef = 0.01;   // Switch load-balancing loss coefficient (MoE only)
  bool tie_embeddings = true;    // the LM head is the token embedding (false: a head of its own)
  // Llama only (0: the family's default).
  int64_t n_kv_head = 0;         // key/value heads, dividing n_head (grouped-query attention); 0 = n_head
  int64_t ffn_hidden = 0;        // SwiGLU width; 0 = Meta's rule: int(8C/3) rounded up to a multiple of 256
  double rope_theta = 0;         // rotary base; 0 = 500000 (Llama 3)
  double norm_eps = 0;           // RMSNorm epsilon; 0 = 1e-5
  // Llama 3.1's rope scaling; factor 0 = none (Llama 3.0).
  double rope_scaling_factor = 0;
  double rope_low_freq_factor = 0;    // 0 = 1
  double rope_high_freq_factor = 0;   // 0 = 4
  int64_t rope_original_context = 0;  // 0 = 8192

  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  bool llama() const { return arch == "llama"; }
  int64_t head_dim() const { return n_embd / n_head; }
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  // The MLP's hidden width: 4C under GPT-2, ffn_hidden or Meta's rule under Llama.
  int64_t mlp_width() const;
  double rotary_base() const { return rope_theta > 0 ? rope_theta : 500000.0; }
  double norm_epsilon() const { return norm_eps > 0 ? norm_eps : 1e-5; }
  // Llama 3.1's rope scaling band, the family's defaults resolved.
  double rope_low_freq() const { return rope_low_freq_factor > 0 ? rope_low_freq_factor : 1.0; }
  double rope_high_freq() const { return rope_high_freq_factor > 0 ? rope_high_freq_factor : 4.0; }
  int64_t rope_context() const { return rope_original_context > 0 ? rope_original_context : 8192; }
  bool is_moe_layer(int64_t layer) const { return n_expert > 0 && (layer + 1) % moe_every == 0; }

  template <class V> void visit(V& v) {
    v("arch", arch);
    v("vocab_size", vocab_size);
    v("seq_len", seq_len);
    v("n_layer", n_layer);
    v("n_head", n_head);
    v("n_embd", n_embd);
    v("n_expert", n_expert);
    v("top_k", top_k);
    v("moe_every", moe_every);
    v("aux_loss_coef", aux_loss_coef);
    v("tie_embeddings", tie_embeddings);
    v("n_kv_head", n_kv_head);
    v("ffn_hidden", ffn_hidden);
    v("rope_theta", rope_theta);
    v("norm_eps", norm_eps);
    v("rope_scaling_factor", rope_scaling_factor);
    v("rope_low_freq_factor", rope_low_freq_factor);
    v("rope_high_freq_factor", rope_high_freq_factor);
    v("rope_original_context", rope_original_context);
  }
};

// One source of tokens (docs/architecture.md "Data"): a glob of llm.c
// token shards, or the prefix of a Megatron-LM indexed dataset (PREFIX.idx
// and PREFIX.bin), with its share of a blend.
struct DataSource {
  double weight = 1;
  bool weighted = false;  // written "WEIGHT PATH"
  std::string path;
};

struct DataConfig {
  // The training data: one source ("data/train_*.bin", "corpus/web_text_document"), or a blend of weighted
  // ones adding up to 1 (["0.7 web/web_text_document", "0.3 code/code_text_document"]); relative to the config file
  std::vector<std::string> train;
  std::string val = "";    // one source for validation; empty = no validation

  // data.train's entries, parsed. Throws Error(kBadConfig) naming an entry
  // that is neither "PATH" nor "WEIGHT PATH".
  std::vector<DataSource> train_sources() const;

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
  // Blocks per pipeline stage, first stage first: "3,3,2"; empty = as even
  // as possible (see common::stage_layers).
  std::string pp_layers = "";
  // Model chunks per pipeline stage: > 1 runs interleaved 1F1B (stage s
  // holds virtual stages s, s + pp, ...); pp_layers then lists pp *
  // pp_virtual counts, one per virtual stage.
  int64_t pp_virtual = 1;
  // "1f1b" (interleaved when pp_virtual > 1), or "zb-h1": 1F1B with each
  // backward split into input and weight gradients, the weight gradients
  // run where 1F1B's stages would wait (a third of its bubble; pp >= 2,
  // pp_virtual = 1). It costs activation memory on every stage: each slot
  // keeps what the weight pass reads, and stages after the first hold up
  // to p + 1 slots (docs/architecture.md "Pipeline schedules").
  std::string pp_schedule = "1f1b";
  double timeout_s = 120;      // rendezvous and per-collective timeout; a rank past it exits 10 or 12
  bool overlap_comm = true;    // DP gradient sums and ZeRO-3 gathers run while compute goes on

  // The ranks the layout needs: dp x tp x pp x cp.
  int64_t world_size() const { return dp * tp * pp * cp; }

  template <class V> void visit(V& v) {
    v("dp", dp);
    v("tp", tp);
    v("pp", pp);
    v("cp", cp);
    v("ep", ep);
    v("zero", zero);
    v("micro_batches", micro_batches);
    v("pp_layers", pp_layers);
    v("pp_virtual", pp_virtual);
    v("pp_schedule", pp_schedule);
    v("timeout_s", timeout_s);
    v("overlap_comm", overlap_comm);
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
  int64_t threads = 0;           // CPU threads for kernels; 0 = OMP_NUM_THREADS, else every CPU the rank may use
  std::string device = "cpu";    // "cpu" or "cuda" (one GPU per rank): the backend every rank trains on
  std::string precision = "auto";  // GEMM inputs: "fp32", "bf16" or "auto" (bf16 on cuda, else fp32)
  // OpenBLAS kernels of the cpu device (common/blas_core.h): "auto" (the
  // newest this CPU runs when OpenBLAS picked older ones), "library"
  // (OpenBLAS's own choice) or a core name ("Haswell", "SkylakeX", ...).
  std::string blas_core = "auto";

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
    v("device", device);
    v("precision", precision);
    v("blas_core", blas_core);
  }
  // precision with "auto" resolved for the device.
  std::string gemm_precision() const {
    if (precision != "auto") return precision;
    return device == "cuda" ? "bf16" : "fp32";
  }
};

struct CheckpointConfig {
  static constexpr std::string_view kHfPrefix = "hf:";
  std::string dir = "";        // where checkpoints go; empty = run_dir/checkpoints; relative to the config file
  int64_t every_steps = 0;     // save after every N steps; 0 = not by step count
  double every_seconds = 0;    // save when N seconds have passed since the last save; 0 = not by time
  int64_t keep = 3;            // newest committed checkpoints kept
  int64_t keep_every = 0;      // also keep every checkpoint whose step is a multiple of N; 0 = none
  std::string verify = "full"; // before a load: "full" checks every file's checksum, "off" its size only
  std::string retention_verify = "sizes";  // what retention counts as a good checkpoint: "sizes" | "full" (checksums)
  std::string init_from = "";  // when the run has no checkpoint that loads: "" fails if any exists, "none" starts at step 0, a checkpoint directory, or "hf:DIR": step 0 from a Hugging Face model directory's weights
  bool o_direct = true;        // bulk writes bypass the page cache where the filesystem allows it
  double timeout_s = 600;      // how long rank 0 waits for every rank's file before abandoning a save
  // In-memory snapshots held by keeld (docs/architecture.md "In-memory
  // snapshots"): after every N steps; 0 = none; -1 = as often as keeps
  // their stall within memory_stall_budget of the step time. keeld gives
  // each rank its area (KEEL_SNAPSHOT_FD) unless this is 0.
  int64_t memory_every_steps = -1;
  int64_t memory_keep = 2;     // newest in-memory snapshots kept per rank
  double memory_stall_budget = 0.02;  // memory_every_steps = -1: the share of the step time snapshots may take
  // With cluster.etcd: each rank's newest snapshot is also copied to the
  // next node's keeld, so that a node lost restores from memory too.
  bool memory_buddy = true;
  double memory_buddy_mb_per_s = 1000;  // the pace of those copies, per node; 0 = unpaced

  template <class V> void visit(V& v) {
    v("dir", dir);
    v("every_steps", every_steps);
    v("every_seconds", every_seconds);
    v("keep", keep);
    v("keep_every", keep_every);
    v("verify", verify);
    v("retention_verify", retention_verify);
    v("init_from", init_from);
    v("o_direct", o_direct);
    v("timeout_s", timeout_s);
    v("memory_every_steps", memory_every_steps);
    v("memory_keep", memory_keep);
    v("memory_stall_budget", memory_stall_budget);
    v("memory_buddy", memory_buddy);
    v("memory_buddy_mb_per_s", memory_buddy_mb_per_s);
  }
};

// keeld (docs/architecture.md "Daemon"). The trainer reads this section too (it is one file)
// but uses none of it.
struct DaemonConfig {
  std::string socket = "/run/keel/keeld.sock";  // control socket; relative to the config file
  std::string control_group = "";  // members of this group may use the socket (root and keeld's user always may)
  int64_t max_message_bytes = 65536;  // a longer control request is refused
  double client_timeout_s = 10;    // a control connection idle this long is closed
  int64_t metrics_port = 9400;     // Prometheus text on 127.0.0.1:PORT/metrics; 0 = any free port; -1 = off
  std::string trainer = "";        // keel-trainer to run; empty = the one installed beside keeld
  int64_t ranks = 0;               // ranks on this node; 0 = dp x tp x pp x cp (one node); required with cluster.etcd
  bool pin_cpus = true;            // give each rank its own share of keeld's CPUs and set its thread counts
  double grace_s = 30;             // after SIGTERM, ranks of a failed generation get this long before SIGKILL
  double stop_timeout_s = 900;     // a stop waits this long for the final checkpoint before SIGKILL
  double restart_backoff_s = 1;    // first delay before a restart; doubles per failed generation
  double restart_backoff_max_s = 60;  // the delay never grows past this
  int64_t crash_loop_generations = 3;  // this many generations in a row without a new checkpoint fail the job
  double stale_after_s = 60;       // a running rank whose board is older than this shows health "stale"
  double progress_every_s = 10;    // keeld logs a progress line this often

  template <class V> void visit(V& v) {
    v("socket", socket);
    v("control_group", control_group);
    v("max_message_bytes", max_message_bytes);
    v("client_timeout_s", client_timeout_s);
    v("metrics_port", metrics_port);
    v("trainer", trainer);
    v("ranks", ranks);
    v("pin_cpus", pin_cpus);
    v("grace_s", grace_s);
    v("stop_timeout_s", stop_timeout_s);
    v("restart_backoff_s", restart_backoff_s);
    v("restart_backoff_max_s", restart_backoff_max_s);
    v("crash_loop_generations", crash_loop_generations);
    v("stale_after_s", stale_after_s);
    v("progress_every_s", progress_every_s);
  }
};

// Many nodes as one job (docs/architecture.md "Multi-node on etcd"). keeld
// reads it; with `etcd` empty the job runs on one node, as before. The
// parallel layout describes the job on max_nodes nodes; on fewer, DP
// shrinks and the global batch stays (cluster/elastic_layout.h).
struct ClusterConfig {
  std::string etcd = "";           // etcd://h:p[,h:p...]/PREFIX, the job's own prefix; empty = one node, embedded store
  std::string node_name = "";      // this node's name in the job, unique among its nodes; empty = the host name
  std::string address = "127.0.0.1";  // what this node's ranks bind and advertise for Gloo and NCCL
  int64_t snapshot_port = 0;        // keeld takes the snapshot copies of its buddy on address:PORT; 0 = any free port
  int64_t min_nodes = 0;           // fewest nodes the job trains on; 0 = max_nodes (no shrinking)
  int64_t max_nodes = 0;           // nodes of the full layout: dp x tp x pp x cp / daemon.ranks; 0 = that
  double join_timeout_s = 60;      // a rendezvous waits this long for max_nodes before sealing with fewer
  double lease_ttl_s = 5;          // a node silent this long (dead, or cut off from etcd) is out of the job
  std::string credential_file = "";  // a file holding USER:PASSWORD for etcd's auth; empty = auth off
  // etcd over TLS (its client URLs are https): the CA that signed etcd's
  // certificates; empty = plain HTTP. A client certificate and its key,
  // for etcd's --client-cert-auth, go with it or not at all.
  std::string tls_ca_file = "";
  std::string tls_cert_file = "";
  std::string tls_key_file = "";
  // Axes among "tp,cp,ep" whose groups may span nodes (cluster/placement.h);
  // empty = none: their collectives run every layer and belong on a node's fast links.
  std::string cross_node_axes = "";

  template <class V> void visit(V& v) {
    v("etcd", etcd);
    v("node_name", node_name);
    v("address", address);
    v("snapshot_port", snapshot_port);
    v("min_nodes", min_nodes);
    v("max_nodes", max_nodes);
    v("join_timeout_s", join_timeout_s);
    v("lease_ttl_s", lease_ttl_s);
    v("credential_file", credential_file);
    v("tls_ca_file", tls_ca_file);
    v("tls_cert_file", tls_cert_file);
    v("tls_key_file", tls_key_file);
    v("cross_node_axes", cross_node_axes);
  }
};

// The detectors (docs/architecture.md "Health"). keeld runs the hang and
// straggler detectors and compares replica digests from the boards; the
// ranks run the rerun and the known-answer tests.
struct HealthConfig {
  double heartbeat_timeout_s = 10;      // a rank whose heartbeat is older than this is frozen (stopped, not waiting)
  double hang_timeout_floor_s = 30;     // a learned collective or phase budget is never shorter
  // Nor longer; before warm-up, and for a phase never seen, the budget is
  // this. Below parallel.timeout_s (120), so that keeld names a hang's
  // culprit before the waiting ranks' own timeout ends the generation.
  double hang_timeout_ceiling_s = 100;
  int64_t hang_warmup_steps = 20;       // steps observed before budgets are learned
  double hang_timeout_multiple = 5;     // a budget is this multiple of the 99th percentile of observed durations
  int64_t sdc_digest_every = 10;        // replica digests every N steps; 0 = off
  double sdc_kat_every_s = 600;         // known-answer kernel tests at start and this often; 0 = at start only
  bool sdc_rerun = true;                // re-run a step whose loss or gradient norm is anomalous before applying it
  // Robust z-score (median, MAD of the recent window) that makes a step
  // anomalous: twice the largest a fault-free run scored (docs/architecture.md "Health").
  double sdc_anomaly_z = 20;
  // Steps of loss, gradient-norm and activation history after
  // train.warmup_steps for that score; nothing is scored until it is full.
  int64_t sdc_anomaly_window = 50;
  // A re-run step that came out the same (a loss spike, not corruption):
  // "apply" trains on it (clipped as ever), "skip" drops its update.
  std::string spike_policy = "apply";
  std::string sdc_policy = "restart";   // on a rank-attributed SDC: "warn" | "restart" (roll back to the newest checkpoint before it) | "exclude"
  int64_t straggler_window = 10;        // steps per window of the stragglers table's score and of relearning the noise
  double straggler_threshold = 0.04;    // slowness against the median rank that gathers no evidence (why: health/straggler_monitor.h)
  int64_t straggler_false_alarm_steps = 1'000'000;  // steps of the whole job per false flag that the ranks' noise allows, about

  template <class V> void visit(V& v) {
    v("heartbeat_timeout_s", heartbeat_timeout_s);
    v("hang_timeout_floor_s", hang_timeout_floor_s);
    v("hang_timeout_ceiling_s", hang_timeout_ceiling_s);
    v("hang_warmup_steps", hang_warmup_steps);
    v("hang_timeout_multiple", hang_timeout_multiple);
    v("sdc_digest_every", sdc_digest_every);
    v("sdc_kat_every_s", sdc_kat_every_s);
    v("sdc_rerun", sdc_rerun);
    v("sdc_anomaly_z", sdc_anomaly_z);
    v("sdc_anomaly_window", sdc_anomaly_window);
    v("spike_policy", spike_policy);
    v("sdc_policy", sdc_policy);
    v("straggler_window", straggler_window);
    v("straggler_threshold", straggler_threshold);
    v("straggler_false_alarm_steps", straggler_false_alarm_steps);
  }
};

// Fault injection for game days (docs/architecture.md "Health"): inert
// unless configured. A crash kills the rank with SIGKILL, as the kernel's
// OOM killer or a lost node would. Every other fault fires in generation
// fault_generation only, so the restarted generation runs clean.
struct FaultsConfig {
  int64_t crash_rank = -1;        // the rank to kill; -1 = none
  int64_t crash_step = 0;         // killed just before training this step
  int64_t crash_generation = 0;   // only in this generation; -1 = in every generation (a crash loop)
  // "step": before training crash_step; "save": writing the checkpoint of
  // step crash_step, before reporting it; "snapshot": halfway through
  // copying the in-memory snapshot of step crash_step
  std::string crash_in = "step";
  int64_t fault_generation = 0;   // the generation the faults below fire in; -1 = every generation
  int64_t nan_rank = -1;          // the rank whose step turns non-finite; -1 = none
  int64_t nan_step = 0;           // at this step
  std::string nan_target = "gradient";  // what turns NaN: "gradient" (one element) | "loss"
  // Every rank scales its share of this step's loss (and so the gradient)
  // by loss_spike_factor, in each computation of the step: a spike that a
  // rerun reproduces. -1 = none.
  int64_t loss_spike_step = -1;
  double loss_spike_factor = 100;
  int64_t hang_rank = -1;         // the rank that stops inside its next collective of hang_group and never returns; -1 = none
  int64_t hang_step = 0;          // from this step on
  std::string hang_group = "dp";  // the mesh axis of that collective: "dp" | "tp" | ...
  int64_t slow_rank = -1;         // the rank whose compute is slowed; -1 = none
  double slow_factor = 1.0;       // its compute takes this many times as long
  // What of the slow rank is slowed: "compute" (forward and backward, by
  // slow_factor), or each "checkpoint" save (the part training waits for)
  // or "validation" pass, which stalls for slow_stall_s: a phase a hang
  // detector must not mistake for a hang. The stall is absolute, not a
  // multiple of a step, so that a loaded machine cannot stretch it past the
  // phase's budget.
  std::string slow_phase = "compute";
  double slow_stall_s = 0;        // with slow_phase "checkpoint" or "validation"; 0 = off
  int64_t bitflip_rank = -1;      // the rank where one bit of one float32 flips; -1 = none
  int64_t bitflip_step = 0;       // during this step
  // "param" | "exp_avg" | "exp_avg_sq" (persistent) | "grad" | "activation"
  // (transient) | "blas_core" (the known-answer test that proves a BLAS
  // core keel chose gets one wrong GEMM output, at start, on bitflip_rank)
  std::string bitflip_target = "param";
  std::string bitflip_tensor = "";       // the tensor (e.g. "h.0.mlp.c_fc.weight"); empty = one chosen from the step
  int64_t bitflip_bit = 22;       // 0-22 mantissa (22, the highest, is silent), 23-30 exponent, 31 sign
  // "write_error" | "corrupt" (a byte flipped after its checksum) |
  // "disk_full" | "snapshot_corrupt" (a byte of the in-memory snapshot of
  // checkpoint_fault_step flipped after its checksum); empty = none
  std::string checkpoint_fault = "";
  int64_t checkpoint_fault_rank = 0;  // the rank whose file fails
  int64_t checkpoint_fault_step = 0;  // the checkpoint of this step; 0 = the first one saved

  template <class V> void visit(V& v) {
    v("crash_rank", crash_rank);
    v("crash_step", crash_step);
    v("crash_generation", crash_generation);
    v("crash_in", crash_in);
    v("fault_generation", fault_generation);
    v("nan_rank", nan_rank);
    v("nan_step", nan_step);
    v("nan_target", nan_target);
    v("loss_spike_step", loss_spike_step);
    v("loss_spike_factor", loss_spike_factor);
    v("hang_rank", hang_rank);
    v("hang_step", hang_step);
    v("hang_group", hang_group);
    v("slow_rank", slow_rank);
    v("slow_factor", slow_factor);
    v("slow_phase", slow_phase);
    v("slow_stall_s", slow_stall_s);
    v("bitflip_rank", bitflip_rank);
    v("bitflip_step", bitflip_step);
    v("bitflip_target", bitflip_target);
    v("bitflip_tensor", bitflip_tensor);
    v("bitflip_bit", bitflip_bit);
    v("checkpoint_fault", checkpoint_fault);
    v("checkpoint_fault_rank", checkpoint_fault_rank);
    v("checkpoint_fault_step", checkpoint_fault_step);
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
  DaemonConfig daemon;
  ClusterConfig cluster;
  HealthConfig health;
  FaultsConfig faults;

  // checkpoint.dir, or run_dir/checkpoints when it is empty.
  std::filesystem::path checkpoint_dir() const;
  // Whether keeld runs this job on many nodes (cluster.etcd is set).
  bool multi_node() const { return !cluster.etcd.empty(); }
  // The ranks one keeld runs: daemon.ranks on many nodes, the whole layout on one.
  int64_t node_ranks() const { return multi_node() ? daemon.ranks : parallel.world_size(); }
  // The nodes of the full layout: cluster.max_nodes, or the layout's ranks
  // over daemon.ranks; 1 on one node.
  int64_t max_nodes() const;
  // The fewest nodes the job trains on: cluster.min_nodes, or max_nodes().
  int64_t min_nodes() const;

  template <class V> void visit(V& v) {
    v.section("job", job);
    v.section("model", model);
    v.section("data", data);
    v.section("parallel", parallel);
    v.section("train", train);
    v.section("checkpoint", checkpoint);
    v.section("daemon", daemon);
    v.section("cluster", cluster);
    v.section("health", health);
    v.section("faults", faults);
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
