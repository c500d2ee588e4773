#include "ops/checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <limits>

namespace splitgrad::detail {

at::Tensor flatten_tokens(const at::Tensor& t) {
  if (t.dim() == 2) return t;
  // Not reshape(-1, last): with no elements (a last dimension of 0) the -1 is ambiguous.
  if (t.dim() > 2) return t.flatten(0, -2);
  if (t.dim() == 1) return t.unsqueeze(0);
  return t.reshape_symint({c10::SymInt(-1), t.sym_size(-1)});  // 0-d: the error names the shape
}

std::vector<int64_t> with_last_dim(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

std::vector<c10::SymInt> with_last_dim(c10::SymIntArrayRef sizes, c10::SymInt last) {
  std::vector<c10::SymInt> out(sizes.begin(), sizes.end());
  out.back() = std::move(last);
  return out;
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kLong:
      return "torch.int64";
    case at::kInt:
      return "torch.int32";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    case at::kFloat8_e4m3fn:
      return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "torch.float8_e5m2";
    default:
      return std::string("torch.") + c10::toString(type);
  }
}

void check_linear_args(Who who, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       std::optional<at::ScalarType> compute_dtype) {
  TORCH_CHECK_VALUE(weight.dim() == 2, who(), ": expected a weight of shape [out_features, ",
                    "in_features], got shape ", weight.sym_sizes());
  const c10::SymInt in_features = weight.sym_size(1);
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.sym_size(-1) == in_features, who(),
                    ": expected input of shape [*, ", in_features, "] (in_features = ", in_features,
                    "), got shape ", input.sym_sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(weight.scalar_type()), who(),
                   ": expected a floating-point weight, got ", dtype_name(weight.scalar_type()));
  const at::ScalarType input_dtype = compute_dtype.value_or(weight.scalar_type());
  TORCH_CHECK_TYPE(input.scalar_type() == input_dtype, who(), ": expected input of dtype ",
                   dtype_name(input_dtype),
                   compute_dtype.has_value() ? " (autocast's dtype)" : " (the weight's dtype)",
                   ", got ", dtype_name(input.scalar_type()));
  TORCH_CHECK(input.device() == weight.device(), who(), ": expected input on ", weight.device(),
              " (the weight's device), got ", input.device());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), who(),
                      ": expected a bias of shape [", weight.sym_size(0),
                      "] (the weight's out_features, weight of shape ", weight.sym_sizes(),
                      "), got shape ", bias->sym_sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), who(),
                     ": expected a bias of dtype ", dtype_name(weight.scalar_type()),
                     " (the weight's dtype), got ", dtype_name(bias->scalar_type()));
    TORCH_CHECK(bias->device() == weight.device(), who(), ": expected the bias on ",
                weight.device(), ", got ", bias->device());
  }
}

void check_gemm_args(Who who, const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& weight_main_grad,
                     const std::optional<at::Tensor>& bias_main_grad,
                     const std::string& weight_name, const std::string& bias_name,
                     std::optional<at::ScalarType> compute_dtype) {
  check_linear_args(who, input, weight, bias, compute_dtype);
  if (weight_main_grad.has_value()) check_main_grad(who, weight_name, *weight_main_grad, weight);
  if (bias_main_grad.has_value() && bias.has_value() && bias->defined()) {
    check_main_grad(who, bias_name, *bias_main_grad, *bias);
  }
}

bool is_gated_activation(const std::string& activation) {
  return activation == "geglu" || activation == "reglu" || activation == "swiglu" ||
         activation == "qgeglu" || activation == "sreglu" || activation == "glu";
}

void check_activation_name(Who who, const std::string& activation) {
  static const std::array<const char*, 11> names{"gelu",   "relu",   "silu",  "qgelu",
                                                 "srelu",  "geglu",  "reglu", "swiglu",
                                                 "qgeglu", "sreglu", "glu"};
  TORCH_CHECK_VALUE(std::find(names.begin(), names.end(), activation) != names.end(), who(),
                    ": expected activation \"gelu\", \"relu\", \"silu\", \"qgelu\", \"srelu\", "
                    "\"geglu\", \"reglu\", \"swiglu\", \"qgeglu\", \"sreglu\" or \"glu\", got \"",
                    activation, "\"");
}

