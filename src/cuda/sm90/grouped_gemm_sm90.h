#pragma once
// The SM90 grouped products, one translation unit each (grouped_gemm_*.cu, compiled for sm_90a
// only); src/cuda/grouped_gemm.cpp picks one. Arguments as in cuda/grouped_gemm.h.
#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/grouped_gemm.h"

namespace splitgrad::cuda::sm90 {

size_t fprop_workspace_bytes(const GroupedGemmArgs& args);
cudaError_t fprop(const GroupedGemmArgs& args, cudaStream_t stream);

size_t dgrad_workspace_bytes(const GroupedGemmArgs& args);
cudaError_t dgrad(const GroupedGemmArgs& args, cudaStream_t stream);

/// Into fp32 targets (main_grad): ping-pong schedule, one warp group's epilogue (the fp32
/// read-modify-write) overlapping the other's main loop.
size_t wgrad_fp32_workspace_bytes(const GroupedGemmArgs& args);
cudaError_t wgrad_fp32(const GroupedGemmArgs& args, cudaStream_t stream);
/// The same into fp32 targets with the cooperative schedule (both warp groups on one larger
/// tile): measured against the ping-pong one (benchmarks/bench_grouped.py).
size_t wgrad_fp32_cooperative_workspace_bytes(const GroupedGemmArgs& args);
cudaError_t wgrad_fp32_cooperative(const GroupedGemmArgs& args, cudaStream_t stream);

/// Into bf16 targets (.grad of bf16 parameters, or a fresh bf16 gradient zeroed first).
size_t wgrad_bf16_workspace_bytes(const GroupedGemmArgs& args);
cudaError_t wgrad_bf16(const GroupedGemmArgs& args, cudaStream_t stream);

#ifdef SPLITGRAD_GROUPED_GEMM_TUNING
/// Tuning builds: more kernels per product (grouped_gemm_variant.cuh), which
/// SPLITGRAD_GROUPED_GEMM_VARIANT=<name> selects for benchmarks/tune_grouped.py.
struct TuningVariant {
  const char* name;
  GroupedProduct product;
  bool fp32_targets;  ///< wgrad: into fp32 targets
  cudaError_t (*run)(const GroupedGemmArgs&, cudaStream_t);
  size_t (*workspace_bytes)(const GroupedGemmArgs&);
};
void register_tuning_variant(const TuningVariant& variant);
#endif

}  // namespace splitgrad::cuda::sm90
