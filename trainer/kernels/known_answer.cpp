#include "trainer/kernels/known_answer.h"

#include "trainer/kernels/backend_array.h"

#include <xxhash.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace keel::trainer {
namespace {

// Shapes: big enough that the GEMMs are tiled like a model's, small
// enough that the integer loops beside them stay cheap. Every sum stays
// far below 2^24, where float32 stops holding integers exactly.
constexpr int kN = 64, kC = 128, kOC = 96;         // matmul
constexpr int kB = 4, kT = 32, kE = 64, kV = 128;  // embedding
constexpr int kRows = 100, kM = 200;               // MoE rows
constexpr size_t kFlat = 10000;                    // accumulate, sum, sum of squares

// An integer in [-4, 4], a different sequence per salt.
float small(size_t i, uint32_t salt) {
  return static_cast<float>(static_cast<int>((i * 2654435761u + salt * 40503u) % 9u) - 4);
}

std::vector<float> filled(size_t n, uint32_t salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = small(i, salt);
  return v;
}

// Moves host vectors into backend memory and back, owning what it made,
// and compares each kernel's output with its expected value.
class Checker {
 public:
  explicit Checker(Backend& backend) : backend_(backend), total_(XXH3_createState(), &XXH3_freeState) {
    XXH3_64bits_reset(total_.get());
  }

  template <class T>
  T* upload(const std::vector<T>& host) {
    auto array = std::make_shared<BackendArray<T>>(backend_, host.size());
    backend_.copy_from_host(array->data(), host.data(), host.size() * sizeof(T));
    owned_.push_back(array);
    return array->data();
  }

  std::vector<float> download(const float* data, size_t n) {
    std::vector<float> host(n);
    backend_.copy_to_host(host.data(), data, n * sizeof(float));
    return host;
  }

  // Holds `actual` against `expected`; the first kernel that differs is
  // the one named.
  void check(const char* kernel, const void* actual, const void* expected, size_t bytes) {
    XXH3_64bits_update(total_.get(), actual, bytes);
    if (failed_.empty() && XXH3_64bits(actual, bytes) != XXH3_64bits(expected, bytes)) failed_ = kernel;
  }
  void check(const char* kernel, const std::vector<float>& actual, const std::vector<float>& expected) {
    check(kernel, actual.data(), expected.data(), actual.size() * sizeof(float));
  }

  KnownAnswers result() const { return KnownAnswers{failed_, XXH3_64bits_digest(total_.get()), 0}; }

