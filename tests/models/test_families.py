"""The model-family matrix: every ``rlhforge tiny-model --arch`` family trains, exports and syncs.

For each family (llama, qwen2, qwen3, gemma3_text, mistral, phi3, qwen3_moe, mixtral; hidden 64,
head_dim 32, 2 layers, 4 experts top-2 for the MoE ones), through the real CLIs:

- SFT (2 steps) and GRPO with the HF engine (2 steps; MoE with ``--actor.aux_loss_coef``, logged
  as ``actor/aux_loss``) change the weights, and the export reloads with ``from_pretrained`` to
  exactly the tensors on disk (checkpoint layout: MoE experts per expert, Gemma's head tied);
- DPO (2 steps) starts at loss log 2 (policy == reference) and the MoE families log
  ``train/aux_loss``;
- LoRA's default targets (``all-linear``) are each family's projections (Phi-3's fused
  ``qkv_proj``/``gate_up_proj``; for MoE the attention only: transformers 5 keeps experts as fused
  3-D parameters and the router is not an ``nn.Linear``), never the head or the embeddings, and the
  weight-sync merge gives the PEFT model's logits;
- vLLM (CPU build, every family here): greedy tokens equal HF's before and after a weight sync of
  trained weights (MoE expert names mapped to the checkpoint layout, the CPU experts repacked), and
  GRPO with a vLLM engine samples step 2 from the synced weights (rollout log-probs == trainer's).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.models.tiny import ARCHS, MOE_ARCHS, TinyModelSpec, build_tiny_model
from tests.rl.helpers import metrics, rl_args, write_reward

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                     moe_intermediate_size=64, tie_word_embeddings=False)

#: LoRA's default targets per family (module leaf names)
DENSE_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LORA_TARGETS = {arch: DENSE_TARGETS for arch in ARCHS}
LORA_TARGETS.update(phi3={"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
                    qwen3_moe={"q_proj", "k_proj", "v_proj", "o_proj"},
                    mixtral={"q_proj", "k_proj", "v_proj", "o_proj"})


@pytest.fixture(scope="module", params=list(ARCHS))
def family(request, tmp_path_factory):
    arch = request.param
    return arch, build_tiny_model(tmp_path_factory.mktemp(arch) / "model", SPEC, arch=arch)


def test_cli_tiny_model_arch_and_unknown_name(tmp_path, capsys):
    from rlhforge.cli.tiny_model import main

    assert main(["--out", str(tmp_path / "m"), "--arch", "phi3", "--spec.hidden_size", "64",
                 "--spec.num_attention_heads", "2", "--spec.num_key_value_heads", "1",
                 "--spec.num_hidden_layers", "1"]) == 0
    assert '"model_type": "phi3"' in (tmp_path / "m" / "config.json").read_text()
    assert main(["--out", str(tmp_path / "x"), "--arch", "gpt9"]) == 2
    assert ("unknown --arch 'gpt9'; valid: llama, qwen2, qwen3, gemma3_text, mistral, phi3, qwen3_moe, mixtral (text); "
            "vision-language: qwen2_vl, qwen2_5_vl, qwen3_vl") in capsys.readouterr().err


def _check_export(arch, out, initial):
    """The export reloads to exactly the tensors on disk, and training changed them."""
    from transformers import AutoModelForCausalLM

    from rlhforge.models.moe import checkpoint_names

    disk = load_file(out / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.model_type == arch
    again = dict(checkpoint_names(model.state_dict().items(), model))
    assert set(disk) <= set(again) and set(again) - set(disk) <= {"lm_head.weight"}
    assert all(torch.equal(again[k], disk[k]) for k in disk)
    if arch == "gemma3_text":  # tied: one tensor after reloading (the export may also write the head: the same values)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        embed = disk["model.embed_tokens.weight"]
        assert torch.equal(disk.get("lm_head.weight", embed), embed)
    if arch in MOE_ARCHS:
        assert any(".experts.3." in k for k in disk)  # per-expert checkpoint names
    before = load_file(initial / "model.safetensors")
    assert sum(not torch.equal(before[k], disk[k]) for k in before) >= len(before) // 2


def test_sft_trains_and_exports(family, tmp_path):
    from rlhforge.cli.train_sft import main as sft_main
    from tests.trainers.sft_helpers import sft_args, write_sft_data

    arch, model_dir = family
    data = write_sft_data(tmp_path / "train.jsonl", n=16)
    out = tmp_path / "sft"
    assert sft_main(sft_args(model_dir, data, out, "--train.max_steps", "2", "--logger.progress_bar", "off")) == 0
    losses = [r["train/loss"] for r in metrics(out) if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    _check_export(arch, out, model_dir)


def test_dpo_starts_at_log2(family, tmp_path):
    from rlhforge.cli.main import main as rlhforge_main

    arch, model_dir = family
    out = tmp_path / "dpo"
    aux = ["--model.aux_loss_coef", "0.01"] if arch in MOE_ARCHS else []
    assert rlhforge_main(["dpo", "--model.model_name_or_path", str(model_dir), "--data.dataset",
                          "builtin:arithmetic_preference?n=8", "--data.prompt_key", "prompt", "--data.input_template",
                          "Q: {}\nA: ", "--train.batch_size", "4", "--train.micro_batch_size", "4",
                          "--ckpt.output_dir", str(out), "--logger.progress_bar", "off", *aux]) == 0
    rows = [r for r in metrics(out) if "train/loss" in r]
    assert len(rows) == 2 and rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert ("train/aux_loss" in rows[0]) == bool(aux)
    if aux:
        assert 1.8 < rows[0]["train/aux_loss"] < 4.0  # ~top_k on random routers
    _check_export(arch, out, model_dir)


def test_grpo_two_steps_with_the_hf_engine(family, tmp_path):
    from rlhforge.cli.train_ppo_ray import main as rl_main

    arch, model_dir = family
    out = tmp_path / "grpo"
    aux = ["--actor.aux_loss_coef", "0.01"] if arch in MOE_ARCHS else []
    reward = write_reward(tmp_path / "reward.py")  # varied rewards: non-zero advantages on a random model
    assert rl_main(rl_args(model_dir, out, "--reward.remote_url", reward, *aux, steps=2)) == 0
    rows = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["actor/policy_loss"]) for r in rows)
    assert ("actor/aux_loss" in rows[0]) == bool(aux)
    if aux:
        assert 1.8 < rows[0]["actor/aux_loss"] < 4.0
    _check_export(arch, out, model_dir)


def test_lora_default_targets_and_sync_merge(family):
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from rlhforge.config.parsing import parse_args
    from rlhforge.config.sft import SFTConfig
    from rlhforge.models.export import merged_lora_state
    from rlhforge.models.loading import load_causal_lm

    arch, model_dir = family
    cfg = parse_args(SFTConfig, ["--model.model_name_or_path", str(model_dir), "--data.dataset", "x.jsonl",
                                 "--ds.lora.rank", "4"])
    torch.manual_seed(0)
    peft_model = load_causal_lm(str(model_dir), cfg.model, cfg.ds, torch.device("cpu"))
    layers = {name: m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    assert {n.rsplit(".", 1)[-1] for n in layers} == LORA_TARGETS[arch]
    assert len(layers) == len(LORA_TARGETS[arch]) * SPEC.num_hidden_layers
    with torch.no_grad():  # adapters that do something (B starts at 0)
        for m in layers.values():
            m.lora_B["default"].weight.normal_(0, 0.2)
    merged = merged_lora_state(peft_model.state_dict(), peft_model)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert set(merged) == set(base.state_dict())
    base.load_state_dict(merged)
    ids = torch.tensor([[5, 17, 99, 240, 7, 31]])
    with torch.no_grad():
        expected, got = peft_model(ids).logits, base(ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits, atol=1e-3)


# --------------------------------------------------------------------------------------------- vLLM

@pytest.fixture(scope="module")
def engine(family, vllm):
    from transformers import AutoTokenizer

    from rlhforge.rollout.vllm_engine import VLLMEngine

    _, model_dir = family
    eng = VLLMEngine.from_tokenizer(str(model_dir), AutoTokenizer.from_pretrained(model_dir), max_model_len=128)
    yield eng
    eng.close()


TEXTS = ["What is 3 + 4?", "hello world", "sort 3 1 2", "Reverse the letters: abc"]


def test_vllm_greedy_equals_hf_after_syncing_trained_weights(family, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    arch, model_dir = family
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for t in TEXTS]
    greedy = [SamplingParams(max_new_tokens=8, temperature=0.0)] * len(prompts)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = [o.token_ids for o in asyncio.run(engine.generate(prompts, greedy))]
    assert before == [o.token_ids for o in HFEngine.from_model(model, tok).generate_sync(prompts, greedy)]

    target = tok("The answer is 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(6):  # a few steps towards one answer: every weight moves, the greedy outputs change
        for p in prompts[:2]:
            ids = torch.tensor([p + target])
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    trained = [o.token_ids for o in HFEngine.from_model(model, tok).generate_sync(prompts, greedy)]
    assert trained != before
    engine.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert [o.token_ids for o in asyncio.run(engine.generate(prompts, greedy))] == trained


def test_grpo_two_steps_with_a_vllm_engine(family, vllm, tmp_path):
    from rlhforge.cli.train_ppo_ray import main as rl_main

    arch, model_dir = family
    out = tmp_path / "grpo_vllm"
    aux = ["--actor.aux_loss_coef", "0.01"] if arch in MOE_ARCHS else []
    reward = write_reward(tmp_path / "reward.py")
    assert rl_main(rl_args(model_dir, out, "--reward.remote_url", reward, "--vllm.num_engines", "1",
                           "--vllm.enforce_eager", *aux, steps=2)) == 0
    diffs = [r["rollout/logprob_diff_rollout_vs_train"] for r in metrics(out)
             if "rollout/logprob_diff_rollout_vs_train" in r]
    # step 1 samples from the weights on disk, step 2 from the weights synced after step 1
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs
    _check_export(arch, out, model_dir)


def test_cli_tiny_model_preset_says_its_size_on_disk(tmp_path, capsys, monkeypatch):
    """Issue 47, item 9: ``--preset qwen3-0.6b`` writes 2.3 GB; the line says how much was written."""
    import rlhforge.models.tiny as tiny
    from rlhforge.cli.tiny_model import main

    monkeypatch.setitem(tiny.PRESETS, "test-small", ("llama", tiny.TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)))
    assert main(["--out", str(tmp_path / "m"), "--preset", "test-small"]) == 0
    size = sum(f.stat().st_size for f in (tmp_path / "m").rglob("*") if f.is_file()) / 1e9
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[rlhforge] test-small (llama, hidden 64, 1 layers") and line.endswith(
        f"written to {tmp_path / 'm'}: {size:.2f} GB on disk")
