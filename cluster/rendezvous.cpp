#include "cluster/rendezvous.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"

namespace keel::cluster {

using common::Error;
using common::ErrorCode;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

spdlog::logger& cluster_log() {
  static const std::shared_ptr<spdlog::logger> instance = common::logger("cluster");
  return *instance;
}

constexpr const char* kGenerationKey = "rdzv/generation";
constexpr const char* kConfigKey = "rdzv/config";
constexpr std::string_view kNodesPrefix = "rdzv/nodes/";
constexpr std::string_view kWaitingPrefix = "rdzv/waiting/";

std::string generation_prefix(int64_t g) { return fmt::format("rdzv/g{}/", g); }
std::string join_prefix(int64_t g) { return generation_prefix(g) + "join/"; }
std::string members_key(int64_t g) { return generation_prefix(g) + "members"; }
std::string failed_key(int64_t g) { return generation_prefix(g) + "failed"; }

std::string encode_failure(const GenerationFailure& f) {
  return nlohmann::json{{"cause", f.cause}, {"culprit_nodes", f.culprit_nodes}}.dump();
}

// A record that is not what fail() writes is a cause naming no node: it
// ends the generation all the same, and never crashes keeld.
GenerationFailure decode_failure(const std::string& text) {
  const auto record = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!record.is_object() || !record.contains("cause") || !record.at("cause").is_string()) return {text, {}};
  GenerationFailure f{record.at("cause").get<std::string>(), {}};
  if (auto nodes = record.find("culprit_nodes"); nodes != record.end() && nodes->is_array()) {
    for (const auto& node : *nodes) {
      if (node.is_string()) f.culprit_nodes.push_back(node.get<std::string>());
    }
  }
  return f;
}
std::string done_key(int64_t g, const std::string& node) { return generation_prefix(g) + "done/" + node; }

// An integer the store holds, or Error(kPeerFailure): what another keeld
// wrote there is not keel's.
int64_t parse_generation(const std::string& text) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("the job's {} in etcd holds '{}', not a generation number: something other than keel "
                            "wrote under the job's prefix",
                            kGenerationKey, text.substr(0, 40)));
  }
  return value;
}

std::vector<std::string> parse_members(int64_t g, const std::string& text) {
  auto members = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  std::vector<std::string> nodes;
  if (members.is_array()) {
    for (const auto& node : members) {
      if (!node.is_string()) {
        nodes.clear();
        break;
      }
      nodes.push_back(node.get<std::string>());
    }
  }
  if (nodes.empty()) {
    throw Error(ErrorCode::kPeerFailure, fmt::format("the membership of generation {} in etcd is not a list of node "
                                                     "names: '{}'",
                                                     g, text.substr(0, 80)));
  }
  return nodes;
}

// "train.lr is 0.1 here but 0.3 on the job's nodes; ..." for the keys of
// two configs (JSON objects of sections) that differ.
std::string config_differences(const std::string& here, const std::string& job) {
  const auto mine = nlohmann::json::parse(here, nullptr, false);
  const auto theirs = nlohmann::json::parse(job, nullptr, false);
  if (!mine.is_object() || !theirs.is_object()) return fmt::format("the job's nodes recorded '{}'", job.substr(0, 80));
  const auto flat_mine = mine.flatten(), flat_theirs = theirs.flatten();
  std::vector<std::string> differences;
  for (const auto& [key, value] : flat_mine.items()) {
    const auto other = flat_theirs.find(key);
    const std::string name = key.substr(1);  // "/train/lr" -> "train/lr"
    if (other == flat_theirs.end()) {
      differences.push_back(fmt::format("{} is {} here but unset on the job's nodes", name, value.dump()));
    } else if (*other != value) {
      differences.push_back(fmt::format("{} is {} here but {} on the job's nodes", name, value.dump(), other->dump()));
    }
  }
  for (const auto& [key, value] : flat_theirs.items()) {
    if (!flat_mine.contains(key)) differences.push_back(fmt::format("{} is unset here", key.substr(1)));
  }
  if (differences.size() > 3) differences.resize(3);
  for (auto& d : differences) std::replace(d.begin(), d.begin() + static_cast<ptrdiff_t>(d.find(' ')), '/', '.');
  return fmt::format("{}", fmt::join(differences, "; "));
}

bool contains(const std::vector<std::string>& nodes, const std::string& name) {
  return std::find(nodes.begin(), nodes.end(), name) != nodes.end();
}

