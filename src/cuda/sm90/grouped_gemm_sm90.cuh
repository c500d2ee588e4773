#pragma once
// One grouped product on CUTLASS's SM90 pointer-array kernel: the kernel type for a product's
// layouts, and run<Product>(), which fills each group's problem size, pointers and strides on the
// device from the split tensor and launches the persistent kernel. Included by one .cu per
// product (grouped_gemm_fprop.cu, ...), so nvcc compiles the heavy kernels in parallel.
//
// Layouts (rows r of group g start at offset o_g, the sum of the earlier splits):
//   fprop  M = r, N = out, K = in:  A = x[o_g:]  (row-major),   B = W_g as K-major,  D = y[o_g:]
//   dgrad  M = r, N = in,  K = out: A = dy[o_g:] (row-major),   B = W_g as N-major,  D = dx[o_g:]
//   wgrad  M = out, N = in, K = r:  A = dy[o_g:]ᵀ (M-major),    B = x[o_g:] (N-major),
//          D = C = target_g, beta = 1: the fp32 sum is added to the target in the epilogue
//          (beta = 0 where the targets are overwritten: fresh gradients).
#include <cute/tensor.hpp>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/group_tables.h"
#include "cuda/grouped_gemm.h"
#include "cuda/split_check.cuh"

namespace splitgrad::cuda::sm90 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int32_t, int32_t, int32_t>>;
using Problem = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

// The epilogue: CUTLASS's builder's, or with the pipeline a tuning variant sets (Pipeline =
// EpiloguePipeline): stages of C (the target read) and of D, and whether D reuses C's shared
// memory (the builder's choice for fp32 targets, which then wait for D's stores to drain).
template <int StagesC, int StagesD, bool ReuseSmemC>
struct EpiloguePipeline {};

template <class TileShape, class ClusterShape, class EpilogueTile, class ElementD,
          class EpilogueSchedule, class Pipeline>
struct EpilogueOf {  // the builder's
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using type = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile,
      float, float, ElementD, cutlass::layout::RowMajor*, kAlignD, ElementD,
      cutlass::layout::RowMajor*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
};

template <class TileShape, class ClusterShape, class EpilogueTile, class ElementD,
          class EpilogueSchedule, int StagesC, int StagesD, bool ReuseSmemC>
struct EpilogueOf<TileShape, ClusterShape, EpilogueTile, ElementD, EpilogueSchedule,
                  EpiloguePipeline<StagesC, StagesD, ReuseSmemC>> {
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kWarpGroups = EpilogueSchedule::NumEpilogueWarpGroups;
  static constexpr bool kCooperative =
      cute::is_same_v<EpilogueSchedule, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Policy = cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<
      StagesC, StagesD, cute::size(EpilogueTile{}) / (kCooperative ? 256 : 128), ReuseSmemC,
      /*DelayTmaStore=*/false, kWarpGroups>;
  using type = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      TileShape, EpilogueTile, float, float, ElementD, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>, Policy>::CollectiveOp;
};

template <class LayoutA, class LayoutB, class ElementD, class TileShape, class ClusterShape,
          bool Pingpong, class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto,
          class Pipeline = void>
struct GroupedKernel {
  static constexpr int kAlignAB = 16 / sizeof(Bf16);
  using KernelSchedule =
      cute::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      cute::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = typename EpilogueOf<TileShape, ClusterShape, EpilogueTile, ElementD,
                                       EpilogueSchedule, Pipeline>::type;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignAB, Bf16,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// A pointer-array stride has one dynamic entry, the leading dimension; the others are static.
template <class Stride>
__device__ Stride leading_dimension(int64_t ld) {
  Stride stride{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(stride))>>) {
    cute::get<1>(stride) = ld;
  } else {
    cute::get<0>(stride) = ld;
  }
  return stride;
}

// An overwriting wgrad gives a group without rows a product of kZeroRows zero rows: CUTLASS's
// kernel leaves the accumulators of a problem with no K uninitialised, and a problem with no
// tiles would leave the target unwritten.
constexpr int64_t kZeroRows = 8;

