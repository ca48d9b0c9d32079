#include "trainer/data/text_tokenizer.h"

#include "common/error.h"

#include <fmt/format.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

class ByteTokenizer final : public TextTokenizer {
 public:
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> end_of_document() const override { return std::nullopt; }
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    for (unsigned char c : text) out.push_back(c);
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    for (int32_t id : ids) text.push_back(static_cast<char>(id));
    return text;
  }
  std::string name() const override { return "bytes"; }
};

class SentencePieceTokenizer final : public TextTokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& model) : path_(model) {
    const auto status = processor_.Load(model.string());
    if (!status.ok()) {
      throw Error(ErrorCode::kBadConfig,
                  fmt::format("{}: not a SentencePiece model that loads ({}): pass a tokenizer.model file, or "
                              "--train-tokenizer to train one",
                              model.string(), status.ToString()));
    }
  }
  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::optional<int32_t> end_of_document() const override {
    const int eos = processor_.eos_id();
    return eos >= 0 ? std::optional<int32_t>(eos) : std::nullopt;
  }
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) {
      throw Error(ErrorCode::kDataError, fmt::format("SentencePiece cannot encode the text: {}", status.ToString()));
    }
    out.insert(out.end(), ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    const auto status = processor_.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    if (!status.ok()) {
      throw Error(ErrorCode::kDataError, fmt::format("SentencePiece cannot decode the ids: {}", status.ToString()));
    }
    return text;
  }
  std::string name() const override {
    return fmt::format("SentencePiece, {} pieces ({})", processor_.GetPieceSize(), path_.string());
  }

 private:
  std::filesystem::path path_;
  sentencepiece::SentencePieceProcessor processor_;
};

}  // namespace

std::unique_ptr<TextTokenizer> byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<TextTokenizer> load_sentencepiece(const std::filesystem::path& model) {
  return std::make_unique<SentencePieceTokenizer>(model);
}

void train_sentencepiece(const std::filesystem::path& text, int64_t vocab_size,
                         const std::filesystem::path& model_prefix, int threads) {
  const std::unordered_map<std::string, std::string> spec = {
      {"input", text.string()},
      {"input_sentence_size", "2000000"},
      {"shuffle_input_sentence", "true"},
      {"model_prefix", model_prefix.string()},
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      // Lossless: no normalization, whitespace as written, no dummy prefix,
      // and bytes for whatever the pieces do not cover.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"max_sentence_length", "1048576"},
      {"num_threads", std::to_string(std::max(1, threads))},
      {"minloglevel", "2"},  // SentencePiece's own progress lines would drown keel's
  };
  const auto status = sentencepiece::SentencePieceTrainer::Train(spec);
  if (!status.ok()) {
    throw Error(ErrorCode::kBadConfig, fmt::format("SentencePiece could not train a {}-piece BPE model on this text: {}",
                                                   vocab_size, status.ToString()));
  }
}

}  // namespace keel::trainer
