// A small C++ training program on splitgrad, checked step by step against the same model written in
// plain libtorch autograd (a copy of its initial weights):
//
//   h1 = tanh(x·Wᵀ + b1)        enc:  splitgrad::Linear
//   h2 = tanh(h1·Wᵀ + b2)       mid:  splitgrad::Linear, weight tied to enc's (one parameter W)
//   y  = h2·Hᵀ + c              head: splitgrad::Linear
//
// Every layer defers its weight gradient (delay_wgrad_compute). Each step runs four micro-batches
// in a zero-bubble-like order: the backward pass of micro-batch i computes only activation
// gradients, and the weight gradients of micro-batch i-1 run right after it (backward_dw), the last
// ones at the end of the step. A grad-ready hook on every parameter plays a data-parallel reducer:
// it counts the passes and, at the last one, takes the gradient it would all-reduce. Then a guarded
// SGD step over the de-duplicated parameters (W once, though two layers list it).
//
// Usage: train_tied [cpu|cuda]   (default cpu)
// Exit status 0 if, at every step, the gradients and the updated parameters match plain autograd's
// within a tight bound, the hooks ran once per micro-batch and saw the final gradient, and no
// deferred work was left before the optimizer step; 1 otherwise.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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
// float32 results that differ only in the order their terms are added.
constexpr double kBound = 1e-5;

splitgrad::LinearOptions delayed(int64_t in, int64_t out, const char* name, torch::Device device) {
  return splitgrad::LinearOptions(in, out).delay_wgrad_compute(true).device(device).name(name);
}

// The model as a torch::nn::Module: its parameters() lists W twice (enc.weight and mid.weight).
struct TiedMlpImpl : torch::nn::Module {
  explicit TiedMlpImpl(torch::Device device)
      : enc(register_module("enc",
                            splitgrad::Linear(delayed(kFeatures, kFeatures, "enc", device)))),
        mid(register_module("mid",
                            splitgrad::Linear(delayed(kFeatures, kFeatures, "mid", device)))),
        head(register_module("head",
                             splitgrad::Linear(delayed(kFeatures, kOutputs, "head", device)))) {
    mid->tie_weight(enc->weight);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::tanh(mid(torch::tanh(enc(x)))));
  }
  // The deferred weight gradients of the oldest micro-batch still pending, in any order.
  void backward_dw() {
    head->backward_dw();
    mid->backward_dw();
    enc->backward_dw();
  }
  splitgrad::Linear enc, mid, head;
};
TORCH_MODULE(TiedMlp);

// The same model in plain autograd, from a copy of the same initial values.
struct Reference {
  torch::Tensor w, b1, b2, head_w, head_b;

  explicit Reference(const TiedMlp& m) {
    auto copy = [](const torch::Tensor& p) { return p.detach().clone().requires_grad_(); };
    w = copy(m->enc->weight);
    b1 = copy(m->enc->bias);
    b2 = copy(m->mid->bias);
    head_w = copy(m->head->weight);
    head_b = copy(m->head->bias);
  }
  torch::Tensor forward(const torch::Tensor& x) const {
    torch::Tensor h = torch::tanh(F::linear(x, w, b1));
    h = torch::tanh(F::linear(h, w, b2));
    return F::linear(h, head_w, head_b);
  }
  std::vector<torch::Tensor> parameters() const { return {w, b1, b2, head_w, head_b}; }
};

// The model's parameters in Reference::parameters()'s order.
std::vector<torch::Tensor> paired(const TiedMlp& m) {
  return {m->enc->weight, m->enc->bias, m->mid->bias, m->head->weight, m->head->bias};
}

double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double diff = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
  }
  return diff;
}

