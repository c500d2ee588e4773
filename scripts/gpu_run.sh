#!/usr/bin/env bash
# On the GPU machine (no network): build splitgrad from the source tree with its own CMake, against
# the machine's PyTorch, into a private site folder; then run what is asked. Wheels for test-only
# packages the machine may lack can be carried in .whl/ (see BENCHMARKS.md): hypothesis with its
# dependencies for the tests, and nvidia-cutlass, whose headers the SM90 grouped GEMMs are built from.
#   bash scripts/gpu_run.sh build                  (SPLITGRAD_CMAKE_ARGS: more -D options)
#   bash scripts/gpu_run.sh pytest [pytest args...]
#   bash scripts/gpu_run.sh python FILE [args...]
#   bash scripts/gpu_run.sh run PROGRAM [args...]     (a C++ program of build/gpu, e.g. bench_host_overhead)
#   bash scripts/gpu_run.sh suite a|b [pytest args...] (the whole pytest suite in two halves that
#     each fit one 10-minute device call: b the multi-process files, a every other test file)
set -euo pipefail
cd "$(dirname "$0")/.."
site="${SPLITGRAD_SITE:-/tmp/splitgrad-site}"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
case "${1:-build}" in
  build)
    mkdir -p "$site"
    if compgen -G ".whl/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    fi
    # The system g++, as PyTorch's own extensions use: the machine's CXX may name a toolchain that
    # links libstdc++ statically, and two libstdc++ copies in one process crash on the first
    # formatted error message (locale facets registered in one copy, used from the other).
    # nvcc's host compiler too (CUDAHOSTCXX), or CMake adds that toolchain's library folders, and
    # its static libstdc++, to the link. The cache is dropped so the compilers are identified anew.
    compiler=()
    if [ -x /usr/bin/g++ ]; then
      export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
      compiler=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
      rm -rf build/gpu/CMakeCache.txt build/gpu/CMakeFiles
    fi
    cmake -S . -B build/gpu -G Ninja "${compiler[@]}" -DSPLITGRAD_BUILD_PYTHON=ON -DSPLITGRAD_BUILD_BENCHMARKS=ON -DCMAKE_BUILD_TYPE=Release \
      -DPython3_EXECUTABLE="$(command -v python3)" ${SPLITGRAD_CMAKE_ARGS:-} > build-gpu.log 2>&1 || { cat build-gpu.log; exit 1; }
    cmake --build build/gpu -j "$(nproc)" >> build-gpu.log 2>&1 || { tail -50 build-gpu.log; exit 1; }
    if ! readelf -d build/gpu/libsplitgrad.so | grep -q 'libstdc++' ||
       nm -D --defined-only build/gpu/libsplitgrad.so | grep -q ' __cxa_throw$'; then
      echo "libsplitgrad.so does not link libstdc++ dynamically (a static libstdc++ crashes with PyTorch's)"
      readelf -d build/gpu/libsplitgrad.so | grep NEEDED
      grep -E "CMAKE_(CXX|CUDA)_COMPILER|CMAKE_CUDA_HOST_COMPILER|CMAKE_LINKER" build/gpu/CMakeCache.txt
      grep -A3 "^build libsplitgrad.so" build/gpu/build.ninja | head -8
      exit 1
    fi
    cmake --install build/gpu --prefix "$site" >> build-gpu.log 2>&1
    cp python/splitgrad/*.py "$site/splitgrad/"
    grep -E "splitgrad:" build-gpu.log || true
    # On Hopper a build without CUTLASS's headers loops over the experts and reads device splits on
    # the host: the grouped tests and benchmarks would measure the wrong thing. The machine has no
    # network: carry nvidia-cutlass's wheel (pip download --no-deps nvidia-cutlass==4.2.0.0) in .whl/.
    if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else 1)" &&
       ! grep -q "building the SM90 grouped GEMMs" build-gpu.log; then
      echo "built without the SM90 grouped GEMMs on a Hopper GPU: put nvidia-cutlass's wheel in .whl/ (see above)"
      exit 1
    fi
    python3 -c "import splitgrad, torch; print('splitgrad', splitgrad.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    ;;
  pytest) shift; python3 -m pytest "$@" ;;
  python) shift; python3 "$@" ;;
  run) shift; "build/gpu/$1" "${@:2}" ;;
  suite)
    half="${2:-}"; shift 2 || true
    slow=(test_distributed test_workflows test_pipelining test_fsdp test_demo test_stage_costs
          test_reproducer test_cpp_package)
    files=()
    for f in tests/python/test_*.py; do
      name=$(basename "$f" .py)
      in_slow=0
      for s in "${slow[@]}"; do [ "$name" = "$s" ] && in_slow=1; done
      if { [ "$half" = a ] && [ $in_slow = 0 ]; } || { [ "$half" = b ] && [ $in_slow = 1 ]; }; then
        files+=("$f")
      fi
    done
    [ ${#files[@]} -gt 0 ] || { echo "usage: $0 suite a|b [pytest args...]"; exit 2; }
    parallel=()  # pytest-xdist where installed (the device has it), one file per worker
    if python3 -c "import xdist" 2> /dev/null; then parallel=(-n 16 --dist loadfile); fi
    python3 -m pytest "${files[@]}" -q -p no:cacheprovider "${parallel[@]}" -rfE "$@" ;;
  *) echo "usage: $0 build | pytest [args] | python FILE [args] | run PROGRAM [args] | suite a|b"; exit 2 ;;
esac
