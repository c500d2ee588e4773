#pragma once
/// \file deferred.h
/// Deferred weight gradients: the layers that queue them, running them, and the per-parameter
/// grad-ready hooks that data-parallel and sharded reducers hang their collectives on.
///
/// Errors from running deferred work (LayerHandle::backward_dw(), backward_dw_all()): if a tensor
/// stashed for an item (its input or grad_output) was modified in place after the backward pass
/// that queued it, that item is dropped (dropped_wgrads_for() counts it), nothing of the call runs
/// and c10::Error is thrown naming the layer (and the GEMM of a module with several) and the
/// tensor. LayerHandle::backward_dw() runs one backward pass's items all or none: the pass's other
/// items are dropped too (counted alike), so no gradient of it is half-written and the next call
/// runs the next pass. backward_dw_all() puts the other items back on the queue. An exception
/// thrown by a grad-ready hook reaches the caller once the item that fired it has landed; the items
/// not run yet stay queued. Either way no gradient is lost silently or left half-written.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace splitgrad {

/// A layer's registration with the deferred-wgrad store (RAII). Its id is what the `linear` op's
/// `layer_id` names. Destroying it frees the tensors of any work still queued for the layer (with a
/// warning that names the layer: those contributions are lost).
class LayerHandle {
 public:
  /// Registers a layer with the process-wide deferred-wgrad store.
  /// \param name the layer's name in messages (may be empty, and set later with set_name())
  explicit LayerHandle(std::string name);
  /// Unregisters the layer (release()), warning (TORCH_WARN) with its name if work was pending.
  ~LayerHandle();
  LayerHandle(const LayerHandle&) = delete;
  LayerHandle& operator=(const LayerHandle&) = delete;

  /// The layer's id: the `layer_id` to give ops::linear(). Positive (0 means "no layer" there).
  int64_t id() const { return id_; }
  /// The name used in messages about this layer.
  std::string name() const;
  /// Renames the layer (in later messages).
  void set_name(std::string name);
  /// Unregisters the layer now (the destructor does it otherwise): frees the tensors of the work it
  /// still had queued and returns how many items that was. Idempotent.
  int64_t release();
  /// Number of deferred wgrad items queued for this layer.
  int64_t pending() const;
  /// Runs this layer's deferred wgrad for the oldest backward pass still pending: all of that
  /// pass's items (a layer applied several times in one forward queues one item per application).
  /// Throws c10::Error naming the layer if nothing is pending, and as the file comment says.
  void backward_dw();
  /// The backward passes (autograd graph tasks) that have work queued for this layer, oldest
  /// first. A pipeline stage diffs this before and after its B step to learn which pass that was.
  std::vector<int64_t> pending_passes() const;
  /// Runs this layer's deferred wgrad queued by backward pass `pass` (one of pending_passes()),
  /// whatever is older: a pipeline's W step for the micro-batch the schedule names. Throws
  /// c10::Error naming the layer and the pass if that pass queued nothing for it, and as the file
  /// comment says.
  /// \param pass an id from pending_passes()
  void backward_dw(int64_t pass);
  /// Whether the layer ever ran where its backward is not its op's own: inside a traced graph
  /// (torch.compile, jit.trace; a forward of its op with fake, functional or other
  /// Python-dispatched tensors notes it), a CUDA graph capture or a torch.func transform (the
  /// Python modules note those). There grad_ready_layer_ran() cannot name the layer.
  bool ran_untracked() const;
  /// Notes that the layer ran where its backward is not its op's (see ran_untracked()).
  void note_ran_untracked();

 private:
  int64_t id_;
  bool released_ = false;
};

/// Runs every pending deferred wgrad in the process, oldest first, and returns once all of it has
/// landed: work that another thread's backward_dw()/backward_dw_all() had already taken when this
/// call began is waited for, not skipped. "All" is process-wide: from several threads that each
/// train their own model, use the overload below with the model's parameters, so that each thread
/// runs (and its hooks see) only its own model's work. Two calls never write one gradient at once.
/// Nothing pending: returns at once. Throws as the file comment says.
void backward_dw_all();
/// Runs the pending deferred wgrad that feeds any of `params` (one model's work, for instance),
/// oldest first, waiting as above for such work already taken by another thread.
/// \param params the parameters whose work to run; empty: all (as backward_dw_all())
void backward_dw_all(const std::vector<at::Tensor>& params);

/// How many deferred wgrad items are waiting (all layers).
int64_t pending_wgrads();

/// Deferred contributions still owed to `param`: queued by backward passes and not yet landed
/// (an item taken by a running backward_dw() counts until it has been added).
/// Throws c10::ValueError if `param` is undefined.
int64_t pending_wgrads_for(const at::Tensor& param);

/// Deferred contributions to `param` dropped so far (an item whose stashed tensor was modified in
/// place, a layer deleted with work pending). Never decreases while `param` lives: a reducer
/// compares it before and after a step to know that a gradient is incomplete.
/// Throws c10::ValueError if `param` is undefined.
int64_t dropped_wgrads_for(const at::Tensor& param);

/// Names of the layers with pending work; with `params` non-empty, only the layers whose pending
/// work feeds one of them.
std::vector<std::string> layers_with_pending_wgrads(const std::vector<at::Tensor>& params = {});

