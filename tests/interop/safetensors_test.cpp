// safetensors in and out (docs/architecture.md "Outside formats"): what
// keel writes reads back exactly, F16 and BF16 widen exactly, and a file
// that is not what its header says is refused with a sentence, never read
// past its end.
#include "interop/safetensors.h"

#include "tests/support/temp_dir.h"
#include "trainer/kernels/dtype.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace {

using keel::interop::SafetensorsFile;
using keel::interop::TensorDtype;

// A file of an 8-byte header length (`length`, or the header's own), the
// header text and `data` bytes, as a writer of any quality might leave it.
std::filesystem::path write_raw(const keel::test::TempDir& dir, const std::string& name, const std::string& header,
                                size_t data_bytes, std::optional<uint64_t> length = std::nullopt) {
  const auto path = dir / name;
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = length.value_or(header.size());
  out.write(reinterpret_cast<const char*>(&n), sizeof(n));
  out << header;
  const std::string data(data_bytes, '\0');
  out << data;
  return path;
}

std::string refusal(const std::filesystem::path& path) {
  try {
    SafetensorsFile file(path);
  } catch (const keel::common::Error& e) {
    CHECK(e.code() == keel::common::ErrorCode::kDataError);
    return e.what();
  }
  return "(read without complaint)";
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("safetensors written as F32 read back bit for bit with their names and shapes and an aligned header") {
    keel::test::TempDir dir;
    const std::vector<keel::interop::TensorToWrite> tensors = {{"a.weight", {2, 3}}, {"b", {5}}, {"empty", {0, 4}}};
    const std::vector<std::vector<float>> values = {{1, -2, 3.5f, 1e-30f, -0.0f, 7}, {0.1f, 0.2f, 0.3f, 0.4f, 0.5f}, {}};
    const auto path = dir / "model.safetensors";
    keel::interop::write_safetensors(path, tensors, TensorDtype::kF32, [&](size_t i, float* dst) {
      std::copy(values[i].begin(), values[i].end(), dst);
    });
    CHECK(std::filesystem::file_size(path) == keel::interop::safetensors_bytes(tensors, TensorDtype::kF32));
    const SafetensorsFile file(path);
    CHECK(file.metadata().at("format") == "pt");
    REQUIRE(file.tensors().size() == 3);
    for (size_t i = 0; i < tensors.size(); ++i) {
      CAPTURE(tensors[i].name);
      const auto* t = file.find(tensors[i].name);
      REQUIRE(t != nullptr);
      CHECK(t->shape == tensors[i].shape);
      CHECK(t->dtype == TensorDtype::kF32);
      std::vector<float> back(values[i].size());
      file.read(*t, back.data());
      CHECK(std::memcmp(back.data(), values[i].data(), back.size() * sizeof(float)) == 0);
    }
    uint64_t header = 0;
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&header), sizeof(header));
    CHECK(header % 8 == 0);  // the data starts 8-byte aligned, as the reference writer leaves it
    CHECK(file.find("missing") == nullptr);
  }

  TEST_CASE("safetensors written as BF16 hold each value rounded to nearest even and F16 and BF16 widen exactly") {
    keel::test::TempDir dir;
    const std::vector<float> values = {1.0f, 1.00390625f, 1.01171875f, -3.14159f, 65504.0f, 1e-20f};
    keel::interop::write_safetensors(dir / "b.safetensors", {{"x", {6}}}, TensorDtype::kBF16,
                                     [&](size_t, float* dst) { std::copy(values.begin(), values.end(), dst); });
    const SafetensorsFile bf16(dir / "b.safetensors");
    REQUIRE(bf16.find("x")->dtype == TensorDtype::kBF16);
    std::vector<float> back(6);
    bf16.read(*bf16.find("x"), back.data());
    for (size_t i = 0; i < values.size(); ++i) CHECK(back[i] == keel::trainer::bf16_rounded(values[i]));
    CHECK(back[1] == 1.0f);          // a tie goes to the even neighbour
    CHECK(back[2] == 1.015625f);     // and away from the odd one

    // F16 as a published checkpoint may hold it: 1, -2, the smallest
    // subnormal, the largest finite, infinity.
    const uint16_t halves[] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00};
    const std::string header = R"({"h":{"dtype":"F16","shape":[5],"data_offsets":[0,10]}})";
    const auto path = dir / "h.safetensors";
    {
      std::ofstream out(path, std::ios::binary);
      const uint64_t n = header.size();
      out.write(reinterpret_cast<const char*>(&n), 8);
      out << header;
      out.write(reinterpret_cast<const char*>(halves), sizeof(halves));
    }
    const SafetensorsFile f16(path);
    std::vector<float> wide(5);
    f16.read(*f16.find("h"), wide.data());
    CHECK(wide[0] == 1.0f);
    CHECK(wide[1] == -2.0f);
    CHECK(wide[2] == std::ldexp(1.0f, -24));
    CHECK(wide[3] == 65504.0f);
    CHECK(wide[4] == std::numeric_limits<float>::infinity());
  }

  TEST_CASE("a safetensors file that is not what its header says is refused with a sentence naming the problem") {
    keel::test::TempDir dir;
    struct Row {
      const char* what;
      std::string header;
      size_t data_bytes;
      std::optional<uint64_t> length;
      const char* said;
    };
    const std::string good_entry = R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
    const Row rows[] = {
        {"truncated to 4 bytes", "", 0, std::nullopt, "shorter than the 8-byte header length"},
        {"a header length past the file", "{" + good_entry + "}", 16, 1000, "runs past the end of the file"},
        {"a header that is not JSON", "{\"w\": [1, 2", 0, std::nullopt, "header is not a JSON object"},
        {"a header that is a list", "[1, 2]", 0, std::nullopt, "header is not a JSON object"},
        {"a dtype keel does not read", R"({"w":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16, std::nullopt,
         "\"I64\", which keel does not read"},
        {"a shape the offsets do not hold", R"({"w":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}})", 16,
         std::nullopt, "which takes 24 bytes"},
        {"offsets past the end", R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}})", 16, std::nullopt,
         "past the end of the data"},
        {"offsets that end before they begin", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 16,
         std::nullopt, "end before they begin"},
        {"two tensors sharing bytes",
         "{" + good_entry + R"(,"v":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16, std::nullopt,
         "share bytes"},
        {"a negative dimension", R"({"w":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,16]}})", 16, std::nullopt,
         "not a list of non-negative integers"},
        {"no data_offsets", R"({"w":{"dtype":"F32","shape":[2,2]}})", 16, std::nullopt, "has no data_offsets"},
        {"metadata that is not strings", "{" + good_entry + R"(,"__metadata__":{"format":1}})", 16, std::nullopt,
         "__metadata__ entry \"format\" is not a string"},
    };
    int n = 0;
    for (const Row& row : rows) {
      INFO(row.what);
      const auto path = std::string(row.what) == "truncated to 4 bytes"
                            ? [&] {
                                const auto p = dir / "short.safetensors";
                                std::ofstream(p, std::ios::binary) << "abcd";
                                return p;
                              }()
                            : write_raw(dir, "bad" + std::to_string(n++) + ".safetensors", row.header, row.data_bytes,
                                        row.length);
      const auto before = std::filesystem::file_size(path);
      const std::string said = refusal(path);
      CHECK_MESSAGE(said.find(row.said) != std::string::npos, said);
      CHECK(said.find(path.string()) != std::string::npos);
      CHECK(std::filesystem::file_size(path) == before);
    }
  }
}
