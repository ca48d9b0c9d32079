#include "daemon/job.h"

#include "checkpoint/catalog.h"
#include "cluster/placement.h"
#include "common/error.h"
#include "common/events.h"
#include "common/human_format.h"
#include "common/log.h"
#include "daemon/checkpoint_quarantine.h"
#include "daemon/flight_dump.h"
#include "daemon/health_policy.h"
#include "daemon/protocol.h"
#include "daemon/world_view.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>

namespace keel::daemon {

std::filesystem::path job_trainer(const common::Config& config) {
  std::filesystem::path trainer(config.daemon.trainer);
  if (trainer.empty()) {
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    trainer = ec ? std::filesystem::path("keel-trainer") : self.parent_path() / "keel-trainer";
  }
  if (access(trainer.c_str(), X_OK) != 0) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("the trainer {} is not an executable file; install keel-trainer beside keeld "
                                    "and keelctl or set daemon.trainer",
                                    trainer.string()));
  }
  return trainer;
}

Job::Job(JobOptions options, std::function<void(JobState, bool)> on_end, const common::Clock& clock)
    : options_(std::move(options)),
      on_end_(std::move(on_end)),
      clock_(clock),
      run_dir_(options_.config.job.run_dir),
      machine_(options_.config.job.name, options_.config.daemon),
      ranks_(RankSetOptions{static_cast<int>(options_.config.node_ranks()), options_.trainer, options_.config_path,
                            options_.overrides, options_.store_address, options_.store_secret,
                            options_.config.cluster.address, run_dir_, options_.config.daemon.pin_cpus, options_.gpus,
                            options_.config.checkpoint.memory_every_steps != 0, options_.buddy != nullptr}),
      history_(run_dir_),
      health_(options_.config.health, static_cast<int>(options_.config.node_ranks())),
      started_at_ns_(clock.now_ns()) {
  if (options_.buddy != nullptr) options_.buddy->attach_areas(ranks_.snapshot_area_fds());
  const auto& c = options_.config;
  if (c.health.hang_timeout_ceiling_s >= c.parallel.timeout_s) {
    common::logger("health")->warn(
        "health.hang_timeout_ceiling_s = {} is not below parallel.timeout_s = {}: a hang longer than the latter ends "
        "with the waiting ranks' own timeout (exit 10) before keeld names its culprit; set the ceiling lower",
        c.health.hang_timeout_ceiling_s, c.parallel.timeout_s);
  }
}

void Job::event(const std::string& kind, nlohmann::json fields) const {
  common::append_event(run_dir_, kind, machine_.generation(), -1, std::move(fields));
}

void Job::apply(const JobActions& actions) {
  auto log = common::logger("job");
  for (auto it = actions.begin(); it != actions.end(); ++it) {
    const JobAction& a = *it;
    switch (a.kind) {
      case JobAction::Kind::kStartGeneration:
        start_generation(a.generation);
        break;
      case JobAction::Kind::kSignal:
        ranks_.signal(a.signal);
        break;
      case JobAction::Kind::kTerminate:
        ranks_.terminate(a.grace_s, clock_.now_ns());
        break;
      case JobAction::Kind::kTellRanks:
        if (options_.cluster != nullptr) {
          // Every node's ranks and keelds learn it through etcd; a failure of
          // a generation this node has left is old news.
          if (membership_ && membership_->generation == a.generation) {
            // What follows (a kill) waits until etcd has the cause: the
            // peers' failures it brings about must not come first there.
            const int64_t g = a.generation;
            options_.cluster->fail(g, {a.text, a.nodes}, [this, g, rest = JobActions(std::next(it), actions.end())] {
              // etcd may have taken long enough for the job to have moved on.
              if (membership_ && membership_->generation == g) apply(rest);
            });
            return;
          }
          break;
        }
        if (options_.store == nullptr) break;
        try {
          options_.store->set(store::rank_failed_key(a.generation), a.text);
        } catch (const std::exception& e) {
          log->warn("could not tell the ranks through the store that {}: {}", a.text, e.what());
        }
        break;
      case JobAction::Kind::kRecord:
        common::append_event(run_dir_, a.text, a.generation, -1, a.fields);
        break;
      case JobAction::Kind::kLog:
        log->log(a.level, "{}", a.text);
        break;
      case JobAction::Kind::kEnd:
        if (options_.cluster != nullptr && membership_ && a.state == JobState::kFinished) {
          options_.cluster->finish(membership_->generation);
        }
        on_end_(a.state, a.stop_requested);
        break;
    }
  }
}

