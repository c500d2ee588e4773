#pragma once
// The ATen back end of splitgrad::activation / activation_backward, and their differentiable
// forms for a backward with create_graph=True (splitgrad's ops have no double backward).
#include <ATen/core/Tensor.h>

#include <string_view>

namespace splitgrad::aten_backend {

/// TE's activation of `input` ("gelu" is the tanh approximation; a gated one computes act(a) * b
/// for input = [a | b] along the last dimension): the kernels, in the order, of the ATen composite
/// (at::gelu(a, "tanh") * b ...), so the result is that composite's bit for bit.
at::Tensor activation(const at::Tensor& input, std::string_view activation);

/// The gradient with respect to `input` (input's shape), with the kernels autograd runs for the
/// composite; a gated one's two halves are written in place into one result.
at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& input,
                               std::string_view activation);

/// The same values from differentiable ATen ops only (no out= writes), for double backward.
at::Tensor activation_differentiable(const at::Tensor& input, std::string_view activation);
at::Tensor activation_backward_differentiable(const at::Tensor& grad_output,
                                              const at::Tensor& input, std::string_view activation);

}  // namespace splitgrad::aten_backend