void check_activation_args(Who who, const at::Tensor& input, const std::string& activation) {
  check_activation_name(who, activation);
  TORCH_CHECK_TYPE(at::isFloatingType(input.scalar_type()), who(),
                   ": expected a floating-point input to activation \"", activation, "\", got ",
                   dtype_name(input.scalar_type()));
  TORCH_CHECK_VALUE(input.dim() >= 1, who(),
                    ": expected an input of shape [*, features] for "
                    "activation \"",
                    activation, "\", got a scalar");
  TORCH_CHECK_VALUE(!is_gated_activation(activation) || input.sym_size(-1) % 2 == 0, who(),
                    ": the gated activation \"", activation,
                    "\" expects an even last dimension (the halves [a | b]), got shape ",
                    input.sym_sizes());
}

void check_activation_backward_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                                    const std::string& activation) {
  check_activation_args(who, input, activation);
  const at::Tensor output_like = activation_output_view(input, activation);
  const c10::SymIntArrayRef out_shape = output_like.sym_sizes();
  TORCH_CHECK_VALUE(grad_output.sym_sizes() == out_shape, who(), ": expected grad_output of shape ",
                    out_shape, " (the activation's output for input ", input.sym_sizes(), "), got ",
                    grad_output.sym_sizes());
  TORCH_CHECK_TYPE(grad_output.scalar_type() == input.scalar_type(), who(),
                   ": expected grad_output of dtype ", dtype_name(input.scalar_type()),
                   " (the input's), got ", dtype_name(grad_output.scalar_type()));
  TORCH_CHECK(grad_output.device() == input.device(), who(), ": grad_output on ",
              grad_output.device(), " but input on ", input.device());
}

at::Tensor activation_output_view(const at::Tensor& input, const std::string& activation) {
  if (!is_gated_activation(activation)) return input;
  return input.narrow_symint(-1, 0, input.sym_size(-1) / 2);
}

at::Tensor activation_gemm_input(Who who, const at::Tensor& input, const std::string& activation,
                                 const at::Tensor& weight) {
  check_activation_args(who, input, activation);
  if (weight.dim() == 2) {  // else check_linear_args says what the weight should be
    const bool gated = is_gated_activation(activation);
    const c10::SymInt width = weight.sym_size(1) * (gated ? 2 : 1);
    TORCH_CHECK_VALUE(
        input.sym_size(-1) == width, who(), ": expected input of shape [*, ", width,
        "] for activation \"", activation, "\" before in_features = ", weight.sym_size(1),
        gated ? " (a gated activation halves its input)" : "", ", got shape ", input.sym_sizes());
  }
  return activation_output_view(input, activation);
}

void check_wgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& input) {
  TORCH_CHECK_VALUE(grad_output.dim() >= 1 && input.dim() == grad_output.dim(), who(),
                    ": expected grad_output [*, out_features] and input [*, in_features] with the ",
                    "same leading dims, got shapes ", grad_output.sym_sizes(), " and ",
                    input.sym_sizes());
  TORCH_CHECK_VALUE(grad_output.sym_sizes().slice(0, grad_output.dim() - 1) ==
                        input.sym_sizes().slice(0, input.dim() - 1),
                    who(), ": grad_output ", grad_output.sym_sizes(), " and input ",
                    input.sym_sizes(), " differ in their leading dims");
  TORCH_CHECK_TYPE(grad_output.scalar_type() == input.scalar_type(), who(),
                   ": expected grad_output of dtype ", dtype_name(input.scalar_type()),
                   " (the input's), got ", dtype_name(grad_output.scalar_type()));
  TORCH_CHECK(grad_output.device() == input.device(), who(), ": grad_output on ",
              grad_output.device(), " but input on ", input.device());
}

void check_dgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(
      weight.dim() == 2 && grad_output.dim() >= 1 && grad_output.sym_size(-1) == weight.sym_size(0),
      who(), ": expected grad_output of shape [*, ", weight.sym_size(0), "] for a weight of shape ",
      weight.sym_sizes(), ", got ", grad_output.sym_sizes());
  TORCH_CHECK_TYPE(grad_output.scalar_type() == weight.scalar_type(), who(),
                   ": expected grad_output of dtype ", dtype_name(weight.scalar_type()),
                   " (the weight's), got ", dtype_name(grad_output.scalar_type()));
}

