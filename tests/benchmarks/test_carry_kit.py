"""The GPU carry kit (benchmarks/gpu/carry_kit.py): chunks join back byte for byte and a damaged chunk is named;
a stripped wheel still installs; the committed manifest's bundle covers what rlhforge's GPU paths import."""

import ast
import importlib.util
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("carry_kit", ROOT / "benchmarks" / "gpu" / "carry_kit.py")
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def _manifest(bundle: bytes, chunks: list[bytes]) -> dict:
    return {"bundle_sha256": kit.sha256(bundle),
            "chunks": [{"name": f"chunk_{i:02d}", "bytes": len(c), "sha256": kit.sha256(c)} for i, c in enumerate(chunks)]}


def test_split_and_join_are_byte_identical_and_name_a_bad_chunk():
    wheels = {f"pkg{i}-1.0-py3-none-any.whl": os.urandom(1000 + 37 * i) for i in range(5)}
    bundle = kit.pack(wheels)
    assert kit.pack(dict(reversed(list(wheels.items())))) == bundle  # name order, fixed metadata: reproducible
    chunks = kit.split(bundle, 1024)
    assert len(chunks) == -(-len(bundle) // 1024) and all(len(c) == 1024 for c in chunks[:-1])
    manifest = _manifest(bundle, chunks)
    assert kit.join(chunks, manifest) == bundle
    assert kit.unpack(kit.join(chunks, manifest)) == wheels
    bad = list(chunks)
    bad[2] = bad[2][:-1] + bytes([bad[2][-1] ^ 1])
    with pytest.raises(ValueError, match="chunk_02: .*carry it again"):
        kit.join(bad, manifest)
    with pytest.raises(ValueError, match=f"{len(chunks) - 1} chunks, the manifest lists {len(chunks)}"):
        kit.join(chunks[:-1], manifest)


def test_chunk_size_leaves_room_for_the_repository():
    limit = kit.TRANSFER_LIMIT
    assert kit.chunk_size(5 * 2**20) == limit - 5 * 2**20 - kit.MARGIN
    with pytest.raises(ValueError, match="less than 8 MiB"):
        kit.chunk_size(limit - 4 * 2**20)


def _wheel(tmp_path: Path) -> bytes:
    """A tiny real wheel (pip wheel of a one-module project), with an extra 'kernel' file to strip."""
    src = tmp_path / "src"
    (src / "demo").mkdir(parents=True)
    (src / "demo" / "__init__.py").write_text("VALUE = 42\n")
    (src / "demo" / "_fa2_C.abi3.so").write_bytes(b"\0" * 4096)
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
                                        '[project]\nname = "demo"\nversion = "1.0"\n'
                                        '[tool.setuptools.package-data]\ndemo = ["*.so"]\n')
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    return next(out.glob("demo-1.0-*.whl")).read_bytes()


def test_a_stripped_wheel_installs_without_the_stripped_members(tmp_path):
    import re

    wheel = _wheel(tmp_path)
    slim, removed = kit.strip_wheel(wheel, (re.compile(r"^demo/_fa2_C\.abi3\.so$"),))
    assert removed == ["demo/_fa2_C.abi3.so"]
    names = zipfile.ZipFile(io.BytesIO(slim)).namelist()
    assert "demo/_fa2_C.abi3.so" not in names and "demo/__init__.py" in names
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    assert "_fa2_C" not in zipfile.ZipFile(io.BytesIO(slim)).read(record).decode()
    assert kit.import_names(slim) == ["demo"]
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    path.write_bytes(slim)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(path)], check=True, capture_output=True)
    assert not (target / "demo" / "_fa2_C.abi3.so").exists()
    out = subprocess.run([sys.executable, "-c", "import demo; print(demo.VALUE)"], env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


#: what the GPU machine has (benchmarks/gpu/carry_kit.py ON_MACHINE, as import names)
MACHINE_IMPORTS = {"torch", "triton", "transformers", "accelerate", "peft", "numpy", "pyarrow", "pandas", "yaml",
                   "safetensors", "tokenizers", "tqdm", "packaging", "huggingface_hub", "psutil", "jinja2"}
#: imported by rlhforge's GPU paths only for features the GPU check does not run (each lazily, with its own error)
OPTIONAL = {"flash_attn": "--ds.ring_attn_size / --model.attn_implementation flash_attention_2",
            "liger_kernel": "--model.use_liger_kernel", "math_verify": "math rewards", "matplotlib": "report plots",
            "wandb": "--logger.wandb", "torchvision": "vision-language engines"}
GPU_PATHS = ["algorithms", "backend", "config", "data", "distributed", "models", "rollout", "rewards", "trainers",
             "tracking", "cli/train_ppo_ray.py", "cli/tiny_model.py", "cli/main.py", "cli/env.py"]


def _third_party_imports() -> set[str]:
    files = []
    for part in GPU_PATHS:
        p = ROOT / "rlhforge" / part
        files += list(p.rglob("*.py")) if p.is_dir() else [p]
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "rlhforge"}


def test_the_bundle_covers_what_the_gpu_paths_import():
    manifest = json.loads((ROOT / "benchmarks" / "gpu" / "carry_manifest.json").read_text())
    bundled = {name for w in manifest["wheels"] for name in w["imports"]}
    assert {"vllm", "ray", "deepspeed", "tyro", "datasets", "trl"} <= bundled
    imported = _third_party_imports()
    assert {"vllm", "ray", "deepspeed", "tyro", "torch", "transformers"} <= imported  # the walk sees the GPU paths
    missing = imported - bundled - MACHINE_IMPORTS - set(OPTIONAL)
    assert not missing, f"imported by rlhforge's GPU paths, neither carried nor on the GPU machine: {sorted(missing)}"
    # every carried wheel is at requirements/gpu-carry.lock's version, and nothing the machine has is carried
    pins = kit.read_pins(ROOT / "requirements" / "gpu-carry.lock")
    for w in manifest["wheels"]:
        name, version = w["file"].split("-")[:2]
        assert pins[kit.normalize(name)] == version, w["file"]
        assert kit.normalize(name) not in kit.ON_MACHINE and kit.normalize(name) not in kit.LEFT_OUT
    assert sum(c["bytes"] for c in manifest["chunks"]) == manifest["bundle_bytes"]
    assert all(c["bytes"] <= manifest["chunk_limit_bytes"] for c in manifest["chunks"])
    steps = kit.plan(manifest)
    assert len(steps) == len(manifest["chunks"]) + 1 and "carry_kit.py install --from /tmp/carry" in steps[-1]
