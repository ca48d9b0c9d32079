// The tensor-core attention kernels (trainer/kernels/cuda/
// attention_tc_kernels.cuh), compiled for the host against the warp
// emulator and launched as attention_tc.cu launches them, held to the CPU
// backend's bf16 attention within the bound the gpu test holds the real
// ones to. This runs on every CI machine: it proves the lane addressing,
// fragment bookkeeping, masks, offsets and accumulation of the kernels,
// and that every tile a cp.async brings is waited for before it is read
// and read by every warp before the next one is copied over it;
// speed and the hardware's own rounding are left to the gpu tests.
#include "tests/trainer/warp_emulator.h"
// After the emulator: the kernels use what it declares.
#include "trainer/kernels/cuda/attention_tc_kernels.cuh"

#include "tests/trainer/random_data.h"
#include "tests/trainer/relative_error.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/kernels/dtype.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using keel::trainer::Backend;
using keel::trainer::CpuBackend;
using keel::test::random_vec;
using keel::test::relative_l2;
using Vec = std::vector<float>;
namespace tc = keel::trainer::cuda::tc_attention;

// Forward and backward as tensor_core_attention_forward and _backward
// launch them, on host memory, for views whose elements are T.
template <int D, typename T>
void emulated_attention(float* out, float* lse, const Backend::AttentionGrads& grads, const float* dout,
                        const Backend::AttentionInputs& in) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const unsigned heads = static_cast<unsigned>(in.B * in.NH);
  keel::emulator::launch(tc::tiles_of(in.Tq), heads, tc::kTileThreads, tc::kForwardSharedBytes<D>,
                         [&] { tc::attention_forward_tc_kernel<D, T, float>(out, lse, in, scale * tc::kLog2e); });
  const size_t rows = static_cast<size_t>(in.B) * in.NH * in.Tq;
  Vec lse2(rows, NAN), dots(rows, NAN);
  std::vector<__nv_bfloat16> dout16(static_cast<size_t>(in.B) * in.Tq * in.C, __nv_bfloat16{0xffff});
  const tc::RowStats stats{lse2.data(), dots.data(), dout16.data()};
  const unsigned warps_per_block = keel::trainer::cuda::kThreads / keel::trainer::cuda::kWarp;
  keel::emulator::launch(static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block), 1,
                         keel::trainer::cuda::kThreads, 0,
                         [&] { tc::attention_row_stats_kernel(stats, dout, out, lse, in); });
  auto backward = [&](auto* dq) {
    using G = std::remove_pointer_t<decltype(dq)>;
    auto* dk = static_cast<G*>(grads.dk);
    auto* dv = static_cast<G*>(grads.dv);
    keel::emulator::launch(tc::tiles_of(in.Tk), heads, tc::kTileThreads, tc::kBackwardKeysSharedBytes<D>,
                           [&] { tc::attention_backward_keys_tc_kernel<D, T, G>(dk, dv, stats, in, scale); });
    keel::emulator::launch(tc::tiles_of(in.Tq), heads, tc::kTileThreads, tc::kBackwardQueriesSharedBytes<D>,
                           [&] { tc::attention_backward_queries_tc_kernel<D, T, G>(dq, stats, in, scale); });
  };
  if (grads.dtype == keel::trainer::DType::kBF16) {
    backward(static_cast<__nv_bfloat16*>(grads.dq));
  } else {
    backward(static_cast<float*>(grads.dq));
  }
}

struct Shape {
  int B, Tq, Tk, C, NH, q_offset, k_offset;
};

