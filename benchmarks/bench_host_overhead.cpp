// Host overhead of splitgrad from C++: CPU microseconds per forward and per backward_dw() on tiny
// shapes (16 x 16 weights, 4 tokens, fp32 main_grad), for 1, 32 and 128 layers, next to plain
// torch::nn::Linear's forward. On CUDA the device work is queued, not waited for: this is the
// host's cost per call. Calls are timed in batches of at most 64 with the GPU drained in between
// (untimed), so a full launch queue never makes the host wait.
//
// Then where one backward_dw() spends its time (CUDA): the same wgrad through each layer of the
// stack, from the bottom up, above two floors of this machine:
//   cudaMemsetAsync    one 4-byte memset queued through the CUDA driver (the cost of any launch)
//   Tensor::zero_      one tiny PyTorch kernel launch (dispatcher + launch)
//   cuBLASLt core      splitgrad::cuda::gemm with prepared arguments (plan cache + cublasLtMatmul)
//   op                 splitgrad::ops::linear_wgrad_accumulate_ (dispatcher, checks, views, core)
//   at::addmm_         PyTorch's in-place alternative, for scale
//   backward_dw        the whole deferred step (store, version checks, op, grad-ready ledger)
//
// Then the same for a 32-expert GroupedLinear's backward_dw() against a Linear's (bf16, fp32
// main_grads): the op alone, the whole step, and their difference (the bookkeeping).
//
// Then the W steps of 1, 32 and 128 layers captured once in a CUDA graph and replayed: host time
// per layer per replay, next to the eager backward_dw() of the same layers.
//
//   build/<dir>/bench_host_overhead [cuda|cpu]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "splitgrad/splitgrad.h"
#ifdef SPLITGRAD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cublaslt_gemm.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kBatch = 64;

void drain(bool cuda) {
  if (cuda) torch::cuda::synchronize();
}

// Host µs per call of `call`, run `calls` times in batches of kBatch with the device drained
// (untimed) between batches; `prepare(n)` (untimed) runs before each batch of n calls.
double host_us_per_call(bool cuda, int64_t calls, const std::function<void(int64_t)>& prepare,
                        const std::function<void(int64_t)>& call) {
  double total = 0.0;
  for (int64_t done = 0; done < calls;) {
    const int64_t n = std::min(kBatch, calls - done);
    prepare(n);
    drain(cuda);
    const auto start = Clock::now();
    for (int64_t i = 0; i < n; ++i) call(done + i);
    total += std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    drain(cuda);
    done += n;
  }
  return total / static_cast<double>(calls);
}

}  // namespace