// The per-group arguments in the workspace, the zero rows of an overwriting wgrad, then the
// kernel's own workspace (which holds TMA descriptors: those need 128-byte alignment), each part
// 256-byte aligned.
struct WorkspaceLayout {
  size_t ptr_a = 0, ptr_b = 0, ptr_d = 0, stride_a = 0, stride_b = 0, stride_d = 0, problems = 0,
         zeros = 0, kernel = 0, total = 0;
  template <class K>
  static WorkspaceLayout of(const GroupedGemmArgs& args, size_t kernel_bytes) {
    const auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    const size_t g = static_cast<size_t>(args.groups);
    WorkspaceLayout w;
    size_t at = 0;
    const auto take = [&](size_t bytes) {
      const size_t here = at;
      at += aligned(bytes);
      return here;
    };
    w.ptr_a = take(g * sizeof(void*));
    w.ptr_b = take(g * sizeof(void*));
    w.ptr_d = take(g * sizeof(void*));
    w.stride_a = take(g * sizeof(typename K::StrideA));
    w.stride_b = take(g * sizeof(typename K::StrideB));
    w.stride_d = take(g * sizeof(typename K::StrideD));
    w.problems = take(g * sizeof(Problem));
    w.zeros = take(args.overwrite_targets ? static_cast<size_t>(kZeroRows) *
                                                static_cast<size_t>(std::max<int64_t>(
                                                    args.in_features, args.out_features)) *
                                                sizeof(Bf16)
                                          : 0);
    w.kernel = take(kernel_bytes);
    w.total = at;
    return w;
  }
};

template <class K>
struct GroupArrays {
  const Bf16** a;
  const Bf16** b;
  typename K::Gemm::ElementD** d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  Problem* problems;
  Bf16* zeros;  ///< kZeroRows x max(in, out), zeroed by the argument kernel (overwriting wgrad)
};

// One block; thread g fills group g. The table the arguments point into is written first, where
// it comes with the launch, then the splits are checked (cuda/split_check.cuh), before the GEMM
// reads a row.
template <class K, GroupedProduct kProduct>
__global__ void fill_group_arrays(GroupedGemmArgs args, GroupArrays<K> out, TableChunk table) {
  using ElementD = typename K::Gemm::ElementD;
  write_table_chunk(table);
  if (threadIdx.x == 0) check_splits_or_stop(args.splits, args.groups, args.rows);
  for (int64_t i = threadIdx.x; i < args.zeroed_word_count; i += blockDim.x) {
    args.zeroed_words[i] = 0;
  }
  // An overwriting wgrad with an expert without rows reads the zero rows: zeroed then only, in
  // 16-byte stores (the area is a multiple of 128 bytes: features are multiples of 8).
  bool zero_rows_read = false;
  if constexpr (kProduct == GroupedProduct::wgrad_accumulate) {
    for (int64_t g = threadIdx.x; args.overwrite_targets && g < args.groups; g += blockDim.x) {
      zero_rows_read |= args.splits[g] == 0 && args.targets[g] != nullptr;
    }
  }
  if (__syncthreads_or(zero_rows_read)) {
    const int64_t widest =
        args.in_features > args.out_features ? args.in_features : args.out_features;
    const int64_t stores = kZeroRows * widest * static_cast<int64_t>(sizeof(Bf16)) / 16;
    auto* const zeros = reinterpret_cast<uint4*>(out.zeros);
    for (int64_t i = threadIdx.x; i < stores; i += blockDim.x) zeros[i] = make_uint4(0, 0, 0, 0);
  }
  const auto* tokens = static_cast<const Bf16*>(args.tokens);
  const int64_t in = args.in_features, out_features = args.out_features;
  for (int64_t g = threadIdx.x; g < args.groups; g += blockDim.x) {
    int64_t offset = 0;  // groups are few (experts): the prefix sum per thread is cheap
    for (int64_t j = 0; j < g; ++j) offset += args.splits[j];
    const int rows = static_cast<int>(args.splits[g]);
    if (args.row_offsets != nullptr) {  // the splits are checked: no clamping needed
      args.row_offsets[g] = offset;
      if (g == args.groups - 1) args.row_offsets[g + 1] = offset + rows;
    }
    if constexpr (kProduct == GroupedProduct::fprop) {
      out.problems[g] = Problem(rows, out_features, in);
      out.a[g] = tokens + offset * in;
      out.b[g] = static_cast<const Bf16*>(args.weights[g]);
      out.d[g] = static_cast<ElementD*>(args.out) + offset * out_features;
      out.stride_a[g] = leading_dimension<typename K::StrideA>(in);
      out.stride_b[g] = leading_dimension<typename K::StrideB>(in);
      out.stride_d[g] = leading_dimension<typename K::StrideD>(out_features);
    } else if constexpr (kProduct == GroupedProduct::dgrad) {
      out.problems[g] = Problem(rows, in, out_features);
      out.a[g] = tokens + offset * out_features;
      out.b[g] = static_cast<const Bf16*>(args.weights[g]);
      out.d[g] = static_cast<ElementD*>(args.out) + offset * in;
      out.stride_a[g] = leading_dimension<typename K::StrideA>(out_features);
      out.stride_b[g] = leading_dimension<typename K::StrideB>(in);
      out.stride_d[g] = leading_dimension<typename K::StrideD>(in);
    } else {
      // A group without rows, or without a target in this launch, adds nothing: no tiles; but
      // overwritten, a group without rows gets the product of the zero rows: zeros.
      void* target = args.targets[g];
      const bool zero_rows = rows == 0 && target != nullptr && args.overwrite_targets;
      const bool runs = (rows > 0 && target != nullptr) || zero_rows;
      out.problems[g] = runs ? Problem(out_features, in, zero_rows ? int(kZeroRows) : rows)
                             : Problem(0, in, 0);
      out.a[g] = zero_rows ? out.zeros : tokens + offset * out_features;
      out.b[g] = zero_rows ? out.zeros : static_cast<const Bf16*>(args.tokens_in) + offset * in;
      out.d[g] = static_cast<ElementD*>(target);
      out.stride_a[g] = leading_dimension<typename K::StrideA>(out_features);
      out.stride_b[g] = leading_dimension<typename K::StrideB>(in);
      out.stride_d[g] = leading_dimension<typename K::StrideD>(in);
    }
  }
}

