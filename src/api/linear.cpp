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
  reduce_hooks_.clear();  // a clone starts without the original's hooks
  layer_ = detail::register_layer(options.name(), c10::str("Linear(", options.in_features(), ", ",
                                                           options.out_features(), ")"));
  reset_parameters();
}

void LinearImpl::reset_parameters() { detail::reset_linear(weight, bias); }

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "splitgrad::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", delay_wgrad_compute=" << options.delay_wgrad_compute()
         << ", fuse_wgrad_accumulation=" << options.fuse_wgrad_accumulation() << ")";
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
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

void LinearImpl::backward_dw() {
  if (options.delay_wgrad_compute()) layer_->backward_dw();
}

void LinearImpl::backward_dw(int64_t pass) {
  if (options.delay_wgrad_compute()) layer_->backward_dw(pass);
}

std::vector<int64_t> LinearImpl::pending_passes() const { return layer_->pending_passes(); }

int64_t LinearImpl::pending_wgrads() const { return layer_->pending(); }

void LinearImpl::check_tie(const char* what, const torch::Tensor& current,
                           const torch::Tensor& tied) const {
  detail::check_tie(*layer_, c10::str("tie_", what), what, current, tied);
}

void LinearImpl::tie_weight(const torch::Tensor& new_weight) {
  check_tie("weight", weight, new_weight);
  parameters_["weight"] = new_weight;
  weight = new_weight;
  reduce_hooks_.follow({weight, bias});
}

void LinearImpl::tie_bias(const torch::Tensor& new_bias) {
  TORCH_CHECK_VALUE(bias.defined(), "splitgrad layer '", layer_->name(),
                    "': tie_bias on a layer built with bias=false");
  check_tie("bias", bias, new_bias);
  parameters_["bias"] = new_bias;
  bias = new_bias;
  reduce_hooks_.follow({weight, bias});
}

std::shared_ptr<torch::nn::Module> LinearImpl::clone(
    const std::optional<at::Device>& device) const {
  auto copy = torch::nn::Cloneable<LinearImpl>::clone(device);
  auto& linear = static_cast<LinearImpl&>(*copy);
  // reset() gave the copy a registration of its own; a default name already carries its id, a
  // user's name gets it too, so messages tell the two apart.
  if (!options.name().empty()) {
    linear.options.name(c10::str(options.name(), "#", linear.layer_->id()));
    linear.layer_->set_name(linear.options.name());
  }
  return copy;
}

void LinearImpl::save(torch::serialize::OutputArchive& archive) const {
  check_pending_wgrads(c10::str("saving splitgrad layer '", layer_->name(), "'"), {weight, bias});
  torch::nn::Cloneable<LinearImpl>::save(archive);
}

void LinearImpl::zero_grad(bool set_to_none) {
  check_pending_wgrads(c10::str("zero_grad() of splitgrad layer '", layer_->name(), "'"),
                       {weight, bias});
  torch::nn::Cloneable<LinearImpl>::zero_grad(set_to_none);
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

void LinearImpl::register_wgrad_accumulation_and_reduce_hooks(GradReadyHook hook) {
  reduce_hooks_.add(std::move(hook), {weight, bias});
}

}  // namespace splitgrad
