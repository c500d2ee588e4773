// main_grad += dyᵀ·x per group, fp32 targets: ping-pong 128x128 tiles, clusters of 1x2 (two
// blocks along N share each dyᵀ tile: 0-1.5% faster than 2x1 along M on the H200). The epilogue
// reads main_grad in 64x32 subtiles through 4 stages and stores through 4 stages of its own
// shared memory (CUTLASS's choice for fp32 targets lets D reuse C's, so a C stage waits for its
// store to drain): 2-5% faster on every benchmark shape (H100, benchmarks/tune_grouped.py).
#include "cuda/sm90/grouped_gemm_sm90.cuh"
#include "cuda/sm90/grouped_gemm_sm90.h"

namespace splitgrad::cuda::sm90 {
namespace {
using Kernel = GroupedKernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float,
                             cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>, true,
                             cute::Shape<cute::_64, cute::_32>, EpiloguePipeline<4, 4, false>>;
}  // namespace

size_t wgrad_fp32_workspace_bytes(const GroupedGemmArgs& args) { return workspace_bytes<Kernel>(args); }

cudaError_t wgrad_fp32(const GroupedGemmArgs& args, cudaStream_t stream) {
  return run<Kernel, GroupedProduct::wgrad_accumulate>(args, stream);
}

}  // namespace splitgrad::cuda::sm90
