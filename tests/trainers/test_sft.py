"""SFT end to end through the real CLI on a tiny local model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli.train_sft import main as sft_main
from tests.trainers.sft_helpers import losses, sft_args, write_sft_data

ROOT = Path(__file__).parents[2]


def test_sft_trains_exports_and_reloads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_sft_data(tmp_path / "train.jsonl")
    out = tmp_path / "out"
    args = sft_args(tiny_model_dir, data, out, "--train.max_epochs", "3", "--eval.dataset", str(data),
                    "--eval.steps", "3", "--logger.tensorboard_dir", str(tmp_path / "tb"))
    assert sft_main(args) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 6  # 18 steps (6/epoch x 3), eval every 3
    assert evals[-1] < evals[0] - 0.5  # it learns the data
    assert all(k in records[0] for k in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # parameters changed, and the export reloads and generates
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)
    assert (out / "chat_template.jinja").is_file() and (out / "config.yaml").is_file()
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


def test_packed_padded_and_token_budget_give_the_same_losses(tiny_model_dir, tmp_path):
    data = write_sft_data(tmp_path / "train.jsonl", n=24)
    runs = {
        "padded": [],
        "packed": ["--ds.packing_samples"],
        "budget": ["--ds.packing_samples", "--train.max_tokens_per_device", "80"],
    }
    result = {}
    for name, extra in runs.items():
        out = tmp_path / name
        assert sft_main(sft_args(tiny_model_dir, data, out, "--ds.attn_implementation", "eager", *extra)) == 0
        result[name] = losses(out)
    assert len(result["padded"]) == 3
    for name in ("packed", "budget"):
        for step, value in result["padded"].items():
            assert result[name][step] == pytest.approx(value, abs=1e-5), (name, step)


def test_gradient_checkpointing_gives_the_same_losses(tiny_model_dir, tmp_path):
    data = write_sft_data(tmp_path / "train.jsonl", n=16)
    plain, ckpt = tmp_path / "plain", tmp_path / "gc"
    assert sft_main(sft_args(tiny_model_dir, data, plain)) == 0
    assert sft_main(sft_args(tiny_model_dir, data, ckpt, "--model.gradient_checkpointing_enable")) == 0
    a, b = losses(plain), losses(ckpt)
    assert len(a) == 2
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5)


def _run_cli(args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlhforge.cli.train_sft", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_resume_in_a_new_process_continues_the_same_curve(tiny_model_dir, tmp_path):
    import shutil

    data = write_sft_data(tmp_path / "train.jsonl", n=48)
    common = ["--train.max_epochs", "2", "--ckpt.save_steps", "5", "--ckpt.max_num", "2"]  # 12 steps, 6/epoch
    straight = tmp_path / "straight"
    assert sft_main(sft_args(tiny_model_dir, data, straight, *common)) == 0
    # rotation kept ckpt.max_num = 2 checkpoints: steps 10 and 12 (5 was removed)
    assert sorted(p.name for p in (straight / "ckpts").glob("step_*")) == ["step_10", "step_12"]
    # An interrupted run: the same run directory as it stood after the checkpoint at step 10 (and two
    # more logged steps that the crash lost); resume it in a new process.
    split = tmp_path / "split"
    shutil.copytree(straight, split)
    shutil.rmtree(split / "ckpts" / "step_12")
    (split / "ckpts" / "latest").write_text("step_10")
    args = sft_args(tiny_model_dir, data, split, *common, "--ckpt.load_enable")
    args[args.index("--ckpt.path") + 1] = str(split / "ckpts")
    second = _run_cli(args)
    assert second.returncode == 0, second.stderr[-3000:]
    # mid-epoch: step 10 is step 4 of epoch 2's 6; the line says exactly what is next
    assert (f"resuming from {split / 'ckpts' / 'step_10'}: steps 1-10 of 12 are done; next is step 11 (epoch 2, "
            "step 5 of 6 in it)") in second.stdout
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in (11, 12):
        assert b[step] == pytest.approx(a[step], abs=1e-5), step
    # the two steps after the checkpoint from the first run were moved aside, not lost
    discarded = (split / "metrics.discarded.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in discarded] == [11, 12]


def test_resume_across_an_epoch_boundary(tiny_model_dir, tmp_path):
    import shutil

    data = write_sft_data(tmp_path / "train.jsonl", n=48)
    common = ["--train.max_epochs", "2", "--ckpt.save_steps", "4"]
    straight = tmp_path / "straight"
    assert sft_main(sft_args(tiny_model_dir, data, straight, *common)) == 0
    split = tmp_path / "split"
    shutil.copytree(straight, split)
    for later in ("step_8", "step_12"):
        shutil.rmtree(split / "ckpts" / later)
    (split / "ckpts" / "latest").write_text("step_4")
    args = sft_args(tiny_model_dir, data, split, *common, "--ckpt.load_enable")
    args[args.index("--ckpt.path") + 1] = str(split / "ckpts")
    assert sft_main(args) == 0  # in-process resume: the RNG and data position come from the checkpoint
    a, b = losses(straight), losses(split)
    for step in range(5, 13):  # crosses the epoch boundary at step 6
        assert b[step] == pytest.approx(a[step], abs=1e-5), step


def test_bad_record_is_named_and_nothing_is_written(tiny_model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n{"input": "c"}\n')
    out = tmp_path / "out"
    proc = _run_cli(sft_args(tiny_model_dir, data, out))
    assert proc.returncode == 2
    assert "bad.jsonl" in proc.stderr and "record 1" in proc.stderr and "'output'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "model.safetensors").exists()


def test_lora_adapter_and_merge(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhforge.cli.lora_combiner import main as merge_main

    data = write_sft_data(tmp_path / "train.jsonl", n=16)
    out = tmp_path / "lora"
    assert sft_main(sft_args(tiny_model_dir, data, out, "--ds.lora.rank", "4", "--ds.lora.alpha", "8",
                             "--adam.lr", "1e-2")) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    merged = tmp_path / "merged"
    assert merge_main(["--model_path", str(tiny_model_dir), "--lora_path", str(out), "--output_path", str(merged)]) == 0
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        a, b, c = peft_model(ids).logits, plain(ids).logits, base(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (a - c).abs().max() > 1e-3  # the adapter learned something


def test_python_m_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "rlhforge.cli.train_sft", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 0
    for flag in ("--model.model_name_or_path", "--data.input_key", "--train.micro_batch_size", "--ckpt.save_steps",
                 "--ds.zero_stage", "--optim.adam.lr"):
        assert flag in proc.stdout, flag
