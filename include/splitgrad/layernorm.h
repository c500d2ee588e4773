#pragma once
/// \file layernorm.h
/// splitgrad::LayerNormLinear and splitgrad::LayerNormMLP, Transformer Engine's te.LayerNormLinear
/// and te.LayerNormMLP in the torch::nn style: a norm (ATen's layer_norm / rms_norm, differentiated
/// by autograd in the backward, as TE does) followed by splitgrad linear maps whose weight and
/// bias gradients can be deferred to backward_dw(). Every GEMM of a module queues its deferred
/// work under the module's one registration, so one backward_dw() runs one backward pass's work
/// of all of them (fc2's, then fc1's).

#include <torch/arg.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "splitgrad/deferred.h"
#include "splitgrad/module.h"

namespace splitgrad {

/// Options for LayerNormLinear; the keywords are te.LayerNormLinear's.
/// \code
/// splitgrad::LayerNormLinear qkv(splitgrad::LayerNormLinearOptions(1024, 3072)
///                                    .normalization("RMSNorm").delay_wgrad_compute(true));
/// \endcode
struct LayerNormLinearOptions {
  LayerNormLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// Added to the variance (LayerNorm) or the mean square (RMSNorm).
  TORCH_ARG(double, eps) = 1e-5;
  /// Whether the linear map has a bias.
  TORCH_ARG(bool, bias) = true;
  /// "LayerNorm" (layer_norm_weight and layer_norm_bias) or "RMSNorm" (layer_norm_weight only).
  TORCH_ARG(std::string, normalization) = "LayerNorm";
  /// The norm scales by 1 + layer_norm_weight (which starts at 0), as TE's zero_centered_gamma;
  /// with 16-bit parameters the 1 is added in fp32 and the norm runs in fp32 (TE's numerics).
  TORCH_ARG(bool, zero_centered_gamma) = false;
  /// Queue the weight/bias gradients in backward; compute them in backward_dw(). The norm's
  /// gradients are computed in the backward either way.
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  /// Accumulate the weight gradient into the fp32 buffer set with set_main_grad(); the bias's
  /// too if it has one, else into the bias's `.grad`. The norm's gradients go to `.grad`.
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  /// Parameter dtype (default: torch's default dtype).
  TORCH_ARG(std::optional<at::ScalarType>, params_dtype) = std::nullopt;
  /// Parameter device (default: CUDA when available, else the CPU).
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// TE's init_method: draws the weight (and zeroes the bias) instead of nn.Linear's
  /// initialisation (see InitMethod).
  TORCH_ARG(InitMethod, init_method) = nullptr;
  /// Name used in messages about this module (default: "LayerNormLinear(in, out)#id").
  TORCH_ARG(std::string, name) = "";
};

/// y = norm(x)·Wᵀ + b.
class LayerNormLinearImpl : public DeferredWgradModule<LayerNormLinearImpl> {
 public:
  LayerNormLinearImpl(int64_t in_features, int64_t out_features)
      : LayerNormLinearImpl(LayerNormLinearOptions(in_features, out_features)) {}
  explicit LayerNormLinearImpl(const LayerNormLinearOptions& options);

  /// Creates the parameters (norm weight 1, or 0 with zero_centered_gamma; norm bias 0; the
  /// linear map as nn.Linear initialises it, or by init_method) and registers the module.
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// norm(x)·Wᵀ + b for x of shape [*, in_features].
  /// `is_first_microbatch` is accepted for TE compatibility; it does not change the gradients
  /// (they accumulate over micro-batches either way).
  torch::Tensor forward(const torch::Tensor& input,
                        std::optional<bool> is_first_microbatch = std::nullopt);
  /// (norm(x)·Wᵀ + b, norm(x)): TE's return_layernorm_output.
  std::tuple<torch::Tensor, torch::Tensor> forward_with_layernorm_output(
      const torch::Tensor& input);

  /// Makes the parameter `name` ("layer_norm_weight", "layer_norm_bias", "weight" or "bias")
  /// this tensor (typically another module's parameter): a leaf of the same shape, dtype and
  /// device. Every contribution to the shared parameter accumulates.
  void tie_parameter(const std::string& name, const torch::Tensor& param);

  // backward_dw(), pending_passes(), pending_wgrads() (one item per application),
  // register_wgrad_accumulation_and_reduce_hooks(), clone(), save(), zero_grad():
  // DeferredWgradModule's.

  LayerNormLinearOptions options;
  torch::Tensor layer_norm_weight;
  torch::Tensor layer_norm_bias;  ///< undefined for RMSNorm
  torch::Tensor weight;
  torch::Tensor bias;

