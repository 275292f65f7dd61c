"""The multi-turn token checker (``--train.check_tokens``, rlhforge/agents/token_check.py).

- hand-built trajectories: the checker passes the exact one and names the turn and position of
  every kind of drift (re-tokenised history, an edited action, feedback inside a span, moved
  log-probs, a training row that differs);
- every model family with its own chat template (ChatML, Llama 3, Gemma, Mistral, Phi-3), through
  the environment API and through the OpenAI-compatible server with the conversation re-rendered
  each turn: the tokens trained on are the tokens the engine saw and produced, feedback masked;
- ``rlhforge rl --train.check_tokens``: a run logs what it checked; an OpenRLHF ``execute`` that
  re-tokenises the conversation trains silently without the flag and stops with exit 3 with it.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from rlhforge.agents import AgentInstanceBase, AgentSettings, MultiTurnAgentExecutor
from rlhforge.agents.openrlhf.multi_turn import chat_feedback
from rlhforge.agents.serving.chat import OpenAIServerAgentExecutor
from rlhforge.agents.single_turn import PromptRequest, SingleTurnExecutor
from rlhforge.agents.token_check import EngineTurn, TokenDriftError, check_trajectory, check_training_rows
from rlhforge.agents.types import Trajectory
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.models.tiny import ARCHS, TinyModelSpec, build_tiny_model
from rlhforge.rollout.engine import GenerationOutput, SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from tests.agents.agent_helpers import agent_args, metrics, write_prompts

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]


# ------------------------------------------------------------------------------ hand-built cases
def _traj():
    # prompt [1 2 3], action [10 11], feedback [4 5], action [12 13 14]
    ids = [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    traj = Trajectory(token_ids=ids, prompt_len=3, action_ranges=[(3, 5), (7, 10)],
                      rollout_logprobs=[-0.5, -1.0, -0.25, -2.0, -0.125], finish_reason="stop",
                      prompt_index=7, sample_index=1)
    turns = [EngineTurn((1, 2, 3), (10, 11), (-0.5, -1.0)),
             EngineTurn((1, 2, 3, 10, 11, 4, 5), (12, 13, 14), (-0.25, -2.0, -0.125))]
    return traj, turns


def test_exact_trajectory_passes_and_rows_match():
    traj, turns = _traj()
    assert check_trajectory(traj, turns) == 2
    rollout = [0.0] * 3 + [-0.5, -1.0, 0.0, 0.0, -0.25, -2.0, -0.125]
    check_training_rows([traj], [(traj.token_ids, [0, 0, 0, 1, 1, 0, 0, 1, 1, 1], rollout)])


def test_retokenised_history_is_named_by_turn_and_position():
    traj, turns = _traj()
    # the environment decoded the conversation and encoded it again: "10 11" became "10 9 2"
    turns[1] = EngineTurn((1, 2, 3, 10, 9, 2, 4, 5), (12, 13, 14), (-0.25, -2.0, -0.125))
    with pytest.raises(TokenDriftError, match=r"prompt 7 sample 1 turn 1: the engine saw 8 tokens but 7 precede "
                                              r"this action.*position 4: engine saw 9, trained on 11"):
        check_trajectory(traj, turns)


def test_edited_action_feedback_in_span_and_moved_logprobs_fail():
    traj, turns = _traj()
    traj.token_ids[8] = 99  # the action was edited after generation
    with pytest.raises(TokenDriftError, match=r"turn 1: the action span \(7, 10\).*action token 1: engine produced "
                                              r"13, trained on 99"):
        check_trajectory(traj, turns)
    traj, turns = _traj()
    traj.action_ranges = [(3, 7), (7, 10)]  # feedback [4 5] inside the first span: it would be trained on
    traj.rollout_logprobs = [-0.5, -1.0, 0.0, 0.0, -0.25, -2.0, -0.125]
    with pytest.raises(TokenDriftError, match=r"turn 0: the action span \(3, 7\) is not the engine's output"):
        check_trajectory(traj, turns)
    traj, turns = _traj()
    traj.rollout_logprobs[3] = -3.0
    with pytest.raises(TokenDriftError, match=r"turn 1: rollout log-prob 1 of the span is -3.0, the engine's -2.0"):
        check_trajectory(traj, turns)
    traj, turns = _traj()
    with pytest.raises(TokenDriftError, match="1 action spans are trained on but the engine produced 2"):
        check_trajectory(Trajectory(traj.token_ids, 3, [(3, 5)], [-0.5, -1.0], "stop", prompt_index=7,
                                    sample_index=1), turns)


def test_cut_at_the_budget_and_row_drift():
    traj, turns = _traj()
    cut = Trajectory(traj.token_ids[:9], 3, [(3, 5), (7, 9)], [-0.5, -1.0, -0.25, -2.0], "length")
    assert check_trajectory(cut, turns) == 2  # the last action cut where the sequence ends
    mid = Trajectory(traj.token_ids[:9] + [0], 3, [(3, 5), (7, 9)], [-0.5, -1.0, -0.25, -2.0], "stop")
    with pytest.raises(TokenDriftError, match="turn 1"):
        check_trajectory(mid, turns)  # a shortened action followed by more tokens is drift
    rollout = [0.0] * 3 + [-0.5, -1.0, 0.0, 0.0, -0.25, -2.0, -0.125]
    with pytest.raises(TokenDriftError, match="training action mask is 1 at position 5"):
        check_training_rows([traj], [(traj.token_ids, [0, 0, 0, 1, 1, 1, 0, 1, 1, 1], rollout)])
    with pytest.raises(TokenDriftError, match="differs from the trajectory at position 2"):
        check_training_rows([traj], [([1, 2, 9] + traj.token_ids[3:], [0, 0, 0, 1, 1, 0, 0, 1, 1, 1], rollout)])


class _EchoEngine:
    """Answers each prompt with its last two ids reversed."""

    async def generate(self, prompts, sampling, vision=None):
        return [GenerationOutput(token_ids=p[-2:][::-1], logprobs=[-0.5, -0.25], finish_reason="stop") for p in prompts]


@pytest.mark.parametrize("check", [False, True])
def test_single_turn_records_engine_turns_only_with_check_tokens(check):
    from rlhforge.agents.loader import build_executor
    from rlhforge.cli.train_ppo_ray import parse_rl_args

    flag = ["--train.check_tokens"] if check else []
    cfg = parse_rl_args(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "x.jsonl", *flag], validate=False)
    executor = build_executor(cfg, None, None)  # no agent: the single-turn executor, told the flag
    assert isinstance(executor, SingleTurnExecutor) and executor.check_tokens is check
    reqs = [PromptRequest([1, 2, 3], prompt_index=i) for i in range(2)]
    trajs = asyncio.run(executor.generate(reqs, [SamplingParams(max_new_tokens=2)] * 2, _EchoEngine()))
    for traj in trajs:
        assert traj.token_ids == [1, 2, 3, 3, 2] and traj.action_ranges == [(3, 5)]
        if not check:
            assert traj.engine_turns is None
            continue
        assert traj.engine_turns == [EngineTurn((1, 2, 3), (3, 2), (-0.5, -0.25))]
        assert check_trajectory(traj, traj.engine_turns) == 1


# ------------------------------------------------------------------------ every family, real engines
TEMPLATES = {
    "chatml": None,  # the tiny tokenizer's own (Qwen's format)
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
               "{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}"
              "\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
                "{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}"),
    "phi3": ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}
FAMILY_TEMPLATE = {"llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "qwen3_moe": "chatml",
                   "gemma3_text": "gemma", "mistral": "mistral", "mixtral": "mistral", "phi3": "phi3"}
SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                     num_hidden_layers=2, moe_intermediate_size=64)


class Env(AgentInstanceBase):
    """Three turns; feedback in the chat template's own format (a user message per turn)."""

    tokenizer = None

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"], "sampling_params": {"max_tokens": 5}}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 3
        return {"rewards": 1.0, "scores": 1.0, "done": done,
                "environment_feedback": "" if done else chat_feedback(self.tokenizer, f"observation {self.turn}: 42")}


