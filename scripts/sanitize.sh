#!/usr/bin/env bash
# The C++ suite under sanitizers, each in a build folder of its own (libtorch is not instrumented;
# splitgrad, the tests and the example are):
#   scripts/sanitize.sh asan   AddressSanitizer + UndefinedBehaviorSanitizer: all of ctest (the
#                              GoogleTest suite and the C++ example), failing on any report
#   scripts/sanitize.sh tsan   ThreadSanitizer: the tests that train from two threads at once
#                              (two processes side by side, 25 times each)
# SPLITGRAD_JOBS sets the build's parallelism (default: all cores). Needs the venv (scripts/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-asan}"
jobs="${SPLITGRAD_JOBS:-$(nproc)}"
supp="$PWD/scripts/sanitizers"
case "$mode" in
  asan) dir=build/asan flags=address,undefined ;;
  tsan) dir=build/tsan flags=thread ;;
  *) echo "usage: $0 asan|tsan" >&2; exit 2 ;;
esac
# Set before the build too: gtest_discover_tests runs the test binary to list its tests.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_odr_violation=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
# report_mutex_bugs=0: libtorch_cuda's static initialisers unlock a mutex of libtorch_cpu that TSan
# takes for destroyed (not suppressible by module: the report has no stack of its own to match).
export TSAN_OPTIONS="halt_on_error=1:report_mutex_bugs=0:suppressions=$supp/tsan.supp"
export OMP_NUM_THREADS=1  # libtorch's OpenMP pool is not instrumented: keep kernels on one thread

# -O1 -g1: the optimisation the sanitizers' docs advise and line tables for the reports' stacks;
# half the compile time of -O2 -g on libtorch's headers.
cmake -S . -B "$dir" -G Ninja -DSPLITGRAD_BUILD_TESTS=ON -DSPLITGRAD_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DSPLITGRAD_SANITIZE="$flags" -DPython3_EXECUTABLE="$(command -v python)"
if [ "$mode" = asan ]; then
  cmake --build "$dir" -j "$jobs" --target splitgrad_tests train_tied
  ctest --test-dir "$dir" --output-on-failure -j "$jobs"
else
  cmake --build "$dir" -j "$jobs" --target splitgrad_thread_tests
  # Two processes at once, 25 times each: a race shows only in some interleavings, and far more
  # of them come with the cores loaded (an unlocked .grad read: missed by 30 repeats alone, caught
  # by 2 of 3 processes of 100 repeats side by side).
  pids=()
  for _ in 1 2; do
    "$dir/tests/cpp/splitgrad_thread_tests" --gtest_brief=1 \
      --gtest_filter='ApiTest.TwoThreads*:ApiTest.BackwardDwAll*:ApiTest.WorkAnotherThreadTook*' \
      --gtest_repeat=25 &
    pids+=("$!")
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  exit "$failed"
fi
