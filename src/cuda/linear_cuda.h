#pragma once
// The cuBLASLt back end's linear products (src/cuda/linear_cuda.cpp), for the grouped back end
// (src/cuda/grouped_linear_cuda.cpp), which runs them on each group's rows. All run on the current
// stream of the current device (the caller holds a device guard).

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace splitgrad::cuda_backend {

/// Whether the cuBLASLt kernels take this dtype (fp32, bf16, fp16); others go to the ATen back end.
bool covers(at::ScalarType type);

/// y = x·Wᵀ + b into `y`: x [tokens, in] 2-D, y [tokens, out] row-major (unit column stride, rows
/// `stride(0)` apart: a row slice of a larger output is fine), of a covered dtype, checked.
void fprop_into(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& y);
/// dx = dy·W into `dx`: dy [tokens, out] 2-D, dx [tokens, in] row-major as `y` above.
void dgrad_into(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& dx);

/// The registered kernels of the linear ops (arguments checked, any dtype).
at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias);
at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad);
void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad);

}  // namespace splitgrad::cuda_backend
