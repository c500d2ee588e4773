#pragma once
/// \file ops.h
/// The linear-layer operators, called through the PyTorch dispatcher (so autograd, tracing and
/// torch.compile see them). Shapes: `input` [*, in_features], `weight` [out_features, in_features],
/// `bias` [out_features], `grad_output` [*, out_features] with the same leading dims as `input`.
///
/// Every operator checks its arguments and throws, naming the operator (or the layer), what it
/// expected and what it got: c10::ValueError for a shape, c10::TypeError for a dtype (weights are
/// floating-point; the input, bias and grad_output have the weight's dtype, or autocast's for the
/// input), c10::Error for tensors on different devices.

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

namespace splitgrad::ops {

/// fprop: y = x·Wᵀ + b.
/// \param input  x, [*, in_features]
/// \param weight W, [out_features, in_features]
/// \param bias   b, [out_features], or nullopt
/// \return y, [*, out_features] (no autograd: see linear() for the differentiable op)
at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias);

/// dgrad: dx = dy·W.
/// \param grad_output dy, [*, out_features]
/// \param weight      W, [out_features, in_features]
/// \return dx, [*, in_features]
at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight);

/// wgrad into fresh tensors: dW = dyᵀ·x over all leading dims, db = Σ dy.
/// \param grad_output       dy, [*, out_features]
/// \param input             x, [*, in_features]
/// \param compute_bias_grad whether to compute db; when false the second result is empty ([0])
/// \return (dW [out_features, in_features], db [out_features] or [0]), in the inputs' dtype
std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad);

/// wgrad accumulated in place: `+=`, never `=`. weight_grad += dyᵀ·x, bias_grad += Σ dy. The sums
/// are formed in the target's dtype: an fp32 main_grad receives fp32 products of bf16/fp16 inputs;
/// a target of the inputs' dtype receives what linear_wgrad would return, added in place.
/// \param weight_grad [out_features, in_features], modified in place, or nullopt for none
/// \param bias_grad   [out_features], modified in place, or nullopt for none
void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad);

/// The differentiable linear layer: y = x·Wᵀ + b, whose backward computes dgrad at once and the
/// weight/bias gradients either at once (delay_wgrad_compute=false) or queued for backward_dw().
/// Throws as the file comment says, and c10::ValueError for a main_grad of the wrong shape, dtype
/// (fp32 only) or device, a bias_main_grad without a bias, or delay_wgrad_compute with an
/// unregistered layer_id; c10::Error in a backward with create_graph=True under
/// fuse_wgrad_accumulation (main_grad is not differentiable), and when a delayed layer would queue
/// work inside a traced graph (torch.compile).
/// \param weight_main_grad fp32 [out_features, in_features] buffer the weight gradient is added to
///        (fuse_wgrad_accumulation), or nullopt to accumulate into weight.grad
/// \param bias_main_grad   likewise for the bias; with nullopt the bias gradient goes to bias.grad
/// \param layer_id         the layer registered with the deferred-wgrad store (0: none; then
///        delay_wgrad_compute must be false)
/// \param delay_wgrad_compute queue the weight/bias gradient for backward_dw() instead of
///        computing it in backward
/// \param input_activation an activation (as for activation()) applied to `input` first: the op
///        computes act(input)·Wᵀ + b, and its backward returns the gradient with respect to
///        `input`. The backward keeps `input` only (not act(input)): the activation is
///        recomputed where the wgrad runs — in backward_dw() right before its GEMM when deferred.
/// \param lazy_main_grad   fuse_wgrad_accumulation with the main_grads read by the backward, when
///        it computes the gradients (as Transformer Engine does; Megatron-FSDP allocates them only
///        then), instead of passed here: weight_main_grad and bias_main_grad must be nullopt. The
///        weight's is required (set_main_grad(); from Python `param.main_grad`, or
///        `param.get_main_grad()` for a Megatron-FSDP parameter), a bias without one gets its
///        gradient in bias.grad. A missing or invalid one is a c10::ValueError in the backward.
/// \param gemm             names this GEMM in a module with several ("fc1" of a LayerNormMLP):
///        messages say "splitgrad layer 'mlp' (fc1)", backward_dw()'s too
/// \return y, [*, out_features]
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& weight_main_grad,
                  const std::optional<at::Tensor>& bias_main_grad, int64_t layer_id,
                  bool delay_wgrad_compute,
                  std::optional<std::string_view> input_activation = std::nullopt,
                  bool lazy_main_grad = false, std::optional<std::string_view> gemm = std::nullopt);

