"""SFT of a tiny Qwen2-VL on coloured-shape images through the real CLI (docs/vlm.md)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli.train_sft import main as sft_main
from tests.vlm_helpers import write_colour_data
from tests.torchrun import free_port, run_torchrun

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    from rlhforge.models.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    return {arch: build_tiny_vlm(root / arch, arch=arch, seed=0) for arch in ("qwen2_vl", "qwen2_5_vl")}


@pytest.fixture(scope="module")
def tiny_vlm_dir(vlm_dirs):
    return vlm_dirs["qwen2_vl"]


def _args(model, data, out, *extra):
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data), "--data.input_key", "messages",
            "--data.apply_chat_template", "--data.max_len", "96", "--data.max_images_per_prompt", "1",
            "--train.batch_size", "6", "--train.micro_batch_size", "3", "--train.max_epochs", "4",
            "--adam.lr", "1e-2", "--lr_warmup_ratio", "0", "--ds.param_dtype", "fp32",
            "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "ckpts"), *extra]


@pytest.mark.parametrize("arch, model_class", [("qwen2_vl", "Qwen2VLForConditionalGeneration"),
                                               ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")])
def test_vlm_sft_learns_keeps_the_frozen_tower_and_reloads(vlm_dirs, arch, model_class, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from rlhforge.models.vlm import load_processor, vision_tower

    tiny_vlm_dir = vlm_dirs[arch]
    data = write_colour_data(tmp_path / "data", n=12)
    out = tmp_path / "out"
    assert sft_main(_args(tiny_vlm_dir, data, out, "--model.freeze_visual_encoder")) == 0
    losses = [json.loads(x)["train/loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in json.loads(x)]
    assert len(losses) == 8  # 12 samples / 6 per step x 4 epochs
    assert losses[-1] < losses[0] * 0.5, losses  # it learns the colour names
    before, after = load_file(tiny_vlm_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) <= set(after)  # (the export also names the tied lm_head)
    tower = [k for k in before if k.startswith(("visual.", "model.visual."))]  # saved names: visual.*, model.*
    assert len(tower) > 10 and all(torch.equal(before[k], after[k]) for k in tower)  # bit-identical
    text = [k for k in before if k not in tower]
    assert all(not torch.equal(before[k], after[k]) for k in text)  # every language-model tensor trained
    # the export reloads with from_pretrained and its processor files
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                 "chat_template.jinja", "tokenizer.json"):
        assert (out / name).is_file(), name
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == model_class
    assert AutoImageProcessor.from_pretrained(out).merge_size == 2
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    original = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    pairs = list(zip(vision_tower(original).state_dict().values(), vision_tower(model).state_dict().values()))
    assert len(pairs) == len(tower) and all(torch.equal(a, b) for a, b in pairs)
    assert load_processor(str(out)).image_token_id == model.config.image_token_id


def _exit_code(args) -> int:
    with pytest.raises(SystemExit) as info:
        sft_main(args)
    return info.value.code


def test_vlm_sft_refuses_what_it_cannot_do(tiny_vlm_dir, tiny_model_dir, tmp_path, capsys):
    data = write_colour_data(tmp_path / "data", n=3)
    # a text model with --model.freeze_visual_encoder; a VLM without the chat template
    assert _exit_code(_args(tiny_model_dir, data, tmp_path / "a", "--model.freeze_visual_encoder")) == 2
    assert "is not a vision-language model" in capsys.readouterr().err
    args = _args(tiny_vlm_dir, data, tmp_path / "b")
    args.remove("--data.apply_chat_template")
    assert _exit_code(args) == 2
    assert "--data.apply_chat_template" in capsys.readouterr().err
    # too many images: the error names file, record and field
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    rows[2]["images"] = ["img/0.png", "img/1.png"]
    rows[2]["messages"][0]["content"] = "<image><image>Which?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _exit_code(_args(tiny_vlm_dir, data, tmp_path / "c")) == 2
    err = capsys.readouterr().err
    assert f"{data}, record 2, field 'images': has 2 images, more than --data.max_images_per_prompt 1" in err, err


def _write_preferences(folder, n=9):
    """Pairs "<image>What colour is the shape?": chosen = the colour, rejected = a refusal."""
    rows = [json.loads(x) for x in write_colour_data(folder, n=n).read_text().splitlines()]
    pairs = [{"prompt": row["messages"][0]["content"], "chosen": row["messages"][1]["content"],
              "rejected": "I do not know", "images": row["images"]} for row in rows]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


def test_vlm_dpo_learns_the_preference_with_a_frozen_tower(tiny_vlm_dir, tmp_path):
    from rlhforge.cli.train_dpo import main as dpo_main
    from rlhforge.tracking.metrics import read_metrics

    data = _write_preferences(tmp_path / "data")
    out = tmp_path / "dpo"
    args = ["--model.model_name_or_path", str(tiny_vlm_dir), "--data.dataset", str(data), "--data.prompt_key", "prompt",
            "--data.apply_chat_template", "--data.max_len", "96", "--train.batch_size", "9",
            "--train.micro_batch_size", "3", "--train.max_epochs", "6", "--adam.lr", "1e-2", "--lr_warmup_ratio", "0",
            "--ds.param_dtype", "fp32", "--model.beta", "0.5", "--model.freeze_visual_encoder",
            "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "ckpts")]
    assert dpo_main(args) == 0
    rows = [r for r in read_metrics(out) if "train/loss" in r]
    assert len(rows) == 6
    assert rows[0]["train/loss"] == pytest.approx(0.6931472, abs=1e-5)  # policy == reference at step 1
    assert rows[-1]["train/loss"] < 0.3 and rows[-1]["train/acc"] == 1.0, rows[-1]
    before, after = load_file(tiny_vlm_dir / "model.safetensors"), load_file(out / "model.safetensors")
    tower = [k for k in before if k.startswith(("visual.", "model.visual."))]
    assert len(tower) > 10 and all(torch.equal(before[k], after[k]) for k in tower)
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])


@pytest.mark.slow
def test_vlm_sft_zero3_two_processes_matches_one(tiny_vlm_dir, tmp_path):
    """DeepSpeed ZeRO-3 on 2 CPU processes: the same losses as one process, the frozen (sharded) tower
    bit-identical, the same weights to float tolerance."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    data = write_colour_data(tmp_path / "data", n=12)
    single, dist = tmp_path / "single", tmp_path / "zero3"
    common = ["--train.max_epochs", "1", "--logger.logging_steps", "1", "--model.freeze_visual_encoder"]
    assert sft_main(_args(tiny_vlm_dir, data, single, *common)) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_sft",
           *_args(tiny_vlm_dir, data, dist, *common, "--ds.strategy", "deepspeed", "--ds.zero_stage", "3")]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = run_torchrun(cmd, env=env, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    def losses(run):
        return [json.loads(x)["train/loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = losses(single), losses(dist)
    assert len(a) == 2 and b == pytest.approx(a, rel=1e-5)
    before, one, two = (load_file(d / "model.safetensors") for d in (tiny_vlm_dir, single, dist))
    tower = [k for k in before if k.startswith(("visual.", "model.visual."))]
    assert tower and all(torch.equal(before[k], two[k]) for k in tower)
    assert max((one[k] - two[k]).abs().max().item() for k in before) < 1e-4


def test_vlm_gradient_checkpointing_gives_the_same_losses(tiny_vlm_dir, tmp_path):
    data = write_colour_data(tmp_path / "data", n=12)
    runs = {}
    for name, extra in (("plain", []), ("gc", ["--model.gradient_checkpointing_enable"])):
        out = tmp_path / name
        assert sft_main(_args(tiny_vlm_dir, data, out, "--train.max_epochs", "1", "--logger.logging_steps", "1",
                              *extra)) == 0
        runs[name] = [json.loads(x)["train/loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["plain"]) == 2 and runs["gc"] == pytest.approx(runs["plain"], abs=1e-5)
