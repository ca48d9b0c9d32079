// CudaBackend held against CpuBackend, the reference: every kernel of
// backend.h on the same random inputs, then whole GPT training steps.
// Shapes are chosen off the tile sizes (warps of 32, blocks of 256, chunks
// of 32 rows), so edge handling is exercised. Where no device is present
// each test says why and returns, so a CPU-only build with nvcc still
// compiles, links and runs this file.
//
// Tolerances (float32 on both sides; the GPU sums in other orders and uses
// expf where the CPU uses a 1.5-ulp polynomial):
// * elementwise kernels and gathers: 1e-5 relative;
// * reductions over a row or a column (layernorm, softmaxes, GEMMs,
//   attention): 1e-4 relative with an absolute part, |gpu - cpu| <= 1e-4 x
//   (|cpu| + a floor per case), so that an element near zero, the sum of
//   terms that cancelled, is held to the size of the terms, not to itself;
//   attention's floor grows with the square root of the head dimension
//   beyond 64 (the rounding of a float32 dot product of d terms does);
// * a GPT step with float32 GEMMs: each step's loss within 1e-4 relative
//   for 20 steps, the first step's gradients within 1e-4 in relative L2
//   norm; with bf16 GEMM inputs, 2e-2 for both. (Elementwise bounds do not
//   survive training: AdamW turns a gradient that is only rounding noise
//   into a full-size step of either sign.)
#ifdef KEEL_HAVE_CUDA

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/counter_rng.h"
#include "tests/trainer/cuda_fixture.h"
#include "tests/trainer/random_data.h"
#include "tests/trainer/relative_error.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/kernels/cuda/cuda_backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/zero_storage.h"

namespace {

using keel::test::device_or_skip;
using keel::trainer::Backend;
using keel::trainer::CpuBackend;
using keel::trainer::RowNorm;
using keel::trainer::cuda::CudaBackend;
using Vec = std::vector<float>;
using Ints = std::vector<int32_t>;

using keel::test::random_ints;
using keel::test::random_vec;
using keel::test::relative_l2;

// |got - want| <= rel * (|want| + floor) for every element: relative, with
// rel * floor as its absolute part.
void check_close(const std::string& what, const Vec& got, const Vec& want, double rel, double floor) {
  REQUIRE(got.size() == want.size());
  double worst = 0.0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]) /
                       (std::fabs(static_cast<double>(want[i])) + floor);
    if (std::isnan(err)) {  // an element written on one side only, or a NaN made
      worst = err;
      worst_i = i;
      break;
    }
    if (err > worst) {
      worst = err;
      worst_i = i;
    }
  }
  INFO(what << ": worst element " << worst_i << " of " << got.size() << ": gpu " << got[worst_i] << " cpu "
            << want[worst_i] << ", relative error " << worst);
  CHECK(worst <= rel);
}


// Named arrays in one backend's memory, copied in from host vectors.
class Tensors {
 public:
  Tensors(Backend& backend, const std::map<std::string, Vec>& floats, const std::map<std::string, Ints>& ints)
      : backend_(backend) {
    for (const auto& [name, host] : floats) put(name, host.data(), host.size() * sizeof(float));
    for (const auto& [name, host] : ints) put(name, host.data(), host.size() * sizeof(int32_t));
  }
  ~Tensors() {
    for (auto& [name, array] : arrays_) backend_.free(array.ptr);
  }
  Tensors(const Tensors&) = delete;
  Tensors& operator=(const Tensors&) = delete;

  // A bf16 array of `count` elements, all bits set (a NaN) until written.
  void add_bf16(const std::string& name, size_t count) {
    const std::vector<keel::trainer::bf16> nans(count, keel::trainer::bf16{0xffff});
    put(name, nans.data(), count * sizeof(keel::trainer::bf16));
  }
  keel::trainer::bf16* h(const std::string& name) { return static_cast<keel::trainer::bf16*>(at(name).ptr); }
  // A bf16 array widened to float32 (exact).
  Vec read_bf16(const std::string& name) {
    std::vector<keel::trainer::bf16> host(at(name).bytes / sizeof(keel::trainer::bf16));
    backend_.copy_to_host(host.data(), at(name).ptr, at(name).bytes);
    Vec wide(host.size());
    for (size_t k = 0; k < host.size(); ++k) wide[k] = keel::trainer::to_float(host[k]);
    return wide;
  }
  float* f(const std::string& name) { return static_cast<float*>(at(name).ptr); }
  const int32_t* i(const std::string& name) { return static_cast<const int32_t*>(at(name).ptr); }
  Vec read(const std::string& name) {
    Vec host(at(name).bytes / sizeof(float));
    backend_.copy_to_host(host.data(), at(name).ptr, at(name).bytes);
    return host;
  }

 private:
  struct Array {
    void* ptr;
    size_t bytes;
  };
  void put(const std::string& name, const void* host, size_t bytes) {
    void* ptr = backend_.alloc(bytes);
    backend_.copy_from_host(ptr, host, bytes);
    arrays_[name] = {ptr, bytes};
  }
  Array& at(const std::string& name) {
    auto found = arrays_.find(name);
    REQUIRE_MESSAGE(found != arrays_.end(), "no tensor " << name);
    return found->second;
  }
  Backend& backend_;
  std::map<std::string, Array> arrays_;
};

// One kernel call: its inputs (outputs too: their starting contents, since
// backward kernels accumulate), what to compare afterwards, and how closely.
struct KernelCase {
  std::string name;
  std::map<std::string, Vec> floats;
  std::map<std::string, Ints> ints;
  std::vector<std::string> outputs;
  std::function<void(Backend&, Tensors&)> run;
  double rel;
  double floor;
};

void check_case(CpuBackend& cpu, CudaBackend& gpu, const KernelCase& c) {
  CAPTURE(c.name);
  Tensors on_cpu(cpu, c.floats, c.ints), on_gpu(gpu, c.floats, c.ints);
  c.run(cpu, on_cpu);
  c.run(gpu, on_gpu);
  for (const auto& out : c.outputs) check_close(c.name + " " + out, on_gpu.read(out), on_cpu.read(out), c.rel, c.floor);
}

