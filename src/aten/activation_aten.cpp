// The ATen back end of the activation ops, for every device (CompositeExplicitAutograd: CPU, CUDA,
// Meta); src/cuda may register fused kernels for the CUDA key. Each result is what the ATen
// composite the modules used before computes, and its gradient what autograd computes for that
// composite: the same kernels on the same operands, so deferred and immediate gradients agree bit
// for bit with plain PyTorch's.
#include "aten/activation_aten.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"

namespace splitgrad::aten_backend {
namespace {

// TE's activations; a gated one ("geglu" ... "glu") applies its act to the first half. "qgelu" is
// x * sigmoid(1.702 x), "srelu" relu(x)², and "glu"'s act the sigmoid: each computed with the ops
// of the plain PyTorch composite (x * torch.sigmoid(1.702 * x), torch.relu(x).square()).
enum class Act { Gelu, Relu, Silu, QGelu, SRelu, Sigmoid };

struct Parsed {
  Act act;
  bool gated;
};

constexpr double kQuickGelu = 1.702;

// The name, already checked.
Parsed parse(std::string_view name) {
  const bool gated = detail::is_gated_activation(std::string(name));
  if (name == "gelu" || name == "geglu") return {Act::Gelu, gated};
  if (name == "relu" || name == "reglu") return {Act::Relu, gated};
  if (name == "qgelu" || name == "qgeglu") return {Act::QGelu, gated};
  if (name == "srelu" || name == "sreglu") return {Act::SRelu, gated};
  if (name == "glu") return {Act::Sigmoid, gated};
  return {Act::Silu, gated};
}

Parsed checked(const char* op, const at::Tensor& input, std::string_view activation) {
  detail::check_activation_args(detail::named(op), input, std::string(activation));
  return parse(activation);
}

Parsed checked_backward(const at::Tensor& grad_output, const at::Tensor& input,
                        std::string_view activation) {
  detail::check_activation_backward_args(detail::named("splitgrad::activation_backward"),
                                         grad_output, input, std::string(activation));
  return parse(activation);
}

at::Tensor act(Act a, const at::Tensor& x) {
  switch (a) {
    case Act::Gelu:
      return at::gelu(x, "tanh");
    case Act::Relu:
      return at::relu(x);
    case Act::Silu:
      return at::silu(x);
    case Act::QGelu:
      return x * at::sigmoid(x * kQuickGelu);
    case Act::SRelu:
      return at::pow(at::relu(x), 2);  // torch.square is pow(x, 2)
    case Act::Sigmoid:
      return at::sigmoid(x);
  }
  TORCH_INTERNAL_ASSERT(false);
}

// act(x) into `out` (at::relu is at::clamp_min(x, 0), which has an out= form; the composites are
// computed, then copied).
void act_out(Act a, at::Tensor& out, const at::Tensor& x) {
  switch (a) {
    case Act::Gelu:
      at::gelu_out(out, x, "tanh");
      return;
    case Act::Relu:
      at::clamp_min_out(out, x, 0);
      return;
    case Act::Silu:
      at::silu_out(out, x);
      return;
    case Act::Sigmoid:
      at::sigmoid_out(out, x);
      return;
    case Act::QGelu:
    case Act::SRelu:
      out.copy_(act(a, x));
      return;
  }
}

// The gradient autograd computes for the composite: GeluBackward0 / ReluBackward0 / SiluBackward0 /
// SigmoidBackward0 (the sigmoid recomputed: the values it saved); for qgelu the sum of
// MulBackward0's two paths, grad * s and sigmoid_backward(grad * x, s) * 1.702; for srelu
// PowBackward0's grad * (2 * r), then ReluBackward0. ReluBackward0 reads relu's result, not its
// input: `result <= 0` exactly where `input <= 0`, so the same values.
at::Tensor act_backward(Act a, const at::Tensor& grad, const at::Tensor& x) {
  switch (a) {
    case Act::Gelu:
      return at::gelu_backward(grad, x, "tanh");
    case Act::Relu:
      return at::threshold_backward(grad, x, 0);
    case Act::Silu:
      return at::silu_backward(grad, x);
    case Act::Sigmoid:
      return at::sigmoid_backward(grad, at::sigmoid(x));
    case Act::QGelu: {
      const at::Tensor s = at::sigmoid(x * kQuickGelu);
      return grad * s + at::sigmoid_backward(grad * x, s) * kQuickGelu;
    }
    case Act::SRelu:
      return at::threshold_backward(grad * (at::relu(x) * 2), x, 0);
  }
  TORCH_INTERNAL_ASSERT(false);
}

void act_backward_out(Act a, at::Tensor& out, const at::Tensor& grad, const at::Tensor& x) {
  switch (a) {
    case Act::Gelu:
      at::gelu_backward_out(out, grad, x, "tanh");
      return;
    case Act::Relu:
      at::threshold_backward_out(out, grad, x, 0);
      return;
    case Act::Silu:
      at::silu_backward_out(out, grad, x);
      return;
    case Act::Sigmoid:
    case Act::QGelu:
    case Act::SRelu:
      out.copy_(act_backward(a, grad, x));
      return;
  }
}

std::pair<at::Tensor, at::Tensor> halves(const at::Tensor& t) {
  const auto parts = t.chunk(2, /*dim=*/-1);
  return {parts[0], parts[1]};
}

}  // namespace

at::Tensor activation(const at::Tensor& input, std::string_view activation) {
  const Parsed p = checked("splitgrad::activation", input, activation);
  // Not differentiable (linear's autograd differentiates it): out= writes need no grad mode.
  at::NoGradGuard no_grad;
  if (!p.gated) return act(p.act, input);
  // act(a) * b as the composite computes it (act(a) rounded, then the product), with the product
  // written over act(a): one result, no temporary.
  const auto [a, b] = halves(input);
  at::Tensor out = at::empty(a.sizes(), a.options());
  act_out(p.act, out, a);
  return out.mul_(b);
}

at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& input,
                               std::string_view activation) {
  const Parsed p = checked_backward(grad_output, input, activation);
  at::NoGradGuard no_grad;
  if (!p.gated) return act_backward(p.act, grad_output, input);
  // The product rule of act(a) * b, as MulBackward0 and the activation's backward compute it:
  // d_b = grad * act(a), d_a = act'(a) · (grad * b); each half written in place into the result.
  const auto [a, b] = halves(input);
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  auto [d_a, d_b] = halves(grad_input);
  act_out(p.act, d_b, a);
  d_b.mul_(grad_output);
  at::mul_out(d_a, grad_output, b);
  act_backward_out(p.act, d_a, d_a, a);
  return grad_input;
}

