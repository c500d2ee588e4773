#include "splitgrad/linear.h"

#include <algorithm>

#include "api/module_common.h"
#include "ops/checks.h"
#include "splitgrad/ops.h"

namespace splitgrad {

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_) { reset(); }

void LinearImpl::reset() {
  TORCH_CHECK_VALUE(options.in_features() > 0 && options.out_features() > 0,
                    "splitgrad::Linear: expected positive in_features and out_features, got ",
                    options.in_features(), " and ", options.out_features());
  const at::Device device = detail::module_device(options.device());
  const at::ScalarType dtype = detail::module_dtype("splitgrad::Linear", options.params_dtype());
  const auto tensor_options = torch::TensorOptions().dtype(dtype).device(device);
  weight = register_parameter(
      "weight", torch::empty({options.out_features(), options.in_features()}, tensor_options));
  bias = options.bias()
             ? register_parameter("bias", torch::empty({options.out_features()}, tensor_options))
             : register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  layer_ = detail::register_layer(options.name(), c10::str("Linear(", options.in_features(), ", ",
                                                           options.out_features(), ")"));
  reset_parameters();
}

void LinearImpl::reset_parameters() { detail::reset_linear(weight, bias, options.init_method()); }

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "splitgrad::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", delay_wgrad_compute=" << options.delay_wgrad_compute()
         << ", fuse_wgrad_accumulation=" << options.fuse_wgrad_accumulation() << ")";
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input,
                                  std::optional<bool> /*is_first_microbatch*/) {
  // Checked here: the dispatcher fails on an undefined tensor before splitgrad's checks run.
  TORCH_CHECK_VALUE(input.defined(), "splitgrad layer '", layer_->name(),
                    "': expected an input of shape [*, ", options.in_features(),
                    "], got an undefined tensor");
  const bool fused = options.fuse_wgrad_accumulation();
  if (fused) {
    // The weight's main_grad is required; a bias without one gets its gradient in bias.grad.
    // Checked here; the backward reads them again (lazy_main_grad), as Transformer Engine's does.
    detail::fused_main_grad(*layer_, weight, "weight", /*required=*/true);
    detail::fused_main_grad(*layer_, bias, "bias", /*required=*/false);
  }
  return ops::linear(input, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                     std::nullopt, std::nullopt, layer_->id(), options.delay_wgrad_compute(),
                     std::nullopt, fused);
}

void LinearImpl::check_tie(const char* what, const torch::Tensor& current,
                           const torch::Tensor& tied) const {
  detail::check_tie(*layer_, c10::str("tie_", what), what, current, tied);
}

void LinearImpl::tie_weight(const torch::Tensor& new_weight) {
  check_tie("weight", weight, new_weight);
  weight = new_weight;
  retied("weight", weight);
}

void LinearImpl::tie_bias(const torch::Tensor& new_bias) {
  TORCH_CHECK_VALUE(bias.defined(), "splitgrad layer '", layer_->name(),
                    "': tie_bias on a layer built with bias=false");
  check_tie("bias", bias, new_bias);
  bias = new_bias;
  retied("bias", bias);
}

std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (const auto& param : module.parameters()) {
    const bool seen = std::any_of(out.begin(), out.end(),
                                  [&](const torch::Tensor& p) { return p.is_same(param); });
    if (!seen) out.push_back(param);
  }
  return out;
}

void LinearImpl::tie_in_copy(const std::string& name, const torch::Tensor& param) {
  // weight [out, in] and bias [out] are never one tensor: nothing of a Linear is tied within it.
  TORCH_INTERNAL_ASSERT(
      false, "splitgrad::Linear: no parameter can be tied to another of its own (", name, ")");
}

}  // namespace splitgrad