void Job::start() {
  std::filesystem::create_directories(run_dir_ / "logs");
  RankSet::remove_orphaned_boards();
  history_.refresh();
  // Until the ranks say which checkpoint they resumed from, the newest one
  // committed is the best guess.
  base_checkpoint_ = options_.cluster != nullptr ? newest_in_catalog() : history_.newest_committed();
  const auto& c = options_.config.checkpoint;
  if (c.every_steps == 0 && c.every_seconds == 0) {
    common::logger("job")->warn(
        "checkpoint.every_steps and every_seconds are 0: a restart begins again from step 0; set one of them");
  }
  apply(machine_.start(history_.last_generation() + 1).actions);
}

void Job::start_generation(int64_t generation) {
  fetching_for_.reset();
  if (options_.cluster == nullptr) {
    return spawn_generation(generation, RankSlice{0, static_cast<int>(options_.config.parallel.world_size()), {}});
  }
  // The generation's number and nodes come from the rendezvous
  // (docs/architecture.md "Multi-node on etcd"); on_joined() goes on.
  joining_ = true;
  std::optional<int64_t> ended;
  if (membership_) ended = membership_->generation;
  options_.cluster->join_next(ended, ended_cause_);
}

void Job::on_joined(const cluster::Membership& membership) {
  joining_ = false;
  if (membership.job_finished) {
    apply(machine_
              .finished_elsewhere(fmt::format("on nodes {} in generation {}", fmt::join(membership.nodes, ", "),
                                              membership.generation),
                                  newest_in_catalog())
              .actions);
    end_generation_if_over();
    return;
  }
  membership_ = membership;
  const std::string& node = membership.nodes[static_cast<size_t>(membership.node_rank)];
  if (machine_.state() != JobState::kStarting) {
    // Stopped while it joined: the other nodes must not wait for ranks that will not come.
    options_.cluster->fail(membership.generation, {fmt::format("node '{}' stopped before its ranks started", node), {}});
    end_generation_if_over();
    return;
  }
  machine_.joined(membership.generation);
  const auto placed = cluster::place_on_nodes(options_.config, static_cast<int64_t>(membership.nodes.size()));
  if (!placed.layout || !placed.problem.empty()) {
    // Only a node whose config differs from the one that sealed gets here.
    const std::string why = fmt::format("node '{}' cannot run generation {} on {} nodes: {}; give every node the "
                                        "same config",
                                        node, membership.generation, membership.nodes.size(), placed.problem);
    apply(machine_.rank_exited({0, -1, common::exit_code(common::ErrorCode::kBadConfig), -1, why}).actions);
    end_generation_if_over();
    return;
  }
  cross_node_axes_ = placed.crossing;
  event("generation_joined", {{"nodes", membership.nodes},
                              {"cross_node_axes", cross_node_axes_},
                              {"node_rank", membership.node_rank},
                              {"world", membership.world_size()},
                              {"dp", placed.layout->dp},
                              {"micro_batches", placed.layout->micro_batches}});
  const RankSlice slice{membership.rank_offset(), membership.world_size(), placed.layout->overrides()};
  if (fetch_snapshots(membership, slice)) return;
  send_snapshots_on(membership, slice);
  spawn_generation(membership.generation, slice);
}

