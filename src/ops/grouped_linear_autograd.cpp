// The autograd of splitgrad::grouped_linear (MoE experts), as linear_autograd.cpp does it for one
// linear map: dgrad at once; every group's weight and bias gradients either at once (returned to
// autograd, so they accumulate exactly as per-expert nn.Linear's do) or, with delay_wgrad_compute,
// queued as ONE item of the deferred-wgrad store with a target per group (same store, same ledger,
// same backward_dw() as splitgrad::linear).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <unordered_map>

#include "ops/checks.h"
#include "ops/deferred_internal.h"
#include "splitgrad/ops.h"

namespace splitgrad::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensorList = c10::List<std::optional<at::Tensor>>;

at::Tensor entry(const OptTensorList& list, size_t i) {
  if (list.empty()) return at::Tensor();
  const std::optional<at::Tensor> t = list.get(i);
  return t.has_value() ? *t : at::Tensor();
}

// Per-group tensors as saved_data entries of their own ("w0", "w1", ...; an absent one is not
// saved): compiled autograd swaps a saved_data tensor for its proxy only at the top level, not
// inside a list.
template <class Tensors>
void save_groups(AutogradContext* ctx, const char* prefix, const Tensors& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t;
    if constexpr (std::is_same_v<Tensors, OptTensorList>) {
      t = entry(tensors, i);
    } else {
      t = tensors[i];
    }
    if (t.defined()) ctx->saved_data[prefix + std::to_string(i)] = std::move(t);
  }
}

// save_groups()'s tensors back, an undefined tensor where none was saved.
std::vector<at::Tensor> saved_groups(AutogradContext* ctx, const char* prefix, size_t groups) {
  std::vector<at::Tensor> tensors(groups);
  for (size_t i = 0; i < groups; ++i) {
    const auto it = ctx->saved_data.find(prefix + std::to_string(i));
    if (it != ctx->saved_data.end()) tensors[i] = it->second.toTensor();
  }
  return tensors;
}

std::string who_of(core::LayerId layer) {
  return layer > 0 ? layer_label(layer) : std::string("splitgrad::grouped_linear");
}

// Everything a call can get wrong, checked before anything runs or is queued. The splits' values
// are checked here when they are on the CPU; on a device, by the back end that reads them.
void check_layer_args(core::LayerId layer_id, bool delay, const at::Tensor& input,
                      const at::Tensor& m_splits, at::TensorList weights, at::TensorList biases,
                      const OptTensorList& weight_main_grads, const OptTensorList& bias_main_grads,
                      bool lazy_main_grad, std::optional<at::ScalarType> compute_dtype) {
  auto who = [&] { return who_of(layer_id); };
  TORCH_CHECK_VALUE(!lazy_main_grad || (weight_main_grads.empty() && bias_main_grads.empty()),
                    who(),
                    ": lazy_main_grad=True reads the main_grads in the backward; expected "
                    "empty weight_main_grads and bias_main_grads, got ",
                    weight_main_grads.size(), " and ", bias_main_grads.size(), " entries");
  check_grouped_linear_args(who, input, m_splits, weights, biases, /*splits_on_cpu_only=*/false,
                            compute_dtype);
  if (m_splits.device().is_cpu() && !is_traced(m_splits)) {
    split_sizes(who, m_splits, flatten_tokens(input).size(0));
  }
  const int64_t groups = static_cast<int64_t>(weights.size());
  check_group_list_length(who, "weight_main_grads", weight_main_grads, groups);
  check_group_list_length(who, "bias_main_grads", bias_main_grads, groups);
  for (int64_t i = 0; i < groups; ++i) {
    const at::Tensor weight_main_grad = entry(weight_main_grads, i);
    if (weight_main_grad.defined()) {
      check_main_grad(who, c10::str("weight", i), weight_main_grad, weights[i]);
    }
    const at::Tensor bias_main_grad = entry(bias_main_grads, i);
    if (bias_main_grad.defined()) {
      TORCH_CHECK_VALUE(!biases.empty(), who(), ": got bias_main_grads but the layer has no bias");
      check_main_grad(who, c10::str("bias", i), bias_main_grad, biases[i]);
    }
  }
  check_registered_if_delayed(who, delay, layer_id);
}

