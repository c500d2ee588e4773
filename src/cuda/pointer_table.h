#pragma once
/// \file pointer_table.h
/// A device array of pointers known on the host (the experts' weights or gradient targets of a
/// grouped kernel), written by a kernel that takes them as parameters: nothing is read from host
/// memory on the stream, so the write is captured in a CUDA graph by value.

#include <cuda_runtime.h>

#include <cstdint>

namespace splitgrad::cuda {

/// device[i] = pointers[i] for i < count, on `stream` (count may be 0). Returns the launch's error.
cudaError_t write_pointer_table(const void* const* pointers, int64_t count, const void** device,
                                cudaStream_t stream);

}  // namespace splitgrad::cuda
