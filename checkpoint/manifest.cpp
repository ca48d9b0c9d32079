#include "checkpoint/manifest.h"

#include "checkpoint/file_system.h"
#include "checkpoint/paths.h"
#include "common/error.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace keel::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& what) { throw common::Error(common::ErrorCode::kCheckpointFailure, what); }

std::string errno_text() { return std::strerror(errno); }

}  // namespace

nlohmann::json Manifest::to_json() const {
  nlohmann::json files_json = nlohmann::json::array();
  for (const auto& f : files) files_json.push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh3", f.xxh3}});
  return {{"format", "keel-checkpoint-1"}, {"step", step},     {"tokens", tokens}, {"created", created},
          {"config", config},              {"layout", layout}, {"files", files_json}};
}

Manifest Manifest::from_json(const nlohmann::json& json) {
  try {
    if (json.at("format") != "keel-checkpoint-1") fail("unknown manifest format " + json.at("format").dump());
    Manifest m;
    m.step = json.at("step").get<int64_t>();
    m.tokens = json.at("tokens").get<int64_t>();
    m.created = json.at("created").get<std::string>();
    m.config = json.at("config");
    m.layout = json.at("layout");
    for (const auto& f : json.at("files")) {
      m.files.push_back(
          ManifestFile{f.at("name").get<std::string>(), f.at("bytes").get<uint64_t>(), f.at("xxh3").get<std::string>()});
    }
    if (m.step < 0 || m.files.empty()) fail("manifest has a negative step or no files");
    return m;
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("malformed manifest: ") + e.what());
  }
}

void write_manifest(const std::filesystem::path& dir, const Manifest& manifest) {
  const auto path = dir / kManifestFile;
  {
    std::ofstream out(path, std::ios::trunc);
    out << manifest.to_json().dump(2) << "\n";
    if (!out.flush()) fail(fmt::format("cannot write {}: {}", path.string(), errno_text()));
  }
  fsync_path(path);
}

Manifest read_manifest(const std::filesystem::path& dir) {
  const auto path = dir / kManifestFile;
  std::ifstream in(path);
  if (!in) fail(fmt::format("{} has no manifest.json: not a committed checkpoint", dir.string()));
  try {
    return Manifest::from_json(nlohmann::json::parse(in));
  } catch (const nlohmann::json::exception& e) {
    fail(fmt::format("{}: not valid JSON: {}", path.string(), e.what()));
  } catch (const common::Error& e) {
    fail(fmt::format("{}: {}", path.string(), e.what()));
  }
}

std::string file_xxh3(const std::filesystem::path& path) { return FileSystem::real().checksum(path); }

std::vector<std::string> verify_files(const std::filesystem::path& dir, const Manifest& manifest, bool checksums,
                                      FileSystem& fs) {
  std::vector<std::string> problems;
  for (const auto& f : manifest.files) {
    const auto path = dir / f.name;
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) {
      problems.push_back(fmt::format("{} is missing", path.string()));
    } else if (size != f.bytes) {
      problems.push_back(fmt::format("{} has {} bytes, the manifest says {}", path.string(), size, f.bytes));
    } else if (!checksums) {
      continue;
    } else if (const auto sum = fs.checksum(path); sum != f.xxh3) {
      problems.push_back(fmt::format("{} has checksum {}, the manifest says {}", path.string(), sum, f.xxh3));
    }
  }
  return problems;
}

void fsync_path(const std::filesystem::path& path) { FileSystem::real().sync(path); }

}  // namespace keel::checkpoint
