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
    const torch::Tensor before = splitgrad::main_grad(stack[0]->weight).clone();
    graph.replay();
    torch::cuda::synchronize();
    const torch::Tensor added = splitgrad::main_grad(stack[0]->weight) - before;
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
