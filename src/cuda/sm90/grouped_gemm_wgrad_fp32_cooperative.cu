// main_grad += dyᵀ·x per group, fp32 targets: cooperative 128x256 tiles, clusters of 2x1. The
// epilogue reads main_grad in 128x32 subtiles through 2 stages and stores through 2 stages of its
// own shared memory (CUTLASS's choice lets D reuse C's, so a C stage waits for its store):
// dsv3-gate-up-32, the shape this kernel serves, 0.874 -> 0.849 of the per-expert addmm loop
// (H100, benchmarks/tune_grouped.py, 2026-12-06).
#include "cuda/sm90/grouped_gemm_sm90.cuh"
#include "cuda/sm90/grouped_gemm_sm90.h"

namespace splitgrad::cuda::sm90 {
namespace {
using Kernel = GroupedKernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float,
                             cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, false,
                             cute::Shape<cute::_128, cute::_32>, EpiloguePipeline<2, 2, false>>;
}  // namespace

size_t wgrad_fp32_cooperative_workspace_bytes(const GroupedGemmArgs& args) { return workspace_bytes<Kernel>(args); }

cudaError_t wgrad_fp32_cooperative(const GroupedGemmArgs& args, cudaStream_t stream) {
  return run<Kernel, GroupedProduct::wgrad_accumulate>(args, stream);
}

}  // namespace splitgrad::cuda::sm90