int main(int argc, char** argv) {
  const bool use_cuda = argc > 1 ? std::string(argv[1]) == "cuda" : torch::cuda::is_available();
  const torch::Device device = use_cuda ? torch::kCUDA : torch::kCPU;
  const auto f32 = torch::dtype(torch::kFloat).device(device);
  std::printf("host overhead per call from C++ (%s, 16x16 weights, 4 tokens, fp32 main_grad)\n",
              use_cuda ? "cuda" : "cpu");
  std::printf("%6s | %18s | %18s | %24s\n", "layers", "fwd us splitgrad", "fwd us nn::Linear",
              "backward_dw us splitgrad");
  for (int layers : {1, 32, 128}) {
    std::vector<splitgrad::Linear> ours;
    std::vector<torch::nn::Linear> plain;
    for (int i = 0; i < layers; ++i) {
      ours.emplace_back(splitgrad::LinearOptions(16, 16)
                            .bias(false)
                            .device(device)
                            .delay_wgrad_compute(true)
                            .fuse_wgrad_accumulation(true));
      splitgrad::set_main_grad(ours.back()->weight, torch::zeros({16, 16}, f32));
      plain.emplace_back(torch::nn::LinearOptions(16, 16).bias(false));
      plain.back()->to(device);
    }
    const torch::Tensor x = torch::randn({4, 16}, f32).requires_grad_(true);
    const torch::Tensor grad_out = torch::randn({4, 16}, f32);  // dense: every dy is dense too
    const int64_t passes = std::max<int64_t>(8, 4096 / layers);
    auto forward_ours = [&] {
      torch::Tensor h = x;
      for (auto& layer : ours) h = layer->forward(h);
      return h;
    };
    auto forward_plain = [&] {
      torch::Tensor h = x;
      for (auto& layer : plain) h = layer->forward(h);
      return h;
    };
    forward_ours().backward(grad_out);  // warm-up: plans, allocator
    for (auto& layer : ours) layer->backward_dw();
    forward_plain();
    const auto nothing = [](int64_t) {};
    const double fwd_ours =
        host_us_per_call(use_cuda, passes, nothing, [&](int64_t) { forward_ours(); }) / layers;
    const double fwd_plain =
        host_us_per_call(use_cuda, passes, nothing, [&](int64_t) { forward_plain(); }) / layers;
    // backward_dw: each batch's backward passes are queued (untimed), then their W steps timed.
    const double dw = host_us_per_call(
                          use_cuda, passes,
                          [&](int64_t n) {
                            for (int64_t i = 0; i < n; ++i) forward_ours().backward(grad_out);
                          },
                          [&](int64_t) {
                            for (auto it = ours.rbegin(); it != ours.rend(); ++it)
                              (*it)->backward_dw();
                          }) /
                      layers;
    std::printf("%6d | %18.2f | %18.2f | %24.2f\n", layers, fwd_ours, fwd_plain, dw);
    if (splitgrad::pending_wgrads() != 0) {
      std::fprintf(stderr, "deferred work left over\n");
      return 1;
    }
  }

#ifdef SPLITGRAD_WITH_CUDA
  if (!use_cuda) return 0;
  // The breakdown of one wgrad + fp32 accumulation (16x16 weight, 4 tokens), from the bottom up.
  const int64_t calls = 4096;
  const torch::Tensor dy = torch::randn({4, 16}, f32), x = torch::randn({4, 16}, f32);
  torch::Tensor main_grad = torch::zeros({16, 16}, f32);
  splitgrad::cuda::GemmArgs args;  // as linear_cuda.cpp's wgrad_gemm prepares them
  args.m = 16, args.n = 16, args.k = 4;
  args.a = {x.data_ptr(), CUDA_R_32F, 16, /*transposed=*/true};
  args.b = {dy.data_ptr(), CUDA_R_32F, 16, /*transposed=*/false};
  args.d = main_grad.data_ptr(), args.d_type = CUDA_R_32F, args.ldd = 16;
  args.accumulate = splitgrad::cuda::Accumulate::kAdd;
  args.compute =
      at::globalContext().allowTF32CuBLAS() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  args.workspace = at::cuda::getCUDABlasLtWorkspace();
  args.workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  const auto handle = at::cuda::getCurrentCUDABlasLtHandle();
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  const auto nothing = [](int64_t) {};
  torch::Tensor scratch = torch::zeros({1}, f32);
  const double memset = host_us_per_call(true, calls, nothing, [&](int64_t) {
    if (cudaMemsetAsync(scratch.data_ptr(), 0, 4, stream) != cudaSuccess)
      throw std::runtime_error("cudaMemsetAsync failed");
  });
  const double zero = host_us_per_call(true, calls, nothing, [&](int64_t) { scratch.zero_(); });
  const double core = host_us_per_call(true, calls, nothing, [&](int64_t) {
    if (!splitgrad::cuda::gemm(handle, args, stream).ok) throw std::runtime_error("gemm failed");
  });
  const double op = host_us_per_call(true, calls, nothing, [&](int64_t) {
    splitgrad::ops::linear_wgrad_accumulate_(dy, x, main_grad, std::nullopt);
  });
  const double addmm =
      host_us_per_call(true, calls, nothing, [&](int64_t) { main_grad.addmm_(dy.t(), x); });
  splitgrad::Linear layer(splitgrad::LinearOptions(16, 16)
                              .bias(false)
                              .device(device)
                              .delay_wgrad_compute(true)
                              .fuse_wgrad_accumulation(true));
  splitgrad::set_main_grad(layer->weight, torch::zeros({16, 16}, f32));
  const torch::Tensor input = torch::randn({4, 16}, f32).requires_grad_(true);
  const double step = host_us_per_call(
      true, calls,
      [&](int64_t n) {
        for (int64_t i = 0; i < n; ++i) layer->forward(input).backward(dy);
      },
      [&](int64_t) { layer->backward_dw(); });
  std::printf(
      "\none backward_dw() from the bottom up (host us per call, 16x16, 4 tokens, fp32 "
      "main_grad)\n");
  std::printf("%-40s | %8s\n", "layer of the stack", "us");
  std::printf("%-40s | %8.2f\n", "cudaMemsetAsync (one driver launch)", memset);
  std::printf("%-40s | %8.2f\n", "Tensor::zero_ (one PyTorch kernel)", zero);
  std::printf("%-40s | %8.2f\n", "cuBLASLt core (splitgrad::cuda::gemm)", core);
  std::printf("%-40s | %8.2f\n", "op (ops::linear_wgrad_accumulate_)", op);
  std::printf("%-40s | %8.2f\n", "at::addmm_ (PyTorch, for scale)", addmm);
  std::printf("%-40s | %8.2f\n", "backward_dw() (store, checks, op, ledger)", step);

  // The same ladder for a grouped layer's backward_dw() against a Linear's, the shapes of
  // bench_grouped.py's host section (bf16, 64 -> 512 features with biases, 512 tokens, fp32
  // main_grads, 32 experts, host splits and device splits): backward_dw() less the op is the
  // bookkeeping (store, sinks, ledger), the op less its launches the checks and tables.
  {
    const int64_t experts = 32, in = 64, out = 512, tokens = 512;
    const auto bf16 = torch::dtype(torch::kBFloat16).device(device);
    const torch::Tensor gx = torch::randn({tokens, in}, bf16).requires_grad_(true);
    const torch::Tensor gdy = torch::randn({tokens, out}, bf16);
    splitgrad::GroupedLinear experts_layer(splitgrad::GroupedLinearOptions(experts, in, out)
                                               .params_dtype(torch::kBFloat16)
                                               .device(device)
                                               .delay_wgrad_compute(true)
                                               .fuse_wgrad_accumulation(true));
    c10::List<std::optional<at::Tensor>> weight_targets, bias_targets;
    for (const auto& p : experts_layer->parameters()) {
      splitgrad::set_main_grad(p, torch::zeros(p.sizes(), f32));
    }
    for (int64_t e = 0; e < experts; ++e) {
      weight_targets.push_back(splitgrad::main_grad(experts_layer->weights[e]));
      bias_targets.push_back(splitgrad::main_grad(experts_layer->biases[e]));
    }
    splitgrad::Linear single(splitgrad::LinearOptions(in, out)
                                 .params_dtype(torch::kBFloat16)
                                 .device(device)
                                 .delay_wgrad_compute(true)
                                 .fuse_wgrad_accumulation(true));
    for (const auto& p : single->parameters()) {
      splitgrad::set_main_grad(p, torch::zeros(p.sizes(), f32));
    }
    const torch::Tensor host_splits = torch::full({experts}, tokens / experts, torch::kLong);
    const torch::Tensor device_splits = host_splits.to(device);
    const torch::Tensor x_plain = gx.detach();
    const int64_t reps = 2048;
    const double linear_op = host_us_per_call(true, reps, nothing, [&](int64_t) {
      const at::NoGradGuard no_grad;  // as backward_dw() calls it
      splitgrad::ops::linear_wgrad_accumulate_(gdy, x_plain, splitgrad::main_grad(single->weight),
                                               splitgrad::main_grad(single->bias));
    });
    const double linear_step = host_us_per_call(
        true, reps,
        [&](int64_t n) {
          for (int64_t i = 0; i < n; ++i) single->forward(gx).backward(gdy);
        },
        [&](int64_t) { single->backward_dw(); });
    std::printf(
        "\none backward_dw() of %lld experts against one Linear (host us per call, bf16, %lld -> "
        "%lld with biases, %lld tokens, fp32 main_grads)\n",
        static_cast<long long>(experts), static_cast<long long>(in), static_cast<long long>(out),
        static_cast<long long>(tokens));
    std::printf("%-40s | %8s | %8s | %8s\n", "", "op", "step", "step-op");
    std::printf("%-40s | %8.2f | %8.2f | %8.2f\n", "Linear", linear_op, linear_step,
                linear_step - linear_op);
    for (const auto* splits : {&host_splits, &device_splits}) {
      const double op = host_us_per_call(true, reps, nothing, [&](int64_t) {
        // As backward_dw() calls it: without grad mode, below the autograd keys.
        const at::NoGradGuard no_grad;
        const at::AutoDispatchBelowAutograd below_autograd;
        splitgrad::ops::grouped_linear_wgrad_accumulate_(gdy, x_plain, *splits, weight_targets,
                                                         bias_targets);
      });
      const double step = host_us_per_call(
          true, reps,
          [&](int64_t n) {
            for (int64_t i = 0; i < n; ++i) experts_layer->forward(gx, *splits).backward(gdy);
          },
          [&](int64_t) { experts_layer->backward_dw(); });
      std::printf("%-40s | %8.2f | %8.2f | %8.2f   (step %.2fx Linear's)\n",
                  splits->is_cuda() ? "GroupedLinear, device splits" : "GroupedLinear, host splits",
                  op, step, step - op, step / linear_step);
    }
  }

  // Graphed W steps: the backward_dw() of every layer captured once in a CUDA graph and replayed.
  // Each layer reads an input and a grad-output the benchmark holds, so the stash the graph reads
  // stays alive; one replay does every layer's W step.
  std::printf(
      "\nW steps replayed from a CUDA graph (host us per layer per W step; eager beside it)\n");
  std::printf("%6s | %14s | %14s | %s\n", "layers", "eager us", "graphed us", "graph checked");
  for (int layers : {1, 32, 128}) {
    std::vector<splitgrad::Linear> stack;
    std::vector<torch::Tensor> inputs, grads, outputs;
    for (int i = 0; i < layers; ++i) {
      stack.emplace_back(splitgrad::LinearOptions(16, 16)
                             .bias(false)
                             .device(device)
                             .delay_wgrad_compute(true)
                             .fuse_wgrad_accumulation(true));
      splitgrad::set_main_grad(stack.back()->weight, torch::zeros({16, 16}, f32));
      inputs.push_back(torch::randn({4, 16}, f32));
      grads.push_back(torch::randn({4, 16}, f32));
    }
    auto queue = [&] {
      outputs.clear();
      for (int i = 0; i < layers; ++i) outputs.push_back(stack[i]->forward(inputs[i]));
      torch::autograd::backward(outputs, grads);
    };
    auto run_w = [&] {
      for (auto it = stack.rbegin(); it != stack.rend(); ++it) (*it)->backward_dw();
    };
    queue();
    run_w();  // warm-up: plans, allocator
    const int64_t reps = std::max<int64_t>(8, 4096 / layers);
    const double eager = host_us_per_call(
                             true, reps,
                             [&](int64_t n) {
                               for (int64_t i = 0; i < n; ++i) queue();
                             },
                             [&](int64_t) { run_w(); }) /
                         layers;
    at::cuda::CUDAGraph graph;
    {
      const at::cuda::CUDAStreamGuard capture_stream(at::cuda::getStreamFromPool());
      queue();
      torch::cuda::synchronize();
      graph.capture_begin();
      run_w();
      graph.capture_end();
    }
    torch::cuda::synchronize();
    splitgrad::main_grad(stack[0]->weight).zero_();  // the timing loops filled it
    graph.replay();
    torch::cuda::synchronize();
    const torch::Tensor added = splitgrad::main_grad(stack[0]->weight);
    const bool checked = torch::allclose(added, grads[0].t().mm(inputs[0]), 1e-4, 1e-4);
    const double graphed =
        host_us_per_call(true, reps, nothing, [&](int64_t) { graph.replay(); }) / layers;
    std::printf("%6d | %14.2f | %14.2f | %s\n", layers, eager, graphed,
                checked ? "replay adds dy^T x" : "MISMATCH");
    if (!checked) return 1;
  }
#endif
  return 0;
}