at::Tensor activation_differentiable(const at::Tensor& input, std::string_view activation) {
  const Parsed p = checked("splitgrad::activation", input, activation);
  if (!p.gated) return act(p.act, input);
  const auto [a, b] = halves(input);
  return act(p.act, a) * b;
}

namespace {
// As autograd's create_graph formulas: silu_backward has no derivative, so SiluBackward0 uses
// infinitely_differentiable_silu_backward there (this expression).
at::Tensor act_backward_differentiable(Act a, const at::Tensor& grad, const at::Tensor& x) {
  if (a != Act::Silu) return act_backward(a, grad, x);
  const at::Tensor sigmoid = x.sigmoid();
  return grad * sigmoid * (1.0 + x * (1.0 - sigmoid));
}
}  // namespace

at::Tensor activation_backward_differentiable(const at::Tensor& grad_output,
                                              const at::Tensor& input,
                                              std::string_view activation) {
  const Parsed p = checked_backward(grad_output, input, activation);
  if (!p.gated) return act_backward_differentiable(p.act, grad_output, input);
  const auto [a, b] = halves(input);
  return at::cat(
      {act_backward_differentiable(p.act, grad_output * b, a), grad_output * act(p.act, a)}, -1);
}

namespace {
at::Tensor activation_kernel(const at::Tensor& input, c10::string_view activation) {
  return aten_backend::activation(input, activation);
}
at::Tensor activation_backward_kernel(const at::Tensor& grad_output, const at::Tensor& input,
                                      c10::string_view activation) {
  return aten_backend::activation_backward(grad_output, input, activation);
}
}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, CompositeExplicitAutograd, m) {
  m.impl("activation", &activation_kernel);
  m.impl("activation_backward", &activation_backward_kernel);
}

}  // namespace splitgrad::aten_backend
