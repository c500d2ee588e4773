#pragma once
// What the C++ modules (Linear, GroupedLinear, LayerNormLinear, LayerNormMLP) share in building
// and running them, written once: where their parameters go, their registration with the
// deferred-wgrad store, nn.Linear's initialisation, the fused main_grad lookup and the checks of
// a tie. (What they offer alike to callers is DeferredWgradModule's, splitgrad/module.h.)

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "splitgrad/deferred.h"
#include "splitgrad/module.h"

namespace splitgrad::detail {

/// The parameters' device: `device`, else CUDA when it is available, else the CPU.
at::Device module_device(const std::optional<at::Device>& device);

/// The parameters' dtype: `dtype`, else torch's default dtype; must be floating
/// (c10::TypeError naming `module`, e.g. "splitgrad::Linear", otherwise).
at::ScalarType module_dtype(const char* module, const std::optional<at::ScalarType>& dtype);

/// A registration named `name`, or "<default_prefix>#<id>" when `name` is empty.
std::shared_ptr<LayerHandle> register_layer(const std::string& name,
                                            const std::string& default_prefix);

/// nn.Linear's initialisation: kaiming-uniform weight [out, in], bias (if defined) uniform in
/// ±1/sqrt(in); or TE's with an `init_method`: the weight by it, the bias zero.
void reset_linear(const at::Tensor& weight, const at::Tensor& bias,
                  const InitMethod& init_method = nullptr);

/// For fuse_wgrad_accumulation: `param`'s main_grad (set_main_grad), checked (the op's
/// check_main_grad, in messages naming `gemm` of a module with several). nullopt for a parameter
/// that is undefined or frozen, or has none and is not `required` (a bias: its gradient goes to
/// .grad); a required one missing is a c10::ValueError naming the layer and `what`.
std::optional<at::Tensor> fused_main_grad(const LayerHandle& layer, const at::Tensor& param,
                                          const std::string& what, bool required,
                                          const std::string& gemm = "");

/// Checks that `tied` can replace `current` as `what` of `layer` (`call` names the method in
/// messages: "tie_weight"): a defined leaf of its shape, dtype and device.
void check_tie(const LayerHandle& layer, const std::string& call, const std::string& what,
               const at::Tensor& current, const at::Tensor& tied);

}  // namespace splitgrad::detail