// q, k and v in one [B, T, 3C] buffer (self-attention's strided views) when
// the query and key positions are the same, else three dense buffers; as
// float32, and as bf16, which must give the bits of the float32 views the
// kernels round as they load them.
template <int D>
void check_against_cpu(const Shape& s) {
  const bool packed = s.Tq == s.Tk && s.q_offset == s.k_offset;
  const int C = s.C, ld_q = packed ? 3 * C : C, ld_kv = packed ? 3 * C : C;
  const size_t q_n = static_cast<size_t>(s.B) * s.Tq * ld_q, kv_n = static_cast<size_t>(s.B) * s.Tk * ld_kv;
  const Vec q = random_vec(q_n, 111, -2.0f, 2.0f), kv_k = random_vec(kv_n, 112, -2.0f, 2.0f);
  const Vec kv_v = random_vec(kv_n, 113, -2.0f, 2.0f), dout = random_vec(static_cast<size_t>(s.B) * s.Tq * C, 114);
  // Gradients start non-zero: the kernels must add to them.
  const Vec dq0 = random_vec(q_n, 115), dk0 = random_vec(kv_n, 116), dv0 = random_vec(kv_n, 117);
  struct Result {
    Vec out, lse, dq, dk, dv;
  };
  auto rounded = [](const Vec& v) {
    std::vector<keel::trainer::bf16> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = keel::trainer::to_bf16(v[i]);
    return r;
  };
  const std::vector<keel::trainer::bf16> q16 = rounded(q), k16 = rounded(kv_k), v16 = rounded(kv_v);
  // The gradients start as dq0, dk0 and dv0, or at zero.
  auto run = [&](auto&& attention, keel::trainer::DType dtype = keel::trainer::DType::kF32, bool from_zero = false) {
    Result r{Vec(static_cast<size_t>(s.B) * s.Tq * C, NAN), Vec(static_cast<size_t>(s.B) * s.NH * s.Tq, NAN), dq0,
             packed ? dq0 : dk0, packed ? dq0 : dv0};
    if (from_zero) {
      for (Vec* grad : {&r.dq, &r.dk, &r.dv}) std::fill(grad->begin(), grad->end(), 0.0f);
    }
    const bool bf16 = dtype == keel::trainer::DType::kBF16;
    const size_t width = static_cast<size_t>(C) * keel::trainer::dtype_bytes(dtype);
    const auto* qs = bf16 ? static_cast<const void*>(q16.data()) : q.data();
    const auto* base = static_cast<const std::byte*>(qs);
    const Backend::AttentionInputs in =
        packed ? Backend::AttentionInputs{base, base + width, base + 2 * width, ld_q, ld_kv, s.B, s.Tq, s.Tk, C,
                                          s.NH, s.q_offset, s.k_offset, dtype}
               : Backend::AttentionInputs{qs,
                                          bf16 ? static_cast<const void*>(k16.data()) : kv_k.data(),
                                          bf16 ? static_cast<const void*>(v16.data()) : kv_v.data(),
                                          ld_q, ld_kv, s.B, s.Tq, s.Tk, C, s.NH, s.q_offset, s.k_offset, dtype};
    // Packed, the three gradients are views of one buffer, as dqkv is.
    const Backend::AttentionGrads grads = packed
                                              ? Backend::AttentionGrads{r.dq.data(), r.dq.data() + C, r.dq.data() + 2 * C}
                                              : Backend::AttentionGrads{r.dq.data(), r.dk.data(), r.dv.data()};
    attention(r.out.data(), r.lse.data(), grads, dout.data(), in);
    return r;
  };
  CpuBackend cpu(2, keel::trainer::DType::kBF16);
  auto on_cpu = [&](float* out, float* lse, const Backend::AttentionGrads& grads, const float* dy,
                    const Backend::AttentionInputs& in) {
    cpu.attention_forward(out, lse, in);
    cpu.attention_backward(grads, dy, out, lse, in);
  };
  const Result want = run(on_cpu), want16 = run(on_cpu, keel::trainer::DType::kBF16);
  const Result got = run(emulated_attention<D, float>);
  const Result got16 = run(emulated_attention<D, __nv_bfloat16>, keel::trainer::DType::kBF16);
  {
    // The output kept as bf16 (the projection's GEMM input): each float32
    // output rounded, and the same log-sum-exps.
    auto out16 = std::make_unique<__nv_bfloat16[]>(got.out.size());
    Vec lse(got.lse.size(), NAN);
    run([&](float*, float*, const Backend::AttentionGrads&, const float*, const Backend::AttentionInputs& in) {
      keel::emulator::launch(tc::tiles_of(in.Tq), static_cast<unsigned>(in.B * in.NH), tc::kTileThreads,
                             tc::kForwardSharedBytes<D>, [&] {
                               tc::attention_forward_tc_kernel<D, float, __nv_bfloat16>(
                                   out16.get(), lse.data(), in, 1.0f / std::sqrt(static_cast<float>(D)) * tc::kLog2e);
                             });
    });
    size_t mismatches = 0;
    for (size_t i = 0; i < got.out.size(); ++i) mismatches += out16[i].bits != keel::emulator::to_bf16(got.out[i]);
    CHECK(mismatches == 0);
    CHECK(std::memcmp(lse.data(), got.lse.data(), lse.size() * sizeof(float)) == 0);
  }
  {
    // bf16 gradients (the dqkv only the qkv linear's GEMMs read) are
    // overwritten with the float32 ones, summed from zero, rounded.
    const keel::trainer::DType kBF16 = keel::trainer::DType::kBF16;
    const Result from_zero = run(emulated_attention<D, __nv_bfloat16>, kBF16, true);
    std::vector<__nv_bfloat16> dq16(q_n, __nv_bfloat16{0xffff}), dk16(kv_n, __nv_bfloat16{0xffff}),
        dv16(kv_n, __nv_bfloat16{0xffff});
    run(
        [&](float* out, float* lse, const Backend::AttentionGrads&, const float* dy,
            const Backend::AttentionInputs& in) {
          const Backend::AttentionGrads grads16 =
              packed ? Backend::AttentionGrads{dq16.data(), dq16.data() + C, dq16.data() + 2 * C, kBF16}
                     : Backend::AttentionGrads{dq16.data(), dk16.data(), dv16.data(), kBF16};
          emulated_attention<D, __nv_bfloat16>(out, lse, grads16, dy, in);
        },
        kBF16);
    auto rounding_mismatches = [](const std::vector<__nv_bfloat16>& got, const Vec& want) {
      size_t mismatches = got.size() == want.size() ? 0 : 1;
      for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
        mismatches += got[i].bits != keel::emulator::to_bf16(want[i]);
      }
      return mismatches;
    };
    CHECK(rounding_mismatches(dq16, from_zero.dq) == 0);
    if (!packed) {
      CHECK(rounding_mismatches(dk16, from_zero.dk) == 0);
      CHECK(rounding_mismatches(dv16, from_zero.dv) == 0);
    }
  }
  auto same_bits = [](const Vec& a, const Vec& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  // On bf16 views: the kernels' bits, and the CPU's, of the float32 views.
  for (const auto& [name, part] : {std::pair{"out", &Result::out}, std::pair{"lse", &Result::lse},
                                    std::pair{"dq", &Result::dq}, std::pair{"dk", &Result::dk},
                                    std::pair{"dv", &Result::dv}}) {
    CAPTURE(name);
    CHECK(same_bits(got16.*part, got.*part));
    CHECK(same_bits(want16.*part, want.*part));
  }
  for (size_t i = 0; i < want.lse.size(); ++i) {
    if (std::isinf(want.lse[i])) CHECK(got.lse[i] == want.lse[i]);  // a query that sees no key
  }
  auto finite = [](Vec v) {
    for (float& x : v) x = std::isinf(x) ? 0.0f : x;
    return v;
  };
  for (const auto& [name, a, b] :
       {std::tuple{"out", got.out, want.out}, std::tuple{"lse", finite(got.lse), finite(want.lse)},
        std::tuple{"dq", got.dq, want.dq}, std::tuple{"dk", got.dk, want.dk}, std::tuple{"dv", got.dv, want.dv}}) {
    CAPTURE(name);
    CHECK(relative_l2(a, b) <= 1e-2);
  }
}

}  // namespace

