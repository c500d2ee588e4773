#!/usr/bin/env bash
# All tests: the C++ library with its GoogleTest suite and example (ctest), the same under
# AddressSanitizer + UBSan and the two-thread tests under ThreadSanitizer (scripts/sanitize.sh),
# then the Python package and its pytest suite. Fails on any failure, and when pytest collects no test (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
jobs="$(nproc)"

cmake -S . -B build/cpp -G Ninja -DSPLITGRAD_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DPython3_EXECUTABLE="$(command -v python)"
cmake --build build/cpp -j "$jobs"
ctest --test-dir build/cpp --output-on-failure
# The same suite and the example under AddressSanitizer + UBSan, in build/asan, and the tests that
# train from two threads under ThreadSanitizer, in build/tsan (any report fails).
bash scripts/sanitize.sh asan
bash scripts/sanitize.sh tsan

pip install --no-build-isolation -q .
python -m pytest tests/python "$@"