// A nonce, so that a keeld can tell its own node record from the record of
// an earlier keeld of the same name.
std::string nonce() {
  uint64_t value = 0;
  if (getrandom(&value, sizeof(value), 0) != sizeof(value)) value = static_cast<uint64_t>(getpid());
  return fmt::format("{:016x}", value);
}

}  // namespace

Rendezvous::Rendezvous(store::ClusterStore& store, RendezvousOptions options)
    : store_(store), options_(std::move(options)) {
  if (options_.node_name.empty() || options_.node_name.find('/') != std::string::npos) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("bad [cluster] node_name '{}': it must be non-empty and hold no '/'", options_.node_name));
  }
  if (options_.lease_ttl < std::chrono::seconds(2)) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("[cluster] lease_ttl_s = {}: etcd grants no lease below 2 s", options_.lease_ttl.count()));
  }
  if (options_.min_nodes < 1 || options_.max_nodes < options_.min_nodes) {
    throw Error(ErrorCode::kBadConfig, fmt::format("[cluster] min_nodes = {} and max_nodes = {}: they need 1 <= "
                                                   "min_nodes <= max_nodes",
                                                   options_.min_nodes, options_.max_nodes));
  }
  take_name();
}

void Rendezvous::take_name() {
  record_ = nlohmann::json{
      {"name", options_.node_name},
      {"address", options_.address},
      {"snapshots", options_.snapshot_endpoint},
      {"ranks", options_.ranks_per_node},
      {"pid", static_cast<int64_t>(getpid())},
      {"nonce",
       nonce()}}.dump();
  const std::string key = std::string(kNodesPrefix) + options_.node_name;
  // A keeld restarted by systemd finds its predecessor's record until that
  // lease ends; a second live keeld of the same name keeps renewing it.
  const auto deadline = Clock::now() + 2 * options_.lease_ttl + std::chrono::seconds(2);
  for (;;) {
    auto listing = store_.list(key);
    // A lease of its own for each try: the wait may outlast a whole TTL,
    // and nothing renews a lease before the name is taken.
    lease_ = store_.grant_lease(options_.lease_ttl);
    auto held = store_.compare_set_with_lease(key, std::nullopt, record_, lease_);
    if (held == record_) break;
    store_.revoke(lease_);
    if (Clock::now() >= deadline) {
      throw Error(ErrorCode::kBadConfig,
                  fmt::format("another live keeld holds node name '{}' in this job (its record: {}): give each node "
                              "its own [cluster] node_name",
                              options_.node_name, held.value_or("")));
    }
    cluster_log().info("node name '{}' is still held by an earlier keeld; waiting for its lease to end",
                       options_.node_name);
    store_.watch(key, listing.revision, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
  }
  try {
    check_job_config();
  } catch (const Error&) {
    store_.revoke(lease_);
    throw;
  }
  if (renewer_.joinable()) renewer_.join();  // it ended when the old lease did
  lease_lost_ = false;
  renewer_ = std::thread([this] { renew_until_stopped(); });
}

Rendezvous::~Rendezvous() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  stop_signal_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  try {
    store_.revoke(lease_);
  } catch (const std::exception& e) {
    // etcd unreachable: the lease ends by itself after its TTL.
    cluster_log().warn("cannot revoke node '{}''s lease ({}); it ends within {} s", options_.node_name, e.what(),
                       options_.lease_ttl.count());
  }
}

void Rendezvous::renew_until_stopped() {
  // Three renewals a TTL, each given a third of it: one that takes longer
  // is too late anyway, and the next may reach another member.
  const milliseconds third = std::chrono::duration_cast<milliseconds>(options_.lease_ttl) / 3;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    stop_signal_.wait_for(lock, third, [this] { return stop_.load(); });
    if (stop_) return;
    lock.unlock();
    bool renewed = false;
    std::string failure;
    try {
      renewed = store_.keep_alive(lease_, third);
      if (!renewed) failure = "etcd says it expired";
    } catch (const std::exception& e) {
      failure = e.what();
    }
    lock.lock();
    if (renewed) {
      if (unreachable_since_) cluster_log().info("node '{}' reaches etcd again", options_.node_name);
      unreachable_since_.reset();
    } else if (failure == "etcd says it expired") {
      lease_lost_ = true;
      cluster_log().error("node '{}''s lease expired: the job has gone on without this node", options_.node_name);
      return;
    } else if (!unreachable_since_) {
      unreachable_since_ = Clock::now();
      cluster_log().warn("node '{}' cannot renew its lease: {}", options_.node_name, failure);
    }
  }
}

