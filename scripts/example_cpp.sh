#!/usr/bin/env bash
# Builds the out-of-tree C++ example (examples/cpp) from a clean build folder against an installed
# splitgrad, as a C++ user would (find_package(Torch), find_package(splitgrad)), and runs it: it
# exits non-zero unless its training matches plain libtorch autograd.
#   scripts/example_cpp.sh pip [ARGS]          the splitgrad that pip installed (splitgrad.cmake_prefix_path)
#   scripts/example_cpp.sh prefix DIR [ARGS]   the prefix of a `cmake --install`
# ARGS go to the example (`cuda` runs it on the GPU).
# Uses the active Python's PyTorch (torch.utils.cmake_prefix_path). CI runs both from scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pip) splitgrad_prefix="$(python3 -c 'import splitgrad; print(splitgrad.cmake_prefix_path)')"; shift ;;
  prefix) splitgrad_prefix="$(cd "${2:?usage: $0 prefix DIR}" && pwd)"; shift 2 ;;
  *) echo "usage: $0 pip [ARGS] | prefix DIR [ARGS]" >&2; exit 2 ;;
esac
torch_prefix="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
cmake -S examples/cpp -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$splitgrad_prefix" > "$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
# The package found must be the one asked for (not, say, a build tree's).
found="$(sed -n 's/^splitgrad_DIR:PATH=//p' "$build/CMakeCache.txt")"
case "$found" in
  "$splitgrad_prefix"/*) echo "example_cpp: splitgrad package $found" ;;
  *) echo "example_cpp: found splitgrad in $found, not under $splitgrad_prefix" >&2; exit 1 ;;
esac
cmake --build "$build"
"$build/train_tied" "$@"
