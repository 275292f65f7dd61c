"""Tiny VLMs (Qwen2-VL, Qwen2.5-VL): processor output vs the model's expectations, pixels reaching the
forward, padded log-probs vs per-sample and plain HF forwards, frozen tower, LoRA targets."""

import pytest
import torch

from rlhforge.config.components import DSConfig, LoraConfig, ModelConfig
from rlhforge.data.images import collate_vlm, place_images
from rlhforge.data.records import RecordRef
from rlhforge.data.vlm_sft import build_vlm_sft_samples
from rlhforge.models.forward import token_logprobs
from rlhforge.models.vlm import (freeze_vision_tower, is_vlm, language_model_lora_targets, load_processor, load_vlm,
                                 vision_tower, vlm_model_inputs)
from tests.vlm_helpers import shape_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCHS = ["qwen2_vl", "qwen2_5_vl"]
ALL_ARCHS = [*ARCHS, "qwen3_vl"]  # Qwen3-VL's own checks: tests/models/test_vlm_family3.py


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    from rlhforge.models.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {arch: build_tiny_vlm(root / arch, arch=arch, seed=0) for arch in ALL_ARCHS}


def _records():
    return [
        {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}],
         "images": [shape_image("red", size=(56, 56))]},
        {"messages": [{"role": "user", "content": "Two shapes: <image> and <image>"},
                      {"role": "assistant", "content": "blue then green"}],
         "images": [shape_image("blue", size=(28, 28), seed=1), shape_image("green", "circle", size=(28, 84), seed=2)]},
    ]


