// What the C++ API guarantees at process exit, across threads, and to a user who misuses it: the
// process-wide state outlives the layers and hooks destroyed at exit, backward_dw_all() in one
// thread never returns before the work it asked for has landed, ties to non-parameters are
// refused, pending work is reported before an optimizer step or a save, and messages name layers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ops/deferred_internal.h"
#include "splitgrad/splitgrad.h"
#include "test_helpers.h"

namespace {

namespace F = torch::nn::functional;
using splitgrad::Linear;
using splitgrad::LinearOptions;

LinearOptions opts(int64_t in, int64_t out) {
  return LinearOptions(in, out).device(torch::Device(torch::kCPU));
}

torch::Tensor ref_param(const torch::Tensor& param) {
  return param.detach().clone().requires_grad_();
}

using splitgrad_test::error_message;

class CapturingWarningHandler : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

class ApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    ASSERT_EQ(splitgrad::pending_wgrads(), 0) << "an earlier test left deferred work";
  }
  void TearDown() override { EXPECT_EQ(splitgrad::pending_wgrads(), 0); }
};

// ---------------------------------------------------------------------------------------------
// 1. Process exit

// A hook owning a layer, with work pending, at exit: the ledger must not destroy the hook (whose
// layer would call back into the half-destroyed ledger); a global layer must find the store alive.
struct ExitSentinel {
  ~ExitSentinel() { std::_Exit(3); }  // runs only if the ledger destroys its hooks at exit
};

void exit_with_pending_work() {
  static Linear global_layer(opts(4, 4).delay_wgrad_compute(true).name("global"));
  {  // std::exit destroys no local: only the hook may own `held` and the sentinel by then
    Linear held(opts(4, 4).delay_wgrad_compute(true).name("held_by_hook"));
    auto sentinel = std::make_shared<ExitSentinel>();
    splitgrad::register_grad_ready_hook(held->weight,
                                        [held, sentinel](const at::Tensor&) { (void)held; });
    torch::Tensor x = torch::randn({2, 4});
    held(global_layer(x)).sum().backward();
  }
  if (splitgrad::pending_wgrads() != 2) std::_Exit(4);
  std::exit(0);
}

TEST(ApiExitDeathTest, PendingWorkHeldByAHookAndAGlobalLayerAtExit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with_pending_work(), ::testing::ExitedWithCode(0), "");
}

// ---------------------------------------------------------------------------------------------
// 2. Threads

// Two delayed layers a -> b with their plain-autograd twins, and a thread T whose backward_dw_all()
// has landed b's item and is stuck in b's grad-ready hook, holding a's item not yet run, until
// release() (from another thread, after a delay, so the main thread can block meanwhile).
class StuckInAnotherThread {
 public:
  StuckInAnotherThread()
      : a(opts(8, 8).delay_wgrad_compute(true).name("a")),
        b(opts(8, 8).delay_wgrad_compute(true).name("b")),
        wa(ref_param(a->weight)), wb(ref_param(b->weight)),
        ba(ref_param(a->bias)), bb(ref_param(b->bias)) {
    torch::Tensor x = torch::randn({4, 8});
    b(a(x)).sum().backward();  // queues b's item, then a's
    F::linear(F::linear(x, wa, ba), wb, bb).sum().backward();
    released_ = release_.get_future().share();
    handle_ = splitgrad::register_grad_ready_hook(b->weight, [this](const at::Tensor&) {
      if (!first_.exchange(false)) return;
      entered_.set_value();
      released_.wait();
    });
    other_ = std::thread([] { splitgrad::backward_dw_all(); });
    entered_.get_future().wait();
  }
  void release_later() {
    releaser_ = std::thread([this] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      release_.set_value();
    });
  }
  ~StuckInAnotherThread() {
    if (!releaser_.joinable()) release_.set_value();
    if (releaser_.joinable()) releaser_.join();
    other_.join();
    handle_.remove();
  }

  Linear a, b;
  torch::Tensor wa, wb, ba, bb;

 private:
  std::promise<void> entered_, release_;
  std::shared_future<void> released_;
  std::atomic<bool> first_{true};
  splitgrad::GradReadyHookHandle handle_;
  std::thread other_, releaser_;
};

