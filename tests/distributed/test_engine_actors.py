"""vLLM engines as Ray actors (vLLM's CPU build in each actor), 2 actor ranks under ZeRO-3 on the
2-CPU local Ray cluster (``--train.colocate_all``: ranks and engines share the two bundles).

- a run with engine actors equals the same run with the engines in the driver (rewards equal,
  losses within 1e-4), and both engines serve requests;
- after a sync over the collective group (and over the object store), every engine's weights
  fingerprint equals that of the actor's weights and of the exported model, and greedy tokens equal
  those of an engine loaded from the export;
- an engine actor killed mid-generation: the batch completes, ``rollout/engine_restarts`` is 1, and
  the restarted engine holds the current weights.
"""

import asyncio
import threading
import time

import pytest
import torch

from rlhforge.cli.train_ppo_ray import build_trainer, main, parse_rl_args
from rlhforge.rollout.engine import SamplingParams
from tests.rl.helpers import metrics, per_step, rl_args, write_reward

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("vllm")]

RAY = ["--ds.strategy", "deepspeed", "--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2",
       "--train.colocate_all", "--vllm.num_engines", "2"]


def _args(model, out, reward, *extra, steps=2):
    return rl_args(model, out, "--reward.remote_url", reward, "--algo.kl.init_coef", "0", "--ds.packing_samples",
                   *extra, steps=steps)


def _export_fingerprint(folder) -> str:
    from safetensors.torch import load_file

    from rlhforge.backend.collective import state_fingerprint

    state = load_file(folder / "model.safetensors")
    if "lm_head.weight" not in state:  # tied embeddings: the export stores them once, the sync sends both names
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state_fingerprint(state)


def test_engine_actors_match_the_in_driver_engines(ray_cluster, tiny_model_dir, tmp_path):
    reward = str(write_reward(tmp_path / "r.py"))
    driver = tmp_path / "driver"
    assert main(_args(tiny_model_dir, driver, reward, "--train.workers", "local", "--vllm.num_engines", "2")) == 0
    actors = tmp_path / "actors"
    assert main(_args(tiny_model_dir, actors, reward, *RAY)) == 0
    assert per_step(actors, "rollout/reward_mean") == per_step(driver, "rollout/reward_mean")
    for key in ("actor/policy_loss", "actor/grad_norm"):
        a, b = per_step(driver, key), per_step(actors, key)
        assert a.keys() == b.keys() == {1, 2}
        for step in a:
            assert b[step] == pytest.approx(a[step], abs=1e-4), (key, step)
    assert any(abs(v) > 1e-4 for v in per_step(driver, "actor/policy_loss").values())  # a real update
    last = metrics(actors)[-1]
    assert last["rollout/engine0_requests"] > 0 and last["rollout/engine1_requests"] > 0
    assert last["rollout/engine0_requests"] + last["rollout/engine1_requests"] == 8  # 4 prompts x 2 samples
    assert last["rollout/engine_restarts"] == 0
    assert "rollout/engine0_requests" not in metrics(driver)[-1]


@pytest.fixture(scope="module", params=["collective", "object_store"])
def trained(request, ray_cluster, tiny_model_dir, tmp_path_factory):
    """A 1-step run with engine actors, kept alive (trainer, its export folder)."""
    out = tmp_path_factory.mktemp(f"ea_{request.param}")
    reward = str(write_reward(out / "r.py"))
    extra = ["--vllm.sync_with_ray"] if request.param == "object_store" else []
    cfg = parse_rl_args(_args(tiny_model_dir, out / "run", reward, *RAY, *extra, "--actor.adam.lr", "5e-3",
                              "--eval.max_new_tokens", "150", steps=1))  # engines hold 150+ tokens (kill test)
    trainer = build_trainer(cfg)
    trainer.fit()
    yield trainer, out / "run"
    trainer.logger.close()
    trainer.engine.close()
    from rlhforge.distributed.launch import close_groups

    close_groups(trainer.actor, trainer.ref, trainer.critic)


def _greedy(engine, prompts, n=8):
    params = [SamplingParams(max_new_tokens=n, temperature=0.0)] * len(prompts)
    return [o.token_ids for o in asyncio.run(engine.generate(prompts, params))]


def test_sync_fingerprints_and_greedy_tokens_equal_the_export(trained, tiny_model_dir):
    from rlhforge.models.loading import load_tokenizer
    from rlhforge.rollout.vllm_engine import VLLMEngine

    trainer, run_dir = trained
    engine = trainer.engine
    engine.fingerprint_syncs = True
    trainer.sync_weights()  # the weights after the update, again, now with fingerprints
    actor_fp = trainer.actor.call("weights_fingerprint")[0]
    assert engine.last_fingerprints == [actor_fp, actor_fp]
    assert actor_fp == _export_fingerprint(run_dir)  # what the engines hold is what was exported
    assert actor_fp != _export_fingerprint(tiny_model_dir)  # the update did change the weights
    tok = load_tokenizer(str(run_dir))
    prompts = [tok.encode(t) for t in ("What is 3 + 4?", "hello world", "sort 3 1 2", "x y z")]
    reference = VLLMEngine.from_tokenizer(str(run_dir), tok, max_model_len=64)
    try:
        assert _greedy(engine, prompts) == _greedy(reference, prompts)
    finally:
        reference.close()


@pytest.mark.parametrize("trained", ["collective"], indirect=True)
def test_killed_engine_is_restarted_with_the_current_weights(trained):
    import ray

    trainer, _ = trained
    engine = trainer.engine
    engine.fingerprint_syncs = True
    trainer.sync_weights()
    current = engine.last_fingerprints[0]
    victim = engine.engines[0]
    prompts = [[5 + i, 9, 11 + i] for i in range(8)]
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=i) for i in range(8)]  # long: killed mid-way

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while victim.load == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        ray.kill(victim.handle, no_restart=True)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    outs = asyncio.run(engine.generate(prompts, params))
    killer.join()
    assert len(outs) == 8 and all(len(o.token_ids) > 0 for o in outs)
    m = engine.step_metrics()
    assert m["rollout/engine_restarts"] == 1 and m["rollout/engines_alive"] == 2
    assert victim.restarts == 1
    # the restarted engine loaded the current weights (object store from rank 0), and serves
    assert ray.get(victim.handle.fingerprint.remote()) == current
    again = asyncio.run(engine.generate(prompts, params))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # per-request seeds, same weights
    # the next sync rebuilds the group with the new actor and reaches both engines
    trainer.sync_weights()
    assert engine.last_fingerprints == [current, current]
