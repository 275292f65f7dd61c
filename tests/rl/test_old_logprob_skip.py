"""When a rollout feeds exactly one optimizer step and nothing reads pi_old first (no reference model,
no IS correction), the update uses its own forward's detached log-probs as pi_old and the separate
old-log-prob pass is skipped. The run equals the one that makes the pass, and the pass is really gone."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from rlhforge.workers.actor import ActorWorker
from rlhforge.trainers.rl import RLTrainer
from tests.rl.helpers import per_step, rl_args, write_reward

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(tiny_model_dir, out, reward, monkeypatch, skip: bool, *extra):
    calls = {"logprobs": 0}
    original = ActorWorker.logprobs

    def counting(self, samples, *a, **k):
        if any("rollout_logprobs" in s.tensors for s in samples):  # not the post-sync probe (no rollout)
            calls["logprobs"] += 1
        return original(self, samples, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(ActorWorker, "logprobs", counting)
        if not skip:  # the other path: decide "not equal" and make the pass
            m.setattr(RLTrainer, "_old_equals_update", lambda self, n: False)
        args = rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--train.batch_size", "8",
                       "--algo.kl.init_coef", "0", *extra, steps=2)
        assert main(args) == 0
    return calls["logprobs"]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_skipping_the_old_logprob_pass_changes_nothing(tiny_model_dir, tmp_path, monkeypatch, packed):
    reward = str(write_reward(tmp_path / "r.py"))
    extra = ["--ds.packing_samples"] if packed else []
    with_pass = _run(tiny_model_dir, tmp_path / "pass", reward, monkeypatch, False, *extra)
    skipped = _run(tiny_model_dir, tmp_path / "skip", reward, monkeypatch, True, *extra)
    assert with_pass == 2 and skipped == 0  # one experience pass per step, or none
    a, b = tmp_path / "pass", tmp_path / "skip"
    assert per_step(a, "rollout/reward_mean") == per_step(b, "rollout/reward_mean")
    for key in ("actor/policy_loss", "actor/grad_norm", "rollout/logprob_diff_rollout_vs_train", "rollout/vllm_kl"):
        pa, pb = per_step(a, key), per_step(b, key)
        assert pa.keys() == pb.keys() == {1, 2}, key
        for step in pa:
            assert pb[step] == pytest.approx(pa[step], rel=1e-5, abs=1e-6), (key, step)
    assert any(abs(v) > 1e-4 for v in per_step(a, "actor/grad_norm").values())


def test_the_pass_stays_when_an_epoch_has_two_optimizer_steps(tiny_model_dir, tmp_path, monkeypatch):
    reward = str(write_reward(tmp_path / "r.py"))
    calls = {"logprobs": 0}
    original = ActorWorker.logprobs

    def counting(self, samples, *a, **k):
        if any("rollout_logprobs" in s.tensors for s in samples):  # not the post-sync probe (no rollout)
            calls["logprobs"] += 1
        return original(self, samples, *a, **k)

    monkeypatch.setattr(ActorWorker, "logprobs", counting)
    # 4 prompts x 2 samples = 8 samples, train.batch_size 4: two optimizer steps, pi_old must be fixed first
    assert main(rl_args(tiny_model_dir, tmp_path / "two", "--reward.remote_url", reward, steps=1)) == 0
    assert calls["logprobs"] == 1
