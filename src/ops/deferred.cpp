// Running deferred wgrad work, the grad-ready hooks API, and main_grad bookkeeping.
#include "splitgrad/deferred.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "ops/checks.h"
#include "ops/deferred_internal.h"
#include "splitgrad/ops.h"

namespace splitgrad {

using core::DeferredWgrad;
using core::GradLedger;
using core::WgradStore;

namespace detail {

std::string layer_label(core::LayerId layer) {
  return "splitgrad layer '" + WgradStore::instance().layer_name(layer) + "'";
}

std::string layer_label(core::LayerId layer, const std::string& gemm) {
  return gemm.empty() ? layer_label(layer) : c10::str(layer_label(layer), " (", gemm, ")");
}

namespace {
std::atomic<core::PassId> next_synthetic_pass{-2};
}

PassScope::PassScope() {
  const int task = torch::autograd::get_current_graph_task_id();
  auto& ledger = GradLedger::instance();
  if (task < 0) {
    id_ = next_synthetic_pass.fetch_sub(1);
    owns_pass_ = true;
    ledger.open_pass(id_);
    return;
  }
  id_ = task;
  owns_pass_ = false;
  if (ledger.open_pass(id_)) {
    const core::PassId pass = id_;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [pass] { GradLedger::instance().autograd_pass_finished(pass); });
  }
}

PassScope::~PassScope() {
  if (owns_pass_) GradLedger::instance().autograd_pass_finished(id_);
}

bool pass_accumulates_into(const at::Tensor& param) {
  if (!param.is_leaf()) return false;
  // Empty exec_info: backward() without inputs, every node runs. Otherwise only the nodes
  // marked needed_ run; autograd.grad() only captures its inputs' gradients.
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!accumulator) return false;
  const auto it = exec_info->find(accumulator.get());
  return it != exec_info->end() && it->second.needed_;
}

namespace {
// Process-wide state is leaked, not destroyed at exit: layers and hooks destroyed after it (a
// global layer, a hook holding one) still reach it.
struct MainGradCallback {
  std::mutex mutex;
  std::function<void(const at::Tensor&)> callback;
};
MainGradCallback& main_grad_callback() {
  static auto* state = new MainGradCallback();
  return *state;
}

// The gradient write locks: 64 stripes, one per bit of GradWriteLocks::held_.
constexpr size_t kGradLockStripes = 64;
std::array<std::mutex, kGradLockStripes>& grad_lock_stripes() {
  static auto* m = new std::array<std::mutex, kGradLockStripes>();
  return *m;
}
}  // namespace

GradWriteLocks::GradWriteLocks(const std::vector<WgradSinks>& sinks) {
  TORCH_CHECK(!ReferenceBatch::active(),
              "splitgrad internal error: gradient locks taken inside a ReferenceBatch, which may "
              "hold the GIL (a deadlock with a thread that holds them and waits for the GIL); "
              "please report it to splitgrad");
  uint64_t stripes = 0;  // bit s: stripe s is needed
  for (const WgradSinks& sink : sinks) {
    for (const at::Tensor* param : {&sink.weight, &sink.bias}) {
      if (!param->defined()) continue;
      // TensorImpls are 16-byte aligned: the address's low bits would reach 4 stripes only.
      const auto address = reinterpret_cast<uintptr_t>(param->unsafeGetTensorImpl());
      stripes |= uint64_t{1} << ((address >> 4) % kGradLockStripes);
    }
  }
  for (size_t s = 0; s < kGradLockStripes; ++s) {  // in stripe order, one global order
    if (((stripes >> s) & 1) == 0) continue;
    try {
      grad_lock_stripes()[s].lock();
    } catch (...) {
      unlock();
      throw;
    }
    held_ |= uint64_t{1} << s;
  }
}

GradWriteLocks::~GradWriteLocks() { unlock(); }

void GradWriteLocks::unlock() {
  for (size_t s = 0; s < kGradLockStripes; ++s) {
    if ((held_ >> s) & 1) grad_lock_stripes()[s].unlock();
  }
  held_ = 0;
}

namespace {
// `value`, a gradient of `param`, in the dtype autograd gives param's .grad: its grad_dtype (a
// bf16 parameter may keep fp32 gradients), else its own; unchanged where any dtype is allowed.
at::Tensor as_grad_dtype(const at::Tensor& param, at::Tensor value) {
  const auto* meta = torch::autograd::impl::get_autograd_meta(param);
  const std::optional<at::ScalarType> dtype =
      meta != nullptr ? meta->grad_dtype(param) : std::optional(param.scalar_type());
  return dtype.has_value() && value.scalar_type() != *dtype ? value.to(*dtype) : std::move(value);
}
}  // namespace

at::Tensor as_contribution(const at::Tensor& param, at::Tensor value) {
  return value.scalar_type() == param.scalar_type() ? as_grad_dtype(param, std::move(value))
                                                    : std::move(value);
}

namespace {
// Adds `value` to `param`'s .grad with AccumulateGrad's arithmetic: without a .grad, the value
// becomes it (cast to the gradient's dtype, laid out as the parameter); else the value is added in
// place (a sparse .grad, left by a sparse nn.Embedding tied to the layer, becomes the dense sum).
void add_to_grad(const at::Tensor& param, at::Tensor value) {
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    value = as_grad_dtype(param, std::move(value));
    grad = value.strides() == param.strides()
               ? value
               : at::empty_like(param, value.options().memory_format(at::MemoryFormat::Preserve))
                     .copy_(value);
    return;
  }
  if (grad.layout() != at::kStrided) {  // AccumulateGrad's new + old: dense, the dtypes promoted
    grad = value + grad;
    return;
  }
  grad.add_(value);
}

// The bytes a non-empty strided tensor spans in memory: [first byte, last byte + 1).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  int64_t last = 0;  // the last element's offset from the first, in elements
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// Whether any two of `tensors` overlap in memory (byte ranges of their storages' spans).
bool shares_memory(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  spans.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 0) spans.push_back(byte_span(t));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

std::optional<at::Tensor> optional_if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
}  // namespace

c10::Stream current_stream_of(const at::Tensor& t) {
  const c10::Device device = t.device();
  if (device.is_cpu()) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

namespace {
std::function<void(const at::Tensor&)> main_grad_accumulated_callback() {
  std::lock_guard<std::mutex> lock(main_grad_callback().mutex);
  return main_grad_callback().callback;
}

// Tells the callback set by set_main_grad_accumulated_callback(), if any, of each of `sinks`'
// parameters with a main_grad (after an accumulate, with the locks released: the callback may take
// others, the GIL).
void notify_main_grads_accumulated(const std::vector<WgradSinks>& sinks) {
  const auto callback = main_grad_accumulated_callback();  // read once for all sinks
  if (!callback) return;
  for (const WgradSinks& sink : sinks) {
    if (sink.weight.defined() && sink.weight_main_grad.defined()) callback(sink.weight);
    if (sink.bias.defined() && sink.bias_main_grad.defined()) callback(sink.bias);
  }
}
}  // namespace

namespace {
std::atomic<MainGradSource>& main_grad_source() {
  static std::atomic<MainGradSource> source{nullptr};
  return source;
}
}  // namespace

void set_main_grad_source(MainGradSource source) {
  main_grad_source().store(source, std::memory_order_release);
}

std::vector<at::Tensor> main_grads_for_backward(const std::vector<at::Tensor>& params) {
  if (const auto source = main_grad_source().load(std::memory_order_acquire)) {
    return source(params);
  }
  std::vector<at::Tensor> buffers(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].defined()) buffers[i] = splitgrad::main_grad(params[i]);
  }
  return buffers;
}

void read_main_grads(Who who, std::vector<WgradSinks>& sinks, bool numbered,
                     const std::string& gemm) {
  std::vector<at::Tensor> params;
  params.reserve(2 * sinks.size());
  for (const WgradSinks& sink : sinks) {
    params.push_back(sink.weight);
    params.push_back(sink.bias);
  }
  const std::vector<at::Tensor> buffers = main_grads_for_backward(params);
  TORCH_INTERNAL_ASSERT(buffers.size() == params.size(), "the main_grad source returned ",
                        buffers.size(), " tensors for ", params.size(), " parameters");
  for (size_t i = 0; i < sinks.size(); ++i) {
    auto name = [&](const char* kind) {
      return numbered       ? c10::str(kind, i)
             : gemm.empty() ? std::string(kind)
                            : c10::str(gemm, "_", kind);
    };
    if (sinks[i].weight.defined()) {
      check_main_grad(who, name("weight"), buffers[2 * i], sinks[i].weight);
      sinks[i].weight_main_grad = buffers[2 * i];
    }
    if (sinks[i].bias.defined() && buffers[2 * i + 1].defined()) {
      check_main_grad(who, name("bias"), buffers[2 * i + 1], sinks[i].bias);
      sinks[i].bias_main_grad = buffers[2 * i + 1];
    }
  }
}

