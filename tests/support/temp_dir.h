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

// A tmpfs of `size` (mount's syntax: "128k") mounted on `dir` (created),
// unmounted when the object goes away: a small filesystem that really
// fills up. Mounting needs root; why() says why it is not mounted.
class SmallTmpfs {
 public:
  SmallTmpfs(std::filesystem::path dir, const std::string& size);
  ~SmallTmpfs();
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;

  bool mounted() const { return why_.empty(); }
  const std::string& why() const { return why_; }

 private:
  std::filesystem::path dir_;
  std::string why_;
};

}  // namespace keel::test
