"""On-policy distillation through ``rlhforge rl`` (``--algo.advantage.estimator on_policy_distill``): the reward is
the teacher/student log-prob gap recomputed here with plain HF forward passes of the two tiny models on the
generated tokens; the forward_kl_topk mode's teacher rows are the teacher's own top-k; both modes train 2 steps
through ``python -m rlhforge.cli.train_ppo_ray``'s ``main``; a teacher with another tokenizer is refused at
start-up (exit 2, both paths named)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
from rlhforge.workers.distill import TOPK_IDS, TOPK_LOGPROBS
from tests.flag_tables import refused_line
from tests.rl.helpers import metrics, rl_args

TEMP = 0.8


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A different model (3 layers, other weights) with the student's tokenizer (same tokenizer seed)."""
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", TinyModelSpec(num_hidden_layers=3), seed=0)


def _opd_args(student, teacher, out, *extra, steps=2):
    return rl_args(student, out, "--teacher.model_name_or_path", str(teacher), "--algo.kl.init_coef", "0",
                   "--rollout.temperature", str(TEMP), *extra, estimator="on_policy_distill", steps=steps)


def _experience(args, train: bool = False):
    """The first rollout's experience (and, with ``train``, the metrics of training on it)."""
    trainer = build_trainer(parse_rl_args(args))
    try:
        trajs = trainer.rollout()[0]
        samples, m = trainer.make_experience(trajs)
        return (samples, m, trainer.train(samples)) if train else (samples, m)
    finally:
        trainer.logger.close()


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def test_reward_is_the_teacher_student_gap(tiny_model_dir, teacher_dir, tmp_path):
    samples, m = _experience(_opd_args(tiny_model_dir, teacher_dir, tmp_path / "run", "--algo.distill.coef", "1.5"))
    assert len(samples) == 8
    gaps = []
    for s in samples:
        ids = s.input_ids
        student = torch.log_softmax(_hf_logits(tiny_model_dir, ids) / TEMP, -1)
        teacher = torch.log_softmax(_hf_logits(teacher_dir, ids) / TEMP, -1)
        act = [pos for pos in range(1, len(ids)) if s.loss_mask[pos]]
        assert act, "a sample without generated tokens"
        for pos in act:  # the token at pos was predicted at pos - 1
            gap = float(student[pos - 1, ids[pos]] - teacher[pos - 1, ids[pos]])
            gaps.append(gap)
            assert s.tensors["advantages"][pos].item() == pytest.approx(-1.5 * gap, abs=2e-5)
        assert all(s.tensors["advantages"][pos].item() == 0.0 for pos in range(len(ids)) if not s.loss_mask[pos])
    assert any(abs(g) > 1e-2 for g in gaps)  # the two models really differ
    assert m["distill/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)


def test_discount_sums_the_future_gaps(tiny_model_dir, teacher_dir, tmp_path):
    samples, _ = _experience(_opd_args(tiny_model_dir, teacher_dir, tmp_path / "run", "--algo.distill.discount",
                                       "0.5"))
    s = samples[0]
    student = torch.log_softmax(_hf_logits(tiny_model_dir, s.input_ids) / TEMP, -1)
    teacher = torch.log_softmax(_hf_logits(teacher_dir, s.input_ids) / TEMP, -1)
    act = [pos for pos in range(1, len(s.input_ids)) if s.loss_mask[pos]]
    r = [-float(student[p - 1, s.input_ids[p]] - teacher[p - 1, s.input_ids[p]]) for p in act]
    for i, pos in enumerate(act):
        expected = sum(0.5 ** (j - i) * r[j] for j in range(i, len(act)))
        assert s.tensors["advantages"][pos].item() == pytest.approx(expected, abs=2e-5)


def test_topk_rows_are_the_teachers_topk(tiny_model_dir, teacher_dir, tmp_path):
    """The teacher's rows on the samples are its own top-k; the actor's forward-KL term (one optimizer step over
    the whole rollout, so every micro-batch sees the initial student) equals the formula recomputed here from
    plain HF forwards of the student and those rows."""
    samples, m, trained = _experience(_opd_args(tiny_model_dir, teacher_dir, tmp_path / "run", "--algo.distill.mode",
                                                "forward_kl_topk", "--algo.distill.topk", "5", "--train.batch_size",
                                                "8"), train=True)
    total, tokens = 0.0, 0
    for s in samples:
        student = torch.log_softmax(_hf_logits(tiny_model_dir, s.input_ids) / TEMP, -1)
        ids, lps = s.tensors[TOPK_IDS], s.tensors[TOPK_LOGPROBS].double()
        for pos in (p for p in range(1, len(s.input_ids)) if s.loss_mask[p]):
            total += float((lps[pos].exp() * (lps[pos] - student[pos - 1, ids[pos].long()])).sum())
            tokens += 1
    assert trained["actor/distill_forward_kl"] == pytest.approx(total / tokens, abs=1e-5)
    s = samples[1]
    ids, lps = s.tensors[TOPK_IDS], s.tensors[TOPK_LOGPROBS]
    assert ids.shape == lps.shape == (len(s.input_ids), 5)
    teacher = torch.log_softmax(_hf_logits(teacher_dir, s.input_ids) / TEMP, -1)
    for pos in range(len(s.input_ids)):
        if not s.loss_mask[pos]:
            assert not ids[pos].any() and not lps[pos].any()
            continue
        top = teacher[pos - 1].topk(5)
        assert ids[pos].tolist() == top.indices.tolist()
        assert torch.allclose(lps[pos].double(), top.values, atol=2e-5)
    # no reward from the teacher in this mode: env_reward_coef 0 leaves zero advantages
    assert all(not s.tensors["advantages"].any() for s in samples)
    assert 0 < m["distill/teacher_topk_mass"] < 1


@pytest.mark.parametrize("mode", ["reverse_kl", "forward_kl_topk"])
def test_each_mode_trains_two_steps(tiny_model_dir, teacher_dir, tmp_path, mode):
    out = tmp_path / "run"
    extra = ["--algo.distill.mode", mode, "--algo.distill.env_reward_coef", "0.5"]
    if mode == "forward_kl_topk":
        extra += ["--algo.distill.topk", "8", "--ds.packing_samples"]
    assert rl_main(_opd_args(tiny_model_dir, teacher_dir, out, *extra)) == 0
    recs = [r for r in metrics(out) if "actor/policy_loss" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0
        if mode == "reverse_kl":
            assert math.isfinite(r["distill/reverse_kl"]) and r["rollout/advantage_std"] > 0
        else:
            assert math.isfinite(r["actor/distill_forward_kl"]) and 0 < r["distill/teacher_topk_mass"] < 1
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path, capsys):
    other = build_tiny_model(tmp_path / "other", seed=1)  # another tokenizer: trained on another corpus
    line = refused_line(rl_main, _opd_args(tiny_model_dir, other, tmp_path / "run"), capsys)
    assert str(other) in line and str(tiny_model_dir) in line and "tokenizer" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_teacher_and_estimator_come_together(tiny_model_dir, teacher_dir, tmp_path, capsys):
    line = refused_line(rl_main, rl_args(tiny_model_dir, tmp_path / "a", estimator="on_policy_distill"), capsys)
    assert "--teacher.model_name_or_path" in line, line
    line = refused_line(rl_main, rl_args(tiny_model_dir, tmp_path / "b", "--teacher.model_name_or_path",
                                         str(teacher_dir)), capsys)
    assert "--algo.advantage.estimator on_policy_distill" in line, line


@pytest.mark.parametrize("extra, message", [
    (["--algo.distill.coef", "0"], "leave nothing to learn from"),
    (["--algo.distill.coef", "-1"], "--algo.distill.coef and --algo.distill.env_reward_coef must be >= 0"),
    (["--algo.distill.discount", "1.5"], "--algo.distill.discount must be in [0, 1] (got 1.5)"),
    (["--algo.distill.topk", "0"], "--algo.distill.topk must be >= 1 (got 0)"),
    (["--teacher.num_gpus_per_node", "0"], "--teacher.num_gpus_per_node must be >= 1 (got 0)"),
    (["--algo.distill.mode", "forward_kl_topk", "--ds.ring_attn_size", "2", "--ds.packing_samples",
      "--actor.num_gpus_per_node", "2",
      "--train.batch_size", "8"], "forward_kl_topk with --ds.ring_attn_size 2"),
])
def test_distill_flags_out_of_range_are_refused(tiny_model_dir, teacher_dir, tmp_path, capsys, extra, message):
    line = refused_line(rl_main, _opd_args(tiny_model_dir, teacher_dir, tmp_path / "run", *extra), capsys)
    assert message in line, line


def test_k1_is_reverse_kl(tiny_model_dir, teacher_dir, tmp_path):
    from rlhforge.config.rl_distill import distill_mode

    cfg = parse_rl_args(_opd_args(tiny_model_dir, teacher_dir, tmp_path / "run", "--algo.distill.mode", "k1"))
    assert distill_mode(cfg) == "reverse_kl"