std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool cuda = argc > 1 && std::strcmp(argv[1], "cuda") == 0;
  if (argc > 2 || (argc == 2 && !cuda && std::strcmp(argv[1], "cpu") != 0)) {
    std::fprintf(stderr, "usage: %s [cpu|cuda]\n", argv[0]);
    return 2;
  }
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "error: cuda requested but no GPU is available\n");
    return 2;
  }
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  // On CUDA both sides run exact fp32 GEMMs: libtorch leaves TF32 off unless asked.

  torch::manual_seed(0);
  TiedMlp model(device);
  Reference reference(model);
  const std::vector<torch::Tensor> params = paired(model);

  // Each tensor once: given model->parameters(), SGD would step W twice.
  const std::vector<torch::Tensor> unique = splitgrad::unique_parameters(*model);
  std::printf(
      "splitgrad C++ example on %s: parameters() lists %zu tensors, unique_parameters() %zu\n",
      cuda ? "cuda" : "cpu", model->parameters().size(), unique.size());
  // Guarded: step() and zero_grad() throw if deferred work feeding the parameters is still queued.
  splitgrad::set_pending_work_policy(splitgrad::PendingWorkPolicy::kError);
  splitgrad::GuardedOptimizer<torch::optim::SGD> optimizer(unique,
                                                           torch::optim::SGDOptions(kLearningRate));
  torch::optim::SGD reference_optimizer(reference.parameters(), kLearningRate);

  // The "reducer": per parameter, the number of passes seen this step, and the gradient it would
  // have all-reduced when the last micro-batch's contributions had landed.
  std::vector<int> ready_calls(params.size(), 0);
  std::vector<torch::Tensor> reduced(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    splitgrad::register_grad_ready_hook(params[i], [&, i](const torch::Tensor& p) {
      if (++ready_calls[i] == kMicroBatches) reduced[i] = p.grad().clone();
    });
  }

  // Synthetic regression data from a fixed random "teacher", made on the CPU (same on any device).
  const torch::Tensor teacher = torch::randn({kOutputs, kFeatures}) / std::sqrt(kFeatures);
  auto batch = [&] {
    torch::Tensor x = torch::randn({kMicroBatch, kFeatures});
    return std::make_pair(x.to(device), torch::sin(F::linear(x, teacher)).to(device));
  };

  bool ok = true;
  auto fail = [&](const char* what, double value) {
    std::printf("  error: %s (%.3e)\n", what, value);
    ok = false;
  };
  std::printf("step  loss (splitgrad)  loss (autograd)  max|grad diff|  max|param diff|  hooks\n");
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    reference_optimizer.zero_grad();
    std::fill(ready_calls.begin(), ready_calls.end(), 0);
    std::fill(reduced.begin(), reduced.end(), torch::Tensor());
    double loss_sum = 0.0;
    double reference_loss_sum = 0.0;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      auto [x, target] = batch();
      torch::Tensor loss = F::mse_loss(model->forward(x), target) / kMicroBatches;
      loss.backward();                   // B: activation gradients only
      if (mb > 0) model->backward_dw();  // W of the previous micro-batch
      torch::Tensor reference_loss = F::mse_loss(reference.forward(x), target) / kMicroBatches;
      reference_loss.backward();
      loss_sum += loss.item<double>();
      reference_loss_sum += reference_loss.item<double>();
    }
    model->backward_dw();  // W of the last micro-batch

    const int64_t pending = splitgrad::pending_wgrads();
    if (pending != 0) fail("deferred wgrad items still pending before the optimizer step", pending);
    const double grad_diff = max_diff(grads(params), grads(reference.parameters()));
    if (!(grad_diff <= kBound)) fail("gradients differ from plain autograd's", grad_diff);
    const bool hooks_ok = std::all_of(ready_calls.begin(), ready_calls.end(),
                                      [](int n) { return n == kMicroBatches; });
    if (!hooks_ok) fail("a grad-ready hook did not run once per micro-batch", 0);
    for (size_t i = 0; hooks_ok && i < params.size(); ++i) {
      const double early = (reduced[i] - params[i].grad()).abs().max().item<double>();
      if (early != 0.0) fail("a grad-ready hook ran before its gradient was complete", early);
    }

    optimizer.step();
    reference_optimizer.step();
    const double param_diff = max_diff(params, reference.parameters());
    if (!(param_diff <= kBound))
      fail("parameters after the step differ from plain autograd's", param_diff);
    std::printf("%4d  %16.6f  %15.6f  %14.3e  %15.3e  %5s\n", step, loss_sum, reference_loss_sum,
                grad_diff, param_diff, hooks_ok ? "ok" : "WRONG");
  }
  std::printf(ok ? "OK: delayed, tied, micro-batched gradients and SGD steps match plain autograd "
                   "(bound %.0e)\n"
                 : "FAILED (bound %.0e)\n",
              kBound);
  return ok ? 0 : 1;
}
