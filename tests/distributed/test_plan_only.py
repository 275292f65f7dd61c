"""The placement plan (engines, colocation, the resource check) and ``--train.plan_only``."""

from __future__ import annotations

import json

import pytest

from rlhforge.cli.train_ppo_ray import check_environment, parse_rl_args
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.config.parsing import ConfigError
from rlhforge.distributed.placement import EnginePlacement, check_resources, plan_placement
from rlhforge.distributed.plan_report import (
    GIB,
    MemoryEstimate,
    count_parameters,
    frozen_memory,
    memory_rows,
    train_memory,
)
from tests.flag_tables import refused_line

SEED = {"actor": 8, "ref": 8, "critic": 8, "reward": 8}


def test_engines_get_their_own_groups_without_colocation():
    p = plan_placement(SEED, device="cuda", num_engines=4, engine_tp=2)
    assert p.bundles == {"actor": 8, "ref": 8, "critic": 8, "reward": 8,
                         "engine0": 2, "engine1": 2, "engine2": 2, "engine3": 2}
    assert p.total_bundles == 40
    assert p.engines[3] == EnginePlacement(index=3, pg="engine3", bundle_indices=(0, 1), share=1.0)
    assert all(g.share == 1.0 for g in p.groups.values())


def test_defaults_keep_the_old_plans():
    p = plan_placement({"actor": 2, "ref": 2, "critic": 2}, device="cpu", colocate_all=True)
    assert p.bundles == {"all": 2} and p.engines == () and p.groups["actor"].share == pytest.approx(1 / 3)


def test_colocate_all_puts_engines_on_consecutive_bundles():
    p = plan_placement(SEED, device="cuda", colocate_all=True, num_engines=4, engine_tp=2)
    assert p.bundles == {"all": 8}
    assert [e.bundle_indices for e in p.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # 4 models + the engines (one member) share each bundle: 1/5 each, as OpenRLHF's 0.2
    assert {g.share for g in p.groups.values()} == {0.2} and {e.share for e in p.engines} == {0.2}
    assert p.members("all")[:4] == ["actor", "ref", "critic", "reward"]
    # GRPO: no critic, no reward model -> actor + ref + engines
    p = plan_placement({"actor": 8, "ref": 8}, device="cuda", colocate_all=True, num_engines=8, engine_tp=1)
    assert p.engines[7].bundle_indices == (7,) and p.engines[0].share == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match=r"4 engines x TP 4 = 16 bundles, but the shared group has 8"):
        plan_placement(SEED, device="cuda", colocate_all=True, num_engines=4, engine_tp=4)


def test_colocate_critic_reward():
    p = plan_placement(SEED, device="cuda", colocate_critic_reward=True, colocate_actor_ref=True)
    assert p.bundles == {"actor": 8, "critic": 8}
    assert p.groups["reward"].pg == "critic" and p.groups["reward"].share == 0.5 and p.groups["ref"].pg == "actor"
    with pytest.raises(ConfigError, match=r"colocate_critic_reward needs as many reward workers as critic workers "
                                          r"\(critic 8, reward 4\)"):
        plan_placement({"actor": 8, "critic": 8, "reward": 4}, device="cuda", colocate_critic_reward=True)
    # no critic (GRPO): the reward model keeps its own group
    assert plan_placement({"actor": 2, "reward": 2}, device="cpu", colocate_critic_reward=True).bundles == \
        {"actor": 2, "reward": 2}


def test_resource_check_spells_out_the_arithmetic():
    p = plan_placement(SEED, device="cuda", num_engines=4, engine_tp=2)
    with pytest.raises(ConfigError) as err:
        check_resources(p, {"GPU": 8.0, "CPU": 16.0})
    assert str(err.value) == ("the Ray workers need 40 GPU bundle(s): 4 engines x TP 2 = 8 GPUs plus actor 8 + ref 8 + "
                              "critic 8 + reward 8 without colocation = 40; the Ray cluster has 8 free GPU(s): "
                              "add --train.colocate_all")
    # the flag that would make it fit: colocating actor + ref is enough here
    p = plan_placement({"actor": 2, "ref": 2, "critic": 2}, device="cpu")
    with pytest.raises(ConfigError, match=r"= 6; the Ray cluster has 4 free CPU\(s\): add --train.colocate_actor_ref$"):
        check_resources(p, {"CPU": 4.0})
    # nothing would make it fit
    p = plan_placement(SEED, device="cuda", colocate_all=True, num_engines=4, engine_tp=2)
    with pytest.raises(ConfigError, match=r"\(actor \+ ref \+ critic \+ reward \+ 4 engines x TP 2 sharing 8\) with "
                                          r"--train.colocate_all = 8; the Ray cluster has 4 free GPU\(s\): use fewer"):
        check_resources(p, {"GPU": 4.0, "CPU": 16.0})
    check_resources(p, {"GPU": 8.0, "CPU": 16.0})
    with pytest.raises(ConfigError, match=r"has 4 free CPU\(s\) for them"):
        check_resources(p, {"GPU": 8.0, "CPU": 4.0})


