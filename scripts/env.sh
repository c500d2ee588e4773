# Sourced by the other scripts: a Python environment with PyTorch and the tools, kept outside the
# clone (PyTorch is several GB) and reused; created and filled on a fresh machine.
SPLITGRAD_VENV="${SPLITGRAD_VENV:-$HOME/.cache/splitgrad/venv}"
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$SPLITGRAD_VENV/bin/python" ]; then
  echo "splitgrad: creating the environment $SPLITGRAD_VENV (first run: downloads PyTorch)"
  python3 -m venv "$SPLITGRAD_VENV"
  "$SPLITGRAD_VENV/bin/pip" install -q --upgrade pip
fi
# shellcheck disable=SC1091
. "$SPLITGRAD_VENV/bin/activate"
pip install -q -r "$_root/requirements-dev.txt"
# CUTLASS's C++ headers for the SM90 grouped GEMMs; only the headers are used, so without the
# package's Python dependencies (cuda-python, scipy, ...).
pip install -q --no-deps nvidia-cutlass==4.2.0.0
# GoogleTest for the C++ suite (a Debian package).
if [ ! -f /usr/include/gtest/gtest.h ]; then
  echo "splitgrad: installing GoogleTest (libgtest-dev)"
  if [ "$(id -u)" = 0 ]; then sudo_=""; else sudo_="sudo"; fi
  $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq libgtest-dev
  unset sudo_
fi
unset _root
