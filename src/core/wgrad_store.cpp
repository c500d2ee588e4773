#include "core/wgrad_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>

namespace splitgrad::core {

std::vector<at::Tensor> DeferredWgrad::targets() const {
  // A frozen weight (requires_grad=False) with a trainable bias leaves `weight` empty.
  std::vector<at::Tensor> out;
  out.reserve(2 + 2 * groups.size());
  auto add = [&](const WeakTensor& target) {
    at::Tensor param(target.lock());
    if (param.defined()) out.push_back(std::move(param));
  };
  add(weight);
  add(bias);
  for (const auto& group : groups) {
    add(group.weight);
    add(group.bias);
  }
  return out;
}

bool DeferredWgrad::feeds(const at::Tensor& param) const {
  if (!param.defined()) return false;
  // The weak references keep a freed parameter's address from being reused, so an address
  // match is the parameter itself, live.
  const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
  if (weight._unsafe_get_target() == impl || bias._unsafe_get_target() == impl) return true;
  return std::any_of(groups.begin(), groups.end(), [&](const GroupTargets& group) {
    return group.weight._unsafe_get_target() == impl || group.bias._unsafe_get_target() == impl;
  });
}

bool DeferredWgrad::targets_freed() const {
  // expired() reads a count: no parameter is revived (and maybe freed) by asking.
  if (!weight.expired() || !bias.expired()) return false;
  return std::all_of(groups.begin(), groups.end(), [](const GroupTargets& group) {
    return group.weight.expired() && group.bias.expired();
  });
}

WgradStore& WgradStore::instance() {
  // Leaked on purpose, like the ledger: layers destroyed at exit still unregister here.
  static WgradStore* store = new WgradStore();
  return *store;
}

LayerId WgradStore::register_layer(std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  LayerId id = next_layer_++;
  names_.emplace(id, std::move(name));
  queues_.emplace(id, LayerQueue{});
  return id;
}

std::vector<DeferredWgrad> WgradStore::release_layer(LayerId layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The name stays: a backward pass still running through the deleted layer names it.
  auto it = queues_.find(layer);
  if (it == queues_.end()) return {};
  auto& items = it->second.items;
  std::vector<DeferredWgrad> dropped(std::make_move_iterator(items.begin()),
                                     std::make_move_iterator(items.end()));
  pending_ -= dropped.size();
  queues_.erase(it);
  return dropped;
}

void WgradStore::rename_layer(LayerId layer, std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = names_.find(layer);
  TORCH_CHECK(it != names_.end() && queues_.count(layer),
              "splitgrad: cannot rename unregistered layer ", layer);
  it->second = std::move(name);
}

std::string WgradStore::layer_name(LayerId layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = names_.find(layer);
  return it == names_.end() ? "<unregistered layer " + std::to_string(layer) + ">" : it->second;
}

bool WgradStore::is_registered(LayerId layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queues_.count(layer) != 0;
}

void WgradStore::note_ran_untracked(LayerId layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(layer);
  if (it != queues_.end()) it->second.ran_untracked = true;
}

bool WgradStore::ran_untracked(LayerId layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(layer);
  return it != queues_.end() && it->second.ran_untracked;
}

void WgradStore::push(DeferredWgrad item) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(item.layer);
  TORCH_CHECK(it != queues_.end(), "splitgrad: cannot queue deferred wgrad for layer ", item.layer,
              ": the layer is not registered (was it deleted?)");
  item.seq = next_seq_++;
  it->second.per_pass[item.pass] += 1;
  it->second.items.push_back(std::move(item));
  pending_ += 1;
}

std::vector<DeferredWgrad> WgradStore::take_oldest_pass(LayerId layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(layer);
  if (it == queues_.end() || it->second.items.empty()) return {};
  return take_pass_locked(it->second, it->second.items.front().pass);
}

std::vector<DeferredWgrad> WgradStore::take_pass(LayerId layer, PassId pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(layer);
  if (it == queues_.end()) return {};
  return take_pass_locked(it->second, pass);
}

