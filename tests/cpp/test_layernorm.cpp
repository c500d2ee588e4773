// splitgrad::LayerNormLinear and splitgrad::LayerNormMLP against the same blocks in plain libtorch
// autograd (at::layer_norm / at::rms_norm, torch::nn::functional::linear and the activation, on
// parameters cloned from the module's). The same ATen kernels run on both sides on the CPU, so
// float32 results are compared bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "splitgrad/splitgrad.h"
#include "test_helpers.h"

namespace {

namespace F = torch::nn::functional;
using splitgrad::LayerNormLinear;
using splitgrad::LayerNormLinearOptions;
using splitgrad::LayerNormMLP;
using splitgrad::LayerNormMLPOptions;
using splitgrad_test::error_message;

constexpr int64_t kHidden = 8, kFfn = 12, kOut = 6;
const std::vector<std::string> kActivations{"gelu",  "relu",   "silu",   "qgelu",  "srelu", "geglu",
                                            "reglu", "swiglu", "qgeglu", "sreglu", "glu"};

bool is_gated(const std::string& name) {
  return name == "geglu" || name == "reglu" || name == "swiglu" || name == "qgeglu" ||
         name == "sreglu" || name == "glu";
}
const std::vector<std::string> kNorms{"LayerNorm", "RMSNorm"};

::testing::AssertionResult Bitwise(const torch::Tensor& actual, const torch::Tensor& expected) {
  if (actual.defined() != expected.defined()) {
    return ::testing::AssertionFailure()
           << "defined: " << actual.defined() << " vs " << expected.defined();
  }
  if (!actual.defined() || torch::equal(actual, expected)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "not bitwise equal: " << actual.sizes() << " vs " << expected.sizes();
}

// Non-trivial values for every parameter (the norm's defaults are 1 and 0).
void randomize(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& param : module.parameters()) param.copy_(torch::randn(param.sizes()) * 0.5);
}

torch::Tensor ref_param(const torch::Tensor& param) {
  return param.defined() ? param.detach().clone().requires_grad_() : torch::Tensor();
}

// The norm in plain libtorch: nn::LayerNorm's / nn::RMSNorm's computation.
torch::Tensor ref_norm(const torch::Tensor& x, const std::string& normalization,
                       const torch::Tensor& weight, const torch::Tensor& bias, bool zero_centered) {
  const torch::Tensor gamma = zero_centered ? weight + 1 : weight;
  if (normalization == "LayerNorm") {
    return at::layer_norm(x, {gamma.size(0)}, gamma,
                          bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, 1e-5);
  }
  return at::rms_norm(x, {gamma.size(0)}, gamma, 1e-5);
}

torch::Tensor ref_activation(const std::string& name, const torch::Tensor& x) {
  // TE's activations as plain libtorch composites (qgelu: x * sigmoid(1.702 x); srelu: relu(x)²)
  auto act = [&](const torch::Tensor& t) {
    if (name == "gelu" || name == "geglu") return torch::gelu(t, "tanh");
    if (name == "relu" || name == "reglu") return torch::relu(t);
    if (name == "qgelu" || name == "qgeglu") return t * torch::sigmoid(t * 1.702);
    if (name == "srelu" || name == "sreglu") return torch::square(torch::relu(t));
    if (name == "glu") return torch::sigmoid(t);
    return torch::silu(t);
  };
  if (!is_gated(name)) return act(x);
  auto halves = x.chunk(2, -1);  // TE gates the first half
  return act(halves[0]) * halves[1];
}

// ---------------------------------------------------------------------------------------------

TEST(LayerNormLinear, MatchesPlainAutogradForEveryOption) {
  for (const auto& normalization : kNorms) {
    for (bool zero_centered : {false, true}) {
      for (bool bias : {false, true}) {
        for (bool delay : {false, true}) {
          SCOPED_TRACE(normalization + " zero_centered=" + std::to_string(zero_centered) +
                       " bias=" + std::to_string(bias) + " delay=" + std::to_string(delay));
          LayerNormLinear m(LayerNormLinearOptions(kHidden, kOut)
                                .normalization(normalization)
                                .zero_centered_gamma(zero_centered)
                                .bias(bias)
                                .delay_wgrad_compute(delay)
                                .device(torch::kCPU));
          randomize(*m);
          auto lw = ref_param(m->layer_norm_weight), lb = ref_param(m->layer_norm_bias);
          auto w = ref_param(m->weight), b = ref_param(m->bias);
          auto x = torch::randn({2, 3, kHidden}, torch::requires_grad());
          auto xr = x.detach().clone().requires_grad_();
          auto [out, ln_out] = m->forward_with_layernorm_output(x);
          (out.sum() + (ln_out * 0.5).sum()).backward();
          EXPECT_EQ(m->pending_wgrads(), delay ? 1 : 0);
          m->backward_dw();
          auto ref_ln = ref_norm(xr, normalization, lw, lb, zero_centered);
          auto ref_out = F::linear(ref_ln, w, b);
          (ref_out.sum() + (ref_ln * 0.5).sum()).backward();
          EXPECT_TRUE(Bitwise(out, ref_out));
          EXPECT_TRUE(Bitwise(ln_out, ref_ln));
          EXPECT_TRUE(Bitwise(x.grad(), xr.grad()));
          EXPECT_TRUE(Bitwise(m->layer_norm_weight.grad(), lw.grad()));
          EXPECT_TRUE(
              Bitwise(m->layer_norm_bias.defined() ? m->layer_norm_bias.grad() : torch::Tensor(),
                      lb.defined() ? lb.grad() : torch::Tensor()));
          EXPECT_TRUE(Bitwise(m->weight.grad(), w.grad()));
          EXPECT_TRUE(
              Bitwise(bias ? m->bias.grad() : torch::Tensor(), bias ? b.grad() : torch::Tensor()));
        }
      }
    }
  }
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

TEST(LayerNormMLP, MatchesPlainAutogradForEveryActivationAndNorm) {
  for (const auto& normalization : kNorms) {
    for (const auto& activation : kActivations) {
      for (bool delay : {false, true}) {
        SCOPED_TRACE(normalization + " " + activation + " delay=" + std::to_string(delay));
        LayerNormMLP m(LayerNormMLPOptions(kHidden, kFfn)
                           .normalization(normalization)
                           .activation(activation)
                           .delay_wgrad_compute(delay)
                           .device(torch::kCPU));
        randomize(*m);
        auto lw = ref_param(m->layer_norm_weight), lb = ref_param(m->layer_norm_bias);
        auto w1 = ref_param(m->fc1_weight), b1 = ref_param(m->fc1_bias);
        auto w2 = ref_param(m->fc2_weight), b2 = ref_param(m->fc2_bias);
        auto x = torch::randn({5, kHidden}, torch::requires_grad());
        auto xr = x.detach().clone().requires_grad_();
        auto out = m->forward(x);
        out.pow(2).sum().backward();
        EXPECT_EQ(m->pending_wgrads(), delay ? 2 : 0);
        m->backward_dw();
        auto ref_out =
            F::linear(ref_activation(activation,
                                     F::linear(ref_norm(xr, normalization, lw, lb, false), w1, b1)),
                      w2, b2);
        ref_out.pow(2).sum().backward();
        EXPECT_TRUE(Bitwise(out, ref_out));
        EXPECT_TRUE(Bitwise(x.grad(), xr.grad()));
        EXPECT_TRUE(Bitwise(m->layer_norm_weight.grad(), lw.grad()));
        EXPECT_TRUE(Bitwise(m->fc1_weight.grad(), w1.grad()));
        EXPECT_TRUE(Bitwise(m->fc1_bias.grad(), b1.grad()));
        EXPECT_TRUE(Bitwise(m->fc2_weight.grad(), w2.grad()));
        EXPECT_TRUE(Bitwise(m->fc2_bias.grad(), b2.grad()));
      }
    }
  }
}

TEST(LayerNormLinear, ZeroCenteredGammaAddsTheOneInFp32) {
  // TE's numerics for a 16-bit zero-centred gamma: 1 + gamma formed in fp32 inside the norm, which
  // runs in fp32 and rounds its output once. Against a double computation rounded to the dtype,
  // the norm's output and the input's gradient agree but for the odd tie; with 1 + gamma rounded
  // to 16 bits first, a quarter of them differ (so the data tell the two apart).
  constexpr int64_t hidden = 256, rows = 64;
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const auto& normalization : kNorms) {
      SCOPED_TRACE(normalization + " " + std::string(c10::toString(dtype)));
      LayerNormLinear m(LayerNormLinearOptions(hidden, 16)
                            .normalization(normalization)
                            .zero_centered_gamma(true)
                            .params_dtype(dtype)
                            .device(torch::kCPU));
      torch::manual_seed(0);
      {
        torch::NoGradGuard no_grad;
        m->layer_norm_weight.copy_(torch::randn({hidden}) * 0.1);
        if (m->layer_norm_bias.defined()) m->layer_norm_bias.copy_(torch::randn({hidden}) * 0.1);
      }
      const auto x = torch::randn({rows, hidden}).to(dtype);
      const auto gy = torch::randn({rows, hidden}).to(dtype);
      auto norm_and_dx = [&](const torch::Tensor& input, const torch::Tensor& gamma,
                             const torch::Tensor& beta) {
        auto leaf = input.detach().requires_grad_();
        auto out = normalization == "LayerNorm"
                       ? at::layer_norm(
                             leaf, {hidden}, gamma,
                             beta.defined() ? std::optional<at::Tensor>(beta) : std::nullopt, 1e-5)
                       : at::rms_norm(leaf, {hidden}, gamma, 1e-5);
        (out.to(torch::kDouble) * gy.to(torch::kDouble)).sum().backward();
        return std::make_pair(out.detach(), leaf.grad());
      };
      auto xg = x.clone().requires_grad_();
      auto [out, ln_out] = m->forward_with_layernorm_output(xg);
      (ln_out.to(torch::kDouble) * gy.to(torch::kDouble)).sum().backward();
      const auto weight = m->layer_norm_weight.detach();
      const auto bias =
          m->layer_norm_bias.defined() ? m->layer_norm_bias.detach() : torch::Tensor();
      auto [exact, exact_dx] = norm_and_dx(x.to(torch::kDouble), weight.to(torch::kDouble) + 1,
                                           bias.defined() ? bias.to(torch::kDouble) : bias);
      auto [rounded, rounded_dx] = norm_and_dx(x, weight + 1, bias);  // 1 + gamma in dtype
      auto differing = [&](const torch::Tensor& got, const torch::Tensor& want) {
        return got.ne(want.to(dtype)).to(torch::kDouble).mean().item<double>();
      };
      EXPECT_LT(differing(ln_out, exact), 1e-3);
      EXPECT_LT(differing(xg.grad(), exact_dx), 1e-3);
      EXPECT_GT(differing(rounded, exact), 0.1);
      EXPECT_GT(differing(rounded_dx, exact_dx), 0.1);
    }
  }
}

