// Fake (meta) kernels: shapes and dtypes only, so FakeTensor, torch.compile and opcheck can trace
// the ops without running them. They check arguments as the real kernels do, and keep sizes
// symbolic (dynamic shapes).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"

namespace splitgrad::meta {
namespace {

at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  detail::check_linear_args(detail::named("splitgrad::linear_fprop"), input, weight, bias);
  return at::empty_symint(detail::with_last_dim(input.sym_sizes(), weight.sym_size(0)),
                          input.options());
}

at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight) {
  detail::check_dgrad_args(detail::named("splitgrad::linear_dgrad"), grad_output, weight);
  return at::empty_symint(detail::with_last_dim(grad_output.sym_sizes(), weight.sym_size(1)),
                          grad_output.options());
}

std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad) {
  detail::check_wgrad_args(detail::named("splitgrad::linear_wgrad"), grad_output, input);
  const c10::SymInt out = grad_output.sym_size(-1);
  return {at::empty_symint({out, input.sym_size(-1)}, input.options()),
          at::empty_symint({compute_bias_grad ? out : c10::SymInt(0)}, input.options())};
}

void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad) {
  detail::check_wgrad_accumulate_args(detail::named("splitgrad::linear_wgrad_accumulate_"),
                                      grad_output, input, weight_grad, bias_grad);
}

at::Tensor activation(const at::Tensor& input, c10::string_view activation) {
  const std::string name(activation);
  detail::check_activation_args(detail::named("splitgrad::activation"), input, name);
  return at::empty_symint(detail::activation_output_view(input, name).sym_sizes(), input.options());
}

at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& input,
                               c10::string_view activation) {
  const std::string name(activation);
  detail::check_activation_backward_args(detail::named("splitgrad::activation_backward"),
                                         grad_output, input, name);
  return at::empty_symint(input.sym_sizes(), input.options());
}

// Grouped: the splits' values are data, which fake tensors have not; their dtype, shape and device
// are checked, and the output shapes depend on the number of groups only.
using OptTensorList = c10::List<std::optional<at::Tensor>>;

at::Tensor grouped_linear_fprop(const at::Tensor& input, const at::Tensor& m_splits,
                                at::TensorList weights, at::TensorList biases) {
  detail::check_grouped_linear_args(detail::named("splitgrad::grouped_linear_fprop"), input,
                                    m_splits, weights, biases, /*splits_on_cpu_only=*/false);
  return at::empty_symint(detail::with_last_dim(input.sym_sizes(), weights[0].sym_size(0)),
                          input.options());
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const at::Tensor& m_splits,
                                at::TensorList weights) {
  detail::check_grouped_dgrad_args(detail::named("splitgrad::grouped_linear_dgrad"), grad_output,
                                   m_splits, weights, /*splits_on_cpu_only=*/false);
  return at::empty_symint(detail::with_last_dim(grad_output.sym_sizes(), weights[0].sym_size(1)),
                          grad_output.options());
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& m_splits,
    bool compute_bias_grad) {
  detail::check_grouped_wgrad_args(detail::named("splitgrad::grouped_linear_wgrad"), grad_output,
                                   input, m_splits, /*splits_on_cpu_only=*/false);
  const c10::SymInt out = grad_output.sym_size(-1);
  std::vector<at::Tensor> weight_grads, bias_grads;
  for (int64_t i = 0; i < m_splits.size(0); ++i) {
    weight_grads.push_back(at::empty_symint({out, input.sym_size(-1)}, input.options()));
    if (compute_bias_grad) bias_grads.push_back(at::empty_symint({out}, input.options()));
  }
  return {std::move(weight_grads), std::move(bias_grads)};
}

void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& m_splits, const OptTensorList& weight_grads,
                                      const OptTensorList& bias_grads) {
  detail::check_grouped_wgrad_accumulate_args(
      detail::named("splitgrad::grouped_linear_wgrad_accumulate_"), grad_output, input, m_splits,
      weight_grads, bias_grads, /*splits_on_cpu_only=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, Meta, m) {
  m.impl("activation", &activation);
  m.impl("activation_backward", &activation_backward);
  m.impl("grouped_linear_fprop", &grouped_linear_fprop);
  m.impl("grouped_linear_dgrad", &grouped_linear_dgrad);
  m.impl("grouped_linear_wgrad", &grouped_linear_wgrad);
  m.impl("grouped_linear_wgrad_accumulate_", &grouped_linear_wgrad_accumulate_);
  m.impl("linear_fprop", &linear_fprop);
  m.impl("linear_dgrad", &linear_dgrad);
  m.impl("linear_wgrad", &linear_wgrad);
  m.impl("linear_wgrad_accumulate_", &linear_wgrad_accumulate_);
}

}  // namespace splitgrad::meta
