"""The MoE load-balancing loss (``--model.aux_loss_coef`` / ``--actor.aux_loss_coef``) and
``--ds.experts_implementation`` on tiny Qwen3-MoE and Mixtral models.

- the loss :func:`token_logprobs(..., return_aux_loss=True)` returns equals transformers' own
  ``load_balancing_loss_func`` recomputed from the router logits of a separate forward (padded
  batch, padding masked), and its gradient on the router weights equals the gradient of that
  recomputation;
- packed batches computed in bounded rows give the padded batch's loss (the rows' padding is not
  counted; transformers' unmasked loss on the same rows differs, which is why the mask is ours);
- SFT and RM with a coefficient log ``train/aux_loss`` (RM: equal packed and padded), report the
  same first-step loss as without it, and move the router weights differently; a dense model prints
  one notice and trains as with 0;
- experts implementations give the same logits; unknown and CUDA-only names are refused.
"""

from __future__ import annotations

import pytest
import torch

from rlhforge.models.forward import token_logprobs
from rlhforge.models.moe import load_balancing_loss, moe_routing, router_modules
from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                     moe_intermediate_size=64, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param) / "model", SPEC, arch=request.param)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _samples():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (9, 4, 7, 3)]


def _padded(seqs):
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding, as rollouts are
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _packed(seqs):
    return {"input_ids": torch.tensor([sum(seqs, [])]),
            "position_ids": torch.tensor([sum((list(range(len(s))) for s in seqs), [])]),
            "seq_lens": [len(s) for s in seqs]}


def _router_grads(model):
    return torch.cat([m.weight.grad.flatten() for _, m in router_modules(model)])


def test_aux_loss_equals_transformers_recomputation_and_reaches_the_router(moe_dir):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = _model(moe_dir)
    num_experts, top_k = moe_routing(model)
    batch = _padded(_samples())
    _, aux = token_logprobs(model, batch, return_aux_loss=True)
    aux.backward()
    ours = _router_grads(model).clone()
    model.zero_grad()

    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids,
                use_cache=False, output_router_logits=True)
    ref = load_balancing_loss_func(out.router_logits, num_experts, top_k, batch["attention_mask"])
    ref.backward()
    assert len(out.router_logits) == SPEC.num_hidden_layers == len(router_modules(model))
    aux = aux.detach()
    assert float(aux) == pytest.approx(float(ref), abs=1e-6)
    assert float(aux) == pytest.approx(float(out.aux_loss), abs=1e-6)  # the model's own (unscaled) value
    assert top_k * 0.9 < float(aux) < num_experts  # near balanced (k) on random routers, far from collapse (E)
    theirs = _router_grads(model)
    assert ours.abs().max() > 1e-4  # the gradient reaches every router ...
    assert torch.allclose(ours, theirs, atol=1e-6)  # ... and is transformers' gradient


def test_aux_loss_by_hand_on_two_tokens():
    # E=2, k=1, one layer; logits favour expert 0 then expert 1: f = (1/2, 1/2); P_0 = (p + 1 - q) / 2
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    p, q = torch.softmax(logits[0], 0)[0], torch.softmax(logits[1], 0)[1]
    expected = 2 * (0.5 * (p + 1 - q) / 2 + 0.5 * (1 - p + q) / 2)
    assert float(load_balancing_loss((logits,), 2, 1)) == pytest.approx(float(expected), abs=1e-7)
    # masking the second token: f = (1, 0), P_0 = p -> 2 * p
    masked = load_balancing_loss((logits,), 2, 1, torch.tensor([1.0, 0.0]))
    assert float(masked) == pytest.approx(float(2 * p), abs=1e-7)


def test_packed_rows_count_only_real_tokens(moe_dir):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from rlhforge.models.forward import packed_model_inputs

    model = _model(moe_dir)
    seqs = _samples()
    with torch.no_grad():
        _, padded = token_logprobs(model, _padded(seqs), return_aux_loss=True)
        _, packed = token_logprobs(model, _packed(seqs), return_aux_loss=True)
        kwargs, rows = packed_model_inputs(model, _packed(seqs))
        assert rows is not None and rows.input_ids.numel() > sum(map(len, seqs))  # the rows hold padding
        unmasked = load_balancing_loss_func(model(**kwargs, output_router_logits=True).router_logits,
                                            *moe_routing(model), None)
    assert float(packed) == pytest.approx(float(padded), abs=1e-5)
    assert abs(float(unmasked) - float(padded)) > 1e-4  # counting the rows' padding would be wrong


def _sft(model_dir, data, out, *extra):
    from rlhforge.cli.train_sft import main as sft_main
    from tests.trainers.sft_helpers import sft_args

    assert sft_main(sft_args(model_dir, data, out, "--train.max_steps", "2", "--logger.progress_bar", "off",
                             *extra)) == 0
    from tests.rl.helpers import metrics

    return [r for r in metrics(out) if "train/loss" in r]


