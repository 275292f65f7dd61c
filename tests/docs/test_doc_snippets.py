"""The Python snippets and commands of the docs that did not run as written (issue 47, item 7), run
here exactly as the pages show them (taken from the markdown), in a folder laid out as the pages assume
(``runs/rm_tiny`` from docs/rm.md's command, servers on the documented ports' stand-ins): docs/rm.md's
reward-model loading, docs/serve_rm.md's client, docs/sandbox.md's client and docs/vlm.md's GRPO
command with images (tiny sizes added). Tiny models are built locally; nothing comes from the hub."""

from __future__ import annotations

import json
import math

import pytest

from tests.docs.blocks import ROOT, command_argv, fenced_block

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_snippet(code: str, capsys) -> tuple[dict, str]:
    """exec ``code`` as a script (``__name__ == "__main__"``); its globals and what it printed."""
    scope = {"__name__": "__main__"}
    exec(compile(code, "<docs snippet>", "exec"), scope)  # noqa: S102 - the documented snippet itself
    return scope, capsys.readouterr().out


@pytest.fixture(scope="module")
def rm_home(tmp_path_factory):
    """A folder holding ``runs/tiny`` and ``runs/rm_tiny``, made by docs/rm.md's two commands (the
    reward model: 2 steps on 64 pairs instead of the full epoch)."""
    import os

    from rlhforge.cli.main import main

    home = tmp_path_factory.mktemp("rm_home")
    block = fenced_block("docs/rm.md", "rlhforge rm --config examples/rm_tiny.yaml", "bash")
    commands = [command_argv(line) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["rlhforge", "tiny-model"], ["rlhforge", "rm"]]
    tiny = ["--train.max_steps", "2", "--data.dataset", "builtin:arithmetic_preference?n=64",
            "--eval.dataset", "builtin:arithmetic_preference?n=16@test"]
    here = os.getcwd()
    os.chdir(home)
    try:
        assert main(commands[0][1:]) == 0
        assert main([a.replace("examples/", f"{ROOT}/examples/") for a in commands[1][1:]] + tiny) == 0
    finally:
        os.chdir(here)
    assert (home / "runs" / "rm_tiny" / "model.safetensors").is_file()
    return home


def _scorer(rm_dir, normalize: bool):
    from rlhforge.config.serve_rm import ServeRewardConfig, ServeRMConfig
    from rlhforge.rewards.server import RewardScorer

    return RewardScorer.from_config(ServeRMConfig(reward=ServeRewardConfig(str(rm_dir), normalize_enable=normalize)))


def test_rm_loading_snippet(rm_home, monkeypatch, capsys):
    """docs/rm.md: the output folder loads with transformers alone, and the snippet's reward is the one
    rlhforge scores for the same text (``rlhforge serve-rm`` without normalisation)."""
    code = fenced_block("docs/rm.md", "AutoModelForSequenceClassification.from_pretrained", "python")
    monkeypatch.chdir(rm_home)
    scope, out = run_snippet(code, capsys)
    reward = scope["reward"].item()
    assert math.isfinite(reward) and out.startswith("reward ")
    expected = _scorer(rm_home / "runs" / "rm_tiny", normalize=False).score([scope["text"]])[0][0]
    assert reward == pytest.approx(expected, abs=1e-5)


def test_serve_rm_client_snippet(rm_home, monkeypatch, capsys):
    """docs/serve_rm.md: the client snippet against ``rlhforge serve-rm``'s app for runs/rm_tiny, as the
    page's first command serves it (--reward.normalize_enable), on a free port instead of 5000."""
    from rlhforge.rewards.server import create_app, start_server_thread

    code = fenced_block("docs/serve_rm.md", "RemoteRewardClient(", "python")
    assert "http://127.0.0.1:5000/get_reward" in code
    scorer = _scorer(rm_home / "runs" / "rm_tiny", normalize=True)
    monkeypatch.delenv("RLHFORGE_REWARD_API_KEY", raising=False)
    with start_server_thread(create_app(scorer)) as handle:
        scope, out = run_snippet(code.replace("http://127.0.0.1:5000/get_reward", handle.url), capsys)
    queries = ["What is 12 + 30? The answer is 42.", "What is 7 * 6? The answer is 42."]
    rewards, _raw = scorer.score(queries)
    assert out.startswith("[") and json.loads(out.split("]")[0] + "]") == pytest.approx(rewards, abs=1e-5)


def test_sandbox_client_snippet(monkeypatch, capsys):
    """docs/sandbox.md: the client snippet against a keyed sandbox service (the key from
    $RLHFORGE_SANDBOX_API_KEY, as the page's server command), on a free port instead of 10003."""
    from rlhforge.agents.sandbox import Sandbox, SandboxConfig
    from rlhforge.agents.sandbox.server import create_app, start_service_thread

    code = fenced_block("docs/sandbox.md", "SandboxClient(", "python")
    assert "http://127.0.0.1:10003" in code
    monkeypatch.setenv("RLHFORGE_SANDBOX_API_KEY", "doc-key")
    app = create_app(Sandbox(SandboxConfig(timeout_s=5.0)), api_key="doc-key", concurrency=1, max_queue=2)
    with start_service_thread(app) as handle:
        _, out = run_snippet(code.replace("http://127.0.0.1:10003", handle.base_url), capsys)
    assert out.split() == ["42", "0"]  # stdout "42\n", exit code 0: the code ran there, the key was accepted


def test_vlm_grpo_command(tmp_path, monkeypatch, capsys):
    """docs/vlm.md "RL with images": the command as shown (GRPO needs groups: it exited 2 without
    --rollout.n_samples_per_prompt), on a tiny Qwen2-VL in runs/quickstart_vlm/sft and prompts.jsonl of
    the page's form, with tiny sizes added."""
    from rlhforge.cli.main import main
    from rlhforge.models.tiny_vlm import build_tiny_vlm
    from tests.vlm_helpers import COLOURS, shape_image

    argv = command_argv(fenced_block("docs/vlm.md", "--reward.remote_url builtin:shape_colour", "bash"))
    assert argv[:2] == ["rlhforge", "rl"]
    build_tiny_vlm(tmp_path / "runs" / "quickstart_vlm" / "sft", arch="qwen2_vl", seed=0)
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(4):
        colour = list(COLOURS)[i % 3]
        shape_image(colour, "square", (56, 56), seed=i).save(tmp_path / f"img/{i}.png")
        rows.append({"prompt": "<image>What colour is the shape?", "images": [f"img/{i}.png"], "answer": colour})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    tiny = ["--rollout.batch_size", "2", "--rollout.max_new_tokens", "4", "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4", "--train.max_steps", "1",
            "--ckpt.output_dir", "runs/vlm_rl"]
    code = main(argv[1:] + tiny)
    assert code == 0, capsys.readouterr().err[-2000:]
    metrics = [json.loads(x) for x in (tmp_path / "runs/vlm_rl/metrics.jsonl").read_text().splitlines()]
    assert any("rollout/logprob_diff_rollout_vs_train" in m for m in metrics)