async def _openai_agent(prompt, label, client):
    messages = [{"role": "user", "content": prompt}]
    for turn in range(3):  # the whole conversation re-rendered by the chat template every call
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"observation {turn}: 42"}]
    return 1.0


def _episodes(executor, tok, engine, settings):
    executor.configure(tokenizer=tok, settings=settings)
    text = tok.apply_chat_template([{"role": "user", "content": "count with me"}], tokenize=False,
                                   add_generation_prompt=True)
    reqs = [PromptRequest(tok.encode(text, add_special_tokens=False), "1", None, i, 0,
                          raw_prompt="count with me") for i in range(2)]
    params = [SamplingParams(max_new_tokens=400, seed=3 + i) for i in range(2)]
    return asyncio.run(executor.execute_batch(reqs, params, engine))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_family_trains_on_the_engines_tokens(arch, tmp_path):
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / arch, SPEC, seed=1, arch=arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    template = TEMPLATES[FAMILY_TEMPLATE[arch]]
    if template is not None:
        tok.chat_template = template
    engine = HFEngine.from_pretrained(str(model_dir), tok)
    settings = AgentSettings(step_timeout=30.0, episode_timeout=120.0, check_tokens=True)
    Env.tokenizer = tok
    env_trajs = _episodes(MultiTurnAgentExecutor(Env), tok, engine, settings)
    server = OpenAIServerAgentExecutor(_openai_agent)
    try:
        chat_trajs = _episodes(server, tok, engine, settings)
    finally:
        server.close()
    for traj in env_trajs + chat_trajs:
        assert traj.drop_reason is None, traj.error
        turns = check_trajectory(traj, traj.engine_turns)
        assert turns == len(traj.action_ranges) >= 2
        mask = traj.action_mask()
        # every token outside the engine's outputs (prompt, feedback, template glue) has mask 0
        produced = sum(len(t.produced) for t in traj.engine_turns)
        assert sum(mask) == traj.response_length <= produced
        env_tokens = len(traj.token_ids) - traj.prompt_len - sum(mask)
        assert env_tokens > 0 and "observation 1: 42" in tok.decode(traj.token_ids[traj.prompt_len:])
        assert all(math.isfinite(x) and x <= 0 for x in traj.rollout_logprobs)


