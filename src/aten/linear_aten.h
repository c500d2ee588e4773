#pragma once
// The ATen back end's kernels, also the fallback of other back ends for what they do not cover
// (the cuBLASLt back end hands float64 to them).

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace splitgrad::aten_backend {

at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias);
at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad);
void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad);

// Grouped (src/aten/grouped_linear_aten.cpp), on splits already on the host and checked (non-
// negative, summing to the rows): a loop over the groups, each on its own rows' views. Arguments
// are checked by the caller. Other back ends hand dtypes they do not cover to these.
at::Tensor grouped_linear_fprop(const at::Tensor& input, const std::vector<int64_t>& splits,
                                at::TensorList weights, at::TensorList biases);
at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const std::vector<int64_t>& splits,
                                at::TensorList weights);
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const std::vector<int64_t>& splits,
    bool compute_bias_grad);
void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const std::vector<int64_t>& splits,
                                      const c10::List<std::optional<at::Tensor>>& weight_grads,
                                      const c10::List<std::optional<at::Tensor>>& bias_grads);

}  // namespace splitgrad::aten_backend
