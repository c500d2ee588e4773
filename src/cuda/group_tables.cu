// Per-group tables on the device: host words by value (kernel parameters), and the splits' check.
#include "cuda/group_tables.h"
#include "cuda/split_check.cuh"

namespace splitgrad::cuda {
namespace {

// 500 words: 4000 bytes of parameters with the other two, within the classic 4 KiB launch limit.
constexpr int kWordsPerLaunch = 500;

struct WordChunk {
  uint64_t words[kWordsPerLaunch];
};

__global__ void write_words(WordChunk chunk, int count, uint64_t* out) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < count) out[i] = chunk.words[i];
}

__global__ void check_splits_kernel(const int64_t* splits, int64_t groups, int64_t rows) {
  check_splits_or_stop(splits, groups, rows);
}

}  // namespace

cudaError_t write_table(const uint64_t* words, int64_t count, uint64_t* device,
                        cudaStream_t stream) {
  for (int64_t start = 0; start < count; start += kWordsPerLaunch) {
    const int n =
        static_cast<int>(count - start < kWordsPerLaunch ? count - start : kWordsPerLaunch);
    WordChunk chunk{};
    for (int i = 0; i < n; ++i) chunk.words[i] = words[start + i];
    write_words<<<1, kWordsPerLaunch, 0, stream>>>(chunk, n, device + start);
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t check_splits(const int64_t* splits, int64_t groups, int64_t rows, cudaStream_t stream) {
  check_splits_kernel<<<1, 1, 0, stream>>>(splits, groups, rows);
  return cudaGetLastError();
}

}  // namespace splitgrad::cuda
