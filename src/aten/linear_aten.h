#pragma once
// The ATen back end's kernels, also the fallback of other back ends for what they do not cover
// (the cuBLASLt back end hands float64 to them).

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace splitgrad::aten_backend {

at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias);
at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad);
void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad);

}  // namespace splitgrad::aten_backend