TEST(LayerNormMLP, ParametersHaveTeNamesAndShapes) {
  LayerNormMLP m(LayerNormMLPOptions(kHidden, kFfn).activation("swiglu").device(torch::kCPU));
  std::vector<std::string> names;
  for (const auto& item : m->named_parameters()) names.push_back(item.key());
  EXPECT_EQ(names, (std::vector<std::string>{"layer_norm_weight", "layer_norm_bias", "fc1_weight",
                                             "fc1_bias", "fc2_weight", "fc2_bias"}));
  EXPECT_EQ(m->fc1_weight.sizes(), (std::vector<int64_t>{2 * kFfn, kHidden}));
  EXPECT_EQ(m->fc2_weight.sizes(), (std::vector<int64_t>{kHidden, kFfn}));
  EXPECT_TRUE(torch::equal(m->layer_norm_weight, torch::ones({kHidden})));
  LayerNormLinear rms(
      LayerNormLinearOptions(kHidden, kOut).normalization("RMSNorm").zero_centered_gamma(true));
  EXPECT_FALSE(rms->layer_norm_bias.defined());
  EXPECT_TRUE(torch::equal(rms->layer_norm_weight.cpu(), torch::zeros({kHidden})));
}

TEST(LayerNormMLP, OneBackwardDwRunsOnePassOfFc2ThenFc1) {
  LayerNormMLP m(LayerNormMLPOptions(kHidden, kFfn).delay_wgrad_compute(true).device(torch::kCPU));
  std::vector<std::string> order;
  splitgrad::register_grad_ready_hook(m->fc1_weight,
                                      [&](const torch::Tensor&) { order.push_back("fc1"); });
  splitgrad::register_grad_ready_hook(m->fc2_weight,
                                      [&](const torch::Tensor&) { order.push_back("fc2"); });
  m->forward(torch::randn({2, kHidden})).sum().backward();
  m->forward(torch::randn({2, kHidden})).sum().backward();
  EXPECT_EQ(m->pending_wgrads(), 4);
  EXPECT_EQ(m->pending_passes().size(), 2u);
  EXPECT_TRUE(order.empty());
  m->backward_dw();
  EXPECT_EQ(order, (std::vector<std::string>{"fc2", "fc1"}));
  EXPECT_EQ(m->pending_wgrads(), 2);
  m->backward_dw(m->pending_passes().front());
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  std::string msg = error_message([&] { m->backward_dw(); });
  EXPECT_CONTAINS(msg, "LayerNormMLP(8, 12)#");
  EXPECT_CONTAINS(msg, "no backward pass has queued");
}