// The parameters in the forward's compute dtype: autocast's (set by linear_autocast.cpp for this
// call), else their own. Cast for the product only, so their gradients keep their dtype.
std::vector<at::Tensor> in_compute_dtype(at::TensorList params,
                                         std::optional<at::ScalarType> dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(dtype.has_value() && p.scalar_type() != *dtype ? p.to(*dtype) : p);
  }
  return out;
}

// Per-group views of [tokens, features] rows, for the double-backward path's ATen ops.
std::vector<at::Tensor> split_rows(const at::Tensor& t, const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (int64_t size : sizes) {
    out.push_back(t.narrow(0, offset, size));
    offset += size;
  }
  return out;
}

// Autograd adds the gradients an op returns for one parameter in slot order, (v0 + v1) + v2,
// where per-expert nn.Linear ops reach a parameter tied across experts in reverse (the last
// expert's backward runs first): (v2 + v1) + v0, each as_contribution. Such a
// parameter gets that sum in one slot of `grads` (slots first_slot + i for params[i]), the others
// none, as the delayed path adds it (accumulate_grouped_wgrad).
void sum_tied_in_reverse(variable_list& grads, size_t first_slot,
                         const std::vector<at::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, size_t> sum_slot;
  for (size_t i = params.size(); i-- > 0;) {
    at::Tensor& grad = grads[first_slot + i];
    if (!grad.defined()) continue;
    const auto [it, first] = sum_slot.emplace(params[i].unsafeGetTensorImpl(), first_slot + i);
    if (first) continue;
    grads[it->second] =
        as_contribution(params[i], std::move(grads[it->second])) + as_contribution(params[i], grad);
    grad = at::Tensor();
  }
}

