"""Train-step metrics of the actor and critic workers are the same for 1 rank and 2 ranks:
dp-scaled losses are averaged over ranks, token-share-weighted metrics are summed.

Two data-parallel ranks run as two threads, each with its own copy of a tiny model and a
strategy stub whose ``all_reduce`` really sums across the threads (no Ray, no process group).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from rlhforge.algorithms import entropy_from_logits
from rlhforge.workers.experience import ExperienceSample
from rlhforge.workers.actor import ActorWorker, CriticWorker, PolicyLossSpec, reduce_step_metrics


class _Collective:
    """All-reduce (sum / mean) across ``n`` threads."""

    def __init__(self, n: int):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

    def all_reduce(self, rank: int, t: torch.Tensor, op: str) -> torch.Tensor:
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        out = torch.stack(self.slots).sum(0)
        self.barrier.wait()
        return out / self.n if op == "mean" else out


class _Strategy:
    def __init__(self, rank: int, collective: _Collective):
        self.rank, self.world_size, self.collective = rank, collective.n, collective
        self.device = torch.device("cpu")

    def all_reduce(self, t, op="sum"):
        return self.collective.all_reduce(self.rank, t, op)

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss, is_last_micro_batch=True):
        loss.backward()

    def step(self):
        return {"grad_norm": 0.0, "lr": 0.0}


def _worker(cls, model, strategy):
    w = object.__new__(cls)
    w.cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=2))
    w.tokenizer = SimpleNamespace(pad_token_id=0)
    w.strategy, w.model, w.device, w.packed, w.prefix = strategy, model, torch.device("cpu"), False, "score"
    return w


def _samples(seed: int = 0) -> list[ExperienceSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, resp) in enumerate([(3, 4), (2, 6), (4, 2), (3, 5), (2, 3), (5, 4), (3, 7), (2, 2)]):
        n = prompt + resp
        ids = torch.randint(1, 64, (n,), generator=g).tolist()
        mask = [0] * prompt + [1] * resp
        s = ExperienceSample(ids, mask, reward=0.0, score=0.0)
        noise = lambda: torch.randn(n, generator=g) * torch.tensor(mask, dtype=torch.float32)  # noqa: E731
        s.tensors.update(old_logprobs=-4.2 + 0.5 * noise(), ref_logprobs=-4.2 + 0.5 * noise(),
                         advantages=noise(), values=0.3 * noise(), returns=noise())
        out.append(s)
    return out


def _run(cls, model, samples, n_ranks: int, *args) -> list[dict]:
    """train_step on ``n_ranks`` thread-ranks, each with the contiguous shard of ``samples``."""
    collective = _Collective(n_ranks)
    per = len(samples) // n_ranks
    results: list = [None] * n_ranks
    errors: list = []

    def rank_main(r):
        try:
            torch.manual_seed(0)
            w = _worker(cls, copy.deepcopy(model), _Strategy(r, collective))
            results[r] = w.train_step(samples[r * per : (r + 1) * per], *args)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            errors.append(err)
            collective.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, attn_implementation="eager", pad_token_id=0, num_labels=1)
    return LlamaForCausalLM(cfg).eval(), LlamaForSequenceClassification(cfg).eval()


def test_reduce_step_metrics_by_hand():
    # rank 0: policy_loss 0.3 (already x dp / N), entropy partial sum 0.4; rank 1: 0.5 and 0.6
    other = {"policy_loss": 0.5, "entropy": 0.6}

    def all_reduce(t, op="sum"):
        assert op == "sum"
        return t + torch.tensor([other["policy_loss"], other["entropy"]], dtype=torch.float64)

    out = reduce_step_metrics({"policy_loss": 0.3}, {"entropy": 0.4}, all_reduce, world_size=2)
    assert out == pytest.approx({"policy_loss": (0.3 + 0.5) / 2, "entropy": 0.4 + 0.6})
    # one rank: identity
    assert reduce_step_metrics({"a": 1.5}, {"b": 2.5}, lambda t, op: t, 1) == {"a": 1.5, "b": 2.5}
    with pytest.raises(ValueError, match="both"):
        reduce_step_metrics({"a": 1.0}, {"a": 1.0}, lambda t, op: t, 1)


def test_actor_metrics_equal_on_one_and_two_ranks(tiny_lm):
    lm, _ = tiny_lm
    samples = _samples()
    spec = PolicyLossSpec(loss_kwargs={"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0}, kl_loss_coef=0.1)
    (one,) = _run(ActorWorker, lm, samples, 1, spec)
    two = _run(ActorWorker, lm, samples, 2, spec)
    assert two[0] == two[1]  # every rank reports the global values
    for key in ("policy_loss", "kl_loss", "entropy", "clip_frac", "approx_kl", "ratio_mean", "dual_clip_frac"):
        assert key in one, key
        assert two[0][key] == pytest.approx(one[key], rel=1e-9, abs=1e-12), key
    # real numbers: the entropy of a random 64-token model is close to ln 64 = 4.16; the ratio is
    # exp(logp - old) with old ~ logp, clipping happens
    assert 3.0 < one["entropy"] < 4.2
    assert 0.0 < one["clip_frac"] < 1.0 and one["ratio_mean"] > 0.5
    # independent recomputation: the entropy of the distribution that predicted each action token,
    # averaged over all action tokens of the step (one forward per sample, no batching)
    ents = []
    with torch.no_grad():
        for s in samples:
            logits = lm(torch.tensor([s.input_ids])).logits[0].float()
            h = entropy_from_logits(logits[:-1])  # h[t - 1] belongs to token t
            ents += [h[t - 1] for t, m in enumerate(s.loss_mask) if m]
    assert one["entropy"] == pytest.approx(float(torch.stack(ents).mean()), rel=1e-5)
    tokens = [sum(s.loss_mask) for s in samples]
    assert sum(tokens[:4]) != sum(tokens[4:])  # unequal shards: averaging the ranks' own means would differ too


def test_critic_metrics_equal_on_one_and_two_ranks(tiny_lm):
    _, critic = tiny_lm
    samples = _samples(1)
    (one,) = _run(CriticWorker, critic, samples, 1, 0.2)
    two = _run(CriticWorker, critic, samples, 2, 0.2)
    for key in ("value_loss", "clip_frac", "values_mean"):
        assert two[0][key] == pytest.approx(one[key], rel=1e-9, abs=1e-12), key
    assert one["value_loss"] > 0 and one["clip_frac"] > 0 and one["values_mean"] != 0
