// WgradStore on its own: layers, per-layer FIFOs, taking and restoring items. Items here are plain
// data (the store never runs them); `input` carries a tag so the tests can check the order.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/wgrad_store.h"

namespace {

using splitgrad::core::DeferredWgrad;
using splitgrad::core::LayerId;
using splitgrad::core::PassId;
using splitgrad::core::WgradStore;

constexpr PassId kPass0 = 1'000'100;
constexpr PassId kPass1 = 1'000'101;

class WgradStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // take_all() and pending() are global: start from an empty store.
    ASSERT_EQ(store().pending(), 0u) << "an earlier test left deferred work in the store";
  }
  void TearDown() override {
    for (LayerId layer : layers_) store().release_layer(layer);
  }

  static WgradStore& store() { return WgradStore::instance(); }

  LayerId layer(const std::string& name) {
    layers_.push_back(store().register_layer(name));
    return layers_.back();
  }

  // An item whose input holds `tag`, feeding `weight` (and `bias` when defined).
  static DeferredWgrad item(LayerId layer, PassId pass, int tag, const at::Tensor& weight,
                            const at::Tensor& bias = {}) {
    DeferredWgrad w;
    w.layer = layer;
    w.pass = pass;
    w.input = torch::full({1, 1}, static_cast<double>(tag));
    w.grad_output = torch::zeros({1, 1});
    w.weight = splitgrad::core::weak_ref(weight);
    w.bias = splitgrad::core::weak_ref(bias);
    return w;
  }

  static std::vector<int> tags(const std::vector<DeferredWgrad>& items) {
    std::vector<int> out;
    for (const auto& w : items) out.push_back(static_cast<int>(w.input.item<double>()));
    return out;
  }

  std::vector<LayerId> layers_;
  at::Tensor weight_ = torch::zeros({1, 1});
};

TEST_F(WgradStoreTest, RegisterRenameRelease) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  EXPECT_NE(a, 0);
  EXPECT_NE(a, b);
  EXPECT_TRUE(store().is_registered(a));
  EXPECT_EQ(store().layer_name(a), "fc_a");
  store().rename_layer(a, "fc_renamed");
  EXPECT_EQ(store().layer_name(a), "fc_renamed");

  EXPECT_TRUE(store().release_layer(a).empty());
  EXPECT_FALSE(store().is_registered(a));
  EXPECT_EQ(store().layer_name(a), "fc_renamed") << "a released layer keeps its name for messages";
  EXPECT_EQ(store().layer_name(9'999'999), "<unregistered layer 9999999>");
  EXPECT_THROW(store().rename_layer(a, "again"), c10::Error);
  EXPECT_TRUE(store().release_layer(a).empty()) << "releasing twice is harmless";
  EXPECT_TRUE(store().is_registered(b));
  EXPECT_FALSE(store().is_registered(0)) << "0 is 'no layer'";
}

TEST_F(WgradStoreTest, RanUntrackedIsNotedPerRegisteredLayer) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  store().note_ran_untracked(a);
  EXPECT_TRUE(store().ran_untracked(a));
  EXPECT_FALSE(store().ran_untracked(b));
  store().release_layer(a);
  EXPECT_FALSE(store().ran_untracked(a)) << "forgotten with the layer";
  store().note_ran_untracked(a);  // unregistered: ignored
  EXPECT_FALSE(store().ran_untracked(a));
}

TEST_F(WgradStoreTest, PushToAnUnregisteredLayerThrowsAndQueuesNothing) {
  const LayerId a = layer("fc_gone");
  store().release_layer(a);
  try {
    store().push(item(a, kPass0, 1, weight_));
    FAIL() << "push to a released layer did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not registered"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store().pending(), 0u);
}

TEST_F(WgradStoreTest, FifoPerLayerAndPendingCounts) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(b, kPass0, 2, weight_));
  store().push(item(a, kPass1, 3, weight_));
  store().push(item(b, kPass1, 4, weight_));
  EXPECT_EQ(store().pending(), 4u);
  EXPECT_EQ(store().pending(a), 2u);
  EXPECT_EQ(store().pending(b), 2u);
  EXPECT_EQ(store().pending(12345678), 0u) << "an unknown layer has nothing pending";

  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({1}));
  EXPECT_EQ(store().pending(a), 1u);
  EXPECT_EQ(store().pending(), 3u);
  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({3}));
  EXPECT_TRUE(store().take_oldest_pass(a).empty());
  EXPECT_EQ(store().pending(a), 0u);
  EXPECT_EQ(tags(store().take_oldest_pass(b)), std::vector<int>({2}));
  EXPECT_EQ(tags(store().take_oldest_pass(b)), std::vector<int>({4}));
  EXPECT_EQ(store().pending(), 0u);
}

