"""--train.routing_replay end to end: a tiny Qwen3-MoE trains two GRPO steps through the real CLI with
the HF engine's recorded routing replayed in the old-log-prob and training forwards; bad combinations
stop at start-up (exit 2) naming the flag."""

import pytest

import rlhforge.models.routing as routing
from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import per_step, rl_args, write_reward

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rlhforge.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, arch="qwen3_moe")


def _run(moe_dir, out, reward, monkeypatch, *extra):
    calls = {"replayed": 0, "tokens": 0}
    original = routing.replay_routing

    def counting(model, record):
        if record is not None:
            calls["replayed"] += 1
            calls["tokens"] += int((record[:, 0, 0] >= 0).sum())
        return original(model, record)

    with monkeypatch.context() as m:
        m.setattr(routing, "replay_routing", counting)
        # 8 samples, train.batch_size 4: two optimizer steps per rollout, so the old-log-prob pass runs too
        args = rl_args(moe_dir, out, "--reward.remote_url", reward, "--algo.kl.init_coef", "0", *extra, steps=2)
        code = main(args)
    return code, calls


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_grpo_on_an_moe_model_replays_the_rollout_routing(moe_dir, tmp_path, monkeypatch, packed):
    reward = str(write_reward(tmp_path / "r.py"))
    extra = ["--ds.packing_samples"] if packed else []
    code, calls = _run(moe_dir, tmp_path / "replay", reward, monkeypatch, "--train.routing_replay", *extra)
    assert code == 0
    # the start-up check, then per rollout: the old-log-prob pass (one micro-batch of 8) + two optimizer
    # steps x 2 micro-batches of 2
    assert calls["replayed"] == 1 + 2 * (1 + 2 * 2)
    assert calls["tokens"] > 0
    gap = per_step(tmp_path / "replay", "rollout/logprob_diff_rollout_vs_train")
    assert gap.keys() == {1, 2} and all(v < 1e-4 for v in gap.values())  # same fp32 weights and routing
    code, calls = _run(moe_dir, tmp_path / "free", reward, monkeypatch, *extra)
    assert code == 0 and calls["replayed"] == 0


def _exit_code(args) -> int:
    with pytest.raises(SystemExit) as stop:
        main(args)
    return stop.value.code


def test_routing_replay_refuses_a_dense_model_and_gradient_checkpointing(tiny_model_dir, moe_dir, tmp_path, capsys):
    reward = str(write_reward(tmp_path / "r.py"))
    assert _exit_code(rl_args(tiny_model_dir, tmp_path / "dense", "--reward.remote_url", reward,
                              "--train.routing_replay")) == 2
    err = capsys.readouterr().err
    assert "--train.routing_replay" in err and "no MoE router" in err
    assert _exit_code(rl_args(moe_dir, tmp_path / "ckpt", "--reward.remote_url", reward, "--train.routing_replay",
                              "--actor.gradient_checkpointing_enable")) == 2
    assert "gradient_checkpointing_enable" in capsys.readouterr().err
