// Host pointers into a device array by value, as kernel parameters: no pinned buffer and no
// copy from host memory, so the launch can be captured in a CUDA graph and replayed.
#include "cuda/pointer_table.h"

namespace splitgrad::cuda {
namespace {

constexpr int kPointersPerLaunch = 512;  // 4 KiB of parameters, within every launch's limit

struct PointerChunk {
  const void* pointers[kPointersPerLaunch];
};

__global__ void write_pointers(PointerChunk chunk, int count, const void** out) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < count) out[i] = chunk.pointers[i];
}

}  // namespace

cudaError_t write_pointer_table(const void* const* pointers, int64_t count, const void** device,
                                cudaStream_t stream) {
  for (int64_t start = 0; start < count; start += kPointersPerLaunch) {
    const int n = static_cast<int>(count - start < kPointersPerLaunch ? count - start
                                                                      : kPointersPerLaunch);
    PointerChunk chunk{};
    for (int i = 0; i < n; ++i) chunk.pointers[i] = pointers[start + i];
    write_pointers<<<1, kPointersPerLaunch, 0, stream>>>(chunk, n, device + start);
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

}  // namespace splitgrad::cuda
