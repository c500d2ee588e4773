// The autotuner's helpers (see tuning_kernels.h): a fixed pseudo-random fill, a bitwise compare
// and a busy wait.

#include "cuda/float_convert.cuh"
#include "cuda/tuning_kernels.h"

namespace splitgrad::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 4096;

// A 32-bit integer hash (lowbias32): consecutive indices give uncorrelated values.
__device__ __forceinline__ uint32_t hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

template <typename T>
__global__ void fill_kernel(T* data, size_t elements, uint32_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements;
       i += stride) {
    const uint32_t bits =
        hash(static_cast<uint32_t>(i) ^ hash(seed + static_cast<uint32_t>(i >> 32)));
    // 24 random bits -> [-1, 1): every value is exact in fp32; 16-bit types round it.
    data[i] = from_float<T>(static_cast<float>(bits >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}

__global__ void compare_kernel(const unsigned char* a, const unsigned char* b, size_t bytes,
                               unsigned int* differing) {
  const size_t words = bytes / 4;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned int local = 0;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned =
      reinterpret_cast<uintptr_t>(a) % 4 == 0 && reinterpret_cast<uintptr_t>(b) % 4 == 0;
  for (size_t i = first; i < words; i += stride) {
    if (aligned) {
      local += reinterpret_cast<const uint32_t*>(a)[i] != reinterpret_cast<const uint32_t*>(b)[i];
    } else {
      for (int j = 0; j < 4; ++j) local += a[4 * i + j] != b[4 * i + j];
    }
  }
  if (first == 0) {
    for (size_t i = words * 4; i < bytes; ++i) local += a[i] != b[i];
  }
  if (local != 0) atomicAdd(differing, local);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__global__ void busy_wait_kernel(uint64_t nanoseconds) {
  const uint64_t until = global_timer_ns() + nanoseconds;
  while (global_timer_ns() < until) {
  }
}

unsigned blocks_for(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

}  // namespace

cudaError_t fill_pseudo_random(void* data, cudaDataType_t type, size_t elements, uint32_t seed,
                               cudaStream_t stream) {
  if (elements == 0) return cudaSuccess;
  const unsigned blocks = blocks_for(elements);
  switch (type) {
    case CUDA_R_32F:
      fill_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(data), elements, seed);
      break;
    case CUDA_R_16BF:
      fill_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(data), elements,
                                                   seed);
      break;
    case CUDA_R_16F:
      fill_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(data), elements, seed);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t count_differing_words(const void* a, const void* b, size_t bytes,
                                  unsigned int* differing, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  compare_kernel<<<blocks_for(bytes / 4 + 1), kThreads, 0, stream>>>(
      static_cast<const unsigned char*>(a), static_cast<const unsigned char*>(b), bytes, differing);
  return cudaGetLastError();
}

cudaError_t busy_wait(uint64_t nanoseconds, cudaStream_t stream) {
  busy_wait_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

}  // namespace splitgrad::cuda
