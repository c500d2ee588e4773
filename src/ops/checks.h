#pragma once
// Argument checks shared by every entry point, so each rule and its message is written once.
// `who` names the caller in messages ("splitgrad layer 'fc1'", "splitgrad::linear_fprop"); it is
// called only when a check fails, so the fast path builds no string.

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <optional>
#include <string>
#include <vector>

namespace splitgrad::detail {

using Who = c10::function_ref<std::string()>;

/// A Who for a fixed name: `check_wgrad_args(named("splitgrad::linear_wgrad"), ...)`.
inline auto named(const char* name) {
  return [name] { return std::string(name); };
}

/// [*, features] as [tokens, features]; 2-D inputs as they are (no view to make).
at::Tensor flatten_tokens(const at::Tensor& t);

/// `sizes` with its last entry replaced: the output shape of a linear map over [*, features].
std::vector<int64_t> with_last_dim(at::IntArrayRef sizes, int64_t last);
/// The same for symbolic sizes (fake kernels traced with dynamic shapes).
std::vector<c10::SymInt> with_last_dim(c10::SymIntArrayRef sizes, c10::SymInt last);

/// "torch.bfloat16" for BFloat16, "torch.int64" for Long: as Python prints dtypes.
std::string dtype_name(at::ScalarType type);

// The checks read sizes as SymInts, so that fake kernels traced with dynamic shapes (torch.export
// with Dim, compile(dynamic=True)) guard on the relations they check instead of specialising the
// traced sizes.

/// input [*, in_features] and weight [out, in] (and bias [out]) of one floating dtype, one device;
/// under autocast the input is in autocast's `compute_dtype` instead of the weight's.
void check_linear_args(Who who, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       std::optional<at::ScalarType> compute_dtype = std::nullopt);

/// One GEMM of a module as the linear op checks it: check_linear_args, then each main_grad given
/// against its parameter, named `weight_name` / `bias_name` in messages ("fc2_weight"). Modules
/// with several GEMMs run it before the op, with a `who` that names the GEMM too.
void check_gemm_args(Who who, const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& weight_main_grad,
                     const std::optional<at::Tensor>& bias_main_grad,
                     const std::string& weight_name, const std::string& bias_name,
                     std::optional<at::ScalarType> compute_dtype = std::nullopt);

/// TE's activation names: "gelu" (tanh approximation), "relu", "silu", "qgelu" (x·sigmoid(1.702x)),
/// "srelu" (relu(x)²), and the gated "geglu", "reglu", "swiglu", "qgeglu", "sreglu", "glu"
/// (act(a) * b for input [a | b] along the last dimension; glu's act is the sigmoid).
bool is_gated_activation(const std::string& activation);
/// `activation` one of those names (c10::ValueError listing them otherwise).
void check_activation_name(Who who, const std::string& activation);
/// check_activation_name, input floating-point with at least one dimension, and a gated
/// activation's last dimension even.
void check_activation_args(Who who, const at::Tensor& input, const std::string& activation);
/// check_activation_args, and grad_output shaped as the activation's output, of input's dtype and
/// device.
void check_activation_backward_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                                    const std::string& activation);
/// A tensor shaped as the activation's output, without computing it: `input` itself, or for a
/// gated activation its first half (a view). For the checks of the GEMM that consumes the output.
at::Tensor activation_output_view(const at::Tensor& input, const std::string& activation);
/// For a GEMM whose input is `activation(input)` (linear's input_activation):
/// check_activation_args, then input's width against the weight's in_features (twice that for a
/// gated activation), in a message about the tensor the caller passed; returns
/// activation_output_view for the GEMM's checks.
at::Tensor activation_gemm_input(Who who, const at::Tensor& input, const std::string& activation,
                                 const at::Tensor& weight);
/// grad_output [*, out] and input [*, in] with the same leading dims, dtype and device.
void check_wgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& input);

/// grad_output [*, out_features] for a weight [out_features, in_features].
void check_dgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& weight);

