#include "cuda/cublaslt_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cuda/tuning_kernels.h"

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
  int epilogue;  // not `accumulate`: beta is a launch argument, and write and add must share
                 // one algorithm so that they do the same arithmetic
  uint32_t align_a, align_b, align_d;
  size_t workspace_bytes;
  int device;

  auto tie() const {
    return std::tie(m, n, k, lda, ldb, ldd, a_type, b_type, d_type, bias_type, compute,
                    a_transposed, b_transposed, epilogue, align_a, align_b, align_d,
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
    mix(key.a_transposed), mix(key.b_transposed), mix(key.epilogue);
    mix(key.align_a), mix(key.align_b), mix(key.align_d), mix(key.workspace_bytes);
    mix(key.device);
    return h;
  }
};

// Cached descriptors, the heuristic's candidates and the algorithm chosen for one PlanKey.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  bool tuning_pending = false;  // the choice among `candidates` is still to be timed
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
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
                 static_cast<int>(args.epilogue),
                 alignment_of(args.a.data),
                 alignment_of(args.b.data),
                 alignment_of(args.d),
                 args.workspace_bytes,
                 device};
}

// Autotuning. The heuristic's first algorithm is not always the fastest (small and skinny shapes
// especially), so a new plan times up to kCandidates of them once and keeps the fastest — but
// only among candidates whose output equals the first one's bit for bit, both written (beta = 0)
// and added to an existing D (beta = 1). The choice is then a matter of speed alone: every run,
// process and path (write or add) does the heuristic's arithmetic, whichever candidate won the
// timing. SPLITGRAD_CUBLASLT_AUTOTUNE=0 keeps the first.
// What is timed is one call as a training step makes it: each launch queued behind a busy wait, so
// that its events time the kernel alone (back-to-back launches of one kernel overlap, and favour
// kernels that run 5-20% slower as a lone call: benchmarks/probe_small_gemms.py on the H200),
// with the beta of the call that tunes it, the first one outside capture (wgrad's adds read D,
// fprop's writes do not), in interleaved rounds. A candidate must beat the first choice by kMargin
// to replace it: timing noise leaves the plan on the kernel cuBLAS's own heuristic, and so
// PyTorch, would run.
constexpr int kCandidates = 8;
constexpr int kTimedRounds = 7;
constexpr float kMargin = 0.02f;
constexpr uint64_t kQueueAheadNs = 40000;  // longer than the host takes to queue one timed call

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

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) != cudaSuccess ||
         status != cudaStreamCaptureStatusNone;
}