// wgrad's output tiles (out x in) are walked so that the larger operand panel stays in L2 while
// the smaller is read again: along N (the input features, x's) where out >= in, else along M.
// Along N on every shape measured 0.5% slower (DeepSeek-V3 gate/up, 7168 -> 4096) to 25% faster
// (Mixtral, 2x1 clusters) on the H200; where in > out, along M is 1.4-1.8% faster on an H100
// (qwen3 2048 -> 1536 ping-pong, DeepSeek-V3 gate/up cooperative; benchmarks/tune_grouped.py).
template <class K>
typename K::Gemm::Arguments kernel_arguments(const GroupedGemmArgs& args, GroupArrays<K> arrays,
                                             float beta) {
  typename K::Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(args.groups), arrays.problems, nullptr},
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
      {{}, const_cast<const typename K::Gemm::ElementD**>(arrays.d), arrays.stride_d, arrays.d,
       arrays.stride_d}};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = beta;
  arguments.hw_info.sm_count = args.multiprocessors;
  using Raster = decltype(arguments.scheduler.raster_order);
  if (args.product == GroupedProduct::wgrad_accumulate) {
    arguments.scheduler.raster_order =
        args.out_features >= args.in_features ? Raster::AlongN : Raster::AlongM;
  }
#ifdef SPLITGRAD_GROUPED_GEMM_TUNING
  // Tuning builds: the persistent scheduler's raster order (m|n) and swizzle (1, 2, 4, 8).
  if (const char* raster = std::getenv("SPLITGRAD_GROUPED_GEMM_RASTER")) {
    arguments.scheduler.raster_order = raster[0] == 'n' ? Raster::AlongN : Raster::AlongM;
  }
  if (const char* swizzle = std::getenv("SPLITGRAD_GROUPED_GEMM_SWIZZLE")) {
    arguments.scheduler.max_swizzle_size = std::atoi(swizzle);
  }
#endif
  return arguments;
}

template <class K>
GroupArrays<K> arrays_in(const GroupedGemmArgs& args, const WorkspaceLayout& w) {
  char* base = static_cast<char*>(args.workspace);
  return {reinterpret_cast<const Bf16**>(base + w.ptr_a),
          reinterpret_cast<const Bf16**>(base + w.ptr_b),
          reinterpret_cast<typename K::Gemm::ElementD**>(base + w.ptr_d),
          reinterpret_cast<typename K::StrideA*>(base + w.stride_a),
          reinterpret_cast<typename K::StrideB*>(base + w.stride_b),
          reinterpret_cast<typename K::StrideD*>(base + w.stride_d),
          reinterpret_cast<Problem*>(base + w.problems),
          reinterpret_cast<Bf16*>(base + w.zeros)};
}

