#!/usr/bin/env bash
# Refresh the committed locks from pyproject.toml's ranges and requirements/*.in (docs/install.md, "Locked installs"):
#   requirements/cpu.lock   the whole CPU stack (torch's CPU build, vLLM's CPU build, every extra but bench/wandb):
#                           what scripts/setup_env.sh installs by default, CI included
#   requirements/cuda.lock  a single-GPU CUDA machine (torch 2.11.0 = CUDA 13.0, vLLM 0.26.0, Python 3.12):
#                           resolved here, not installable here (no GPU); the versions the GPU path is checked against
#   requirements/gpu-carry.lock  what benchmarks/gpu/carry_kit.py carries to the GPU check's machine (vLLM 0.26, Ray,
#                           DeepSpeed, ...), resolved against cuda.lock
# Usage: bash scripts/lock.sh [--upgrade]    (without --upgrade, uv keeps what the lock already pins where it can)
# Needs uv (in the dev extra; else `pip install uv`). Then run the tests: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-$(command -v uv || echo .venv/bin/uv)}"
[ -x "$UV" ] || { echo "lock.sh: uv not found (pip install uv, or bash scripts/setup_env.sh dev)" >&2; exit 2; }
EXTRAS=(dev report serve agents ray math vision tinker envs deepspeed tensorboard)
EXTRA_FLAGS=(); for e in "${EXTRAS[@]}"; do EXTRA_FLAGS+=(--extra "$e"); done
# torch's CPU build: from pip's find-links where pip.conf names them (a local file on this project's machines),
# else from PyTorch's CPU index (TORCH_INDEX_URL to pick another)
FIND=()
for link in $(python3 -m pip config get global.find-links 2>/dev/null || true); do FIND+=(--find-links "$link"); done
[ ${#FIND[@]} -gt 0 ] || FIND=(--extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
# vLLM's CPU build lists torchvision/torchaudio/torchcodec (broken beside the CPU torch: every import of peft,
# transformers and vLLM fails) and triton (~1 GB nothing on a CPU torch runs): resolved, never installed
NO_EMIT=(--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec --no-emit-package triton)
COMMON=(--index-strategy unsafe-best-match --no-header --annotation-style line "$@")
"$UV" pip compile pyproject.toml requirements/cpu.in "${EXTRA_FLAGS[@]}" "${FIND[@]}" "${NO_EMIT[@]}" "${COMMON[@]}" \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o requirements/cpu.lock
"$UV" pip compile pyproject.toml requirements/cuda.in "${EXTRA_FLAGS[@]}" "${COMMON[@]}" \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o requirements/cuda.lock
# what the GPU check carries to the GPU machine (benchmarks/gpu/carry_kit.py), at the CUDA lock's versions
"$UV" pip compile requirements/gpu-carry.in -c requirements/cuda.lock "${COMMON[@]}" \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o requirements/gpu-carry.lock
echo "locks written: requirements/cpu.lock ($(grep -c '==' requirements/cpu.lock) pins), requirements/cuda.lock ($(grep -c '==' requirements/cuda.lock) pins)"