std::vector<DeferredWgrad> WgradStore::take_pass_locked(LayerQueue& queue, PassId pass) {
  std::vector<DeferredWgrad> taken;
  auto count = queue.per_pass.find(pass);
  if (count == queue.per_pass.end()) return taken;
  const size_t in_pass = count->second;
  queue.per_pass.erase(count);
  auto& items = queue.items;
  auto first = items.begin();
  if (first->pass != pass) {
    first = std::find_if(items.begin(), items.end(),
                         [&](const DeferredWgrad& item) { return item.pass == pass; });
  }
  auto last = first;
  while (last != items.end() && last->pass == pass) ++last;
  if (static_cast<size_t>(last - first) != in_pass) {
    // Concurrent backward passes interleaved their items: gather this pass's from the rest.
    last = std::stable_partition(first, items.end(),
                                 [&](const DeferredWgrad& item) { return item.pass == pass; });
  }
  taken.assign(std::make_move_iterator(first), std::make_move_iterator(last));
  items.erase(first, last);
  pending_ -= taken.size();
  return taken;
}

std::vector<PassId> WgradStore::pending_passes(LayerId layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<PassId> passes;
  auto it = queues_.find(layer);
  if (it == queues_.end()) return passes;
  passes.reserve(it->second.per_pass.size());
  for (const auto& item : it->second.items) {
    if (passes.size() == it->second.per_pass.size()) break;
    if (std::find(passes.begin(), passes.end(), item.pass) == passes.end())
      passes.push_back(item.pass);
  }
  return passes;
}

std::vector<DeferredWgrad> WgradStore::take_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<DeferredWgrad> taken;
  taken.reserve(pending_);
  for (auto& [layer, queue] : queues_) {
    std::move(queue.items.begin(), queue.items.end(), std::back_inserter(taken));
    queue.items.clear();
    queue.per_pass.clear();
  }
  pending_ = 0;
  std::sort(taken.begin(), taken.end(),
            [](const DeferredWgrad& a, const DeferredWgrad& b) { return a.seq < b.seq; });
  return taken;
}

bool WgradStore::feeds(const DeferredWgrad& item, const std::vector<at::Tensor>& params) {
  if (params.empty()) return true;
  return std::any_of(params.begin(), params.end(),
                     [&](const at::Tensor& p) { return item.feeds(p); });
}

std::vector<DeferredWgrad> WgradStore::take_feeding(const std::vector<at::Tensor>& params) {
  if (params.empty()) return take_all();
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<DeferredWgrad> taken;
  for (auto& [layer, queue] : queues_) {
    auto& items = queue.items;
    auto keep = std::stable_partition(items.begin(), items.end(), [&](const DeferredWgrad& item) {
      // An item whose parameters are all freed feeds no one: any call takes it, so that it is
      // reported and its stash freed rather than kept until its layer goes.
      return !feeds(item, params) && !item.targets_freed();
    });
    for (auto it = keep; it != items.end(); ++it) {
      if (--queue.per_pass[it->pass] == 0) queue.per_pass.erase(it->pass);
      taken.push_back(std::move(*it));
    }
    items.erase(keep, items.end());
  }
  pending_ -= taken.size();
  std::sort(taken.begin(), taken.end(),
            [](const DeferredWgrad& a, const DeferredWgrad& b) { return a.seq < b.seq; });
  return taken;
}

std::vector<DeferredWgrad> WgradStore::restore(std::vector<DeferredWgrad> items) {
  std::vector<DeferredWgrad> released;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& item : items) {
    auto it = queues_.find(item.layer);
    if (it == queues_.end()) {  // the layer was released meanwhile: its work goes with it
      released.push_back(std::move(item));
      continue;
    }
    it->second.per_pass[item.pass] += 1;
    auto& queue = it->second.items;
    auto pos =
        std::upper_bound(queue.begin(), queue.end(), item.seq,
                         [](uint64_t seq, const DeferredWgrad& other) { return seq < other.seq; });
    queue.insert(pos, std::move(item));
    pending_ += 1;
  }
  return released;
}

size_t WgradStore::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_;
}

size_t WgradStore::pending(LayerId layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(layer);
  return it == queues_.end() ? 0 : it->second.items.size();
}

std::vector<LayerId> WgradStore::layers_with_pending(const std::vector<at::Tensor>& params) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LayerId> layers;
  for (const auto& [layer, queue] : queues_) {
    if (std::any_of(queue.items.begin(), queue.items.end(),
                    [&](const DeferredWgrad& item) { return feeds(item, params); }))
      layers.push_back(layer);
  }
  return layers;
}

}  // namespace splitgrad::core
