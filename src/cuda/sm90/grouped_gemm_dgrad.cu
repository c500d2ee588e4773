// dx = dy·W per group: cooperative 128x256 tiles.
#include "cuda/sm90/grouped_gemm_sm90.cuh"
#include "cuda/sm90/grouped_gemm_sm90.h"

namespace splitgrad::cuda::sm90 {
namespace {
using Kernel = GroupedKernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Bf16,
                             cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, false>;
}  // namespace

size_t dgrad_workspace_bytes(const GroupedGemmArgs& args) { return workspace_bytes<Kernel>(args); }

cudaError_t dgrad(const GroupedGemmArgs& args, cudaStream_t stream) {
  return run<Kernel, GroupedProduct::dgrad>(args, stream);
}

}  // namespace splitgrad::cuda::sm90
