// What every splitgrad module gets from DeferredWgradModule (splitgrad/module.h), checked on all
// four: backward_dw() and the pending passes, the pending-work guard on zero_grad() and save(),
// grad-ready hooks that follow a re-tied parameter, and a named clone's own name and no hooks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "splitgrad/splitgrad.h"
#include "test_helpers.h"

namespace {

using splitgrad_test::error_message;
const torch::Device kCPU(torch::kCPU);

// Per module: build one (delayed or not, named), run one forward + backward, and tie one of its
// weights (tied()) to another module's.
template <class Module>
struct Traits;

template <>
struct Traits<splitgrad::Linear> {
  static splitgrad::Linear build(bool delay, const std::string& name) {
    return splitgrad::Linear(
        splitgrad::LinearOptions(4, 3).delay_wgrad_compute(delay).name(name).device(kCPU));
  }
  static void backward(splitgrad::Linear& m) { m(torch::randn({5, 4})).sum().backward(); }
  static torch::Tensor tied(splitgrad::Linear& m) { return m->weight; }
  static void tie(splitgrad::Linear& m, splitgrad::Linear& other) { m->tie_weight(other->weight); }
  static constexpr int kGemms = 1;
  static splitgrad::Linear build_init(const splitgrad::InitMethod& init) {
    return splitgrad::Linear(splitgrad::LinearOptions(4, 3).init_method(init).device(kCPU));
  }
  static torch::Tensor run(splitgrad::Linear& m, const torch::Tensor& x,
                           std::optional<bool> first) {
    return first ? m(x, *first) : m(x);
  }
  static torch::Tensor run_in_sequential(splitgrad::Linear& m, const torch::Tensor& x) {
    return torch::nn::Sequential(m)->forward(x);
  }
};

template <>
struct Traits<splitgrad::GroupedLinear> {
  static splitgrad::GroupedLinear build(bool delay, const std::string& name) {
    return splitgrad::GroupedLinear(
        splitgrad::GroupedLinearOptions(2, 4, 3).delay_wgrad_compute(delay).name(name).device(
            kCPU));
  }
  static void backward(splitgrad::GroupedLinear& m) {
    m(torch::randn({5, 4}), torch::tensor({2, 3})).sum().backward();
  }
  static torch::Tensor tied(splitgrad::GroupedLinear& m) { return m->weights[0]; }
  static void tie(splitgrad::GroupedLinear& m, splitgrad::GroupedLinear& other) {
    m->tie_weight(0, other->weights[0]);
  }
  static constexpr int kGemms = 2;  // experts
  static splitgrad::GroupedLinear build_init(const splitgrad::InitMethod& init) {
    return splitgrad::GroupedLinear(
        splitgrad::GroupedLinearOptions(2, 4, 3).init_method(init).device(kCPU));
  }
  static torch::Tensor run(splitgrad::GroupedLinear& m, const torch::Tensor& x,
                           std::optional<bool> first) {
    return first ? m(x, torch::tensor({2, 3}), *first) : m(x, torch::tensor({2, 3}));
  }
  static torch::Tensor run_in_sequential(splitgrad::GroupedLinear& m, const torch::Tensor& x) {
    return torch::nn::Sequential(m)->forward(x, torch::tensor({2, 3}));
  }
};

template <>
struct Traits<splitgrad::LayerNormLinear> {
  static splitgrad::LayerNormLinear build(bool delay, const std::string& name) {
    return splitgrad::LayerNormLinear(
        splitgrad::LayerNormLinearOptions(4, 3).delay_wgrad_compute(delay).name(name).device(kCPU));
  }
  static void backward(splitgrad::LayerNormLinear& m) { m(torch::randn({5, 4})).sum().backward(); }
  static torch::Tensor tied(splitgrad::LayerNormLinear& m) { return m->weight; }
  static void tie(splitgrad::LayerNormLinear& m, splitgrad::LayerNormLinear& other) {
    m->tie_parameter("weight", other->weight);
  }
  static constexpr int kGemms = 1;
  static splitgrad::LayerNormLinear build_init(const splitgrad::InitMethod& init) {
    return splitgrad::LayerNormLinear(
        splitgrad::LayerNormLinearOptions(4, 3).init_method(init).device(kCPU));
  }
  static torch::Tensor run(splitgrad::LayerNormLinear& m, const torch::Tensor& x,
                           std::optional<bool> first) {
    return first ? m(x, *first) : m(x);
  }
  static torch::Tensor run_in_sequential(splitgrad::LayerNormLinear& m, const torch::Tensor& x) {
    return torch::nn::Sequential(m)->forward(x);
  }
};

template <>
struct Traits<splitgrad::LayerNormMLP> {
  static splitgrad::LayerNormMLP build(bool delay, const std::string& name) {
    return splitgrad::LayerNormMLP(
        splitgrad::LayerNormMLPOptions(4, 6).delay_wgrad_compute(delay).name(name).device(kCPU));
  }
  static void backward(splitgrad::LayerNormMLP& m) { m(torch::randn({5, 4})).sum().backward(); }
  static torch::Tensor tied(splitgrad::LayerNormMLP& m) { return m->fc1_weight; }
  static void tie(splitgrad::LayerNormMLP& m, splitgrad::LayerNormMLP& other) {
    m->tie_parameter("fc1_weight", other->fc1_weight);
  }
  static constexpr int kGemms = 2;  // fc1 by init_method, fc2 by output_layer_init_method
  static splitgrad::LayerNormMLP build_init(const splitgrad::InitMethod& init) {
    return splitgrad::LayerNormMLP(splitgrad::LayerNormMLPOptions(4, 6)
                                       .init_method(init)
                                       .output_layer_init_method(init)
                                       .device(kCPU));
  }
  static torch::Tensor run(splitgrad::LayerNormMLP& m, const torch::Tensor& x,
                           std::optional<bool> first) {
    return first ? m(x, *first) : m(x);
  }
  static torch::Tensor run_in_sequential(splitgrad::LayerNormMLP& m, const torch::Tensor& x) {
    return torch::nn::Sequential(m)->forward(x);
  }
};

template <class Module>
class ModuleBase : public ::testing::Test {};
using Modules = ::testing::Types<splitgrad::Linear, splitgrad::GroupedLinear,
                                 splitgrad::LayerNormLinear, splitgrad::LayerNormMLP>;
TYPED_TEST_SUITE(ModuleBase, Modules);

TYPED_TEST(ModuleBase, PendingPassesAndTheGuardOnZeroGradAndSave) {
  using T = Traits<TypeParam>;
  auto module = T::build(/*delay=*/true, "guarded");
  T::backward(module);
  EXPECT_GT(module->pending_wgrads(), 0);
  ASSERT_EQ(module->pending_passes().size(), 1u);
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
  EXPECT_CONTAINS(error_message([&] { module->zero_grad(); }),
                  "zero_grad() of splitgrad layer 'guarded'");
  std::ostringstream stream;
  EXPECT_CONTAINS(error_message([&] { torch::save(module, stream); }),
                  "saving splitgrad layer 'guarded'");
  module->backward_dw(module->pending_passes()[0]);
  EXPECT_EQ(module->pending_wgrads(), 0);
  EXPECT_NO_THROW(module->zero_grad());
  EXPECT_NO_THROW(torch::save(module, stream));
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kWarn);
  for (const auto& param : module->parameters()) EXPECT_FALSE(param.grad().defined());
}

