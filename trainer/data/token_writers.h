// Where keel-prepare-data's tokens go (docs/architecture.md "Data"): one
// split's llm.c token shards, or one Megatron-LM indexed dataset; both
// read back by keel-trainer (data.train names the shards' glob or the
// dataset's prefix) and by the tools they come from.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace keel::trainer {

class TokenWriter {
 public:
  virtual ~TokenWriter() = default;
  // Appends one sequence: a piece of the current document.
  virtual void add_sequence(const std::vector<int32_t>& tokens) = 0;
  // Ends the current document, `end` (the end-of-document token) appended
  // to its last sequence when given; nothing when no sequence came since
  // the last end.
  virtual void end_document(std::optional<int32_t> end) = 0;
  // Writes what is buffered; the files are complete after it.
  virtual void finish() = 0;
  // Removes files of this name that an earlier, larger run left behind and
  // that the trainer would otherwise read as part of this data; how many.
  virtual int remove_stale() const = 0;
  virtual int64_t tokens() const = 0;
  virtual std::vector<std::string> written() const = 0;
  // What data.train and data.val name: the shards' glob, or the prefix.
  virtual std::string source() const = 0;
};

// NAME_000000.bin, NAME_000001.bin, ... of at most `shard_tokens` tokens:
// llm.c's GPT-2 format for vocabularies up to 65536, its Llama 3 format
// (uint32 tokens) past that.
std::unique_ptr<TokenWriter> llmc_shard_writer(const std::filesystem::path& dir, const std::string& name,
                                               int64_t shard_tokens, int64_t vocab_size);

// NAME.bin and NAME.idx as Megatron-LM's IndexedDatasetBuilder writes them:
// uint16 tokens for vocabularies under 65500, int32 past that (its
// best-fitting dtype), one sequence per add_sequence, one document per
// end_document. The index is written last, so a crash leaves no index
// that names a partial .bin.
std::unique_ptr<TokenWriter> megatron_writer(const std::filesystem::path& dir, const std::string& name,
                                             int64_t vocab_size);

}  // namespace keel::trainer
