"""``rlhforge kto`` (issue 41, item 3): one step equals TRL's KTO formula recomputed independently (HF forward,
hand-made mismatched sequences, the loss as TRL's KTOTrainer states it), the data's mismatched pairing and
labels, the reference precomputed or live, a short run that learns, and bad labels refused naming the record."""

from __future__ import annotations

import json

import pytest
import torch

from rlhforge.tracking.metrics import read_metrics
from tests.trainers import arithmetic_ref as ref
from tests.trainers.test_arithmetic_preference import _response_logp_sum, instrumented, perturbed_reference  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DATA = "builtin:arithmetic_kto?n=8"
BETA, TOL = 0.3, 1e-5


def _args(model, out, *extra):
    return ["--model.model_name_or_path", str(model), "--data.dataset", DATA, "--data.input_template", "Q: {}\nA: ",
            "--train.batch_size", "8", "--train.micro_batch_size", "8", "--train.max_steps", "1",
            "--ds.param_dtype", "fp32", "--ckpt.output_dir", str(out), "--logger.progress_bar", "off", *extra]


def _trl_kto_loss(policy, ref_, policy_kl, ref_kl, desirable, beta, dw, uw):
    """TRL KTOTrainer.kto_loss on one process (see tests/algorithms/test_unpaired_losses.py)."""
    kl = (policy_kl - ref_kl).mean().detach().clamp(min=0)
    chosen = 1 - torch.sigmoid(beta * ((policy[desirable] - ref_[desirable]) - kl))
    rejected = 1 - torch.sigmoid(beta * (kl - (policy[~desirable] - ref_[~desirable])))
    return torch.cat((dw * chosen, uw * rejected)).mean()