namespace {
std::atomic<std::shared_ptr<void> (*)()>& reference_batch_hook() {
  static std::atomic<std::shared_ptr<void> (*)()> hook{nullptr};
  return hook;
}
}  // namespace

void set_reference_batch_hook(std::shared_ptr<void> (*hook)()) {
  reference_batch_hook().store(hook, std::memory_order_release);
}

namespace {
thread_local int reference_batch_depth = 0;  // the ReferenceBatch scopes open on this thread
}  // namespace

ReferenceBatch::ReferenceBatch() {
  if (const auto hook = reference_batch_hook().load(std::memory_order_acquire)) held_ = hook();
  ++reference_batch_depth;
}

ReferenceBatch::~ReferenceBatch() { --reference_batch_depth; }

bool ReferenceBatch::active() { return reference_batch_depth > 0; }

ReferenceBatch::Reentry::Reentry() : saved_depth_(reference_batch_depth) {
  reference_batch_depth = 0;
}

ReferenceBatch::Reentry::~Reentry() { reference_batch_depth = saved_depth_; }

void accumulate_wgrad(const at::Tensor& grad_output, const at::Tensor& input,
                      const WgradSinks& sinks, const GradWriteLocks& /*locked*/) {
  // A .grad made here must outlive inference mode; InferenceMode(false) also turns grad mode on,
  // so the NoGradGuard comes after it.
  c10::InferenceMode not_inference(false);
  at::NoGradGuard no_grad;
  // A .grad gets autograd's own arithmetic: the gradient is computed on its own (rounded to the
  // inputs' dtype) and then stored or added, as AccumulateGrad does, so the deferred path is
  // bit-identical to the immediate one. The exception, in place with the same rounding: a bias
  // .grad of the inputs' dtype (the bias kernel rounds the sum before adding, as add_ does).
  // A main_grad is accumulated in place: dW inside the GEMM in fp32 (beta = 1, no temporary).
  const bool weight_to_grad = sinks.weight.defined() && !sinks.weight_main_grad.defined();
  const at::Tensor bias_grad = sinks.bias.defined() ? sinks.bias.grad() : at::Tensor();
  const bool bias_in_place =
      sinks.bias.defined() && (sinks.bias_main_grad.defined() ||
                               (bias_grad.defined() && bias_grad.layout() == at::kStrided &&
                                bias_grad.scalar_type() == grad_output.scalar_type()));
  const bool bias_value = sinks.bias.defined() && !bias_in_place;
  if (weight_to_grad) {
    auto [weight_grad, db] = ops::linear_wgrad(grad_output, input, bias_value);
    add_to_grad(sinks.weight, weight_grad);
    if (bias_value) add_to_grad(sinks.bias, db);
  } else if (bias_value) {  // the bias kernel's sum on its own: 0 + round(Σ dy) = round(Σ dy)
    at::Tensor db = at::zeros({sinks.bias.size(0)}, grad_output.options());
    ops::linear_wgrad_accumulate_(grad_output, input, std::nullopt, db);
    add_to_grad(sinks.bias, db);
  }
  const at::Tensor weight_sink =
      sinks.weight.defined() && !weight_to_grad ? sinks.weight_main_grad : at::Tensor();
  const at::Tensor bias_sink = !bias_in_place                   ? at::Tensor()
                               : sinks.bias_main_grad.defined() ? sinks.bias_main_grad
                                                                : bias_grad;
  if (weight_sink.defined() || bias_sink.defined()) {
    ops::linear_wgrad_accumulate_(grad_output, input, optional_if_defined(weight_sink),
                                  optional_if_defined(bias_sink));
  }
}

void accumulate_grouped_wgrad(const at::Tensor& grad_output, const at::Tensor& input,
                              const at::Tensor& m_splits, const std::vector<WgradSinks>& sinks,
                              const GradWriteLocks& /*locked*/) {
  // accumulate_wgrad's rules, per group; the products of all groups come from at most two grouped
  // ops (one making fresh gradients for .grad, one adding in place), so a grouped kernel serves
  // them all at once.
  c10::InferenceMode not_inference(false);
  at::NoGradGuard no_grad;
  const size_t groups = sinks.size();
  std::vector<char> weight_to_grad(groups), bias_in_place(groups), bias_value(groups);
  bool any_weight_to_grad = false, any_bias_value = false;
  for (size_t i = 0; i < groups; ++i) {
    weight_to_grad[i] = sinks[i].weight.defined() && !sinks[i].weight_main_grad.defined();
    any_weight_to_grad |= static_cast<bool>(weight_to_grad[i]);
  }
  // Where the weights' fresh gradients are made anyway, a bias whose gradient goes to its .grad
  // comes from the same op and is added with them (one op, not a second one in place).
  // Otherwise a .grad of the gradient's dtype takes the bias kernel in place, unless its memory
  // is another group's bias .grad too (a bias tied across experts, or one tensor set as the
  // .grad of two biases): those get their values summed, or added one by one, in reverse group
  // order as autograd does (below), not in the kernel's group order.
  std::vector<char> bias_grad_shared(groups, 0);
  if (!any_weight_to_grad) {
    struct Span {
      uintptr_t begin, end;
      size_t group;
    };
    std::vector<Span> spans;
    for (size_t i = 0; i < groups; ++i) {
      if (!sinks[i].bias.defined() || sinks[i].bias_main_grad.defined()) continue;
      const at::Tensor& grad = sinks[i].bias.grad();
      if (!grad.defined() || grad.layout() != at::kStrided || grad.numel() == 0) continue;
      const auto [begin, end] = byte_span(grad);
      spans.push_back({begin, end, i});
    }
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.begin < b.begin; });
    // A sweep: each span that starts before the furthest end so far overlaps the span that
    // reaches it, and both are marked.
    for (size_t k = 1, furthest = 0; k < spans.size(); ++k) {
      if (spans[k].begin < spans[furthest].end) {
        bias_grad_shared[spans[k].group] = 1;
        bias_grad_shared[spans[furthest].group] = 1;
      }
      if (spans[k].end > spans[furthest].end) furthest = k;
    }
  }
  c10::List<std::optional<at::Tensor>> weight_targets, bias_targets;
  weight_targets.reserve(groups);
  bias_targets.reserve(groups);
  for (size_t i = 0; i < groups; ++i) {
    const WgradSinks& sink = sinks[i];
    const at::Tensor bias_grad =
        !any_weight_to_grad && sink.bias.defined() && !sink.bias_main_grad.defined()
            ? sink.bias.grad()
            : at::Tensor();
    bias_in_place[i] =
        sink.bias.defined() &&
        (sink.bias_main_grad.defined() ||
         (bias_grad.defined() && bias_grad.layout() == at::kStrided &&
          bias_grad.scalar_type() == grad_output.scalar_type() && !bias_grad_shared[i]));
    bias_value[i] = sink.bias.defined() && !bias_in_place[i];
    any_bias_value |= static_cast<bool>(bias_value[i]);
    weight_targets.push_back(sink.weight.defined() && !weight_to_grad[i]
                                 ? std::optional<at::Tensor>(sink.weight_main_grad)
                                 : std::nullopt);
    bias_targets.push_back(!bias_in_place[i]               ? std::nullopt
                           : sink.bias_main_grad.defined() ? std::optional(sink.bias_main_grad)
                                                           : std::optional(bias_grad));
  }
  std::vector<at::Tensor> fresh_weight, fresh_bias;
  {
    // Grad mode is off: the grouped op, and the ATen ops it runs per group, skip the autograd
    // kernels (and the boxed autograd fallback of the op itself). Version counters still move.
    at::AutoDispatchBelowAutograd below_autograd;
    if (any_weight_to_grad) {
      std::tie(fresh_weight, fresh_bias) =
          ops::grouped_linear_wgrad(grad_output, input, m_splits, any_bias_value);
    } else if (any_bias_value) {  // the bias kernel's sums on their own, as accumulate_wgrad
      for (size_t i = 0; i < groups; ++i) {
        fresh_bias.push_back(bias_value[i]
                                 ? at::zeros({sinks[i].bias.size(0)}, grad_output.options())
                                 : at::Tensor());
        if (bias_value[i]) bias_targets.set(i, fresh_bias[i]);
      }
    }
    const bool any_in_place =
        std::any_of(weight_targets.begin(), weight_targets.end(),
                    [](const std::optional<at::Tensor>& t) { return t.has_value(); }) ||
        std::any_of(bias_targets.begin(), bias_targets.end(),
                    [](const std::optional<at::Tensor>& t) { return t.has_value(); });
    if (any_in_place) {
      ops::grouped_linear_wgrad_accumulate_(grad_output, input, m_splits, weight_targets,
                                            bias_targets);
    }
  }
  // Each parameter's values of this item are summed first where several groups reach it (tied
  // experts), in reverse group order (the order the per-expert reference's backward reaches
  // them), so that its .grad gets one add, as AccumulateGrad gets the pass's sum:
  // old + (v1 + v3). Then .grads already there get their sums with add_'s arithmetic, those
  // that cannot fail in one multi-tensor add (one launch, not one per parameter).
  std::vector<const at::Tensor*> params_to_grad;
  std::vector<at::Tensor> sums;
  params_to_grad.reserve(2 * groups);
  sums.reserve(2 * groups);
  for (size_t i = groups; i-- > 0;) {
    if (weight_to_grad[i]) {
      params_to_grad.push_back(&sinks[i].weight);
      sums.push_back(std::move(fresh_weight[i]));
    }
    if (bias_value[i]) {
      params_to_grad.push_back(&sinks[i].bias);
      sums.push_back(std::move(fresh_bias[i]));
    }
  }
  // Tied experts, from the parameters sorted with their positions (plain pairs: sorting the
  // tensors, or a hash map, costs more host time for a few dozen experts): each tied
  // parameter's values are summed in position order (each as_contribution, as autograd sums
  // them) into its last position (its lowest group: per-expert autograd's AccumulateGrad runs
  // after that expert's backward, the last to reach it), and the other positions dropped. That
  // order matters where .grads share memory (added one by one).
  std::vector<std::pair<const c10::TensorImpl*, size_t>> order;
  order.reserve(params_to_grad.size());
  for (size_t p = 0; p < params_to_grad.size(); ++p) {
    order.emplace_back(params_to_grad[p]->unsafeGetTensorImpl(), p);
  }
  std::sort(order.begin(), order.end());
  const auto same_param = [](const auto& a, const auto& b) { return a.first == b.first; };
  if (std::adjacent_find(order.begin(), order.end(), same_param) != order.end()) {
    std::vector<char> merged(params_to_grad.size(), 0);
    for (size_t k = 0, end = 0; k < order.size(); k = end) {
      for (end = k + 1; end < order.size() && order[end].first == order[k].first;) ++end;
      if (end - k == 1) continue;
      const at::Tensor& param = *params_to_grad[order[k].second];
      at::Tensor sum = as_contribution(param, std::move(sums[order[k].second]));
      for (size_t j = k + 1; j < end; ++j) {
        sum = sum + as_contribution(param, std::move(sums[order[j].second]));
        merged[order[j - 1].second] = 1;
      }
      sums[order[end - 1].second] = std::move(sum);
    }
    size_t kept = 0;
    for (size_t p = 0; p < params_to_grad.size(); ++p) {
      if (merged[p]) continue;
      params_to_grad[kept] = params_to_grad[p];
      sums[kept] = std::move(sums[p]);
      ++kept;
    }
    params_to_grad.resize(kept);
    sums.resize(kept);
  }
  // Three kinds, in this order, so that an add that fails (an inference-tensor or expanded
  // .grad) comes before anything is written: .grads the multi-tensor add might fail on (or
  // of another dtype) one at a time, then parameters without a .grad (it becomes the value),
  // then the rest in one multi-tensor add.
  std::vector<at::Tensor> grads, values;
  std::vector<size_t> fresh;
  grads.reserve(params_to_grad.size());
  values.reserve(params_to_grad.size());
  fresh.reserve(params_to_grad.size());
  for (size_t p = 0; p < params_to_grad.size(); ++p) {
    const at::Tensor& grad = params_to_grad[p]->mutable_grad();
    if (!grad.defined()) {
      fresh.push_back(p);
    } else if (grad.layout() == at::kStrided && grad.is_non_overlapping_and_dense() &&
               !grad.is_inference() && grad.scalar_type() == sums[p].scalar_type() &&
               grad.device() == sums[p].device()) {
      grads.push_back(grad);
      values.push_back(std::move(sums[p]));
    } else {
      add_to_grad(*params_to_grad[p], std::move(sums[p]));
    }
  }
  for (const size_t p : fresh) add_to_grad(*params_to_grad[p], std::move(sums[p]));
  // One launch writes every .grad at once: two .grads sharing memory (one tensor set as the
  // .grad of two parameters) would race there, so those go one at a time.
  if (shares_memory(grads)) {
    for (size_t i = 0; i < grads.size(); ++i) grads[i].add_(values[i]);
  } else if (!grads.empty()) {
    at::_foreach_add_(grads, values);
  }
}