// One backward pass queues fc2's and fc1's items. fc1's stash (the norm's output, returned) is
// modified in place: backward_dw() names the module, fc1 and the tensor, says that fc2's item was
// dropped too, writes nothing and leaves nothing of that pass queued (the hooks skip it); the next
// pass takes one backward_dw() and matches plain autograd bit for bit.
TEST(LayerNormMLP, AFailedCheckDropsThePassAndTheNextPassIsExact) {
  LayerNormMLP m(LayerNormMLPOptions(kHidden, kFfn)
                     .delay_wgrad_compute(true)
                     .name("blocks.0.mlp")
                     .device(torch::kCPU));
  randomize(*m);
  const std::vector<torch::Tensor> fc{m->fc1_weight, m->fc1_bias, m->fc2_weight, m->fc2_bias};
  int fired = 0;
  for (const auto& p : fc) {
    splitgrad::register_grad_ready_hook(p, [&](const torch::Tensor&) { ++fired; });
  }
  auto [out, ln_out] = m->forward_with_layernorm_output(torch::randn({5, kHidden}));
  (out.pow(2).sum() + ln_out.sum()).backward();
  ASSERT_EQ(m->pending_wgrads(), 2);
  ln_out.add_(1.0);  // fc1's stashed input
  const std::string msg = error_message([&] { m->backward_dw(); });
  EXPECT_CONTAINS(msg, "splitgrad layer 'blocks.0.mlp' (fc1): the input stashed");
  EXPECT_CONTAINS(msg, "modified in place");
  EXPECT_CONTAINS(msg, "for the weight of shape [12, 8], was dropped");
  EXPECT_CONTAINS(msg,
                  "The other 1 deferred item(s) that backward pass queued for this layer (fc2) "
                  "were dropped too");
  EXPECT_EQ(m->pending_wgrads(), 0);
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  for (const auto& p : fc) {
    EXPECT_FALSE(p.grad().defined());
    EXPECT_EQ(splitgrad::pending_wgrads_for(p), 0);
    EXPECT_EQ(splitgrad::dropped_wgrads_for(p), 1);
  }
  EXPECT_EQ(fired, 0) << "that pass's gradients are incomplete";

  m->zero_grad(/*set_to_none=*/true);
  auto lw = ref_param(m->layer_norm_weight), lb = ref_param(m->layer_norm_bias);
  auto w1 = ref_param(m->fc1_weight), b1 = ref_param(m->fc1_bias);
  auto w2 = ref_param(m->fc2_weight), b2 = ref_param(m->fc2_bias);
  const torch::Tensor x = torch::randn({5, kHidden});
  m->forward(x).pow(2).sum().backward();
  m->backward_dw();
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  F::linear(ref_activation("gelu", F::linear(ref_norm(x, "LayerNorm", lw, lb, false), w1, b1)), w2,
            b2)
      .pow(2)
      .sum()
      .backward();
  EXPECT_TRUE(Bitwise(m->layer_norm_weight.grad(), lw.grad()));
  EXPECT_TRUE(Bitwise(m->fc1_weight.grad(), w1.grad()));
  EXPECT_TRUE(Bitwise(m->fc1_bias.grad(), b1.grad()));
  EXPECT_TRUE(Bitwise(m->fc2_weight.grad(), w2.grad()));
  EXPECT_TRUE(Bitwise(m->fc2_bias.grad(), b2.grad()));
  EXPECT_EQ(fired, 4);
}

