#include "common/config.h"

#include "common/blas_core.h"
#include "common/error.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <fstream>
#include <set>
#include <sstream>
#include <type_traits>

namespace keel::common {
namespace {

// The weight of a blend entry ("0.7 web/prefix"): text that is a number
// and nothing else.
std::optional<double> parse_weight(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return std::nullopt;
  return value;
}

// A data.train entry: "PATH", or "WEIGHT PATH" (weight_text as written).
struct SourceEntry {
  std::optional<double> weight;
  std::string weight_text;
  std::string path;  // empty when a weight names no path
};
SourceEntry split_source(const std::string& entry) {
  const auto space = entry.find_first_of(" \t");
  const auto weight = space == std::string::npos ? std::nullopt : parse_weight(entry.substr(0, space));
  if (!weight) return {std::nullopt, "", entry};
  const auto path = entry.find_first_not_of(" \t", space);
  return {weight, entry.substr(0, space), path == std::string::npos ? "" : entry.substr(path)};
}

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw Error(ErrorCode::kBadConfig, fmt::format("{}: {}", where, what));
}

template <class T> const char* type_name() {
  if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  if constexpr (std::is_same_v<T, double>) return "a number";
  if constexpr (std::is_same_v<T, bool>) return "true or false";
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a string or a list of strings";
}

const char* toml_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    default: return "a date or time";
  }
}

// Converts a TOML node to a field's type, or returns false when the types
// do not fit. Integers are accepted where a float is expected (lr = 1).
template <class T> bool convert(const toml::node& node, T& out) {
  if constexpr (std::is_same_v<T, int64_t>) {
    if (auto v = node.as_integer()) { out = v->get(); return true; }
  } else if constexpr (std::is_same_v<T, double>) {
    if (auto v = node.as_floating_point()) { out = v->get(); return true; }
    if (auto v = node.as_integer()) { out = static_cast<double>(v->get()); return true; }
  } else if constexpr (std::is_same_v<T, bool>) {
    if (auto v = node.as_boolean()) { out = v->get(); return true; }
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (auto v = node.as_string()) { out = v->get(); return true; }
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    // One string is a list of one.
    if (auto v = node.as_string()) { out = {v->get()}; return true; }
    const toml::array* items = node.as_array();
    if (items == nullptr) return false;
    std::vector<std::string> values;
    for (const auto& item : *items) {
      auto v = item.as_string();
      if (v == nullptr) return false;
      values.push_back(v->get());
    }
    out = std::move(values);
    return true;
  }
  return false;
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out;
}

// Collects the section and field names, for "known keys" hints.
struct KeyLister {
  std::vector<std::string> sections;
  std::map<std::string, std::vector<std::string>> keys;
  std::string current;
  template <class S> void section(const char* name, S& s) {
    sections.emplace_back(name);
    current = name;
    s.visit(*this);
  }
  template <class T> void operator()(const char* key, T&) { keys[current].emplace_back(key); }
};

// Reads every known field from a parsed TOML table.
struct TableReader {
  TableReader(const toml::table& r, const std::string& s, std::map<std::string, std::string>& o)
      : root(r), source(s), origins(o) {}
  const toml::table& root;
  const std::string& source;
  std::map<std::string, std::string>& origins;
  const toml::table* table = nullptr;
  std::string section_name;

  std::string where(const toml::node& node) const {
    return fmt::format("{}:{}", source, node.source().begin.line);
  }

  template <class S> void section(const char* name, S& s) {
    const toml::node* node = root.get(name);
    if (node == nullptr) return;
    if (!node->is_table()) fail(where(*node), fmt::format("[{}] must be a table, not {}", name, toml_type_name(*node)));
    table = node->as_table();
    section_name = name;
    s.visit(*this);
  }

  template <class T> void operator()(const char* key, T& field) {
    const toml::node* node = table->get(key);
    if (node == nullptr) return;
    if (!convert(*node, field)) {
      fail(where(*node), fmt::format("[{}] {} must be {}, not {}", section_name, key, type_name<T>(), toml_type_name(*node)));
    }
    origins[section_name + "." + key] = where(*node);
  }
};

// Applies one --set override to the field it names.
struct OverrideSetter {
  std::string section_name, key, value, text;
  bool found = false;
  std::string current;

  template <class S> void section(const char* name, S& s) {
    current = name;
    if (current == section_name) s.visit(*this);
  }

