"""The GPU carry kit (issue 44): vLLM 0.26, Ray and DeepSpeed carried to the GPU check's machine in chunks.

The machine (one H100/H200, Python 3.12, torch 2.11.0+cu130, transformers, accelerate, peft, triton; no package
index) takes at most 64 MiB per transfer, repository included, but keeps git-ignored files between calls while
it is warm. So the bundle is built here from exact pins (``requirements/gpu-carry.in`` resolved against
``requirements/cuda.lock``), stripped of what a dense model on Hopper never loads, packed into one tar, split
into chunks under the per-transfer limit, and described by a manifest of sha256 sums; there, the chunks are
joined, every sum checked, the wheels installed into ``/tmp/site`` and ``import vllm, ray, deepspeed`` tried.

    python benchmarks/gpu/carry_kit.py build      # here: -> .carry/ (git-ignored): chunk_00..NN, manifest.json
    python benchmarks/gpu/carry_kit.py plan       # the transfer plan: one device call per chunk, then the check
    python3 benchmarks/gpu/carry_kit.py install --from /tmp/carry   # there: join, check every sum, install, import
    python benchmarks/gpu/carry_kit.py install --check-only          # here: the dry run (join and check only)

The pure parts (``split``, ``join``, ``strip_wheel``, ``plan``, ``import_names``) are tested in
``tests/benchmarks/test_carry_kit.py``; ``benchmarks/gpu/carry_manifest.json`` is the manifest of the last
build (committed: the bundle's wheels, sizes, sums and import names, checked against rlhforge's GPU imports).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / ".carry"
MANIFEST = ROOT / "benchmarks" / "gpu" / "carry_manifest.json"
TRANSFER_LIMIT = 64 * 1024 * 1024  # bytes per device call, the repository's tracked files included
MARGIN = 2 * 1024 * 1024  # slack for untracked-not-ignored files and rounding
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]

#: distributions the GPU machine already has (platform-notes.md; torch's CUDA 13 wheels bring nvidia-*/cuda-*)
ON_MACHINE = {
    "torch", "triton", "transformers", "accelerate", "peft", "numpy", "pyarrow", "pandas", "pytest", "msgpack",
    "rich", "pyyaml", "tqdm", "fsspec", "huggingface-hub", "xxhash", "safetensors", "tokenizers", "psutil",
    "jinja2", "numba", "llvmlite", "filelock", "networkx", "sympy", "mpmath", "packaging", "requests", "urllib3",
    "certifi", "idna", "charset-normalizer", "markupsafe", "regex", "setuptools", "hf-xet", "python-dateutil",
    "pytz", "tzdata", "six", "pygments", "markdown-it-py", "mdurl", "pluggy", "iniconfig",
}
ON_MACHINE_PREFIXES = ("nvidia-", "cuda-")

#: left out: kernels and front-ends a dense text model on Hopper does not load (each imported lazily or under
#: an ImportError guard by vLLM 0.26), the audio/vision stack, and torch (the machine's own 2.11.0+cu130)
LEFT_OUT = {
    "torchvision": "vision models only", "torchaudio": "audio models only", "torchcodec": "audio/video only",
    "opencv-python-headless": "multimodal inputs only", "flashinfer-python": "FlashInfer backend; FA3 is Hopper's",
    "tilelang": "experimental kernels", "humming-kernels": "quantised kernels", "quack-kernels": "CuTe-DSL kernels",
    "tokenspeed-mla": "MLA (DeepSeek) kernels", "z3-solver": "tilelang's solver", "apache-tvm-ffi": "tilelang",
    "torch-c-dlpack-ext": "tilelang/quack",
    "tokenspeed-triton": "tokenspeed-mla's own Triton (90 MiB)", "pynvvideocodec": "video decoding (41 MiB)",
}

#: members of the vLLM wheel a dense model on Hopper does not need (platform-notes.md, last section)
VLLM_STRIP = (
    re.compile(r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"),  # FA2: FA3 is the Hopper path (own try/except)
    re.compile(r"^vllm/_moe_C_stable_libtorch\.abi3\.so$"),  # MoE kernels: contextlib.suppress(ImportError)
    re.compile(r"^vllm/vllm-rs(/|$)"),  # the Rust front-end
)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried(pins: dict[str, str]) -> dict[str, str]:
    """The pins the machine lacks, minus what is left out on purpose."""
    return {n: v for n, v in pins.items()
            if n not in ON_MACHINE and not n.startswith(ON_MACHINE_PREFIXES) and n not in LEFT_OUT}


def strip_wheel(data: bytes, patterns=VLLM_STRIP) -> tuple[bytes, list[str]]:
    """The wheel without the members matching ``patterns``, their RECORD lines removed too (pip installs a wheel
    by its RECORD); returns the new wheel's bytes and the removed names."""
    src = zipfile.ZipFile(io.BytesIO(data))
    removed = [i.filename for i in src.infolist() if any(p.search(i.filename) for p in patterns)]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in removed:
                continue
            body = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                gone = set(removed)
                body = "".join(line for line in body.decode().splitlines(keepends=True)
                               if line.split(",", 1)[0] not in gone).encode()
            dst.writestr(info, body)
    return out.getvalue(), removed