# --------------------------------------------------------------------------------------------- memory arithmetic


# hidden 64, 2 layers, 4 heads (head_dim 16), 2 kv heads, intermediate 128, vocab 256, untied
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "tie_word_embeddings": False}
# embed 256*64 = 16384; per layer q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288, mlp 3*64*128 = 24576,
# 2 norms 128 -> 36992, x2 = 73984; final norm 64; lm_head 16384
TINY_PARAMS = 16384 + 73984 + 64 + 16384  # 106816
TINY_VALUE_PARAMS = TINY_PARAMS - 16384 + 64  # the lm_head replaced by a 64 -> 1 score head: 90496
# LoRA r=8 on every linear but the head: r*(in+out) for q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128,
# down 128+64 -> 8*(128+96+96+128+192+192+192) = 8192 per layer, x2
TINY_LORA = 16384

# Llama-3-8B: embed 128256*4096 = 525336576; per layer attention 2*4096*4096 + 2*4096*1024 = 41943040,
# mlp 3*4096*14336 = 176160768, norms 8192 -> 218112000, x32; final norm 4096; lm_head 525336576
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LLAMA8B_PARAMS = 2 * 525336576 + 32 * 218112000 + 4096  # 8030261248
LLAMA8B_VALUE_PARAMS = LLAMA8B_PARAMS - 525336576 + 4096  # 7504928768


def _folder(tmp_path, name, config) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))  # no weights: a plan never reads them
    return str(d)


def test_parameter_counts_from_config_json_alone(tmp_path):
    d = _folder(tmp_path, "tiny", TINY)
    assert count_parameters(d) == (TINY_PARAMS, TINY_PARAMS)
    assert count_parameters(d, value_model=True) == (TINY_VALUE_PARAMS, TINY_VALUE_PARAMS)
    assert count_parameters(d, lora_rank=8) == (TINY_PARAMS, TINY_LORA)
    assert count_parameters(d, value_model=True, lora_rank=8) == (TINY_VALUE_PARAMS, TINY_LORA + 64)  # + the head
    assert count_parameters(d, lora_rank=8, lora_targets=("q_proj", "v_proj")) == (TINY_PARAMS, 2 * 8 * (128 + 96))
    assert count_parameters(str(tmp_path / "missing")) is None and count_parameters(None) is None


def test_memory_per_device_under_zero_stages():
    P, N = TINY_PARAMS, 4  # bf16: 2 bytes; Adam 12 bytes per parameter (fp32 master + 2 moments)
    assert train_memory(P, P, world=N, zero_stage=0, dtype_bytes=2) == MemoryEstimate(2 * P, 2 * P, 12 * P)
    assert train_memory(P, P, world=N, zero_stage=1, dtype_bytes=2) == MemoryEstimate(2 * P, 2 * P, 12 * P / N)
    assert train_memory(P, P, world=N, zero_stage=2, dtype_bytes=2) == MemoryEstimate(2 * P, 2 * P / N, 12 * P / N)
    assert train_memory(P, P, world=N, zero_stage=3, dtype_bytes=2) == MemoryEstimate(2 * P / N, 2 * P / N, 12 * P / N)
    assert train_memory(P, P, world=N, zero_stage=3, dtype_bytes=2).device == 427264  # (2 + 2 + 12) * 106816 / 4
    off = train_memory(P, P, world=N, zero_stage=2, dtype_bytes=2, adam_offload=True)
    assert off == MemoryEstimate(2 * P, 2 * P / N, 0.0, 12 * P / N) and off.device == 213632 + 53408
    assert train_memory(P, P, world=1, zero_stage=0, dtype_bytes=4) == MemoryEstimate(4 * P, 4 * P, 8 * P)  # fp32
    assert train_memory(P, TINY_LORA, world=N, zero_stage=2, dtype_bytes=2) == \
        MemoryEstimate(2 * P, 2 * TINY_LORA / N, 12 * TINY_LORA / N)
    assert frozen_memory(P, world=N, zero_stage=2, dtype_bytes=2) == MemoryEstimate(2 * P)
    assert frozen_memory(P, world=N, zero_stage=3, dtype_bytes=2) == MemoryEstimate(2 * P / N)


