// The CUDA back end of the grouped ops. On Hopper, for bf16 operands with contiguous rows, each
// product is one launch of the grouped kernels (cuda/grouped_gemm.h): the splits stay on the
// device, so a router's counts never synchronise the host, and the weight gradients go straight
// into their targets (fp32 main_grad or the .grad) with beta = 1. Elsewhere (other dtypes or
// devices, strided operands) a loop over the groups runs the cuBLASLt linear products
// (cuda/linear_cuda.h) on views of each group's rows; it reads the splits on the host, which waits
// for the device when they live there.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "aten/linear_aten.h"
#include "cuda/bias_grad.h"
#include "cuda/group_tables.h"
#include "cuda/grouped_gemm.h"
#include "cuda/linear_cuda.h"
#include "ops/checks.h"

namespace splitgrad::cuda_backend {
namespace {

using OptTensorList = c10::List<std::optional<at::Tensor>>;

// The splits on the host, checked (a device tensor is copied, which waits for the stream).
std::vector<int64_t> host_splits(detail::Who who, const at::Tensor& m_splits, int64_t rows) {
  return detail::split_sizes(who, m_splits.device().is_cpu() ? m_splits : m_splits.cpu(), rows);
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Whether the grouped kernels take these operands: bf16 on a device they run on, each operand
// contiguous and 16-byte aligned (a view of one group's rows of a larger tensor is not).
bool grouped_kernels_take(std::initializer_list<std::reference_wrapper<const at::Tensor>> operands,
                          at::TensorList more = {}) {
  const at::Tensor& first = operands.begin()->get();
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(first.device().index());
  if (!cuda::grouped_gemm_runs_on(props->major, props->minor)) return false;
  const auto fits = [](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 && t.is_contiguous() && aligned16(t);
  };
  for (const at::Tensor& t : operands) {
    if (!fits(t)) return false;
  }
  for (const at::Tensor& t : more) {
    if (!fits(t)) return false;
  }
  return true;
}

size_t aligned256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Bytes per element of a gradient target of the grouped kernels (fp32 or bf16).
size_t target_element_bytes(cudaDataType_t type) {
  return type == CUDA_R_32F ? sizeof(float) : sizeof(uint16_t);
}

// Room on the device for `words` 8-byte words, as an int64 tensor, and `extra_bytes` more after
// them, from a 256-byte boundary: a launch's workspace in the same allocation (host time).
at::Tensor table_space(size_t words, const at::Tensor& like, size_t extra_bytes = 0) {
  const size_t words_bytes = words * sizeof(uint64_t);
  const size_t bytes = extra_bytes > 0 ? aligned256(words_bytes) + extra_bytes : words_bytes;
  return at::empty({static_cast<int64_t>((bytes + 7) / 8)}, like.options().dtype(at::kLong));
}

// Host words (pointers, split values) written to the start of `table` by a kernel that takes them
// by value (cuda/group_tables.h): graph-capturable, and later host writes to the words' source
// cannot reach the device copy.
void write_words(const std::vector<uint64_t>& words, const at::Tensor& table) {
  const cudaError_t status = cuda::write_table(words.data(), static_cast<int64_t>(words.size()),
                                               reinterpret_cast<uint64_t*>(table.data_ptr()),
                                               at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "splitgrad grouped GEMM: writing a group table failed (",
              cudaGetErrorString(status), ")");
}

at::Tensor device_table(const std::vector<uint64_t>& words, const at::Tensor& like) {
  at::Tensor table = table_space(words.size(), like);
  write_words(words, table);
  return table;
}

// The splits as the grouped kernels read them: int64 on the device. A CPU tensor's values are
// checked here and written by value; a device tensor's are checked on the device, here by
// `check_now` (for work that launches no grouped GEMM, whose argument kernel checks them).
at::Tensor device_splits(detail::Who who, const at::Tensor& m_splits, const at::Tensor& rows_of,
                         bool check_now = false) {
  if (m_splits.device().is_cpu()) {
    const std::vector<int64_t> sizes = detail::split_sizes(who, m_splits, rows_of.size(0));
    return device_table(std::vector<uint64_t>(sizes.begin(), sizes.end()), rows_of);
  }
  const at::Tensor splits = m_splits.contiguous();
  TORCH_CHECK_VALUE(splits.numel() > 0 || rows_of.size(0) == 0, who(),
                    ": expected m_splits to sum to the input's ", rows_of.size(0),
                    " rows (tokens), got no splits");
  if (check_now && splits.numel() > 0) {
    const cudaError_t status =
        cuda::check_splits(splits.data_ptr<int64_t>(), splits.numel(), rows_of.size(0),
                           at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(status == cudaSuccess, who(), ": the splits' check failed to launch (",
                cudaGetErrorString(status), ")");
  }
  return splits;
}

// `count` tensors of `sizes` over consecutive blocks of `buffer`'s storage (contiguous buffer),
// the first at element `offset` (each group's fresh gradient, the host splits of a group table).
// Tensors of their own, not autograd views of `buffer`: unbind's view bookkeeping cost ~1 µs of
// host time per tensor, two per expert.
std::vector<at::Tensor> blocks_of(const at::Tensor& buffer, int64_t offset, int64_t count,
                                  at::IntArrayRef sizes) {
  std::vector<at::Tensor> blocks;
  blocks.reserve(count);
  const int64_t numel = c10::multiply_integers(sizes);
  for (int64_t g = 0; g < count; ++g) {
    // As at::empty makes a tensor (its own version counter and autograd keys), on shared storage.
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()),
                                                     buffer.key_set(), buffer.dtype());
    impl->set_sizes_contiguous(sizes);
    impl->set_storage_offset(buffer.storage_offset() + offset + g * numel);
    blocks.emplace_back(std::move(impl));
  }
  return blocks;
}

// What a grouped launch reads per group and its workspace, in one allocation (host time: each
// table of its own was an allocation and a launch): the splits as the kernels read them (host
// splits' values first in the table, checked here; device splits as they are, see
// device_splits()), then `pointers`, then `workspace_bytes` (256-byte aligned). The table is
// written by the first grouped GEMM's argument kernel (give_words_to()), or at once (`write_now`)
// for work that reads it before, or without, a grouped GEMM: one launch fewer.
struct GroupTable {
  at::Tensor splits;  ///< int64 on the device: the table's first entries, or the device tensor
  void** pointers = nullptr;    ///< the device copy of `pointers`
  void* workspace = nullptr;    ///< `workspace_bytes` after the table, or nullptr for none
  at::Tensor table;             ///< keeps the table and the workspace alive
  std::vector<uint64_t> words;  ///< the table's words, for the launch that writes them
  bool written = false;