class GroupedLinearFunction : public torch::autograd::Function<GroupedLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& m_splits, at::TensorList weights,
                            at::TensorList biases, const OptTensorList& weight_main_grads,
                            const OptTensorList& bias_main_grads, int64_t layer_id, bool delay,
                            bool lazy_main_grad) {
    const std::optional<at::ScalarType> compute_dtype = AutocastComputeDtype::current();
    check_layer_args(layer_id, delay, input, m_splits, weights, biases, weight_main_grads,
                     bias_main_grads, lazy_main_grad, compute_dtype);
    note_layer_forward(layer_id, input);
    // The splits as they are now (a few integers): a per-expert model splits its rows at the
    // forward, so a router's counts buffer refilled before the backward must not change it.
    std::vector<at::Tensor> saved{input, m_splits.clone()};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    // The parameters themselves, for the gradient sinks (saved tensors may come back as copies:
    // see linear_autograd.cpp).
    save_groups(ctx, "w", weights);
    save_groups(ctx, "b", biases);
    save_groups(ctx, "wm", weight_main_grads);
    save_groups(ctx, "bm", bias_main_grads);
    ctx->saved_data["has_bias"] = !biases.empty();
    ctx->saved_data["lazy_main_grad"] = lazy_main_grad;
    ctx->saved_data["layer_id"] = layer_id;
    ctx->saved_data["delay"] = delay;
    if (compute_dtype.has_value()) ctx->saved_data["compute_dtype"] = *compute_dtype;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return ops::grouped_linear_fprop(input, m_splits, in_compute_dtype(weights, compute_dtype),
                                     in_compute_dtype(biases, compute_dtype));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& m_splits = saved[1];
    std::optional<at::ScalarType> compute_dtype;
    if (ctx->saved_data.count("compute_dtype"))
      compute_dtype = ctx->saved_data["compute_dtype"].toScalarType();
    const std::vector<at::Tensor> weight_values =
        in_compute_dtype(std::vector<at::Tensor>(saved.begin() + 2, saved.end()), compute_dtype);
    const size_t groups = saved.size() - 2;  // input, m_splits, then each weight's value
    const std::vector<at::Tensor> weights = saved_groups(ctx, "w", groups);
    const std::vector<at::Tensor> biases = ctx->saved_data["has_bias"].toBool()
                                               ? saved_groups(ctx, "b", groups)
                                               : std::vector<at::Tensor>();
    const std::vector<at::Tensor> weight_main_grads = saved_groups(ctx, "wm", groups);
    const std::vector<at::Tensor> bias_main_grads = saved_groups(ctx, "bm", groups);
    const bool lazy_main_grad = ctx->saved_data["lazy_main_grad"].toBool();
    const core::LayerId layer = ctx->saved_data["layer_id"].toInt();
    const bool delay = defers_wgrad(ctx->saved_data["delay"].toBool(), layer);
    const bool has_bias = !biases.empty();
    // One gradient per flattened forward argument: input, m_splits, each weight, each bias, then
    // the five non-tensor arguments.
    variable_list grads(2 + groups + biases.size() + 5);
    const size_t weight_slot = 2, bias_slot = 2 + groups;
    const at::Tensor& grad_output = grad_outputs[0];
    if (!grad_output.defined()) return grads;
    note_layer_backward(layer);
    std::vector<char> weight_wanted(groups), bias_wanted(groups);
    bool any_wanted = false, any_bias_wanted = false;
    for (size_t i = 0; i < groups; ++i) {
      weight_wanted[i] = ctx->needs_input_grad(weight_slot + i) && weights[i].requires_grad();
      bias_wanted[i] =
          has_bias && ctx->needs_input_grad(bias_slot + i) && biases[i].requires_grad();
      any_wanted |= weight_wanted[i] || bias_wanted[i];
      any_bias_wanted |= static_cast<bool>(bias_wanted[i]);
    }

    // autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) run this backward under
    // the legacy vmap (torch.func's vmap also reaches here), whose fallback cannot batch ops
    // taking tensor lists (the grouped ops): there, as for create_graph, ATen ops per group, and
    // every gradient is returned (a batched backward accumulates nothing).
    const bool batched = grad_output.key_set().has(c10::DispatchKey::Batched) ||
                         grad_output.key_set().has(c10::DispatchKey::FuncTorchBatched);
    const bool create_graph = at::GradMode::is_enabled();
    if (create_graph || batched) {
      // backward(create_graph=True): differentiable ATen ops per group (the splits are read on
      // the host: this path is not the hot one).
      for (size_t i = 0; i < groups && create_graph; ++i) {
        check_no_fused_double_backward(
            [&] { return who_of(layer); },
            (weight_wanted[i] && (weight_main_grads[i].defined() || lazy_main_grad)) ||
                (bias_wanted[i] && (bias_main_grads[i].defined() || lazy_main_grad)));
      }
      const at::Tensor dy = flatten_tokens(grad_output);
      const at::Tensor x = flatten_tokens(input);
      const auto sizes = split_sizes([&] { return who_of(layer); }, m_splits.cpu(), x.size(0));
      const auto dys = split_rows(dy, sizes);
      const auto xs = split_rows(x, sizes);
      if (ctx->needs_input_grad(0)) {
        std::vector<at::Tensor> dxs;
        for (size_t i = 0; i < groups; ++i) {
          const bool fused = create_graph && (weight_main_grads[i].defined() || lazy_main_grad);
          dxs.push_back(at::mm(dys[i], fused ? refuse_second_order_weight_grad(
                                                   [&] { return who_of(layer); }, weight_values[i])
                                             : weight_values[i]));
        }
        grads[0] = at::cat(dxs).view(input.sizes());
      }
      for (size_t i = 0; i < groups; ++i) {
        if (weight_wanted[i]) grads[weight_slot + i] = at::mm(dys[i].t(), xs[i]);
        if (bias_wanted[i]) grads[bias_slot + i] = dys[i].sum(0);
      }
      sum_tied_in_reverse(grads, weight_slot, weights);
      sum_tied_in_reverse(grads, bias_slot, biases);
      return grads;
    }
    if (ctx->needs_input_grad(0)) {
      grads[0] = ops::grouped_linear_dgrad(grad_output, m_splits, weight_values);
    }
    if (!any_wanted) return grads;

    // As in linear_autograd.cpp: only a gradient this pass adds to a parameter's .grad may be
    // deferred or fused; the others (a computed weight, autograd.grad) are computed now.
    std::vector<WgradSinks> sinks(groups);
    bool any_sink = false, fused = false, any_returned = false;
    for (size_t i = 0; i < groups; ++i) {
      const bool weight_sink = weight_wanted[i] && pass_accumulates_into(weights[i]);
      const bool bias_sink = bias_wanted[i] && pass_accumulates_into(biases[i]);
      sinks[i] = {weight_sink ? weights[i] : at::Tensor(), bias_sink ? biases[i] : at::Tensor(),
                  weight_sink ? weight_main_grads[i] : at::Tensor(),
                  bias_sink ? bias_main_grads[i] : at::Tensor()};
      any_sink |= weight_sink || bias_sink;
      any_returned |= (weight_wanted[i] && !weight_sink) || (bias_wanted[i] && !bias_sink);
    }
    if (lazy_main_grad && any_sink) read_main_grads([&] { return who_of(layer); }, sinks, true);
    for (const WgradSinks& sink : sinks) {
      fused |= sink.weight_main_grad.defined() || sink.bias_main_grad.defined();
    }
    if (!delay && !fused) {  // the regular path: autograd accumulates, as for nn.Linear
      auto [weight_grads, bias_grads] =
          ops::grouped_linear_wgrad(grad_output, input, m_splits, any_bias_wanted);
      for (size_t i = 0; i < groups; ++i) {
        if (weight_wanted[i]) grads[weight_slot + i] = weight_grads[i];
        if (bias_wanted[i]) grads[bias_slot + i] = bias_grads[i];
      }
      sum_tied_in_reverse(grads, weight_slot, weights);
      sum_tied_in_reverse(grads, bias_slot, biases);
      return grads;
    }
    if (any_returned) {
      auto [weight_grads, bias_grads] =
          ops::grouped_linear_wgrad(grad_output, input, m_splits, any_bias_wanted);
      for (size_t i = 0; i < groups; ++i) {
        if (weight_wanted[i] && !sinks[i].weight.defined())
          grads[weight_slot + i] = weight_grads[i];
        if (bias_wanted[i] && !sinks[i].bias.defined()) grads[bias_slot + i] = bias_grads[i];
      }
      sum_tied_in_reverse(grads, weight_slot, weights);
      sum_tied_in_reverse(grads, bias_slot, biases);
    }
    if (!any_sink) return grads;
    accumulate_or_defer(layer, delay, grad_output, input, m_splits, sinks,
                        "splitgrad.GroupedLinear");
    return grads;
  }
};