// Device buffers of the tuner, freed in stream order.
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  ~Scratch() {
    for (void* p : buffers_) cudaFreeAsync(p, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get(size_t bytes) {
    void* p = nullptr;
    if (cudaMallocAsync(&p, std::max<size_t>(bytes, 4), stream_) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    buffers_.push_back(p);
    return p;
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> buffers_;
};

// CUDA events with timing, destroyed with the owner.
class Events {
 public:
  explicit Events(size_t count) : events_(count, nullptr) {
    for (auto& event : events_) ok_ = ok_ && cudaEventCreate(&event) == cudaSuccess;
  }
  ~Events() {
    for (cudaEvent_t event : events_)
      if (event != nullptr) cudaEventDestroy(event);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  bool ok() const { return ok_; }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
  bool ok_ = true;
};

// Stored elements of an operand: ld x (columns as stored).
size_t operand_bytes(const Operand& op, int64_t stored_cols) {
  return static_cast<size_t>(op.ld) * static_cast<size_t>(stored_cols) * element_bytes(op.type);
}

// The candidate the plan should use: the fastest of those that compute what the heuristic's first
// choice (the untuned plan's algorithm) computes, bit for bit, on operands of the tuner's own
// (fixed pseudo-random values: no special values in the caller's data can make candidates of
// other arithmetic look alike). Returns -1 to keep the first choice: no memory or events for the
// tuner, no other eligible candidate, or a launch or timing that failed (its error cleared).
int choose(cublasLtHandle_t handle, const Plan& plan, const GemmArgs& args, cudaStream_t stream) {
  if (args.epilogue != Epilogue::kNone &&
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &args.bias,
                                     sizeof(args.bias)) != CUBLAS_STATUS_SUCCESS) {
    return -1;
  }
  Scratch scratch(stream);
  const size_t d_bytes = static_cast<size_t>(args.ldd) * args.n * element_bytes(args.d_type);
  const size_t a_bytes = operand_bytes(args.a, args.a.transposed ? args.m : args.k);
  const size_t b_bytes = operand_bytes(args.b, args.b.transposed ? args.k : args.n);
  void* written_reference = scratch.get(d_bytes);
  void* added_reference = scratch.get(d_bytes);
  void* output = scratch.get(d_bytes);
  auto* differing = static_cast<unsigned int*>(scratch.get(sizeof(unsigned int)));
  void* a = scratch.get(a_bytes);
  void* b = scratch.get(b_bytes);
  if (written_reference == nullptr || added_reference == nullptr || output == nullptr ||
      differing == nullptr || a == nullptr || b == nullptr ||
      fill_pseudo_random(a, args.a.type, a_bytes / element_bytes(args.a.type), 1, stream) !=
          cudaSuccess ||
      fill_pseudo_random(b, args.b.type, b_bytes / element_bytes(args.b.type), 2, stream) !=
          cudaSuccess) {
    return -1;
  }
  const float alpha = 1.0f, zero = 0.0f, one = 1.0f;
  auto launch = [&](int candidate, void* d, const float* beta) {
    return cublasLtMatmul(handle, plan.desc, &alpha, a, plan.a, b, plan.b, beta, d, plan.d, d,
                          plan.d, &plan.candidates[candidate].algo, args.workspace,
                          args.workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
  };
  // D before the product: zeros to write over, fixed pseudo-random values to add to. Padding
  // between D's columns (ldd > m) is never written, so it is alike in every output.
  auto prepare = [&](void* d, bool added) {
    return added ? fill_pseudo_random(d, args.d_type, d_bytes / element_bytes(args.d_type), 3,
                                      stream) == cudaSuccess
                 : cudaMemsetAsync(d, 0, d_bytes, stream) == cudaSuccess;
  };
  auto equals = [&](const void* reference) {
    unsigned int differs = 0;
    return cudaMemsetAsync(differing, 0, sizeof(unsigned int), stream) == cudaSuccess &&
           count_differing_words(reference, output, d_bytes, differing, stream) == cudaSuccess &&
           cudaMemcpyAsync(&differs, differing, sizeof(differs), cudaMemcpyDeviceToHost,
                           stream) == cudaSuccess &&
           cudaStreamSynchronize(stream) == cudaSuccess && differs == 0;
  };

  // Candidates that run and do the first choice's arithmetic (else a split-K, another reduction
  // order); the first choice itself is eligible[0].
  std::vector<int> eligible;
  for (int i = 0; i < static_cast<int>(plan.candidates.size()); ++i) {
    const auto& candidate = plan.candidates[i];
    bool ok = candidate.state == CUBLAS_STATUS_SUCCESS &&
              candidate.workspaceSize <= args.workspace_bytes;
    for (const bool added : {false, true}) {
      void* reference = added ? added_reference : written_reference;
      void* d = i == 0 ? reference : output;
      ok = ok && prepare(d, added) && launch(i, d, added ? &one : &zero) &&
           (i == 0 || equals(reference));
    }
    if (!ok) cudaGetLastError();  // this call's failure must not surface in a later check
    if (!ok && i == 0) return -1;  // nothing to compare with: the first choice stands
    if (ok) eligible.push_back(i);
  }
  if (eligible.size() < 2) return -1;

  const size_t count = eligible.size();
  Events events(2 * count * kTimedRounds);
  if (!events.ok()) {
    cudaGetLastError();
    return -1;
  }
  const float* beta = args.accumulate == Accumulate::kAdd ? &one : &zero;
  bool ok = true;
  for (int round = 0; round < kTimedRounds && ok; ++round) {
    for (size_t j = 0; j < count && ok; ++j) {
      const size_t slot = (j + round) % count;  // a rotating order: drift touches all alike
      const size_t event = 2 * (round * count + slot);
      ok = busy_wait(kQueueAheadNs, stream) == cudaSuccess &&
           cudaEventRecord(events[event], stream) == cudaSuccess &&
           launch(eligible[slot], output, beta) &&
           cudaEventRecord(events[event + 1], stream) == cudaSuccess;
    }
  }
  ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
  std::vector<float> medians(count);
  for (size_t slot = 0; slot < count && ok; ++slot) {
    std::vector<float> samples(kTimedRounds);
    for (int round = 0; round < kTimedRounds && ok; ++round) {
      const size_t event = 2 * (round * count + slot);
      ok = cudaEventElapsedTime(&samples[round], events[event], events[event + 1]) == cudaSuccess;
    }
    std::nth_element(samples.begin(), samples.begin() + kTimedRounds / 2, samples.end());
    medians[slot] = samples[kTimedRounds / 2];
  }
  if (!ok) {
    cudaGetLastError();
    return -1;
  }
  const size_t fastest = std::min_element(medians.begin(), medians.end()) - medians.begin();
  return medians[fastest] < (1.0f - kMargin) * medians[0] ? eligible[fastest] : eligible[0];
}

// Times the plan's candidates if that is still to do and can be done now (not while the stream
// is being captured into a CUDA graph: it cannot be synchronised; a later call tunes).
void tune_if_pending(cublasLtHandle_t handle, Plan& plan, const GemmArgs& args,
                     cudaStream_t stream) {
  // An error the caller's earlier work left pending is the caller's to see: tune on a later call
  // (the tuner clears only its own errors).
  if (!plan.tuning_pending || !args.autotune || capturing(stream) ||
      cudaPeekAtLastError() != cudaSuccess) {
    return;
  }
  plan.tuning_pending = false;
  if (const int best = choose(handle, plan, args, stream); best >= 0) {
    plan.algo = plan.candidates[best].algo;
  }
  plan.candidates.clear();
  plan.candidates.shrink_to_fit();
}

#define SPLITGRAD_CUBLAS_TRY(call, what)               \
  do {                                                 \
    const cublasStatus_t status_ = (call);             \
    if (status_ != CUBLAS_STATUS_SUCCESS) {            \
      plan->status = GemmStatus{false, what, status_}; \
      return plan;                                     \
    }                                                  \
  } while (0)

std::unique_ptr<Plan> make_plan(cublasLtHandle_t handle, const GemmArgs& args, const PlanKey& key) {
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
  if (count > 1 && autotune_enabled()) {  // timed by the first call that may (not under capture)
    plan->candidates.assign(results, results + count);
    plan->tuning_pending = true;
  }
  return plan;
}

#undef SPLITGRAD_CUBLAS_TRY

Plan& plan_for(cublasLtHandle_t handle, const GemmArgs& args) {
  const PlanKey key = key_of(args);
  auto& plans = cache();
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, make_plan(handle, args, key)).first;
  return *it->second;
}

}  // namespace

GemmStatus gemm(cublasLtHandle_t handle, const GemmArgs& args, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(
      cache_mutex);  // the cached descriptor's bias pointer is per call
  Plan& plan = plan_for(handle, args);
  if (!plan.found) return plan.status;
  tune_if_pending(handle, plan, args, stream);
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