void check_registered_if_delayed(Who who, bool delay, core::LayerId layer) {
  TORCH_CHECK_VALUE(!delay || WgradStore::instance().is_registered(layer), who(),
                    ": delay_wgrad_compute=True needs a layer registered with the deferred-wgrad "
                    "store (layer_id ",
                    layer, " is not)");
}

void check_no_fused_double_backward(Who who, bool fused_gradient_wanted) {
  TORCH_CHECK(!fused_gradient_wanted, who(),
              ": fuse_wgrad_accumulation=True cannot take a backward with create_graph=True "
              "(double backward): main_grad is not differentiable. Build the layer with "
              "fuse_wgrad_accumulation=False for higher-order gradients.");
}

namespace {
struct SecondOrderWeightGradRefused
    : public torch::autograd::Function<SecondOrderWeightGradRefused> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight,
                            std::string who) {
    ctx->saved_data["who"] = std::move(who);
    return weight.alias();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list /*grads*/) {
    TORCH_CHECK(false, ctx->saved_data["who"].toStringRef(),
                ": a gradient reached the weight through the input gradient of a backward with "
                "create_graph=True (a gradient penalty, double backward), and "
                "fuse_wgrad_accumulation=True cannot take it: main_grad is not differentiable. "
                "Build the layer with fuse_wgrad_accumulation=False for higher-order gradients.");
  }
};
}  // namespace

at::Tensor refuse_second_order_weight_grad(Who who, const at::Tensor& weight) {
  if (!weight.requires_grad()) return weight;
  return SecondOrderWeightGradRefused::apply(weight, who());
}

bool is_traced(const at::Tensor& t) {
  return t.is_meta() || t.key_set().has(c10::DispatchKey::Functionalize) ||
         t.key_set().has(c10::DispatchKey::Python);
}

void note_layer_forward(core::LayerId layer, const at::Tensor& input) {
  if (layer > 0 && is_traced(input)) WgradStore::instance().note_ran_untracked(layer);
}

void note_layer_backward(core::LayerId layer) {
  auto& ledger = GradLedger::instance();
  if (layer <= 0 || !ledger.hooks_registered()) return;  // nobody to tell
  PassScope pass;
  ledger.note_layer_ran(pass.id(), layer);
}

bool defers_wgrad(bool delay, core::LayerId layer) {
  return delay && WgradStore::instance().is_registered(layer);
}

namespace {
// Whether anomaly detection with check_nan is on (torch.autograd.set_detect_anomaly(True)).
bool anomaly_checks_nan() {
  return torch::autograd::AnomalyMode::is_enabled() &&
         torch::autograd::AnomalyMode::should_check_nan();
}

// The first .grad of `sinks`' parameters that cannot take an in-place add, as AccumulateGrad's
// would fail on it (an inference tensor, an expanded one): "the .grad of bias1: it is an
// inference tensor ..." ("bias1" with `numbered`, else "bias"), or "" if none.
std::string unwritable_grad(const std::vector<WgradSinks>& sinks, bool numbered) {
  for (size_t i = 0; i < sinks.size(); ++i) {
    const WgradSinks& sink = sinks[i];
    for (const bool is_weight : {true, false}) {
      const at::Tensor& param = is_weight ? sink.weight : sink.bias;
      const at::Tensor& main_grad = is_weight ? sink.weight_main_grad : sink.bias_main_grad;
      if (!param.defined() || main_grad.defined()) continue;  // a main_grad is written, not .grad
      const at::Tensor grad = param.grad();
      if (!grad.defined() || grad.layout() != at::kStrided) continue;  // sparse: made dense anew
      std::string why;
      if (grad.is_inference()) {
        why =
            "it is an inference tensor (set under torch.inference_mode), which cannot be "
            "updated in place outside it";
      } else if (at::has_internal_overlap(grad) == at::MemOverlap::Yes) {
        why = c10::str("elements of it share memory (an expanded tensor, strides ", grad.strides(),
                       "), so it cannot be added to in place");
      } else {
        continue;
      }
      return c10::str("the .grad of ", is_weight ? "weight" : "bias",
                      numbered ? std::to_string(i) : "", ": ", why);
    }
  }
  return "";
}

// The gradient buffers a write to `sinks` may change, as they were before it (a copy of each
// main_grad, each .grad object and a copy of its values): to find a nan the write brought and to
// put the buffers back then, as anomaly detection stops plain autograd before its AccumulateGrad
// adds such a gradient.
class BuffersBefore {
 public:
  explicit BuffersBefore(const std::vector<WgradSinks>& sinks) {
    for (size_t i = 0; i < sinks.size(); ++i) {
      keep(sinks[i].weight, sinks[i].weight_main_grad, "weight", i);
      keep(sinks[i].bias, sinks[i].bias_main_grad, "bias", i);
    }
  }

