#!/usr/bin/env bash
# Builds and installs the Python package (splitgrad and its C++ extension) into the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
pip install --no-build-isolation -q .
