// The splitgrad operator schemas, written once. Back ends register kernels in their own files
// (src/aten, src/cuda, src/ops/fake_kernels.cpp); autograd lives in src/ops/linear_autograd.cpp and
// src/ops/grouped_linear_autograd.cpp.
#include <torch/library.h>

TORCH_LIBRARY(splitgrad, m) {
  m.def("linear_fprop(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_dgrad(Tensor grad_output, Tensor weight) -> Tensor");
  m.def(
      "linear_wgrad(Tensor grad_output, Tensor input, bool compute_bias_grad) -> (Tensor, Tensor)");
  m.def(
      "linear_wgrad_accumulate_(Tensor grad_output, Tensor input, Tensor(a!)? weight_grad, "
      "Tensor(b!)? bias_grad) -> ()");
  m.def(
      "linear(Tensor input, Tensor weight, Tensor? bias, Tensor? weight_main_grad, "
      "Tensor? bias_main_grad, int layer_id, bool delay_wgrad_compute, "
      "str? input_activation=None, bool lazy_main_grad=False, str? gemm=None) -> Tensor");
  // TE's activations ("gelu" tanh-approximated, "relu", "silu", "qgelu", "srelu"; gated "geglu",
  // "reglu", "swiglu", "qgeglu", "sreglu", "glu":
  // act(a) * b for input [a | b] along the last dim). activation_backward returns the gradient
  // with respect to `input`. linear's input_activation applies one to its input first; its gemm
  // names the GEMM in a module with several ("fc1"), for messages.
  m.def("activation(Tensor input, str activation) -> Tensor");
  m.def("activation_backward(Tensor grad_output, Tensor input, str activation) -> Tensor");
  // lazy_main_grad (fuse_wgrad_accumulation as Transformer Engine does it): no main_grad is
  // passed; the backward looks each parameter's up when it computes its gradient.
  // Grouped (MoE experts): rows [offset_i, offset_i + m_splits[i]) go through group i. The splits
  // are an int64 tensor, so a router's counts on the device need no host copy to be passed on.
  m.def(
      "grouped_linear_fprop(Tensor input, Tensor m_splits, Tensor[] weights, Tensor[] biases) -> "
      "Tensor");
  m.def("grouped_linear_dgrad(Tensor grad_output, Tensor m_splits, Tensor[] weights) -> Tensor");
  m.def(
      "grouped_linear_wgrad(Tensor grad_output, Tensor input, Tensor m_splits, "
      "bool compute_bias_grad) -> (Tensor[], Tensor[])");
  m.def(
      "grouped_linear_wgrad_accumulate_(Tensor grad_output, Tensor input, Tensor m_splits, "
      "Tensor(a!)?[] weight_grads, Tensor(b!)?[] bias_grads) -> ()");
  m.def(
      "grouped_linear(Tensor input, Tensor m_splits, Tensor[] weights, Tensor[] biases, "
      "Tensor?[] weight_main_grads, Tensor?[] bias_main_grads, int layer_id, "
      "bool delay_wgrad_compute, bool lazy_main_grad=False) -> Tensor");
}
