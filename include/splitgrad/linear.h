#pragma once
/// \file linear.h
/// splitgrad::Linear, in the torch::nn style: y = x·Wᵀ + b, whose weight gradient can be deferred
/// to backward_dw() (delay_wgrad_compute) and accumulated into an fp32 main_grad
/// (fuse_wgrad_accumulation).

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>

#include "splitgrad/deferred.h"

namespace splitgrad {

/// Options for Linear; the keywords are Transformer Engine's te.Linear ones.
/// \code
/// splitgrad::Linear fc(splitgrad::LinearOptions(1024,
/// 4096).bias(false).delay_wgrad_compute(true)); \endcode
struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// Whether the layer has a bias.
  TORCH_ARG(bool, bias) = true;
  /// Queue the weight/bias gradient in backward; compute it in backward_dw().
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  /// Accumulate the weight gradient into the fp32 buffer set with set_main_grad() instead of
  /// `.grad` (Megatron's main_grad); the bias's too if it has one, else into the bias's `.grad`.
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  /// Parameter dtype (default: torch's default dtype).
  TORCH_ARG(std::optional<at::ScalarType>, params_dtype) = std::nullopt;
  /// Parameter device (default: CUDA when available, else the CPU).
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// Name used in messages about this layer (default: "Linear(in, out)#id").
  TORCH_ARG(std::string, name) = "";
};

class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const LinearOptions& options);

  /// Creates the parameters (as nn.Linear initialises them) and registers the layer.
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// y = x·Wᵀ + b for x of shape [*, in_features].
  torch::Tensor forward(const torch::Tensor& input);

  /// Runs this layer's deferred wgrad for the oldest backward pass still pending. Does nothing for
  /// a layer built with delay_wgrad_compute=false; throws if a delayed layer has nothing pending.
  void backward_dw();
  /// Runs this layer's deferred wgrad queued by backward pass `pass` (see pending_passes()):
  /// a pipeline's W step for one named micro-batch. Does nothing for a regular layer.
  void backward_dw(int64_t pass);
  /// The backward passes with work queued for this layer, oldest first.
  std::vector<int64_t> pending_passes() const;
  /// Deferred wgrad items queued for this layer.
  int64_t pending_wgrads() const;

  /// Makes this layer use `weight` (typically another layer's) as its weight: the two share one
  /// parameter, and every contribution to it accumulates. `weight` must be a leaf tensor (a
  /// parameter, not a view such as `other->weight.t()`) of this layer's shape, dtype and device.
  /// The module's parameters() then lists the shared tensor once per layer: give an optimizer
  /// unique_parameters(model) so that it is not stepped twice.
  void tie_weight(const torch::Tensor& weight);
  /// Likewise for the bias (this layer must have one).
  void tie_bias(const torch::Tensor& bias);

  /// Registers `hook(param)` as a grad-ready hook of each of this layer's parameters (TE's name).
  void register_wgrad_accumulation_and_reduce_hooks(GradReadyHook hook);

  /// A deep copy with a registration (and, for a named layer, a name "<name>#<id>") of its own.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<at::Device>& device = std::nullopt) const override;
  /// torch::save: runs the pending-work guard (check_pending_wgrads) first.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Runs the pending-work guard first (also when called on a module that holds this layer).
  void zero_grad(bool set_to_none = true) override;

  LinearOptions options;
  torch::Tensor weight;
  torch::Tensor bias;

 private:
  void check_tie(const char* what, const torch::Tensor& current, const torch::Tensor& tied) const;
  std::shared_ptr<LayerHandle> layer_;
};

/// `module.parameters()` with each tensor once: a weight tied between layers (tie_weight) is
/// listed by every layer that uses it, and an optimizer given it twice steps it twice.
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& module);

/// A ModuleHolder for LinearImpl (`splitgrad::Linear fc(16, 16); fc->forward(x)`).
TORCH_MODULE(Linear);

}  // namespace splitgrad
