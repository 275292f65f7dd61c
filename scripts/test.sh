#!/usr/bin/env bash
# The README's second command: set up .venv with the test extras, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
export TQDM_DISABLE=1
exec .venv/bin/python -m pytest -q "$@"