 private:
  Backend& backend_;
  std::vector<std::shared_ptr<void>> owned_;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> total_;
  std::string failed_;
};

void matmuls(Checker& checker, Backend& k) {
  const auto inp = filled(size_t{kN} * kC, 1), weight = filled(size_t{kOC} * kC, 2), bias = filled(kOC, 3);
  const auto dout = filled(size_t{kN} * kOC, 4);
  // Backward kernels accumulate: they start from non-zero gradients.
  const auto dinp0 = filled(size_t{kN} * kC, 5), dweight0 = filled(size_t{kOC} * kC, 6), dbias0 = filled(kOC, 7);

  float* out = checker.upload(std::vector<float>(size_t{kN} * kOC));
  k.matmul_forward(out, checker.upload(inp), checker.upload(weight), checker.upload(bias), kN, kC, kOC);
  std::vector<float> expected(size_t{kN} * kOC);
  for (int n = 0; n < kN; ++n) {
    for (int o = 0; o < kOC; ++o) {
      int64_t s = static_cast<int64_t>(bias[o]);
      for (int c = 0; c < kC; ++c)
        s += static_cast<int64_t>(inp[n * kC + c]) * static_cast<int64_t>(weight[o * kC + c]);
      expected[static_cast<size_t>(n) * kOC + o] = static_cast<float>(s);
    }
  }
  checker.check("matmul_forward", checker.download(out, expected.size()), expected);

  float* dinp = checker.upload(dinp0);
  float* dweight = checker.upload(dweight0);
  float* dbias = checker.upload(dbias0);
  k.matmul_backward(dinp, Into::kAdd, dweight, dbias, checker.upload(dout), checker.upload(inp), checker.upload(weight), kN, kC,
                    kOC);
  // A dense block's linears write their input gradients over (Into::kWrite):
  // over NaN here, with no weight or bias gradient asked for.
  float* written = checker.upload(std::vector<float>(size_t{kN} * kC, std::nanf("")));
  k.matmul_backward(written, Into::kWrite, nullptr, nullptr, checker.upload(dout), checker.upload(inp),
                    checker.upload(weight), kN, kC, kOC);
  std::vector<float> want_dinp(dinp0), want_written(dinp0.size()), want_dweight(dweight0), want_dbias(dbias0);
  for (int n = 0; n < kN; ++n) {
    for (int c = 0; c < kC; ++c) {
      int64_t s = 0;
      for (int o = 0; o < kOC; ++o)
        s += static_cast<int64_t>(dout[n * kOC + o]) * static_cast<int64_t>(weight[o * kC + c]);
      want_dinp[static_cast<size_t>(n) * kC + c] += static_cast<float>(s);
      want_written[static_cast<size_t>(n) * kC + c] = static_cast<float>(s);
    }
  }
  for (int o = 0; o < kOC; ++o) {
    int64_t sb = 0;
    for (int n = 0; n < kN; ++n) sb += static_cast<int64_t>(dout[n * kOC + o]);
    want_dbias[o] += static_cast<float>(sb);
    for (int c = 0; c < kC; ++c) {
      int64_t s = 0;
      for (int n = 0; n < kN; ++n) s += static_cast<int64_t>(dout[n * kOC + o]) * static_cast<int64_t>(inp[n * kC + c]);
      want_dweight[static_cast<size_t>(o) * kC + c] += static_cast<float>(s);
    }
  }
  checker.check("matmul_backward (input gradient)", checker.download(dinp, want_dinp.size()), want_dinp);
  checker.check("matmul_backward (input gradient written over)", checker.download(written, want_written.size()),
                want_written);
  checker.check("matmul_backward (weight gradient)", checker.download(dweight, want_dweight.size()), want_dweight);
  checker.check("matmul_backward (bias gradient)", checker.download(dbias, want_dbias.size()), want_dbias);
}

void embeddings(Checker& checker, Backend& k) {
  std::vector<int32_t> tokens(size_t{kB} * kT);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 37 % kV);
  const auto wte = filled(size_t{kV} * kE, 8), wpe = filled(size_t{kT} * kE, 9),
             dout = filled(size_t{kB} * kT * kE, 10);
  const auto dwte0 = filled(wte.size(), 11), dwpe0 = filled(wpe.size(), 12);
  const int32_t* device_tokens = checker.upload(tokens);

  float* out = checker.upload(std::vector<float>(dout.size()));
  k.embedding_forward(out, device_tokens, checker.upload(wte), 0, kV, checker.upload(wpe), kB, kT, kE);
  std::vector<float> expected(dout.size());
  for (size_t bt = 0; bt < tokens.size(); ++bt) {
    for (int c = 0; c < kE; ++c) {
      expected[bt * kE + c] = wte[static_cast<size_t>(tokens[bt]) * kE + c] + wpe[(bt % kT) * kE + c];
    }
  }
  checker.check("embedding_forward", checker.download(out, expected.size()), expected);

  float* dwte = checker.upload(dwte0);
  float* dwpe = checker.upload(dwpe0);
  k.embedding_backward(dwte, dwpe, checker.upload(dout), device_tokens, 0, kV, kB, kT, kE);
  std::vector<float> want_dwte(dwte0), want_dwpe(dwpe0);
  for (size_t bt = 0; bt < tokens.size(); ++bt) {
    for (int c = 0; c < kE; ++c) {
      want_dwte[static_cast<size_t>(tokens[bt]) * kE + c] += dout[bt * kE + c];
      want_dwpe[(bt % kT) * kE + c] += dout[bt * kE + c];
    }
  }
  checker.check("embedding_backward (token gradient)", checker.download(dwte, want_dwte.size()), want_dwte);
  checker.check("embedding_backward (position gradient)", checker.download(dwpe, want_dwpe.size()), want_dwpe);
}

