"""A vLLM CPU engine's KV cache is sized to the rollout (rollout/vllm_memory.py): hand-worked sizes,
the user's ``VLLM_CPU_KVCACHE_SPACE`` kept, and a sized engine that holds exactly that cache, is
resident-smaller than the 1 GiB one and generates the same greedy tokens."""

import json
import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from rlhforge.config.parsing import from_dict
from rlhforge.config.rl import RLConfig
from rlhforge.rollout.vllm_memory import (MAX_BYTES, MIN_BYTES, cpu_kv_cache_bytes, engine_kv_cache_bytes,
                                          kv_bytes_per_token, rollout_seqs_per_engine)

# the benchmark's model: 4 layers, 8 heads of 32 dims, 4 KV heads
BENCH = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def test_bytes_per_token_and_the_size_between_its_bounds():
    assert kv_bytes_per_token(BENCH, "float32") == 4 * 2 * 4 * 32 * 4 == 4096
    assert kv_bytes_per_token(BENCH, "bfloat16") == 2048
    # 100 sequences of 1024 tokens: 8 blocks of 128 + 1 spare each = 1152 tokens
    assert cpu_kv_cache_bytes(BENCH, "float32", 1024, 100) == 100 * 1152 * 4096 == 471_859_200
    # 32 sequences of 192 tokens: (2 + 1) blocks each -> 48 MiB in fp32, 24 MiB in bf16
    assert cpu_kv_cache_bytes(BENCH, "float32", 192, 32) == 32 * 384 * 4096 == 48 << 20
    assert cpu_kv_cache_bytes(BENCH, "bfloat16", 192, 32) == 24 << 20
    # 4 sequences of 192 tokens in bf16: 3 MiB, raised to the floor (16 MiB)
    assert 4 * 384 * 2048 < MIN_BYTES == cpu_kv_cache_bytes(BENCH, "bfloat16", 192, 4) == 16 << 20
    assert cpu_kv_cache_bytes(BENCH, "float32", 4096, 2000) == MAX_BYTES  # capped at the old fixed 1 GiB


def _cfg(tiny_model_dir, **overrides):
    return from_dict(RLConfig, {"actor.model_name_or_path": str(tiny_model_dir), "rollout.batch_size": 16,
                                "rollout.n_samples_per_prompt": 8, **overrides})


def test_the_rollout_sets_the_sequences_and_the_users_setting_wins(tiny_model_dir, monkeypatch):
    assert rollout_seqs_per_engine(_cfg(tiny_model_dir)) == 16 * 8
    assert rollout_seqs_per_engine(_cfg(tiny_model_dir, **{"vllm.num_engines": 3})) == 43  # ceil(128 / 3)
    # async: the next batch may be generated while this one finishes; oversampling: a call's prompts
    assert rollout_seqs_per_engine(_cfg(tiny_model_dir, **{"train.async_enable": True})) == 16 * 8 * 2
    assert rollout_seqs_per_engine(_cfg(tiny_model_dir, **{"rollout.vllm_generate_batch_size": 24})) == 24 * 8
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    sized = engine_kv_cache_bytes(_cfg(tiny_model_dir, **{"rollout.batch_size": 4}), "float32", 2048)
    assert sized == cpu_kv_cache_bytes(config, "float32", 2048, 4 * 8)
    assert MIN_BYTES < sized < MAX_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engine_kv_cache_bytes(_cfg(tiny_model_dir), "float32", 2048) is None


CHILD = """
import asyncio, json, sys
from transformers import AutoTokenizer
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.vllm_engine import VLLMEngine
def peak_rss_gb():  # VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20
model, size = sys.argv[1], (int(sys.argv[2]) or None)
tok = AutoTokenizer.from_pretrained(model)
engine = VLLMEngine.from_tokenizer(model, tok, max_model_len=128, kv_cache_bytes=size)
prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for t in ("What is 3 + 4?", "hello world")]
outs = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0)))
cc = engine.llm.llm_engine.vllm_config.cache_config
print(json.dumps({"bytes": cc.kv_cache_memory_bytes, "blocks": cc.num_gpu_blocks, "tokens": [o.token_ids for o in outs],
                  "rss_gb": peak_rss_gb()}))
"""


@pytest.mark.timeout(300)
def test_a_sized_engine_holds_that_cache_and_generates_the_same(vllm, tiny_model_dir):
    from transformers import AutoConfig

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(tiny_model_dir), "float32")

    def run(size):  # a process each: peak RSS is per process
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir), str(size)], env=env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    sized, fixed = run(MIN_BYTES), run(0)
    assert sized["bytes"] == MIN_BYTES and fixed["bytes"] == MAX_BYTES
    assert sized["blocks"] * 128 * per_token == MIN_BYTES and fixed["blocks"] == sized["blocks"] * 64
    assert sized["tokens"] == fixed["tokens"] and all(len(t) > 0 for t in sized["tokens"])
    assert fixed["rss_gb"] - sized["rss_gb"] > 0.7  # the 1 GiB cache was resident; 16 MiB now
