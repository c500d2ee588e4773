// GradLedger on its own: no autograd engine. The tests drive it the way the autograd function and
// backward_dw() do (open_pass, note_autograd_contribution, expect_deferred, deferred_landed,
// deferred_dropped, autograd_pass_finished) with plain tensors, and count hook calls.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "core/grad_ledger.h"

namespace {

using splitgrad::core::GradLedger;
using splitgrad::core::PassId;

// Pass ids far from the autograd engine's graph-task ids (small, non-negative) and from the
// synthetic ids of work outside a graph task (negative).
constexpr PassId kPassA = 1'000'001;
constexpr PassId kPassB = 1'000'002;
constexpr PassId kPassC = 1'000'003;

class GradLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override { ledger().reset(); }
  void TearDown() override { ledger().reset(); }

  static GradLedger& ledger() { return GradLedger::instance(); }

  // Adds a hook to `param` that counts its calls and checks it is called with `param` itself.
  static std::shared_ptr<int> counting_hook(const at::Tensor& param, uint64_t* key = nullptr) {
    auto calls = std::make_shared<int>(0);
    const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
    const uint64_t k = ledger().add_hook(param, [calls, impl](const at::Tensor& p) {
      EXPECT_EQ(p.unsafeGetTensorImpl(), impl);
      ++*calls;
    });
    if (key != nullptr) *key = k;
    return calls;
  }
};

TEST_F(GradLedgerTest, AutogradOnlyPassFiresOnceWhenThePassFinishes) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  EXPECT_TRUE(ledger().open_pass(kPassA));
  EXPECT_FALSE(ledger().open_pass(kPassA)) << "a second open_pass of the same pass starts nothing";
  EXPECT_TRUE(ledger().pass_open(kPassA));
  ledger().note_autograd_contribution(p, kPassA);
  ledger().note_autograd_contribution(p, kPassA);  // a parameter used twice in the pass
  EXPECT_EQ(*calls, 0);
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(*calls, 1);
  EXPECT_FALSE(ledger().pass_open(kPassA));
  ledger().autograd_pass_finished(kPassA);  // already over: nothing more
  EXPECT_EQ(*calls, 1);
}

TEST_F(GradLedgerTest, FiresOnlyAfterThePassFinishedAndTheLastDeferredLanded) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  ledger().open_pass(kPassA);
  ledger().note_autograd_contribution(p, kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().expect_deferred(p, kPassA);
  EXPECT_EQ(ledger().pending_for(p), 2);

  ledger().deferred_landed(p, kPassA);  // pass still running, one still owed
  EXPECT_EQ(*calls, 0);
  ledger().autograd_pass_finished(kPassA);  // pass over, one still owed
  EXPECT_EQ(*calls, 0);
  EXPECT_EQ(ledger().pending_for(p), 1);
  ledger().deferred_landed(p, kPassA);  // the last one
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(ledger().pending_for(p), 0);
}

TEST_F(GradLedgerTest, DeferredLandingBeforeThePassEndsWaitsForTheEnd) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().deferred_landed(p, kPassA);
  EXPECT_EQ(*calls, 0) << "the pass may still make autograd contributions";
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(*calls, 1);
}

