// splitgrad::Linear and the splitgrad ops against plain autograd (torch::nn::functional::linear on
// parameters cloned from the layer's). On the CPU the same ATen GEMMs run on both sides, so float32
// gradients are compared bit for bit wherever the two sides add the same terms in the same order;
// where only the association of a sum differs (three or more contributions to one gradient, a
// pre-existing .grad, main_grad), they are compared with a tight tolerance and the test says why.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/grad_ledger.h"  // WeakTensor
#include "splitgrad/splitgrad.h"
#include "test_helpers.h"

namespace {

namespace F = torch::nn::functional;
using splitgrad::Linear;
using splitgrad::LinearImpl;
using splitgrad::LinearOptions;

// ---------------------------------------------------------------------------------------------
// Helpers

LinearOptions opts(int64_t in, int64_t out) {
  return LinearOptions(in, out).device(torch::Device(torch::kCPU));
}

// A reference parameter with the same values as `param`, for the plain-autograd model.
torch::Tensor ref_param(const torch::Tensor& param) {
  return param.defined() ? param.detach().clone().requires_grad_() : torch::Tensor();
}

::testing::AssertionResult same_shape_and_dtype(const torch::Tensor& actual,
                                                const torch::Tensor& expected) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << "actual defined: " << actual.defined()
                                         << ", expected defined: " << expected.defined();
  }
  if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "actual " << actual.sizes() << " " << actual.scalar_type() << ", expected "
           << expected.sizes() << " " << expected.scalar_type();
  }
  return ::testing::AssertionSuccess();
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// Bit-for-bit equality (same shape, same dtype, same values).
::testing::AssertionResult Bitwise(const torch::Tensor& actual, const torch::Tensor& expected) {
  auto shape = same_shape_and_dtype(actual, expected);
  if (!shape) return shape;
  if (torch::equal(actual, expected)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "not bitwise equal; max |diff| = " << max_abs_diff(actual, expected);
}

// |actual - expected| <= atol + rtol * |expected| elementwise.
::testing::AssertionResult Close(const torch::Tensor& actual, const torch::Tensor& expected,
                                 double rtol, double atol) {
  auto shape = same_shape_and_dtype(actual, expected);
  if (!shape) return shape;
  if (torch::allclose(actual, expected, rtol, atol)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not close (rtol " << rtol << ", atol " << atol
                                       << "); max |diff| = " << max_abs_diff(actual, expected);
}

// float32 tolerance for sums that differ only in association.
constexpr double kReassocRtol = 1e-5;
constexpr double kReassocAtol = 1e-6;

using splitgrad_test::error_message;

class LinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    ASSERT_EQ(splitgrad::pending_wgrads(), 0) << "an earlier test left deferred work";
  }
  void TearDown() override {
    // The layers of a test are gone by now; their handles released anything they had queued.
    EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  }
};

// ---------------------------------------------------------------------------------------------
// One layer against F::linear

struct LayerCase {
  bool delay;
  bool bias;
  std::vector<int64_t> input_shape;  // [*, in_features]
};

void PrintTo(const LayerCase& c, std::ostream* os) {
  *os << "{delay " << c.delay << ", bias " << c.bias << ", input " << at::IntArrayRef(c.input_shape)
      << "}";
}

std::string case_name(const ::testing::TestParamInfo<LayerCase>& info) {
  std::string name = info.param.delay ? "Delayed" : "Regular";
  name += info.param.bias ? "Bias" : "NoBias";
  name += std::to_string(info.param.input_shape.size()) + "D";
  return name;
}

class LinearVsAutograd : public LinearTest, public ::testing::WithParamInterface<LayerCase> {};

TEST_P(LinearVsAutograd, Float32Bitwise) {
  const LayerCase& c = GetParam();
  const int64_t in = c.input_shape.back();
  const int64_t out = 24;
  Linear fc(opts(in, out).bias(c.bias).delay_wgrad_compute(c.delay));
  ASSERT_EQ(fc->weight.scalar_type(), torch::kFloat);
  ASSERT_EQ(fc->bias.defined(), c.bias);
  torch::Tensor w_ref = ref_param(fc->weight);
  torch::Tensor b_ref = ref_param(fc->bias);

  torch::Tensor x = torch::randn(c.input_shape).requires_grad_();
  torch::Tensor x_ref = ref_param(x);
  torch::Tensor y = fc(x);
  torch::Tensor y_ref = F::linear(x_ref, w_ref, b_ref);
  EXPECT_TRUE(Bitwise(y, y_ref));

  torch::Tensor g = torch::randn_like(y);
  y.backward(g);
  y_ref.backward(g);
  EXPECT_TRUE(Bitwise(x.grad(), x_ref.grad())) << "dgrad runs inside autograd's backward";
  if (c.delay) {
    EXPECT_FALSE(fc->weight.grad().defined()) << "wgrad is deferred to backward_dw()";
    EXPECT_EQ(fc->pending_wgrads(), 1);
    fc->backward_dw();
  }
  EXPECT_EQ(fc->pending_wgrads(), 0);
  EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
  if (c.bias) {
    EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearVsAutograd,
    ::testing::Values(LayerCase{false, true, {10, 16}}, LayerCase{true, true, {10, 16}},
                      LayerCase{false, false, {10, 16}}, LayerCase{true, false, {10, 16}},
                      LayerCase{false, true, {3, 5, 16}}, LayerCase{true, true, {3, 5, 16}},
                      LayerCase{false, false, {3, 5, 16}}, LayerCase{true, false, {3, 5, 16}},
                      LayerCase{true, true, {2, 3, 2, 16}}),
    case_name);

TEST_F(LinearTest, NonContiguousInput) {
  // A transposed 2-D input and a permuted 3-D one: splitgrad flattens the tokens (a copy for the
  // 3-D case) where F::linear runs matmul on the strided tensor; the same products either way.
  for (bool delay : {false, true}) {
    Linear fc(opts(16, 8).delay_wgrad_compute(delay));
    torch::Tensor w_ref = ref_param(fc->weight);
    torch::Tensor b_ref = ref_param(fc->bias);
    for (const torch::Tensor& base : {torch::randn({16, 6}).t(),  // [6, 16], column-major
                                      torch::randn({4, 16, 3}).permute({0, 2, 1})}) {
      ASSERT_FALSE(base.is_contiguous());
      torch::Tensor x = base.detach().requires_grad_();
      torch::Tensor x_ref = ref_param(x);
      torch::Tensor y = fc(x);
      torch::Tensor y_ref = F::linear(x_ref, w_ref, b_ref);
      EXPECT_TRUE(Close(y, y_ref, 0, 1e-6));
      torch::Tensor g = torch::randn_like(y);
      y.backward(g);
      y_ref.backward(g);
      fc->backward_dw();
      EXPECT_TRUE(Close(x.grad(), x_ref.grad(), 0, 1e-6));
    }
    // Two inputs per layer: two contributions, added in the same order on both sides.
    EXPECT_TRUE(Close(fc->weight.grad(), w_ref.grad(), kReassocRtol, kReassocAtol));
    EXPECT_TRUE(Close(fc->bias.grad(), b_ref.grad(), kReassocRtol, kReassocAtol));
  }
}

TEST_F(LinearTest, ZeroTokens) {
  // An empty batch: no work, zero gradients, as plain autograd gives.
  for (bool delay : {false, true}) {
    for (const std::vector<int64_t>& shape :
         {std::vector<int64_t>{0, 16}, std::vector<int64_t>{2, 0, 16}}) {
      Linear fc(opts(16, 8).delay_wgrad_compute(delay));
      torch::Tensor w_ref = ref_param(fc->weight);
      torch::Tensor b_ref = ref_param(fc->bias);
      torch::Tensor x = torch::randn(shape).requires_grad_();
      torch::Tensor x_ref = ref_param(x);
      torch::Tensor y = fc(x);
      torch::Tensor y_ref = F::linear(x_ref, w_ref, b_ref);
      EXPECT_EQ(y.sizes(), y_ref.sizes());
      y.sum().backward();
      y_ref.sum().backward();
      fc->backward_dw();
      EXPECT_TRUE(Bitwise(x.grad(), x_ref.grad()));
      EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
      EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tying, reuse, micro-batches, existing gradients

struct TieCase {
  bool delay1;
  bool delay2;
};

void PrintTo(const TieCase& c, std::ostream* os) {
  *os << "{delay1 " << c.delay1 << ", delay2 " << c.delay2 << "}";
}

class TiedWeights : public LinearTest, public ::testing::WithParamInterface<TieCase> {};

TEST_P(TiedWeights, TwoLayersShareAWeightBitwise) {
  // y = fc2(tanh(fc1(x))) with fc2's weight tied to fc1's. Two contributions to the weight: a sum
  // of two terms is the same in either order, so the result is bitwise plain autograd's.
  Linear fc1(opts(16, 16).delay_wgrad_compute(GetParam().delay1).name("fc1"));
  Linear fc2(opts(16, 16).delay_wgrad_compute(GetParam().delay2).name("fc2"));
  fc2->tie_weight(fc1->weight);
  ASSERT_TRUE(fc2->weight.is_same(fc1->weight));
  ASSERT_TRUE(fc2->named_parameters()["weight"].is_same(fc1->weight));
  torch::Tensor w_ref = ref_param(fc1->weight);
  torch::Tensor b1_ref = ref_param(fc1->bias);
  torch::Tensor b2_ref = ref_param(fc2->bias);

  torch::Tensor x = torch::randn({12, 16});
  torch::Tensor g = torch::randn({12, 16});
  (fc2(torch::tanh(fc1(x))) * g).sum().backward();
  (F::linear(torch::tanh(F::linear(x, w_ref, b1_ref)), w_ref, b2_ref) * g).sum().backward();
  EXPECT_EQ(fc1->pending_wgrads(), GetParam().delay1 ? 1 : 0);
  EXPECT_EQ(fc2->pending_wgrads(), GetParam().delay2 ? 1 : 0);
  fc2->backward_dw();
  fc1->backward_dw();
  EXPECT_TRUE(Bitwise(fc1->weight.grad(), w_ref.grad()));
  EXPECT_TRUE(Bitwise(fc1->bias.grad(), b1_ref.grad()));
  EXPECT_TRUE(Bitwise(fc2->bias.grad(), b2_ref.grad()));
}

INSTANTIATE_TEST_SUITE_P(DelayFlags, TiedWeights,
                         ::testing::Values(TieCase{true, false}, TieCase{false, true},
                                           TieCase{true, true}, TieCase{false, false}),
                         [](const ::testing::TestParamInfo<TieCase>& info) {
                           return std::string(info.param.delay1 ? "Delayed" : "Regular") +
                                  (info.param.delay2 ? "Delayed" : "Regular");
                         });

TEST_F(LinearTest, TiedWeightAndBiasWithOrdinaryAutogradUsers) {
  // The shared weight and bias also feed an ordinary F::linear call and a regulariser: four
  // contributions to the weight, whose sum autograd and splitgrad associate differently.
  Linear fc1(opts(16, 16).delay_wgrad_compute(true));
  Linear fc2(opts(16, 16).delay_wgrad_compute(false));
  Linear fc3(opts(16, 16).delay_wgrad_compute(true));
  fc2->tie_weight(fc1->weight);
  fc3->tie_weight(fc1->weight);
  fc3->tie_bias(fc1->bias);
  torch::Tensor w = fc1->weight;
  torch::Tensor w_ref = ref_param(w);
  torch::Tensor b1_ref = ref_param(fc1->bias);
  torch::Tensor b2_ref = ref_param(fc2->bias);

  auto model = [](const torch::Tensor& x, const std::function<torch::Tensor(torch::Tensor)>& l1,
                  const std::function<torch::Tensor(torch::Tensor)>& l2,
                  const std::function<torch::Tensor(torch::Tensor)>& l3,
                  const torch::Tensor& weight) {
    torch::Tensor h = torch::tanh(l1(x));
    torch::Tensor extra = F::linear(h, weight);  // an ordinary user of the tied weight
    return (l3(torch::tanh(l2(h) + extra))).square().mean() + 1e-2 * weight.square().sum();
  };
  torch::Tensor x = torch::randn({12, 16});
  model(
      x, [&](torch::Tensor t) { return fc1(t); }, [&](torch::Tensor t) { return fc2(t); },
      [&](torch::Tensor t) { return fc3(t); }, w)
      .backward();
  model(
      x, [&](torch::Tensor t) { return F::linear(t, w_ref, b1_ref); },
      [&](torch::Tensor t) { return F::linear(t, w_ref, b2_ref); },
      [&](torch::Tensor t) { return F::linear(t, w_ref, b1_ref); }, w_ref)
      .backward();
  EXPECT_TRUE(w.grad().defined()) << "the ordinary users' contributions landed at once";
  splitgrad::backward_dw_all();
  EXPECT_TRUE(Close(w.grad(), w_ref.grad(), kReassocRtol, kReassocAtol));
  EXPECT_TRUE(Close(fc1->bias.grad(), b1_ref.grad(), kReassocRtol, kReassocAtol));
  EXPECT_TRUE(Bitwise(fc2->bias.grad(), b2_ref.grad()));
}

TEST_F(LinearTest, TieChecksShapes) {
  Linear fc1(opts(16, 8).name("fc_a"));
  Linear fc2(opts(8, 16).name("fc_b"));
  Linear no_bias(opts(16, 8).bias(false).name("fc_nobias"));
  std::string msg = error_message([&] { fc2->tie_weight(fc1->weight); });
  EXPECT_CONTAINS(msg, "fc_b");
  EXPECT_CONTAINS(msg, "[16, 8]");
  EXPECT_CONTAINS(msg, "[8, 16]");
  msg = error_message([&] { no_bias->tie_bias(fc1->bias); });
  EXPECT_CONTAINS(msg, "fc_nobias");
  msg = error_message([&] { fc2->tie_bias(fc1->bias); });
  EXPECT_CONTAINS(msg, "[16]");
  EXPECT_CONTAINS(msg, "[8]");
}

TEST_F(LinearTest, LayerAppliedTwiceInOneForward) {
  for (bool delay : {false, true}) {
    Linear fc(opts(16, 16).delay_wgrad_compute(delay).name("reused"));
    torch::Tensor w_ref = ref_param(fc->weight);
    torch::Tensor b_ref = ref_param(fc->bias);
    torch::Tensor x = torch::randn({7, 16}).requires_grad_();
    torch::Tensor x_ref = ref_param(x);
    torch::Tensor g = torch::randn({7, 16});
    (fc(torch::tanh(fc(x))) * g).sum().backward();
    (F::linear(torch::tanh(F::linear(x_ref, w_ref, b_ref)), w_ref, b_ref) * g).sum().backward();
    EXPECT_TRUE(Bitwise(x.grad(), x_ref.grad()));
    EXPECT_EQ(fc->pending_wgrads(), delay ? 2 : 0) << "one item per application";
    fc->backward_dw();  // runs both items of the pass
    EXPECT_EQ(fc->pending_wgrads(), 0);
    EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
    EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));
    if (delay) {
      EXPECT_THROW(fc->backward_dw(), c10::Error) << "both applications ran in one call";
    }
  }
}

// A micro-batch schedule: "F<i>" forward of micro-batch i, "B<i>" its backward, "W" one
// backward_dw() of every layer (each runs its oldest pending pass), "A" backward_dw_all().
struct ScheduleCase {
  std::string schedule;
  bool fc2_delay;
};

void PrintTo(const ScheduleCase& c, std::ostream* os) {
  *os << "\"" << c.schedule << "\"" << (c.fc2_delay ? "" : ", fc2 regular");
}

class MicroBatches : public LinearTest, public ::testing::WithParamInterface<ScheduleCase> {};

TEST_P(MicroBatches, AnyInterleavingMatchesAutogradBitwise) {
  // Gradients of successive backward passes are added in the order the passes ran, on both sides
  // (backward_dw runs a layer's oldest pass first), so the sums agree bit for bit.
  Linear fc1(opts(16, 32).delay_wgrad_compute(true).name("fc1"));
  Linear fc2(opts(32, 8).delay_wgrad_compute(GetParam().fc2_delay).name("fc2"));
  torch::Tensor w1_ref = ref_param(fc1->weight), b1_ref = ref_param(fc1->bias);
  torch::Tensor w2_ref = ref_param(fc2->weight), b2_ref = ref_param(fc2->bias);

  constexpr int kMicroBatches = 3;
  std::vector<torch::Tensor> xs, gs, losses(kMicroBatches);
  for (int i = 0; i < kMicroBatches; ++i) {
    xs.push_back(torch::randn({5, 16}).requires_grad_());
    gs.push_back(torch::randn({5, 8}));
  }
  std::vector<int> backward_order;
  std::istringstream steps(GetParam().schedule);
  for (std::string step; steps >> step;) {
    if (step[0] == 'F') {
      const int i = step[1] - '0';
      losses[i] = (fc2(torch::relu(fc1(xs[i]))) * gs[i]).sum();
    } else if (step[0] == 'B') {
      const int i = step[1] - '0';
      losses[i].backward();
      backward_order.push_back(i);
    } else if (step == "W") {
      fc2->backward_dw();
      fc1->backward_dw();
    } else {
      ASSERT_EQ(step, "A") << "unknown step";
      splitgrad::backward_dw_all();
    }
  }
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);

  // The reference runs the backward passes in the same order.
  for (int i : backward_order) {
    torch::Tensor x_ref = ref_param(xs[i]);
    (F::linear(torch::relu(F::linear(x_ref, w1_ref, b1_ref)), w2_ref, b2_ref) * gs[i])
        .sum()
        .backward();
    EXPECT_TRUE(Bitwise(xs[i].grad(), x_ref.grad())) << "micro-batch " << i;
  }
  EXPECT_TRUE(Bitwise(fc1->weight.grad(), w1_ref.grad()));
  EXPECT_TRUE(Bitwise(fc1->bias.grad(), b1_ref.grad()));
  EXPECT_TRUE(Bitwise(fc2->weight.grad(), w2_ref.grad()));
  EXPECT_TRUE(Bitwise(fc2->bias.grad(), b2_ref.grad()));
}

INSTANTIATE_TEST_SUITE_P(Schedules, MicroBatches,
                         ::testing::Values(ScheduleCase{"F0 F1 F2 B0 B1 B2 W W W", true},
                                           ScheduleCase{"F0 B0 F1 W B1 F2 W B2 W", true},
                                           ScheduleCase{"F0 F1 B1 F2 B0 W B2 W W", true},
                                           ScheduleCase{"F0 F1 F2 B2 B1 B0 A", true},
                                           ScheduleCase{"F0 B0 W F1 B1 W F2 B2 W", false},
                                           ScheduleCase{"F0 F1 B0 F2 B1 W B2 W W", false}),
                         [](const ::testing::TestParamInfo<ScheduleCase>& info) {
                           return "Schedule" + std::to_string(info.index) +
                                  (info.param.fc2_delay ? "" : "Fc2Regular");
                         });

TEST_F(LinearTest, ExistingGradIsAddedTo) {
  for (bool delay : {false, true}) {
    Linear fc(opts(16, 8).delay_wgrad_compute(delay));
    torch::Tensor w_ref = ref_param(fc->weight);
    torch::Tensor b_ref = ref_param(fc->bias);
    torch::Tensor w_grad0 = torch::randn({8, 16});
    torch::Tensor b_grad0 = torch::randn({8});
    fc->weight.mutable_grad() = w_grad0.clone();
    fc->bias.mutable_grad() = b_grad0.clone();
    w_ref.mutable_grad() = w_grad0.clone();
    b_ref.mutable_grad() = b_grad0.clone();
    const void* w_grad_storage = fc->weight.grad().data_ptr();

    torch::Tensor x = torch::randn({10, 16});
    torch::Tensor g = torch::randn({10, 8});
    (fc(x) * g).sum().backward();
    (F::linear(x, w_ref, b_ref) * g).sum().backward();
    fc->backward_dw();
    // One new term added to the old value: the same single addition on both sides.
    EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
    EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));
    EXPECT_FALSE(torch::equal(fc->weight.grad(), w_grad0)) << "added to, not left alone";
    if (delay) {
      EXPECT_EQ(fc->weight.grad().data_ptr(), w_grad_storage) << "accumulated in place";
    }
  }
}

