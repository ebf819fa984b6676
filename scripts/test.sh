#!/usr/bin/env bash
# The whole test suite. Installs what it needs: the Debian packages prometheus and prometheus-alertmanager
# (promtool, amtool and the real servers the ops tests start), .venv with the test dependencies, and
# .venv-vllm with a CPU build of vLLM for the tests on a running engine.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null || ! command -v amtool >/dev/null; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null
fi
scripts/setup.sh test
# A running vLLM for the engine tests, in its own .venv-vllm (tests/integrations/vllm/test_vllm_engine*.py)
scripts/setup_vllm.sh
exec .venv/bin/python -m pytest -q "$@"