// Emulating a kernel runs each of its threads on the host, minutes for the
// larger shapes on two cores: the default suite checks one small shape that
// holds every case the kernels branch on (a tile cut short, a query chunk
// with no key before it, tiles off 64-row boundaries), and
// the larger shapes run under the label long (ctest -L long).
TEST_SUITE("unit") {
  TEST_CASE("tensor-core attention kernels emulated on the host match the CPU's bf16 attention on a ring chunk of head 64") {
    // A query chunk against a later key chunk (ring attention): queries
    // 40..59 see none of its keys; tiles start off 64-row boundaries.
    check_against_cpu<64>({1, 70, 50, 64, 1, 40, 60});
  }
}

TEST_SUITE("long") {
  TEST_CASE("tensor-core attention kernels emulated on the host match the CPU's bf16 attention over three tiles of head 64") {
    // Self-attention over three tiles, the last cut short; and the ring
    // chunk over two sequences.
    check_against_cpu<64>({1, 130, 130, 128, 2, 0, 0});
    check_against_cpu<64>({2, 70, 50, 64, 1, 40, 60});
  }

  TEST_CASE("tensor-core attention kernels emulated on the host match the CPU's bf16 attention with head 128") {
    check_against_cpu<128>({1, 65, 65, 128, 1, 0, 0});
  }
}
