#pragma once
/// \file module.h
/// What every splitgrad module (Linear, GroupedLinear, LayerNormLinear, LayerNormMLP) adds to
/// torch::nn::Module, written once: its deferred work (backward_dw(), the pending passes),
/// grad-ready hooks that follow re-tied parameters, the pending-work guard on save() and
/// zero_grad(), and a clone() that keeps the ties among the module's own parameters.

#include <c10/util/StringUtil.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "splitgrad/deferred.h"

namespace splitgrad {

/// TE's init_method: draws a GEMM weight in place, e.g.
/// `[](const at::Tensor& w) { torch::nn::init::normal_(w, 0.0, 0.02); }`. Run under no-grad; the
/// GEMM's bias is then zeroed, as TE (and Megatron) zero every GEMM bias.
using InitMethod = std::function<void(const at::Tensor& weight)>;

/// The base of the splitgrad modules, over torch::nn::Cloneable as torch::nn's own modules are
/// (`class LinearImpl : public DeferredWgradModule<LinearImpl>`). `Derived` has an `options`
/// member with delay_wgrad_compute() and name(), sets `layer_` in its reset() (its registration
/// with the deferred-wgrad store), and re-ties a parameter by name in tie_in_copy(). A clone's
/// `reduce_hooks_` start empty (a copied ModuleReduceHooks has none).
template <class Derived>
class DeferredWgradModule : public torch::nn::Cloneable<Derived> {
 public:
  /// Runs this module's deferred wgrad (all its GEMMs) for the oldest backward pass still
  /// pending. Does nothing for a module built with delay_wgrad_compute=false; throws c10::Error
  /// if a delayed module has nothing pending (see LayerHandle::backward_dw() for the others).
  void backward_dw() {
    if (derived().options.delay_wgrad_compute()) layer_->backward_dw();
  }
  /// Runs this module's deferred wgrad queued by backward pass `pass` (see pending_passes()): a
  /// pipeline's W step for one named micro-batch. Does nothing for a regular module; throws
  /// c10::Error if that pass queued nothing for a delayed one.
  void backward_dw(int64_t pass) {
    if (derived().options.delay_wgrad_compute()) layer_->backward_dw(pass);
  }
  /// TE's name: whether this module defers its weight gradients to backward_dw() (built with
  /// delay_wgrad_compute).
  bool need_backward_dw() const { return derived().options.delay_wgrad_compute(); }
  /// The backward passes with work queued for this module, oldest first.
  std::vector<int64_t> pending_passes() const { return layer_->pending_passes(); }
  /// Deferred wgrad items queued for this module: one per application and GEMM (GroupedLinear's
  /// experts are one GEMM; LayerNormMLP has two).
  int64_t pending_wgrads() const { return layer_->pending(); }

  /// Registers `hook(param)` as a grad-ready hook of each of this module's parameters that
  /// requires grad, each tensor once (TE's name); see register_grad_ready_hook(). They follow a
  /// parameter re-tied later; they cannot be removed, and a clone() has none.
  void register_wgrad_accumulation_and_reduce_hooks(GradReadyHook hook) {
    reduce_hooks_.add(std::move(hook), this->parameters(/*recurse=*/false));
  }

  /// A deep copy with a registration (and, for a named module, a name "<name>#<id>") of its own.
  /// Parameters tied to each other here share one copy there (as Python's deepcopy keeps them).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<at::Device>& device = std::nullopt) const override {
    auto copy = torch::nn::Cloneable<Derived>::clone(device);
    auto& module = static_cast<DeferredWgradModule&>(static_cast<Derived&>(*copy));
    for (const auto& [name, first] : tied_parameter_names()) {
      module.tie_in_copy(name, module.parameters_[first]);
    }
    // reset() gave the copy a registration of its own; a default name already carries its id, a
    // user's name gets it too, so messages tell the two apart.
    auto& options = static_cast<Derived&>(*copy).options;
    if (!options.name().empty()) {
      options.name(c10::str(options.name(), "#", module.layer_->id()));
      module.layer_->set_name(options.name());
    }
    return copy;
  }
  /// torch::save: runs the pending-work guard (check_pending_wgrads) first.
  void save(torch::serialize::OutputArchive& archive) const override {
    check_pending_wgrads(c10::str("saving splitgrad layer '", layer_->name(), "'"),
                         this->parameters(/*recurse=*/false));
    torch::nn::Cloneable<Derived>::save(archive);
  }
  /// Runs the pending-work guard first (also when called on a module that holds this one).
  void zero_grad(bool set_to_none = true) override {
    check_pending_wgrads(c10::str("zero_grad() of splitgrad layer '", layer_->name(), "'"),
                         this->parameters(/*recurse=*/false));
    torch::nn::Cloneable<Derived>::zero_grad(set_to_none);
  }

 protected:
  /// Makes parameter `name` of this copy (clone()) the tensor `param`, another of its parameters.
  virtual void tie_in_copy(const std::string& name, const torch::Tensor& param) = 0;
  /// Records that parameter `name` is now `tied` (a tie_* method, after its checks): the module's
  /// parameters() list it, and the grad-ready hooks move onto it.
  void retied(const std::string& name, const torch::Tensor& tied) {
    this->parameters_[name] = tied;
    reduce_hooks_.follow(this->parameters(/*recurse=*/false));
  }

  std::shared_ptr<LayerHandle> layer_;      ///< set by Derived::reset()
  detail::ModuleReduceHooks reduce_hooks_;  ///< follow re-tying

 private:
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
  /// The ties among this module's own parameters: each name whose tensor an earlier name also
  /// holds, with that earlier name (torch::nn::Cloneable copies each name apart).
  std::vector<std::pair<std::string, std::string>> tied_parameter_names() const {
    std::vector<std::pair<std::string, std::string>> ties;
    const auto named = this->named_parameters(/*recurse=*/false);
    for (size_t i = 0; i < named.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (named[i].value().is_same(named[j].value())) {
          ties.emplace_back(named[i].key(), named[j].key());
          break;
        }
      }
    }
    return ties;
  }
};

}  // namespace splitgrad
