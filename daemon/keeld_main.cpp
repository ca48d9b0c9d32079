// keeld: the per-node daemon (docs/architecture.md "Daemon"). It runs one job: starts its
// ranks, watches them through their progress boards and exit statuses,
// restarts the generation after a failure, and answers keelctl on the
// control socket. systemd runs it (systemd/keeld.service); --foreground
// runs it in a terminal until the job ends.
#include "common/atomic_file.h"
#include "common/config.h"
#include "common/error.h"
#include "common/layout_check.h"
#include "common/log.h"
#include "cluster/placement.h"
#include "store/etcd_gateway.h"
#include "store/tcp_store.h"
#include "daemon/cluster_link.h"
#include "daemon/health_exchange.h"
#include "daemon/control_server.h"
#include "daemon/gpu_assignment.h"
#include "daemon/job.h"
#include "daemon/metrics_server.h"
#include "daemon/snapshot_buddy.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <systemd/sd-daemon.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

namespace {

namespace asio = boost::asio;
using keel::common::Error;
using keel::common::ErrorCode;
using keel::daemon::JobState;

// The keel-trainer installed beside this keeld.
// Runs `tick` every `period`, from the event loop.
class Ticker {
 public:
  Ticker(asio::io_context& io, std::chrono::milliseconds period, std::function<void()> tick)
      : timer_(io), period_(period), tick_(std::move(tick)) {
    arm();
  }

 private:
  void arm() {
    timer_.expires_after(period_);
    timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      tick_();
      arm();
    });
  }
  asio::steady_timer timer_;
  std::chrono::milliseconds period_;
  std::function<void()> tick_;
};

// The ranks' Store (docs/architecture.md "Store (store/)"): on one node an
// embedded TCP store with a new secret at every start (why: "Run
// directory"); on many, the job's prefix in etcd, whose credential comes
// from cluster.credential_file and TLS files from cluster.tls_*.
struct JobStore {
  std::optional<keel::store::StoreServer> server;
  std::unique_ptr<keel::store::Store> client;  // keeld's own
  std::string address;
  std::string secret;
};

void open_job_store(const keel::common::Config& config, JobStore& out) {
  if (config.multi_node()) {
    // The ranks reach etcd by this address too, TLS files and all.
    out.address = keel::store::etcd_address_with_tls(
        config.cluster.etcd, {config.cluster.tls_ca_file, config.cluster.tls_cert_file, config.cluster.tls_key_file});
    if (!config.cluster.credential_file.empty()) {
      std::ifstream in(config.cluster.credential_file);
      if (!in || !std::getline(in, out.secret) || out.secret.empty()) {
        throw Error(ErrorCode::kBadConfig, fmt::format("cluster.credential_file {} cannot be read or is empty; it "
                                                       "must hold etcd's USER:PASSWORD on its first line",
                                                       config.cluster.credential_file));
      }
    }
  } else {
    out.secret = keel::store::new_store_secret();
    std::error_code ignored;  // a run directory that cannot be made fails the write below, which says so
    std::filesystem::create_directories(config.job.run_dir, ignored);
    keel::common::write_file_atomically(std::filesystem::path(config.job.run_dir) / "store.secret", out.secret + "\n",
                                        0600, ErrorCode::kBadConfig);
    out.server.emplace(out.secret);
    out.address = out.server->address();
  }
  out.client = keel::store::connect_store(out.address, out.secret, std::chrono::seconds(10));
}

// This node's part in the rendezvous, from [cluster] (common/config.h).
keel::cluster::RendezvousOptions rendezvous_options(const keel::common::Config& config) {
  keel::cluster::RendezvousOptions o;
  o.node_name = config.cluster.node_name;
  if (o.node_name.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    o.node_name = host;
  }
  o.address = config.cluster.address;
  o.ranks_per_node = static_cast<int>(config.daemon.ranks);
  o.min_nodes = static_cast<int>(config.min_nodes());
  o.max_nodes = static_cast<int>(config.max_nodes());
  o.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(config.cluster.join_timeout_s * 1000));
  o.lease_ttl = std::chrono::seconds(static_cast<int64_t>(std::ceil(config.cluster.lease_ttl_s)));
  o.runs_on = [config](int nodes) { return keel::cluster::place_on_nodes(config, nodes).problem.empty(); };
  // What the nodes' ranks must agree on to train one model; paths, ports and
  // the node's own settings may differ.
  const auto all = config.to_json();
  o.job_config = nlohmann::json{{"job", {{"name", config.job.name}, {"seed", config.job.seed}}},
                                {"model", all.at("model")},
                                {"parallel", all.at("parallel")},
                                {"train", all.at("train")},
                                {"checkpoint", {{"dir", config.checkpoint_dir().string()}}},
                                {"daemon", {{"ranks", config.daemon.ranks}}},
                                {"cluster", {{"min_nodes", config.min_nodes()}, {"max_nodes", config.max_nodes()}}}}
                     .dump();
  return o;
}

