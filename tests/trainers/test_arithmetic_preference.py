"""The DPO and reward-model trainers' own arithmetic, checked against an independent computation.

One optimizer step of the real trainer, through its real CLI (``rlhforge.cli.train_dpo`` /
``rlhforge.cli.train_rm`` ``main``, tiny local model, one process, fp32 on CPU, 8 pairs in one step
of 2 micro-batches). The test recomputes the step's loss and the gradient of every parameter from
the pairs' raw token ids with plain torch (``tests/trainers/arithmetic_ref.py``: one unpadded float64
HF forward per sequence, OpenRLHF 0.11's formulas):

- DPO: sequence log-prob = sum of response-token log-probs (the pair's mask), under a fresh copy of
  the policy and of a separate, perturbed reference; loss = mean over pairs of
  ``-log sigmoid(beta ((pc - pr) - (rc - rr)))``; implicit rewards ``beta (logp - logp_ref)``.
- RM: reward = the value head at the last token of the unpadded sequence (= the last non-pad token
  of a padded batch); loss = mean over pairs of ``-log sigmoid(r_c - r_r)``; accuracy.

The gradient is read by wrapping the strategy's ``step`` (``StepRecorder``: it copies ``param.grad``
and the weights the gradient was taken at, then runs the real step; the strategy is instrumented as
``build_strategy`` returns it). The pairs the step used are read by wrapping the trainer's
``train_step`` the same way. The update itself (learning-rate schedule) is not asserted.
"""

from __future__ import annotations

import pytest
import torch

from rlhforge.tracking.metrics import read_metrics
from tests.model_helpers import perturbed_copy
from tests.trainers import arithmetic_ref as ref

DATA = "builtin:arithmetic_preference?n=8"
BETA = 0.3
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def perturbed_reference(tiny_model_dir, tmp_path_factory):
    """The tiny model with noise on every weight: a reference that differs from the policy."""
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("arith_ref") / "model", seed=5)


@pytest.fixture
def instrumented(monkeypatch):
    """Records every strategy ``build_strategy`` builds (``steps``) and each trainer step's pairs (``pairs``)."""
    import rlhforge.backend.factory as factory
    from rlhforge.trainers.dpo import DPOTrainer
    from rlhforge.trainers.rm import RMTrainer

    seen = {"steps": [], "pairs": []}
    real_build = factory.build_strategy

    def build_strategy(*args, **kwargs):
        strategy = real_build(*args, **kwargs)
        seen["steps"].append(ref.StepRecorder(strategy))
        return strategy

    monkeypatch.setattr(factory, "build_strategy", build_strategy)
    for cls in (DPOTrainer, RMTrainer):
        real_step = cls.train_step

        def train_step(self, indices, _real=real_step):
            seen["pairs"].append([self.train_samples[i] for i in indices])
            return _real(self, indices)

        monkeypatch.setattr(cls, "train_step", train_step)
    return seen


def _common(out, packed):
    return ["--data.dataset", DATA, "--data.prompt_key", "prompt", "--data.input_template", "Q: {}\nA: ",
            "--train.batch_size", "8", "--train.micro_batch_size", "4", "--train.max_steps", "1",
            "--ds.param_dtype", "fp32", "--ckpt.output_dir", str(out), "--logger.progress_bar", "off",
            *(["--ds.packing_samples"] if packed else [])]


def _response_logp_sum(model, ids, mask):
    logp = ref.token_logprobs(ref.logits_of(model, ids), ids)
    return (logp * torch.tensor(mask, dtype=torch.float64)).sum()


