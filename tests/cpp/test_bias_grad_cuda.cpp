// The grouped bias-gradient kernel (src/cuda/bias_grad.cu) called directly, against per-group fp32
// sums from ATen: imbalanced and empty groups, skipped and shared targets, clamped splits, both
// modes, every target type, groups finished in parallel (distinct targets) or in group order,
// counters left zero for the next launch; and one group is bitwise the single-layer kernel. Needs
// a GPU (skipped without one).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <gtest/gtest.h>

#include <vector>

#include "cuda/bias_grad.h"

namespace {

using splitgrad::cuda::GroupedBiasGradArgs;

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_16F;
  }
}

class GroupedBiasGrad : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the kernel cannot run here";
  }

  // Runs the kernel on dy's rows split by `splits` into `targets` (an undefined tensor: null).
  static void run(const at::Tensor& dy, const std::vector<int64_t>& splits,
                  const std::vector<at::Tensor>& targets, bool accumulate,
                  bool distinct_targets = false) {
    const auto device = dy.options();
    std::vector<int64_t> pointers;
    for (const at::Tensor& t : targets) {
      pointers.push_back(t.defined() ? reinterpret_cast<int64_t>(t.data_ptr()) : 0);
    }
    const at::Tensor splits_device = at::tensor(splits, at::kLong).to(dy.device());
    const at::Tensor targets_device = at::tensor(pointers, at::kLong).to(dy.device());
    GroupedBiasGradArgs args;
    args.dy = dy.data_ptr();
    args.dy_type = cuda_type(dy.scalar_type());
    args.rows = dy.size(0), args.cols = dy.size(1), args.ld = dy.stride(0);
    args.splits = splits_device.data_ptr<int64_t>();
    args.groups = static_cast<int64_t>(splits.size());
    args.targets = reinterpret_cast<void* const*>(targets_device.data_ptr<int64_t>());
    for (const at::Tensor& t : targets) {
      if (t.defined()) args.target_type = cuda_type(t.scalar_type());
    }
    args.accumulate = accumulate;
    args.distinct_targets = distinct_targets;
    args.multiprocessors = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const at::Tensor workspace =
        at::empty({static_cast<int64_t>(splitgrad::cuda::grouped_bias_grad_workspace_bytes(
                      args.rows, args.cols, args.groups, args.multiprocessors))},
                  device.dtype(at::kByte));
    args.workspace = workspace.data_ptr();
    ASSERT_EQ(splitgrad::cuda::grouped_bias_grad(args, at::cuda::getCurrentCUDAStream()),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(at::cuda::getCurrentCUDAStream()), cudaSuccess);
  }

  // The body of BadSplitsAreClampedNotReadOutOfBounds, for one mode.
  void bad_splits_are_clamped(bool distinct);

  // Σ of dy's rows [begin, end) in fp64, as fp32.
  static at::Tensor rows_sum(const at::Tensor& dy, int64_t begin, int64_t end) {
    return dy.narrow(0, begin, end - begin).to(at::kDouble).sum(0).to(at::kFloat);
  }
};

TEST_F(GroupedBiasGrad, ImbalancedEmptyAndSkippedGroupsAccumulateIntoFp32) {
  for (const bool distinct : {false, true})
    for (const int64_t cols : {1536, 1000, 7}) {  // 16-byte loads, and the scalar tail
      const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
      const at::Tensor dy = at::randn({5000, cols}, options);
      const std::vector<int64_t> splits = {3, 0, 4000, 1, 0, 990, 6};
      std::vector<at::Tensor> targets, start;
      for (size_t g = 0; g < splits.size(); ++g) {
        start.push_back(at::randn({cols}, options.dtype(at::kFloat)));
        targets.push_back(start.back().clone());
      }
      targets[5] = at::Tensor();  // skipped
      run(dy, splits, targets, /*accumulate=*/true, distinct);
      int64_t offset = 0;
      for (size_t g = 0; g < splits.size(); offset += splits[g], ++g) {
        if (!targets[g].defined()) continue;
        const at::Tensor want = start[g] + rows_sum(dy, offset, offset + splits[g]);
        if (splits[g] == 0) {
          EXPECT_TRUE(at::equal(targets[g], start[g])) << "group " << g << " has no rows";
        } else {
          EXPECT_TRUE(at::allclose(targets[g], want, 1e-4, 1e-3))
              << "group " << g << " cols " << cols << " distinct " << distinct;
        }
      }
    }
}

