#include "common/counter_rng.h"
#include "common/error.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/zero_storage.h"
#include "tests/trainer/relative_error.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

using keel::common::ModelConfig;
using keel::trainer::CpuBackend;
using keel::trainer::Gpt;
using keel::trainer::ParameterTable;
using keel::trainer::ZeroStorage;

namespace {

ModelConfig tiny_model(int64_t n_expert = 0) {
  ModelConfig m;
  m.vocab_size = 50;  // padded to 128: the padded logits must stay out of the loss
  m.seq_len = 8;
  m.n_layer = 2;
  m.n_head = 2;
  m.n_embd = 16;
  m.n_expert = n_expert;
  m.top_k = 2;
  m.moe_every = 2;
  m.aux_loss_coef = 0.1;
  return m;
}

// A Llama of the same size: grouped-query attention (4 query heads, 2
// key/value heads), a SwiGLU width of 24, optionally MoE blocks.
ModelConfig tiny_llama(int64_t n_expert = 0) {
  ModelConfig m = tiny_model(n_expert);
  m.arch = "llama";
  m.n_head = 4;
  m.n_kv_head = 2;
  m.ffn_hidden = 24;
  m.tie_embeddings = false;
  return m;
}

std::vector<int32_t> sample_tokens(int count, int vocab, uint64_t salt) {
  std::vector<int32_t> t(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) t[i] = static_cast<int32_t>(keel::common::counter_uniform_below(salt, i, vocab));
  return t;
}

// A single-rank model with its storage, initialised from `seed`.
struct TestModel {
  TestModel(const ModelConfig& config, CpuBackend& backend, int max_batch, uint64_t seed, bool split_backward = false)
      : table(config),
        storage(backend, table),
        gpt(config, backend, max_batch, storage, keel::trainer::ProcessGroups::none(), 1, split_backward) {
    memory = keel::trainer::lay_out(backend, storage, gpt);
    storage.init(seed);
  }
  std::unique_ptr<keel::trainer::Arena> memory;  // freed last
  ParameterTable table;
  ZeroStorage storage;
  Gpt gpt;
};

std::vector<float> copy_out(Gpt& model, const float* buffer) {
  std::vector<float> host(model.table().total());
  model.backend().copy_to_host(host.data(), buffer, host.size() * sizeof(float));
  return host;
}

// d(CE + aux)/dparam by central differences, for the elements with the
// largest analytic gradient of every tensor whose name contains `filter`.
void check_model_gradients(const ModelConfig& config, float eps, double tolerance, const std::string& filter = "") {
  CpuBackend backend(1);
  const int B = 2, T = static_cast<int>(config.seq_len);
  TestModel test_model(config, backend, B, 7);
  Gpt& model = test_model.gpt;
  auto inputs = sample_tokens(B * T, static_cast<int>(config.vocab_size), 1);
  auto targets = sample_tokens(B * T, static_cast<int>(config.vocab_size), 2);

  test_model.storage.zero_gradients();
  model.forward(inputs.data(), targets.data(), B);
  model.backward(1.0f);
  auto grads = copy_out(model, test_model.storage.grads());
  auto objective = [&] {
    model.forward(inputs.data(), targets.data(), B);
    double loss = model.loss();
    return loss + model.aux_loss();
  };

  int checked = 0;
  for (const auto& spec : model.table().specs()) {
    if (spec.name.find(filter) == std::string::npos) continue;
    ++checked;
    CAPTURE(spec.name);
    size_t best = spec.offset;
    for (size_t i = spec.offset; i < spec.offset + spec.numel; ++i) {
      if (std::fabs(grads[i]) > std::fabs(grads[best])) best = i;
    }
    float* p = test_model.storage.params() + best;
    const float saved = *p;
    *p = saved + eps;
    const double up = objective();
    *p = saved - eps;
    const double down = objective();
    *p = saved;
    const double numeric = (up - down) / (2.0 * eps);
    CAPTURE(numeric);
    CAPTURE(grads[best]);
    CHECK(std::fabs(numeric - grads[best]) <= tolerance * std::fabs(grads[best]) + 1e-5);
  }
  CHECK(checked > 0);
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the parameter table has the nanoGPT names and PyTorch shapes") {
    ModelConfig m = tiny_model(4);
    ParameterTable table(m);
    CHECK(table.find("wte").shape == std::vector<int64_t>{128, 16});
    CHECK(table.find("wpe").shape == std::vector<int64_t>{8, 16});
    CHECK(table.find("h.0.attn.c_attn.weight").shape == std::vector<int64_t>{48, 16});
    CHECK(table.find("h.0.attn.c_attn.bias").shape == std::vector<int64_t>{48});
    CHECK(table.find("h.0.mlp.c_fc.weight").shape == std::vector<int64_t>{64, 16});
    CHECK(table.find("h.0.mlp.c_proj.weight").shape == std::vector<int64_t>{16, 64});
    CHECK(table.find("h.1.moe.router.weight").shape == std::vector<int64_t>{4, 16});
    CHECK(table.find("h.1.moe.experts.3.c_proj.bias").shape == std::vector<int64_t>{16});
    CHECK(table.find("ln_f.weight").shape == std::vector<int64_t>{16});
    CHECK_THROWS_AS(table.find("h.1.mlp.c_fc.weight"), std::out_of_range);
    CHECK(table.find("wte").weight_decay());
    CHECK_FALSE(table.find("h.0.ln_1.weight").weight_decay());
    CHECK_FALSE(table.find("h.0.attn.c_attn.bias").weight_decay());
  }

