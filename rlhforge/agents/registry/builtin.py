"""Built-in registry entries: task ``math`` (answer checking with math-verify) and task + env_func
``math_tir`` (tool-integrated reasoning: the model may run Python in the sandbox between turns).

``math_tir`` episode: the model answers; when its turn contains a ```` ```python ```` block, the
last block runs in :class:`~rlhforge.agents.sandbox.Sandbox` and its result comes back as the next
user turn (rendered with the tokenizer's chat template, loss mask 0) as a ```` ```output ````
block; the episode ends at an answer without code, after ``max_tool_calls`` tool calls (label
field, default 4), or when the token budget is spent. The reward of both tasks is math-verify's
check of the final answer (the last ``\\boxed{}``, else the last number) against ``label["answer"]``
(or the label itself when it is not a dict): 1.0 or 0.0.

Remote sandboxes: with ``RLHFORGE_SANDBOX_URL`` set (``http://host:10003``, several URLs separated by
commas, or ``endpoints:FILE``, a file of URLs checked on every call) the code runs on
``rlhforge serve-sandbox`` servers through :class:`~rlhforge.agents.sandbox.SandboxClient` (failover
between servers; a call no server could run is a sandbox failure like a local one), with the key
of ``RLHFORGE_SANDBOX_API_KEY``. :func:`configure_sandbox` sets the same from code.

Filters: ``math_tir``'s per-sample filter keeps out of the loss samples in which the sandbox itself
failed (not the model's code: the tool was unavailable, so the sample says nothing about the
policy); its per-experience filter drops prompt groups in which every sample met a sandbox failure
(the tool was down for the whole group). The reward-failure handler of both scores 0.0.
"""

from __future__ import annotations

from typing import Any


__all__ = ["math_score", "math_tir_generate", "label_answer", "sandbox", "configure_sandbox"]

_SANDBOX = None
_SANDBOX_KEY: tuple | None = None
_CONFIGURED: tuple | None = None
_LIMITS = dict(timeout_s=5.0, memory_bytes=512 << 20)


def configure_sandbox(url: str | None = None, *, api_key: str | None = None) -> None:
    """Where ``math_tir`` runs code: ``url`` (URLs or ``endpoints:FILE``, see the module docstring)
    instead of ``$RLHFORGE_SANDBOX_URL``; ``None`` goes back to the environment variable (unset: a
    local sandbox). Checks the URLs / file now (ValueError naming the problem)."""
    global _CONFIGURED
    if url:
        from rlhforge.agents.sandbox.client import sandbox_endpoints

        sandbox_endpoints(url)
    _CONFIGURED = (url, api_key) if url else None


def sandbox():
    """The shared sandbox of the built-in tool environment: a local :class:`Sandbox`, or a
    :class:`SandboxClient` when remote servers are configured (re-checked on every call, so a
    changed setting takes effect at the next call)."""
    global _SANDBOX, _SANDBOX_KEY
    import os

    from rlhforge.agents.sandbox.client import API_KEY_ENV, URL_ENV

    url, key = _CONFIGURED or (os.environ.get(URL_ENV) or None, None)
    key = key if key is not None else os.environ.get(API_KEY_ENV) or None
    if _SANDBOX is None or _SANDBOX_KEY != (url, key):
        from rlhforge.agents.sandbox import Sandbox, SandboxClient, SandboxConfig

        if url:
            _SANDBOX = SandboxClient(url, api_key=key, timeout_s=_LIMITS["timeout_s"],
                                     limits={"memory_bytes": _LIMITS["memory_bytes"]})
        else:
            _SANDBOX = Sandbox(SandboxConfig(**_LIMITS, concurrency=4))
        _SANDBOX_KEY = (url, key)
    return _SANDBOX


def label_answer(label: Any) -> str:
    if isinstance(label, dict):
        for key in ("answer", "ground_truth", "solution"):
            if key in label:
                return str(label[key])
        raise ValueError(f"the label has no 'answer' field (keys: {sorted(label)})")
    return str(label)


def math_score(response: str, label: Any, **kwargs) -> dict:
    from rlhforge.rewards.math import extract_answer, math_reward

    r = math_reward(response, label_answer(label))
    return {"reward": r, "score": r, "extra_logs": {"math_answer_found": float(extract_answer(response) is not None)}}


def _zero_on_failure(traj, label, err) -> float:
    return 0.0


def feedback_text(ctx, content: str, after_eos: bool) -> str:
    """``content`` as the next user turn in the chat template (plain text without a template)."""
    from rlhforge.data.templates import chat_feedback

    if getattr(ctx.tokenizer, "chat_template", None):
        with ctx.lock:
            return chat_feedback(ctx.tokenizer, content, after_eos=after_eos)
    return f"\n{content}\n"


async def math_tir_generate(ep, label, ctx) -> dict:
    from rlhforge.agents.sandbox import extract_code_blocks, format_feedback

    max_calls = int(label.get("max_tool_calls", 4)) if isinstance(label, dict) else 4
    calls = errors = infra_errors = 0
    while True:
        action = await ep.generate()
        if action is None:
            break
        blocks = extract_code_blocks(action.text)
        if not blocks or calls >= max_calls or action.finish_reason == "length" or ep.remaining <= 0:
            break
        result = await ctx.guard(sandbox().run(blocks[-1]), what="math_tir sandbox call")
        calls += 1
        errors += not result.ok
        infra_errors += result.error is not None
        ended_with_eos = bool(action.token_ids) and action.token_ids[-1] == ctx.tokenizer.eos_token_id
        ep.add_feedback(feedback_text(ctx, f"```output\n{format_feedback(result)}\n```", ended_with_eos))
    return {"extra_logs": {"tir_tool_calls": float(calls), "tir_tool_errors": float(errors),
                           "tir_sandbox_errors": float(infra_errors)}}


def math_tir_sample_filter(traj, label) -> bool:
    return traj.extra.get("tir_sandbox_errors", 0.0) == 0.0


def math_tir_experience_filter(group) -> bool:
    return not all(t.extra.get("tir_sandbox_errors", 0.0) > 0 for t in group)


# What the registry registers before the first lookup (``rlhforge.agents.registry``): task name ->
# keyword arguments of ``register_task``, env name -> generate function.
BUILTIN_TASKS: dict[str, dict[str, Any]] = {
    "math": dict(reward=math_score, reward_fail=_zero_on_failure),
    "math_tir": dict(reward=math_score, sample_filter=math_tir_sample_filter,
                     experience_filter=math_tir_experience_filter, reward_fail=_zero_on_failure),
}
BUILTIN_ENVS: dict[str, Any] = {"math_tir": math_tir_generate}