bool Job::fetch_snapshots(const cluster::Membership& m, const RankSlice& slice) {
  const auto lacking = ranks_.areas_lacking(slice);
  if (options_.buddy == nullptr || m.nodes.size() < 2 || lacking.empty()) return false;
  // The copies of this node's ranks are with the node after the one that
  // ran them: this one's successor when the nodes are the same, another
  // when the numbering moved. Asked in the ring's order, from the next.
  std::vector<SnapshotBuddy::Holder> holders;
  const size_t n = m.nodes.size();
  for (size_t k = 1; k < n; ++k) {
    const size_t i = (static_cast<size_t>(m.node_rank) + k) % n;
    holders.push_back({m.nodes[i], m.snapshot_endpoints.size() == n ? m.snapshot_endpoints[i] : ""});
  }
  // The copies written into the areas belong to the new numbering: the
  // sender, still pointed at the last generation's buddy and numbering,
  // must not take them for its ranks' commits.
  options_.buddy->send_to("", "", 0);
  // The join goes on until the areas are filled: no board is read and no
  // event of the generation acted on before its ranks exist.
  joining_ = true;
  fetching_for_ = m.generation;
  ended_while_fetching_.reset();
  // The peers' ranks wait parallel.timeout_s for this node's at their
  // rendezvous; the copies must come well within it.
  const auto within = std::chrono::milliseconds(static_cast<int64_t>(options_.config.parallel.timeout_s * 500));
  options_.buddy->fetch(lacking, slice.first_rank, holders, within,
                        [this, g = m.generation, slice](const FetchedCopies& got) { on_snapshots_fetched(g, slice, got); });
  return true;
}

void Job::on_snapshots_fetched(int64_t generation, const RankSlice& slice, const FetchedCopies& got) {
  auto log = common::logger("job");
  nlohmann::json filled = nlohmann::json::array();
  for (const auto& f : got.filled) {
    filled.push_back({{"rank", f.rank},
                      {"steps", f.steps},
                      {"from", f.from},
                      {"bytes", f.bytes},
                      {"received_s", f.received_s},
                      {"written_s", f.written_s}});
    log->info("rank {}: its snapshots of steps {} ({}) copied back from node '{}'", f.rank, fmt::join(f.steps, ", "),
              common::format_bytes(f.bytes), f.from);
  }
  if (!got.absent.empty()) {
    log->info("no node holds a snapshot copy of ranks {} (a new job, or the copies went with their holder): they "
              "resume as their areas allow",
              fmt::join(got.absent, ", "));
  }
  for (const auto& why : got.problems) log->warn("a snapshot copy could not be had: {}", why);
  common::append_event(run_dir_, "snapshots_fetched", generation, -1,
                       {{"filled", filled}, {"absent", got.absent}, {"problems", got.problems}, {"seconds", got.seconds}});
  if (fetching_for_ != generation) return;  // the job moved on meanwhile
  fetching_for_.reset();
  joining_ = false;
  if (ended_while_fetching_) {
    const auto e = *std::exchange(ended_while_fetching_, std::nullopt);
    apply(machine_.ended_elsewhere(e.cause, false).actions);
    end_generation_if_over();
    return;
  }
  if (machine_.state() != JobState::kStarting) {
    // Stopped meanwhile: the other nodes must not wait for ranks that will not come.
    options_.cluster->fail(generation, {fmt::format("node '{}' stopped before its ranks started",
                                                    options_.cluster->node_name()),
                                        {}});
    end_generation_if_over();
    return;
  }
  send_snapshots_on(*membership_, slice);
  spawn_generation(generation, slice);
}

void Job::send_snapshots_on(const cluster::Membership& m, const RankSlice& slice) {
  if (options_.buddy == nullptr) return;
  const size_t n = m.nodes.size();
  const size_t next = (static_cast<size_t>(m.node_rank) + 1) % n;
  if (n < 2 || m.snapshot_endpoints.size() != n) return options_.buddy->send_to("", "", 0);
  options_.buddy->send_to(m.nodes[next], m.snapshot_endpoints[next], slice.first_rank);
}

void Job::on_join_failed(const std::string& why) {
  joining_ = false;
  if (machine_.state() == JobState::kStarting) return apply(machine_.join_failed(why, clock_.now_ns()).actions);
  end_generation_if_over();  // stopped while it joined
}

