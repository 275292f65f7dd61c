"""DPO family end to end on a tiny model through the real CLI: the first step's loss equals a hand
computation from policy and reference log-probs (DPO, cDPO + NLL, IPO; padded and packed), is log 2
when policy == reference, preference accuracy and margins rise, the LoRA reference (adapter
disabled) and precomputed reference log-probs give the same run, and OpenRLHF's flags parse."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhforge.cli.main import main as rlhforge_main
from rlhforge.config.dpo import DPOConfig
from rlhforge.config.parsing import ConfigError, parse_args
from rlhforge.tracking.metrics import read_metrics
from tests.flag_tables import check_every_flag
from tests.model_helpers import perturbed_copy

TRAIN = "builtin:arithmetic_preference?n=16"


def dpo_args(model_dir, out, *extra, data=TRAIN):
    return ["dpo", "--model.model_name_or_path", str(model_dir), "--data.dataset", data, "--data.prompt_key", "prompt",
            "--data.input_template", "Q: {}\nA: ", "--train.micro_batch_size", "8", "--ckpt.output_dir", str(out),
            "--logger.progress_bar", "off", *extra]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def perturbed_reference(tiny_model_dir, tmp_path_factory):
    """The tiny model with noise on every weight: a reference that differs from the policy."""
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("ref") / "model", seed=1)


@pytest.fixture(scope="module")
def hand_computed(tiny_model_dir, perturbed_reference):
    """The training pairs and their summed response log-probs under policy and reference, by hand."""
    from transformers import AutoTokenizer

    from rlhforge.data.loading import load_dataset_spec
    from rlhforge.data.preference import build_preference_samples

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = build_preference_samples(load_dataset_spec(TRAIN), tok, prompt_key="prompt", input_template="Q: {}\nA: ")
    return samples, hand_logps(tiny_model_dir, samples), hand_logps(perturbed_reference, samples)


def hand_logps(model_dir, samples):
    """Summed response log-probs of chosen and rejected, one unbatched forward per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for ids, mask in [(s.chosen_ids, s.chosen_mask) for s in samples] + [(s.rejected_ids, s.rejected_mask) for s in samples]:
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append((logp * torch.tensor(mask[1:], dtype=torch.float64)).sum())
    out = torch.stack(out)
    n = len(samples)
    return out[:n], out[n:]


