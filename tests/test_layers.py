"""The import rule of the package as an ordered layer table (issue 45; docs/architecture.md has it in prose):
a package may import only packages on lower floors, packages on one floor never import each other, and the
maths, data and model layers never import ray, vllm or deepspeed. Every import counts, lazy ones inside
functions too (they run just the same, only later)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlhforge"

#: floor -> the top-level packages (or modules) of rlhforge on it, lowest first
LAYERS: dict[int, tuple[str, ...]] = {
    1: ("algorithms", "config", "tracking", "net", "openrlhf_alias"),
    2: ("data",),
    3: ("models",),
    4: ("backend",),
    5: ("rollout", "rewards"),
    6: ("agents", "tinker_server"),
    7: ("workers",),
    8: ("distributed",),
    9: ("trainers",),
    10: ("cli",),
}
FLOOR = {name: floor for floor, names in LAYERS.items() for name in names}
#: never imported by these, however lazily: the heavy engines stay out of the maths, data and model layers
LIGHT = ("algorithms", "config", "tracking", "net", "data", "models")
HEAVY = ("ray", "vllm", "deepspeed")
#: the RL trainer never imports the supervised trainers (shared code lives in trainers/common, faults, resume)
SUPERVISED = ("rlhforge.trainers.sft", "rlhforge.trainers.rm", "rlhforge.trainers.dpo", "rlhforge.trainers.kto")


def _imports():
    """``(importing package, file:line, imported module)`` for every import of every module of rlhforge."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        owner = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: resolve against the file
                base = rel.parent.parts[: len(rel.parent.parts) - (node.level - 1)]
                names = [".".join(("rlhforge", *base, *([node.module] if node.module else [])))]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                yield owner, f"{rel}:{node.lineno}", name, rel


def test_every_package_has_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert packages | modules <= set(FLOOR), f"place these in LAYERS: {sorted((packages | modules) - set(FLOOR))}"


def test_no_import_runs_up_or_sideways():
    found = []
    for owner, where, name, _ in _imports():
        parts = name.split(".")
        if parts[0] != "rlhforge" or len(parts) < 2 or owner not in FLOOR:
            continue
        target = parts[1]
        if target == owner or target not in FLOOR:
            continue
        if FLOOR[target] >= FLOOR[owner]:
            kind = "sideways (same floor)" if FLOOR[target] == FLOOR[owner] else "up"
            found.append(f"{where}: {owner} (floor {FLOOR[owner]}) imports {name} (floor {FLOOR[target]}): {kind}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", LIGHT)
def test_light_layers_never_import_the_engines(package):
    found = [f"{where}: {name}" for owner, where, name, _ in _imports()
             if owner == package and name.split(".")[0] in HEAVY]
    assert not found, "\n".join(found)


def test_the_rl_trainer_never_imports_the_supervised_trainers():
    found = [f"{where}: {name}" for _, where, name, rel in _imports()
             if rel.parts[:2] == ("trainers", "rl") and name.startswith(SUPERVISED)]
    assert not found, "\n".join(found)


def test_the_rule_can_fail():
    """The walk sees lazy imports inside functions (the rule would be blind otherwise)."""
    lazy = [(where, name) for owner, where, name, _ in _imports() if owner == "cli" and name == "rlhforge.trainers.rl"]
    assert lazy, "cli/train_ppo_ray.py imports rlhforge.trainers.rl inside a function"


#: agents/: the flat kernel and its sub-packages (docs/architecture.md); who may import which sub-package
AGENT_SUBPACKAGES = ("openrlhf", "registry", "serving", "envs", "sandbox")
AGENT_ALLOWED = {"envs": {"serving"}, "registry": {"sandbox"}}
#: the face, the one chooser, and the old module paths kept for documented imports (tests/test_moved_paths.py)
AGENT_KERNEL_EXEMPT = {"__init__", "loader", "multi_turn", "openai_server", "builtin_envs", "env_verifiers"}


def test_the_agents_kernel_imports_no_sub_package_and_sub_packages_only_the_kernel():
    found = []
    for owner, where, name, rel in _imports():
        parts = name.split(".")
        if owner != "agents" or parts[:2] != ["rlhforge", "agents"] or len(parts) < 3:
            continue
        target = parts[2] if parts[2] in AGENT_SUBPACKAGES else None
        home = rel.parts[1] if len(rel.parts) > 2 else None  # the sub-package of the importing file, if any
        if home is None:
            if target and rel.stem not in AGENT_KERNEL_EXEMPT:
                found.append(f"{where}: the kernel imports {name}")
        elif target and target != home and target not in AGENT_ALLOWED.get(home, set()):
            found.append(f"{where}: agents/{home} imports {name}")
    assert not found, "\n".join(found)


#: issue 45's measure: the longest chain of imports inside agents/ (lazy ones too), counted in modules
AGENTS_MAX_DEPTH = 8


def _module_name(rel: Path) -> str:
    parts = ("rlhforge", *rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def agents_import_chain() -> list[str]:
    """The longest chain of agents/ modules, each importing the next (``from pkg import mod`` counts
    as importing ``pkg.mod``); a circle would make it endless and fails instead."""
    modules = {_module_name(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        me = _module_name(rel)
        if not me.startswith("rlhforge.agents"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = rel.parent.parts[: len(rel.parent.parts) - (node.level - 1)] if node.level else ()
                module = ".".join((*(("rlhforge", *base) if node.level else ()), *([node.module] if node.module else [])))
                names = [module, *(f"{module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges.setdefault(me, set()).update(n for n in names if n in modules and n != me
                                               and n.startswith("rlhforge.agents"))
    longest: dict[str, list[str]] = {}

    def chain(mod: str, seen: tuple[str, ...]) -> list[str]:
        assert mod not in seen, f"import circle: {' -> '.join(seen + (mod,))}"
        if mod not in longest:
            longest[mod] = [mod, *max((chain(m, seen + (mod,)) for m in edges.get(mod, ())), key=len, default=[])]
        return longest[mod]

    return max((chain(m, ()) for m in edges), key=len)


def test_agents_is_at_most_eight_import_levels_deep():
    found = agents_import_chain()
    assert len(found) <= AGENTS_MAX_DEPTH, f"{len(found)} levels: {' -> '.join(found)}"
    assert len(found) >= 3  # the walk sees the chain (loader -> ... -> types), it cannot pass by seeing nothing
