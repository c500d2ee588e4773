#pragma once
/// \file linear.h
/// splitgrad::Linear, in the torch::nn style: y = x·Wᵀ + b, whose weight gradient can be deferred
/// to backward_dw() (delay_wgrad_compute) and accumulated into an fp32 main_grad
/// (fuse_wgrad_accumulation).

#include <torch/arg.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>

#include "splitgrad/deferred.h"
#include "splitgrad/module.h"

namespace splitgrad {

/// Options for Linear; the keywords are Transformer Engine's te.Linear ones.
/// \code
/// splitgrad::Linear fc(splitgrad::LinearOptions(1024,
/// 4096).bias(false).delay_wgrad_compute(true)); \endcode
struct LinearOptions {
  /// Both must be positive (checked when the layer is built).
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Size of the last dimension of the input.
  TORCH_ARG(int64_t, in_features);
  /// Size of the last dimension of the output.
  TORCH_ARG(int64_t, out_features);
  /// Whether the layer has a bias.
  TORCH_ARG(bool, bias) = true;
  /// Queue the weight/bias gradient in backward; compute it in backward_dw().
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  /// Accumulate the weight gradient into the fp32 buffer set with set_main_grad() instead of
  /// `.grad` (Megatron's main_grad); the bias's too if it has one, else into the bias's `.grad`.
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  /// Parameter dtype, a floating-point one (default: torch's default dtype).
  TORCH_ARG(std::optional<at::ScalarType>, params_dtype) = std::nullopt;
  /// Parameter device (default: CUDA when available, else the CPU).
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// TE's init_method: draws the weight (and zeroes the bias) instead of nn.Linear's
  /// initialisation (see InitMethod).
  TORCH_ARG(InitMethod, init_method) = nullptr;
  /// Name used in messages about this layer (default: "Linear(in, out)#id").
  TORCH_ARG(std::string, name) = "";
};

/// A linear layer, y = x·Wᵀ + b, whose gradients equal torch::nn::Linear's under plain autograd
/// for any tying, reuse, micro-batching and order of backward_dw() calls. Use it through the
/// module holder splitgrad::Linear. Its backward computes the input gradient at once; the weight
/// and bias gradients too, unless built with delay_wgrad_compute, which queues them for
/// backward_dw() (or splitgrad::backward_dw_all()).
class LinearImpl : public DeferredWgradModule<LinearImpl> {
 public:
  /// LinearOptions(in_features, out_features) with the defaults.
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(LinearOptions(in_features, out_features)) {}
  /// Builds the layer (reset()). Throws c10::ValueError for a non-positive size and
  /// c10::TypeError for a params_dtype that is not floating-point.
  explicit LinearImpl(const LinearOptions& options);

  /// Creates the parameters (as nn.Linear initialises them) and registers the layer with the
  /// deferred-wgrad store. Called by the constructor and by clone() on the copy (a fresh
  /// registration); as for torch::nn modules, calling it on a built layer throws (its parameters
  /// are already registered): reset_parameters() re-draws them in place.
  void reset() override;
  /// Re-initialises the parameters in place as torch::nn::Linear does: weight kaiming-uniform
  /// (a = √5), bias uniform in ±1/√in_features; with an init_method, as TE: the weight by it, the
  /// bias zero.
  void reset_parameters();
  /// Prints "splitgrad::Linear(in_features=…, out_features=…, bias=…, delay_wgrad_compute=…,
  /// fuse_wgrad_accumulation=…)".
  void pretty_print(std::ostream& stream) const override;

  /// y = x·Wᵀ + b for x of shape [*, in_features], of the weight's dtype (or autocast's) and
  /// device. Throws c10::ValueError / c10::TypeError / c10::Error naming the layer for an
  /// undefined input, a wrong shape, dtype or device, or, with fuse_wgrad_accumulation, a weight
  /// without a main_grad (set_main_grad()).
  /// `is_first_microbatch` is accepted for TE compatibility; it does not change the gradients
  /// (they accumulate over micro-batches either way).
  torch::Tensor forward(const torch::Tensor& input,
                        std::optional<bool> is_first_microbatch = std::nullopt);

  /// Makes this layer use `weight` (typically another layer's) as its weight: the two share one
  /// parameter, and every contribution to it accumulates. `weight` must be a leaf tensor (a
  /// parameter, not a view such as `other->weight.t()`) of this layer's shape, dtype and device.
  /// The module's parameters() then lists the shared tensor once per layer: give an optimizer
  /// unique_parameters(model) so that it is not stepped twice. Throws c10::ValueError (shape,
  /// device, undefined or non-leaf tensor) or c10::TypeError (dtype) naming the layer.
  void tie_weight(const torch::Tensor& weight);
  /// Likewise for the bias; throws c10::ValueError if this layer was built with bias=false.
  void tie_bias(const torch::Tensor& bias);
  // backward_dw(), pending_passes(), pending_wgrads(),
  // register_wgrad_accumulation_and_reduce_hooks(), clone(), save(), zero_grad():
  // DeferredWgradModule's.

  /// The options the layer was built with.
  LinearOptions options;
  /// W, [out_features, in_features] (registered as "weight"; tie_weight() replaces it).
  torch::Tensor weight;
  /// b, [out_features], or an undefined tensor for bias=false (registered as "bias").
  torch::Tensor bias;

 protected:
  // torch::nn::Sequential / AnyModule call forward() with the defaulted is_first_microbatch.
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(std::optional<bool>())})

 private:
  void check_tie(const char* what, const torch::Tensor& current, const torch::Tensor& tied) const;
  void tie_in_copy(const std::string& name, const torch::Tensor& param) override;
};

/// `module.parameters()` with each tensor once: a weight tied between layers (tie_weight) is
/// listed by every layer that uses it, and an optimizer given it twice steps it twice.
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& module);

/// A ModuleHolder for LinearImpl (`splitgrad::Linear fc(16, 16); fc->forward(x)`).
TORCH_MODULE(Linear);

}  // namespace splitgrad
