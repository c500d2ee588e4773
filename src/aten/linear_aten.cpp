// The ATen back end: the linear products on ATen's own GEMMs. It serves the CPU, and any device
// without a back end of its own. Its wgrad is the same GEMM autograd runs for nn.Linear
// (dW = dyᵀ·x), so on the CPU deferred and plain-autograd gradients agree bit for bit in float32.
#include "aten/linear_aten.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"

namespace splitgrad::aten_backend {

at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  detail::check_linear_args(detail::named("splitgrad::linear_fprop"), input, weight, bias);
  const at::Tensor x = detail::flatten_tokens(input);
  at::Tensor y =
      bias.has_value() && bias->defined() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  return input.dim() == 2 ? y : y.view(detail::with_last_dim(input.sizes(), weight.size(0)));
}

at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight) {
  detail::check_dgrad_args(detail::named("splitgrad::linear_dgrad"), grad_output, weight);
  at::Tensor dx = at::mm(detail::flatten_tokens(grad_output), weight);
  return grad_output.dim() == 2
             ? dx
             : dx.view(detail::with_last_dim(grad_output.sizes(), weight.size(1)));
}

std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad) {
  detail::check_wgrad_args(detail::named("splitgrad::linear_wgrad"), grad_output, input);
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  at::Tensor weight_grad = at::mm(dy.t(), detail::flatten_tokens(input));
  at::Tensor bias_grad = compute_bias_grad ? dy.sum(0) : at::empty({0}, dy.options());
  return {weight_grad, bias_grad};
}

void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad) {
  detail::check_wgrad_accumulate_args(detail::named("splitgrad::linear_wgrad_accumulate_"),
                                      grad_output, input, weight_grad, bias_grad);
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  if (weight_grad.has_value() && weight_grad->defined()) {
    const at::Tensor x = detail::flatten_tokens(input);
    if (weight_grad->scalar_type() == dy.scalar_type()) {
      weight_grad->add_(at::mm(dy.t(), x));  // what autograd adds to .grad: bit-identical sums
    } else {
      const auto acc = weight_grad->scalar_type();  // fp32 main_grad: products formed in fp32
      weight_grad->addmm_(dy.t().to(acc), x.to(acc));
    }
  }
  if (bias_grad.has_value() && bias_grad->defined()) {
    bias_grad->add_(at::sum(dy, {0}, /*keepdim=*/false, bias_grad->scalar_type()));
  }
}

TORCH_LIBRARY_IMPL(splitgrad, CompositeExplicitAutograd, m) {
  m.impl("linear_fprop", &linear_fprop);
  m.impl("linear_dgrad", &linear_dgrad);
  m.impl("linear_wgrad", &linear_wgrad);
  m.impl("linear_wgrad_accumulate_", &linear_wgrad_accumulate_);
}

}  // namespace splitgrad::aten_backend
