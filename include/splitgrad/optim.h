#pragma once
/// \file optim.h
/// The pending-work guard for torch::optim: an optimizer whose step() and zero_grad() first run
/// check_pending_wgrads() over its own parameters (SPEC §3).

#include <c10/util/Type.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

#include "splitgrad/deferred.h"

namespace splitgrad {

/// Any torch::optim optimizer, guarded:
/// \code
/// splitgrad::GuardedOptimizer<torch::optim::SGD> opt(splitgrad::unique_parameters(*model),
///                                                    torch::optim::SGDOptions(0.1));
/// \endcode
/// step() and zero_grad() warn (or throw, with PendingWorkPolicy::kError) naming the layers whose
/// deferred work feeding this optimizer's parameters is still queued; the work stays queued.
/// zero_grad() is not virtual in libtorch: the guard holds only when it is called through this
/// type (step() is guarded through an Optimizer& too).
template <class Optimizer>
class GuardedOptimizer : public Optimizer {
 public:
  /// The wrapped optimizer's constructors (parameters, options).
  using Optimizer::Optimizer;

  /// check_pending_wgrads() over this optimizer's parameters, then Optimizer::step().
  /// Throws c10::Error (kError policy) before stepping anything; the work stays queued.
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    check_pending_wgrads(name() + "::step()", params());
    return Optimizer::step(std::move(closure));
  }

  /// check_pending_wgrads() over this optimizer's parameters, then Optimizer::zero_grad().
  /// Throws c10::Error (kError policy) before clearing anything; the work stays queued.
  void zero_grad(bool set_to_none = true) {
    check_pending_wgrads(name() + "::zero_grad()", params());
    Optimizer::zero_grad(set_to_none);
  }

  /// torch::save of the optimizer (its state, not the gradients) is not guarded: nothing is lost.

 private:
  static std::string name() { return std::string(c10::demangle_type<Optimizer>()); }
  std::vector<torch::Tensor> params() const {
    std::vector<torch::Tensor> out;
    for (const auto& group : this->param_groups()) {
      out.insert(out.end(), group.params().begin(), group.params().end());
    }
    return out;
  }
};

}  // namespace splitgrad
