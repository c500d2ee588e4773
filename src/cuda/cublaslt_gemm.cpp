#include "cuda/cublaslt_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace splitgrad::cuda {
namespace {

// Largest power of two (up to 256) dividing the address: cuBLASLt picks kernels by alignment.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// Everything the descriptors and the heuristic depend on (not the pointers themselves).
struct PlanKey {
  int64_t m, n, k, lda, ldb, ldd;
  int a_type, b_type, d_type, bias_type, compute;
  bool a_transposed, b_transposed;
  int accumulate, epilogue;
  uint32_t align_a, align_b, align_d;
  size_t workspace_bytes;
  int device;

  auto tie() const {
    return std::tie(m, n, k, lda, ldb, ldd, a_type, b_type, d_type, bias_type, compute,
                    a_transposed, b_transposed, accumulate, epilogue, align_a, align_b, align_d,
                    workspace_bytes, device);
  }
  bool operator==(const PlanKey& other) const { return tie() == other.tie(); }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    // FNV-1a over the fields (the struct has padding, so hash field by field).
    size_t h = 1469598103934665603ull;
    auto mix = [&](uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(key.m), mix(key.n), mix(key.k), mix(key.lda), mix(key.ldb), mix(key.ldd);
    mix(key.a_type), mix(key.b_type), mix(key.d_type), mix(key.bias_type), mix(key.compute);
    mix(key.a_transposed), mix(key.b_transposed), mix(key.accumulate), mix(key.epilogue);
    mix(key.align_a), mix(key.align_b), mix(key.align_d), mix(key.workspace_bytes);
    mix(key.device);
    return h;
  }
};

// Cached descriptors and the algorithm the heuristic chose for one PlanKey.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  GemmStatus status;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

std::mutex cache_mutex;
std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>& cache() {
  static auto* plans = new std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>();
  return *plans;  // never destroyed: cuBLASLt may already be unloaded at exit
}

PlanKey key_of(const GemmArgs& args) {
  int device = 0;
  cudaGetDevice(&device);
  return PlanKey{args.m,
                 args.n,
                 args.k,
                 args.a.ld,
                 args.b.ld,
                 args.ldd,
                 static_cast<int>(args.a.type),
                 static_cast<int>(args.b.type),
                 static_cast<int>(args.d_type),
                 static_cast<int>(args.bias_type),
                 static_cast<int>(args.compute),
                 args.a.transposed,
                 args.b.transposed,
                 static_cast<int>(args.accumulate),
                 static_cast<int>(args.epilogue),
                 alignment_of(args.a.data),
                 alignment_of(args.b.data),
                 alignment_of(args.d),
                 args.workspace_bytes,
                 device};
}

// Autotuning: the heuristic's first algorithm is not always the fastest (small and skinny
// shapes especially), so a new plan times up to kCandidates of them once, on the caller's operands
// and a scratch output, and keeps the fastest. SPLITGRAD_CUBLASLT_AUTOTUNE=0 keeps the first.
constexpr int kCandidates = 8;
constexpr int kTimedRuns = 5;

bool autotune_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("SPLITGRAD_CUBLASLT_AUTOTUNE");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

size_t element_bytes(cudaDataType_t type) {
  switch (type) {
    case CUDA_R_64F:
      return 8;
    case CUDA_R_32F:
      return 4;
    default:
      return 2;
  }
}

// Index of the fastest of `results` on this GEMM, or -1 if none could be timed (a stream being
// captured into a CUDA graph cannot be synchronised: the heuristic's choice stands then).
int fastest(cublasLtHandle_t handle, const Plan& plan, const GemmArgs& args,
            const cublasLtMatmulHeuristicResult_t* results, int count, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess ||
      capturing != cudaStreamCaptureStatusNone) {
    return -1;
  }
  if (args.epilogue != Epilogue::kNone &&
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &args.bias,
                                     sizeof(args.bias)) != CUBLAS_STATUS_SUCCESS) {
    return -1;
  }
  const size_t d_bytes = static_cast<size_t>(args.ldd) * args.n * element_bytes(args.d_type);
  void* scratch = nullptr;
  if (cudaMallocAsync(&scratch, std::max<size_t>(d_bytes, 1), stream) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const float alpha = 1.0f;
  const float beta = args.accumulate == Accumulate::kAdd ? 1.0f : 0.0f;
  int best = -1;
  float best_ms = 0.0f;
  for (int i = 0; i < count; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS ||
        results[i].workspaceSize > args.workspace_bytes)
      continue;
    auto launch = [&] {
      return cublasLtMatmul(handle, plan.desc, &alpha, args.a.data, plan.a, args.b.data, plan.b,
                            &beta, scratch, plan.d, scratch, plan.d, &results[i].algo,
                            args.workspace, args.workspace_bytes, stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up, and a check that it runs
    cudaEventRecord(start, stream);
    bool ok = true;
    for (int run = 0; run < kTimedRuns && ok; ++run) ok = launch() == CUBLAS_STATUS_SUCCESS;
    cudaEventRecord(stop, stream);
    float ms = 0.0f;
    if (!ok || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    if (best < 0 || ms < best_ms) best = i, best_ms = ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFreeAsync(scratch, stream);
  return best;
}

#define SPLITGRAD_CUBLAS_TRY(call, what)               \
  do {                                                 \
    const cublasStatus_t status_ = (call);             \
    if (status_ != CUBLAS_STATUS_SUCCESS) {            \
      plan->status = GemmStatus{false, what, status_}; \
      return plan;                                     \
    }                                                  \
  } while (0)

std::unique_ptr<Plan> make_plan(cublasLtHandle_t handle, const GemmArgs& args, const PlanKey& key,
                                cudaStream_t stream) {
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t scale_type = CUDA_R_32F;
  SPLITGRAD_CUBLAS_TRY(cublasLtMatmulDescCreate(&plan->desc, args.compute, scale_type),
                       "cublasLtMatmulDescCreate");
  const cublasOperation_t op_a = args.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = args.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  SPLITGRAD_CUBLAS_TRY(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)),
      "setting TRANSA");
  SPLITGRAD_CUBLAS_TRY(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)),
      "setting TRANSB");
  if (args.epilogue != Epilogue::kNone) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    SPLITGRAD_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                        &epilogue, sizeof(epilogue)),
                         "setting the epilogue");
    SPLITGRAD_CUBLAS_TRY(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                       &args.bias_type, sizeof(args.bias_type)),
        "setting the bias data type");
  }
  // Stored shapes: op(A) is [m, k], so A is stored [k, m] when transposed; likewise B.
  const uint64_t a_rows = args.a.transposed ? args.k : args.m;
  const uint64_t a_cols = args.a.transposed ? args.m : args.k;
  const uint64_t b_rows = args.b.transposed ? args.n : args.k;
  const uint64_t b_cols = args.b.transposed ? args.k : args.n;
  SPLITGRAD_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&plan->a, args.a.type, a_rows, a_cols, args.a.ld),
                       "creating A's layout");
  SPLITGRAD_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&plan->b, args.b.type, b_rows, b_cols, args.b.ld),
                       "creating B's layout");
  SPLITGRAD_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&plan->d, args.d_type, args.m, args.n, args.ldd),
                       "creating D's layout");

  cublasLtMatmulPreference_t preference = nullptr;
  SPLITGRAD_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&preference), "creating the preference");
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)>
      owned(preference, &cublasLtMatmulPreferenceDestroy);
  const uint64_t workspace = args.workspace_bytes;
  SPLITGRAD_CUBLAS_TRY(
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace, sizeof(workspace)),
      "setting the workspace size");
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d}};
  for (const auto& [attribute, value] : alignments) {
    SPLITGRAD_CUBLAS_TRY(
        cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)),
        "setting an operand alignment");
  }
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int count = 0;
  SPLITGRAD_CUBLAS_TRY(
      cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d,
                                     preference, kCandidates, results, &count),
      "cublasLtMatmulAlgoGetHeuristic");
  if (count == 0) {
    plan->status =
        GemmStatus{false, "cuBLASLt has no algorithm for this GEMM", CUBLAS_STATUS_NOT_SUPPORTED};
    return plan;
  }
  plan->algo = results[0].algo;
  plan->found = true;
  if (count > 1 && autotune_enabled()) {
    if (const int best = fastest(handle, *plan, args, results, count, stream); best >= 0) {
      plan->algo = results[best].algo;
    }
  }
  return plan;
}