/// \name Activations (Transformer Engine's names)
/// "gelu" (the tanh approximation), "relu", "silu", "qgelu" (x·sigmoid(1.702x)), "srelu"
/// (relu(x)²), and the gated "geglu", "reglu", "swiglu", "qgeglu", "sreglu", "glu" (sigmoid),
/// which compute act(a) * b for input = [a | b] along the last dimension (output: last dim halved).
/// Throws c10::ValueError for another name or a gated input with an odd last dim, c10::TypeError
/// for a non-floating input. Not differentiable themselves (linear() uses them in its autograd).
/// @{

/// act(input), bit-identical to the ATen composite (at::gelu(x, "tanh"), at::relu, at::silu,
/// x * at::sigmoid(x * 1.702), at::pow(at::relu(x), 2), at::sigmoid; act(a) * b for a gated one).
at::Tensor activation(const at::Tensor& input, std::string_view activation);

/// The gradient with respect to `input` (input's shape) for the gradient `grad_output` of the
/// activation's output, with the kernels autograd runs for the composite.
at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& input,
                               std::string_view activation);
/// @}

/// \name Grouped linear (MoE experts)
/// `groups` linear maps over one tensor's rows: rows [offset_i, offset_i + m_splits[i]) of the
/// input (flattened to [tokens, in_features]) go through group i, offset_i being the sum of the
/// splits before i. `m_splits` is an int64 tensor of `groups` non-negative entries summing to the
/// tokens; the CPU back end needs it on the CPU, the CUDA one takes it on either device. Every
/// weight is [out_features, in_features] (one dtype, one device), every bias [out_features].
/// @{

/// fprop: y_i = x_i·W_iᵀ + b_i for each group's rows.
/// \param input    x, [*, in_features]
/// \param m_splits int64 [groups]
/// \param weights  W_0 … W_{groups-1}
/// \param biases   b_0 … b_{groups-1}, or empty for none
/// \return y, [*, out_features]
at::Tensor grouped_linear_fprop(const at::Tensor& input, const at::Tensor& m_splits,
                                at::TensorList weights, at::TensorList biases);

/// dgrad: dx_i = dy_i·W_i for each group's rows.
/// \return dx, [*, in_features]
at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const at::Tensor& m_splits,
                                at::TensorList weights);

/// wgrad into fresh tensors: dW_i = dy_iᵀ·x_i, db_i = Σ dy_i (zeros for a group without rows).
/// \return (dW_0 … dW_{groups-1}, db_0 … db_{groups-1} or empty when !compute_bias_grad), in the
///         inputs' dtype
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& m_splits,
    bool compute_bias_grad);

/// wgrad accumulated in place, `+=` per group as linear_wgrad_accumulate_ does: weight_grads[i] +=
/// dy_iᵀ·x_i, bias_grads[i] += Σ dy_i. Targets may alias (experts sharing a weight): each group's
/// product is added in group order.
/// \param weight_grads [out_features, in_features] per group (nullopt: none), or an empty list
/// \param bias_grads   [out_features] per group (nullopt: none), or an empty list
void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& m_splits,
                                      const c10::List<std::optional<at::Tensor>>& weight_grads,
                                      const c10::List<std::optional<at::Tensor>>& bias_grads);

/// The differentiable grouped layer: y_i = x_i·W_iᵀ + b_i, whose backward computes dgrad at once
/// and every group's weight/bias gradients either at once or queued as one item for backward_dw().
/// \param weight_main_grads fp32 buffer per weight (fuse_wgrad_accumulation), or an empty list
/// \param bias_main_grads   fp32 buffer per bias (nullopt: that bias's gradient goes to .grad), or
///        an empty list
/// \param layer_id, lazy_main_grad as for linear() (with lazy_main_grad, both lists empty)
at::Tensor grouped_linear(const at::Tensor& input, const at::Tensor& m_splits,
                          at::TensorList weights, at::TensorList biases,
                          const c10::List<std::optional<at::Tensor>>& weight_main_grads,
                          const c10::List<std::optional<at::Tensor>>& bias_main_grads,
                          int64_t layer_id, bool delay_wgrad_compute, bool lazy_main_grad = false);
/// @}

}  // namespace splitgrad::ops
