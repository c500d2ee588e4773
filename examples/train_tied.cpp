// Trains a small model whose two hidden layers share one weight, with delayed weight gradients,
// next to the same model written in plain autograd, and checks that the gradients agree.
//
//   h1 = tanh(x·Wᵀ + b1)        enc:  splitgrad::Linear, delay_wgrad_compute
//   h2 = tanh(h1·Wᵀ + b2)       mid:  splitgrad::Linear, delay_wgrad_compute, weight tied to enc's
//   y  = h2·Hᵀ + c              head: splitgrad::Linear, regular (its wgrad runs in backward)
//
// Each step runs four micro-batches in a zero-bubble-like order: the backward pass of micro-batch i
// computes only activation gradients for the delayed layers, and their weight gradients for
// micro-batch i-1 run right after it (backward_dw), the last one at the end of the step. A
// grad-ready hook on W counts the points where a data-parallel reducer could start its all-reduce.
//
// Exit status: 0 if every step's gradients match plain autograd's within a tight bound and no
// deferred work is left before each optimizer step; 1 otherwise.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "splitgrad/splitgrad.h"

namespace F = torch::nn::functional;

namespace {

constexpr int64_t kFeatures = 32;
constexpr int64_t kOutputs = 4;
constexpr int64_t kMicroBatch = 16;
constexpr int kMicroBatches = 4;
constexpr int kSteps = 12;
constexpr double kLearningRate = 0.1;
// float32 gradients that differ only in the order their terms are added.
constexpr double kMaxGradDiff = 1e-5;

struct SplitgradModel {
  splitgrad::Linear enc{splitgrad::LinearOptions(kFeatures, kFeatures)
                            .delay_wgrad_compute(true)
                            .device(torch::kCPU)
                            .name("enc")};
  splitgrad::Linear mid{splitgrad::LinearOptions(kFeatures, kFeatures)
                            .delay_wgrad_compute(true)
                            .device(torch::kCPU)
                            .name("mid")};
  splitgrad::Linear head{
      splitgrad::LinearOptions(kFeatures, kOutputs).device(torch::kCPU).name("head")};

  SplitgradModel() { mid->tie_weight(enc->weight); }

  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::tanh(mid(torch::tanh(enc(x)))));
  }
  // Each parameter once (W is both enc's and mid's): an optimizer given W twice would step it
  // twice. For a torch::nn::Module, splitgrad::unique_parameters(module) builds this list.
  std::vector<torch::Tensor> parameters() const {
    return {enc->weight, enc->bias, mid->bias, head->weight, head->bias};
  }
  // The deferred weight gradients of the oldest micro-batch still pending.
  void backward_dw() {
    mid->backward_dw();
    enc->backward_dw();
    head->backward_dw();  // a regular layer: does nothing
  }
};

// The same model in plain autograd, starting from the same values.
struct ReferenceModel {
  torch::Tensor w, b1, b2, head_w, head_b;

  explicit ReferenceModel(const SplitgradModel& m) {
    auto copy = [](const torch::Tensor& p) { return p.detach().clone().requires_grad_(); };
    w = copy(m.enc->weight);
    b1 = copy(m.enc->bias);
    b2 = copy(m.mid->bias);
    head_w = copy(m.head->weight);
    head_b = copy(m.head->bias);
  }
  torch::Tensor forward(const torch::Tensor& x) const {
    torch::Tensor h = torch::tanh(F::linear(x, w, b1));
    h = torch::tanh(F::linear(h, w, b2));
    return F::linear(h, head_w, head_b);
  }
  std::vector<torch::Tensor> parameters() const { return {w, b1, b2, head_w, head_b}; }
};

double max_grad_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double diff = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i].grad() - b[i].grad()).abs().max().item<double>());
  }
  return diff;
}

}  // namespace

int main() {
  torch::manual_seed(0);
  SplitgradModel model;
  ReferenceModel reference(model);
  // Guarded: step() and zero_grad() throw if deferred work feeding W is still queued.
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
  splitgrad::GuardedOptimizer<torch::optim::SGD> optimizer(model.parameters(), kLearningRate);
  torch::optim::SGD reference_optimizer(reference.parameters(), kLearningRate);

  int grad_ready_calls = 0;
  splitgrad::register_grad_ready_hook(model.enc->weight,
                                      [&](const at::Tensor&) { ++grad_ready_calls; });

  // Synthetic regression data from a fixed random "teacher".
  const torch::Tensor teacher = torch::randn({kOutputs, kFeatures}) / std::sqrt(kFeatures);
  auto batch = [&] {
    torch::Tensor x = torch::randn({kMicroBatch, kFeatures});
    return std::make_pair(x, torch::sin(F::linear(x, teacher)));
  };

  bool ok = true;
  std::printf("step      loss  max|grad diff|  grad-ready calls\n");
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    reference_optimizer.zero_grad();
    grad_ready_calls = 0;
    double loss_sum = 0.0;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      auto [x, target] = batch();
      torch::Tensor loss = F::mse_loss(model.forward(x), target) / kMicroBatches;
      loss.backward();                  // B: activation gradients (+ head's wgrad)
      if (mb > 0) model.backward_dw();  // W of the previous micro-batch
      (F::mse_loss(reference.forward(x), target) / kMicroBatches).backward();
      loss_sum += loss.item<double>();
    }
    model.backward_dw();  // W of the last micro-batch

    if (splitgrad::pending_wgrads() != 0) {
      std::printf("error: %lld deferred wgrad item(s) still pending before the optimizer step\n",
                  static_cast<long long>(splitgrad::pending_wgrads()));
      ok = false;
    }
    const double diff = max_grad_diff(model.parameters(), reference.parameters());
    std::printf("%4d  %8.5f  %14.3e  %16d\n", step, loss_sum, diff, grad_ready_calls);
    if (!(diff <= kMaxGradDiff)) {
      std::printf("error: gradients differ from plain autograd by %.3e (bound %.1e)\n", diff,
                  kMaxGradDiff);
      ok = false;
    }
    if (grad_ready_calls != kMicroBatches) {
      std::printf("error: the grad-ready hook of W ran %d times, expected once per micro-batch\n",
                  grad_ready_calls);
      ok = false;
    }
    optimizer.step();
    reference_optimizer.step();
  }
  std::printf(ok ? "OK: delayed, tied gradients match plain autograd\n" : "FAILED\n");
  return ok ? 0 : 1;
}
