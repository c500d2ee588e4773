#include "splitgrad/grouped_linear.h"

#include <string>

#include "api/module_common.h"
#include "ops/checks.h"
#include "splitgrad/ops.h"

namespace splitgrad {

GroupedLinearImpl::GroupedLinearImpl(const GroupedLinearOptions& options_) : options(options_) {
  reset();
}

void GroupedLinearImpl::reset() {
  TORCH_CHECK_VALUE(
      options.num_gemms() > 0 && options.in_features() > 0 && options.out_features() > 0,
      "splitgrad::GroupedLinear: expected positive num_gemms, in_features and "
      "out_features, got ",
      options.num_gemms(), ", ", options.in_features(), " and ", options.out_features());
  const auto tensor_options =
      torch::TensorOptions()
          .dtype(detail::module_dtype("splitgrad::GroupedLinear", options.params_dtype()))
          .device(detail::module_device(options.device()));
  weights.clear();
  biases.clear();
  // te.GroupedLinear's order: weight0, bias0, weight1, ...
  for (int64_t i = 0; i < options.num_gemms(); ++i) {
    weights.push_back(register_parameter(
        c10::str("weight", i),
        torch::empty({options.out_features(), options.in_features()}, tensor_options)));
    if (options.bias()) {
      biases.push_back(register_parameter(c10::str("bias", i),
                                          torch::empty({options.out_features()}, tensor_options)));
    }
  }
  layer_ = detail::register_layer(
      options.name(), c10::str("GroupedLinear(", options.num_gemms(), ", ", options.in_features(),
                               ", ", options.out_features(), ")"));
  reset_parameters();
}

void GroupedLinearImpl::reset_parameters() {
  // Each expert as nn.Linear, expert by expert (weight0, bias0, weight1, ...).
  for (size_t i = 0; i < weights.size(); ++i) {
    detail::reset_linear(weights[i], i < biases.size() ? biases[i] : at::Tensor(),
                         options.init_method());
  }
}

void GroupedLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "splitgrad::GroupedLinear(num_gemms=" << options.num_gemms()
         << ", in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << std::boolalpha << options.bias()
         << ", delay_wgrad_compute=" << options.delay_wgrad_compute()
         << ", fuse_wgrad_accumulation=" << options.fuse_wgrad_accumulation() << ")";
}

torch::Tensor GroupedLinearImpl::forward(const torch::Tensor& input, const torch::Tensor& m_splits,
                                         std::optional<bool> /*is_first_microbatch*/) {
  TORCH_CHECK_VALUE(input.defined(), "splitgrad layer '", layer_->name(),
                    "': expected an input of shape [*, ", options.in_features(),
                    "], got an undefined tensor");
  TORCH_CHECK_VALUE(m_splits.defined(), "splitgrad layer '", layer_->name(),
                    "': expected m_splits (", options.num_gemms(),
                    " row counts), got an undefined tensor");
  const bool fused = options.fuse_wgrad_accumulation();
  if (fused) {
    // Every trainable weight needs its main_grad; a bias without one gets its gradient in .grad.
    // Checked here; the backward reads them again (lazy_main_grad), as in LinearImpl::forward.
    for (size_t i = 0; i < weights.size(); ++i) {
      detail::fused_main_grad(*layer_, weights[i], c10::str("weight", i), /*required=*/true);
    }
    for (size_t i = 0; i < biases.size(); ++i) {
      detail::fused_main_grad(*layer_, biases[i], c10::str("bias", i), /*required=*/false);
    }
  }
  // Any integer dtype (a router's counts are often int32), as the Python module takes: the op wants
  // int64. The cast stays on the splits' device (no host synchronisation).
  const auto dtype = m_splits.scalar_type();
  const bool other_integer = at::isIntegralType(dtype, /*includeBool=*/false) && dtype != at::kLong;
  const c10::List<std::optional<at::Tensor>> none;  // lazy_main_grad: the backward reads them
  return ops::grouped_linear(input, other_integer ? m_splits.to(at::kLong) : m_splits, weights,
                             biases, none, none, layer_->id(), options.delay_wgrad_compute(),
                             fused);
}

void GroupedLinearImpl::check_expert(int64_t expert) const {
  TORCH_CHECK_INDEX(expert >= 0 && expert < options.num_gemms(), "splitgrad layer '",
                    layer_->name(), "': expected an expert in [0, ", options.num_gemms(), "), got ",
                    expert);
}

void GroupedLinearImpl::tie(const char* what, int64_t expert, std::vector<torch::Tensor>& params,
                            const torch::Tensor& tied) {
  check_expert(expert);
  TORCH_CHECK_VALUE(!params.empty(), "splitgrad layer '", layer_->name(), "': tie_", what, "(",
                    expert, ") on a layer built with bias=false");
  detail::check_tie(*layer_, c10::str("tie_", what, "(", expert, ")"), c10::str(what, expert),
                    params[expert], tied);
  params[expert] = tied;
  retied(c10::str(what, expert), tied);
}

void GroupedLinearImpl::tie_weight(int64_t expert, const torch::Tensor& weight) {
  tie("weight", expert, weights, weight);
}

void GroupedLinearImpl::tie_bias(int64_t expert, const torch::Tensor& bias) {
  tie("bias", expert, biases, bias);
}

void GroupedLinearImpl::tie_in_copy(const std::string& name, const torch::Tensor& param) {
  const bool is_weight = name.rfind("weight", 0) == 0;
  const int64_t expert = std::stoll(name.substr(is_weight ? 6 : 4));
  tie(is_weight ? "weight" : "bias", expert, is_weight ? weights : biases, param);
}

}  // namespace splitgrad