  template <class T> void operator()(const char* field_key, T& field) {
    if (key != field_key) return;
    found = true;
    try {
      toml::table parsed = toml::parse("v = " + value);
      if (const toml::node* node = parsed.get("v"); node != nullptr && convert(*node, field)) return;
    } catch (const toml::parse_error&) {
      // Not a TOML value: only a string field takes the raw text.
    }
    if constexpr (std::is_same_v<T, std::string>) {
      field = value;  // a bare string: --set job.run_dir=/tmp/run
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      field = {value};  // --set data.train=/data/train_*.bin
    } else {
      fail("--set " + text, fmt::format("{}.{} must be {}", section_name, key, type_name<T>()));
    }
  }
};

struct TomlWriter {
  toml::table root;
  toml::table* table = nullptr;
  template <class S> void section(const char* name, S& s) {
    root.insert(name, toml::table{});
    table = root.get(name)->as_table();
    s.visit(*this);
  }
  template <class T> void operator()(const char* key, const T& field) {
    if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      toml::array items;
      for (const auto& s : field) items.push_back(s);
      table->insert(key, std::move(items));
    } else {
      table->insert(key, field);
    }
  }
};

struct JsonWriter {
  nlohmann::json root = nlohmann::json::object();
  std::string current;
  template <class S> void section(const char* name, S& s) {
    current = name;
    root[current] = nlohmann::json::object();
    s.visit(*this);
  }
  template <class T> void operator()(const char* key, const T& field) { root[current][key] = field; }
};

void check_unknown_keys(const toml::table& root, const std::string& source) {
  Config defaults;
  KeyLister lister;
  defaults.visit(lister);
  for (const auto& [name, node] : root) {
    std::string section(name.str());
    auto known = lister.keys.find(section);
    if (known == lister.keys.end()) {
      fail(fmt::format("{}:{}", source, node.source().begin.line),
           fmt::format("unknown section [{}]; known sections: {}", section, join_keys(lister.sections)));
    }
    if (!node.is_table()) continue;  // TableReader reports the type error
    for (const auto& [key_name, value] : *node.as_table()) {
      std::string key(key_name.str());
      const auto& keys = known->second;
      if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
        fail(fmt::format("{}:{}", source, value.source().begin.line),
             fmt::format("unknown key '{}' in [{}]; known keys: {}", key, section, join_keys(keys)));
      }
    }
  }
}

void apply_override(Config& config, const std::string& text, std::map<std::string, std::string>& origins) {
  auto eq = text.find('=');
  auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
    fail("--set " + text, "expected section.key=value, e.g. --set train.lr=3e-4");
  }
  OverrideSetter setter;
  setter.section_name = text.substr(0, dot);
  setter.key = text.substr(dot + 1, eq - dot - 1);
  setter.value = text.substr(eq + 1);
  setter.text = text;
  config.visit(setter);
  if (!setter.found) {
    KeyLister lister;
    config.visit(lister);
    auto known = lister.keys.find(setter.section_name);
    fail("--set " + text, known == lister.keys.end()
                              ? fmt::format("unknown section [{}]; known sections: {}", setter.section_name, join_keys(lister.sections))
                              : fmt::format("unknown key '{}' in [{}]; known keys: {}", setter.key, setter.section_name, join_keys(known->second)));
  }
  origins[setter.section_name + "." + setter.key] = "--set " + text;
}

// Relative paths in the file are relative to the file; on the command line,
// to the working directory.
void resolve_path(std::string& value, const std::string& origin, const std::filesystem::path& base_dir) {
  if (value.empty() || std::filesystem::path(value).is_absolute()) return;
  // A config named without a directory ("run.toml") lives in the working directory.
  std::filesystem::path base =
      origin.starts_with("--set") || base_dir.empty() ? std::filesystem::current_path() : base_dir;
  value = (std::filesystem::absolute(base) / value).lexically_normal().string();
}

}  // namespace

