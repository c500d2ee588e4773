// splitgrad::GroupedLinear and the grouped ops against per-expert plain autograd
// (torch::nn::functional::linear on each expert's rows, with parameters cloned from the layer's).
// On the CPU every expert runs the GEMMs F::linear runs on the same rows, so float32 results are
// compared bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ops/deferred_internal.h"
#include "splitgrad/splitgrad.h"
#include "test_helpers.h"

namespace {

namespace F = torch::nn::functional;
using splitgrad::GroupedLinear;
using splitgrad::GroupedLinearOptions;
using splitgrad_test::error_message;

constexpr int64_t kIn = 6, kOut = 5;

GroupedLinearOptions opts(int64_t n) {
  return GroupedLinearOptions(n, kIn, kOut).device(torch::Device(torch::kCPU));
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// Per-expert plain autograd: F::linear on each expert's rows, concatenated.
torch::Tensor reference(const torch::Tensor& x, const std::vector<int64_t>& splits,
                        const std::vector<torch::Tensor>& weights,
                        const std::vector<torch::Tensor>& biases) {
  std::vector<torch::Tensor> outs;
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    outs.push_back(F::linear(x.narrow(0, offset, splits[i]), weights[i],
                             biases.empty() ? torch::Tensor() : biases[i]));
  }
  return torch::cat(outs);
}

::testing::AssertionResult Bitwise(const torch::Tensor& actual, const torch::Tensor& expected) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure()
           << "defined: " << actual.defined() << " vs " << expected.defined();
  }
  if (actual.sizes() == expected.sizes() && torch::equal(actual, expected)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "not bitwise equal: " << actual.sizes() << " vs " << expected.sizes();
}

class GroupedLinearTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    ASSERT_EQ(splitgrad::pending_wgrads(), 0);
  }
  void TearDown() override { EXPECT_EQ(splitgrad::pending_wgrads(), 0); }
};

TEST_P(GroupedLinearTest, MatchesPerExpertAutogradBitwise) {
  const bool delay = GetParam();
  GroupedLinear experts(opts(4).delay_wgrad_compute(delay));
  const std::vector<int64_t> splits{3, 0, 5, 1};  // expert 1 gets no rows
  auto w_ref = clones(experts->weights);
  auto b_ref = clones(experts->biases);
  torch::Tensor x = torch::randn({9, kIn}).requires_grad_();
  torch::Tensor x_ref = x.detach().clone().requires_grad_();
  torch::Tensor y = experts(x, torch::tensor(splits));
  torch::Tensor y_ref = reference(x_ref, splits, w_ref, b_ref);
  EXPECT_TRUE(Bitwise(y, y_ref));
  torch::Tensor g = torch::randn_like(y);
  y.backward(g);
  y_ref.backward(g);
  EXPECT_TRUE(Bitwise(x.grad(), x_ref.grad()));
  if (delay) {
    EXPECT_FALSE(experts->weights[0].grad().defined());
    EXPECT_EQ(experts->pending_wgrads(), 1) << "one item for all the experts";
    experts->backward_dw();
  }
  for (size_t i = 0; i < splits.size(); ++i) {
    EXPECT_TRUE(Bitwise(experts->weights[i].grad(), w_ref[i].grad())) << "weight" << i;
    EXPECT_TRUE(Bitwise(experts->biases[i].grad(), b_ref[i].grad())) << "bias" << i;
  }
  EXPECT_EQ(torch::count_nonzero(experts->weights[1].grad()).item<int64_t>(), 0);
}

