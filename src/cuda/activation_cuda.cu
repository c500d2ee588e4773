// The CUDA kernels of splitgrad::activation and splitgrad::activation_backward for TE's gated
// activations ("geglu", "reglu", "swiglu": input = [a | b] along the last dim, y = act(a) * b), one
// pass each over contiguous bf16 / fp16 / fp32 rows:
//   forward   reads a and b once, writes y once
//   backward  reads grad, a and b once, writes both halves of d input once
// Everything else (the plain activations, the other gated ones, other dtypes, non-contiguous
// tensors) runs the ATen composite the kernels replace (src/aten/activation_aten.cpp). Both check
// their arguments with the same detail::check_activation_args, so the errors are one set.
//
// Numerics: the results are bit-identical to that composite and to torch.autograd of it, because
// LayerNormMLP's recomputed forward and its delayed and immediate gradients are compared bit for
// bit with plain PyTorch. So each kernel rounds where ATen materialises a tensor in the input
// dtype, and uses ATen's own CUDA formulas (ActivationGeluKernel.cu's tanh GELU,
// ActivationSiluKernel.cu, clamp_min / threshold_backward for ReLU), in fp32:
//   forward   act = T(act(a));                y = T(act * b)
//   backward  g_act = T(grad * b) (MulBackward's grad of act(a));  da = T(act'(g_act, a))
//             db = T(grad * T(act(a)))        (MulBackward's grad of b, act(a) as saved)
#define _USE_MATH_DEFINES
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMathCompat.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "aten/activation_aten.h"
#include "cuda/float_convert.cuh"
#include "ops/checks.h"

namespace splitgrad::cuda_backend {
namespace {

using cuda::from_float;
using cuda::to_float;

enum class Act { kGelu, kRelu, kSilu };

struct Activation {
  Act act;
  bool fused;  // one of the gated activations these kernels compute
};

// The name, checked already (detail::check_activation_args).
Activation parse_activation(c10::string_view name) {
  if (name == "geglu") return {Act::kGelu, true};
  if (name == "reglu") return {Act::kRelu, true};
  if (name == "swiglu") return {Act::kSilu, true};
  return {Act::kSilu, false};  // the others run the ATen composite
}

// ---- Device math: ATen's CUDA formulas, in fp32 (opmath for bf16 / fp16 / fp32).

template <Act A>
struct Formula;

template <>
struct Formula<Act::kGelu> {  // ActivationGeluKernel.cu, GeluType::Tanh
  __device__ __forceinline__ static float forward(float x) {
    constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * float(0.5);
    constexpr float kKappa = 0.044715;
    auto x_cube = x * x * x;
    auto inner = kBeta * (x + kKappa * x_cube);
    return float(0.5) * x * (float(1) + c10::cuda::compat::tanh(inner));
  }
  __device__ __forceinline__ static float backward(float dy, float x) {
    constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * float(0.5);
    constexpr float kKappa = 0.044715;
    auto x_sq = x * x;
    auto x_cube = x_sq * x;
    auto inner = kBeta * (x + kKappa * x_cube);
    auto tanh_inner = c10::cuda::compat::tanh(inner);
    auto left = float(0.5) * x;
    auto right = float(1) + tanh_inner;
    auto left_derivative = float(0.5) * right;
    auto tanh_derivative = float(1) - tanh_inner * tanh_inner;
    auto inner_derivative = kBeta * (float(1) + float(3) * kKappa * x_sq);
    auto right_derivative = left * tanh_derivative * inner_derivative;
    return dy * (left_derivative + right_derivative);
  }
};

template <>
struct Formula<Act::kRelu> {  // relu = clamp_min(x, 0) (NaN kept); its grad threshold_backward
  __device__ __forceinline__ static float forward(float x) {
    return ::isnan(x) ? x : ::max(x, 0.0f);
  }
  __device__ __forceinline__ static float backward(float dy, float x) {
    return x <= 0.0f ? 0.0f : dy;
  }
};

template <>
struct Formula<Act::kSilu> {  // ActivationSiluKernel.cu
  __device__ __forceinline__ static float forward(float x) {
    return x / (float(1) + c10::cuda::compat::exp(-x));
  }
  __device__ __forceinline__ static float backward(float dy, float x) {
    const float s = float(1) / (float(1) + c10::cuda::compat::exp(-x));
    return dy * s * (float(1) + x * (float(1) - s));
  }
};

// act(a) as ATen materialises it: rounded to T.
template <Act A, typename T>
__device__ __forceinline__ T act_rounded(T a) {
  return from_float<T>(Formula<A>::forward(to_float(a)));
}

// ---- Kernels. Block (bx, by): x walks a row's packs (W elements each: 16 bytes, or 1 element on
// the scalar path), y walks rows, grid-stride over rows (gridDim.y is capped). A row of the input
// is [a: n | b: n], of y and grad n wide; `packs` = n / W.

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

template <Act A, typename T, int W>
__global__ void __launch_bounds__(kThreads)
    gated_forward(const Pack<T, W>* __restrict__ input, Pack<T, W>* __restrict__ out, int64_t rows,
                  int64_t packs) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= packs) return;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const Pack<T, W>* in_row = input + row * 2 * packs;
    const Pack<T, W> a = in_row[col];
    const Pack<T, W> b = in_row[packs + col];
    Pack<T, W> y;
#pragma unroll
    for (int j = 0; j < W; ++j)
      y.v[j] = from_float<T>(to_float(act_rounded<A>(a.v[j])) * to_float(b.v[j]));
    out[row * packs + col] = y;
  }
}