Config Config::parse(std::string_view toml_text, const std::string& source_name,
                     const std::filesystem::path& base_dir, const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    fail(fmt::format("{}:{}", source_name, e.source().begin.line),
         fmt::format("not valid TOML: {}", e.description()));
  }
  check_unknown_keys(root, source_name);

  Config config;
  TableReader reader(root, source_name, config.origins_);
  config.visit(reader);
  for (const auto& text : overrides) apply_override(config, text, config.origins_);

  resolve_path(config.job.run_dir, config.origin("job.run_dir"), base_dir);
  for (auto& entry : config.data.train) {
    // The path of "WEIGHT PATH" resolves; the weight stays as written.
    auto source = split_source(entry);
    if (source.path.empty()) continue;  // validate() names the entry with no path
    resolve_path(source.path, config.origin("data.train"), base_dir);
    entry = source.weight ? source.weight_text + " " + source.path : source.path;
  }
  resolve_path(config.data.val, config.origin("data.val"), base_dir);
  resolve_path(config.checkpoint.dir, config.origin("checkpoint.dir"), base_dir);
  if (auto& from = config.checkpoint.init_from; from.starts_with(CheckpointConfig::kHfPrefix)) {
    std::string dir = from.substr(CheckpointConfig::kHfPrefix.size());
    resolve_path(dir, config.origin("checkpoint.init_from"), base_dir);
    from = std::string(CheckpointConfig::kHfPrefix) + dir;
  } else if (from != "none") {
    resolve_path(from, config.origin("checkpoint.init_from"), base_dir);
  }
  resolve_path(config.daemon.socket, config.origin("daemon.socket"), base_dir);
  resolve_path(config.daemon.trainer, config.origin("daemon.trainer"), base_dir);
  resolve_path(config.cluster.credential_file, config.origin("cluster.credential_file"), base_dir);
  resolve_path(config.cluster.tls_ca_file, config.origin("cluster.tls_ca_file"), base_dir);
  resolve_path(config.cluster.tls_cert_file, config.origin("cluster.tls_cert_file"), base_dir);
  resolve_path(config.cluster.tls_key_file, config.origin("cluster.tls_key_file"), base_dir);
  config.validate();
  return config;
}

Config Config::load(const std::filesystem::path& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) fail(path.string(), "cannot open the config file; check the path given to --config");
  std::stringstream text;
  text << in.rdbuf();
  return parse(text.str(), path.string(), path.parent_path(), overrides);
}

std::vector<DataSource> DataConfig::train_sources() const {
  std::vector<DataSource> sources;
  for (const auto& entry : train) {
    auto source = split_source(entry);
    sources.push_back({source.weight.value_or(1.0), source.weight.has_value(), std::move(source.path)});
  }
  return sources;
}

int64_t ModelConfig::mlp_width() const {
  if (!llama()) return 4 * n_embd;
  if (ffn_hidden > 0) return ffn_hidden;
  // Meta's FeedForward without ffn_dim_multiplier (docs/research/llama3.md
  // section 2): the true 1B and 8B shapes set ffn_hidden instead.
  constexpr int64_t kMultipleOf = 256;
  const int64_t hidden = 2 * 4 * n_embd / 3;
  return (hidden + kMultipleOf - 1) / kMultipleOf * kMultipleOf;
}

std::filesystem::path Config::checkpoint_dir() const {
  return checkpoint.dir.empty() ? std::filesystem::path(job.run_dir) / "checkpoints"
                                : std::filesystem::path(checkpoint.dir);
}

int64_t Config::max_nodes() const {
  if (!multi_node() || daemon.ranks <= 0) return 1;
  return cluster.max_nodes > 0 ? cluster.max_nodes : parallel.world_size() / daemon.ranks;
}

int64_t Config::min_nodes() const { return cluster.min_nodes > 0 ? cluster.min_nodes : max_nodes(); }

std::string Config::origin(const std::string& dotted_key) const {
  auto it = origins_.find(dotted_key);
  return it == origins_.end() ? std::string("default") : it->second;
}

