// db = Σ_tokens dy: a deterministic column sum in two launches (see bias_grad.h); grouped, in one
// (grouped_column_sums: the last block to write a group's partials finishes it, as
// finish_column_sums does).
//   column_partial_sums: block (32 x 8 threads) = 256 columns x `rows_per_block` rows; each thread
//     owns 8 adjacent columns and every 8th row of the block's rows, summing in fp32 registers;
//     the 8 row lanes are then added in order through shared memory -> partials[chunk][column].
//   finish_column_sums: 8 row lanes per column add every 8th chunk's partials, then the lanes are
//     added in order (a fixed order: deterministic), and the sum written
//     target = sum, or target += sum rounded first to the target's type (as `grad.add_(db)` would,
//     so deferred and immediate bias gradients are bit-identical).

#include <algorithm>

#include "cuda/bias_grad.h"
#include "cuda/float_convert.cuh"

namespace splitgrad::cuda {
namespace {

constexpr int kColsPerThread = 8;
constexpr int kThreadsX = 32;
constexpr int kRowLanes = 8;
constexpr int kColsPerBlock = kColsPerThread * kThreadsX;  // 256
constexpr int kMinRowsPerBlock = 64;                       // 8 rows per thread
constexpr int kFillThreads = 256;

// Adds 8 adjacent elements starting at `p` (16-byte aligned) into acc, with 16-byte loads.
template <typename T>
__device__ __forceinline__ void add8_vectorized(const T* p, float (&acc)[kColsPerThread]) {
  constexpr int kPerLoad = 16 / sizeof(T);
  static_assert(kColsPerThread % kPerLoad == 0, "whole 16-byte loads");
#pragma unroll
  for (int part = 0; part < kColsPerThread / kPerLoad; ++part) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + part);
    const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPerLoad; ++j) acc[part * kPerLoad + j] += to_float(values[j]);
  }
}

// Adds rows [row_begin + threadIdx.y, row_end) step kRowLanes of dy's columns col0 .. col0 + 7
// into acc (this thread's share of a tile).
template <typename T>
__device__ __forceinline__ void sum_rows(const T* __restrict__ dy, int64_t row_begin,
                                         int64_t row_end, int64_t features, int64_t ld,
                                         int64_t col0, bool vectorized,
                                         float (&acc)[kColsPerThread]) {
  // Two loops rather than a branch per row, so the vectorised one unrolls into 8 loads in flight.
  if (vectorized && col0 + kColsPerThread <= features) {
#pragma unroll 8
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowLanes) {
      add8_vectorized(dy + r * ld + col0, acc);
    }
  } else if (col0 < features) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowLanes) {
      const T* row = dy + r * ld + col0;
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        if (col0 + j < features) acc[j] += to_float(row[j]);
      }
    }
  }
}

// lanes[y][c]: row lane y's sum of the block's column c; +1 breaks the 8-way bank conflicts.
using TileLanes = float[kRowLanes][kColsPerBlock + 1];

// The block's column sums: each thread's acc into `lanes`, then thread (x, y) adds the 8 lanes of
// column y * 32 + x in order. Every thread of the block must call it.
__device__ __forceinline__ float add_row_lanes(const float (&acc)[kColsPerThread],
                                               TileLanes& lanes) {
#pragma unroll
  for (int j = 0; j < kColsPerThread; ++j)
    lanes[threadIdx.y][threadIdx.x * kColsPerThread + j] = acc[j];
  __syncthreads();
  const int c = threadIdx.y * kThreadsX + threadIdx.x;  // 0..255: one column per thread
  float sum = 0.0f;
#pragma unroll
  for (int y = 0; y < kRowLanes; ++y) sum += lanes[y][c];
  return sum;
}