#undef SPLITGRAD_CUBLAS_TRY

Plan& plan_for(cublasLtHandle_t handle, const GemmArgs& args, cudaStream_t stream) {
  const PlanKey key = key_of(args);
  auto& plans = cache();
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, make_plan(handle, args, key, stream)).first;
  return *it->second;
}

}  // namespace

GemmStatus gemm(cublasLtHandle_t handle, const GemmArgs& args, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(
      cache_mutex);  // the cached descriptor's bias pointer is per call
  Plan& plan = plan_for(handle, args, stream);
  if (!plan.found) return plan.status;
  if (args.epilogue != Epilogue::kNone) {
    const cublasStatus_t status = cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &args.bias, sizeof(args.bias));
    if (status != CUBLAS_STATUS_SUCCESS)
      return GemmStatus{false, "setting the bias pointer", status};
  }
  const float alpha = 1.0f;
  const float beta = args.accumulate == Accumulate::kAdd ? 1.0f : 0.0f;
  const cublasStatus_t status = cublasLtMatmul(
      handle, plan.desc, &alpha, args.a.data, plan.a, args.b.data, plan.b, &beta, args.d, plan.d,
      args.d, plan.d, &plan.algo, args.workspace, args.workspace_bytes, stream);
  if (status != CUBLAS_STATUS_SUCCESS) return GemmStatus{false, "cublasLtMatmul", status};
  return GemmStatus{};
}

}  // namespace splitgrad::cuda
