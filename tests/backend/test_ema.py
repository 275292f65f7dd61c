"""EMA of the actor (``--train.enable_ema``, ``--train.ema_beta``): hand-computed values, sharded
(ZeRO-3 / FSDP2, 2 ranks) updates and export, and the RL CLI: exports are the EMA, resume equals the
uninterrupted run."""

import os
import socket
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.backend.ema import ParamEMA, ema_update_
from tests.torchrun import run_torchrun

ROOT = Path(__file__).parents[2]
WORKER = Path(__file__).with_name("ema_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _toy():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([4.0]))
    model.bias.requires_grad_(False)  # frozen: not averaged
    return model


def test_two_steps_by_hand_swap_and_restore(tmp_path):
    model = _toy()
    ema = ParamEMA(model, beta=0.5)
    assert list(ema.shadow) == ["weight"]
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 4.0]]))
    ema.update()  # 0.5 * [1, 2] + 0.5 * [3, 4] = [2, 3]
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[2.0, 3.0]]))
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[5.0, 0.0]]))
    ema.update()  # 0.5 * [2, 3] + 0.5 * [5, 0] = [3.5, 1.5]
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[3.5, 1.5]]))
    with ema.swapped():
        torch.testing.assert_close(model.weight.detach(), torch.tensor([[3.5, 1.5]]))
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[5.0, 0.0]]))  # live weights back
    # beta 0.992 (OpenRLHF's default) on one value: 0.992 * 2 + 0.008 * 7 = 2.04
    t = torch.tensor([2.0])
    ema_update_(t, torch.tensor([7.0]), 0.992)
    assert t.item() == pytest.approx(2.04, abs=1e-6)
    # resume: the state written by save() is what load() restores
    ema.save(tmp_path)
    other = ParamEMA(_toy(), beta=0.5)
    other.load(tmp_path)
    torch.testing.assert_close(other.shadow["weight"], torch.tensor([[3.5, 1.5]]))
    with pytest.raises(FileNotFoundError, match="ema_rank1.pt"):
        ParamEMA(_toy(), beta=0.5, rank=1).load(tmp_path)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ParamEMA(_toy(), beta=1.0)


@pytest.mark.slow
def test_sharded_ema_on_two_ranks_exports_the_recomputed_average(tiny_model_dir, tmp_path):
    """Each rank averages its own ZeRO-3 partition / FSDP2 shard; the export (gathered through the strategy)
    equals the EMA recomputed from the full weights after every step, and the live weights come back."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(WORKER), str(tiny_model_dir), str(tmp_path), "0.5", "2",
           "fsdp2", "deepspeed:3"]
    proc = run_torchrun(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for spec in ("fsdp2", "deepspeed_3"):
        record = torch.load(tmp_path / spec / "live.pt", weights_only=False)
        ema = {k: v.clone() for k, v in record["init"].items()}
        for state in record["steps"]:
            ema = {k: 0.5 * ema[k] + 0.5 * state[k] for k in ema}
        exported = load_file(tmp_path / spec / "export" / "model.safetensors")
        assert len(exported) == 20  # every weight of the tiny Llama (the tied head once)
        for k, v in exported.items():
            torch.testing.assert_close(v, ema[k], rtol=0, atol=1e-7, msg=f"{spec}: {k}")
            torch.testing.assert_close(record["after_export"][k], record["steps"][-1][k], rtol=0, atol=0)
        moved = max(float((record["steps"][-1][k] - record["init"][k]).abs().max()) for k in exported)
        assert moved > 1e-3  # the weights did move, so the check above is not trivially true


def _ema_args(model_dir, out, *extra):
    from tests.rl.helpers import rl_args, write_reward

    reward = write_reward(Path(out).parent / "reward.py")  # varied rewards: non-zero advantages, weights move
    # one optimizer step per rollout (train.batch_size = 4 prompts x 2 samples), a checkpoint after each
    return rl_args(model_dir, out, "--reward.remote_url", reward, "--train.enable_ema", "--train.ema_beta", "0.5", "--train.batch_size", "8",
                   "--ckpt.save_steps", "1", "--ckpt.max_num", "5", "--algo.kl.init_coef", "0", *extra, steps=2)


def test_rl_cli_exports_the_ema_and_resume_matches_the_straight_run(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhforge.cli.train_ppo_ray import main as rl_main

    straight = tmp_path / "straight"
    assert rl_main(_ema_args(tiny_model_dir, straight)) == 0
    ckpt = straight / "ckpts"
    live = [load_file(tiny_model_dir / "model.safetensors")] + [
        torch.load(ckpt / f"step_{k}" / "torch_state.pt", weights_only=False)["model"] for k in (1, 2)]
    ema = [torch.load(ckpt / f"step_{k}" / "ema_rank0.pt", weights_only=True)["shadow"] for k in (1, 2)]
    names = list(ema[0])
    assert len(names) == 20 and "model.embed_tokens.weight" in names
    for k in names:  # the recursion, recomputed from the live weights each checkpoint holds
        torch.testing.assert_close(ema[0][k], 0.5 * live[0][k] + 0.5 * live[1][k], rtol=0, atol=1e-6)
        torch.testing.assert_close(ema[1][k], 0.5 * ema[0][k] + 0.5 * live[2][k], rtol=0, atol=1e-6)
    for a, b in ((live[0], live[1]), (live[1], live[2]), (live[2], ema[1])):  # weights moved; EMA != live
        assert max(float((a[k] - b[k]).abs().max()) for k in names) > 1e-4
    exported = AutoModelForCausalLM.from_pretrained(straight, dtype=torch.float32).state_dict()
    for k in names:
        torch.testing.assert_close(exported[k], ema[1][k], rtol=0, atol=0, msg=k)  # the export is the EMA

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "ckpts" / "step_2")
    (resumed / "ckpts" / "latest").write_text("step_1")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlhforge.cli.train_ppo_ray", *_ema_args(tiny_model_dir, resumed, "--ckpt.load_enable")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    ema_resumed = torch.load(resumed / "ckpts" / "step_2" / "ema_rank0.pt", weights_only=True)["shadow"]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in names:
        torch.testing.assert_close(ema_resumed[k], ema[1][k], rtol=0, atol=1e-6, msg=k)
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