TEST_F(GradLedgerTest, HooksSeeWhichLayersRanInTheirPass) {
  at::Tensor p = torch::zeros({3});
  std::vector<std::pair<std::optional<bool>, std::optional<bool>>> seen;  // layers 7 and 3
  ledger().add_hook(p, [&](const at::Tensor&) {
    seen.emplace_back(GradLedger::firing_layer_ran(7), GradLedger::firing_layer_ran(3));
  });
  EXPECT_TRUE(ledger().hooks_registered());
  EXPECT_FALSE(GradLedger::firing_layer_ran(7).has_value()) << "outside a hook";

  ledger().open_pass(kPassA);  // layer 7 ran (twice) and queued work; p's gradient via autograd
  ledger().note_layer_ran(kPassA, 7);
  ledger().expect_deferred(p, kPassA);
  ledger().note_layer_ran(kPassA, 7);
  ledger().open_pass(kPassB);  // only ordinary ops: no layer ran
  ledger().note_autograd_contribution(p, kPassB);
  ledger().open_pass(kPassC);  // layer 3 ran, but p's gradient is not its
  ledger().note_layer_ran(kPassC, 3);
  ledger().note_autograd_contribution(p, kPassC);
  ledger().note_layer_ran(kPassA + 100, 3);  // a pass never opened: ignored
  for (PassId pass : {kPassB, kPassC, kPassA}) ledger().autograd_pass_finished(pass);
  ASSERT_EQ(seen.size(), 2u) << "A still owes its deferred item";
  EXPECT_EQ(seen[0], std::make_pair(std::optional<bool>(), std::optional<bool>()))
      << "pass B: no layer ran";
  EXPECT_EQ(seen[1], std::make_pair(std::optional<bool>(false), std::optional<bool>(true)));
  ledger().deferred_landed(p, kPassA);  // after its end: still known
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[2], std::make_pair(std::optional<bool>(true), std::optional<bool>(false)));
  EXPECT_FALSE(GradLedger::firing_layer_ran(7).has_value());
}

TEST_F(GradLedgerTest, EachParameterFiresOnItsOwn) {
  at::Tensor weight = torch::zeros({2, 3});
  at::Tensor bias = torch::zeros({2});
  at::Tensor other = torch::zeros({4});
  auto weight_calls = counting_hook(weight);
  auto bias_calls = counting_hook(bias);
  auto other_calls = counting_hook(other);
  ledger().open_pass(kPassA);
  ledger().expect_deferred(weight, kPassA);
  ledger().expect_deferred(bias, kPassA);
  ledger().note_autograd_contribution(other, kPassA);
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(*other_calls, 1);
  EXPECT_EQ(*weight_calls, 0);
  EXPECT_EQ(*bias_calls, 0);
  ledger().deferred_landed(weight, kPassA);
  EXPECT_EQ(*weight_calls, 1);
  EXPECT_EQ(*bias_calls, 0);
  ledger().deferred_landed(bias, kPassA);
  EXPECT_EQ(*bias_calls, 1);
  EXPECT_EQ(*weight_calls, 1);
  EXPECT_EQ(*other_calls, 1);
}

TEST_F(GradLedgerTest, SeveralPassesInterleavedFireOncePerPass) {
  // F0 F1 B0 B1 W1 W0: two passes owe `p` a deferred contribution each, settled in reverse order.
  at::Tensor p = torch::zeros({3});
  std::vector<int> fired_after;  // the number of landed items when each call happened
  int landed = 0;
  ledger().add_hook(p, [&](const at::Tensor&) { fired_after.push_back(landed); });
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().autograd_pass_finished(kPassA);
  ledger().open_pass(kPassB);
  ledger().note_autograd_contribution(p, kPassB);
  ledger().expect_deferred(p, kPassB);
  ledger().expect_deferred(p, kPassB);
  ledger().autograd_pass_finished(kPassB);
  EXPECT_EQ(ledger().pending_for(p), 3);
  EXPECT_TRUE(fired_after.empty());

  ++landed;
  ledger().deferred_landed(p, kPassB);
  EXPECT_TRUE(fired_after.empty()) << "pass B still owes one";
  ++landed;
  ledger().deferred_landed(p, kPassA);
  EXPECT_EQ(fired_after, std::vector<int>({2})) << "pass A is complete";
  ++landed;
  ledger().deferred_landed(p, kPassB);
  EXPECT_EQ(fired_after, std::vector<int>({2, 3})) << "pass B is complete";
  EXPECT_EQ(ledger().pending_for(p), 0);
}