  // The first buffer now holding a nan in an entry that was finite before (or in any entry, for
  // a .grad that was None), e.g. "weight2's main_grad" ("weight2" with `numbered`), or "" if none.
  // A finite value plus a gradient is nan only where the gradient is; where the buffer held a nan
  // or an infinity (-inf + inf is nan), the sum cannot tell, so no nan is blamed there.
  std::string brought_nan(bool numbered) const {
    for (const Buffer& buffer : buffers_) {
      const auto dense = [](const at::Tensor& t) {
        return t.layout() == at::kStrided ? t : t.to_dense();
      };
      at::Tensor now = buffer.main_grad.defined() ? buffer.main_grad : buffer.param.grad();
      if (!now.defined()) continue;
      at::Tensor fresh = at::isnan(dense(now));
      if (buffer.values.defined()) fresh.logical_and_(at::isfinite(dense(buffer.values)));
      if (!fresh.any().item<bool>()) continue;
      return c10::str(buffer.name, numbered ? std::to_string(buffer.group) : "", "'s ",
                      buffer.main_grad.defined() ? "main_grad" : ".grad");
    }
    return std::string();
  }

  void put_back() const {
    for (const Buffer& buffer : buffers_) {
      if (buffer.main_grad.defined()) {
        buffer.main_grad.copy_(buffer.values);
        continue;
      }
      // A strided .grad was added to in place; a sparse one was replaced by the dense sum.
      if (buffer.grad.defined() && buffer.grad.layout() == at::kStrided) {
        buffer.grad.copy_(buffer.values);
      }
      buffer.param.mutable_grad() = buffer.grad;  // undefined again where it was
    }
  }

 private:
  struct Buffer {
    at::Tensor param, main_grad, grad, values;
    const char* name;
    size_t group;
  };

  void keep(const at::Tensor& param, const at::Tensor& main_grad, const char* name, size_t group) {
    if (!param.defined()) return;  // freed: nothing is written
    Buffer buffer{param, main_grad, main_grad.defined() ? at::Tensor() : param.grad(),
                  {},    name,      group};
    const at::Tensor& written = main_grad.defined() ? main_grad : buffer.grad;
    if (written.defined()) buffer.values = written.clone();
    buffers_.push_back(std::move(buffer));
  }

  std::vector<Buffer> buffers_;
};

// Adds one GEMM's weight and bias gradients to `sinks`, the same way on the fused path and in
// backward_dw(): under one hold of their GradWriteLocks, `check_writable` (throws before anything
// is written), then `accumulate`, with the anomaly check where `check_nan` (a nan the write brings
// is reported, and the buffers put back as they were); the main_grad callback after the unlock,
// where the gradients landed. Returns the nan message ("" if none) for the caller to raise once
// it has settled its own state; `what` names the writer in it.
std::string add_to_sinks(core::LayerId layer, const std::string& gemm,
                         const std::vector<WgradSinks>& sinks, bool numbered, bool check_nan,
                         const char* what, c10::function_ref<void()> check_writable,
                         c10::function_ref<void(const GradWriteLocks&)> accumulate) {
  std::string nan;
  {
    const GradWriteLocks locked(sinks);
    check_writable();
    if (!check_nan) {
      accumulate(locked);
    } else {
      const BuffersBefore before(sinks);
      accumulate(locked);
      const std::string where = before.brought_nan(numbered);
      if (!where.empty()) {
        before.put_back();
        nan = c10::str(layer_label(layer, gemm), ": ", what, " brought nan values into ", where,
                       " (anomaly detection with check_nan=True, which plain autograd reports as "
                       "a backward Function that \"returned nan values\"). None of this GEMM's "
                       "weight and bias gradients was added: every .grad and main_grad it writes "
                       "holds its value from before, as autograd raises before accumulating.");
      }
    }
  }
  if (nan.empty()) notify_main_grads_accumulated(sinks);
  return nan;
}
}  // namespace

void accumulate_or_defer(core::LayerId layer, bool delay, const at::Tensor& grad_output,
                         const at::Tensor& input, const at::Tensor& m_splits,
                         const std::vector<WgradSinks>& sinks, const char* module,
                         const std::string& input_activation, const std::string& gemm) {
  const bool grouped = m_splits.defined();
  TORCH_INTERNAL_ASSERT(input_activation.empty() || (delay && !grouped),
                        "an input activation is recomputed by deferred linear work only");
  if (delay && !WgradStore::instance().is_registered(layer)) {
    // Deleted since the backward's defers_wgrad() (by another thread): nothing could run the
    // item, so the gradients are added at once, as for a layer deleted before its backward.
    const at::Tensor gemm_input =
        input_activation.empty() ? input : ops::activation(input, input_activation);
    accumulate_or_defer(layer, false, grad_output, gemm_input, m_splits, sinks, module);
    return;
  }
  DeferredWgrad item;
  item.layer = layer;
  if (grouped) {
    for (const auto& sink : sinks) {
      item.groups.push_back({core::weak_ref(sink.weight), core::weak_ref(sink.bias),
                             sink.weight_main_grad, sink.bias_main_grad});
    }
  } else {
    TORCH_INTERNAL_ASSERT(sinks.size() == 1, "a linear application has one sink");
    item.weight = core::weak_ref(sinks[0].weight);
    item.bias = core::weak_ref(sinks[0].bias);
    item.weight_main_grad = sinks[0].weight_main_grad;
    item.bias_main_grad = sinks[0].bias_main_grad;
  }
  PassScope pass;
  item.pass = pass.id();
  auto& ledger = GradLedger::instance();
  if (!delay) {  // regular and fused: straight into main_grad, nothing for autograd to add
    ledger.note_autograd_contribution(item.targets(), pass.id());
    const ReferenceBatch::Reentry reentry;
    const std::string nan = add_to_sinks(
        layer, gemm, sinks, grouped, anomaly_checks_nan(), "the fused weight gradient",
        [&] {
          // As on the deferred path: a .grad that cannot be added to stops the layer before it
          // writes anything (a main_grad, another expert's .grad), where autograd's add would
          // fail midway.
          const std::string unwritable = unwritable_grad(sinks, grouped);
          TORCH_CHECK(unwritable.empty(), layer_label(layer, gemm),
                      ": the fused weight gradient cannot add to ", unwritable,
                      ". None of this GEMM's weight and bias gradients was written. Set a .grad "
                      "of its own, made outside inference mode (p.grad = p.grad.clone()).");
        },
        [&](const GradWriteLocks& locked) {
          if (grouped) {
            accumulate_grouped_wgrad(grad_output, input, m_splits, sinks, locked);
          } else {
            accumulate_wgrad(grad_output, input, sinks[0], locked);
          }
        });
    TORCH_CHECK(nan.empty(), nan);
    return;
  }
  // A store filled inside a traced backward (torch.compile's AOTAutograd traces with fake and
  // functional tensors, Python-dispatched subclasses) would hold placeholders, not data.
  TORCH_CHECK(!is_traced(input) && !is_traced(grad_output) && !(grouped && is_traced(m_splits)),
              layer_label(layer),
              ": delay_wgrad_compute=True cannot queue deferred work inside a traced graph "
              "(torch.compile / AOTAutograd): the stashed tensors would be tracing placeholders. ",
              module, " runs delayed layers outside compiled graphs; call the op eagerly.");
  // The item needs the values only: a tensor with autograd history is kept detached (the version
  // counter shared), or it would keep the upstream graph's nodes, and the parameters their
  // contexts hold, alive until backward_dw(). Others are kept as they are, as autograd saves an
  // input: the caller's tensor lives exactly until its deferred work has run.
  const auto values_of = [](const at::Tensor& t) { return t.grad_fn() ? t.detach() : t; };
  item.input = values_of(input);
  item.input_activation = input_activation;
  item.gemm = gemm;
  item.grad_output = values_of(grad_output);
  item.input_version = input._version();
  item.grad_output_version = grad_output._version();
  if (grouped) {
    item.m_splits = m_splits;
    item.m_splits_version = m_splits._version();
  }
  item.stream = current_stream_of(input);
  item.check_nan = anomaly_checks_nan();
  if (const auto device = input.device().type(); at::autocast::is_autocast_available(device)) {
    item.autocast_enabled = at::autocast::is_autocast_enabled(device);
    item.autocast_dtype = at::autocast::get_autocast_dtype(device);
  }
  ledger.expect_deferred(item.targets(), pass.id());
  WgradStore::instance().push(std::move(item));
}

}  // namespace detail