std::vector<KernelCase> kernel_cases() {
  std::vector<KernelCase> cases;
  const float nan = NAN;
  // Elementwise, with large arguments where GELU's exp saturates.
  {
    const size_t n = (size_t{1} << 20) + 3;
    Vec inp = random_vec(n, 1, -8.0f, 8.0f);
    for (float x : {-100.0f, -30.0f, -12.0f, 0.0f, 12.0f, 30.0f, 100.0f}) inp.push_back(x);
    const size_t m = inp.size();
    cases.push_back({"gelu",
                     {{"inp", inp}, {"out", Vec(m, nan)}, {"dout", random_vec(m, 2)}, {"dinp", random_vec(m, 3)}},
                     {},
                     {"out", "dinp"},
                     [m](Backend& k, Tensors& t) {
                       k.gelu_forward(t.f("out"), t.f("inp"), m);
                       k.gelu_backward(t.f("dinp"), t.f("inp"), t.f("dout"), m);
                     },
                     // The floor is the terms' size: dinp's start and the added
                     // gradient cancel to near zero, where 1 ulp of a term is all
                     // the error there is.
                     1e-5,
                     1.0});
    cases.push_back({"accumulate", {{"dst", random_vec(n, 4)}, {"src", random_vec(n, 5)}}, {}, {"dst"},
                     [n](Backend& k, Tensors& t) { k.accumulate(t.f("dst"), t.f("src"), n); }, 1e-5, 1e-6});
    // The k and v columns of qkv rows into kv rows and back.
    const int rows = 1031, C = 24;
    cases.push_back({"copy_columns and accumulate_columns",
                     {{"qkv", random_vec(static_cast<size_t>(rows) * 3 * C, 8)},
                      {"kv", Vec(static_cast<size_t>(rows) * 2 * C, nan)}},
                     {},
                     {"qkv", "kv"},
                     [](Backend& k, Tensors& t) {
                       k.copy_columns(t.f("kv"), 2 * C, t.f("qkv") + C, 3 * C, rows, 2 * C);
                       k.accumulate_columns(t.f("qkv") + C, 3 * C, t.f("kv"), 2 * C, rows, 2 * C);
                     },
                     1e-6,
                     1e-6});
  }
  {
    const size_t n = 1'000'003;
    cases.push_back({"adamw over three steps",
                     {{"p", random_vec(n, 6)}, {"g", random_vec(n, 7, -2.0f, 2.0f)}, {"m", Vec(n)}, {"v", Vec(n)}},
                     {}, {"p", "m", "v"},
                     [n](Backend& k, Tensors& t) {
                       for (int64_t step = 1; step <= 3; ++step) {
                         k.adamw_update({{t.f("p"), t.f("g"), t.f("m"), t.f("v"), n, 0.1f}}, 1e-2f, 0.9f, 0.95f,
                                        1e-8f, 0.7f, step);
                       }
                     },
                     1e-4, 1e-3});
  }
  // Embedding: a vocabulary shard [5, 5 + 23) of 29 real tokens, so some
  // tokens fall outside it; tokens repeat.
  {
    const int B = 3, T = 37, C = 67, v_begin = 5, Vl = 23;
    const size_t N = static_cast<size_t>(B) * T;
    cases.push_back({"embedding",
                     {{"wte", random_vec(Vl * C, 8)},
                      {"wpe", random_vec(T * C, 9)},
                      {"out", Vec(N * C, nan)},
                      {"dout", random_vec(N * C, 10)},
                      {"dwte", random_vec(Vl * C, 11)},
                      {"dwpe", random_vec(T * C, 12)}},
                     {{"tokens", random_ints(N, 29, 13)}},
                     {"out", "dwte", "dwpe"},
                     [=](Backend& k, Tensors& t) {
                       k.embedding_forward(t.f("out"), t.i("tokens"), t.f("wte"), v_begin, Vl, t.f("wpe"), B, T, C);
                       k.embedding_backward(t.f("dwte"), t.f("dwpe"), t.f("dout"), t.i("tokens"), v_begin, Vl, B, T,
                                            C);
                     },
                     1e-5,
                     1e-3});
  }
  // LayerNorm: 97 rows (chunks of 32 and a remainder), 67 channels.
  {
    const int N = 97, C = 67;
    const size_t n = static_cast<size_t>(N) * C;
    cases.push_back({"layernorm",
                     {{"inp", random_vec(n, 14, -3.0f, 3.0f)}, {"w", random_vec(C, 15)}, {"b", random_vec(C, 16)},
                      {"out", Vec(n, nan)}, {"mean", Vec(N, nan)}, {"rstd", Vec(N, nan)}, {"dout", random_vec(n, 17)},
                      {"dinp", random_vec(n, 18)}, {"dw", random_vec(C, 19)}, {"db", random_vec(C, 20)}},
                     {}, {"out", "mean", "rstd", "dinp", "dw", "db"},
                     [=](Backend& k, Tensors& t) {
                       k.norm_forward(t.f("out"), t.f("mean"), t.f("rstd"), t.f("inp"), t.f("w"), t.f("b"), N, C,
                                      RowNorm{});
                       k.norm_backward(t.f("dinp"), nullptr, t.f("dw"), t.f("db"), t.f("dout"), t.f("inp"), t.f("w"),
                                       t.f("mean"), t.f("rstd"), N, C, RowNorm{});
                     },
                     1e-4, 1e-2});
  }
  // LayerNorm's backward in a split backward's two passes (input, then
  // parameters), over more channels than a block has threads.
  {
    const int N = 97, C = 1100;
    const size_t n = static_cast<size_t>(N) * C;
    cases.push_back({"layernorm_backward_split",
                     {{"inp", random_vec(n, 14, -3.0f, 3.0f)}, {"w", random_vec(C, 15)}, {"b", random_vec(C, 16)},
                      {"out", Vec(n, nan)}, {"mean", Vec(N, nan)}, {"rstd", Vec(N, nan)}, {"dout", random_vec(n, 17)},
                      {"dinp", random_vec(n, 18)}, {"dw", random_vec(C, 19)}, {"db", random_vec(C, 20)}},
                     {}, {"dinp", "dw", "db"},
                     [=](Backend& k, Tensors& t) {
                       k.norm_forward(t.f("out"), t.f("mean"), t.f("rstd"), t.f("inp"), t.f("w"), t.f("b"), N, C,
                                      RowNorm{});
                       k.norm_backward(t.f("dinp"), nullptr, nullptr, nullptr, t.f("dout"), t.f("inp"), t.f("w"),
                                       t.f("mean"), t.f("rstd"), N, C, RowNorm{});
                       k.norm_backward(nullptr, nullptr, t.f("dw"), t.f("db"), t.f("dout"), t.f("inp"), t.f("w"),
                                       t.f("mean"), t.f("rstd"), N, C, RowNorm{});
                     },
                     1e-4, 1e-2});
  }
  {
    const int N = 97, C = 67;
    const size_t n = static_cast<size_t>(N) * C;
    cases.push_back({"add_layernorm",
                     {{"sum", random_vec(n, 21, -3.0f, 3.0f)}, {"addend", random_vec(n, 22)}, {"w", random_vec(C, 15)},
                      {"b", random_vec(C, 16)}, {"out", Vec(n, nan)}, {"mean", Vec(N, nan)}, {"rstd", Vec(N, nan)}},
                     {}, {"sum", "out", "mean", "rstd"},
                     [=](Backend& k, Tensors& t) {
                       k.add_norm_forward(t.f("sum"), t.f("addend"), t.f("out"), t.f("mean"), t.f("rstd"),
                                          t.f("w"), t.f("b"), N, C, RowNorm{});
                     },
                     1e-4, 1e-2});
  }
  // Llama's parts (issue 46): RMSNorm (no bias, its own eps), SwiGLU over
  // packed [gate | up] rows, rotary positions from a global offset, and
  // grouped-query attention (two and four query heads a key/value head).
  {
    const int N = 97, C = 67;
    const size_t n = static_cast<size_t>(N) * C;
    const RowNorm rms{RowNorm::Kind::kRmsNorm, 1e-6f};
    cases.push_back({"rmsnorm",
                     {{"sum", random_vec(n, 21, -3.0f, 3.0f)}, {"addend", random_vec(n, 22)}, {"w", random_vec(C, 15)},
                      {"out", Vec(n, nan)}, {"mean", Vec(N, nan)}, {"rstd", Vec(N, nan)}, {"dout", random_vec(n, 17)},
                      {"dinp", random_vec(n, 18)}, {"dw", random_vec(C, 19)}},
                     {}, {"sum", "out", "mean", "rstd", "dinp", "dw"},
                     [=](Backend& k, Tensors& t) {
                       k.add_norm_forward(t.f("sum"), t.f("addend"), t.f("out"), t.f("mean"), t.f("rstd"), t.f("w"),
                                          nullptr, N, C, rms);
                       k.norm_backward(t.f("dinp"), nullptr, t.f("dw"), nullptr, t.f("dout"), t.f("sum"), t.f("w"),
                                       t.f("mean"), t.f("rstd"), N, C, rms);
                     },
                     1e-4, 1e-2});
  }
  {
    const int N = 97, F = 45;
    const size_t n = static_cast<size_t>(N) * F;
    cases.push_back({"swiglu",
                     {{"pre", random_vec(2 * n, 23, -6.0f, 6.0f)}, {"out", Vec(n, nan)}, {"dout", random_vec(n, 24)},
                      {"dpre", Vec(2 * n, nan)}},
                     {}, {"out", "dpre"},
                     [=](Backend& k, Tensors& t) {
                       k.swiglu_forward(t.f("out"), t.f("pre"), N, F);
                       k.swiglu_backward(t.f("dpre"), t.f("pre"), t.f("dout"), N, F);
                     },
                     1e-5, 1e-3});
  }
  {
    // Rows of 3 query heads, 1 key head and a value head of 16 channels;
    // positions 40.. of a 128-long table.
    const int B = 2, T = 37, d = 16, heads = 4, ld = 5 * d, P = 128, position = 40;
    const size_t n = static_cast<size_t>(B) * T * ld, table = static_cast<size_t>(P) * d / 2;
    cases.push_back({"rotary",
                     {{"x", random_vec(n, 25)}, {"g", random_vec(n, 26)}, {"cos", random_vec(table, 27)},
                      {"sin", random_vec(table, 28)}},
                     {}, {"x", "g"},
                     [=](Backend& k, Tensors& t) {
                       k.rotary_forward(t.f("x"), ld, t.f("cos"), t.f("sin"), B, T, position, heads, d);
                       k.rotary_backward(t.f("g"), ld, t.f("cos"), t.f("sin"), B, T, position, heads, d);
                     },
                     1e-6, 1e-5});
  }
  for (const int KVH : {2, 1}) {
    const int B = 2, T = 70, NH = 4, d = 24, C = NH * d, W = C + 2 * KVH * d;
    const size_t n = static_cast<size_t>(B) * T;
    cases.push_back({"grouped-query attention, " + std::to_string(NH / KVH) + " query heads a key/value head",
                     {{"qkv", random_vec(n * W, 31, -2.0f, 2.0f)}, {"out", Vec(n * C, nan)},
                      {"lse", Vec(static_cast<size_t>(B) * NH * T, nan)}, {"dout", random_vec(n * C, 32)},
                      {"dqkv", random_vec(n * W, 33)}},
                     {}, {"out", "lse", "dqkv"},
                     [=](Backend& k, Tensors& t) {
                       const auto in = Backend::self_attention(t.f("qkv"), B, T, C, NH, KVH);
                       k.attention_forward(t.f("out"), t.f("lse"), in);
                       k.attention_backward(Backend::self_attention_grads(t.f("dqkv"), C, KVH * d), t.f("dout"),
                                            t.f("out"), t.f("lse"), in);
                     },
                     1e-4, 1e-2});
  }
  // Matmul, with and without bias, and a weight at an odd offset (the
  // parameters are offsets into one buffer); the input gradient added to
  // (with bias) or written over NaN (without).
  for (const bool bias : {true, false}) {
    const int N = 97, C = 67, OC = 131;
    const keel::trainer::Into into = bias ? keel::trainer::Into::kAdd : keel::trainer::Into::kWrite;
    cases.push_back({std::string("matmul ") + (bias ? "with bias, dinp added to" : "without bias, dinp written over"),
                     {{"inp", random_vec(N * C, 21)}, {"w", random_vec(OC * C + 1, 22)}, {"bias", random_vec(OC, 23)},
                      {"out", Vec(N * OC, nan)}, {"dout", random_vec(N * OC, 24)},
                      {"dinp", bias ? random_vec(N * C, 25) : Vec(N * C, nan)},
                      {"dw", random_vec(OC * C + 1, 26)}, {"dbias", random_vec(OC, 27)}},
                     {}, {"out", "dinp", "dw", "dbias"},
                     [=](Backend& k, Tensors& t) {
                       // +1: a weight aligned to 4 bytes only.
                       k.matmul_forward(t.f("out"), t.f("inp"), t.f("w") + 1, bias ? t.f("bias") : nullptr, N, C, OC);
                       k.matmul_backward(t.f("dinp"), into, t.f("dw") + 1, bias ? t.f("dbias") : nullptr, t.f("dout"),
                                         t.f("inp"), t.f("w") + 1, N, C, OC);
                     },
                     1e-4, 1e-1});
  }
  // Attention: T = 70 spans three chunks of 32 keys; head dimensions of 23
  // (under a warp), 40 (two channels for some lanes) and 256 (every
  // accumulator of a lane); then GPT-2's head of 64 over T = 1024, where
  // rows of a thousand terms summed in other orders differ by more.
  struct AttentionCase {
    int B, T, C, NH;
    double rel;
  };
  for (const AttentionCase a : {AttentionCase{2, 70, 69, 3, 1e-4}, AttentionCase{2, 70, 80, 2, 1e-4},
                                AttentionCase{1, 70, 512, 2, 1e-4}, AttentionCase{1, 1024, 128, 2, 5e-4}}) {
    const int B = a.B, T = a.T, C = a.C, NH = a.NH;
    const size_t n = static_cast<size_t>(B) * T;
    cases.push_back({"attention, T " + std::to_string(T) + ", head dimension " + std::to_string(C / NH),
                     {{"qkv", random_vec(n * 3 * C, 28, -2.0f, 2.0f)}, {"out", Vec(n * C, nan)},
                      {"lse", Vec(static_cast<size_t>(B) * NH * T, nan)}, {"dout", random_vec(n * C, 29)},
                      {"dqkv", random_vec(n * 3 * C, 30)}},
                     {}, {"out", "lse", "dqkv"},
                     [=](Backend& k, Tensors& t) {
                       k.attention_forward(t.f("out"), t.f("lse"), Backend::self_attention(t.f("qkv"), B, T, C, NH));
                       k.attention_backward(Backend::self_attention_grads(t.f("dqkv"), C), t.f("dout"), t.f("out"),
                                            t.f("lse"), Backend::self_attention(t.f("qkv"), B, T, C, NH));
                     },
                     a.rel, 1e-2 * std::max(1.0, std::sqrt((C / NH) / 64.0))});
  }
  // A chunk of queries against a chunk of keys that starts after some of
  // them (ring attention): queries 40..59 see no key, then the merge with a
  // second part, then the backward with the merged out and lse.
  {
    const int B = 2, NH = 2, C = 64, Tq = 70, Tk = 50;
    const size_t q_n = static_cast<size_t>(B) * Tq * C, kv_n = static_cast<size_t>(B) * Tk * C;
    const size_t lse_n = static_cast<size_t>(B) * NH * Tq;
    cases.push_back({"attention of a query chunk against a later key chunk, merged",
                     {{"q", random_vec(q_n, 90, -2.0f, 2.0f)}, {"k", random_vec(kv_n, 91, -2.0f, 2.0f)},
                      {"v", random_vec(kv_n, 92)}, {"out", Vec(q_n, nan)}, {"lse", Vec(lse_n, nan)},
                      {"part_out", random_vec(q_n, 93)}, {"part_lse", random_vec(lse_n, 94, -1.0f, 3.0f)},
                      {"dout", random_vec(q_n, 95)}, {"dq", random_vec(q_n, 96)}, {"dk", random_vec(kv_n, 97)},
                      {"dv", random_vec(kv_n, 98)}},
                     {}, {"out", "lse", "dq", "dk", "dv"},
                     [=](Backend& k, Tensors& t) {
                       const Backend::AttentionInputs in{t.f("q"), t.f("k"), t.f("v"), C, C, B, Tq, Tk, C, NH, 40, 60};
                       k.attention_forward(t.f("out"), t.f("lse"), in);
                       k.attention_merge(t.f("out"), t.f("lse"), t.f("part_out"), t.f("part_lse"), B, Tq, C, NH);
                       k.attention_backward({t.f("dq"), t.f("dk"), t.f("dv")}, t.f("dout"), t.f("out"), t.f("lse"),
                                            in);
                     },
                     1e-4, 1e-2});
  }
  // Cross-entropy over two vocabulary shards of 300 padded classes, V = 517
  // real ones: the second shard has padding, one target is in each.
  {
    const int N = 37, Vl = 300, V = 517, S = 2;
    const Ints targets = random_ints(N, V, 31);
    for (int shard = 0; shard < S; ++shard) {
      const int v_begin = shard * Vl;
      cases.push_back({"cross-entropy, shard " + std::to_string(shard),
                       {{"logits", random_vec(N * Vl, 32 + shard, -6.0f, 6.0f)}, {"stats", Vec(N * 3, nan)},
                        {"dlogits", Vec(N * Vl, nan)}},
                       {{"targets", targets}}, {"stats", "dlogits"},
                       [=](Backend& k, Tensors& t) {
                         k.crossentropy_stats(t.f("stats"), t.f("logits"), t.i("targets"), N, v_begin, Vl, V);
                         // The shard's own lse stands in for the combined one.
                         Vec stats(N * 3), lse(N), losses(N);
                         k.copy_to_host(stats.data(), t.f("stats"), stats.size() * sizeof(float));
                         CpuBackend combine;
                         combine.crossentropy_combine(losses.data(), lse.data(), stats.data(), 1, N);
                         float* d_lse = static_cast<float*>(k.alloc(N * sizeof(float)));
                         k.copy_from_host(d_lse, lse.data(), N * sizeof(float));
                         k.crossentropy_backward(t.f("dlogits"), t.f("logits"), d_lse, t.i("targets"), 0.5f, N,
                                                 v_begin, Vl, V);
                         k.copy_to_host(lse.data(), d_lse, N * sizeof(float));  // waits for the kernel
                         k.free(d_lse);
                       },
                       1e-4, 1e-4});
    }
    // One rank's whole vocabulary scored and differentiated in one call,
    // the gradient written over the logits: rows of whole 16-byte vectors
    // (304 columns) and not (301), padding past V = 290 in both.
    for (const int Vp : {304, 301}) {
      const int Vr = 290;
      cases.push_back({"cross-entropy and its gradient in one call, written over " + std::to_string(Vp) + " columns",
                       {{"logits", random_vec(N * Vp, 38, -6.0f, 6.0f)}, {"losses", Vec(N, nan)}, {"lse", Vec(N, nan)}},
                       {{"targets", random_ints(N, Vr, 39)}},
                       {"logits", "losses", "lse"},
                       [=](Backend& k, Tensors& t) {
                         k.crossentropy_and_gradient(t.f("logits"), t.f("losses"), t.f("lse"), t.f("logits"),
                                                     t.i("targets"), 0.5f, N, Vp, Vr);
                       },
                       1e-4,
                       1e-4});
    }
    // A row 16 blocks wide whose logits climb along it: the running max of
    // the one-pass statistics moves at nearly every element, read one at a
    // time (4099 columns) and as whole 16-byte vectors (4096).
    for (const int Vw : {4099, 4096}) {
      const int Nw = 5;
      Vec logits = random_vec(Nw * Vw, 35, -6.0f, 6.0f);
      for (int n = 0; n < Nw; ++n) {
        for (int c = 0; c < Vw; ++c) logits[n * Vw + c] += 0.01f * c;
      }
      cases.push_back({"cross-entropy statistics, a wide row with climbing logits, " + std::to_string(Vw) + " columns",
                       {{"logits", logits}, {"stats", Vec(Nw * 3, nan)}},
                       {{"targets", random_ints(Nw, Vw, 36)}},
                       {"stats"},
                       [=](Backend& k, Tensors& t) {
                         k.crossentropy_stats(t.f("stats"), t.f("logits"), t.i("targets"), Nw, 0, Vw, Vw);
                       },
                       1e-4, 1e-4});
    }
    Vec stats = random_vec(S * N * 3, 34, 0.5f, 4.0f);
    for (int n = 0; n < N; ++n) stats[(N + n) * 3] = -INFINITY, stats[(N + n) * 3 + 1] = 0.0f;  // an empty shard
    cases.push_back(
        {"cross-entropy combine",
         {{"stats", stats}, {"losses", Vec(N, nan)}, {"lse", Vec(N, nan)}},
         {},
         {"losses", "lse"},
         [=](Backend& k, Tensors& t) { k.crossentropy_combine(t.f("losses"), t.f("lse"), t.f("stats"), S, N); },
         1e-4,
         1e-3});
  }
  // Router softmax: E = 37 experts (a warp and a remainder).
  {
    const int N = 97, E = 37;
    cases.push_back({"router softmax",
                     {{"logits", random_vec(N * E, 35, -4.0f, 4.0f)}, {"probs", Vec(N * E, nan)},
                      {"dprobs", random_vec(N * E, 36)}, {"dlogits", random_vec(N * E, 37)}},
                     {}, {"probs", "dlogits"},
                     [=](Backend& k, Tensors& t) {
                       k.softmax_forward(t.f("probs"), t.f("logits"), N, E);
                       k.softmax_backward(t.f("dlogits"), t.f("dprobs"), t.f("probs"), N, E);
                     },
                     1e-4, 1e-3});
  }
  // MoE dispatch and combine: 91 slots drawn from 41 rows, rows repeating.
  {
    const int rows = 41, M = 91, C = 67;
    cases.push_back({"row gather, scatter and dot",
                     {{"inp", random_vec(rows * C, 38)}, {"w", random_vec(M, 39)}, {"gathered", Vec(M * C, nan)},
                      {"plain", Vec(M * C, nan)}, {"src", random_vec(M * C, 40)}, {"out", random_vec(rows * C, 41)},
                      {"dots", Vec(M, nan)}},
                     {{"rows", random_ints(M, rows, 42)}}, {"gathered", "plain", "out", "dots"},
                     [=](Backend& k, Tensors& t) {
                       k.gather_rows(t.f("gathered"), t.f("inp"), t.i("rows"), t.f("w"), M, C);
                       k.gather_rows(t.f("plain"), t.f("inp"), t.i("rows"), nullptr, M, C);
                       k.scatter_add_rows(t.f("out"), t.f("src"), t.i("rows"), t.f("w"), M, C);
                       k.scatter_add_rows(t.f("out"), t.f("src"), t.i("rows"), nullptr, M, C);
                       k.gathered_row_dot(t.f("dots"), t.f("inp"), t.i("rows"), t.f("src"), M, C);
                     },
                     1e-4, 1e-3});
  }
  return cases;
}