 protected:
  // torch::nn::Sequential / AnyModule call forward() with the defaulted is_first_microbatch.
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(std::optional<bool>())})

 private:
  void tie_in_copy(const std::string& name, const torch::Tensor& param) override {
    tie_parameter(name, param);
  }
};

/// A ModuleHolder for LayerNormLinearImpl.
TORCH_MODULE(LayerNormLinear);

/// Options for LayerNormMLP; the keywords are te.LayerNormMLP's.
/// \code
/// splitgrad::LayerNormMLP mlp(splitgrad::LayerNormMLPOptions(1024, 4096)
///                                 .activation("swiglu").delay_wgrad_compute(true));
/// \endcode
struct LayerNormMLPOptions {
  LayerNormMLPOptions(int64_t hidden_size, int64_t ffn_hidden_size)
      : hidden_size_(hidden_size), ffn_hidden_size_(ffn_hidden_size) {}
  /// Size of the input's last dimension and of the output's.
  TORCH_ARG(int64_t, hidden_size);
  /// fc2's input size; fc1's output size (twice that for a gated activation).
  TORCH_ARG(int64_t, ffn_hidden_size);
  TORCH_ARG(double, eps) = 1e-5;
  /// Whether fc1 and fc2 have biases.
  TORCH_ARG(bool, bias) = true;
  /// "LayerNorm" or "RMSNorm".
  TORCH_ARG(std::string, normalization) = "LayerNorm";
  /// TE's names: "gelu" (the tanh approximation, as TE computes it), "relu", "silu", "qgelu",
  /// "srelu", or the gated "geglu", "reglu", "swiglu", "qgeglu", "sreglu", "glu": fc1's output
  /// [a | b] gives act(a) * b (TE gates the first half). See ops.h's activation().
  TORCH_ARG(std::string, activation) = "gelu";
  TORCH_ARG(bool, zero_centered_gamma) = false;
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  TORCH_ARG(std::optional<at::ScalarType>, params_dtype) = std::nullopt;
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// TE's init_method and output_layer_init_method: draw fc1_weight and fc2_weight (and zero
  /// their biases) instead of nn.Linear's initialisation (see InitMethod).
  TORCH_ARG(InitMethod, init_method) = nullptr;
  TORCH_ARG(InitMethod, output_layer_init_method) = nullptr;
  /// Name used in messages (default: "LayerNormMLP(hidden, ffn)#id").
  TORCH_ARG(std::string, name) = "";
};

/// y = fc2(act(fc1(norm(x)))).
class LayerNormMLPImpl : public DeferredWgradModule<LayerNormMLPImpl> {
 public:
  LayerNormMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size)
      : LayerNormMLPImpl(LayerNormMLPOptions(hidden_size, ffn_hidden_size)) {}
  explicit LayerNormMLPImpl(const LayerNormMLPOptions& options);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// fc2(act(fc1(norm(x)))) for x of shape [*, hidden_size].
  /// `is_first_microbatch` is accepted for TE compatibility; it does not change the gradients
  /// (they accumulate over micro-batches either way).
  torch::Tensor forward(const torch::Tensor& input,
                        std::optional<bool> is_first_microbatch = std::nullopt);
  /// (fc2(act(fc1(norm(x)))), norm(x)): TE's return_layernorm_output.
  std::tuple<torch::Tensor, torch::Tensor> forward_with_layernorm_output(
      const torch::Tensor& input);

  /// As LayerNormLinear's, for "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias",
  /// "fc2_weight" or "fc2_bias".
  void tie_parameter(const std::string& name, const torch::Tensor& param);
  // backward_dw() (one backward pass's wgrad of both GEMMs: fc2's, then fc1's),
  // pending_passes(), pending_wgrads() (two items per application: fc2 and fc1),
  // register_wgrad_accumulation_and_reduce_hooks(), clone(), save(), zero_grad():
  // DeferredWgradModule's.

  LayerNormMLPOptions options;
  torch::Tensor layer_norm_weight;
  torch::Tensor layer_norm_bias;  ///< undefined for RMSNorm
  torch::Tensor fc1_weight;       ///< [ffn (2·ffn gated), hidden]
  torch::Tensor fc1_bias;
  torch::Tensor fc2_weight;  ///< [hidden, ffn]
  torch::Tensor fc2_bias;

 protected:
  // torch::nn::Sequential / AnyModule call forward() with the defaulted is_first_microbatch.
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(std::optional<bool>())})

 private:
  void tie_in_copy(const std::string& name, const torch::Tensor& param) override {
    tie_parameter(name, param);
  }
};

/// A ModuleHolder for LayerNormMLPImpl.
TORCH_MODULE(LayerNormMLP);

}  // namespace splitgrad
