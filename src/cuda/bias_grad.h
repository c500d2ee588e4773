#pragma once
/// \file bias_grad.h
/// The bias gradient of a linear layer, db = Σ_tokens dy, as a column sum of dy (and of grouped
/// experts, a column sum per segment of dy's rows): framework-free (pointers and a stream),
/// deterministic (fixed summation order; no atomic adds), fp32 accumulation.
///
/// Two launches: each block sums a tile of `rows_per_block` rows x 256 columns into fp32
/// partial sums (16-byte loads where dy's rows allow), then 8 threads per column add the
/// partials in a fixed order and write `target = sum` or `target += sum`. It reads dy once and
/// needs `bias_grad_workspace_bytes()` of scratch.

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>

namespace splitgrad::cuda {

/// Arguments of bias_grad(). Element types (dy's and the target's): CUDA_R_32F, CUDA_R_16BF or
/// CUDA_R_16F.
struct BiasGradArgs {
  const void* dy = nullptr;  ///< [tokens, features], row-major, row stride `ld` (elements)
  cudaDataType_t dy_type = CUDA_R_32F;
  int64_t tokens = 0;
  int64_t features = 0;
  int64_t ld = 0;
  void* target = nullptr;  ///< [features], contiguous
  cudaDataType_t target_type = CUDA_R_32F;
  bool accumulate = false;     ///< `target += Σ dy` (true) or `target = Σ dy` (false)
  float* workspace = nullptr;  ///< at least bias_grad_workspace_bytes(tokens, features, sms)
  int multiprocessors = 1;     ///< the device's SM count: the tiling keeps every SM busy
};

/// Scratch bytes bias_grad() needs for these sizes on a device with `multiprocessors` SMs
/// (fp32 partial sums).
size_t bias_grad_workspace_bytes(int64_t tokens, int64_t features, int multiprocessors);

/// Launches the two kernels on `stream`; returns the launch's error (cudaSuccess if none), or
/// cudaErrorInvalidValue for an element type not listed above.
/// tokens == 0 writes zeros (or adds nothing); features == 0 launches nothing.
cudaError_t bias_grad(const BiasGradArgs& args, cudaStream_t stream);

/// Arguments of grouped_bias_grad(): the bias gradients of `groups` experts (MoE) whose rows are
/// consecutive segments of one dy, rows [offset_g, offset_g + splits[g]) for group g, in one pass
/// over dy. Element types as for BiasGradArgs.
struct GroupedBiasGradArgs {
  const void* dy = nullptr;  ///< [rows, cols], row-major, row stride `ld` (elements)
  cudaDataType_t dy_type = CUDA_R_32F;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  /// [groups] int64 row counts on the device, read only there (no host synchronisation). They are
  /// clamped, never read out of bounds: a negative split counts as 0, rows past `rows` are not
  /// read (splits summing to more), and rows past the splits' sum belong to no group.
  const int64_t* splits = nullptr;
  /// Optional, device, `groups` + 1 entries: the groups' first rows and the rows at the end, for
  /// splits already checked (non-negative, summing to `rows`), as the grouped GEMM's argument
  /// kernel writes them (GroupedGemmArgs::row_offsets); then one launch fewer. Null: computed
  /// from `splits` here, clamped as above.
  const int64_t* row_offsets = nullptr;
  /// With `row_offsets` (required then): device, grouped_bias_grad_tile_counters(cols, groups)
  /// words, zero when the kernel starts (the grouped GEMM's argument kernel zeroes them:
  /// GroupedGemmArgs::zeroed_words) and zero again when it ends. Without: unused (the workspace
  /// has its own, zeroed by the launch that computes the offsets).
  unsigned* tile_counters = nullptr;
  int64_t groups = 0;
  /// Device array of `groups` pointers to [cols] contiguous targets of `target_type`; a null entry
  /// skips its group. Groups sharing a target (tied experts) reach it in group order (with
  /// `distinct_targets` false, which they need).
  void* const* targets = nullptr;
  cudaDataType_t target_type = CUDA_R_32F;
  /// `target += Σ dy[group's rows]` (a group without rows adds nothing), or `target = Σ ...`
  /// (zeros for a group without rows).
  bool accumulate = true;
  /// No two groups' targets overlap (a target per expert): each group is then finished by the last
  /// block to sum its rows, all groups in parallel. False: the groups are finished one after the
  /// other in group order (shared targets are safe; the work of all groups falls on one block per
  /// 256 columns). Setting it for overlapping targets is a data race.
  bool distinct_targets = false;
  void* workspace = nullptr;  ///< at least grouped_bias_grad_workspace_bytes(), 16-byte aligned
  int multiprocessors = 1;    ///< the device's SM count: the tiling keeps every SM busy
};

/// Scratch bytes grouped_bias_grad() needs for these sizes (the groups' row offsets, tile
/// counters and fp32 partial sums).
size_t grouped_bias_grad_workspace_bytes(int64_t rows, int64_t cols, int64_t groups,
                                         int multiprocessors);

/// Counters (one per column tile, and one per column tile and group) that grouped_bias_grad()
/// needs zeroed where it is given row offsets.
int64_t grouped_bias_grad_tile_counters(int64_t cols, int64_t groups);

/// Launches two kernels on `stream` (one with `row_offsets`): the groups' row offsets from the
/// splits; and fp32 partial sums of tiles of rows (the tiling of bias_grad(), over all rows
/// whatever the routing, so imbalanced groups keep every SM busy; a tile crossing a group
/// boundary sums each group's part apart); the last block to sum a group's rows then adds its
/// partials in a fixed order and writes them (with shared targets, the last block of each column
/// tile does so for all groups in group order, so groups sharing a target reach it one after the
/// other). Deterministic: the only atomics count blocks.
/// Returns the launch's error (cudaSuccess if none), or cudaErrorInvalidValue for bad sizes, a
/// missing pointer (tile counters with row offsets) or an element type not listed above.
/// cols == 0 or groups == 0 launches nothing.
cudaError_t grouped_bias_grad(const GroupedBiasGradArgs& args, cudaStream_t stream);

}  // namespace splitgrad::cuda
