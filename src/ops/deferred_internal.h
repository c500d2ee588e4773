#pragma once
// What the autograd function shares with the deferred-wgrad runner (src/ops/deferred.cpp).

#include <ATen/core/Tensor.h>

#include <string>

#include "core/grad_ledger.h"
#include "core/wgrad_store.h"

namespace splitgrad::detail {

/// "splitgrad layer 'fc1'": how messages name a layer.
std::string layer_label(core::LayerId layer);

/// The backward pass now running (the current autograd graph task), watched so that the ledger
/// hears when it ends. Outside any graph task it is a pass of its own that ends with the scope.
class PassScope {
 public:
  PassScope();
  ~PassScope();
  PassScope(const PassScope&) = delete;
  PassScope& operator=(const PassScope&) = delete;
  core::PassId id() const { return id_; }

 private:
  core::PassId id_;
  bool owns_pass_;
};

/// Where one linear application's weight gradients go. Undefined members receive nothing.
struct WgradSinks {
  at::Tensor weight;            ///< gets dW in weight.grad, unless weight_main_grad is set
  at::Tensor bias;              ///< gets db in bias.grad, unless bias_main_grad is set
  at::Tensor weight_main_grad;  ///< fp32 buffer: dW is accumulated here in fp32
  at::Tensor bias_main_grad;
};

/// Adds dW = dyᵀ·x and db = Σ dy to their sinks (`+=`, never `=`); a parameter without a .grad gets
/// one, as AccumulateGrad would give it.
void accumulate_wgrad(const at::Tensor& grad_output, const at::Tensor& input,
                      const WgradSinks& sinks);

/// The stream current on `t`'s device (the CPU's default stream for CPU tensors).
c10::Stream current_stream_of(const at::Tensor& t);

/// Tells the callback set by set_main_grad_accumulated_callback(), if any.
void notify_main_grad_accumulated(const at::Tensor& param);

}  // namespace splitgrad::detail
