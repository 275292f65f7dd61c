#!/usr/bin/env bash
# The README's first command: set up .venv, then run the main job on the embedded default
# (a tiny local model on a built-in task, CPU). Extra flags go to `rlhforge quickstart`.
# --help answers at once: from the installed rlhforge if .venv has one, else this header (no install first).
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    if [ -x .venv/bin/rlhforge ]; then exec .venv/bin/rlhforge quickstart --help; fi
    echo "usage: bash scripts/quickstart.sh [rlhforge quickstart flags]"
    echo "Sets up .venv (scripts/setup_env.sh report), then runs \`rlhforge quickstart\`: a tiny local model"
    echo "trained on a built-in task on CPU. Run it once (or bash scripts/setup_env.sh) to see every flag."
    exit 0
  fi
done
bash scripts/setup_env.sh report
exec .venv/bin/rlhforge quickstart "$@"