// The buddy copy of the in-memory snapshots (daemon/snapshot_buddy.h):
// on many nodes, with snapshots and checkpoint.memory_buddy on.
std::unique_ptr<keel::daemon::SnapshotBuddy> snapshot_buddy(const keel::common::Config& config,
                                                            std::function<void(std::function<void()>)> post) {
  const auto& c = config.checkpoint;
  if (!config.multi_node() || c.memory_every_steps == 0 || !c.memory_buddy) return nullptr;
  auto buddy = std::make_unique<keel::daemon::SnapshotBuddy>(keel::daemon::SnapshotBuddyOptions{
      config.cluster.address, static_cast<uint16_t>(config.cluster.snapshot_port), static_cast<int>(c.memory_keep),
      c.memory_buddy_mb_per_s, std::move(post)});
  keel::common::logger("keeld")->info("snapshot copies taken on {}, sent at up to {} MB/s", buddy->endpoint(),
                                      c.memory_buddy_mb_per_s);
  return buddy;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keeld: the keel training daemon; runs one job's ranks and keeps them running"};
  std::string config_path, socket;
  std::vector<std::string> overrides;
  bool foreground = false;
  app.add_option("--config", config_path, "the job's TOML configuration")->required();
  app.add_option("--set", overrides, "override a config entry: --set section.key=value (repeatable)");
  app.add_flag("--foreground", foreground,
               "exit when the job ends (0 finished, 1 failed) instead of staying up for keelctl");
  app.add_option("--socket", socket, "control socket (default: daemon.socket, /run/keel/keeld.sock)");
  app.footer(
      "SIGTERM or SIGINT: the ranks save a final checkpoint, then keeld exits 0, or 1 when that checkpoint\n"
      "could not be saved (a second signal stops at once). Starting keeld again resumes the job from its\n"
      "newest good checkpoint.\n"
      "Exit codes: 0 finished or stopped, 1 the job failed (--foreground) or its final checkpoint was not\n"
      "saved, 2 bad config or usage, 70 internal error. Operate it with keelctl (keelctl --help).");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : keel::common::exit_code(ErrorCode::kBadConfig);
  }

  keel::common::init_logging(-1);
  auto log = keel::common::logger("keeld");
  // A client that hangs up mid-reply must not kill the daemon.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    auto config = keel::common::Config::load(config_path, overrides);
    // The ranks' own check: a layout they would refuse starts none of them.
    keel::common::validate_layout(config, config.parallel.world_size());
    if (!socket.empty()) config.daemon.socket = std::filesystem::absolute(socket).string();
    keel::daemon::JobOptions options;
    options.trainer = keel::daemon::job_trainer(config);
    if (config.train.device == "cuda") {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      const auto gpus =
          keel::daemon::node_gpus(visible != nullptr ? std::optional<std::string>(visible) : std::nullopt);
      options.gpus = keel::daemon::assign_gpus(gpus, static_cast<int>(config.node_ranks()));
      log->info("ranks get GPUs {} of {}", fmt::join(options.gpus, ","), gpus.source);
    }
    options.config_path = std::filesystem::absolute(config_path);
    options.overrides = overrides;
    log->info("job {}: config {}\n{}", config.job.name, options.config_path.string(), config.to_toml());

    asio::io_context io;
    if (config.multi_node()) {
      const auto placement = keel::cluster::place_on_nodes(config, config.max_nodes());
      if (!placement.problem.empty()) throw Error(ErrorCode::kBadConfig, placement.problem);
    }
    JobStore store;
    open_job_store(config, store);
    options.store_address = store.address;
    options.store_secret = store.secret;
    options.config = config;
    // Set once the job exists; the link's callbacks run on the loop, after.
    keel::daemon::Job* linked_job = nullptr;
    auto post = [&io](std::function<void()> f) { asio::post(io, std::move(f)); };
    std::unique_ptr<keel::daemon::SnapshotBuddy> buddy = snapshot_buddy(config, post);
    options.buddy = buddy.get();
    std::unique_ptr<keel::daemon::ClusterLink> cluster;
    std::unique_ptr<keel::daemon::HealthExchange> health_exchange;  // ends before the link whose lease it uses
    if (config.multi_node()) {
      auto& etcd = dynamic_cast<keel::store::ClusterStore&>(*store.client);
      auto rendezvous = rendezvous_options(config);
      if (buddy) rendezvous.snapshot_endpoint = buddy->endpoint();
      cluster = std::make_unique<keel::daemon::ClusterLink>(
          etcd, rendezvous, post,
          keel::daemon::ClusterCallbacks{
              [&](keel::cluster::Membership m) { linked_job->on_joined(m); },
              [&](std::string why) { linked_job->on_join_failed(why); },
              [&](int64_t g, keel::cluster::GenerationEvent e) { linked_job->on_cluster_event(g, e); }});
      options.cluster = cluster.get();
      health_exchange = std::make_unique<keel::daemon::HealthExchange>(
          etcd, cluster->node_name(), [&cluster] { return cluster->lease(); }, keel::common::Clock::steady());
      options.health_exchange = health_exchange.get();
      log->info("node '{}' of job {} on {}, {} ranks a node, {} to {} nodes", cluster->node_name(), config.job.name,
                config.cluster.etcd, config.daemon.ranks, config.min_nodes(), config.max_nodes());
    } else {
      options.store = store.client.get();
    }

    int exit_code = 0;
    auto finish = [&](int code) {
      exit_code = code;
      sd_notify(0, "STOPPING=1");
      io.stop();
    };
    keel::daemon::Job job(options, [&](JobState state, bool stop_requested) {
      // What systemd shows once keeld is gone: how the job ended, and why.
      sd_notify(0, ("STATUS=" + keel::daemon::status_line(job.report())).c_str());
      if (stop_requested || foreground) return finish(state == JobState::kFailed ? 1 : 0);
      log->info("the job has {}; keeld stays up for keelctl (keelctl restart runs it again, keelctl stop exits)",
                keel::daemon::job_state_name(state));
    });
    linked_job = &job;
    auto stop = [&](bool checkpoint, const std::string& by) {
      auto reply = job.stop(checkpoint, by);
      if (job.state() == JobState::kStopping) sd_notify(0, "STOPPING=1");
      return reply;
    };

    std::optional<keel::daemon::MetricsServer> metrics;
    if (config.daemon.metrics_port >= 0) {
      metrics.emplace(io, "127.0.0.1", static_cast<uint16_t>(config.daemon.metrics_port),
                      [&job] { return keel::daemon::metrics_text(job.report()); });
      log->info("metrics on http://127.0.0.1:{}/metrics", metrics->port());
    }
    keel::daemon::ControlServer control(
        io,
        keel::daemon::ControlServerOptions{config.daemon.socket, config.daemon.control_group,
                                           static_cast<size_t>(config.daemon.max_message_bytes),
                                           std::chrono::milliseconds(
                                               static_cast<int64_t>(config.daemon.client_timeout_s * 1000))},
        [&](const keel::daemon::Request& request) -> nlohmann::json {
          using keel::daemon::Command;
          switch (request.command) {
            case Command::kStatus: {
              auto out = keel::daemon::status_json(job.report());
              out["socket"] = config.daemon.socket;
              out["metrics_port"] = metrics ? nlohmann::json(metrics->port()) : nlohmann::json(nullptr);
              return out;
            }
            case Command::kEvents: return keel::daemon::newest_events(config.job.run_dir, request.limit);
            case Command::kCheckpointNow: return job.checkpoint_now();
            case Command::kStop: return stop(request.checkpoint, "keelctl stop");
            case Command::kRestart: return job.restart("keelctl restart");
            case Command::kHealth: return job.health();
            case Command::kDiagnose: return job.diagnose();
            case Command::kStragglers: return job.stragglers();
            case Command::kInject: return job.inject(request.fault, "keelctl inject");
          }
          return keel::daemon::error_reply("unknown command");
        });
    log->info("control socket {}", config.daemon.socket);

    asio::signal_set children(io, SIGCHLD);
    std::function<void()> reap = [&] {
      children.async_wait([&](const boost::system::error_code& ec, int) {
        if (ec) return;
        int status = 0;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) job.on_child_exit(pid, status);
        reap();
      });
    };
    reap();
    asio::signal_set stops(io, SIGTERM, SIGINT);
    std::function<void()> on_stop = [&] {
      stops.async_wait([&](const boost::system::error_code& ec, int signo) {
        if (ec) return;
        const bool again = job.state() == JobState::kStopping;
        log->warn("{}: {}", signo == SIGTERM ? "SIGTERM" : "SIGINT",
                  again ? "stopping now without waiting for the final checkpoint"
                        : "the ranks save a final checkpoint, then keeld exits (send it again to stop at once)");
        stop(!again, signo == SIGTERM ? "SIGTERM" : "SIGINT");
        on_stop();
      });
    };
    on_stop();

    std::string last_status;
    Ticker poll(io, std::chrono::milliseconds(200), [&] {
      job.poll();
      const std::string line = keel::daemon::status_line(job.report());
      if (line != last_status) {
        sd_notify(0, ("STATUS=" + line).c_str());
        last_status = line;
      }
    });
    // systemd's watchdog is fed from the event loop itself, so a wedged
    // loop (not a slow rank) is what makes systemd restart keeld.
    uint64_t watchdog_usec = 0;
    std::optional<Ticker> watchdog;
    if (sd_watchdog_enabled(0, &watchdog_usec) > 0) {
      watchdog.emplace(io, std::chrono::milliseconds(std::max<uint64_t>(watchdog_usec / 2000, 1)),
                       [] { sd_notify(0, "WATCHDOG=1"); });
    }

    job.start();
    sd_notify(0, ("READY=1\nSTATUS=" + keel::daemon::status_line(job.report())).c_str());
    io.run();
    log->info("keeld exits {}", exit_code);
    return exit_code;
  } catch (const Error& e) {
    log->error("{}: {}", keel::common::error_code_name(e.code()), e.what());
    std::cerr << "keeld: " << e.what() << std::endl;
    return keel::common::exit_code(e.code());
  } catch (const std::exception& e) {
    log->error("internal error: {}", e.what());
    std::cerr << "keeld: internal error: " << e.what() << std::endl;
    return keel::common::exit_code(ErrorCode::kInternal);
  }
}