std::optional<Clock::time_point> Rendezvous::unreachable_since() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return unreachable_since_;
}

void Rendezvous::check_job_config() {
  if (options_.job_config.empty()) return;
  const auto held = store_.compare_set(kConfigKey, std::nullopt, options_.job_config);
  if (held == options_.job_config) return;
  const std::string differences = config_differences(options_.job_config, held.value_or(""));
  const std::string own = std::string(kNodesPrefix) + options_.node_name;
  bool others_live = false;
  for (const auto& entry : store_.list(std::string(kNodesPrefix)).entries) others_live |= entry.key != own;
  if (others_live) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("node '{}''s config differs from the one the job's running nodes use: {}. Every node of a "
                            "job needs the same config; a second job needs its own prefix in cluster.etcd",
                            options_.node_name, differences));
  }
  // No node runs the old one: the job starts again with a new config.
  store_.set(kConfigKey, options_.job_config);
  cluster_log().warn("the job's config changes from the one its nodes ran last: {}", differences);
}

int64_t Rendezvous::current_generation() {
  // Read first: every keeld asks about twice a second, and a
  // compare-and-set is a write to etcd's log even when it fails
  // (docs/architecture.md "The control plane at scale"). The first keeld of
  // a job creates the counter.
  if (const auto value = store_.get(kGenerationKey)) return parse_generation(*value);
  return parse_generation(store_.compare_set(kGenerationKey, std::nullopt, "0").value_or("0"));
}

std::optional<std::vector<std::string>> Rendezvous::sealed_members(int64_t generation) {
  auto members = store_.get(members_key(generation));
  if (!members) return std::nullopt;
  return parse_members(generation, *members);
}

std::optional<std::vector<std::string>> Rendezvous::try_seal(int64_t generation,
                                                             const store::ClusterStore::Listing& joined,
                                                             bool timed_out) {
  std::vector<std::string> names;
  const std::string prefix = join_prefix(generation);
  for (const auto& entry : joined.entries) {
    if (entry.key.starts_with(prefix)) names.push_back(entry.key.substr(prefix.size()));
  }
  std::sort(names.begin(), names.end());
  const int count = static_cast<int>(names.size());
  if (count < options_.max_nodes && !(timed_out && count >= options_.min_nodes)) return std::nullopt;
  int take = std::min(count, options_.max_nodes);
  while (take >= options_.min_nodes && !options_.runs_on(take)) --take;
  if (take < options_.min_nodes) return std::nullopt;
  names.resize(static_cast<size_t>(take));
  // Whoever seals first decides; everyone reads the same answer.
  auto sealed = store_.compare_set(members_key(generation), std::nullopt, nlohmann::json(names).dump());
  return parse_members(generation, sealed.value_or("[]"));
}

Membership Rendezvous::sealed_with_this_node(int64_t generation, std::vector<std::string> nodes, int64_t revision) {
  store_.remove(std::string(kWaitingPrefix) + options_.node_name);
  Membership m;
  m.generation = generation;
  m.node_rank = static_cast<int>(std::find(nodes.begin(), nodes.end(), options_.node_name) - nodes.begin());
  m.nodes = std::move(nodes);
  read_join_records(generation, m);
  m.ranks_per_node = options_.ranks_per_node;
  m.revision = revision;
  cluster_log().info("generation {}: nodes {}; this node '{}' is node {}", generation, fmt::join(m.nodes, ", "),
                     options_.node_name, m.node_rank);
  return m;
}

void Rendezvous::read_join_records(int64_t generation, Membership& m) {
  m.addresses.assign(m.nodes.size(), "");
  m.snapshot_endpoints.assign(m.nodes.size(), "");
  const std::string prefix = join_prefix(generation);
  auto text = [](const nlohmann::json& record, const char* key) {
    return record.contains(key) && record[key].is_string() ? record[key].get<std::string>() : std::string();
  };
  try {
    for (const auto& entry : store_.list(prefix).entries) {
      const auto at = std::find(m.nodes.begin(), m.nodes.end(), entry.key.substr(prefix.size()));
      const auto record = nlohmann::json::parse(entry.value, nullptr, /*allow_exceptions=*/false);
      if (at == m.nodes.end() || !record.is_object()) continue;
      const auto node = static_cast<size_t>(at - m.nodes.begin());
      m.addresses[node] = text(record, "address");
      m.snapshot_endpoints[node] = text(record, "snapshots");
    }
  } catch (const std::exception& e) {
    // The membership stands without them: the status shows no address, and
    // the snapshots are not copied between nodes this generation.
    cluster_log().warn("generation {}: cannot read the nodes' join records: {}", generation, e.what());
  }
}

