"""``rlhforge-chat``: a verifiers 0.4 harness that runs its chat loop in-process (no ``uv`` script,
no container, no network), for training on the host with rlhforge's engines.

verifiers' built-in harnesses (``bash``, ``null``, ...) launch a program bootstrapped with ``uv``
(which downloads its dependencies); on an offline training machine that cannot run. This harness
plays the same role as ``null`` (a tool-less chat loop): it sends the task's prompt (system prompt
as a system message) to the rollout's interception endpoint with the ``openai`` client, once per
segment (verifiers' default ``resume()`` replays the conversation for environments whose user
continues the exchange). Every model call goes through the interception endpoint, as verifiers
requires, so the trace, the task's rewards and the recorded tokens are verifiers' own.

Selected by :mod:`rlhforge.agents.envs.verifiers` unless ``--env.harness`` names another one.
"""

from __future__ import annotations

import json

from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

__all__ = ["RlhforgeChatHarness", "RlhforgeChatHarnessConfig"]

HARNESS_ID = "rlhforge_chat"
"""The id rlhforge registers this module under (``sys.modules``) for verifiers' plugin loader."""


class RlhforgeChatHarnessConfig(HarnessConfig):
    pass


def _wire(message) -> dict:
    if isinstance(message, dict):
        return message
    from verifiers.v1.dialects.chat import message_to_wire

    return message_to_wire(message)


class RlhforgeChatHarness(Harness[RlhforgeChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: TaskData, tool_interception_url: str | None = None
                     ) -> ProgramResult:
        import httpx
        import openai

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(_wire(m) for m in prompt)
        async with httpx.AsyncClient(timeout=None) as http:
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http)
            try:
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            except openai.APIError as err:
                return ProgramResult(exit_code=1, stdout="", stderr=f"{type(err).__name__}: {err}")
        return ProgramResult(exit_code=0, stdout=json.dumps({"content": reply.choices[0].message.content}), stderr="")