def test_rows_of_a_colocated_plan_and_unreadable_configs():
    plan = plan_placement({"actor": 2, "ref": 2}, device="cuda", colocate_all=True, num_engines=1, engine_tp=2)
    rows = memory_rows(plan, {"actor": (100, 100), "ref": None}, dtype_bytes=2, zero_stage=3, adam_offload=False)
    assert [(r.name, r.bundles, r.share) for r in rows] == [("actor", (0, 1), 1 / 3), ("ref", (0, 1), 1 / 3),
                                                            ("engine 0", (0, 1), 1 / 3)]
    assert rows[0].memory == MemoryEstimate(100.0, 100.0, 600.0) and rows[1].memory is None
    assert rows[2].memory == MemoryEstimate(100.0) and rows[2].engine_tp == 2  # 100 params x 2 bytes / TP 2


# --------------------------------------------------------------------------------------------- --train.plan_only


#: the shared 2-CPU cluster of tests/distributed/conftest.py (re-made after this module if it was up)
_SHARED_INIT = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")


@pytest.fixture(scope="module")
def gpu8_cluster(ray_module):
    """Ray declared as one 8-GPU node (Ray accepts declared resources; nothing touches a GPU)."""
    ray = ray_module
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    ray.init(num_cpus=16, num_gpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()
    if was_up:  # the session fixture `ray_cluster` already yielded; give later modules its cluster back
        ray.init(**_SHARED_INIT)


def _seed_argv(model, *, grpo=False, colocate=True):
    argv = ["--actor.model_name_or_path", model, "--data.prompt_dataset", "builtin:arithmetic",
            "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8",
            "--reward.num_gpus_per_node", "8", "--reward.model_name_or_path", model,
            "--vllm.num_engines", "4", "--vllm.tensor_parallel_size", "2", "--vllm.gpu_memory_utilization", "0.5",
            "--vllm.enable_sleep", "--ds.enable_sleep", "--algo.kl.init_coef", "0.01", "--train.plan_only"]
    if grpo:
        argv += ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8"]
    else:
        argv += ["--critic.num_gpus_per_node", "8", "--critic.model_name_or_path", model,
                 "--algo.advantage.estimator", "gae"]
    return argv + (["--train.colocate_all"] if colocate else [])


def _row(out: str, name: str) -> str:
    lines = [x for x in out.splitlines() if x.strip().startswith(name + " ")]
    assert len(lines) == 1, out
    return lines[0]


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("plan"), "llama8b", LLAMA8B)


def test_plan_only_plans_the_seed_ppo_command(gpu8_cluster, llama8b, capsys):
    assert rl_main(_seed_argv(llama8b)) == 0
    out = capsys.readouterr().out
    assert "placement plan: 8 GPU bundle(s) in 1 placement group(s)" in out
    for i, span in enumerate(["0-1", "2-3", "4-5", "6-7"]):
        row = _row(out, f"engine {i}")
        assert f" all      {span} TP 2 0.2 " in row, row  # group, bundles, GPU fraction (5 members: 1/5)
        assert f"weights {_gib(LLAMA8B_PARAMS * 2 / 2)} GiB inside vLLM's 0.5 x device memory" in row
    # bf16, DeepSpeed ZeRO-2 (the default stage) over 8 ranks
    actor = train_memory(LLAMA8B_PARAMS, LLAMA8B_PARAMS, world=8, zero_stage=2, dtype_bytes=2)
    critic = train_memory(LLAMA8B_VALUE_PARAMS, LLAMA8B_VALUE_PARAMS, world=8, zero_stage=2, dtype_bytes=2)
    ref = frozen_memory(LLAMA8B_PARAMS, world=8, zero_stage=2, dtype_bytes=2)
    reward = frozen_memory(LLAMA8B_VALUE_PARAMS, world=8, zero_stage=2, dtype_bytes=2)
    assert f"params {_gib(actor.params)} + grads {_gib(actor.grads)} + optimizer {_gib(actor.optimizer)} = " \
           f"{_gib(actor.device)} GiB" in _row(out, "actor")
    assert _gib(actor.device) == "28.05" and "0-7 x8   0.2" in _row(out, "actor")
    assert f"= {_gib(critic.device)} GiB" in _row(out, "critic") and "7.50B" in _row(out, "critic")
    assert f"params {_gib(ref.params)} = " in _row(out, "ref")
    assert f"params {_gib(reward.params)} = " in _row(out, "reward")
    total = actor.device + critic.device + ref.device + reward.device
    assert (f"total per device, group all (8 bundle(s)): {_gib(total)} GiB of models (actor + ref + critic + reward)"
            f" + vLLM's 0.5 x device memory (4 engine(s) x TP 2)") in out
    assert "Ray placed 1 placement group(s)" in out and "no weights loaded" in out
    assert gpu8_cluster.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in gpu8_cluster.util.placement_group_table().values())


