"""Runs the fenced blocks of README.md and docs/ as a user walking the pages would (issue 47): Sybil finds
the blocks, this module decides and does what each one gets.

Every ``bash`` and ``python`` block is **run**, command by command, in a working folder of its page (which
sees the clone's ``examples/``, ``benchmarks/``, ``scripts/`` and ``.venv`` through links), with tiny sizes
appended (:data:`TINY`) - unless the block or the command is one of these, which are only **parsed**:

- fence label ``gpu`` or ``cluster`` (```` ```bash gpu ````): needs CUDA or several machines;
- fence label ``template``: a shape to fill in (``MODEL``, ``$KEY``, a user's own file), and any command
  with a literal ``...`` argument;
- fence label ``tested``: run by a test of its own in ``tests/docs/`` that sets up what it needs (a server,
  a folder); the harness checks that such a test names the block;
- fence label ``repeat``: commands an overview page repeats from another page, where they run; the harness
  checks that every command of the block stands, to the letter, in a run block of another page;
- installs (``pip install``) and the suite's own commands (``scripts/test.sh``, ``scripts/setup_env.sh``,
  ``scripts/quickstart.sh``, ``pytest``): ``.ci/run`` is exactly these on a fresh clone.

Parsing is a real check: a shell line must split (:mod:`shlex`), an ``rlhforge`` command must name a command
and only flags its ``--help`` lists (after OpenRLHF alias rewriting), a ``-m`` module must exist, an
install's extras must be in pyproject.toml and its ``-c`` file in the clone, a ``python`` block must compile,
a ``json`` block must load.

A ``python`` block whose first line is ``# name.py`` is written to that file in the page folder first (a
later command runs it); other python blocks run as scripts in a fresh interpreter. ``rlhforge serve-*``
commands and commands ending in ``&`` are started in the background and waited for until they listen;
they are stopped when the page ends (or when the same server command starts again).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from sybil import Document, Region
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
LABELS = {"gpu", "cluster", "template", "tested", "repeat"}
PARSED_ONLY = {"gpu", "cluster", "template", "tested", "repeat"}
LINKED = ("examples", "benchmarks", "scripts", ".venv", "requirements", "pyproject.toml")
TRAIN_MODULES = {f"rlhforge.cli.{m}" for m in ("train_sft", "train_rm", "train_dpo", "train_kto", "train_ppo_ray")}
#: what each runnable command gets appended so the page runs in seconds (the documented sizes are the real ones)
TINY = {
    "train": ["--train.max_steps", "2"],
    "quickstart": ["--sft_steps", "3", "--rl_steps", "1", "--eval_size", "4", "--eval_samples", "1"],
    "benchmarks/bench_dpo.py": ["--quick", "--repeats", "1", "--out", "bench_dpo.json"],
}
SUITE_SCRIPTS = ("scripts/test.sh", "scripts/setup_env.sh", "scripts/quickstart.sh")
COMMAND_TIMEOUT_S = 420
LISTEN_TIMEOUT_S = 180


@dataclass
class Block:
    page: str
    line: int
    language: str
    labels: set[str]
    source: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _block_parser(document: Document):
    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>[\w-]*)(?P<labels>[^\n]*)$\n", re.M))
    for region in lexer(document):
        language, labels = region.lexemes["language"], set(region.lexemes["labels"].split())
        unknown = labels - LABELS
        assert not unknown, f"{document.path}: unknown fence label(s) {sorted(unknown)} (known: {sorted(LABELS)})"
        line = document.text[: region.start].count("\n") + 1
        block = Block(str(Path(document.path).relative_to(ROOT)), line, language, labels,
                      str(region.lexemes["source"]))
        yield Region(region.start, region.end, parsed=block, evaluator=lambda example: None)


def page_blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` (relative to the clone), in order, as Sybil parses the markdown."""
    document = Document.parse(str(ROOT / page), _block_parser)
    return [example.parsed for example in document.examples()]


# ---------------------------------------------------------------- commands of a shell block