void Job::on_cluster_event(int64_t generation, const cluster::GenerationEvent& e) {
  if (e.kind == cluster::GenerationEvent::kEndedBefore) {
    // This node's ranks failed on what another node's failure did to them
    // (their peers gone): its record names what every node records.
    if (generation == cause_recorded_for_) return;
    cause_recorded_for_ = generation;
    common::logger("job")->warn("generation {} had ended on another node before this node's ranks failed: {}",
                                generation, e.cause);
    common::append_event(run_dir_, "generation_ended_elsewhere", generation, -1, {{"cause", e.cause}});
    return;
  }
  if (fetching_for_ == generation && e.kind == cluster::GenerationEvent::kEnded) {
    ended_while_fetching_ = e;  // on_snapshots_fetched() acts on it
    return;
  }
  // About a generation this node has left, or not yet started.
  if (joining_ || !membership_ || membership_->generation != generation) return;
  if (e.kind == cluster::GenerationEvent::kEnded) {
    const std::string& here = membership_->nodes[static_cast<size_t>(membership_->node_rank)];
    const bool named_here = std::find(e.culprit_nodes.begin(), e.culprit_nodes.end(), here) != e.culprit_nodes.end();
    apply(machine_.ended_elsewhere(e.cause, named_here).actions);
    end_generation_if_over();
    return;
  }
  if (machine_.state() != JobState::kRunning) return;
  const int64_t nodes = static_cast<int64_t>(membership_->nodes.size());
  bool grows = false;
  for (int64_t n = nodes + 1; n <= options_.config.max_nodes() && !grows; ++n) {
    grows = cluster::place_on_nodes(options_.config, n).problem.empty();
  }
  if (!grows) return;
  // Every node sees the same waiting node and restarts alike; the ranks
  // agree on the step of the checkpoint they save.
  apply(machine_.restart(fmt::format("the rendezvous ({}; the job grows from {} nodes)", e.cause, nodes)).actions);
}

void Job::spawn_generation(int64_t generation, const RankSlice& slice) {
  auto log = common::logger("job");
  resumed_ = false;
  last_progress_log_ns_ = clock_.now_ns();
  std::vector<std::string> placement(static_cast<size_t>(slice.world));
  if (membership_) {
    for (int r = 0; r < slice.world; ++r) placement[static_cast<size_t>(r)] = membership_->node_of(r);
  }
  health_.new_generation(placement);
  if (const auto failed = ranks_.spawn(generation, slice)) {
    log->error("generation {}: {}", generation, failed->why);
    apply(machine_.rank_exited({failed->rank, -1, 127, -1, ranks_.exit_cause(failed->rank, 127)}).actions);
    end_generation_if_over();
    return;
  }
  const auto& ranks = ranks_.ranks();
  log->info("generation {}: started {} ranks of {}, resuming from the checkpoint the ranks choose (the newest that "
            "loads)",
            generation, ranks.size(), options_.config.job.name);
  nlohmann::json pids = nlohmann::json::array();
  for (const auto& rank : ranks) pids.push_back(rank.pid);
  event("generation_started", {{"ranks", ranks.size()}, {"pids", pids}});
}

bool Job::on_child_exit(pid_t pid, int wait_status) {
  const RankReport* rank = ranks_.reap(pid, wait_status);
  if (rank == nullptr) return false;
  const int code = *rank->exit_code;
  apply(machine_
            .rank_exited({rank->rank, rank->pid, code, rank->last ? rank->last->steps_done : -1,
                          ranks_.exit_cause(rank->rank, code)})
            .actions);
  end_generation_if_over();
  return true;
}

void Job::end_generation_if_over() {
  if (!machine_.generation_live() || ranks_.alive() || joining_) return;
  observe();  // the boards' last words and the ranks' last events, for status and the events below
  // A replica corrupted in the last steps, between keeld's polls and the
  // ranks' exit, must not end the job as finished on corrupted state.
  act_on(health_.last_words(health_samples(), clock_.now_ns()));
  ranks_.remove_boards();
  quarantine_suspect_checkpoints();
  // A generation made progress when it committed a checkpoint of its own:
  // the newest directory's name says nothing when that one is corrupt.
  GenerationOutcome outcome;
  outcome.progressed = history_.committed_in(machine_.generation()) >= 0;
  if (options_.cluster != nullptr) {
    // Rank 0, which records commits in its node's events, may run on
    // another node: the shared checkpoint directory says what was committed.
    const int64_t newest = newest_in_catalog();
    outcome.progressed = newest > base_checkpoint_;
    base_checkpoint_ = std::max(base_checkpoint_, newest);
  }
  base_checkpoint_ = checkpoint_step();
  outcome.checkpoint_step = base_checkpoint_;
  outcome.abandoned_cause = history_.abandoned_in(machine_.generation());
  outcome.steps_done = steps_done();
  for (const auto& rank : ranks_.ranks()) outcome.exit_codes.push_back(rank.exit_code.value_or(-1));
  ended_cause_ = machine_.reason().empty()
                     ? fmt::format("generation {} was restarted to save a checkpoint and regroup", machine_.generation())
                     : machine_.reason();
  apply(machine_.generation_over(outcome, clock_.now_ns()).actions);
}

