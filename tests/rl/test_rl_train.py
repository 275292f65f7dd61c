"""RL end to end through the real CLI on a tiny model: every estimator and loss type, resume, failures."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli.train_ppo_ray import main as rl_main
from tests.rl.helpers import metrics, per_step, rl_args, write_reward

ROOT = Path(__file__).parents[2]

CASES = {
    "gae": ["--algo.kl.init_coef", "0.05", "--algo.kl.target", "0.01", "--critic.value_clip", "0.2",
            "--critic.freezing_steps", "1", "--critic.save_value_network", "--ds.packing_samples",
            "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "4"],
    "reinforce": ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.entropy_coef", "0.01"],
    "reinforce_baseline": ["--actor.dual_clip", "3", "--actor.eps_clip_low_high", "0.2", "0.28",
                           "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip"],
    "rloo": ["--algo.kl.init_coef", "0", "--reward.stop_properly_penalty_coef", "0.5"],
    "group_norm": ["--actor.policy_loss_type", "gspo", "--actor.eps_clip_low_high", "3e-4", "4e-4",
                   "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "0.99"],
    "dr_grpo": ["--reward.overlong_buffer_len", "2", "--train.max_epochs", "2", "--reward.clip_range", "-1", "1"],
    "flash_reinforce": ["--algo.kl.init_coef", "0"],
}


@pytest.mark.parametrize("estimator", list(CASES))
def test_every_estimator_trains_end_to_end(tiny_model_dir, tmp_path, estimator):
    from transformers import AutoModelForCausalLM

    reward = write_reward(tmp_path / "reward.py")
    out = tmp_path / "run"
    args = rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--ckpt.save_steps", "1",
                   *CASES[estimator], estimator=estimator)
    assert rl_main(args) == 0
    recs = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for key in ("rollout/reward_mean", "rollout/response_length", "rollout/truncated_frac", "timing/generation",
                "timing/ppo_train", "perf/tokens_per_s", "rollout/resp_chars"):
        assert key in recs[0], key
    if estimator == "gae":
        assert recs[0]["actor/frozen"] == 1.0 and recs[1]["actor/frozen"] == 0.0  # critic warm-up
        assert "critic/value_loss" in recs[0] and "actor/kl_ref" in recs[0]
        assert recs[1]["rollout/kl_coef"] != 0.05  # adaptive controller moved
        assert (out / "critic" / "model.safetensors").is_file()
    else:
        assert "actor/policy_loss" in recs[0] and "actor/entropy" in recs[0]
    if estimator == "reinforce":
        assert "actor/kl_loss" in recs[0]
    if estimator == "group_norm":
        assert 0 < recs[0]["rollout/filter_pass_rate"] <= 1
    # parameters changed, the export reloads, checkpoints exist
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    AutoModelForCausalLM.from_pretrained(out)
    assert (out / "ckpts" / "step_2" / "trainer_state.json").is_file()
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {"prompt", "response", "reward", "finish_reason"} <= set(samples[0])


def test_checkpoints_rotate_by_disk_budget(tiny_model_dir, tmp_path):
    """--ckpt.max_mem (GB): the oldest resumable checkpoints go while the total exceeds the budget; the
    newest always stays. A budget of ~1 byte keeps only the newest; no budget keeps every one."""
    reward = write_reward(tmp_path / "reward.py")
    for name, extra, kept in (("tight", ["--ckpt.max_mem", "1e-9"], ["step_3"]),
                              ("none", [], ["step_1", "step_2", "step_3"])):
        out = tmp_path / name
        assert rl_main(rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--ckpt.save_steps", "1",
                               "--ckpt.max_num", "5", *extra, steps=3)) == 0
        assert sorted(p.name for p in (out / "ckpts").glob("step_*")) == kept


def test_resume_matches_the_straight_run(tiny_model_dir, tmp_path):
    """4 steps straight vs 2 steps, stop, resume in a new process, 2 more: identical per-step numbers."""
    reward = write_reward(tmp_path / "reward.py")
    extra = ["--reward.remote_url", reward, "--ckpt.save_steps", "2", "--ckpt.max_num", "5",
             "--algo.kl.init_coef", "0.05", "--algo.kl.target", "0.01", "--rollout.n_samples_per_prompt", "1"]
    straight = tmp_path / "straight"
    assert rl_main(rl_args(tiny_model_dir, straight, *extra, estimator="gae", steps=4)) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "ckpts" / "step_4")
    (resumed / "ckpts" / "latest").write_text("step_2")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlhforge.cli.train_ppo_ray",
           *rl_args(tiny_model_dir, resumed, *extra, "--ckpt.load_enable", estimator="gae", steps=4)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"resuming from {resumed / 'ckpts' / 'step_2'}: steps 1-2 of 4 are done; next is step 3; prompts "
            "continue at stream position") in proc.stdout
    for key in ("rollout/reward_mean", "actor/policy_loss", "critic/value_loss", "rollout/kl_coef", "actor/grad_norm"):
        a, b = per_step(straight, key), per_step(resumed, key)
        assert sorted(b) == [1, 2, 3, 4], key
        for step in (3, 4):
            assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-9), (key, step)
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


FAILING = {
    "raises": "    raise RuntimeError('judge unavailable')",
    "wrong_length": "    return {'rewards': [1.0]}",
    "nan": "    return {'rewards': [float('nan')] * len(queries)}",
}


@pytest.mark.parametrize("mode", list(FAILING))
def test_failing_reward_stops_the_run_and_keeps_the_checkpoint(tiny_model_dir, tmp_path, capsys, mode):
    state = tmp_path / "calls"
    body = (
        "from pathlib import Path\n"
        "def reward_func(queries, prompts, labels):\n"
        f"    p = Path({str(state)!r}); n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1))\n"
        "    if n == 0:\n        return {'rewards': [0.5 * (i % 2) for i in range(len(queries))]}\n"
        f"{FAILING[mode]}\n"
    )
    reward = write_reward(tmp_path / "judge.py", body)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        rl_main(rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--ckpt.save_steps", "1", steps=3))
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert f"reward_func in {reward}" in err
    assert {"raises": "judge unavailable", "wrong_length": "returned 1 rewards for 8 samples",
            "nan": "rewards[0] = nan for sample 0 (prompt+response"}[mode] in err
    ckpts = out / "ckpts"
    assert (ckpts / "latest").read_text() == "step_1"
    assert (ckpts / "step_1" / "trainer_state.json").is_file()
    assert [r["step"] for r in metrics(out)] == [1]