  /// `args`'s launch writes the table first, unless an earlier launch has (set `written` once a
  /// launch given the words has run).
  void give_words_to(cuda::GroupedGemmArgs& args) const {
    args.table_words = words.data();
    args.table_word_count = written ? 0 : static_cast<int64_t>(words.size());
    args.table = reinterpret_cast<uint64_t*>(table.data_ptr());
  }
};
GroupTable group_table(detail::Who who, const at::Tensor& m_splits, const at::Tensor& rows_of,
                       const std::vector<const void*>& pointers, size_t workspace_bytes,
                       bool check_now, bool write_now) {
  GroupTable out;
  std::vector<uint64_t>& words = out.words;
  int64_t first_pointer = 0;
  if (m_splits.device().is_cpu()) {
    const std::vector<int64_t> sizes = detail::split_sizes(who, m_splits, rows_of.size(0));
    words.assign(sizes.begin(), sizes.end());
    first_pointer = static_cast<int64_t>(sizes.size());
  } else {
    out.splits = device_splits(who, m_splits, rows_of, check_now);
  }
  for (const void* p : pointers) words.push_back(reinterpret_cast<uint64_t>(p));
  out.table = table_space(words.size(), rows_of, workspace_bytes);
  if (write_now) {
    write_words(words, out.table);
    out.written = true;
  }
  // The host splits' entries without a narrow() through the dispatcher (host time).
  if (!out.splits.defined()) out.splits = blocks_of(out.table, 0, 1, {first_pointer})[0];
  auto* const base = static_cast<char*>(out.table.data_ptr());
  out.pointers = reinterpret_cast<void**>(base) + first_pointer;
  if (workspace_bytes > 0) out.workspace = base + aligned256(words.size() * sizeof(uint64_t));
  return out;
}

// Runs a grouped product on the current stream in `args.workspace` (which has
// grouped_gemm_workspace_bytes(args)); false where the kernel does not take the arguments after
// all (the caller loops instead).
bool run_grouped_gemm(detail::Who who, const cuda::GroupedGemmArgs& args) {
  const cudaError_t status = cuda::grouped_gemm(args, at::cuda::getCurrentCUDAStream());
  if (status == cudaErrorNotSupported) {
    (void)cudaGetLastError();
    return false;
  }
  TORCH_CHECK(status == cudaSuccess, who(), ": the grouped GEMM failed to launch (",
              cudaGetErrorString(status), ")");
  return true;
}

int multiprocessors_of(const at::Tensor& like) {
  return at::cuda::getDeviceProperties(like.device().index())->multiProcessorCount;
}

// The peak DRAM bandwidth of `like`'s device in bytes per second (double data rate over the bus),
// or 0 where the runtime does not say; queried once per device.
double memory_bandwidth_of(const at::Tensor& like) {
  static std::array<std::atomic<double>, 64> known{};  // 0: not queried yet; -1: unknown
  const int device = like.device().index();
  if (device < 0 || device >= static_cast<int>(known.size())) return 0;
  double bandwidth = known[device].load(std::memory_order_relaxed);
  if (bandwidth == 0) {
    int kilohertz = 0, bus_bits = 0;
    const bool queried =
        cudaDeviceGetAttribute(&kilohertz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess;
    // These queries fail only for a bad device index, which `like`'s tensor rules out; their
    // error, if any, is theirs to clear.
    if (!queried) (void)cudaGetLastError();
    bandwidth =
        queried && kilohertz > 0 && bus_bits > 0 ? 2.0 * kilohertz * 1e3 * bus_bits / 8 : -1;
    known[device].store(bandwidth, std::memory_order_relaxed);
  }
  return std::max(bandwidth, 0.0);
}

// A grouped product's arguments, less the table's pointers (splits, weights or targets) and the
// workspace, which come with the group table.
cuda::GroupedGemmArgs grouped_args(cuda::GroupedProduct product, int64_t groups, int64_t rows,
                                   int64_t in, int64_t out, const at::Tensor& like) {
  cuda::GroupedGemmArgs args;
  args.product = product;
  args.groups = groups;
  args.rows = rows;
  args.in_features = in;
  args.out_features = out;
  args.multiprocessors = multiprocessors_of(like);
  args.memory_bytes_per_second = memory_bandwidth_of(like);
  return args;
}

// The start of each of `count` consecutive blocks of `numel` elements of the contiguous `buffer`,
// the first at element `offset`, by pointer arithmetic (no tensor per block).
std::vector<const void*> block_pointers(const at::Tensor& buffer, int64_t offset, int64_t count,
                                        int64_t numel) {
  std::vector<const void*> pointers;
  pointers.reserve(count);
  const auto* first = static_cast<const char*>(buffer.data_ptr()) + offset * buffer.element_size();
  for (int64_t g = 0; g < count; ++g) pointers.push_back(first + g * numel * buffer.element_size());
  return pointers;
}

// The group of each row, [rows] int64, from device splits without reading them on the host.
at::Tensor group_of_rows(const at::Tensor& splits, int64_t rows) {
  const at::Tensor groups = at::arange(splits.numel(), splits.options());
  return at::repeat_interleave(groups, splits, /*dim=*/0, /*output_size=*/rows);
}

// Each group's bias gradient from its rows of dy, in one pass over dy (cuda/bias_grad.h), added
// to `targets` (a device array, one per group of `target_type`, nullptr skips a group; tied
// targets are reached in group order by the kernel itself), in `workspace`
// (grouped_bias_grad_workspace_bytes()); `row_offsets` and `tile_counters`, where not null, are
// the groups' row offsets and zeroed counters already on the device (written by the grouped
// GEMM's argument kernel).
void add_group_bias_grads(detail::Who who, const at::Tensor& dy, const at::Tensor& splits,
                          void* const* targets, cudaDataType_t target_type, void* workspace,
                          const int64_t* row_offsets, unsigned* tile_counters, bool overwrite,
                          bool distinct_targets) {
  cuda::GroupedBiasGradArgs args;
  args.dy = dy.data_ptr();
  args.dy_type = CUDA_R_16BF;
  args.rows = dy.size(0);
  args.cols = dy.size(1);
  args.ld = dy.size(1);
  args.splits = splits.data_ptr<int64_t>();
  args.row_offsets = row_offsets;
  args.tile_counters = tile_counters;
  args.groups = splits.numel();
  args.targets = targets;
  args.target_type = target_type;
  args.accumulate = !overwrite;
  args.distinct_targets = distinct_targets;
  args.multiprocessors = multiprocessors_of(dy);
  args.workspace = workspace;
  const cudaError_t status = cuda::grouped_bias_grad(args, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, who(), ": the grouped bias gradient kernel failed (",
              cudaGetErrorString(status), ")");
}

// Whether two of the non-null `targets` (each `bytes_each` long) overlap: from the sorted
// addresses (host time: every pair compared costs ~4k instructions at 32 experts, ~65k at 128).
bool any_targets_overlap(const std::vector<const void*>& targets, size_t bytes_each) {
  std::vector<uintptr_t> sorted;
  sorted.reserve(targets.size());
  for (const void* t : targets) {
    if (t != nullptr) sorted.push_back(reinterpret_cast<uintptr_t>(t));
  }
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i] - sorted[i - 1] < bytes_each) return true;
  }
  return false;
}