TEST_F(GroupedBiasGrad, DeterministicAndOneGroupIsTheSingleLayerKernelBitwise) {
  const at::Tensor dy =
      at::randn({8192, 2048}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  const std::vector<int64_t> splits = {8192};
  at::Tensor grouped = at::zeros({2048}, dy.options().dtype(at::kFloat));
  run(dy, splits, {grouped}, /*accumulate=*/true);
  at::Tensor grouped_distinct = at::zeros({2048}, dy.options().dtype(at::kFloat));
  run(dy, splits, {grouped_distinct}, /*accumulate=*/true, /*distinct_targets=*/true);

  at::Tensor single = at::zeros({2048}, dy.options().dtype(at::kFloat));
  splitgrad::cuda::BiasGradArgs args;
  args.dy = dy.data_ptr(), args.dy_type = CUDA_R_16BF;
  args.tokens = 8192, args.features = 2048, args.ld = 2048;
  args.target = single.data_ptr(), args.target_type = CUDA_R_32F, args.accumulate = true;
  args.multiprocessors = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const at::Tensor workspace = at::empty(
      {static_cast<int64_t>(
          splitgrad::cuda::bias_grad_workspace_bytes(8192, 2048, args.multiprocessors) / 4)},
      dy.options().dtype(at::kFloat));
  args.workspace = workspace.data_ptr<float>();
  ASSERT_EQ(splitgrad::cuda::bias_grad(args, at::cuda::getCurrentCUDAStream()), cudaSuccess);
  EXPECT_TRUE(at::equal(grouped, single));
  EXPECT_TRUE(at::equal(grouped_distinct, single));

  // The same sums whichever block finishes a group.
  const std::vector<int64_t> imbalanced = {100, 7000, 0, 1092};
  std::vector<at::Tensor> first, second;
  for (int g = 0; g < 4; ++g) {
    first.push_back(at::zeros({2048}, dy.options().dtype(at::kFloat)));
    second.push_back(at::zeros({2048}, dy.options().dtype(at::kFloat)));
  }
  run(dy, imbalanced, first, /*accumulate=*/true);
  run(dy, imbalanced, second, /*accumulate=*/true, /*distinct_targets=*/true);
  for (int g = 0; g < 4; ++g) EXPECT_TRUE(at::equal(first[g], second[g])) << "group " << g;
}

TEST_F(GroupedBiasGrad, GroupsSharingATargetAddUpInOrder) {
  const at::Tensor dy =
      at::randn({3000, 256}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  const at::Tensor shared = at::randn({256}, dy.options());
  const at::Tensor start = shared.clone();
  const at::Tensor other = at::zeros({256}, dy.options());
  run(dy, {1000, 500, 1500}, {shared, other, shared}, /*accumulate=*/true);
  const at::Tensor want = start + rows_sum(dy, 0, 1000) + rows_sum(dy, 1500, 3000);
  EXPECT_TRUE(at::allclose(shared, want, 1e-4, 1e-3));
  EXPECT_TRUE(at::allclose(other, rows_sum(dy, 1000, 1500), 1e-4, 1e-3));

  // More groups than one tile of 256 (offsets scan, sharing across tiles): 600 groups of 5 rows,
  // groups 10, 300 and 599 sharing one target.
  const std::vector<int64_t> splits(600, 5);
  std::vector<at::Tensor> targets;
  for (int g = 0; g < 600; ++g) targets.push_back(at::zeros({256}, dy.options()));
  targets[300] = targets[599] = targets[10];
  run(dy, splits, targets, /*accumulate=*/true);
  for (int g = 0; g < 600; ++g) {
    const at::Tensor want =
        g == 10 || g == 300 || g == 599
            ? rows_sum(dy, 50, 55) + rows_sum(dy, 1500, 1505) + rows_sum(dy, 2995, 3000)
            : rows_sum(dy, 5 * g, 5 * g + 5);
    EXPECT_TRUE(at::allclose(targets[g], want, 1e-4, 1e-3)) << "group " << g;
  }
}

TEST_F(GroupedBiasGrad, LowPrecisionTargetsAreRoundedAsTheSingleLayerKernel) {
  for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    const at::Tensor dy = at::randn({4096, 512}, at::TensorOptions().device(at::kCUDA).dtype(type));
    const std::vector<int64_t> splits = {1024, 0, 3072};
    // Overwrite: target = the fp32 sum rounded once; an empty group's target becomes zeros.
    std::vector<at::Tensor> written, written_distinct;
    for (int g = 0; g < 3; ++g) {
      written.push_back(at::full({512}, 7.0, dy.options()));
      written_distinct.push_back(at::full({512}, 7.0, dy.options()));
    }
    run(dy, splits, written, /*accumulate=*/false);
    run(dy, splits, written_distinct, /*accumulate=*/false, /*distinct_targets=*/true);
    EXPECT_TRUE(at::allclose(written[0].to(at::kFloat), rows_sum(dy, 0, 1024), 1e-2, 1e-2));
    EXPECT_TRUE(at::equal(written[1], at::zeros({512}, dy.options())));
    EXPECT_TRUE(at::allclose(written[2].to(at::kFloat), rows_sum(dy, 1024, 4096), 1e-2, 1e-2));
    for (int g = 0; g < 3; ++g) EXPECT_TRUE(at::equal(written_distinct[g], written[g])) << g;
    // Accumulate: the sum rounded to the target's type, then added (as `grad.add_(db)` would).
    const at::Tensor start = at::randn({512}, dy.options());
    std::vector<at::Tensor> added = {start.clone(), at::Tensor(), at::Tensor()};
    run(dy, {1024, 0, 3072}, added, /*accumulate=*/true);
    EXPECT_TRUE(at::equal(added[0], start + written[0]));
  }
}

TEST_F(GroupedBiasGrad, DistinctTargetsOfManyGroupsCrowdedIntoOneChunk) {
  // 700 groups, most of them empty and ~640 within the first chunk of rows: a block counts and
  // finishes its groups in rounds of 256; empty groups are zeroed (overwrite) or kept.
  const at::Tensor dy =
      at::randn({2000, 300}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  std::vector<int64_t> splits(700, 0);
  for (size_t g = 0; g < splits.size(); g += 10) splits[g] = 1;  // 70 rows in 70 groups
  splits[699] = 2000 - 70;
  for (const bool accumulate : {true, false}) {
    std::vector<at::Tensor> targets;
    for (int g = 0; g < 700; ++g) targets.push_back(at::full({300}, 2.0, dy.options()));
    targets[350] = at::Tensor();  // skipped
    run(dy, splits, targets, accumulate, /*distinct_targets=*/true);
    int64_t offset = 0;
    for (size_t g = 0; g < splits.size(); offset += splits[g], ++g) {
      if (!targets[g].defined()) continue;
      const at::Tensor sum = rows_sum(dy, offset, offset + splits[g]);
      EXPECT_TRUE(at::allclose(targets[g], accumulate ? sum + 2.0 : sum, 1e-4, 1e-3))
          << "group " << g << " accumulate " << accumulate;
    }
  }
}

TEST_F(GroupedBiasGrad, BadSplitsAreClampedNotReadOutOfBounds) {
  for (const bool distinct : {false, true}) {
    SCOPED_TRACE(distinct ? "distinct targets" : "targets finished in group order");
    bad_splits_are_clamped(distinct);
  }
}

void GroupedBiasGrad::bad_splits_are_clamped(bool distinct) {
  const at::Tensor dy =
      at::randn({1000, 64}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  std::vector<at::Tensor> targets;
  for (int g = 0; g < 4; ++g) targets.push_back(at::zeros({64}, dy.options()));
  // A negative split counts as 0; a split past the end is cut at the last row.
  run(dy, {-5, 400, 100000, 30}, targets, /*accumulate=*/true, distinct);
  EXPECT_TRUE(at::equal(targets[0], at::zeros({64}, dy.options())));
  EXPECT_TRUE(at::allclose(targets[1], rows_sum(dy, 0, 400), 1e-4, 1e-3));
  EXPECT_TRUE(at::allclose(targets[2], rows_sum(dy, 400, 1000), 1e-4, 1e-3));
  EXPECT_TRUE(at::equal(targets[3], at::zeros({64}, dy.options())));
  // Splits summing to fewer rows: the rest belongs to no group.
  std::vector<at::Tensor> short_targets = {at::zeros({64}, dy.options())};
  run(dy, {250}, short_targets, /*accumulate=*/true, distinct);
  EXPECT_TRUE(at::allclose(short_targets[0], rows_sum(dy, 0, 250), 1e-4, 1e-3));
  // No rows at all: accumulate adds nothing, overwrite writes zeros.
  const at::Tensor none = dy.narrow(0, 0, 0);
  std::vector<at::Tensor> kept = {at::ones({64}, dy.options())};
  run(none, {0}, kept, /*accumulate=*/true, distinct);
  EXPECT_TRUE(at::equal(kept[0], at::ones({64}, dy.options())));
  run(none, {0}, kept, /*accumulate=*/false, distinct);
  EXPECT_TRUE(at::equal(kept[0], at::zeros({64}, dy.options())));
}

TEST_F(GroupedBiasGrad, GivenRowOffsetsTheCountersAreLeftZeroForTheNextLaunch) {
  // As the grouped GEMM's argument kernel hands them over: row offsets already on the device and
  // counters zeroed once; the kernel leaves them zero, so launches reusing them stay right.
  const at::Tensor dy =
      at::randn({6000, 1000}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  const std::vector<int64_t> splits = {0, 2500, 7, 0, 3400, 93, 0};
  const auto groups = static_cast<int64_t>(splits.size());
  const at::Tensor splits_device = at::tensor(splits, at::kLong).to(dy.device());
  const at::Tensor offsets =
      at::cat({at::zeros({1}, splits_device.options()), splits_device.cumsum(0)});
  const int64_t counter_count = splitgrad::cuda::grouped_bias_grad_tile_counters(1000, groups);
  ASSERT_EQ(counter_count, 4 * (1 + groups));  // 4 tiles of 256 columns
  const at::Tensor counters = at::zeros({counter_count}, splits_device.options().dtype(at::kInt));
  const int multiprocessors = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(splitgrad::cuda::grouped_bias_grad_workspace_bytes(
                    6000, 1000, groups, multiprocessors))},
                dy.options().dtype(at::kByte));
  for (const bool distinct : {true, false, true}) {
    for (const bool accumulate : {true, false}) {
      std::vector<at::Tensor> targets;
      std::vector<int64_t> pointers;
      for (int64_t g = 0; g < groups; ++g) {
        targets.push_back(at::full({1000}, 3.0, dy.options().dtype(at::kFloat)));
        pointers.push_back(reinterpret_cast<int64_t>(targets.back().data_ptr()));
      }
      const at::Tensor targets_device = at::tensor(pointers, at::kLong).to(dy.device());
      GroupedBiasGradArgs args;
      args.dy = dy.data_ptr(), args.dy_type = CUDA_R_16BF;
      args.rows = 6000, args.cols = 1000, args.ld = 1000;
      args.splits = splits_device.data_ptr<int64_t>();
      args.row_offsets = offsets.data_ptr<int64_t>();
      args.tile_counters = reinterpret_cast<unsigned*>(counters.data_ptr<int>());
      args.groups = groups;
      args.targets = reinterpret_cast<void* const*>(targets_device.data_ptr<int64_t>());
      args.target_type = CUDA_R_32F;
      args.accumulate = accumulate;
      args.distinct_targets = distinct;
      args.multiprocessors = multiprocessors;
      args.workspace = workspace.data_ptr();
      ASSERT_EQ(splitgrad::cuda::grouped_bias_grad(args, at::cuda::getCurrentCUDAStream()),
                cudaSuccess);
      int64_t offset = 0;
      for (int64_t g = 0; g < groups; offset += splits[g], ++g) {
        const at::Tensor sum = rows_sum(dy, offset, offset + splits[g]);
        const at::Tensor want = accumulate ? sum + 3.0 : sum;
        EXPECT_TRUE(at::allclose(targets[g], want, 1e-4, 1e-3))
            << "group " << g << " distinct " << distinct << " accumulate " << accumulate;
      }
      EXPECT_EQ(counters.count_nonzero().item<int64_t>(), 0)
          << "distinct " << distinct << " accumulate " << accumulate;
    }
  }
}

// Checked before any launch: runs without a GPU too.
TEST(GroupedBiasGradArgs, BadArgumentsAreRefused) {
  GroupedBiasGradArgs args;
  args.rows = 4, args.cols = 8, args.ld = 4, args.groups = 1;  // ld < cols
  EXPECT_EQ(splitgrad::cuda::grouped_bias_grad(args, nullptr), cudaErrorInvalidValue);
  args.ld = 8;  // no splits, targets or workspace
  EXPECT_EQ(splitgrad::cuda::grouped_bias_grad(args, nullptr), cudaErrorInvalidValue);
  args.groups = 0;  // nothing to do
  EXPECT_EQ(splitgrad::cuda::grouped_bias_grad(args, nullptr), cudaSuccess);
}

}  // namespace
