#pragma once
/// \file cublaslt_gemm.h
/// splitgrad's GEMM core on cuBLASLt: framework-free (CUDA types only), column-major as cuBLAS is.
///
/// Computes D = alpha · op(A) · op(B) + beta · D, with op(X) = X or Xᵀ, and an optional epilogue:
///   - Epilogue::kBias: D += bias, bias of length m broadcast over the n columns (fprop's b).
/// (wgrad's db = Σ_tokens dy is cuda/bias_grad.h's: BGRADB runs as a second kernel on Hopper.)
/// A row-major [r, c] tensor with row stride ld is, to cuBLAS, a column-major [c, r] matrix with
/// leading dimension ld: the callers (linear_cuda.cpp) map the three linear products onto this.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace splitgrad::cuda {

enum class Epilogue {
  kNone,
  kBias,  ///< D += bias (bias: m elements, bias_type)
};

/// Whether D's old contents are kept: beta = 1 adds the product to D ("+="), beta = 0 replaces it.
enum class Accumulate { kOverwrite, kAdd };

/// One matrix operand: column-major `rows x cols` as stored, with leading dimension `ld`.
struct Operand {
  const void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  int64_t ld = 0;
  bool transposed = false;  ///< use Xᵀ: the stored matrix is [k, m] for A, [n, k] for B
};

struct GemmArgs {
  int64_t m = 0;      ///< rows of D and op(A)
  int64_t n = 0;      ///< columns of D and op(B)
  int64_t k = 0;      ///< columns of op(A), rows of op(B)
  Operand a;          ///< op(A): [m, k]
  Operand b;          ///< op(B): [k, n]
  void* d = nullptr;  ///< D: column-major [m, n], leading dimension ldd
  cudaDataType_t d_type = CUDA_R_32F;
  int64_t ldd = 0;
  Accumulate accumulate = Accumulate::kOverwrite;
  Epilogue epilogue = Epilogue::kNone;
  void* bias = nullptr;  ///< read by kBias
  cudaDataType_t bias_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  ///< CUBLAS_COMPUTE_32F_FAST_TF32 allows TF32
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  /// Whether a new plan may time the heuristic's candidates (false keeps its first choice: for
  /// torch.use_deterministic_algorithms). Either way the numerics are the first choice's.
  bool autotune = true;
};

/// Status of a GEMM call; `message` is a static description when ok is false.
struct GemmStatus {
  bool ok = true;
  const char* message = "";
  cublasStatus_t cublas = CUBLAS_STATUS_SUCCESS;
};

/// Runs one GEMM on `stream`. Descriptors and the algorithm are cached per shape, dtypes, layouts,
/// epilogue and operand alignment — not per `accumulate`: writing and adding share one algorithm,
/// so both do the same arithmetic — and a repeated call costs one launch.
/// Reproducible numerics: the algorithm always computes what the heuristic's first choice
/// computes, bit for bit. The first call for a new combination (outside CUDA-graph capture) times
/// up to 8 of the heuristic's candidates on scratch operands of fixed pseudo-random values, each
/// as a lone call with that call's beta, and keeps the fastest of those whose output equals the
/// first choice's bit for bit, written and added, if it beats the first choice by 2% (it waits
/// for `stream`); SPLITGRAD_CUBLASLT_AUTOTUNE=0 or `args.autotune = false` keeps the first.
/// Returns !ok (and launches nothing) when cuBLASLt has no algorithm for the combination.
GemmStatus gemm(cublasLtHandle_t handle, const GemmArgs& args, cudaStream_t stream);

}  // namespace splitgrad::cuda
