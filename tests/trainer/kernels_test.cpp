// CpuBackend against three independent oracles: central finite differences
// for every backward, naive double-precision loops for every forward, and
// the same inputs run with different thread counts for determinism.
#include "common/error.h"
#include "tests/trainer/thread_count_guard.h"
#include "tests/trainer/random_data.h"
#include "tests/trainer/relative_error.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/kernels/dtype.h"

#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

namespace {

using keel::trainer::CpuBackend;
using keel::trainer::RowNorm;
using Vec = std::vector<float>;
using Ref = std::vector<double>;
using Ints = std::vector<int32_t>;

using keel::test::random_ints;
using keel::test::random_vec;
using keel::test::relative_l2;

// Forward outputs start as NaN so a kernel that fails to overwrite them all
// shows up in the comparison.
Vec nan_vec(size_t n) { return Vec(n, std::numeric_limits<float>::quiet_NaN()); }

double weighted_sum(const Vec& out, const Vec& weights) {
  double total = 0.0;
  for (size_t i = 0; i < out.size(); ++i) total += static_cast<double>(out[i]) * weights[i];
  return total;
}

double max_abs(const Vec& v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// Every element within tol * max|want| (float accumulations make errors
// scale with the largest values, not with each element).
void check_close(const char* what, const Vec& got, const Ref& want, double tol) {
  REQUIRE(got.size() == want.size());
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  double worst = 0.0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) : INFINITY;
    if (err > worst) {
      worst = err;
      worst_i = i;
    }
  }
  INFO(what << ": worst element " << worst_i << " got " << got[worst_i] << " want " << want[worst_i]);
  CHECK(worst <= tol * std::max(scale, 1e-30));
}

// Central differences of loss() with respect to each element of x, against
// the analytic gradient. The tolerance is relative to the largest analytic
// gradient: the float forward pass leaves noise of that order in the
// quotient.
void check_gradient(const char* what, Vec& x, const Vec& analytic, const std::function<double()>& loss,
                    double tol = 1e-2) {
  REQUIRE(x.size() == analytic.size());
  const double scale = max_abs(analytic);
  REQUIRE(scale > 0.0);  // an all-zero gradient would agree with anything flat
  constexpr float kStep = 1e-3f;
  double worst = 0.0;
  size_t worst_i = 0;
  double worst_numeric = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float orig = x[i];
    const float up = orig + kStep;
    const float down = orig - kStep;
    x[i] = up;
    const double loss_up = loss();
    x[i] = down;
    const double loss_down = loss();
    x[i] = orig;
    const double numeric = (loss_up - loss_down) / (static_cast<double>(up) - static_cast<double>(down));
    const double err = std::fabs(numeric - analytic[i]);
    if (!(err <= worst)) {
      worst = err;
      worst_i = i;
      worst_numeric = numeric;
    }
  }
  INFO(what << ": worst element " << worst_i << " analytic " << analytic[worst_i] << " numeric " << worst_numeric
            << " (max |g| " << scale << ")");
  CHECK(worst <= tol * scale);
}

// ---- naive double-precision references ----

void layernorm_ref(Ref& out, Ref& mean, Ref& rstd, const Vec& inp, const Vec& w, const Vec& b, int N, int C) {
  out.assign(static_cast<size_t>(N) * C, 0.0);
  mean.assign(N, 0.0);
  rstd.assign(N, 0.0);
  for (int n = 0; n < N; ++n) {
    double mu = 0.0;
    for (int c = 0; c < C; ++c) mu += inp[n * C + c];
    mu /= C;
    double var = 0.0;
    for (int c = 0; c < C; ++c) var += (inp[n * C + c] - mu) * (inp[n * C + c] - mu);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    for (int c = 0; c < C; ++c) out[n * C + c] = (inp[n * C + c] - mu) * rs * w[c] + b[c];
    mean[n] = mu;
    rstd[n] = rs;
  }
}

Ref matmul_ref(const Vec& inp, const Vec& w, const float* bias, int N, int C, int OC) {
  Ref out(static_cast<size_t>(N) * OC);
  for (int n = 0; n < N; ++n) {
    for (int o = 0; o < OC; ++o) {
      double acc = bias != nullptr ? bias[o] : 0.0;
      for (int c = 0; c < C; ++c) acc += static_cast<double>(inp[n * C + c]) * w[o * C + c];
      out[n * OC + o] = acc;
    }
  }
  return out;
}

void attention_ref(Ref& out, Ref& lse, const Vec& qkv, int B, int T, int C, int NH) {
  const int d = C / NH;
  out.assign(static_cast<size_t>(B) * T * C, 0.0);
  lse.assign(static_cast<size_t>(B) * NH * T, 0.0);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        const float* q = &qkv[(static_cast<size_t>(b) * T + t) * 3 * C + h * d];
        std::vector<double> s(t + 1);
        double max = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          const float* k = &qkv[(static_cast<size_t>(b) * T + j) * 3 * C + C + h * d];
          double dot = 0.0;
          for (int i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * k[i];
          s[j] = dot / std::sqrt(static_cast<double>(d));
          max = std::max(max, s[j]);
        }
        double sum = 0.0;
        for (double& x : s) sum += (x = std::exp(x - max));
        lse[(static_cast<size_t>(b) * NH + h) * T + t] = max + std::log(sum);
        double* o = &out[(static_cast<size_t>(b) * T + t) * C + h * d];
        for (int j = 0; j <= t; ++j) {
          const float* v = &qkv[(static_cast<size_t>(b) * T + j) * 3 * C + 2 * C + h * d];
          for (int i = 0; i < d; ++i) o[i] += s[j] / sum * v[i];
        }
      }
    }
  }
}

// 0.5 x (1 + tanh u) written as x / (1 + exp(-2u)): equal, but 1 + tanh u
// cancels in the negative tail even in double.
double gelu_ref(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));
}

Ref softmax_ref(const Vec& logits, int N, int E) {
  Ref p(static_cast<size_t>(N) * E);
  for (int n = 0; n < N; ++n) {
    double max = -INFINITY;
    for (int e = 0; e < E; ++e) max = std::max(max, static_cast<double>(logits[n * E + e]));
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += std::exp(logits[n * E + e] - max);
    for (int e = 0; e < E; ++e) p[n * E + e] = std::exp(logits[n * E + e] - max) / sum;
  }
  return p;
}

// The three cross-entropy passes over an unsplit vocabulary (one shard),
// as a single rank runs them; dlogits nullable.
void crossentropy(CpuBackend& cpu, float* losses, float* dlogits, const float* logits, const int32_t* targets,
                  float dloss, int N, int V, int Vp) {
  Vec stats(static_cast<size_t>(N) * 3), lse(static_cast<size_t>(N));
  cpu.crossentropy_stats(stats.data(), logits, targets, N, 0, Vp, V);
  cpu.crossentropy_combine(losses, lse.data(), stats.data(), 1, N);
  if (dlogits != nullptr) cpu.crossentropy_backward(dlogits, logits, lse.data(), targets, dloss, N, 0, Vp, V);
}

// Columns [begin, begin + width) of a row-major [rows, cols] matrix.
Vec columns(const Vec& m, int rows, int cols, int begin, int width) {
  Vec out(static_cast<size_t>(rows) * width);
  for (int r = 0; r < rows; ++r) {
    std::copy_n(m.begin() + static_cast<ptrdiff_t>(r) * cols + begin, width, out.begin() + static_cast<ptrdiff_t>(r) * width);
  }
  return out;
}

// ---- the kernels' losses for finite differences ----

struct AttentionShape {
  int B, T, C, NH;
  size_t qkv() const { return static_cast<size_t>(B) * T * 3 * C; }
  size_t out() const { return static_cast<size_t>(B) * T * C; }
  size_t lse() const { return static_cast<size_t>(B) * NH * T; }
};

void check_attention_gradient(const AttentionShape& s, uint64_t seed) {
  CpuBackend cpu;
  Vec qkv = random_vec(s.qkv(), seed, -2.0f, 2.0f);
  const Vec r = random_vec(s.out(), seed + 1);
  Vec out(s.out());
  Vec lse(s.lse());
  auto loss = [&] {
    cpu.attention_forward(out.data(), lse.data(), CpuBackend::self_attention(qkv.data(), s.B, s.T, s.C, s.NH));
    return weighted_sum(out, r);
  };
  loss();
  Vec dqkv(s.qkv(), 0.0f);
  cpu.attention_backward(CpuBackend::self_attention_grads(dqkv.data(), s.C), r.data(), out.data(), lse.data(),
                         CpuBackend::self_attention(qkv.data(), s.B, s.T, s.C, s.NH));
  check_gradient("dqkv", qkv, dqkv, loss);
}

