"""Ring attention (``--ds.ring_attn_size``): 2 (and 3, slow) gloo ranks on CPU equal one rank.

The distributed part runs ``ring_worker.py`` under torchrun: the attention function alone vs SDPA
with a block-diagonal causal mask (GQA, several head strides), and a tiny float32 Llama on a packed
row of 3 samples (6 + 4 + 3 = 13 tokens, padded to 14) whose logits, log-probs and parameter
gradients equal the one-rank forward. The rest checks slicing, padding and block plans by hand.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.backend.context_parallel import RingGroup, padded_length, packed_sequence_ids, ring_topology, slice_packed
from rlhforge.backend.ring_attention import BlockPlan, TorchBlockKernel, block_plan, plan_mask
from tests.torchrun import free_port, run_torchrun

WORKER = Path(__file__).with_name("ring_worker.py")


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["ring2", "ring3"])
def ring_results(request, tmp_path_factory):
    """Ring of 2 (13 tokens + 1 pad, slices of 7) or 3 (+ 2 pads, slices of 5; three blocks per ring pass)."""
    out = tmp_path_factory.mktemp("ring") / "ring.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(request.param), "--master_port",
           str(free_port()), str(WORKER), str(out)]
    proc = run_torchrun(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def test_ring_attention_equals_block_diagonal_sdpa(ring_results):
    names = [k for k in ring_results if k.startswith("attn_")]
    # 4 head layouts (GQA 4/2 stride all and 1, MHA 4/4, GQA 6/3 stride 2), GQA 4/2 with a sliding window of 3
    assert len(names) == 20  # x out, dq, dk, dv
    for name in names:
        ring, ref = ring_results[name]
        assert ref.abs().max() > 0.1, name  # a real signal, not zeros
        torch.testing.assert_close(ring, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_ring_llama_equals_one_rank_forward_and_gradients(ring_results):
    for name in ("model_logits", "model_logps"):
        ring, ref = ring_results[name]
        torch.testing.assert_close(ring, ref, rtol=1e-5, atol=1e-5, msg=name)
    logps = ring_results["model_logps"][1]
    assert (logps[0, [0, 6, 10]] == 0).all() and (logps[0, [1, 5, 7, 12]] < 0).all()  # sample starts carry no prediction
    control, ref = ring_results["control_unpacked_logits"]
    assert (control - ref).abs().max() > 1e-3  # attention across samples would show
    grads = [k for k in ring_results if k.startswith("grad_")]
    assert len(grads) == 21  # every parameter of the 2-layer Llama (embeddings, 9 per layer, norm, head)
    for name in grads:
        ring, ref = ring_results[name]
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(ring, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_ring_attention_in_other_hf_families(ring_results):
    for name in ("qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral", "gemma3_text"):  # gemma: a window of 4
        ring, ref = ring_results[f"family_{name}"]
        assert (ref < 0).sum() == 10, name  # 13 tokens, 3 sample starts
        torch.testing.assert_close(ring, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_ring_topology_is_dp_by_ring():
    topo = ring_topology(world_size=4, ring_size=2)
    assert topo.dp_size == 2 and topo.rings() == [[0, 1], [2, 3]]
    assert [topo.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [topo.ring_rank(r) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="ring_attn_size 2 must divide the 3 training ranks"):
        ring_topology(world_size=3, ring_size=2)


def test_slice_packed_pads_to_the_ring_and_cuts_contiguously():
    assert [padded_length(n, 2) for n in (13, 14)] == [14, 14] and padded_length(13, 4) == 16
    ids = torch.arange(101, 114)[None]  # 13 tokens: samples of 6, 4 and 3
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1]])
    assert packed_sequence_ids(pos).tolist() == [0] * 6 + [1] * 4 + [2] * 3
    assert packed_sequence_ids(pos, [6, 4, 3]).tolist() == [0] * 6 + [1] * 4 + [2] * 3
    batch = {"input_ids": ids, "position_ids": pos, "loss_mask": mask}
    first = slice_packed(batch, RingGroup(None, 0, 2, 0, 1), keys=["loss_mask"])
    second = slice_packed(batch, RingGroup(None, 1, 2, 0, 1), keys=["loss_mask"])
    assert first.input_ids.tolist() == [[101, 102, 103, 104, 105, 106, 107]]
    assert second.input_ids.tolist() == [[108, 109, 110, 111, 112, 113, 0]]  # one pad
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0]]
    assert second.position_ids.tolist() == [[1, 2, 3, 0, 1, 2, 0]]  # the pad starts a sample of its own
    assert second.extras["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 0]]
    assert first.layout.seq_ids.tolist() == [0] * 6 + [1] * 4 + [2] * 3 + [3]
    assert first.total == 13 and first.layout.local_len == 7


def test_block_plans_by_hand():
    seq = torch.tensor([0] * 6 + [1] * 4 + [2] * 3 + [3])
    s0, s1 = seq[:7], seq[7:]
    assert block_plan(s0, s0, 0, 0) == BlockPlan(0, 7, 0, 7, (0, 6, 7), (0, 6, 7), True)
    assert block_plan(s1, s1, 1, 1) == BlockPlan(0, 7, 0, 7, (0, 3, 6, 7), (0, 3, 6, 7), True, 7, 7)
    # slice 1's first 3 queries (sample 1) see the one token of sample 1 at the end of slice 0
    assert block_plan(s1, s0, 1, 0) == BlockPlan(0, 3, 6, 7, (0, 3), (0, 1), False, 7, 0)
    # a sliding window of 2: query 7 sees key 6 (1 back), queries 8 and 9 do not; window 1: the block is skipped
    windowed = plan_mask(block_plan(s1, s0, 1, 0, window=2), 7, 7)
    assert windowed.sum() == 1 and windowed[0, 6]
    assert block_plan(s1, s0, 1, 0, window=1) is None
    assert block_plan(s0, s1, 0, 1) is None  # the future
    assert block_plan(torch.tensor([2, 2]), torch.tensor([1, 1]), 1, 0) is None  # no straddling sample
    allowed = plan_mask(block_plan(s1, s0, 1, 0), 7, 7)
    assert allowed.sum() == 3 and allowed[:3, 6].all()


def test_torch_block_kernel_backward_matches_autograd():
    """One block (the own slice, GQA 4/2) against autograd through SDPA with the same mask."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 7, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 7, 32, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(4, 7, 32, generator=g)
    plan = block_plan(torch.tensor([1, 1, 1, 2, 2, 2, 3]), torch.tensor([1, 1, 1, 2, 2, 2, 3]), 1, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], k.repeat_interleave(2, 0)[None], v.repeat_interleave(2, 0)[None], attn_mask=plan_mask(plan, 7, 7))[0]
    ref.backward(dout)
    kernel = TorchBlockKernel()
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), plan, 32 ** -0.5)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    dq, dk, dv = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, plan, 32 ** -0.5)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_batch_plans_divide_by_the_data_parallel_size():
    from rlhforge.config.batching import plan_batches, plan_rl_batches
    from rlhforge.config.parsing import ConfigError

    # 4 ranks in rings of 2 = 2 data-parallel ranks: 8 samples -> 4 per rank -> 2 micro-batches of 2
    plan = plan_batches(num_samples=32, batch_size=8, micro_batch_size=2, world_size=4, max_epochs=1, ring_size=2)
    assert (plan.world_size, plan.per_rank_batch, plan.grad_accum_steps, plan.total_steps) == (2, 4, 2, 4)
    with pytest.raises(ConfigError, match=r"micro_batch_size 4 x 2 data-parallel ranks \(4 ranks / ring 2\) = 8"):
        plan_batches(num_samples=32, batch_size=12, micro_batch_size=4, world_size=4, max_epochs=1, ring_size=2)
    with pytest.raises(ConfigError, match="ring_attn_size 3 must divide the 4 training ranks"):
        plan_batches(num_samples=32, batch_size=8, micro_batch_size=2, world_size=4, max_epochs=1, ring_size=3)
    rl = plan_rl_batches(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=4, micro_batch_size=2,
                         rollout_micro_batch_size=8, world_size=2, num_prompts=32, ring_size=2)
    assert rl.grad_accum_steps == 2  # 4 samples / (2 per micro-batch x 1 data-parallel rank)