void Config::validate() const {
  auto check = [this](bool ok, const char* key, const std::string& what) {
    if (!ok) fail(fmt::format("{} ({})", origin(key), key), what);
  };
  auto at_least = [&](int64_t value, int64_t min, const char* key) {
    check(value >= min, key, fmt::format("must be at least {} (got {})", min, value));
  };

  check(!job.name.empty(), "job.name", "must not be empty");
  check(!job.run_dir.empty(), "job.run_dir", "must name a directory for metrics and checkpoints");
  check(job.seed >= 0, "job.seed", fmt::format("must be non-negative (got {})", job.seed));

  // Token ids travel as int32, and the padded embedding's rows must too.
  constexpr int64_t kMaxVocab = int64_t{1} << 30;
  check(model.vocab_size >= 2 && model.vocab_size <= kMaxVocab, "model.vocab_size",
        fmt::format("must be in [2, {}] (token ids are int32; past 65536 the data must be llm.c's Llama 3 shards "
                    "of uint32 tokens) (got {})",
                    kMaxVocab, model.vocab_size));
  at_least(model.seq_len, 1, "model.seq_len");
  at_least(model.n_layer, 1, "model.n_layer");
  at_least(model.n_head, 1, "model.n_head");
  at_least(model.n_embd, 1, "model.n_embd");
  check(model.n_embd % model.n_head == 0, "model.n_head",
        fmt::format("n_head={} does not divide n_embd={}; pick a head count that divides the width", model.n_head, model.n_embd));
  check(model.arch == "gpt2" || model.llama(), "model.arch",
        fmt::format("must be \"gpt2\" or \"llama\" (got \"{}\")", model.arch));
  if (model.llama()) {
    at_least(model.n_kv_head, 0, "model.n_kv_head");
    check(model.n_kv_head == 0 || model.n_head % model.n_kv_head == 0, "model.n_kv_head",
          fmt::format("n_kv_head={} does not divide n_head={}: each key/value head serves a whole group of query "
                      "heads, so pick a divisor of {}",
                      model.n_kv_head, model.n_head, model.n_head));
    check(model.n_head <= 0 || model.n_embd % model.n_head != 0 || model.head_dim() % 2 == 0, "model.n_head",
          fmt::format("gives heads of n_embd / n_head = {} channels, and rotary positions turn pairs of channels; "
                      "pick a head count that gives an even head size",
                      model.n_head > 0 ? model.head_dim() : 0));
    at_least(model.ffn_hidden, 0, "model.ffn_hidden");
    check(model.rope_theta >= 0, "model.rope_theta",
          fmt::format("must be positive, or 0 for Llama 3's 500000 (got {})", model.rope_theta));
    check(model.norm_eps >= 0 && model.norm_eps < 1, "model.norm_eps",
          fmt::format("must be in (0, 1), or 0 for 1e-5 (got {})", model.norm_eps));
    check(model.rope_scaling_factor == 0 || model.rope_scaling_factor >= 1, "model.rope_scaling_factor",
          fmt::format("must be at least 1 (Llama 3.1: 8, Llama 3.2: 32), or 0 for no scaling (got {})",
                      model.rope_scaling_factor));
    check(model.rope_low_freq_factor >= 0, "model.rope_low_freq_factor",
          fmt::format("must be positive, or 0 for 1 (got {})", model.rope_low_freq_factor));
    check(model.rope_high_freq_factor >= 0, "model.rope_high_freq_factor",
          fmt::format("must be positive, or 0 for 4 (got {})", model.rope_high_freq_factor));
    check(model.rope_high_freq() > model.rope_low_freq(),
          "model.rope_high_freq_factor", "must exceed rope_low_freq_factor: they bound the band of wavelengths "
                                         "that is scaled in part");
    at_least(model.rope_original_context, 0, "model.rope_original_context");
  } else {
    // GPT-2's parts are fixed; a Llama key here is a mistake, not a no-op.
    for (const auto& [value, key] : {std::pair{static_cast<double>(model.n_kv_head), "model.n_kv_head"},
                                     {static_cast<double>(model.ffn_hidden), "model.ffn_hidden"},
                                     {model.rope_theta, "model.rope_theta"},
                                     {model.norm_eps, "model.norm_eps"},
                                     {model.rope_scaling_factor, "model.rope_scaling_factor"},
                                     {model.rope_low_freq_factor, "model.rope_low_freq_factor"},
                                     {model.rope_high_freq_factor, "model.rope_high_freq_factor"},
                                     {static_cast<double>(model.rope_original_context), "model.rope_original_context"}}) {
      check(value == 0, key, "applies to Llama models only; set model.arch = \"llama\" or leave the key out");
    }
  }
  at_least(model.n_expert, 0, "model.n_expert");
  if (model.n_expert > 0) {
    check(model.top_k >= 1 && model.top_k <= model.n_expert, "model.top_k",
          fmt::format("must be in [1, n_expert={}] (got {})", model.n_expert, model.top_k));
    check(model.moe_every >= 1 && model.moe_every <= model.n_layer, "model.moe_every",
          fmt::format("must be in [1, n_layer={}] so that at least one block is MoE (got {})", model.n_layer, model.moe_every));
    check(model.aux_loss_coef >= 0, "model.aux_loss_coef", "must be non-negative");
  }

  check(!data.train.empty(), "data.train", "must name the training shards, e.g. train = \"data/train_*.bin\"");
  const auto sources = data.train_sources();
  double total_weight = 0;
  for (const auto& s : sources) {
    check(!s.path.empty(), "data.train", "an entry names no data: write PATH, or WEIGHT PATH in a blend");
    check(sources.size() == 1 || s.weighted, "data.train",
          fmt::format("\"{}\" has no weight: in a blend every source is \"WEIGHT PATH\", e.g. \"0.3 {}\"", s.path,
                      s.path));
    check(std::isfinite(s.weight) && s.weight > 0, "data.train",
          fmt::format("the weight of {} is {}: weights are positive", s.path, s.weight));
    total_weight += s.weight;
  }
  check(std::fabs(total_weight - 1) <= 1e-6, "data.train",
        fmt::format("the weights add up to {:.6g}, not 1: give each source its share of the samples", total_weight));

  for (auto [value, key] : {std::pair{parallel.dp, "parallel.dp"}, {parallel.tp, "parallel.tp"}, {parallel.pp, "parallel.pp"},
                            {parallel.cp, "parallel.cp"}, {parallel.ep, "parallel.ep"}, {parallel.micro_batches, "parallel.micro_batches"}}) {
    at_least(value, 1, key);
  }
  check(parallel.zero >= 0 && parallel.zero <= 3, "parallel.zero", fmt::format("must be a ZeRO stage 0-3 (got {})", parallel.zero));
  check(parallel.timeout_s > 0, "parallel.timeout_s", fmt::format("must be positive (got {})", parallel.timeout_s));

  at_least(checkpoint.every_steps, 0, "checkpoint.every_steps");
  check(checkpoint.every_seconds >= 0, "checkpoint.every_seconds",
        fmt::format("must be non-negative; 0 disables saving by time (got {})", checkpoint.every_seconds));
  at_least(checkpoint.keep, 1, "checkpoint.keep");
  at_least(checkpoint.keep_every, 0, "checkpoint.keep_every");
  at_least(checkpoint.memory_every_steps, -1, "checkpoint.memory_every_steps");
  check(checkpoint.memory_stall_budget > 0 && checkpoint.memory_stall_budget < 1, "checkpoint.memory_stall_budget",
        fmt::format("must be above 0 and below 1, a share of the step time (got {})", checkpoint.memory_stall_budget));
  // An area holds at most 64 slots (checkpoint/memory_snapshot.cpp): the
  // kept ones, the one written and the buddy copy's two copy steps.
  check(checkpoint.memory_keep >= 1 && checkpoint.memory_keep <= 61, "checkpoint.memory_keep",
        fmt::format("must be 1 to 61 in-memory snapshots kept a rank (got {})", checkpoint.memory_keep));
  check(checkpoint.memory_buddy_mb_per_s >= 0, "checkpoint.memory_buddy_mb_per_s",
        fmt::format("must be 0 (unpaced) or a positive rate in MB/s (got {})", checkpoint.memory_buddy_mb_per_s));
  check(checkpoint.verify == "full" || checkpoint.verify == "off", "checkpoint.verify",
        fmt::format("must be \"full\" or \"off\" (got \"{}\")", checkpoint.verify));
  check(checkpoint.init_from != CheckpointConfig::kHfPrefix, "checkpoint.init_from",
        "\"hf:\" names no directory: write hf:DIR, DIR holding a Hugging Face model's config.json and safetensors");
  check(faults.crash_in == "step" || faults.crash_in == "save" || faults.crash_in == "snapshot", "faults.crash_in",
        fmt::format("must be \"step\", \"save\" or \"snapshot\" (got \"{}\")", faults.crash_in));
  check(faults.nan_target == "gradient" || faults.nan_target == "loss", "faults.nan_target",
        fmt::format("must be \"gradient\" or \"loss\" (got \"{}\")", faults.nan_target));
  at_least(faults.loss_spike_step, -1, "faults.loss_spike_step");
  check(std::isfinite(faults.loss_spike_factor) && faults.loss_spike_factor > 0, "faults.loss_spike_factor",
        fmt::format("must be a positive number (got {})", faults.loss_spike_factor));
  check(checkpoint.retention_verify == "sizes" || checkpoint.retention_verify == "full", "checkpoint.retention_verify",
        fmt::format("must be \"sizes\" or \"full\" (got \"{}\")", checkpoint.retention_verify));
  check(checkpoint.timeout_s > 0, "checkpoint.timeout_s", fmt::format("must be positive (got {})", checkpoint.timeout_s));

  at_least(train.steps, 1, "train.steps");
  at_least(train.batch_size, 1, "train.batch_size");
  check(train.batch_size % (parallel.dp * parallel.micro_batches) == 0, "train.batch_size",
        fmt::format("batch_size={} must be divisible by dp x micro_batches = {} x {}", train.batch_size, parallel.dp,
                    parallel.micro_batches));
  check(train.lr > 0, "train.lr", fmt::format("must be positive (got {})", train.lr));
  check(train.min_lr_ratio >= 0 && train.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]");
  at_least(train.warmup_steps, 0, "train.warmup_steps");
  check(train.warmup_steps <= train.steps, "train.warmup_steps",
        fmt::format("warmup_steps={} exceeds steps={}; shorten the warmup", train.warmup_steps, train.steps));
  check(train.weight_decay >= 0, "train.weight_decay", "must be non-negative");
  check(train.beta1 >= 0 && train.beta1 < 1, "train.beta1", "must be in [0, 1)");
  check(train.beta2 >= 0 && train.beta2 < 1, "train.beta2", "must be in [0, 1)");
  check(train.eps > 0, "train.eps", "must be positive");
  check(train.grad_clip >= 0, "train.grad_clip", "must be non-negative (0 disables clipping)");
  at_least(train.val_every, 0, "train.val_every");
  at_least(train.val_batches, 1, "train.val_batches");
  at_least(train.log_every, 1, "train.log_every");
  at_least(train.threads, 0, "train.threads");
  check(train.device == "cpu" || train.device == "cuda", "train.device",
        fmt::format("must be \"cpu\" or \"cuda\" (got \"{}\")", train.device));
  check(train.blas_core == "auto" || train.blas_core == "library" || is_openblas_core(train.blas_core),
        "train.blas_core",
        fmt::format("must be \"auto\", \"library\" or an OpenBLAS x86-64 core such as \"Haswell\", \"SkylakeX\" or "
                    "\"Cooperlake\" (got \"{}\")",
                    train.blas_core));
  check(train.precision == "auto" || train.precision == "fp32" || train.precision == "bf16", "train.precision",
        fmt::format("must be \"auto\", \"fp32\" or \"bf16\" (got \"{}\")", train.precision));
  // trainer/kernels/cuda/attention.cu holds a head in registers, 8 floats a lane.
  check(train.device != "cuda" || model.n_head <= 0 || model.head_dim() <= 256, "model.n_head",
        fmt::format("gives heads of n_embd / n_head = {} channels, and the CUDA attention takes at most 256; use "
                    "more heads",
                    model.n_head > 0 ? model.head_dim() : 0));

  check(!daemon.socket.empty(), "daemon.socket", "must name the control socket, e.g. /run/keel/keeld.sock");
  // sockaddr_un holds 108 bytes with the terminating NUL.
  check(daemon.socket.size() < 108, "daemon.socket",
        fmt::format("is {} bytes long but a Unix socket path must be under 108; pick a shorter path",
                    daemon.socket.size()));
  at_least(daemon.max_message_bytes, 64, "daemon.max_message_bytes");
  check(daemon.client_timeout_s > 0, "daemon.client_timeout_s", "must be positive");
  check(daemon.metrics_port >= -1 && daemon.metrics_port <= 65535, "daemon.metrics_port",
        fmt::format("must be a TCP port, 0 for any free port or -1 for none (got {})", daemon.metrics_port));
  at_least(daemon.ranks, 0, "daemon.ranks");
  if (multi_node()) {
    check(cluster.etcd.starts_with("etcd://"), "cluster.etcd",
          fmt::format("must be an etcd address with the job's prefix, etcd://host:2379[,host:2379...]/keel/{} (got "
                      "\"{}\")",
                      job.name, cluster.etcd));
    check(cluster.etcd.find('?') == std::string::npos, "cluster.etcd",
          "takes no query: name etcd's TLS files with cluster.tls_ca_file, tls_cert_file and tls_key_file");
    check(daemon.ranks > 0, "daemon.ranks",
          "must name the ranks each node runs when cluster.etcd is set, e.g. ranks = 8 for a node of 8 GPUs");
    check(parallel.world_size() % daemon.ranks == 0, "daemon.ranks",
          fmt::format("ranks={} does not divide the layout's dp x tp x pp x cp = {} ranks into whole nodes",
                      daemon.ranks, parallel.world_size()));
    check(cluster.max_nodes == 0 || cluster.max_nodes * daemon.ranks == parallel.world_size(), "cluster.max_nodes",
          fmt::format("max_nodes={} nodes of daemon.ranks={} ranks are {} ranks, but the layout dp x tp x pp x cp "
                      "describes the job on max_nodes nodes: {} ranks; set max_nodes = {} or 0",
                      cluster.max_nodes, daemon.ranks, cluster.max_nodes * daemon.ranks, parallel.world_size(),
                      parallel.world_size() / daemon.ranks));
    at_least(cluster.min_nodes, 0, "cluster.min_nodes");
    check(cluster.min_nodes <= max_nodes(), "cluster.min_nodes",
          fmt::format("min_nodes={} exceeds the {} nodes of the full layout", cluster.min_nodes, max_nodes()));
    check(cluster.snapshot_port >= 0 && cluster.snapshot_port <= 65535, "cluster.snapshot_port",
          fmt::format("must be a TCP port, or 0 for any free port (got {})", cluster.snapshot_port));
    check(cluster.join_timeout_s > 0, "cluster.join_timeout_s",
          fmt::format("must be positive (got {})", cluster.join_timeout_s));
    // etcd grants no lease shorter than 2 s.
    check(cluster.lease_ttl_s >= 2, "cluster.lease_ttl_s",
          fmt::format("must be at least 2 s, etcd's shortest lease (got {})", cluster.lease_ttl_s));
    check(!cluster.address.empty(), "cluster.address",
          "must name this node's address on the network its ranks share, e.g. its InfiniBand interface's");
    check(cluster.tls_cert_file.empty() == cluster.tls_key_file.empty(),
          cluster.tls_cert_file.empty() ? "cluster.tls_cert_file" : "cluster.tls_key_file",
          "a client certificate goes with its key: set both tls_cert_file and tls_key_file, or neither");
    check(cluster.tls_cert_file.empty() || !cluster.tls_ca_file.empty(), "cluster.tls_ca_file",
          "must name the CA of etcd's certificates when tls_cert_file is set (a client certificate is sent over "
          "TLS only)");
  } else {
    check(daemon.ranks == 0 || daemon.ranks == parallel.world_size(), "daemon.ranks",
          fmt::format("ranks={} but one node runs the whole layout dp x tp x pp x cp = {}; set 0 or that number, or "
                      "set cluster.etcd to run the job on many nodes",
                      daemon.ranks, parallel.world_size()));
  }
  for (auto [value, key] : {std::pair{daemon.grace_s, "daemon.grace_s"}, {daemon.stop_timeout_s, "daemon.stop_timeout_s"},
                            {daemon.stale_after_s, "daemon.stale_after_s"},
                            {daemon.progress_every_s, "daemon.progress_every_s"}}) {
    check(value > 0, key, fmt::format("must be positive (got {})", value));
  }
  check(daemon.restart_backoff_s >= 0, "daemon.restart_backoff_s", "must be non-negative");
  check(daemon.restart_backoff_max_s >= daemon.restart_backoff_s, "daemon.restart_backoff_max_s",
        fmt::format("must be at least restart_backoff_s = {}", daemon.restart_backoff_s));
  at_least(daemon.crash_loop_generations, 1, "daemon.crash_loop_generations");

  at_least(faults.crash_rank, -1, "faults.crash_rank");
  at_least(faults.crash_step, 0, "faults.crash_step");
  at_least(faults.crash_generation, -1, "faults.crash_generation");
  at_least(faults.fault_generation, -1, "faults.fault_generation");
  for (auto [value, key] : {std::pair{faults.nan_rank, "faults.nan_rank"}, {faults.hang_rank, "faults.hang_rank"},
                            {faults.slow_rank, "faults.slow_rank"}, {faults.bitflip_rank, "faults.bitflip_rank"}}) {
    at_least(value, -1, key);
  }
  for (auto [value, key] : {std::pair{faults.nan_step, "faults.nan_step"}, {faults.hang_step, "faults.hang_step"},
                            {faults.bitflip_step, "faults.bitflip_step"},
                            {faults.checkpoint_fault_rank, "faults.checkpoint_fault_rank"},
                            {faults.checkpoint_fault_step, "faults.checkpoint_fault_step"}}) {
    at_least(value, 0, key);
  }
  check(faults.slow_phase == "compute" || faults.slow_phase == "checkpoint" || faults.slow_phase == "validation",
        "faults.slow_phase",
        fmt::format("must be \"compute\", \"checkpoint\" or \"validation\" (got \"{}\")", faults.slow_phase));
  check(faults.slow_factor >= 1.0, "faults.slow_factor",
        fmt::format("must be at least 1 (1 = not slowed; got {})", faults.slow_factor));
  check(std::isfinite(faults.slow_stall_s) && faults.slow_stall_s >= 0, "faults.slow_stall_s",
        fmt::format("must be a number of seconds, 0 or more (got {})", faults.slow_stall_s));
  check(faults.slow_phase == "compute" || faults.slow_factor == 1.0, "faults.slow_factor",
        fmt::format("slows compute only; a slowed {} stalls for faults.slow_stall_s instead", faults.slow_phase));
  check(faults.bitflip_bit >= 0 && faults.bitflip_bit <= 31, "faults.bitflip_bit",
        fmt::format("must be a bit of a float32, 0-31 (got {})", faults.bitflip_bit));
  check(faults.bitflip_target == "param" || faults.bitflip_target == "exp_avg" ||
            faults.bitflip_target == "exp_avg_sq" || faults.bitflip_target == "grad" ||
            faults.bitflip_target == "activation" || faults.bitflip_target == "blas_core",
        "faults.bitflip_target",
        fmt::format("must be \"param\", \"exp_avg\", \"exp_avg_sq\", \"grad\", \"activation\" or \"blas_core\" (got \"{}\")",
                    faults.bitflip_target));
  check(!faults.hang_group.empty(), "faults.hang_group", "must name a mesh axis, e.g. \"dp\" or \"tp\"");
  check(faults.checkpoint_fault.empty() || faults.checkpoint_fault == "write_error" ||
            faults.checkpoint_fault == "corrupt" || faults.checkpoint_fault == "disk_full" ||
            faults.checkpoint_fault == "snapshot_corrupt",
        "faults.checkpoint_fault",
        fmt::format("must be \"write_error\", \"corrupt\", \"disk_full\", \"snapshot_corrupt\" or empty (got \"{}\")",
                    faults.checkpoint_fault));

  for (auto [value, key] : {std::pair{health.heartbeat_timeout_s, "health.heartbeat_timeout_s"},
                            {health.hang_timeout_floor_s, "health.hang_timeout_floor_s"},
                            {health.hang_timeout_multiple, "health.hang_timeout_multiple"},
                            {health.sdc_anomaly_z, "health.sdc_anomaly_z"},
                            {health.straggler_threshold, "health.straggler_threshold"}}) {
    check(value > 0, key, fmt::format("must be positive (got {})", value));
  }
  check(health.hang_timeout_ceiling_s >= health.hang_timeout_floor_s, "health.hang_timeout_ceiling_s",
        fmt::format("must be at least hang_timeout_floor_s = {} (got {})", health.hang_timeout_floor_s,
                    health.hang_timeout_ceiling_s));
  at_least(health.hang_warmup_steps, 1, "health.hang_warmup_steps");
  at_least(health.sdc_digest_every, 0, "health.sdc_digest_every");
  check(health.sdc_kat_every_s >= 0, "health.sdc_kat_every_s", "must be non-negative; 0 tests at start only");
  at_least(health.sdc_anomaly_window, 8, "health.sdc_anomaly_window");
  check(health.sdc_policy == "warn" || health.sdc_policy == "restart" || health.sdc_policy == "exclude",
        "health.sdc_policy",
        fmt::format("must be \"warn\", \"restart\" or \"exclude\" (got \"{}\")", health.sdc_policy));
  check(health.spike_policy == "apply" || health.spike_policy == "skip", "health.spike_policy",
        fmt::format("must be \"apply\" or \"skip\" (got \"{}\")", health.spike_policy));
  at_least(health.straggler_window, 2, "health.straggler_window");
  at_least(health.straggler_false_alarm_steps, 1000, "health.straggler_false_alarm_steps");
}

std::string Config::to_toml() const {
  TomlWriter writer;
  Config copy = *this;  // visit() is shared with the readers, which need a mutable config
  copy.visit(writer);
  std::ostringstream out;
  out << writer.root;
  return out.str();
}

nlohmann::json Config::to_json() const {
  JsonWriter writer;
  Config copy = *this;
  copy.visit(writer);
  return writer.root;
}

}  // namespace keel::common