def import_names(wheel: bytes) -> list[str]:
    """Top-level import names a wheel installs (its top_level.txt, else its RECORD's first path parts)."""
    z = zipfile.ZipFile(io.BytesIO(wheel))
    tops = [n for n in z.namelist() if n.endswith(".dist-info/top_level.txt")]
    if tops:
        return sorted({x.strip() for x in z.read(tops[0]).decode().splitlines() if x.strip()})
    firsts = {n.split("/", 1)[0] for n in z.namelist()}
    return sorted(f.removesuffix(".py") for f in firsts
                  if not f.endswith((".dist-info", ".data")) and not f.startswith("__"))


def chunk_size(tracked_bytes: int, limit: int = TRANSFER_LIMIT, margin: int = MARGIN) -> int:
    """The largest chunk that travels with the repository in one call."""
    size = limit - tracked_bytes - margin
    if size < 8 * 1024 * 1024:
        raise ValueError(f"the repository's tracked files take {tracked_bytes} bytes of the {limit}-byte transfer: "
                         "less than 8 MiB is left for a chunk")
    return size


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


def join(chunks: list[bytes], manifest: dict) -> bytes:
    """The bundle from its chunks, each checked against the manifest, and the whole too."""
    if len(chunks) != len(manifest["chunks"]):
        raise ValueError(f"{len(chunks)} chunks, the manifest lists {len(manifest['chunks'])}")
    for data, want in zip(chunks, manifest["chunks"]):
        if len(data) != want["bytes"] or sha256(data) != want["sha256"]:
            raise ValueError(f"{want['name']}: {len(data)} bytes, sha256 {sha256(data)[:12]}...; the manifest says "
                             f"{want['bytes']} bytes, {want['sha256'][:12]}...: carry it again")
    bundle = b"".join(chunks)
    if sha256(bundle) != manifest["bundle_sha256"]:
        raise ValueError("the joined bundle's sha256 differs from the manifest's")
    return bundle


def pack(wheels: dict[str, bytes]) -> bytes:
    """One uncompressed tar of the (already compressed) wheels, in name order, with fixed metadata."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(wheels):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(wheels[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(wheels[name]))
    return out.getvalue()


def unpack(bundle: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def plan(manifest: dict) -> list[str]:
    """The device calls, in order: one per chunk (carry it, keep it in /tmp), then install and check."""
    n = len(manifest["chunks"])
    steps = [f"call {i + 1}/{n + 1}: carry ['.carry/{c['name']}', '.carry/manifest.json'], command "
             f"'mkdir -p /tmp/carry && cp .carry/{c['name']} .carry/manifest.json /tmp/carry/' "
             f"({c['bytes'] / 2**20:.1f} MiB)" for i, c in enumerate(manifest["chunks"])]
    steps.append(f"call {n + 1}/{n + 1}: command 'python3 benchmarks/gpu/carry_kit.py install --from /tmp/carry "
                 "&& PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu/check_rl.sh --budget-s 420' (no carry; the "
                 "vLLM stages run first, the HF stages after them until the budget ends)")
    return steps


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and "==" in line:
            name, version = line.split("==", 1)
            pins[normalize(name)] = version.strip()
    return pins


def _tracked_bytes() -> int:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def _download(name: str, version: str, dest: Path) -> Path:
    """One wheel for CPython 3.12 on manylinux x86-64; DeepSpeed (an sdist only) is built into a wheel here."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = re.sub(r"[-.]", "_", name).lower() + "-" + version + "-"
    have = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix)]
    if have:
        return have[0]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[x for p in PLATFORMS for x in ("--platform", p)], "-d", str(dest),
           f"{name}=={version}"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        env = {**os.environ, "DS_BUILD_OPS": "0"}  # pure Python: DeepSpeed JIT-builds its ops on the machine
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), f"{name}=={version}"],
                       check=True, env=env, capture_output=True)
    have = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix)]
    if not have:
        raise SystemExit(f"carry_kit: no wheel for {name}=={version} (CPython 3.12, manylinux x86-64)")
    return have[0]


