// keeld end to end, with real processes: it resumes a run by itself after a
// rank is killed, stops with a final checkpoint on SIGTERM and resumes when
// started again, gives up on a crash loop, and shrugs off garbage on its
// control socket. "Bit-identical" compares every tensor of the final
// checkpoint, model and optimizer state, with an uninterrupted run.
#include "tests/daemon/control_client.h"
#include "tests/daemon/keeld_job.h"
#include "tests/daemon/notify_socket.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <grp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <algorithm>
#include <random>

namespace keel::test {
namespace {

int64_t step_of(const nlohmann::json& status) { return status.at("step").get<int64_t>(); }

// The secret of the store of the keeld that ran `job` last, checked to be
// readable by its owner only and absent from the ranks' logs.
std::string store_secret(const KeeldJob& job) {
  const auto path = job.run_dir() / "store.secret";
  const auto permissions = std::filesystem::status(path).permissions();
  CHECK((permissions & std::filesystem::perms::all) ==
        (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
  std::ifstream in(path);
  std::string secret;
  std::getline(in, secret);
  CHECK(secret.size() == 64);
  for (const auto& log : std::filesystem::directory_iterator(job.run_dir() / "logs")) {
    std::ifstream text(log.path());
    const std::string content((std::istreambuf_iterator<char>(text)), std::istreambuf_iterator<char>());
    CHECK(content.find(secret) == std::string::npos);
  }
  return secret;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The steps of the checkpoint_committed events rank 0 recorded, oldest first.
std::vector<int64_t> committed_steps(const KeeldJob& job) {
  std::vector<int64_t> steps;
  for (const auto& e : job.events_of("checkpoint_committed")) steps.push_back(e.at("step"));
  return steps;
}

// A raw connection to keeld's control socket, for sending what keelctl never would.
int connect_raw(const std::string& socket_path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strcpy(address.sun_path, socket_path.c_str());
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  return fd;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("keeld resumes by itself after kill -9 of a random rank and ends bit-identical to an uninterrupted run") {
    KeeldJob reference;
    reference.run();
    const auto expected = reference.checkpoint_tensors(40);

    std::random_device seed_source;
    const unsigned seed = seed_source();
    std::mt19937 rng(seed);
    INFO("random seed " << seed);
    for (int trial = 0; trial < 10; ++trial) {
      const int64_t at_step = std::uniform_int_distribution<int64_t>(1, 34)(rng);
      INFO("trial " << trial << ": kill -9 of a random rank at step " << at_step);
      check_resumes_after_kill({}, at_step, rng, expected);
    }
  }

  TEST_CASE("keeld resumes a PP2 x CP2 job after kill -9 of a rank and ends bit-identical to an uninterrupted run") {
    // Four ranks: two pipeline stages, each two CP ranks that split the
    // positions and shard the optimizer state (ZeRO-1 over dp x cp).
    const std::vector<std::string> layout = {"parallel.dp=1", "parallel.tp=1", "parallel.pp=2", "parallel.cp=2",
                                             "parallel.micro_batches=2"};
    KeeldJob reference;
    reference.run(layout);
    const auto expected = reference.checkpoint_tensors(40);

    std::random_device seed_source;
    const unsigned seed = seed_source();
    std::mt19937 rng(seed);
    INFO("random seed " << seed);
    check_resumes_after_kill(layout, 12, rng, expected);
  }

  TEST_CASE("keeld resumes a Llama job after kill -9 of a random rank at a random step and ends bit-identical") {
    // DP2 x TP2: each TP rank holds one key/value head for two query heads.
    const std::vector<std::string> llama = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64",
                                            "model.tie_embeddings=false"};
    KeeldJob reference;
    reference.run(llama);
    const auto expected = reference.checkpoint_tensors(40);
    CHECK(std::any_of(expected.begin(), expected.end(),
                      [](const auto& tensor) { return contains(tensor.first, "model.layers.0.mlp.gate_proj"); }));

    std::random_device seed_source;
    const unsigned seed = seed_source();
    std::mt19937 rng(seed);
    INFO("random seed " << seed);
    check_resumes_after_kill(llama, std::uniform_int_distribution<int64_t>(1, 34)(rng), rng, expected);
  }

  TEST_CASE("SIGTERM to keeld commits a final checkpoint and keeld started again finishes bit-identical") {
    KeeldJob reference;
    reference.run();

    KeeldJob job;
    auto keeld = job.start();
    const auto status =
        job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 12; });
    // The ranks are frozen until keeld's SIGTERM is pending in each, so
    // that however slow this test is they cannot finish before the stop.
    std::vector<pid_t> ranks;
    for (const auto& r : status.at("ranks")) {
      ranks.push_back(r.at("pid").get<pid_t>());
      REQUIRE_MESSAGE(freeze(ranks.back()), "rank " << r.at("rank") << " finished before the stop");
    }
    keeld->signal(SIGTERM);
    for (const pid_t pid : ranks) REQUIRE(wait_until([&] { return signal_pending(pid, SIGTERM); }, 60));
    for (const pid_t pid : ranks) ::kill(pid, SIGCONT);
    const auto stopped = keeld->wait(300);
    INFO(stopped.output);
    REQUIRE(stopped.exit_code == 0);
    const auto stops = job.events_of("job_stopped");
    REQUIRE(stops.size() == 1);
    const int64_t stop_step = stops[0].at("checkpoint_step");
    CHECK(stop_step >= 12);
    CHECK(stop_step < 40);
    // The ranks stopped on request after their final checkpoint.
    for (const auto& code : job.events_of("generation_ended").at(0).at("exit_codes")) CHECK(code == 14);
    CHECK(std::filesystem::exists(checkpoint::step_dir(job.run_dir() / "checkpoints", stop_step) / "manifest.json"));
    const std::string first_secret = store_secret(job);
    CHECK(stopped.output.find(first_secret) == std::string::npos);

    job.run();
    const auto resumed = job.events_of("generation_resumed");
    REQUIRE(resumed.size() == 2);
    CHECK(resumed[1].at("generation") == 1);
    CHECK(resumed[1].at("step") == stop_step);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
    CHECK(job.losses() == reference.losses());
    // Each keeld start makes its own store secret (docs/architecture.md "Run directory").
    CHECK(store_secret(job) != first_secret);
  }

  TEST_CASE("a rank that always dies at start fails the job after K generations with the reason in status and events") {
    KeeldJob job;
    const std::vector<std::string> crash_loop = {"faults.crash_rank=1", "faults.crash_step=0",
                                                 "faults.crash_generation=-1", "daemon.crash_loop_generations=3"};
    // As a service keeld stays up after the failure, for keelctl.
    auto keeld = job.start(crash_loop, /*service=*/true);
    const auto status = job.wait_for([](const nlohmann::json& s) { return s.at("state") == "failed"; });
    const std::string reason = status.at("reason");
    CHECK(reason.find("crash loop") != std::string::npos);
    CHECK(reason.find("3 generations") != std::string::npos);
    CHECK(reason.find("rank 1 killed by SIGKILL") != std::string::npos);
    CHECK(status.at("generation") == 2);
    CHECK(job.events_of("generation_started").size() == 3);
    CHECK(job.events_of("restart_scheduled").size() == 2);
    const auto failed = job.events_of("job_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0].at("reason") == reason);

    const auto keelctl = run_process({keel_binary("keelctl").string(), "--socket", job.socket(), "status"});
    CHECK(keelctl.exit_code == 0);
    CHECK(keelctl.output.find("failed") != std::string::npos);
    CHECK(keelctl.output.find("crash loop") != std::string::npos);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(60).exit_code == 0);

    // In the foreground a failed job is keeld's exit 1.
    KeeldJob again;
    again.run(crash_loop, 1);
  }

  TEST_CASE("a final checkpoint that cannot be written fails the stop with the newest good checkpoint named") {
    KeeldJob job;
    NotifySocket notify(job.dir() / "notify.sock");
    auto keeld = job.start({"train.steps=400"}, false, {{"NOTIFY_SOCKET", notify.path()}});
    const auto status = job.wait_for([&](const nlohmann::json& s) {
      return s.at("state") == "running" && !job.events_of("checkpoint_committed").empty();
    });
    // A file-size limit below a rank file on every rank, as on a full disk:
    // every later save fails (EFBIG) while logs, metrics and events still fit.
    const rlimit limit{100000, 100000};
    for (const auto& rank : status.at("ranks")) {
      REQUIRE(prlimit(rank.at("pid").get<pid_t>(), RLIMIT_FSIZE, &limit, nullptr) == 0);
    }
    // The stop must land past the newest committed step, or there is
    // nothing left to save (seen: a stop right after step 5's commit
    // exited 0, rightly).
    const int64_t saved = committed_steps(job).back();
    job.wait_for([&](const nlohmann::json& s) { return step_of(s) > saved; });
    keeld->signal(SIGTERM);
    const auto result = keeld->wait(300);
    notify.stop();
    INFO(result.output);
    CHECK(result.exit_code == 1);
    const int64_t newest = committed_steps(job).back();
    const auto failed = job.events_of("final_checkpoint_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0].at("checkpoint_step") == newest);
    CHECK_FALSE(failed[0].at("cause").get<std::string>().empty());
    CHECK(job.events_of("job_stopped").empty());
    const auto job_failed = job.events_of("job_failed");
    REQUIRE(job_failed.size() == 1);
    const std::string reason = job_failed[0].at("reason");
    CHECK(contains(reason, "final checkpoint"));
    CHECK(contains(reason, fmt::format("step {}", newest)));
    // What systemd shows of keeld last: the job failed, and why.
    const auto statuses = notify.statuses();
    REQUIRE_FALSE(statuses.empty());
    CHECK(contains(statuses.back(), "failed"));
    CHECK(contains(statuses.back(), reason));
  }

  TEST_CASE("keeld reports the checkpoint the ranks resumed from when the newest one does not verify") {
    KeeldJob job;
    auto first = job.start();
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 12; });
    first->signal(SIGTERM);
    REQUIRE(first->wait(300).exit_code == 0);
    const auto committed = committed_steps(job);
    REQUIRE(committed.size() >= 2);
    const int64_t corrupt = committed.back(), older = committed[committed.size() - 2];
    // One flipped byte: the manifest still lists the file, its checksum no longer matches.
    {
      const auto file = checkpoint::step_dir(job.run_dir() / "checkpoints", corrupt) / checkpoint::rank_file_name(1);
      std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
      io.seekg(static_cast<std::streamoff>(std::filesystem::file_size(file) / 2));
      char byte = 0;
      io.read(&byte, 1);
      byte = static_cast<char>(byte ^ 0x10);
      io.seekp(static_cast<std::streamoff>(std::filesystem::file_size(file) / 2));
      io.write(&byte, 1);
    }

    // No scheduled saves: the newest good checkpoint stays the one resumed from.
    auto second = job.start({"checkpoint.verify=full", "checkpoint.every_steps=1000", "train.steps=400"},
                            /*service=*/true);
    const auto status =
        job.wait_for([](const nlohmann::json& s) { return s.at("generation") == 1 && s.at("state") == "running"; });
    CHECK(status.at("checkpoint_step") == older);
    const auto skipped = job.events_of("checkpoint_skipped");
    REQUIRE(skipped.size() == 1);
    CHECK(contains(skipped[0].at("dir"), fmt::format("{:08d}", corrupt)));
    const auto resumed = job.events_of("generation_resumed");
    REQUIRE(resumed.size() == 2);
    CHECK(resumed[1].at("generation") == 1);
    CHECK(resumed[1].at("step") == older);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(second->wait(120).exit_code == 0);
  }

