#include "api/module_common.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/DefaultDtype.h>
#include <torch/cuda.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>

#include "ops/checks.h"
#include "ops/deferred_internal.h"

namespace splitgrad::detail {

at::Device module_device(const std::optional<at::Device>& device) {
  return device.value_or(torch::cuda::is_available() ? at::Device(at::kCUDA)
                                                     : at::Device(at::kCPU));
}

at::ScalarType module_dtype(const char* module, const std::optional<at::ScalarType>& dtype) {
  const at::ScalarType type = dtype.value_or(c10::typeMetaToScalarType(c10::get_default_dtype()));
  TORCH_CHECK_TYPE(at::isFloatingType(type), module,
                   ": expected a floating-point params_dtype (torch.float32, torch.bfloat16, "
                   "...), got ",
                   dtype_name(type));
  return type;
}

std::shared_ptr<LayerHandle> register_layer(const std::string& name,
                                            const std::string& default_prefix) {
  auto layer = std::make_shared<LayerHandle>(name);
  if (name.empty()) layer->set_name(c10::str(default_prefix, "#", layer->id()));
  return layer;
}

void reset_linear(const at::Tensor& weight, const at::Tensor& bias, const InitMethod& init_method) {
  if (init_method) {
    const at::NoGradGuard no_grad;  // the parameters are leaves that require grad
    init_method(weight);
    if (bias.defined()) bias.zero_();
    return;
  }
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

std::optional<at::Tensor> fused_main_grad(const LayerHandle& layer, const at::Tensor& param,
                                          const std::string& what, bool required,
                                          const std::string& gemm) {
  // No backward can reach a frozen parameter, nor one used with grad mode off (an eval forward).
  if (!param.defined() || !param.requires_grad() || !at::GradMode::is_enabled()) {
    return std::nullopt;
  }
  at::Tensor buffer = main_grad(param);
  if (!buffer.defined() && !required) return std::nullopt;
  TORCH_CHECK_VALUE(buffer.defined(), layer_label(layer.id(), gemm),
                    ": fuse_wgrad_accumulation=true needs the ", what,
                    "'s main_grad (an fp32 tensor of shape ", param.sizes(),
                    "); set it with splitgrad::set_main_grad()");
  // set_main_grad() checked it, but a buffer can change after that (resize_).
  check_main_grad([&] { return layer_label(layer.id(), gemm); }, what, buffer, param);
  return buffer;
}

void check_tie(const LayerHandle& layer, const std::string& call, const std::string& what,
               const at::Tensor& current, const at::Tensor& tied) {
  const std::string who = c10::str("splitgrad layer '", layer.name(), "': ", call);
  TORCH_CHECK_VALUE(tied.defined(), who, " expected a tensor of shape ", current.sizes(), " for ",
                    what, ", got an undefined tensor");
  TORCH_CHECK_VALUE(tied.sizes() == current.sizes(), who, " expected a tensor of shape ",
                    current.sizes(), " for ", what, ", got ", tied.sizes());
  // A deferred gradient is added to the tied tensor's own .grad: for a non-leaf (a view such as
  // other->weight.t()) it would never reach the parameter behind it.
  TORCH_CHECK_VALUE(tied.is_leaf(), who,
                    " expected a parameter (a leaf tensor), got a non-leaf tensor (a view or the "
                    "result of an op, such as other->weight.t()). Tie to the parameter itself; for "
                    "a transposed tie, use torch::nn::functional::linear(x, other->weight.t()).");
  TORCH_CHECK_TYPE(tied.scalar_type() == current.scalar_type(), who, " expected a tensor of dtype ",
                   dtype_name(current.scalar_type()), " for ", what, " (the layer's), got ",
                   dtype_name(tied.scalar_type()));
  TORCH_CHECK_VALUE(tied.device() == current.device(), who, " expected a tensor on ",
                    current.device(), " for ", what, " (the layer's device), got ", tied.device());
}

void ModuleReduceHooks::install(const GradReadyHook& hook, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> seen;
  for (const auto& param : params) {
    if (!param.defined() || !param.requires_grad()) continue;
    if (std::any_of(seen.begin(), seen.end(), [&](const auto& p) { return p.is_same(param); }))
      continue;  // tied within the module: one hook
    seen.push_back(param);
    handles_.push_back(register_grad_ready_hook(param, hook));
  }
}

void ModuleReduceHooks::add(GradReadyHook hook, const std::vector<at::Tensor>& params) {
  install(hook, params);
  hooks_.push_back(std::move(hook));
}

void ModuleReduceHooks::follow(const std::vector<at::Tensor>& params) {
  for (auto& handle : handles_) handle.remove();
  handles_.clear();
  for (const auto& hook : hooks_) install(hook, params);
}

void ModuleReduceHooks::clear() {
  hooks_.clear();
  handles_.clear();
}

}  // namespace splitgrad::detail
