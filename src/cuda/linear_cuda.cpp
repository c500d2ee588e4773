// The CUDA back end: the three products of a linear layer on cuBLASLt (cuda/cublaslt_gemm.h), on
// the current stream, with memory from PyTorch's caching allocator.
//   fprop  y  = x·Wᵀ + b   bias added in the epilogue
//   dgrad  dx = dy·W
//   wgrad  dW = dyᵀ·x      written straight into its target (beta = 1 adds to main_grad or .grad),
//          db = Σ dy       by splitgrad's column-sum kernels (cuda/bias_grad.cu), straight into its
//                          target too; cuBLASLt's BGRADB epilogue runs as a second, slower kernel
//                          on Hopper and writes rather than adds, so it would need a scratch and an
//                          add
// Row-major [r, c] tensors are column-major [c, r] to cuBLAS; transposes are GEMM flags, not
// copies.
#include "cuda/linear_cuda.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "aten/linear_aten.h"
#include "cuda/bias_grad.h"
#include "cuda/cublaslt_gemm.h"
#include "ops/checks.h"

namespace splitgrad::cuda_backend {
namespace {

using cuda::Accumulate;
using cuda::Epilogue;
using cuda::GemmArgs;
using cuda::Operand;

bool covered(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

cudaDataType_t cuda_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    default:
      TORCH_CHECK_TYPE(false, "splitgrad cuBLASLt back end: unsupported dtype ",
                       detail::dtype_name(type));
  }
}

// fp32 products use TF32 only where PyTorch's torch.backends.cuda.matmul.allow_tf32 says so.
cublasComputeType_t compute_type(at::ScalarType inputs) {
  return inputs == at::kFloat && at::globalContext().allowTF32CuBLAS()
             ? CUBLAS_COMPUTE_32F_FAST_TF32
             : CUBLAS_COMPUTE_32F;
}

// `t` (2-D, logically row-major [r, c]) as a GEMM operand whose op() must equal t itself
// (`use_as_is`) or tᵀ. To cuBLAS a row-major tensor is tᵀ stored column-major, a column-major one
// is t; any other layout is copied to row-major first (kept alive in `storage`).
Operand operand(const at::Tensor& t, bool use_as_is, at::Tensor& storage) {
  const int64_t rows = t.size(0), cols = t.size(1);
  const bool row_major =
      (t.stride(1) == 1 || cols == 1) && t.stride(0) >= std::max<int64_t>(cols, 1);
  const bool column_major =
      !row_major && (t.stride(0) == 1 || rows == 1) && t.stride(1) >= std::max<int64_t>(rows, 1);
  storage = row_major || column_major ? t : t.contiguous();
  Operand op;
  op.data = storage.data_ptr();
  op.type = cuda_type(storage.scalar_type());
  if (column_major) {
    op.ld = storage.stride(1);
    op.transposed = !use_as_is;
  } else {
    op.ld = std::max<int64_t>({storage.stride(0), cols, 1});
    op.transposed = use_as_is;  // stored tᵀ: op(stored) = t needs the transpose flag
  }
  return op;
}

// A row-major output [r, c] with unit column stride: to cuBLAS a column-major [c, r] matrix.
bool writable_row_major(const at::Tensor& t) {
  return t.dim() == 2 && (t.stride(1) == 1 || t.size(1) == 1) &&
         t.stride(0) >= std::max<int64_t>(t.size(1), 1);
}

int64_t row_major_ld(const at::Tensor& t) { return std::max<int64_t>({t.stride(0), t.size(1), 1}); }

void run(GemmArgs& args, const char* what, const at::Tensor& a, const at::Tensor& b) {
  args.workspace = at::cuda::getCUDABlasLtWorkspace();
  args.workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  args.autotune = !at::globalContext().deterministicAlgorithms();
  const cuda::GemmStatus status =
      cuda::gemm(at::cuda::getCurrentCUDABlasLtHandle(), args, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status.ok, "splitgrad cuBLASLt ", what, " failed (", status.message,
              ", cublasStatus ", static_cast<int>(status.cublas), ") for operands of shape ",
              a.sizes(), " (", a.scalar_type(), ") and ", b.sizes(), " (", b.scalar_type(),
              "), m=", args.m, " n=", args.n, " k=", args.k);
}

// db = Σ_tokens dy into `target` ([features], contiguous, a covered dtype): written, or added
// (rounded to the target's dtype first, as `target.add_(db)` would). Partial sums live in the
// cuBLASLt workspace of the current stream when it is large enough and `shared_workspace` (stream
// order keeps them apart from the GEMMs'), else in a fresh buffer.
void reduce_bias_grad(const at::Tensor& dy, const at::Tensor& target, Accumulate accumulate,
                      bool shared_workspace = true) {
  const at::Tensor rows = dy.stride(1) == 1 || dy.size(1) <= 1 ? dy : dy.contiguous();
  cuda::BiasGradArgs args;
  args.dy = rows.data_ptr();
  args.dy_type = cuda_type(rows.scalar_type());
  args.tokens = rows.size(0), args.features = rows.size(1);
  args.ld = std::max<int64_t>({rows.stride(0), rows.size(1), 1});
  args.target = target.data_ptr();
  args.target_type = cuda_type(target.scalar_type());
  args.accumulate = accumulate == Accumulate::kAdd;
  args.multiprocessors = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const size_t bytes =
      cuda::bias_grad_workspace_bytes(args.tokens, args.features, args.multiprocessors);
  at::Tensor scratch;
  if (shared_workspace && bytes <= at::cuda::getCUDABlasLtWorkspaceSize()) {
    args.workspace = static_cast<float*>(at::cuda::getCUDABlasLtWorkspace());
  } else {
    scratch =
        at::empty({static_cast<int64_t>(bytes / sizeof(float))}, dy.options().dtype(at::kFloat));
    args.workspace = scratch.data_ptr<float>();
  }
  const cudaError_t error = cuda::bias_grad(args, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error == cudaSuccess, "splitgrad bias gradient kernel failed (",
              cudaGetErrorString(error), ") for grad_output of shape ", dy.sizes(), " (",
              dy.scalar_type(), ") into a ", target.scalar_type(), " bias gradient");
}

// Whether the bias kernel can write `target` directly (else ATen sums).
bool bias_target_direct(const at::Tensor& target) {
  return covered(target.scalar_type()) && target.dim() == 1 && target.is_contiguous();
}

}  // namespace

