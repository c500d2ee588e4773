// The autograd of splitgrad::linear, in C++ so C++ callers get gradients too. The backward computes
// dgrad at once; the weight and bias gradients either at once (returned to autograd, so they
// accumulate exactly as nn.Linear's do) or, with delay_wgrad_compute, queued in the deferred-wgrad
// store for backward_dw().
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "aten/activation_aten.h"
#include "ops/checks.h"
#include "ops/deferred_internal.h"
#include "splitgrad/ops.h"

namespace splitgrad::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using OptString = std::optional<c10::string_view>;

at::Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// With an input activation, `input` is the activation's input: checked as such, and the GEMM's
// checks see a tensor shaped as the activation's output.
void check_layer_args(core::LayerId layer_id, bool delay, const at::Tensor& input,
                      const at::Tensor& weight, const OptTensor& bias,
                      const OptTensor& weight_main_grad, const OptTensor& bias_main_grad,
                      bool lazy_main_grad, std::optional<at::ScalarType> compute_dtype,
                      const std::string& activation, const std::string& gemm) {
  auto who = [&] {
    return layer_id > 0 ? layer_label(layer_id, gemm) : std::string("splitgrad::linear");
  };
  check_linear_args(
      who, activation.empty() ? input : activation_gemm_input(who, input, activation, weight),
      weight, bias, compute_dtype);
  TORCH_CHECK_VALUE(
      !lazy_main_grad || (!weight_main_grad.has_value() && !bias_main_grad.has_value()), who(),
      ": lazy_main_grad=True reads the main_grads in the backward; expected "
      "weight_main_grad and bias_main_grad None, got ",
      weight_main_grad.has_value() ? "a weight_main_grad" : "a bias_main_grad");
  if (weight_main_grad.has_value()) check_main_grad(who, "weight", *weight_main_grad, weight);
  if (bias_main_grad.has_value()) {
    TORCH_CHECK_VALUE(bias.has_value() && bias->defined(), who(),
                      ": got bias_main_grad but the layer has no bias");
    check_main_grad(who, "bias", *bias_main_grad, *bias);
  }
  check_registered_if_delayed(who, delay, layer_id);
}

// The forward's compute dtype: autocast's (set by linear_autocast.cpp for this call), else the
// weight's. The parameters are cast for the product only, so their gradients keep their dtype.
at::Tensor in_compute_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  return dtype.has_value() && t.defined() && t.scalar_type() != *dtype ? t.to(*dtype) : t;
}

at::Tensor fprop(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                 std::optional<at::ScalarType> compute_dtype) {
  OptTensor bias_now = bias;
  if (bias_now.has_value()) bias_now = in_compute_dtype(*bias_now, compute_dtype);
  return ops::linear_fprop(input, in_compute_dtype(weight, compute_dtype), bias_now);
}

std::string string_or_empty(const OptString& name) {
  return name.has_value() ? std::string(*name) : std::string();
}

// `grad` as the gradient of `value` reaching its next backward: in `value`'s dtype, as the autograd
// engine casts a gradient passed between two nodes. Inside one node (the GEMM's dgrad, then its
// input activation's backward) that cast is ours: a backward run under torch.autocast computes
// the CPU dgrad in autocast's dtype.
at::Tensor as_gradient_of(const at::Tensor& grad, const at::Tensor& value) {
  return grad.scalar_type() == value.scalar_type() ? grad : grad.to(value.scalar_type());
}

