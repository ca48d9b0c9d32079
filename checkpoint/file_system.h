// The file operations whose failure decides whether a checkpoint is safe:
// reserving space, syncing, renaming and reading back. Checkpointer, the
// catalog and ShardWriter reach the disk through this interface, so a test
// can break exactly one operation (LevelDB's EnvWrapper pattern): wrap
// FileSystem::real() in a FileSystemWrapper and override what it breaks.
//
// Every operation throws Error(kCheckpointFailure) naming the path and the
// system's reason. Implementations must be safe to call from several
// threads (each rank's writer thread and its training thread use it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace keel::checkpoint {

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // Allocates the blocks of [0, bytes) of an existing file (growing it when
  // shorter): once it returns, writes inside that range cannot fail for
  // lack of space (a full disk, a quota, a file-size limit).
  virtual void reserve(const std::filesystem::path& file, uint64_t bytes) = 0;
  // fsync of a file or a directory.
  virtual void sync(const std::filesystem::path& path) = 0;
  // rename(2): `to` must not exist (a committed checkpoint is never
  // replaced by a rename; see exchange).
  virtual void rename(const std::filesystem::path& from, const std::filesystem::path& to) = 0;
  // Swaps two existing paths atomically (renameat2 RENAME_EXCHANGE): at
  // every instant each name holds one complete directory.
  virtual void exchange(const std::filesystem::path& a, const std::filesystem::path& b) = 0;
  virtual void remove_all(const std::filesystem::path& path) = 0;
  // XXH3-64 of the whole file as 16 hex digits. A failure to read (EIO,
  // EACCES) throws: it says nothing about the bytes.
  virtual std::string checksum(const std::filesystem::path& file) = 0;

  // The real filesystem.
  static FileSystem& real();
};

// Forwards every operation to `target`; a test derives from it and
// overrides only what it breaks.
class FileSystemWrapper : public FileSystem {
 public:
  explicit FileSystemWrapper(FileSystem& target) : target_(target) {}
  void reserve(const std::filesystem::path& file, uint64_t bytes) override { target_.reserve(file, bytes); }
  void sync(const std::filesystem::path& path) override { target_.sync(path); }
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) override { target_.rename(from, to); }
  void exchange(const std::filesystem::path& a, const std::filesystem::path& b) override { target_.exchange(a, b); }
  void remove_all(const std::filesystem::path& path) override { target_.remove_all(path); }
  std::string checksum(const std::filesystem::path& file) override { return target_.checksum(file); }

 private:
  FileSystem& target_;
};

}  // namespace keel::checkpoint
