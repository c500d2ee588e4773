// Picks the SM90 grouped kernel for a product (cuda/sm90/, built where CUTLASS's headers and an
// sm_90 target are at hand) and checks what the kernels need before launching.
#include "cuda/grouped_gemm.h"

#include "cuda/group_tables.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef SPLITGRAD_SM90_GROUPED_GEMM
#include "cuda/sm90/grouped_gemm_sm90.h"
#endif

namespace splitgrad::cuda {
namespace {

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

#ifdef SPLITGRAD_SM90_GROUPED_GEMM
struct Kernel {
  cudaError_t (*run)(const GroupedGemmArgs&, cudaStream_t) = nullptr;
  size_t (*workspace_bytes)(const GroupedGemmArgs&) = nullptr;
};

// The fp32 wgrad's schedule, from benchmarks/tune_grouped.py (BENCHMARKS.md, "GroupedLinear").
// Ping-pong overlaps one warp group's epilogue (main_grad's fp32 read-modify-write) with the
// other's main loop. On the H200 (HBM3e, 4.8 TB/s) it wins on every benchmark shape:
// dsv3-gate-up-32, 32 experts of 512 rows on average, 0.774x the per-expert addmm loop against
// cooperative's 0.869x (2026-12-07). On the H100 (3.35 TB/s) the epilogue of short experts
// outlasts the other group's main loop: cooperative's 128x256 tile won there on that shape (0.849x
// against 0.911x, 2026-12-06), so devices below 4.4 TB/s (the H100s, the H20, GH200's 96 GB
// part, none measured but the H100 SXM) keep the choice tuned before: cooperative while the groups
// average under 768 rows, ping-pong above (on the H100 within a few percent of each other there).
// An unknown bandwidth is taken as the H100's. SPLITGRAD_GROUPED_WGRAD_SCHEDULE=
// pingpong|cooperative forces one.
bool cooperative_fp32_wgrad(const GroupedGemmArgs& args) {
  const char* forced = std::getenv("SPLITGRAD_GROUPED_WGRAD_SCHEDULE");
  if (forced != nullptr && std::strcmp(forced, "cooperative") == 0) return true;
  if (forced != nullptr && std::strcmp(forced, "pingpong") == 0) return false;
  constexpr double kEpilogueKeepsUp = 4.4e12;  // bytes per second: between the H100s and the H200
  return args.memory_bytes_per_second < kEpilogueKeepsUp && args.rows < 768 * args.groups;
}

#ifdef SPLITGRAD_GROUPED_GEMM_TUNING
std::vector<sm90::TuningVariant>& tuning_variants() {
  static std::vector<sm90::TuningVariant> variants;
  return variants;
}

// SPLITGRAD_GROUPED_GEMM_VARIANT=<name>: that variant where it computes this product.
const sm90::TuningVariant* forced_variant(const GroupedGemmArgs& args) {
  const char* name = std::getenv("SPLITGRAD_GROUPED_GEMM_VARIANT");
  if (name == nullptr) return nullptr;
  for (const auto& variant : tuning_variants()) {
    if (std::strcmp(variant.name, name) == 0 && variant.product == args.product &&
        variant.fp32_targets == (args.target_type == CUDA_R_32F)) {
      return &variant;
    }
  }
  return nullptr;
}

// Whether SPLITGRAD_GROUPED_GEMM_VARIANT names a variant this build lacks (one left out by
// SPLITGRAD_GROUPED_GEMM_TUNING_VARIANTS): an error then, not the shipped kernel timed in its name.
bool forced_variant_missing() {
  const char* name = std::getenv("SPLITGRAD_GROUPED_GEMM_VARIANT");
  if (name == nullptr) return false;
  return std::none_of(
      tuning_variants().begin(), tuning_variants().end(),
      [name](const sm90::TuningVariant& v) { return std::strcmp(v.name, name) == 0; });
}
#endif

Kernel kernel_for(const GroupedGemmArgs& args) {
#ifdef SPLITGRAD_GROUPED_GEMM_TUNING
  if (const auto* variant = forced_variant(args)) return {variant->run, variant->workspace_bytes};
#endif
  switch (args.product) {
    case GroupedProduct::fprop:
      return {&sm90::fprop, &sm90::fprop_workspace_bytes};
    case GroupedProduct::dgrad:
      return {&sm90::dgrad, &sm90::dgrad_workspace_bytes};
    case GroupedProduct::wgrad_accumulate:
      if (args.target_type == CUDA_R_16BF)
        return {&sm90::wgrad_bf16, &sm90::wgrad_bf16_workspace_bytes};
      if (args.target_type != CUDA_R_32F) return {};
      if (cooperative_fp32_wgrad(args)) {
        return {&sm90::wgrad_fp32_cooperative, &sm90::wgrad_fp32_cooperative_workspace_bytes};
      }
      return {&sm90::wgrad_fp32, &sm90::wgrad_fp32_workspace_bytes};
  }
  return {};
}
#endif

}  // namespace

#ifdef SPLITGRAD_GROUPED_GEMM_TUNING
void sm90::register_tuning_variant(const sm90::TuningVariant& variant) {
  tuning_variants().push_back(variant);
}
#endif

bool grouped_gemm_runs_on(int major, int minor) {
#ifdef SPLITGRAD_SM90_GROUPED_GEMM
  return major == 9 && minor == 0;  // sm_90a code: Hopper only
#else
  (void)major;
  (void)minor;
  return false;
#endif
}

size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& args) {
#ifdef SPLITGRAD_SM90_GROUPED_GEMM
  const Kernel kernel = kernel_for(args);
  return kernel.workspace_bytes != nullptr ? kernel.workspace_bytes(args) : 0;
#else
  (void)args;
  return 0;
#endif
}

cudaError_t grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream) {
#ifdef SPLITGRAD_SM90_GROUPED_GEMM
  const Kernel kernel = kernel_for(args);
  // TMA: 16-byte aligned rows and bases; the problem sizes are 32-bit in the kernel.
  const bool takes =
      kernel.run != nullptr && args.in_features % 8 == 0 && args.out_features % 8 == 0 &&
      args.rows < (int64_t{1} << 31) && args.in_features < (int64_t{1} << 31) &&
      args.out_features < (int64_t{1} << 31) && aligned16(args.tokens) &&
      aligned16(args.tokens_in) && aligned16(args.out) &&
      reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0 && args.groups < (int64_t{1} << 31);
  if (!takes) return cudaErrorNotSupported;
  GroupedGemmArgs launched = args;
  if (args.table_word_count > TableChunk::kWords) {  // more than the argument kernel takes
    if (const cudaError_t error =
            write_table(args.table_words, args.table_word_count, args.table, stream);
        error != cudaSuccess) {
      return error;
    }
    launched.table_word_count = 0;
  }
#ifdef SPLITGRAD_GROUPED_GEMM_TUNING
  if (forced_variant_missing()) return cudaErrorInvalidConfiguration;
  // A forced variant that cannot run must not be timed as the fallback loop: an error instead.
  if (forced_variant(args) != nullptr) {
    const cudaError_t status = kernel.run(launched, stream);
    return status == cudaErrorNotSupported ? cudaErrorInvalidConfiguration : status;
  }
#endif
  return kernel.run(launched, stream);
#else
  (void)args;
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace splitgrad::cuda