TEST_P(GroupedLinearTest, TiedExpertsAndHooks) {
  const bool delay = GetParam();
  GroupedLinear experts(opts(3).bias(false).delay_wgrad_compute(delay));
  experts->tie_weight(2, experts->weights[0]);
  auto w_ref = clones({experts->weights[0], experts->weights[1]});
  const std::vector<int64_t> splits{2, 3, 4};
  torch::Tensor x = torch::randn({9, kIn});
  torch::Tensor g = torch::randn({9, kOut});
  int fired = 0;
  experts->register_wgrad_accumulation_and_reduce_hooks([&](const torch::Tensor&) { ++fired; });
  experts(x, torch::tensor(splits)).backward(g);
  reference(x, splits, {w_ref[0], w_ref[1], w_ref[0]}, {}).backward(g);
  if (delay) {
    EXPECT_EQ(fired, 0) << "hooks wait for the deferred work";
    experts->backward_dw();
  }
  EXPECT_EQ(fired, 2) << "once per distinct parameter (weight0 is shared with expert 2)";
  // Two contributions to the shared weight, no earlier .grad: the order of the sum is immaterial.
  EXPECT_TRUE(Bitwise(experts->weights[0].grad(), w_ref[0].grad()));
  EXPECT_TRUE(Bitwise(experts->weights[1].grad(), w_ref[1].grad()));
}

// Per-expert autograd adds the values of a parameter tied across experts in reverse expert order
// ((v4 + v3) + v1: the last expert's backward runs first), which differs from slot order in fp32
// with three or more: both paths add them in that order, bit for bit.
TEST_P(GroupedLinearTest, ThreeOrFourTiedExpertsSumAsPerExpertAutograd) {
  const bool delay = GetParam();
  for (const std::vector<size_t>& tied : {std::vector<size_t>{1, 3, 4}, {0, 1, 2, 4}}) {
    GroupedLinear experts(opts(5).delay_wgrad_compute(delay));
    for (size_t i : tied) {
      if (i == tied.front()) continue;
      experts->tie_weight(static_cast<int64_t>(i), experts->weights[tied.front()]);
      experts->tie_bias(static_cast<int64_t>(i), experts->biases[tied.front()]);
    }
    auto w_ref = clones(experts->weights);
    auto b_ref = clones(experts->biases);
    for (size_t i : tied) {  // the reference ties the same experts
      w_ref[i] = w_ref[tied.front()];
      b_ref[i] = b_ref[tied.front()];
    }
    const std::vector<int64_t> splits{3, 4, 5, 6, 2};
    torch::Tensor x = torch::randn({20, kIn});
    torch::Tensor g = torch::randn({20, kOut});
    experts(x, torch::tensor(splits)).backward(g);
    reference(x, splits, w_ref, b_ref).backward(g);
    if (delay) experts->backward_dw();
    for (size_t i = 0; i < splits.size(); ++i) {
      EXPECT_TRUE(Bitwise(experts->weights[i].grad(), w_ref[i].grad())) << "weight" << i;
      EXPECT_TRUE(Bitwise(experts->biases[i].grad(), b_ref[i].grad())) << "bias" << i;
    }
    // The case tells the orders apart: slot order gives other bits.
    torch::Tensor in_slot_order = torch::zeros({kOut, kIn});
    torch::Tensor bias_in_slot_order = torch::zeros({kOut});
    const auto xs = x.split_with_sizes(splits);
    const auto gs = g.split_with_sizes(splits);
    for (size_t k = 0; k < tied.size(); ++k) {
      const size_t i = tied[k];
      const torch::Tensor v = torch::mm(gs[i].t(), xs[i]), b = gs[i].sum(0);
      in_slot_order = k == 0 ? v : in_slot_order + v;
      bias_in_slot_order = k == 0 ? b : bias_in_slot_order + b;
    }
    EXPECT_FALSE(torch::equal(in_slot_order, w_ref[tied.front()].grad()));
    EXPECT_FALSE(torch::equal(bias_in_slot_order, b_ref[tied.front()].grad()));
  }
}

TEST_P(GroupedLinearTest, FusedMainGrad) {
  const bool delay = GetParam();
  GroupedLinear experts(opts(3).delay_wgrad_compute(delay).fuse_wgrad_accumulation(true));
  auto w_ref = clones(experts->weights);
  std::vector<torch::Tensor> main_grads;
  for (size_t i = 0; i < experts->weights.size(); ++i) {
    main_grads.push_back(torch::randn({kOut, kIn}));
    w_ref[i].mutable_grad() = main_grads.back().clone();
    splitgrad::set_main_grad(experts->weights[i], main_grads.back());
  }
  const std::vector<int64_t> splits{0, 6, 1};
  torch::Tensor x = torch::randn({7, kIn});
  torch::Tensor g = torch::randn({7, kOut});
  experts(x, torch::tensor(splits)).backward(g);
  reference(x, splits, w_ref, clones(experts->biases)).backward(g);
  experts->backward_dw();
  for (size_t i = 0; i < main_grads.size(); ++i) {
    EXPECT_FALSE(experts->weights[i].grad().defined());
    EXPECT_TRUE(Bitwise(main_grads[i], w_ref[i].grad())) << "weight" << i;
    EXPECT_TRUE(experts->biases[i].grad().defined()) << "a bias without main_grad gets .grad";
  }
}