namespace {

// Why an item can no longer run (a stashed tensor changed in place), or "" if it can.
std::string stale_reason(const DeferredWgrad& item) {
  auto check = [&](const at::Tensor& t, uint32_t saved, const char* what) -> std::string {
    const uint32_t now = t._version();
    if (now == saved) return "";
    // The weight's shape tells a module's GEMMs apart (a LayerNormMLP's fc1 from its fc2).
    const at::Tensor weight(item.weight.lock());
    const std::string for_weight =
        weight.defined() ? c10::str(", for the weight of shape ", weight.sizes(), ",") : "";
    return c10::str(detail::layer_label(item.layer, item.gemm), ": the ", what,
                    " stashed for its deferred weight gradient was modified in place after the "
                    "backward pass that queued it (its version is now ",
                    now, "; ", saved, " was stashed). That item", for_weight,
                    " was dropped and no gradient was written for it; the grad-ready hooks of its "
                    "parameters do not fire for that backward pass (their gradient of it is "
                    "incomplete). Run backward_dw() before modifying the tensor, or modify a "
                    "clone.");
  };
  // With an input activation the stash is the activation's input (a LayerNormMLP's fc2 keeps
  // fc1's output): say so, naming the activation, so the message points at the right GEMM.
  std::string reason;
  if (item.input._version() != item.input_version) {
    const std::string input_name =
        item.input_activation.empty()
            ? std::string("input")
            : c10::str("input of its activation \"", item.input_activation,
                       "\" (in a LayerNormMLP: fc2's, fc1's output)");
    reason = check(item.input, item.input_version, input_name.c_str());
  }
  if (reason.empty()) reason = check(item.grad_output, item.grad_output_version, "grad_output");
  if (reason.empty() && item.m_splits.defined()) {
    reason = check(item.m_splits, item.m_splits_version, "m_splits");
  }
  return reason;
}

// The deferred work taken off the store and not yet landed, by the call that runs it. Other
// threads see it: backward_dw_all() waits for batches feeding its parameters, a layer's
// backward_dw() waits for its layer's work another thread took, and the pending counts include
// it, so no guard passes on gradients still being computed. Leaked (see main_grad_callback).
class InFlight {
 public:
  static InFlight& instance() {
    static auto* state = new InFlight();
    return *state;
  }

  // What a call that found nothing of its own to run waits for: other threads' batches holding
  // work of `layer` (of `pass` too, when set).
  struct LayerWork {
    core::LayerId layer = 0;
    std::optional<core::PassId> pass;
  };

  // Takes items with `take` and registers them as one batch of this thread, atomically (no
  // waiter can miss them between the two). When `take` finds nothing and `work` names a layer,
  // fills `others` with the batches of other threads holding that work, in the same critical
  // section (so work that lands meanwhile is not mistaken for work never queued). Returns the
  // batch id (0: nothing taken).
  template <class Take>
  uint64_t take(Take&& take, std::vector<DeferredWgrad>& items, LayerWork work = {},
                std::vector<uint64_t>* others = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    items = take();
    if (items.empty()) {
      if (others != nullptr) *others = others_locked(work);
      return 0;
    }
    Batch batch{std::this_thread::get_id(), {}};
    batch.entries.reserve(items.size());
    for (const auto& item : items) {
      Entry entry{item.layer, item.pass, {}, false};
      entry.targets.reserve(2 + 2 * item.groups.size());
      for (const auto* target : {&item.weight, &item.bias})
        entry.targets.push_back(target->_unsafe_get_target());
      for (const auto& group : item.groups) {
        entry.targets.push_back(group.weight._unsafe_get_target());
        entry.targets.push_back(group.bias._unsafe_get_target());
      }
      batch.entries.push_back(std::move(entry));
    }
    in_flight_ += items.size();
    const uint64_t id = next_batch_++;
    batches_.emplace(id, std::move(batch));
    return id;
  }

  // Item `index` of `batch` has landed (or went back to the store, or was dropped): it no longer
  // counts as pending.
  void settled(uint64_t batch, size_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = batches_.find(batch);
    if (it == batches_.end() || index >= it->second.entries.size()) return;
    settle_locked(it->second.entries[index]);
  }

  // Puts items of `batch` back on the store (`indices`: their places in the batch), atomically
  // with their leaving the batch.
  // Returns the items of layers released meanwhile (WgradStore::restore), for the caller to
  // drop once no lock is held.
  [[nodiscard]] std::vector<DeferredWgrad> restore(uint64_t batch,
                                                   const std::vector<size_t>& indices,
                                                   std::vector<DeferredWgrad> items) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = batches_.find(batch);
    if (it != batches_.end()) {
      for (size_t index : indices) {
        if (index < it->second.entries.size()) settle_locked(it->second.entries[index]);
      }
    }
    return WgradStore::instance().restore(std::move(items));
  }

  void finish(uint64_t batch) {
    if (batch == 0) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = batches_.find(batch);
      if (it == batches_.end()) return;
      for (auto& entry : it->second.entries) settle_locked(entry);
      batches_.erase(it);
    }
    landed_.notify_all();
  }

  // Batches of other threads in flight now that feed one of `params` (any, when empty).
  std::vector<uint64_t> others(const std::vector<at::Tensor>& params) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<uint64_t> out;
    for (const auto& [id, batch] : batches_) {
      if (batch.thread == std::this_thread::get_id()) continue;  // ours: waiting would deadlock
      const bool feeding = std::any_of(batch.entries.begin(), batch.entries.end(),
                                       [&](const Entry& entry) { return feeds(entry, params); });
      if (feeding) out.push_back(id);
    }
    return out;
  }

  void wait_for(const std::vector<uint64_t>& ids) {
    std::unique_lock<std::mutex> lock(mutex_);
    landed_.wait(lock, [&] {
      return std::none_of(ids.begin(), ids.end(), [&](uint64_t id) { return batches_.count(id); });
    });
  }

  // Whether this thread has work of `layer` in flight (a hook calling backward_dw() from inside
  // a backward_dw_all()): for the message of a call that finds nothing.
  bool this_thread_runs(core::LayerId layer) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, batch] : batches_) {
      if (batch.thread != std::this_thread::get_id()) continue;
      for (const auto& entry : batch.entries) {
        if (!entry.settled && entry.layer == layer) return true;
      }
    }
    return false;
  }

  // Items queued or in flight, in all layers or in one. Read under this class's mutex, which
  // every take holds, so an item moving from the store to a batch is counted exactly once.
  size_t pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return WgradStore::instance().pending() + in_flight_;
  }
  size_t pending(core::LayerId layer) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t count = WgradStore::instance().pending(layer);
    for (const auto& [id, batch] : batches_) {
      for (const auto& entry : batch.entries) count += !entry.settled && entry.layer == layer;
    }
    return count;
  }

  // Layers with work queued or in flight (feeding one of `params`, when non-empty), in
  // registration order.
  std::vector<core::LayerId> layers_with_pending(const std::vector<at::Tensor>& params) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<core::LayerId> layers = WgradStore::instance().layers_with_pending(params);
    for (const auto& [id, batch] : batches_) {
      for (const auto& entry : batch.entries) {
        if (entry.settled || !feeds(entry, params)) continue;
        if (std::find(layers.begin(), layers.end(), entry.layer) == layers.end())
          layers.push_back(entry.layer);
      }
    }
    std::sort(layers.begin(), layers.end());  // ids are issued in registration order
    return layers;
  }

 private:
  struct Entry {
    core::LayerId layer;
    core::PassId pass;
    std::vector<const c10::TensorImpl*> targets;
    bool settled;
  };
  struct Batch {
    std::thread::id thread;
    std::vector<Entry> entries;
  };

  void settle_locked(Entry& entry) {
    if (entry.settled) return;
    entry.settled = true;
    in_flight_ -= 1;
  }

  static bool feeds(const Entry& entry, const std::vector<at::Tensor>& params) {
    if (params.empty()) return true;
    for (const auto& param : params) {
      if (std::find(entry.targets.begin(), entry.targets.end(), param.unsafeGetTensorImpl()) !=
          entry.targets.end())
        return true;
    }
    return false;
  }

  std::vector<uint64_t> others_locked(LayerWork work) const {
    std::vector<uint64_t> out;
    if (work.layer == 0) return out;
    for (const auto& [id, batch] : batches_) {
      if (batch.thread == std::this_thread::get_id()) continue;
      for (const auto& entry : batch.entries) {
        if (!entry.settled && entry.layer == work.layer &&
            (!work.pass || entry.pass == *work.pass)) {
          out.push_back(id);
          break;
        }
      }
    }
    return out;
  }

  std::mutex mutex_;
  std::condition_variable landed_;
  uint64_t next_batch_ = 1;
  size_t in_flight_ = 0;  // entries of all batches not yet settled
  std::map<uint64_t, Batch> batches_;
};