TEST_F(GradLedgerTest, ThreePassesOpenAtOnceSettleIndependently) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  for (PassId pass : {kPassA, kPassB, kPassC}) {
    ledger().open_pass(pass);
    ledger().expect_deferred(p, pass);
  }
  EXPECT_TRUE(ledger().pass_open(kPassB));
  ledger().deferred_landed(p, kPassB);
  ledger().autograd_pass_finished(kPassB);
  EXPECT_EQ(*calls, 1);
  EXPECT_TRUE(ledger().pass_open(kPassA));
  EXPECT_TRUE(ledger().pass_open(kPassC));
  ledger().autograd_pass_finished(kPassC);
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(*calls, 1);
  ledger().deferred_landed(p, kPassC);
  ledger().deferred_landed(p, kPassA);
  EXPECT_EQ(*calls, 3);
}

TEST_F(GradLedgerTest, DroppedContributionMarksThePassIncomplete) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(ledger().dropped_for(p), 0);
  ledger().deferred_dropped(p, kPassA);
  EXPECT_EQ(ledger().pending_for(p), 1) << "a dropped contribution is no longer owed";
  EXPECT_EQ(ledger().dropped_for(p), 1);
  ledger().deferred_landed(p, kPassA);
  EXPECT_EQ(*calls, 0) << "the gradient of pass A is incomplete: no hook call for it";
  EXPECT_EQ(ledger().pending_for(p), 0);

  // The next pass is not affected.
  ledger().open_pass(kPassB);
  ledger().expect_deferred(p, kPassB);
  ledger().autograd_pass_finished(kPassB);
  ledger().deferred_landed(p, kPassB);
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(ledger().dropped_for(p), 1) << "the count of drops never decreases";
}

TEST_F(GradLedgerTest, DropsAreCountedWithoutHooksToo) {
  // A reducer compares the count before and after a step, hooks or not.
  at::Tensor p = torch::zeros({3});
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().autograd_pass_finished(kPassA);
  ledger().deferred_dropped(p, kPassA);
  EXPECT_EQ(ledger().pending_for(p), 0);
  EXPECT_EQ(ledger().dropped_for(p), 1) << "kept after the pass settled";
  EXPECT_EQ(ledger().dropped_for(torch::zeros({3})), 0);
}

TEST_F(GradLedgerTest, DroppedLastContributionSettlesThePassWithoutFiring) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().open_pass(kPassB);
  ledger().expect_deferred(p, kPassB);
  ledger().autograd_pass_finished(kPassA);
  ledger().autograd_pass_finished(kPassB);
  ledger().deferred_dropped(p, kPassA);
  EXPECT_EQ(*calls, 0);
  EXPECT_EQ(ledger().pending_for(p), 1);
  ledger().deferred_landed(p, kPassB);
  EXPECT_EQ(*calls, 1) << "only pass A lost a contribution";
}

TEST_F(GradLedgerTest, DroppedForAnUnknownPassIsIgnored) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  ledger().deferred_dropped(p, kPassC);
  EXPECT_EQ(ledger().pending_for(p), 0);
  ledger().autograd_pass_finished(kPassC);
  EXPECT_EQ(*calls, 0);
}

TEST_F(GradLedgerTest, UnexpectedLandingIsAnInternalError) {
  at::Tensor p = torch::zeros({3});
  EXPECT_THROW(ledger().deferred_landed(p, kPassA), c10::Error);
  ledger().open_pass(kPassA);
  ledger().note_autograd_contribution(p, kPassA);
  EXPECT_THROW(ledger().deferred_landed(p, kPassA), c10::Error) << "nothing deferred was expected";
}

