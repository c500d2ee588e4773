#include "ops/checks.h"

#include <c10/util/Exception.h>

namespace splitgrad::detail {

at::Tensor flatten_tokens(const at::Tensor& t) {
  return t.dim() == 2 ? t : t.reshape_symint({c10::SymInt(-1), t.sym_size(-1)});
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
                      ": expected a bias of shape [", weight.sym_size(0), "], got shape ",
                      bias->sym_sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), who(),
                     ": expected a bias of dtype ", dtype_name(weight.scalar_type()),
                     " (the weight's dtype), got ", dtype_name(bias->scalar_type()));
    TORCH_CHECK(bias->device() == weight.device(), who(), ": expected the bias on ",
                weight.device(), ", got ", bias->device());
  }
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

void check_wgrad_accumulate_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                                 const std::optional<at::Tensor>& weight_grad,
                                 const std::optional<at::Tensor>& bias_grad) {
  check_wgrad_args(who, grad_output, input);
  const c10::SymInt out = grad_output.sym_size(-1);
  const c10::SymInt in = input.sym_size(-1);
  if (weight_grad.has_value() && weight_grad->defined()) {
    TORCH_CHECK_VALUE(weight_grad->dim() == 2 && weight_grad->sym_size(0) == out &&
                          weight_grad->sym_size(1) == in,
                      who(), ": expected weight_grad of shape [", out, ", ", in, "], got ",
                      weight_grad->sym_sizes());
    TORCH_CHECK_TYPE(at::isFloatingType(weight_grad->scalar_type()), who(),
                     ": expected a floating-point weight_grad, got ",
                     dtype_name(weight_grad->scalar_type()));
    TORCH_CHECK(weight_grad->device() == input.device(), who(), ": weight_grad on ",
                weight_grad->device(), " but input on ", input.device());
  }
  if (bias_grad.has_value() && bias_grad->defined()) {
    TORCH_CHECK_VALUE(bias_grad->dim() == 1 && bias_grad->sym_size(0) == out, who(),
                      ": expected bias_grad of shape [", out, "], got ", bias_grad->sym_sizes());
    TORCH_CHECK(bias_grad->device() == input.device(), who(), ": bias_grad on ",
                bias_grad->device(), " but input on ", input.device());
  }
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
}

}  // namespace splitgrad::detail