TEST(LayerNormMLP, DelayedEqualsImmediateBitForBitInBf16) {
  auto options = LayerNormMLPOptions(kHidden, kFfn)
                     .activation("geglu")
                     .normalization("RMSNorm")
                     .params_dtype(torch::kBFloat16)
                     .device(torch::kCPU);
  LayerNormMLP immediate(options);
  LayerNormMLP delayed(LayerNormMLPOptions(options).delay_wgrad_compute(true));
  randomize(*immediate);
  {
    torch::NoGradGuard no_grad;
    auto src = immediate->parameters();
    auto dst = delayed->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, kHidden}).to(torch::kBFloat16);
    immediate->forward(x).to(torch::kFloat).pow(2).sum().backward();
    delayed->forward(x).to(torch::kFloat).pow(2).sum().backward();
    delayed->backward_dw();
  }
  auto a = immediate->named_parameters(), b = delayed->named_parameters();
  for (const auto& item : a) {
    SCOPED_TRACE(item.key());
    EXPECT_TRUE(Bitwise(b[item.key()].grad(), item.value().grad()));
  }
}

// The activation ops and linear's input_activation, for C++ callers: the ATen composite's values
// bit for bit, and fc2's deferred wgrad (which keeps fc1's output and recomputes the activation)
// equal to the immediate one.
TEST(ActivationOps, MatchTheCompositeAndItsAutograd) {
  for (const auto& name : kActivations) {
    SCOPED_TRACE(name);
    for (auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf}) {
      const bool gated = is_gated(name);
      auto x = (torch::randn({5, gated ? 8 : 4}) * 2).to(dtype).requires_grad_();
      auto dy = torch::randn({5, 4}).to(dtype);
      auto want = ref_activation(name, x);
      want.backward(dy);
      EXPECT_TRUE(Bitwise(splitgrad::ops::activation(x.detach(), name), want.detach()));
      EXPECT_TRUE(Bitwise(splitgrad::ops::activation_backward(dy, x.detach(), name), x.grad()));
    }
  }
  EXPECT_NE(error_message([] {
              splitgrad::ops::activation(torch::randn({2, 3}), "swiglu");
            }).find("even last dimension"),
            std::string::npos);
  EXPECT_NE(error_message([] {
              splitgrad::ops::activation(torch::randn({2, 4}), "elu");
            }).find("got \"elu\""),
            std::string::npos);
}

