// Host overhead of splitgrad from C++: CPU microseconds per forward and per backward_dw() on tiny
// shapes (16 x 16 weights, 4 tokens), for 1, 32 and 128 layers, next to plain torch::nn::Linear's
// forward. On CUDA the device work is queued, not waited for: this is the host's cost per call.
//
//   build/<dir>/bench_host_overhead [cuda|cpu]
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "splitgrad/splitgrad.h"

namespace {

using Clock = std::chrono::steady_clock;

double microseconds_since(Clock::time_point start, int64_t calls) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count() /
         static_cast<double>(calls);
}

}  // namespace

int main(int argc, char** argv) {
  const bool use_cuda = argc > 1 ? std::string(argv[1]) == "cuda" : torch::cuda::is_available();
  const torch::Device device = use_cuda ? torch::kCUDA : torch::kCPU;
  std::printf("host overhead per call from C++ (%s, 16x16 weights, 4 tokens)\n",
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
      splitgrad::set_main_grad(ours.back()->weight,
                               torch::zeros({16, 16}, torch::dtype(torch::kFloat).device(device)));
      plain.emplace_back(torch::nn::LinearOptions(16, 16).bias(false));
      plain.back()->to(device);
    }
    const torch::Tensor x =
        torch::randn({4, 16}, torch::dtype(torch::kFloat).device(device)).requires_grad_(true);
    const int64_t passes = std::max(4, 4000 / layers);

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
    forward_ours();
    forward_plain();
    auto start = Clock::now();
    for (int64_t i = 0; i < passes; ++i) forward_ours();
    const double fwd_ours = microseconds_since(start, passes * layers);
    start = Clock::now();
    for (int64_t i = 0; i < passes; ++i) forward_plain();
    const double fwd_plain = microseconds_since(start, passes * layers);

    for (int64_t i = 0; i < passes; ++i) forward_ours().sum().backward();
    if (use_cuda) torch::cuda::synchronize();
    start = Clock::now();
    for (int64_t i = 0; i < passes; ++i) {
      for (auto it = ours.rbegin(); it != ours.rend(); ++it) (*it)->backward_dw();
    }
    const double dw = microseconds_since(start, passes * layers);
    if (use_cuda) torch::cuda::synchronize();
    std::printf("%6d | %18.2f | %18.2f | %24.2f\n", layers, fwd_ours, fwd_plain, dw);
    if (splitgrad::pending_wgrads() != 0) {
      std::fprintf(stderr, "deferred work left over\n");
      return 1;
    }
  }
  return 0;
}