// The main thread's backward_dw_all() must wait for a's item, which T took, to land.
TEST_F(ApiTest, BackwardDwAllWaitsForWorkAnotherThreadTook) {
  {
    StuckInAnotherThread t;
    t.release_later();
    splitgrad::backward_dw_all();
    EXPECT_EQ(splitgrad::pending_wgrads_for(t.a->weight), 0)
        << "backward_dw_all() returned while a's work was still running in another thread";
    ASSERT_TRUE(t.a->weight.grad().defined());
    EXPECT_TRUE(torch::equal(t.a->weight.grad(), t.wa.grad()));
  }
}

// Meanwhile, in the main thread, a's item still counts as pending (so guards do not pass on an
// incomplete gradient), and a's own backward_dw() waits for it instead of saying nothing was queued.
TEST_F(ApiTest, WorkAnotherThreadTookCountsAsPendingAndALayersBackwardDwWaitsForIt) {
  torch::Tensor b_weight, b_weight_ref;
  {
    StuckInAnotherThread t;
    EXPECT_EQ(splitgrad::pending_wgrads(), 1);
    EXPECT_EQ(t.a->pending_wgrads(), 1);
    EXPECT_EQ(t.b->pending_wgrads(), 0);
    EXPECT_EQ(splitgrad::layers_with_pending_wgrads({t.a->weight}),
              std::vector<std::string>{"a"});
    EXPECT_EQ(splitgrad::layers_with_pending_wgrads({t.b->weight}), std::vector<std::string>{});
    splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
    const std::string guard = error_message([&] { splitgrad::check_pending_wgrads("step()"); });
    splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kWarn);
    EXPECT_CONTAINS(guard, "'a'");

    t.release_later();
    EXPECT_NO_THROW(t.a->backward_dw()) << "a's own backward_dw() saw nothing while T ran a's item";
    EXPECT_EQ(splitgrad::pending_wgrads_for(t.a->weight), 0)
        << "a's backward_dw() returned while its work was still running in another thread";
    ASSERT_TRUE(t.a->weight.grad().defined());
    EXPECT_TRUE(torch::equal(t.a->weight.grad(), t.wa.grad()));
    EXPECT_TRUE(torch::equal(t.a->bias.grad(), t.ba.grad()));
    b_weight = t.b->weight;
    b_weight_ref = t.wb;
  }
  EXPECT_TRUE(torch::equal(b_weight.grad(), b_weight_ref.grad()));
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
}

// A grad-ready hook that calls a layer's backward_dw() while this thread's backward_dw_all() holds
// that layer's work is told so (not "nothing queued"); the work still lands.
TEST_F(ApiTest, BackwardDwFromAHookOfTheRunningCallSaysWhy) {
  Linear a(opts(4, 4).delay_wgrad_compute(true).name("a"));
  Linear b(opts(4, 4).delay_wgrad_compute(true).name("b"));
  b(a(torch::randn({2, 4}))).sum().backward();  // queues b's item, then a's
  std::string message;
  auto handle = splitgrad::register_grad_ready_hook(
      b->weight, [&](const at::Tensor&) { message = error_message([&] { a->backward_dw(); }); });
  splitgrad::backward_dw_all();
  handle.remove();
  EXPECT_CONTAINS(message, "while this thread is running this layer's deferred work");
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  EXPECT_TRUE(a->weight.grad().defined());
}

// Two threads, each training a model of its own (delayed, tied layers) next to plain autograd:
// every step's gradients equal autograd's (to float32 reassociation), whether each thread calls the
// process-wide backward_dw_all() or the one over its own model's parameters.
struct TiedModel {
  Linear enc{opts(16, 16).delay_wgrad_compute(true).name("enc")};
  Linear mid{opts(16, 16).delay_wgrad_compute(true).name("mid")};
  Linear head{opts(16, 2).name("head")};
  torch::Tensor w, b1, b2, hw, hb;  // the reference model

  TiedModel() {
    mid->tie_weight(enc->weight);
    w = ref_param(enc->weight);
    b1 = ref_param(enc->bias);
    b2 = ref_param(mid->bias);
    hw = ref_param(head->weight);
    hb = ref_param(head->bias);
  }
  std::vector<torch::Tensor> params() const {
    return {enc->weight, enc->bias, mid->bias, head->weight, head->bias};
  }
  std::vector<torch::Tensor> ref_params() const { return {w, b1, b2, hw, hb}; }
};

