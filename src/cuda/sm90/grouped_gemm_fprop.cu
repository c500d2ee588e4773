// y = x·Wᵀ per group: cooperative 128x256 tiles (PyTorch's choice for large grouped bf16 GEMMs).
#include "cuda/sm90/grouped_gemm_sm90.cuh"
#include "cuda/sm90/grouped_gemm_sm90.h"

namespace splitgrad::cuda::sm90 {
namespace {
using Kernel = GroupedKernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Bf16,
                             cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, false>;
}  // namespace

size_t fprop_workspace_bytes(const GroupedGemmArgs& args) { return workspace_bytes<Kernel>(args); }

cudaError_t fprop(const GroupedGemmArgs& args, cudaStream_t stream) {
  return run<Kernel, GroupedProduct::fprop>(args, stream);
}

}  // namespace splitgrad::cuda::sm90