template <class K>
size_t workspace_bytes(const GroupedGemmArgs& args) {
  const WorkspaceLayout none = WorkspaceLayout::of<K>(args, 0);
  GroupedGemmArgs sized = args;
  sized.workspace = nullptr;
  const size_t kernel_bytes =
      K::Gemm::get_workspace_size(kernel_arguments<K>(sized, arrays_in<K>(sized, none), 0.0f));
  return WorkspaceLayout::of<K>(args, kernel_bytes).total;
}

// The kernel's attributes (its shared memory, clusters of any size), which CUTLASS's adapter sets
// with two driver calls on every launch: set once per device here (host time).
template <class K>
cudaError_t configure_once() {
  static std::atomic<uint64_t> configured{0};  // bit d: device d's done (devices past 63: always)
  int device = 0;
  if (const cudaError_t error = cudaGetDevice(&device); error != cudaSuccess) return error;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (configured.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const auto* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<typename K::Kernel>);
  if (const cudaError_t error = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::Kernel::SharedStorageSize);
      error != cudaSuccess) {
    return error;
  }
  if (const cudaError_t error =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      error != cudaSuccess) {
    return error;
  }
  configured.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

template <class K, GroupedProduct kProduct>
cudaError_t run(const GroupedGemmArgs& args, cudaStream_t stream) {
  if (args.groups <= 0) return cudaSuccess;
  const WorkspaceLayout none = WorkspaceLayout::of<K>(args, 0);
  const bool adds = kProduct == GroupedProduct::wgrad_accumulate ? !args.overwrite_targets
                                                                  : args.add_to_out;
  const float beta = adds ? 1.0f : 0.0f;
  const size_t kernel_bytes =
      K::Gemm::get_workspace_size(kernel_arguments<K>(args, arrays_in<K>(args, none), beta));
  const WorkspaceLayout w = WorkspaceLayout::of<K>(args, kernel_bytes);
  const GroupArrays<K> arrays = arrays_in<K>(args, w);
  // grouped_gemm() writes a longer table itself; the launch's parameters stay within 4 KiB.
  if (args.table_word_count > TableChunk::kWords) return cudaErrorInvalidValue;
  static_assert(sizeof(GroupedGemmArgs) + sizeof(GroupArrays<K>) + sizeof(TableChunk) <= 4096);
  const TableChunk table = table_chunk(args.table_words, args.table_word_count, args.table);
  fill_group_arrays<K, kProduct><<<1, 256, 0, stream>>>(args, arrays, table);
  if (const cudaError_t launched = cudaGetLastError(); launched != cudaSuccess) return launched;
  const auto arguments = kernel_arguments<K>(args, arrays, beta);
  if (K::Gemm::can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
  // What GemmUniversalAdapter::initialize() and run() do, less the per-launch attribute calls.
  void* const kernel_workspace = static_cast<char*>(args.workspace) + w.kernel;
  if (K::Kernel::initialize_workspace(arguments, kernel_workspace, stream) !=
      cutlass::Status::kSuccess) {
    return cudaErrorNotSupported;
  }
  if (const cudaError_t error = configure_once<K>(); error != cudaSuccess) return error;
  typename K::Kernel::Params params =
      K::Kernel::to_underlying_arguments(arguments, kernel_workspace);
  using Cluster = typename K::Kernel::DispatchPolicy::ClusterShape;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cute::size<0>(Cluster{});
  cluster.val.clusterDim.y = cute::size<1>(Cluster{});
  cluster.val.clusterDim.z = cute::size<2>(Cluster{});
  cudaLaunchConfig_t config{};
  config.gridDim = K::Kernel::get_grid_shape(params);
  config.blockDim = K::Kernel::get_block_shape();
  config.dynamicSmemBytes = K::Kernel::SharedStorageSize;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  void* kernel_params[] = {&params};
  return cudaLaunchKernelExC(
      &config, reinterpret_cast<const void*>(&cutlass::device_kernel<typename K::Kernel>),
      kernel_params);
}

}  // namespace splitgrad::cuda::sm90