def _model(path, **kw):
    model = load_vlm(str(path), ModelConfig(), DSConfig(), torch.device("cpu"), **kw)
    return model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_processor_output_matches_the_model(vlm_dirs, arch):
    from transformers import AutoModelForImageTextToText

    path = vlm_dirs[arch]
    assert is_vlm(str(path))
    proc = load_processor(str(path))
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.config.text_config.hidden_size == 64 and model.config.text_config.num_hidden_layers == 2
    assert model.config.text_config.hidden_size // model.config.text_config.num_attention_heads == 32
    assert proc.image_token_id == model.config.image_token_id and proc.merge_size == 2
    samples = build_vlm_sft_samples(_records(), proc)
    # grids (t, h, w) by hand: patch 14, sides rounded to multiples of 28: 56x56 -> 4x4 patches, 28x28 -> 2x2,
    # 28 wide x 84 high -> 6x2
    assert samples[0].image_grid_thw.tolist() == [[1, 4, 4]]
    assert samples[1].image_grid_thw.tolist() == [[1, 2, 2], [1, 6, 2]]
    for s, reply in zip(samples, ["red", "blue then green"]):
        n_pad = sum(t == proc.image_token_id for t in s.input_ids)
        assert n_pad == int(s.image_grid_thw.prod(-1).sum()) // proc.merge_size ** 2  # 4; 1 + 3
        assert s.pixel_values.shape == (int(s.image_grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
        # the vision tower turns the pixels into exactly one feature per image token
        with torch.no_grad():
            features = model.model.get_image_features(s.pixel_values, s.image_grid_thw, return_dict=True)
        assert sum(f.shape[0] for f in features.pooler_output) == n_pad
        assert sum(s.loss_mask) == len(proc.tokenizer(reply)["input_ids"]) + 1  # the reply and <|im_end|>


def test_image_key_and_a_legacy_chat_template_file(vlm_dirs, tmp_path):
    import json
    import shutil

    proc = load_processor(str(vlm_dirs["qwen2_vl"]))
    renamed = [{"messages": r["messages"], "pics": r["images"]} for r in _records()]
    a, b = build_vlm_sft_samples(_records(), proc), build_vlm_sft_samples(renamed, proc, image_key="pics")
    assert [s.input_ids for s in a] == [s.input_ids for s in b]
    assert all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(a, b))
    # a folder whose chat template is only in the processor's chat_template.json (older exports)
    legacy = shutil.copytree(vlm_dirs["qwen2_vl"], tmp_path / "legacy")
    template = (legacy / "chat_template.jinja").read_text()
    (legacy / "chat_template.jinja").unlink()
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (legacy / "tokenizer_config.json").write_text(json.dumps(config))
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_processor(str(legacy)).tokenizer.chat_template == template


def test_text_models_are_not_vlms(tiny_model_dir):
    assert not is_vlm(str(tiny_model_dir))


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_padded_logprobs_equal_per_sample_and_plain_hf_forwards(vlm_dirs, arch):
    proc = load_processor(str(vlm_dirs[arch]))
    model = _model(vlm_dirs[arch])
    samples = build_vlm_sft_samples(_records(), proc)
    pad, image = proc.pad_token_id, proc.image_token_id
    seen = []
    hook = vision_tower(model).register_forward_hook(lambda m, args, out: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        batch = collate_vlm(samples, pad, image)
        assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"].sum(-1).tolist() == [len(s) for s in samples]
        together = token_logprobs(model, batch)
        assert len(seen) == 1 and torch.equal(seen[0], torch.cat([s.pixel_values for s in samples]))  # same pixels
        for row, s in enumerate(samples):
            alone = token_logprobs(model, collate_vlm([s], pad, image))[0]
            n = len(s)
            assert torch.allclose(together[row, :n], alone, atol=1e-5, rtol=0)
            assert torch.all(together[row, n:] == 0)
            # plain HF call, no attention mask, log-softmax by hand
            ids = torch.tensor([s.input_ids])
            logits = model(input_ids=ids, pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                           mm_token_type_ids=(ids == image).int(), use_cache=False).logits[0].float()
            ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert torch.allclose(alone[1:], ref, atol=1e-5, rtol=0) and alone[0] == 0
    hook.remove()
    # the pixels matter: other pixels change the tokens after the image, never those before it
    s = samples[0]
    first_image = s.input_ids.index(image)
    other = collate_vlm([s], pad, image)
    other["pixel_values"] = other["pixel_values"].flip(0)
    with torch.no_grad():
        a, b = token_logprobs(model, collate_vlm([s], pad, image))[0], token_logprobs(model, other)[0]
    assert torch.equal(a[: first_image + 1], b[: first_image + 1])
    assert (a[first_image + 1:] - b[first_image + 1:]).abs().max() > 1e-4


def test_packed_vlm_batches_are_refused(vlm_dirs):
    proc = load_processor(str(vlm_dirs["qwen2_vl"]))
    batch = collate_vlm(build_vlm_sft_samples(_records()[:1], proc), proc.pad_token_id, proc.image_token_id)
    batch["attention_mask"] = None
    with pytest.raises(ValueError, match="packing is not supported for VLMs"):
        vlm_model_inputs(None, batch)


def test_frozen_tower_and_lora_on_the_language_model_only(vlm_dirs):
    path = vlm_dirs["qwen2_vl"]
    model = _model(path, freeze_visual_encoder=True)
    tower = {id(p) for p in vision_tower(model).parameters()}
    assert len(tower) > 10
    assert all(not p.requires_grad for p in vision_tower(model).parameters())
    assert all(p.requires_grad for p in model.parameters() if id(p) not in tower)
    assert freeze_vision_tower(model) == sum(p.numel() for p in vision_tower(model).parameters())
    targets = language_model_lora_targets(model, ["all-linear"])
    assert targets and all(".language_model." in t for t in targets)
    assert len(language_model_lora_targets(model, ["q_proj", "v_proj"])) == 4  # 2 layers x (q, v)
    ds = DSConfig(lora=LoraConfig(rank=4, alpha=8))
    peft_model = load_vlm(str(path), ModelConfig(), ds, torch.device("cpu"))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)
    assert not any("lora_" in n for n, _ in vision_tower(peft_model).named_parameters())


def test_preference_pairs_carry_their_images_to_both_sides(vlm_dirs):
    from rlhforge.data.vlm_preference import build_vlm_preference_samples, collate_vlm_pairs

    proc = load_processor(str(vlm_dirs["qwen2_vl"]))
    model = _model(vlm_dirs["qwen2_vl"])
    records = [{"prompt": "<image>Colour?", "chosen": "red", "rejected": "no idea", "images": [shape_image("red")]},
               {"prompt": "Which two?", "chosen": "blue and green", "rejected": "red",
                "images": [shape_image("blue", size=(28, 28)), shape_image("green", size=(28, 56))]}]
    pairs = build_vlm_preference_samples(records, proc, prompt_key="prompt")
    for pair in pairs:  # the same expanded prompt on both sides
        assert pair.chosen_ids[: pair.prompt_len] == pair.rejected_ids[: pair.prompt_len]
        n_pad = sum(t == proc.image_token_id for t in pair.chosen_ids[: pair.prompt_len])
        assert n_pad == int(pair.image_grid_thw.prod(-1).sum()) // 4
    batch = collate_vlm_pairs(pairs, proc.pad_token_id, proc.image_token_id)
    assert batch["image_grid_thw"].shape[0] == 6  # (1 + 2 images) x (chosen, rejected)
    with torch.no_grad():
        together = token_logprobs(model, batch)
        rows = [(p.chosen_ids, p.chosen_mask, p) for p in pairs] + [(p.rejected_ids, p.rejected_mask, p) for p in pairs]
        for row, (ids, mask, pair) in enumerate(rows):
            one = {"input_ids": ids, "loss_mask": mask, "pixel_values": pair.pixel_values,
                   "image_grid_thw": pair.image_grid_thw}
            alone = token_logprobs(model, collate_vlm([type("S", (), one)()], proc.pad_token_id, proc.image_token_id))
            assert torch.allclose(together[row, : len(ids)], alone[0], atol=1e-5, rtol=0)


def test_tiny_model_cli_builds_the_same_vlm(vlm_dirs, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from rlhforge.cli.tiny_model import main as tiny_main

    assert tiny_main(["--out", str(tmp_path / "m"), "--arch", "qwen2_vl"]) == 0
    assert "qwen2_vl vision-language model" in capsys.readouterr().out
    a, b = load_file(vlm_dirs["qwen2_vl"] / "model.safetensors"), load_file(tmp_path / "m" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same seed, same weights
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "m")).__name__ == "Qwen2VLForConditionalGeneration"


@pytest.mark.parametrize("arch", ARCHS)
def test_samples_equal_the_hf_processor_output(vlm_dirs, arch, monkeypatch):
    """Independent reference: transformers' own Qwen2-VL / Qwen2.5-VL processor on the rendered text.
    It cannot be built here without torchvision (its video processor); only its class check is
    switched off for this test, and no video is processed."""
    import transformers
    from transformers import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    mine = load_processor(str(vlm_dirs[arch]))
    cls = getattr(transformers, {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[arch])
    hf = cls(image_processor=mine.image_processor, tokenizer=mine.tokenizer, video_processor=None,
             chat_template=mine.tokenizer.chat_template)
    for record in _records():
        sample = build_vlm_sft_samples([record], mine)[0]
        messages = place_images(record["messages"], len(record["images"]), RecordRef("<dataset>", 0), "messages")
        ref = hf(text=[hf.apply_chat_template(messages, tokenize=False)], images=record["images"], return_tensors="pt")
        assert ref["input_ids"][0].tolist() == sample.input_ids
        assert torch.equal(ref["pixel_values"], sample.pixel_values)
        assert torch.equal(ref["image_grid_thw"], sample.image_grid_thw)
        assert ref["mm_token_type_ids"][0].tolist() == [int(t == mine.image_token_id) for t in sample.input_ids]
