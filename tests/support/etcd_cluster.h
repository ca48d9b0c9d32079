// A real etcd cluster for tests: `members` etcd processes (Debian's
// etcd-server, which scripts/setup installs) on free loopback ports, with
// their data under a directory of the test's. Members can be killed and
// started again, and the leader found, so that a test can take away exactly
// the member it means to.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "store/etcd_gateway.h"
#include "tests/support/process.h"
#include "tests/support/test_certificates.h"

namespace keel::test {

class EtcdCluster {
 public:
  enum class Transport {
    kHttp,
    // Clients speak TLS to the members, which ask for a client certificate
    // signed by the cluster's own CA (etcd's --client-cert-auth).
    kTls,
  };

  // Why no cluster can be started here, or empty when one can.
  static std::string unavailable_reason();

  // Starts the members and returns once one of them leads; throws
  // std::runtime_error with the members' logs when they do not form a
  // cluster within a minute.
  // `also_on`: another local address every member serves clients on too
  // (a veth's, for a node in a network namespace); empty: loopback only.
  explicit EtcdCluster(const std::filesystem::path& dir, int members = 3, std::string also_on = "",
                       Transport transport = Transport::kHttp);
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "etcd://127.0.0.1:P0,127.0.0.1:P1,...[/prefix]": every member, as a
  // store address; over TLS with the client certificate's files as its query.
  std::string address(const std::string& prefix = "") const;
  // The same through `also_on` instead of 127.0.0.1.
  std::string address_on_also(const std::string& prefix = "") const;
  // What a client needs for TLS (nothing over HTTP).
  store::EtcdTls client_tls() const;
  // The files behind it, with the server's; only over TLS.
  const TestCertificates& certificates() const { return certificates_; }
  // "127.0.0.1:P", one member's client endpoint.
  std::string endpoint(int member) const;
  // The member that leads now, as the running members see it; -1 when none
  // answers with a leader.
  int leader() const;
  bool running(int member) const { return members_[member].process != nullptr; }
  // SIGKILL, and reaped.
  void kill(int member);
  // Starts a killed member again on its ports and data.
  void start(int member);
  // Turns on etcd's authentication with a root user and `user`, whose
  // `password` may read and write only keys under `prefix`; throws
  // std::runtime_error with etcdctl's output when a step fails.
  void enable_auth(const std::string& user, const std::string& password, const std::string& prefix) const;
  // Turns authentication off and on again (root's password is root-pw):
  // every token etcd handed out is void, as when a simple token outlives
  // its TTL.
  void void_tokens() const;
  // The end of a member's log, for a failure's message.
  std::string log_tail(int member) const;

 private:
  struct Member {
    std::string name;
    int client_port = 0;
    int peer_port = 0;
    std::unique_ptr<ChildProcess> process;
  };
  bool start_all();
  void launch(int member);

  std::filesystem::path dir_;
  std::string also_on_;
  Transport transport_;
  TestCertificates certificates_;
  std::string token_;
  std::vector<Member> members_;
};

}  // namespace keel::test