namespace {
// a == b, without a call where both are plain integers (host time: a check per expert).
bool same_size(const c10::SymInt& a, const c10::SymInt& b) {
  if (!a.is_heap_allocated() && !b.is_heap_allocated()) {
    return a.as_int_unchecked() == b.as_int_unchecked();
  }
  return a == b;
}

// The accumulation targets for grad_output [*, out] and input [*, in] (checked already), whose
// device is `device`: weight_grad [out, in], bias_grad [out] (nullptr: none).

void check_wgrad_targets(Who who, const c10::SymInt& out, const c10::SymInt& in,
                         const c10::Device& device, const at::Tensor* weight_grad,
                         const at::Tensor* bias_grad) {
  if (weight_grad != nullptr) {
    const c10::SymIntArrayRef sizes = weight_grad->sym_sizes();
    TORCH_CHECK_VALUE(sizes.size() == 2 && same_size(sizes[0], out) && same_size(sizes[1], in),
                      who(), ": expected weight_grad of shape [", out, ", ", in, "], got ", sizes);
    TORCH_CHECK_TYPE(at::isFloatingType(weight_grad->scalar_type()), who(),
                     ": expected a floating-point weight_grad, got ",
                     dtype_name(weight_grad->scalar_type()));
    TORCH_CHECK(weight_grad->device() == device, who(), ": weight_grad on ", weight_grad->device(),
                " but input on ", device);
  }
  if (bias_grad != nullptr) {
    const c10::SymIntArrayRef sizes = bias_grad->sym_sizes();
    TORCH_CHECK_VALUE(sizes.size() == 1 && same_size(sizes[0], out), who(),
                      ": expected bias_grad of shape [", out, "], got ", sizes);
    TORCH_CHECK(bias_grad->device() == device, who(), ": bias_grad on ", bias_grad->device(),
                " but input on ", device);
  }
}

// The defined tensor an optional argument holds, or nullptr.
const at::Tensor* present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}
}  // namespace

void check_wgrad_accumulate_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                                 const std::optional<at::Tensor>& weight_grad,
                                 const std::optional<at::Tensor>& bias_grad) {
  check_wgrad_args(who, grad_output, input);
  check_wgrad_targets(who, grad_output.sym_size(-1), input.sym_size(-1), input.device(),
                      present(weight_grad), present(bias_grad));
}

void check_main_grad(Who who, const std::string& param_name, const at::Tensor& main_grad,
                     const at::Tensor& param) {
  TORCH_CHECK_VALUE(main_grad.defined(), who(), ": fuse_wgrad_accumulation=True needs ", param_name,
                    ".main_grad, an fp32 tensor of shape ", param.sym_sizes(), "; it is not set");
  TORCH_CHECK_VALUE(main_grad.sym_sizes() == param.sym_sizes(), who(), ": expected ", param_name,
                    ".main_grad of shape ", param.sym_sizes(), " (the parameter's), got ",
                    main_grad.sym_sizes());
  TORCH_CHECK_VALUE(main_grad.scalar_type() == at::kFloat, who(), ": expected ", param_name,
                    ".main_grad of dtype torch.float32, got ", dtype_name(main_grad.scalar_type()));
  TORCH_CHECK_VALUE(main_grad.device() == param.device(), who(), ": expected ", param_name,
                    ".main_grad on ", param.device(), " (the parameter's device), got ",
                    main_grad.device());
  // Accumulated in place: elements sharing memory (an expand()ed buffer) would each get every
  // sum written over the others'.
  TORCH_CHECK_VALUE(main_grad.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
                        at::has_internal_overlap(main_grad) != at::MemOverlap::Yes,
                    who(), ": expected ", param_name,
                    ".main_grad whose elements each have memory of their own (it is written in "
                    "place), got one whose elements overlap (strides ",
                    main_grad.strides(), ", e.g. from expand())");
}

