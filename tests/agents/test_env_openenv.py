"""OpenEnv servers as multi-turn environments (``--env.kind openenv``): a real ``openenv-core`` server
(``create_app``) written here runs in a uvicorn thread; rlhforge drives it over its WebSocket (and
HTTP). Rewards equal the environment's, feedback tokens are masked, a bad reply and a hung server
are named failures, and GRPO through ``rlhforge rl`` raises the environment's reward."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytest.importorskip("openenv.core")

from openenv.core.env_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from rlhforge.agents import AgentSettings  # noqa: E402
from rlhforge.agents.envs.openenv import OpenEnvExecutor  # noqa: E402
from rlhforge.agents.single_turn import PromptRequest  # noqa: E402
from rlhforge.cli.train_ppo_ray import main as rl_main  # noqa: E402
from rlhforge.rollout.engine import SamplingParams  # noqa: E402
from rlhforge.rollout.hf_engine import HFEngine  # noqa: E402
from tests.agents.agent_helpers import Recorder, capture_trajectories, check_trajectory, metrics, write_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def digit_fraction(text: str) -> float:
    text = text.strip()
    return sum(c.isdigit() for c in text) / max(len(text), 1)


class DigitAction(Action):
    message: str


class DigitObservation(Observation):
    prompt: str = ""


class DigitEnv(Environment):
    """Two turns: each reply is rewarded by its share of digits; ``mode`` (a reset argument) makes it
    misbehave (``bad``: a string reward) or hang (``hang``)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    LOG: list = []

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="e", step_count=0)
        self.mode = "ok"

    def reset(self, seed=None, episode_id=None, mode="ok", **kwargs):
        self.mode, self._state = mode, State(episode_id=episode_id or "e", step_count=0)
        return DigitObservation(prompt="Write digits.", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if self.mode == "hang":
            time.sleep(3)
        reward = digit_fraction(action.message)
        DigitEnv.LOG.append((action.message, reward))
        done = self._state.step_count >= 2
        return DigitObservation(prompt="" if done else f"[turn {self._state.step_count}] More digits.",
                                done=done, reward=reward)

    @property
    def state(self):
        return self._state


@pytest.fixture(scope="module")
def server():
    yield from _serve()


@pytest.fixture()
def own_server():
    """A server of its own (the hung-environment test leaves a sleeping step behind on the shared one)."""
    yield from _serve()


def _serve():
    import uvicorn
    from fastapi.responses import JSONResponse

    app = create_app(DigitEnv, DigitAction, DigitObservation, max_concurrent_envs=16)

    @app.middleware("http")
    async def bad_reward(request, call_next):  # the "bad" transport: an OpenEnv reply with a string reward
        if request.url.path == "/step" and request.headers.get("x-bad"):
            return JSONResponse({"observation": {}, "reward": "high", "done": True})
        return await call_next(request)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True


@pytest.fixture(scope="module")
def engine_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFEngine.from_pretrained(str(tiny_model_dir), tok), tok


def _run(ex, engine_tok, labels, *, budget=40, stop=(), **settings):
    engine, tok = engine_tok
    ex.configure(tokenizer=tok, settings=AgentSettings(**{"step_timeout": 20.0, "episode_timeout": 60.0, **settings}))
    reqs = [PromptRequest(tok.encode("hi", add_special_tokens=False), lab, None, i, 0) for i, lab in enumerate(labels)]
    params = [SamplingParams(max_new_tokens=budget, seed=11 + i, stop_token_ids=stop) for i in range(len(reqs))]
    return asyncio.run(ex.execute_batch(reqs, params, engine))


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_rewards_and_masks_are_the_environments(server, engine_tok, monkeypatch, transport):
    rec = Recorder(monkeypatch)
    _, tok = engine_tok
    stop = tuple(i for i in range(len(tok)) if "e" in tok.decode([i]))  # short turns: most replies end in a few tokens
    DigitEnv.LOG.clear()
    (t1, t2) = _run(OpenEnvExecutor(server, transport=transport, check=True), engine_tok, [None, None], stop=stop,
                    budget=60)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write digits."}], tokenize=False,
                                     add_generation_prompt=True)
    for t in (t1, t2):
        assert t.drop_reason is None, t.error
        assert t.prompt_ids == tok.encode(prompt, add_special_tokens=False)  # the reset observation is the prompt
        check_trajectory(t, rec)
        actions = [tok.decode(t.token_ids[s:e], skip_special_tokens=True) for s, e in t.action_ranges]
        if transport == "http":  # a fresh environment per request: every step is its first, never done
            assert t.extra["openenv_steps"] >= 1
            continue
        # each episode: turn 1, the environment's feedback (masked), turn 2; reward = what the env computed
        assert len(t.action_ranges) == 2 and t.extra["openenv_steps"] == 2.0
        assert t.reward == pytest.approx(sum(digit_fraction(a) for a in actions))
        (_, e1), (s2, _) = t.action_ranges
        feedback = tok.decode(t.token_ids[e1:s2])
        assert feedback.endswith("<|im_start|>user\n[turn 1] More digits.<|im_end|>\n<|im_start|>assistant\n")
        assert t.action_mask()[e1:s2] == [0] * (s2 - e1)
    if transport == "ws":
        assert sorted(r for _, r in DigitEnv.LOG) == pytest.approx(
            sorted(digit_fraction(tok.decode(t.token_ids[s:e], skip_special_tokens=True))
                   for t in (t1, t2) for s, e in t.action_ranges))


