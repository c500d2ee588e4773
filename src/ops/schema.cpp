// The splitgrad operator schemas, written once. Back ends register kernels in their own files
// (src/cpu, src/cuda, src/ops/fake_kernels.cpp); autograd lives in src/ops/linear_autograd.cpp.
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
      "Tensor? bias_main_grad, int layer_id, bool delay_wgrad_compute) -> Tensor");
}