TEST(ActivationOps, LinearInputActivationDeferredEqualsImmediate) {
  auto h = torch::randn({6, 2 * kFfn});
  auto w = torch::randn({kOut, kFfn}), dy = torch::randn({6, kOut});
  std::vector<torch::Tensor> grads;
  for (bool delay : {false, true}) {
    splitgrad::LayerHandle layer("fc2");
    auto weight = w.clone().requires_grad_();
    auto x = h.clone().requires_grad_();
    splitgrad::ops::linear(x, weight, std::nullopt, std::nullopt, std::nullopt, layer.id(), delay,
                           "swiglu")
        .backward(dy);
    EXPECT_EQ(layer.pending(), delay ? 1 : 0);
    if (delay) layer.backward_dw();
    grads.push_back(weight.grad());
    grads.push_back(x.grad());
  }
  auto x = h.clone().requires_grad_();
  auto weight = w.clone().requires_grad_();
  F::linear(ref_activation("swiglu", x), weight).backward(dy);
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(Bitwise(grads[i], i % 2 == 0 ? weight.grad() : x.grad())) << i;
  }
}

TEST(LayerNormLinear, TiedWeightAndNormWeightAccumulateEveryContribution) {
  auto options =
      LayerNormLinearOptions(kHidden, kOut).delay_wgrad_compute(true).device(torch::kCPU);
  LayerNormLinear a(options);
  LayerNormLinear b(options);
  randomize(*a);
  randomize(*b);
  b->tie_parameter("weight", a->weight);
  b->tie_parameter("layer_norm_weight", a->layer_norm_weight);
  EXPECT_TRUE(b->weight.is_same(a->weight));
  EXPECT_TRUE(b->named_parameters()["weight"].is_same(a->weight));
  auto lw = ref_param(a->layer_norm_weight), w = ref_param(a->weight);
  auto lb_a = ref_param(a->layer_norm_bias), lb_b = ref_param(b->layer_norm_bias);
  auto ba = ref_param(a->bias), bb = ref_param(b->bias);
  auto x = torch::randn({3, kHidden});
  (a->forward(x) * b->forward(x.flip(-1))).sum().backward();
  b->backward_dw();
  a->backward_dw();
  auto ref = F::linear(ref_norm(x, "LayerNorm", lw, lb_a, false), w, ba) *
             F::linear(ref_norm(x.flip(-1), "LayerNorm", lw, lb_b, false), w, bb);
  ref.sum().backward();
  // two contributions each: their order cannot change a float32 sum
  EXPECT_TRUE(Bitwise(a->weight.grad(), w.grad()));
  EXPECT_TRUE(Bitwise(a->layer_norm_weight.grad(), lw.grad()));
  EXPECT_TRUE(Bitwise(b->bias.grad(), bb.grad()));
}