TEST_F(LinearTest, ExistingGradWithReuseAndMicroBatches) {
  // An existing .grad plus two applications in each of two micro-batches: autograd adds each
  // pass's sum to .grad, backward_dw adds the items one by one, so only the association differs.
  Linear fc(opts(16, 16).delay_wgrad_compute(true));
  torch::Tensor w_ref = ref_param(fc->weight);
  torch::Tensor b_ref = ref_param(fc->bias);
  torch::Tensor w_grad0 = torch::randn({16, 16});
  fc->weight.mutable_grad() = w_grad0.clone();
  w_ref.mutable_grad() = w_grad0.clone();
  for (int mb = 0; mb < 2; ++mb) {
    torch::Tensor x = torch::randn({6, 16});
    fc(torch::tanh(fc(x))).square().sum().backward();
    F::linear(torch::tanh(F::linear(x, w_ref, b_ref)), w_ref, b_ref).square().sum().backward();
  }
  fc->backward_dw();
  fc->backward_dw();
  EXPECT_TRUE(Close(fc->weight.grad(), w_ref.grad(), kReassocRtol, kReassocAtol));
  EXPECT_TRUE(Close(fc->bias.grad(), b_ref.grad(), kReassocRtol, kReassocAtol));
}

TEST_F(LinearTest, BackwardDwOfANamedPassInAnyOrder) {
  // A pipeline's W steps name their micro-batch: run the newer pass first, then the older one.
  Linear fc(opts(16, 16).delay_wgrad_compute(true));
  torch::Tensor w_ref = ref_param(fc->weight);
  torch::Tensor b_ref = ref_param(fc->bias);
  std::vector<torch::Tensor> xs = {torch::randn({5, 16}), torch::randn({7, 16})};
  for (const auto& x : xs) fc(x).square().sum().backward();
  const std::vector<int64_t> passes = fc->pending_passes();
  ASSERT_EQ(passes.size(), 2u);
  EXPECT_NE(passes[0], passes[1]);
  fc->backward_dw(passes[1]);
  EXPECT_EQ(fc->pending_passes(), std::vector<int64_t>({passes[0]}));
  // the newer micro-batch's gradient alone, bit for bit
  F::linear(xs[1], w_ref, b_ref).square().sum().backward();
  EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
  EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));

  std::string msg = error_message([&] { fc->backward_dw(passes[1]); });
  EXPECT_CONTAINS(msg, "backward_dw(pass=" + std::to_string(passes[1]) + ")");
  EXPECT_CONTAINS(msg, "passes pending: " + std::to_string(passes[0]));
  EXPECT_EQ(fc->pending_wgrads(), 1) << "a failed call takes nothing";

  fc->backward_dw(passes[0]);
  F::linear(xs[0], w_ref, b_ref).square().sum().backward();
  EXPECT_TRUE(Close(fc->weight.grad(), w_ref.grad(), kReassocRtol, kReassocAtol));
  EXPECT_TRUE(Close(fc->bias.grad(), b_ref.grad(), kReassocRtol, kReassocAtol));
  EXPECT_TRUE(fc->pending_passes().empty());
}