template <typename T>
__global__ void column_partial_sums(const T* __restrict__ dy, int64_t tokens, int64_t features,
                                    int64_t ld, int64_t rows_per_block, bool vectorized,
                                    float* __restrict__ partials) {
  const int64_t col0 =
      (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * kColsPerThread;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = min(tokens, row_begin + rows_per_block);
  float acc[kColsPerThread] = {};
  sum_rows(dy, row_begin, row_end, features, ld, col0, vectorized, acc);
  __shared__ TileLanes lanes;
  const float sum = add_row_lanes(acc, lanes);
  const int64_t col =
      static_cast<int64_t>(blockIdx.x) * kColsPerBlock + threadIdx.y * kThreadsX + threadIdx.x;
  if (col < features) partials[static_cast<int64_t>(blockIdx.y) * features + col] = sum;
}

// Block (32 x 8 threads) = 32 columns: row lane y adds the partials of chunks y, y + 8, ... (32
// adjacent columns per load, so each load is one 128-byte line), then lane 0 adds the 8 lanes in
// order. Bounded serial work per thread even when there are hundreds of chunks.
template <typename Out>
__global__ void finish_column_sums(const float* __restrict__ partials, int64_t chunks,
                                   int64_t features, Out* __restrict__ target, bool accumulate) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x;
  float sum = 0.0f;
  if (col < features) {
#pragma unroll 4
    for (int64_t chunk = threadIdx.y; chunk < chunks; chunk += kRowLanes)
      sum += partials[chunk * features + col];
  }
  __shared__ float lanes[kRowLanes][kThreadsX + 1];
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= features) return;
  float total = 0.0f;
#pragma unroll
  for (int y = 0; y < kRowLanes; ++y) total += lanes[y][threadIdx.x];
  const Out rounded = from_float<Out>(total);
  target[col] = accumulate ? from_float<Out>(to_float(target[col]) + to_float(rounded)) : rounded;
}

template <typename Out>
__global__ void fill_zero_or_keep(int64_t features, Out* target, bool accumulate) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col < features && !accumulate) target[col] = from_float<Out>(0.0f);
}

// ---- Grouped: the bias gradients of experts over consecutive segments of dy's rows ----

constexpr int kOffsetThreads = 256;

// offsets[0] = 0, offsets[g + 1] = min(rows, Σ_{h <= g} clamp(splits[h], 0, rows)): monotone and
// within [0, rows] whatever the splits, so no later kernel reads outside dy. One block, a tile of
// 256 groups at a time: an inclusive scan per warp by shuffles, then across the 8 warps.
// It also zeroes the `counter_count` tile counters of the grouped_column_sums that follows.
__global__ void group_offsets(const int64_t* __restrict__ splits, int64_t groups, int64_t rows,
                              int64_t* __restrict__ offsets, unsigned* __restrict__ tile_counters,
                              int64_t counter_count) {
  __shared__ int64_t warp_totals[kOffsetThreads / 32];
  __shared__ int64_t carry;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t i = threadIdx.x; i < counter_count; i += kOffsetThreads) tile_counters[i] = 0;
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    carry = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < groups; base += kOffsetThreads) {
    const int64_t g = base + threadIdx.x;
    int64_t sum = g < groups ? min(max(splits[g], int64_t{0}), rows) : 0;
#pragma unroll
    for (int step = 1; step < 32; step *= 2) {
      const int64_t below = __shfl_up_sync(0xffffffffu, sum, step);
      if (lane >= step) sum += below;
    }
    if (lane == 31) warp_totals[warp] = sum;
    __syncthreads();
    for (int w = 0; w < warp; ++w) sum += warp_totals[w];
    // sum <= 256 * rows and carry <= rows: no overflow for any tensor that fits in memory.
    if (g < groups) offsets[g + 1] = min(rows, carry + sum);
    __syncthreads();  // every thread has read carry and warp_totals
    if (threadIdx.x == kOffsetThreads - 1) carry = min(rows, carry + sum);
    __syncthreads();
  }
}

// Column `col` of group g's sum, from its partials (rows first + g .. last + g of `partials`, one
// per chunk the group's rows [begin, end) overlap), written to `target`: 8 lanes, lane y adding
// the chunks first + y, first + y + 8, ..., then the lanes in order (the sums of
// finish_column_sums, bit for bit). L2 loads: the partials come from other blocks.
template <typename Out>
__device__ __forceinline__ void finish_group(const float* __restrict__ partials, int64_t features,
                                             int64_t col, int64_t g, int64_t begin, int64_t end,
                                             int64_t rows_per_block, Out* target, bool accumulate) {
  const int64_t first = begin / rows_per_block, last_chunk = (end - 1) / rows_per_block;
  float lane_sums[kRowLanes] = {};
  for (int64_t c = first; c <= last_chunk; c += kRowLanes) {
#pragma unroll
    for (int y = 0; y < kRowLanes; ++y) {
      if (c + y <= last_chunk) lane_sums[y] += __ldcg(&partials[(c + y + g) * features + col]);
    }
  }
  float total = 0.0f;
#pragma unroll
  for (int y = 0; y < kRowLanes; ++y) total += lane_sums[y];
  const Out rounded = from_float<Out>(total);
  target[col] = accumulate ? from_float<Out>(to_float(target[col]) + to_float(rounded)) : rounded;
}