// TE's keywords in C++: init_method draws each GEMM weight (under no-grad) and zeroes its bias,
// need_backward_dw() says whether the module defers, and forward()'s is_first_microbatch is
// accepted and changes nothing, also through torch::nn::Sequential (which fills the default).
TYPED_TEST(ModuleBase, TeInitMethodNeedBackwardDwAndIsFirstMicrobatch) {
  using T = Traits<TypeParam>;
  int calls = 0;
  auto module = T::build_init([&](const at::Tensor& weight) {
    ++calls;
    weight.fill_(0.25);
  });
  EXPECT_EQ(calls, T::kGemms);
  int gemm_params = 0;
  for (const auto& item : module->named_parameters()) {
    const std::string& name = item.key();
    if (name.find("layer_norm") != std::string::npos) continue;
    const torch::Tensor& p = item.value();
    const double want = name.find("weight") != std::string::npos ? 0.25 : 0.0;
    EXPECT_TRUE(torch::equal(p, torch::full_like(p, want))) << name;
    EXPECT_TRUE(p.requires_grad()) << name;
    ++gemm_params;
  }
  EXPECT_EQ(gemm_params, 2 * T::kGemms) << "a weight and a bias per GEMM";
  auto plain = T::build(/*delay=*/false, "");
  for (const auto& item : plain->named_parameters()) {
    const std::string& name = item.key();
    if (name.find("bias") == std::string::npos || name.find("layer_norm") != std::string::npos) {
      continue;
    }
    EXPECT_GT(item.value().abs().max().item().toDouble(), 0.0) << name << ": nn.Linear's draw";
  }

  EXPECT_FALSE(module->need_backward_dw());
  auto delayed = T::build(/*delay=*/true, "");
  EXPECT_TRUE(delayed->need_backward_dw());
  const torch::Tensor x = torch::randn({5, 4});
  const torch::Tensor y = T::run(delayed, x, std::nullopt);
  EXPECT_TRUE(torch::equal(T::run(delayed, x, true), y));
  EXPECT_TRUE(torch::equal(T::run(delayed, x, false), y));
  EXPECT_TRUE(torch::equal(T::run_in_sequential(delayed, x), y));
}

