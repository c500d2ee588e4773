// The ATen back end of the grouped ops: a loop over the groups, each on views of its rows (row
// slices of row-major [tokens, features] tensors, so each GEMM reads and writes them in place).
// Each group runs the GEMM the linear ops run (addmm / mm, linear_wgrad's and
// linear_wgrad_accumulate_'s), so on the CPU a group's results equal nn.Linear's on its rows bit
// for bit. The registered kernels take the splits on the CPU; the host-split functions are also
// the fallback of other back ends for dtypes they do not cover.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "aten/linear_aten.h"
#include "ops/checks.h"

namespace splitgrad::aten_backend {
namespace {
using OptTensorList = c10::List<std::optional<at::Tensor>>;

std::optional<at::Tensor> entry(const OptTensorList& list, size_t i) {
  if (list.empty()) return std::nullopt;
  std::optional<at::Tensor> t = list.get(i);
  return t.has_value() && t->defined() ? t : std::nullopt;
}
}  // namespace

at::Tensor grouped_linear_fprop(const at::Tensor& input, const std::vector<int64_t>& splits,
                                at::TensorList weights, at::TensorList biases) {
  const at::Tensor x = detail::flatten_tokens(input);
  const int64_t out = weights[0].size(0);
  at::Tensor y = at::empty({x.size(0), out}, input.options());
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    if (splits[i] == 0) continue;
    const at::Tensor x_i = x.narrow(0, offset, splits[i]);
    at::Tensor y_i = y.narrow(0, offset, splits[i]);
    if (biases.empty()) {
      at::mm_out(y_i, x_i, weights[i].t());
    } else {
      at::addmm_out(y_i, biases[i], x_i, weights[i].t());
    }
  }
  return input.dim() == 2 ? y : y.view(detail::with_last_dim(input.sizes(), out));
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const std::vector<int64_t>& splits,
                                at::TensorList weights) {
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const int64_t in = weights[0].size(1);
  at::Tensor dx = at::empty({dy.size(0), in}, grad_output.options());
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    if (splits[i] == 0) continue;
    at::Tensor dx_i = dx.narrow(0, offset, splits[i]);
    at::mm_out(dx_i, dy.narrow(0, offset, splits[i]), weights[i]);
  }
  return grad_output.dim() == 2 ? dx : dx.view(detail::with_last_dim(grad_output.sizes(), in));
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const std::vector<int64_t>& splits,
    bool compute_bias_grad) {
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  std::vector<at::Tensor> weight_grads, bias_grads;
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    // A group without rows gets zeros (mm over an empty k), as nn.Linear's backward gives it.
    auto [weight_grad, bias_grad] = linear_wgrad(dy.narrow(0, offset, splits[i]),
                                                 x.narrow(0, offset, splits[i]), compute_bias_grad);
    weight_grads.push_back(std::move(weight_grad));
    if (compute_bias_grad) bias_grads.push_back(std::move(bias_grad));
  }
  return {std::move(weight_grads), std::move(bias_grads)};
}

void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const std::vector<int64_t>& splits,
                                      const OptTensorList& weight_grads,
                                      const OptTensorList& bias_grads) {
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    const auto weight_grad = entry(weight_grads, i);
    const auto bias_grad = entry(bias_grads, i);
    if (splits[i] == 0 || (!weight_grad && !bias_grad)) continue;  // adds zero
    linear_wgrad_accumulate_(dy.narrow(0, offset, splits[i]), x.narrow(0, offset, splits[i]),
                             weight_grad, bias_grad);
  }
}

namespace {

auto named(const char* name) { return detail::named(name); }

at::Tensor fprop_kernel(const at::Tensor& input, const at::Tensor& m_splits, at::TensorList weights,
                        at::TensorList biases) {
  const auto who = named("splitgrad::grouped_linear_fprop");
  detail::check_grouped_linear_args(who, input, m_splits, weights, biases,
                                    /*splits_on_cpu_only=*/true);
  const auto splits = detail::split_sizes(who, m_splits, detail::flatten_tokens(input).size(0));
  return grouped_linear_fprop(input, splits, weights, biases);
}

at::Tensor dgrad_kernel(const at::Tensor& grad_output, const at::Tensor& m_splits,
                        at::TensorList weights) {
  const auto who = named("splitgrad::grouped_linear_dgrad");
  detail::check_grouped_dgrad_args(who, grad_output, m_splits, weights,
                                   /*splits_on_cpu_only=*/true);
  const auto splits =
      detail::split_sizes(who, m_splits, detail::flatten_tokens(grad_output).size(0));
  return grouped_linear_dgrad(grad_output, splits, weights);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> wgrad_kernel(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& m_splits,
    bool compute_bias_grad) {
  const auto who = named("splitgrad::grouped_linear_wgrad");
  detail::check_grouped_wgrad_args(who, grad_output, input, m_splits, /*splits_on_cpu_only=*/true);
  const auto splits = detail::split_sizes(who, m_splits, detail::flatten_tokens(input).size(0));
  return grouped_linear_wgrad(grad_output, input, splits, compute_bias_grad);
}

void wgrad_accumulate_kernel(const at::Tensor& grad_output, const at::Tensor& input,
                             const at::Tensor& m_splits, const OptTensorList& weight_grads,
                             const OptTensorList& bias_grads) {
  const auto who = named("splitgrad::grouped_linear_wgrad_accumulate_");
  detail::check_grouped_wgrad_accumulate_args(who, grad_output, input, m_splits, weight_grads,
                                              bias_grads, /*splits_on_cpu_only=*/true);
  const auto splits = detail::split_sizes(who, m_splits, detail::flatten_tokens(input).size(0));
  grouped_linear_wgrad_accumulate_(grad_output, input, splits, weight_grads, bias_grads);
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, CompositeExplicitAutograd, m) {
  m.impl("grouped_linear_fprop", &fprop_kernel);
  m.impl("grouped_linear_dgrad", &dgrad_kernel);
  m.impl("grouped_linear_wgrad", &wgrad_kernel);
  m.impl("grouped_linear_wgrad_accumulate_", &wgrad_accumulate_kernel);
}

}  // namespace splitgrad::aten_backend
