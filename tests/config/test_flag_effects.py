"""Every accepted flag of ``rlhforge rl`` (and of sft / rm / dpo), walked from the config dataclasses,
is one of three things in the base run (one process, HF engine, built-in reward):

- ``works``: it does what OpenRLHF's flag does (the table is the claim; :data:`PROOFS` names tests
  that prove a sample of them);
- ``refused``: a non-default value ends the command at start-up: exit 2, one line naming the flag;
- ``notice``: a non-default value prints exactly one ``[rlhforge] note: --flag ... has no effect: why``
  line (an OpenRLHF knob that means nothing in this run; several work in another context, which the
  line names: DeepSpeed-only ``--ds.*`` with ``--ds.strategy deepspeed``, ``--vllm.*`` with
  ``--vllm.num_engines``, ``--reward.api_key`` with an HTTP reward server).

Each ``refused`` / ``notice`` flag must be named in docs/rl.md's "OpenRLHF compatibility" section or
docs/config.md. A new flag fails :func:`test_every_flag_is_classified` until it is put in a table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhforge.cli.train_dpo import main as dpo_main
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.cli.train_ppo_ray import parse_rl_args
from rlhforge.cli.train_rm import RM_LEGACY_ALIASES
from rlhforge.cli.train_rm import main as rm_main
from rlhforge.cli.train_sft import main as sft_main
from rlhforge.config.dpo import DPOConfig
from rlhforge.config.parsing import ConfigError, from_dict, parse_args
from rlhforge.config.rl import RLConfig
from rlhforge.config.rm import RMConfig
from rlhforge.config.sft import SFTConfig
from tests.flag_tables import dataclass_flags, flag_argv, non_default_value, refused_line

ROOT = Path(__file__).parents[2]
MISSING = "/nonexistent/model"  # reaching the model load would say "model folder not found"

# --------------------------------------------------------------------------------------------- rl

RL_BASE = ["--actor.model_name_or_path", MISSING, "--data.prompt_dataset", "builtin:arithmetic",
           "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8"]

RL_REFUSED = [
    "--ds.deepcompile", "--ds.use_liger_kernel", "--use_ms",
    # on-policy distillation's teacher without --algo.advantage.estimator on_policy_distill
    "--teacher.model_name_or_path",
]
RL_NOTICE = [
    # always in this project
    "--data.dataloader_num_workers",
    # without --train.enable_ema
    "--train.ema_beta",
    # without --train.dynamic_batch_enable (fixed micro-batches)
    "--train.max_tokens_per_gpu", "--rollout.max_tokens_per_gpu",
    # without --algo.kl.use_loss (the KL is a reward penalty)
    "--algo.kl.unbiased_gradient",
    # without --actor.optim muon / --critic.optim muon
    *[f"--{role}.muon.{name}" for role in ("actor", "critic") for name in ("lr", "momentum", "ns_steps", "nesterov")],
    # without Ray workers, a critic and a reward model (--reward.offload: without a reward model)
    "--train.colocate_critic_reward", "--reward.num_nodes", "--reward.num_gpus_per_node", "--reward.offload",
    # DeepSpeed-only: when no worker group runs DeepSpeed (one process -> plain torch)
    "--ds.zero_stage", "--ds.zpg", "--ds.adam_offload", "--ds.overlap_comm", "--ds.grad_accum_dtype",
    "--ds.use_universal_ckpt",
    # without --vllm.num_engines (the HF engine) / without Ray workers
    "--vllm.tensor_parallel_size", "--vllm.enable_prefix_caching", "--vllm.enforce_eager", "--vllm.enable_sleep",
    "--vllm.gpu_memory_utilization", "--vllm.sync_with_ray", "--vllm.sync_bucket_mb", "--vllm.sync_backend",
    "--vllm.max_restarts", "--vllm.request_timeout_s",
    # without an HTTP reward server
    "--reward.api_key", "--reward.wait_for_server_s",
    # without --ds.ring_attn_size > 1
    "--ds.ring_attn_head_stride",
    # without the --actor.policy_loss_type that reads it (the base run is ppo; config/rl_losses.py)
    *[f"--actor.policy_loss.{name}" for name in (
        "cispo_eps_low", "cispo_eps_high", "sapo_tau_pos", "sapo_tau_neg", "dppo_delta_low", "dppo_delta_high",
        "dppo_ratio_cap", "dro_beta", "gmpo_eps_low", "gmpo_eps_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
        "kl_cov_ratio", "ppo_kl_coef")],
    # without --algo.advantage.estimator on_policy_distill (config/rl_distill.py)
    *[f"--algo.distill.{name}" for name in ("mode", "coef", "env_reward_coef", "discount", "topk")],
    "--teacher.num_nodes", "--teacher.num_gpus_per_node", "--teacher.offload",
]
#: values for flags whose automatic non-default value would not show the point
RL_VALUES = {"--ds.experts_implementation": ["eager"], "--ds.grad_accum_dtype": ["fp32"], "--vllm.sync_backend": ["gloo"],
             "--ds.zero_stage": ["3"], "--ds.zpg": ["8"], "--reward.api_key": ["s3cret"]}


def _table(flags, refused, notice) -> dict[str, str]:
    table = {f: "works" for f in flags}
    table.update({f: "refused" for f in refused})
    table.update({f: "notice" for f in notice})
    return table


RL_FLAGS = dataclass_flags(RLConfig)
RL_TABLE = _table(RL_FLAGS, RL_REFUSED, RL_NOTICE)

#: "works" flags proven by other tests: flag -> test file that sets the flag and checks its effect
PROOFS = {
    "--algo.kl.target": "tests/rl/test_rl_train.py",  # the adaptive controller moves rollout/kl_coef
    "--critic.freezing_steps": "tests/rl/test_rl_train.py",  # actor/frozen is 1 then 0
    "--critic.save_value_network": "tests/rl/test_rl_train.py",  # critic/model.safetensors is written
    "--algo.kl.use_loss": "tests/rl/test_rl_train.py",  # actor/kl_loss is logged
    "--algo.kl.unbiased_gradient": "tests/algorithms/test_kl_unbiased.py",  # gradient by hand and in expectation
    "--algo.dynamic_filtering_enable": "tests/rl/test_rl_train.py",  # filter pass rate in (0, 1]
    "--ds.ring_attn_size": "tests/distributed/test_ray_ring.py",  # 2 ring ranks = the 1-process run
    "--ds.tensor_parallel_size": "tests/distributed/test_ray_autotp.py",  # 2 AutoTP ranks = the 1-process run
    "--train.dynamic_batch_enable": "tests/rl/test_dynamic_batching.py",
    "--ds.use_universal_ckpt": "tests/backend/test_universal_ckpt.py",
    "--actor.aux_loss_coef": "tests/models/test_families.py",  # actor/aux_loss logged in GRPO on MoE
    "--ds.experts_implementation": "tests/models/test_moe_aux.py",  # validated, passed to from_pretrained
    "--rollout.vllm_generate_batch_size": "tests/rl/test_oversampling.py",  # prompts counted across steps and a resume  # 2 ranks -> 1: weights, moments, losses  # equal loss/grads, fewer passes
    "--ckpt.save_steps": "tests/rl/test_rl_train.py",
    "--ckpt.max_num": "tests/rl/test_rl_train.py",
    "--train.async_enable": "tests/distributed/test_async.py",
    "--vllm.num_engines": "tests/rl/test_vllm_engine.py",
    "--reward.remote_url": "tests/rewards/test_reward_api_key.py",
    "--reward.api_key": "tests/rewards/test_reward_api_key.py",  # works with an HTTP server (noticed without)
    "--reward.wait_for_server_s": "tests/config/test_startup_errors.py",
    "--logger.logging_steps": "tests/config/test_startup_errors.py",
    "--ref.offload": "tests/rl/test_ref_precision.py",  # offload/reload counts, log-probs unchanged
    "--reward.offload": "tests/distributed/test_reward_group.py",
    "--reward.num_gpus_per_node": "tests/distributed/test_reward_group.py",  # a 2-rank Ray reward group
    "--train.colocate_critic_reward": "tests/distributed/test_reward_group.py",
    "--actor.policy_loss_type": "tests/rl/test_rl_losses.py",  # each loss trains 2 steps, its metric logged
    "--algo.advantage.estimator": "tests/rl/test_opd.py",  # on_policy_distill: the reward is the teacher gap
    "--rollout.hf_decode": "tests/rl/test_graph_decode.py",  # graphs: the eager tokens; refused for an unsupported model
}


def _named_in_docs(flag: str, *docs: str) -> bool:
    return any(re.search(re.escape(flag) + r"(?![\w.])", text) for text in docs)


def _rl_docs() -> tuple[str, str]:
    rl = (ROOT / "docs" / "rl.md").read_text()
    section = rl.split("## OpenRLHF compatibility", 1)[1].split("\n## ", 1)[0]
    return section, (ROOT / "docs" / "config.md").read_text()


def test_every_flag_is_classified():
    assert set(RL_REFUSED) <= set(RL_FLAGS) and set(RL_NOTICE) <= set(RL_FLAGS)
    assert not set(RL_REFUSED) & set(RL_NOTICE)
    assert len(RL_FLAGS) > 150
    for name, (sft_table, cls) in COMMAND_TABLES.items():
        assert set(sft_table) == set(dataclass_flags(cls)), name


def test_refused_and_notice_flags_are_documented():
    docs = _rl_docs()
    missing = [f for f, kind in RL_TABLE.items() if kind != "works" and not _named_in_docs(f, *docs)]
    assert missing == [], "name these rl flags in docs/rl.md (OpenRLHF compatibility) or docs/config.md"
    config_md = (ROOT / "docs" / "config.md").read_text()
    for name, (table, _cls) in COMMAND_TABLES.items():
        missing = [f for f, kind in table.items() if kind != "works" and not _named_in_docs(f, config_md)]
        assert missing == [], f"name these {name} flags in docs/config.md"


def _value(flags, flag, values) -> list[str]:
    if flag in values:
        return [flag, *values[flag]]
    tp, default = flags[flag]
    tokens, _ = non_default_value(tp, default)
    return flag_argv(flag, tokens)


def _notice_lines(text: str, flag: str) -> list[str]:
    return [x for x in text.splitlines() if "has no effect" in x and re.search(re.escape(flag) + r"(?![\w.])", x)]


@pytest.mark.parametrize("flag", RL_REFUSED)
def test_rl_refused_flags_exit_2_naming_the_flag(flag, capsys):
    line = refused_line(rl_main, [*RL_BASE, *_value(RL_FLAGS, flag, RL_VALUES)], capsys)
    assert flag in line, line


def test_rl_notice_flags_print_exactly_one_line(capsys):
    capsys.readouterr()
    parse_rl_args(RL_BASE)
    base = capsys.readouterr()
    assert "has no effect" not in base.out + base.err  # the base run prints no notice
    for flag in RL_NOTICE:
        parse_rl_args([*RL_BASE, *_value(RL_FLAGS, flag, RL_VALUES)])
        out = capsys.readouterr()
        lines = _notice_lines(out.err, flag)
        assert len(lines) == 1 and lines[0].startswith("[rlhforge] note: "), (flag, out.err)
        assert len([x for x in out.err.splitlines() if "has no effect" in x]) == 1, (flag, out.err)


def test_rl_works_flags_print_no_notice(capsys):
    """A non-default value of each "works" flag validates (or meets a rule that names it, e.g. a
    critic-only flag without a critic) and never prints a "has no effect" line. The base has an HTTP
    reward URL here so that the reward-server flags have their context (nothing is contacted)."""
    base = {"actor.model_name_or_path": "m", "data.prompt_dataset": "builtin:arithmetic",
            "reward.remote_url": "http://127.0.0.1:1/get_reward", "rollout.batch_size": 8, "train.batch_size": 8}
    for flag, kind in RL_TABLE.items():
        if kind != "works":
            continue
        tp, default = RL_FLAGS[flag]
        value = non_default_value(tp, default)
        if value is None:
            continue  # e.g. --actor.optim: adam is its only choice
        capsys.readouterr()
        try:
            from_dict(RLConfig, {**base, flag[2:]: value[1]}).validate()
        except ConfigError as err:
            assert flag.rsplit(".", 1)[-1].lstrip("-") in str(err), (flag, err)
        out = capsys.readouterr()
        assert not _notice_lines(out.out + out.err, flag), (flag, out.err)


def test_works_samples_have_proving_tests():
    for flag, path in PROOFS.items():
        assert RL_TABLE[flag] in ("works", "notice"), flag
        text = (ROOT / path).read_text()
        assert flag in text, (flag, path)


# --------------------------------------------------------------------------------------------- sft / rm / dpo

TRAIN_BASE = ["--model.model_name_or_path", MISSING, "--data.dataset", "builtin:arithmetic"]
COMMON_REFUSED = ["--ds.deepcompile", "--ds.use_liger_kernel", "--ds.tensor_parallel_size", "--use_ms"]
COMMON_NOTICE = ["--ds.zero_stage", "--ds.zpg", "--ds.adam_offload", "--ds.overlap_comm", "--ds.grad_accum_dtype",
                 "--ds.use_universal_ckpt",
                 "--data.dataloader_num_workers", "--optim.muon.lr", "--optim.muon.momentum", "--optim.muon.ns_steps",
                 "--optim.muon.nesterov"]
PREFERENCE_REFUSED = ["--model.pretrain_mode_enable"]
# ring attention runs in sft, rm and dpo (tests/trainers/test_{sft,rm,dpo}_ring.py); the head stride alone does nothing
TRAIN_NOTICE = COMMON_NOTICE + ["--ds.ring_attn_head_stride"]
COMMAND_TABLES = {
    "sft": (_table(dataclass_flags(SFTConfig), COMMON_REFUSED, TRAIN_NOTICE), SFTConfig),
    "rm": (_table(dataclass_flags(RMConfig), COMMON_REFUSED + PREFERENCE_REFUSED, TRAIN_NOTICE), RMConfig),
    "dpo": (_table(dataclass_flags(DPOConfig), COMMON_REFUSED + PREFERENCE_REFUSED, TRAIN_NOTICE), DPOConfig),
}
MAINS = {"sft": sft_main, "rm": rm_main, "dpo": dpo_main}


@pytest.mark.parametrize("command, flag", [(c, f) for c, (t, _) in COMMAND_TABLES.items() for f, k in t.items()
                                           if k == "refused"])
def test_train_refused_flags_exit_2_naming_the_flag(command, flag, capsys):
    flags = dataclass_flags(COMMAND_TABLES[command][1])
    line = refused_line(MAINS[command], [*TRAIN_BASE, *_value(flags, flag, RL_VALUES)], capsys)
    assert flag in line, line


@pytest.mark.parametrize("command", list(COMMAND_TABLES))
def test_train_notice_flags_print_exactly_one_line(command, capsys):
    table, cls = COMMAND_TABLES[command]
    flags = dataclass_flags(cls)
    legacy = RM_LEGACY_ALIASES if command == "rm" else None
    capsys.readouterr()
    parse_args(cls, TRAIN_BASE, legacy=legacy)
    assert "has no effect" not in capsys.readouterr().err
    for flag in (f for f, k in table.items() if k == "notice"):
        parse_args(cls, [*TRAIN_BASE, *_value(flags, flag, RL_VALUES)], legacy=legacy)
        err = capsys.readouterr().err
        assert len(_notice_lines(err, flag)) == 1, (flag, err)
        assert len([x for x in err.splitlines() if "has no effect" in x]) == 1, (flag, err)


def test_train_deepspeed_flags_are_silent_when_deepspeed_runs(monkeypatch, capsys):
    """The same --ds.* knobs print nothing where DeepSpeed reads them (several processes, or asked for)."""
    argv = [*TRAIN_BASE, "--ds.zero_stage", "3", "--ds.adam_offload", "--ds.overlap_comm", "--ds.zpg", "2",
            "--ds.grad_accum_dtype", "fp32"]
    capsys.readouterr()
    parse_args(SFTConfig, [*argv, "--ds.strategy", "deepspeed"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    parse_args(SFTConfig, argv)
    assert "has no effect" not in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    parse_args(SFTConfig, [*argv, "--ds.strategy", "fsdp2"])
    lines = capsys.readouterr().err.splitlines()
    assert len([x for x in lines if "has no effect" in x and "fsdp2" in x]) == 5
    # rl: Ray worker groups of 2 run DeepSpeed, so nothing is printed there either
    parse_rl_args([*RL_BASE, "--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"])
    assert "--ds.zero_stage" not in capsys.readouterr().err
