// Certificates for tests of TLS, made by the openssl tool (Debian's openssl,
// which scripts/setup installs): a CA of their own, a server certificate
// for the addresses a test's servers listen on, and a client certificate.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace keel::test {

struct TestCertificates {
  std::filesystem::path ca;  // PEM, the CA that signed the others
  std::filesystem::path server_cert;
  std::filesystem::path server_key;
  std::filesystem::path client_cert;  // for clientAuth
  std::filesystem::path client_key;
  // Another client certificate of the CA, with Common Name "keel".
  std::filesystem::path named_client_cert;
  std::filesystem::path named_client_key;
};

// Makes them under `dir` (created); the server certificate names each of
// `server_addresses` (IP addresses) and "localhost". The client certificate
// has no Common Name, as etcd's JSON gateway wants with its authentication
// on. Throws std::runtime_error with openssl's output when a step fails.
TestCertificates make_test_certificates(const std::filesystem::path& dir,
                                        const std::vector<std::string>& server_addresses);

}  // namespace keel::test
