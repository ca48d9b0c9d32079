#include "trainer/data/megatron_dataset.h"

#include "common/error.h"
#include "common/log.h"
#include "common/unique_fd.h"
#include "trainer/data/token_scan.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

constexpr size_t kHeaderBytes = kMegatronMagic.size() + 8 + 1 + 8 + 8;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::kDataError, fmt::format("{}: {}", path, what));
}

template <class T> T read_at(const std::vector<char>& bytes, size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}

}  // namespace

bool MegatronDataset::exists(const std::string& prefix) { return std::filesystem::is_regular_file(prefix + ".idx"); }

MegatronDataset MegatronDataset::open(const std::string& prefix, int64_t vocab_size, int64_t min_tokens) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  std::ifstream in(idx_path, std::ios::binary);
  if (!in) fail(idx_path, fmt::format("cannot open: {}", std::strerror(errno)));
  const std::vector<char> idx((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (idx.size() < kHeaderBytes) {
    fail(idx_path, fmt::format("{} bytes, shorter than the {}-byte header of a Megatron-LM index", idx.size(),
                               kHeaderBytes));
  }
  if (std::string_view(idx.data(), kMegatronMagic.size()) != kMegatronMagic) {
    fail(idx_path, "wrong magic: a Megatron-LM index starts with \"MMIDIDX\\0\\0\" (made by its "
                   "preprocess_data.py or IndexedDatasetBuilder)");
  }
  const auto version = read_at<uint64_t>(idx, 9);
  if (version != kMegatronVersion) {
    fail(idx_path, fmt::format("index version {}: keel reads version {}", version, kMegatronVersion));
  }
  const auto code = static_cast<uint8_t>(idx[17]);
  MegatronDataset data;
  if (code == kMegatronUint16) {
    data.token_bytes_ = 2;
  } else if (code == kMegatronInt32) {
    data.token_bytes_ = 4;
  } else {
    fail(idx_path, fmt::format("dtype code {}: keel reads tokens of uint16 (code 8) and int32 (code 4)", code));
  }
  const auto sequences = read_at<uint64_t>(idx, 18);
  const auto documents = read_at<uint64_t>(idx, 26);
  // Lengths, offsets and the document index; a multimodal index adds a mode
  // byte per sequence.
  constexpr uint64_t kMax = uint64_t{1} << 40;
  const uint64_t needed = sequences < kMax && documents < kMax ? kHeaderBytes + sequences * 12 + documents * 8 : 0;
  if (needed == 0 || (idx.size() != needed && idx.size() != needed + sequences)) {
    fail(idx_path, fmt::format("the index is {} bytes, but its {} sequences and {} documents take {}: it is "
                               "truncated or corrupt",
                               idx.size(), sequences, documents, needed));
  }
  const std::string bin = bin_path;
  common::UniqueFd fd(::open(bin.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(bin, fmt::format("cannot open: {}: a Megatron-LM dataset is PREFIX.idx with PREFIX.bin", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(bin, fmt::format("cannot stat: {}", std::strerror(errno)));
  const auto bin_bytes = static_cast<uint64_t>(st.st_size);

  // Megatron writes the sequences back to back: each offset is the one
  // before plus its length in bytes, and the last ends the file.
  const size_t lengths_at = kHeaderBytes, offsets_at = lengths_at + sequences * 4, documents_at = offsets_at + sequences * 8;
  uint64_t expected_offset = 0;
  for (uint64_t s = 0; s < sequences; ++s) {
    const auto length = read_at<int32_t>(idx, lengths_at + s * 4);
    const auto offset = read_at<int64_t>(idx, offsets_at + s * 8);
    if (length < 0 || offset < 0 || static_cast<uint64_t>(offset) != expected_offset) {
      fail(idx_path, fmt::format("sequence {} has length {} at byte {} where the sequences before it end at byte {}: "
                                 "the lengths and offsets disagree",
                                 s, length, offset, expected_offset));
    }
    expected_offset += static_cast<uint64_t>(length) * data.token_bytes_;
  }
  if (expected_offset != bin_bytes) {
    fail(bin, fmt::format("{} bytes, but the index's {} sequences take {} bytes: the .bin and the .idx do not "
                          "belong together, or one is truncated",
                          bin_bytes, sequences, expected_offset));
  }
  int64_t previous = -1;
  for (uint64_t d = 0; d < documents; ++d) {
    const auto first = read_at<int64_t>(idx, documents_at + d * 8);
    const bool ends = d + 1 == documents;
    if (first < previous || first < 0 || static_cast<uint64_t>(first) > sequences || (d == 0 && first != 0) ||
        (ends && static_cast<uint64_t>(first) != sequences)) {
      fail(idx_path, fmt::format("document index entry {} is {}: it runs from 0 to the sequence count {}, never "
                                 "decreasing",
                                 d, first, sequences));
    }
    previous = first;
  }
  data.sequences_ = static_cast<int64_t>(sequences);
  data.documents_ = documents > 0 ? static_cast<int64_t>(documents) - 1 : 0;
  data.num_tokens_ = static_cast<int64_t>(bin_bytes / data.token_bytes_);
  if (data.num_tokens_ < min_tokens) {
    fail(bin, fmt::format("{} tokens, fewer than the {} needed: add data or lower model.seq_len", data.num_tokens_,
                          min_tokens));
  }
  data.map_ = ::mmap(nullptr, bin_bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (data.map_ == MAP_FAILED) {
    data.map_ = nullptr;
    fail(bin, fmt::format("cannot mmap {} bytes: {}", bin_bytes, std::strerror(errno)));
  }
  data.map_bytes_ = bin_bytes;
  ::madvise(data.map_, bin_bytes, MADV_SEQUENTIAL);
  if (const auto bad = first_token_outside(data.map_, data.token_bytes_, data.num_tokens_, vocab_size)) {
    // int32 tokens were scanned as uint32: a negative one shows as itself.
    const auto as_read = [&](int64_t t) {
      return data.token_bytes_ == 4 && t > std::numeric_limits<int32_t>::max() ? t - (int64_t{1} << 32) : t;
    };
    fail(bin, fmt::format("token {} at token offset {} (byte {}) is outside model.vocab_size {}: set model.vocab_size "
                          "to the tokenizer's, or re-tokenize",
                          as_read(bad->token), bad->index, bad->index * static_cast<int64_t>(data.token_bytes_),
                          vocab_size));
  }
  ::madvise(data.map_, bin_bytes, MADV_RANDOM);
  common::logger("data")->info("Megatron-LM dataset {}: {} documents, {} sequences, {} tokens of {} bytes", prefix,
                               data.documents_, data.sequences_, data.num_tokens_, data.token_bytes_);
  return data;
}

MegatronDataset::MegatronDataset(MegatronDataset&& other) noexcept
    : map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      token_bytes_(other.token_bytes_),
      num_tokens_(other.num_tokens_),
      sequences_(other.sequences_),
      documents_(other.documents_) {}

MegatronDataset& MegatronDataset::operator=(MegatronDataset&& other) noexcept {
  std::swap(map_, other.map_);
  std::swap(map_bytes_, other.map_bytes_);
  token_bytes_ = other.token_bytes_;
  num_tokens_ = other.num_tokens_;
  sequences_ = other.sequences_;
  documents_ = other.documents_;
  return *this;
}

MegatronDataset::~MegatronDataset() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void MegatronDataset::copy(int64_t pos, int64_t count, int32_t* out) const {
  copy_tokens(map_, token_bytes_, pos, count, out);
}

}  // namespace keel::trainer
