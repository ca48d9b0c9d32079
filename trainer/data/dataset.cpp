#include "trainer/data/dataset.h"

#include "common/error.h"
#include "common/log.h"

#include <glob.h>

#include <fmt/format.h>

#include <algorithm>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

std::vector<std::string> glob_paths(const std::string& pattern) {
  glob_t matches{};
  int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
  std::vector<std::string> paths;
  if (rc == 0) paths.assign(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
  ::globfree(&matches);
  if (rc == GLOB_NOMATCH) {
    throw Error(ErrorCode::kDataError,
                fmt::format("{}: no token shards match this pattern: run keel-prepare-data to create them, "
                            "or fix the data path in the config",
                            pattern));
  }
  if (rc != 0) {
    throw Error(ErrorCode::kDataError,
                fmt::format("{}: cannot expand the pattern ({}): check that its directories exist and are readable",
                            pattern, rc == GLOB_NOSPACE ? "out of memory" : "read error"));
  }
  // glob(3) sorts by the locale's collation; byte order makes the stream,
  // and with it every batch, the same on every machine.
  std::sort(paths.begin(), paths.end());
  return paths;
}

}  // namespace

TokenDataset TokenDataset::open(const std::string& glob_pattern, int64_t vocab_size, int64_t min_tokens) {
  TokenDataset data;
  for (const auto& path : glob_paths(glob_pattern)) {
    data.starts_.push_back(data.total_tokens_);
    data.shards_.push_back(TokenShard::open(path, vocab_size));
    data.total_tokens_ += data.shards_.back().size();
  }
  if (data.total_tokens_ < min_tokens) {
    throw Error(ErrorCode::kDataError,
                fmt::format("{}: the dataset holds {} tokens in {} shard(s), fewer than the {} needed: "
                            "add data or lower model.seq_len",
                            glob_pattern, data.total_tokens_, data.shards_.size(), min_tokens));
  }
  common::logger("data")->info("dataset {}: {} shard(s), {} tokens", glob_pattern, data.shards_.size(),
                               data.total_tokens_);
  return data;
}

void TokenDataset::copy(int64_t pos, int64_t count, int32_t* out) const {
  if (pos < 0 || count < 0 || pos + count > total_tokens_) {
    throw Error(ErrorCode::kInternal,
                fmt::format("TokenDataset::copy({}, {}) is outside the {}-token stream", pos, count, total_tokens_));
  }
  // The last shard starting at or before pos holds it; empty shards share
  // their start with the next one and are skipped by upper_bound.
  auto shard = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
  while (count > 0) {
    const TokenShard& s = shards_[shard];
    const int64_t offset = pos - starts_[shard];
    const int64_t n = std::min(count, s.size() - offset);
    s.copy(offset, n, out);
    out += n;
    pos += n;
    count -= n;
    ++shard;
  }
}

}  // namespace keel::trainer
