#!/usr/bin/env bash
# All tests: the C++ library with its GoogleTest suite and example (ctest), the example again out of
# tree against the installed C++ package (scripts/example_cpp.sh), the same suite under
# AddressSanitizer + UBSan and the two-thread tests under ThreadSanitizer (scripts/sanitize.sh),
# then the Python package, the example against the C++ package it ships, and the pytest suite.
# Fails on any failure, and when pytest collects no test (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
jobs="$(nproc)"

# SPLITGRAD_BUILD_PYTHON=OFF: the C++ package's layout here (the pip install below turns it on in
# the same folder).
cmake -S . -B build/cpp -G Ninja -DSPLITGRAD_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DSPLITGRAD_BUILD_PYTHON=OFF -DPython3_EXECUTABLE="$(command -v python)"
cmake --build build/cpp -j "$jobs"
ctest --test-dir build/cpp --output-on-failure
# The C++ package as `cmake --install` lays it out, and the out-of-tree example built against it.
prefix="$(mktemp -d)"
cmake --install build/cpp --prefix "$prefix" > /dev/null
bash scripts/example_cpp.sh prefix "$prefix"
rm -rf "$prefix"
# The same suite and the example under AddressSanitizer + UBSan, in build/asan, and the tests that
# train from two threads under ThreadSanitizer, in build/tsan (any report fails).
bash scripts/sanitize.sh asan
bash scripts/sanitize.sh tsan

# In build/cpp: the library's objects (the CUDA kernels included) are those built above, so only
# the Python module compiles.
pip install --no-build-isolation -q -Cbuild-dir=build/cpp .
# The C++ package the Python package ships (splitgrad.cmake_prefix_path): the example against it.
bash scripts/example_cpp.sh pip
# --durations: the slowest tests in the log, to keep the run well inside CI's time.
python -m pytest tests/python --durations=25 "$@"