/// check_wgrad_args, plus the accumulation targets: weight_grad [out, in], bias_grad [out].
void check_wgrad_accumulate_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                                 const std::optional<at::Tensor>& weight_grad,
                                 const std::optional<at::Tensor>& bias_grad);

/// main_grad: fp32, param's shape, param's device (Megatron's contract).
void check_main_grad(Who who, const std::string& param_name, const at::Tensor& main_grad,
                     const at::Tensor& param);

/// A grouped layer's arguments, without the splits' values: m_splits a 1-D int64 tensor of one
/// entry per weight (on input's device or the CPU; only the CPU where `splits_on_cpu_only`);
/// every weight [out, in] like weights[0], of one floating dtype and on one device; biases none or
/// one per weight, [out], of the weights' dtype; input [*, in] of the weights' dtype (autocast's
/// `compute_dtype` under autocast) and device.
void check_grouped_linear_args(Who who, const at::Tensor& input, const at::Tensor& m_splits,
                               at::TensorList weights, at::TensorList biases,
                               bool splits_on_cpu_only,
                               std::optional<at::ScalarType> compute_dtype = std::nullopt);

/// grad_output [*, out] for weights [out, in] alike, and m_splits as above.
void check_grouped_dgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& m_splits,
                              at::TensorList weights, bool splits_on_cpu_only);

/// check_wgrad_args, and m_splits a 1-D int64 tensor (one entry per group) as above.
void check_grouped_wgrad_args(Who who, const at::Tensor& grad_output, const at::Tensor& input,
                              const at::Tensor& m_splits, bool splits_on_cpu_only);

/// check_grouped_wgrad_args, plus the targets: each list empty or one entry per group, each
/// entry absent or as check_wgrad_accumulate_args wants it.
void check_grouped_wgrad_accumulate_args(Who who, const at::Tensor& grad_output,
                                         const at::Tensor& input, const at::Tensor& m_splits,
                                         const c10::List<std::optional<at::Tensor>>& weight_grads,
                                         const c10::List<std::optional<at::Tensor>>& bias_grads,
                                         bool splits_on_cpu_only);

/// m_splits a 1-D int64 tensor of `groups` entries (any number when nullopt), on the CPU or on
/// `data`'s device (only the CPU where `cpu_only`, or where `data` is on the CPU: a CPU kernel
/// reading a device tensor would synchronise with the device).
void check_splits_tensor(Who who, const at::Tensor& m_splits, std::optional<int64_t> groups,
                         const at::Tensor& data, bool cpu_only);

/// The splits' values, checked: non-negative, summing to `rows`. m_splits must be on the CPU.
std::vector<int64_t> split_sizes(Who who, const at::Tensor& m_splits, int64_t rows);
/// split_sizes' check of values already read.
void check_split_sizes(Who who, const std::vector<int64_t>& sizes, int64_t rows);

/// A `Tensor?[]` argument's entries by reference (host time: c10::List::get() copies each
/// tensor, a reference count up and down): entry i, or nullptr where it is None or undefined.
class OptionalTensors {
 public:
  explicit OptionalTensors(const c10::List<std::optional<at::Tensor>>& list)
      : list_(c10::impl::toList(list)) {}
  bool empty() const { return list_.empty(); }
  int64_t size() const { return static_cast<int64_t>(list_.size()); }
  const at::Tensor* operator[](int64_t i) const {
    const c10::IValue& entry = list_[static_cast<size_t>(i)];
    return entry.isTensor() && entry.toTensor().defined() ? &entry.toTensor() : nullptr;
  }

 private:
  c10::List<c10::IValue> list_;  // the same list, untyped: its entries as IValue references
};

/// A list of per-group optional tensors: empty, or one entry per group.
void check_group_list_length(Who who, const char* what,
                             const c10::List<std::optional<at::Tensor>>& list, int64_t groups);

}  // namespace splitgrad::detail