TEST_F(WgradStoreTest, PushAssignsIncreasingSequenceNumbers) {
  const LayerId a = layer("fc_a");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(a, kPass0, 2, weight_));
  auto taken = store().take_oldest_pass(a);
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_GT(taken[0].seq, 0u);
  EXPECT_LT(taken[0].seq, taken[1].seq);
}

TEST_F(WgradStoreTest, TakeOldestPassTakesAllItemsOfThatPass) {
  // A layer applied three times in one forward queues three items in one pass.
  const LayerId a = layer("fc_reused");
  for (int tag : {1, 2, 3}) store().push(item(a, kPass0, tag, weight_));
  store().push(item(a, kPass1, 4, weight_));
  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({1, 2, 3}));
  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({4}));
}

TEST_F(WgradStoreTest, TakeOldestPassWithPassesInterleaved) {
  // Two backward passes running concurrently interleave their items in one layer's queue.
  const LayerId a = layer("fc_interleaved");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(a, kPass1, 2, weight_));
  store().push(item(a, kPass0, 3, weight_));
  store().push(item(a, kPass1, 4, weight_));
  store().push(item(a, kPass0, 5, weight_));
  auto first = store().take_oldest_pass(a);
  EXPECT_EQ(tags(first), std::vector<int>({1, 3, 5}));
  for (const auto& w : first) EXPECT_EQ(w.pass, kPass0);
  EXPECT_EQ(store().pending(a), 2u);
  auto second = store().take_oldest_pass(a);
  EXPECT_EQ(tags(second), std::vector<int>({2, 4}));
  for (const auto& w : second) EXPECT_EQ(w.pass, kPass1);
  EXPECT_EQ(store().pending(), 0u);
}

TEST_F(WgradStoreTest, TakePassTakesThatPassWhateverIsOlder) {
  // A pipeline's W step names its micro-batch's pass, which need not be the oldest.
  constexpr PassId kPass2 = 1'000'102;
  const LayerId a = layer("fc_named_pass");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(a, kPass1, 2, weight_));
  store().push(item(a, kPass2, 3, weight_));
  store().push(item(a, kPass1, 4, weight_));  // interleaved with the newer pass
  EXPECT_EQ(store().pending_passes(a), std::vector<PassId>({kPass0, kPass1, kPass2}));
  EXPECT_EQ(tags(store().take_pass(a, kPass1)), std::vector<int>({2, 4}));
  EXPECT_EQ(store().pending(a), 2u);
  EXPECT_EQ(store().pending(), 2u);
  EXPECT_EQ(store().pending_passes(a), std::vector<PassId>({kPass0, kPass2}));
  EXPECT_TRUE(store().take_pass(a, kPass1).empty()) << "a pass is taken once";
  EXPECT_TRUE(store().take_pass(a, 424242).empty()) << "an unknown pass has nothing";
  EXPECT_TRUE(store().take_pass(12345678, kPass0).empty()) << "an unknown layer has nothing";
  EXPECT_EQ(tags(store().take_pass(a, kPass2)), std::vector<int>({3}));
  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({1}));
  EXPECT_TRUE(store().pending_passes(a).empty());
  EXPECT_EQ(store().pending(), 0u);
}

TEST_F(WgradStoreTest, TakeAllIsGloballyOldestFirst) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  store().push(item(b, kPass0, 1, weight_));
  store().push(item(a, kPass0, 2, weight_));
  store().push(item(b, kPass1, 3, weight_));
  store().push(item(a, kPass1, 4, weight_));
  store().push(item(a, kPass0, 5, weight_));
  EXPECT_EQ(tags(store().take_all()), std::vector<int>({1, 2, 3, 4, 5}));
  EXPECT_EQ(store().pending(), 0u);
  EXPECT_EQ(store().pending(a), 0u);
  EXPECT_TRUE(store().take_all().empty());
}

TEST_F(WgradStoreTest, RestorePutsItemsBackInOrder) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  for (int tag = 1; tag <= 6; ++tag) {
    store().push(item(tag % 2 ? a : b, tag <= 3 ? kPass0 : kPass1, tag, weight_));
  }
  auto all = store().take_all();
  ASSERT_EQ(tags(all), std::vector<int>({1, 2, 3, 4, 5, 6}));
  std::reverse(all.begin(), all.end());  // the order they come back in does not matter
  store().restore(std::move(all));
  EXPECT_EQ(store().pending(), 6u);
  EXPECT_EQ(store().pending(a), 3u);
  EXPECT_EQ(store().pending(b), 3u);
  EXPECT_EQ(tags(store().take_all()), std::vector<int>({1, 2, 3, 4, 5, 6}));
}