def _one_step(main, args, out, instrumented):
    """Run one optimizer step through the CLI ``main``: the step's gradient record, its 8 pairs and the
    step-1 metrics row."""
    assert main(args) == 0
    [recorder] = instrumented["steps"]
    [pairs] = instrumented["pairs"]
    [record] = recorder.records
    assert len(pairs) == 8
    row = read_metrics(out)[0]
    assert row["step"] == 1
    return record, pairs, row


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_one_dpo_step_matches_an_independent_computation(tiny_model_dir, perturbed_reference, tmp_path, instrumented,
                                                         packed):
    from rlhforge.cli.train_dpo import main

    out = tmp_path / "dpo"
    args = ["--model.model_name_or_path", str(tiny_model_dir), "--ref.model_name_or_path", str(perturbed_reference),
            "--model.beta", str(BETA), "--optim.adam.lr", "1e-3", *_common(out, packed)]
    record, pairs, row = _one_step(main, args, out, instrumented)

    # the step's weights are the initial model's (a fresh copy, loaded from the folder)
    policy = ref.causal_lm(tiny_model_dir)
    initial = policy.state_dict()
    assert all(torch.equal(record["state"][k].double(), initial[k]) for k in initial)
    reference = ref.causal_lm(perturbed_reference)
    losses, chosen_rewards, rejected_rewards = [], [], []
    for p in pairs:
        pc = _response_logp_sum(policy, p.chosen_ids, p.chosen_mask)
        pr = _response_logp_sum(policy, p.rejected_ids, p.rejected_mask)
        with torch.no_grad():
            rc = _response_logp_sum(reference, p.chosen_ids, p.chosen_mask)
            rr = _response_logp_sum(reference, p.rejected_ids, p.rejected_mask)
        losses.append(ref.dpo_pair_loss(pc, pr, rc, rr, BETA))
        chosen_rewards.append(float(BETA * (pc - rc)))
        rejected_rewards.append(float(BETA * (pr - rr)))
    loss = torch.stack(losses).mean()
    loss.backward()
    ref.assert_grads_close(record["grads"], {n: q.grad for n, q in policy.named_parameters()}, TOL, "dpo")
    n = len(pairs)
    assert row["train/loss"] == pytest.approx(float(loss), abs=TOL, rel=TOL)
    assert row["train/chosen_reward"] == pytest.approx(sum(chosen_rewards) / n, abs=TOL, rel=TOL)
    assert row["train/rejected_reward"] == pytest.approx(sum(rejected_rewards) / n, abs=TOL, rel=TOL)
    assert row["train/acc"] == pytest.approx(sum(c > r for c, r in zip(chosen_rewards, rejected_rewards)) / n)
    assert abs(float(loss) - 0.6931471805599453) > 1e-3  # policy != reference: not the trivial log 2


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_one_rm_step_matches_an_independent_computation(tiny_model_dir, tmp_path, instrumented, packed):
    from transformers import AutoTokenizer

    from rlhforge.cli.train_rm import main

    out = tmp_path / "rm"
    args = ["--model.model_name_or_path", str(tiny_model_dir), "--adam.lr", "1e-3",
            *_common(out, packed)]
    record, pairs, row = _one_step(main, args, out, instrumented)

    # the backbone is the initial causal LM's; the new value head's initial weights come from the
    # recorded state (a random init of the trainer's, not re-derivable here)
    state = record["state"]
    base = ref.causal_lm(tiny_model_dir).state_dict()
    assert all(torch.equal(state[k].double(), base[k]) for k in state if k.startswith("model."))
    rm = ref.sequence_classifier(tiny_model_dir, state)
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    chosen, rejected = [], []
    for p in pairs:
        assert p.chosen_ids[-1] == eos and p.rejected_ids[-1] == eos  # the RM data ends every sequence with EOS
        chosen.append(ref.last_token_reward(rm, p.chosen_ids))
        rejected.append(ref.last_token_reward(rm, p.rejected_ids))
    c, r = torch.stack(chosen), torch.stack(rejected)
    loss = ref.rm_pair_loss(c, r).mean()
    loss.backward()
    ref.assert_grads_close(record["grads"], {n: q.grad for n, q in rm.named_parameters()}, TOL, "rm")
    assert row["train/loss"] == pytest.approx(float(loss), abs=TOL, rel=TOL)
    assert row["train/chosen_reward"] == pytest.approx(float(c.mean()), abs=TOL, rel=TOL)
    assert row["train/rejected_reward"] == pytest.approx(float(r.mean()), abs=TOL, rel=TOL)
    assert row["train/acc"] == pytest.approx(float((c > r).double().mean()))
