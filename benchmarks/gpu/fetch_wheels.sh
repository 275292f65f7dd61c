#!/usr/bin/env bash
# Download, on a machine that reaches a package index, the pure-Python wheels that the GPU check needs on
# the GPU machine and that the machine lacks, into REPO/.whl/ (git-ignored; carried to the machine with the
# working tree). See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/fetch_wheels.sh            # -> .whl/*.whl, prints the total size
#
# The GPU machine (one H200, Python 3.12, torch 2.11, transformers 5.x, accelerate, peft, triton, numpy,
# pyarrow, pandas, pytest, msgpack, rich, pyyaml, tqdm, fsspec, huggingface-hub, xxhash, safetensors,
# tokenizers) has no package index and none of:
#   tyro (+ docstring-parser, typeguard)  rlhforge's flag parsing: every CLI, `rlhforge tiny-model` and the RL run
#   datasets (+ dill, multiprocess)       TRL's trainers take a datasets.Dataset (rlhforge's built-in prompts do not
#                                         need it, but the GPU-marked tests' modules and TRL import it)
#   trl                                   the side-by-side GRPO stage (pyproject's `bench` extra: trl>=1.16,<1.17)
#   deepspeed (+ hjson, pydantic, pydantic-core, annotated-types, typing-inspection)
#                                         the grpo_deepspeed stage (issue 39): DeepSpeed is an sdist only, built
#                                         here with `pip wheel --no-deps` and DS_BUILD_OPS=0 into a pure-Python
#                                         wheel (its ops, cpu_adam for --ds.adam_offload, are JIT-built on the
#                                         machine with its ninja and compiler); the version is requirements/
#                                         cuda.lock's pin. Its other needs (einops, msgpack, ninja, numpy,
#                                         packaging, psutil, py-cpuinfo, tqdm) are on the machine.
# typing-extensions: typeguard needs >= 4.14, newer than some torch installs bring.
# Each wheel is py3-none-any (multiprocess: py312-none-any; pydantic-core: cp312 manylinux); their Requires-Dist
# are covered by the list above
# plus psutil and jinja2 (accelerate's and torch's dependencies). Fails when the total is over MAX_MIB.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${WHEEL_DIR:-$REPO/.whl}"
MAX_MIB="${MAX_MIB:-40}"
PY="${PYTHON:-python3}"

WHEELS=(
    tyro==1.0.17
    docstring-parser==0.18.0
    typeguard==4.6.1
    typing-extensions==4.16.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    trl==1.16.0
)
# DeepSpeed and what it needs that the machine lacks, at requirements/cuda.lock's pins
pin() { grep -E "^$1==" "$REPO/requirements/cuda.lock" | head -1 | sed -E 's/[[:space:]].*//'; }
DS_PIN="$(pin deepspeed)"
for name in hjson pydantic pydantic-core annotated-types typing-inspection; do
    spec="$(pin "$name")"
    [ -n "$spec" ] || { echo "fetch_wheels: no $name pin in requirements/cuda.lock" >&2; exit 1; }
    WHEELS+=("$spec")
done
[ -n "$DS_PIN" ] || { echo "fetch_wheels: no deepspeed pin in requirements/cuda.lock" >&2; exit 1; }

mkdir -p "$DEST"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${WHEELS[@]}"
ds_version="${DS_PIN##*==}"
if ! ls "$DEST" | grep -qE "^deepspeed-${ds_version}-py3-none-any\.whl$"; then
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$DEST" "$DS_PIN"
fi
WHEELS+=("$DS_PIN")

# only what this list names stays (an older version left from an earlier list would be installed too)
keep=()
for spec in "${WHEELS[@]}"; do
    name="${spec%%==*}"; version="${spec##*==}"
    norm="$(echo "$name" | tr '-' '_')"
    f="$(ls "$DEST" | grep -iE "^${norm}-${version}-.*\.whl$" | head -1 || true)"
    if [ -z "$f" ]; then
        echo "fetch_wheels: no wheel for $spec in $DEST" >&2
        exit 1
    fi
    keep+=("$f")
done
for f in "$DEST"/*.whl; do
    base="$(basename "$f")"
    if ! printf '%s\n' "${keep[@]}" | grep -qxF "$base"; then
        echo "fetch_wheels: removing $base (not in the list)"
        rm -f "$f"
    fi
done

bytes=0
for f in "${keep[@]}"; do
    n=$(stat -c %s "$DEST/$f")
    bytes=$((bytes + n))
    awk -v n="$n" -v f="$f" 'BEGIN { printf "  %8.1f KiB  %s\n", n / 1024, f }'
done
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1048576 }')
echo "fetch_wheels: ${#keep[@]} wheels, $bytes bytes ($mib MiB) in $DEST"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
    echo "fetch_wheels: over the ${MAX_MIB} MiB cap (the GPU machine takes at most 64 MiB of carried files)" >&2
    exit 1
fi
