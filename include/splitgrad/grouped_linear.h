#pragma once
/// \file grouped_linear.h
/// splitgrad::GroupedLinear, in the torch::nn style: `num_gemms` experts (MoE) over one tensor's
/// rows. Rows [offset_i, offset_i + m_splits[i]) of the input go through expert i:
/// y_i = x_i·W_iᵀ + b_i. Every expert's weight and bias is a parameter of its own (tie, hook,
/// give a main_grad each), and one application queues one deferred item for backward_dw().

#include <torch/arg.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "splitgrad/deferred.h"
#include "splitgrad/module.h"

namespace splitgrad {

/// Options for GroupedLinear; the keywords are Transformer Engine's te.GroupedLinear ones.
/// \code
/// splitgrad::GroupedLinear experts(
///     splitgrad::GroupedLinearOptions(8, 1024, 4096).bias(false).delay_wgrad_compute(true));
/// \endcode
struct GroupedLinearOptions {
  GroupedLinearOptions(int64_t num_gemms, int64_t in_features, int64_t out_features)
      : num_gemms_(num_gemms), in_features_(in_features), out_features_(out_features) {}
  /// Number of experts (GEMMs).
  TORCH_ARG(int64_t, num_gemms);
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// Whether every expert has a bias.
  TORCH_ARG(bool, bias) = true;
  /// Queue the weight/bias gradients in backward; compute them in backward_dw().
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  /// Accumulate each expert's weight gradient into its fp32 buffer set with set_main_grad()
  /// instead of `.grad`; a bias's too if it has one, else into the bias's `.grad`.
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  /// Parameter dtype (default: torch's default dtype).
  TORCH_ARG(std::optional<at::ScalarType>, params_dtype) = std::nullopt;
  /// Parameter device (default: CUDA when available, else the CPU).
  TORCH_ARG(std::optional<at::Device>, device) = std::nullopt;
  /// TE's init_method: draws each expert's weight (and zeroes its bias) instead of nn.Linear's
  /// initialisation (see InitMethod).
  TORCH_ARG(InitMethod, init_method) = nullptr;
  /// Name used in messages about this layer (default: "GroupedLinear(n, in, out)#id").
  TORCH_ARG(std::string, name) = "";
};

class GroupedLinearImpl : public DeferredWgradModule<GroupedLinearImpl> {
 public:
  GroupedLinearImpl(int64_t num_gemms, int64_t in_features, int64_t out_features)
      : GroupedLinearImpl(GroupedLinearOptions(num_gemms, in_features, out_features)) {}
  explicit GroupedLinearImpl(const GroupedLinearOptions& options);

  /// Creates the parameters weight0 … (and bias0 …), each initialised as nn.Linear's, and
  /// registers the layer.
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// y = x_i·W_iᵀ + b_i per expert, for x [*, in_features] (flattened to [tokens, in_features]).
  /// \param m_splits the rows per expert: an integer tensor (int64; another integer dtype is cast
  ///        to it on its device) of num_gemms non-negative entries
  ///        summing to the tokens, on the CPU or on the input's device (not synchronised on by the
  ///        ops; the CUDA back end's per-expert loop reads it to the host for now)
  ///        Host splits: `torch::tensor(std::vector<int64_t>{...})`. (One overload only, so that
  ///        the ModuleHolder's `experts(x, m_splits)` resolves.)
  /// `is_first_microbatch` is accepted for TE compatibility; it does not change the gradients
  /// (they accumulate over micro-batches either way).
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& m_splits,
                        std::optional<bool> is_first_microbatch = std::nullopt);

  /// Makes expert `expert` use `weight` (another expert's, another layer's) as its weight: a leaf
  /// tensor of the layer's weight shape, dtype and device. Every contribution accumulates.
  void tie_weight(int64_t expert, const torch::Tensor& weight);
  /// Likewise for expert `expert`'s bias (the layer must have biases).
  void tie_bias(int64_t expert, const torch::Tensor& bias);

  // backward_dw(), pending_passes(), pending_wgrads() (one item per application, whatever
  // num_gemms), register_wgrad_accumulation_and_reduce_hooks(), clone(), save(), zero_grad():
  // DeferredWgradModule's.

  GroupedLinearOptions options;
  std::vector<torch::Tensor> weights;  ///< weight0 … weight{num_gemms-1}
  std::vector<torch::Tensor> biases;   ///< bias0 …, or empty without bias

 protected:
  // torch::nn::Sequential / AnyModule call forward() with the defaulted is_first_microbatch.
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(std::optional<bool>())})

 private:
  void check_expert(int64_t expert) const;
  void tie(const char* what, int64_t expert, std::vector<torch::Tensor>& params,
           const torch::Tensor& tied);
  void tie_in_copy(const std::string& name, const torch::Tensor& param) override;
};

/// A ModuleHolder for GroupedLinearImpl.
TORCH_MODULE(GroupedLinear);

}  // namespace splitgrad
