"""Reward model end to end on a tiny model through the real CLI: it learns the built-in preference
task, exports an ``AutoModelForSequenceClassification`` folder with its reward statistics, packed
equals padded, LoRA exports a merged model, OpenRLHF's flags parse and bad ones fail clearly."""

from __future__ import annotations

import json

import pytest
import torch

from rlhforge.cli.main import main as rlhforge_main
from rlhforge.config.parsing import ConfigError, parse_args
from rlhforge.config.rm import RMConfig
from rlhforge.tracking.metrics import read_metrics
from tests.flag_tables import check_every_flag

DATA = ["--data.dataset", "builtin:arithmetic_preference?n=96", "--eval.dataset", "builtin:arithmetic_preference?n=32@test",
        "--data.prompt_key", "prompt", "--data.input_template", "Q: {}\nA: "]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rm_args(model_dir, out, *extra):
    return ["rm", "--model.model_name_or_path", str(model_dir), *DATA, "--train.batch_size", "16",
            "--train.micro_batch_size", "8", "--adam.lr", "2e-3", "--lr_warmup_ratio", "0", "--ckpt.output_dir", str(out),
            "--logger.progress_bar", "off", *extra]


@pytest.fixture(scope="module")
def trained_rm(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "run"
    assert rlhforge_main(rm_args(tiny_model_dir, out, "--train.max_steps", "5", "--eval.steps", "5")) == 0
    return out


def test_reward_model_learns_the_preference(trained_rm):
    rows = read_metrics(trained_rm)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["train/acc"] < 0.8  # the random head starts near chance
    final = rows[-1]
    assert final["eval/acc"] >= 0.9, final
    assert final["eval/reward_margin"] > 1.0 and final["eval/loss"] < rows[0]["train/loss"]
    for key in ("train/loss", "train/chosen_reward", "train/rejected_reward", "train/grad_norm", "eval/reward_mean",
                "eval/reward_std", "perf/pairs_per_s"):
        assert key in final


def test_export_reloads_as_sequence_classifier_with_stats(trained_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhforge.data.packing import collate_packed, collate_padded
    from rlhforge.models.reward import encode_reward_text, reward_stats, sequence_rewards

    config = json.loads((trained_rm / "config.json").read_text())
    final = read_metrics(trained_rm)[-1]
    assert len(config["id2label"]) == 1 and config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["reward_mean"] == pytest.approx(final["eval/reward_mean"])
    assert config["reward_std"] == pytest.approx(final["eval/reward_std"])
    model = AutoModelForSequenceClassification.from_pretrained(trained_rm).eval()
    tok = AutoTokenizer.from_pretrained(trained_rm)
    assert reward_stats(model.config) == pytest.approx((final["eval/reward_mean"], final["eval/reward_std"]))
    texts = ["Q: What is 3 + 4?\nA: 7", "Q: What is 3 + 4?\nA: I am not sure, maybe 9.", "Q: What is 10 - 2?\nA: 8"]
    ids = [encode_reward_text(tok, t, 512) for t in texts]
    with torch.no_grad():
        direct = torch.stack([model(torch.tensor([i])).logits[0, 0] for i in ids])
        seqs = [{"input_ids": i, "loss_mask": [1] * len(i)} for i in ids]
        padded = sequence_rewards(model, collate_padded(seqs, tok.pad_token_id))
        packed = sequence_rewards(model, collate_packed(seqs))
        hf_batch = model(**{k: v for k, v in collate_padded(seqs, tok.pad_token_id).items()
                            if k in ("input_ids", "attention_mask")}).logits[:, 0]
    torch.testing.assert_close(padded, direct, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, direct, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_batch, direct, rtol=1e-5, atol=1e-5)  # HF's own pooling agrees
    assert direct[0] > direct[1]  # the direct answer beats the hedge


def test_lora_logexp_margin_packed_exports_a_merged_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "lora"
    args = rm_args(tiny_model_dir, out, "--train.max_steps", "2", "--ds.lora.rank", "4", "--model.loss_type", "logexp",
                   "--model.margin_loss_enable", "--ds.packing_samples", "--model.compute_fp32_loss_enable",
                   "--ckpt.save_steps", "1", "--ckpt.disable_ds", "--ckpt.save_hf", "--ckpt.path", str(out / "ckpt"))
    assert rlhforge_main(args) == 0
    rows = read_metrics(out)
    assert len(rows) == 2 and rows[-1]["eval/acc"] >= 0.0
    # --ckpt.disable_ds: no resumable state, only HF exports per save
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_1_hf", "step_2_hf"]
    assert (out / "ckpt" / "step_1_hf" / "model.safetensors").is_file()
    assert (out / "adapter" / "adapter_config.json").is_file()
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and "reward_mean" in model.config.to_dict()
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_openrlhf_flags_parse_and_bad_values_fail_clearly(tiny_model_dir):
    base = ["--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", "x.jsonl"]
    cfg = parse_args(RMConfig, base + ["--model.loss_type", "logexp", "--model.margin_loss_enable",
                                       "--model.compute_fp32_loss_enable", "--ds.value_head_prefix", "score",
                                       "--data.prompt_key", "p", "--data.chosen_key", "c", "--data.rejected_key", "r",
                                       "--adam.lr", "1e-5", "--max_norm", "0.5", "--train.micro_batch_size", "2"])
    assert (cfg.model.loss_type, cfg.model.margin_loss_enable, cfg.data.prompt_key, cfg.optim.adam.lr) == \
           ("logexp", True, "p", 1e-5)
    defaults = parse_args(RMConfig, base)  # OpenRLHF's train_rm defaults
    assert (defaults.train.micro_batch_size, defaults.train.max_epochs, defaults.optim.adam.lr, defaults.data.max_len,
            defaults.data.chosen_key, defaults.ckpt.checkpoint_dir) == (1, 1, 9e-6, 512, "chosen", "./ckpt/checkpoints_rm")
    legacy = parse_args(RMConfig, ["--pretrain", str(tiny_model_dir), "--dataset", "x.jsonl", "--loss", "logexp",
                                   "--prompt_key", "q"], legacy=__import__("rlhforge.cli.train_rm", fromlist=["x"]).RM_LEGACY_ALIASES)
    assert legacy.model.loss_type == "logexp" and legacy.data.prompt_key == "q"
    with pytest.raises(ConfigError, match="'hinge' is not a reward-model loss; valid: sigmoid, logexp"):
        parse_args(RMConfig, base + ["--model.loss_type", "hinge"])
    with pytest.raises(ConfigError, match="aux_loss_coef must be >= 0"):
        parse_args(RMConfig, base + ["--model.aux_loss_coef", "-0.1"])
    with pytest.raises(ConfigError, match="ring_attn_size 2 needs --ds.packing_samples"):  # tests/trainers/test_rm_ring.py
        parse_args(RMConfig, base + ["--ds.ring_attn_size", "2"])
    with pytest.raises(ConfigError, match="input_template.*prompt_key"):
        parse_args(RMConfig, base + ["--data.input_template", "Q: {}"])


def test_unknown_value_head_is_named(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="no value head named 'value_head'.*top-level modules are: model, score"):
        rlhforge_main(rm_args(tiny_model_dir, tmp_path / "x", "--ds.value_head_prefix", "value_head",
                              "--train.max_steps", "1"))


def test_every_openrlhf_train_rm_flag_is_accepted():
    base = ["--model.model_name_or_path", "m", "--data.dataset", "x.jsonl"]
    values = {"--adam.betas": ["0.9", "0.95"], "--data.dataset_probs": ["1.0"], "--ds.lora.target_modules": ["q_proj"],
              "--lr_scheduler": ["cosine"], "--model.loss_type": ["logexp"]}
    check_every_flag(RMConfig, "train_rm", 79, base, values)
    # the input template needs a prompt field to wrap
    parse_args(RMConfig, base + ["--data.prompt_key", "q", "--data.input_template", "Q: {} A:"])