void Job::quarantine_suspect_checkpoints() {
  if (!keep_through_step_) return;
  // The checkpoint this generation resumed from went alike into every
  // replica: a set whose digests were never seen agreeing (its steps
  // outran keeld's polls) still agreed there.
  const int64_t last_good = std::max(*keep_through_step_, base_checkpoint_);
  keep_through_step_.reset();
  const auto root = options_.config.checkpoint_dir();
  const Quarantine q = quarantine_checkpoints(root, last_good, machine_.generation());
  // The in-memory snapshots of those steps too ("In-memory snapshots"),
  // and the copies held of other nodes' ranks, which may be as corrupted.
  const int snapshots = ranks_.quarantine_snapshots_after(last_good) +
                        (options_.buddy != nullptr ? options_.buddy->drop_after(last_good) : 0);
  for (const auto& error : q.errors) common::logger("health")->error("{}", error);
  common::logger("health")->warn(
      "moved aside the checkpoints after step {}, the last known good: [{}]; {} in-memory snapshots quarantined",
      last_good, fmt::join(q.moved, ", "), snapshots);
  event("checkpoint_quarantined", {{"last_good_step", last_good},
                                   {"steps", q.steps},
                                   {"moved", q.moved},
                                   {"errors", q.errors},
                                   {"snapshots", snapshots}});
  history_.refresh();
  const auto kept = checkpoint::committed(root);
  base_checkpoint_ = kept.empty() ? -1 : kept.back().step;
}

void Job::act_on(const Verdicts& verdicts) {
  if (verdicts.empty()) return;
  auto log = common::logger("health");
  std::string flight;
  if (!verdicts.hangs.empty()) {
    // Written before the ranks are killed: the boards as the verdict saw them.
    const auto records = collective_records();
    auto verdict = verdicts.hangs.front().to_json();
    verdict["generation"] = machine_.generation();
    try {
      flight = write_flight_dump(run_dir_, machine_.generation(), records, verdict);
    } catch (const std::exception& e) {
      log->error("no flight dump of the hang: {}", e.what());
    }
    diagnosis_ = {{"verdict", verdict}, {"generation", machine_.generation()}, {"ranks", records}};
    diagnosis_["flight"] = flight.empty() ? nlohmann::json(nullptr) : nlohmann::json(flight);
  }
  HealthResponse response = respond(verdicts, options_.config.health.sdc_policy, flight);
  const std::vector<std::string> culprit_nodes = name_nodes(response);
  for (const auto& warning : response.warnings) log->warn("{}", warning);
  for (const auto& e : response.events) {
    log->warn("{}: {}", e.kind, e.fields.dump());
    event(e.kind, e.fields);
  }
  if (response.keep_through_step) {
    keep_through_step_ = std::min(keep_through_step_.value_or(*response.keep_through_step), *response.keep_through_step);
  }
  if (!response.stop_cause.empty()) apply(machine_.verdict(response.stop_cause, culprit_nodes).actions);
}

std::vector<std::string> Job::name_nodes(HealthResponse& response) const {
  if (!membership_) return {};
  const cluster::Membership& m = *membership_;
  std::set<std::string> culprits;
  for (auto& e : response.events) {
    if (e.fields.contains("culprit_ranks")) {
      nlohmann::json nodes = nlohmann::json::array();
      for (const auto& r : e.fields["culprit_ranks"]) {
        nodes.push_back(m.node_of(r.get<int64_t>()));
        culprits.insert(nodes.back().get<std::string>());
      }
      e.fields["culprit_nodes"] = nodes;
    } else if (e.fields.value("rank", int64_t{-1}) >= 0) {
      e.fields["node"] = m.node_of(e.fields["rank"].get<int64_t>());
      culprits.insert(e.fields["node"].get<std::string>());
    }
  }
  // Every node records the cause; it names the nodes as well as the ranks.
  culprits.erase("");
  if (!response.stop_cause.empty() && !culprits.empty()) {
    response.stop_cause += fmt::format(" [on node {}]", fmt::join(culprits, ", "));
  }
  return {culprits.begin(), culprits.end()};
}

