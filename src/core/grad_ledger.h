#pragma once
// The gradient ledger: per parameter, which backward passes still owe it a contribution, and the
// grad-ready hooks to run once a pass's last contribution has landed. No CUDA, no Python.
//
// A "pass" is one autograd graph task (one `backward()` / `autograd.grad()` call). Contributions to
// a parameter P in pass k come from two places:
//   - autograd itself (AccumulateGrad, or a regular splitgrad layer writing main_grad in its
//     backward): they have all landed when pass k's graph task ends;
//   - deferred wgrad items queued during pass k: they land one by one in backward_dw().
// P's hooks fire for pass k when both are over: the graph task has ended and no deferred item of
// pass k for P is outstanding. So each hook runs exactly once per pass, after the last
// contribution. The ledger also notes which splitgrad layers' ops ran their backward in a pass, and
// a hook sees them (firing_layer_ran()): a module's hook tells its own passes from those that
// reach a tied parameter through other layers only.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace splitgrad::core {

/// Identifies one backward pass (an autograd graph task id, or a synthetic negative id for work
/// queued outside any graph task).
using PassId = int64_t;

/// Identifies a layer registered with the store (WgradStore::register_layer); 0 is "no layer".
using LayerId = int64_t;

/// Called with the parameter once its gradient for a pass is complete.
using GradReadyHook = std::function<void(const at::Tensor& param)>;

/// A tensor held without keeping it alive.
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

/// A weak reference to `t` (to nothing when `t` is undefined); lock() gives the tensor back, or an
/// undefined one once it is freed. Holding it keeps the address from being reused.
inline WeakTensor weak_ref(const at::Tensor& t) { return WeakTensor(t.getIntrusivePtr()); }

class GradLedger {
 public:
  static GradLedger& instance();

  /// Adds `hook` to `param`'s grad-ready hooks; returns a key for remove_hook().
  uint64_t add_hook(const at::Tensor& param, GradReadyHook hook);
  /// Removes a hook; returns false if the key is unknown (already removed).
  bool remove_hook(const at::Tensor& param, uint64_t key);
  /// Number of grad-ready hooks registered for `param`.
  size_t hook_count(const at::Tensor& param) const;

  /// Starts tracking `pass`; returns true if this call started it (the caller then arranges for
  /// autograd_pass_finished() to be called when the pass's graph task ends).
  /// Inside a hook this ledger is running: the backward pass whose completion it reports; else
  /// nullopt (per thread).
  static std::optional<PassId> firing_pass();
  /// Inside a hook this ledger is running: whether `layer`'s ops ran their backward in that pass
  /// (note_layer_ran()); nullopt if no layer's did, or outside a hook (per thread).
  static std::optional<bool> firing_layer_ran(LayerId layer);
  /// Whether a hook was ever added (what note_layer_ran() is for), cheaply, without the lock.
  bool hooks_registered() const { return hooks_registered_.load(std::memory_order_relaxed); }
  bool open_pass(PassId pass);
  /// Pass `pass` made (or will have made, by its end) an autograd contribution to `param`.
  void note_autograd_contribution(const at::Tensor& param, PassId pass);
  /// A deferred contribution to `param` was queued in `pass`.
  void expect_deferred(const at::Tensor& param, PassId pass);
  /// A deferred contribution of `pass` to `param` landed. Fires hooks if it was the last one.
  void deferred_landed(const at::Tensor& param, PassId pass);
  /// A deferred contribution was dropped (failed check, layer deleted): it is no longer owed, but
  /// the gradient of that pass is incomplete, so its hooks do not fire for that pass.
  void deferred_dropped(const at::Tensor& param, PassId pass);
  /// The three above for each of `params` under one lock (a parameter listed twice counts twice):
  /// one item's targets at once. Hooks fire after every parameter has been counted.
  void note_autograd_contribution(const std::vector<at::Tensor>& params, PassId pass);
  void expect_deferred(const std::vector<at::Tensor>& params, PassId pass);
  void deferred_landed(const std::vector<at::Tensor>& params, PassId pass);
  void deferred_dropped(const std::vector<at::Tensor>& params, PassId pass);
  /// `layer`'s op ran its backward in `pass`, an open pass (ignored otherwise).
  void note_layer_ran(PassId pass, LayerId layer);
  /// The autograd part of `pass` is over (its graph task ended). Fires the hooks of every parameter
  /// of that pass that owes nothing more.
  void autograd_pass_finished(PassId pass);

