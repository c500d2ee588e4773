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

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, Meta, m) {
  m.impl("linear_fprop", &linear_fprop);
  m.impl("linear_dgrad", &linear_dgrad);
  m.impl("linear_wgrad", &linear_wgrad);
  m.impl("linear_wgrad_accumulate_", &linear_wgrad_accumulate_);
}

}  // namespace splitgrad::meta