def test_plan_only_plans_the_grpo_variant_under_zero3_with_offload(gpu8_cluster, llama8b, capsys):
    assert rl_main([*_seed_argv(llama8b, grpo=True), "--ds.zero_stage", "3", "--ds.adam_offload"]) == 0
    out = capsys.readouterr().out
    assert "critic" not in out
    assert " all      6-7 TP 2 0.25 " in _row(out, "engine 3")  # actor + ref + reward + the engines: 1/4
    actor = train_memory(LLAMA8B_PARAMS, LLAMA8B_PARAMS, world=8, zero_stage=3, dtype_bytes=2, adam_offload=True)
    assert actor.optimizer == 0 and actor.host_optimizer == 12 * LLAMA8B_PARAMS / 8
    assert (f"params {_gib(actor.params)} + grads {_gib(actor.grads)} + optimizer 0.00 = {_gib(actor.device)} GiB "
            f"(+ optimizer {_gib(actor.host_optimizer)} GiB per rank in host memory: --ds.adam_offload)") \
        in _row(out, "actor")
    ref = frozen_memory(LLAMA8B_PARAMS, world=8, zero_stage=3, dtype_bytes=2)  # sharded like the actor
    assert f"params {_gib(ref.params)} = " in _row(out, "ref")


def test_plan_only_refuses_an_over_full_plan_with_the_arithmetic(gpu8_cluster, llama8b, capsys):
    line = refused_line(rl_main, _seed_argv(llama8b, colocate=False), capsys)
    assert ("4 engines x TP 2 = 8 GPUs plus actor 8 + ref 8 + critic 8 + reward 8 without colocation = 40; "
            "the Ray cluster has 8 free GPU(s): add --train.colocate_all") in line


def test_plan_only_without_readable_configs_still_plans(gpu8_cluster, tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    assert rl_main([*_seed_argv(missing, grpo=True), "--ds.param_dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "n/a (config.json not readable)" in _row(out, "actor") and "n/a GiB of models" in out
    assert " 0-1 TP 2 0.25 " in _row(out, "engine 0")


def test_plan_only_skips_the_checks_that_need_vllm_and_the_hardware(monkeypatch, llama8b):
    """A CPU machine with vLLM's CPU build refuses --vllm.enable_sleep and TP 2 for a real run, not for a plan."""
    import rlhforge.rollout.vllm_engine as ve

    monkeypatch.setattr(ve, "vllm_available", lambda: True)
    monkeypatch.setattr(ve, "vllm_is_cpu_build", lambda: True)
    cfg = parse_rl_args(_seed_argv(llama8b), validate=False)
    check_environment(cfg)
    real = parse_rl_args([a for a in _seed_argv(llama8b) if a != "--train.plan_only"], validate=False)
    with pytest.raises(ConfigError, match="--vllm.enable_sleep needs a GPU"):
        check_environment(real)
    with pytest.raises(ConfigError, match="--train.plan_only plans the Ray placement groups"):
        parse_rl_args([*_seed_argv(llama8b), "--train.workers", "local", "--actor.num_gpus_per_node", "1",
                       "--ref.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1"])


def test_several_reward_models_are_summed_per_reward_rank(tmp_path):
    from rlhforge.distributed.placement import plan_sizes
    from rlhforge.distributed.plan_report import report

    d = _folder(tmp_path, "tiny", TINY)
    argv = ["--actor.model_name_or_path", d, "--data.prompt_dataset", "builtin:arithmetic",
            "--reward.num_gpus_per_node", "2", "--reward.model_name_or_path", f"{d},{d}",
            "--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0", "--ds.param_dtype", "fp32",
            "--train.plan_only"]
    cfg = parse_rl_args(argv, validate=False)
    assert plan_sizes(cfg) == {"actor": 1, "reward": 2}
    text = report(cfg, plan_placement(plan_sizes(cfg), device="cpu"), strategy="deepspeed")
    reward = frozen_memory(2 * TINY_VALUE_PARAMS, world=2, zero_stage=2, dtype_bytes=4)
    assert f"params {_gib(reward.params)} = " in _row(text, "reward") and "0.00B" in _row(text, "reward")
    remote = parse_rl_args([*argv, "--reward.remote_url", "builtin:arithmetic"], validate=False)
    assert plan_sizes(remote) == {"actor": 1}  # a remote_url wins over the reward model
