"""The third vision-language family, Qwen3-VL (``qwen3_vl``), on a tiny random model: the tiny-model CLI
and its processor files, samples equal to transformers' own Qwen3VLProcessor, and SFT / GRPO runs through
the CLIs (about 1 s each on the tiny model). Padded = per-sample log-probs: tests/models/test_vlm.py; the HF
engine's log-probs = the trainer's forward with the same pixels: tests/rl/test_vlm_rl.py (both parametrized
over the families)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.data.images import collate_vlm, place_images
from rlhforge.data.records import RecordRef
from rlhforge.data.vlm_sft import build_vlm_sft_samples
from rlhforge.models.forward import token_logprobs
from rlhforge.models.vlm import check_supported_vlm, is_vlm, load_processor, vision_tower
from tests.vlm_helpers import COLOURS, shape_image, write_colour_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCH = "qwen3_vl"
PATCH_DIM = 3 * 2 * 16 * 16  # channels x temporal patch x patch 16 x 16


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """The tiny Qwen3-VL, built by the ``rlhforge tiny-model`` CLI."""
    from rlhforge.cli.tiny_model import main as tiny_main

    out = tmp_path_factory.mktemp("qwen3_vl") / "model"
    assert tiny_main(["--out", str(out), "--arch", ARCH]) == 0
    return out


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return load_processor(str(vlm_dir))


@pytest.fixture(scope="module")
def model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(vlm_dir)).eval()


def _records():
    return [
        {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}],
         "images": [shape_image("red", size=(56, 56))]},
        {"messages": [{"role": "user", "content": "Two shapes: <image> and <image>"},
                      {"role": "assistant", "content": "blue then green"}],
         "images": [shape_image("blue", size=(28, 28), seed=1), shape_image("green", "circle", size=(28, 84), seed=2)]},
    ]


def test_tiny_model_cli_writes_a_loadable_qwen3_vl(vlm_dir, processor, model, tmp_path):
    cfg = model.config
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and is_vlm(str(vlm_dir))
    check_supported_vlm(str(vlm_dir))  # no error: a supported family
    text = cfg.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (64, 2, 32)
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2
    assert (cfg.vision_config.depth, cfg.vision_config.patch_size, cfg.vision_config.hidden_size) == (2, 16, 32)
    assert processor.image_token_id == cfg.image_token_id and processor.merge_size == 2
    assert processor.image_processor.patch_size == 16
    assert json.loads((vlm_dir / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], tokenize=False)
    assert rendered == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
    # same seed, same weights
    from rlhforge.models.tiny_vlm import build_tiny_vlm

    a = load_file(vlm_dir / "model.safetensors")
    b = load_file(build_tiny_vlm(tmp_path / "again", arch=ARCH, seed=0) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_samples_match_the_model_and_equal_the_hf_processor_output(processor, model, monkeypatch):
    """Independent reference: transformers' Qwen3VLProcessor on the rendered text (built from its parts:
    its video processor needs torchvision; only its class check is switched off, no video is processed)."""
    from transformers import ProcessorMixin, Qwen3VLProcessor

    samples = build_vlm_sft_samples(_records(), processor)
    # grids by hand: patch 16, sides rounded to multiples of 32: 56x56 -> 64x64 = 4x4 patches,
    # 28x28 -> 32x32 = 2x2, 28 wide x 84 high -> 32 x 96 = 6 rows x 2 columns
    assert samples[0].image_grid_thw.tolist() == [[1, 4, 4]]
    assert samples[1].image_grid_thw.tolist() == [[1, 2, 2], [1, 6, 2]]
    for s, reply, n in zip(samples, ["red", "blue then green"], [4, 1 + 3]):
        assert sum(t == processor.image_token_id for t in s.input_ids) == n
        assert s.pixel_values.shape == (4 * n, PATCH_DIM)
        with torch.no_grad():  # one feature (and one DeepStack feature) per image token
            out = model.model.get_image_features(s.pixel_values, s.image_grid_thw, return_dict=True)
        assert sum(f.shape[0] for f in out.pooler_output) == n
        assert len(out.deepstack_features) == 1 and sum(f.shape[0] for f in out.deepstack_features[0]) == n
        assert sum(s.loss_mask) == len(processor.tokenizer(reply)["input_ids"]) + 1  # the reply and <|im_end|>

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    hf = Qwen3VLProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                          video_processor=None, chat_template=processor.tokenizer.chat_template)
    for record, sample in zip(_records(), samples):
        messages = place_images(record["messages"], len(record["images"]), RecordRef("<dataset>", 0), "messages")
        ref = hf(text=[hf.apply_chat_template(messages, tokenize=False)], images=record["images"], return_tensors="pt")
        assert ref["input_ids"][0].tolist() == sample.input_ids
        assert torch.equal(ref["pixel_values"], sample.pixel_values)
        assert torch.equal(ref["image_grid_thw"], sample.image_grid_thw)
        assert ref["mm_token_type_ids"][0].tolist() == [int(t == processor.image_token_id) for t in sample.input_ids]


def _tower_keys(weights):
    return [k for k in weights if k.startswith(("model.visual.", "visual."))]


def test_sft_with_images_through_the_cli(vlm_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from rlhforge.cli.train_sft import main as sft_main

    data = write_colour_data(tmp_path / "data", n=12)
    out = tmp_path / "sft"
    args = ["--model.model_name_or_path", str(vlm_dir), "--data.dataset", str(data), "--data.input_key", "messages",
            "--data.apply_chat_template", "--data.max_len", "96", "--data.max_images_per_prompt", "1",
            "--train.batch_size", "6", "--train.micro_batch_size", "3", "--train.max_epochs", "4",
            "--adam.lr", "1e-2", "--lr_warmup_ratio", "0", "--ds.param_dtype", "fp32",
            "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "ckpts"), "--model.freeze_visual_encoder"]
    assert sft_main(args) == 0
    losses = [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] * 0.5, losses  # 12 samples / 6 x 4 epochs; it learns
    before, after = load_file(vlm_dir / "model.safetensors"), load_file(out / "model.safetensors")
    tower = _tower_keys(before)
    assert len(tower) > 10 and all(torch.equal(before[k], after[k]) for k in tower)  # frozen: bit-identical
    assert all(not torch.equal(before[k], after[k]) for k in before if k not in tower)
    assert type(AutoModelForImageTextToText.from_pretrained(out)).__name__ == "Qwen3VLForConditionalGeneration"
    assert load_processor(str(out)).image_processor.patch_size == 16


REWARD = '''
def reward_func(queries, prompts, labels, **kwargs):
    r = [float(l in resp) + (len(resp) % 3) / 4 for resp, l in zip(kwargs["responses"], labels)]
    return {"rewards": r, "scores": r}
'''


def test_grpo_with_images_through_the_cli(vlm_dir, tmp_path):
    from rlhforge.cli.train_ppo_ray import main as rl_main
    from tests.rl.helpers import per_step

    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    rows = []
    for i in range(8):
        colour = list(COLOURS)[i % 3]
        shape_image(colour, "square", (56, 56), seed=i).save(data / f"img/{i}.png")
        rows.append({"prompt": "<image>What colour is the shape?", "images": [f"img/{i}.png"], "answer": colour})
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "reward.py").write_text(REWARD)
    out = tmp_path / "rl"
    assert rl_main([
        "--actor.model_name_or_path", str(vlm_dir), "--data.prompt_dataset", str(data / "prompts.jsonl"),
        "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
        "--reward.remote_url", str(data / "reward.py"), "--rollout.batch_size", "4",
        "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "6", "--train.batch_size", "8",
        "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4", "--algo.advantage.estimator",
        "group_norm", "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0", "--train.max_steps", "2",
        "--ckpt.output_dir", str(out), "--train.seed", "3", "--actor.freeze_visual_encoder",
        "--data.max_images_per_prompt", "1"]) == 0
    gaps = per_step(out, "rollout/logprob_diff_rollout_vs_train")
    assert sorted(gaps) == [1, 2] and all(g < 1e-5 for g in gaps.values()), gaps  # measured ~2e-7
    assert abs(per_step(out, "actor/kl_ref")[2]) > 1e-5  # the reference ran and the policy moved
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert any("<|image_pad|>" * 4 in s["prompt"] for s in samples)  # 56x56 -> 4 image tokens
    before, after = load_file(vlm_dir / "model.safetensors"), load_file(out / "model.safetensors")
    tower = _tower_keys(before)
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert sum(not torch.equal(before[k], after[k]) for k in before if k not in tower) > 10


def test_preference_pairs_and_lora_on_the_language_model_only(vlm_dir, processor, model):
    """DPO batches: both sides of a pair carry its images (padded rows == each row alone); LoRA and the
    frozen tower leave the vision encoder (DeepStack mergers included) alone."""
    from rlhforge.config.components import DSConfig, LoraConfig, ModelConfig
    from rlhforge.data.vlm_preference import build_vlm_preference_samples, collate_vlm_pairs
    from rlhforge.models.vlm import language_model_lora_targets, load_vlm

    records = [{"prompt": "<image>Colour?", "chosen": "red", "rejected": "no idea", "images": [shape_image("red")]},
               {"prompt": "Which two?", "chosen": "blue and green", "rejected": "red",
                "images": [shape_image("blue", size=(28, 28)), shape_image("green", size=(28, 56))]}]
    pairs = build_vlm_preference_samples(records, processor, prompt_key="prompt")
    pad, image = processor.pad_token_id, processor.image_token_id
    batch = collate_vlm_pairs(pairs, pad, image)
    assert batch["image_grid_thw"].shape[0] == 6  # (1 + 2 images) x (chosen, rejected)
    with torch.no_grad():
        together = token_logprobs(model, batch)
        rows = [(p.chosen_ids, p.chosen_mask, p) for p in pairs] + [(p.rejected_ids, p.rejected_mask, p) for p in pairs]
        for row, (ids, mask, pair) in enumerate(rows):
            one = {"input_ids": ids, "loss_mask": mask, "pixel_values": pair.pixel_values,
                   "image_grid_thw": pair.image_grid_thw}
            alone = token_logprobs(model, collate_vlm([type("S", (), one)()], pad, image))
            assert torch.allclose(together[row, : len(ids)], alone[0], atol=1e-5, rtol=0)
    frozen = load_vlm(str(vlm_dir), ModelConfig(), DSConfig(), torch.device("cpu"), freeze_visual_encoder=True)
    tower = {id(p) for p in vision_tower(frozen).parameters()}
    assert any("deepstack" in n for n, _ in vision_tower(frozen).named_parameters())
    assert all(p.requires_grad == (id(p) not in tower) for p in frozen.parameters())
    assert len(language_model_lora_targets(frozen, ["q_proj", "v_proj"])) == 4  # 2 layers x (q, v)
    peft_model = load_vlm(str(vlm_dir), ModelConfig(), DSConfig(lora=LoraConfig(rank=4, alpha=8)), torch.device("cpu"))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)