  TEST_CASE("a data error only the ranks can see fails the job at once with the rank's own sentence") {
    KeeldJob job;
    // keeld never reads the data; the ranks refuse a file that is not a token shard (exit 3).
    const auto bad = job.dir() / "bad.bin";
    std::ofstream(bad, std::ios::binary) << std::string(4096, 'x');
    auto keeld = job.start({"data.train=" + bad.string()}, /*service=*/true);
    const auto status = job.wait_for([](const nlohmann::json& s) { return s.at("state") == "failed"; });
    const std::string reason = status.at("reason");
    CHECK(contains(reason, "exited 3 (data_error)"));
    CHECK(contains(reason, "wrong magic"));  // the rank's own sentence, from its log
    CHECK(status.at("generation") == 0);
    CHECK(job.events_of("generation_started").size() == 1);
    CHECK(job.events_of("restart_scheduled").empty());
    const auto failed = job.events_of("job_failed");
    REQUIRE(failed.size() == 1);
    CHECK(failed[0].at("reason") == reason);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(60).exit_code == 0);
  }

  TEST_CASE("garbage on the control socket gets error replies and leaves the loss sequence unchanged") {
    // Endless runs, so that every message arrives while the ranks train
    // however fast they are; each is stopped once past step 30, and the
    // steps both ran must agree.
    const std::vector<std::string> endless = {"train.steps=1000000"};
    auto stop_past_step_30 = [](const KeeldJob& job, ChildProcess& keeld) {
      job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 30; });
      CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
      const auto result = keeld.wait(300);
      INFO(result.output);
      REQUIRE(result.exit_code == 0);
    };
    KeeldJob reference;
    stop_past_step_30(reference, *reference.start(endless));

    KeeldJob job;
    auto keeld = job.start(endless);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running"; });

    const std::string oversized(70000, 'x');
    std::string deep(30000, '[');
    const std::vector<std::string> malformed = {
        "",
        "garbage",
        "{",
        "[]",
        "42",
        "null",
        "\"status\"",
        "{}",
        "{\"command\": 5}",
        "{\"command\": \"explode\"}",
        "{\"command\": \"status\", \"extra\": 1}",
        "{\"command\": \"events\", \"limit\": -1}",
        "{\"command\": \"events\", \"limit\": \"ten\"}",
        "{\"command\": \"events\", \"limit\": 1e300}",
        "{\"command\": \"stop\", \"checkpoint\": \"yes\"}",
        "{\"command\": \"restart\", \"now\": true}",
        std::string("{\"command\": \"\xff\xfe\"}"),
        std::string("\x00\x01\x02\xff", 4),
        deep,
        "{\"command\": \"status\"} trailing",
    };
    int replies = 0;
    auto send_line = [&](const std::string& payload, bool expect_close) {
      const int fd = connect_raw(job.socket());
      const std::string line = payload + "\n";
      size_t sent = 0;
      while (sent < line.size()) {
        const ssize_t n = send(fd, line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;  // keeld may close an oversized request early
        sent += static_cast<size_t>(n);
      }
      std::string reply;
      char chunk[4096];
      ssize_t n;
      while (reply.find('\n') == std::string::npos && (n = recv(fd, chunk, sizeof(chunk), 0)) > 0) {
        reply.append(chunk, static_cast<size_t>(n));
      }
      INFO("request: " << payload.substr(0, 80) << " reply: " << reply);
      REQUIRE(reply.find('\n') != std::string::npos);
      const auto parsed = nlohmann::json::parse(reply.substr(0, reply.find('\n')));
      CHECK(parsed.at("ok") == false);
      CHECK(!parsed.at("error").get<std::string>().empty());
      if (expect_close) CHECK(recv(fd, chunk, sizeof(chunk), 0) <= 0);  // EOF, or ECONNRESET for the unread rest
      close(fd);
      ++replies;
    };
    for (int round = 0; round < 9; ++round) {
      for (const auto& m : malformed) send_line(m, false);
    }
    for (int i = 0; i < 10; ++i) send_line(oversized, true);
    // A client that sends half a request and vanishes gets nothing and harms nothing.
    for (int i = 0; i < 10; ++i) {
      const int fd = connect_raw(job.socket());
      (void)!send(fd, "{\"command\": \"sta", 16, MSG_NOSIGNAL);
      close(fd);
    }
    CHECK(replies == 9 * 20 + 10);
    CHECK(job.ask(daemon::Command::kStatus).at("state") == "running");

    stop_past_step_30(job, *keeld);
    auto losses = job.losses();
    auto expected = reference.losses();
    const size_t common = std::min(losses.size(), expected.size());
    REQUIRE(common >= 30);
    losses.resize(common);
    expected.resize(common);
    CHECK(losses == expected);
    CHECK(job.events_of("rank_failed").empty());
  }

  TEST_CASE("a connection from a user who is not allowed gets an error reply and training goes on") {
    if (geteuid() != 0) {
      MESSAGE("skipped: switching to another uid needs root");
      return;
    }
    KeeldJob job;
    // nobody must reach the socket to be refused by keeld rather than by the filesystem.
    std::filesystem::permissions(job.dir(), std::filesystem::perms::owner_all | std::filesystem::perms::group_exec |
                                                std::filesystem::perms::others_exec);
    auto keeld = job.start({"train.steps=1000000"}, /*service=*/true);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running"; });

    const std::string reply = status_reply_as({65534, 65534, {}}, job.socket());
    INFO(reply);
    const auto parsed = nlohmann::json::parse(reply);
    CHECK(parsed.at("ok") == false);
    CHECK(parsed.at("error").get<std::string>().find("permission denied: uid 65534") != std::string::npos);

    const auto status = job.ask(daemon::Command::kStatus);
    CHECK(status.at("state") == "running");
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(120).exit_code == 0);
    CHECK(job.events_of("rank_failed").empty());
  }
}