// The targets split into launches so that no launch writes a byte twice: a target goes one round
// after the last earlier target it overlaps (the same target, tied experts, or an overlapping
// view), the others nullptr there. Rounds run in order, so a tied target sums its groups in group
// order, as the loop does.
std::vector<std::vector<const void*>> rounds_of(const std::vector<const void*>& targets,
                                                size_t bytes_each) {
  if (std::all_of(targets.begin(), targets.end(), [](const void* t) { return t == nullptr; })) {
    return {};
  }
  // The usual case, targets that do not overlap (a main_grad per expert), is one round.
  if (!any_targets_overlap(targets, bytes_each)) return {targets};
  std::vector<std::vector<const void*>> rounds;
  std::vector<size_t> round_of(targets.size(), 0);
  for (size_t g = 0; g < targets.size(); ++g) {
    if (targets[g] == nullptr) continue;
    const auto begin = reinterpret_cast<uintptr_t>(targets[g]);
    size_t round = 0;
    for (size_t e = 0; e < g; ++e) {  // experts are few: quadratic is cheap
      const auto other = reinterpret_cast<uintptr_t>(targets[e]);
      if (targets[e] != nullptr && begin < other + bytes_each && other < begin + bytes_each) {
        round = std::max(round, round_of[e] + 1);
      }
    }
    round_of[g] = round;
    if (round >= rounds.size()) rounds.resize(round + 1, std::vector<const void*>(targets.size()));
    rounds[round][g] = targets[g];
  }
  return rounds;
}