std::vector<nlohmann::json> Job::collective_records() const {
  const int64_t now = clock_.now_ns();
  std::vector<nlohmann::json> records;
  for (const auto& rank : ranks_.ranks()) records.push_back(rank_collectives(rank, now));
  return records;
}

void Job::observe() {
  ranks_.read_boards();
  history_.refresh();
  note_resume();
}

void Job::note_resume() {
  const auto& head = ranks_.ranks().front().last;
  // The extent is the first thing TrainLoop::run publishes; before it,
  // first_step means nothing.
  if (resumed_ || !head || head->total_steps == 0) return;
  resumed_ = true;
  const int64_t step = head->first_step;
  // Rank 0's record says whether that was memory (none when rank 0 runs
  // on another node): a snapshot is no checkpoint, so the newest known
  // good checkpoint stays what it was.
  const nlohmann::json restored = history_.restored_in(machine_.generation());
  const std::string from = restored.is_object() ? restored.value("from", "") : "";
  if (from != "memory") base_checkpoint_ = step > 0 ? step : -1;
  const std::string why =
      restored.is_object() && restored.contains("why") && restored["why"].is_string() ? restored["why"].get<std::string>()
                                                                                      : "";
  common::logger("job")->info("generation {}: the ranks resumed from {}{}", machine_.generation(),
                              from == "memory" ? fmt::format("the in-memory snapshot of step {}", step)
                              : step > 0       ? fmt::format("the checkpoint of step {}", step)
                                               : std::string("the start: no checkpoint loads"),
                              why.empty() ? "" : fmt::format(" ({})", why));
  nlohmann::json fields = {{"step", step}};
  if (!from.empty()) fields["from"] = from;
  if (!why.empty()) fields["why"] = why;
  event("generation_resumed", fields);
}

int64_t Job::newest_in_catalog() const {
  const auto kept = checkpoint::committed(options_.config.checkpoint_dir());
  return kept.empty() ? -1 : kept.back().step;
}

int64_t Job::checkpoint_step() const {
  return std::max(base_checkpoint_, history_.committed_in(machine_.generation()));
}

void Job::poll() {
  auto log = common::logger("job");
  observe();
  // While the rendezvous runs, the boards are the last generation's.
  if (joining_) return;
  publish_health();
  const int64_t now = clock_.now_ns();
  if (options_.cluster != nullptr && membership_ && !options_.cluster->alive()) {
    // Cut off for longer than the lease: the other nodes have gone on
    // without this one, and its ranks wait on peers that left.
    apply(machine_
              .verdict(fmt::format("node '{}' lost its lease: it was cut off from etcd for longer than "
                                   "cluster.lease_ttl_s, and the other nodes went on without it",
                                   options_.cluster->node_name()))
              .actions);
  }
  if (machine_.state() == JobState::kStarting || machine_.state() == JobState::kRunning) {
    act_on(health_.observe(health_samples(), now));
  }
  if (machine_.state() == JobState::kStarting) {
    const auto& ranks = ranks_.ranks();
    const bool all_up = std::all_of(ranks.begin(), ranks.end(), [](const RankReport& r) {
      return r.last && r.last->phase != static_cast<uint32_t>(health::Phase::kInit);
    });
    if (all_up) apply(machine_.ranks_up().actions);
  }
  if (machine_.state() == JobState::kRunning &&
      common::ns_to_seconds(now - last_progress_log_ns_) >= options_.config.daemon.progress_every_s) {
    last_progress_log_ns_ = now;
    const std::string line = progress_line(report());
    if (!line.empty()) log->info("{}", line);
  }
  if (ranks_.tick(now)) {
    log->warn("generation {}: ranks still running after their grace period; sent SIGKILL", machine_.generation());
  }
  apply(machine_.tick(now).actions);
}

health::RankSamples Job::health_samples() const {
  if (options_.health_exchange == nullptr || !membership_) return ranks_.samples();
  // A node heard of within its lease and two summaries is alive and in the
  // generation; after that its lease has ended or its keeld stalled.
  const int64_t stale_after_ns =
      static_cast<int64_t>((options_.config.cluster.lease_ttl_s + 2) * 1e9);
  return world_samples(ranks_.samples(), *membership_, options_.health_exchange->received(), clock_.now_ns(),
                       stale_after_ns);
}