TYPED_TEST(ModuleBase, RegularModuleQueuesNothingAndBackwardDwDoesNothing) {
  using T = Traits<TypeParam>;
  auto module = T::build(/*delay=*/false, "");
  T::backward(module);
  EXPECT_EQ(module->pending_wgrads(), 0);
  EXPECT_NO_THROW(module->backward_dw());
  for (const auto& param : module->parameters()) EXPECT_TRUE(param.grad().defined());
}

TYPED_TEST(ModuleBase, HooksFollowARetiedParameter) {
  using T = Traits<TypeParam>;
  auto module = T::build(/*delay=*/true, "");
  auto other = T::build(/*delay=*/false, "");
  std::vector<torch::Tensor> fired;
  module->register_wgrad_accumulation_and_reduce_hooks(
      [&](const torch::Tensor& param) { fired.push_back(param); });
  const torch::Tensor own = T::tied(module);
  T::tie(module, other);
  T::backward(module);
  module->backward_dw();
  const torch::Tensor shared = T::tied(other);
  EXPECT_EQ(fired.size(), module->parameters().size());
  int shared_fired = 0;
  for (const auto& param : fired) {
    EXPECT_FALSE(param.is_same(own)) << "a hook stayed on the parameter replaced by the tie";
    shared_fired += param.is_same(shared);
  }
  EXPECT_EQ(shared_fired, 1);
}

TYPED_TEST(ModuleBase, ATieOnACopiedImplLeavesTheOriginalsHooks) {
  using T = Traits<TypeParam>;
  auto module = T::build(/*delay=*/true, "");
  auto other = T::build(/*delay=*/false, "");
  int fired = 0;
  module->register_wgrad_accumulation_and_reduce_hooks([&](const torch::Tensor&) { ++fired; });
  TypeParam copy(std::make_shared<typename TypeParam::ContainedType>(*module));  // copies the Impl
  T::tie(copy, other);
  T::backward(module);
  module->backward_dw();
  EXPECT_EQ(fired, static_cast<int>(module->parameters().size()));
}

TYPED_TEST(ModuleBase, NamedCloneHasItsOwnNameAndNoHooks) {
  using T = Traits<TypeParam>;
  auto module = T::build(/*delay=*/true, "original");
  int fired = 0;
  module->register_wgrad_accumulation_and_reduce_hooks([&](const torch::Tensor&) { ++fired; });
  auto copy =
      TypeParam(std::dynamic_pointer_cast<typename TypeParam::ContainedType>(module->clone()));
  const std::string name = copy->options.name();
  EXPECT_EQ(name.rfind("original#", 0), 0u) << name;
  EXPECT_NE(name, "original#");
  T::backward(copy);
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
  EXPECT_CONTAINS(error_message([&] { copy->zero_grad(); }), "'" + name + "'");
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kWarn);
  EXPECT_EQ(module->pending_wgrads(), 0);
  copy->backward_dw();
  EXPECT_EQ(fired, 0);
  for (const auto& param : copy->parameters()) EXPECT_TRUE(param.grad().defined());
}

}  // namespace
