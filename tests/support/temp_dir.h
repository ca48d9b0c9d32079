#pragma once

#include <filesystem>
#include <string>

namespace keel::test {

// A fresh directory under the system temp dir (or under `parent`), removed
// with everything in it when the object goes away.
class TempDir {
 public:
  TempDir();
  explicit TempDir(const std::filesystem::path& parent);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

  // Writes text to a file below the directory and returns its path.
  std::filesystem::path write(const std::string& name, const std::string& text) const;

 private:
  std::filesystem::path path_;
};

}  // namespace keel::test
