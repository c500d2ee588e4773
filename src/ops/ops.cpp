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
                  int64_t layer_id, bool delay_wgrad_compute,
                  std::optional<std::string_view> input_activation, bool lazy_main_grad,
                  std::optional<std::string_view> gemm) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                    const OptTensor&, int64_t, bool, std::optional<c10::string_view>, bool,
                    std::optional<c10::string_view>)>("splitgrad::linear");
  return handle.call(input, weight, bias, weight_main_grad, bias_main_grad, layer_id,
                     delay_wgrad_compute, input_activation, lazy_main_grad, gemm);
}

at::Tensor activation(const at::Tensor& input, std::string_view activation) {
  static auto handle = op<at::Tensor(const at::Tensor&, c10::string_view)>("splitgrad::activation");
  return handle.call(input, activation);
}

at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& input,
                               std::string_view activation) {
  static auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>(
      "splitgrad::activation_backward");
  return handle.call(grad_output, input, activation);
}

using OptTensorList = c10::List<std::optional<at::Tensor>>;

at::Tensor grouped_linear_fprop(const at::Tensor& input, const at::Tensor& m_splits,
                                at::TensorList weights, at::TensorList biases) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList)>(
          "splitgrad::grouped_linear_fprop");
  return handle.call(input, m_splits, weights, biases);
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const at::Tensor& m_splits,
                                at::TensorList weights) {
  static auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList)>(
      "splitgrad::grouped_linear_dgrad");
  return handle.call(grad_output, m_splits, weights);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& m_splits,
    bool compute_bias_grad) {
  static auto handle = op<std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>(
      "splitgrad::grouped_linear_wgrad");
  return handle.call(grad_output, input, m_splits, compute_bias_grad);
}

void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& m_splits, const OptTensorList& weight_grads,
                                      const OptTensorList& bias_grads) {
  static auto handle =
      op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensorList&,
              const OptTensorList&)>("splitgrad::grouped_linear_wgrad_accumulate_");
  handle.call(grad_output, input, m_splits, weight_grads, bias_grads);
}

at::Tensor grouped_linear(const at::Tensor& input, const at::Tensor& m_splits,
                          at::TensorList weights, at::TensorList biases,
                          const OptTensorList& weight_main_grads,
                          const OptTensorList& bias_main_grads, int64_t layer_id,
                          bool delay_wgrad_compute, bool lazy_main_grad) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList,
                    const OptTensorList&, const OptTensorList&, int64_t, bool, bool)>(
          "splitgrad::grouped_linear");
  return handle.call(input, m_splits, weights, biases, weight_main_grads, bias_main_grads, layer_id,
                     delay_wgrad_compute, lazy_main_grad);
}

}  // namespace splitgrad::ops
