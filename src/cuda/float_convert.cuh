#pragma once
// fp32 <-> element type conversions for splitgrad's kernels (fp32, bf16, fp16), device side.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace splitgrad::cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

/// Rounds `v` to T (round to nearest even).
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);
}

}  // namespace splitgrad::cuda
