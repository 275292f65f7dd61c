"""Start-up refusals added by issue 30's review of the GPU paths (each names the flags and the reason)."""

import pytest

from rlhforge.cli.train_ppo_ray import parse_rl_args
from rlhforge.config.parsing import ConfigError
from tests.rl.helpers import rl_args


def _cfg(tmp_path, *extra):
    return rl_args("/nonexistent/model", tmp_path / "run", *extra)


def test_async_training_with_colocation_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--train.async_enable with --train.colocate_all"):
        parse_rl_args(_cfg(tmp_path, "--train.async_enable", "--train.colocate_all"))


@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_fp16_without_loss_scaling_is_refused(tmp_path, strategy):
    with pytest.raises(ConfigError, match=f"fp16 with the {strategy} strategy: it has no loss scaling"):
        parse_rl_args(_cfg(tmp_path, "--ds.strategy", strategy, "--ds.param_dtype", "fp16"))


def test_fp16_is_refused_for_sft_too(tmp_path):
    from rlhforge.config.parsing import parse_args
    from rlhforge.config.sft import SFTConfig

    with pytest.raises(ConfigError, match="fp16 with the torch strategy"):
        parse_args(SFTConfig, ["--model.model_name_or_path", "x", "--data.dataset", "builtin:arithmetic",
                               "--ds.param_dtype", "fp16"])


def test_fp16_under_deepspeed_is_accepted(tmp_path):
    cfg = parse_rl_args(_cfg(tmp_path, "--ds.strategy", "deepspeed", "--ds.param_dtype", "fp16"))
    assert cfg.ds.param_dtype == "fp16"


def test_ray_driver_never_takes_a_gpu_outside_rays_accounting(tmp_path, tiny_model_dir, monkeypatch):
    """With Ray workers on a GPU machine and no vLLM engine actors, the driver's HF engine would sit on
    cuda:0 beside actor rank 0 without Ray knowing: refused before Ray starts or any model loads."""
    import rlhforge.cli.train_ppo_ray as cli

    monkeypatch.setattr(cli, "_cuda_here", lambda: True)  # the probe of this machine's CUDA, as on a GPU node
    cfg = parse_rl_args(rl_args(tiny_model_dir, tmp_path / "run", "--actor.num_gpus_per_node", "2",
                                "--train.workers", "ray"))
    with pytest.raises(ConfigError, match="outside Ray's GPU accounting"):
        cli.build_trainer(cfg)


def test_every_model_group_releases_cached_memory_before_the_engines_wake(tmp_path):
    """Issue 30, bug 3: with vLLM's sleep mode a waking engine re-maps its start-up KV allocation into the GPU's
    free memory (it does not re-size it: gpu-review-2 F1), so every model group first hands its cached blocks
    back (the call order is what is checked here: on CPU there is no cache to release and vLLM has no sleep
    mode)."""
    from rlhforge.trainers.rl import RLTrainer

    calls = []

    class Group:  # records what the trainer asks of a worker group, in order
        def __init__(self, name):
            self.name = name

        def call(self, method, *args):
            calls.append((self.name, method))
            return [0]

    class Engine:
        def wake_up(self):
            calls.append(("engine", "wake_up"))

    trainer = RLTrainer.__new__(RLTrainer)
    trainer.actor, trainer.critic, trainer.ref, trainer.reward_group = (Group("actor"), Group("critic"),
                                                                        Group("ref"), None)
    trainer.engine = Engine()
    for sleep, expected in ((True, [("actor", "release_cached_memory"), ("critic", "release_cached_memory"),
                                    ("ref", "release_cached_memory"), ("engine", "wake_up")]),
                            (False, [("engine", "wake_up")])):
        trainer.cfg = parse_rl_args(_cfg(tmp_path, *(["--vllm.enable_sleep", "--vllm.num_engines", "1"]
                                                     if sleep else [])), validate=False)
        calls.clear()
        trainer._wake_engine()
        assert calls == expected


@pytest.mark.parametrize("path", ["sync_from", "update_weights"])
def test_every_model_group_releases_cached_memory_before_a_sync_wakes_the_engines_weights(tmp_path, path):
    """Review 2, F5: with vLLM's sleep mode a sync wakes the engines' weights (``_wake_weights``) next to the
    models' caching allocators, so every model group first hands its cached blocks back, before ``sync_from``
    (engine actors) or ``update_weights`` (in-driver engines). Call order only (CPU: nothing to release)."""
    from rlhforge.trainers.rl import RLTrainer
    from rlhforge.trainers.rl.checkpoints import RLState

    calls = []

    class Group:
        def __init__(self, name):
            self.name = name

        def call(self, method, *args):
            calls.append((self.name, method))
            return [None]

        def gather_weights(self):
            calls.append((self.name, "gather_weights"))
            return {}

    class Engine:  # no sync reports, no probe: a test double the trainer does not check
        def update_weights(self, state):
            calls.append(("engine", "update_weights"))

    class ActorEngines(Engine):
        def sync_from(self, actor):
            calls.append(("engine", "sync_from"))

    trainer = RLTrainer.__new__(RLTrainer)
    trainer.actor, trainer.critic, trainer.ref, trainer.reward_group = (Group("actor"), Group("critic"),
                                                                        Group("ref"), Group("reward"))
    trainer.engine = ActorEngines() if path == "sync_from" else Engine()
    trainer.state = RLState()
    release = [(g, "release_cached_memory") for g in ("actor", "critic", "ref", "reward")]
    for sleep in (True, False):
        trainer.cfg = parse_rl_args(_cfg(tmp_path, "--vllm.num_engines", "1", *(["--vllm.enable_sleep"] if sleep
                                                                                 else [])), validate=False)
        calls.clear()
        trainer.sync_weights()
        synced = [c for c in calls if c[0] == "engine"]
        assert synced == [("engine", path)]
        before = calls[: calls.index(synced[0])]
        assert [c for c in before if c[1] == "release_cached_memory"] == (release if sleep else [])
        assert all(c[1] != "release_cached_memory" for c in calls[calls.index(synced[0]):])


def test_deepspeed_sleep_with_zero_0_is_refused_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match="--ds.enable_sleep under DeepSpeed needs --ds.zero_stage 1-3"):
        parse_rl_args(_cfg(tmp_path, "--ds.strategy", "deepspeed", "--ds.zero_stage", "0", "--ds.enable_sleep"))
    cfg = parse_rl_args(_cfg(tmp_path, "--ds.strategy", "deepspeed", "--ds.zero_stage", "3", "--ds.enable_sleep"))
    assert cfg.ds.enable_sleep and cfg.ds.zero_stage == 3