TEST_SUITE("unit") {
  TEST_CASE("alloc returns zeroed memory aligned to 64 bytes") {
    CpuBackend cpu;
    for (size_t bytes : {size_t{1}, size_t{100}, size_t{4096}, size_t{1} << 20}) {
      auto* p = static_cast<unsigned char*>(cpu.alloc(bytes));
      REQUIRE(p != nullptr);
      CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
      CHECK(std::all_of(p, p + bytes, [](unsigned char c) { return c == 0; }));
      std::memset(p, 0xab, bytes);
      cpu.zero(p, bytes);
      CHECK(std::all_of(p, p + bytes, [](unsigned char c) { return c == 0; }));
      cpu.free(p);
    }
  }

  TEST_CASE("embedding forward adds the token and position rows") {
    CpuBackend cpu;
    const int B = 2, T = 5, C = 8, V = 4;
    const Vec wte = random_vec(static_cast<size_t>(V) * C, 1);
    const Vec wpe = random_vec(static_cast<size_t>(T) * C, 2);
    const Ints tokens = random_ints(B * T, V, 3);
    Vec out = nan_vec(static_cast<size_t>(B) * T * C);
    cpu.embedding_forward(out.data(), tokens.data(), wte.data(), 0, V, wpe.data(), B, T, C);
    Ref want(out.size());
    for (int bt = 0; bt < B * T; ++bt) {
      for (int c = 0; c < C; ++c) want[bt * C + c] = static_cast<double>(wte[tokens[bt] * C + c]) + wpe[bt % T * C + c];
    }
    check_close("out", out, want, 1e-7);
  }

  TEST_CASE("embedding backward matches finite differences with repeated tokens") {
    CpuBackend cpu;
    const int B = 2, T = 5, C = 8, V = 4;  // 10 positions over 4 tokens: repeats are certain
    Vec wte = random_vec(static_cast<size_t>(V) * C, 1);
    Vec wpe = random_vec(static_cast<size_t>(T) * C, 2);
    const Ints tokens = random_ints(B * T, V, 3);
    const Vec r = random_vec(static_cast<size_t>(B) * T * C, 4);
    Vec out(r.size());
    auto loss = [&] {
      cpu.embedding_forward(out.data(), tokens.data(), wte.data(), 0, V, wpe.data(), B, T, C);
      return weighted_sum(out, r);
    };
    Vec dwte(wte.size(), 0.0f);
    Vec dwpe(wpe.size(), 0.0f);
    cpu.embedding_backward(dwte.data(), dwpe.data(), r.data(), tokens.data(), 0, V, B, T, C);
    check_gradient("dwte", wte, dwte, loss);
    check_gradient("dwpe", wpe, dwpe, loss);
  }

  TEST_CASE("layernorm forward matches a naive double-precision reference") {
    CpuBackend cpu;
    const int N = 7, C = 40;
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 5, -3.0f, 5.0f);
    const Vec w = random_vec(C, 6, 0.5f, 1.5f);
    const Vec b = random_vec(C, 7);
    Vec out = nan_vec(inp.size());
    Vec mean = nan_vec(N);
    Vec rstd = nan_vec(N);
    cpu.norm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C, RowNorm{});
    Ref want_out, want_mean, want_rstd;
    layernorm_ref(want_out, want_mean, want_rstd, inp, w, b, N, C);
    check_close("out", out, want_out, 1e-6);
    check_close("mean", mean, want_mean, 1e-6);
    check_close("rstd", rstd, want_rstd, 1e-6);
  }

  TEST_CASE("add_norm_forward is accumulate then norm_forward bit for bit") {
    CpuBackend cpu;
    const int N = 9, C = 40;
    const Vec addend = random_vec(static_cast<size_t>(N) * C, 8, -2.0f, 2.0f);
    const Vec w = random_vec(C, 9, 0.5f, 1.5f), b = random_vec(C, 10);
    Vec fused_sum = random_vec(addend.size(), 11, -3.0f, 5.0f), apart_sum = fused_sum;
    Vec fused_out = nan_vec(addend.size()), fused_mean = nan_vec(N), fused_rstd = nan_vec(N);
    Vec apart_out = nan_vec(addend.size()), apart_mean = nan_vec(N), apart_rstd = nan_vec(N);
    cpu.add_norm_forward(fused_sum.data(), addend.data(), fused_out.data(), fused_mean.data(), fused_rstd.data(),
                         w.data(), b.data(), N, C, RowNorm{});
    cpu.accumulate(apart_sum.data(), addend.data(), apart_sum.size());
    cpu.norm_forward(apart_out.data(), apart_mean.data(), apart_rstd.data(), apart_sum.data(), w.data(), b.data(),
                     N, C, RowNorm{});
    CHECK(fused_sum == apart_sum);
    CHECK(fused_out == apart_out);
    CHECK(fused_mean == apart_mean);
    CHECK(fused_rstd == apart_rstd);
  }

  TEST_CASE("a bf16 LayerNorm output holds the float32 output rounded - with the same statistics and sum") {
    using keel::trainer::bf16;
    CpuBackend cpu;
    const int N = 33, C = 96;
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 12, -3.0f, 5.0f), addend = random_vec(inp.size(), 13);
    const Vec w = random_vec(C, 14, 0.5f, 1.5f), b = random_vec(C, 15);
    auto rounded = [](const Vec& v) {
      std::vector<uint16_t> bits(v.size());
      for (size_t i = 0; i < v.size(); ++i) bits[i] = keel::trainer::to_bf16(v[i]).bits;
      return bits;
    };
    auto bits_of = [](const std::vector<bf16>& v) {
      std::vector<uint16_t> bits(v.size());
      for (size_t i = 0; i < v.size(); ++i) bits[i] = v[i].bits;
      return bits;
    };
    Vec out = nan_vec(inp.size()), mean = nan_vec(N), rstd = nan_vec(N), mean16 = nan_vec(N), rstd16 = nan_vec(N);
    std::vector<bf16> out16(inp.size(), bf16{0xffff});
    cpu.norm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C, RowNorm{});
    cpu.norm_forward(out16.data(), mean16.data(), rstd16.data(), inp.data(), w.data(), b.data(), N, C, RowNorm{});
    CHECK(bits_of(out16) == rounded(out));
    CHECK(mean16 == mean);
    CHECK(rstd16 == rstd);
    Vec sum = inp, sum16 = inp;
    cpu.add_norm_forward(sum.data(), addend.data(), out.data(), mean.data(), rstd.data(), w.data(), b.data(), N,
                         C, RowNorm{});
    cpu.add_norm_forward(sum16.data(), addend.data(), out16.data(), mean16.data(), rstd16.data(), w.data(),
                         b.data(), N, C, RowNorm{});
    CHECK(sum16 == sum);
    CHECK(bits_of(out16) == rounded(out));
    CHECK(rstd16 == rstd);
  }

  TEST_CASE("layernorm backward matches finite differences") {
    CpuBackend cpu;
    const int N = 10, C = 8;
    Vec inp = random_vec(static_cast<size_t>(N) * C, 8);
    Vec w = random_vec(C, 9, 0.5f, 1.5f);
    Vec b = random_vec(C, 10);
    const Vec r = random_vec(inp.size(), 11);
    Vec out(inp.size());
    Vec mean(N);
    Vec rstd(N);
    auto loss = [&] {
      cpu.norm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C, RowNorm{});
      return weighted_sum(out, r);
    };
    loss();
    Vec dinp(inp.size(), 0.0f);
    Vec dw(C, 0.0f);
    Vec db(C, 0.0f);
    cpu.norm_backward(dinp.data(), nullptr, dw.data(), db.data(), r.data(), inp.data(), w.data(), mean.data(),
                      rstd.data(), N, C, RowNorm{});
    check_gradient("dinp", inp, dinp, loss);
    check_gradient("dweight", w, dw, loss);
    check_gradient("dbias", b, db, loss);
  }

  TEST_CASE("RMSNorm divides each row by its root mean square and its backward matches finite differences") {
    CpuBackend cpu;
    for (const float eps : {1e-5f, 1e-2f}) {
      CAPTURE(eps);
      const RowNorm rms{RowNorm::Kind::kRmsNorm, eps};
      const int N = 10, C = 8;
      Vec inp = random_vec(static_cast<size_t>(N) * C, 41, -3.0f, 5.0f);
      Vec w = random_vec(C, 42, 0.5f, 1.5f);
      const Vec r = random_vec(inp.size(), 43);
      Vec out = nan_vec(inp.size()), mean = nan_vec(N), rstd = nan_vec(N);
      auto loss = [&] {
        cpu.norm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), nullptr, N, C, rms);
        return weighted_sum(out, r);
      };
      loss();
      Ref want(out.size());
      for (int n = 0; n < N; ++n) {
        double squares = 0.0;
        for (int c = 0; c < C; ++c) squares += static_cast<double>(inp[n * C + c]) * inp[n * C + c];
        const double rs = 1.0 / std::sqrt(squares / C + eps);
        for (int c = 0; c < C; ++c) want[n * C + c] = inp[n * C + c] * rs * w[c];
      }
      check_close("out", out, want, 1e-6);
      CHECK(mean == Vec(N, 0.0f));
      Vec dinp(inp.size(), 0.0f), dw(C, 0.0f);
      cpu.norm_backward(dinp.data(), nullptr, dw.data(), nullptr, r.data(), inp.data(), w.data(), mean.data(),
                        rstd.data(), N, C, rms);
      check_gradient("dinp", inp, dinp, loss);
      check_gradient("dweight", w, dw, loss);
    }
  }

  TEST_CASE("SwiGLU is the SiLU of the gate times the up over packed rows and its backward matches finite differences") {
    CpuBackend cpu;
    const int N = 6, F = 5;
    Vec pre = random_vec(static_cast<size_t>(N) * 2 * F, 44, -4.0f, 4.0f);
    const Vec r = random_vec(static_cast<size_t>(N) * F, 45);
    Vec out = nan_vec(r.size());
    auto loss = [&] {
      cpu.swiglu_forward(out.data(), pre.data(), N, F);
      return weighted_sum(out, r);
    };
    loss();
    Ref want(out.size());
    for (int n = 0; n < N; ++n) {
      for (int j = 0; j < F; ++j) {
        const double gate = pre[n * 2 * F + j], up = pre[n * 2 * F + F + j];
        want[n * F + j] = gate / (1.0 + std::exp(-gate)) * up;
      }
    }
    check_close("out", out, want, 1e-6);
    Vec dpre = nan_vec(pre.size());  // written over, not added to
    cpu.swiglu_backward(dpre.data(), pre.data(), r.data(), N, F);
    check_gradient("dpre", pre, dpre, loss);
  }

  TEST_CASE("rotary turns each pair of a head by its global position's angle and its backward is the transpose") {
    CpuBackend cpu;
    // Rows of 3 heads of 8 channels and 2 channels past them no turn touches.
    const int B = 2, T = 5, d = 8, heads = 3, ld = heads * d + 2, P = 16, position = 7;
    Vec cos(static_cast<size_t>(P) * d / 2), sin(cos.size());
    const Vec angles = random_vec(cos.size(), 46, -3.0f, 3.0f);
    for (size_t i = 0; i < angles.size(); ++i) {
      cos[i] = std::cos(angles[i]);
      sin[i] = std::sin(angles[i]);
    }
    const Vec x = random_vec(static_cast<size_t>(B) * T * ld, 47), g = random_vec(x.size(), 48);
    Vec y = x, back = g;
    cpu.rotary_forward(y.data(), ld, cos.data(), sin.data(), B, T, position, heads, d);
    cpu.rotary_backward(back.data(), ld, cos.data(), sin.data(), B, T, position, heads, d);
    Ref want(x.begin(), x.end());
    for (int row = 0; row < B * T; ++row) {
      const size_t angle = static_cast<size_t>(position + row % T) * d / 2;
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < d / 2; ++j) {
          const size_t at = static_cast<size_t>(row) * ld + h * d + j;
          const double x1 = x[at], x2 = x[at + d / 2], c = cos[angle + j], s = sin[angle + j];
          want[at] = x1 * c - x2 * s;
          want[at + d / 2] = x2 * c + x1 * s;
        }
      }
    }
    check_close("turned", y, want, 1e-6);
    // <R x, g> = <x, R^T g>: the backward is the transpose of the turn.
    double forward_dot = 0.0, backward_dot = 0.0;
    for (size_t i = 0; i < x.size(); ++i) {
      forward_dot += static_cast<double>(y[i]) * g[i];
      backward_dot += static_cast<double>(x[i]) * back[i];
    }
    CHECK(std::fabs(forward_dot - backward_dot) <= 1e-5 * std::fabs(forward_dot));
  }

  TEST_CASE("grouped-query attention equals multi-head attention over repeated key/value heads") {
    CpuBackend cpu;
    for (const int KVH : {2, 1}) {
      CAPTURE(KVH);
      // T = 70: two query blocks, so a key/value head gathers across blocks and heads.
      const int B = 2, T = 70, NH = 4, d = 8, C = NH * d, KV = KVH * d, W = C + 2 * KV, group = NH / KVH;
      const size_t rows = static_cast<size_t>(B) * T;
      const Vec grouped = random_vec(rows * W, 49, -2.0f, 2.0f);
      Vec repeated(rows * 3 * C);
      for (size_t r = 0; r < rows; ++r) {
        const float* from = grouped.data() + r * W;
        float* to = repeated.data() + r * 3 * C;
        std::copy_n(from, C, to);
        for (int h = 0; h < NH; ++h) {
          std::copy_n(from + C + h / group * d, d, to + C + h * d);
          std::copy_n(from + C + KV + h / group * d, d, to + 2 * C + h * d);
        }
      }
      const Vec dout = random_vec(rows * C, 50);
      Vec out_g = nan_vec(rows * C), out_r = nan_vec(rows * C);
      Vec lse_g = nan_vec(static_cast<size_t>(B) * NH * T), lse_r = nan_vec(lse_g.size());
      const auto in_g = CpuBackend::self_attention(grouped.data(), B, T, C, NH, KVH);
      const auto in_r = CpuBackend::self_attention(repeated.data(), B, T, C, NH);
      cpu.attention_forward(out_g.data(), lse_g.data(), in_g);
      cpu.attention_forward(out_r.data(), lse_r.data(), in_r);
      check_close("out", out_g, Ref(out_r.begin(), out_r.end()), 1e-6);
      check_close("lse", lse_g, Ref(lse_r.begin(), lse_r.end()), 1e-6);
      Vec dgrouped(grouped.size(), 0.0f), drepeated(repeated.size(), 0.0f);
      cpu.attention_backward(CpuBackend::self_attention_grads(dgrouped.data(), C, KV), dout.data(), out_g.data(),
                             lse_g.data(), in_g);
      cpu.attention_backward(CpuBackend::self_attention_grads(drepeated.data(), C), dout.data(), out_r.data(),
                             lse_r.data(), in_r);
      // A key/value head's gradient is the sum of its group's.
      Ref want(dgrouped.size(), 0.0);
      for (size_t r = 0; r < rows; ++r) {
        const float* from = drepeated.data() + r * 3 * C;
        double* to = want.data() + r * W;
        for (int c = 0; c < C; ++c) to[c] = from[c];
        for (int h = 0; h < NH; ++h) {
          for (int j = 0; j < d; ++j) {
            to[C + h / group * d + j] += from[C + h * d + j];
            to[C + KV + h / group * d + j] += from[2 * C + h * d + j];
          }
        }
      }
      check_close("dqkv", dgrouped, want, 1e-5);
    }
    // And against finite differences directly.
    const int B = 1, T = 9, NH = 4, KVH = 2, d = 4, C = NH * d, W = C + 2 * KVH * d;
    Vec qkv = random_vec(static_cast<size_t>(B) * T * W, 51, -2.0f, 2.0f);
    const Vec r = random_vec(static_cast<size_t>(B) * T * C, 52);
    Vec out(r.size()), lse(static_cast<size_t>(B) * NH * T);
    auto loss = [&] {
      cpu.attention_forward(out.data(), lse.data(), CpuBackend::self_attention(qkv.data(), B, T, C, NH, KVH));
      return weighted_sum(out, r);
    };
    loss();
    Vec dqkv(qkv.size(), 0.0f);
    cpu.attention_backward(CpuBackend::self_attention_grads(dqkv.data(), C, KVH * d), r.data(), out.data(), lse.data(),
                           CpuBackend::self_attention(qkv.data(), B, T, C, NH, KVH));
    check_gradient("dqkv", qkv, dqkv, loss);
  }

  TEST_CASE("layernorm backward puts each input gradient sum rounded to bf16 beside it and changes nothing else") {
    CpuBackend cpu;
    const int N = 70, C = 24;  // chunks of rows, the last one short
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 15), w = random_vec(C, 16, 0.5f, 1.5f);
    const Vec dout = random_vec(inp.size(), 17), start = random_vec(inp.size(), 18);
    Vec mean(N), rstd(N), out(inp.size());
    cpu.norm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), w.data(), N, C, RowNorm{});
    Vec plain = start, with_copy = start, dw(C, 0.0f), db(C, 0.0f), dw_copy(C, 0.0f), db_copy(C, 0.0f);
    std::vector<keel::trainer::bf16> rounded(inp.size());
    cpu.norm_backward(plain.data(), nullptr, dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(),
                      rstd.data(), N, C, RowNorm{});
    cpu.norm_backward(with_copy.data(), rounded.data(), dw_copy.data(), db_copy.data(), dout.data(), inp.data(),
                      w.data(), mean.data(), rstd.data(), N, C, RowNorm{});
    CHECK(with_copy == plain);
    CHECK(dw_copy == dw);
    CHECK(db_copy == db);
    size_t mismatches = 0;
    for (size_t i = 0; i < plain.size(); ++i) mismatches += rounded[i].bits != keel::trainer::to_bf16(plain[i]).bits;
    CHECK(mismatches == 0);
  }

  TEST_CASE("matmul forward matches a naive reference with and without bias") {
    CpuBackend cpu;
    // The second shape is big enough to cut the GEMM into uneven tiles.
    for (auto [N, C, OC] : {std::tuple{3, 5, 4}, std::tuple{200, 400, 900}}) {
      CAPTURE(N);
      const Vec inp = random_vec(static_cast<size_t>(N) * C, 12);
      const Vec w = random_vec(static_cast<size_t>(OC) * C, 13);
      const Vec bias = random_vec(OC, 14);
      Vec out = nan_vec(static_cast<size_t>(N) * OC);
      cpu.matmul_forward(out.data(), inp.data(), w.data(), bias.data(), N, C, OC);
      check_close("with bias", out, matmul_ref(inp, w, bias.data(), N, C, OC), 1e-6);
      out = nan_vec(out.size());
      cpu.matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
      check_close("without bias", out, matmul_ref(inp, w, nullptr, N, C, OC), 1e-6);
    }
  }

  TEST_CASE("matmul backward matches finite differences for input and weight and bias") {
    CpuBackend cpu;
    const int N = 10, C = 8, OC = 6;
    Vec inp = random_vec(static_cast<size_t>(N) * C, 15);
    Vec w = random_vec(static_cast<size_t>(OC) * C, 16);
    Vec bias = random_vec(OC, 17);
    const Vec r = random_vec(static_cast<size_t>(N) * OC, 18);
    Vec out(r.size());
    auto loss = [&] {
      cpu.matmul_forward(out.data(), inp.data(), w.data(), bias.data(), N, C, OC);
      return weighted_sum(out, r);
    };
    Vec dinp(inp.size(), 0.0f);
    Vec dw(w.size(), 0.0f);
    Vec db(OC, 0.0f);
    cpu.matmul_backward(dinp.data(), keel::trainer::Into::kAdd, dw.data(), db.data(), r.data(), inp.data(), w.data(), N, C, OC);
    check_gradient("dinp", inp, dinp, loss);
    check_gradient("dweight", w, dw, loss);
    check_gradient("dbias", bias, db, loss);
  }

  TEST_CASE("matmul backward leaves null gradients alone - adds to the others - and writes dinp over when told to") {
    CpuBackend cpu;
    const int N = 6, C = 4, OC = 3;
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 19);
    const Vec w = random_vec(static_cast<size_t>(OC) * C, 20);
    const Vec r = random_vec(static_cast<size_t>(N) * OC, 21);
    Vec dinp_all(inp.size(), 0.0f), dw_all(w.size(), 0.0f), db_all(OC, 0.0f);
    cpu.matmul_backward(dinp_all.data(), keel::trainer::Into::kAdd, dw_all.data(), db_all.data(), r.data(), inp.data(), w.data(), N, C, OC);
    Vec dw_only(w.size(), 0.0f);
    cpu.matmul_backward(nullptr, keel::trainer::Into::kAdd, dw_only.data(), nullptr, r.data(), inp.data(), w.data(), N, C, OC);
    CHECK(dw_only == dw_all);
    Vec dinp_only(inp.size(), 0.0f);
    cpu.matmul_backward(dinp_only.data(), keel::trainer::Into::kAdd, nullptr, nullptr, r.data(), inp.data(), w.data(), N, C, OC);
    CHECK(dinp_only == dinp_all);
    // Written over, what it held (NaN) is gone; added to, it stays.
    Vec written = nan_vec(inp.size()), added(inp.size(), 1.0f);
    cpu.matmul_backward(written.data(), keel::trainer::Into::kWrite, nullptr, nullptr, r.data(), inp.data(), w.data(),
                        N, C, OC);
    CHECK(written == dinp_all);
    cpu.matmul_backward(added.data(), keel::trainer::Into::kAdd, nullptr, nullptr, r.data(), inp.data(), w.data(), N,
                        C, OC);
    for (size_t i = 0; i < added.size(); ++i) CHECK(added[i] == doctest::Approx(1.0f + dinp_all[i]));
  }

  TEST_CASE("matmul with bf16 inputs is the float32 matmul of the operands rounded to bf16") {
    // The big shape cuts the GEMMs into tiles, so the rounded copies are
    // shared across tiles; dbias sums dout itself, unrounded.
    for (auto [N, C, OC] : {std::tuple{7, 5, 3}, std::tuple{200, 400, 900}}) {
      CAPTURE(N);
      CpuBackend bf16(0, keel::trainer::DType::kBF16), fp32(0, keel::trainer::DType::kF32);
      CHECK(bf16.gemm_inputs() == keel::trainer::DType::kBF16);
      const Vec inp = random_vec(static_cast<size_t>(N) * C, 22), w = random_vec(static_cast<size_t>(OC) * C, 23);
      const Vec bias = random_vec(OC, 24), dout = random_vec(static_cast<size_t>(N) * OC, 25);
      auto rounded = [](Vec v) {
        for (float& x : v) x = keel::trainer::bf16_rounded(x);
        return v;
      };
      struct Result {
        Vec out, dinp, dw, db;
      };
      auto run = [&](CpuBackend& cpu, const Vec& x, const Vec& weight, const Vec& dy) {
        Result r{nan_vec(dout.size()), Vec(inp.size(), 0.5f), Vec(w.size(), 0.25f), Vec(OC, 0.0f)};
        cpu.matmul_forward(r.out.data(), x.data(), weight.data(), bias.data(), N, C, OC);
        cpu.matmul_backward(r.dinp.data(), keel::trainer::Into::kAdd, r.dw.data(), r.db.data(), dy.data(), x.data(), weight.data(), N, C, OC);
        return r;
      };
      const Result got = run(bf16, inp, w, dout);
      const Result want = run(fp32, rounded(inp), rounded(w), rounded(dout));
      CHECK(got.out == want.out);
      CHECK(got.dinp == want.dinp);
      CHECK(got.dw == want.dw);
      CHECK(got.db == run(fp32, inp, w, dout).db);
      CHECK(got.out != run(fp32, inp, w, dout).out);  // the rounding really happened
    }
  }

  TEST_CASE("a bf16 activation multiplies as its float32 original does under bf16 GEMM inputs") {
    using keel::trainer::bf16;
    const int N = 200, C = 400, OC = 90;
    CpuBackend cpu(0, keel::trainer::DType::kBF16);
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 26), w = random_vec(static_cast<size_t>(OC) * C, 27);
    const Vec dout = random_vec(static_cast<size_t>(N) * OC, 28);
    std::vector<bf16> inp16(inp.size());
    for (size_t i = 0; i < inp.size(); ++i) inp16[i] = keel::trainer::to_bf16(inp[i]);
    Vec out = nan_vec(dout.size()), out16 = nan_vec(dout.size());
    Vec dw(w.size(), 0.25f), dw16(w.size(), 0.25f);
    cpu.matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
    cpu.matmul_forward(out16.data(), inp16.data(), w.data(), nullptr, N, C, OC);
    cpu.matmul_backward(nullptr, keel::trainer::Into::kAdd, dw.data(), nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
    cpu.matmul_backward(nullptr, keel::trainer::Into::kAdd, dw16.data(), nullptr, dout.data(), inp16.data(), w.data(), N, C, OC);
    CHECK(out16 == out);
    CHECK(dw16 == dw);
  }

  TEST_CASE("a backend reports the working buffers its GEMMs grew - and float32 GEMMs grow none") {
    const int N = 30, C = 20, OC = 10;
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 35), w = random_vec(static_cast<size_t>(OC) * C, 36);
    Vec out(static_cast<size_t>(N) * OC);
    CpuBackend fp32(0, keel::trainer::DType::kF32), bf16(0, keel::trainer::DType::kBF16);
    CHECK(bf16.scratch_bytes() == 0);
    fp32.matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
    bf16.matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
    CHECK(fp32.scratch_bytes() == 0);
    // Both operands' rounded copies, kept for the next call.
    CHECK(bf16.scratch_bytes() >= (inp.size() + w.size()) * sizeof(float));
  }

  TEST_CASE("a bf16 GEMM operand or attention input on a backend with float32 GEMM inputs is an internal error") {
    CpuBackend cpu(0, keel::trainer::DType::kF32);
    std::vector<keel::trainer::bf16> inp(6);
    Vec w(6, 1.0f), out(4, 0.0f);
    try {
      cpu.matmul_forward(out.data(), inp.data(), w.data(), nullptr, 2, 3, 2);
      FAIL("no error");
    } catch (const keel::common::Error& e) {
      CHECK(e.code() == keel::common::ErrorCode::kInternal);
    }
    // Nor may attention's q, k and v be bf16 there.
    std::vector<keel::trainer::bf16> qkv(2 * 3 * 4);
    Vec att_out(2 * 4), lse(2);
    try {
      cpu.attention_forward(att_out.data(), lse.data(),
                            CpuBackend::self_attention(qkv.data(), 1, 2, 4, 1));
      FAIL("no error");
    } catch (const keel::common::Error& e) {
      CHECK(e.code() == keel::common::ErrorCode::kInternal);
    }
  }

  TEST_CASE("a bf16 matmul output is the float32 output rounded - and GELU both ways reads the rounded value") {
    using keel::trainer::bf16;
    const int N = 40, C = 24, OC = 64;
    CpuBackend cpu(0, keel::trainer::DType::kBF16);
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 30, -2.0f, 2.0f), w = random_vec(static_cast<size_t>(OC) * C, 31);
    const Vec bias = random_vec(OC, 32);
    const size_t n = static_cast<size_t>(N) * OC;
    // Without a bias (the logits) and with one (the MLP's pre-activation).
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      CAPTURE(b != nullptr);
      Vec linear = nan_vec(n);
      std::vector<bf16> linear16(n, bf16{0xffff});
      cpu.matmul_forward(linear.data(), inp.data(), w.data(), b, N, C, OC);
      cpu.matmul_forward(linear16.data(), inp.data(), w.data(), b, N, C, OC);
      size_t mismatches = 0;
      for (size_t i = 0; i < n; ++i) mismatches += linear16[i].bits != keel::trainer::to_bf16(linear[i]).bits;
      CHECK(mismatches == 0);
    }
    // A bf16 bias (the GEMM copy's) adds the values it holds: the float32
    // bias of the same values gives the same bits; one beside a float32
    // output is refused.
    {
      std::vector<bf16> bias16(OC);
      Vec bias_widened(OC);
      for (int c = 0; c < OC; ++c) {
        bias16[c] = keel::trainer::to_bf16(bias[c]);
        bias_widened[c] = keel::trainer::to_float(bias16[c]);
      }
      std::vector<bf16> from_bf16(n, bf16{0xffff}), from_f32(n, bf16{0xffff});
      cpu.matmul_forward(from_bf16.data(), inp.data(), w.data(), bias16.data(), N, C, OC);
      cpu.matmul_forward(from_f32.data(), inp.data(), w.data(), bias_widened.data(), N, C, OC);
      size_t mismatches = 0;
      for (size_t i = 0; i < n; ++i) mismatches += from_bf16[i].bits != from_f32[i].bits;
      CHECK(mismatches == 0);
      Vec linear = nan_vec(n);
      CHECK_THROWS_AS(cpu.matmul_forward(linear.data(), inp.data(), w.data(), bias16.data(), N, C, OC),
                      keel::common::Error);
    }
    // As float32, then rounded by hand.
    Vec pre = nan_vec(n), out = nan_vec(n);
    cpu.matmul_forward(pre.data(), inp.data(), w.data(), bias.data(), N, C, OC);
    for (float& x : pre) x = keel::trainer::bf16_rounded(x);
    cpu.gelu_forward(out.data(), pre.data(), n);
    // Kept as bf16, and GELU of that.
    std::vector<bf16> pre16(n, bf16{0xffff});
    Vec out16 = nan_vec(n);
    cpu.matmul_forward(pre16.data(), inp.data(), w.data(), bias.data(), N, C, OC);
    cpu.gelu_forward(out16.data(), pre16.data(), n);
    Vec widened(n);
    for (size_t i = 0; i < n; ++i) widened[i] = keel::trainer::to_float(pre16[i]);
    CHECK(widened == pre);
    CHECK(out16 == out);
    // The backward through GELU at the bf16 pre-activation is the one at its float32 widening.
    const Vec w_proj = random_vec(static_cast<size_t>(C) * OC, 33), dout = random_vec(static_cast<size_t>(N) * C, 34);
    Vec dpre = nan_vec(n), dpre16 = nan_vec(n), dw(w_proj.size(), 0.0f), dw16(w_proj.size(), 0.0f);
    cpu.matmul_backward_through_gelu(dpre.data(), dw.data(), nullptr, dout.data(), out.data(), w_proj.data(), pre.data(),
                                     N, OC, C);
    cpu.matmul_backward_through_gelu(dpre16.data(), dw16.data(), nullptr, dout.data(), out.data(), w_proj.data(),
                                     pre16.data(), N, OC, C);
    CHECK(dpre16 == dpre);
    CHECK(dw16 == dw);
    // Kept as bf16, dpre is the float32 one rounded, bit for bit.
    std::vector<bf16> dpre_kept(n, bf16{0xffff});
    cpu.matmul_backward_through_gelu(dpre_kept.data(), nullptr, nullptr, dout.data(), nullptr, w_proj.data(),
                                     pre16.data(), N, OC, C);
    size_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += dpre_kept[i].bits != keel::trainer::to_bf16(dpre[i]).bits;
    CHECK(mismatches == 0);
  }

  TEST_CASE("a bf16 GELU output holds the float32 output rounded to nearest - ties to even") {
    CpuBackend cpu;
    const Vec inp = random_vec(50000, 29, -8.0f, 8.0f);
    Vec out = nan_vec(inp.size());
    std::vector<keel::trainer::bf16> out16(inp.size(), keel::trainer::bf16{0xffff});
    cpu.gelu_forward(out.data(), inp.data(), inp.size());
    cpu.gelu_forward(out16.data(), inp.data(), inp.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < inp.size(); ++i) mismatches += out16[i].bits != keel::trainer::to_bf16(out[i]).bits;
    CHECK(mismatches == 0);
  }

  TEST_CASE("attention forward matches a naive reference within and across query blocks") {
    CpuBackend cpu;
    for (AttentionShape s : {AttentionShape{2, 5, 8, 2}, AttentionShape{2, 150, 16, 2}}) {
      CAPTURE(s.T);
      const Vec qkv = random_vec(s.qkv(), 22, -2.0f, 2.0f);
      Vec out = nan_vec(s.out());
      Vec lse = nan_vec(s.lse());
      cpu.attention_forward(out.data(), lse.data(), CpuBackend::self_attention(qkv.data(), s.B, s.T, s.C, s.NH));
      Ref want_out, want_lse;
      attention_ref(want_out, want_lse, qkv, s.B, s.T, s.C, s.NH);
      check_close("out", out, want_out, 1e-5);
      check_close("lse", lse, want_lse, 1e-5);
    }
  }

  TEST_CASE("attention over two chunks of keys merged equals attention over all of them forward and backward") {
    // Queries at positions 40..149 (three query blocks); keys 0..69 in one
    // chunk and 70..149 in the other, so queries 40..69 see nothing of the
    // second (out 0, lse -inf) and the merge must leave them alone.
    CpuBackend cpu;
    const int B = 2, NH = 2, C = 16, T = 150, q0 = 40, split = 70;
    const Vec q = random_vec(static_cast<size_t>(B) * T * C, 81, -2.0f, 2.0f);
    const Vec k = random_vec(q.size(), 82, -2.0f, 2.0f), v = random_vec(q.size(), 83, -2.0f, 2.0f);
    // Positions [begin, end) of every batch of a [B, T, C] tensor, as their own [B, end - begin, C] tensor.
    auto rows = [&](const Vec& x, int begin, int end) {
      Vec out;
      for (int b = 0; b < B; ++b) {
        out.insert(out.end(), x.begin() + (static_cast<ptrdiff_t>(b) * T + begin) * C,
                   x.begin() + (static_cast<ptrdiff_t>(b) * T + end) * C);
      }
      return out;
    };
    const int Tq = T - q0;
    const Vec q_chunk = rows(q, q0, T), dout = random_vec(static_cast<size_t>(B) * Tq * C, 84);
    struct Keys {
      Vec k, v;
      int offset, count;
    };
    const Keys all{rows(k, 0, T), rows(v, 0, T), 0, T};
    const Keys first{rows(k, 0, split), rows(v, 0, split), 0, split};
    const Keys second{rows(k, split, T), rows(v, split, T), split, T - split};
    auto inputs = [&](const Keys& keys) {
      return CpuBackend::AttentionInputs{q_chunk.data(), keys.k.data(), keys.v.data(), C, C, B, Tq, keys.count, C, NH,
                                         q0, keys.offset};
    };
    const size_t out_n = static_cast<size_t>(B) * Tq * C, lse_n = static_cast<size_t>(B) * NH * Tq;
    Vec whole_out = nan_vec(out_n), whole_lse = nan_vec(lse_n), out = nan_vec(out_n), lse = nan_vec(lse_n);
    Vec part_out = nan_vec(out_n), part_lse = nan_vec(lse_n);
    cpu.attention_forward(whole_out.data(), whole_lse.data(), inputs(all));
    cpu.attention_forward(out.data(), lse.data(), inputs(first));
    cpu.attention_forward(part_out.data(), part_lse.data(), inputs(second));
    CHECK(part_lse[0] == -INFINITY);  // query 40 sees no key of 70..149
    CHECK(part_out[0] == 0.0f);
    cpu.attention_merge(out.data(), lse.data(), part_out.data(), part_lse.data(), B, Tq, C, NH);
    check_close("merged out", out, Ref(whole_out.begin(), whole_out.end()), 1e-6);
    check_close("merged lse", lse, Ref(whole_lse.begin(), whole_lse.end()), 1e-6);

    struct Grads {
      Vec dq, dk, dv;
    };
    auto backward = [&](const Keys& keys, Vec& dq) {
      Grads g{{}, Vec(keys.k.size(), 0.0f), Vec(keys.v.size(), 0.0f)};
      cpu.attention_backward({dq.data(), g.dk.data(), g.dv.data()}, dout.data(), whole_out.data(), whole_lse.data(),
                             inputs(keys));
      return g;
    };
    Vec whole_dq(q_chunk.size(), 0.0f), chunked_dq(q_chunk.size(), 0.0f);
    const Grads whole = backward(all, whole_dq);
    const Grads a = backward(first, chunked_dq), b = backward(second, chunked_dq);
    check_close("dq summed over the chunks", chunked_dq, Ref(whole_dq.begin(), whole_dq.end()), 1e-5);
    for (const auto& [name, got, want] : {std::tuple{"dk of the first chunk", a.dk, rows(whole.dk, 0, split)},
                                          std::tuple{"dk of the second chunk", b.dk, rows(whole.dk, split, T)},
                                          std::tuple{"dv of the first chunk", a.dv, rows(whole.dv, 0, split)},
                                          std::tuple{"dv of the second chunk", b.dv, rows(whole.dv, split, T)}}) {
      check_close(name, got, Ref(want.begin(), want.end()), 1e-5);
    }
  }

  TEST_CASE("with bf16 GEMM inputs attention rounds q k v dout and the probabilities and nothing else") {
    // Queries cross three query blocks; the views are qkv's strided ones,
    // so the gradients must land in the caller's layout.
    const AttentionShape s{2, 150, 32, 2};
    CpuBackend fp32, bf16(0, keel::trainer::DType::kBF16);
    auto rounded = [](Vec v) {
      for (float& x : v) x = keel::trainer::bf16_rounded(x);
      return v;
    };
    struct Result {
      Vec out, lse, dqkv;
    };
    auto run = [&](CpuBackend& cpu, const Vec& qkv, const Vec& dout) {
      Result r{nan_vec(s.out()), nan_vec(s.lse()), Vec(s.qkv(), 0.5f)};
      const auto in = CpuBackend::self_attention(qkv.data(), s.B, s.T, s.C, s.NH);
      cpu.attention_forward(r.out.data(), r.lse.data(), in);
      cpu.attention_backward(CpuBackend::self_attention_grads(r.dqkv.data(), s.C), dout.data(), r.out.data(),
                             r.lse.data(), in);
      return r;
    };
    const Vec qkv = random_vec(s.qkv(), 85, -2.0f, 2.0f), dout = random_vec(s.out(), 86);
    // On inputs bf16 holds exactly, the scores, and so lse, are float32's;
    // only the rounded probabilities and score gradients move out and dqkv.
    const Result exact = run(fp32, rounded(qkv), rounded(dout)), got = run(bf16, rounded(qkv), rounded(dout));
    CHECK(got.lse == exact.lse);
    CHECK(got.out != exact.out);
    for (const auto& [name, a, b] : {std::tuple{"out", got.out, exact.out}, std::tuple{"dqkv", got.dqkv, exact.dqkv}}) {
      CAPTURE(name);
      CHECK(relative_l2(a, b) <= 1e-2);
    }
    // On any inputs: within bf16's rounding of float32 attention.
    const Result want = run(fp32, qkv, dout), any = run(bf16, qkv, dout);
    for (const auto& [name, a, b] : {std::tuple{"out", any.out, want.out}, std::tuple{"lse", any.lse, want.lse},
                                     std::tuple{"dqkv", any.dqkv, want.dqkv}}) {
      CAPTURE(name);
      CHECK(relative_l2(a, b) <= 2e-2);
      CHECK(relative_l2(a, b) > 0.0);
    }
  }

  TEST_CASE("attention's output and dqkv kept as bf16 are the float32 ones rounded - and the backward reads out widened") {
    using keel::trainer::bf16;
    const AttentionShape s{2, 150, 32, 2};
    CpuBackend cpu(0, keel::trainer::DType::kBF16);
    const Vec qkv = random_vec(s.qkv(), 87, -2.0f, 2.0f), dout = random_vec(s.out(), 88);
    const auto in = CpuBackend::self_attention(qkv.data(), s.B, s.T, s.C, s.NH);
    Vec out = nan_vec(s.out()), lse = nan_vec(s.lse()), lse16 = nan_vec(s.lse());
    std::vector<bf16> out16(s.out(), bf16{0xffff});
    cpu.attention_forward(out.data(), lse.data(), in);
    cpu.attention_forward(out16.data(), lse16.data(), in);
    size_t mismatches = 0;
    Vec widened(out16.size());
    for (size_t i = 0; i < out16.size(); ++i) {
      mismatches += out16[i].bits != keel::trainer::to_bf16(out[i]).bits;
      widened[i] = keel::trainer::to_float(out16[i]);
    }
    CHECK(mismatches == 0);
    CHECK(lse16 == lse);
    Vec dqkv(s.qkv(), 0.5f), dqkv16(s.qkv(), 0.5f);
    cpu.attention_backward(CpuBackend::self_attention_grads(dqkv.data(), s.C), dout.data(), widened.data(), lse.data(),
                           in);
    cpu.attention_backward(CpuBackend::self_attention_grads(dqkv16.data(), s.C), dout.data(), out16.data(), lse.data(),
                           in);
    CHECK(dqkv16 == dqkv);
    // dqkv kept as bf16 is overwritten, whatever it held (NaN bits here),
    // with the float32 gradients summed from zero, rounded, in qkv's
    // strided layout.
    Vec from_zero(s.qkv(), 0.0f);
    std::vector<bf16> kept(s.qkv(), bf16{0xffff});
    cpu.attention_backward(CpuBackend::self_attention_grads(from_zero.data(), s.C), dout.data(), out.data(),
                           lse.data(), in);
    cpu.attention_backward(CpuBackend::self_attention_grads(kept.data(), s.C), dout.data(), out.data(), lse.data(), in);
    mismatches = 0;
    for (size_t i = 0; i < kept.size(); ++i) mismatches += kept[i].bits != keel::trainer::to_bf16(from_zero[i]).bits;
    CHECK(mismatches == 0);
    // Only a backend whose GEMMs take bf16 keeps them so.
    CpuBackend fp32;
    CHECK_THROWS_AS(fp32.attention_backward(CpuBackend::self_attention_grads(kept.data(), s.C), dout.data(),
                                            out.data(), lse.data(), in),
                    keel::common::Error);
  }

  TEST_CASE("attention backward matches finite differences") {
    check_attention_gradient({2, 5, 8, 2}, 23);
  }

  TEST_CASE("attention backward matches finite differences across several query blocks") {
    check_attention_gradient({1, 67, 4, 2}, 24);
  }

  TEST_CASE("gelu forward matches the tanh formula in double precision") {
    CpuBackend cpu;
    Vec inp = random_vec(20000, 25, -6.0f, 6.0f);
    for (float x : {0.0f, -0.0f, 1e-20f, -1e-20f, 12.0f, -12.0f, 30.0f, -30.0f, 100.0f, -100.0f}) inp.push_back(x);
    Vec out = nan_vec(inp.size());
    cpu.gelu_forward(out.data(), inp.data(), inp.size());
    size_t failures = 0;
    for (size_t i = 0; i < inp.size(); ++i) {
      const double x = inp[i];
      const double want = gelu_ref(x);
      // u itself carries float rounding of |u| ulps and gelu's relative
      // sensitivity to u is up to 2, so the bound widens with |u| in the
      // negative tail; 1e-30 absolute covers where gelu underflows.
      const double u = std::fabs(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x));
      const double err = std::fabs(out[i] - want);
      if (!(err <= 1e-6 * std::max(1.0, u / 2.0) * std::fabs(want) || err <= 1e-30)) {
        if (failures++ < 5) MESSAGE("x " << x << " got " << out[i] << " want " << want);
      }
    }
    CHECK(failures == 0);
  }

  TEST_CASE("gelu backward matches finite differences") {
    CpuBackend cpu;
    Vec inp = random_vec(64, 26, -4.0f, 4.0f);
    const Vec r = random_vec(inp.size(), 27);
    Vec out(inp.size());
    auto loss = [&] {
      cpu.gelu_forward(out.data(), inp.data(), inp.size());
      return weighted_sum(out, r);
    };
    Vec dinp(inp.size(), 0.0f);
    cpu.gelu_backward(dinp.data(), inp.data(), r.data(), inp.size());
    check_gradient("dinp", inp, dinp, loss);
  }

  TEST_CASE("gelu backward is finite and vanishes far into the negative tail") {
    CpuBackend cpu;
    const Vec inp = {-100.0f, -30.0f, -12.0f, 12.0f, 30.0f, 100.0f};
    const Vec ones(inp.size(), 1.0f);
    Vec dinp(inp.size(), 0.0f);
    cpu.gelu_backward(dinp.data(), inp.data(), ones.data(), inp.size());
    for (size_t i = 0; i < 3; ++i) CHECK(std::fabs(dinp[i]) < 1e-20f);
    for (size_t i = 3; i < 6; ++i) CHECK(dinp[i] == doctest::Approx(1.0f).epsilon(1e-6));
  }

  TEST_CASE("crossentropy loss matches a naive reference and ignores padded columns") {
    CpuBackend cpu;
    const int N = 6, V = 7, Vp = 10;
    Vec logits = random_vec(static_cast<size_t>(N) * Vp, 28, -3.0f, 3.0f);
    for (int n = 0; n < N; ++n) {
      for (int c = V; c < Vp; ++c) logits[n * Vp + c] = 50.0f;  // would dominate if they took part
    }
    const Ints targets = random_ints(N, V, 29);
    Vec losses = nan_vec(N);
    crossentropy(cpu, losses.data(), nullptr, logits.data(), targets.data(), 1.0f, N, V, Vp);
    Ref want(N);
    for (int n = 0; n < N; ++n) {
      double max = -INFINITY;
      for (int c = 0; c < V; ++c) max = std::max(max, static_cast<double>(logits[n * Vp + c]));
      double sum = 0.0;
      for (int c = 0; c < V; ++c) sum += std::exp(logits[n * Vp + c] - max);
      want[n] = max + std::log(sum) - logits[n * Vp + targets[n]];
    }
    check_close("losses", losses, want, 1e-6);
  }

  TEST_CASE("crossentropy gradient matches finite differences and is zero in padded columns") {
    CpuBackend cpu;
    const int N = 4, V = 7, Vp = 10;
    const float dloss = 0.37f;
    Vec logits = random_vec(static_cast<size_t>(N) * Vp, 30, -3.0f, 3.0f);
    const Ints targets = random_ints(N, V, 31);
    Vec losses(N);
    auto loss = [&] {
      crossentropy(cpu, losses.data(), nullptr, logits.data(), targets.data(), dloss, N, V, Vp);
      return dloss * std::accumulate(losses.begin(), losses.end(), 0.0);
    };
    Vec dlogits = nan_vec(logits.size());
    crossentropy(cpu, losses.data(), dlogits.data(), logits.data(), targets.data(), dloss, N, V, Vp);
    for (int n = 0; n < N; ++n) {
      for (int c = V; c < Vp; ++c) CHECK(dlogits[n * Vp + c] == 0.0f);
    }
    check_gradient("dlogits", logits, dlogits, loss);
  }

  TEST_CASE("crossentropy gives the same losses and gradient when dlogits aliases the logits") {
    CpuBackend cpu;
    const int N = 5, V = 9, Vp = 16;
    const Vec logits = random_vec(static_cast<size_t>(N) * Vp, 32, -4.0f, 4.0f);
    const Ints targets = random_ints(N, V, 33);
    Vec losses(N);
    Vec dlogits(logits.size());
    crossentropy(cpu, losses.data(), dlogits.data(), logits.data(), targets.data(), 0.5f, N, V, Vp);
    Vec inplace = logits;
    Vec losses_inplace(N);
    crossentropy(cpu, losses_inplace.data(), inplace.data(), inplace.data(), targets.data(), 0.5f, N, V, Vp);
    CHECK(losses_inplace == losses);
    CHECK(inplace == dlogits);
  }

  TEST_CASE("crossentropy overwrites dlogits instead of accumulating") {
    CpuBackend cpu;
    const int N = 3, V = 5, Vp = 8;
    const Vec logits = random_vec(static_cast<size_t>(N) * Vp, 34);
    const Ints targets = random_ints(N, V, 35);
    Vec losses(N);
    Vec once(logits.size(), 0.0f);
    crossentropy(cpu, losses.data(), once.data(), logits.data(), targets.data(), 1.0f, N, V, Vp);
    Vec twice = once;
    crossentropy(cpu, losses.data(), twice.data(), logits.data(), targets.data(), 1.0f, N, V, Vp);
    CHECK(twice == once);
    CHECK(max_abs(once) > 0.0);
  }

  TEST_CASE("crossentropy over a vocabulary split in shards equals the unsplit one") {
    CpuBackend cpu;
    // V = 21 real classes padded to 32 and split 4 ways: the last shard
    // holds 5 real and 3 padded classes.
    const int N = 6, V = 21, Vp = 32, S = 4, Vl = Vp / S;
    Vec logits = random_vec(static_cast<size_t>(N) * Vp, 70, -4.0f, 4.0f);
    const Ints targets = random_ints(N, V, 71);
    Vec losses(N), dlogits(logits.size());
    crossentropy(cpu, losses.data(), dlogits.data(), logits.data(), targets.data(), 0.25f, N, V, Vp);

    Vec stats(static_cast<size_t>(S) * N * 3);
    for (int s = 0; s < S; ++s) {
      const Vec shard = columns(logits, N, Vp, s * Vl, Vl);
      cpu.crossentropy_stats(stats.data() + static_cast<size_t>(s) * N * 3, shard.data(), targets.data(), N, s * Vl,
                             Vl, V);
    }
    Vec split_losses(N), lse(N);
    cpu.crossentropy_combine(split_losses.data(), lse.data(), stats.data(), S, N);
    check_close("losses", split_losses, Ref(losses.begin(), losses.end()), 1e-6);
    for (int s = 0; s < S; ++s) {
      Vec shard = columns(logits, N, Vp, s * Vl, Vl);
      cpu.crossentropy_backward(shard.data(), shard.data(), lse.data(), targets.data(), 0.25f, N, s * Vl, Vl, V);
      const Vec want = columns(dlogits, N, Vp, s * Vl, Vl);
      check_close("dlogits shard", shard, Ref(want.begin(), want.end()), 1e-6);
    }
  }

  TEST_CASE("a vocabulary shard with no real classes contributes nothing to the crossentropy") {
    CpuBackend cpu;
    const int N = 3, V = 8, Vl = 8;
    const Vec logits = random_vec(static_cast<size_t>(N) * Vl, 72);
    const Ints targets = random_ints(N, V, 73);
    Vec stats(static_cast<size_t>(N) * 3);
    cpu.crossentropy_stats(stats.data(), logits.data(), targets.data(), N, 8, Vl, V);
    for (int n = 0; n < N; ++n) {
      CHECK(std::isinf(stats[n * 3]));
      CHECK(stats[n * 3 + 1] == 0.0f);
      CHECK(stats[n * 3 + 2] == 0.0f);
    }
    Vec dlogits = nan_vec(logits.size());
    cpu.crossentropy_backward(dlogits.data(), logits.data(), std::vector<float>(N, 1.0f).data(), targets.data(),
                              1.0f, N, 8, Vl, V);
    CHECK(max_abs(dlogits) == 0.0);
  }

  TEST_CASE("embedding shards of the vocabulary sum to the unsplit embedding and split its gradient") {
    CpuBackend cpu;
    const int B = 2, T = 6, C = 4, Vp = 12, S = 3, Vl = Vp / S;
    const Vec wte = random_vec(static_cast<size_t>(Vp) * C, 74);
    const Vec wpe = random_vec(static_cast<size_t>(T) * C, 75);
    const Ints tokens = random_ints(B * T, Vp, 76);
    const Vec dout = random_vec(static_cast<size_t>(B) * T * C, 77);
    Vec whole(static_cast<size_t>(B) * T * C), dwte(wte.size(), 0.0f);
    cpu.embedding_forward(whole.data(), tokens.data(), wte.data(), 0, Vp, wpe.data(), B, T, C);
    cpu.embedding_backward(dwte.data(), nullptr, dout.data(), tokens.data(), 0, Vp, B, T, C);
    Ref sum(whole.size(), 0.0);
    for (int s = 0; s < S; ++s) {
      const float* rows = wte.data() + static_cast<size_t>(s) * Vl * C;
      Vec part = nan_vec(whole.size());
      // The position rows are added by one shard only, as TP rank 0 does.
      cpu.embedding_forward(part.data(), tokens.data(), rows, s * Vl, Vl, s == 0 ? wpe.data() : nullptr, B, T, C);
      for (size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
      Vec dshard(static_cast<size_t>(Vl) * C, 0.0f);
      cpu.embedding_backward(dshard.data(), nullptr, dout.data(), tokens.data(), s * Vl, Vl, B, T, C);
      CHECK(std::equal(dshard.begin(), dshard.end(), dwte.begin() + static_cast<ptrdiff_t>(s) * Vl * C));
    }
    check_close("sum of shards", whole, sum, 1e-7);
  }

  TEST_CASE("softmax forward matches a naive reference") {
    CpuBackend cpu;
    const int N = 9, E = 19;
    const Vec logits = random_vec(static_cast<size_t>(N) * E, 36, -8.0f, 8.0f);
    Vec probs = nan_vec(logits.size());
    cpu.softmax_forward(probs.data(), logits.data(), N, E);
    check_close("probs", probs, softmax_ref(logits, N, E), 1e-6);
  }

  TEST_CASE("softmax backward matches finite differences") {
    CpuBackend cpu;
    const int N = 4, E = 6;
    Vec logits = random_vec(static_cast<size_t>(N) * E, 37, -2.0f, 2.0f);
    const Vec r = random_vec(logits.size(), 38);
    Vec probs(logits.size());
    auto loss = [&] {
      cpu.softmax_forward(probs.data(), logits.data(), N, E);
      return weighted_sum(probs, r);
    };
    loss();
    Vec dlogits(logits.size(), 0.0f);
    cpu.softmax_backward(dlogits.data(), r.data(), probs.data(), N, E);
    check_gradient("dlogits", logits, dlogits, loss);
  }

  TEST_CASE("gather_rows and scatter_add_rows match naive references with and without weights") {
    CpuBackend cpu;
    const int rows_in = 5, M = 12, C = 70;
    const Vec inp = random_vec(static_cast<size_t>(rows_in) * C, 39);
    const Ints rows = random_ints(M, rows_in, 40);
    const Vec weights = random_vec(M, 41);
    const Vec base = random_vec(inp.size(), 42);
    const Vec src = random_vec(static_cast<size_t>(M) * C, 43);
    for (const float* w : {static_cast<const float*>(nullptr), weights.data()}) {
      CAPTURE(w != nullptr);
      Vec gathered = nan_vec(static_cast<size_t>(M) * C);
      cpu.gather_rows(gathered.data(), inp.data(), rows.data(), w, M, C);
      Ref want_gathered(gathered.size());
      for (int m = 0; m < M; ++m) {
        for (int c = 0; c < C; ++c) want_gathered[m * C + c] = (w != nullptr ? w[m] : 1.0) * inp[rows[m] * C + c];
      }
      check_close("gather", gathered, want_gathered, 1e-7);

      Vec out = base;
      cpu.scatter_add_rows(out.data(), src.data(), rows.data(), w, M, C);
      Ref want(base.begin(), base.end());
      for (int m = 0; m < M; ++m) {
        for (int c = 0; c < C; ++c) want[rows[m] * C + c] += (w != nullptr ? w[m] : 1.0) * src[m * C + c];
      }
      check_close("scatter", out, want, 1e-6);
    }
  }

  TEST_CASE("gathered_row_dot matches a naive reference") {
    CpuBackend cpu;
    const int rows_in = 4, M = 9, C = 37;
    const Vec a = random_vec(static_cast<size_t>(rows_in) * C, 43);
    const Vec b = random_vec(static_cast<size_t>(M) * C, 44);
    const Ints rows = random_ints(M, rows_in, 45);
    Vec out = nan_vec(M);
    cpu.gathered_row_dot(out.data(), a.data(), rows.data(), b.data(), M, C);
    Ref want(M, 0.0);
    for (int m = 0; m < M; ++m) {
      for (int c = 0; c < C; ++c) want[m] += static_cast<double>(a[rows[m] * C + c]) * b[m * C + c];
    }
    check_close("out", out, want, 1e-6);
  }

  TEST_CASE("weighted gather_rows gradients from scatter_add_rows and gathered_row_dot match finite "
            "differences") {
    // dispatch: out[m] = w[m] * inp[rows[m]]. Backward: dinp[rows[m]] +=
    // w[m] * dout[m] (a scatter) and dw[m] = dot(inp[rows[m]], dout[m]).
    CpuBackend cpu;
    const int rows_in = 4, M = 7, C = 5;  // 7 picks of 4 rows: repeats are certain
    Vec inp = random_vec(static_cast<size_t>(rows_in) * C, 46);
    Vec w = random_vec(M, 47, 0.1f, 1.0f);
    const Ints rows = random_ints(M, rows_in, 48);
    const Vec r = random_vec(static_cast<size_t>(M) * C, 49);
    Vec out(r.size());
    auto loss = [&] {
      cpu.gather_rows(out.data(), inp.data(), rows.data(), w.data(), M, C);
      return weighted_sum(out, r);
    };
    Vec dinp(inp.size(), 0.0f);
    cpu.scatter_add_rows(dinp.data(), r.data(), rows.data(), w.data(), M, C);
    Vec dw = nan_vec(M);
    cpu.gathered_row_dot(dw.data(), inp.data(), rows.data(), r.data(), M, C);
    check_gradient("dinp", inp, dinp, loss);
    check_gradient("dw", w, dw, loss);
  }

  TEST_CASE("MoE combine gradients from gather_rows and gathered_row_dot match finite differences") {
    // combine: y[rows[m]] += w[m] * x[m]. Backward: dx[m] = w[m] *
    // dy[rows[m]] (a weighted gather) and dw[m] = dot(dy[rows[m]], x[m]).
    CpuBackend cpu;
    const int tokens = 4, M = 7, C = 5;
    Vec x = random_vec(static_cast<size_t>(M) * C, 50);
    Vec w = random_vec(M, 51, 0.1f, 1.0f);
    const Ints rows = random_ints(M, tokens, 52);
    const Vec r = random_vec(static_cast<size_t>(tokens) * C, 53);
    Vec y(r.size());
    auto loss = [&] {
      std::fill(y.begin(), y.end(), 0.0f);
      cpu.scatter_add_rows(y.data(), x.data(), rows.data(), w.data(), M, C);
      return weighted_sum(y, r);
    };
    Vec dx = nan_vec(x.size());
    cpu.gather_rows(dx.data(), r.data(), rows.data(), w.data(), M, C);
    Vec dw = nan_vec(M);
    cpu.gathered_row_dot(dw.data(), r.data(), rows.data(), x.data(), M, C);
    check_gradient("dx", x, dx, loss);
    check_gradient("dw", w, dw, loss);
  }

  TEST_CASE("accumulate adds elementwise") {
    CpuBackend cpu;
    const size_t n = 100001;  // above the parallel threshold, odd tail
    const Vec a = random_vec(n, 53);
    const Vec b = random_vec(n, 54);
    Vec acc = a;
    cpu.accumulate(acc.data(), b.data(), n);
    size_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += acc[i] != a[i] + b[i];
    CHECK(mismatches == 0);
  }

  TEST_CASE("copy_columns and accumulate_columns move a block of columns between matrices of other widths") {
    // The k and v columns of [rows, 3C] qkv rows into [rows, 2C] and back.
    CpuBackend cpu;
    for (const int rows : {1, 7, 4099}) {  // the last above the parallel threshold
      CAPTURE(rows);
      const int C = 12;
      const Vec qkv = random_vec(static_cast<size_t>(rows) * 3 * C, 56);
      Vec kv = nan_vec(static_cast<size_t>(rows) * 2 * C);
      cpu.copy_columns(kv.data(), 2 * C, qkv.data() + C, 3 * C, rows, 2 * C);
      Vec sum = qkv;
      cpu.accumulate_columns(sum.data() + C, 3 * C, kv.data(), 2 * C, rows, 2 * C);
      size_t mismatches = 0;
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
        for (size_t c = 0; c < 3 * static_cast<size_t>(C); ++c) {
          const float x = qkv[r * 3 * C + c];
          if (c >= static_cast<size_t>(C)) mismatches += kv[r * 2 * C + c - C] != x;
          // The q columns stay as they were; k and v doubled.
          mismatches += sum[r * 3 * C + c] != (c < static_cast<size_t>(C) ? x : x + x);
        }
      }
      CHECK(mismatches == 0);
    }
  }

  TEST_CASE("sum and sum_squares match double-precision references") {
    CpuBackend cpu;
    for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{1000003}}) {
      CAPTURE(n);
      const Vec x = random_vec(n, 55, -1.0f, 3.0f);
      double want_sum = 0.0;
      double want_squares = 0.0;
      for (float v : x) {
        want_sum += v;
        want_squares += static_cast<double>(v) * v;
      }
      CHECK(cpu.sum(x.data(), n) == doctest::Approx(want_sum).epsilon(1e-12));
      CHECK(cpu.sum_squares(x.data(), n) == doctest::Approx(want_squares).epsilon(1e-12));
    }
  }

  TEST_CASE("bf16 logits score - sum and back-propagate as their float32 widening - the gradient rounded") {
    using keel::trainer::bf16;
    // A shard of a TP-split vocabulary with padded columns (v_begin 8,
    // 40 real of Vl 48), and a bias gradient over the bf16 gradient.
    const int N = 6, Vl = 48, V = 48, v_begin = 8, C = 20;
    CpuBackend cpu(0, keel::trainer::DType::kBF16);
    const size_t n = static_cast<size_t>(N) * Vl;
    std::vector<bf16> logits16(n);
    Vec widened(n);
    const Vec raw = random_vec(n, 71, -6.0f, 6.0f);
    for (size_t i = 0; i < n; ++i) {
      logits16[i] = keel::trainer::to_bf16(raw[i]);
      widened[i] = keel::trainer::to_float(logits16[i]);
    }
    const std::vector<int32_t> targets = {8, 20, 47, 3, 2, 30};  // two before the shard
    Vec stats(static_cast<size_t>(N) * 3), stats16(stats.size()), lse(N), losses(N);
    cpu.crossentropy_stats(stats.data(), widened.data(), targets.data(), N, v_begin, Vl, V);
    cpu.crossentropy_stats(stats16.data(), logits16.data(), targets.data(), N, v_begin, Vl, V);
    CHECK(stats16 == stats);
    cpu.crossentropy_combine(losses.data(), lse.data(), stats.data(), 1, N);
    // The gradient written over the bf16 logits in place is the float32 one rounded.
    Vec dlogits(n);
    cpu.crossentropy_backward(dlogits.data(), widened.data(), lse.data(), targets.data(), 0.25f, N, v_begin, Vl, V);
    cpu.crossentropy_backward(logits16.data(), logits16.data(), lse.data(), targets.data(), 0.25f, N, v_begin, Vl, V);
    size_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += logits16[i].bits != keel::trainer::to_bf16(dlogits[i]).bits;
    CHECK(mismatches == 0);
    // Squares (the SDC fingerprint of the logits) and a linear's backward
    // from the bf16 gradient: those of its widening, bit for bit.
    Vec dwide(n);
    for (size_t i = 0; i < n; ++i) dwide[i] = keel::trainer::to_float(logits16[i]);
    cpu.queue_sum_squares(logits16.data(), n);
    const double squares = cpu.sum_squares(dwide.data(), n);
    const std::vector<double> queued = cpu.take_queued_sums();
    REQUIRE(queued.size() == 1);
    CHECK(std::memcmp(&queued[0], &squares, sizeof(double)) == 0);
    const Vec inp = random_vec(static_cast<size_t>(N) * C, 72), w = random_vec(static_cast<size_t>(Vl) * C, 73);
    Vec dinp(inp.size(), 0.0f), dw(w.size(), 0.0f), db(Vl, 0.0f);
    Vec dinp16 = dinp, dw16 = dw, db16 = db;
    cpu.matmul_backward(dinp.data(), keel::trainer::Into::kAdd, dw.data(), db.data(), dwide.data(), inp.data(), w.data(), N, C, Vl);
    cpu.matmul_backward(dinp16.data(), keel::trainer::Into::kAdd, dw16.data(), db16.data(), logits16.data(), inp.data(), w.data(), N, C, Vl);
    CHECK(dinp16 == dinp);
    CHECK(dw16 == dw);
    CHECK(db16 == db);
  }

  TEST_CASE("queued sums of squares come out in queue order bit for bit as sum_squares and the queue empties") {
    CpuBackend cpu;
    Vec x = random_vec(200003, 57, -2.0f, 2.0f);
    cpu.queue_sum_squares(x.data(), 150000);
    cpu.queue_sum_squares(x.data(), 0);
    cpu.queue_sum_squares(x.data() + 150000, 50003);
    const double first = cpu.sum_squares(x.data(), 150000), last = cpu.sum_squares(x.data() + 150000, 50003);
    x[0] = 1e6f;  // the queue holds values, not pointers to read later
    const std::vector<double> sums = cpu.take_queued_sums();
    REQUIRE(sums.size() == 3);
    CHECK(std::memcmp(&sums[0], &first, sizeof(double)) == 0);
    CHECK(sums[1] == 0.0);
    CHECK(std::memcmp(&sums[2], &last, sizeof(double)) == 0);
    CHECK(cpu.take_queued_sums().empty());
    // Many at once: the same sums, in order.
    cpu.queue_sums_of_squares({{x.data() + 1, 149999}, {x.data(), 0}, {x.data() + 150000, 50003}});
    const std::vector<double> many = cpu.take_queued_sums();
    REQUIRE(many.size() == 3);
    CHECK(many[0] == cpu.sum_squares(x.data() + 1, 149999));
    CHECK(many[1] == 0.0);
    CHECK(std::memcmp(&many[2], &last, sizeof(double)) == 0);
  }

  TEST_CASE("backward kernels accumulate into their gradients") {
    CpuBackend cpu;
    // Runs backward once and twice into zeroed gradients; twice must be
    // double once (up to rounding of the second addition).
    auto check_doubles = [](const char* what, const auto& backward, size_t n) {
      Vec once(n, 0.0f);
      backward(once.data());
      Vec twice(n, 0.0f);
      backward(twice.data());
      backward(twice.data());
      Ref want(n);
      for (size_t i = 0; i < n; ++i) want[i] = 2.0 * once[i];
      REQUIRE(max_abs(once) > 0.0);
      check_close(what, twice, want, 1e-6);
    };
    const int B = 2, T = 70, C = 8, NH = 2, N = B * T, OC = 12, V = 5;
    const Vec x = random_vec(static_cast<size_t>(N) * C, 56);
    const Vec dy = random_vec(static_cast<size_t>(N) * C, 57);
    const Ints tokens = random_ints(N, V, 58);
    check_doubles("embedding dwte", [&](float* g) {
      cpu.embedding_backward(g, nullptr, dy.data(), tokens.data(), 0, V, B, T, C);
    }, static_cast<size_t>(V) * C);
    check_doubles("embedding dwpe", [&](float* g) {
      cpu.embedding_backward(nullptr, g, dy.data(), tokens.data(), 0, V, B, T, C);
    }, static_cast<size_t>(T) * C);

    const Vec w = random_vec(C, 59, 0.5f, 1.5f);
    const Vec bias = random_vec(C, 60);
    Vec ln(x.size()), mean(N), rstd(N);
    cpu.norm_forward(ln.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), N, C, RowNorm{});
    auto ln_backward = [&](float* dinp, float* dw, float* db) {
      cpu.norm_backward(dinp, nullptr, dw, db, dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C,
                        RowNorm{});
    };
    check_doubles("layernorm dinp", [&](float* g) { ln_backward(g, nullptr, nullptr); }, x.size());
    check_doubles("layernorm dweight", [&](float* g) { ln_backward(nullptr, g, nullptr); }, C);
    check_doubles("layernorm dbias", [&](float* g) { ln_backward(nullptr, nullptr, g); }, C);

    const Vec mw = random_vec(static_cast<size_t>(OC) * C, 61);
    const Vec mdy = random_vec(static_cast<size_t>(N) * OC, 62);
    auto mm_backward = [&](float* dinp, float* dw, float* db) {
      cpu.matmul_backward(dinp, keel::trainer::Into::kAdd, dw, db, mdy.data(), x.data(), mw.data(), N, C, OC);
    };
    check_doubles("matmul dinp", [&](float* g) { mm_backward(g, nullptr, nullptr); }, x.size());
    check_doubles("matmul dweight", [&](float* g) { mm_backward(nullptr, g, nullptr); }, mw.size());
    check_doubles("matmul dbias", [&](float* g) { mm_backward(nullptr, nullptr, g); }, OC);

    const Vec qkv = random_vec(static_cast<size_t>(N) * 3 * C, 63);
    Vec out(static_cast<size_t>(N) * C), lse(static_cast<size_t>(B) * NH * T);
    cpu.attention_forward(out.data(), lse.data(), CpuBackend::self_attention(qkv.data(), B, T, C, NH));
    check_doubles("attention dqkv", [&](float* g) {
      cpu.attention_backward(CpuBackend::self_attention_grads(g, C), dy.data(), out.data(), lse.data(),
                             CpuBackend::self_attention(qkv.data(), B, T, C, NH));
    }, qkv.size());

    check_doubles("gelu dinp", [&](float* g) { cpu.gelu_backward(g, x.data(), dy.data(), x.size()); }, x.size());

    Vec probs(x.size());
    cpu.softmax_forward(probs.data(), x.data(), N, C);
    check_doubles("softmax dlogits", [&](float* g) { cpu.softmax_backward(g, dy.data(), probs.data(), N, C); },
                  x.size());

    check_doubles("scatter_add_rows", [&](float* g) {
      cpu.scatter_add_rows(g, dy.data(), tokens.data(), nullptr, N, C);
    }, static_cast<size_t>(V) * C);
  }

  TEST_CASE("adamw_update matches a scalar double-precision AdamW over several steps") {
    CpuBackend cpu;
    const size_t n = 50000;
    const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.5f;
    const Vec initial = random_vec(n, 64);
    Vec params = initial;
    Vec m(n, 0.0f), v(n, 0.0f);
    Ref p_ref(params.begin(), params.end()), m_ref(n, 0.0), v_ref(n, 0.0);
    for (int64_t t = 1; t <= 3; ++t) {
      const Vec grads = random_vec(n, 65 + t, -2.0f, 2.0f);
      cpu.adamw_update({{params.data(), grads.data(), m.data(), v.data(), n, wd}}, lr, beta1, beta2, eps, grad_scale, t);
      const double b1 = beta1, b2 = beta2;
      for (size_t i = 0; i < n; ++i) {
        const double g = static_cast<double>(grads[i]) * grad_scale;
        p_ref[i] *= 1.0 - static_cast<double>(lr) * wd;
        m_ref[i] = b1 * m_ref[i] + (1.0 - b1) * g;
        v_ref[i] = b2 * v_ref[i] + (1.0 - b2) * g * g;
        const double m_hat = m_ref[i] / (1.0 - std::pow(b1, static_cast<double>(t)));
        const double v_hat = v_ref[i] / (1.0 - std::pow(b2, static_cast<double>(t)));
        p_ref[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
      }
    }
    // Float rounding is absolute at the scale of each tensor, so m and v are
    // held to 1e-6 of their largest element; params to 1e-5 of the largest
    // total update, which is what AdamW computes.
    Ref want_update(n);
    Vec got_update(n);
    for (size_t i = 0; i < n; ++i) {
      want_update[i] = p_ref[i] - initial[i];
      got_update[i] = static_cast<float>(static_cast<double>(params[i]) - initial[i]);
    }
    check_close("params update", got_update, want_update, 1e-5);
    check_close("m", m, m_ref, 1e-6);
    check_close("v", v, v_ref, 1e-6);
  }

  TEST_CASE("reductions and backward kernels are bit-identical with one or two or three threads") {
    keel::test::ThreadCountGuard guard;
    // Shapes large enough that every kernel splits its work: several GEMM
    // tiles, several layernorm row chunks, several reduction chunks.
    const int B = 4, T = 130, C = 64, NH = 4, N = B * T, V = 37;
    const int mm_in = 256, OC = 640;  // ~170 MFLOP per GEMM: two tiles each
    const Vec x = random_vec(static_cast<size_t>(N) * C, 70);
    const Vec dy = random_vec(static_cast<size_t>(N) * C, 71);
    const Vec dy_wide = random_vec(static_cast<size_t>(N) * OC, 72);
    const Vec mm_x = random_vec(static_cast<size_t>(N) * mm_in, 79);
    const Vec w = random_vec(static_cast<size_t>(OC) * mm_in, 73);
    const Vec ln_w = random_vec(C, 74, 0.5f, 1.5f);
    const Vec ln_b = random_vec(C, 75);
    const Vec qkv = random_vec(static_cast<size_t>(N) * 3 * C, 76, -2.0f, 2.0f);
    const Ints tokens = random_ints(N, V, 77);
    const Vec big = random_vec(1000003, 78);

    struct Results {
      double sum = 0.0;
      double sum_squares = 0.0;
      std::vector<Vec> tensors;
    };
    auto run = [&](int threads) {
      CpuBackend cpu(threads);
      REQUIRE(omp_get_max_threads() == threads);
      Results r;
      r.sum = cpu.sum(big.data(), big.size());
      r.sum_squares = cpu.sum_squares(big.data(), big.size());
      std::vector<Vec>& results = r.tensors;

      Vec ln(x.size()), mean(N), rstd(N), dinp(x.size(), 0.0f), dw(C, 0.0f), db(C, 0.0f);
      cpu.norm_forward(ln.data(), mean.data(), rstd.data(), x.data(), ln_w.data(), ln_b.data(), N, C, RowNorm{});
      cpu.norm_backward(dinp.data(), nullptr, dw.data(), db.data(), dy.data(), x.data(), ln_w.data(), mean.data(),
                        rstd.data(), N, C, RowNorm{});
      results.insert(results.end(), {ln, dinp, dw, db});

      Vec out(dy_wide.size()), mm_dinp(mm_x.size(), 0.0f), mm_dw(w.size(), 0.0f), mm_db(OC, 0.0f);
      cpu.matmul_forward(out.data(), mm_x.data(), w.data(), nullptr, N, mm_in, OC);
      cpu.matmul_backward(mm_dinp.data(), keel::trainer::Into::kAdd, mm_dw.data(), mm_db.data(), dy_wide.data(), mm_x.data(), w.data(), N, mm_in,
                          OC);
      results.insert(results.end(), {out, mm_dinp, mm_dw, mm_db});

      Vec att_out(x.size()), lse(static_cast<size_t>(B) * NH * T), dqkv(qkv.size(), 0.0f);
      cpu.attention_forward(att_out.data(), lse.data(), CpuBackend::self_attention(qkv.data(), B, T, C, NH));
      cpu.attention_backward(CpuBackend::self_attention_grads(dqkv.data(), C), dy.data(), att_out.data(), lse.data(),
                             CpuBackend::self_attention(qkv.data(), B, T, C, NH));
      results.insert(results.end(), {att_out, lse, dqkv});

      Vec dwte(static_cast<size_t>(V) * C, 0.0f), dwpe(static_cast<size_t>(T) * C, 0.0f);
      cpu.embedding_backward(dwte.data(), dwpe.data(), dy.data(), tokens.data(), 0, V, B, T, C);
      Vec scattered(static_cast<size_t>(V) * C, 0.0f);
      cpu.scatter_add_rows(scattered.data(), dy.data(), tokens.data(), dy.data(), N, C);
      results.insert(results.end(), {dwte, dwpe, scattered});
      return r;
    };
    const Results one = run(1);
    for (int threads : {2, 3}) {
      CAPTURE(threads);
      const Results many = run(threads);
      CHECK(std::memcmp(&many.sum, &one.sum, sizeof(double)) == 0);
      CHECK(std::memcmp(&many.sum_squares, &one.sum_squares, sizeof(double)) == 0);
      REQUIRE(many.tensors.size() == one.tensors.size());
      for (size_t i = 0; i < one.tensors.size(); ++i) {
        CAPTURE(i);
        REQUIRE(many.tensors[i].size() == one.tensors[i].size());
        CHECK(std::memcmp(many.tensors[i].data(), one.tensors[i].data(), one.tensors[i].size() * sizeof(float)) == 0);
      }
    }
  }
}

}  // namespace