int train_in_thread(bool per_model, int steps) {
  TiedModel m;
  torch::optim::SGD opt(m.params(), 0.05), ref_opt(m.ref_params(), 0.05);
  int mismatches = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    for (int mb = 0; mb < 2; ++mb) {
      torch::Tensor x = torch::randn({8, 16});
      m.head(torch::tanh(m.mid(torch::tanh(m.enc(x))))).square().mean().backward();
      F::linear(torch::tanh(F::linear(torch::tanh(F::linear(x, m.w, m.b1)), m.w, m.b2)), m.hw, m.hb)
          .square()
          .mean()
          .backward();
    }
    if (per_model) {
      splitgrad::backward_dw_all(m.params());
    } else {
      splitgrad::backward_dw_all();
    }
    const auto params = m.params(), refs = m.ref_params();
    for (size_t i = 0; i < params.size(); ++i) {
      // W's four contributions are added in another association than autograd's: within 1e-5.
      if (!params[i].grad().defined() ||
          !torch::allclose(params[i].grad(), refs[i].grad(), 1e-5, 1e-6)) {
        ++mismatches;
        break;
      }
    }
    opt.step();
    ref_opt.step();
  }
  return mismatches;
}

void two_threads_train(bool per_model) {
  constexpr int kSteps = 40;
  std::future<int> a = std::async(std::launch::async, train_in_thread, per_model, kSteps);
  std::future<int> b = std::async(std::launch::async, train_in_thread, per_model, kSteps);
  EXPECT_EQ(a.get(), 0) << "steps whose gradients differ from plain autograd (thread 1)";
  EXPECT_EQ(b.get(), 0) << "steps whose gradients differ from plain autograd (thread 2)";
}

TEST_F(ApiTest, TwoThreadsEachTrainingAModelWithProcessWideBackwardDwAll) {
  two_threads_train(/*per_model=*/false);
}

TEST_F(ApiTest, TwoThreadsEachTrainingAModelWithBackwardDwAllOverItsParameters) {
  two_threads_train(/*per_model=*/true);
}

TEST_F(ApiTest, BackwardDwAllOverParametersRunsOnlyThatWork) {
  Linear a(opts(8, 8).delay_wgrad_compute(true).name("a"));
  Linear b(opts(8, 8).delay_wgrad_compute(true).name("b"));
  torch::Tensor x = torch::randn({4, 8});
  a(x).sum().backward();
  b(x).sum().backward();
  splitgrad::backward_dw_all({b->weight});
  EXPECT_EQ(a->pending_wgrads(), 1);
  EXPECT_EQ(b->pending_wgrads(), 0);
  EXPECT_TRUE(b->weight.grad().defined());
  EXPECT_FALSE(a->weight.grad().defined());
  splitgrad::backward_dw_all();
  EXPECT_TRUE(a->weight.grad().defined());
}

// ---------------------------------------------------------------------------------------------
// 3. tie_weight / tie_bias take parameters only

TEST_F(ApiTest, TieRefusesNonLeavesOtherDtypesAndUndefinedTensors) {
  Linear up(opts(8, 16).name("up"));
  Linear down(opts(16, 8).delay_wgrad_compute(true).name("down"));
  std::string msg = error_message([&] { down->tie_weight(up->weight.t()); });
  EXPECT_CONTAINS(msg, "'down'");
  EXPECT_CONTAINS(msg, "non-leaf");

  msg = error_message([&] { down->tie_weight(torch::zeros({8, 16}, torch::kDouble)); });
  EXPECT_CONTAINS(msg, "'down'");
  EXPECT_CONTAINS(msg, "torch.float32");
  EXPECT_CONTAINS(msg, "torch.float64");

  msg = error_message([&] { down->tie_weight(torch::Tensor()); });
  EXPECT_CONTAINS(msg, "undefined tensor");
  EXPECT_CONTAINS(msg, "[8, 16]");
  msg = error_message([&] { down->tie_bias(down->bias * 2); });
  EXPECT_CONTAINS(msg, "non-leaf");
  EXPECT_TRUE(down->parameters()[0].is_same(down->weight)) << "a refused tie changes nothing";
}

// ---------------------------------------------------------------------------------------------
// 4. The pending-work guard