keel::common::ModelConfig small_model(int64_t n_expert) {
  keel::common::ModelConfig m;
  m.vocab_size = 91;  // padded: the padded logits must stay out of the loss
  m.seq_len = 37;
  m.n_layer = 2;
  m.n_head = 3;
  m.n_embd = 48;
  m.n_expert = n_expert;
  m.top_k = 2;
  m.moe_every = 2;
  m.aux_loss_coef = 0.1;
  return m;
}

Ints sample_tokens(int count, int vocab, uint64_t salt) {
  Ints t(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) t[i] = static_cast<int32_t>(keel::common::counter_uniform_below(salt, i, vocab));
  return t;
}

// A single-rank model trained by AdamW on one backend; records the loss of
// every step and, after the first, the gradients.
struct Trainee {
  Trainee(const keel::common::ModelConfig& config, Backend& backend, int batch)
      : table(config), storage(backend, table), gpt(config, backend, batch, storage), batch(batch) {
    train.steps = 20;
    train.warmup_steps = 0;
    train.lr = 3e-3;
    optimizer.emplace(backend, table, train);
    memory = keel::trainer::lay_out(backend, storage, gpt, *optimizer);
    storage.init(7);
  }

  float step(int index, const Ints& inputs, const Ints& targets) {
    storage.zero_gradients();
    gpt.forward(inputs.data(), targets.data(), batch);
    const float loss = gpt.loss();
    gpt.backward(1.0f);
    double squares = 0;
    for (const auto& spec : table.specs())
      squares += gpt.backend().sum_squares(storage.grads() + spec.offset, spec.numel);
    const float scale = optimizer->clip_scale(std::sqrt(squares));
    std::vector<keel::trainer::AdamW::Part> parts;
    for (size_t i = 0; i < table.specs().size(); ++i) {
      parts.push_back({i, storage.params() + table.specs()[i].offset, storage.grads() + table.specs()[i].offset});
    }
    optimizer->update(parts, static_cast<float>(keel::trainer::learning_rate(train, index)), scale, index);
    return loss;
  }

