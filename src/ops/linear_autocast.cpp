// Autocast kernels: under torch.autocast splitgrad's ops compute in autocast's dtype, as
// nn.Linear's F.linear does. For splitgrad::linear only the input is cast here; the parameters go
// on as they are, with the compute dtype set for that call (the autograd kernel casts them for the
// product), so their gradients land in their own dtype whether immediate, deferred or fused into
// main_grad.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "ops/deferred_internal.h"
#include "splitgrad/ops.h"

namespace splitgrad::detail {
namespace {
thread_local std::optional<at::ScalarType> compute_dtype_now;
}  // namespace

AutocastComputeDtype::AutocastComputeDtype(at::ScalarType dtype) : previous_(compute_dtype_now) {
  compute_dtype_now = dtype;
}
AutocastComputeDtype::~AutocastComputeDtype() { compute_dtype_now = previous_; }
std::optional<at::ScalarType> AutocastComputeDtype::current() { return compute_dtype_now; }

namespace {
using OptTensor = std::optional<at::Tensor>;

template <c10::DeviceType device>
at::Tensor linear_fprop_autocast(const at::Tensor& input, const at::Tensor& weight,
                                 const OptTensor& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(device);
  return ops::linear_fprop(at::autocast::cached_cast(dtype, input, device),
                           at::autocast::cached_cast(dtype, weight, device),
                           at::autocast::cached_cast(dtype, bias, device));
}

template <c10::DeviceType device>
at::Tensor linear_autocast(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                           const OptTensor& weight_main_grad, const OptTensor& bias_main_grad,
                           int64_t layer_id, bool delay_wgrad_compute,
                           std::optional<c10::string_view> input_activation, bool lazy_main_grad,
                           std::optional<c10::string_view> gemm) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  // A weight autocast leaves alone (float64, another device) keeps the op as it is, as F.linear.
  if (!at::autocast::is_eligible(weight, device)) {
    return ops::linear(input, weight, bias, weight_main_grad, bias_main_grad, layer_id,
                       delay_wgrad_compute, input_activation, lazy_main_grad, gemm);
  }
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(device);
  AutocastComputeDtype compute(dtype);
  // An input activation runs in the compute dtype too, on the cast input.
  return ops::linear(at::autocast::cached_cast(dtype, input, device), weight, bias,
                     weight_main_grad, bias_main_grad, layer_id, delay_wgrad_compute,
                     input_activation, lazy_main_grad, gemm);
}

// The grouped forms, likewise (the splits are not cast).
using OptTensorList = c10::List<std::optional<at::Tensor>>;

template <c10::DeviceType device>
at::Tensor grouped_linear_fprop_autocast(const at::Tensor& input, const at::Tensor& m_splits,
                                         at::TensorList weights, at::TensorList biases) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(device);
  return ops::grouped_linear_fprop(at::autocast::cached_cast(dtype, input, device), m_splits,
                                   at::autocast::cached_cast(dtype, weights, device),
                                   at::autocast::cached_cast(dtype, biases, device));
}

template <c10::DeviceType device>
at::Tensor grouped_linear_autocast(const at::Tensor& input, const at::Tensor& m_splits,
                                   at::TensorList weights, at::TensorList biases,
                                   const OptTensorList& weight_main_grads,
                                   const OptTensorList& bias_main_grads, int64_t layer_id,
                                   bool delay_wgrad_compute, bool lazy_main_grad) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  if (weights.empty() || !at::autocast::is_eligible(weights[0], device)) {
    return ops::grouped_linear(input, m_splits, weights, biases, weight_main_grads, bias_main_grads,
                               layer_id, delay_wgrad_compute, lazy_main_grad);
  }
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(device);
  AutocastComputeDtype compute(dtype);
  return ops::grouped_linear(at::autocast::cached_cast(dtype, input, device), m_splits, weights,
                             biases, weight_main_grads, bias_main_grads, layer_id,
                             delay_wgrad_compute, lazy_main_grad);
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, AutocastCPU, m) {
  m.impl("linear", &linear_autocast<c10::DeviceType::CPU>);
  m.impl("linear_fprop", &linear_fprop_autocast<c10::DeviceType::CPU>);
  m.impl("grouped_linear", &grouped_linear_autocast<c10::DeviceType::CPU>);
  m.impl("grouped_linear_fprop", &grouped_linear_fprop_autocast<c10::DeviceType::CPU>);
}
TORCH_LIBRARY_IMPL(splitgrad, AutocastCUDA, m) {
  m.impl("linear", &linear_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_fprop", &linear_fprop_autocast<c10::DeviceType::CUDA>);
  m.impl("grouped_linear", &grouped_linear_autocast<c10::DeviceType::CUDA>);
  m.impl("grouped_linear_fprop", &grouped_linear_fprop_autocast<c10::DeviceType::CUDA>);
}

}  // namespace splitgrad::detail