void Rendezvous::watch_a_while(const std::string& prefix, int64_t revision, Clock::time_point until) {
  if (cancelled_) throw Error(ErrorCode::kPeerFailure, "the rendezvous was cancelled: keeld is stopping");
  const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
  store_.watch(prefix, revision, std::clamp(left, milliseconds(1), milliseconds(1000)));
}

void Rendezvous::wait_for_generation_after(int64_t generation, Clock::time_point deadline) {
  for (;;) {
    auto listing = store_.list(kGenerationKey);
    for (const auto& entry : listing.entries) {
      if (entry.key == kGenerationKey && parse_generation(entry.value) > generation) return;
    }
    if (Clock::now() >= deadline) return;
    watch_a_while(kGenerationKey, listing.revision, deadline);
  }
}

Membership Rendezvous::join(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  // The generation this call joined, and the store's revision before its seal.
  int64_t joined = -1;
  int64_t revision = 0;
  if (lease_lost_) {
    // Cut off from etcd for longer than the lease: the job went on without
    // this node, which now comes back as a new one.
    cluster_log().info("node '{}' takes a new lease to rejoin the job", options_.node_name);
    take_name();
  }
  for (;;) {
    if (cancelled_) throw Error(ErrorCode::kPeerFailure, "the rendezvous was cancelled: keeld is stopping");
    if (Clock::now() >= deadline) break;
    const int64_t g = current_generation();
    if (auto sealed = sealed_members(g)) {
      if (joined == g && contains(*sealed, options_.node_name))
        return sealed_with_this_node(g, std::move(*sealed), revision);
      if (finished_by(g, *sealed)) {
        cluster_log().info("the job finished in generation {} on nodes {}; node '{}' has nothing to join", g,
                           fmt::join(*sealed, ", "), options_.node_name);
        Membership m;
        m.generation = g;
        m.nodes = std::move(*sealed);
        m.ranks_per_node = options_.ranks_per_node;
        m.job_finished = true;
        return m;
      }
      if (contains(*sealed, options_.node_name)) {
        fail(g, {fmt::format("node '{}' came back while generation {} ran (its keeld restarted): its ranks are gone",
                             options_.node_name, g)});
      } else {
        store_.set_with_lease(std::string(kWaitingPrefix) + options_.node_name, record_, lease_);
        cluster_log().info("generation {} is sealed without node '{}' ({}); it waits for the next", g,
                           options_.node_name, fmt::join(*sealed, ", "));
        wait_for_generation_after(g, deadline);
      }
      continue;
    }
    store_.set_with_lease(join_prefix(g) + options_.node_name, record_, lease_);
    joined = g;
    // Joins of earlier generations live as long as the lease: drop the last.
    if (g > 0) store_.remove(join_prefix(g - 1) + options_.node_name);
    const auto join_deadline = Clock::now() + options_.join_timeout;
    for (;;) {
      auto listing = store_.list(generation_prefix(g));
      revision = listing.revision;
      bool moved_on = false;
      for (const auto& entry : listing.entries) {
        // Sealed by another keeld: watches start just before its seal.
        if (entry.key == members_key(g)) revision = entry.revision - 1;
        moved_on |= entry.key == members_key(g) || entry.key == failed_key(g);
      }
      if (moved_on) break;  // sealed, or failed: look again
      const bool timed_out = Clock::now() >= join_deadline;
      if (auto sealed = try_seal(g, listing, timed_out)) {
        if (!contains(*sealed, options_.node_name)) break;
        return sealed_with_this_node(g, std::move(*sealed), revision);
      }
      if (Clock::now() >= deadline) break;
      watch_a_while(generation_prefix(g), listing.revision, timed_out ? deadline : std::min(deadline, join_deadline));
    }
  }
  const int64_t g = current_generation();
  std::vector<std::string> arrived;
  for (const auto& entry : store_.list(join_prefix(g)).entries) {
    arrived.push_back(entry.key.substr(join_prefix(g).size()));
  }
  throw Error(ErrorCode::kPeerFailure,
              fmt::format("the rendezvous of generation {} did not complete within {} ms: {} node(s) joined ({}), and "
                          "the job needs at least {} (min_nodes) on which its layout runs: start the missing nodes' "
                          "keelds, or lower [cluster] min_nodes",
                          g, timeout.count(), arrived.size(), fmt::join(arrived, ", "), options_.min_nodes));
}