template <Act A, typename T, int W>
__global__ void __launch_bounds__(kThreads)
    gated_backward(const Pack<T, W>* __restrict__ grad, const Pack<T, W>* __restrict__ input,
                   Pack<T, W>* __restrict__ grad_input, int64_t rows, int64_t packs) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= packs) return;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const int64_t in_offset = row * 2 * packs + col;
    const Pack<T, W> g = grad[row * packs + col];
    const Pack<T, W> a = input[in_offset];
    const Pack<T, W> b = input[in_offset + packs];
    Pack<T, W> da;
    Pack<T, W> db;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float g_j = to_float(g.v[j]);
      const T g_act = from_float<T>(g_j * to_float(b.v[j]));
      da.v[j] = from_float<T>(Formula<A>::backward(to_float(g_act), to_float(a.v[j])));
      db.v[j] = from_float<T>(g_j * to_float(act_rounded<A>(a.v[j])));
    }
    grad_input[in_offset] = da;
    grad_input[in_offset + packs] = db;
  }
}

// ---- Launch

struct Launch {
  dim3 grid;
  dim3 block;
};

// bx: the smallest power of two >= packs (at most 256); the rest of the block's threads take
// further rows, so narrow rows still fill whole warps.
Launch launch_shape(int64_t rows, int64_t packs) {
  int bx = 1;
  while (bx < kThreads && bx < packs) bx *= 2;
  const int by = kThreads / bx;
  const int64_t grid_x = (packs + bx - 1) / bx;
  const int64_t grid_y = std::min<int64_t>((rows + by - 1) / by, kMaxGridY);
  TORCH_CHECK(grid_x <= std::numeric_limits<int32_t>::max(), "splitgrad activation: rows of ",
              packs, " packs are too wide for one grid");
  return {dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)),
          dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by))};
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The fused kernels take contiguous bf16 / fp16 / fp32 tensors of one dtype on one device.
bool fusable(std::initializer_list<const at::Tensor*> tensors) {
  const at::Tensor& first = **tensors.begin();
  const at::ScalarType type = first.scalar_type();
  if (type != at::kBFloat16 && type != at::kHalf && type != at::kFloat) return false;
  for (const at::Tensor* t : tensors) {
    if (t->scalar_type() != type || t->device() != first.device() || !t->is_contiguous())
      return false;
  }
  return true;
}

