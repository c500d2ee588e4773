#pragma once
/// \file bias_grad.h
/// The bias gradient of a linear layer, db = Σ_tokens dy, as a column sum of dy: framework-free
/// (pointers and a stream), deterministic (fixed summation order, no atomics), fp32 accumulation.
///
/// Two launches: each block sums a tile of `rows_per_block` rows x 256 columns into fp32
/// partial sums (16-byte loads where dy's rows allow), then 8 threads per column add the
/// partials in a fixed order and write `target = sum` or `target += sum`. It reads dy once and
/// needs `bias_grad_workspace_bytes()` of scratch.

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>

namespace splitgrad::cuda {

/// Arguments of bias_grad(). Element types (dy's and the target's): CUDA_R_32F, CUDA_R_16BF or
/// CUDA_R_16F.
struct BiasGradArgs {
  const void* dy = nullptr;  ///< [tokens, features], row-major, row stride `ld` (elements)
  cudaDataType_t dy_type = CUDA_R_32F;
  int64_t tokens = 0;
  int64_t features = 0;
  int64_t ld = 0;
  void* target = nullptr;  ///< [features], contiguous
  cudaDataType_t target_type = CUDA_R_32F;
  bool accumulate = false;     ///< `target += Σ dy` (true) or `target = Σ dy` (false)
  float* workspace = nullptr;  ///< at least bias_grad_workspace_bytes(tokens, features, sms)
  int multiprocessors = 1;     ///< the device's SM count: the tiling keeps every SM busy
};

/// Scratch bytes bias_grad() needs for these sizes on a device with `multiprocessors` SMs
/// (fp32 partial sums).
size_t bias_grad_workspace_bytes(int64_t tokens, int64_t features, int multiprocessors);

/// Launches the two kernels on `stream`; returns the launch's error (cudaSuccess if none), or
/// cudaErrorInvalidValue for an element type not listed above.
/// tokens == 0 writes zeros (or adds nothing); features == 0 launches nothing.
cudaError_t bias_grad(const BiasGradArgs& args, cudaStream_t stream);

}  // namespace splitgrad::cuda