def build(args) -> int:
    pins = read_pins(ROOT / "requirements" / "gpu-carry.lock")
    todo = carried(pins)
    wheels = {}
    for name, version in sorted(todo.items()):
        path = _download(name, version, CARRY / "wheels")
        data = path.read_bytes()
        if name == "vllm":
            stripped = CARRY / "stripped" / path.name
            if not stripped.is_file():
                slim, removed = strip_wheel(data)
                stripped.parent.mkdir(parents=True, exist_ok=True)
                stripped.write_bytes(slim)
                print(f"carry_kit: vllm: left out {', '.join(removed[:3])}{' ...' if len(removed) > 3 else ''} "
                      f"({len(removed)} members, {(len(data) - len(slim)) / 2**20:.0f} MiB)")
            data = stripped.read_bytes()
        wheels[path.name] = data
    bundle = pack(wheels)
    size = chunk_size(_tracked_bytes())
    chunks = split(bundle, size)
    for old in CARRY.glob("chunk_*"):
        old.unlink()
    manifest = {"bundle_sha256": sha256(bundle), "bundle_bytes": len(bundle), "chunk_limit_bytes": size,
                "chunks": [], "wheels": [], "left_out": LEFT_OUT, "on_machine": sorted(ON_MACHINE)}
    for i, data in enumerate(chunks):
        name = f"chunk_{i:02d}"
        (CARRY / name).write_bytes(data)
        manifest["chunks"].append({"name": name, "bytes": len(data), "sha256": sha256(data)})
    for name in sorted(wheels):
        manifest["wheels"].append({"file": name, "bytes": len(wheels[name]), "sha256": sha256(wheels[name]),
                                   "imports": import_names(wheels[name])})
    text = json.dumps(manifest, indent=1) + "\n"
    (CARRY / "manifest.json").write_text(text)
    MANIFEST.write_text(text)
    print(f"carry_kit: {len(wheels)} wheels, bundle {len(bundle) / 2**20:.1f} MiB in {len(chunks)} chunks of at most "
          f"{size / 2**20:.1f} MiB -> {CARRY}; manifest {MANIFEST.relative_to(ROOT)}")
    for step in plan(manifest):
        print("  " + step)
    return 0


def install(args) -> int:
    src = Path(args.src)
    manifest = json.loads((src / "manifest.json").read_text())
    bundle = join([(src / c["name"]).read_bytes() for c in manifest["chunks"]], manifest)
    wheels = unpack(bundle)
    for w in manifest["wheels"]:
        if sha256(wheels[w["file"]]) != w["sha256"]:
            raise SystemExit(f"carry_kit: {w['file']}: sha256 differs from the manifest")
    print(f"carry_kit: {len(manifest['chunks'])} chunks joined, {len(wheels)} wheels, every sha256 as the manifest says")
    if args.check_only:
        return 0
    wheel_dir = Path(args.target).with_name("carry_wheels")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for name, data in wheels.items():
        (wheel_dir / name).write_bytes(data)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", args.target, *sorted(str(p) for p in wheel_dir.glob("*.whl"))], check=True)
    check = ("import importlib.metadata as m, sys; import vllm, ray, deepspeed; "
             "print({k: m.version(k) for k in ('vllm', 'ray', 'deepspeed', 'torch', 'transformers')})")
    env = {**os.environ, "PYTHONPATH": f"{args.target}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", check], env=env).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="here: download, strip, pack, split into .carry/")
    sub.add_parser("plan", help="print the transfer plan of benchmarks/gpu/carry_manifest.json")
    ins = sub.add_parser("install", help="there: join the chunks, check every sum, install, import")
    ins.add_argument("--from", dest="src", default=str(CARRY), help="folder with chunk_NN and manifest.json")
    ins.add_argument("--target", default="/tmp/site", help="pip --target folder (put it on PYTHONPATH)")
    ins.add_argument("--check-only", action="store_true", help="join and check the sums, install nothing (the dry run)")
    args = p.parse_args(argv)
    if args.cmd == "plan":
        for step in plan(json.loads(MANIFEST.read_text())):
            print(step)
        return 0
    return build(args) if args.cmd == "build" else install(args)


if __name__ == "__main__":
    sys.exit(main())