void check_splits_tensor(Who who, const at::Tensor& m_splits, std::optional<int64_t> groups,
                         const at::Tensor& data, bool cpu_only) {
  TORCH_CHECK_VALUE(m_splits.defined(), who(),
                    ": expected m_splits, a tensor of int64 row counts, got an undefined tensor");
  TORCH_CHECK_TYPE(m_splits.scalar_type() == at::kLong, who(),
                   ": expected m_splits of dtype torch.int64 (row counts), got ",
                   dtype_name(m_splits.scalar_type()));
  TORCH_CHECK_VALUE(m_splits.dim() == 1 && (!groups || m_splits.size(0) == *groups), who(),
                    ": expected ", groups ? c10::str(*groups, " splits (one per group)") : "splits",
                    " in a 1-D m_splits, got shape ", m_splits.sizes());
  if (cpu_only || data.device().is_cpu()) {
    TORCH_CHECK(m_splits.device().is_cpu(), who(), ": expected m_splits on the CPU for input on ",
                data.device(), ", got m_splits on ", m_splits.device());
  } else {
    TORCH_CHECK(m_splits.device().is_cpu() || m_splits.device() == data.device(), who(),
                ": expected m_splits on the CPU or on ", data.device(),
                " (the input's device), got m_splits on ", m_splits.device());
  }
}

std::vector<int64_t> split_sizes(Who who, const at::Tensor& m_splits, int64_t rows) {
  TORCH_INTERNAL_ASSERT(m_splits.device().is_cpu() && m_splits.scalar_type() == at::kLong);
  const at::Tensor splits = m_splits.contiguous();
  const int64_t* data = splits.data_ptr<int64_t>();
  std::vector<int64_t> sizes(data, data + splits.numel());
  check_split_sizes(who, sizes, rows);
  return sizes;
}

void check_split_sizes(Who who, const std::vector<int64_t>& sizes, int64_t rows) {
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK_VALUE(sizes[i] >= 0, who(), ": expected non-negative m_splits, got m_splits[", i,
                      "] = ", sizes[i], " (m_splits = [", c10::Join(", ", sizes), "])");
    // Splits near INT64_MAX must not wrap around to the right total.
    TORCH_CHECK_VALUE(sizes[i] <= std::numeric_limits<int64_t>::max() - total, who(),
                      ": expected m_splits to sum to the input's ", rows,
                      " rows (tokens), got a sum past the int64 range at m_splits[", i, "] = ",
                      sizes[i], " (m_splits = [", c10::Join(", ", sizes), "])");
    total += sizes[i];
  }
  TORCH_CHECK_VALUE(total == rows, who(), ": expected m_splits to sum to the input's ", rows,
                    " rows (tokens), got a sum of ", total, " (m_splits = [",
                    c10::Join(", ", sizes), "])");
}

namespace {
// Every weight defined, 2-D, and alike (weight0's shape, dtype and device).
void check_weights_alike(Who who, at::TensorList weights) {
  TORCH_CHECK_VALUE(!weights.empty(), who(), ": expected at least one weight (group), got none");
  const at::Tensor& first = weights[0];
  TORCH_CHECK_VALUE(first.defined() && first.dim() == 2, who(),
                    ": expected weight0 of shape [out_features, in_features], got ",
                    first.defined() ? c10::str("shape ", first.sizes()) : "an undefined tensor");
  TORCH_CHECK_TYPE(at::isFloatingType(first.scalar_type()), who(),
                   ": expected a floating-point weight0, got ", dtype_name(first.scalar_type()));
  for (size_t i = 1; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    // Neutral wording: either of the two may be the one that changed.
    TORCH_CHECK_VALUE(w.defined() && w.sizes() == first.sizes(), who(),
                      ": expected every weight of one shape, got weight0 of shape ", first.sizes(),
                      " and weight", i, " of ",
                      w.defined() ? c10::str("shape ", w.sizes()) : "an undefined tensor");
    TORCH_CHECK_TYPE(w.scalar_type() == first.scalar_type(), who(), ": expected weight", i,
                     " of dtype ", dtype_name(first.scalar_type()), " (weight0's), got ",
                     dtype_name(w.scalar_type()));
    TORCH_CHECK(w.device() == first.device(), who(), ": expected weight", i, " on ", first.device(),
                " (weight0's device), got ", w.device());
  }
}
}  // namespace

