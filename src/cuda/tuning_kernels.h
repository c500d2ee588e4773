#pragma once
/// \file tuning_kernels.h
/// Three small kernels for the cuBLASLt autotuner (cuda/cublaslt_gemm.cpp): framework-free
/// (pointers and a stream). The tuner times candidate algorithms on operands of its own, filled
/// with fixed pseudo-random values, and keeps only candidates whose output equals the heuristic's
/// first choice bit for bit, so the algorithm it settles on never changes the numerics.

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>

namespace splitgrad::cuda {

/// Fills `elements` values of `type` (CUDA_R_32F, CUDA_R_16BF or CUDA_R_16F) with a fixed
/// pseudo-random sequence in [-1, 1) determined by `seed` (the same in every run).
/// Returns the launch's error, or cudaErrorInvalidValue for another type.
cudaError_t fill_pseudo_random(void* data, cudaDataType_t type, size_t elements, uint32_t seed,
                               cudaStream_t stream);

/// `*differing` (device memory) += the number of 32-bit words (and trailing bytes) in which the
/// `bytes` bytes at `a` and `b` differ. Set `*differing` to 0 first.
cudaError_t count_differing_words(const void* a, const void* b, size_t bytes,
                                  unsigned int* differing, cudaStream_t stream);

/// Keeps the GPU busy for about `nanoseconds` (one thread spinning on the global timer): the
/// tuner launches it before each timed GEMM so that the GEMM is queued before the GPU reaches it
/// and its events time the kernel alone, not the host's launch.
cudaError_t busy_wait(uint64_t nanoseconds, cudaStream_t stream);

}  // namespace splitgrad::cuda