TEST_F(GradLedgerTest, RemoveHook) {
  at::Tensor p = torch::zeros({3});
  uint64_t removed_key = 0;
  auto removed_calls = counting_hook(p, &removed_key);
  auto kept_calls = counting_hook(p);
  EXPECT_EQ(ledger().hook_count(p), 2u);
  EXPECT_TRUE(ledger().remove_hook(p, removed_key));
  EXPECT_FALSE(ledger().remove_hook(p, removed_key)) << "already removed";
  EXPECT_FALSE(ledger().remove_hook(torch::zeros({3}), removed_key)) << "another tensor";
  EXPECT_EQ(ledger().hook_count(p), 1u);

  ledger().open_pass(kPassA);
  ledger().note_autograd_contribution(p, kPassA);
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(*removed_calls, 0);
  EXPECT_EQ(*kept_calls, 1);
}

TEST_F(GradLedgerTest, HookRemovedWhilePassIsPendingDoesNotFire) {
  at::Tensor p = torch::zeros({3});
  uint64_t key = 0;
  auto calls = counting_hook(p, &key);
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().autograd_pass_finished(kPassA);
  ASSERT_TRUE(ledger().remove_hook(p, key));
  ledger().deferred_landed(p, kPassA);
  EXPECT_EQ(*calls, 0);
  EXPECT_EQ(ledger().hook_count(p), 0u);
}

TEST_F(GradLedgerTest, AddHookRejectsAnEmptyFunction) {
  EXPECT_THROW(ledger().add_hook(torch::zeros({1}), nullptr), c10::Error);
}

TEST_F(GradLedgerTest, PendingForCountsOverAllPassesAndParams) {
  at::Tensor p = torch::zeros({3});
  at::Tensor q = torch::zeros({3});
  EXPECT_EQ(ledger().pending_for(p), 0);
  ledger().expect_deferred(p, kPassA);
  ledger().expect_deferred(p, kPassB);
  ledger().expect_deferred(p, kPassB);
  ledger().expect_deferred(q, kPassB);
  EXPECT_EQ(ledger().pending_for(p), 3);
  EXPECT_EQ(ledger().pending_for(q), 1);
  EXPECT_TRUE(ledger().pass_open(kPassA)) << "expect_deferred tracks the pass";
  ledger().deferred_landed(p, kPassB);
  EXPECT_EQ(ledger().pending_for(p), 2);
  EXPECT_EQ(ledger().pending_for(q), 1);
}

TEST_F(GradLedgerTest, NoHooksMeansNothingToCallButCountsStillWork) {
  at::Tensor p = torch::zeros({3});
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(ledger().pending_for(p), 1);
  ledger().deferred_landed(p, kPassA);
  EXPECT_EQ(ledger().pending_for(p), 0);
  EXPECT_EQ(ledger().hook_count(p), 0u);
}

TEST_F(GradLedgerTest, ResetForgetsEverything) {
  at::Tensor p = torch::zeros({3});
  auto calls = counting_hook(p);
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().reset();
  EXPECT_EQ(ledger().hook_count(p), 0u);
  EXPECT_EQ(ledger().pending_for(p), 0);
  EXPECT_FALSE(ledger().pass_open(kPassA));
  ledger().autograd_pass_finished(kPassA);
  EXPECT_EQ(*calls, 0);
}

TEST_F(GradLedgerTest, NewTensorsInheritNothingFromDeadOnes) {
  // The ledger keys parameters by TensorImpl address and holds them weakly. A tensor that dies with
  // hooks and owed work must not pass either on to a later tensor, whatever address that one gets.
  // (While the ledger holds its weak reference the allocator cannot hand the same address out, so
  // true address reuse cannot be forced here; the test checks many fresh tensors instead.)
  auto calls = std::make_shared<int>(0);
  {
    at::Tensor dead = torch::zeros({3});
    ledger().add_hook(dead, [calls](const at::Tensor&) { ++*calls; });
    ledger().open_pass(kPassA);
    ledger().expect_deferred(dead, kPassA);
    ledger().note_autograd_contribution(dead, kPassA);
  }
  for (int i = 0; i < 64; ++i) {
    at::Tensor fresh = torch::zeros({3});
    EXPECT_EQ(ledger().hook_count(fresh), 0u);
    EXPECT_EQ(ledger().pending_for(fresh), 0);
    ledger().open_pass(kPassB);
    ledger().note_autograd_contribution(fresh, kPassB);
    ledger().autograd_pass_finished(kPassB);
  }
  ledger().autograd_pass_finished(kPassA);  // the dead tensor's pass ends: nobody to call
  EXPECT_EQ(*calls, 0);
}

