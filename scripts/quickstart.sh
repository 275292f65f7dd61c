#!/usr/bin/env bash
# The README's first command: set up .venv, then run the main job on the embedded default
# (a tiny local model on a built-in task, CPU). Extra flags go to `rlhforge quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh report
exec .venv/bin/rlhforge quickstart "$@"