// fprop and dgrad of a few large experts whose splits are known on the host: cuBLAS's per-expert
// GEMMs beat the grouped kernel (H200, benchmarks/tune_grouped.py: 8 DeepSeek-V3 experts of 1024
// rows on average, 7168 -> 4096, in 0.89x its time; 2048 -> 7168 in 0.91x; no tile, cluster or
// order of the grouped kernel closes it). From 16 experts, or below 1024 or from 4096 rows on
// average, the grouped kernel is as fast or faster (Qwen3's 16: 0.78x the loop; Mixtral's 2:
// dgrad 0.95x). Device splits always take the grouped kernel: a loop would read them on the host.
bool per_expert_loop_is_faster(const at::Tensor& m_splits, int64_t rows) {
  const int64_t groups = m_splits.numel();
  return m_splits.device().is_cpu() && groups > 0 && groups <= 8 && rows >= 1024 * groups &&
         rows < 4096 * groups;
}

at::Tensor grouped_linear_fprop(const at::Tensor& input, const at::Tensor& m_splits,
                                at::TensorList weights, at::TensorList biases) {
  const auto who = detail::named("splitgrad::grouped_linear_fprop");
  detail::check_grouped_linear_args(who, input, m_splits, weights, biases,
                                    /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = detail::flatten_tokens(input);
  const int64_t out = weights[0].size(0);
  const auto shaped = [&](const at::Tensor& y) {
    return input.dim() == 2 ? y : y.view(detail::with_last_dim(input.sizes(), out));
  };
  // An empty product (in_features 0) is the loop's: it writes the bias or zeros.
  if (x.size(1) > 0 && out > 0 && !per_expert_loop_is_faster(m_splits, x.size(0)) &&
      grouped_kernels_take({x}, weights)) {
    at::Tensor y = at::empty({x.size(0), out}, input.options());
    const bool has_rows = x.size(0) > 0;
    if (!has_rows) {
      device_splits(who, m_splits, x, /*check_now=*/true);
      return shaped(y);
    }
    std::vector<const void*> weight_pointers;
    for (const at::Tensor& w : weights) weight_pointers.push_back(w.data_ptr());
    auto args =
        grouped_args(cuda::GroupedProduct::fprop, m_splits.numel(), x.size(0), x.size(1), out, x);
    // With biases, the rows' biases are gathered (below) by the splits before the GEMM.
    const GroupTable table =
        group_table(who, m_splits, x, weight_pointers, cuda::grouped_gemm_workspace_bytes(args),
                    /*check_now=*/!biases.empty(), /*write_now=*/!biases.empty());
    table.give_words_to(args);
    const at::Tensor& splits = table.splits;
    args.splits = splits.data_ptr<int64_t>();
    args.workspace = table.workspace;
    args.tokens = x.data_ptr();
    args.weights = table.pointers;
    args.out = y.data_ptr();
    if (!biases.empty()) {
      // y starts as each row's bias and the GEMM adds x·Wᵀ in its epilogue (beta = 1): the sum
      // in fp32, rounded once, as cuBLASLt's bias epilogue does. The splits were checked above,
      // before repeat_interleave reads them.
      at::index_select_out(y, at::stack(biases), 0, group_of_rows(splits, y.size(0)));
      args.add_to_out = true;
    }
    if (run_grouped_gemm(who, args)) return shaped(y);
  }
  const auto splits = host_splits(who, m_splits, x.size(0));
  if (!covers(input.scalar_type())) {
    return aten_backend::grouped_linear_fprop(input, splits, weights, biases);
  }
  at::Tensor y = at::empty({x.size(0), out}, input.options());
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    const std::optional<at::Tensor> bias =
        biases.empty() ? std::nullopt : std::optional<at::Tensor>(biases[i]);
    fprop_into(x.narrow(0, offset, splits[i]), weights[i], bias, y.narrow(0, offset, splits[i]));
  }
  return shaped(y);
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const at::Tensor& m_splits,
                                at::TensorList weights) {
  const auto who = detail::named("splitgrad::grouped_linear_dgrad");
  detail::check_grouped_dgrad_args(who, grad_output, m_splits, weights,
                                   /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const int64_t in = weights[0].size(1);
  const auto shaped = [&](const at::Tensor& dx) {
    return grad_output.dim() == 2 ? dx : dx.view(detail::with_last_dim(grad_output.sizes(), in));
  };
  if (in > 0 && dy.size(1) > 0 && !per_expert_loop_is_faster(m_splits, dy.size(0)) &&
      grouped_kernels_take({dy}, weights)) {
    at::Tensor dx = at::empty({dy.size(0), in}, grad_output.options());
    if (dy.size(0) == 0) {
      device_splits(who, m_splits, dy, /*check_now=*/true);
      return shaped(dx);
    }
    std::vector<const void*> weight_pointers;
    for (const at::Tensor& w : weights) weight_pointers.push_back(w.data_ptr());
    auto args =
        grouped_args(cuda::GroupedProduct::dgrad, m_splits.numel(), dy.size(0), in, dy.size(1), dy);
    const GroupTable table =
        group_table(who, m_splits, dy, weight_pointers, cuda::grouped_gemm_workspace_bytes(args),
                    /*check_now=*/false, /*write_now=*/false);
    table.give_words_to(args);
    args.splits = table.splits.data_ptr<int64_t>();
    args.workspace = table.workspace;
    args.tokens = dy.data_ptr();
    args.weights = table.pointers;
    args.out = dx.data_ptr();
    if (run_grouped_gemm(who, args)) return shaped(dx);
  }
  const auto splits = host_splits(who, m_splits, dy.size(0));
  if (!covers(grad_output.scalar_type())) {
    return aten_backend::grouped_linear_dgrad(grad_output, splits, weights);
  }
  at::Tensor dx = at::empty({dy.size(0), in}, grad_output.options());
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    dgrad_into(dy.narrow(0, offset, splits[i]), weights[i], dx.narrow(0, offset, splits[i]));
  }
  return shaped(dx);
}