// With an input activation, `input` is h and the GEMM's input a = act(h). The backward needs h
// (for the activation's gradient) and a (for the wgrad); only h is saved, and a is recomputed where
// a wgrad runs (in backward_dw() right before its GEMM, or in the backward). Saving a too would
// hold it through the activation's backward in this one node (plain autograd frees it after fc2's
// node, before the activation's): a peak above plain PyTorch's in immediate mode, and in delayed
// mode fc2's input held from the backward until backward_dw().
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const OptTensor& bias, const OptTensor& weight_main_grad,
                            const OptTensor& bias_main_grad, int64_t layer_id, bool delay,
                            const OptString& input_activation, bool lazy_main_grad,
                            const OptString& gemm_name) {
    const std::optional<at::ScalarType> compute_dtype = AutocastComputeDtype::current();
    const std::string activation = string_or_empty(input_activation);
    const std::string gemm = string_or_empty(gemm_name);
    check_layer_args(layer_id, delay, input, weight, bias, weight_main_grad, bias_main_grad,
                     lazy_main_grad, compute_dtype, activation, gemm);
    note_layer_forward(layer_id, input);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor gemm_input = activation.empty() ? input : ops::activation(input, activation);
    ctx->save_for_backward({input, weight});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["gemm"] = gemm;
    // The parameters themselves, for the gradient sinks: saved tensors may come back as other
    // tensors (activation checkpointing's saved-tensor hooks return recomputed copies), and a
    // gradient added to a copy's .grad would be lost.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["bias"] = value_or_undefined(bias);
    ctx->saved_data["weight_main_grad"] = value_or_undefined(weight_main_grad);
    ctx->saved_data["bias_main_grad"] = value_or_undefined(bias_main_grad);
    ctx->saved_data["lazy_main_grad"] = lazy_main_grad;
    ctx->saved_data["layer_id"] = layer_id;
    ctx->saved_data["delay"] = delay;
    if (compute_dtype.has_value()) ctx->saved_data["compute_dtype"] = *compute_dtype;
    return fprop(gemm_input, weight, bias, compute_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];  // the values (maybe a recomputed copy)
    const at::Tensor weight_param = ctx->saved_data["weight"].toTensor();
    const at::Tensor bias = ctx->saved_data["bias"].toTensor();
    const at::Tensor& grad_output = grad_outputs[0];
    std::optional<at::ScalarType> compute_dtype;
    if (ctx->saved_data.count("compute_dtype"))
      compute_dtype = ctx->saved_data["compute_dtype"].toScalarType();
    const core::LayerId layer = ctx->saved_data["layer_id"].toInt();
    const bool delay = defers_wgrad(ctx->saved_data["delay"].toBool(), layer);
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const std::string gemm = ctx->saved_data["gemm"].toStringRef();
    // The GEMM's input: the input, or act(input) recomputed (the forward's bit for bit).
    auto gemm_input = [&]() -> at::Tensor {
      return activation.empty() ? input : ops::activation(input, activation);
    };
    variable_list grads(10);  // one per forward argument
    if (!grad_output.defined()) return grads;
    note_layer_backward(layer);
    // needs_input_grad is false for a parameter frozen at the forward (no edge to it) and for one
    // this pass does not ask for (autograd.grad or backward(inputs=...) without it).
    const bool weight_wanted = ctx->needs_input_grad(1) && weight_param.requires_grad();
    const bool bias_wanted = bias.defined() && ctx->needs_input_grad(2) && bias.requires_grad();
    const at::Tensor weight_main_grad = ctx->saved_data["weight_main_grad"].toTensor();
    const at::Tensor bias_main_grad = ctx->saved_data["bias_main_grad"].toTensor();
    const bool lazy_main_grad = ctx->saved_data["lazy_main_grad"].toBool();
    auto who = [&] {
      return layer > 0 ? layer_label(layer, gemm) : std::string("splitgrad::linear");
    };

    if (at::GradMode::is_enabled()) {
      // backward(create_graph=True): the gradients must be differentiable themselves, so they
      // are computed now with ATen's differentiable ops (splitgrad's have no double backward).
      check_no_fused_double_backward(
          who, (weight_wanted && (weight_main_grad.defined() || lazy_main_grad)) ||
                   (bias_wanted && (bias_main_grad.defined() || lazy_main_grad)));
      const at::Tensor dy = flatten_tokens(grad_output);
      if (ctx->needs_input_grad(0)) {
        at::Tensor dgrad_weight = in_compute_dtype(weight, compute_dtype);
        if (weight_main_grad.defined() || lazy_main_grad) {
          dgrad_weight = refuse_second_order_weight_grad(who, dgrad_weight);
        }
        grads[0] = at::matmul(grad_output, dgrad_weight);
        if (!activation.empty()) {
          grads[0] = aten_backend::activation_backward_differentiable(
              as_gradient_of(grads[0], input), input, activation);
        }
      }
      if (weight_wanted) {
        const at::Tensor x =
            activation.empty() ? input : aten_backend::activation_differentiable(input, activation);
        grads[1] = at::mm(dy.t(), flatten_tokens(x));
      }
      if (bias_wanted) grads[2] = dy.sum(0);
      return grads;
    }
    if (ctx->needs_input_grad(0)) {
      grads[0] = ops::linear_dgrad(grad_output, in_compute_dtype(weight, compute_dtype));
      if (!activation.empty()) {
        grads[0] = ops::activation_backward(as_gradient_of(grads[0], input), input, activation);
      }
    }
    if (!weight_wanted && !bias_wanted) return grads;

    // Only a gradient this pass adds to a parameter's .grad may be deferred or fused. A computed
    // (non-leaf) weight's flows on through autograd to the tensors it came from (a main_grad
    // given with it is not used), and one that autograd.grad asked for is returned to it: both
    // are computed now. Autograd casts returned gradients to the parameters' dtype (autocast
    // computes in a narrower one).
    const bool weight_sink = weight_wanted && pass_accumulates_into(weight_param);
    const bool bias_sink = bias_wanted && pass_accumulates_into(bias);
    std::vector<WgradSinks> sinks{
        {weight_sink ? weight_param : at::Tensor(), bias_sink ? bias : at::Tensor(),
         weight_sink ? weight_main_grad : at::Tensor(), bias_sink ? bias_main_grad : at::Tensor()}};
    if (lazy_main_grad && (weight_sink || bias_sink)) read_main_grads(who, sinks, false, gemm);
    const bool fused = sinks[0].weight_main_grad.defined() || sinks[0].bias_main_grad.defined();
    if (!delay && !fused) {  // the regular path: autograd accumulates, exactly as for nn.Linear
      auto [weight_grad, bias_grad] = ops::linear_wgrad(grad_output, gemm_input(), bias_wanted);
      if (weight_wanted) grads[1] = weight_grad;
      if (bias_wanted) grads[2] = bias_grad;
      return grads;
    }
    if ((weight_wanted && !weight_sink) || (bias_wanted && !bias_sink)) {
      auto [weight_grad, bias_grad] =
          ops::linear_wgrad(grad_output, gemm_input(), bias_wanted && !bias_sink);
      if (weight_wanted && !weight_sink) grads[1] = weight_grad;
      if (bias_wanted && !bias_sink) grads[2] = bias_grad;
    }
    if (!weight_sink && !bias_sink) return grads;
    // Deferred: the activation's input is stashed, the activation recomputed by backward_dw().
    const bool defer_activation = delay && !activation.empty();
    accumulate_or_defer(layer, delay, grad_output, defer_activation ? input : gemm_input(),
                        /*m_splits=*/at::Tensor(), sinks, "splitgrad.Linear",
                        defer_activation ? activation : std::string(), gemm);
    return grads;
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                           const OptTensor& weight_main_grad, const OptTensor& bias_main_grad,
                           int64_t layer_id, bool delay_wgrad_compute, OptString input_activation,
                           bool lazy_main_grad, OptString gemm) {
  return LinearFunction::apply(input, weight, bias, weight_main_grad, bias_main_grad, layer_id,
                               delay_wgrad_compute, input_activation, lazy_main_grad, gemm);
}