def test_one_kto_step_equals_trls_formula(tiny_model_dir, perturbed_reference, tmp_path, instrumented):  # noqa: F811
    from rlhforge.cli.train_kto import main

    out = tmp_path / "kto"
    assert main(_args(tiny_model_dir, out, "--ref.model_name_or_path", str(perturbed_reference), "--model.beta",
                      str(BETA), "--model.undesirable_weight", "1.33", "--adam.lr", "1e-3")) == 0
    [recorder] = instrumented["steps"]
    [samples] = instrumented["pairs"]
    [record] = recorder.records
    assert len(samples) == 8 and 0 < sum(s.desirable for s in samples) < 8
    policy, reference = ref.causal_lm(tiny_model_dir), ref.causal_lm(perturbed_reference)
    p = torch.stack([_response_logp_sum(policy, s.chosen_ids, s.chosen_mask) for s in samples])
    p_kl = torch.stack([_response_logp_sum(policy, s.rejected_ids, s.rejected_mask) for s in samples])
    with torch.no_grad():
        r = torch.stack([_response_logp_sum(reference, s.chosen_ids, s.chosen_mask) for s in samples])
        r_kl = torch.stack([_response_logp_sum(reference, s.rejected_ids, s.rejected_mask) for s in samples])
    desirable = torch.tensor([s.desirable for s in samples])
    loss = _trl_kto_loss(p, r, p_kl.detach(), r_kl, desirable, BETA, 1.0, 1.33)
    loss.backward()
    ref.assert_grads_close(record["grads"], {n: q.grad for n, q in policy.named_parameters()}, TOL, "kto")
    row = read_metrics(out)[0]
    assert row["train/loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert row["train/kl"] == pytest.approx(float((p_kl - r_kl).mean()), abs=TOL)
    assert row["train/desirable_reward"] == pytest.approx(float(BETA * (p - r)[desirable].mean()), abs=TOL)
    assert abs(loss.item() - 0.5) > 1e-3  # policy != reference: not the trivial 1 - sigmoid(0)


def test_each_example_runs_with_the_previous_records_completion(tiny_model_dir):
    """The mismatched sequence of record i is its own prompt with record i-1's completion (0: the last one's)."""
    from transformers import AutoTokenizer

    from rlhforge.data.unpaired import build_unpaired_samples

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = [{"prompt": f"Q{i}:", "completion": f" answer {i}", "label": i % 2 == 0} for i in range(3)]
    samples = build_unpaired_samples(records, tok, input_template="{} ")
    for i, s in enumerate(samples):
        prompt = tok.encode(f"Q{i}: ", add_special_tokens=False)
        assert s.chosen_ids[: s.prompt_len] == s.rejected_ids[: s.prompt_len]
        assert tok.decode(s.chosen_ids[s.prompt_len:], skip_special_tokens=True) == f" answer {i}"
        assert tok.decode(s.rejected_ids[s.prompt_len:], skip_special_tokens=True) == f" answer {(i - 1) % 3}"
        assert s.desirable == (i % 2 == 0) and s.prompt_len >= len(prompt) - 1


def test_a_short_run_learns_and_precomputing_the_reference_changes_nothing(tiny_model_dir, tmp_path):
    from rlhforge.cli.main import main

    common = ["--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", "builtin:arithmetic_kto?n=96",
              "--eval.dataset", "builtin:arithmetic_kto?n=24@test", "--data.apply_chat_template",
              "--train.batch_size", "16", "--train.micro_batch_size", "8", "--adam.lr", "1e-3", "--eval.steps", "6",
              "--ds.param_dtype", "fp32", "--logger.progress_bar", "off"]
    assert main(["kto", *common, "--ckpt.output_dir", str(tmp_path / "live")]) == 0
    assert main(["kto", *common, "--ref.precompute_enable", "--ckpt.output_dir", str(tmp_path / "pre")]) == 0
    live, pre = read_metrics(tmp_path / "live"), read_metrics(tmp_path / "pre")
    assert len(live) == len(pre) == 6
    assert live[0]["train/loss"] == pytest.approx(0.5, abs=1e-7)  # policy == reference: 1 - sigmoid(0)
    for a, b in zip(live, pre):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
    assert live[-1]["train/loss"] < 0.45 and live[-1]["eval/reward_margin"] > 0.2
    assert live[-1]["eval/examples"] == 24


@pytest.mark.parametrize("label", ["maybe", 2, None])
def test_a_bad_label_is_refused_naming_the_record(tiny_model_dir, tmp_path, capsys, label):
    from rlhforge.cli.main import main

    data = tmp_path / "kto.jsonl"
    rows = [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": label}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as exit_:
        main(["kto", "--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", str(data),
              "--ckpt.output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "kto.jsonl" in err and "label" in err and "line 2" in err, err


@pytest.mark.slow
def test_two_ranks_match_one_process(tiny_model_dir, perturbed_reference, tmp_path):  # noqa: F811
    """Two torchrun ranks (DeepSpeed ZeRO-2, 8 examples each) against one process holding all 16 in one
    micro-batch: KTO's reference point is averaged over the ranks, so every step's loss and KL agree. The
    reference is a perturbed copy, so the reference point is above 0 (not clamped away): a rank-local
    reference point would give other losses."""
    import os
    import sys
    from pathlib import Path

    from rlhforge.cli.train_kto import main
    from tests.torchrun import free_port, run_torchrun

    common = ["--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", "builtin:arithmetic_kto?n=48",
              "--ref.model_name_or_path", str(perturbed_reference), "--data.apply_chat_template",
              "--train.batch_size", "16", "--adam.lr", "5e-3", "--logger.progress_bar", "off"]
    assert main([*common, "--train.micro_batch_size", "16", "--ckpt.output_dir", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]), "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_kto", *common,
           "--train.micro_batch_size", "8", "--ds.zero_stage", "2", "--ckpt.output_dir", str(tmp_path / "dist")]
    proc = run_torchrun(cmd, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "2 rank(s)" in proc.stdout
    a, b = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "dist")
    assert len(a) == len(b) == 3
    assert all(r["train/kl"] > 0 for r in a)
    for ra, rb in zip(a, b):
        for key in ("train/loss", "train/kl", "train/reward_margin"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