// The grouped kernel's weight gradients added to `targets` (one per group, nullptr skips it; all
// contiguous, 16-byte aligned, of `target_type`), and the bias gradients to `bias_targets` (of
// `bias_type`, or none); with `overwrite`, written there instead (zeros for a group without rows;
// the targets must then be distinct). False where the kernel does not take them; no gradient has
// been written then. Host time: one table for the splits and every launch's targets, one
// workspace, and the bias kernel takes the row offsets the GEMM's argument kernel writes.
bool accumulate_grouped(detail::Who who, const at::Tensor& dy, const at::Tensor& x,
                        const at::Tensor& m_splits, const std::vector<const void*>& targets,
                        cudaDataType_t target_type, const std::vector<const void*>& bias_targets,
                        cudaDataType_t bias_type, bool overwrite = false) {
  const int64_t groups = m_splits.numel();
  const size_t target_bytes =
      static_cast<size_t>(dy.size(1) * x.size(1)) * target_element_bytes(target_type);
  const auto weight_rounds = rounds_of(targets, target_bytes);
  TORCH_INTERNAL_ASSERT(!overwrite || weight_rounds.size() <= 1,
                        "grouped wgrad: overwritten targets must not overlap");
  const bool any_bias = std::any_of(bias_targets.begin(), bias_targets.end(),
                                    [](const void* target) { return target != nullptr; });
  std::vector<const void*> pointers;  // each round's targets, then the bias targets
  pointers.reserve((weight_rounds.size() + 1) * static_cast<size_t>(groups));
  for (const auto& round : weight_rounds)
    pointers.insert(pointers.end(), round.begin(), round.end());
  if (any_bias) pointers.insert(pointers.end(), bias_targets.begin(), bias_targets.end());
  auto args = grouped_args(cuda::GroupedProduct::wgrad_accumulate, groups, dy.size(0), x.size(1),
                           dy.size(1), dy);
  args.tokens = dy.data_ptr();
  args.tokens_in = x.data_ptr();
  args.target_type = target_type;
  args.overwrite_targets = overwrite;
  // One workspace, after the table: the GEMM's (the same for every round), the row offsets, the
  // bias kernel's.
  const size_t gemm_bytes =
      weight_rounds.empty() ? 0 : aligned256(cuda::grouped_gemm_workspace_bytes(args));
  // The row offsets and the bias kernel's tile counters, both written by the argument kernel.
  const int64_t tile_counters = cuda::grouped_bias_grad_tile_counters(dy.size(1), groups);
  const size_t offsets_bytes = aligned256(static_cast<size_t>(groups + 1) * sizeof(int64_t) +
                                          static_cast<size_t>(tile_counters) * sizeof(unsigned));
  const size_t bias_bytes = any_bias ? cuda::grouped_bias_grad_workspace_bytes(
                                           dy.size(0), dy.size(1), groups, args.multiprocessors)
                                     : 0;
  // Without a GEMM no argument kernel checks device splits or writes the table: done first.
  GroupTable table =
      group_table(who, m_splits, dy, pointers, gemm_bytes + offsets_bytes + bias_bytes,
                  /*check_now=*/weight_rounds.empty(),
                  /*write_now=*/weight_rounds.empty());
  args.splits = table.splits.data_ptr<int64_t>();
  char* const base = static_cast<char*>(table.workspace);
  auto* const row_offsets = reinterpret_cast<int64_t*>(base + gemm_bytes);
  auto* const counters = reinterpret_cast<unsigned*>(row_offsets + groups + 1);
  args.workspace = base;
  for (size_t r = 0; r < weight_rounds.size(); ++r) {
    args.targets = table.pointers + r * static_cast<size_t>(groups);
    args.row_offsets = r == 0 && any_bias ? row_offsets : nullptr;
    args.zeroed_words = r == 0 && any_bias ? counters : nullptr;
    args.zeroed_word_count = r == 0 && any_bias ? tile_counters : 0;
    table.give_words_to(args);
    if (!run_grouped_gemm(who, args)) {
      TORCH_CHECK(r == 0, who(), ": the grouped GEMM took the first targets but not the others");
      return false;
    }
    table.written = true;
  }
  if (any_bias) {
    const bool offsets_written = !weight_rounds.empty();
    void* const* bias_pointers =
        table.pointers + weight_rounds.size() * static_cast<size_t>(groups);
    // Biases of tied experts share a target: their groups are then finished in group order.
    const bool distinct_biases = !any_targets_overlap(
        bias_targets, static_cast<size_t>(dy.size(1)) * target_element_bytes(bias_type));
    TORCH_INTERNAL_ASSERT(!overwrite || distinct_biases,
                          "grouped wgrad: overwritten bias targets must not overlap");
    add_group_bias_grads(who, dy, table.splits, bias_pointers, bias_type,
                         base + gemm_bytes + offsets_bytes, offsets_written ? row_offsets : nullptr,
                         offsets_written ? counters : nullptr, overwrite, distinct_biases);
  }
  return true;
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_wgrad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& m_splits,
    bool compute_bias_grad) {
  const auto who = detail::named("splitgrad::grouped_linear_wgrad");
  detail::check_grouped_wgrad_args(who, grad_output, input, m_splits,
                                   /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  const int64_t groups = m_splits.numel(), out = dy.size(1), in = x.size(1);
  if (grouped_kernels_take({dy, x}) && dy.size(0) > 0 && out > 0 && in > 0 && groups > 0) {
    // Fresh gradients: the grouped kernels write each group's sum, zeros for a group without
    // rows (as nn.Linear's backward gives it), into one buffer (one allocation, no fill) that
    // holds the weights' gradients, then the biases'; the bias kernel sums in fp32 and writes
    // once, so a bf16 bias gradient is its fp32 sum rounded once, as dy.sum(0)'s.
    const int64_t weight_numel = groups * out * in, bias_groups = compute_bias_grad ? groups : 0;
    const at::Tensor grads = at::empty({weight_numel + bias_groups * out}, input.options());
    if (accumulate_grouped(who, dy, x, m_splits, block_pointers(grads, 0, groups, out * in),
                           CUDA_R_16BF, block_pointers(grads, weight_numel, bias_groups, out),
                           CUDA_R_16BF, /*overwrite=*/true)) {
      return {blocks_of(grads, 0, groups, {out, in}),
              compute_bias_grad ? blocks_of(grads, weight_numel, groups, {out})
                                : std::vector<at::Tensor>()};
    }
  }
  const auto splits = host_splits(who, m_splits, x.size(0));
  std::vector<at::Tensor> weight_grads, bias_grads;
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    // linear_wgrad hands dtypes it does not cover to the ATen back end itself.
    auto [weight_grad, bias_grad] = linear_wgrad(dy.narrow(0, offset, splits[i]),
                                                 x.narrow(0, offset, splits[i]), compute_bias_grad);
    weight_grads.push_back(std::move(weight_grad));
    if (compute_bias_grad) bias_grads.push_back(std::move(bias_grad));
  }
  return {std::move(weight_grads), std::move(bias_grads)};
}