// Below autograd (inference mode, tracing): the forward alone.
at::Tensor linear_forward_only(const at::Tensor& input, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& weight_main_grad,
                               const OptTensor& bias_main_grad, int64_t layer_id,
                               bool delay_wgrad_compute, OptString input_activation,
                               bool lazy_main_grad, OptString gemm) {
  const std::optional<at::ScalarType> compute_dtype = AutocastComputeDtype::current();
  const std::string activation = string_or_empty(input_activation);
  check_layer_args(layer_id, delay_wgrad_compute, input, weight, bias, weight_main_grad,
                   bias_main_grad, lazy_main_grad, compute_dtype, activation,
                   string_or_empty(gemm));
  return fprop(activation.empty() ? input : ops::activation(input, activation), weight, bias,
               compute_dtype);
}

// splitgrad::activation / activation_backward are kernels without a derivative of their own (the
// linear op differentiates its input_activation). Called where autograd must differentiate them,
// they run the ATen composite's differentiable ops instead (the same values), rather than hand
// autograd an output whose gradient it would drop.
at::Tensor activation_autograd(const at::Tensor& input, c10::string_view activation) {
  const std::string_view name(activation.data(), activation.size());
  if (at::GradMode::is_enabled() && input.requires_grad()) {
    return aten_backend::activation_differentiable(input, name);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::activation(input, name);
}

at::Tensor activation_backward_autograd(const at::Tensor& grad_output, const at::Tensor& input,
                                        c10::string_view activation) {
  const std::string_view name(activation.data(), activation.size());
  if (at::GradMode::is_enabled() && (input.requires_grad() || grad_output.requires_grad())) {
    return aten_backend::activation_backward_differentiable(grad_output, input, name);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::activation_backward(grad_output, input, name);
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, Autograd, m) {
  m.impl("linear", &linear_autograd);
  m.impl("activation", &activation_autograd);
  m.impl("activation_backward", &activation_backward_autograd);
}
TORCH_LIBRARY_IMPL(splitgrad, CompositeExplicitAutograd, m) {
  m.impl("linear", &linear_forward_only);
}

}  // namespace splitgrad::detail
