#!/usr/bin/env bash
# GPU check of issue #11 (one H200, under 8 minutes): install the CUDA vLLM wheel that matches the
# machine's torch, build a ~100M-parameter Llama, run GRPO with one actor rank and one colocated
# vLLM engine actor (NCCL sync, then --vllm.sync_with_ray), compare greedy tokens after the sync, and
# write benchmarks/results/gpu_rl.json. See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/check_rl.sh               # the check (GPU)
#   bash benchmarks/gpu/check_rl.sh --dry-run     # print every command, run none
#   bash benchmarks/gpu/check_rl.sh --cpu-smoke   # same pipeline, tiny model, CPU, HF engine (~1 min)
#   bash benchmarks/gpu/check_rl.sh --help        # all options (passed to check_rl.py)
#
# Environment: CHECK_RL_PYTHON (the Python to use), CHECK_RL_WORK (work dir, default
# /tmp/rlhforge_gpu_check), CHECK_RL_WHEELS (a wheel folder for pip --find-links),
# CHECK_RL_VLLM_SPEC (default "vllm": pip picks the wheel whose torch pin matches).
# Exit: 0 all passed; 1 an error; 2 partial (vLLM/Ray unavailable: HF-engine numbers only).
# When $OUT is set (the device tool), the results JSON and the log are copied there.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1
WORK="${CHECK_RL_WORK:-/tmp/rlhforge_gpu_check}"
mkdir -p "$WORK"
LOG="$WORK/check_rl.log"

want_cuda=1
for arg in "$@"; do
    case "$arg" in
        --cpu-smoke|--dry-run|-h|--help) want_cuda=0 ;;
    esac
done

# The Python that holds torch (with CUDA for the GPU check): the first candidate that passes.
probe='import torch; print("TORCH", torch.__version__, int(torch.cuda.is_available()))'
PY=""
fallback=""
for cand in "${CHECK_RL_PYTHON:-}" "$REPO/.venv/bin/python" "$(command -v python3 || true)" \
            /opt/torch/.venv/bin/python3 "$(command -v python || true)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    line="$(timeout 120 "$cand" -c "$probe" 2>/dev/null | grep '^TORCH ' || true)"
    [ -n "$line" ] || continue
    echo "[check_rl.sh] $cand: torch $(echo "$line" | cut -d' ' -f2), cuda $(echo "$line" | cut -d' ' -f3)"
    [ -n "$fallback" ] || fallback="$cand"
    if [ "$want_cuda" = 0 ] || [ "$(echo "$line" | cut -d' ' -f3)" = 1 ]; then
        PY="$cand"
        break
    fi
done
if [ -z "$PY" ]; then
    if [ "$want_cuda" = 1 ]; then
        echo "[check_rl.sh] ERROR: no Python here imports a torch that sees a CUDA device (set CHECK_RL_PYTHON);" \
             "continuing so that the results JSON records it" >&2
    fi
    PY="${fallback:-$(command -v python3 || echo python3)}"
fi
echo "[check_rl.sh] using $PY; log: $LOG"

"$PY" "$REPO/benchmarks/gpu/check_rl.py" --base-python "$PY" --work "$WORK" "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$LOG" "$OUT/" 2>/dev/null
    for f in "$REPO/benchmarks/results/gpu_rl.json" "$WORK/gpu_rl_cpu_smoke.json"; do
        [ -f "$f" ] && cp "$f" "$OUT/" 2>/dev/null
    done
fi
if [ "$rc" != 0 ]; then
    echo "[check_rl.sh] FAILED or PARTIAL: exit $rc (see the 'errors' / 'partial' fields of the results JSON)" >&2
fi
exit "$rc"