TEST_F(WgradStoreTest, RestoreInterleavesWithItemsQueuedMeanwhile) {
  const LayerId a = layer("fc_a");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(a, kPass0, 2, weight_));
  auto taken = store().take_oldest_pass(a);
  store().push(item(a, kPass1, 3, weight_));  // queued while the taken items were out
  store().restore(std::move(taken));
  EXPECT_EQ(store().pending(a), 3u);
  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({1, 2}));
  EXPECT_EQ(tags(store().take_oldest_pass(a)), std::vector<int>({3}));
}

TEST_F(WgradStoreTest, RestoreAfterTheLayerWasReleasedDropsItsItems) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(b, kPass0, 2, weight_));
  auto all = store().take_all();
  store().release_layer(a);
  store().restore(std::move(all));
  EXPECT_EQ(store().pending(), 1u);
  EXPECT_EQ(tags(store().take_all()), std::vector<int>({2}));
}

TEST_F(WgradStoreTest, LayersWithPendingFilteredByParams) {
  at::Tensor w1 = torch::zeros({1, 1});
  at::Tensor b1 = torch::zeros({1});
  at::Tensor w2 = torch::zeros({1, 1});
  at::Tensor unrelated = torch::zeros({1, 1});
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  const LayerId idle = layer("fc_idle");
  (void)idle;
  store().push(item(b, kPass0, 1, w2));
  store().push(item(a, kPass0, 2, w1, b1));

  EXPECT_EQ(store().layers_with_pending(), std::vector<LayerId>({a, b}))
      << "registration order, only layers with work";
  EXPECT_EQ(store().layers_with_pending({w2}), std::vector<LayerId>({b}));
  EXPECT_EQ(store().layers_with_pending({b1}), std::vector<LayerId>({a})) << "the bias counts";
  EXPECT_EQ(store().layers_with_pending({w1, w2}), std::vector<LayerId>({a, b}));
  EXPECT_TRUE(store().layers_with_pending({unrelated}).empty());
  EXPECT_TRUE(store().layers_with_pending({torch::zeros({1, 1})}).empty())
      << "same values, different tensor";
  EXPECT_EQ(store().layers_with_pending({at::Tensor(), w2}), std::vector<LayerId>({b}))
      << "undefined entries are skipped";
}

TEST_F(WgradStoreTest, ItemTargetsAreWeightThenBias) {
  at::Tensor w = torch::zeros({1, 1});
  at::Tensor b = torch::zeros({1});
  auto with_bias = item(1, kPass0, 0, w, b).targets();
  ASSERT_EQ(with_bias.size(), 2u);
  EXPECT_TRUE(with_bias[0].is_same(w));
  EXPECT_TRUE(with_bias[1].is_same(b));
  auto without_bias = item(1, kPass0, 0, w).targets();
  ASSERT_EQ(without_bias.size(), 1u);
  EXPECT_TRUE(without_bias[0].is_same(w));
}

TEST_F(WgradStoreTest, ReleaseLayerReturnsItsItemsInOrder) {
  const LayerId a = layer("fc_a");
  const LayerId b = layer("fc_b");
  store().push(item(a, kPass0, 1, weight_));
  store().push(item(b, kPass0, 2, weight_));
  store().push(item(a, kPass1, 3, weight_));
  auto released = store().release_layer(a);
  EXPECT_EQ(tags(released), std::vector<int>({1, 3}));
  EXPECT_EQ(store().pending(), 1u);
  EXPECT_EQ(store().pending(a), 0u);
  EXPECT_FALSE(store().is_registered(a));
  EXPECT_EQ(store().layers_with_pending(), std::vector<LayerId>({b}));
  EXPECT_EQ(tags(store().take_all()), std::vector<int>({2}));
}

TEST_F(WgradStoreTest, ReleasedItemsKeepTheirTensorsOnlyAsLongAsTheCallerDoes) {
  // The store holds the stashed tensors strongly while queued and gives them up with the items.
  const LayerId a = layer("fc_a");
  std::optional<splitgrad::core::WeakTensor> weak_input;
  {
    DeferredWgrad w = item(a, kPass0, 1, weight_);
    weak_input.emplace(w.input.getIntrusivePtr());
    store().push(std::move(w));
  }
  EXPECT_FALSE(weak_input->expired()) << "queued: the store keeps the input alive";
  { auto released = store().release_layer(a); }
  EXPECT_TRUE(weak_input->expired()) << "released and dropped: the input is freed";
}

}  // namespace
