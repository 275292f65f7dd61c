#!/usr/bin/env bash
# The GPU check of issue 30 (one H200, at most 8.5 minutes): NCCL all-reduce bug and fix, an NCCL sync group of
# one, CUDA-IPC weight sync into a plain-torch receiver, the GPU-marked tests, GRPO with the torch, FSDP2 and
# DeepSpeed strategies in bf16 on a ~0.4B Qwen3-shaped model (DeepSpeed: ZeRO-3 with --ds.enable_sleep and
# --ds.adam_offload, from the wheel fetch_wheels.sh builds with DS_BUILD_OPS=0; its cpu_adam op is JIT-built
# there), TRL side by side; first, after the model, the vLLM stages of issue 44 (rlhforge's vLLM engine with
# sleep/wake, the hybrid engine through Ray with CUDA-IPC sync, TRL with vLLM), from vLLM 0.26, Ray and DeepSpeed
# carried by benchmarks/gpu/carry_kit.py (its `plan` prints the device calls). Writes
# benchmarks/results/gpu_check.json after every stage. See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/fetch_wheels.sh            # first, on a machine with a package index: .whl/ (~7 MiB)
#   bash benchmarks/gpu/check_rl.sh                # the check (GPU; installs .whl/*.whl into /tmp/site)
#   bash benchmarks/gpu/check_rl.sh --dry-run      # print every command, run none
#   bash benchmarks/gpu/check_rl.sh --cpu-smoke    # the same stages on CPU, tiny model (~1.5 min), /tmp only
#   bash benchmarks/gpu/check_rl.sh --help         # all options (passed to check_rl.py)
#
# Environment: CHECK_RL_PYTHON (the Python to use). When $OUT names a folder (the device tool), the results
# JSON and the log are written there too. Exit: 0 every stage passed; 1 otherwise.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1

mode=gpu
for arg in "$@"; do
    case "$arg" in
        --cpu-smoke) mode=cpu ;;
        --dry-run|-h|--help) [ "$mode" = gpu ] && mode=any ;;
    esac
done

# The Python with torch: on the GPU machine `python3` (/opt/torch/.venv), here the repo's .venv.
if [ "$mode" = cpu ]; then
    candidates=("${CHECK_RL_PYTHON:-}" "$REPO/.venv/bin/python" "$(command -v python3 || true)")
else
    candidates=("${CHECK_RL_PYTHON:-}" "$(command -v python3 || true)" /opt/torch/.venv/bin/python3 "$REPO/.venv/bin/python")
fi
PY=""
for cand in "${candidates[@]}"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if [ "$mode" = any ]; then PY="$cand"; break; fi
    probe='import torch, sys; sys.exit(0 if (torch.cuda.is_available() or sys.argv[1] == "cpu") else 3)'
    if timeout 120 "$cand" -c "$probe" "$mode" >/dev/null 2>&1; then PY="$cand"; break; fi
    echo "[check_rl.sh] $cand: no torch$([ "$mode" = gpu ] && echo ' with CUDA')" >&2
done
if [ -z "$PY" ]; then
    PY="$(command -v python3 || echo python3)"
    echo "[check_rl.sh] no Python here imports torch$([ "$mode" = gpu ] && echo ' with CUDA'); using $PY so that" \
         "the results JSON records the failure" >&2
fi

LOGDIR="/tmp/rlhforge_gpu_check$([ "$mode" = cpu ] && echo _smoke)"
mkdir -p "$LOGDIR"
LOG="$LOGDIR/check_rl.log"
TEES=("$LOG")
if [ "$mode" = gpu ] && [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then TEES+=("$OUT/check_rl.log"); fi
echo "[check_rl.sh] python: $PY; log: ${TEES[*]}"

"$PY" "$REPO/benchmarks/gpu/check_rl.py" --python "$PY" "$@" 2>&1 | tee "${TEES[@]}"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || echo "[check_rl.sh] FAILED: exit $rc (see failed_stages in the results JSON)" >&2
exit "$rc"