/// What check_pending_wgrads() does when deferred work is pending.
enum class PendingWorkPolicy {
  kWarn,   ///< TORCH_WARN, and go on
  kError,  ///< throw c10::Error
};
/// Sets the policy, process-wide; the default is kWarn. (The Python package has its own,
/// splitgrad.set_pending_work_policy.)
void set_pending_work_policy(PendingWorkPolicy policy);
/// The policy set by set_pending_work_policy().
PendingWorkPolicy pending_work_policy();
/// The pending-work guard: if deferred work feeding `params` (any, when empty) is still queued,
/// warns (TORCH_WARN) or throws c10::Error, per the policy, naming the layers. `action` names what
/// was about to happen ("optimizer step"). Call it before anything that reads or clears gradients
/// (an optimizer step, zero_grad, a checkpoint); splitgrad::GuardedOptimizer and
/// splitgrad::Linear's save() call it for you. Throws c10::Error only under kError.
void check_pending_wgrads(const std::string& action, const std::vector<at::Tensor>& params = {});

/// Called with the parameter once all of a backward pass's contributions to it have landed, in the
/// thread that landed the last one. An exception it throws reaches that call's caller.
using GradReadyHook = std::function<void(const at::Tensor& param)>;

/// A registered grad-ready hook; remove() unregisters it (idempotent). Destroying the handle does
/// not remove the hook.
class GradReadyHookHandle {
 public:
  /// A handle to no hook (active() is false).
  GradReadyHookHandle() = default;
  /// Unregisters the hook: it is not called again. Idempotent; a no-op once the parameter is gone.
  void remove();
  /// Whether this handle still holds a hook (registered and not remove()d).
  bool active() const { return state_ != nullptr; }

 private:
  friend GradReadyHookHandle register_grad_ready_hook(const at::Tensor&, GradReadyHook);
  struct State;
  std::shared_ptr<State> state_;
};

/// Calls `hook(param)` exactly once per backward pass that contributes to `param`, after the last
/// contribution of that pass has landed — immediate (autograd, regular layers) or deferred
/// (backward_dw), from any layer or ordinary autograd op. Passes that write no gradient
/// (autograd::grad) do not call it. `param` must be a leaf that requires grad; the hook is
/// dropped with it (neither the hook nor its handle keeps `param` alive). Several hooks on one
/// parameter run in the order registered. Throws c10::ValueError if `param` is undefined or not a
/// leaf that requires grad.
/// \return the handle that removes the hook
GradReadyHookHandle register_grad_ready_hook(const at::Tensor& param, GradReadyHook hook);

/// Inside a grad-ready hook: the id of the backward pass whose gradient it reports complete (the
/// ids LayerHandle::pending_passes() lists); nullopt elsewhere. Lets a hook of several parameters
/// tell which of their events belong to one pass.
std::optional<int64_t> grad_ready_pass();

/// Inside a grad-ready hook: whether the ops of layer `layer` (a LayerHandle::id()) ran their
/// backward in the pass it reports on; nullopt if no splitgrad layer's did (a pass through ordinary
/// ops, or through layers whose backward is not their op's: see LayerHandle::ran_untracked()), and
/// outside a hook. Lets a module's hook tell its own passes from those that reach a tied parameter
/// through other layers only. A layer is noted only while some grad-ready hook exists.
std::optional<bool> grad_ready_layer_ran(int64_t layer);

namespace detail {
/// The hooks a module registered with register_wgrad_accumulation_and_reduce_hooks(), kept so that
/// they follow its parameters when one is re-tied (tie_weight), as the Python modules' do. A copy
/// (a copied module's, a clone's) starts with none; a move takes them along.
class ModuleReduceHooks {
 public:
  ModuleReduceHooks() = default;
  /// A copy (a copied module's) starts with none: the hooks stay on the original's parameters,
  /// and a tie on the copy must not move them.
  ModuleReduceHooks(const ModuleReduceHooks& /*other*/) {}
  ModuleReduceHooks& operator=(const ModuleReduceHooks& other) {
    if (this != &other) clear();
    return *this;
  }
  ModuleReduceHooks(ModuleReduceHooks&&) = default;
  ModuleReduceHooks& operator=(ModuleReduceHooks&&) = default;
  /// Registers `hook` as a grad-ready hook of each of `params` that requires grad, each tensor
  /// once, and keeps it.
  void add(GradReadyHook hook, const std::vector<at::Tensor>& params);
  /// Moves every kept hook onto `params` (the module's parameters after a tie).
  void follow(const std::vector<at::Tensor>& params);
  /// Forgets the hooks without unregistering them (they stay on the parameters they were on).
  void clear();

 private:
  void install(const GradReadyHook& hook, const std::vector<at::Tensor>& params);
  std::vector<GradReadyHook> hooks_;
  std::vector<GradReadyHookHandle> handles_;
};
}  // namespace detail

/// Sets where a parameter's fp32 gradient buffer lives for fuse_wgrad_accumulation (Megatron's
/// `param.main_grad`) for C++ callers. An undefined `main_grad` clears it. `param` must be a leaf
/// that requires grad, `main_grad` an fp32 tensor of its shape on its device (c10::ValueError
/// otherwise). The table holds `param` weakly: the entry goes with the parameter.
void set_main_grad(const at::Tensor& param, const at::Tensor& main_grad);
/// The buffer set by set_main_grad() for `param`, or an undefined tensor if none is.
at::Tensor main_grad(const at::Tensor& param);

/// Called with each parameter right after a wgrad was accumulated into its main_grad, for C++
/// callers that track it (the Python package sets `param.grad_added_to_main_grad` in the fused
/// forward instead). Empty function: none.
void set_main_grad_accumulated_callback(std::function<void(const at::Tensor& param)> callback);

}  // namespace splitgrad