def shell_commands(source: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, ``#`` comments and blank lines dropped."""
    commands = []
    for line in source.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


def _env_prefix(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        key, _, value = argv[0].partition("=")
        env[key] = value
        argv = argv[1:]
    return env, argv


def rlhforge_target(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, flags)`` of a command that runs an rlhforge entry point (``rlhforge X``, ``python -m``,
    ``torchrun``/``deepspeed`` ``-m``/``--module``); None for anything else."""
    from rlhforge.cli.main import COMMANDS

    name = Path(argv[0]).name
    if name == "rlhforge" and len(argv) > 1:
        if argv[1] not in COMMANDS:
            raise AssertionError(f"unknown rlhforge command {argv[1]!r}")
        return COMMANDS[argv[1]][0], argv[2:]
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-m", "--module") and argv[i + 1].startswith("rlhforge"):
            return argv[i + 1], argv[i + 2:]
    return None


def kind_of(block: Block, argv: list[str]) -> str:
    """``run``, or why the command is only parsed: a label, ``template``, ``install`` or ``suite``."""
    labels = block.labels & PARSED_ONLY
    if labels:
        return sorted(labels)[0]
    if "..." in argv:
        return "template"
    _, rest = _env_prefix(argv)
    if rest[:1] and Path(rest[0]).name in ("pip", "pip3") or rest[1:3] in (["-m", "pip"], ["-m", "venv"]):
        return "install"
    if any(a.endswith(SUITE_SCRIPTS) for a in rest[:2]) or "pytest" in rest[:3]:
        return "suite"
    return "run"


_HELP: dict[str, str] = {}


def help_text(module: str) -> str:
    """What ``--help`` prints for an rlhforge entry point (in this process)."""
    if module not in _HELP:
        mod = importlib.import_module(module)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), contextlib.suppress(SystemExit):
            mod.main(["--help"])
        _HELP[module] = out.getvalue()
    return _HELP[module]


def check_parses(argv: list[str]) -> None:
    """The parse-only check of one command (see the module docstring)."""
    _, rest = _env_prefix(argv)
    if not rest:
        return
    if Path(rest[0]).name in ("pip", "pip3") or rest[1:3] == ["-m", "pip"]:
        _check_install(rest)
        return
    target = rlhforge_target(rest)
    if target is None:
        module = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a in ("-m", "--module")), None)
        if module and module not in ("pytest", "pip", "venv"):
            assert importlib.util.find_spec(module) is not None, f"no module {module!r}"
        return
    from rlhforge.cli.main import COMMANDS
    from rlhforge.config.parsing import rewrite_aliases

    module, flags = target
    assert importlib.util.find_spec(module) is not None, f"no module {module!r}"
    if module not in {m for m, _ in COMMANDS.values()}:
        return
    flags = flags[: flags.index("...")] if "..." in flags else flags
    known = set(re.findall(r"--[\w.\-]+", help_text(module))) | {"--config", "--help"}
    for flag in rewrite_aliases([f for f in flags if f.startswith("--")]):
        name = flag.split("=", 1)[0]
        assert name in known, f"{module}: {name} is not a flag of its --help"


def _check_install(argv: list[str]) -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for i, arg in enumerate(argv):
        if arg == "-c":
            assert (ROOT / argv[i + 1]).is_file(), f"pip -c {argv[i + 1]}: no such file in the clone"
        m = re.fullmatch(r"(?:\.|rlhforge)\[([\w,-]+)\]", arg)
        if m:
            missing = set(m.group(1).split(",")) - extras
            assert not missing, f"{arg}: no extra(s) {sorted(missing)} in pyproject.toml"


def tiny(argv: list[str]) -> list[str]:
    """``argv`` with the tiny sizes of :data:`TINY` appended (nothing for ``--help``)."""
    if "--help" in argv or "-h" in argv:
        return argv
    target = rlhforge_target(argv)
    if target is not None:
        module, _ = target
        if module in TRAIN_MODULES:
            return argv + TINY["train"]
        if module == "rlhforge.cli.quickstart":
            return argv + TINY["quickstart"]
    for script, extra in TINY.items():
        if script.endswith(".py") and script in argv:
            return argv + extra
    return argv


# ---------------------------------------------------------------- a page's working folder


@dataclass
class PageRun:
    """One page walked in its own folder: the commands' environment, the servers it started, counts."""

    page: str
    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    servers: dict[str, subprocess.Popen] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, page: str, folder: Path) -> PageRun:
        folder.mkdir(parents=True, exist_ok=True)
        for name in LINKED:
            if not (folder / name).exists():
                (folder / name).symlink_to(ROOT / name)
        env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                   OMP_NUM_THREADS="1", TQDM_DISABLE="1")
        env.pop("PYTEST_CURRENT_TEST", None)
        return cls(page, folder, env)

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def write_named_scripts(self, blocks: list[Block]) -> set[int]:
        """Python blocks headed ``# name.py`` go to that file; the lines of those a command of the page runs."""
        commands = " ".join(b.source for b in blocks if b.language == "bash")
        ran_by_command = set()
        for b in blocks:
            m = re.match(r"# (\w+\.py)\s*\n", b.source)
            if b.language == "python" and m and not b.labels & PARSED_ONLY:
                (self.folder / m.group(1)).write_text(b.source)
                if re.search(rf"\bpython3?\s+{re.escape(m.group(1))}", commands):
                    ran_by_command.add(b.line)
        return ran_by_command

    def run(self, argv: list[str], where: str) -> None:
        env_prefix, rest = _env_prefix(argv)
        if rest[0] == "export":
            for assignment in rest[1:]:
                key, _, value = assignment.partition("=")
                self.env[key] = value
            return
        background = rest[-1] == "&"
        rest = tiny([a for a in rest if a != "&"])
        target = rlhforge_target(rest)
        server = background or (target is not None and target[0].startswith("rlhforge.cli.serve_"))
        env = dict(self.env, **env_prefix)
        if server:
            self._serve(rest, env, where)
            return
        proc = subprocess.run(rest, cwd=self.folder, env=env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        assert proc.returncode == 0, (f"{where}: `{shlex.join(rest)}` exited {proc.returncode}\n"
                                      f"{(proc.stdout + proc.stderr)[-3000:]}")

    def _serve(self, argv: list[str], env: dict[str, str], where: str) -> None:
        key = shlex.join(argv[:2])
        if key in self.servers:  # the same server again (another example of it): the first one stops
            _stop(self.servers.pop(key))
        log = open(self.folder / f"server-{len(self.servers)}.log", "w")  # noqa: SIM115 - the server's lifetime
        proc = subprocess.Popen(argv, cwd=self.folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_end_with_this_process)
        self.servers[key] = proc
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not _listening(proc.pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (self.folder / log.name).read_text()[-3000:]
                raise AssertionError(f"{where}: `{shlex.join(argv)}` did not start listening "
                                     f"(exit {proc.poll()}):\n{tail}")
            time.sleep(0.5)

    def run_python(self, block: Block) -> None:
        script = self.folder / f"block_{block.line}.py"
        script.write_text(block.source)
        proc = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), script.name], cwd=self.folder,
                              env=self.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert proc.returncode == 0, f"{block.where}: python block exited {proc.returncode}\n{proc.stderr[-3000:]}"

    def stop(self) -> None:
        for proc in self.servers.values():
            _stop(proc)
        self.servers.clear()