// Ends a batch when its run() is over, however it ends.
struct BatchScope {
  uint64_t id;
  ~BatchScope() { InFlight::instance().finish(id); }
};

// An item run on a stream other than the one that queued it: its kernels were only enqueued, so
// the stashed tensors, about to be released, must not go back to the allocator (and to the
// queuing stream's next allocation) before that stream has read them — as record_stream does
// for any tensor used on a side stream. On the queuing stream, stream order already protects
// them.
void keep_until_read(const DeferredWgrad& item) {
  if (item.stream.device().is_cpu()) return;
  const c10::Stream now = detail::current_stream_of(item.input);
  if (now == item.stream) return;
  for (const at::Tensor* t : {&item.input, &item.grad_output, &item.m_splits}) {
    if (t->defined() && t->device() == now.device()) t->record_stream(now);
  }
}

// Autocast's state for an item's device set to what it was when the item was queued, for the
// item's run (a W step overlapped with the next micro-batch's forward may run inside an autocast
// region the backward was outside of, or the other way round), and restored after. The autocast
// cache is off meanwhile: casts made for the item are not kept past it.
class AutocastAsQueued {
 public:
  explicit AutocastAsQueued(const DeferredWgrad& item) : device_(item.input.device().type()) {
    if (!at::autocast::is_autocast_available(device_)) return;
    applies_ = true;
    enabled_ = at::autocast::is_autocast_enabled(device_);
    dtype_ = at::autocast::get_autocast_dtype(device_);
    cache_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_enabled(device_, item.autocast_enabled);
    at::autocast::set_autocast_dtype(device_, item.autocast_dtype);
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastAsQueued() {
    if (!applies_) return;
    at::autocast::set_autocast_enabled(device_, enabled_);
    at::autocast::set_autocast_dtype(device_, dtype_);
    at::autocast::set_autocast_cache_enabled(cache_);
  }
  AutocastAsQueued(const AutocastAsQueued&) = delete;
  AutocastAsQueued& operator=(const AutocastAsQueued&) = delete;

 private:
  c10::DeviceType device_;
  bool applies_ = false, enabled_ = false, cache_ = true;
  at::ScalarType dtype_ = at::ScalarType::BFloat16;
};

// `target` (weak) named a parameter when the item was queued, and `locked` finds it freed.
// `what` ("weight", "bias") and, in a grouped item, the group name it as the layer does
// ("weight1").
void warn_if_freed(const DeferredWgrad& item, const core::WeakTensor& target,
                   const at::Tensor& locked, const char* what, std::optional<size_t> group) {
  if (locked.defined() || target._unsafe_get_target() == c10::UndefinedTensorImpl::singleton())
    return;
  TORCH_WARN(detail::layer_label(item.layer, item.gemm), ": the ", what,
             group.has_value() ? std::to_string(*group) : std::string(),
             " parameter its deferred weight gradient was for was freed before backward_dw() ran "
             "it; that contribution was dropped. Keep a parameter alive until the deferred work "
             "feeding it has run.");
}

void drop(const DeferredWgrad& item) {
  GradLedger::instance().deferred_dropped(item.targets(), item.pass);
}

// Items that could not go back on the queue, their layer released while they were in flight:
// reported as dropped (the ledger, and a warning, as a layer released with work pending), and
// freed with no lock held, their references in a batch.
void drop_released(std::vector<DeferredWgrad> items) {
  if (items.empty()) return;
  for (const auto& item : items) drop(item);
  TORCH_WARN(detail::layer_label(items.front().layer),
             " was destroyed while its deferred wgrad work was running; ", items.size(),
             " item(s) not yet run were discarded, and those gradient contributions with them.");
  const detail::ReferenceBatch references;
  items.clear();
}

// What run() does with the items of a batch that passed their checks when another failed.
enum class OnStale {
  kRequeue,  // they go back on the queue (backward_dw_all: items of many layers and passes)
  kDropAll,  // they are dropped too (one layer's backward_dw(): the items of one pass)
};

// " (fc1, fc2)": the distinct GEMM names of items [first, end) of a pass (`gemms`: each item's),
// the item `skipped` left out, or "" where none has a name.
std::string gemm_names(const std::vector<std::string>& gemms, size_t first, size_t end,
                       size_t skipped) {
  std::vector<std::string> names;
  for (size_t i = first; i < end; ++i) {
    if (i != skipped && !gemms[i].empty() &&
        std::find(names.begin(), names.end(), gemms[i]) == names.end())
      names.push_back(gemms[i]);
  }
  return names.empty() ? "" : c10::str(" (", c10::Join(", ", names), ")");
}

// " The other 1 deferred item(s) ... (fc2) ... were dropped too": the rest of a pass, dropped with
// its item `failed` (`gemms`: each item's GEMM name).
std::string dropped_with_it(const std::vector<std::string>& gemms, size_t failed) {
  return c10::str(
      " The other ", gemms.size() - 1, " deferred item(s) that backward pass queued for this layer",
      gemm_names(gemms, 0, gemms.size(), failed),
      " were dropped too, unrun: backward_dw() runs a pass's items all or none, so that no "
      "gradient of the pass is half-written and the next backward_dw() runs the next pass.");
}

// Why a .grad the item would add to cannot take an in-place add, or "" if none (see
// detail::unwritable_grad); `sinks`: the item's parameters, their GradWriteLocks held. Checked
// before the item writes anything: with the stale stashes, before any item runs, where the call
// runs several (a LayerNormMLP's fc2 item runs before fc1's), else as the item runs, under the
// hold that writes them (the grouped op adds to biases' .grads in place before other experts'
// .grads are written).
std::string unwritable_grad_reason(const DeferredWgrad& item,
                                   const std::vector<detail::WgradSinks>& sinks) {
  const std::string which = detail::unwritable_grad(sinks, !item.groups.empty());
  if (which.empty()) return which;
  return c10::str(detail::layer_label(item.layer, item.gemm), ": backward_dw() cannot add to ",
                  which,
                  ". That item was dropped and no gradient was written for it; the grad-ready "
                  "hooks of its parameters do not fire for that backward pass. Set a .grad of "
                  "its own, made outside inference mode (p.grad = p.grad.clone()).");
}

// The item's parameters, locked (undefined where freed), with their main_grads: one per group.
std::vector<detail::WgradSinks> sinks_of(const DeferredWgrad& item) {
  const auto sink = [](const core::WeakTensor& weak_weight, const core::WeakTensor& weak_bias,
                       const at::Tensor& weight_main_grad, const at::Tensor& bias_main_grad) {
    const at::Tensor weight(weak_weight.lock()), bias(weak_bias.lock());
    return detail::WgradSinks{weight, bias, weight.defined() ? weight_main_grad : at::Tensor(),
                              bias.defined() ? bias_main_grad : at::Tensor()};
  };
  std::vector<detail::WgradSinks> sinks;
  sinks.reserve(std::max<size_t>(item.groups.size(), 1));
  if (item.groups.empty()) {
    sinks.push_back(sink(item.weight, item.bias, item.weight_main_grad, item.bias_main_grad));
  }
  for (const auto& group : item.groups) {
    sinks.push_back(sink(group.weight, group.bias, group.weight_main_grad, group.bias_main_grad));
  }
  return sinks;
}

// The parameters of `sinks` that are alive, as DeferredWgrad::targets() lists them (each weight,
// then its bias), moved out of the sinks (no reference taken again); the sinks are cleared.
std::vector<at::Tensor> take_targets(std::vector<detail::WgradSinks>& sinks) {
  std::vector<at::Tensor> targets;
  targets.reserve(2 * sinks.size());
  for (auto& sink : sinks) {
    if (sink.weight.defined()) targets.push_back(std::move(sink.weight));
    if (sink.bias.defined()) targets.push_back(std::move(sink.bias));
  }
  sinks.clear();
  return targets;
}

// Runs the items of `batch` in order. Items whose stashed tensors changed, or with a .grad that
// cannot be added to, are dropped and reported; then nothing runs and the others go back on the
// queue (kRequeue) or are dropped too (kDropAll), so one call either runs everything or nothing.
void run(std::vector<DeferredWgrad> items, uint64_t batch, OnStale on_stale) {
  const detail::ReferenceBatch::Reentry reentry;
  auto& in_flight = InFlight::instance();
  const bool drop_all = on_stale == OnStale::kDropAll && items.size() > 1;
  std::vector<std::string> gemms;
  if (drop_all) {
    for (const auto& item : items) gemms.push_back(item.gemm);
  }
  std::string error;
  size_t failed = 0;  // the first item whose check failed, where `error` is set
  // Several items: every .grad they add to is checked before any runs (see unwritable_grad_reason).
  const bool checks_grads_first = items.size() > 1;
  std::vector<DeferredWgrad> runnable;
  std::vector<size_t> index;  // runnable[i] is item index[i] of the batch
  runnable.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    std::string reason = stale_reason(items[i]);
    if (reason.empty() && checks_grads_first) {
      // The gradient locks are never waited for inside a ReferenceBatch: it holds the GIL (the
      // Python module), which a thread holding a lock may need (a __torch_dispatch__ mode).
      std::vector<detail::WgradSinks> sinks;
      {
        const detail::ReferenceBatch references;
        sinks = sinks_of(items[i]);
      }
      {
        const detail::GradWriteLocks locked(sinks);
        reason = unwritable_grad_reason(items[i], sinks);
      }
      const detail::ReferenceBatch references;
      sinks.clear();
    }
    if (reason.empty()) {
      runnable.push_back(std::move(items[i]));
      index.push_back(i);
    } else {
      drop(items[i]);
      in_flight.settled(batch, i);
      if (error.empty()) {
        error = std::move(reason);
        failed = i;
      }
    }
  }
  if (!error.empty() && drop_all) {
    error += dropped_with_it(gemms, failed);
    for (size_t i = 0; i < runnable.size(); ++i) {
      drop(runnable[i]);
      in_flight.settled(batch, index[i]);
    }
    const detail::ReferenceBatch references;
    runnable.clear();
    index.clear();
  }
  // Puts the items after runnable[i] back on the queue: no gradient is lost, but for items of a
  // layer released meanwhile (a hook deleted it), which are reported as dropped.
  auto restore_after = [&](size_t i) {
    drop_released(in_flight.restore(
        batch, std::vector<size_t>(index.begin() + i + 1, index.end()),
        std::vector<DeferredWgrad>(std::make_move_iterator(runnable.begin() + i + 1),
                                   std::make_move_iterator(runnable.end()))));
  };
  if (!error.empty()) {
    drop_released(in_flight.restore(batch, index, std::move(runnable)));
    items.clear();  // free the dropped items' tensors now, not while the exception unwinds
    TORCH_CHECK(false, error);
  }
  for (size_t i = 0; i < runnable.size(); ++i) {
    DeferredWgrad& item = runnable[i];
    // The item's parameters are referenced once, for the whole item, and those references (and
    // the item's own) dropped together: each in a ReferenceBatch. Parameters freed since the item
    // was queued get nothing (their main_grad neither); the contribution is reported, not lost
    // silently.
    std::vector<detail::WgradSinks> sinks;
    {
      const detail::ReferenceBatch references;
      sinks = sinks_of(item);
      const auto warn = [&](const core::WeakTensor& weight, const core::WeakTensor& bias,
                            const detail::WgradSinks& sink, std::optional<size_t> group) {
        warn_if_freed(item, weight, sink.weight, "weight", group);
        warn_if_freed(item, bias, sink.bias, "bias", group);
      };
      if (item.groups.empty()) warn(item.weight, item.bias, sinks.front(), std::nullopt);
      for (size_t g = 0; g < item.groups.size(); ++g) {
        warn(item.groups[g].weight, item.groups[g].bias, sinks[g], g);
      }
    }
    // Anomaly detection: a nan this item brings into a gradient stops it before it lands (its
    // pass's hooks do not fire), as autograd's check stops a backward before AccumulateGrad. A
    // gradient that held a nan before is not blamed on it.
    std::string nan;
    try {
      nan = detail::add_to_sinks(
          item.layer, item.gemm, sinks, !item.groups.empty(),
          item.check_nan || detail::anomaly_checks_nan(),
          "backward_dw() (the deferred weight gradient)",
          [&] {
            if (checks_grads_first) return;  // checked before any item ran
            const std::string unwritable = unwritable_grad_reason(item, sinks);
            TORCH_CHECK(unwritable.empty(), unwritable);
          },
          [&](const detail::GradWriteLocks& locked) {
            const AutocastAsQueued autocast(item);
            if (!item.groups.empty()) {
              detail::accumulate_grouped_wgrad(item.grad_output, item.input, item.m_splits, sinks,
                                               locked);
              return;
            }
            const detail::WgradSinks& single = sinks.front();
            if (!single.weight.defined() && !single.bias.defined()) return;  // both freed
            // The GEMM's input, recomputed from the stashed activation input only now and freed
            // right after the GEMM (the same kernels on the same tensor: the forward's bit for
            // bit). Without grad mode: the stash requires grad, and backward_dw() may run with
            // grad mode on, where the op would take its differentiable composite and record a
            // graph.
            const at::Tensor input = item.input_activation.empty() ? item.input : [&] {
              const at::NoGradGuard no_grad;
              return ops::activation(item.input, item.input_activation);
            }();
            detail::accumulate_wgrad(item.grad_output, input, single, locked);
          });
    } catch (...) {
      keep_until_read(item);  // some of its kernels may have been enqueued
      drop(item);
      in_flight.settled(batch, index[i]);
      restore_after(i);
      throw;
    }
    keep_until_read(item);
    if (!nan.empty()) {
      drop(item);
      in_flight.settled(batch, index[i]);
      if (!drop_all) {  // backward_dw_all(): the items not run yet stay queued
        restore_after(i);
        TORCH_CHECK(false, nan);
      }
      // A layer's pass: its items not run yet are dropped too, as autograd's backward stops at the
      // nan, and so that the next backward_dw() runs the next pass.
      for (size_t j = i + 1; j < runnable.size(); ++j) {
        drop(runnable[j]);
        in_flight.settled(batch, index[j]);
      }
      const size_t dropped = runnable.size() - i - 1;
      {
        const detail::ReferenceBatch references;
        runnable.clear();
      }
      // (nothing was dropped before the loop: a stale item throws above, so index[j] == j)
      TORCH_CHECK(
          false, nan,
          dropped == 0
              ? std::string()
              : c10::str(" The ", dropped, " deferred item(s) of that backward pass not run yet",
                         gemm_names(gemms, i + 1, gemms.size(), gemms.size()),
                         " were dropped, unrun: autograd's backward stops at the nan, and "
                         "the next backward_dw() runs the next pass."));
    }
    const core::PassId pass = item.pass;
    std::vector<at::Tensor> targets;
    {
      const detail::ReferenceBatch references;
      targets = take_targets(sinks);
      item = DeferredWgrad{};  // free the stashed activations before the hooks run
    }
    in_flight.settled(batch, index[i]);  // landed: hooks see it no longer pending
    try {
      // Under one ledger lock; every target lands before any hook runs.
      GradLedger::instance().deferred_landed(targets, pass);
    } catch (...) {  // a grad-ready hook threw: the items not run yet stay queued
      restore_after(i);
      throw;
    }
    const detail::ReferenceBatch references;
    targets.clear();
  }
}

}  // namespace