  Vec read(const float* buffer) {
    Vec host(table.total());
    gpt.backend().copy_to_host(host.data(), buffer, host.size() * sizeof(float));
    return host;
  }

  std::unique_ptr<keel::trainer::Arena> memory;  // freed last
  keel::trainer::ParameterTable table;
  keel::trainer::ZeroStorage storage;
  keel::trainer::Gpt gpt;
  int batch;
  keel::common::TrainConfig train;
  std::optional<keel::trainer::AdamW> optimizer;
};

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("every CUDA kernel matches the CPU backend on shapes off the tile sizes") {
    if (!device_or_skip()) return;
    CpuBackend cpu(2);
    CudaBackend gpu;
    for (const auto& c : kernel_cases()) check_case(cpu, gpu, c);
  }

  TEST_CASE("CUDA sums and sums of squares match the CPU backend across chunk edges") {
    if (!device_or_skip()) return;
    CpuBackend cpu(2);
    CudaBackend gpu;
    for (const size_t n : {size_t{0}, size_t{1}, size_t{65535}, size_t{65537}, size_t{3'000'017}}) {
      CAPTURE(n);
      const Vec x = random_vec(n, 43, -3.0f, 3.0f);
      Tensors t(gpu, {{"x", x}}, {});
      const float* d_x = n == 0 ? nullptr : t.f("x");
      CHECK(gpu.sum(d_x, n) == doctest::Approx(cpu.sum(x.data(), n)).epsilon(1e-12));
      CHECK(gpu.sum_squares(d_x, n) == doctest::Approx(cpu.sum_squares(x.data(), n)).epsilon(1e-12));
      // Queued, then taken at once: each as sum_squares gives it, bit for
      // bit, in queue order.
      const std::vector<keel::trainer::FloatSpan> spans = {{d_x, n / 3}, {d_x, 0}, {d_x + n / 3, n - n / 3}};
      std::vector<double> each;
      for (const auto& span : spans) each.push_back(gpu.sum_squares(span.data, span.numel));
      for (const auto& span : spans) gpu.queue_sum_squares(span.data, span.numel);
      CHECK(gpu.take_queued_sums() == each);
      CHECK(gpu.take_queued_sums().empty());
      gpu.queue_sums_of_squares(spans);
      CHECK(gpu.take_queued_sums() == each);
    }
  }

  TEST_CASE("AdamW over many tensors in one call on the GPU updates each bit for bit as a call of its own does") {
    if (!device_or_skip()) return;
    CudaBackend gpu;
    // 60 tensors (three launches of at most 24), empty ones among them,
    // lengths across a block's chunk of 16384, two weight decays.
    const std::vector<size_t> lengths = {0, 1, 768, 16383, 16384, 16385, 2304, 0, 40001, 3};
    size_t total = 0;
    for (size_t i = 0; i < 60; ++i) total += lengths[i % lengths.size()];
    const std::map<std::string, Vec> floats = {{"p", random_vec(total, 121)},
                                               {"g", random_vec(total, 122, -2.0f, 2.0f)},
                                               {"m", random_vec(total, 123, -0.1f, 0.1f)},
                                               {"v", random_vec(total, 124, 0.0f, 0.1f)}};
    Tensors together(gpu, floats, {}), alone(gpu, floats, {});
    auto tensors_of = [&](Tensors& t) {
      std::vector<keel::trainer::AdamwTensor> out;
      size_t at = 0;
      for (size_t i = 0; i < 60; ++i) {
        const size_t n = lengths[i % lengths.size()];
        out.push_back({t.f("p") + at, t.f("g") + at, t.f("m") + at, t.f("v") + at, n, i % 2 == 0 ? 0.1f : 0.0f});
        at += n;
      }
      return out;
    };
    for (int64_t step = 1; step <= 2; ++step) {
      gpu.adamw_update(tensors_of(together), 1e-2f, 0.9f, 0.95f, 1e-8f, 0.7f, step);
      for (const auto& x : tensors_of(alone)) gpu.adamw_update({x}, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.7f, step);
    }
    for (const char* name : {"p", "m", "v"}) {
      CAPTURE(name);
      CHECK(together.read(name) == alone.read(name));
    }
  }

  TEST_CASE("squares of many spans queued at once are each span's sum_squares bit for bit and in order") {
    if (!device_or_skip()) return;
    CudaBackend gpu;
    // 150 spans (three launches of at most 64), empty ones at a launch's
    // edges and between, lengths across the reduction's chunk edges.
    const Vec x = random_vec(3'000'000, 77, -3.0f, 3.0f);
    Tensors t(gpu, {{"x", x}}, {});
    std::vector<keel::trainer::FloatSpan> spans;
    const std::vector<size_t> lengths = {0, 1, 768, 65535, 65536, 65537, 2304, 0, 131073, 3};
    size_t offset = 0;
    for (size_t i = 0; i < 150; ++i) {
      const size_t n = i == 63 || i == 64 || i == 149 ? 0 : lengths[i % lengths.size()];
      if (offset + n > x.size()) offset = 0;
      spans.push_back({t.f("x") + offset, n});
      offset += n;
    }
    std::vector<double> each;
    for (const auto& span : spans) each.push_back(gpu.sum_squares(span.data, span.numel));
    gpu.queue_sum_squares(t.f("x"), 5);  // one queued before stays first
    gpu.queue_sums_of_squares(spans);
    const std::vector<double> got = gpu.take_queued_sums();
    REQUIRE(got.size() == spans.size() + 1);
    CHECK(got[0] == gpu.sum_squares(t.f("x"), 5));
    CHECK(std::vector<double>(got.begin() + 1, got.end()) == each);
  }

  TEST_CASE("CUDA kernels do nothing on an empty range") {
    if (!device_or_skip()) return;
    CudaBackend gpu;
    Tensors t(gpu, {{"x", Vec{1.0f, 2.0f}}}, {});
    gpu.accumulate(t.f("x"), t.f("x"), 0);
    gpu.copy_columns(t.f("x"), 1, t.f("x") + 1, 1, 0, 1);
    gpu.accumulate_columns(t.f("x"), 1, t.f("x") + 1, 1, 1, 0);
    gpu.gelu_forward(t.f("x"), t.f("x"), 0);
    gpu.norm_forward(t.f("x"), t.f("x"), t.f("x"), t.f("x"), t.f("x"), t.f("x"), 0, 2, RowNorm{});
    CHECK(t.read("x") == Vec{1.0f, 2.0f});
  }

  TEST_CASE("a snapshot into pinned host memory holds what the compute stream wrote before it") {
    if (!device_or_skip()) return;
    CudaBackend gpu;
    const size_t n = (size_t{1} << 22) + 5;
    const Vec a = random_vec(n, 44), b = random_vec(n, 45);
    Tensors t(gpu, {{"a", a}, {"b", b}}, {});
    // Queued, not waited for: the snapshot's copy stream must wait for it.
    for (int i = 0; i < 4; ++i) gpu.accumulate(t.f("a"), t.f("b"), n);
    std::vector<float> host(n + 3, NAN);
    gpu.pin_host(host.data(), host.size() * sizeof(float));
    gpu.snapshot_to_host({{host.data() + 3, t.f("a"), n * sizeof(float)}});
    gpu.unpin_host(host.data());
    Vec want = a;
    for (int i = 0; i < 4; ++i) {
      for (size_t j = 0; j < n; ++j) want[j] += b[j];
    }
    CHECK(Vec(host.begin() + 3, host.end()) == want);
    CHECK(std::isnan(host[0]));
  }

  TEST_CASE("20 GPT training steps on the GPU follow the CPU within the bound of each GEMM precision") {
    if (!device_or_skip()) return;
    struct Row {
      keel::trainer::DType gemm_inputs;
      double bound;  // on each step's loss and on the first step's gradients
    };
    for (const Row row : {Row{keel::trainer::DType::kF32, 1e-4}, Row{keel::trainer::DType::kBF16, 2e-2}}) {
      for (const int64_t experts : {int64_t{0}, int64_t{4}}) {
        CAPTURE(keel::trainer::dtype_name(row.gemm_inputs));
        CAPTURE(experts);
        const auto config = small_model(experts);
        const int batch = 3, tokens = batch * static_cast<int>(config.seq_len);
        CpuBackend cpu(2);
        CudaBackend gpu(0, row.gemm_inputs);
        Trainee on_cpu(config, cpu, batch), on_gpu(config, gpu, batch);
        for (int step = 0; step < 20; ++step) {
          CAPTURE(step);
          const Ints inputs = sample_tokens(tokens, 91, 100 + step), targets = sample_tokens(tokens, 91, 200 + step);
          const float want = on_cpu.step(step, inputs, targets);
          const float got = on_gpu.step(step, inputs, targets);
          CHECK(std::fabs(got - want) <= row.bound * std::fabs(want));
          if (step == 0) {
            CHECK(relative_l2(on_gpu.read(on_gpu.storage.grads()), on_cpu.read(on_cpu.storage.grads())) <= row.bound);
          }
        }
      }
    }
  }

  TEST_CASE("bf16 GEMMs match the CPU's bf16 GEMMs and stay within bf16 rounding of the float32 products") {
    if (!device_or_skip()) return;
    // Channel counts are multiples of 8, as every model's are (bf16 tensor
    // core kernels want 16-byte rows); N need not be.
    const int N = 97, C = 72, OC = 136;
    CpuBackend cpu(2), cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    const std::map<std::string, Vec> floats = {
        {"inp", random_vec(N * C, 46)},      {"w", random_vec(OC * C, 47)},   {"bias", random_vec(OC, 48)},
        {"out", Vec(N * OC, NAN)},           {"dout", random_vec(N * OC, 49)}, {"dinp", Vec(N * C)},
        {"dw", Vec(OC * C)},                 {"dbias", Vec(OC)}};
    Tensors on_cpu(cpu, floats, {}), on_cpu_bf16(cpu_bf16, floats, {}), on_gpu(gpu, floats, {});
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu}, {&on_cpu_bf16, &cpu_bf16}, {&on_gpu, &gpu}}) {
      k->matmul_forward(t->f("out"), t->f("inp"), t->f("w"), t->f("bias"), N, C, OC);
      k->matmul_backward(t->f("dinp"), keel::trainer::Into::kAdd, t->f("dw"), t->f("dbias"), t->f("dout"), t->f("inp"), t->f("w"), N, C, OC);
    }
    // Inputs rounded to 8 significant bits: about 2^-9 relative each, and
    // the errors of a dot product's terms partly cancel. Against the CPU's
    // bf16 GEMMs only the float32 summation order differs.
    for (const char* name : {"out", "dinp", "dw"}) {
      CAPTURE(name);
      const double error = relative_l2(on_gpu.read(name), on_cpu.read(name));
      CHECK(error <= 1e-2);
      CHECK(error > 0.0);  // the bf16 path really ran
      CHECK(relative_l2(on_gpu.read(name), on_cpu_bf16.read(name)) <= 1e-5);
    }
    check_close("dbias (float32 on both)", on_gpu.read("dbias"), on_cpu.read("dbias"), 1e-5, 1e-3);
  }

  TEST_CASE("the MLP's linear then its GELU written as bf16 matches the CPU's and feeds the next GEMM as is") {
    if (!device_or_skip()) return;
    // GPT-2's fc then projection, cut small and off the tile sizes.
    const int N = 97, C = 72, OC = 136;
    CpuBackend cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    const std::map<std::string, Vec> floats = {
        {"inp", random_vec(N * C, 50, -2.0f, 2.0f)}, {"w", random_vec(OC * C, 51)},   {"bias", random_vec(OC, 52)},
        {"w_proj", random_vec(C * OC, 58)},          {"pre", Vec(N * OC, NAN)},       {"gelu", Vec(N * OC, NAN)},
        {"out", Vec(N * C, NAN)},                    {"out_from_f32", Vec(N * C, NAN)}};
    Tensors on_cpu(cpu_bf16, floats, {}), on_gpu(gpu, floats, {});
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu_bf16}, {&on_gpu, &gpu}}) {
      t->add_bf16("gelu16", static_cast<size_t>(N) * OC);
      k->matmul_forward(t->f("pre"), t->f("inp"), t->f("w"), t->f("bias"), N, C, OC);
      k->gelu_forward(t->h("gelu16"), t->f("pre"), static_cast<size_t>(N) * OC);
      k->gelu_forward(t->f("gelu"), t->f("pre"), static_cast<size_t>(N) * OC);
      k->matmul_forward(t->f("out"), t->h("gelu16"), t->f("w_proj"), nullptr, N, OC, C);
      k->matmul_forward(t->f("out_from_f32"), t->f("gelu"), t->f("w_proj"), nullptr, N, OC, C);
    }
    // pre: only the summation order differs. The bf16 GELU is the float32
    // one rounded, bit for bit, on each backend; across them the two GELUs
    // (expf against the CPU's exp) round apart now and then, by one bf16 step.
    check_close("pre", on_gpu.read("pre"), on_cpu.read("pre"), 1e-4, 1.0);
    for (Tensors* t : {&on_cpu, &on_gpu}) {
      Vec rounded = t->read("gelu");
      for (float& x : rounded) x = keel::trainer::bf16_rounded(x);
      CHECK(t->read_bf16("gelu16") == rounded);
      // The projection takes the bf16 GELU as it is: as the float32 one rounded by the GEMM.
      CHECK(t->read("out") == t->read("out_from_f32"));
    }
    check_close("gelu16", on_gpu.read_bf16("gelu16"), on_cpu.read_bf16("gelu16"), 8e-3, 1.0);
    CHECK(relative_l2(on_gpu.read("out"), on_cpu.read("out")) <= 1e-3);
  }

  TEST_CASE("a LayerNorm backward on the GPU puts its input gradient rounded beside it for the linear below") {
    if (!device_or_skip()) return;
    // The residual stream's gradient as Gpt::backward hands it on: added
    // into by the LayerNorm backward, rounded there, taken by the
    // projection's backward as its output gradient.
    const int N = 70, C = 72, IN = 136;
    CpuBackend cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    const std::map<std::string, Vec> floats = {
        {"inp", random_vec(N * C, 53, -2.0f, 2.0f)}, {"w", random_vec(C, 54, 0.5f, 1.5f)},
        {"dout", random_vec(N * C, 55)},             {"dres", random_vec(N * C, 56)},
        {"mean", Vec(N, NAN)},                       {"rstd", Vec(N, NAN)},
        {"out", Vec(N * C, NAN)},                    {"x", random_vec(N * IN, 57)},
        {"w_proj", random_vec(C * IN, 59)},          {"dx", Vec(N * IN, NAN)},
        {"dx_from_f32", Vec(N * IN, NAN)},           {"dw", Vec(C * IN, 0.0f)},
        {"dw_from_f32", Vec(C * IN, 0.0f)}};
    Tensors on_cpu(cpu_bf16, floats, {}), on_gpu(gpu, floats, {});
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu_bf16}, {&on_gpu, &gpu}}) {
      t->add_bf16("dres16", static_cast<size_t>(N) * C);
      k->norm_forward(t->f("out"), t->f("mean"), t->f("rstd"), t->f("inp"), t->f("w"), t->f("w"), N, C, RowNorm{});
      k->norm_backward(t->f("dres"), t->h("dres16"), nullptr, nullptr, t->f("dout"), t->f("inp"), t->f("w"),
                       t->f("mean"), t->f("rstd"), N, C, RowNorm{});
      k->matmul_backward(t->f("dx"), keel::trainer::Into::kWrite, t->f("dw"), nullptr, t->h("dres16"), t->f("x"),
                         t->f("w_proj"), N, IN, C);
      k->matmul_backward(t->f("dx_from_f32"), keel::trainer::Into::kWrite, t->f("dw_from_f32"), nullptr,
                         t->f("dres"), t->f("x"), t->f("w_proj"), N, IN, C);
    }
    for (Tensors* t : {&on_cpu, &on_gpu}) {
      Vec rounded = t->read("dres");
      for (float& x : rounded) x = keel::trainer::bf16_rounded(x);
      CHECK(t->read_bf16("dres16") == rounded);
      // The GEMMs round a float32 output gradient to these very values.
      CHECK(t->read("dx") == t->read("dx_from_f32"));
      CHECK(t->read("dw") == t->read("dw_from_f32"));
    }
    check_close("dres", on_gpu.read("dres"), on_cpu.read("dres"), 1e-4, 1e-3);
    CHECK(relative_l2(on_gpu.read("dx"), on_cpu.read("dx")) <= 1e-2);
  }

  TEST_CASE("small copies to the GPU are queued and each lands whole though its host buffer is rewritten at once") {
    if (!device_or_skip()) return;
    // Twice as many small copies as the backend has staging slots, from
    // one host buffer refilled after each call, queued behind a long
    // zeroing of a large buffer (so the stream has run none of them when
    // the slots come round again) and each behind a zeroing of its own
    // destination that it must land after; then one large copy.
    CudaBackend gpu(0);
    const size_t small = 8192, large = Backend::kQueuedUploadBytes / sizeof(int32_t) + 1, copies = 17;
    const size_t slow_bytes = size_t{1} << 30;
    void* slow = gpu.alloc(slow_bytes);
    std::vector<int32_t*> at;
    for (size_t k = 0; k < copies; ++k) {
      at.push_back(static_cast<int32_t*>(gpu.alloc((k + 1 == copies ? large : small) * sizeof(int32_t))));
    }
    for (int i = 0; i < 8; ++i) gpu.zero(slow, slow_bytes);
    std::vector<int32_t> host;
    for (size_t k = 0; k < copies; ++k) {
      host.assign(k + 1 == copies ? large : small, static_cast<int32_t>(k + 1));
      gpu.zero(at[k], host.size() * sizeof(int32_t));
      gpu.copy_from_host(at[k], host.data(), host.size() * sizeof(int32_t));
      std::fill(host.begin(), host.end(), -1);
    }
    for (size_t k = 0; k < copies; ++k) {
      CAPTURE(k);
      std::vector<int32_t> back(k + 1 == copies ? large : small);
      gpu.copy_to_host(back.data(), at[k], back.size() * sizeof(int32_t));
      CHECK(std::count(back.begin(), back.end(), static_cast<int32_t>(k + 1)) ==
            static_cast<std::ptrdiff_t>(back.size()));
      gpu.free(at[k]);
    }
    gpu.free(slow);
  }

  TEST_CASE("a bf16 matmul output on the GPU is its float32 output rounded and written by cuBLASLt or after it") {
    if (!device_or_skip()) return;
    // cuBLASLt writes bf16 itself with rows of whole 16-byte vectors (OC
    // 136) and no bias or a bf16 one (its bias takes the output's type);
    // with a float32 bias, or OC 137, keel rounds the float32 output after
    // the GEMM, a bf16 bias widened into it.
    const int N = 97, C = 72;
    CpuBackend cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    enum class Bias { kNone, kF32, kBF16 };
    for (const int OC : {136, 137}) {
      for (const Bias bias : {Bias::kNone, Bias::kF32, Bias::kBF16}) {
        CAPTURE(OC);
        CAPTURE(static_cast<int>(bias));
        Vec bias_values = random_vec(OC, 70);
        // The float32 product adds the bias the bf16 one adds, widened.
        if (bias == Bias::kBF16) {
          for (float& b : bias_values) b = keel::trainer::bf16_rounded(b);
        }
        const std::map<std::string, Vec> floats = {{"inp", random_vec(N * C, 68, -2.0f, 2.0f)},
                                                   {"w", random_vec(OC * C, 69)},
                                                   {"bias", bias_values},
                                                   {"out", Vec(N * OC, NAN)}};
        Tensors on_cpu(cpu_bf16, floats, {}), on_gpu(gpu, floats, {});
        for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu_bf16}, {&on_gpu, &gpu}}) {
          t->add_bf16("out16", static_cast<size_t>(N) * OC);
          t->add_bf16("bias16", static_cast<size_t>(OC));
          k->round_to_bf16(t->h("bias16"), t->f("bias"), static_cast<size_t>(OC));
          const float* b = bias == Bias::kNone ? nullptr : t->f("bias");
          const keel::trainer::ConstBuffer b16 =
              bias == Bias::kBF16 ? keel::trainer::ConstBuffer(t->h("bias16")) : keel::trainer::ConstBuffer(b);
          k->matmul_forward(t->f("out"), t->f("inp"), t->f("w"), b, N, C, OC);
          k->matmul_forward(t->h("out16"), t->f("inp"), t->f("w"), b16, N, C, OC);
        }
        // Within one bf16 step of the GPU's own float32 output (cuBLASLt
        // may sum in another order for a bf16 output) and of the CPU's.
        Vec rounded = on_gpu.read("out");
        for (float& x : rounded) x = keel::trainer::bf16_rounded(x);
        check_close("out16 against the float32 output", on_gpu.read_bf16("out16"), rounded, 8e-3, 1.0);
        check_close("out16 against the CPU", on_gpu.read_bf16("out16"), on_cpu.read_bf16("out16"), 8e-3, 1.0);
      }
    }
  }

  TEST_CASE("bf16 logits on the GPU score and sum and back-propagate as the CPU's with the gradient written over them") {
    if (!device_or_skip()) return;
    // The classifier of one vocabulary shard with padding (V 517 of 2 x 304)
    // as the trainer runs it with bf16 GEMM inputs: logits written as bf16
    // by cuBLASLt, the statistics and their squares read from them, the
    // gradient written over them in place and taken by the GEMMs as it is.
    const int N = 37, C = 72, Vl = 304, V = 517, v_begin = 304;
    CpuBackend cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    const Ints targets = random_ints(N, V, 74);
    const std::map<std::string, Vec> floats = {
        {"inp", random_vec(N * C, 75, -2.0f, 2.0f)}, {"w", random_vec(Vl * C, 76)},   {"stats", Vec(N * 3, NAN)},
        {"dinp", Vec(N * C, 0.0f)},                 {"dw", Vec(Vl * C, 0.0f)},       {"db", Vec(Vl, 0.0f)}};
    Tensors on_cpu(cpu_bf16, floats, {{"targets", targets}}), on_gpu(gpu, floats, {{"targets", targets}});
    std::map<Tensors*, std::vector<double>> squares;
    Vec lse(N), losses(N);
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu_bf16}, {&on_gpu, &gpu}}) {
      t->add_bf16("logits", static_cast<size_t>(N) * Vl);
      k->matmul_forward(t->h("logits"), t->f("inp"), t->f("w"), nullptr, N, C, Vl);
      k->queue_sum_squares(t->h("logits"), static_cast<size_t>(N) * Vl);
      k->crossentropy_stats(t->f("stats"), t->h("logits"), t->i("targets"), N, v_begin, Vl, V);
      squares[t] = k->take_queued_sums();
      // Both backwards from the CPU's lse, so only the kernels differ.
      if (t == &on_cpu) cpu_bf16.crossentropy_combine(losses.data(), lse.data(), t->f("stats"), 1, N);
      float* d_lse = static_cast<float*>(k->alloc(N * sizeof(float)));
      k->copy_from_host(d_lse, lse.data(), N * sizeof(float));
      k->crossentropy_backward(t->h("logits"), t->h("logits"), d_lse, t->i("targets"), 0.5f, N, v_begin, Vl, V);
      k->matmul_backward(t->f("dinp"), keel::trainer::Into::kAdd, t->f("dw"), t->f("db"), t->h("logits"), t->f("inp"), t->f("w"), N, C, Vl);
      k->copy_to_host(lse.data(), d_lse, N * sizeof(float));  // waits for the kernels
      k->free(d_lse);
    }
    REQUIRE(squares[&on_gpu].size() == 1);
    CHECK(squares[&on_gpu][0] == doctest::Approx(squares[&on_cpu][0]).epsilon(1e-2));
    check_close("stats", on_gpu.read("stats"), on_cpu.read("stats"), 2e-2, 1.0);
    // The gradient: a bf16 step apart now and then (the logits were).
    check_close("dlogits", on_gpu.read_bf16("logits"), on_cpu.read_bf16("logits"), 2e-2, 1e-2);
    CHECK(relative_l2(on_gpu.read("dinp"), on_cpu.read("dinp")) <= 1e-2);
    CHECK(relative_l2(on_gpu.read("dw"), on_cpu.read("dw")) <= 1e-2);
    CHECK(relative_l2(on_gpu.read("db"), on_cpu.read("db")) <= 1e-2);
  }

  TEST_CASE("a bf16 pre-activation on the GPU is the linear's output rounded and read back as the CPU reads it") {
    if (!device_or_skip()) return;
    const int N = 97, C = 72, OC = 136;
    CpuBackend cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    const std::map<std::string, Vec> floats = {
        {"inp", random_vec(N * C, 63, -2.0f, 2.0f)}, {"w", random_vec(OC * C, 64)},     {"bias", random_vec(OC, 65)},
        {"w_proj", random_vec(C * OC, 66)},          {"dout", random_vec(N * C, 67)},    {"out", Vec(N * OC, NAN)},
        {"dpre", Vec(N * OC, NAN)},                  {"dw", Vec(C * OC, 0.0f)},          {"db", Vec(C, 0.0f)}};
    Tensors on_cpu(cpu_bf16, floats, {}), on_gpu(gpu, floats, {});
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu_bf16}, {&on_gpu, &gpu}}) {
      t->add_bf16("pre16", static_cast<size_t>(N) * OC);
      k->matmul_forward(t->h("pre16"), t->f("inp"), t->f("w"), t->f("bias"), N, C, OC);
      k->gelu_forward(t->f("out"), t->h("pre16"), static_cast<size_t>(N) * OC);
      k->matmul_backward_through_gelu(t->f("dpre"), t->f("dw"), t->f("db"), t->f("dout"), t->f("out"), t->f("w_proj"),
                                      t->h("pre16"), N, OC, C);
    }
    // The two GEMMs differ in their summation order only, so a bf16 value
    // now and then rounds one step apart; the GELU reads what was rounded.
    check_close("pre16", on_gpu.read_bf16("pre16"), on_cpu.read_bf16("pre16"), 8e-3, 1.0);
    Vec gelu_of_pre = on_gpu.read_bf16("pre16"), want(gelu_of_pre.size());
    cpu_bf16.gelu_forward(want.data(), gelu_of_pre.data(), want.size());
    check_close("out", on_gpu.read("out"), want, 1e-5, 1.0);
    CHECK(relative_l2(on_gpu.read("dpre"), on_cpu.read("dpre")) <= 1e-2);
    CHECK(relative_l2(on_gpu.read("dw"), on_cpu.read("dw")) <= 1e-2);
  }

  TEST_CASE("a LayerNorm written as bf16 is the float32 one rounded on the GPU and matches the CPU's") {
    if (!device_or_skip()) return;
    const int N = 70, C = 200;
    CpuBackend cpu(2);
    CudaBackend gpu;
    const std::map<std::string, Vec> floats = {
        {"inp", random_vec(N * C, 59, -3.0f, 5.0f)}, {"addend", random_vec(N * C, 60)}, {"w", random_vec(C, 61)},
        {"b", random_vec(C, 62)},  {"out", Vec(N * C, NAN)},  {"mean", Vec(N, NAN)},  {"rstd", Vec(N, NAN)}};
    Tensors on_cpu(cpu, floats, {}), on_gpu(gpu, floats, {});
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu}, {&on_gpu, &gpu}}) {
      t->add_bf16("out16", static_cast<size_t>(N) * C);
      t->add_bf16("sum_out16", static_cast<size_t>(N) * C);
      k->norm_forward(t->f("out"), t->f("mean"), t->f("rstd"), t->f("inp"), t->f("w"), t->f("b"), N, C, RowNorm{});
      k->norm_forward(t->h("out16"), t->f("mean"), t->f("rstd"), t->f("inp"), t->f("w"), t->f("b"), N, C, RowNorm{});
      k->add_norm_forward(t->f("inp"), t->f("addend"), t->h("sum_out16"), t->f("mean"), t->f("rstd"), t->f("w"),
                          t->f("b"), N, C, RowNorm{});
    }
    Vec rounded = on_gpu.read("out");
    for (float& x : rounded) x = keel::trainer::bf16_rounded(x);
    CHECK(on_gpu.read_bf16("out16") == rounded);
    // Across backends the float32 results differ in their last bits, so a
    // bf16 value now and then rounds one step apart.
    check_close("out16", on_gpu.read_bf16("out16"), on_cpu.read_bf16("out16"), 8e-3, 1.0);
    check_close("sum_out16", on_gpu.read_bf16("sum_out16"), on_cpu.read_bf16("sum_out16"), 8e-3, 1.0);
    check_close("sum", on_gpu.read("inp"), on_cpu.read("inp"), 1e-6, 1e-6);
  }

  TEST_CASE("the projection's backward through GELU's derivative on the bf16 GEMM matches the CPU's") {
    if (!device_or_skip()) return;
    // The MLP's projection cut small: its input is GELU(pre) [N, C], C a
    // multiple of 8 (cuBLASLt's GELU input leading dimension).
    const int N = 97, C = 136, OC = 72;
    CpuBackend cpu_bf16(2, keel::trainer::DType::kBF16);
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    Vec pre = random_vec(N * C, 53, -3.0f, 3.0f), gelu(N * C);
    cpu_bf16.gelu_forward(gelu.data(), pre.data(), gelu.size());
    const std::map<std::string, Vec> floats = {
        {"pre", pre},          {"inp", gelu},         {"w", random_vec(OC * C, 54)}, {"dout", random_vec(N * OC, 55)},
        {"dpre", Vec(N * C, NAN)}, {"dw", random_vec(OC * C, 56)}, {"db", random_vec(OC, 57)}};
    Tensors on_cpu(cpu_bf16, floats, {}), on_gpu(gpu, floats, {});
    for (auto [t, k] : {std::pair<Tensors*, Backend*>{&on_cpu, &cpu_bf16}, {&on_gpu, &gpu}}) {
      k->matmul_backward_through_gelu(t->f("dpre"), t->f("dw"), t->f("db"), t->f("dout"), t->f("inp"), t->f("w"),
                                      t->f("pre"), N, C, OC);
      // dpre kept as bf16, as the trainer keeps it (no weight gradients).
      t->add_bf16("dpre16", static_cast<size_t>(N) * C);
      k->matmul_backward_through_gelu(t->h("dpre16"), nullptr, nullptr, t->f("dout"), nullptr, t->f("w"), t->f("pre"),
                                      N, C, OC);
    }
    // dpre overwritten (NaN before), by gelu.h's derivative on both
    // backends: only the GEMMs' summation order and the exp differ.
    check_close("dpre", on_gpu.read("dpre"), on_cpu.read("dpre"), 1e-4, 1.0);
    // The bf16 dpre is the float32 one rounded: a bf16 step apart at most.
    for (Tensors* t : {&on_cpu, &on_gpu}) {
      Vec rounded = t->read("dpre");
      for (float& x : rounded) x = keel::trainer::bf16_rounded(x);
      check_close("dpre16", t->read_bf16("dpre16"), rounded, 8e-3, 1e-2);
    }
    CHECK(relative_l2(on_gpu.read("dw"), on_cpu.read("dw")) <= 1e-5);
    check_close("db", on_gpu.read("db"), on_cpu.read("db"), 1e-5, 1e-3);
  }

  TEST_CASE("tensor-core attention matches the CPU's bf16 attention forward and backward and repeats its bits") {
    if (!device_or_skip()) return;
    using keel::trainer::DType;
    CpuBackend cpu(2), cpu_bf16(2, DType::kBF16);
    CudaBackend gpu(0, DType::kBF16);
    struct Shape {
      int B, Tq, Tk, C, NH, q_offset, k_offset;
      bool merge;  // with a second part over other keys, as ring attention does
    };
    // GPT-2's head of 64 on tiles cut at 70 rows and on whole ones at 1024;
    // a head of 128; a query chunk against a later key chunk, whose queries
    // 40..59 see none of its keys, merged with a second part.
    for (const Shape a : {Shape{2, 70, 70, 128, 2, 0, 0, false}, Shape{1, 1024, 1024, 128, 2, 0, 0, false},
                          Shape{1, 200, 200, 256, 2, 0, 0, false}, Shape{2, 70, 50, 128, 2, 40, 60, true}}) {
      const int B = a.B, Tq = a.Tq, Tk = a.Tk, C = a.C, NH = a.NH;
      CAPTURE(Tq);
      CAPTURE(C / NH);
      const size_t q_n = static_cast<size_t>(B) * Tq * C, kv_n = static_cast<size_t>(B) * Tk * C;
      const size_t lse_n = static_cast<size_t>(B) * NH * Tq;
      const std::map<std::string, Vec> floats = {
          {"q", random_vec(q_n, 101, -2.0f, 2.0f)}, {"k", random_vec(kv_n, 102, -2.0f, 2.0f)},
          {"v", random_vec(kv_n, 103)},             {"out", Vec(q_n, NAN)},
          {"lse", Vec(lse_n, NAN)},                 {"part_out", random_vec(q_n, 104)},
          {"part_lse", random_vec(lse_n, 105, -1.0f, 3.0f)},
          {"dout", random_vec(q_n, 106)},           {"dq", random_vec(q_n, 107)},
          {"dk", random_vec(kv_n, 108)},            {"dv", random_vec(kv_n, 109)}};
      auto run = [&](Backend& k, Tensors& t) {
        const Backend::AttentionInputs in{t.f("q"), t.f("k"), t.f("v"), C,  C,
                                          B,        Tq,       Tk,       C,  NH,
                                          a.q_offset, a.k_offset};
        k.attention_forward(t.f("out"), t.f("lse"), in);
        if (a.merge) k.attention_merge(t.f("out"), t.f("lse"), t.f("part_out"), t.f("part_lse"), B, Tq, C, NH);
        k.attention_backward({t.f("dq"), t.f("dk"), t.f("dv")}, t.f("dout"), t.f("out"), t.f("lse"), in);
      };
      Tensors on_cpu(cpu, floats, {}), on_cpu_bf16(cpu_bf16, floats, {}), on_gpu(gpu, floats, {}),
          again(gpu, floats, {});
      run(cpu, on_cpu);
      run(cpu_bf16, on_cpu_bf16);
      run(gpu, on_gpu);
      run(gpu, again);
      // Both round q, k, v, dout, P and dS to bf16 (P here before its
      // normalisation, there after) and sum in float32 in other orders.
      for (const char* name : {"out", "lse", "dq", "dk", "dv"}) {
        CAPTURE(name);
        CHECK(relative_l2(on_gpu.read(name), on_cpu_bf16.read(name)) <= 1e-2);
        CHECK(relative_l2(on_gpu.read(name), on_cpu.read(name)) <= 2e-2);
        CHECK(on_gpu.read(name) == again.read(name));
      }
      CHECK(relative_l2(on_gpu.read("out"), on_cpu.read("out")) > 0.0);  // the bf16 path really ran
      check_close("lse", on_gpu.read("lse"), on_cpu_bf16.read("lse"), 1e-3, 1.0);
    }
  }

  TEST_CASE("GPU attention on bf16 q k and v gives the bits of the float32 views they round") {
    if (!device_or_skip()) return;
    // Self-attention over qkv [B, T, 3C]: head 64 on the tensor cores, and
    // head 32 on the float32 kernels, which take bf16 views widened.
    CudaBackend gpu(0, keel::trainer::DType::kBF16);
    for (const int NH : {2, 4}) {
      const int B = 2, T = 70, C = 128;
      CAPTURE(C / NH);
      const size_t qkv_n = static_cast<size_t>(B) * T * 3 * C, q_n = static_cast<size_t>(B) * T * C;
      Vec qkv = random_vec(qkv_n, 118, -2.0f, 2.0f);
      // The float32 kernels do not round: give them values bf16 holds.
      if (C / NH != 64) {
        for (float& x : qkv) x = keel::trainer::bf16_rounded(x);
      }
      const std::map<std::string, Vec> floats = {{"qkv", qkv},
                                                 {"out", Vec(q_n, NAN)},
                                                 {"lse", Vec(static_cast<size_t>(B) * NH * T, NAN)},
                                                 {"dout", random_vec(q_n, 119)},
                                                 {"dqkv", random_vec(qkv_n, 120)}};
      Tensors on_f32(gpu, floats, {}), on_bf16(gpu, floats, {});
      std::vector<keel::trainer::bf16> qkv16(qkv_n);
      for (size_t i = 0; i < qkv_n; ++i) qkv16[i] = keel::trainer::to_bf16(qkv[i]);
      on_bf16.add_bf16("qkv16", qkv_n);
      gpu.copy_from_host(on_bf16.h("qkv16"), qkv16.data(), qkv_n * sizeof(keel::trainer::bf16));
      for (auto [t, view] : {std::pair<Tensors*, keel::trainer::ConstBuffer>{&on_f32, on_f32.f("qkv")},
                             {&on_bf16, on_bf16.h("qkv16")}}) {
        const auto in = Backend::self_attention(view, B, T, C, NH);
        gpu.attention_forward(t->f("out"), t->f("lse"), in);
        gpu.attention_backward(Backend::self_attention_grads(t->f("dqkv"), C), t->f("dout"), t->f("out"), t->f("lse"),
                               in);
      }
      for (const char* name : {"out", "lse", "dqkv"}) {
        CAPTURE(name);
        CHECK(on_bf16.read(name) == on_f32.read(name));
      }
      // The output kept as bf16: the float32 one rounded, bit for bit, and
      // the backward from it that of its widening.
      Tensors kept(gpu, floats, {});
      kept.add_bf16("out16", q_n);
      const auto in = Backend::self_attention(on_f32.f("qkv"), B, T, C, NH);
      gpu.attention_forward(kept.h("out16"), kept.f("lse"), in);
      Vec rounded = on_f32.read("out");
      for (float& x : rounded) x = keel::trainer::bf16_rounded(x);
      CHECK(kept.read_bf16("out16") == rounded);
      CHECK(kept.read("lse") == on_f32.read("lse"));
      Tensors widened(gpu, {{"out", rounded}, {"dqkv", floats.at("dqkv")}}, {});
      gpu.attention_backward(Backend::self_attention_grads(kept.f("dqkv"), C), kept.f("dout"), kept.h("out16"),
                             kept.f("lse"), in);
      gpu.attention_backward(Backend::self_attention_grads(widened.f("dqkv"), C), kept.f("dout"), widened.f("out"),
                             kept.f("lse"), in);
      CHECK(kept.read("dqkv") == widened.read("dqkv"));
      // dqkv kept as bf16 (the qkv linear's GEMMs read only that): the
      // float32 gradients summed from zero, rounded, bit for bit, over
      // whatever it held.
      Tensors from_zero(gpu, {{"dqkv", Vec(qkv_n, 0.0f)}}, {});
      from_zero.add_bf16("dqkv16", qkv_n);
      const std::vector<keel::trainer::bf16> garbage(qkv_n, keel::trainer::bf16{0xffff});
      gpu.copy_from_host(from_zero.h("dqkv16"), garbage.data(), qkv_n * sizeof(keel::trainer::bf16));
      gpu.attention_backward(Backend::self_attention_grads(from_zero.f("dqkv"), C), kept.f("dout"), on_f32.f("out"),
                             on_f32.f("lse"), in);
      gpu.attention_backward(Backend::self_attention_grads(from_zero.h("dqkv16"), C), kept.f("dout"),
                             on_f32.f("out"), on_f32.f("lse"), in);
      Vec summed = from_zero.read("dqkv");
      for (float& x : summed) x = keel::trainer::bf16_rounded(x);
      CHECK(from_zero.read_bf16("dqkv16") == summed);
    }
  }

  TEST_CASE("the same GPU training run twice gives the same bits") {
    if (!device_or_skip()) return;
    const auto config = small_model(4);
    const int batch = 3, tokens = batch * static_cast<int>(config.seq_len);
    std::vector<Vec> params;
    std::vector<std::vector<float>> losses(2);
    for (int run = 0; run < 2; ++run) {
      CudaBackend gpu;
      Trainee trainee(config, gpu, batch);
      for (int step = 0; step < 10; ++step) {
        losses[run].push_back(
            trainee.step(step, sample_tokens(tokens, 91, 300 + step), sample_tokens(tokens, 91, 400 + step)));
      }
      params.push_back(trainee.read(trainee.storage.params()));
    }
    CHECK(losses[0] == losses[1]);
    REQUIRE(params[0].size() == params[1].size());
    CHECK(std::memcmp(params[0].data(), params[1].data(), params[0].size() * sizeof(float)) == 0);
  }
}

#endif  // KEEL_HAVE_CUDA
