// The CUDA kernels against CpuBackend on the same random inputs. Where no
// device is present each test says why and returns, so a CPU-only build
// with nvcc still compiles, links and runs this file.
#ifdef KEEL_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "trainer/kernels/cpu_backend.h"
#include "tests/trainer/cuda_fixture.h"
#include "trainer/kernels/cuda/cuda_kernels.h"

namespace {

namespace kc = keel::trainer::cuda;
using keel::trainer::CpuBackend;
using Vec = std::vector<float>;

Vec random_vec(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

using keel::test::device_or_skip;
using keel::test::DeviceVec;

class Stream {
 public:
  Stream() { REQUIRE(cudaStreamCreate(&stream_) == cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  void sync() const { REQUIRE(cudaStreamSynchronize(stream_) == cudaSuccess); }

 private:
  cudaStream_t stream_ = nullptr;
};

// |got - want| <= rel * max(|want|, floor) for every element; the floor
// keeps values that round to nearly zero from demanding digits nobody has.
void check_close(const char* what, const Vec& got, const Vec& want, double rel, double floor) {
  REQUIRE(got.size() == want.size());
  double worst = 0.0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]) /
                       std::max(std::fabs(static_cast<double>(want[i])), floor);
    if (!(err <= worst)) {
      worst = err;
      worst_i = i;
    }
  }
  INFO(what << ": worst element " << worst_i << " gpu " << got[worst_i] << " cpu " << want[worst_i]);
  CHECK(worst <= rel);
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gelu forward and backward match the CPU backend") {
    if (!device_or_skip()) return;
    CpuBackend cpu;
    Stream stream;
    const size_t n = (size_t{1} << 20) + 3;
    Vec inp = random_vec(n, 1, -8.0f, 8.0f);
    for (float x : {-100.0f, -30.0f, -12.0f, 0.0f, 12.0f, 30.0f, 100.0f}) inp.push_back(x);
    const Vec dout = random_vec(inp.size(), 2, -1.0f, 1.0f);
    const Vec dinp_start = random_vec(inp.size(), 3, -1.0f, 1.0f);

    DeviceVec d_inp(inp), d_out(Vec(inp.size(), NAN)), d_dout(dout), d_dinp(dinp_start);
    kc::gelu_forward(d_out.get(), d_inp.get(), inp.size(), stream.get());
    kc::gelu_backward(d_dinp.get(), d_inp.get(), d_dout.get(), inp.size(), stream.get());
    stream.sync();

    Vec out(inp.size());
    cpu.gelu_forward(out.data(), inp.data(), inp.size());
    Vec dinp = dinp_start;
    cpu.gelu_backward(dinp.data(), inp.data(), dout.data(), inp.size());
    check_close("gelu forward", d_out.to_host(), out, 1e-5, 1e-6);
    check_close("gelu backward", d_dinp.to_host(), dinp, 1e-5, 1e-6);
  }

  TEST_CASE("cuda accumulate matches the CPU backend") {
    if (!device_or_skip()) return;
    CpuBackend cpu;
    Stream stream;
    const size_t n = 3'000'017;
    const Vec a = random_vec(n, 4, -2.0f, 2.0f);
    const Vec b = random_vec(n, 5, -2.0f, 2.0f);
    DeviceVec d_b(b), d_acc(a);
    kc::accumulate(d_acc.get(), d_b.get(), n, stream.get());
    stream.sync();

    Vec acc = a;
    cpu.accumulate(acc.data(), b.data(), n);
    check_close("accumulate", d_acc.to_host(), acc, 1e-5, 1e-6);
  }

  TEST_CASE("cuda adamw_update matches the CPU backend over several steps") {
    if (!device_or_skip()) return;
    CpuBackend cpu;
    Stream stream;
    const size_t n = 1'000'003;
    const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.7f;
    Vec params = random_vec(n, 6, -1.0f, 1.0f);
    Vec m(n, 0.0f), v(n, 0.0f);
    DeviceVec d_params(params), d_m(m), d_v(v);
    for (int64_t t = 1; t <= 3; ++t) {
      const Vec grads = random_vec(n, 10 + t, -2.0f, 2.0f);
      DeviceVec d_grads(grads);
      kc::adamw_update(d_params.get(), d_grads.get(), d_m.get(), d_v.get(), n, lr, beta1, beta2, eps, wd, grad_scale,
                       t, stream.get());
      stream.sync();
      cpu.adamw_update(params.data(), grads.data(), m.data(), v.data(), n, lr, beta1, beta2, eps, wd, grad_scale, t);
    }
    check_close("params", d_params.to_host(), params, 1e-6, 1e-2);
    check_close("m", d_m.to_host(), m, 1e-6, 1e-3);
    check_close("v", d_v.to_host(), v, 1e-6, 1e-4);
  }

  TEST_CASE("cuda kernels do nothing on an empty range") {
    if (!device_or_skip()) return;
    Stream stream;
    DeviceVec d_x(Vec{1.0f, 2.0f});
    kc::accumulate(d_x.get(), d_x.get(), 0, stream.get());
    kc::gelu_forward(d_x.get(), d_x.get(), 0, stream.get());
    stream.sync();
    CHECK(d_x.to_host() == Vec{1.0f, 2.0f});
  }
}

}  // namespace

#endif  // KEEL_HAVE_CUDA