TEST_F(ApiTest, GuardedOptimizerAndSaveReportPendingWorkNamingTheLayers) {
  CapturingWarningHandler handler;
  c10::WarningUtils::WarningHandlerGuard guard(&handler);
  Linear fc(opts(8, 4).delay_wgrad_compute(true).name("guarded_fc"));
  Linear other(opts(8, 4).delay_wgrad_compute(true).name("other_fc"));
  splitgrad::GuardedOptimizer<torch::optim::SGD> opt(fc->parameters(),
                                                     torch::optim::SGDOptions(0.1));
  torch::Tensor x = torch::randn({3, 8});
  other(x).sum().backward();
  opt.zero_grad();  // other's work does not feed this optimizer
  EXPECT_TRUE(handler.messages.empty());

  fc(x).sum().backward();
  opt.zero_grad();
  ASSERT_EQ(handler.messages.size(), 1u);
  EXPECT_CONTAINS(handler.messages[0], "zero_grad()");
  EXPECT_CONTAINS(handler.messages[0], "'guarded_fc'");
  EXPECT_EQ(handler.messages[0].find("other_fc"), std::string::npos);

  std::ostringstream out;
  torch::save(fc, out);
  ASSERT_EQ(handler.messages.size(), 2u);
  EXPECT_CONTAINS(handler.messages[1], "saving");
  EXPECT_CONTAINS(handler.messages[1], "'guarded_fc'");

  torch::nn::Sequential model(fc);  // Module::zero_grad reaches the layer's
  model->zero_grad();
  ASSERT_EQ(handler.messages.size(), 3u);
  EXPECT_CONTAINS(handler.messages[2], "zero_grad()");
  EXPECT_CONTAINS(handler.messages[2], "'guarded_fc'");

  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
  const torch::Tensor before = fc->weight.detach().clone();
  std::string msg = error_message([&] { opt.step(); });
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kWarn);
  EXPECT_CONTAINS(msg, "step()");
  EXPECT_CONTAINS(msg, "'guarded_fc'");
  EXPECT_TRUE(torch::equal(fc->weight, before)) << "a refused step changes nothing";
  EXPECT_EQ(fc->pending_wgrads(), 1) << "the work stays queued";

  splitgrad::backward_dw_all();
  handler.messages.clear();
  opt.step();
  splitgrad::check_pending_wgrads("a custom step");
  EXPECT_TRUE(handler.messages.empty());
}

// ---------------------------------------------------------------------------------------------
// 5. Messages

// As nn.Linear's: a delayed layer destroyed before its backward adds its gradients at once to the
// parameters that outlive it (nothing could run deferred work of it later), with no warning.
TEST_F(ApiTest, ALayerDeletedBeforeItsBackwardStillDeliversItsGradients) {
  CapturingWarningHandler handler;
  c10::WarningUtils::WarningHandlerGuard guard(&handler);
  torch::Tensor y, weight, bias, w_ref, b_ref;
  const torch::Tensor x = torch::randn({3, 4});
  {
    Linear fc(opts(4, 4).delay_wgrad_compute(true).name("short_lived"));
    weight = fc->weight;
    bias = fc->bias;
    w_ref = ref_param(weight);
    b_ref = ref_param(bias);
    y = fc(x);
  }
  const torch::Tensor g = torch::randn({3, 4});
  y.backward(g);
  F::linear(x, w_ref, b_ref).backward(g);
  EXPECT_TRUE(handler.messages.empty());
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  ASSERT_TRUE(weight.grad().defined() && bias.grad().defined());
  EXPECT_TRUE(torch::equal(weight.grad(), w_ref.grad()));
  EXPECT_TRUE(torch::equal(bias.grad(), b_ref.grad()));
}

// Likewise where the layer goes after the backward chose to defer and before it queues (another
// thread deleting it): accumulate_or_defer adds the gradients at once, the input activation
// recomputed first.
TEST_F(ApiTest, WorkOfALayerReleasedBeforeItIsQueuedIsAddedAtOnce) {
  splitgrad::LayerHandle handle("released");
  handle.release();
  torch::Tensor w = torch::randn({4, 4}).requires_grad_(), b = torch::randn({4}).requires_grad_();
  torch::Tensor w_ref = ref_param(w), b_ref = ref_param(b);
  const torch::Tensor h = torch::randn({3, 4}), dy = torch::randn({3, 4});
  {
    torch::NoGradGuard no_grad;  // as in a backward
    splitgrad::detail::accumulate_or_defer(handle.id(), /*delay=*/true, dy, h, torch::Tensor(),
                                           {{w, b, torch::Tensor(), torch::Tensor()}},
                                           "splitgrad.Linear", "gelu");
  }
  F::linear(torch::gelu(h, "tanh"), w_ref, b_ref).backward(dy);
  EXPECT_EQ(splitgrad::pending_wgrads(), 0);
  ASSERT_TRUE(w.grad().defined() && b.grad().defined());
  EXPECT_TRUE(torch::equal(w.grad(), w_ref.grad()));
  EXPECT_TRUE(torch::equal(b.grad(), b_ref.grad()));
}