void moe_rows(Checker& checker, Backend& k) {
  std::vector<int32_t> rows(kM);
  for (int m = 0; m < kM; ++m) rows[m] = m * 13 % kRows;
  const auto table = filled(size_t{kRows} * kE, 13), per_slot = filled(size_t{kM} * kE, 14), weights = filled(kM, 15);
  const auto scatter0 = filled(table.size(), 16);
  const int32_t* device_rows = checker.upload(rows);
  const float* device_weights = checker.upload(weights);

  float* gathered = checker.upload(std::vector<float>(per_slot.size()));
  k.gather_rows(gathered, checker.upload(table), device_rows, device_weights, kM, kE);
  std::vector<float> want_gathered(per_slot.size());
  for (int m = 0; m < kM; ++m) {
    for (int c = 0; c < kE; ++c) want_gathered[static_cast<size_t>(m) * kE + c] = weights[m] * table[rows[m] * kE + c];
  }
  checker.check("gather_rows", checker.download(gathered, want_gathered.size()), want_gathered);

  float* scattered = checker.upload(scatter0);
  k.scatter_add_rows(scattered, checker.upload(per_slot), device_rows, device_weights, kM, kE);
  std::vector<float> want_scattered(scatter0);
  for (int m = 0; m < kM; ++m) {
    for (int c = 0; c < kE; ++c)
      want_scattered[rows[m] * kE + c] += weights[m] * per_slot[static_cast<size_t>(m) * kE + c];
  }
  checker.check("scatter_add_rows", checker.download(scattered, want_scattered.size()), want_scattered);

  float* dots = checker.upload(std::vector<float>(kM));
  k.gathered_row_dot(dots, checker.upload(table), device_rows, checker.upload(per_slot), kM, kE);
  std::vector<float> want_dots(kM);
  for (int m = 0; m < kM; ++m) {
    int64_t s = 0;
    for (int c = 0; c < kE; ++c) {
      s += static_cast<int64_t>(table[rows[m] * kE + c]) *
           static_cast<int64_t>(per_slot[static_cast<size_t>(m) * kE + c]);
    }
    want_dots[m] = static_cast<float>(s);
  }
  checker.check("gathered_row_dot", checker.download(dots, want_dots.size()), want_dots);
}

void reductions(Checker& checker, Backend& k) {
  const auto x = filled(kFlat, 17), y = filled(kFlat, 18);
  float* dst = checker.upload(x);
  k.accumulate(dst, checker.upload(y), kFlat);
  std::vector<float> want(kFlat);
  for (size_t i = 0; i < kFlat; ++i) want[i] = x[i] + y[i];
  checker.check("accumulate", checker.download(dst, kFlat), want);

  const float* device_x = checker.upload(x);
  double want_sum = 0, want_squares = 0;
  for (float v : x) {
    want_sum += v;
    want_squares += static_cast<double>(v) * v;
  }
  const double sum = k.sum(device_x, kFlat), squares = k.sum_squares(device_x, kFlat);
  checker.check("sum", &sum, &want_sum, sizeof(double));
  checker.check("sum_squares", &squares, &want_squares, sizeof(double));
}

}  // namespace

KnownAnswers test_known_answers(Backend& backend) {
  const auto start = std::chrono::steady_clock::now();
  Checker checker(backend);
  matmuls(checker, backend);
  embeddings(checker, backend);
  moe_rows(checker, backend);
  reductions(checker, backend);
  KnownAnswers result = checker.result();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace keel::trainer