@pytest.mark.parametrize("variant", ["dpo", "cdpo_nll_packed", "ipo"])
def test_first_step_loss_matches_hand_computation(tiny_model_dir, perturbed_reference, hand_computed, tmp_path, variant):
    beta, eps, nll = 0.3, 0.0, 0.0
    extra = {"dpo": [], "ipo": ["--model.ipo_enable"],
             "cdpo_nll_packed": ["--model.label_smoothing", "0.2", "--model.nll_loss_coef", "0.5", "--ds.packing_samples"]}
    if variant.startswith("cdpo"):
        eps, nll = 0.2, 0.5
    out = tmp_path / variant
    # one optimizer step over all 16 pairs (2 micro-batches): the logged loss is the pre-update loss
    assert rlhforge_main(dpo_args(tiny_model_dir, out, "--train.batch_size", "16", "--model.beta", str(beta),
                                  "--ref.model_name_or_path", str(perturbed_reference), *extra[variant])) == 0
    logged = read_metrics(out)[0]
    samples, (pc, pr), (rc, rr) = hand_computed
    h = (pc - pr) - (rc - rr)
    if variant == "ipo":
        loss = ((h - 1 / (2 * beta)) ** 2).mean()
    else:
        loss = (-(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)).mean()
        counts = torch.tensor([sum(s.chosen_mask) for s in samples], dtype=torch.float64)
        loss = loss + nll * (-(pc / counts).mean())
    assert logged["train/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert logged["train/chosen_logp"] == pytest.approx(pc.mean().item(), rel=1e-5)
    assert logged["train/rejected_logp"] == pytest.approx(pr.mean().item(), rel=1e-5)
    assert logged["train/reward_margin"] == pytest.approx((beta * h).mean().item(), rel=1e-4, abs=1e-6)


def test_dpo_learns_and_starts_at_log2(tiny_model_dir, tmp_path):
    out = tmp_path / "learn"
    assert rlhforge_main(dpo_args(tiny_model_dir, out, "--train.batch_size", "16", "--train.max_epochs", "2",
                                  "--adam.lr", "1e-3", "--lr_scheduler", "constant", "--eval.steps", "1",
                                  "--eval.dataset", "builtin:arithmetic_preference?n=24@test",
                                  data="builtin:arithmetic_preference?n=48")) == 0
    rows = read_metrics(out)
    assert len(rows) == 6
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert rows[0]["train/acc"] == 0.0 and rows[0]["train/reward_margin"] == 0.0  # ties: no preference yet
    margins = [r["eval/reward_margin"] for r in rows]
    assert margins[0] > 0 and margins[-1] > 2 * margins[0] and margins[-1] >= 0.8 * max(margins), margins
    accs = [r["eval/acc"] for r in rows]
    assert accs[-1] >= 0.9 and accs[-1] >= accs[0], accs
    assert rows[-1]["eval/chosen_logp"] > rows[-1]["eval/rejected_logp"]
    assert rows[-1]["train/loss"] < 0.5


def test_lora_adapter_reference_and_precomputed_reference_agree(tiny_model_dir, tmp_path):
    common = ["--train.batch_size", "16", "--train.max_epochs", "3", "--ds.lora.rank", "4", "--adam.lr", "5e-3", "--ds.packing_samples",
              "--eval.dataset", "builtin:arithmetic_preference?n=8@test"]
    live, pre = tmp_path / "live", tmp_path / "pre"
    assert rlhforge_main(dpo_args(tiny_model_dir, live, *common)) == 0
    assert rlhforge_main(dpo_args(tiny_model_dir, pre, *common, "--ref.precompute_enable")) == 0
    a, b = read_metrics(live), read_metrics(pre)
    assert a[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # adapter disabled == policy at init
    assert a[-1]["train/reward_margin"] > 0
    for ra, rb in zip(a, b):
        for key in ("train/loss", "train/reward_margin", "train/chosen_logp"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), key
    assert rb["eval/loss"] == pytest.approx(ra["eval/loss"], rel=1e-5)
    assert (live / "adapter_config.json").is_file()


def test_openrlhf_flags_parse_and_bad_values_fail_clearly(tiny_model_dir):
    from rlhforge.cli.train_dpo import DPO_LEGACY_ALIASES

    base = ["--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", "x.jsonl"]
    cfg = parse_args(DPOConfig, base + ["--model.beta", "0.2", "--model.label_smoothing", "0.1",
                                        "--model.nll_loss_coef", "0.3", "--ref.model_name_or_path", "ref",
                                        "--ref.offload", "--ref.precompute_enable", "--data.chosen_key", "good"])
    assert (cfg.model.beta, cfg.model.label_smoothing, cfg.model.nll_loss_coef, cfg.ref.model_name_or_path,
            cfg.ref.offload, cfg.ref.precompute_enable, cfg.data.chosen_key) == (0.2, 0.1, 0.3, "ref", True, True, "good")
    d = parse_args(DPOConfig, base)  # OpenRLHF's train_dpo defaults
    assert (d.model.beta, d.train.micro_batch_size, d.optim.adam.lr, d.eval.split, d.data.max_len) == \
           (0.1, 8, 1e-5, "test", 512)
    legacy = parse_args(DPOConfig, ["--pretrain", "m", "--dataset", "x.jsonl", "--beta", "0.5", "--ipo",
                                    "--ref_pretrain", "r"], legacy=DPO_LEGACY_ALIASES)
    assert (legacy.model.beta, legacy.model.ipo_enable, legacy.ref.model_name_or_path) == (0.5, True, "r")
    with pytest.raises(ConfigError, match="ipo_enable and --model.label_smoothing 0.1 are exclusive"):
        parse_args(DPOConfig, base + ["--model.ipo_enable", "--model.label_smoothing", "0.1"])
    with pytest.raises(ConfigError, match=r"label_smoothing must be in \[0, 0.5\)"):
        parse_args(DPOConfig, base + ["--model.label_smoothing", "0.5"])
    with pytest.raises(ConfigError, match="beta must be > 0"):
        parse_args(DPOConfig, base + ["--model.beta", "0"])
    with pytest.raises(ConfigError, match="no separate reference model to offload"):
        parse_args(DPOConfig, base + ["--ds.lora.rank", "4", "--ref.offload"])


def test_every_openrlhf_train_dpo_flag_is_accepted():
    base = ["--model.model_name_or_path", "m", "--data.dataset", "x.jsonl"]
    values = {"--adam.betas": ["0.9", "0.95"], "--data.dataset_probs": ["1.0"], "--ds.lora.target_modules": ["q_proj"],
              "--lr_scheduler": ["cosine"]}
    check_every_flag(DPOConfig, "train_dpo", 82, base, values)
