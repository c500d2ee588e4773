#include "splitgrad/layernorm.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/rms_norm.h>

#include <algorithm>
#include <array>

#include "api/module_common.h"
#include "ops/checks.h"
#include "ops/deferred_internal.h"
#include "splitgrad/ops.h"

namespace splitgrad {
namespace {

// at::autocast::is_autocast_enabled for any device (it throws for one without autocast: meta).
bool autocast_enabled(c10::DeviceType device_type) {
  return at::autocast::is_autocast_available(device_type) &&
         at::autocast::is_autocast_enabled(device_type);
}

using OptTensor = std::optional<at::Tensor>;

OptTensor optional_if_defined(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

void check_normalization(const char* module, const std::string& normalization) {
  TORCH_CHECK_VALUE(normalization == "LayerNorm" || normalization == "RMSNorm", module,
                    ": expected normalization \"LayerNorm\" or \"RMSNorm\", got \"", normalization,
                    "\"");
}

// Registers layer_norm_weight (1, or 0 when zero-centred) and, for LayerNorm, layer_norm_bias (0).
void register_norm(torch::nn::Module& module, int64_t hidden, const std::string& normalization,
                   const at::TensorOptions& tensor_options, torch::Tensor& weight,
                   torch::Tensor& bias) {
  weight = module.register_parameter("layer_norm_weight", torch::empty({hidden}, tensor_options));
  bias = normalization == "LayerNorm"
             ? module.register_parameter("layer_norm_bias", torch::empty({hidden}, tensor_options))
             : module.register_parameter("layer_norm_bias", torch::Tensor(),
                                         /*requires_grad=*/false);
}

void reset_norm(const torch::Tensor& weight, const torch::Tensor& bias, bool zero_centered) {
  torch::NoGradGuard no_grad;
  weight.fill_(zero_centered ? 0.0 : 1.0);  // zero-centred gamma stores gamma - 1
  if (bias.defined()) bias.zero_();
}

// The input's checks before the norm runs (the first GEMM's own), naming the module and, in a
// module with several GEMMs, that GEMM.
void check_input(const LayerHandle& layer, const torch::Tensor& input,
                 const torch::Tensor& first_weight, const std::string& gemm = "") {
  TORCH_CHECK_VALUE(input.defined(), "splitgrad layer '", layer.name(),
                    "': expected an input of shape [*, ", first_weight.size(1),
                    "], got an undefined tensor");
  // Under autocast the norm and the GEMM cast the input themselves.
  const bool autocast = input.is_floating_point() && autocast_enabled(input.device().type());
  detail::check_linear_args(
      [&] { return detail::layer_label(layer.id(), gemm); }, input, first_weight, std::nullopt,
      autocast ? std::optional<at::ScalarType>(input.scalar_type()) : std::nullopt);
}

// ATen's own differentiable norms: autograd computes their gradients in the backward.
torch::Tensor normalize(const torch::Tensor& input, const std::string& normalization,
                        const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                        bool zero_centered) {
  auto norm = [&](const torch::Tensor& x, const torch::Tensor& gamma, const torch::Tensor& beta) {
    const std::array<int64_t, 1> shape{gamma.size(0)};
    if (normalization == "LayerNorm") {
      return at::layer_norm(x, shape, gamma, optional_if_defined(beta), eps);
    }
    return at::rms_norm(x, shape, gamma, eps);
  };
  if (!zero_centered) return norm(input, weight, bias);
  const auto dtype = weight.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return norm(input, weight + 1, bias);
  // TE adds the 1 to a 16-bit gamma in fp32 inside its kernel (1 + gamma rounded to 16 bits would
  // lose gamma's low bits): the norm runs in fp32 and its output is rounded once.
  const torch::Tensor gamma = weight.to(at::kFloat) + 1;
  const torch::Tensor beta = bias.defined() ? bias.to(at::kFloat) : bias;
  if (autocast_enabled(input.device().type())) {
    return norm(input, gamma, beta);  // autocast casts the input as it casts the norm's
  }
  return norm(input.to(at::kFloat), gamma, beta).to(input.scalar_type());
}

void check_activation(const std::string& activation) {
  detail::check_activation_name(detail::named("splitgrad::LayerNormMLP"), activation);
}

// Checks a tie and sets the member named `name` among `members` to `tied` (the caller updates
// its registered parameter, which only the module itself may touch).
void tie(const LayerHandle& layer, const std::string& name,
         const std::vector<std::pair<const char*, torch::Tensor*>>& members,
         const torch::Tensor& tied) {
  for (const auto& [member_name, member] : members) {
    if (name != member_name) continue;
    TORCH_CHECK_VALUE(member->defined(), "splitgrad layer '", layer.name(), "': tie_parameter(\"",
                      name, "\") on a module built without a ", name);
    detail::check_tie(layer, c10::str("tie_parameter(\"", name, "\")"), name, *member, tied);
    *member = tied;
    return;
  }
  std::string known;
  for (const auto& member : members) known += c10::str(known.empty() ? "" : ", ", member.first);
  TORCH_CHECK_VALUE(false, "splitgrad layer '", layer.name(), "': tie_parameter expected one of ",
                    known, ", got \"", name, "\"");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// LayerNormLinear

LayerNormLinearImpl::LayerNormLinearImpl(const LayerNormLinearOptions& options_)
    : options(options_) {
  reset();
}

void LayerNormLinearImpl::reset() {
  TORCH_CHECK_VALUE(options.in_features() > 0 && options.out_features() > 0,
                    "splitgrad::LayerNormLinear: expected positive in_features and out_features, "
                    "got ",
                    options.in_features(), " and ", options.out_features());
  check_normalization("splitgrad::LayerNormLinear", options.normalization());
  const auto tensor_options =
      torch::TensorOptions()
          .dtype(detail::module_dtype("splitgrad::LayerNormLinear", options.params_dtype()))
          .device(detail::module_device(options.device()));
  register_norm(*this, options.in_features(), options.normalization(), tensor_options,
                layer_norm_weight, layer_norm_bias);
  weight = register_parameter(
      "weight", torch::empty({options.out_features(), options.in_features()}, tensor_options));
  bias = options.bias()
             ? register_parameter("bias", torch::empty({options.out_features()}, tensor_options))
             : register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  layer_ = detail::register_layer(
      options.name(),
      c10::str("LayerNormLinear(", options.in_features(), ", ", options.out_features(), ")"));
  reset_parameters();
}

void LayerNormLinearImpl::reset_parameters() {
  reset_norm(layer_norm_weight, layer_norm_bias, options.zero_centered_gamma());
  detail::reset_linear(weight, bias, options.init_method());
}

void LayerNormLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "splitgrad::LayerNormLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", normalization=" << options.normalization()
         << ", zero_centered_gamma=" << options.zero_centered_gamma()
         << ", delay_wgrad_compute=" << options.delay_wgrad_compute()
         << ", fuse_wgrad_accumulation=" << options.fuse_wgrad_accumulation() << ")";
}

std::tuple<torch::Tensor, torch::Tensor> LayerNormLinearImpl::forward_with_layernorm_output(
    const torch::Tensor& input) {
  check_input(*layer_, input, weight);
  torch::Tensor ln_out = normalize(input, options.normalization(), layer_norm_weight,
                                   layer_norm_bias, options.eps(), options.zero_centered_gamma());
  const bool fused = options.fuse_wgrad_accumulation();
  if (fused) {  // checked here; the backward reads them again (as in LinearImpl::forward)
    detail::fused_main_grad(*layer_, weight, "weight", /*required=*/true);
    detail::fused_main_grad(*layer_, bias, "bias", /*required=*/false);
  }
  torch::Tensor out =
      ops::linear(ln_out, weight, optional_if_defined(bias), std::nullopt, std::nullopt,
                  layer_->id(), options.delay_wgrad_compute(), std::nullopt, fused);
  return {out, ln_out};
}

torch::Tensor LayerNormLinearImpl::forward(const torch::Tensor& input,
                                           std::optional<bool> /*is_first_microbatch*/) {
  return std::get<0>(forward_with_layernorm_output(input));
}

void LayerNormLinearImpl::tie_parameter(const std::string& name, const torch::Tensor& param) {
  tie(*layer_, name,
      {{"layer_norm_weight", &layer_norm_weight},
       {"layer_norm_bias", &layer_norm_bias},
       {"weight", &weight},
       {"bias", &bias}},
      param);
  retied(name, param);
}

// ---------------------------------------------------------------------------------------------
// LayerNormMLP

LayerNormMLPImpl::LayerNormMLPImpl(const LayerNormMLPOptions& options_) : options(options_) {
  reset();
}

void LayerNormMLPImpl::reset() {
  TORCH_CHECK_VALUE(options.hidden_size() > 0 && options.ffn_hidden_size() > 0,
                    "splitgrad::LayerNormMLP: expected positive hidden_size and ffn_hidden_size, "
                    "got ",
                    options.hidden_size(), " and ", options.ffn_hidden_size());
  check_normalization("splitgrad::LayerNormMLP", options.normalization());
  check_activation(options.activation());
  const auto tensor_options =
      torch::TensorOptions()
          .dtype(detail::module_dtype("splitgrad::LayerNormMLP", options.params_dtype()))
          .device(detail::module_device(options.device()));
  const int64_t hidden = options.hidden_size(), ffn = options.ffn_hidden_size();
  const int64_t fc1_out = detail::is_gated_activation(options.activation()) ? 2 * ffn : ffn;
  register_norm(*this, hidden, options.normalization(), tensor_options, layer_norm_weight,
                layer_norm_bias);
  // TE's order: fc1_weight, fc1_bias, fc2_weight, fc2_bias.
  fc1_weight = register_parameter("fc1_weight", torch::empty({fc1_out, hidden}, tensor_options));
  fc1_bias = options.bias()
                 ? register_parameter("fc1_bias", torch::empty({fc1_out}, tensor_options))
                 : register_parameter("fc1_bias", torch::Tensor(), /*requires_grad=*/false);
  fc2_weight = register_parameter("fc2_weight", torch::empty({hidden, ffn}, tensor_options));
  fc2_bias = options.bias()
                 ? register_parameter("fc2_bias", torch::empty({hidden}, tensor_options))
                 : register_parameter("fc2_bias", torch::Tensor(), /*requires_grad=*/false);
  layer_ =
      detail::register_layer(options.name(), c10::str("LayerNormMLP(", hidden, ", ", ffn, ")"));
  reset_parameters();
}

void LayerNormMLPImpl::reset_parameters() {
  reset_norm(layer_norm_weight, layer_norm_bias, options.zero_centered_gamma());
  detail::reset_linear(fc1_weight, fc1_bias, options.init_method());
  detail::reset_linear(fc2_weight, fc2_bias, options.output_layer_init_method());
}

void LayerNormMLPImpl::pretty_print(std::ostream& stream) const {
  stream << "splitgrad::LayerNormMLP(hidden_size=" << options.hidden_size()
         << ", ffn_hidden_size=" << options.ffn_hidden_size() << ", bias=" << std::boolalpha
         << options.bias() << ", normalization=" << options.normalization()
         << ", activation=" << options.activation()
         << ", zero_centered_gamma=" << options.zero_centered_gamma()
         << ", delay_wgrad_compute=" << options.delay_wgrad_compute()
         << ", fuse_wgrad_accumulation=" << options.fuse_wgrad_accumulation() << ")";
}

std::tuple<torch::Tensor, torch::Tensor> LayerNormMLPImpl::forward_with_layernorm_output(
    const torch::Tensor& input) {
  check_input(*layer_, input, fc1_weight, "fc1");
  torch::Tensor ln_out = normalize(input, options.normalization(), layer_norm_weight,
                                   layer_norm_bias, options.eps(), options.zero_centered_gamma());
  // Both GEMMs queue under this module's id: one backward_dw() runs a pass's fc2 and fc1 work.
  // `activation`: x is the activation's input, applied inside the op (fc2's deferred wgrad keeps
  // fc1's output and recomputes the activation in backward_dw(), instead of keeping its output).
  auto gemm = [&](const char* name, const torch::Tensor& x, const torch::Tensor& weight,
                  const torch::Tensor& bias, std::optional<std::string_view> activation) {
    const std::string weight_name = c10::str(name, "_weight"), bias_name = c10::str(name, "_bias");
    const bool fused = options.fuse_wgrad_accumulation();
    OptTensor weight_main_grad, bias_main_grad;  // checked here; the backward reads them again
    if (fused) {
      weight_main_grad =
          detail::fused_main_grad(*layer_, weight, weight_name, /*required=*/true, name);
      bias_main_grad = detail::fused_main_grad(*layer_, bias, bias_name, /*required=*/false, name);
    }
    // The op's own checks, first with messages that say which GEMM and parameter they mean.
    const bool autocast = x.is_floating_point() && autocast_enabled(x.device().type());
    const auto who = [&] { return detail::layer_label(layer_->id(), name); };
    detail::check_gemm_args(
        who,
        activation ? detail::activation_gemm_input(who, x, std::string(*activation), weight) : x,
        weight, optional_if_defined(bias), weight_main_grad, bias_main_grad, weight_name, bias_name,
        autocast ? std::optional<at::ScalarType>(x.scalar_type()) : std::nullopt);
    return ops::linear(x, weight, optional_if_defined(bias), std::nullopt, std::nullopt,
                       layer_->id(), options.delay_wgrad_compute(), activation, fused, name);
  };
  torch::Tensor fc1_out = gemm("fc1", ln_out, fc1_weight, fc1_bias, std::nullopt);
  torch::Tensor out = gemm("fc2", fc1_out, fc2_weight, fc2_bias, options.activation());
  return {out, ln_out};
}

torch::Tensor LayerNormMLPImpl::forward(const torch::Tensor& input,
                                        std::optional<bool> /*is_first_microbatch*/) {
  return std::get<0>(forward_with_layernorm_output(input));
}

void LayerNormMLPImpl::tie_parameter(const std::string& name, const torch::Tensor& param) {
  tie(*layer_, name,
      {{"layer_norm_weight", &layer_norm_weight},
       {"layer_norm_bias", &layer_norm_bias},
       {"fc1_weight", &fc1_weight},
       {"fc1_bias", &fc1_bias},
       {"fc2_weight", &fc2_weight},
       {"fc2_bias", &fc2_bias}},
      param);
  retied(name, param);
}

}  // namespace splitgrad