TEST_F(GradLedgerTest, LiveParametersKeepTheirStateAndDeadOnesAreSwept) {
  // A parameter's state outlives its settled passes (re-creating it each step was host time)
  // without holding a weak reference to it, and what dead parameters leave behind stays bounded
  // however many come and go.
  std::vector<at::Tensor> live;
  for (int i = 0; i < 10; ++i) live.push_back(torch::zeros({3}));
  const auto step = [&](const std::vector<at::Tensor>& params, PassId pass) {
    ledger().open_pass(pass);
    ledger().expect_deferred(params, pass);
    ledger().autograd_pass_finished(pass);
    ledger().deferred_landed(params, pass);
  };
  const size_t weak_refs_before = live[1].weak_use_count();
  auto calls = counting_hook(live[0]);
  for (int s = 0; s < 5; ++s) step(live, kPassA + s);
  EXPECT_EQ(*calls, 5);
  EXPECT_EQ(ledger().tracked_params(), live.size());
  // Settled, without hooks: no weak reference left (torch.utils.swap_tensors refuses those);
  // nor once the last hook of a parameter is removed.
  EXPECT_EQ(live[1].weak_use_count(), weak_refs_before);
  uint64_t key = 0;
  counting_hook(live[1], &key);
  EXPECT_GT(live[1].weak_use_count(), weak_refs_before);
  EXPECT_TRUE(ledger().remove_hook(live[1], key));
  EXPECT_EQ(live[1].weak_use_count(), weak_refs_before);
  for (int i = 0; i < 1000; ++i) {
    at::Tensor transient = torch::zeros({3});
    step({transient}, kPassB);
    step({transient}, kPassC);  // a second pass finds its state
    EXPECT_EQ(ledger().pending_for(transient), 0);
  }
  EXPECT_LE(ledger().tracked_params(), 2 * 64 + live.size());
  step(live, kPassA);
  EXPECT_EQ(*calls, 6);
  for (const at::Tensor& p : live) EXPECT_EQ(ledger().pending_for(p), 0);
}

TEST_F(GradLedgerTest, DeadParametersHooksAreFreed) {
  // A hook may hold something big (a reducer's bucket); once its parameter is gone it can never
  // run, so the ledger lets it go (at the latest when the next hook is added).
  auto held = std::make_shared<int>(0);
  {
    at::Tensor dead = torch::zeros({3});
    ledger().add_hook(dead, [held](const at::Tensor&) {});
    EXPECT_EQ(held.use_count(), 2);
  }
  at::Tensor alive = torch::zeros({3});
  ledger().add_hook(alive, [](const at::Tensor&) {});
  EXPECT_EQ(held.use_count(), 1) << "the dead parameter's hook was freed";
  EXPECT_EQ(ledger().hook_count(alive), 1u);
}

TEST_F(GradLedgerTest, AThrowingHookDoesNotStopTheOthers) {
  // All of a settled pass's hooks run even if one throws (a skipped one would never run for that
  // pass); the first exception reaches the caller afterwards.
  at::Tensor p = torch::zeros({3});
  at::Tensor q = torch::zeros({3});
  ledger().add_hook(p, [](const at::Tensor&) { throw std::runtime_error("reducer failed"); });
  auto p_calls = counting_hook(p);
  auto q_calls = counting_hook(q);
  ledger().open_pass(kPassA);
  ledger().note_autograd_contribution(p, kPassA);
  ledger().note_autograd_contribution(q, kPassA);
  EXPECT_THROW(ledger().autograd_pass_finished(kPassA), std::runtime_error);
  EXPECT_EQ(*p_calls, 1);
  EXPECT_EQ(*q_calls, 1);
  EXPECT_FALSE(ledger().pass_open(kPassA));
}

