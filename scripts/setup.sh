#!/usr/bin/env bash
# Shared set-up for demo.sh and test.sh: a virtual environment in .venv with kvobs installed.
# Usage: scripts/setup.sh [EXTRA]   (EXTRA: "test" adds the test dependencies)
# The installs run only when .venv is not current for EXTRA: each extra has its own stamp file in .venv holding
# a checksum of pyproject.toml, this script and the extra's name, written once its installs succeeded.
# KVOBS_SETUP_FORCE=1 reinstalls anyway (or delete .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
python="${PYTHON:-python3}"
stamp=".venv/.kvobs-setup-${extra:-base}"
current="$(cat pyproject.toml scripts/setup.sh | cksum) extra=${extra}"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$current" ] \
    && [ "${KVOBS_SETUP_FORCE:-0}" != "1" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
rm -f "$stamp"
.venv/bin/python -m pip install --quiet --upgrade pip
# torch (kvobs's `torch` extra: the demo and the tests need it) is pinned to 2.13.0 on its own first: on the
# project's machines this takes the CPU build on disk, and any other spec would download a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0" numpy
if [ -n "$extra" ]; then
  .venv/bin/python -m pip install --quiet -e ".[$extra]"
else
  .venv/bin/python -m pip install --quiet -e .
fi
printf '%s\n' "$current" > "$stamp"
