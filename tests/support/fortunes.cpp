#include "tests/support/fortunes.h"

#include "tests/support/process.h"

#include <algorithm>
#include <stdexcept>

namespace keel::test {

std::vector<std::string> fortune_files() {
  std::vector<std::string> files;
  const std::filesystem::path dir = "/usr/share/games/fortunes";
  if (!std::filesystem::is_directory(dir)) return files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    // Skip the .dat indexes and the .u8 links.
    const auto ext = entry.path().extension();
    if (entry.is_regular_file() && !entry.is_symlink() && ext != ".dat" && ext != ".u8") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

PreparedCorpus prepare_fortunes(const std::filesystem::path& dir) {
  const auto files = fortune_files();
  if (files.empty()) {
    throw std::runtime_error("the fortunes corpus is missing: run scripts/setup (it installs Debian's fortunes)");
  }
  std::vector<std::string> argv = {keel_binary("keel-prepare-data").string(), "--out", dir.string(), "--name",
                                   "fortunes", "--val-fraction", "0.1", "--json"};
  argv.insert(argv.end(), files.begin(), files.end());
  const auto prepared = run_process(argv, {}, 300);
  if (prepared.exit_code != 0) {
    throw std::runtime_error("keel-prepare-data exited " + std::to_string(prepared.exit_code) + ":\n" +
                             prepared.output);
  }
  PreparedCorpus corpus;
  corpus.train_glob = (dir / "fortunes_train_*.bin").string();
  corpus.val_glob = (dir / "fortunes_val_*.bin").string();
  corpus.unigram_entropy_nats = last_json_line(prepared.output).at("train_unigram_entropy_nats").get<double>();
  return corpus;
}

}  // namespace keel::test
