#include "core/grad_ledger.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <iterator>

namespace splitgrad::core {

GradLedger& GradLedger::instance() {
  // Leaked on purpose: hooks it holds may own layers whose destructors call back into the ledger,
  // and objects destroyed at exit (a global layer) may too; a static would be gone by then.
  static GradLedger* ledger = new GradLedger();
  return *ledger;
}

GradLedger::ParamState& GradLedger::state_for(const at::Tensor& param) {
  TORCH_INTERNAL_ASSERT(param.defined(), "GradLedger: undefined parameter");
  Key key = param.unsafeGetTensorImpl();
  auto it = params_.find(key);
  if (it != params_.end() && disarmed(it->second)) {
    it->second.impl = weak_ref(param);  // empty: this tensor's, or fresh for a new one here
    return it->second;
  }
  if (it != params_.end() && it->second.impl.expired()) {
    params_.erase(it);  // a dead tensor's address was reused
    it = params_.end();
  }
  if (it == params_.end()) {
    sweep_if_grown();
    it = params_.emplace(key, ParamState{WeakTensor(param.getIntrusivePtr()), {}, {}}).first;
  }
  return it->second;
}

bool GradLedger::disarmed(const ParamState& state) {
  return state.impl._unsafe_get_target() == c10::UndefinedTensorImpl::singleton();
}

void GradLedger::sweep_if_grown() {
  if (params_.size() < sweep_at_) return;
  for (auto it = params_.begin(); it != params_.end();) {
    const ParamState& state = it->second;
    if (disarmed(state) || (state.impl.expired() && state.hooks.empty())) {
      it = params_.erase(it);
    } else {
      ++it;
    }
  }
  sweep_at_ = std::max<size_t>(64, 2 * params_.size());
}

GradLedger::PassIter GradLedger::find_pass(ParamState& state, PassId pass) {
  return std::find_if(state.passes.begin(), state.passes.end(),
                      [pass](const auto& entry) { return entry.first == pass; });
}

GradLedger::PassState& GradLedger::pass_state(const at::Tensor& param, PassId pass) {
  ParamState& state = state_for(param);
  const auto found = find_pass(state, pass);
  if (found != state.passes.end()) return found->second;
  open_passes_[pass].params.push_back(param.unsafeGetTensorImpl());
  return state.passes.emplace_back(pass, PassState{}).second;
}

uint64_t GradLedger::add_hook(const at::Tensor& param, GradReadyHook hook) {
  TORCH_CHECK(hook, "register_grad_ready_hook: the hook is empty");
  // Hooks are destroyed after the lock is released: destroying one may run arbitrary code (a
  // Python closure's finalizers) that calls back into the ledger.
  std::vector<ParamState> dead;
  std::lock_guard<std::mutex> lock(mutex_);
  // Forget parameters that died: their hooks (and whatever the hooks hold) can never run again.
  for (auto it = params_.begin(); it != params_.end();) {
    if (it->second.impl.expired() && !disarmed(it->second)) {
      dead.push_back(std::move(it->second));
      it = params_.erase(it);
    } else {
      ++it;
    }
  }
  uint64_t key = next_hook_key_++;
  state_for(param).hooks.emplace_back(key, std::move(hook));
  hooks_registered_.store(true, std::memory_order_relaxed);
  return key;
}

bool GradLedger::remove_hook(const at::Tensor& param, uint64_t key) {
  GradReadyHook removed;  // destroyed after the lock is released (see add_hook)
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = params_.find(param.unsafeGetTensorImpl());
  if (it == params_.end()) return false;
  auto& hooks = it->second.hooks;
  auto pos =
      std::find_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.first == key; });
  if (pos == hooks.end()) return false;
  removed = std::move(pos->second);
  hooks.erase(pos);
  ParamState& state = it->second;
  if (state.hooks.empty() && state.passes.empty() && state.dropped == 0) state.impl.reset();
  return true;
}

size_t GradLedger::hook_count(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = params_.find(param.unsafeGetTensorImpl());
  return it == params_.end() || it->second.impl.expired() ? 0 : it->second.hooks.size();
}

bool GradLedger::open_pass(PassId pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_passes_.try_emplace(pass).second;
}

bool GradLedger::pass_open(PassId pass) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_passes_.count(pass) != 0;
}

void GradLedger::note_autograd_contribution(const at::Tensor& param, PassId pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!pass_state(param, pass).autograd_done,
                        "GradLedger: autograd contribution after its pass ended (pass ", pass, ")");
}

void GradLedger::note_autograd_contribution(const std::vector<at::Tensor>& params, PassId pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& param : params) {
    TORCH_INTERNAL_ASSERT(!pass_state(param, pass).autograd_done,
                          "GradLedger: autograd contribution after its pass ended (pass ", pass,
                          ")");
  }
}

void GradLedger::expect_deferred(const at::Tensor& param, PassId pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  pass_state(param, pass).owed += 1;
}

void GradLedger::expect_deferred(const std::vector<at::Tensor>& params, PassId pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& param : params) pass_state(param, pass).owed += 1;
}

void GradLedger::deferred_landed(const at::Tensor& param, PassId pass) {
  std::vector<Firing> firings;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landed_locked(param, pass, firings);
  }
  fire(firings);
}

void GradLedger::deferred_landed(const std::vector<at::Tensor>& params, PassId pass) {
  std::vector<Firing> firings;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& param : params) landed_locked(param, pass, firings);
  }
  fire(firings);
}

