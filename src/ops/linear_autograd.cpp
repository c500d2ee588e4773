// The autograd of splitgrad::linear, in C++ so C++ callers get gradients too. The backward computes
// dgrad at once; the weight and bias gradients either at once (returned to autograd, so they
// accumulate exactly as nn.Linear's do) or, with delay_wgrad_compute, queued in the deferred-wgrad
// store for backward_dw().
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "ops/deferred_internal.h"
#include "splitgrad/ops.h"

namespace splitgrad::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

at::Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

void check_layer_args(core::LayerId layer_id, bool delay, const at::Tensor& input,
                      const at::Tensor& weight, const OptTensor& bias,
                      const OptTensor& weight_main_grad, const OptTensor& bias_main_grad) {
  auto who = [&] {
    return layer_id > 0 ? layer_label(layer_id) : std::string("splitgrad::linear");
  };
  check_linear_args(who, input, weight, bias);
  if (weight_main_grad.has_value()) check_main_grad(who, "weight", *weight_main_grad, weight);
  if (bias_main_grad.has_value()) {
    TORCH_CHECK_VALUE(bias.has_value() && bias->defined(), who(),
                      ": got bias_main_grad but the layer has no bias");
    check_main_grad(who, "bias", *bias_main_grad, *bias);
  }
  TORCH_CHECK_VALUE(!delay || core::WgradStore::instance().is_registered(layer_id), who(),
                    ": delay_wgrad_compute=True needs a layer registered with the deferred-wgrad "
                    "store (layer_id ",
                    layer_id, " is not)");
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const OptTensor& bias, const OptTensor& weight_main_grad,
                            const OptTensor& bias_main_grad, int64_t layer_id, bool delay) {
    check_layer_args(layer_id, delay, input, weight, bias, weight_main_grad, bias_main_grad);
    ctx->save_for_backward({input, weight});
    // The parameters themselves, for the gradient sinks: saved tensors may come back as other
    // tensors (activation checkpointing's saved-tensor hooks return recomputed copies), and a
    // gradient added to a copy's .grad would be lost.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["bias"] = value_or_undefined(bias);
    ctx->saved_data["weight_main_grad"] = value_or_undefined(weight_main_grad);
    ctx->saved_data["bias_main_grad"] = value_or_undefined(bias_main_grad);
    ctx->saved_data["layer_id"] = layer_id;
    ctx->saved_data["delay"] = delay;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return ops::linear_fprop(input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];  // the values (maybe a recomputed copy)
    const at::Tensor weight_param = ctx->saved_data["weight"].toTensor();
    const at::Tensor bias = ctx->saved_data["bias"].toTensor();
    const at::Tensor& grad_output = grad_outputs[0];
    variable_list grads(7);  // one per forward argument
    if (!grad_output.defined()) return grads;
    if (ctx->needs_input_grad(0)) grads[0] = ops::linear_dgrad(grad_output, weight);

    // Deferred work is queued whenever the parameters train, even in a pass that asked autograd
    // only for input gradients (a pipeline's B step): its W step is backward_dw().
    const bool delay = ctx->saved_data["delay"].toBool();
    const bool weight_trains = weight_param.requires_grad() && (delay || ctx->needs_input_grad(1));
    const bool bias_trains =
        bias.defined() && bias.requires_grad() && (delay || ctx->needs_input_grad(2));
    if (!weight_trains && !bias_trains) return grads;
    WgradSinks sinks{weight_trains ? weight_param : at::Tensor(), bias_trains ? bias : at::Tensor(),
                     ctx->saved_data["weight_main_grad"].toTensor(),
                     ctx->saved_data["bias_main_grad"].toTensor()};
    const bool fused = sinks.weight_main_grad.defined() || sinks.bias_main_grad.defined();
    if (!delay && !fused) {  // the regular path: autograd accumulates, exactly as for nn.Linear
      auto [weight_grad, bias_grad] = ops::linear_wgrad(grad_output, input, bias_trains);
      if (weight_trains) grads[1] = weight_grad;
      if (bias_trains) grads[2] = bias_grad;
      return grads;
    }

    PassScope pass;
    auto& ledger = core::GradLedger::instance();
    if (!delay) {  // regular and fused: straight into main_grad, nothing for autograd to add
      for (const auto& p : {sinks.weight, sinks.bias}) {
        if (p.defined()) ledger.note_autograd_contribution(p, pass.id());
      }
      accumulate_wgrad(grad_output, input, sinks);
      return grads;
    }
    const core::LayerId layer = ctx->saved_data["layer_id"].toInt();
    if (!core::WgradStore::instance().is_registered(layer)) {
      // The layer was deleted between its forward and this backward. As for work pending when a
      // layer is deleted: its contribution is discarded with a warning (and the parameters' hooks
      // skip this pass), but the rest of the backward pass goes on.
      TORCH_WARN(layer_label(layer),
                 " was deleted before its backward pass: its deferred weight "
                 "gradient is discarded. Keep a layer alive until its backward_dw() has run.");
      for (const auto& target : {sinks.weight, sinks.bias}) {
        if (!target.defined()) continue;
        ledger.expect_deferred(target, pass.id());
        ledger.deferred_dropped(target, pass.id());
      }
      return grads;
    }
    // A store filled inside a traced backward (torch.compile's AOTAutograd traces with fake and
    // functional tensors, Python-dispatched subclasses) would hold placeholders, not data.
    auto traced = [](const at::Tensor& t) {
      return t.is_meta() || t.key_set().has(c10::DispatchKey::Functionalize) ||
             t.key_set().has(c10::DispatchKey::Python);
    };
    TORCH_CHECK(
        !traced(input) && !traced(grad_output), layer_label(layer),
        ": delay_wgrad_compute=True cannot queue deferred work inside a traced graph "
        "(torch.compile / AOTAutograd): the stashed tensors would be tracing placeholders. "
        "splitgrad.Linear runs delayed layers outside compiled graphs; call the op eagerly.");
    core::DeferredWgrad item;
    item.layer = layer;
    item.pass = pass.id();
    item.input = input;
    item.grad_output = grad_output;
    item.input_version = input._version();
    item.grad_output_version = grad_output._version();
    item.weight = sinks.weight;
    item.bias = sinks.bias;
    item.weight_main_grad = sinks.weight_main_grad;
    item.bias_main_grad = sinks.bias_main_grad;
    item.stream = current_stream_of(input);
    for (const auto& target : item.targets()) ledger.expect_deferred(target, pass.id());
    core::WgradStore::instance().push(std::move(item));
    return grads;
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                           const OptTensor& weight_main_grad, const OptTensor& bias_main_grad,
                           int64_t layer_id, bool delay_wgrad_compute) {
  return LinearFunction::apply(input, weight, bias, weight_main_grad, bias_main_grad, layer_id,
                               delay_wgrad_compute);
}

// Below autograd (inference mode, tracing): the forward alone.
at::Tensor linear_forward_only(const at::Tensor& input, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& weight_main_grad,
                               const OptTensor& bias_main_grad, int64_t layer_id,
                               bool delay_wgrad_compute) {
  check_layer_args(layer_id, delay_wgrad_compute, input, weight, bias, weight_main_grad,
                   bias_main_grad);
  return ops::linear_fprop(input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, Autograd, m) { m.impl("linear", &linear_autograd); }
TORCH_LIBRARY_IMPL(splitgrad, CompositeExplicitAutograd, m) {
  m.impl("linear", &linear_forward_only);
}

}  // namespace splitgrad::detail
