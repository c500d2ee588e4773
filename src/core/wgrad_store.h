#pragma once
// The deferred-wgrad store: the weight-gradient work that a backward pass of a layer built with
// delay_wgrad_compute=True queued instead of running. FIFO per layer, and ordered globally by the
// time it was queued. No CUDA, no Python: items hold tensors and say which parameters they feed;
// running them is the ops layer's job (src/ops/deferred.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/grad_ledger.h"

namespace splitgrad::core {

/// One group's gradient targets in a grouped application (GroupedLinear's expert i). Empty
/// members receive nothing. The parameters are held weakly, as DeferredWgrad's are.
struct GroupTargets {
  WeakTensor weight = weak_ref(at::Tensor());  ///< the group's weight parameter
  WeakTensor bias = weak_ref(at::Tensor());    ///< the group's bias parameter
  at::Tensor weight_main_grad;  ///< fp32 accumulation buffer (fuse_wgrad_accumulation)
  at::Tensor bias_main_grad;
};

/// One linear layer application's deferred wgrad: dW = dyᵀ·x (and db = Σ dy), to be added to the
/// target parameters' gradients. A grouped application (GroupedLinear) is one item too: its rows
/// are split into groups, group i's products going to groups[i].
struct DeferredWgrad {
  LayerId layer = 0;
  PassId pass = 0;         ///< the backward pass that queued it
  uint64_t seq = 0;        ///< global queue order, set by WgradStore::push
  at::Tensor input;        ///< x, [tokens, in_features]
  at::Tensor grad_output;  ///< dy, [tokens, out_features]
  /// When set, `input` is the activation's input h and x = activation(h) is recomputed right
  /// before the GEMM. The store does not interpret it (the ops layer names its activations).
  std::string input_activation;
  /// The GEMM in a module with several ("fc1" of a LayerNormMLP), for messages; empty otherwise.
  std::string gemm;
  uint32_t input_version = 0;        ///< x's version counter when stashed
  uint32_t grad_output_version = 0;  ///< dy's version counter when stashed
  /// The parameters the gradient belongs to (the bias: none when there is no bias gradient),
  /// held weakly: the queue must not keep a model alive (a hook on its parameter may refer to the
  /// model, a cycle the garbage collector cannot see through C++). A parameter freed before its
  /// item runs needs no gradient.
  WeakTensor weight = weak_ref(at::Tensor());
  WeakTensor bias = weak_ref(at::Tensor());
  at::Tensor
      weight_main_grad;       ///< fp32 accumulation buffer (fuse_wgrad_accumulation), or undefined
  at::Tensor bias_main_grad;  ///< likewise for the bias
  /// The stream current when the item was queued (the backward's): the stashed tensors were made
  /// on it. Work run on another stream must keep them from the allocator until it has read them.
  c10::Stream stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  /// The backward that queued it ran under anomaly detection with check_nan (autograd checks
  /// the gradients it computes for nan; backward_dw() checks this item's likewise).
  bool check_nan = false;
  /// torch.autocast's state for the item's device when it was queued (the backward's): the item
  /// runs under it, so its GEMM rounds as the backward's own would have, whatever autocast
  /// region backward_dw() is called in.
  bool autocast_enabled = false;
  at::ScalarType autocast_dtype = at::ScalarType::BFloat16;

  /// A grouped application: rows [offset_i, offset_i + m_splits[i]) of input and grad_output
  /// belong to group i (offset_i: the sum of the splits before i), whose targets are groups[i];
  /// weight and bias above stay undefined. m_splits undefined and groups empty otherwise.
  at::Tensor m_splits;            ///< int64 [groups]
  uint32_t m_splits_version = 0;  ///< m_splits' version counter when stashed
  std::vector<GroupTargets> groups;

  /// The live parameters this item contributes to (weight if it trains, then bias if any; for a
  /// grouped application, each group's in order; a parameter tied between groups appears once per
  /// group).
  std::vector<at::Tensor> targets() const;
  /// Whether it contributes to `param` (compared by identity; a freed parameter is no match).
  bool feeds(const at::Tensor& param) const;
  /// Whether every parameter it was for has been freed (it can land nowhere).
  bool targets_freed() const;
};

class WgradStore {
 public:
  static WgradStore& instance();

  /// Registers a layer; its name appears in every message about its work.
  LayerId register_layer(std::string name);
  /// Unregisters a layer and returns the items it still had queued (the caller accounts for them).
  /// Its name is kept for messages about work of it still in flight.
  std::vector<DeferredWgrad> release_layer(LayerId layer);
  void rename_layer(LayerId layer, std::string name);
  /// The layer's name (also after release), or "<unregistered layer N>" for an id never issued.
  std::string layer_name(LayerId layer) const;
  bool is_registered(LayerId layer) const;
  /// The layer ran where its backward is not its op's own (a traced or captured graph, a
  /// torch.func transform): the ledger cannot name it there. Ignored for an unregistered layer.
  void note_ran_untracked(LayerId layer);
  bool ran_untracked(LayerId layer) const;

  /// Queues an item at the back of its layer's FIFO. The layer must be registered.
  void push(DeferredWgrad item);
  /// Takes the layer's items of the oldest pass it has pending (all of them: a layer applied
  /// several times in one forward queues several items in one pass). Empty if the layer has none.
  std::vector<DeferredWgrad> take_oldest_pass(LayerId layer);
  /// Takes the layer's items queued by `pass` (all of them). Empty if that pass queued none.
  std::vector<DeferredWgrad> take_pass(LayerId layer, PassId pass);
  /// The passes that have items queued for the layer, oldest first (by their first item).
  std::vector<PassId> pending_passes(LayerId layer) const;
  /// Takes every queued item, oldest first.
  std::vector<DeferredWgrad> take_all();
  /// Takes every queued item that feeds one of `params` (all of them when empty), oldest first.
  std::vector<DeferredWgrad> take_feeding(const std::vector<at::Tensor>& params);
  /// Puts items taken earlier back in place (same order as before they were taken). Returns
  /// those whose layer was released meanwhile, for the caller to drop outside any lock (freeing
  /// a stashed tensor with a Python object takes the GIL).
  std::vector<DeferredWgrad> restore(std::vector<DeferredWgrad> items);

  /// Number of queued items, in all layers or in one.
  size_t pending() const;
  size_t pending(LayerId layer) const;
  /// Layers that have queued items, in registration order. With `params` non-empty, only those
  /// whose items feed one of `params`.
  std::vector<LayerId> layers_with_pending(const std::vector<at::Tensor>& params = {}) const;

 private:
  mutable std::mutex mutex_;
  LayerId next_layer_ = 1;
  uint64_t next_seq_ = 1;
  size_t pending_ = 0;
  std::map<LayerId, std::string> names_;  // every layer ever registered, released ones too
  struct LayerQueue {
    std::deque<DeferredWgrad> items;              // in queue order
    std::unordered_map<PassId, size_t> per_pass;  // items per pass, so a take is O(its items)
    bool ran_untracked = false;
  };
  std::vector<DeferredWgrad> take_pass_locked(LayerQueue& queue, PassId pass);  // requires mutex_
  static bool feeds(const DeferredWgrad& item, const std::vector<at::Tensor>& params);
  std::map<LayerId, LayerQueue> queues_;
};

}  // namespace splitgrad::core