void GradLedger::landed_locked(const at::Tensor& param, PassId pass, std::vector<Firing>& out) {
  Key key = param.unsafeGetTensorImpl();
  auto it = params_.find(key);
  TORCH_INTERNAL_ASSERT(it != params_.end(),
                        "GradLedger: a deferred contribution landed that was never expected");
  auto ps = find_pass(it->second, pass);
  TORCH_INTERNAL_ASSERT(ps != it->second.passes.end(),
                        "GradLedger: a deferred contribution landed that was never expected");
  TORCH_INTERNAL_ASSERT(ps->second.owed > 0,
                        "GradLedger: more deferred contributions than expected");
  ps->second.owed -= 1;
  settle(it, ps, out);
}

void GradLedger::deferred_dropped(const at::Tensor& param, PassId pass) {
  deferred_dropped(std::vector<at::Tensor>{param}, pass);
}

void GradLedger::deferred_dropped(const std::vector<at::Tensor>& params, PassId pass) {
  std::vector<Firing> firings;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& param : params) {
      auto it = params_.find(param.unsafeGetTensorImpl());
      if (it == params_.end()) continue;
      auto ps = find_pass(it->second, pass);
      if (ps == it->second.passes.end()) continue;
      ps->second.owed = std::max<int64_t>(0, ps->second.owed - 1);
      ps->second.incomplete = true;
      it->second.dropped += 1;
      settle(it, ps, firings);
    }
  }
  fire(firings);
}

void GradLedger::note_layer_ran(PassId pass, LayerId layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto open = open_passes_.find(pass);
  if (open == open_passes_.end()) return;
  auto& layers = open->second.layers;
  const auto at = std::lower_bound(layers.begin(), layers.end(), layer);
  if (at == layers.end() || *at != layer) layers.insert(at, layer);
}

void GradLedger::autograd_pass_finished(PassId pass) {
  std::vector<Firing> firings;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto open = open_passes_.find(pass);
    if (open == open_passes_.end()) return;
    std::vector<Key> keys = std::move(open->second.params);
    // Complete now: every backward of the pass has run. Its parameters share one copy.
    std::shared_ptr<const std::vector<LayerId>> layers_ran;
    if (!open->second.layers.empty()) {
      layers_ran = std::make_shared<const std::vector<LayerId>>(std::move(open->second.layers));
    }
    open_passes_.erase(open);
    for (Key key : keys) {
      auto it = params_.find(key);
      if (it == params_.end()) continue;
      auto ps = find_pass(it->second, pass);
      if (ps == it->second.passes.end()) continue;
      ps->second.autograd_done = true;
      ps->second.layers_ran = layers_ran;
      settle(key, pass, firings);
    }
  }
  fire(firings);
}

void GradLedger::settle(Key key, PassId pass, std::vector<Firing>& out) {
  auto it = params_.find(key);
  if (it == params_.end()) return;
  auto ps = find_pass(it->second, pass);
  if (ps == it->second.passes.end()) return;
  settle(it, ps, out);
}

void GradLedger::settle(ParamIter it, PassIter ps, std::vector<Firing>& out) {
  ParamState& state = it->second;
  if (!ps->second.autograd_done || ps->second.owed > 0) return;
  const bool complete = !ps->second.incomplete;
  const PassId ps_pass = ps->first;
  auto layers_ran = std::move(ps->second.layers_ran);
  state.passes.erase(ps);
  if (complete && !state.hooks.empty()) {
    Firing firing{state.impl, ps_pass, std::move(layers_ran), {}};
    firing.hooks.reserve(state.hooks.size());
    for (const auto& hook : state.hooks) firing.hooks.push_back(hook.second);
    out.push_back(std::move(firing));
  }
  if (state.passes.empty() && state.dropped == 0 && state.hooks.empty()) {
    if (state.impl.expired()) {
      params_.erase(it);
    } else {
      state.impl.reset();  // disarmed
    }
  }
}

namespace {
thread_local std::optional<PassId> current_firing_pass;
thread_local const std::vector<LayerId>* current_firing_layers = nullptr;  // null: none ran
}  // namespace

std::optional<PassId> GradLedger::firing_pass() { return current_firing_pass; }

std::optional<bool> GradLedger::firing_layer_ran(LayerId layer) {
  if (current_firing_layers == nullptr) return std::nullopt;
  return std::binary_search(current_firing_layers->begin(), current_firing_layers->end(), layer);
}

void GradLedger::fire(std::vector<Firing>& firings) {
  // Every hook runs even if an earlier one throws: the passes are settled already, so a hook
  // skipped now would never run for them. The first exception is rethrown once all have run.
  std::exception_ptr first_error;
  const std::optional<PassId> outer = current_firing_pass;  // a hook may fire others (nested)
  const std::vector<LayerId>* outer_layers = current_firing_layers;
  for (auto& firing : firings) {
    const at::Tensor param(firing.param.lock());
    if (!param.defined()) continue;  // freed since it settled: nothing to report on
    current_firing_pass = firing.pass;
    current_firing_layers = firing.layers_ran.get();
    for (auto& hook : firing.hooks) {
      try {
        hook(param);
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
  }
  current_firing_pass = outer;
  current_firing_layers = outer_layers;
  if (first_error) std::rethrow_exception(first_error);
}

int64_t GradLedger::pending_for(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = params_.find(param.unsafeGetTensorImpl());
  if (it == params_.end() || it->second.impl.expired()) return 0;
  int64_t owed = 0;
  for (const auto& [pass, ps] : it->second.passes) owed += ps.owed;
  return owed;
}

int64_t GradLedger::dropped_for(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = params_.find(param.unsafeGetTensorImpl());
  if (it == params_.end() || it->second.impl.expired()) return 0;
  return it->second.dropped;
}

size_t GradLedger::tracked_params() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return params_.size();
}

void GradLedger::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  params_.clear();
  open_passes_.clear();
  sweep_at_ = 64;
}

}  // namespace splitgrad::core