TEST_F(LinearTest, RetainedGraphBackwardTwice) {
  // Two backward passes over one graph queue one item each.
  Linear fc(opts(16, 8).delay_wgrad_compute(true));
  torch::Tensor w_ref = ref_param(fc->weight);
  torch::Tensor b_ref = ref_param(fc->bias);
  torch::Tensor x = torch::randn({5, 16});
  torch::Tensor y = fc(x);
  torch::Tensor y_ref = F::linear(x, w_ref, b_ref);
  torch::Tensor g = torch::randn({5, 8});
  y.backward(g, /*retain_graph=*/true);
  y.backward(g);
  y_ref.backward(g, /*retain_graph=*/true);
  y_ref.backward(g);
  EXPECT_EQ(fc->pending_wgrads(), 2);
  fc->backward_dw();
  EXPECT_EQ(fc->pending_wgrads(), 1) << "one pass per backward_dw()";
  fc->backward_dw();
  EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
  EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));
}

TEST_F(LinearTest, InputGradientsOnlyPassQueuesNothing) {
  // autograd::grad for the input alone writes no parameter's .grad in plain autograd: a delayed
  // layer queues nothing (a pipeline's B step runs a full backward, see splitgrad.pipelining).
  Linear fc1(opts(16, 16).delay_wgrad_compute(true));
  Linear fc2(opts(16, 8).delay_wgrad_compute(true));
  torch::Tensor w1_ref = ref_param(fc1->weight), b1_ref = ref_param(fc1->bias);
  torch::Tensor w2_ref = ref_param(fc2->weight), b2_ref = ref_param(fc2->bias);
  torch::Tensor x = torch::randn({5, 16}).requires_grad_();
  torch::Tensor x_ref = ref_param(x);
  torch::Tensor dx = torch::autograd::grad({fc2(torch::tanh(fc1(x))).sum()}, {x})[0];
  F::linear(torch::tanh(F::linear(x_ref, w1_ref, b1_ref)), w2_ref, b2_ref).sum().backward();
  EXPECT_TRUE(Bitwise(dx, x_ref.grad()));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  EXPECT_FALSE(fc1->weight.grad().defined());
  // Asked for the parameters, autograd::grad gets them at once, as from plain autograd.
  auto grads = torch::autograd::grad({fc2(torch::tanh(fc1(x))).sum()}, {fc1->weight, fc2->bias});
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  EXPECT_TRUE(Bitwise(grads[0], w1_ref.grad()));
  EXPECT_TRUE(Bitwise(grads[1], b2_ref.grad()));
  EXPECT_FALSE(fc1->weight.grad().defined());
}

TEST_F(LinearTest, NonLeafWeightGradientReachesItsSource) {
  // A computed weight given to the op (tie_weight refuses one): its gradient flows on through
  // autograd to the tensor it was computed from, computed at once even on a delayed layer.
  for (bool delay : {false, true}) {
    splitgrad::LayerHandle layer("computed weight");
    torch::Tensor source = torch::randn({8, 16}).requires_grad_(true);
    torch::Tensor bias = torch::randn({8}).requires_grad_(true);
    torch::Tensor source_ref = ref_param(source);
    torch::Tensor b_ref = ref_param(bias);
    torch::Tensor x = torch::randn({5, 16});
    splitgrad::ops::linear(x, source * 2, bias, std::nullopt, std::nullopt, layer.id(), delay)
        .pow(2)
        .sum()
        .backward();
    F::linear(x, source_ref * 2, b_ref).pow(2).sum().backward();
    EXPECT_EQ(layer.pending(), delay ? 1 : 0);  // the bias, a leaf, is deferred
    if (delay) layer.backward_dw();
    ASSERT_TRUE(source.grad().defined());
    EXPECT_TRUE(Bitwise(source.grad(), source_ref.grad()));
    EXPECT_TRUE(Bitwise(bias.grad(), b_ref.grad()));
  }
}