  TEST_CASE("the Llama parameter table has Hugging Face's names and shapes and no biases") {
    ParameterTable table(tiny_llama(4));
    CHECK(table.find("model.embed_tokens.weight").shape == std::vector<int64_t>{128, 16});
    CHECK(table.find("lm_head.weight").shape == std::vector<int64_t>{128, 16});
    CHECK(table.find("model.norm.weight").shape == std::vector<int64_t>{16});
    CHECK(table.find("model.layers.0.input_layernorm.weight").shape == std::vector<int64_t>{16});
    CHECK(table.find("model.layers.0.self_attn.q_proj.weight").shape == std::vector<int64_t>{16, 16});
    CHECK(table.find("model.layers.0.self_attn.k_proj.weight").shape == std::vector<int64_t>{8, 16});
    CHECK(table.find("model.layers.0.self_attn.v_proj.weight").shape == std::vector<int64_t>{8, 16});
    CHECK(table.find("model.layers.0.self_attn.o_proj.weight").shape == std::vector<int64_t>{16, 16});
    CHECK(table.find("model.layers.0.post_attention_layernorm.weight").shape == std::vector<int64_t>{16});
    CHECK(table.find("model.layers.0.mlp.gate_proj.weight").shape == std::vector<int64_t>{24, 16});
    CHECK(table.find("model.layers.0.mlp.up_proj.weight").shape == std::vector<int64_t>{24, 16});
    CHECK(table.find("model.layers.0.mlp.down_proj.weight").shape == std::vector<int64_t>{16, 24});
    CHECK(table.find("model.layers.1.block_sparse_moe.gate.weight").shape == std::vector<int64_t>{4, 16});
    CHECK(table.find("model.layers.1.block_sparse_moe.experts.3.w1.weight").shape == std::vector<int64_t>{24, 16});
    CHECK(table.find("model.layers.1.block_sparse_moe.experts.3.w3.weight").shape == std::vector<int64_t>{24, 16});
    CHECK(table.find("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape == std::vector<int64_t>{16, 24});
    for (const auto& spec : table.specs()) {
      CAPTURE(spec.name);
      CHECK(spec.name.find("bias") == std::string::npos);
      CHECK(spec.name.find("wpe") == std::string::npos);  // rotary positions have no table
    }
    // Tied, the head is the embedding.
    ModelConfig tied = tiny_llama();
    tied.tie_embeddings = true;
    CHECK_THROWS_AS(ParameterTable(tied).find("lm_head.weight"), std::out_of_range);
  }

  TEST_CASE("each TP rank's query key and value rows and its gate and up rows are one matrix in the flat buffer") {
    for (int tp : {1, 2}) {
      CAPTURE(tp);
      const ParameterTable table(tiny_llama(4), tp - 1, tp);
      const auto& q = table.find("model.layers.0.self_attn.q_proj.weight");
      const auto& k = table.find("model.layers.0.self_attn.k_proj.weight");
      const auto& v = table.find("model.layers.0.self_attn.v_proj.weight");
      CHECK(q.shape == std::vector<int64_t>{16 / tp, 16});
      CHECK(k.shape == std::vector<int64_t>{8 / tp, 16});
      CHECK(k.offset == q.offset + q.numel);
      CHECK(v.offset == k.offset + k.numel);
      for (const std::string mlp : {"model.layers.0.mlp.", "model.layers.1.block_sparse_moe.experts.2."}) {
        const bool expert = mlp.find("experts") != std::string::npos;
        const auto& gate = table.find(mlp + (expert ? "w1.weight" : "gate_proj.weight"));
        const auto& up = table.find(mlp + (expert ? "w3.weight" : "up_proj.weight"));
        CHECK(gate.shape == std::vector<int64_t>{24 / tp, 16});
        CHECK(up.offset == gate.offset + gate.numel);
        CHECK(up.expert == expert);
      }
      // TP rank r holds key/value head r of 2, with the query heads it serves.
      CHECK(k.global_blocks(0, k.rows())[0].row == (tp - 1) * 4);
      CHECK(q.global_blocks(0, q.rows())[0].row == (tp - 1) * 8);
    }
  }

  TEST_CASE("initialisation follows GPT-2 and every element is a pure function of seed and name and index") {
    ModelConfig m = tiny_model();
    m.n_embd = 64;
    m.n_head = 4;
    ParameterTable table(m);
    std::vector<float> a(table.total()), b(table.total()), c(table.total());
    keel::trainer::init_parameters(table, 42, a.data());
    keel::trainer::init_parameters(table, 42, b.data());
    keel::trainer::init_parameters(table, 43, c.data());
    CHECK(a == b);
    CHECK(a != c);

    auto stddev = [&](const std::string& name) {
      const auto& spec = table.find(name);
      double sum = 0, sq = 0;
      for (size_t i = 0; i < spec.numel; ++i) {
        sum += a[spec.offset + i];
        sq += a[spec.offset + i] * a[spec.offset + i];
      }
      const double mean = sum / spec.numel;
      return std::sqrt(sq / spec.numel - mean * mean);
    };
    CHECK(stddev("h.0.mlp.c_fc.weight") == doctest::Approx(0.02).epsilon(0.05));
    CHECK(stddev("h.0.mlp.c_proj.weight") == doctest::Approx(0.02 / std::sqrt(4.0)).epsilon(0.05));
    CHECK(stddev("h.1.attn.c_proj.weight") == doctest::Approx(0.01).epsilon(0.05));
    CHECK(a[table.find("h.0.ln_1.weight").offset] == 1.0f);
    CHECK(a[table.find("h.0.attn.c_attn.bias").offset + 5] == 0.0f);

    // Element 1000 of c_attn can be drawn without drawing the others.
    const auto& spec = table.find("h.1.attn.c_attn.weight");
    const uint64_t key = keel::common::stream_key(42, spec.name);
    CHECK(a[spec.offset + 1000] == static_cast<float>(0.02 * keel::common::counter_normal(key, 1000)));
  }

  TEST_CASE("the TP slices of every tensor tile the global tensor with rectangular blocks") {
    ModelConfig gpt2 = tiny_model(4);
    gpt2.n_head = 4;
    ModelConfig llama = tiny_llama(4);
    llama.n_kv_head = 4;
    llama.tie_embeddings = true;
    for (const auto& [m, tp] : {std::pair{gpt2, 2}, {gpt2, 4}, {tiny_llama(4), 2}, {llama, 4}}) {
      CAPTURE(m.arch);
      CAPTURE(tp);
      const ParameterTable whole(m);
      std::vector<std::vector<int>> covered(whole.specs().size());
      for (size_t t = 0; t < whole.specs().size(); ++t) covered[t].assign(whole.specs()[t].numel, 0);
      for (int r = 0; r < tp; ++r) {
        const ParameterTable slice(m, r, tp);
        REQUIRE(slice.specs().size() == whole.specs().size());
        for (size_t t = 0; t < slice.specs().size(); ++t) {
          const auto& spec = slice.specs()[t];
          CAPTURE(spec.name);
          CHECK(spec.global_shape == whole.specs()[t].shape);
          const int64_t global_cols = spec.global_shape.size() == 2 ? spec.global_shape[1] : 1;
          int64_t local_rows = 0;
          for (const auto& block : spec.global_blocks(0, spec.rows())) {
            CHECK(block.local_row == local_rows);
            local_rows += block.rows;
            for (int64_t i = 0; i < block.rows; ++i) {
              for (int64_t j = 0; j < block.cols; ++j) ++covered[t][(block.row + i) * global_cols + block.col + j];
            }
          }
          CHECK(local_rows == spec.rows());
        }
      }
      for (size_t t = 0; t < covered.size(); ++t) {
        CAPTURE(whole.specs()[t].name);
        const bool split = ParameterTable(m, 0, tp).specs()[t].split != keel::trainer::TpSplit::kReplicated;
        const int want = split ? 1 : tp;  // replicated tensors: every rank holds all of it
        CHECK(std::all_of(covered[t].begin(), covered[t].end(), [&](int n) { return n == want; }));
      }
    }
    // q, k and v each give a TP rank the rows of its own heads.
    const auto blocks = ParameterTable(gpt2, 1, 2).find("h.0.attn.c_attn.weight").global_blocks(0, 24);
    REQUIRE(blocks.size() == 3);
    CHECK(blocks[0].row == 8);
    CHECK(blocks[1].row == 24);
    CHECK(blocks[2].row == 40);
  }

  TEST_CASE("every TP rank initialises its slice with the values of the global model") {
    ModelConfig m = tiny_model();
    m.n_head = 4;
    const ParameterTable whole(m);
    std::vector<float> global(whole.total());
    keel::trainer::init_parameters(whole, 9, global.data());
    for (int r = 0; r < 4; ++r) {
      const ParameterTable slice(m, r, 4);
      std::vector<float> local(slice.total());
      keel::trainer::init_parameters(slice, 9, local.data());
      for (size_t t = 0; t < slice.specs().size(); ++t) {
        const auto& spec = slice.specs()[t];
        CAPTURE(spec.name);
        const int64_t global_cols = spec.global_shape.size() == 2 ? spec.global_shape[1] : 1;
        for (const auto& block : spec.global_blocks(0, spec.rows())) {
          for (int64_t i = 0; i < block.rows; ++i) {
            for (int64_t j = 0; j < block.cols; ++j) {
              REQUIRE(local[spec.offset + (block.local_row + i) * block.cols + j] ==
                      global[whole.specs()[t].offset + (block.row + i) * global_cols + block.col + j]);
            }
          }
        }
      }
    }
  }

  TEST_CASE("the dense model's backward matches finite differences for every tensor") {
    check_model_gradients(tiny_model(), 1e-2f, 0.05);
  }

  TEST_CASE("an untied head's backward matches finite differences and the embedding then serves the tokens alone") {
    ModelConfig untied = tiny_model();
    untied.tie_embeddings = false;
    check_model_gradients(untied, 1e-2f, 0.05);
  }

  TEST_CASE("a Llama model's backward matches finite differences for every tensor with and without rope scaling") {
    // A small rotary base, so that positions turn q and k by whole radians.
    ModelConfig llama = tiny_llama();
    llama.rope_theta = 10;
    check_model_gradients(llama, 1e-2f, 0.05);
    llama.rope_scaling_factor = 8;
    llama.rope_original_context = 4;
    llama.tie_embeddings = true;
    check_model_gradients(llama, 1e-2f, 0.05);
  }

  TEST_CASE("the shipped Llama 3.2 1B and 3.1 8B configs describe the published models to the parameter") {
    // Meta's counts: 1,235,814,400 (1B, tied head) and 8,030,261,248 (8B).
    struct Shape {
      const char* file;
      size_t parameters;
    };
    for (const Shape& s : {Shape{"llama-3.2-1b.toml", 1'235'814'400}, Shape{"llama-3.1-8b.toml", 8'030'261'248}}) {
      CAPTURE(s.file);
      const auto config = keel::common::Config::load(std::filesystem::path(KEEL_TESTS_DIR) / ".." / "configs" / s.file);
      CHECK(config.model.padded_vocab() == 128256);
      CHECK(ParameterTable(config.model).parameter_count() == s.parameters);
    }
  }

  TEST_CASE("a Mixtral-shaped Llama's backward matches finite differences for every tensor") {
    ModelConfig mixtral = tiny_llama(4);
    mixtral.top_k = 4;  // k = E: no routing change inside a difference quotient
    check_model_gradients(mixtral, 1e-2f, 0.05);
  }

  TEST_CASE("the MoE model's backward with router and load-balancing loss matches finite differences") {
    // Top-k routing is a step function of everything upstream of the router,
    // so a difference quotient across a routing change is meaningless. With
    // k = E nothing can change experts and every tensor is checked; with
    // k < E the experts of the last block (downstream of its routing) are.
    ModelConfig all_experts = tiny_model(2);
    all_experts.top_k = 2;
    check_model_gradients(all_experts, 1e-2f, 0.05);
    check_model_gradients(tiny_model(4), 1e-2f, 0.05, "h.1.moe.experts");
  }

  TEST_CASE("padded vocabulary columns get no gradient and the loss starts near log(V)") {
    ModelConfig m = tiny_model();
    CpuBackend backend(1);
    TestModel test_model(m, backend, 2, 3);
    Gpt& model = test_model.gpt;
    auto inputs = sample_tokens(16, 50, 1), targets = sample_tokens(16, 50, 2);
    test_model.storage.zero_gradients();
    model.forward(inputs.data(), targets.data(), 2);
    const float loss = model.loss();
    CHECK(loss == doctest::Approx(std::log(50.0)).epsilon(0.05));
    model.backward(1.0f);
    auto grads = copy_out(model, test_model.storage.grads());
    const auto& wte = model.table().find("wte");
    // wte rows >= V get gradient only from the head's padded columns: none.
    for (size_t i = 50 * 16; i < 128 * 16; ++i) REQUIRE(grads[wte.offset + i] == 0.0f);
  }

  TEST_CASE("a forward told its backward's loss scale leaves the loss and gradients of a plain forward bit for bit") {
    ModelConfig m = tiny_model();
    CpuBackend backend(1);
    TestModel test_model(m, backend, 2, 3);
    Gpt& model = test_model.gpt;
    auto inputs = sample_tokens(16, 50, 1), targets = sample_tokens(16, 50, 2);
    auto pass = [&](std::optional<float> backward_scale) {
      test_model.storage.zero_gradients();
      model.forward(inputs.data(), targets.data(), 2, 0, 0, backward_scale);
      const float loss = model.loss();
      model.backward(0.25f);
      return std::make_pair(loss, copy_out(model, test_model.storage.grads()));
    };
    const auto plain = pass(std::nullopt), fused = pass(0.25f);
    CHECK(fused.first == plain.first);
    CHECK(fused.second == plain.second);
    // The forward's gradient is the scale's: another one in the backward
    // would be silently wrong, so it is refused.
    model.forward(inputs.data(), targets.data(), 2, 0, 0, 0.5f);
    CHECK_THROWS_WITH(model.backward(0.25f), doctest::Contains("is not the 0.5"));
  }

  TEST_CASE("with bf16 GEMM inputs every gradient follows the float32 model's - fused or split backward - dense or MoE - GPT-2 or Llama") {
    // The bf16 path hands the linears the residual stream's gradient as
    // the norm backward above them rounded it: a copy not written, or
    // written by the wrong norm, leaves a projection's gradients far
    // from the float32 model's. Llama's rotary turns bf16 q and k in place.
    for (const ModelConfig& config : {tiny_model(0), tiny_model(4), tiny_llama(0), tiny_llama(4)}) {
      for (const bool split : {false, true}) {
        CAPTURE(config.arch);
        CAPTURE(config.n_expert);
        CAPTURE(split);
        auto gradients = [&](CpuBackend& backend) {
          TestModel test_model(config, backend, 2, 11, split);
          auto inputs = sample_tokens(16, 50, 1), targets = sample_tokens(16, 50, 2);
          test_model.storage.zero_gradients();
          test_model.gpt.forward(inputs.data(), targets.data(), 2);
          test_model.gpt.backward(1.0f, 0, !split);
          if (split) test_model.gpt.weight_gradients(0);
          return copy_out(test_model.gpt, test_model.storage.grads());
        };
        CpuBackend f32(1), bf16(1, keel::trainer::DType::kBF16);
        const std::vector<float> want = gradients(f32), got = gradients(bf16);
        const ParameterTable table(config);
        for (const auto& spec : table.specs()) {
          CAPTURE(spec.name);
          const std::vector<float> a(got.begin() + spec.offset, got.begin() + spec.offset + spec.numel);
          const std::vector<float> b(want.begin() + spec.offset, want.begin() + spec.offset + spec.numel);
          CHECK(keel::test::relative_l2(a, b) <= 3e-2);
        }
      }
    }
  }

  TEST_CASE("the learning rate warms up linearly and decays by cosine to the floor") {
    keel::common::TrainConfig t;
    t.steps = 110;
    t.warmup_steps = 10;
    t.lr = 1.0;
    t.min_lr_ratio = 0.1;
    CHECK(keel::trainer::learning_rate(t, 0) == doctest::Approx(0.1));
    CHECK(keel::trainer::learning_rate(t, 9) == doctest::Approx(1.0));
    CHECK(keel::trainer::learning_rate(t, 10) == doctest::Approx(1.0));
    CHECK(keel::trainer::learning_rate(t, 109) == doctest::Approx(0.1));
    CHECK(keel::trainer::learning_rate(t, 60) < keel::trainer::learning_rate(t, 30));
  }

  TEST_CASE("AdamW steps drive the loss of a repeated batch down") {
    ModelConfig m = tiny_model(4);
    CpuBackend backend(1);
    TestModel test_model(m, backend, 2, 5);
    Gpt& model = test_model.gpt;
    keel::common::TrainConfig t;
    t.steps = 60;
    t.warmup_steps = 0;
    t.lr = 1e-2;
    keel::trainer::AdamW optimizer(backend, model.table(), t);
    const auto optimizer_memory = keel::trainer::lay_out(backend, optimizer);
    auto inputs = sample_tokens(16, 50, 1), targets = sample_tokens(16, 50, 2);
    float first = 0, last = 0;
    for (int step = 0; step < t.steps; ++step) {
      test_model.storage.zero_gradients();
      model.forward(inputs.data(), targets.data(), 2);
      last = model.loss();
      if (step == 0) first = last;
      model.backward(1.0f);
      const auto& specs = test_model.table.specs();
      double squares = 0;
      for (const auto& spec : specs) squares += backend.sum_squares(test_model.storage.grads() + spec.offset, spec.numel);
      CHECK(std::isfinite(squares));
      const float scale = optimizer.clip_scale(std::sqrt(squares));
      std::vector<keel::trainer::AdamW::Part> parts;
      for (size_t i = 0; i < specs.size(); ++i) {
        parts.push_back({i, test_model.storage.params() + specs[i].offset, test_model.storage.grads() + specs[i].offset});
      }
      optimizer.update(parts, static_cast<float>(keel::trainer::learning_rate(t, step)), scale, step);
    }
    CHECK(last < 0.5f * first);
  }
}
