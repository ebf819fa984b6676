#!/usr/bin/env bash
# The main job: both incidents reproduced in a simulated engine, then prevented by kvobs.
# Sets up .venv itself; needs no external service. Extra arguments go to `kvobs demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvobs demo "$@"