TEST_F(LinearTest, FrozenWeightTrainableBias) {
  for (bool delay : {false, true}) {
    for (bool fused : {false, true}) {
      Linear fc(opts(16, 8).delay_wgrad_compute(delay).fuse_wgrad_accumulation(fused));
      fc->weight.requires_grad_(false);
      torch::Tensor b_main = torch::zeros({8});
      if (fused) splitgrad::set_main_grad(fc->bias, b_main);
      torch::Tensor b_ref = ref_param(fc->bias);
      torch::Tensor x = torch::randn({5, 16});
      torch::Tensor g = torch::randn({5, 8});
      (fc(x) * g).sum().backward();
      (F::linear(x, fc->weight.detach(), b_ref) * g).sum().backward();
      EXPECT_EQ(fc->pending_wgrads(), delay ? 1 : 0);
      fc->backward_dw();
      EXPECT_FALSE(fc->weight.grad().defined());
      if (fused) {
        EXPECT_FALSE(fc->bias.grad().defined());
        EXPECT_TRUE(Close(b_main, b_ref.grad(), kReassocRtol, kReassocAtol));
      } else {
        EXPECT_TRUE(Bitwise(fc->bias.grad(), b_ref.grad()));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fuse_wgrad_accumulation: main_grad

TEST_F(LinearTest, FusedMainGradAccumulates) {
  for (bool delay : {false, true}) {
    Linear fc(opts(16, 8).delay_wgrad_compute(delay).fuse_wgrad_accumulation(true));
    torch::Tensor w_ref = ref_param(fc->weight);
    torch::Tensor b_ref = ref_param(fc->bias);
    // main_grad already holds a value: it is added to.
    torch::Tensor w_main = torch::randn({8, 16});
    torch::Tensor b_main = torch::randn({8});
    w_ref.mutable_grad() = w_main.clone();
    b_ref.mutable_grad() = b_main.clone();
    splitgrad::set_main_grad(fc->weight, w_main);
    splitgrad::set_main_grad(fc->bias, b_main);
    EXPECT_TRUE(splitgrad::main_grad(fc->weight).is_same(w_main));

    std::vector<const c10::TensorImpl*> accumulated;
    splitgrad::set_main_grad_accumulated_callback(
        [&](const at::Tensor& param) { accumulated.push_back(param.unsafeGetTensorImpl()); });
    for (int mb = 0; mb < 2; ++mb) {
      torch::Tensor x = torch::randn({3, 5, 16});
      torch::Tensor g = torch::randn({3, 5, 8});
      (fc(x) * g).sum().backward();
      (F::linear(x, w_ref, b_ref) * g).sum().backward();
    }
    fc->backward_dw();
    fc->backward_dw();
    splitgrad::set_main_grad_accumulated_callback({});

    EXPECT_FALSE(fc->weight.grad().defined()) << "main_grad, not .grad";
    EXPECT_FALSE(fc->bias.grad().defined());
    // The GEMM adds into main_grad (beta = 1): rounding may differ from a separate addition.
    EXPECT_TRUE(Close(w_main, w_ref.grad(), kReassocRtol, kReassocAtol));
    EXPECT_TRUE(Close(b_main, b_ref.grad(), kReassocRtol, kReassocAtol));
    const std::vector<const c10::TensorImpl*> expected = {
        fc->weight.unsafeGetTensorImpl(), fc->bias.unsafeGetTensorImpl(),
        fc->weight.unsafeGetTensorImpl(), fc->bias.unsafeGetTensorImpl()};
    EXPECT_EQ(accumulated, expected) << "the callback hears of each accumulation";
    splitgrad::set_main_grad(fc->weight, {});
    EXPECT_FALSE(splitgrad::main_grad(fc->weight).defined());
  }
}

// Anomaly detection stops plain autograd before AccumulateGrad adds a nan gradient: a deferred
// item that brings one is reported, and its main_grads are put back and not announced.
TEST_F(LinearTest, AnomalyModeNanLeavesMainGradAsBeforeAndUnannounced) {
  Linear fc(opts(16, 8).delay_wgrad_compute(true).fuse_wgrad_accumulation(true).name("fc_nan"));
  const torch::Tensor w_main = torch::randn({8, 16}), b_main = torch::randn({8});
  splitgrad::set_main_grad(fc->weight, w_main);
  splitgrad::set_main_grad(fc->bias, b_main);
  const torch::Tensor w_before = w_main.clone(), b_before = b_main.clone();
  std::vector<const c10::TensorImpl*> accumulated;
  splitgrad::set_main_grad_accumulated_callback(
      [&](const at::Tensor& param) { accumulated.push_back(param.unsafeGetTensorImpl()); });
  std::string msg;
  {
    torch::autograd::DetectAnomalyGuard anomaly(/*check_nan=*/true);
    torch::Tensor x = torch::randn({4, 16});
    x[1][3] = std::numeric_limits<float>::quiet_NaN();  // masked in the output: dW alone sees it
    fc(x).nan_to_num(0.0).sum().backward();
    msg = error_message([&] { fc->backward_dw(); });
  }
  splitgrad::set_main_grad_accumulated_callback({});
  EXPECT_CONTAINS(msg, "fc_nan");
  EXPECT_CONTAINS(msg, "brought nan values into weight's main_grad");
  EXPECT_TRUE(torch::equal(w_main, w_before)) << "put back as it was";
  EXPECT_TRUE(torch::equal(b_main, b_before));
  EXPECT_TRUE(accumulated.empty()) << "nothing landed, nothing announced";
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  splitgrad::set_main_grad(fc->weight, {});
  splitgrad::set_main_grad(fc->bias, {});
}

TEST_F(LinearTest, FusedMainGradBf16AccumulatesInFp32) {
  Linear fc(opts(32, 16)
                .params_dtype(torch::kBFloat16)
                .delay_wgrad_compute(true)
                .fuse_wgrad_accumulation(true));
  torch::Tensor w_main = torch::zeros({16, 32});
  torch::Tensor b_main = torch::zeros({16});
  splitgrad::set_main_grad(fc->weight, w_main);
  splitgrad::set_main_grad(fc->bias, b_main);
  torch::Tensor x = torch::randn({64, 32}).to(torch::kBFloat16);
  torch::Tensor g = torch::randn({64, 16}).to(torch::kBFloat16);
  fc(x).backward(g);
  fc->backward_dw();
  // The products of bf16 values are exact in fp32; only the fp32 summation order differs.
  const torch::Tensor dw_fp32 = torch::mm(g.to(torch::kFloat).t(), x.to(torch::kFloat));
  const torch::Tensor db_fp32 = g.to(torch::kFloat).sum(0);
  EXPECT_TRUE(Close(w_main, dw_fp32, 1e-5, 1e-5));
  EXPECT_TRUE(Close(b_main, db_fp32, 1e-5, 1e-5));
}

TEST_F(LinearTest, FusedForwardWithoutGradModeNeedsNoMainGrad) {
  // An eval forward (NoGradGuard) of a fused layer: no backward can follow, so no main_grad is
  // needed and nothing is queued; the output equals F::linear's.
  Linear fc(opts(16, 8).fuse_wgrad_accumulation(true).delay_wgrad_compute(true).name("eval_fc"));
  torch::Tensor x = torch::randn({4, 16});
  torch::NoGradGuard no_grad;
  torch::Tensor y;
  ASSERT_NO_THROW(y = fc(x));
  EXPECT_TRUE(torch::equal(y, torch::nn::functional::linear(x, fc->weight, fc->bias)));
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

TEST_F(LinearTest, FusedMainGradMissingOrWrong) {
  Linear fc(opts(16, 8).fuse_wgrad_accumulation(true).name("fused_fc"));
  torch::Tensor x = torch::randn({4, 16});
  std::string msg = error_message([&] { fc(x); });
  EXPECT_CONTAINS(msg, "fused_fc");
  EXPECT_CONTAINS(msg, "main_grad");
  EXPECT_CONTAINS(msg, "set_main_grad");

  // set_main_grad refuses a wrong buffer (ApiTest.SetMainGradChecksItsArguments); one that
  // changes after it was set is caught by the forward.
  torch::Tensor buffer = torch::zeros({8, 16});
  splitgrad::set_main_grad(fc->weight, buffer);
  splitgrad::set_main_grad(fc->bias, torch::zeros({8}));
  buffer.resize_({16, 8});
  msg = error_message([&] { fc(x); });
  EXPECT_CONTAINS(msg, "fused_fc");
  EXPECT_CONTAINS(msg, "[8, 16]");
  EXPECT_CONTAINS(msg, "[16, 8]");

  splitgrad::set_main_grad(fc->weight, torch::zeros({8, 16}));
  EXPECT_NO_THROW(fc(x).sum().backward());
}

TEST_F(LinearTest, FusedMainGradIsReadInTheBackward) {
  // As Transformer Engine's backward reads main_grad: a buffer set after the forward receives the
  // gradient; one cleared by then is an error in the backward, with nothing queued.
  for (bool delay : {false, true}) {
    Linear fc(opts(16, 8).delay_wgrad_compute(delay).fuse_wgrad_accumulation(true).name("late"));
    torch::Tensor w_ref = ref_param(fc->weight);
    torch::Tensor b_ref = ref_param(fc->bias);
    torch::Tensor w_first = torch::zeros({8, 16}), b_first = torch::zeros({8});
    splitgrad::set_main_grad(fc->weight, w_first);
    splitgrad::set_main_grad(fc->bias, b_first);
    torch::Tensor x = torch::randn({5, 16});
    torch::Tensor g = torch::randn({5, 8});
    torch::Tensor y = fc(x);
    torch::Tensor w_later = torch::zeros({8, 16}), b_later = torch::zeros({8});
    splitgrad::set_main_grad(fc->weight, w_later);
    splitgrad::set_main_grad(fc->bias, b_later);
    y.backward(g);
    if (delay) fc->backward_dw();
    F::linear(x, w_ref, b_ref).backward(g);
    EXPECT_EQ(torch::count_nonzero(w_first).item<int64_t>(), 0);
    EXPECT_EQ(torch::count_nonzero(b_first).item<int64_t>(), 0);
    EXPECT_TRUE(Close(w_later, w_ref.grad(), kReassocRtol, kReassocAtol));
    EXPECT_TRUE(Close(b_later, b_ref.grad(), kReassocRtol, kReassocAtol));

    y = fc(x);
    splitgrad::set_main_grad(fc->weight, {});
    const std::string msg = error_message([&] { y.backward(g); });
    EXPECT_CONTAINS(msg, "late");
    EXPECT_CONTAINS(msg, "weight.main_grad");
    EXPECT_EQ(splitgrad::pending_wgrads(), 0);
    splitgrad::set_main_grad(fc->bias, {});
  }
}

// ---------------------------------------------------------------------------------------------
// Grad-ready hooks

TEST_F(LinearTest, GradReadyHookFiresOnceAfterTheLastBackwardDw) {
  // fc1 and fc2 (both delayed) share a weight; two micro-batches. The weight's hook must fire once
  // per backward pass, when that pass's second contribution lands, and see the complete gradient.
  Linear fc1(opts(16, 16).delay_wgrad_compute(true));
  Linear fc2(opts(16, 16).delay_wgrad_compute(true));
  fc2->tie_weight(fc1->weight);
  torch::Tensor w_ref = ref_param(fc1->weight);
  torch::Tensor b1_ref = ref_param(fc1->bias);
  torch::Tensor b2_ref = ref_param(fc2->bias);

  std::vector<torch::Tensor> weight_seen;  // .grad at each call
  int bias1_calls = 0;
  auto handle = splitgrad::register_grad_ready_hook(fc1->weight, [&](const at::Tensor& p) {
    EXPECT_TRUE(p.is_same(fc1->weight));
    weight_seen.push_back(p.grad().clone());
  });
  EXPECT_TRUE(handle.active());
  fc1->register_wgrad_accumulation_and_reduce_hooks([&](const at::Tensor& p) {
    if (p.is_same(fc1->bias)) ++bias1_calls;
  });

  std::vector<torch::Tensor> ref_after_pass;
  for (int mb = 0; mb < 2; ++mb) {
    torch::Tensor x = torch::randn({6, 16});
    fc2(torch::tanh(fc1(x))).square().sum().backward();
    F::linear(torch::tanh(F::linear(x, w_ref, b1_ref)), w_ref, b2_ref).square().sum().backward();
    ref_after_pass.push_back(w_ref.grad().clone());
  }
  EXPECT_TRUE(weight_seen.empty()) << "all weight contributions are still deferred";

  fc1->backward_dw();  // pass 0: fc1's item
  EXPECT_TRUE(weight_seen.empty()) << "fc2 still owes pass 0 a contribution";
  EXPECT_EQ(bias1_calls, 1) << "fc1's bias is complete for pass 0";
  fc2->backward_dw();  // pass 0: fc2's item, the last one
  ASSERT_EQ(weight_seen.size(), 1u);
  EXPECT_TRUE(Bitwise(weight_seen[0], ref_after_pass[0]));
  fc2->backward_dw();  // pass 1: fc2's item
  EXPECT_EQ(weight_seen.size(), 1u);
  fc1->backward_dw();  // pass 1: fc1's item, the last one
  ASSERT_EQ(weight_seen.size(), 2u);
  EXPECT_EQ(bias1_calls, 2);
  // Pass 0's gradient plus pass 1's two items, added one by one: association differs.
  EXPECT_TRUE(Close(weight_seen[1], ref_after_pass[1], kReassocRtol, kReassocAtol));

  handle.remove();
  EXPECT_FALSE(handle.active());
  handle.remove();  // idempotent
  fc2(fc1(torch::randn({2, 16}))).sum().backward();
  fc1->backward_dw();
  fc2->backward_dw();
  EXPECT_EQ(weight_seen.size(), 2u) << "removed";
  EXPECT_EQ(bias1_calls, 3) << "the layer's own hook stays";
}

TEST_F(LinearTest, ReduceHooksFollowReTying) {
  // Registered before tie_weight(): the hooks move to the tied weight (as the Python modules'),
  // and fire once per pass after its last contribution; the untied old weight gets none.
  Linear a(opts(16, 16).delay_wgrad_compute(true).name("a"));
  Linear b(opts(16, 16).delay_wgrad_compute(true).name("b"));
  std::vector<const c10::TensorImpl*> seen;
  b->register_wgrad_accumulation_and_reduce_hooks(
      [&](const at::Tensor& p) { seen.push_back(p.unsafeGetTensorImpl()); });
  const torch::Tensor old_weight = b->weight;
  b->tie_weight(a->weight);
  b(torch::tanh(a(torch::randn({4, 16})))).sum().backward();
  b->backward_dw();
  EXPECT_EQ(std::count(seen.begin(), seen.end(), a->weight.unsafeGetTensorImpl()), 0)
      << "a still owes the tied weight its contribution";
  a->backward_dw();
  EXPECT_EQ(std::count(seen.begin(), seen.end(), a->weight.unsafeGetTensorImpl()), 1);
  EXPECT_EQ(std::count(seen.begin(), seen.end(), b->bias.unsafeGetTensorImpl()), 1);
  EXPECT_EQ(std::count(seen.begin(), seen.end(), old_weight.unsafeGetTensorImpl()), 0);
  EXPECT_EQ(seen.size(), 2u);
  // A clone has hooks of its own only.
  auto copy = std::dynamic_pointer_cast<splitgrad::LinearImpl>(b->clone());
  seen.clear();
  copy->forward(torch::randn({4, 16})).sum().backward();
  copy->backward_dw();
  EXPECT_TRUE(seen.empty());
}

TEST_F(LinearTest, GradReadyHookWithRegularAndDelayedUsers) {
  // A regular layer's contribution lands in autograd (AccumulateGrad); a delayed one's in
  // backward_dw(). The hook waits for both; for a regular-only pass it fires at the end of
  // backward.
  Linear regular(opts(16, 16).name("regular"));
  Linear delayed(opts(16, 16).delay_wgrad_compute(true).name("delayed"));
  delayed->tie_weight(regular->weight);
  torch::Tensor w_ref = ref_param(regular->weight);
  torch::Tensor b_r_ref = ref_param(regular->bias);
  torch::Tensor b_d_ref = ref_param(delayed->bias);
  std::vector<torch::Tensor> seen;
  splitgrad::register_grad_ready_hook(
      regular->weight, [&](const at::Tensor& p) { seen.push_back(p.grad().clone()); });

  torch::Tensor x = torch::randn({6, 16});
  delayed(torch::tanh(regular(x))).sum().backward();
  F::linear(torch::tanh(F::linear(x, w_ref, b_r_ref)), w_ref, b_d_ref).sum().backward();
  EXPECT_TRUE(seen.empty()) << "the delayed layer still owes its contribution";
  delayed->backward_dw();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(Bitwise(seen[0], w_ref.grad()));

  // A pass through the regular layer alone: the hook fires when backward ends, grad complete.
  regular(x).sum().backward();
  F::linear(x, w_ref, b_r_ref).sum().backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(Bitwise(seen[1], w_ref.grad()));
}

TEST_F(LinearTest, LayerHooksOnALayerWithoutBias) {
  Linear fc(opts(16, 8).bias(false).delay_wgrad_compute(true));
  int calls = 0;
  fc->register_wgrad_accumulation_and_reduce_hooks([&](const at::Tensor& p) {
    EXPECT_TRUE(p.is_same(fc->weight));
    ++calls;
  });
  fc(torch::randn({3, 16})).sum().backward();
  fc->backward_dw();
  EXPECT_EQ(calls, 1);
}

TEST_F(LinearTest, AThrowingGradReadyHookLosesNoGradient) {
  // A reducer hook that throws during backward_dw_all(): the error reaches the caller, and the
  // deferred work not run yet stays queued instead of being lost.
  Linear fc_a(opts(16, 16).delay_wgrad_compute(true).name("a"));
  Linear fc_b(opts(16, 16).delay_wgrad_compute(true).name("b"));
  torch::Tensor wa_ref = ref_param(fc_a->weight), ba_ref = ref_param(fc_a->bias);
  torch::Tensor wb_ref = ref_param(fc_b->weight), bb_ref = ref_param(fc_b->bias);
  bool thrown = false;
  splitgrad::register_grad_ready_hook(fc_b->weight, [&](const at::Tensor&) {
    if (!thrown) {
      thrown = true;
      throw std::runtime_error("reducer failed");
    }
  });
  torch::Tensor x = torch::randn({5, 16});
  fc_b(torch::tanh(fc_a(x))).sum().backward();
  F::linear(torch::tanh(F::linear(x, wa_ref, ba_ref)), wb_ref, bb_ref).sum().backward();
  // fc_b's item was queued first (its backward ran first), so it runs first and its hook throws.
  EXPECT_THROW(splitgrad::backward_dw_all(), std::runtime_error);
  EXPECT_TRUE(Bitwise(fc_b->weight.grad(), wb_ref.grad()));
  EXPECT_TRUE(Bitwise(fc_b->bias.grad(), bb_ref.grad())) << "the item's other target landed";
  EXPECT_EQ(splitgrad::pending_wgrads(), 1) << "fc_a's item is still queued";
  splitgrad::backward_dw_all();
  EXPECT_TRUE(Bitwise(fc_a->weight.grad(), wa_ref.grad()));
  EXPECT_TRUE(Bitwise(fc_a->bias.grad(), ba_ref.grad()));
}

// A reentrant checkpoint (Megatron's CheckpointFunction): the forward runs without a graph; the
// backward recomputes it and runs a nested backward pass, i.e. a graph task of its own.
struct ReentrantCheckpoint : public torch::autograd::Function<ReentrantCheckpoint> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const std::shared_ptr<LinearImpl>& layer) {
    ctx->save_for_backward({x});
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer.get());
    torch::NoGradGuard no_grad;
    return layer->forward(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* layer = reinterpret_cast<LinearImpl*>(ctx->saved_data["layer"].toInt());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_();
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = layer->forward(x);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor()};
  }
};

// KNOWN LIMITATION (reported, not fixed): the ledger counts a pass per autograd graph task, and a
// reentrant backward (checkpointing with use_reentrant=True, Megatron's CheckpointFunction) is a
// nested graph task. A parameter used both inside and outside the checkpointed region gets two
// "passes" in one backward step, so its grad-ready hook fires twice, the first time before the
// outer contribution has landed. Fixing it needs the ledger to map a nested graph task to the
// outermost one running on the thread.
TEST_F(LinearTest, DISABLED_GradReadyHookOncePerStepWithReentrantCheckpoint) {
  Linear inner(opts(16, 16).name("inner"));
  Linear outer(opts(16, 16).name("outer"));
  outer->tie_weight(inner->weight);
  std::vector<torch::Tensor> seen;
  splitgrad::register_grad_ready_hook(
      inner->weight, [&](const at::Tensor& p) { seen.push_back(p.grad().clone()); });
  torch::Tensor x = torch::randn({4, 16}).requires_grad_();
  outer(ReentrantCheckpoint::apply(x, inner.ptr())).sum().backward();
  ASSERT_EQ(seen.size(), 1u) << "fired once per reentrant graph task instead of once per step";
  EXPECT_TRUE(Bitwise(seen[0], inner->weight.grad()));
}

TEST_F(LinearTest, GradReadyHookRejectsNonParameters) {
  torch::Tensor leaf_no_grad = torch::zeros({2});
  torch::Tensor non_leaf = torch::zeros({2}, torch::requires_grad()) * 2;
  EXPECT_THROW(splitgrad::register_grad_ready_hook(leaf_no_grad, [](const at::Tensor&) {}),
               c10::Error);
  EXPECT_THROW(splitgrad::register_grad_ready_hook(non_leaf, [](const at::Tensor&) {}), c10::Error);
  EXPECT_THROW(splitgrad::register_grad_ready_hook(torch::Tensor(), [](const at::Tensor&) {}),
               c10::Error);
}

// ---------------------------------------------------------------------------------------------
// Misuse: clear errors, nothing lost

TEST_F(LinearTest, BackwardDwWithNothingPendingNamesTheLayer) {
  Linear named(opts(16, 8).delay_wgrad_compute(true).name("proj_out"));
  EXPECT_THROW(named->backward_dw(), c10::Error);
  std::string msg = error_message([&] { named->backward_dw(); });
  EXPECT_CONTAINS(msg, "proj_out");
  EXPECT_CONTAINS(msg, "no backward pass has queued");

  named(torch::randn({2, 16}));  // a forward alone queues nothing
  msg = error_message([&] { named->backward_dw(); });
  EXPECT_CONTAINS(msg, "proj_out");

  Linear unnamed(opts(16, 8).delay_wgrad_compute(true));
  msg = error_message([&] { unnamed->backward_dw(); });
  EXPECT_CONTAINS(msg, "Linear(16, 8)#");

  Linear regular(opts(16, 8));
  EXPECT_NO_THROW(regular->backward_dw()) << "a regular layer's backward_dw() does nothing";
}

TEST_F(LinearTest, WrongInputShapeOrDtype) {
  Linear fc(opts(16, 8).name("fc_in16"));
  std::string msg = error_message([&] { fc(torch::randn({4, 12})); });
  EXPECT_CONTAINS(msg, "fc_in16");
  EXPECT_CONTAINS(msg, "[*, 16]");
  EXPECT_CONTAINS(msg, "[4, 12]");
  msg = error_message([&] { fc(torch::randn({2, 3, 12})); });
  EXPECT_CONTAINS(msg, "[2, 3, 12]");
  msg = error_message([&] { fc(torch::randn({4, 16}, torch::kDouble)); });
  EXPECT_CONTAINS(msg, "fc_in16");
  EXPECT_CONTAINS(msg, "torch.float32");
  EXPECT_CONTAINS(msg, "torch.float64");
}

TEST_F(LinearTest, InPlaceChangeOfStashedInputIsAnErrorAndTheStoreStaysUsable) {
  Linear fc(opts(16, 8).delay_wgrad_compute(true).name("stash_fc"));
  int hook_calls = 0;
  fc->register_wgrad_accumulation_and_reduce_hooks([&](const at::Tensor&) { ++hook_calls; });
  torch::Tensor x = torch::randn({5, 16});
  fc(x).sum().backward();
  x.add_(1.0);  // changes the stashed activation
  const std::string msg = error_message([&] { fc->backward_dw(); });
  EXPECT_CONTAINS(msg, "stash_fc");
  EXPECT_CONTAINS(msg, "input");
  EXPECT_CONTAINS(msg, "modified in place");
  EXPECT_EQ(fc->pending_wgrads(), 0) << "the failed item is taken off the queue";
  EXPECT_FALSE(fc->weight.grad().defined()) << "no gradient written";
  EXPECT_EQ(hook_calls, 0) << "the pass lost a contribution: its hooks do not fire";

  // The layer and the store keep working.
  torch::Tensor w_ref = ref_param(fc->weight);
  torch::Tensor b_ref = ref_param(fc->bias);
  torch::Tensor x2 = torch::randn({5, 16});
  fc(x2).sum().backward();
  F::linear(x2, w_ref, b_ref).sum().backward();
  fc->backward_dw();
  EXPECT_TRUE(Bitwise(fc->weight.grad(), w_ref.grad()));
  EXPECT_EQ(hook_calls, 2) << "weight and bias, once each";
}

TEST_F(LinearTest, InPlaceChangeOfStashedGradOutputIsAnError) {
  Linear fc(opts(16, 8).delay_wgrad_compute(true).name("stash_dy"));
  torch::Tensor y = fc(torch::randn({5, 16}));
  torch::Tensor g = torch::randn({5, 8});
  y.backward(g);  // the root's gradient reaches the layer's backward as it is
  g.mul_(2.0);
  const std::string msg = error_message([&] { fc->backward_dw(); });
  EXPECT_CONTAINS(msg, "stash_dy");
  EXPECT_CONTAINS(msg, "grad_output");
  EXPECT_EQ(fc->pending_wgrads(), 0);
  EXPECT_FALSE(fc->weight.grad().defined());
}

TEST_F(LinearTest, StaleItemInBackwardDwAllLeavesTheOthersQueued) {
  Linear fc1(opts(16, 8).delay_wgrad_compute(true).name("stale"));
  Linear fc2(opts(16, 8).delay_wgrad_compute(true).name("fresh"));
  torch::Tensor w2_ref = ref_param(fc2->weight);
  torch::Tensor b2_ref = ref_param(fc2->bias);
  torch::Tensor x1 = torch::randn({5, 16});
  torch::Tensor x2 = torch::randn({5, 16});
  fc1(x1).sum().backward();
  fc2(x2).sum().backward();
  F::linear(x2, w2_ref, b2_ref).sum().backward();
  x1.zero_();
  const std::string msg = error_message([] { splitgrad::backward_dw_all(); });
  EXPECT_CONTAINS(msg, "stale");
  EXPECT_EQ(splitgrad::pending_wgrads(), 1) << "the good item is back on the queue";
  EXPECT_EQ(splitgrad::layers_with_pending_wgrads(), std::vector<std::string>({"fresh"}));
  splitgrad::backward_dw_all();
  EXPECT_FALSE(fc1->weight.grad().defined());
  EXPECT_TRUE(Bitwise(fc2->weight.grad(), w2_ref.grad()));
}

TEST_F(LinearTest, PendingWorkIsVisibleByLayerAndParameter) {
  Linear fc1(opts(16, 8).delay_wgrad_compute(true).name("enc"));
  Linear fc2(opts(8, 4).delay_wgrad_compute(true).name("dec"));
  Linear fc3(opts(4, 4).name("head"));
  fc3(fc2(fc1(torch::randn({3, 16})))).sum().backward();
  EXPECT_EQ(splitgrad::pending_wgrads(), 2);
  EXPECT_EQ(splitgrad::layers_with_pending_wgrads(), std::vector<std::string>({"enc", "dec"}));
  EXPECT_EQ(splitgrad::layers_with_pending_wgrads({fc2->bias}), std::vector<std::string>({"dec"}));
  EXPECT_TRUE(splitgrad::layers_with_pending_wgrads({fc3->weight}).empty());
  splitgrad::backward_dw_all();
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  EXPECT_TRUE(splitgrad::layers_with_pending_wgrads().empty());
}

TEST_F(LinearTest, StashedActivationsAreFreedAfterBackwardDw) {
  Linear fc(opts(16, 8).delay_wgrad_compute(true));
  // The item keeps a detached view of the activation (its values): its storage is watched.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> weak;
  {
    torch::Tensor x = torch::randn({5, 16});
    weak.emplace(x.storage().getWeakStorageImpl());
    fc(x).sum().backward();
  }
  EXPECT_FALSE(weak->expired()) << "the deferred item holds the activation";
  fc->backward_dw();
  EXPECT_TRUE(weak->expired()) << "freed as soon as its wgrad ran";
}

class CapturingWarningHandler : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

TEST_F(LinearTest, DeletingALayerWithPendingWorkFreesItAndWarns) {
  CapturingWarningHandler handler;
  c10::WarningUtils::WarningHandlerGuard guard(&handler);
  std::optional<splitgrad::core::WeakTensor> weak;
  int hook_calls = 0;
  torch::Tensor weight;
  {
    Linear fc(opts(16, 8).delay_wgrad_compute(true).name("doomed"));
    weight = fc->weight;
    splitgrad::register_grad_ready_hook(weight, [&](const at::Tensor&) { ++hook_calls; });
    torch::Tensor x = torch::randn({5, 16});
    weak.emplace(x.getIntrusivePtr());
    fc(x).sum().backward();
    EXPECT_EQ(splitgrad::pending_wgrads(), 1);
  }
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  EXPECT_TRUE(weak->expired()) << "the stashed input was freed";
  EXPECT_EQ(hook_calls, 0) << "the dropped contribution leaves that pass incomplete";
  ASSERT_EQ(handler.messages.size(), 1u);
  EXPECT_CONTAINS(handler.messages[0], "doomed");
  EXPECT_CONTAINS(handler.messages[0], "1 deferred wgrad item");
}

// ---------------------------------------------------------------------------------------------
// Low precision, clone, inference

TEST_F(LinearTest, Bf16WithinPyTorchsOwnError) {
  // bf16 results are judged against an fp32 reference computed from the same bf16 values, with an
  // error bound relative to plain bf16 autograd's own error.
  for (bool delay : {false, true}) {
    Linear fc(opts(64, 32).params_dtype(torch::kBFloat16).delay_wgrad_compute(delay));
    ASSERT_EQ(fc->weight.scalar_type(), torch::kBFloat16);
    torch::Tensor w_bf16 = ref_param(fc->weight), b_bf16 = ref_param(fc->bias);
    torch::Tensor w_fp32 = ref_param(fc->weight.to(torch::kFloat));
    torch::Tensor b_fp32 = ref_param(fc->bias.to(torch::kFloat));
    torch::Tensor x = torch::randn({4, 16, 64}).to(torch::kBFloat16).requires_grad_();
    torch::Tensor x_bf16 = ref_param(x), x_fp32 = ref_param(x.to(torch::kFloat));
    torch::Tensor g = torch::randn({4, 16, 32}).to(torch::kBFloat16);

    torch::Tensor y = fc(x);
    y.backward(g);
    fc->backward_dw();
    torch::Tensor y_bf16 = F::linear(x_bf16, w_bf16, b_bf16);
    y_bf16.backward(g);
    torch::Tensor y_fp32 = F::linear(x_fp32, w_fp32, b_fp32);
    y_fp32.backward(g.to(torch::kFloat));

    auto check = [](const char* what, const torch::Tensor& ours, const torch::Tensor& pytorch_bf16,
                    const torch::Tensor& fp32) {
      ASSERT_EQ(ours.scalar_type(), torch::kBFloat16) << what;
      const double ours_err = max_abs_diff(ours, fp32);
      const double pytorch_err = max_abs_diff(pytorch_bf16, fp32);
      const double scale = fp32.abs().max().item<double>();
      EXPECT_LE(ours_err, 2 * pytorch_err + 1e-3 * scale)
          << what << ": splitgrad error " << ours_err << ", PyTorch bf16 error " << pytorch_err;
    };
    check("y", y, y_bf16, y_fp32);
    check("x.grad", x.grad(), x_bf16.grad(), x_fp32.grad());
    check("weight.grad", fc->weight.grad(), w_bf16.grad(), w_fp32.grad());
    check("bias.grad", fc->bias.grad(), b_bf16.grad(), b_fp32.grad());
  }
}

TEST_F(LinearTest, Bf16DelayedEqualsRegularBitwise) {
  Linear regular(opts(64, 32).params_dtype(torch::kBFloat16));
  Linear delayed(opts(64, 32).params_dtype(torch::kBFloat16).delay_wgrad_compute(true));
  {
    torch::NoGradGuard no_grad;
    delayed->weight.copy_(regular->weight);
    delayed->bias.copy_(regular->bias);
  }
  torch::Tensor x = torch::randn({24, 64}).to(torch::kBFloat16);
  torch::Tensor g = torch::randn({24, 32}).to(torch::kBFloat16);
  regular(x).backward(g);
  delayed(x).backward(g);
  delayed->backward_dw();
  EXPECT_TRUE(Bitwise(delayed->weight.grad(), regular->weight.grad()));
  EXPECT_TRUE(Bitwise(delayed->bias.grad(), regular->bias.grad()));
}

TEST_F(LinearTest, CloneIsAnIndependentRegistration) {
  for (bool bias : {true, false}) {
    Linear fc(opts(16, 8).bias(bias).delay_wgrad_compute(true));
    auto copy = std::dynamic_pointer_cast<LinearImpl>(fc->clone());
    ASSERT_TRUE(copy);
    EXPECT_FALSE(copy->weight.is_same(fc->weight));
    EXPECT_TRUE(torch::equal(copy->weight, fc->weight));
    EXPECT_TRUE(copy->named_parameters()["weight"].is_same(copy->weight));
    EXPECT_EQ(copy->bias.defined(), bias);
    EXPECT_EQ(copy->parameters().size(), fc->parameters().size());

    torch::Tensor w_ref = ref_param(copy->weight);
    torch::Tensor b_ref = ref_param(copy->bias);
    torch::Tensor x = torch::randn({5, 16});
    copy->forward(x).sum().backward();
    F::linear(x, w_ref, b_ref).sum().backward();
    EXPECT_EQ(copy->pending_wgrads(), 1);
    EXPECT_EQ(fc->pending_wgrads(), 0) << "the original's queue is its own";
    EXPECT_THROW(fc->backward_dw(), c10::Error);
    ASSERT_EQ(splitgrad::layers_with_pending_wgrads().size(), 1u);
    const std::string copy_name = splitgrad::layers_with_pending_wgrads()[0];
    copy->backward_dw();
    EXPECT_TRUE(Bitwise(copy->weight.grad(), w_ref.grad()));
    EXPECT_FALSE(fc->weight.grad().defined());

    // And the other way round: the original still works, under a name of its own, and dropping
    // the copy leaves it alone.
    fc(x).sum().backward();
    ASSERT_EQ(splitgrad::layers_with_pending_wgrads().size(), 1u);
    EXPECT_NE(splitgrad::layers_with_pending_wgrads()[0], copy_name);
    copy.reset();
    EXPECT_EQ(fc->pending_wgrads(), 1);
    fc->backward_dw();
    EXPECT_TRUE(fc->weight.grad().defined());
  }
}

TEST_F(LinearTest, InferenceModeRunsTheForwardOnly) {
  Linear fc(opts(16, 8).delay_wgrad_compute(true));
  torch::Tensor x = torch::randn({5, 16});
  torch::Tensor expected = F::linear(x, fc->weight.detach(), fc->bias.detach());
  c10::InferenceMode guard;
  torch::Tensor y = fc(x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(Bitwise(y, expected));
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

// ---------------------------------------------------------------------------------------------
// The ops, through the dispatcher, against at::mm

TEST(LinearOps, RegisteredWithTheDispatcher) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const char* name :
       {"splitgrad::linear_fprop", "splitgrad::linear_dgrad", "splitgrad::linear_wgrad",
        "splitgrad::linear_wgrad_accumulate_", "splitgrad::linear"}) {
    EXPECT_TRUE(dispatcher.findSchema({name, ""}).has_value()) << name;
  }
  const auto& schema =
      dispatcher.findSchemaOrThrow("splitgrad::linear_wgrad_accumulate_", "").schema();
  ASSERT_EQ(schema.arguments().size(), 4u);
  ASSERT_NE(schema.arguments()[2].alias_info(), nullptr);
  EXPECT_TRUE(schema.arguments()[2].alias_info()->isWrite()) << "weight_grad is mutated";
  ASSERT_NE(schema.arguments()[3].alias_info(), nullptr);
  EXPECT_TRUE(schema.arguments()[3].alias_info()->isWrite()) << "bias_grad is mutated";
}

TEST(LinearOps, FpropDgradWgradMatchMm) {
  torch::manual_seed(1);
  for (const std::vector<int64_t>& lead : {std::vector<int64_t>{7}, std::vector<int64_t>{3, 4}}) {
    std::vector<int64_t> x_shape = lead, dy_shape = lead;
    x_shape.push_back(16);
    dy_shape.push_back(8);
    torch::Tensor x = torch::randn(x_shape);
    torch::Tensor w = torch::randn({8, 16});
    torch::Tensor b = torch::randn({8});
    torch::Tensor dy = torch::randn(dy_shape);
    torch::Tensor x2 = x.reshape({-1, 16});
    torch::Tensor dy2 = dy.reshape({-1, 8});

    EXPECT_TRUE(
        Bitwise(splitgrad::ops::linear_fprop(x, w, b), torch::addmm(b, x2, w.t()).view(dy_shape)));
    EXPECT_TRUE(Bitwise(splitgrad::ops::linear_fprop(x, w, std::nullopt),
                        torch::mm(x2, w.t()).view(dy_shape)));
    EXPECT_TRUE(Bitwise(splitgrad::ops::linear_dgrad(dy, w), torch::mm(dy2, w).view(x_shape)));

    auto [dw, db] = splitgrad::ops::linear_wgrad(dy, x, /*compute_bias_grad=*/true);
    EXPECT_TRUE(Bitwise(dw, torch::mm(dy2.t(), x2)));
    EXPECT_TRUE(Bitwise(db, dy2.sum(0)));
    auto [dw_only, no_db] = splitgrad::ops::linear_wgrad(dy, x, /*compute_bias_grad=*/false);
    EXPECT_TRUE(Bitwise(dw_only, dw));
    EXPECT_EQ(no_db.numel(), 0);

    torch::Tensor w_acc = torch::randn({8, 16});
    torch::Tensor b_acc = torch::randn({8});
    const torch::Tensor w_expected = w_acc + torch::mm(dy2.t(), x2);
    const torch::Tensor b_expected = b_acc + dy2.sum(0);
    splitgrad::ops::linear_wgrad_accumulate_(dy, x, w_acc, b_acc);
    EXPECT_TRUE(Close(w_acc, w_expected, kReassocRtol, kReassocAtol));
    EXPECT_TRUE(Close(b_acc, b_expected, kReassocRtol, kReassocAtol));
    torch::Tensor w_acc_only = torch::zeros({8, 16});
    splitgrad::ops::linear_wgrad_accumulate_(dy, x, w_acc_only, std::nullopt);
    EXPECT_TRUE(Close(w_acc_only, torch::mm(dy2.t(), x2), kReassocRtol, kReassocAtol));
  }
}

TEST(LinearOps, WgradAccumulateMixedPrecision) {
  // bf16 grad_output and input, fp32 accumulators (main_grad): the products run in fp32.
  torch::manual_seed(2);
  torch::Tensor x = torch::randn({32, 16}).to(torch::kBFloat16);
  torch::Tensor dy = torch::randn({32, 8}).to(torch::kBFloat16);
  torch::Tensor w_acc = torch::ones({8, 16});
  torch::Tensor b_acc = torch::ones({8});
  splitgrad::ops::linear_wgrad_accumulate_(dy, x, w_acc, b_acc);
  EXPECT_TRUE(
      Close(w_acc, 1 + torch::mm(dy.to(torch::kFloat).t(), x.to(torch::kFloat)), 1e-5, 1e-5));
  EXPECT_TRUE(Close(b_acc, 1 + dy.to(torch::kFloat).sum(0), 1e-5, 1e-5));
  EXPECT_EQ(w_acc.scalar_type(), torch::kFloat);
}

TEST(LinearOps, EmptyInputs) {
  // Zero tokens: empty outputs and zero weight gradients (accumulators left unchanged).
  for (const std::vector<int64_t>& lead :
       {std::vector<int64_t>{0}, std::vector<int64_t>{2, 0}, std::vector<int64_t>{0, 3}}) {
    std::vector<int64_t> x_shape = lead, dy_shape = lead;
    x_shape.push_back(16);
    dy_shape.push_back(8);
    torch::Tensor x = torch::randn(x_shape);
    torch::Tensor dy = torch::randn(dy_shape);
    torch::Tensor w = torch::randn({8, 16});
    torch::Tensor b = torch::randn({8});
    EXPECT_EQ(splitgrad::ops::linear_fprop(x, w, b).sizes(), at::IntArrayRef(dy_shape));
    EXPECT_EQ(splitgrad::ops::linear_fprop(x, w, std::nullopt).sizes(), at::IntArrayRef(dy_shape));
    EXPECT_EQ(splitgrad::ops::linear_dgrad(dy, w).sizes(), at::IntArrayRef(x_shape));
    auto [dw, db] = splitgrad::ops::linear_wgrad(dy, x, true);
    EXPECT_TRUE(Bitwise(dw, torch::zeros({8, 16})));
    EXPECT_TRUE(Bitwise(db, torch::zeros({8})));
    torch::Tensor w_acc = torch::randn({8, 16});
    torch::Tensor b_acc = torch::randn({8});
    const torch::Tensor w_before = w_acc.clone(), b_before = b_acc.clone();
    splitgrad::ops::linear_wgrad_accumulate_(dy, x, w_acc, b_acc);
    EXPECT_TRUE(Bitwise(w_acc, w_before));
    EXPECT_TRUE(Bitwise(b_acc, b_before));
  }
}

TEST(LinearOps, ErrorsSayExpectedAndActual) {
  torch::Tensor w = torch::randn({8, 16});
  std::string msg = error_message([&] { splitgrad::ops::linear_dgrad(torch::randn({4, 7}), w); });
  EXPECT_CONTAINS(msg, "splitgrad::linear_dgrad");
  EXPECT_CONTAINS(msg, "[*, 8]");
  EXPECT_CONTAINS(msg, "[4, 7]");
  msg = error_message([&] {
    splitgrad::ops::linear_wgrad(torch::randn({4, 8}), torch::randn({5, 16}), true);
  });
  EXPECT_CONTAINS(msg, "splitgrad::linear_wgrad");
  EXPECT_CONTAINS(msg, "[4, 8]");
  EXPECT_CONTAINS(msg, "[5, 16]");
  msg = error_message([&] {
    torch::Tensor acc = torch::zeros({16, 8});
    splitgrad::ops::linear_wgrad_accumulate_(torch::randn({4, 8}), torch::randn({4, 16}), acc,
                                             std::nullopt);
  });
  EXPECT_CONTAINS(msg, "[8, 16]");
  EXPECT_CONTAINS(msg, "[16, 8]");
  msg = error_message([&] {
    splitgrad::ops::linear_fprop(torch::randn({4, 16}), w, torch::randn({9}));
  });
  EXPECT_CONTAINS(msg, "[8]");
  EXPECT_CONTAINS(msg, "[9]");
}

TEST(LinearOps, MetaKernelsGiveShapes) {
  auto meta = torch::TensorOptions().device(torch::kMeta);
  torch::Tensor x = torch::empty({3, 5, 16}, meta);
  torch::Tensor w = torch::empty({8, 16}, meta);
  torch::Tensor dy = torch::empty({3, 5, 8}, meta);
  torch::Tensor y = splitgrad::ops::linear_fprop(x, w, std::nullopt);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), at::IntArrayRef({3, 5, 8}));
  EXPECT_EQ(splitgrad::ops::linear_dgrad(dy, w).sizes(), at::IntArrayRef({3, 5, 16}));
  auto [dw, db] = splitgrad::ops::linear_wgrad(dy, x, true);
  EXPECT_EQ(dw.sizes(), at::IntArrayRef({8, 16}));
  EXPECT_EQ(db.sizes(), at::IntArrayRef({8}));
  EXPECT_THROW(splitgrad::ops::linear_fprop(torch::empty({3, 7}, meta), w, std::nullopt),
               c10::Error);
}

TEST(LinearOps, LinearOpWithoutALayer) {
  // The differentiable op on its own (layer_id 0): the regular path works; deferral needs a layer.
  torch::manual_seed(3);
  torch::Tensor w = torch::randn({8, 16}, torch::requires_grad());
  torch::Tensor b = torch::randn({8}, torch::requires_grad());
  torch::Tensor w_ref = ref_param(w), b_ref = ref_param(b);
  torch::Tensor x = torch::randn({5, 16});
  splitgrad::ops::linear(x, w, b, std::nullopt, std::nullopt, /*layer_id=*/0,
                         /*delay_wgrad_compute=*/false)
      .sum()
      .backward();
  F::linear(x, w_ref, b_ref).sum().backward();
  EXPECT_TRUE(Bitwise(w.grad(), w_ref.grad()));
  EXPECT_TRUE(Bitwise(b.grad(), b_ref.grad()));
  const std::string msg = error_message([&] {
    splitgrad::ops::linear(x, w, b, std::nullopt, std::nullopt, 0, /*delay_wgrad_compute=*/true);
  });
  EXPECT_CONTAINS(msg, "delay_wgrad_compute");
  EXPECT_CONTAINS(msg, "not");
}

}  // namespace
