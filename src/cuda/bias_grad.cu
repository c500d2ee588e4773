// db = Σ_tokens dy: a deterministic column sum in two launches (see bias_grad.h).
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

template <typename T>
__global__ void column_partial_sums(const T* __restrict__ dy, int64_t tokens, int64_t features,
                                    int64_t ld, int64_t rows_per_block, bool vectorized,
                                    float* __restrict__ partials) {
  const int64_t col0 =
      (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * kColsPerThread;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = min(tokens, row_begin + rows_per_block);
  float acc[kColsPerThread] = {};
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
  // lanes[y][c]: row lane y's sum of the block's column c; +1 breaks the 8-way bank conflicts.
  __shared__ float lanes[kRowLanes][kColsPerBlock + 1];
#pragma unroll
  for (int j = 0; j < kColsPerThread; ++j)
    lanes[threadIdx.y][threadIdx.x * kColsPerThread + j] = acc[j];
  __syncthreads();
  const int c = threadIdx.y * kThreadsX + threadIdx.x;  // 0..255: one column per thread
  float sum = 0.0f;
#pragma unroll
  for (int y = 0; y < kRowLanes; ++y) sum += lanes[y][c];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + c;
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

}  // namespace splitgrad::cuda
