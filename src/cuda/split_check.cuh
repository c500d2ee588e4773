#pragma once
// The device-side check of a grouped op's splits, shared by the grouped GEMMs' argument kernel and
// check_splits() (cuda/group_tables.h). Called by one thread: a negative split or a total other
// than `rows` prints the problem and stops the kernel with a device-side assertion, as PyTorch's
// indexing kernels stop on a bad index (the host cannot read device splits without waiting).
#include <cassert>
#include <cstdint>
#include <cstdio>

#ifdef NDEBUG
// <cassert> declares the assertion handler only without NDEBUG; the check must stop in release
// builds too (PyTorch's CUDA_KERNEL_ASSERT declares it the same way).
extern "C" __host__ __device__ void __assert_fail(const char* assertion, const char* file,
                                                  unsigned int line, const char* function) noexcept
    __attribute__((__noreturn__));
#endif

namespace splitgrad::cuda {

__device__ inline void check_splits_or_stop(const int64_t* splits, int64_t groups, int64_t rows) {
  int64_t total = 0;
  bool bad = false;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t split = splits[g];
    if (split < 0) {
      printf("splitgrad grouped GEMM: m_splits[%lld] = %lld is negative\n",
             static_cast<long long>(g), static_cast<long long>(split));
      bad = true;
    } else if (split > INT64_MAX - total) {  // a huge split must not wrap around to `rows`
      printf("splitgrad grouped GEMM: m_splits[%lld] = %lld takes the sum past the int64 range\n",
             static_cast<long long>(g), static_cast<long long>(split));
      bad = true;
      break;
    } else {
      total += split;
    }
  }
  if (!bad && total != rows) {
    printf("splitgrad grouped GEMM: m_splits sum to %lld, expected the input's %lld rows\n",
           static_cast<long long>(total), static_cast<long long>(rows));
    bad = true;
  }
  if (bad) {
    __assert_fail("m_splits are non-negative and sum to the rows", __FILE__, __LINE__,
                  "splitgrad::cuda::check_splits_or_stop");
  }
}

}  // namespace splitgrad::cuda