LayerHandle::LayerHandle(std::string name)
    : id_(WgradStore::instance().register_layer(std::move(name))) {}

LayerHandle::~LayerHandle() {
  const std::string label = detail::layer_label(id_);
  if (const int64_t dropped = release()) {
    TORCH_WARN(
        label, " was destroyed with ", dropped,
        " deferred wgrad item(s) pending; their stashed tensors were freed and those "
        "gradient contributions were discarded. Call backward_dw() before deleting a layer.");
  }
}

int64_t LayerHandle::release() {
  if (released_) return 0;
  released_ = true;
  std::vector<DeferredWgrad> dropped = WgradStore::instance().release_layer(id_);
  for (const auto& item : dropped) drop(item);
  return static_cast<int64_t>(dropped.size());
}

std::string LayerHandle::name() const { return WgradStore::instance().layer_name(id_); }
void LayerHandle::set_name(std::string name) {
  WgradStore::instance().rename_layer(id_, std::move(name));
}
int64_t LayerHandle::pending() const {
  return static_cast<int64_t>(InFlight::instance().pending(id_));
}

void LayerHandle::backward_dw() {
  std::vector<DeferredWgrad> items;
  std::vector<uint64_t> others;
  BatchScope batch{
      InFlight::instance().take([&] { return WgradStore::instance().take_oldest_pass(id_); }, items,
                                {id_, std::nullopt}, &others)};
  if (items.empty() && !others.empty()) {
    // Another thread (a backward_dw_all()) took this layer's oldest work: it lands before we
    // return, as if we had run it.
    InFlight::instance().wait_for(others);
    return;
  }
  TORCH_CHECK(!items.empty() || !InFlight::instance().this_thread_runs(id_),
              detail::layer_label(id_),
              ": backward_dw() was called while this thread is running this layer's deferred work "
              "(a grad-ready hook calling backward_dw() from inside backward_dw_all()?); that work "
              "lands when the running call reaches it.");
  TORCH_CHECK(!items.empty(), detail::layer_label(id_),
              ": backward_dw() was called but no backward pass has queued deferred wgrad work for "
              "this layer (run a backward pass through it first, or check that it was built with "
              "delay_wgrad_compute=True). A backward that needs none of its weight gradients "
              "(frozen parameters, autograd.grad, backward(inputs=...)) or computes them at once "
              "(create_graph=True) queues nothing.");
  run(std::move(items), batch.id, OnStale::kDropAll);
}

