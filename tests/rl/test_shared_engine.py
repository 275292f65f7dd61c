"""``--rollout.hf_engine_weights auto`` (the default): a one-process run whose HF engine would hold an exact copy
of the actor (fp32, torch strategy, no LoRA, synchronous) generates with the actor's own module instead, as TRL
does: no second copy, nothing to sync. The run must be the same computation as with ``copy``: the same tokens,
rewards, losses and final weights, step for step."""

import pytest
import torch

from tests.rl.helpers import metrics, rl_args, write_reward


def _run(tiny_model_dir, out, mode, *extra):
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args

    reward = write_reward(out.parent / f"reward_{out.name}.py")  # varied rewards: the weights move every step
    cfg = parse_rl_args(rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--rollout.hf_engine_weights",
                                mode, *extra, steps=3))
    trainer = build_trainer(cfg)
    try:
        shared = trainer.engine.model is trainer.actor.workers[0].strategy.module
        trainer.fit()
    finally:
        trainer.logger.close()
    return shared, trainer


def test_a_shared_engine_trains_exactly_as_an_engine_with_its_own_copy(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    shared, trainer = _run(tiny_model_dir, tmp_path / "auto", "auto")
    copied, _ = _run(tiny_model_dir, tmp_path / "copy", "copy")
    assert shared and trainer.engine.shared and not copied
    keys = ("rollout/response_length", "rollout/reward_mean", "policy_loss", "actor/grad_norm")
    auto_rows = [r for r in metrics(tmp_path / "auto") if "timing/broadcast" in r]
    copy_rows = [r for r in metrics(tmp_path / "copy") if "timing/broadcast" in r]
    assert len(auto_rows) == len(copy_rows) == 3
    for a, c in zip(auto_rows, copy_rows):
        for k in keys:
            if k in c:
                assert a[k] == c[k], (a["step"], k)
        assert "sync/probe_logprob_diff" in c and not any(k.startswith("sync/probe") for k in a)
    assert any(k in copy_rows[0] for k in keys[2:])  # a loss was compared, not only the rollout
    a, c = load_file(tmp_path / "auto" / "model.safetensors"), load_file(tmp_path / "copy" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert any(not torch.equal(a[k], initial[k]) for k in initial)  # the three steps changed the weights


def test_other_runs_keep_a_copy(tiny_model_dir, tmp_path):
    """A bf16 engine decodes a bf16 copy of fp32 master weights: not the same computation, so no sharing."""
    shared, trainer = _run(tiny_model_dir, tmp_path / "bf16", "auto", "--ds.param_dtype", "bf16")
    assert not shared and not trainer.engine.shared


def test_generation_leaves_the_modules_as_training_left_them(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    model.model.embed_tokens.eval()  # a module the trainer keeps in eval mode (a frozen tower, say)
    engine = HFEngine.from_model(model, tok, share=True)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    out = engine.generate_sync([[5, 6, 7]], greedy)
    reference = HFEngine.from_model(model, tok).generate_sync([[5, 6, 7]], greedy)  # an eval-mode copy
    assert [o.token_ids for o in out] == [o.token_ids for o in reference]
    assert model.training and model.model.layers[0].training and not model.model.embed_tokens.training
    assert all(p.requires_grad for p in model.parameters())  # the trainer's parameters still train
    with pytest.raises(RuntimeError, match="own module"):  # a sync into it must not pass silently
        engine.update_weights(model.state_dict())
