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
from tests.distributed.conftest import declared_gpus
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


@pytest.fixture(scope="module")
def gpu8_cluster(ray_module):
    """Ray declared as one 8-GPU node (Ray accepts declared resources; nothing touches a GPU)."""
    with declared_gpus(ray_module, num_cpus=16, num_gpus=8) as ray:
        yield ray


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
    # ZeRO-2 keeps four whole bf16 8B models on every GPU (~60 GiB): only a 141 GB GPU leaves 0.5 for the engine
    assert rl_main([*_seed_argv(llama8b), "--train.gpu_memory_gib", "131"]) == 0
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


def test_plan_only_waits_for_what_a_moment_ago_still_held(gpu8_cluster, llama8b, capsys):
    """Ray hands back a finished task's (or a removed group's) resources asynchronously: right after
    ``ray.get`` of a task that held GPU, ``available_resources`` still reads them as taken (seen: ~0.1 s; the
    CI saw a plan refused for 7.99 free GPUs after the memory probe of the command before it). A task that
    holds one GPU for 2 s while plan_only starts: the plan waits for it, and places all 8 bundles."""
    import time

    @gpu8_cluster.remote(num_gpus=1, num_cpus=0)
    def hold(seconds):
        time.sleep(seconds)

    held = hold.remote(2.0)
    deadline = time.monotonic() + 60
    while gpu8_cluster.available_resources().get("GPU", 0) > 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gpu8_cluster.available_resources().get("GPU", 0) <= 7  # the task holds its GPU now
    start = time.monotonic()
    assert rl_main([*_seed_argv(llama8b), "--train.gpu_memory_gib", "131"]) == 0
    assert "placement plan: 8 GPU bundle(s) in 1 placement group(s)" in capsys.readouterr().out
    assert gpu8_cluster.get(held, timeout=1) is None and time.monotonic() - start < 30


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
    text, _ = report(cfg, plan_placement(plan_sizes(cfg), device="cpu"), strategy="deepspeed")
    reward = frozen_memory(2 * TINY_VALUE_PARAMS, world=2, zero_stage=2, dtype_bytes=4)
    assert f"params {_gib(reward.params)} = " in _row(text, "reward") and "0.00B" in _row(text, "reward")
    remote = parse_rl_args([*argv, "--reward.remote_url", "builtin:arithmetic"], validate=False)
    assert plan_sizes(remote) == {"actor": 1}  # a remote_url wins over the reward model


# -------------------------------------------------------------- engines sharing GPUs (gpu-review-2 F1)

# the seed's colocated 8-GPU PPO command (tests/reference/seeds/001_train_ppo_ray.txt, its first block), in
# OpenRLHF's own flags; the hub ids are replaced by a local folder holding Llama-3-8B's config.json
SEED_PPO_LEGACY = """--ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
 --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
 --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
 --pretrain MODEL --reward_pretrain MODEL --save_path ./output/llama3-8b-rlhf --micro_train_batch_size 8
 --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1
 --prompt_max_len 1024 --generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7
 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data builtin:arithmetic --input_key context_messages
 --apply_chat_template --normalize_reward --gradient_checkpointing --packing_samples --vllm_enable_sleep
 --deepspeed_enable_sleep"""


def _legacy_seed(model: str, util: str) -> list[str]:
    argv = SEED_PPO_LEGACY.replace("MODEL", model).split()
    argv[argv.index("--vllm_gpu_memory_utilization") + 1] = util
    return [*argv, "--train.plan_only"]


def test_the_seed_colocated_command_plans_at_half_and_is_refused_at_095(gpu8_cluster, llama8b, capsys):
    """ZeRO-3 over 8 GPUs, bf16, both sleeps: the models keep their parameter shards only,
    actor 8030261248 x 2 / 8 + ref the same + critic and reward 7504928768 x 2 / 8 = 7.23 GiB, plus 4 CUDA
    contexts x 0.5 GiB = 9.23 GiB per GPU. No GPU is visible here, so the GPU is taken as 80 GiB: 0.5 x 80 =
    40 GiB fits in 80 - 9.23 = 70.77; 0.95 x 80 = 76 GiB does not (the largest that fits is 0.88)."""
    resident = (2 * LLAMA8B_PARAMS * 2 + 2 * LLAMA8B_VALUE_PARAMS * 2) / 8 + 4 * 0.5 * GIB
    assert f"{resident / GIB:.2f}" == "9.23"
    assert rl_main(_legacy_seed(llama8b, "0.5")) == 0
    out = capsys.readouterr().out
    assert ("engines sharing GPUs: --vllm.gpu_memory_utilization 0.5 x 80.00 GiB (assumed: no GPU visible to "
            "measure; set --train.gpu_memory_gib) = 40.00 GiB for the engines; the models beside it keep 9.23 GiB on "
            "the busiest GPU (actor 1.87 + ref 1.87 + critic 1.75 + reward 1.75 GiB of parameters (--ds.enable_sleep "
            "offloads the rest) + 4 CUDA context(s) x 0.5 GiB): 80.00 - 9.23 = 70.77 GiB left for the engine: fits") \
        in out
    line = refused_line(rl_main, _legacy_seed(llama8b, "0.95"), capsys)
    assert "colocated vLLM engines cannot wake their KV cache beside the models" in line
    assert "0.95 x 80.00 GiB" in line and "= 76.00 GiB for the engines" in line and "70.77 GiB left" in line
    assert "does not fit" in line and "use --vllm.gpu_memory_utilization 0.88 or less" in line
    # the default (0.95, the legacy command without the flag) is refused the same way
    argv = _legacy_seed(llama8b, "0.95")
    i = argv.index("--vllm_gpu_memory_utilization")
    assert "0.95 x 80.00 GiB" in refused_line(rl_main, argv[:i] + argv[i + 2:], capsys)