// The targets of a grouped accumulation as the grouped kernels want them, or nullopt: weight
// targets all fp32 or all bf16, contiguous and 16-byte aligned (TMA); bias targets all fp32 or all
// bf16, contiguous (the bias kernel writes them element by element).
struct GroupedTargets {
  std::vector<const void*> weights, biases;
  cudaDataType_t weight_type = CUDA_R_32F, bias_type = CUDA_R_32F;
};
std::optional<GroupedTargets> grouped_targets(const OptTensorList& weight_grads,
                                              const OptTensorList& bias_grads, int64_t groups) {
  // The pointers of one list's present entries, and their one dtype; false where they don't fit.
  const auto collect = [groups](const OptTensorList& list, bool aligned,
                                std::vector<const void*>& pointers, cudaDataType_t& type) {
    std::optional<at::ScalarType> dtype;
    const detail::OptionalTensors entries(list);
    pointers.reserve(static_cast<size_t>(groups));
    for (int64_t g = 0; g < groups && !entries.empty(); ++g) {
      const at::Tensor* t = entries[g];
      if (t == nullptr) {
        pointers.push_back(nullptr);
        continue;
      }
      const at::ScalarType d = t->scalar_type();
      if (!t->is_contiguous() || (aligned && !aligned16(*t)) ||
          (d != at::kFloat && d != at::kBFloat16) || (dtype.has_value() && *dtype != d)) {
        return false;
      }
      dtype = d;
      pointers.push_back(t->data_ptr());
    }
    type = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    return true;
  };
  GroupedTargets targets;
  if (!collect(weight_grads, /*aligned=*/true, targets.weights, targets.weight_type) ||
      !collect(bias_grads, /*aligned=*/false, targets.biases, targets.bias_type)) {
    return std::nullopt;
  }
  return targets;
}

