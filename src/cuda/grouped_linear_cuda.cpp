// The CUDA back end of the grouped ops: for now a loop over the groups, each running the cuBLASLt
// linear products (cuda/linear_cuda.h) on views of its rows, writing straight into the grouped
// output or target (no copies).
//
// TODO(grouped GEMM): the loop reads m_splits to the host (a synchronisation when they are on the
// device) and launches one GEMM per group. A grouped kernel (cuBLASLt grouped GEMM, CUTLASS's
// grouped kernels, torch's _grouped_mm) replaces each loop below with one launch that reads the
// splits on the device; the op schemas, the autograd and the deferred runner stay as they are.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "aten/linear_aten.h"
#include "cuda/linear_cuda.h"
#include "ops/checks.h"

namespace splitgrad::cuda_backend {
namespace {

using OptTensorList = c10::List<std::optional<at::Tensor>>;

// The splits on the host, checked. TODO(grouped GEMM): a device tensor is copied here, which waits
// for the stream; the grouped kernels will read it in place.
std::vector<int64_t> host_splits(detail::Who who, const at::Tensor& m_splits, int64_t rows) {
  return detail::split_sizes(who, m_splits.device().is_cpu() ? m_splits : m_splits.cpu(), rows);
}

at::Tensor grouped_linear_fprop(const at::Tensor& input, const at::Tensor& m_splits,
                                at::TensorList weights, at::TensorList biases) {
  const auto who = detail::named("splitgrad::grouped_linear_fprop");
  detail::check_grouped_linear_args(who, input, m_splits, weights, biases,
                                    /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = detail::flatten_tokens(input);
  const auto splits = host_splits(who, m_splits, x.size(0));
  if (!covers(input.scalar_type())) {
    return aten_backend::grouped_linear_fprop(input, splits, weights, biases);
  }
  const int64_t out = weights[0].size(0);
  at::Tensor y = at::empty({x.size(0), out}, input.options());
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    const std::optional<at::Tensor> bias =
        biases.empty() ? std::nullopt : std::optional<at::Tensor>(biases[i]);
    fprop_into(x.narrow(0, offset, splits[i]), weights[i], bias, y.narrow(0, offset, splits[i]));
  }
  return input.dim() == 2 ? y : y.view(detail::with_last_dim(input.sizes(), out));
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const at::Tensor& m_splits,
                                at::TensorList weights) {
  const auto who = detail::named("splitgrad::grouped_linear_dgrad");
  detail::check_grouped_dgrad_args(who, grad_output, m_splits, weights,
                                   /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const auto splits = host_splits(who, m_splits, dy.size(0));
  if (!covers(grad_output.scalar_type())) {
    return aten_backend::grouped_linear_dgrad(grad_output, splits, weights);
  }
  const int64_t in = weights[0].size(1);
  at::Tensor dx = at::empty({dy.size(0), in}, grad_output.options());
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    dgrad_into(dy.narrow(0, offset, splits[i]), weights[i], dx.narrow(0, offset, splits[i]));
  }
  return grad_output.dim() == 2 ? dx : dx.view(detail::with_last_dim(grad_output.sizes(), in));
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& m_splits,
    bool compute_bias_grad) {
  const auto who = detail::named("splitgrad::grouped_linear_wgrad");
  detail::check_grouped_wgrad_args(who, grad_output, input, m_splits,
                                   /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  const auto splits = host_splits(who, m_splits, x.size(0));
  std::vector<at::Tensor> weight_grads, bias_grads;
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    // linear_wgrad hands dtypes it does not cover to the ATen back end itself.
    auto [weight_grad, bias_grad] = linear_wgrad(dy.narrow(0, offset, splits[i]),
                                                 x.narrow(0, offset, splits[i]), compute_bias_grad);
    weight_grads.push_back(std::move(weight_grad));
    if (compute_bias_grad) bias_grads.push_back(std::move(bias_grad));
  }
  return {std::move(weight_grads), std::move(bias_grads)};
}

void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& m_splits, const OptTensorList& weight_grads,
                                      const OptTensorList& bias_grads) {
  const auto who = detail::named("splitgrad::grouped_linear_wgrad_accumulate_");
  detail::check_grouped_wgrad_accumulate_args(who, grad_output, input, m_splits, weight_grads,
                                              bias_grads, /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  const auto splits = host_splits(who, m_splits, x.size(0));
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    const std::optional<at::Tensor> weight_grad =
        weight_grads.empty() ? std::nullopt : weight_grads.get(i);
    const std::optional<at::Tensor> bias_grad =
        bias_grads.empty() ? std::nullopt : bias_grads.get(i);
    // In group order, so targets shared by several groups (tied experts) add up in sequence.
    linear_wgrad_accumulate_(dy.narrow(0, offset, splits[i]), x.narrow(0, offset, splits[i]),
                             weight_grad, bias_grad);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, CUDA, m) {
  m.impl("grouped_linear_fprop", &grouped_linear_fprop);
  m.impl("grouped_linear_dgrad", &grouped_linear_dgrad);
  m.impl("grouped_linear_wgrad", &grouped_linear_wgrad);
  m.impl("grouped_linear_wgrad_accumulate_", &grouped_linear_wgrad_accumulate_);
}

}  // namespace splitgrad::cuda_backend
