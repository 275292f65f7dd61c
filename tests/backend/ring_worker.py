"""Run under torchrun (gloo, CPU): ring attention and a ring-parallel tiny Llama vs one-rank references.

Usage: torchrun --nproc_per_node R ring_worker.py OUT.pt
Every rank computes the one-rank reference itself (same seeds) and the ring result; rank 0 writes
{name: (ring, reference)} pairs of tensors for the test to compare.
"""

import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from rlhforge.backend.context_parallel import gather_ring, ring_token_logprobs, single_ring, slice_packed, use_ring_attention
from rlhforge.backend.ring_attention import TorchBlockKernel, ring_attention

LENGTHS = [6, 4, 3]  # 13 tokens, padded to the ring; ring 2: sample 1 straddles the slices of 7; ring 3: sample 0 those of 5


def packed_batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    loss_mask = torch.ones(1, sum(LENGTHS))
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    loss_mask[0, starts] = 0.0
    return {"input_ids": ids, "position_ids": pos, "loss_mask": loss_mask, "seq_lens": LENGTHS}


def block_causal_sdpa(q, k, v, lengths, window=None):
    """Reference: full row, SDPA with a block-diagonal causal mask (and sliding window), GQA by repeating K/V."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = seq.numel()
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    if window is not None:
        allowed &= (torch.arange(n)[:, None] - torch.arange(n)[None, :]) < window
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed)[0]


def attention_cases(ring, results):
    n = sum(LENGTHS)
    for hq, hk, stride, window in [(4, 2, 0, None), (4, 2, 1, None), (4, 4, 0, None), (6, 3, 2, None), (4, 2, 0, 3)]:
        g = torch.Generator().manual_seed(hq * 10 + hk)
        q, k, v = (torch.randn(h, n, 32, generator=g, requires_grad=True) for h in (hq, hk, hk))
        w = torch.randn(hq, n, 32, generator=g)
        ref = block_causal_sdpa(q, k, v, LENGTHS, window)
        (ref * w).sum().backward()
        batch = {"input_ids": torch.zeros(1, n, dtype=torch.long), "position_ids": packed_batch(50)["position_ids"]}
        part = slice_packed(batch, dataclasses.replace(ring, head_stride=stride))
        width = part.input_ids.shape[1]
        a = ring.ring_rank * width

        def local(x):
            padded = torch.cat([x.detach(), x.new_zeros(x.shape[0], width * ring.ring_size - n, x.shape[2])], 1)
            return padded[:, a : a + width].clone().requires_grad_(True)

        ql, kl, vl = local(q), local(k), local(v)
        out = ring_attention(ql, kl, vl, part.layout, kernel=TorchBlockKernel(), window=window)
        w_local = torch.cat([w, w.new_zeros(hq, width * ring.ring_size - n, 32)], 1)[:, a : a + width]
        (out * w_local).sum().backward()
        name = f"attn_h{hq}_kv{hk}_stride{stride}" + (f"_window{window}" if window else "")
        gathered = [gather_ring(t.transpose(0, 1)[None].detach().contiguous(), ring)[0, :n].transpose(0, 1)
                    for t in (out, ql.grad, kl.grad, vl.grad)]
        for key, mine, theirs in zip(("out", "dq", "dk", "dv"), gathered, (ref, q.grad, k.grad, v.grad)):
            results[f"{name}_{key}"] = (mine, theirs.detach())


def model_case(ring, results):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhforge.models.forward import token_logprobs

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).float()
    ringed = LlamaForCausalLM(copy.deepcopy(config)).float()
    ringed.load_state_dict(reference.state_dict())
    use_ring_attention(ringed)
    batch = packed_batch(config.vocab_size)
    mask = batch["loss_mask"]

    ref_logps, ref_logits = token_logprobs(reference, batch, return_logits=True)
    (-(ref_logps * mask).sum() / mask.sum()).backward()
    logps = ring_token_logprobs(ringed, batch, ring)
    (-(logps * mask).sum() / mask.sum()).backward()
    results["model_logps"] = (logps.detach(), ref_logps.detach())

    part = slice_packed(batch, ring)
    from rlhforge.backend.ring_attention import ring_layout_active

    with torch.no_grad(), ring_layout_active(part.layout):
        local_logits = ringed(input_ids=part.input_ids, position_ids=part.position_ids, use_cache=False).logits
    results["model_logits"] = (gather_ring(local_logits, ring)[:, : sum(LENGTHS)], ref_logits.detach())
    with torch.no_grad():  # control: one causal row without sample boundaries must differ
        whole = reference(input_ids=batch["input_ids"], position_ids=torch.arange(sum(LENGTHS))[None], use_cache=False)
    results["control_unpacked_logits"] = (whole.logits, ref_logits.detach())
    for name, p in ringed.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=ring.group)  # the ring's partial gradients sum to the row's gradient
        results[f"grad_{name}"] = (grad, dict(reference.named_parameters())[name].grad)


FAMILIES = {  # transformers config class, fields beyond the shared tiny sizes
    "qwen2": ("Qwen2Config", {}), "qwen3": ("Qwen3Config", {}), "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {"original_max_position_embeddings": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # one sliding layer (window 4 < the samples' 6 tokens: it bites) and one full layer
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": 4, "query_pre_attn_scalar": 32,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
}


def families_case(ring, results):
    """Other HF families through the attention interface: log-probs equal the one-rank sdpa forward."""
    import transformers

    from rlhforge.models.forward import token_logprobs

    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, head_dim=32, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    batch = packed_batch(97)
    for name, (cls, extra) in FAMILIES.items():
        config = getattr(transformers, cls)(**sizes, **extra)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config).float()
        ringed = copy.deepcopy(reference)
        use_ring_attention(ringed)
        try:
            results[f"family_{name}"] = (ring_token_logprobs(ringed, batch, ring).detach(),
                                         token_logprobs(reference, batch).detach())
        except ValueError as err:
            results[f"family_{name}"] = str(err)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ring = single_ring()
    results = {}
    attention_cases(ring, results)
    model_case(ring, results)
    families_case(ring, results)
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