void fprop_into(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& y) {
  const int64_t tokens = x.size(0), in = weight.size(1), out = weight.size(0);
  if (tokens == 0 || out == 0) return;
  TORCH_INTERNAL_ASSERT(writable_row_major(y) && y.size(0) == tokens && y.size(1) == out);
  const bool has_bias = bias.has_value() && bias->defined();
  if (in == 0) {
    has_bias ? y.copy_(bias->expand({tokens, out})) : y.zero_();
    return;
  }
  // D (col-major [out, tokens]) = op(A) [out, in] · op(B) [in, tokens], A = W, B = xᵀ.
  at::Tensor a_storage, b_storage, bias_storage;
  GemmArgs args;
  args.m = out, args.n = tokens, args.k = in;
  args.a = operand(weight, /*use_as_is=*/true, a_storage);
  args.b = operand(x, /*use_as_is=*/false, b_storage);
  args.d = y.data_ptr(), args.d_type = cuda_type(y.scalar_type()), args.ldd = row_major_ld(y);
  args.compute = compute_type(x.scalar_type());
  if (has_bias) {
    bias_storage = bias->contiguous();
    args.epilogue = Epilogue::kBias;
    args.bias = bias_storage.data_ptr();
    args.bias_type = args.d_type;
  }
  run(args, "fprop", x, weight);
}