TEST_SUITE("chaos") {
  TEST_CASE("one long run survives twenty kills of random ranks and ends bit-identical") {
    const std::vector<std::string> longer = {"train.steps=200"};
    KeeldJob reference;
    reference.run(longer);

    std::random_device seed_source;
    const unsigned seed = seed_source();
    std::mt19937 rng(seed);
    INFO("random seed " << seed);
    KeeldJob job;
    auto keeld = job.start(longer);
    int64_t at_step = 0;
    std::vector<int> victims;
    for (int kill = 0; kill < 20; ++kill) {
      // Past the next checkpoint each time, so every generation makes progress.
      at_step += std::uniform_int_distribution<int64_t>(6, 9)(rng);
      INFO("kill " << kill << " at step " << at_step);
      const auto status = job.wait_for([&](const nlohmann::json& s) {
        return s.at("state") == "running" && s.at("generation") == kill && step_of(s) >= at_step;
      });
      victims.push_back(kill_live_rank(status, rng));
      REQUIRE_MESSAGE(victims.back() >= 0, "every rank had finished before one could be killed");
    }
    const auto result = keeld->wait(600);
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    const auto failures = job.events_of("rank_failed");
    REQUIRE(failures.size() == 20);
    for (size_t i = 0; i < failures.size(); ++i) CHECK(failures[i].at("rank") == victims[i]);
    require_identical(job.checkpoint_tensors(200), reference.checkpoint_tensors(200));
  }
}

}  // namespace keel::test