// backward_dw() takes and drops an item's references (its parameters', main_grads', stashed
// tensors') in three ReferenceBatch scopes whatever the number of experts, not one per tensor:
// with the Python module each scope holds the GIL once (ops/deferred_internal.h).
std::atomic<int> reference_batches{0};
std::shared_ptr<void> count_reference_batch() {
  reference_batches.fetch_add(1);
  return nullptr;
}

TEST(GroupedLinearHostWork, BackwardDwBatchesItsReferencesPerItemNotPerExpert) {
  for (const int64_t experts : {2, 16}) {
    GroupedLinear layer(opts(experts).delay_wgrad_compute(true).fuse_wgrad_accumulation(true));
    auto w_ref = clones(layer->weights);
    std::vector<torch::Tensor> main_grads;
    for (size_t i = 0; i < layer->weights.size(); ++i) {
      main_grads.push_back(torch::zeros({kOut, kIn}));
      splitgrad::set_main_grad(layer->weights[i], main_grads.back());
      splitgrad::set_main_grad(layer->biases[i], torch::zeros({kOut}));
    }
    const std::vector<int64_t> splits(static_cast<size_t>(experts), 1);
    torch::Tensor x = torch::randn({experts, kIn});
    torch::Tensor g = torch::randn({experts, kOut});
    layer(x, torch::tensor(splits)).backward(g);
    reference(x, splits, w_ref, clones(layer->biases)).backward(g);
    reference_batches = 0;
    splitgrad::detail::set_reference_batch_hook(&count_reference_batch);
    layer->backward_dw();
    splitgrad::detail::set_reference_batch_hook(nullptr);
    EXPECT_EQ(reference_batches.load(), 3) << experts << " experts";
    for (size_t i = 0; i < main_grads.size(); ++i) {
      EXPECT_TRUE(Bitwise(main_grads[i], w_ref[i].grad())) << "weight" << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, GroupedLinearTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Delayed" : "Regular");
                         });

TEST(GroupedLinearErrors, BadSplitsNameTheLayerAndQueueNothing) {
  GroupedLinear experts(opts(3).delay_wgrad_compute(true).name("moe.experts"));
  torch::Tensor x = torch::randn({5, kIn}, torch::requires_grad());
  std::string message = error_message([&] { experts(x, torch::tensor({2, 2, 2})); });
  EXPECT_CONTAINS(message, "splitgrad layer 'moe.experts'");
  EXPECT_CONTAINS(message,
                  "expected m_splits to sum to the input's 5 rows (tokens), got a sum of 6");
  // 2 * INT64_MAX + 7 wraps around to 5 in int64: refused, not run.
  const int64_t huge = std::numeric_limits<int64_t>::max();
  message = error_message([&] { experts(x, torch::tensor(std::vector<int64_t>{huge, huge, 7})); });
  EXPECT_CONTAINS(message, "splitgrad layer 'moe.experts'");
  EXPECT_CONTAINS(message, "got a sum past the int64 range at m_splits[1]");
  message = error_message([&] { experts(x, torch::tensor({6, -1, 0})); });
  EXPECT_CONTAINS(message, "expected non-negative m_splits, got m_splits[1] = -1");
  message = error_message([&] { experts(x, torch::tensor({5, 0})); });
  EXPECT_CONTAINS(message, "expected 3 splits (one per group) in a 1-D m_splits, got shape [2]");
  message = error_message([&] { experts(x, torch::tensor({5.0, 0.0, 0.0})); });
  EXPECT_CONTAINS(message,
                  "expected m_splits of dtype torch.int64 (row counts), got torch.float32");
  message = error_message([&] { experts(x.to(torch::kDouble), torch::tensor({5, 0, 0})); });
  EXPECT_CONTAINS(message, "expected input of dtype torch.float32");
  message = error_message([&] { experts->tie_weight(3, experts->weights[0]); });
  EXPECT_CONTAINS(message, "expected an expert in [0, 3), got 3");
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  message = error_message([&] { experts->backward_dw(); });
  EXPECT_CONTAINS(message, "'moe.experts': backward_dw() was called but no backward pass");
}

TEST(GroupedLinearModule, SplitsOfAnyIntegerDtypeAsInt64) {
  GroupedLinear experts(opts(3));
  torch::Tensor x = torch::randn({5, kIn});
  const torch::Tensor expected = experts(x, torch::tensor({2, 0, 3}));
  for (auto dtype : {torch::kInt, torch::kShort, torch::kByte}) {
    EXPECT_TRUE(Bitwise(experts(x, torch::tensor({2, 0, 3}, dtype)), expected)) << dtype;
  }
}

TEST(GroupedLinearModule, CloneKeepsExpertsTiedToEachOther) {
  GroupedLinear experts(opts(3).delay_wgrad_compute(true));
  experts->tie_weight(2, experts->weights[0]);
  experts->tie_bias(1, experts->biases[0]);
  auto copy = std::dynamic_pointer_cast<splitgrad::GroupedLinearImpl>(experts->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(copy->weights[2].is_same(copy->weights[0]));
  EXPECT_TRUE(copy->biases[1].is_same(copy->biases[0]));
  EXPECT_FALSE(copy->weights[0].is_same(experts->weights[0]));
  EXPECT_TRUE(copy->named_parameters()["weight2"].is_same(copy->weights[0]));
  EXPECT_EQ(splitgrad::unique_parameters(*copy).size(), 4u);  // 3 weights, 3 biases, 2 tied
  // The copy trains as the original: the shared weight gets both experts' contributions.
  const std::vector<int64_t> splits{2, 3, 4};
  torch::Tensor x = torch::randn({9, kIn});
  torch::Tensor g = torch::randn({9, kOut});
  copy->forward(x, torch::tensor(splits)).backward(g);
  copy->backward_dw();
  experts(x, torch::tensor(splits)).backward(g);
  experts->backward_dw();
  EXPECT_TRUE(Bitwise(copy->weights[0].grad(), experts->weights[0].grad()));
  EXPECT_TRUE(Bitwise(copy->biases[0].grad(), experts->biases[0].grad()));
}

TEST(GroupedLinearErrors, FusedWithoutMainGrad) {
  GroupedLinear experts(opts(2).fuse_wgrad_accumulation(true).name("fused"));
  splitgrad::set_main_grad(experts->weights[0], torch::zeros({kOut, kIn}));
  const std::string message = error_message([&] {
    experts(torch::randn({2, kIn}), torch::tensor({1, 1}));
  });
  EXPECT_CONTAINS(message, "'fused': fuse_wgrad_accumulation=true needs the weight1's main_grad");
}

TEST(GroupedLinearErrors, FusedForwardWithoutGradModeNeedsNoMainGrad) {
  GroupedLinear experts(
      opts(2).fuse_wgrad_accumulation(true).delay_wgrad_compute(true).name("eval"));
  torch::NoGradGuard no_grad;
  EXPECT_NO_THROW(experts(torch::randn({3, kIn}), torch::tensor({1, 2})));
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

TEST(GroupedOps, WgradAccumulateAddsPerGroup) {
  torch::Tensor x = torch::randn({5, kIn});
  torch::Tensor dy = torch::randn({5, kOut});
  torch::Tensor target = torch::randn({kOut, kIn});
  torch::Tensor start = target.clone();
  c10::List<std::optional<at::Tensor>> weight_grads({std::nullopt, target});
  splitgrad::ops::grouped_linear_wgrad_accumulate_(dy, x, torch::tensor({2, 3}), weight_grads,
                                                   c10::List<std::optional<at::Tensor>>());
  EXPECT_TRUE(Bitwise(target, start + torch::mm(dy.narrow(0, 2, 3).t(), x.narrow(0, 2, 3))));
}

}  // namespace
