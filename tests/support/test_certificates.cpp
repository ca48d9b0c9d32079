#include "tests/support/test_certificates.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <stdexcept>

#include "tests/support/process.h"

namespace keel::test {
namespace {

void openssl(const std::vector<std::string>& arguments) {
  std::vector<std::string> argv = {"openssl"};
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  const ProcessResult result = run_process(argv, {}, 60);
  if (result.exit_code != 0) {
    throw std::runtime_error(fmt::format("openssl {} failed: {}", fmt::join(arguments, " "), result.output));
  }
}

// A P-256 key and a certificate for `subject` signed by the CA, with the
// extensions in `extensions` (openssl's config syntax).
void issue(const std::filesystem::path& dir, const std::string& name, const std::string& subject,
           const std::string& extensions) {
  const auto base = (dir / name).string();
  std::ofstream(base + ".ext") << extensions << "\n";
  openssl({"req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", base + ".key",
           "-out", base + ".csr", "-subj", subject});
  openssl({"x509", "-req", "-in", base + ".csr", "-CA", (dir / "ca.pem").string(), "-CAkey", (dir / "ca.key").string(),
           "-CAcreateserial", "-days", "7", "-out", base + ".pem", "-extfile", base + ".ext"});
}

}  // namespace

TestCertificates make_test_certificates(const std::filesystem::path& dir,
                                        const std::vector<std::string>& server_addresses) {
  std::filesystem::create_directories(dir);
  openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
           (dir / "ca.key").string(), "-out", (dir / "ca.pem").string(), "-days", "7", "-subj",
           "/CN=keel test CA " + dir.filename().string()});
  std::string names = "DNS:localhost";
  for (const auto& address : server_addresses) names += ",IP:" + address;
  issue(dir, "server", "/CN=etcd", "subjectAltName=" + names + "\nextendedKeyUsage=serverAuth,clientAuth");
  issue(dir, "client", "/O=keel test client", "extendedKeyUsage=clientAuth");
  issue(dir, "named-client", "/CN=keel", "extendedKeyUsage=clientAuth");
  return {dir / "ca.pem",     dir / "server.pem",       dir / "server.key",
          dir / "client.pem", dir / "client.key",       dir / "named-client.pem",
          dir / "named-client.key"};
}

}  // namespace keel::test