GenerationFailure Rendezvous::fail(int64_t generation, const GenerationFailure& failure) {
  const std::string mine = encode_failure(failure);
  const std::string recorded = store_.compare_set(failed_key(generation), std::nullopt, mine).value_or(mine);
  store_.compare_set(kGenerationKey, std::to_string(generation), std::to_string(generation + 1));
  if (recorded == mine) cluster_log().warn("generation {} ends: {}", generation, failure.cause);
  return decode_failure(recorded);
}

void Rendezvous::finish(int64_t generation) {
  store_.set(done_key(generation, options_.node_name), options_.job_config);
}

bool Rendezvous::finished_by(int64_t generation, const std::vector<std::string>& members) {
  for (const auto& member : members) {
    const auto done = store_.get(done_key(generation, member));
    if (!done || *done != options_.job_config) return false;
  }
  return !members.empty();
}

std::optional<GenerationEvent> Rendezvous::next_event(Membership& m, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  if (current_generation() != m.generation) return ended(m);
  int64_t& after = m.revision;
  auto node_lost = [&](const std::string& node) {
    GenerationFailure first =
        fail(m.generation, {fmt::format("node '{}' lost its lease: its keeld or the node died, or it was cut off "
                                        "from etcd for over {} s",
                                        node, options_.lease_ttl.count())});
    return GenerationEvent{GenerationEvent::kEnded, std::move(first.cause), std::move(first.culprit_nodes)};
  };
  // A node that could not be taken in (the job is at max_nodes) asks for nothing.
  auto node_waits = [&](const std::string& node) -> std::optional<GenerationEvent> {
    if (static_cast<int>(m.nodes.size()) >= options_.max_nodes) return std::nullopt;
    return GenerationEvent{GenerationEvent::kNodeWaiting, fmt::format("node '{}' waits to join", node)};
  };
  for (;;) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return std::nullopt;
    std::vector<store::ClusterStore::Change> changes;
    try {
      changes = store_.watch("rdzv/", after, left);
    } catch (const store::HistoryCompacted& e) {
      // A quiet generation's cursor fell behind etcd's history window: what
      // changed since is read whole, from the present.
      cluster_log().info("generation {}: {}; reading the membership's state instead", m.generation, e.what());
      return resync(m, node_lost, node_waits);
    }
    if (changes.empty()) return std::nullopt;
    for (const auto& change : changes) {
      after = std::max(after, change.revision);
      if (change.key == kGenerationKey && change.value && parse_generation(*change.value) != m.generation) {
        return ended(m);
      }
      if (change.key.starts_with(kNodesPrefix) && !change.value) {
        const std::string node = change.key.substr(kNodesPrefix.size());
        if (!contains(m.nodes, node) || store_.get(done_key(m.generation, node))) continue;
        return node_lost(node);
      }
      if (change.key.starts_with(kWaitingPrefix) && change.value) {
        if (auto event = node_waits(change.key.substr(kWaitingPrefix.size()))) return event;
      }
    }
  }
}

GenerationEvent Rendezvous::ended(const Membership& m) {
  const auto recorded = store_.get(failed_key(m.generation));
  GenerationFailure f = recorded ? decode_failure(*recorded) : GenerationFailure{"the generation moved on", {}};
  return GenerationEvent{GenerationEvent::kEnded, std::move(f.cause), std::move(f.culprit_nodes)};
}

std::optional<GenerationEvent> Rendezvous::resync(
    Membership& m, const std::function<GenerationEvent(const std::string&)>& node_lost,
    const std::function<std::optional<GenerationEvent>(const std::string&)>& node_waits) {
  // The cursor goes to the first listing's revision, so that nothing after
  // it is missed; what the later listings show again is harmless.
  const auto nodes = store_.list(std::string(kNodesPrefix));
  m.revision = nodes.revision;
  if (current_generation() != m.generation) return ended(m);
  for (const auto& member : m.nodes) {
    const std::string key = std::string(kNodesPrefix) + member;
    const bool live = std::any_of(nodes.entries.begin(), nodes.entries.end(),
                                  [&](const store::ClusterStore::Entry& e) { return e.key == key; });
    if (!live && !store_.get(done_key(m.generation, member))) return node_lost(member);
  }
  for (const auto& entry : store_.list(std::string(kWaitingPrefix)).entries) {
    if (auto event = node_waits(entry.key.substr(kWaitingPrefix.size()))) return event;
  }
  return std::nullopt;
}

}  // namespace keel::cluster
