// A Megatron-LM indexed dataset as one token stream (docs/architecture.md
// "Data"): PREFIX.idx holds the header (the 9 bytes "MMIDIDX\0\0", version
// 1 as uint64, a dtype code as uint8, the sequence and document counts as
// uint64), then every sequence's length (int32), its byte offset in
// PREFIX.bin (int64) and the document index (int64, sequence numbers from
// 0 to the sequence count); PREFIX.bin holds the tokens, uint16 (code 8)
// or int32 (code 4), little-endian. The stream is the sequences in index
// order, so the end-of-document tokens Megatron's preprocessing appends
// stay between documents, as its GPT dataset concatenates them.
#pragma once

#include "trainer/data/token_stream.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace keel::trainer {

// The index's fixed fields, as MegatronDataset reads them and
// keel-prepare-data's writer (token_writers.h) writes them.
inline constexpr std::string_view kMegatronMagic{"MMIDIDX\0\0", 9};
inline constexpr uint64_t kMegatronVersion = 1;
inline constexpr uint8_t kMegatronUint16 = 8;  // dtype codes
inline constexpr uint8_t kMegatronInt32 = 4;

class MegatronDataset final : public TokenStream {
 public:
  // Whether PREFIX.idx exists: what tells a Megatron prefix from a glob.
  static bool exists(const std::string& prefix);
  // Maps both files and checks them whole: the header, the counts against
  // the index's size, the lengths and offsets against each other and the
  // .bin's size, the document index, and every token below `vocab_size`
  // (naming the file and the token's offset). Error(kDataError) otherwise,
  // and when the stream holds fewer than `min_tokens`.
  static MegatronDataset open(const std::string& prefix, int64_t vocab_size, int64_t min_tokens);

  MegatronDataset(MegatronDataset&& other) noexcept;
  MegatronDataset& operator=(MegatronDataset&& other) noexcept;
  MegatronDataset(const MegatronDataset&) = delete;
  MegatronDataset& operator=(const MegatronDataset&) = delete;
  ~MegatronDataset() override;

  int64_t num_tokens() const override { return num_tokens_; }
  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return documents_; }
  size_t token_bytes() const { return token_bytes_; }
  void copy(int64_t pos, int64_t count, int32_t* out) const override;

 private:
  MegatronDataset() = default;
  void* map_ = nullptr;  // of PREFIX.bin
  size_t map_bytes_ = 0;
  size_t token_bytes_ = 2;
  int64_t num_tokens_ = 0, sequences_ = 0, documents_ = 0;
};

}  // namespace keel::trainer