// Runs `fn` on another thread and fails (ending the process) if it has not returned within a few
// seconds: a deadlock would otherwise hang the suite.
void run_or_abort_on_deadlock(const std::function<void()>& fn) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread([fn, done] {
    fn();
    done->set_value();
  }).detach();
  if (finished.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "GradLedger deadlocked: a hook that calls back into the ledger hung\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  finished.get();
}

TEST_F(GradLedgerTest, HooksCanCallBackIntoTheLedger) {
  at::Tensor p = torch::zeros({3});
  at::Tensor q = torch::zeros({3});
  int p_calls = 0;
  int q_calls = 0;
  int64_t pending_seen = -1;
  uint64_t self_key = 0;
  // p's hook queries the ledger, removes itself, adds a hook to q, and completes q's pass.
  self_key = ledger().add_hook(p, [&](const at::Tensor& param) {
    ++p_calls;
    pending_seen = ledger().pending_for(param);
    EXPECT_EQ(ledger().hook_count(param), 1u);
    EXPECT_TRUE(ledger().remove_hook(param, self_key));
    ledger().add_hook(q, [&](const at::Tensor&) { ++q_calls; });
    ledger().deferred_landed(q, kPassA);
  });
  ledger().open_pass(kPassA);
  ledger().expect_deferred(p, kPassA);
  ledger().expect_deferred(p, kPassB);
  ledger().expect_deferred(q, kPassA);
  ledger().autograd_pass_finished(kPassA);
  run_or_abort_on_deadlock([&] { ledger().deferred_landed(p, kPassA); });
  EXPECT_EQ(p_calls, 1);
  EXPECT_EQ(pending_seen, 1) << "pass B's item is still owed";
  EXPECT_EQ(ledger().hook_count(p), 0u);
  EXPECT_EQ(q_calls, 1) << "the hook added from inside p's hook saw q's pass complete";
}

TEST_F(GradLedgerTest, HookStartingAndFinishingAPassFromInsideAHook) {
  at::Tensor p = torch::zeros({3});
  int calls = 0;
  ledger().add_hook(p, [&](const at::Tensor& param) {
    if (++calls == 1) {  // the first call opens and finishes another pass on the same parameter
      ledger().open_pass(kPassB);
      ledger().note_autograd_contribution(param, kPassB);
      ledger().autograd_pass_finished(kPassB);
    }
  });
  ledger().open_pass(kPassA);
  ledger().note_autograd_contribution(p, kPassA);
  run_or_abort_on_deadlock([&] { ledger().autograd_pass_finished(kPassA); });
  EXPECT_EQ(calls, 2);
}

TEST_F(GradLedgerTest, ConcurrentPassesFromSeveralThreads) {
  // Each thread runs passes of its own on a shared parameter; every pass fires exactly once.
  at::Tensor p = torch::zeros({3});
  std::atomic<int> calls{0};
  ledger().add_hook(p, [&](const at::Tensor&) { calls.fetch_add(1); });
  constexpr int kThreads = 4;
  constexpr int kPasses = 200;
  run_or_abort_on_deadlock([&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPasses; ++i) {
          const PassId pass = 2'000'000 + t * kPasses + i;
          ledger().open_pass(pass);
          ledger().note_autograd_contribution(p, pass);
          ledger().expect_deferred(p, pass);
          ledger().autograd_pass_finished(pass);
          ledger().deferred_landed(p, pass);
        }
      });
    }
    for (auto& thread : threads) thread.join();
  });
  EXPECT_EQ(calls.load(), kThreads * kPasses);
  EXPECT_EQ(ledger().pending_for(p), 0);
}

}  // namespace
