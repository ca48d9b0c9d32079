#include "tests/support/temp_dir.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <cstdlib>
#include <fstream>
#include <stdexcept>

namespace keel::test {

TempDir::TempDir() : TempDir(std::filesystem::temp_directory_path()) {}

TempDir::TempDir(const std::filesystem::path& parent) {
  std::string pattern = (parent / "keel-test-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::filesystem::path TempDir::write(const std::string& name, const std::string& text) const {
  auto file = path_ / name;
  std::filesystem::create_directories(file.parent_path());
  std::ofstream out(file, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + file.string());
  return file;
}

SmallTmpfs::SmallTmpfs(std::filesystem::path dir, const std::string& size) : dir_(std::move(dir)) {
  std::filesystem::create_directories(dir_);
  if (::geteuid() != 0) {
    why_ = "mounting a tmpfs needs root";
  } else if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, ("size=" + size).c_str()) != 0) {
    why_ = std::string("cannot mount a tmpfs here: ") + std::strerror(errno);
  }
}

SmallTmpfs::~SmallTmpfs() {
  if (mounted()) ::umount(dir_.c_str());
}

}  // namespace keel::test
