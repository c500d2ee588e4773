#pragma once
// What the autograd function shares with the deferred-wgrad runner (src/ops/deferred.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/grad_ledger.h"
#include "core/wgrad_store.h"
#include "ops/checks.h"

namespace splitgrad::detail {

/// "splitgrad layer 'fc1'": how messages name a layer.
std::string layer_label(core::LayerId layer);
/// "splitgrad layer 'blocks.0.mlp' (fc2)": one GEMM of a module with several; layer_label(layer)
/// when `gemm` is empty.
std::string layer_label(core::LayerId layer, const std::string& gemm);

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

/// Whether the backward pass now running adds to `param.grad`: true for a leaf whose
/// AccumulateGrad runs (every leaf in backward(), those named in backward(inputs=...)); false for
/// a computed (non-leaf) tensor and in autograd.grad(), which returns gradients and writes no
/// .grad. Outside a backward pass: true.
bool pass_accumulates_into(const at::Tensor& param);

/// The dtype splitgrad::linear computes in for the call the autocast kernel makes
/// (src/ops/linear_autocast.cpp): input in that dtype, parameters cast for the product only, so
/// their gradients land in their own dtype. Unset (nullopt) outside that call.
class AutocastComputeDtype {
 public:
  explicit AutocastComputeDtype(at::ScalarType dtype);
  ~AutocastComputeDtype();
  AutocastComputeDtype(const AutocastComputeDtype&) = delete;
  AutocastComputeDtype& operator=(const AutocastComputeDtype&) = delete;
  static std::optional<at::ScalarType> current();

 private:
  std::optional<at::ScalarType> previous_;
};

/// Where one linear application's weight gradients go. Undefined members receive nothing.
struct WgradSinks {
  at::Tensor weight;            ///< gets dW in weight.grad, unless weight_main_grad is set
  at::Tensor bias;              ///< gets db in bias.grad, unless bias_main_grad is set
  at::Tensor weight_main_grad;  ///< fp32 buffer: dW is accumulated here in fp32
  at::Tensor bias_main_grad;
};

/// `value`, one of a pass's gradients of `param`, as autograd adds it to the others before its
/// .grad: one in the parameter's dtype is cast to the .grad's dtype first (autograd casts each
/// contribution to grad_dtype); one in autocast's compute dtype stays as it is (autocast casts the
/// parameter once, so its contributions are summed before that cast's backward).
at::Tensor as_contribution(const at::Tensor& param, at::Tensor value);

/// Serialises the reads and writes of parameters' gradients: two threads' deferred work (or one's
/// backward_dw() and another's fused backward) may feed one parameter, and a .grad read while
/// another thread assigns it is a data race. Locks `sinks`' parameters while it lives (striped by
/// address, in one global order: no deadlock). Not reentrant: a thread holds one at a time. Never
/// taken inside a ReferenceBatch, which may hold the GIL: a thread holding these locks may wait for
/// the GIL (an op dispatched to a Python __torch_dispatch__ mode).
class GradWriteLocks {
 public:
  explicit GradWriteLocks(const std::vector<WgradSinks>& sinks);
  ~GradWriteLocks();
  GradWriteLocks(const GradWriteLocks&) = delete;
  GradWriteLocks& operator=(const GradWriteLocks&) = delete;

