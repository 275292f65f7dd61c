"""The VLM quick start (``rlhforge quickstart --task shape_colour``) runs end to end, shrunk, and its
greedy accuracies are recomputed independently with transformers' own ``generate`` on the pixels."""

import json

import pytest
import torch

from rlhforge.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _greedy_accuracy(model_dir, records) -> float:
    """transformers ``generate`` one image at a time (not rlhforge's engine), the processor's pixels."""
    from transformers import AutoModelForImageTextToText

    from rlhforge.data.builtin import check_answer
    from rlhforge.data.images import vision_batch
    from rlhforge.data.records import record_ref
    from rlhforge.data.vlm_prompts import vlm_prompt
    from rlhforge.models.vlm import load_processor

    proc = load_processor(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hits = 0
    for i, r in enumerate(records):
        _, ids, vision = vlm_prompt(r, proc, record_ref(r, i), input_key="prompt")
        ids_t = torch.tensor([ids])
        pixels = vision_batch(ids_t, [vision], proc.image_token_id)
        with torch.no_grad():
            out = model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=4,
                                 do_sample=False, eos_token_id=proc.eos_token_id, pad_token_id=proc.pad_token_id,
                                 **pixels)
        hits += check_answer("shape_colour", proc.decode(out[0, len(ids):], skip_special_tokens=True), r["answer"])
    return hits / len(records)


def test_vlm_quickstart_shrunk(tmp_path, capsys):
    from rlhforge.data.builtin import generate_builtin

    out = tmp_path / "qs"
    assert main(["quickstart", "--task", "shape_colour", "--out", str(out), "--sft_steps", "120", "--rl_steps", "3",
                 "--eval_size", "12", "--eval_samples", "2", "--train_records", "1920", "--rl_prompts", "4",
                 "--group_size", "4"]) == 0
    assert "quickstart (VLM)" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "shape_colour" and summary["n_eval"] == 12
    records = generate_builtin("shape_colour", "test", n=12, seed=0, colours=4)
    assert summary["accuracy_after_sft"] > 0  # the format was learned: answers are colour words
    assert summary["accuracy_after_sft"] == pytest.approx(_greedy_accuracy(out / "sft", records))
    assert summary["accuracy_after_rl"] == pytest.approx(_greedy_accuracy(out / "rl", records))
    assert (out / "report.md").read_text().startswith("# rlhforge quickstart (VLM)")
    # the RL stage trained on images: its samples' prompts hold image tokens
    rl_samples = [json.loads(x) for x in (out / "rl" / "samples.jsonl").read_text().splitlines()]
    assert all("<|image_pad|>" in s["prompt"] for s in rl_samples)
