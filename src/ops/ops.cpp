// C++ entry points: each goes through the dispatcher, so C++ callers get autograd and tracing.
#include "splitgrad/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace splitgrad::ops {
namespace {
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}
using OptTensor = std::optional<at::Tensor>;
}  // namespace

at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias) {
  static auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
      "splitgrad::linear_fprop");
  return handle.call(input, weight, bias);
}

at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&)>("splitgrad::linear_dgrad");
  return handle.call(grad_output, weight);
}

std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad) {
  static auto handle =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, bool)>(
          "splitgrad::linear_wgrad");
  return handle.call(grad_output, input, compute_bias_grad);
}

void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const OptTensor& weight_grad, const OptTensor& bias_grad) {
  static auto handle =
      op<void(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&)>(
          "splitgrad::linear_wgrad_accumulate_");
  handle.call(grad_output, input, weight_grad, bias_grad);
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                  const OptTensor& weight_main_grad, const OptTensor& bias_main_grad,
                  int64_t layer_id, bool delay_wgrad_compute) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                    const OptTensor&, int64_t, bool)>("splitgrad::linear");
  return handle.call(input, weight, bias, weight_main_grad, bias_main_grad, layer_id,
                     delay_wgrad_compute);
}

}  // namespace splitgrad::ops