TEST_F(ApiTest, UndefinedInputNamesTheLayer) {
  Linear fc(opts(4, 4).name("fc_in"));
  const std::string msg = error_message([&] { fc(torch::Tensor()); });
  EXPECT_CONTAINS(msg, "'fc_in'");
  EXPECT_CONTAINS(msg, "undefined tensor");
  EXPECT_CONTAINS(msg, "[*, 4]");
}

TEST_F(ApiTest, NonFloatingParamsDtypeNamesTheOption) {
  const std::string msg = error_message([] { Linear fc(opts(4, 4).params_dtype(torch::kLong)); });
  EXPECT_CONTAINS(msg, "params_dtype");
  EXPECT_CONTAINS(msg, "torch.int64");
}

TEST_F(ApiTest, SetMainGradChecksItsArguments) {
  Linear fc(opts(16, 8).fuse_wgrad_accumulation(true).name("fused"));
  std::string msg = error_message([&] {
    splitgrad::set_main_grad(fc->weight, torch::zeros({16, 8}));
  });
  EXPECT_CONTAINS(msg, "[8, 16]");
  EXPECT_CONTAINS(msg, "[16, 8]");
  msg = error_message([&] {
    splitgrad::set_main_grad(fc->weight, torch::zeros({8, 16}, torch::kDouble));
  });
  EXPECT_CONTAINS(msg, "torch.float32");
  EXPECT_CONTAINS(msg, "torch.float64");
  msg = error_message([&] { splitgrad::set_main_grad(fc->weight * 2, torch::zeros({8, 16})); });
  EXPECT_CONTAINS(msg, "leaf");
  EXPECT_FALSE(splitgrad::main_grad(fc->weight).defined()) << "nothing was set";
  splitgrad::set_main_grad(fc->weight, torch::zeros({8, 16}));
  EXPECT_TRUE(splitgrad::main_grad(fc->weight).defined());
  splitgrad::set_main_grad(fc->weight, torch::Tensor());  // clears
  EXPECT_FALSE(splitgrad::main_grad(fc->weight).defined());
}

TEST_F(ApiTest, ACloneHasANameOfItsOwn) {
  Linear fc(opts(4, 4).delay_wgrad_compute(true).name("orig"));
  auto copy = std::dynamic_pointer_cast<splitgrad::LinearImpl>(fc->clone());
  torch::Tensor x = torch::randn({2, 4});
  fc(x).sum().backward();
  copy->forward(x).sum().backward();
  const auto names = splitgrad::layers_with_pending_wgrads();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0], "orig");
  EXPECT_NE(names[1], "orig");
  EXPECT_CONTAINS(names[1], "orig#");
  splitgrad::backward_dw_all();
}

// ---------------------------------------------------------------------------------------------
// 6. Tied parameters listed once

struct TiedPair : torch::nn::Module {
  TiedPair() {
    a = register_module("a", Linear(opts(8, 8).delay_wgrad_compute(true)));
    b = register_module("b", Linear(opts(8, 8).delay_wgrad_compute(true)));
    b->tie_weight(a->weight);
  }
  Linear a{nullptr}, b{nullptr};
};

TEST_F(ApiTest, UniqueParametersListsATiedWeightOnce) {
  auto model = std::make_shared<TiedPair>();
  EXPECT_EQ(model->parameters().size(), 4u) << "libtorch lists the tied weight twice";
  const auto unique = splitgrad::unique_parameters(*model);
  ASSERT_EQ(unique.size(), 3u);
  EXPECT_TRUE(unique[0].is_same(model->a->weight));

  // One SGD step over the unique list equals plain autograd's.
  torch::Tensor w = ref_param(model->a->weight), ba = ref_param(model->a->bias),
                bb = ref_param(model->b->bias);
  torch::Tensor x = torch::randn({4, 8});
  model->b(model->a(x)).sum().backward();
  splitgrad::backward_dw_all();
  F::linear(F::linear(x, w, ba), w, bb).sum().backward();
  torch::optim::SGD opt(unique, 0.1), ref_opt({w, ba, bb}, 0.1);
  opt.step();
  ref_opt.step();
  EXPECT_TRUE(torch::equal(model->a->weight, w));
}

}  // namespace
