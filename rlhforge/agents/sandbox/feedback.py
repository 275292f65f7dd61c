"""Sandbox results as text for the model, and code blocks from a completion."""

from __future__ import annotations

from typing import Literal

from .config import _MIB, SandboxConfig, SandboxResult

# --------------------------------------------------------------------------------------------
# Feedback text and code extraction
# --------------------------------------------------------------------------------------------
def _clip(text: str, max_chars: int, keep: Literal["head", "tail", "both"] = "both") -> str:
    if len(text) <= max_chars:
        return text
    if keep == "tail":
        return "[...]\n" + text[-max_chars:]
    if keep == "head":
        return text[:max_chars] + "\n[...]"
    half = max_chars // 2
    return text[:half] + "\n[...]\n" + text[-(max_chars - half):]


def _fmt_bytes(n: int) -> str:
    if n >= _MIB:
        return f"{n / _MIB:.0f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n} bytes"


def format_feedback(result: SandboxResult, *, max_chars: int = 2000, config: SandboxConfig | None = None) -> str:
    """Concise text telling the model what its code did, whatever happened.

    Success: the output (or a note that there was none). Failure: what went wrong in one line
    (time limit, memory limit, process limit, crash signal), then the end of stderr (where a
    traceback's message is) and any output printed before it. At most ``max_chars`` characters
    plus a short notice; ``config`` (optional) lets the notices quote the limits.
    """
    if result.error is not None:
        return _clip(f"Error: the code could not be run ({result.error}).", max_chars)
    out, err = result.stdout.rstrip("\n"), result.stderr.rstrip("\n")
    problems = []
    if result.timed_out:
        limit = result.time_limit_s if result.time_limit_s is not None else (config.timeout_s if config else None)
        limit = "" if limit is None else f" of {limit:g} s"
        problems.append(f"TimeoutError: the code did not finish within the time limit{limit} and was stopped.")
    if result.memory_exceeded:
        limit = "" if config is None else f" ({_fmt_bytes(config.memory_bytes)})"
        problems.append(f"MemoryError: the code exceeded the memory limit{limit}.")
    if result.cpu_time_exceeded:
        problems.append("Error: the code exceeded the CPU-time limit and was stopped.")
    completed = result.exit_code == 0 and not result.timed_out
    notes = []
    if result.process_limit_hit:
        limit = "" if config is None else f" (at most {config.max_processes} processes and threads)"
        text = f"the code tried to start too many processes or threads{limit}."
        (notes if completed else problems).append(f"[note: {text}]" if completed else f"Error: {text}")
    if result.output_limit_hit:
        problems.append(f"Error: the code printed too much ({_fmt_bytes(result.stdout_bytes + result.stderr_bytes)}"
                        " and counting) and was stopped.")
    sig = result.signal_name
    if sig and not (result.timed_out or result.output_limit_hit or result.cpu_time_exceeded):
        problems.append(f"Error: the process was killed by {sig}.")
    if result.truncated:
        notes.append(f"[output truncated: stdout {_fmt_bytes(result.stdout_bytes)}, stderr "
                     f"{_fmt_bytes(result.stderr_bytes)}; middle part omitted]")
    failed = bool(problems) or (result.exit_code not in (0, None))
    if not failed:
        body = out if out else "(no output; use print() to show results)"
        if err:
            room = max(200, max_chars // 3)
            body = _clip(body, max_chars - min(len(err), room)) + "\n[stderr]\n" + _clip(err, room, "tail")
        else:
            body = _clip(body, max_chars)
        return "\n".join([body] + notes)
    parts = list(problems)
    budget = max(200, max_chars - sum(len(p) for p in parts))
    if err:
        err_room = budget if not out else max(budget // 2, budget - len(out))
        parts.append(_clip(err, err_room, "tail"))
        budget -= min(len(err), err_room)
    if out:
        parts.insert(len(problems), "[stdout]\n" + _clip(out, max(100, budget)))
    if not err and not problems:
        parts.append(f"Error: the code exited with status {result.exit_code}.")
    return "\n".join(parts + notes)


def extract_code_blocks(text: str, languages: tuple[str, ...] = ("python", "py", "python3"), *,
                        include_unclosed: bool = False) -> list[str]:
    """Contents of the fenced code blocks of ``text`` in one of ``languages`` (case-insensitive).

    A block opens with a line of three or more backticks followed by the language name (extra
    words after it are allowed) and closes with a line of at least as many backticks. Indented
    fences (e.g. inside a list) are handled and their indentation removed. An unclosed last block
    (generation stopped at the closing fence) is returned only with ``include_unclosed=True``.
    """
    import textwrap

    langs = {lang.lower() for lang in languages}
    blocks: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        ticks = len(stripped) - len(stripped.lstrip("`"))
        info = stripped[ticks:].strip().split()
        if ticks >= 3 and info and info[0].lower() in langs and "`" not in stripped[ticks:]:
            body = []
            j = i + 1
            closed = False
            while j < len(lines):
                s = lines[j].strip()
                if s.startswith("`" * ticks) and not s.strip("`"):
                    closed = True
                    break
                body.append(lines[j])
                j += 1
            if closed or include_unclosed:
                blocks.append(textwrap.dedent("\n".join(body)).strip("\n") + ("\n" if body else ""))
            i = j + 1
            continue
        i += 1
    return blocks