def test_sft_adds_the_aux_loss_and_moves_the_router(moe_dir, tmp_path):
    from safetensors.torch import load_file

    from tests.trainers.sft_helpers import write_sft_data

    data = write_sft_data(tmp_path / "train.jsonl", n=16)
    plain = _sft(moe_dir, data, tmp_path / "plain")
    aux = _sft(moe_dir, data, tmp_path / "aux", "--model.aux_loss_coef", "1.0")
    assert "train/aux_loss" not in plain[0]
    assert 1.8 < aux[0]["train/aux_loss"] < 4.0  # ~top_k on random routers
    assert aux[0]["train/loss"] == pytest.approx(plain[0]["train/loss"], abs=1e-6)  # same weights, NLL only
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "aux" / "model.safetensors")
    gates = [k for k in a if k.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))]  # the routers
    assert len(gates) == SPEC.num_hidden_layers
    assert all((a[k] - b[k]).abs().max() > 1e-6 for k in gates)


def test_dense_model_prints_one_notice_and_trains_as_without(tiny_model_dir, tmp_path, capfd):
    from tests.trainers.sft_helpers import write_sft_data

    data = write_sft_data(tmp_path / "train.jsonl", n=16)
    plain = _sft(tiny_model_dir, data, tmp_path / "plain")
    capfd.readouterr()
    coef = _sft(tiny_model_dir, data, tmp_path / "coef", "--model.aux_loss_coef", "0.5")
    err = capfd.readouterr().err
    assert err.count("--model.aux_loss_coef 0.5 has no effect") == 1 and "LlamaConfig" in err
    assert [r["train/loss"] for r in coef] == [r["train/loss"] for r in plain]
    assert "train/aux_loss" not in coef[0]


def test_experts_implementations_agree(moe_dir):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([_samples()[0]])
    logits = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, experts_implementation=impl)
        assert model.config._experts_implementation == impl
        with torch.no_grad():
            logits[impl] = model(ids).logits
    assert torch.allclose(logits["eager"], logits["batched_mm"], atol=1e-5)
    assert torch.allclose(logits["eager"], logits["grouped_mm"], atol=1e-5)


def test_experts_implementation_flag_is_validated_and_passed_through(moe_dir, tmp_path):
    from rlhforge.config.parsing import ConfigError, parse_args
    from rlhforge.config.sft import SFTConfig
    from rlhforge.models.loading import load_causal_lm

    base = ["--model.model_name_or_path", str(moe_dir), "--data.dataset", "x.jsonl"]
    with pytest.raises(ConfigError, match="'fast' is not one of transformers' experts implementations: eager, "):
        parse_args(SFTConfig, base + ["--ds.experts_implementation", "fast"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sonicmoe needs a CUDA GPU"):
            parse_args(SFTConfig, base + ["--ds.experts_implementation", "sonicmoe"])
    with pytest.raises(ConfigError, match="aux_loss_coef must be >= 0"):
        parse_args(SFTConfig, base + ["--model.aux_loss_coef", "-1"])
    cfg = parse_args(SFTConfig, base + ["--ds.experts_implementation", "batched_mm"])
    model = load_causal_lm(str(moe_dir), cfg.model, cfg.ds, torch.device("cpu"))
    assert model.config._experts_implementation == "batched_mm"


def test_reward_model_adds_the_aux_loss_packed_and_padded(moe_dir, tmp_path):
    """RM: ``train/aux_loss`` is logged (hooks on the routers: the classification head drops the router
    logits), equal for packed and padded batches, and the routers move differently than without it."""
    from safetensors.torch import load_file

    from rlhforge.cli.main import main as rlhforge_main
    from tests.rl.helpers import metrics

    def run(out, *extra):
        assert rlhforge_main(["rm", "--model.model_name_or_path", str(moe_dir), "--data.dataset",
                              "builtin:arithmetic_preference?n=8", "--data.prompt_key", "prompt",
                              "--data.input_template", "Q: {}\nA: ", "--train.batch_size", "4",
                              "--train.micro_batch_size", "2", "--adam.lr", "1e-3",
                              "--ckpt.output_dir", str(out), "--logger.progress_bar", "off", *extra]) == 0
        return [r for r in metrics(out) if "train/loss" in r]

    plain = run(tmp_path / "plain")
    padded = run(tmp_path / "padded", "--model.aux_loss_coef", "1.0")
    packed = run(tmp_path / "packed", "--model.aux_loss_coef", "1.0", "--ds.packing_samples")
    assert "train/aux_loss" not in plain[0] and 1.8 < padded[0]["train/aux_loss"] < 4.0
    assert packed[0]["train/aux_loss"] == pytest.approx(padded[0]["train/aux_loss"], abs=1e-5)
    assert padded[0]["train/loss"] == pytest.approx(plain[0]["train/loss"], abs=1e-6)
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "padded" / "model.safetensors")
    gates = [k for k in a if k.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))]
    assert len(gates) == SPEC.num_hidden_layers and all((a[k] - b[k]).abs().max() > 1e-6 for k in gates)
