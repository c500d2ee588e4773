#pragma once
/// \file group_tables.h
/// What the grouped kernels read per group, put on the device without a host synchronisation and
/// safely under CUDA-graph capture: tables of host-known 8-byte words (the experts' pointers, the
/// values of host splits) written by a kernel that takes them as parameters (nothing is read from
/// host memory on the stream, so a graph captures them by value, and later host writes cannot
/// change them), and the device-side check of splits that live on the device.

#include <cuda_runtime.h>

#include <cstdint>

namespace splitgrad::cuda {

/// device[i] = words[i] for i < count, on `stream` (count may be 0). Returns the launch's error.
cudaError_t write_table(const uint64_t* words, int64_t count, uint64_t* device,
                        cudaStream_t stream);

/// Checks `groups` int64 splits on the device: each non-negative, summing to `rows`; otherwise the
/// kernel prints the problem and stops with a device-side assertion (the launch that follows
/// never runs). For work that launches no grouped GEMM (whose argument kernel checks the same).
cudaError_t check_splits(const int64_t* splits, int64_t groups, int64_t rows, cudaStream_t stream);

}  // namespace splitgrad::cuda