def _end_with_this_process() -> None:
    """In a page's server, before it starts: SIGTERM when the test process ends, however it ends (a timeout's
    SIGKILL skips the page's own stop), so no server outlives its test to hold the documented port (Linux)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _listening(pid: int) -> bool:
    """Whether the process or one of its children has a listening TCP socket."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN for c in p.net_connections(kind="tcp")):
                return True
    return False


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def tested_elsewhere(block: Block) -> bool:
    """Whether a test of ``tests/docs/`` takes this block by ``fenced_block(page, piece)``."""
    for path in (ROOT / "tests" / "docs").glob("test_*.py"):
        for page, piece in re.findall(r'fenced_block\(\s*"([^"]+)",\s*"([^"]+)"', path.read_text()):
            if page == block.page and piece.encode().decode("unicode_escape") in block.source:
                return True
    return False


def run_on_another_page(block: Block) -> list[str]:
    """The commands of a ``repeat`` block that no run block of another page holds (empty: all are run there)."""
    elsewhere = set()
    for page in PAGES:
        if page != block.page:
            for other in page_blocks(page):
                if other.language in ("bash", "sh", "shell") and not other.labels & PARSED_ONLY:
                    elsewhere.update(map(tuple, shell_commands(other.source)))
    return [shlex.join(argv) for argv in shell_commands(block.source) if tuple(argv) not in elsewhere]


def walk(page: str, folder: Path) -> dict[str, int]:
    """Walk ``page``'s blocks in order in ``folder``: run or parse each (see the module docstring); the counts
    of blocks run and parsed, by kind."""
    blocks = page_blocks(page)
    state = PageRun.start(page, folder)
    try:
        run_by_command = state.write_named_scripts(blocks)
        for block in blocks:
            _walk_block(state, block, run_by_command)
    finally:
        state.stop()
    return state.counts


def _walk_block(state: PageRun, block: Block, run_by_command: set[int]) -> None:
    if "tested" in block.labels:
        assert tested_elsewhere(block), f"{block.where}: labelled `tested` but no test in tests/docs/ takes it"
    if "repeat" in block.labels:
        missing = run_on_another_page(block)
        assert not missing, f"{block.where}: labelled `repeat` but no other page runs {missing}"
    if block.language == "json":
        json.loads(block.source)
        state.count("json parsed")
    elif block.language == "python":
        compile(block.source, block.where, "exec")
        if block.labels & PARSED_ONLY:
            state.count(f"python parsed ({sorted(block.labels & PARSED_ONLY)[0]})")
        elif block.line in run_by_command:
            state.count("python run (as a file a command runs)")
        else:
            state.run_python(block)
            state.count("python run")
    elif block.language in ("bash", "sh", "shell"):
        for argv in shell_commands(block.source):
            kind = kind_of(block, argv)
            try:
                check_parses(argv)
                if kind == "run":
                    state.run(argv, block.where)
            except AssertionError as e:
                message = str(e)
                raise AssertionError(message if message.startswith(block.where) else f"{block.where}: {message}") \
                    from None
            state.count("command run" if kind == "run" else f"command parsed ({kind})")