at::Tensor grouped_linear_autograd(const at::Tensor& input, const at::Tensor& m_splits,
                                   at::TensorList weights, at::TensorList biases,
                                   const OptTensorList& weight_main_grads,
                                   const OptTensorList& bias_main_grads, int64_t layer_id,
                                   bool delay_wgrad_compute, bool lazy_main_grad) {
  return GroupedLinearFunction::apply(input, m_splits, weights, biases, weight_main_grads,
                                      bias_main_grads, layer_id, delay_wgrad_compute,
                                      lazy_main_grad);
}

// Below autograd (inference mode, tracing): the forward alone.
at::Tensor grouped_linear_forward_only(const at::Tensor& input, const at::Tensor& m_splits,
                                       at::TensorList weights, at::TensorList biases,
                                       const OptTensorList& weight_main_grads,
                                       const OptTensorList& bias_main_grads, int64_t layer_id,
                                       bool delay_wgrad_compute, bool lazy_main_grad) {
  const std::optional<at::ScalarType> compute_dtype = AutocastComputeDtype::current();
  check_layer_args(layer_id, delay_wgrad_compute, input, m_splits, weights, biases,
                   weight_main_grads, bias_main_grads, lazy_main_grad, compute_dtype);
  return ops::grouped_linear_fprop(input, m_splits, in_compute_dtype(weights, compute_dtype),
                                   in_compute_dtype(biases, compute_dtype));
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, Autograd, m) { m.impl("grouped_linear", &grouped_linear_autograd); }
TORCH_LIBRARY_IMPL(splitgrad, CompositeExplicitAutograd, m) {
  m.impl("grouped_linear", &grouped_linear_forward_only);
}

}  // namespace splitgrad::detail