def test_bad_output_and_hung_server_are_named_and_counted(server, engine_tok, capsys):
    import httpx

    ex = OpenEnvExecutor(server, transport="http")
    real = httpx.AsyncClient.__init__

    def bad_client(self, *a, **kw):
        real(self, *a, **{**kw, "headers": {"x-bad": "1"}})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx.AsyncClient, "__init__", bad_client)
        (t,) = _run(ex, engine_tok, [None], budget=6)
    assert t.drop_reason == "env_error" and "step 1 returned reward 'high'; expected a number or null" in t.error
    (t,) = _run(OpenEnvExecutor(server), engine_tok, [{"mode": "hang"}], budget=6, step_timeout=1.0)
    assert t.drop_reason == "env_error"
    assert "step 1 did not return within 1 s (--train.agent_step_timeout)" in t.error
    assert "OpenEnv env" in capsys.readouterr().out
    with pytest.raises(ConnectionError, match="no OpenEnv server answers"):
        OpenEnvExecutor("http://127.0.0.1:9", check=True)


def test_bad_flags_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": "x", "label": "1"}])
    base = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--ckpt.output_dir", str(tmp_path / "o"),
            "--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "2",
            "--train.micro_batch_size", "1"]
    for extra, message in ((["--env.kind", "openenv", "--env.id", "localhost:1"],
                            "--env.id localhost:1: an OpenEnv server is named by its URL"),
                           (["--env.kind", "openenv"], "--env.kind openenv needs --env.id"),
                           (["--env.kind", "openenv", "--env.id", "http://127.0.0.1:9"],
                            "--env.id http://127.0.0.1:9 (--env.kind openenv): ConnectionError: no OpenEnv server"),
                           (["--env.kind", "gym", "--env.id", "x"], "env.kind")):
        with pytest.raises(SystemExit) as exc:
            rl_main(base + extra)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


LR = "5e-2"


def test_grpo_raises_the_environments_reward(own_server, tiny_model_dir, tmp_path, monkeypatch):
    server = own_server
    seen = capture_trajectories(monkeypatch)
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"Say {i}.", "label": None} for i in range(32)])
    out = tmp_path / "run"
    args = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--data.apply_chat_template", "--env.kind", "openenv", "--env.id", server,
            "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "8",
            "--rollout.micro_batch_size", "16", "--train.batch_size", "16", "--train.micro_batch_size", "8",
            "--algo.advantage.estimator", "group_norm", "--actor.adam.lr", LR, "--actor.lr_warmup_ratio", "0",
            "--train.max_steps", "8", "--ds.param_dtype", "fp32", "--algo.kl.init_coef", "0",
            "--ckpt.output_dir", str(out), "--train.seed", "5", "--logger.progress_bar", "off"]
    assert rl_main(args) == 0
    rewards = [r["rollout/reward_mean"] for r in metrics(out) if "rollout/reward_mean" in r]
    assert len(rewards) == 8
    print("openenv GRPO reward_mean per step:", [round(r, 3) for r in rewards])
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2
    for t in seen:  # the env's reward, and every action a reply it scored
        actions = [t.token_ids[s:e] for s, e in t.action_ranges]
        assert len(actions) <= 2 and t.reward >= 0