void check_grouped_linear_args(Who who, const at::Tensor& input, const at::Tensor& m_splits,
                               at::TensorList weights, at::TensorList biases,
                               bool splits_on_cpu_only,
                               std::optional<at::ScalarType> compute_dtype) {
  check_weights_alike(who, weights);
  const int64_t groups = static_cast<int64_t>(weights.size());
  TORCH_CHECK_VALUE(biases.empty() || static_cast<int64_t>(biases.size()) == groups, who(),
                    ": expected no biases or one per weight (", groups, "), got ", biases.size());
  // Weights are alike: one group's linear check covers the input for all.
  check_linear_args(who, input, weights[0], std::nullopt, compute_dtype);
  for (size_t i = 0; i < biases.size(); ++i) {
    const at::Tensor& b = biases[i];
    TORCH_CHECK_VALUE(b.defined() && b.dim() == 1 && b.size(0) == weights[0].size(0), who(),
                      ": expected bias", i, " of shape [", weights[0].size(0), "], got ",
                      b.defined() ? c10::str("shape ", b.sizes()) : "an undefined tensor");
    TORCH_CHECK_TYPE(b.scalar_type() == weights[0].scalar_type(), who(), ": expected bias", i,
                     " of dtype ", dtype_name(weights[0].scalar_type()),
                     " (the weights' dtype), got ", dtype_name(b.scalar_type()));
    TORCH_CHECK(b.device() == weights[0].device(), who(), ": expected bias", i, " on ",
                weights[0].device(), ", got ", b.device());
  }
  check_splits_tensor(who, m_splits, groups, input, splits_on_cpu_only);
}

void check_grouped_dgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& m_splits,
                              at::TensorList weights, bool splits_on_cpu_only) {
  check_weights_alike(who, weights);
  check_dgrad_args(who, grad_output, weights[0]);
  TORCH_CHECK(grad_output.device() == weights[0].device(), who(), ": expected grad_output on ",
              weights[0].device(), " (the weights' device), got ", grad_output.device());
  check_splits_tensor(who, m_splits, static_cast<int64_t>(weights.size()), grad_output,
                      splits_on_cpu_only);
}

void check_grouped_wgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                              const at::Tensor& m_splits, bool splits_on_cpu_only) {
  check_wgrad_args(who, grad_output, input);
  check_splits_tensor(who, m_splits, std::nullopt, input, splits_on_cpu_only);
}

void check_grouped_wgrad_accumulate_args(Who who, const at::Tensor& grad_output,
                                         const at::Tensor& input, const at::Tensor& m_splits,
                                         const c10::List<std::optional<at::Tensor>>& weight_grads,
                                         const c10::List<std::optional<at::Tensor>>& bias_grads,
                                         bool splits_on_cpu_only) {
  check_grouped_wgrad_args(who, grad_output, input, m_splits, splits_on_cpu_only);
  const int64_t groups = m_splits.size(0);
  check_group_list_length(who, "weight_grads", weight_grads, groups);
  check_group_list_length(who, "bias_grads", bias_grads, groups);
  // grad_output and input once (check_grouped_wgrad_args), then each group's targets.
  const c10::SymInt out = grad_output.sym_size(-1);
  const c10::SymInt in = input.sym_size(-1);
  const c10::Device device = input.device();
  const OptionalTensors weights(weight_grads), biases(bias_grads);
  for (int64_t i = 0; i < groups; ++i) {
    const at::Tensor* w = weights.empty() ? nullptr : weights[i];
    const at::Tensor* b = biases.empty() ? nullptr : biases[i];
    if (w == nullptr && b == nullptr) continue;
    auto group_who = [&] { return c10::str(who(), " (group ", i, ")"); };
    check_wgrad_targets(group_who, out, in, device, w, b);
  }
}

void check_group_list_length(Who who, const char* what,
                             const c10::List<std::optional<at::Tensor>>& list, int64_t groups) {
  TORCH_CHECK_VALUE(list.empty() || static_cast<int64_t>(list.size()) == groups, who(),
                    ": expected ", what, " to be empty or have one entry per group (", groups,
                    "), got ", list.size());
}

}  // namespace splitgrad::detail