  /// Deferred contributions still owed to `param`, over all passes.
  int64_t pending_for(const at::Tensor& param) const;
  /// Deferred contributions to `param` dropped so far (never decreases while `param` lives).
  int64_t dropped_for(const at::Tensor& param) const;
  /// True if the ledger has seen `pass` but not yet its autograd_pass_finished().
  bool pass_open(PassId pass) const;

  /// How many parameters the ledger holds state for, dead ones not swept yet included (tests).
  size_t tracked_params() const;

  /// Forgets everything (tests only).
  void reset();

 private:
  struct PassState {
    int64_t owed = 0;  // deferred items queued and not yet landed or dropped
    bool autograd_done = false;
    bool incomplete = false;  // a contribution was dropped: do not fire for this pass
    // The layers whose ops ran in the pass (sorted), shared by its parameters from its end on.
    std::shared_ptr<const std::vector<LayerId>> layers_ran;
  };
  // A parameter's state stays once it is empty (no pass, hook or drop: every step's passes settle
  // and reopen it, and erasing and re-creating it was most of the ledger's host time), but without
  // its weak reference ("disarmed"): torch.utils.swap_tensors (a module's .to() with swapping on)
  // refuses tensors that have one, and an empty state is what a new tensor at the same address
  // would start with. Its passes are few (one per backward pass not yet settled): a vector,
  // searched linearly, whose storage outlives them.
  using Passes = std::vector<std::pair<PassId, PassState>>;
  struct ParamState {
    WeakTensor impl;  // the parameter itself is not kept alive by the ledger; reset when disarmed
    std::vector<std::pair<uint64_t, GradReadyHook>> hooks;
    Passes passes;
    int64_t dropped = 0;  // deferred contributions dropped, over the parameter's life
  };
  using Key = const c10::TensorImpl*;
  // The parameter is held weakly until fire(): a strong reference made under mutex_ would, for a
  // tensor with a Python object, take the GIL while holding mutex_ (PyTorch takes it for the
  // first C++ reference beside the Python one), the reverse of a Python caller's order.
  struct Firing {
    WeakTensor param;
    PassId pass;
    std::shared_ptr<const std::vector<LayerId>> layers_ran;
    std::vector<GradReadyHook> hooks;
  };

  using ParamIter = std::unordered_map<Key, ParamState>::iterator;
  using PassIter = Passes::iterator;

  static PassIter find_pass(ParamState& state, PassId pass);

  ParamState& state_for(const at::Tensor& param);               // requires mutex_
  PassState& pass_state(const at::Tensor& param, PassId pass);  // requires mutex_
  // One deferred contribution of `pass` to `param` landed.
  void landed_locked(const at::Tensor& param, PassId pass, std::vector<Firing>& out);
  // Collects the hooks to fire for (param, pass) if it owes nothing; erases settled state.
  void settle(Key key, PassId pass, std::vector<Firing>& out);       // requires mutex_
  void settle(ParamIter it, PassIter ps, std::vector<Firing>& out);  // requires mutex_
  static bool disarmed(const ParamState& state);
  // Forgets disarmed states and dead parameters without hooks (destroying hooks may run code:
  // add_hook() forgets those, outside the lock) once params_ has doubled since the last sweep.
  void sweep_if_grown();                           // requires mutex_
  static void fire(std::vector<Firing>& firings);  // runs without the mutex held

  mutable std::mutex mutex_;
  std::unordered_map<Key, ParamState> params_;
  size_t sweep_at_ = 64;  // params_'s size that triggers the next sweep
  struct OpenPass {
    std::vector<Key> params;      // touched by it
    std::vector<LayerId> layers;  // whose ops ran in it, sorted
  };
  std::unordered_map<PassId, OpenPass> open_passes_;
  std::atomic<bool> hooks_registered_{false};
  uint64_t next_hook_key_ = 1;
};

}  // namespace splitgrad::core
