"""verifiers 0.4 environments (``--env.kind verifiers``): a ``verifiers.v1`` taskset written here runs
through verifiers' own ``Env.run_episode`` (its train client renders with the model's chat template
and calls vLLM's token route, served over rlhforge's HF engine). Rewards equal the rubric's, the
tokens and mask equal verifiers' own record and the engine's output, bad output and a hung rubric
are named failures, and GRPO through ``rlhforge rl`` raises the rubric's reward."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

pytest.importorskip("verifiers.v1")

from rlhforge.agents import AgentSettings  # noqa: E402
from rlhforge.agents.batching import BatchingEngine  # noqa: E402
from rlhforge.agents.envs.verifiers import VerifiersEnvExecutor, taskset_records  # noqa: E402
from rlhforge.agents.single_turn import PromptRequest  # noqa: E402
from rlhforge.agents.serving.tokens import TokenServer  # noqa: E402
from rlhforge.cli.train_ppo_ray import main as rl_main  # noqa: E402
from rlhforge.rollout.engine import SamplingParams  # noqa: E402
from rlhforge.rollout.hf_engine import HFEngine  # noqa: E402
from tests.agents.agent_helpers import Recorder, capture_trajectories, check_trajectory, metrics, write_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TASKSET = '''
import asyncio
import verifiers.v1 as vf

LOG = []


class DigitData(vf.TaskData):
    mode: str = "ok"


class DigitTask(vf.Task[DigitData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, task, trace) -> float:
        text = trace.last_reply.strip()
        if task.mode == "hang":
            await asyncio.sleep(30)
        score = sum(c.isdigit() for c in text) / max(len(text), 1)
        LOG.append((text, score))
        return float("nan") if task.mode == "bad" else score


class DigitTaskset(vf.Taskset[DigitTask, vf.TasksetConfig]):
    def load(self):
        for i in range(8):
            yield DigitTask(DigitData(prompt=f"Write digits {i}.", name=f"t{i}"), self.config.task)
        yield DigitTask(DigitData(prompt="Bad.", name="bad", mode="bad"), self.config.task)
        yield DigitTask(DigitData(prompt="Hang.", name="hang", mode="hang"), self.config.task)


__all__ = ["DigitTaskset"]
'''


def digit_fraction(text: str) -> float:
    text = text.strip()
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@pytest.fixture(scope="module")
def taskset_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf") / "digit_taskset.py"
    path.write_text(TASKSET)
    return path


@pytest.fixture(scope="module")
def engine_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFEngine.from_pretrained(str(tiny_model_dir), tok), tok


def _run(ex, engine_tok, labels, *, budget=12, **settings):
    engine, tok = engine_tok
    ex.configure(tokenizer=tok, settings=AgentSettings(**{"step_timeout": 20.0, "episode_timeout": 60.0, **settings}))
    reqs = [PromptRequest(tok.encode("hi", add_special_tokens=False), lab, None, i, 0) for i, lab in enumerate(labels)]
    params = [SamplingParams(max_new_tokens=budget, seed=11 + i) for i in range(len(reqs))]
    try:
        return asyncio.run(ex.execute_batch(reqs, params, engine))
    finally:
        ex.close()


def test_rewards_and_masks_are_the_environments(taskset_file, tiny_model_dir, engine_tok, monkeypatch):
    rec = Recorder(monkeypatch)
    _, tok = engine_tok
    ex = VerifiersEnvExecutor(str(taskset_file), model_path=str(tiny_model_dir))
    log = sys.modules["digit_taskset"].LOG
    log.clear()
    trajs = _run(ex, engine_tok, [{"idx": 2}, 5, {"name": "t7"}])
    assert [t.drop_reason for t in trajs] == [None] * 3, [t.error for t in trajs]
    assert len(log) == 3
    for t, i in zip(trajs, (2, 5, 7)):
        # the prompt: verifiers' rendering of the task, equal to the model's own chat template
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write digits {i}."}], tokenize=False,
                                         add_generation_prompt=True)
        assert t.prompt_ids == tok.encode(prompt, add_special_tokens=False)
        assert check_trajectory(t, rec) == 0 and len(t.action_ranges) == 1  # the engine's tokens and log-probs
        (s, e), = t.action_ranges
        assert t.action_mask() == [0] * s + [1] * (e - s)
        reply = tok.decode(t.token_ids[s:e], skip_special_tokens=True).strip()
        # the rubric's reward, computed by verifiers on the reply it saw
        assert (reply, t.reward) in [(x, pytest.approx(r)) for x, r in log]
        assert t.reward == pytest.approx(digit_fraction(reply)) and t.extra["reward_digits"] == t.reward
    assert taskset_records(str(taskset_file))[3] == {"prompt": "Write digits 3.", "label": {"idx": 3}}


def test_bad_output_and_hung_rubric_are_named_and_counted(taskset_file, tiny_model_dir, engine_tok, capsys):
    ex = VerifiersEnvExecutor(str(taskset_file), model_path=str(tiny_model_dir))
    bad, hang, missing = _run(ex, engine_tok, [{"name": "bad"}, {"name": "hang"}, 40], episode_timeout=3.0)
    assert bad.drop_reason == "env_error" and "the rubric's reward is nan (digits=nan)" in bad.error
    assert hang.drop_reason == "env_error"
    assert "episode did not finish within 3 s (--train.agent_episode_timeout)" in hang.error
    assert missing.drop_reason == "env_error" and "label names task 40; the taskset has 10" in missing.error
    assert "verifiers env" in capsys.readouterr().out


def test_token_route_is_vllms(engine_tok, monkeypatch):
    """``POST /inference/v1/generate`` without a session: the engine's ids and log-probs, vLLM's shape."""
    rec = Recorder(monkeypatch)
    engine, tok = engine_tok
    server = TokenServer(tok)

    async def go():
        server.start()
        server.bind(asyncio.get_running_loop(), BatchingEngine(engine).generate_one)
        async with httpx.AsyncClient(base_url=server.url) as http:
            ok = await http.post("/inference/v1/generate", json={
                "model": "policy", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "seed": 3}})
            bad = await http.post("/inference/v1/generate", json={"token_ids": [10**6]})
            models = await http.get("/v1/models")
        return ok, bad, models

    try:
        ok, bad, models = asyncio.run(go())
    finally:
        server.stop()
    body = ok.json()
    assert ok.status_code == 200, body
    (choice,) = body["choices"]
    ((prompt, ids, lps),) = rec.calls
    assert prompt == (5, 6, 7) and choice["token_ids"] == ids and body["prompt_token_ids"] == [5, 6, 7]
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == lps
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]
    assert bad.status_code == 400 and "beyond the tokenizer" in bad.json()["error"]["message"]
    assert models.json()["data"][0]["id"] == "policy"


def test_bad_taskset_exits_2(tiny_model_dir, tmp_path, capsys):
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": "x", "label": 0}])
    broken = tmp_path / "broken_taskset.py"
    broken.write_text("import verifiers.v1 as vf\n__all__ = []\n")
    with pytest.raises(SystemExit) as exc:
        rl_main(["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", str(data),
                 "--data.input_key", "prompt", "--ckpt.output_dir", str(tmp_path / "o"), "--rollout.batch_size", "1",
                 "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "2", "--train.micro_batch_size", "1",
                 "--env.kind", "verifiers", "--env.id", str(broken)])
    assert exc.value.code == 2
    assert f"--env.id {broken} (--env.kind verifiers):" in capsys.readouterr().err


def test_grpo_raises_the_rubrics_reward(taskset_file, tiny_model_dir, tmp_path, monkeypatch):
    seen = capture_trajectories(monkeypatch)
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"Write digits {i % 8}.", "label": {"idx": i % 8}}
                                                for i in range(32)])
    out = tmp_path / "run"
    args = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--data.label_key", "label", "--data.apply_chat_template",
            "--env.kind", "verifiers", "--env.id", str(taskset_file),
            "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "8",
            "--rollout.micro_batch_size", "16", "--train.batch_size", "16", "--train.micro_batch_size", "8",
            "--algo.advantage.estimator", "group_norm", "--actor.adam.lr", "5e-2", "--actor.lr_warmup_ratio", "0",
            "--train.max_steps", "8", "--ds.param_dtype", "fp32", "--algo.kl.init_coef", "0",
            "--ckpt.output_dir", str(out), "--train.seed", "5", "--logger.progress_bar", "off", "--train.check_tokens"]
    assert rl_main(args) == 0
    recs = [r for r in metrics(out) if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in recs]
    print("verifiers GRPO reward_mean per step:", [round(r, 3) for r in rewards])
    assert len(rewards) == 8 and "rollout/reward_digits" in recs[0]
    assert recs[0]["rollout/logprob_diff_rollout_vs_train"] < 1e-4
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2
    assert len(seen) == 128 and all(len(t.action_ranges) == 1 for t in seen)