 private:
  void unlock();
  uint64_t held_ = 0;  // bit s: stripe s is locked by this object
};

/// Adds dW = dyᵀ·x and db = Σ dy to their sinks (`+=`, never `=`); a parameter without a .grad gets
/// one, as AccumulateGrad would give it. `locked`: the caller holds the sinks' locks (its checks
/// of their .grads and these writes under one hold; deferred.cpp's add_to_sinks).
void accumulate_wgrad(const at::Tensor& grad_output, const at::Tensor& input,
                      const WgradSinks& sinks, const GradWriteLocks& locked);

/// The grouped form (GroupedLinear): rows [offset_i, offset_i + m_splits[i]) of grad_output and
/// input feed sinks[i], with accumulate_wgrad's arithmetic per group. Sinks may share a parameter
/// (tied experts): its .grad gets their sum in reverse group order, as per-expert autograd adds
/// them (a main_grad accumulates them in group order).
void accumulate_grouped_wgrad(const at::Tensor& grad_output, const at::Tensor& input,
                              const at::Tensor& m_splits, const std::vector<WgradSinks>& sinks,
                              const GradWriteLocks& locked);

/// delay_wgrad_compute=True needs the layer registered with the deferred-wgrad store.
void check_registered_if_delayed(Who who, bool delay, core::LayerId layer);

/// A backward with create_graph=True (double backward) cannot fuse a gradient into main_grad,
/// which is not differentiable: refused where `fused_gradient_wanted`.
void check_no_fused_double_backward(Who who, bool fused_gradient_wanted);

/// A fused layer's weight as a create_graph=True backward's input gradient uses it (dx = dy·W):
/// a gradient that later reaches the weight through that dx (a gradient penalty) would land in
/// .grad beside main_grad, so it is refused there, when it flows (one that never reaches the
/// weight, e.g. a Hessian-vector product in the inputs, runs).
at::Tensor refuse_second_order_weight_grad(Who who, const at::Tensor& weight);

/// Whether `t` is a tracing placeholder (meta, fake or functional tensor) with no values to read
/// or stash.
bool is_traced(const at::Tensor& t);

/// A forward of `layer`'s op with `input`: one traced into a graph (is_traced) is noted
/// (WgradStore::note_ran_untracked), since the graph's backward will not be the op's own.
void note_layer_forward(core::LayerId layer, const at::Tensor& input);

/// A backward of `layer`'s op runs in the current pass: the grad-ready hooks of the pass learn it
/// (grad_ready_layer_ran()). Nothing is noted while no grad-ready hook exists.
void note_layer_backward(core::LayerId layer);

/// Whether a backward of `layer` built with delay_wgrad_compute=`delay` queues its weight
/// gradients: not where the layer was deleted since its forward (nothing could run them later,
/// and its parameters may live on), which computes them at once, as the regular path does.
bool defers_wgrad(bool delay, core::LayerId layer);

/// The end of a linear (`m_splits` undefined, one sink) or grouped (a sink per group) backward,
/// for the gradients this pass writes to parameters (the sinks): without `delay`, added at once
/// (accumulate_wgrad / accumulate_grouped_wgrad; the ledger counts them as this pass's own); with
/// it, queued as one item of the store for backward_dw() (added at once all the same where the
/// layer is no longer registered). `module` ("splitgrad.Linear") is named in the refusal to queue
/// tracing placeholders. `input_activation` (linear only, with `delay`): `input` is the
/// activation's input, and backward_dw() recomputes the GEMM's input act(input) right before its
/// GEMM. `gemm` names the GEMM in a module with several ("fc1"), for backward_dw()'s messages.
void accumulate_or_defer(core::LayerId layer, bool delay, const at::Tensor& grad_output,
                         const at::Tensor& input, const at::Tensor& m_splits,
                         const std::vector<WgradSinks>& sinks, const char* module,
                         const std::string& input_activation = std::string(),
                         const std::string& gemm = std::string());

/// The stream current on `t`'s device (the CPU's default stream for CPU tensors).
c10::Stream current_stream_of(const at::Tensor& t);

/// The main_grads of `params` (undefined entries stay undefined) for a layer that reads them in its
/// backward (the ops' lazy_main_grad), as Transformer Engine does: Megatron-FSDP allocates
/// main_grad only before the backward. By default the buffers set with set_main_grad(); the Python
/// module reads `param.get_main_grad()` for a Megatron-FSDP parameter, else `param.main_grad`. An
/// entry without one comes back undefined.
std::vector<at::Tensor> main_grads_for_backward(const std::vector<at::Tensor>& params);
using MainGradSource = std::vector<at::Tensor> (*)(const std::vector<at::Tensor>& params);
/// Replaces that lookup (nullptr: back to set_main_grad()'s buffers).
void set_main_grad_source(MainGradSource source);

/// lazy_main_grad's backward: gives each sink's weight and bias their main_grads from
/// main_grads_for_backward(), checked with check_main_grad(): the weight's is required, a bias
/// without one keeps its gradient in .grad. `numbered`: the sinks are groups ("weight3"); `gemm`:
/// the GEMM of a module with several, whose parameters are named after it ("fc2_weight").
void read_main_grads(Who who, std::vector<WgradSinks>& sinks, bool numbered,
                     const std::string& gemm = std::string());

/// A scope for taking or dropping many tensor references at once. PyTorch takes the GIL whenever
/// a C++ reference to a tensor with a Python object (a parameter, its main_grad) is added beside
/// the Python one, and when it is dropped again: backward_dw() of a 32-expert GroupedLinear did
/// that about 300 times. Inside the scope the Python package holds the GIL, so each of those is a
/// cheap re-entry. Only around reference work: never around a splitgrad lock (threads holding one
/// may wait for the GIL) or a GEMM. Without a hook (C++ programs) it does nothing.
class ReferenceBatch {
 public:
  ReferenceBatch();
  ~ReferenceBatch();
  ReferenceBatch(const ReferenceBatch&) = delete;
  ReferenceBatch& operator=(const ReferenceBatch&) = delete;
  /// Whether the calling thread is inside one (GradWriteLocks checks it is not).
  static bool active();
  /// At a splitgrad entry point that takes gradient locks (the deferred runner, a backward's
  /// accumulate): a batch open further out on this thread (Python code that a tensor's finalizer
  /// ran inside one) is not this call's, and the GIL was released on the way in (the binding, the
  /// autograd engine), so it does not count for active() until the scope ends.
  class Reentry {
   public:
    Reentry();
    ~Reentry();
    Reentry(const Reentry&) = delete;
    Reentry& operator=(const Reentry&) = delete;

   private:
    int saved_depth_;
  };

 private:
  std::shared_ptr<void> held_;
};
/// What a ReferenceBatch holds, made by `hook` (the Python module: the GIL); nullptr: nothing.
void set_reference_batch_hook(std::shared_ptr<void> (*hook)());

}  // namespace splitgrad::detail
