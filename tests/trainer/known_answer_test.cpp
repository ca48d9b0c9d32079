// The known-answer kernel test (docs/architecture.md "Health": SDC): a
// correct backend matches the exact answers bit for bit at any thread
// count, a backend that gets a single bit of a single output wrong is
// caught and its kernel named, and a rank that fails stops with exit 11,
// reporting itself on its board and in events.jsonl.
#include "trainer/kernels/known_answer.h"
#include "common/error.h"
#include "health/progress_board.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/thread_count_guard.h"
#include "tests/trainer/trainer_runs.h"
#include "trainer/kernels/backend_wrapper.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/train/sdc_guard.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

using keel::trainer::CpuBackend;

// Flips the lowest mantissa bit of one output element of one kernel: the
// smallest wrong answer there is.
class OneWrongBit final : public keel::trainer::BackendWrapper {
 public:
  OneWrongBit(keel::trainer::Backend& target, std::string kernel)
      : BackendWrapper(target), kernel_(std::move(kernel)) {}

  void matmul_forward(keel::trainer::Buffer out, keel::trainer::ConstBuffer inp, keel::trainer::ConstBuffer weight,
                      keel::trainer::ConstBuffer bias, int N, int C, int OC) override {
    target_.matmul_forward(out, inp, weight, bias, N, C, OC);
    flip("matmul_forward", static_cast<float*>(out.data), static_cast<size_t>(N) * OC);
  }
  void matmul_backward(float* dinp, keel::trainer::Into dinp_into, float* dweight, float* dbias,
                       keel::trainer::ConstBuffer dout, keel::trainer::ConstBuffer inp,
                       keel::trainer::ConstBuffer weight, int N, int C, int OC) override {
    target_.matmul_backward(dinp, dinp_into, dweight, dbias, dout, inp, weight, N, C, OC);
    if (dinp_into == keel::trainer::Into::kWrite) {
      flip("matmul_backward written over", dinp, static_cast<size_t>(N) * C);
    } else {
      flip("matmul_backward", dweight, static_cast<size_t>(OC) * C);
    }
  }
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl, const float* wpe,
                         int B, int T, int C) override {
    target_.embedding_forward(out, tokens, wte, v_begin, Vl, wpe, B, T, C);
    flip("embedding_forward", out, static_cast<size_t>(B) * T * C);
  }
  void scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                        int C) override {
    target_.scatter_add_rows(out, inp, rows, weights, M, C);
    flip("scatter_add_rows", out, static_cast<size_t>(C));
  }
  void accumulate(float* dst, const float* src, size_t n) override {
    target_.accumulate(dst, src, n);
    flip("accumulate", dst, n);
  }
  double sum_squares(const float* x, size_t n) override {
    double result = target_.sum_squares(x, n);
    if (kernel_ == "sum_squares") result = std::nextafter(result, 0.0);
    return result;
  }

 private:
  void flip(const char* kernel, float* out, size_t n) {
    if (kernel_ != kernel) return;
    uint32_t bits = 0;
    std::memcpy(&bits, out + n / 3, sizeof bits);
    bits ^= 1u;
    std::memcpy(out + n / 3, &bits, sizeof bits);
  }
  std::string kernel_;
};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the known-answer test passes on the CPU backend with one or two or three threads and one digest") {
    keel::test::ThreadCountGuard guard;
    uint64_t digest = 0;
    for (int threads : {1, 2, 3}) {
      CAPTURE(threads);
      CpuBackend cpu(threads);
      const auto answers = keel::trainer::test_known_answers(cpu);
      CHECK(answers.failed_kernel.empty());
      if (threads == 1) digest = answers.digest;
      CHECK(answers.digest == digest);
      MESSAGE("known-answer test with " << threads << " threads: " << answers.seconds * 1e3 << " ms");
    }
  }

  TEST_CASE("a backend that gets one bit of one output wrong fails the known-answer test naming the kernel") {
    CpuBackend cpu(1);
    const auto good = keel::trainer::test_known_answers(cpu).digest;
    const std::vector<std::pair<std::string, std::string>> rows = {
        {"matmul_forward", "matmul_forward"},
        {"matmul_backward", "matmul_backward (weight gradient)"},
        {"matmul_backward written over", "matmul_backward (input gradient written over)"},
        {"embedding_forward", "embedding_forward"},
        {"scatter_add_rows", "scatter_add_rows"},
        {"accumulate", "accumulate"},
        {"sum_squares", "sum_squares"},
    };
    for (const auto& [kernel, named] : rows) {
      CAPTURE(kernel);
      OneWrongBit wrong(cpu, kernel);
      const auto answers = keel::trainer::test_known_answers(wrong);
      CHECK(answers.failed_kernel == named);
      CHECK(answers.digest != good);
    }
  }

  TEST_CASE("a rank whose kernels compute wrong numbers exits 11 naming the kernel and reports itself") {
    keel::test::TempDir dir;
    const std::string board_name = "/keel-test." + std::to_string(getpid()) + ".kat";
    auto keeld_side = keel::health::ProgressBoard::create(board_name);
    struct Remove {
      std::string name;
      ~Remove() { keel::health::ProgressBoard::remove(name); }
    } remove{board_name};
    keel::health::BoardPublisher board(keel::health::ProgressBoard::open(board_name), 0, 4);
    auto config = keel::common::Config::parse("[data]\ntrain = \"x.bin\"\n", "test", dir.path(),
                                              {"job.run_dir=" + (dir / "run").string()});
    CpuBackend cpu(1);
    OneWrongBit wrong(cpu, "matmul_forward");
    keel::trainer::SdcGuard guard(config, wrong, 0, 1, 4, board, [](float*, size_t) {});
    try {
      guard.test_kernels(17);
      FAIL("a wrong kernel passed");
    } catch (const keel::common::Error& e) {
      CHECK(e.code() == keel::common::ErrorCode::kSdcSuspected);
      CHECK(std::string(e.what()).find("kernel matmul_forward gave a wrong result") != std::string::npos);
    }
    const auto seen = keeld_side.read();
    REQUIRE(seen.has_value());
    CHECK(seen->sdc.count == 1);
    CHECK(seen->sdc.step == 17);
    CHECK(seen->sdc.rank == 0);
    CHECK(std::string(keel::health::sdc_method_name(seen->sdc.method)) == "kat");
    CHECK(std::string(keel::health::sdc_verdict_name(seen->sdc.verdict)) == "persistent");
    const auto events = keel::test::events(dir / "run");
    REQUIRE(events.size() == 1);
    CHECK(events[0].at("kind") == "sdc_detected");
    CHECK(events[0].at("rank") == 0);
    CHECK(events[0].at("generation") == 4);
    CHECK(events[0].at("method") == "kat");
    CHECK(events[0].at("verdict") == "persistent");
    CHECK(events[0].at("kernel") == "matmul_forward");
  }
}
