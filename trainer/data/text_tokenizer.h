// Text to token ids for keel-prepare-data (docs/architecture.md "Data"):
// bytes (the quickstart's vocabulary of 256) or a SentencePiece model (as
// Llama 2, Mistral and many others ship theirs), loaded or trained on the
// corpus.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::trainer {

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;
  virtual int64_t vocab_size() const = 0;
  // The token that ends a document, if the vocabulary has one.
  virtual std::optional<int32_t> end_of_document() const = 0;
  // Appends the ids of `text` to `out`.
  virtual void encode(std::string_view text, std::vector<int32_t>& out) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual std::string name() const = 0;  // for summaries: "bytes", "sentencepiece BPE 1024 (MODEL)"
};

std::unique_ptr<TextTokenizer> byte_tokenizer();

// Loads a SentencePiece model file. Error(kBadConfig) naming the file and
// what SentencePiece said when it does not load.
std::unique_ptr<TextTokenizer> load_sentencepiece(const std::filesystem::path& model);

// Trains a byte-fallback BPE SentencePiece model of `vocab_size` pieces on
// the lines of `text` (SentencePiece samples at most 2 million of them)
// and writes it as MODEL_PREFIX.model and MODEL_PREFIX.vocab. Normalization is off
// (identity, whitespace kept, no dummy prefix) and bytes outside the
// pieces fall back to byte tokens, so decoding what it encodes gives the
// text back exactly. Error(kBadConfig) with SentencePiece's reason when it
// cannot train (a vocabulary too small or too large for the text).
void train_sentencepiece(const std::filesystem::path& text, int64_t vocab_size,
                         const std::filesystem::path& model_prefix, int threads);

}  // namespace keel::trainer