TEST(LayerNormMLP, FusedMainGradAndItsErrors) {
  LayerNormMLP m(LayerNormMLPOptions(kHidden, kFfn)
                     .delay_wgrad_compute(true)
                     .fuse_wgrad_accumulation(true)
                     .name("blocks.0.mlp")
                     .device(torch::kCPU));
  randomize(*m);
  std::string msg = error_message([&] { m->forward(torch::randn({2, kHidden})); });
  EXPECT_CONTAINS(msg, "blocks.0.mlp");
  EXPECT_CONTAINS(msg, "fc1_weight's main_grad");
  splitgrad::set_main_grad(m->fc1_weight, torch::zeros({kFfn, kHidden}));
  msg = error_message([&] { m->forward(torch::randn({2, kHidden})); });
  EXPECT_CONTAINS(msg, "fc2_weight's main_grad");
  splitgrad::set_main_grad(m->fc2_weight, torch::zeros({kHidden, kFfn}));
  auto w1 = ref_param(m->fc1_weight), w2 = ref_param(m->fc2_weight);
  auto b1 = ref_param(m->fc1_bias), b2 = ref_param(m->fc2_bias);
  auto lw = ref_param(m->layer_norm_weight), lb = ref_param(m->layer_norm_bias);
  auto x = torch::randn({4, kHidden});
  m->forward(x).pow(2).sum().backward();
  m->backward_dw();
  F::linear(ref_activation("gelu", F::linear(ref_norm(x, "LayerNorm", lw, lb, false), w1, b1)), w2,
            b2)
      .pow(2)
      .sum()
      .backward();
  EXPECT_FALSE(m->fc1_weight.grad().defined());
  EXPECT_TRUE(Bitwise(splitgrad::main_grad(m->fc1_weight), w1.grad()));
  EXPECT_TRUE(Bitwise(splitgrad::main_grad(m->fc2_weight), w2.grad()));
  EXPECT_TRUE(Bitwise(m->fc2_bias.grad(), b2.grad()));  // no main_grad: its .grad, as in TE
  EXPECT_TRUE(Bitwise(m->layer_norm_weight.grad(), lw.grad()));
}

