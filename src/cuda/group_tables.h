#pragma once
/// \file group_tables.h
/// What the grouped kernels read per group, put on the device without a host synchronisation and
/// safely under CUDA-graph capture: tables of host-known 8-byte words (the experts' pointers, the
/// values of host splits) written by a kernel that takes them as parameters (nothing is read from
/// host memory on the stream, so a graph captures them by value, and later host writes cannot
/// change them), and the device-side check of splits that live on the device.

#include <cuda_runtime.h>

#include <cstdint>

namespace splitgrad::cuda {

/// Host words a kernel takes by value and writes to `device` (`count` of them): 3584 bytes, with
/// a launch's other parameters within the classic 4 KiB limit. write_table() launches one of its
/// own per chunk; the grouped GEMMs' argument kernel takes one for the table its launch reads
/// (GroupedGemmArgs::table), which saves a launch.
struct TableChunk {
  static constexpr int kWords = 448;
  uint64_t words[kWords];
  uint64_t* device;
  int count;
};

/// The first min(count, kWords) of `words`, to go to `device`.
inline TableChunk table_chunk(const uint64_t* words, int64_t count, uint64_t* device) {
  TableChunk chunk;
  chunk.device = device;
  chunk.count = static_cast<int>(count < TableChunk::kWords ? count : TableChunk::kWords);
  for (int i = 0; i < chunk.count; ++i) chunk.words[i] = words[i];
  return chunk;
}

#ifdef __CUDACC__
/// The block's threads write `chunk` to the device; what they wrote is visible to the whole block
/// once it returns.
__device__ inline void write_table_chunk(const TableChunk& chunk) {
  for (int i = static_cast<int>(threadIdx.x); i < chunk.count; i += static_cast<int>(blockDim.x)) {
    chunk.device[i] = chunk.words[i];
  }
  __syncthreads();
}
#endif

/// device[i] = words[i] for i < count, on `stream` (count may be 0). Returns the launch's error.
cudaError_t write_table(const uint64_t* words, int64_t count, uint64_t* device,
                        cudaStream_t stream);

/// Checks `groups` int64 splits on the device: each non-negative, summing to `rows`; otherwise the
/// kernel prints the problem and stops with a device-side assertion (the launch that follows
/// never runs). For work that launches no grouped GEMM (whose argument kernel checks the same).
cudaError_t check_splits(const int64_t* splits, int64_t groups, int64_t rows, cudaStream_t stream);

}  // namespace splitgrad::cuda