// grid (column tiles, chunks): block (x, chunk) sums rows [chunk * rows_per_block, +
// rows_per_block) of its 256 columns like column_partial_sums, but apart for each group the rows
// belong to, into partials[chunk + g] (a distinct row for each chunk and group that overlap: for
// two such pairs with chunk < chunk' and g > g', group g' would have a row after one of group g).
// Groups with a null target are not summed. Then each group is finished (its partials added in a
// fixed order and written) by the last block to write partials of it, found by counting:
// - distinct targets: a counter per column tile and group, so the groups finish in parallel,
//   each as soon as its own chunks are done (no tail of one block adding every group's);
// - targets shared by groups (tied experts): the last block of the column tile (a counter per
//   tile) finishes every group, in group order, so a shared target gets its groups one after the
//   other.
// Groups without rows get zeros (overwrite) from the tile's last block. Counters are zero at the
// launch and left zero. One launch, no second pass to schedule.
template <typename T, typename Out>
__global__ void grouped_column_sums(const T* __restrict__ dy, int64_t rows, int64_t features,
                                    int64_t ld, int64_t rows_per_block, bool vectorized,
                                    const int64_t* __restrict__ offsets, int64_t groups,
                                    void* const* __restrict__ targets, bool accumulate,
                                    bool distinct_targets, float* __restrict__ partials,
                                    unsigned* __restrict__ tile_counters) {
  const int64_t col0 =
      (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * kColsPerThread;
  const int t = threadIdx.y * kThreadsX + threadIdx.x;  // 0..255: one column per thread
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + t;
  const int64_t chunk = blockIdx.y;
  const int64_t chunk_begin = chunk * rows_per_block;
  const int64_t chunk_end = min(rows, chunk_begin + rows_per_block);
  // The first group ending after chunk_begin (groups if none): offsets[g + 1] > chunk_begin.
  int64_t lo = 0, hi = groups;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid + 1] > chunk_begin) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  __shared__ TileLanes lanes;
  // Every test below depends on g only: the whole block takes the same path (__syncthreads).
  int64_t touched_end = lo;  // this block's groups: [lo, touched_end)
  for (; touched_end < groups && offsets[touched_end] < chunk_end; ++touched_end) {
    const int64_t g = touched_end;
    const int64_t begin = max(offsets[g], chunk_begin), end = min(offsets[g + 1], chunk_end);
    if (begin >= end || targets[g] == nullptr) continue;
    float acc[kColsPerThread] = {};
    sum_rows(dy, begin, end, features, ld, col0, vectorized, acc);
    __syncthreads();  // the previous group's lanes have been read
    const float sum = add_row_lanes(acc, lanes);
    if (col < features) partials[(chunk + g) * features + col] = sum;
  }

  // Publish this block's partials, then count it.
  __threadfence();
  __syncthreads();
  if (distinct_targets) {
    // Thread i counts group base + i; the groups this block completes are finished here.
    unsigned* const group_counters = tile_counters + gridDim.x + blockIdx.x * groups;
    __shared__ bool completes[kColsPerBlock];
    for (int64_t base = lo; base < touched_end; base += kColsPerBlock) {
      const int64_t g = base + t;
      bool completed = false;
      if (g < touched_end && targets[g] != nullptr) {
        const int64_t begin = offsets[g], end = offsets[g + 1];
        if (max(begin, chunk_begin) < min(end, chunk_end)) {
          const auto chunks_of_group =
              static_cast<unsigned>((end - 1) / rows_per_block - begin / rows_per_block + 1);
          completed = atomicAdd(&group_counters[g], 1u) == chunks_of_group - 1;
        }
      }
      completes[t] = completed;
      __syncthreads();
      const int64_t count = min(static_cast<int64_t>(kColsPerBlock), touched_end - base);
      for (int64_t i = 0; i < count; ++i) {
        if (!completes[i]) continue;
        __threadfence();
        const int64_t done = base + i;
        if (t == 0) group_counters[done] = 0;  // for the next launch that reuses the memory
        if (col < features) {
          finish_group(partials, features, col, done, offsets[done], offsets[done + 1],
                       rows_per_block, static_cast<Out*>(targets[done]), accumulate);
        }
      }
      __syncthreads();  // completes[] read before the next round writes it
    }
    if (accumulate) return;  // a group without rows adds nothing: no tile pass needed
  }

  __shared__ bool last;
  if (t == 0) last = atomicAdd(&tile_counters[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (t == 0) tile_counters[blockIdx.x] = 0;  // for the next launch that reuses the memory
  if (col >= features) return;
  for (int64_t g = 0; g < groups; ++g) {
    void* const target_memory = targets[g];
    if (target_memory == nullptr) continue;
    Out* const target = static_cast<Out*>(target_memory);
    const int64_t begin = offsets[g], end = offsets[g + 1];
    if (begin >= end) {  // no rows: nothing to add, zeros to write
      if (!accumulate) target[col] = from_float<Out>(0.0f);
      continue;
    }
    if (!distinct_targets) {
      finish_group(partials, features, col, g, begin, end, rows_per_block, target, accumulate);
    }
  }
}

struct Tiling {
  int64_t column_blocks, chunks, rows_per_block;
};

Tiling tiling_for(int64_t tokens, int64_t features, int multiprocessors) {
  Tiling t;
  t.column_blocks = (features + kColsPerBlock - 1) / kColsPerBlock;
  // About eight blocks (2048 threads) per SM in all, to keep enough loads in flight; each chunk
  // at least kMinRowsPerBlock rows (a block reading less costs more to schedule than to run, and
  // every chunk is one more row of partials to add), and a multiple of the 8 row lanes.
  const int64_t wanted_blocks = 8 * static_cast<int64_t>(std::max(multiprocessors, 1));
  const int64_t max_chunks =
      std::max<int64_t>(1, (tokens + kMinRowsPerBlock - 1) / kMinRowsPerBlock);
  const int64_t chunks =
      std::clamp<int64_t>((wanted_blocks + t.column_blocks - 1) / t.column_blocks, 1, max_chunks);
  const int64_t rows = (tokens + chunks - 1) / chunks;
  t.rows_per_block = std::max<int64_t>(kRowLanes, (rows + kRowLanes - 1) / kRowLanes * kRowLanes);
  t.chunks = std::max<int64_t>(1, (tokens + t.rows_per_block - 1) / t.rows_per_block);
  return t;
}

template <typename T, typename Out>
cudaError_t launch(const BiasGradArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) {
    const int fill_blocks = static_cast<int>((a.features + kFillThreads - 1) / kFillThreads);
    fill_zero_or_keep<Out><<<fill_blocks, kFillThreads, 0, stream>>>(
        a.features, static_cast<Out*>(a.target), a.accumulate);
    return cudaGetLastError();
  }
  const Tiling t = tiling_for(a.tokens, a.features, a.multiprocessors);
  const bool vectorized = reinterpret_cast<uintptr_t>(a.dy) % 16 == 0 &&
                          (a.ld * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(t.column_blocks), static_cast<unsigned>(t.chunks));
  const dim3 block(kThreadsX, kRowLanes);
  column_partial_sums<T><<<grid, block, 0, stream>>>(static_cast<const T*>(a.dy), a.tokens,
                                                     a.features, a.ld, t.rows_per_block, vectorized,
                                                     a.workspace);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  const unsigned finish_blocks = static_cast<unsigned>((a.features + kThreadsX - 1) / kThreadsX);
  finish_column_sums<Out><<<finish_blocks, block, 0, stream>>>(
      a.workspace, t.chunks, a.features, static_cast<Out*>(a.target), a.accumulate);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_input(const BiasGradArgs& a, cudaStream_t stream) {
  switch (a.target_type) {
    case CUDA_R_32F:
      return launch<T, float>(a, stream);
    case CUDA_R_16BF:
      return launch<T, __nv_bfloat16>(a, stream);
    case CUDA_R_16F:
      return launch<T, __half>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// The grouped workspace: the groups + 1 row offsets, a counter per column tile and one per column
// tile and group (grouped_bias_grad_tile_counters()), then (chunks + groups - 1) x cols partials.
struct GroupedLayout {
  Tiling tiling;
  size_t offsets_bytes, counters_bytes, partials_bytes;
};

GroupedLayout grouped_layout(int64_t rows, int64_t cols, int64_t groups, int multiprocessors) {
  const auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  GroupedLayout l;
  l.tiling = tiling_for(rows, cols, multiprocessors);
  l.offsets_bytes = aligned(static_cast<size_t>(groups + 1) * sizeof(int64_t));
  l.counters_bytes = aligned(static_cast<size_t>(grouped_bias_grad_tile_counters(cols, groups)) *
                             sizeof(unsigned));
  l.partials_bytes = static_cast<size_t>((l.tiling.chunks + groups - 1) * cols) * sizeof(float);
  return l;
}

template <typename T, typename Out>
cudaError_t grouped_launch(const GroupedBiasGradArgs& a, cudaStream_t stream) {
  const GroupedLayout l = grouped_layout(a.rows, a.cols, a.groups, a.multiprocessors);
  char* const workspace = static_cast<char*>(a.workspace);
  auto* const partials = reinterpret_cast<float*>(workspace + l.offsets_bytes + l.counters_bytes);
  const int64_t* offsets = a.row_offsets;
  unsigned* counters = a.tile_counters;
  if (offsets == nullptr) {
    auto* const computed = reinterpret_cast<int64_t*>(workspace);
    counters = reinterpret_cast<unsigned*>(workspace + l.offsets_bytes);
    group_offsets<<<1, kOffsetThreads, 0, stream>>>(
        a.splits, a.groups, a.rows, computed, counters,
        grouped_bias_grad_tile_counters(a.cols, a.groups));
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
    offsets = computed;
  }
  const bool vectorized = reinterpret_cast<uintptr_t>(a.dy) % 16 == 0 &&
                          (a.ld * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(l.tiling.column_blocks),
                  static_cast<unsigned>(l.tiling.chunks));
  grouped_column_sums<T, Out><<<grid, dim3(kThreadsX, kRowLanes), 0, stream>>>(
      static_cast<const T*>(a.dy), a.rows, a.cols, a.ld, l.tiling.rows_per_block, vectorized,
      offsets, a.groups, a.targets, a.accumulate, a.distinct_targets, partials, counters);
  return cudaGetLastError();
}

template <typename T>
cudaError_t grouped_launch_for_input(const GroupedBiasGradArgs& a, cudaStream_t stream) {
  switch (a.target_type) {
    case CUDA_R_32F:
      return grouped_launch<T, float>(a, stream);
    case CUDA_R_16BF:
      return grouped_launch<T, __nv_bfloat16>(a, stream);
    case CUDA_R_16F:
      return grouped_launch<T, __half>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

size_t bias_grad_workspace_bytes(int64_t tokens, int64_t features, int multiprocessors) {
  if (tokens == 0 || features == 0) return 0;
  return static_cast<size_t>(tiling_for(tokens, features, multiprocessors).chunks * features) *
         sizeof(float);
}

cudaError_t bias_grad(const BiasGradArgs& args, cudaStream_t stream) {
  if (args.features == 0) return cudaSuccess;
  if (args.tokens < 0 || args.features < 0 || (args.tokens > 0 && args.ld < args.features)) {
    return cudaErrorInvalidValue;
  }
  switch (args.dy_type) {
    case CUDA_R_32F:
      return launch_for_input<float>(args, stream);
    case CUDA_R_16BF:
      return launch_for_input<__nv_bfloat16>(args, stream);
    case CUDA_R_16F:
      return launch_for_input<__half>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

size_t grouped_bias_grad_workspace_bytes(int64_t rows, int64_t cols, int64_t groups,
                                         int multiprocessors) {
  if (rows < 0 || cols <= 0 || groups <= 0) return 0;
  const GroupedLayout l = grouped_layout(rows, cols, groups, multiprocessors);
  return l.offsets_bytes + l.counters_bytes + l.partials_bytes;
}

int64_t grouped_bias_grad_tile_counters(int64_t cols, int64_t groups) {
  if (cols <= 0 || groups < 0) return 0;
  return (cols + kColsPerBlock - 1) / kColsPerBlock * (1 + groups);
}

cudaError_t grouped_bias_grad(const GroupedBiasGradArgs& args, cudaStream_t stream) {
  if (args.rows < 0 || args.cols < 0 || args.groups < 0 || (args.rows > 0 && args.ld < args.cols)) {
    return cudaErrorInvalidValue;
  }
  if (args.cols == 0 || args.groups == 0) return cudaSuccess;
  if (args.splits == nullptr || args.targets == nullptr || args.workspace == nullptr ||
      (args.rows > 0 && args.dy == nullptr) ||
      reinterpret_cast<uintptr_t>(args.workspace) % 16 != 0 ||
      (args.row_offsets != nullptr && args.tile_counters == nullptr)) {
    return cudaErrorInvalidValue;
  }
  switch (args.dy_type) {
    case CUDA_R_32F:
      return grouped_launch_for_input<float>(args, stream);
    case CUDA_R_16BF:
      return grouped_launch_for_input<__nv_bfloat16>(args, stream);
    case CUDA_R_16F:
      return grouped_launch_for_input<__half>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace splitgrad::cuda
