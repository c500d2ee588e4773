#pragma once
/// \file grouped_gemm.h
/// The grouped linear products in one launch each, framework-free (pointers and a stream): the
/// rows of a [rows, features] tensor are split into groups (experts) by a split tensor that stays
/// on the device, and group g's rows go through its own weight. Nothing here reads the splits on
/// the host, so a router's counts never force a synchronisation.
///
/// Built on CUTLASS's SM90 pointer-array grouped kernels (TMA + warp-specialised GMMA): a small
/// kernel turns the splits into each group's problem size and pointers on the device, then one
/// persistent kernel runs every group's tiles. Each output tile is computed by one block in a
/// fixed order (no split-K, no atomics), so results are deterministic.
///
/// Splits are checked on the device (cuda/split_check.cuh): a negative split or splits that do
/// not sum to `rows` stop the kernel with a device-side assertion (as PyTorch's indexing kernels
/// check indices), before any memory outside the tensors is touched.

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>

namespace splitgrad::cuda {

/// Which product. Inputs are bf16, row-major with unit column stride and rows `features` apart.
enum class GroupedProduct {
  fprop,  ///< out[rows of g] = tokens[rows of g] · weights[g]ᵀ   (tokens [rows, in], out [rows, out])
  dgrad,  ///< out[rows of g] = tokens[rows of g] · weights[g]    (tokens [rows, out], out [rows, in])
  /// targets[g] += tokens[rows of g]ᵀ · tokens_in[rows of g]      (tokens = dy [rows, out],
  /// tokens_in = x [rows, in], targets [out, in]); the sum in fp32, added in the target's type.
  wgrad_accumulate,
};

struct GroupedGemmArgs {
  GroupedProduct product = GroupedProduct::fprop;
  int64_t groups = 0;
  int64_t rows = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
  const int64_t* splits = nullptr;   ///< device, `groups` entries: the rows of each group, in order
  const void* tokens = nullptr;      ///< fprop: x; dgrad and wgrad: dy
  const void* tokens_in = nullptr;   ///< wgrad: x
  const void* const* weights = nullptr;  ///< fprop, dgrad: device array of `groups` [out, in]
  void* out = nullptr;                   ///< fprop: y [rows, out]; dgrad: dx [rows, in]
  /// fprop, dgrad: out += the product (beta = 1, the sum in fp32 and rounded once), e.g. out
  /// holding each row's bias; otherwise out = the product.
  bool add_to_out = false;
  void* const* targets = nullptr;  ///< wgrad: device array of `groups` [out, in]; nullptr skips g
  /// wgrad: the targets' type, CUDA_R_32F (fp32 main_grad) or CUDA_R_16BF. Two groups of one
  /// launch must not share a target (the caller splits tied targets over launches).
  cudaDataType_t target_type = CUDA_R_32F;
  /// wgrad: targets[g] = the product instead of +=, zeros for a group without rows (fresh
  /// gradients in uninitialised memory: no fill first, and the epilogue reads no target).
  bool overwrite_targets = false;
  /// Optional, device, `groups` + 1 entries: the argument kernel also writes each group's first
  /// row there, and the rows at the end, for a grouped_bias_grad() of the same splits that follows
  /// on the stream (GroupedBiasGradArgs::row_offsets), which then skips computing them.
  int64_t* row_offsets = nullptr;
  /// Optional, device: `zeroed_word_count` words the argument kernel sets to zero, for that
  /// grouped_bias_grad() too (GroupedBiasGradArgs::tile_counters).
  unsigned* zeroed_words = nullptr;
  int64_t zeroed_word_count = 0;
  /// Optional: host words the argument kernel writes to the device array `table` before it reads
  /// anything, so that `splits`, `weights` and `targets` may point into `table` (one launch fewer
  /// than writing it first; taken by value, as write_table() does, see cuda/group_tables.h).
  const uint64_t* table_words = nullptr;
  int64_t table_word_count = 0;
  uint64_t* table = nullptr;
  void* workspace = nullptr;  ///< grouped_gemm_workspace_bytes(*this) bytes, 256-byte aligned
  int multiprocessors = 1;    ///< SMs the persistent kernel may use
  /// The device's peak DRAM bandwidth (0: unknown): the fp32 wgrad's schedule depends on it.
  double memory_bytes_per_second = 0;
};

/// Whether this build has the grouped kernels (compiled for sm_90a) and the device runs them.
bool grouped_gemm_runs_on(int major, int minor);

/// Scratch bytes grouped_gemm() needs for these arguments (pointers may still be null).
size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& args);

/// Launches the argument kernel and the grouped GEMM on `stream`. Returns cudaSuccess, the
/// launch's error, or cudaErrorNotSupported where the kernel cannot take the arguments (a
/// feature count not a multiple of 8, a pointer not 16-byte aligned, this device).
cudaError_t grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace splitgrad::cuda