def test_a_measured_or_given_gpu_size_replaces_the_assumption(gpu8_cluster, llama8b, capsys):
    """On a 141 GB GPU (131 GiB) the same command fits at 0.9: 0.9 x 131 = 117.9 <= 131 - 9.23."""
    assert rl_main([*_legacy_seed(llama8b, "0.9"), "--train.gpu_memory_gib", "131"]) == 0
    out = capsys.readouterr().out
    assert "0.9 x 131.00 GiB (--train.gpu_memory_gib) = 117.90 GiB" in out and "121.77 GiB left" in out


def test_without_deepspeed_sleep_the_whole_training_state_stays(tmp_path):
    """No --ds.enable_sleep: gradients and Adam stay beside the engine (the GRPO seed: actor + ref + reward)."""
    from rlhforge.distributed.plan_report import check_engine_memory, engine_memory_check

    plan = plan_placement({"actor": 8, "ref": 8, "reward": 8}, device="cuda", colocate_all=True, num_engines=4,
                          engine_tp=2)
    counts = {"actor": (LLAMA8B_PARAMS, LLAMA8B_PARAMS), "ref": (LLAMA8B_PARAMS, LLAMA8B_PARAMS),
              "reward": (LLAMA8B_VALUE_PARAMS, LLAMA8B_VALUE_PARAMS)}
    rows = memory_rows(plan, counts, dtype_bytes=2, zero_stage=3, adam_offload=False)
    check = engine_memory_check(plan, rows, device_bytes=80 * GIB, util=0.5, model_sleep=False)
    actor = LLAMA8B_PARAMS * (2 + 2 + 12) / 8  # params, grads, fp32 master + 2 moments, all / 8 under ZeRO-3
    frozen = (LLAMA8B_PARAMS + LLAMA8B_VALUE_PARAMS) * 2 / 8
    assert check.resident == pytest.approx(actor + frozen + 3 * 0.5 * GIB)
    assert check.fits and check.max_util == 0.74  # (80 - 20.08) / 80 = 0.749
    with pytest.raises(ConfigError, match=r"use --vllm.gpu_memory_utilization 0.74 or less"):
        check_engine_memory(engine_memory_check(plan, rows, device_bytes=80 * GIB, util=0.75, model_sleep=False))
    # engines on their own GPUs (no colocation), or CPU bundles: nothing to check
    apart = plan_placement({"actor": 8, "ref": 8}, device="cuda", num_engines=4, engine_tp=2)
    assert engine_memory_check(apart, memory_rows(apart, counts, dtype_bytes=2, zero_stage=3, adam_offload=False),
                               device_bytes=80 * GIB, util=0.95, model_sleep=False) is None


def test_colocated_gpu_engines_need_an_actor_rank_on_every_engine_gpu():
    """gpu-review-2 F6: a colocated engine loads by CUDA IPC from the actor rank on its GPU; engines on GPUs
    that only the reward model uses would fail at the first sync (and be restarted, in vain)."""
    with pytest.raises(ConfigError, match=r"4 engines x TP 1 = 4 GPUs, but the actor has 2 rank\(s\).*use at most 2 "
                                          r"engine\(s\) at TP 1"):
        plan_placement({"actor": 2, "reward": 4}, device="cuda", colocate_all=True, num_engines=4, engine_tp=1)
    plan_placement({"actor": 2, "reward": 4}, device="cuda", colocate_all=True, num_engines=2, engine_tp=1)
    plan_placement({"actor": 2, "reward": 4}, device="cpu", colocate_all=True, num_engines=4, engine_tp=1)  # gloo


def test_the_driver_engine_and_the_models_share_one_gpu(tiny_model_dir, tmp_path, capsys):
    """Local mode on one GPU: the driver's engine(s) and the actor (+ ref) sit on cuda:0. The tiny model's
    bytes are negligible: two CUDA contexts (actor, ref) leave 24 - 1 = 23 GiB, so 0.95 x 24 = 22.8 fits,
    0.97 x 24 = 23.28 does not, nor do two engines at 0.5 (24 GiB)."""
    from rlhforge.distributed.plan_report import check_driver_engines
    from tests.rl.helpers import rl_args

    def cfg(*extra):
        return parse_rl_args(rl_args(tiny_model_dir, tmp_path / "run", "--train.gpu_memory_gib", "24",
                                     "--algo.kl.init_coef", "0.01", *extra), validate=False)

    check_driver_engines(cfg("--vllm.gpu_memory_utilization", "0.95", "--vllm.num_engines", "1"), "torch",
                         log=lambda m: None)
    with pytest.raises(ConfigError, match=r"0.97 x 24.00 GiB \(--train.gpu_memory_gib\) = 23.28 GiB .*"
                                          r"use --vllm.gpu_memory_utilization 0.95 or less"):
        check_driver_engines(cfg("--vllm.gpu_memory_utilization", "0.97", "--vllm.num_engines", "1"), "torch")
    with pytest.raises(ConfigError, match=r"0.5 x 24.00 GiB \(--train.gpu_memory_gib\) x 2 engines = 24.00 GiB"):
        check_driver_engines(cfg("--vllm.gpu_memory_utilization", "0.5", "--vllm.num_engines", "2"), "torch")
