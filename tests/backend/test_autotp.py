"""--ds.tensor_parallel_size: DeepSpeed AutoTP on 2 gloo ranks (tensor-parallel 2, data-parallel 1)
gives the 1-rank loss and gradients, and the same weights after two optimizer steps; the sft, dpo and
rm commands under torchrun with --ds.tensor_parallel_size 2 match one rank (ZeRO-1 there)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.backend.autotp import autotp_ds_config, check_tp_size, tp_layout
from tests.torchrun import free_port, run_torchrun

WORKER = Path(__file__).with_name("autotp_worker.py")


def _run(model_dir, out, nproc, specs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    args = [str(WORKER), str(model_dir), str(out), *specs]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *args] if nproc > 1 else [sys.executable, *args])
    proc = run_torchrun(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_two_rank_autotp_equals_one_rank(tiny_model_dir, tmp_path):
    one = _run(tiny_model_dir, tmp_path / "one.pt", 1, ["0:1"])
    two = _run(tiny_model_dir, tmp_path / "two.pt", 2, ["0:2"])
    ref, tp = one["0:1"], two["0:2"]
    assert tp["dp"] == (0, 1) and tp["grad_accum"] == 4  # 8 samples / (2 per micro-batch x 1 data-parallel rank)
    # the decoder's linear layers are split in two (column-parallel q/k/v/gate/up, row-parallel o/down)
    full, local = ref["local_shapes"], tp["local_shapes"]
    split = {n for n in full if full[n] != local[n]}
    assert split and all(any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj")) for n in split)
    for n in split:
        assert sorted(a // b for a, b in zip(full[n], local[n])) == [1, 2], n
    assert 3.0 < ref["losses"][0] < 10.0
    for spec_one, spec_two in (("0:1", "0:2"),):
        assert two[spec_two]["losses"] == pytest.approx(one[spec_one]["losses"], rel=1e-5), spec_two
        for name, value in one[spec_one]["state"].items():  # gathered by the strategy (HF export / weight sync)
            # Adam's m / sqrt(v) turns the ~1e-8 gradient differences of near-zero gradient entries into
            # up to ~1e-5 of a 1e-3 step: the weights agree to 3e-5, the losses and gradients much closer
            torch.testing.assert_close(two[spec_two]["state"][name], value, rtol=0, atol=3e-5,
                                       msg=f"{spec_two} {name}")
        assert set(two[spec_two]["state"]) == set(one[spec_one]["state"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(tp["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_layout_arithmetic():
    assert autotp_ds_config(4) == {"autotp_size": 4, "vocab_parallel_lm_head": False}
    assert [tp_layout(r, 8, 2) for r in range(8)] == [(0, 4), (0, 4), (1, 4), (1, 4), (2, 4), (2, 4), (3, 4), (3, 4)]
    with pytest.raises(ValueError, match="must divide the 6 training ranks"):
        check_tp_size(4, 6, 1)
    with pytest.raises(ValueError, match="ZeRO stages 0-2"):
        check_tp_size(2, 2, 3)
    check_tp_size(2, 4, 2)


@pytest.mark.slow
def test_sft_cli_with_autotp_on_two_ranks_matches_one(tiny_model_dir, tmp_path):
    """--ds.tensor_parallel_size 2 through the real SFT command (torchrun, 2 gloo ranks = 1 data-parallel
    x 2 tensor-parallel): the loss curve, gradient norms and exported weights equal one DeepSpeed rank."""
    import json

    from safetensors.torch import load_file

    from rlhforge.cli.train_sft import main as sft_main
    from tests.trainers.sft_helpers import losses, sft_args, write_sft_data

    data = write_sft_data(tmp_path / "train.jsonl", n=16)
    common = ["--train.micro_batch_size", "4", "--ds.strategy", "deepspeed", "--ds.zero_stage", "1"]
    single = tmp_path / "single"
    assert sft_main(sft_args(tiny_model_dir, data, single, *common)) == 0
    tp = tmp_path / "tp"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_sft",
           *sft_args(tiny_model_dir, data, tp, *common, "--ds.tensor_parallel_size", "2")]
    proc = run_torchrun(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    a, b = losses(single), losses(tp)
    assert sorted(a) == sorted(b) and len(a) >= 2 and a[1] > 1.0
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    norms = [{r["step"]: r["train/grad_norm"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "train/grad_norm" in r} for d in (single, tp)]
    assert norms[1][1] == pytest.approx(norms[0][1], rel=1e-5)
    tokens = [{r["step"]: r["train/tokens"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
               if "train/tokens" in r} for d in (single, tp)]
    assert tokens[0] == tokens[1]  # each token counted once, not once per tensor-parallel rank
    w1, w2 = load_file(single / "model.safetensors"), load_file(tp / "model.safetensors")
    assert w1.keys() == w2.keys()
    for name in w1:  # the export gathers the split layers; Adam steps of ~1e-3 leave float noise far below
        assert w2[name].shape == w1[name].shape, name
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5, msg=name)


PAIRS = ["--data.dataset", "builtin:arithmetic_preference?n=32", "--eval.dataset",
         "builtin:arithmetic_preference?n=8@test", "--data.prompt_key", "prompt", "--train.batch_size", "8",
         "--train.micro_batch_size", "4", "--ds.strategy", "deepspeed", "--ds.zero_stage", "1",
         "--logger.progress_bar", "off", "--train.max_steps", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("command, lr", [("train_dpo", "5e-3"), ("train_rm", "2e-3")], ids=["dpo", "rm"])
def test_preference_cli_with_autotp_on_two_ranks_matches_one(tiny_model_dir, tmp_path, command, lr):
    """dpo (separate reference model) and rm with --ds.tensor_parallel_size 2 on 2 ranks: per-step loss,
    accuracy, pair counts and the eval loss equal one DeepSpeed rank."""
    import importlib
    import json

    main = importlib.import_module(f"rlhforge.cli.{command}").main
    base = ["--model.model_name_or_path", str(tiny_model_dir), *PAIRS, "--adam.lr", lr, "--eval.steps", "2"]
    single, tp = tmp_path / "single", tmp_path / "tp"
    assert main([*base, "--ckpt.output_dir", str(single)]) == 0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", f"rlhforge.cli.{command}", *base, "--ckpt.output_dir", str(tp),
           "--ds.tensor_parallel_size", "2"]
    proc = run_torchrun(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    def rows(d):
        return {(r["step"], k): v for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                for k, v in r.items() if k in ("train/loss", "train/acc", "train/pairs", "eval/loss", "eval/pairs")}

    a, b = rows(single), rows(tp)
    assert a.keys() == b.keys() and (2, "eval/loss") in a and a[(1, "train/pairs")] == 8
    if command == "train_dpo":  # step 1: policy = reference, every margin is 0 up to float noise (acc = ties)
        a = {k: v for k, v in a.items() if k[1] != "train/acc"}
    for key, value in a.items():
        assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