TEST(LayerNormModules, MisuseGetsErrorsNamingTheModule) {
  LayerNormMLP m(LayerNormMLPOptions(kHidden, kFfn).name("mlp").device(torch::kCPU));
  std::string msg = error_message([&] { m->forward(torch::randn({2, kHidden + 1})); });
  EXPECT_CONTAINS(msg, "splitgrad layer 'mlp'");
  EXPECT_CONTAINS(msg, "[*, 8]");
  msg = error_message([&] { m->forward(torch::randn({2, kHidden}, torch::kDouble)); });
  EXPECT_CONTAINS(msg, "'mlp' (fc1): expected input of dtype torch.float32");
  msg = error_message([&] { m->forward(torch::Tensor()); });
  EXPECT_CONTAINS(msg, "'mlp': expected an input of shape [*, 8], got an undefined tensor");
  msg = error_message([&] { LayerNormMLP(LayerNormMLPOptions(8, 8).activation("tanh")); });
  EXPECT_CONTAINS(msg, "expected activation");
  msg = error_message(
      [&] { LayerNormLinear(LayerNormLinearOptions(8, 8).normalization("BatchNorm")); });
  EXPECT_CONTAINS(msg, "LayerNormLinear: expected normalization \"LayerNorm\" or \"RMSNorm\"");
  msg = error_message([&] { m->tie_parameter("weight", m->fc1_weight); });
  EXPECT_CONTAINS(msg, "tie_parameter expected one of layer_norm_weight");
  msg = error_message([&] { m->tie_parameter("fc1_weight", m->fc2_weight); });
  EXPECT_CONTAINS(msg,
                  "'mlp': tie_parameter(\"fc1_weight\") expected a tensor of shape [12, 8] for "
                  "fc1_weight");
  LayerNormLinear rms(
      LayerNormLinearOptions(8, 8).normalization("RMSNorm").name("qkv").device(torch::kCPU));
  msg = error_message([&] { rms->tie_parameter("layer_norm_bias", torch::zeros({8})); });
  EXPECT_CONTAINS(msg, "'qkv': tie_parameter(\"layer_norm_bias\") on a module built without");
  // A regular module's backward_dw() does nothing.
  m->forward(torch::randn({2, kHidden})).sum().backward();
  m->backward_dw();
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

TEST(LayerNormModules, GemmErrorsNameTheModuleAndTheGemm) {
  // An error from one of LayerNormMLP's two GEMMs says which: parameters replaced by ones of the
  // wrong dtype or shape, a fused module missing one GEMM's main_grad.
  auto fresh = [](bool fused = false) {
    return LayerNormMLP(LayerNormMLPOptions(kHidden, kFfn)
                            .name("blocks.0.mlp")
                            .fuse_wgrad_accumulation(fused)
                            .device(torch::kCPU));
  };
  const auto x = torch::randn({2, kHidden});
  auto m = fresh();
  m->fc2_weight = torch::randn({kHidden, kFfn}, torch::kDouble);
  EXPECT_CONTAINS(error_message([&] { m->forward(x); }),
                  "splitgrad layer 'blocks.0.mlp' (fc2): expected input of dtype torch.float64");
  m = fresh();
  m->fc2_weight = torch::randn({kHidden, kFfn + 1});
  EXPECT_CONTAINS(error_message([&] { m->forward(x); }),
                  "splitgrad layer 'blocks.0.mlp' (fc2): expected input of shape [*, 13]");
  m = fresh();
  m->fc1_weight = torch::randn({kFfn, kHidden}, torch::kDouble);
  EXPECT_CONTAINS(error_message([&] { m->forward(x); }),
                  "splitgrad layer 'blocks.0.mlp' (fc1): expected input of dtype torch.float64");
  m = fresh();
  m->fc1_bias = torch::randn({kFfn + 1});
  EXPECT_CONTAINS(error_message([&] { m->forward(x); }),
                  "splitgrad layer 'blocks.0.mlp' (fc1): expected a bias of shape [12]");
  m = fresh();
  m->fc2_bias = torch::randn({kHidden}, torch::kDouble);
  EXPECT_CONTAINS(error_message([&] { m->forward(x); }),
                  "splitgrad layer 'blocks.0.mlp' (fc2): expected a bias of dtype torch.float32");
  m = fresh(/*fused=*/true);
  splitgrad::set_main_grad(m->fc1_weight, torch::zeros({kFfn, kHidden}));
  EXPECT_CONTAINS(error_message([&] { m->forward(x); }),
                  "'blocks.0.mlp' (fc2): fuse_wgrad_accumulation=true needs the fc2_weight's main_grad");
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

TEST(LayerNormModules, DefaultNamesCopiesAndGuards) {
  LayerNormLinear a(LayerNormLinearOptions(kHidden, kOut)
                        .name("qkv")
                        .delay_wgrad_compute(true)
                        .device(torch::kCPU));
  auto copy = std::dynamic_pointer_cast<splitgrad::LayerNormLinearImpl>(a->clone());
  ASSERT_TRUE(copy);
  EXPECT_EQ(copy->options.name().rfind("qkv#", 0), 0u) << copy->options.name();
  a->forward(torch::randn({2, kHidden})).sum().backward();
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
  std::string msg = error_message([&] { a->zero_grad(); });
  EXPECT_CONTAINS(msg, "zero_grad() of splitgrad layer 'qkv'");
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kWarn);
  EXPECT_EQ(copy->pending_wgrads(), 0);
  a->backward_dw();
  EXPECT_FALSE(copy->weight.grad().defined());
  LayerNormMLP unnamed(LayerNormMLPOptions(kHidden, kFfn).device(torch::kCPU));
  std::ostringstream printed;
  printed << *unnamed;
  EXPECT_CONTAINS(printed.str(), "splitgrad::LayerNormMLP(hidden_size=8, ffn_hidden_size=12");
}

// clone() copies each parameter apart (torch::nn::Cloneable); ties among the module's own
// parameters must hold in the copy too, as Python's deepcopy keeps them.
TEST(LayerNormModules, CloneKeepsTiesAmongItsOwnParameters) {
  LayerNormMLP mlp(LayerNormMLPOptions(kHidden, kHidden).activation("relu").device(torch::kCPU));
  randomize(*mlp);
  mlp->tie_parameter("fc2_weight", mlp->fc1_weight);
  mlp->tie_parameter("fc2_bias", mlp->layer_norm_bias);
  auto copy = std::dynamic_pointer_cast<splitgrad::LayerNormMLPImpl>(mlp->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(copy->fc2_weight.is_same(copy->fc1_weight));
  EXPECT_TRUE(copy->fc2_bias.is_same(copy->layer_norm_bias));
  EXPECT_TRUE(copy->named_parameters()["fc2_weight"].is_same(copy->fc1_weight));
  EXPECT_FALSE(copy->fc1_weight.is_same(mlp->fc1_weight)) << "a clone has its own tensors";
  EXPECT_EQ(splitgrad::unique_parameters(*copy).size(), splitgrad::unique_parameters(*mlp).size());

  // Both uses of the shared tensor add up in the copy, as in the original.
  const auto x = torch::randn({5, kHidden});
  mlp->forward(x).pow(2).sum().backward();
  copy->forward(x).pow(2).sum().backward();
  EXPECT_TRUE(Bitwise(copy->fc1_weight.grad(), mlp->fc1_weight.grad()));
  EXPECT_TRUE(Bitwise(copy->layer_norm_bias.grad(), mlp->layer_norm_bias.grad()));

  LayerNormLinear qkv(LayerNormLinearOptions(kHidden, kHidden).device(torch::kCPU));
  qkv->tie_parameter("bias", qkv->layer_norm_bias);
  auto qkv_copy = std::dynamic_pointer_cast<splitgrad::LayerNormLinearImpl>(qkv->clone());
  ASSERT_TRUE(qkv_copy);
  EXPECT_TRUE(qkv_copy->bias.is_same(qkv_copy->layer_norm_bias));
  EXPECT_FALSE(qkv_copy->weight.is_same(qkv_copy->bias));
}

}  // namespace