std::vector<NodeReport> Job::node_reports(int64_t now_ns) const {
  const cluster::Membership& m = *membership_;
  const RemoteSummaries heard = options_.health_exchange ? options_.health_exchange->received() : RemoteSummaries{};
  std::vector<NodeReport> out;
  for (size_t n = 0; n < m.nodes.size(); ++n) {
    NodeReport node;
    node.name = m.nodes[n];
    node.address = n < m.addresses.size() ? m.addresses[n] : "";
    node.first_rank = static_cast<int>(n) * m.ranks_per_node;
    node.ranks = m.ranks_per_node;
    if (static_cast<int>(n) == m.node_rank) {
      node.heard_s = 0;
    } else if (auto it = heard.find(node.name); it != heard.end() && it->second->generation == m.generation) {
      node.heard_s = common::ns_to_seconds(now_ns - it->second->as_of_ns);
    }
    node.health = node.heard_s ? "ok" : "not heard from";
    RankCondition worst = RankCondition::kHealthy;
    for (int r = node.first_rank; node.heard_s && r < node.first_rank + node.ranks; ++r) {
      if (const auto condition = health_.rank(r).condition; condition > worst) {
        worst = condition;
        node.health = fmt::format("rank {} {}", r, rank_condition_name(condition));
      }
    }
    out.push_back(std::move(node));
  }
  return out;
}

void Job::publish_health() const {
  if (options_.health_exchange == nullptr || !membership_) return;
  options_.health_exchange->offer(health::encode_summary(membership_->generation, ranks_.samples(), clock_.now_ns()));
}

int64_t Job::steps_done() const {
  const auto& first = ranks_.ranks().front().last;
  return first ? first->steps_done : std::max<int64_t>(checkpoint_step(), 0);
}

nlohmann::json Job::checkpoint_now() {
  const auto& c = options_.config.checkpoint;
  if (c.every_steps == 0 && c.every_seconds == 0) {
    return error_reply("checkpoints are off for this job: set checkpoint.every_steps or every_seconds");
  }
  const JobState state = machine_.state();
  if ((state != JobState::kRunning && state != JobState::kStarting) || !ranks_.request_checkpoint()) {
    return error_reply(fmt::format("no generation is training (the job is {})", job_state_name(state)));
  }
  event("checkpoint_requested", {{"step", steps_done()}});
  return {{"ok", true},
          {"message", fmt::format("the ranks will save after the step in progress (step {} is done); watch "
                                  "keelctl events for checkpoint_committed",
                                  steps_done())}};
}

nlohmann::json Job::stop(bool checkpoint, const std::string& by) {
  auto t = machine_.stop(checkpoint, by, checkpoint_step());
  apply(t.actions);
  return t.reply;
}

nlohmann::json Job::restart(const std::string& by) {
  auto t = machine_.restart(by);
  apply(t.actions);
  return t.reply;
}

nlohmann::json Job::health() const {
  auto out = health_.health_json();
  out["ok"] = true;
  if (membership_) {
    for (auto& r : out["ranks"]) {
      if (auto node = membership_->node_of(r.at("rank").get<int64_t>()); !node.empty()) r["node"] = node;
    }
    out["nodes"] = membership_->nodes;
  }
  // Beside the detections, what is only a record (docs/architecture.md "Health").
  out["records"] = {{"loss_spikes", history_.loss_spikes().count}, {"skipped_steps", history_.skipped_steps().count}};
  out["generation"] = machine_.generation();
  return out;
}

nlohmann::json Job::diagnose() const {
  nlohmann::json out = diagnosis_;
  if (out.is_null()) {
    out = {{"verdict", nullptr},
           {"generation", machine_.generation()},
           {"flight", nullptr},
           {"ranks", collective_records()}};
  }
  out["ok"] = true;
  return out;
}

nlohmann::json Job::stragglers() const {
  auto out = health_.straggler_report();
  out["ok"] = true;
  return out;
}

