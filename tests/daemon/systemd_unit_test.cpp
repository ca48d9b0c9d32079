// The files under systemd/ as systemd's own tools read them: the unit must
// verify without a single warning (systemd ignores a misspelt or misplaced
// key with only a log line, so a typo would silently drop hardening), and
// the sysusers.d / tmpfiles.d snippets must parse and do what they say.
// Nothing here touches the machine: the tools run on temporary roots.
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace {

// The sources' systemd/ folder, found from this file (CMake compiles it by
// its absolute path) so the daemon tests need no extra definitions.
const fs::path kSystemdDir = fs::path(KEEL_SOURCE_DIR) / "systemd";

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in, "cannot read ", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The tools ship in Debian's systemd package (scripts/setup installs it);
// a machine without them skips these cases.
bool have_tool(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && ::access((fs::path(dir) / name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("keeld.service passes systemd-analyze verify without a warning") {
    if (!have_tool("systemd-analyze")) {
      MESSAGE("skipped: systemd-analyze not installed");
      return;
    }
    // verify checks that ExecStart names an executable, so point it at the
    // keeld of this build instead of the installed path.
    const fs::path keeld = keel::test::keel_binary("keeld");
    REQUIRE_MESSAGE(fs::exists(keeld), keeld.string(), " is not built");
    std::string unit = read_text(kSystemdDir / "keeld.service");
    const std::string installed = "ExecStart=/usr/local/bin/keeld ";
    const auto at = unit.find(installed);
    REQUIRE_MESSAGE(at != std::string::npos, "keeld.service no longer starts ", installed);
    unit.replace(at, installed.size(), "ExecStart=" + keeld.string() + " ");

    keel::test::TempDir dir;
    const fs::path file = dir.write("keeld.service", unit);
    const auto result = keel::test::run_process({"systemd-analyze", "verify", file.string()}, {}, 60);
    INFO("systemd-analyze verify said:\n", result.output);
    CHECK(result.exit_code == 0);
    CHECK(result.output.empty());
  }

  TEST_CASE("keel.sysusers.conf creates the keel system user and group") {
    if (!have_tool("systemd-sysusers")) {
      MESSAGE("skipped: systemd-sysusers not installed");
      return;
    }
    // An empty root: --dry-run only reports what it would add there.
    keel::test::TempDir root;
    const fs::path conf = kSystemdDir / "keel.sysusers.conf";
    const auto result =
        keel::test::run_process({"systemd-sysusers", "--dry-run", "--root=" + root.path().string(), conf.string()}, {}, 60);
    INFO("systemd-sysusers said:\n", result.output);
    CHECK(result.exit_code == 0);
    CHECK(result.output.find("Creating group 'keel'") != std::string::npos);
    CHECK(result.output.find("Creating user 'keel'") != std::string::npos);
    // Parse problems are reported as "<file>:<line>: ..." without failing.
    CHECK(result.output.find(conf.string() + ":") == std::string::npos);
    CHECK(fs::is_empty(root.path()));
  }

  TEST_CASE("keel.tmpfiles.conf creates the state and config directories") {
    if (!have_tool("systemd-tmpfiles")) {
      MESSAGE("skipped: systemd-tmpfiles not installed");
      return;
    }
    // tmpfiles has no dry run: create into a temporary root whose own
    // passwd maps keel to whoever runs the test, so the chown succeeds
    // without privileges.
    keel::test::TempDir root;
    root.write("etc/passwd", fmt::format("keel:x:{}:{}::/var/lib/keel:/usr/sbin/nologin\n", ::getuid(), ::getgid()));
    root.write("etc/group", fmt::format("keel:x:{}:\n", ::getgid()));
    const fs::path conf = kSystemdDir / "keel.tmpfiles.conf";
    const auto result = keel::test::run_process(
        {"systemd-tmpfiles", "--create", "--root=" + root.path().string(), conf.string()}, {}, 60);
    INFO("systemd-tmpfiles said:\n", result.output);
    CHECK(result.exit_code == 0);
    CHECK(result.output.empty());
    const fs::path state = root / "var/lib/keel";
    REQUIRE(fs::is_directory(state));
    CHECK((fs::status(state).permissions() & fs::perms::all) ==
          (fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec));
    CHECK(fs::is_directory(root / "etc/keel"));
  }
}