void grouped_linear_wgrad_accumulate_(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& m_splits, const OptTensorList& weight_grads,
                                      const OptTensorList& bias_grads) {
  const auto who = detail::named("splitgrad::grouped_linear_wgrad_accumulate_");
  detail::check_grouped_wgrad_accumulate_args(who, grad_output, input, m_splits, weight_grads,
                                              bias_grads, /*splits_on_cpu_only=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dy = detail::flatten_tokens(grad_output);
  const at::Tensor x = detail::flatten_tokens(input);
  if (grouped_kernels_take({dy, x})) {
    if (dy.size(0) == 0 || dy.size(1) == 0 || x.size(1) == 0) {  // adds zero; splits checked
      device_splits(who, m_splits, dy, /*check_now=*/true);
      return;
    }
    const auto targets = grouped_targets(weight_grads, bias_grads, m_splits.numel());
    if (targets.has_value() &&
        accumulate_grouped(who, dy, x, m_splits, targets->weights, targets->weight_type,
                           targets->biases, targets->bias_type)) {
      return;
    }
  }
  const auto splits = host_splits(who, m_splits, x.size(0));
  int64_t offset = 0;
  for (size_t i = 0; i < splits.size(); offset += splits[i], ++i) {
    const std::optional<at::Tensor> weight_grad =
        weight_grads.empty() ? std::nullopt : weight_grads.get(i);
    const std::optional<at::Tensor> bias_grad =
        bias_grads.empty() ? std::nullopt : bias_grads.get(i);
    // In group order, so targets shared by several groups (tied experts) add up in sequence.
    linear_wgrad_accumulate_(dy.narrow(0, offset, splits[i]), x.narrow(0, offset, splits[i]),
                             weight_grad, bias_grad);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(splitgrad, CUDA, m) {
  m.impl("grouped_linear_fprop", &grouped_linear_fprop);
  m.impl("grouped_linear_dgrad", &grouped_linear_dgrad);
  m.impl("grouped_linear_wgrad", &grouped_linear_wgrad);
  m.impl("grouped_linear_wgrad_accumulate_", &grouped_linear_wgrad_accumulate_);
}

}  // namespace splitgrad::cuda_backend