nlohmann::json Job::inject(const FaultSpec& fault, const std::string& by) {
  const JobState state = machine_.state();
  if (state != JobState::kRunning && state != JobState::kStarting) {
    return error_reply(fmt::format("no generation is training (the job is {}); faults go to running ranks",
                                   job_state_name(state)));
  }
  const auto& ranks = ranks_.ranks();
  // A fault names a global rank; on many nodes this node runs some of them.
  const int64_t first = membership_ ? membership_->rank_offset() : 0;
  const int world = membership_ ? membership_->world_size() : static_cast<int>(ranks.size());
  const int64_t local = fault.rank - first;
  if (membership_ && fault.rank >= 0 && fault.rank < world && (local < 0 || local >= static_cast<int64_t>(ranks.size()))) {
    return error_reply(fmt::format("rank {} runs on node '{}', not on this one: ask that node's keeld", fault.rank,
                                   membership_->node_of(fault.rank)));
  }
  int64_t steps_done = -1;  // unknown until the rank publishes
  if (local >= 0 && local < static_cast<int64_t>(ranks.size())) {
    const auto& board = ranks[static_cast<size_t>(local)].last;
    if (board) steps_done = board->steps_done;
  }
  health::FaultRequest request;
  try {
    request = fault_request(fault, world, options_.config.parallel, steps_done);
  } catch (const FaultRefused& e) {
    return error_reply(e.what());
  }
  if (!ranks_.request_fault(static_cast<int>(local), request)) {
    return error_reply(fmt::format("rank {} has no board to take the fault (its generation is over)", fault.rank));
  }
  auto fields = fault_json(fault);
  fields["fault"] = fields["kind"];  // an event's own "kind" is fault_injected
  fields.erase("kind");
  fields["by"] = by;
  common::logger("health")->warn("fault injected by {}: {}", by, fields.dump());
  event("fault_injected", fields);
  return {{"ok", true},
          {"message", fmt::format("rank {} takes the {} fault at {}; keelctl events shows what follows", fault.rank,
                                  fault.kind, fault.step ? fmt::format("step {}", *fault.step) : "its next step")}};
}

JobReport Job::report() const {
  JobReport r;
  r.now_ns = clock_.now_ns();
  r.job = options_.config.job.name;
  r.state = machine_.state();
  r.generation = machine_.generation();
  r.restarts = machine_.restarts();
  r.step = steps_done();
  r.total_steps = options_.config.train.steps;
  r.checkpoint_step = checkpoint_step();
  std::map<int64_t, SnapshotRow, std::greater<>> by_step;
  for (const auto& area : ranks_.snapshots()) {
    for (const auto& listed : area) {
      SnapshotRow& row = by_step[listed.step];
      row.step = listed.step;
      row.ranks += 1;
      row.bytes += listed.bytes;
    }
  }
  for (const auto& [step, row] : by_step) r.snapshots.push_back(row);
  if (options_.buddy != nullptr) {
    BuddyReport b;
    b.held = options_.buddy->held();
    for (const auto& sent : options_.buddy->sent()) {
      if (sent) b.sent.push_back(*sent);
    }
    b.failing = options_.buddy->failing();
    r.buddy = std::move(b);
  }
  r.reason = machine_.reason();
  r.run_dir = run_dir_;
  r.checkpoint_dir = options_.config.checkpoint_dir();
  r.uptime_s = common::ns_to_seconds(r.now_ns - started_at_ns_);
  r.stale_after_s = options_.config.daemon.stale_after_s;
  r.ranks = ranks_.ranks();
  for (auto& rank : r.ranks) {
    if (membership_) rank.rank += membership_->rank_offset();  // an operator knows ranks by their global number
    rank.verdict = health_.rank(rank.rank);
    rank.straggler_score = health_.straggler_score(rank.rank);
  }
  if (options_.cluster != nullptr) {
    ClusterReport c;
    c.node = options_.cluster->node_name();
    if (membership_) {
      c.node_rank = membership_->node_rank;
      c.members = node_reports(r.now_ns);
      c.world = membership_->world_size();
      c.first_rank = membership_->rank_offset();
      c.cross_node_axes = cross_node_axes_;
    }
    if (const auto since = options_.cluster->unreachable_since()) {
      c.etcd_unreachable_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - *since).count();
    }
    r.cluster = std::move(c);
  }
  r.detections = health_.counts();
  r.loss_spikes = history_.loss_spikes();
  r.skipped_steps = history_.skipped_steps();
  return r;
}

}  // namespace keel::daemon
