"""Math answer checking with `math-verify` (``pip install 'rlhforge[math]'``).

::

    math_reward(r"... so the answer is \\boxed{\\frac{1}{2}}", "0.5")     # 1.0
    math_reward("I think it is 3.", "1/2")                                  # 0.0

The final answer of a completion is the content of its last ``\\boxed{...}`` (or ``\\fbox``);
without one, the last number in the text (``-3``, ``1,000``, ``2.5``, ``1/2``, ``\\frac{1}{2}``).
It is parsed and compared with the label by math-verify, so equivalent forms match (``0.5`` and
``\\frac{1}{2}``, ``x^2+2x+1`` and ``(x+1)^2``, ``1,000`` and ``1000``).

**Timeout guard.** Symbolic comparison can take unbounded time (or memory) on adversarial
answers. By default checks run in a persistent helper process (started on first use, one per
:class:`MathVerifier`): each check gets ``timeout_s`` of wall time there (a timer inside the
helper), and if the helper does not answer within ``timeout_s + hard_grace_s`` (stuck in C code,
e.g. evaluating ``9^{9^{9^9}}``) it is killed and restarted and the sample scores 0; its address
space is limited (``memory_bytes``) so such an answer cannot exhaust the machine's memory
either. This works from any thread (math-verify's own timeout uses ``signal.alarm``, which only
works in the main thread). ``isolate=False`` checks in this process instead, guarded by a timer
in the main thread only, which cannot interrupt C code: use it for trusted inputs only.

``reward_func(queries, prompts, labels, **kwargs)`` has OpenRLHF's shape and can be passed as a
reward file (``--reward.remote_url rlhforge/rewards/math.py``); it returns
``{"rewards", "scores", "extra_logs"}`` as float tensors (reward = score = 1.0 for a correct
answer, else 0.0; ``extra_logs``: ``math/answer_found``, ``math/timeout``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["MathCheck", "MathVerifier", "extract_answer", "extract_boxed_answer", "grade_answer", "math_reward",
           "reward_func"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "the math reward needs math-verify: pip install 'rlhforge[math]'"


def _require_math_verify() -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(_INSTALL_HINT)


@dataclass(frozen=True)
class MathCheck:
    reward: float
    """1.0 if the extracted answer equals the label, else 0.0."""
    reason: str
    """``correct``, ``wrong``, ``no_answer`` (nothing to extract), ``unparsable`` (the answer),
    ``bad_label`` (the label could not be parsed), ``timeout`` or ``error``."""
    extracted: str | None = None
    """The answer text taken from the completion."""


# ----------------------------------------------------------------------------------- extraction
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_NUMBER = re.compile(
    r"\\d?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"                  # \frac{a}{b}, \dfrac{a}{b}
    r"|-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"  # 1,000  2.5  -3  1/2
    r"|-?\.\d+"                                            # .5
)


def _boxed_contents(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed 5``."""
    for match in reversed(list(_BOXED.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
                j += 1
            continue  # unbalanced: try an earlier one
        token = re.match(r"[^\s$]+", text[i:])
        if token:
            return token.group(0).rstrip(".,;")
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer of ``completion``: the last ``\\boxed{}`` content, else the last number
    (or ``\\frac``), else None."""
    boxed = _boxed_contents(completion)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1].strip() if numbers else None


# ----------------------------------------------------------------------------------- checking
class _Timeout(Exception):
    pass


def _parse_answer(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    latex = [LatexExtractionConfig(boxed_match_priority=0)]
    inner = text.strip()
    if inner.startswith("$") and inner.endswith("$"):
        inner = inner.strip("$").strip()
    source = inner if "\\boxed" in inner or "\\fbox" in inner else "\\boxed{" + inner + "}"
    parsed = parse(source, latex, parsing_timeout=None)
    if not parsed:
        parsed = parse(inner, [ExprExtractionConfig()], parsing_timeout=None)
    return parsed


def _check(completion: str, answer: str) -> MathCheck:
    """Extraction + parsing + comparison, without a time guard (callers add one)."""
    from math_verify import verify

    if not isinstance(answer, str):
        answer = "" if answer is None else str(answer)
    extracted = extract_answer(completion if isinstance(completion, str) else str(completion))
    if extracted is None:
        return MathCheck(0.0, "no_answer")
    gold = _parse_answer(answer)
    if not gold:
        return MathCheck(0.0, "bad_label", extracted)
    pred = _parse_answer(extracted)
    if not pred:
        return MathCheck(0.0, "unparsable", extracted)
    ok = verify(gold, pred, timeout_seconds=None)
    return MathCheck(1.0 if ok else 0.0, "correct" if ok else "wrong", extracted)


def _quiet_math_verify() -> None:
    # math-verify warns once that its own (signal-based) timeout is disabled: ours replaces it
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _guarded_check(completion: str, answer: str, timeout_s: float) -> MathCheck:
    """``_check`` under a SIGALRM timer when in the main thread (unguarded elsewhere)."""
    _quiet_math_verify()
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        try:
            return _check(completion, answer)
        except Exception as err:  # noqa: BLE001 - a reward must not crash on a weird answer
            return MathCheck(0.0, "error", repr(err)[:200])

    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _check(completion, answer)
    except _Timeout:
        return MathCheck(0.0, "timeout")
    except Exception as err:  # noqa: BLE001
        return MathCheck(0.0, "error", repr(err)[:200])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_timer[0] > 0:  # someone else's timer was running: give back what is left of it
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def _worker_main(memory_bytes: int | None = None) -> None:
    """The helper process: one JSON request per line on stdin, one JSON answer per line."""
    if memory_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    _require_math_verify()
    import math_verify  # noqa: F401 - import (about a second) before saying ready

    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        check = _guarded_check(req["c"], req["a"], req["t"])
        out.write(json.dumps({"r": check.reward, "why": check.reason, "x": check.extracted}) + "\n")
        out.flush()


class MathVerifier:
    """Checks answers with a time guard (see the module docstring). Thread-safe; ``close()``
    (or ``with``) stops the helper process, which also ends when this process exits."""

    def __init__(self, timeout_s: float = 5.0, *, isolate: bool = True, hard_grace_s: float = 5.0,
                 memory_bytes: int | None = 4 << 30, startup_timeout_s: float = 120.0):
        if timeout_s <= 0:
            raise ValueError(f"MathVerifier timeout_s must be > 0 (got {timeout_s})")
        _require_math_verify()
        self.timeout_s = float(timeout_s)
        self.hard_grace_s = float(hard_grace_s)
        self.memory_bytes = memory_bytes
        self.isolate = isolate
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def __call__(self, completion: str, answer: str) -> float:
        return self.check(completion, answer).reward

    def check(self, completion: str, answer: Any) -> MathCheck:
        if not self.isolate:
            return _guarded_check(completion, "" if answer is None else str(answer), self.timeout_s)
        request = json.dumps({"c": str(completion), "a": "" if answer is None else str(answer),
                              "t": self.timeout_s}) + "\n"
        with self._lock:
            proc = self._ensure_worker()
            try:
                proc.stdin.write(request.encode())
                proc.stdin.flush()
                line = _readline(proc, self.timeout_s + self.hard_grace_s)
            except OSError:
                line = None
            if line is None:
                logger.warning("math reward: the checker took longer than %.0f s and was restarted "
                               "(answer %r)", self.timeout_s + self.hard_grace_s, str(completion)[-200:])
                self._kill()
                self.restarts += 1
                return MathCheck(0.0, "timeout")
        reply = json.loads(line)
        return MathCheck(float(reply["r"]), reply["why"], reply.get("x"))

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # noqa: BLE001
            pass

    # ---- helper process
    def _ensure_worker(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:  # it died by itself
            self.restarts += 1
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (f"import sys; sys.path.insert(0, {root!r}); "
                f"from rlhforge.rewards.math import _worker_main; _worker_main({self.memory_bytes!r})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=None, start_new_session=True)
        if _readline(self._proc, self.startup_timeout_s) is None:
            self._kill()
            raise RuntimeError(f"the math-verify helper process did not start within {self.startup_timeout_s:.0f} s")
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def _readline(proc: subprocess.Popen, timeout_s: float) -> bytes | None:
    """One line from the helper within ``timeout_s``; None on timeout or if it died."""
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        buf += chunk
        if buf.endswith(b"\n"):
            return bytes(buf)


_VERIFIERS: dict[float, MathVerifier] = {}
_VERIFIERS_LOCK = threading.Lock()


def _shared_verifier(timeout_s: float) -> MathVerifier:
    with _VERIFIERS_LOCK:
        verifier = _VERIFIERS.get(timeout_s)
        if verifier is None:
            verifier = _VERIFIERS[timeout_s] = MathVerifier(timeout_s)
        return verifier


def math_reward(completion: str, answer: str, *, timeout_s: float = 5.0) -> float:
    """1.0 if the final answer of ``completion`` equals ``answer`` (mathematically), else 0.0.

    Never raises for odd completions or labels (they score 0.0); raises ImportError when
    math-verify is not installed. Uses a shared helper process per ``timeout_s``.
    """
    return _shared_verifier(timeout_s).check(completion, answer).reward


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs) -> dict:
    """OpenRLHF-style batch reward: ``labels`` are the reference answers.

    The response is ``kwargs["responses"]`` when the caller passes it (rlhforge does), else the
    query with its prompt prefix removed. ``timeout_s`` may be passed as a keyword.
    """
    import torch

    verifier = _shared_verifier(float(kwargs.get("timeout_s", 5.0)))
    responses = kwargs.get("responses")
    if responses is None:
        responses = [q[len(p):] if isinstance(q, str) and isinstance(p, str) and q.startswith(p) else q
                     for q, p in zip(queries, prompts)]
    if not (len(responses) == len(labels) == len(queries)):
        raise ValueError(f"reward_func: {len(queries)} queries, {len(responses)} responses, {len(labels)} labels")
    checks = [verifier.check(r, label) for r, label in zip(responses, labels)]
    rewards = torch.tensor([c.reward for c in checks], dtype=torch.float32)
    return {
        "rewards": rewards,
        "scores": rewards.clone(),
        "extra_logs": {
            "math/answer_found": torch.tensor([float(c.reason != "no_answer") for c in checks]),
            "math/timeout": torch.tensor([float(c.reason == "timeout") for c in checks]),
        },
    }


def extract_boxed_answer(text: str) -> str | None:
    """OpenRLHF's ``openrlhf.utils.extract_boxed_answer``: content of the last ``\\boxed{...}`` (or
    ``\\fbox``) in ``text``; None without one."""
    if not isinstance(text, str) or not re.search(r"\\(?:boxed|fbox)", text):
        return None
    return extract_answer(text)


def grade_answer(given_answer: str | None, ground_truth: str) -> bool:
    """OpenRLHF's ``openrlhf.utils.grade_answer``: whether ``given_answer`` equals ``ground_truth``
    mathematically (math-verify, with rlhforge's timeout guard); None or an empty answer is wrong."""
    if given_answer is None or not str(given_answer).strip():
        return False
    return math_reward("\\boxed{" + str(given_answer) + "}", str(ground_truth)) == 1.0