// Calls fn.template operator()<A, T>() for the runtime activation and dtype.
template <typename Fn>
void dispatch(Act act, at::ScalarType type, Fn&& fn) {
  auto by_type = [&](auto act_constant) {
    constexpr Act A = decltype(act_constant)::value;
    switch (type) {
      case at::kBFloat16:
        fn.template operator()<A, __nv_bfloat16>();
        break;
      case at::kHalf:
        fn.template operator()<A, __half>();
        break;
      case at::kFloat:
        fn.template operator()<A, float>();
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "unfusable dtype reached the kernels");
    }
  };
  switch (act) {
    case Act::kGelu:
      by_type(std::integral_constant<Act, Act::kGelu>{});
      break;
    case Act::kRelu:
      by_type(std::integral_constant<Act, Act::kRelu>{});
      break;
    case Act::kSilu:
      by_type(std::integral_constant<Act, Act::kSilu>{});
      break;
  }
}

struct ForwardLaunch {
  const void* input;
  void* out;
  int64_t rows;
  int64_t n;
  cudaStream_t stream;

  template <Act A, typename T>
  void operator()() const {
    constexpr int kVec = 16 / sizeof(T);
    if (n % kVec == 0 && aligned16(input) && aligned16(out)) {
      using P = Pack<T, kVec>;
      const Launch l = launch_shape(rows, n / kVec);
      gated_forward<A, T, kVec><<<l.grid, l.block, 0, stream>>>(
          static_cast<const P*>(input), static_cast<P*>(out), rows, n / kVec);
    } else {
      using P = Pack<T, 1>;
      const Launch l = launch_shape(rows, n);
      gated_forward<A, T, 1><<<l.grid, l.block, 0, stream>>>(static_cast<const P*>(input),
                                                             static_cast<P*>(out), rows, n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

struct BackwardLaunch {
  const void* grad;
  const void* input;
  void* grad_input;
  int64_t rows;
  int64_t n;
  cudaStream_t stream;

  template <Act A, typename T>
  void operator()() const {
    constexpr int kVec = 16 / sizeof(T);
    if (n % kVec == 0 && aligned16(grad) && aligned16(input) && aligned16(grad_input)) {
      using P = Pack<T, kVec>;
      const Launch l = launch_shape(rows, n / kVec);
      gated_backward<A, T, kVec><<<l.grid, l.block, 0, stream>>>(
          static_cast<const P*>(grad), static_cast<const P*>(input), static_cast<P*>(grad_input),
          rows, n / kVec);
    } else {
      using P = Pack<T, 1>;
      const Launch l = launch_shape(rows, n);
      gated_backward<A, T, 1><<<l.grid, l.block, 0, stream>>>(static_cast<const P*>(grad),
                                                              static_cast<const P*>(input),
                                                              static_cast<P*>(grad_input), rows, n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// ---- The ops

at::Tensor activation_cuda(const at::Tensor& input, c10::string_view name) {
  detail::check_activation_args(detail::named("splitgrad::activation"), input, std::string(name));
  const Activation activation = parse_activation(name);
  if (!activation.fused || !fusable({&input})) return aten_backend::activation(input, name);
  c10::cuda::CUDAGuard guard(input.device());
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, input.options());
  if (out.numel() == 0) return out;
  const int64_t n = sizes.back();
  dispatch(activation.act, input.scalar_type(),
           ForwardLaunch{input.const_data_ptr(), out.mutable_data_ptr(), out.numel() / n, n,
                         at::cuda::getCurrentCUDAStream()});
  return out;
}

at::Tensor activation_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                    c10::string_view name) {
  detail::check_activation_backward_args(detail::named("splitgrad::activation_backward"),
                                         grad_output, input, std::string(name));
  const Activation activation = parse_activation(name);
  if (!activation.fused || !fusable({&input, &grad_output})) {
    return aten_backend::activation_backward(grad_output, input, name);
  }
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  if (grad_input.numel() == 0) return grad_input;
  const int64_t n = grad_output.size(-1);
  dispatch(activation.act, input.scalar_type(),
           BackwardLaunch{grad_output.const_data_ptr(), input.const_data_ptr(),
                          grad_input.mutable_data_ptr(), grad_output.numel() / n, n,
                          at::cuda::getCurrentCUDAStream()});
  return grad_input;
}

}  // namespace
}  // namespace splitgrad::cuda_backend

TORCH_LIBRARY_IMPL(splitgrad, CUDA, m) {
  m.impl("activation", &splitgrad::cuda_backend::activation_cuda);
  m.impl("activation_backward", &splitgrad::cuda_backend::activation_backward_cuda);
}
