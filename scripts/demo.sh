#!/usr/bin/env bash
# The main job: builds splitgrad and runs the demo (on the CPU unless --device cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
pip install --no-build-isolation -q .
python examples/demo.py "$@"