bool LayerHandle::ran_untracked() const { return WgradStore::instance().ran_untracked(id_); }

void LayerHandle::note_ran_untracked() { WgradStore::instance().note_ran_untracked(id_); }

std::vector<int64_t> LayerHandle::pending_passes() const {
  return WgradStore::instance().pending_passes(id_);
}

void LayerHandle::backward_dw(int64_t pass) {
  std::vector<DeferredWgrad> items;
  std::vector<uint64_t> others;
  BatchScope batch{InFlight::instance().take(
      [&] { return WgradStore::instance().take_pass(id_, pass); }, items, {id_, pass}, &others)};
  if (items.empty() && !others.empty()) {
    InFlight::instance().wait_for(others);  // another thread is running that pass's work
    return;
  }
  TORCH_CHECK(!items.empty(), detail::layer_label(id_), ": backward_dw(pass=", pass,
              ") was called but that backward pass has no deferred wgrad work queued for this "
              "layer (passes pending: ",
              c10::Join(", ", pending_passes()), ")");
  run(std::move(items), batch.id, OnStale::kDropAll);
}

void backward_dw_all() { backward_dw_all({}); }

void backward_dw_all(const std::vector<at::Tensor>& params) {
  // Two rounds: the second runs what a batch we waited for put back on the queue (its run threw).
  for (int round = 0; round < 2; ++round) {
    std::vector<DeferredWgrad> items;
    std::vector<uint64_t> others;
    {
      BatchScope batch{InFlight::instance().take(
          [&] { return WgradStore::instance().take_feeding(params); }, items)};
      others = InFlight::instance().others(params);
      if (!items.empty()) run(std::move(items), batch.id, OnStale::kRequeue);
    }
    if (others.empty()) return;
    InFlight::instance().wait_for(others);
  }
}

int64_t pending_wgrads() { return static_cast<int64_t>(InFlight::instance().pending()); }

int64_t pending_wgrads_for(const at::Tensor& param) {
  TORCH_CHECK_VALUE(param.defined(),
                    "pending_wgrads_for: expected a parameter, got an undefined tensor");
  return GradLedger::instance().pending_for(param);
}

int64_t dropped_wgrads_for(const at::Tensor& param) {
  TORCH_CHECK_VALUE(param.defined(),
                    "dropped_wgrads_for: expected a parameter, got an undefined tensor");
  return GradLedger::instance().dropped_for(param);
}

std::vector<std::string> layers_with_pending_wgrads(const std::vector<at::Tensor>& params) {
  std::vector<std::string> names;
  for (auto layer : InFlight::instance().layers_with_pending(params)) {
    names.push_back(WgradStore::instance().layer_name(layer));
  }
  return names;
}

namespace {
std::atomic<PendingWorkPolicy> pending_policy{PendingWorkPolicy::kWarn};
}

void set_pending_work_policy(PendingWorkPolicy policy) { pending_policy = policy; }
PendingWorkPolicy pending_work_policy() { return pending_policy; }

void check_pending_wgrads(const std::string& action, const std::vector<at::Tensor>& params) {
  if (InFlight::instance().pending() == 0) return;
  const std::vector<std::string> layers = layers_with_pending_wgrads(params);
  if (layers.empty()) return;
  std::string names;
  for (const auto& name : layers) names += (names.empty() ? "'" : ", '") + name + "'";
  const std::string message = c10::str(
      action, " while deferred wgrad work is pending for splitgrad layer(s) ", names,
      ": their weight gradients have not been computed yet. Call backward_dw() on those layers "
      "(or splitgrad::backward_dw_all()) first.");
  TORCH_CHECK(pending_policy != PendingWorkPolicy::kError, message);
  TORCH_WARN(message);
}

struct GradReadyHookHandle::State {
  // Weak: a handle must not keep its parameter (and the module that owns it) alive.
  core::WeakTensor param;
  uint64_t ledger_key;
  unsigned tensor_hook;
};

std::optional<int64_t> grad_ready_pass() { return GradLedger::firing_pass(); }

std::optional<bool> grad_ready_layer_ran(int64_t layer) {
  return GradLedger::firing_layer_ran(layer);
}

GradReadyHookHandle register_grad_ready_hook(const at::Tensor& param, GradReadyHook hook) {
  TORCH_CHECK_VALUE(param.defined(),
                    "register_grad_ready_hook: expected a parameter, got an "
                    "undefined tensor");
  TORCH_CHECK_VALUE(param.is_leaf() && param.requires_grad(),
                    "register_grad_ready_hook: expected a leaf tensor that requires grad (a "
                    "parameter), got one with is_leaf=",
                    param.is_leaf(), ", requires_grad=", param.requires_grad());
  auto state = std::make_shared<GradReadyHookHandle::State>(
      GradReadyHookHandle::State{core::WeakTensor(param.getIntrusivePtr()), 0, 0});
  state->ledger_key = GradLedger::instance().add_hook(param, std::move(hook));
  // Autograd's own contributions (AccumulateGrad) reach the ledger through a tensor hook; it holds
  // the parameter weakly, since the parameter owns it.
  core::WeakTensor weak(param.getIntrusivePtr());
  state->tensor_hook = param.register_hook([weak](const at::Tensor&) {
    at::Tensor p(weak.lock());
    // autograd.grad() captures the gradient but writes no .grad: not a contribution.
    if (!p.defined() || !detail::pass_accumulates_into(p)) return;
    detail::PassScope pass;
    GradLedger::instance().note_autograd_contribution(p, pass.id());
  });
  GradReadyHookHandle handle;
  handle.state_ = std::move(state);
  return handle;
}

void GradReadyHookHandle::remove() {
  if (!state_) return;
  const at::Tensor param(state_->param.lock());
  if (param.defined()) {  // a dead parameter's hooks went with it
    GradLedger::instance().remove_hook(param, state_->ledger_key);
    param.remove_hook(state_->tensor_hook);
  }
  state_.reset();
}

namespace {
struct MainGrads {  // leaked, like the ledger (see main_grad_callback)
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, std::pair<core::WeakTensor, at::Tensor>> table;
};
MainGrads& main_grads() {
  static auto* state = new MainGrads();
  return *state;
}
}  // namespace

void set_main_grad(const at::Tensor& param, const at::Tensor& main_grad) {
  TORCH_CHECK_VALUE(param.defined(),
                    "set_main_grad: expected a parameter, got an undefined tensor");
  TORCH_CHECK_VALUE(param.is_leaf() && param.requires_grad(),
                    "set_main_grad: expected a leaf tensor that requires grad (a parameter), got "
                    "one with is_leaf=",
                    param.is_leaf(), ", requires_grad=", param.requires_grad());
  if (main_grad.defined()) {
    detail::check_main_grad(detail::named("set_main_grad"), "param", main_grad, param);
  }
  auto& state = main_grads();
  std::lock_guard<std::mutex> lock(state.mutex);
  for (auto it = state.table.begin(); it != state.table.end();) {  // forget dead parameters
    it = it->second.first.expired() ? state.table.erase(it) : std::next(it);
  }
  if (!main_grad.defined()) {
    state.table.erase(param.unsafeGetTensorImpl());
    return;
  }
  state.table.insert_or_assign(
      param.unsafeGetTensorImpl(),
      std::make_pair(core::WeakTensor(param.getIntrusivePtr()), main_grad));
}

at::Tensor main_grad(const at::Tensor& param) {
  auto& state = main_grads();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.table.find(param.unsafeGetTensorImpl());
  if (it == state.table.end() || it->second.first.expired()) return {};
  return it->second.second;
}

void set_main_grad_accumulated_callback(std::function<void(const at::Tensor& param)> callback) {
  std::lock_guard<std::mutex> lock(detail::main_grad_callback().mutex);
  detail::main_grad_callback().callback = std::move(callback);
}

}  // namespace splitgrad
