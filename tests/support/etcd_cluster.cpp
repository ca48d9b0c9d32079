#include "tests/support/etcd_cluster.h"

#include "tests/support/free_ports.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "store/etcd_gateway.h"
#include "tests/support/wait.h"

namespace keel::test {
namespace {

constexpr const char* kEtcd = "etcd";

// Whether a child has exited (a zombie not yet reaped, or gone).
bool exited(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string pid_field, name, state;
  if (!(stat >> pid_field >> name >> state)) return true;
  return state == "Z";
}

std::string url(int port, const std::string& host = "127.0.0.1", const char* scheme = "http") {
  return fmt::format("{}://{}:{}", scheme, host, port);
}

}  // namespace

std::string EtcdCluster::unavailable_reason() {
  ProcessResult version = run_process({kEtcd, "--version"}, {}, 30);
  if (version.exit_code != 0) {
    return "etcd is not installed (scripts/setup installs Debian's etcd-server): " + version.output.substr(0, 200);
  }
  return "";
}

EtcdCluster::EtcdCluster(const std::filesystem::path& dir, int members, std::string also_on, Transport transport)
    : dir_(dir), also_on_(std::move(also_on)), transport_(transport) {
  if (transport_ == Transport::kTls) {
    std::vector<std::string> addresses = {"127.0.0.1"};
    if (!also_on_.empty()) addresses.push_back(also_on_);
    certificates_ = make_test_certificates(dir_ / "pki", addresses);
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    members_.clear();
    members_.resize(members);
    std::vector<int> ports = free_loopback_ports(2 * members);
    token_ = "keel-test-" + std::to_string(getpid()) + "-" + std::to_string(ports[0]);
    for (int i = 0; i < members; ++i) {
      members_[i].name = fmt::format("m{}", i);
      members_[i].client_port = ports[2 * i];
      members_[i].peer_port = ports[2 * i + 1];
      std::filesystem::remove_all(dir_ / members_[i].name);
    }
    if (start_all()) return;
  }
  std::string logs;
  for (int i = 0; i < members; ++i) logs += "\n--- " + members_[i].name + "\n" + log_tail(i);
  for (int i = 0; i < members; ++i) kill(i);
  throw std::runtime_error("the etcd test cluster did not form:" + logs);
}

bool EtcdCluster::start_all() {
  for (int i = 0; i < size(); ++i) launch(i);
  bool formed = wait_until(
      [&] {
        for (int i = 0; i < size(); ++i) {
          // A member that exited at once lost its port to another process.
          if (exited(members_[i].process->pid())) return true;
        }
        return leader() >= 0;
      },
      60);
  if (formed && leader() >= 0) return true;
  for (int i = 0; i < size(); ++i) kill(i);
  return false;
}

void EtcdCluster::launch(int member) {
  std::string cluster;
  for (const auto& m : members_) cluster += (cluster.empty() ? "" : ",") + m.name + "=" + url(m.peer_port);
  Member& m = members_[member];
  const char* client_scheme = transport_ == Transport::kTls ? "https" : "http";
  std::vector<std::string> argv = {
      kEtcd, "--name=" + m.name, "--data-dir=" + (dir_ / m.name).string(),
      "--listen-client-urls=" + url(m.client_port, "127.0.0.1", client_scheme) +
          (also_on_.empty() ? "" : "," + url(m.client_port, also_on_, client_scheme)),
      "--advertise-client-urls=" + url(m.client_port, "127.0.0.1", client_scheme),
      "--listen-peer-urls=" + url(m.peer_port),
      "--initial-advertise-peer-urls=" + url(m.peer_port), "--initial-cluster=" + cluster,
      "--initial-cluster-token=" + token_,
      // A member started again finds its cluster in its data.
      "--initial-cluster-state=new", "--logger=zap", "--log-outputs=" + (dir_ / (m.name + ".log")).string()};
  if (transport_ == Transport::kTls) {
    argv.insert(argv.end(), {"--cert-file=" + certificates_.server_cert.string(),
                             "--key-file=" + certificates_.server_key.string(),
                             "--trusted-ca-file=" + certificates_.ca.string(), "--client-cert-auth"});
  }
  m.process = std::make_unique<ChildProcess>(argv);
}

EtcdCluster::~EtcdCluster() {
  for (int i = 0; i < size(); ++i) kill(i);
}

std::string EtcdCluster::address(const std::string& prefix) const {
  std::string address = "etcd://";
  for (int i = 0; i < size(); ++i) address += fmt::format("{}{}", i ? "," : "", endpoint(i));
  if (!prefix.empty()) address += fmt::format("/{}", prefix);
  return store::etcd_address_with_tls(address, client_tls());
}

std::string EtcdCluster::address_on_also(const std::string& prefix) const {
  std::string address = "etcd://";
  for (int i = 0; i < size(); ++i) address += fmt::format("{}{}:{}", i ? "," : "", also_on_, members_[i].client_port);
  if (!prefix.empty()) address += fmt::format("/{}", prefix);
  return store::etcd_address_with_tls(address, client_tls());
}

store::EtcdTls EtcdCluster::client_tls() const {
  if (transport_ != Transport::kTls) return {};
  return {certificates_.ca.string(), certificates_.client_cert.string(), certificates_.client_key.string()};
}

namespace {

// Runs each etcdctl command (its arguments after the endpoints) in turn on
// `cluster`; throws std::runtime_error with the output of the first that fails.
void run_etcdctl(const EtcdCluster& cluster, const std::vector<std::vector<std::string>>& commands) {
  std::string endpoints = "--endpoints=";
  for (int m = 0; m < cluster.size(); ++m) endpoints += (m > 0 ? "," : "") + cluster.endpoint(m);
  std::vector<std::string> tls;
  if (const store::EtcdTls files = cluster.client_tls(); files.on()) {
    tls = {"--cacert=" + files.ca_file, "--cert=" + files.cert_file, "--key=" + files.key_file};
  }
  for (const auto& command : commands) {
    std::vector<std::string> argv = {"etcdctl", endpoints};
    argv.insert(argv.end(), tls.begin(), tls.end());
    argv.insert(argv.end(), command.begin(), command.end());
    const auto result = run_process(argv, {}, 60);
    if (result.exit_code != 0) {
      throw std::runtime_error(fmt::format("etcdctl {} failed: {}", fmt::join(command, " "), result.output));
    }
  }
}

}  // namespace

void EtcdCluster::enable_auth(const std::string& user, const std::string& password,
                              const std::string& prefix) const {
  const std::string role = user + "-role";
  run_etcdctl(*this, {{"user", "add", "root:root-pw", "--interactive=false"},
                      {"user", "add", user + ":" + password, "--interactive=false"},
                      {"role", "add", role},
                      {"role", "grant-permission", role, "--prefix=true", "readwrite", prefix},
                      {"user", "grant-role", user, role},
                      {"auth", "enable"}});
}

void EtcdCluster::void_tokens() const {
  run_etcdctl(*this, {{"--user=root:root-pw", "auth", "disable"}, {"auth", "enable"}});
}

std::string EtcdCluster::endpoint(int member) const {
  return "127.0.0.1:" + std::to_string(members_[member].client_port);
}

int EtcdCluster::leader() const {
  std::map<std::string, int> by_id;
  std::string leader_id;
  for (int i = 0; i < size(); ++i) {
    if (!running(i)) continue;
    try {
      store::EtcdOptions options;
      options.endpoints = {{"127.0.0.1", static_cast<uint16_t>(members_[i].client_port)}};
      options.timeout = std::chrono::milliseconds(1000);
      options.tls = client_tls();
      store::EtcdGateway gateway(options);
      auto status =
          gateway.call("/v3/maintenance/status", nlohmann::json::object(), store::EtcdGateway::Retry::kIdempotent);
      by_id[status.at("header").value("member_id", "")] = i;
      std::string id = status.value("leader", "");
      if (!id.empty() && id != "0") leader_id = id;
    } catch (const std::exception&) {
      // Starting, or cut off: it says nothing about the leader.
    }
  }
  auto it = by_id.find(leader_id);
  return it == by_id.end() ? -1 : it->second;
}

void EtcdCluster::kill(int member) {
  Member& m = members_[member];
  if (!m.process) return;
  m.process->signal(SIGKILL);
  m.process->wait(30);
  m.process.reset();
}

void EtcdCluster::start(int member) {
  if (!running(member)) launch(member);
}

std::string EtcdCluster::log_tail(int member) const {
  std::ifstream in(dir_ / (members_[member].name + ".log"));
  std::stringstream text;
  text << in.rdbuf();
  std::string all = text.str();
  return all.size() > 2000 ? all.substr(all.size() - 2000) : all;
}

}  // namespace keel::test