# ------------------------------------------------------------------------------------ the CLI flag
RETOKENISING_EXECUTOR = '''
from copy import deepcopy
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    """Two turns; between them it decodes the conversation and encodes it again (a common bug)."""

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        tokens = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ranges, logprobs = [], [0.0] * len(tokens)
        for turn in range(2):
            params = deepcopy(sampling_params)
            params.max_tokens = 6
            out = (await llm_engine.generate(tokens, params)).outputs[0]
            ranges.append((len(tokens), len(tokens) + len(out.token_ids)))
            tokens = tokens + list(out.token_ids)
            logprobs += [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
            if turn == 0:
                text = hf_tokenizer.decode(tokens) + "\\nagain:\\n"
                tokens = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
                logprobs = logprobs + [0.0] * (len(tokens) - len(logprobs))
                logprobs = logprobs[: len(tokens)]
        return {"prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
                "rollout_log_probs": logprobs, "reward": float(len(tokens) % 2), "scores": 1.0}
'''


def test_cli_check_tokens(tiny_model_dir, tmp_path, capsys):
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"count {i} with me", "label": "2"} for i in range(2)])
    env = tmp_path / "env.py"
    env.write_text('''
from rlhforge.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        self.turn = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": 1.0, "done": self.turn >= 2, "environment_feedback": "\\nobservation: 42\\n",
                "sampling_params": {"max_tokens": 5}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
''')
    out = tmp_path / "ok"
    capsys.readouterr()
    assert rl_main(agent_args(tiny_model_dir, out, data, env, "--train.check_tokens", steps=1)) == 0
    (m,) = [r for r in metrics(out) if "rollout/tokens_checked_turns" in r]
    assert m["rollout/tokens_checked_samples"] == 4 and m["rollout/tokens_checked_turns"] >= 4
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[rlhforge] --train.check_tokens:")]
    assert said == [f"[rlhforge] --train.check_tokens: 4 samples ({m['rollout/tokens_checked_turns']:.0f} engine turns) "
                    "match what the engine saw and produced, token for token; checked every step "
                    "(rollout/tokens_checked_*)"]  # the console says it ran (issue 47, item 9)

    bad = tmp_path / "retok.py"
    bad.write_text(RETOKENISING_EXECUTOR)
    assert rl_main(agent_args(tiny_model_dir, tmp_path / "silent", data, bad, steps=1)) == 0  # trains on drift
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        rl_main(agent_args(tiny_model_dir, tmp_path / "caught", data, bad, "--train.check_tokens", steps=1))
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert "turn 0: the action span" in err and "is not the engine's output" in err
