// Per-group tables on the device: host words by value (kernel parameters), and the splits' check.
#include "cuda/group_tables.h"
#include "cuda/split_check.cuh"

namespace splitgrad::cuda {
namespace {

__global__ void write_words(TableChunk chunk) { write_table_chunk(chunk); }

__global__ void check_splits_kernel(const int64_t* splits, int64_t groups, int64_t rows) {
  check_splits_or_stop(splits, groups, rows);
}

}  // namespace

cudaError_t write_table(const uint64_t* words, int64_t count, uint64_t* device,
                        cudaStream_t stream) {
  for (int64_t start = 0; start < count; start += TableChunk::kWords) {
    const TableChunk chunk = table_chunk(words + start, count - start, device + start);
    write_words<<<1, TableChunk::kWords, 0, stream>>>(chunk);
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t check_splits(const int64_t* splits, int64_t groups, int64_t rows, cudaStream_t stream) {
  check_splits_kernel<<<1, 1, 0, stream>>>(splits, groups, rows);
  return cudaGetLastError();
}

}  // namespace splitgrad::cuda
