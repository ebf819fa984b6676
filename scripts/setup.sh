#!/usr/bin/env bash
# Shared set-up for demo.sh and test.sh: a virtual environment in .venv with kvobs installed.
# Usage: scripts/setup.sh [EXTRA]   (EXTRA: "test" adds the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch 2.13.0 is pinned on its own first: on the project's machines this takes the CPU build on disk,
# and any other spec would download a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0" numpy
if [ -n "$extra" ]; then
  .venv/bin/python -m pip install --quiet -e ".[$extra]"
else
  .venv/bin/python -m pip install --quiet -e .
fi