void dgrad_into(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& dx) {
  const int64_t tokens = dy.size(0), in = weight.size(1), out = weight.size(0);
  if (tokens == 0 || in == 0) return;
  TORCH_INTERNAL_ASSERT(writable_row_major(dx) && dx.size(0) == tokens && dx.size(1) == in);
  if (out == 0) {
    dx.zero_();
    return;
  }
  // D (col-major [in, tokens]) = op(A) [in, out] · op(B) [out, tokens], A = Wᵀ, B = dyᵀ.
  at::Tensor a_storage, b_storage;
  GemmArgs args;
  args.m = in, args.n = tokens, args.k = out;
  args.a = operand(weight, /*use_as_is=*/false, a_storage);
  args.b = operand(dy, /*use_as_is=*/false, b_storage);
  args.d = dx.data_ptr(), args.d_type = cuda_type(dx.scalar_type()), args.ldd = row_major_ld(dx);
  args.compute = compute_type(dy.scalar_type());
  run(args, "dgrad", dy, weight);
}

bool covers(at::ScalarType type) { return covered(type); }

at::Tensor linear_fprop(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  detail::check_linear_args(detail::named("splitgrad::linear_fprop"), input, weight, bias);
  if (!covered(input.scalar_type())) return aten_backend::linear_fprop(input, weight, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = detail::flatten_tokens(input);
  const int64_t out = weight.size(0);
  at::Tensor y = at::empty({x.size(0), out}, input.options());
  fprop_into(x, weight, bias, y);
  return input.dim() == 2 ? y : y.view(detail::with_last_dim(input.sizes(), out));
}

at::Tensor linear_dgrad(const at::Tensor& grad_output, const at::Tensor& weight) {
  detail::check_dgrad_args(detail::named("splitgrad::linear_dgrad"), grad_output, weight);
  if (!covered(grad_output.scalar_type())) return aten_backend::linear_dgrad(grad_output, weight);
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const int64_t in = weight.size(1);
  at::Tensor dx = at::empty({dy.size(0), in}, grad_output.options());
  dgrad_into(dy, weight, dx);
  return grad_output.dim() == 2 ? dx : dx.view(detail::with_last_dim(grad_output.sizes(), in));
}

namespace {

// dW into `weight_target` (row-major [out, in]) by one GEMM D (col-major [in, out]) = op(A)
// [in, tokens] · op(B) [tokens, out], A = xᵀ, B = dy; `accumulate` adds to the target (beta = 1).
void wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight_target,
                Accumulate accumulate) {
  at::Tensor a_storage, b_storage;
  GemmArgs args;
  args.m = x.size(1), args.n = dy.size(1), args.k = dy.size(0);
  args.a = operand(x, /*use_as_is=*/false, a_storage);
  args.b = operand(dy, /*use_as_is=*/true, b_storage);
  args.d = weight_target.data_ptr();
  args.d_type = cuda_type(weight_target.scalar_type());
  args.ldd = row_major_ld(weight_target);
  args.accumulate = accumulate;
  args.compute = compute_type(dy.scalar_type());
  run(args, "wgrad", dy, x);
}

// From this many elements of dy up, wgrad-accumulate runs the bias gradient's column sum on a
// side stream while the GEMM runs (benchmarks/probe_bias_overlap.py on the H200: the bias then
// costs +0-2% over the bias-free GEMM on the large wgrad shapes, against +2-10% one after the
// other). The same kernel either way: the numerics do not change.
constexpr int64_t kOverlapBiasElements = int64_t{1} << 21;

// weight_grad (+)= dyᵀ·x and bias_grad (+)= Σ dy, the sum on a pool stream (high priority, so its
// blocks take SMs as the GEMM's retire) forked from and joined back into the current one; the
// partial sums in a buffer of the side stream's, not the cuBLASLt workspace the GEMM uses. Every
// later use of dy, the targets or the buffer is ordered after the join.
void wgrad_and_bias_overlapped(const at::Tensor& dy, const at::Tensor& x,
                               const at::Tensor& weight_grad, const at::Tensor& bias_grad,
                               Accumulate accumulate) {
  const c10::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream();
  const c10::cuda::CUDAStream side =
      c10::cuda::getStreamFromPool(/*isHighPriority=*/true, current.device_index());
  at::cuda::CUDAEvent forked, joined;
  forked.record(current);
  forked.block(side);
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    reduce_bias_grad(dy, bias_grad, accumulate, /*shared_workspace=*/false);
    joined.record(side);
  }
  wgrad_gemm(dy, x, weight_grad, accumulate);
  joined.block(current);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_wgrad(const at::Tensor& grad_output,
                                                const at::Tensor& input, bool compute_bias_grad) {
  detail::check_wgrad_args(detail::named("splitgrad::linear_wgrad"), grad_output, input);
  if (!covered(input.scalar_type())) {
    return aten_backend::linear_wgrad(grad_output, input, compute_bias_grad);
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  const int64_t out = dy.size(1), in = x.size(1);
  at::Tensor weight_grad = at::empty({out, in}, input.options());
  at::Tensor bias_grad = at::empty({compute_bias_grad ? out : 0}, input.options());
  if (out == 0 || in == 0 || dy.size(0) == 0) {  // nothing to multiply: the sums are zero
    weight_grad.zero_();
  } else if (compute_bias_grad && dy.numel() >= kOverlapBiasElements) {
    wgrad_and_bias_overlapped(dy, x, weight_grad, bias_grad, Accumulate::kOverwrite);
    return {weight_grad, bias_grad};
  } else {
    wgrad_gemm(dy, x, weight_grad, Accumulate::kOverwrite);
  }
  if (compute_bias_grad) reduce_bias_grad(dy, bias_grad, Accumulate::kOverwrite);
  return {weight_grad, bias_grad};
}

void linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                              const std::optional<at::Tensor>& weight_grad,
                              const std::optional<at::Tensor>& bias_grad) {
  detail::check_wgrad_accumulate_args(detail::named("splitgrad::linear_wgrad_accumulate_"),
                                      grad_output, input, weight_grad, bias_grad);
  const bool want_weight = weight_grad.has_value() && weight_grad->defined();
  const bool want_bias = bias_grad.has_value() && bias_grad->defined();
  const bool weight_direct =
      !want_weight || (covered(weight_grad->scalar_type()) && writable_row_major(*weight_grad));
  if (!covered(input.scalar_type()) || !weight_direct) {
    return aten_backend::linear_wgrad_accumulate_(grad_output, input, weight_grad, bias_grad);
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  if (dy.size(0) == 0 || dy.size(1) == 0) return;  // adds zero
  const bool gemm = want_weight && x.size(1) > 0;
  if (gemm && want_bias && bias_target_direct(*bias_grad) && dy.numel() >= kOverlapBiasElements) {
    return wgrad_and_bias_overlapped(dy, x, *weight_grad, *bias_grad, Accumulate::kAdd);
  }
  if (gemm) wgrad_gemm(dy, x, *weight_grad, Accumulate::kAdd);
  if (want_bias) {
    if (bias_target_direct(*bias_grad)) {
      reduce_bias_grad(dy, *bias_grad, Accumulate::kAdd);
    } else {  // a strided or other-dtype target: ATen's sum, added in the target's dtype
      bias_grad->add_(at::sum(dy, {0}, /*keepdim=*/false, bias_grad->scalar_type()));
    }
  }
}

TORCH_LIBRARY_IMPL(splitgrad, CUDA, m) {
  m.impl("linear_fprop", &linear_fprop);
  m.impl("linear_dgrad", &linear_dgrad);
  m.impl("linear_wgrad", &linear_wgrad);
  m.impl("linear_wgrad_accumulate_", &linear_wgrad_accumulate_);
}

}  // namespace splitgrad::cuda_backend
