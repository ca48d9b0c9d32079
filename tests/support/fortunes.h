// The default corpus, the text of Debian's fortunes package (installed by
// scripts/setup), prepared as scripts/quickstart prepares it: for tests and
// benchmarks that train on real text, where the loss and the gradient norm
// move as they do in a real run.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace keel::test {

// The plain-text fortune files, as scripts/quickstart selects them; empty
// when the package is missing.
std::vector<std::string> fortune_files();

struct PreparedCorpus {
  std::string train_glob;  // data.train
  std::string val_glob;    // data.val
  double unigram_entropy_nats = 0;  // of the training bytes
};

// Runs keel-prepare-data over fortune_files() into `dir` (10% validation).
// Throws std::runtime_error saying what to do when the corpus is missing or
// the preparation fails.
PreparedCorpus prepare_fortunes(const std::filesystem::path& dir);

}  // namespace keel::test
