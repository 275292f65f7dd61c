"""RL configuration: OpenRLHF flag names, 0.9 aliases, the seed command lines, validation, batch plan, examples."""

import dataclasses
import typing
from pathlib import Path

import pytest

from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.cli.train_ppo_ray import parse_rl_args
from rlhforge.config.batching import plan_rl_batches
from rlhforge.config.parsing import ConfigError, load_yaml
from rlhforge.config.rl import RLConfig

ROOT = Path(__file__).parents[2]
#: the OpenRLHF train_ppo_ray command blocks of the seed texts (tests/reference/extract.py writes them)
SEED_BLOCKS = ROOT / "tests" / "reference" / "seeds"
BASE = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "builtin:arithmetic",
        "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8"]


def _field_exists(dotted: str) -> bool:
    cls = RLConfig
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
        args = [a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)]
        cls = args[0] if args else cls
    return True


def test_every_train_ppo_ray_flag_of_openrlhf_exists():
    from tests.flag_tables import openrlhf_flags

    flags = [flag[2:] for flag, _, _ in openrlhf_flags("train_ppo_ray")]
    assert len(flags) == 139
    missing = [f for f in flags if not _field_exists(f)]
    assert missing == []


def _seed_commands() -> list[list[str]]:
    text = (SEED_BLOCKS / "001_train_ppo_ray.txt").read_text()
    commands = []
    for block in text.split("python3 -m openrlhf.cli.train_ppo_ray")[1:]:
        lines = []
        for line in block.splitlines()[1:]:
            line = line.strip()
            if not line.startswith("--"):
                break
            lines.append(line.rstrip("\\").strip())
        commands.append(" ".join(lines).split())
    return commands


DOTTED_PPO = """--ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
 --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
 --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
 --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k
 --ckpt.output_dir ./output/llama3-8b-rlhf --train.micro_batch_size 8 --train.batch_size 128
 --rollout.micro_batch_size 16 --rollout.batch_size 1024 --train.max_epochs 1 --data.prompt_max_len 1024
 --rollout.max_new_tokens 1024 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6
 --algo.kl.init_coef 0.01 --reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples
 --vllm.enable_sleep --ds.enable_sleep"""
DOTTED_PPO2 = """--ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
 --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
 --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all
 --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path ./output/llama3-8b-rm
 --ckpt.output_dir ./output/llama3-8b-ppo --train.micro_batch_size 8 --train.batch_size 128
 --rollout.micro_batch_size 16 --rollout.batch_size 1024 --train.max_epochs 1 --data.prompt_max_len 1024
 --rollout.max_new_tokens 1024 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6
 --algo.kl.init_coef 0.01 --reward.normalize_enable --vllm.enable_sleep --ds.enable_sleep"""
DOTTED_GRPO = """--algo.advantage.estimator group_norm --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1
 --reward.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8 --vllm.num_engines 4
 --vllm.tensor_parallel_size 2 --train.colocate_all --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture
 --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k --ckpt.output_dir ./output/llama3-8b-grpo
 --train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 1024
 --train.max_epochs 1 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --algo.kl.init_coef 0.01 --algo.kl.use_loss
 --algo.kl.estimator k3 --reward.normalize_enable --algo.advantage.no_std_norm"""


def test_seed_command_lines_resolve_like_their_dotted_equivalents():
    commands = _seed_commands()
    assert len(commands) == 3
    notes = []
    for legacy, dotted in zip(commands, (DOTTED_PPO, DOTTED_PPO2, DOTTED_GRPO)):
        a = parse_rl_args(legacy, validate=False, warn=notes.append)
        b = parse_rl_args(dotted.split(), validate=False, warn=lambda m: pytest.fail(f"unexpected notice {m}"))
        assert a == b
    assert notes and all("deprecated" in n for n in notes)
    # validated here, the GPU-only parts of the first one fail loudly (vLLM missing, or its CPU build)
    with pytest.raises(ConfigError, match=r"needs vLLM, which does not import here|--vllm.enable_sleep needs a GPU"):
        parse_rl_args(commands[0] + ["--prompt_data", "p.jsonl"])


def test_vllm_flag_validation():
    from rlhforge.rollout.vllm_engine import vllm_available

    with pytest.raises(ConfigError, match=r"--vllm.num_engines must be >= 0 \(got -1"):
        parse_rl_args(BASE + ["--vllm.num_engines", "-1"])
    with pytest.raises(ConfigError, match=r"with QLoRA \(--ds.load_in_4bit\) would need its 4-bit base dequantised"):
        parse_rl_args(BASE + ["--vllm.num_engines", "1", "--ds.lora.rank", "4", "--ds.load_in_4bit"])
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        parse_rl_args(BASE + ["--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "1.5"])
    assert parse_rl_args(BASE + ["--vllm.num_engines", "0"]).vllm.num_engines == 0  # 0: the HF engine
    if not vllm_available():
        with pytest.raises(ConfigError, match=r"--vllm.num_engines 1 needs vLLM, which does not import here"):
            parse_rl_args(BASE + ["--vllm.num_engines", "1"])


@pytest.mark.parametrize("extra, message", [
    (["--train.async_queue_size", "2"], "--train.async_queue_size needs --train.async_enable"),
    (["--train.async_enable", "--train.async_queue_size", "0"], r"async_queue_size must be >= 1 \(got 0\)"),
    (["--train.partial_rollout_enable"], "--train.partial_rollout_enable needs --train.async_enable"),
    (["--train.agent_env_concurrency", "0"], "agent_env_concurrency must be >= 1"),
    (["--train.workers", "local", "--actor.num_gpus_per_node", "2"], "use --train.workers ray"),
    (["--actor.num_gpus_per_node", "3"], r"must be divisible by --train.micro_batch_size x actor workers \(1 x 3 = 3\)"),
    (["--actor.num_gpus_per_node", "2", "--ds.lora.rank", "4", "--ds.load_in_4bit"], "QLoRA .* with Ray worker groups"),
    (["--actor.num_gpus_per_node", "0"], r"must be >= 1 \(got 1 and 0\)"),
    (["--algo.advantage.estimator", "group_norm"], r"group_norm needs rollout.n_samples_per_prompt > 1 \(got 1\)"),
    (["--actor.dual_clip", "0.5"], "dual_clip must be > 1"),
    (["--train.batch_size", "3"], r"rollout.batch_size 8 x rollout.n_samples_per_prompt 1 = 8 samples per step is not "
                                  r"divisible by train.batch_size 3"),
    (["--algo.advantage.estimator", "nope"], None),
])
def test_validation_messages(extra, message):
    if message is None:
        with pytest.raises(SystemExit):
            parse_rl_args(BASE + extra)
        return
    with pytest.raises(ConfigError, match=message):
        parse_rl_args(BASE + extra)


def test_no_reward_source_is_an_error():
    with pytest.raises(ConfigError, match="no reward source"):
        parse_rl_args(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "x.jsonl"])


def test_rl_batch_plan_arithmetic():
    plan = plan_rl_batches(rollout_batch_size=16, n_samples_per_prompt=4, train_batch_size=32, micro_batch_size=4,
                           rollout_micro_batch_size=8, world_size=2, num_prompts=100, num_episodes=2, max_epochs=2)
    # 16 x 4 = 64 samples/step -> 2 optimizer steps/epoch, x2 epochs = 4/step; 32 / (4 x 2 ranks) = 4 micro-batches
    # 100 // 16 = 6 steps/episode x 2 episodes = 12 steps; 48 optimizer steps
    assert (plan.rollout_samples, plan.updates_per_epoch, plan.updates_per_step, plan.grad_accum_steps,
            plan.steps_per_episode, plan.total_steps, plan.total_updates) == (64, 2, 4, 4, 6, 12, 48)
    with pytest.raises(ConfigError, match=r"train.batch_size 32 is not divisible by train.micro_batch_size 3 x 2 ranks"):
        plan_rl_batches(rollout_batch_size=16, n_samples_per_prompt=4, train_batch_size=32, micro_batch_size=3,
                        rollout_micro_batch_size=8, world_size=2, num_prompts=100)
    with pytest.raises(ConfigError, match="has 10 prompts, fewer than one RL step"):
        plan_rl_batches(rollout_batch_size=16, n_samples_per_prompt=4, train_batch_size=32, micro_batch_size=4,
                        rollout_micro_batch_size=8, world_size=1, num_prompts=10)


def test_rl_batch_plan_is_computed_once_and_gives_each_group_its_strategy_plan():
    from rlhforge.config.batching import plan_rl_run

    cfg = parse_rl_args(BASE + ["--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "4",
                                "--train.batch_size", "32", "--train.micro_batch_size", "4"])
    plan = plan_rl_run(cfg, world_size=2, num_prompts=100)
    assert (plan.batch_size, plan.micro_batch_size, plan.world_size, plan.grad_accum_steps) == (32, 4, 2, 4)
    assert (plan.train_tokens, plan.pass_tokens) == (None, None)
    actor = plan.strategy_plan(plan.world_size)  # the actor's: the plan's own accumulation
    assert (actor.batch_size, actor.world_size, actor.micro_batch_size, actor.grad_accum_steps,
            actor.per_rank_batch, actor.total_steps) == (32, 2, 4, 4, 16, plan.total_updates)
    assert plan.strategy_plan(4).grad_accum_steps == 2  # a critic group of 4 ranks: 32 / (4 x 4)
    assert plan.strategy_plan(16).grad_accum_steps == 1  # never below one micro-batch
    dyn = plan_rl_run(parse_rl_args(BASE + ["--train.dynamic_batch_enable", "--ds.packing_samples",
                                    "--train.max_tokens_per_gpu", "64"]),
                      world_size=1, num_prompts=None)
    assert (dyn.micro_batch_size, dyn.train_tokens, dyn.pass_tokens, dyn.strategy_plan(1).total_steps) == (1, 64, 64, 1)


MY_EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name.startswith(("rl_", "ppo_")))


@pytest.mark.parametrize("path", MY_EXAMPLES, ids=lambda p: p.name)
def test_rl_examples_parse_and_validate(path):
    assert "rlhforge.cli.train_ppo_ray" in path.read_text().splitlines()[0]
    load_yaml(RLConfig, path).validate()


def test_rl_examples_exist():
    names = {p.stem for p in MY_EXAMPLES}
    assert {"ppo_reward_model", "ppo_reward_func", "rl_grpo", "rl_dapo", "rl_reinforce_baseline", "rl_rloo",
            "rl_dr_grpo", "rl_gspo"} <= names


def _tiny_reward_model(model_dir, out):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, pad_token_id=tok.pad_token_id)
    rm.config.reward_mean, rm.config.reward_std = 0.1, 2.0
    rm.save_pretrained(out)
    tok.save_pretrained(out)
    return out


SHRINK = {"--pretrain": None, "--reward_pretrain": None, "--save_path": None, "--micro_train_batch_size": "2",
          "--train_batch_size": "4", "--micro_rollout_batch_size": "4", "--rollout_batch_size": "2",
          "--prompt_max_len": "48", "--generate_max_len": "6",
          **{f"--{m}_num_gpus_per_node": "1" for m in ("actor", "critic", "ref", "reward")}}  # one in-process worker each
DROP = {"--vllm_num_engines": 1, "--vllm_tensor_parallel_size": 1, "--vllm_gpu_memory_utilization": 1,
        "--vllm_enable_sleep": 0, "--deepspeed_enable_sleep": 0}


@pytest.mark.parametrize("which", [0, 2], ids=["ppo_rm", "grpo_kl_loss"])
def test_seed_command_lines_run_shrunk_to_a_tiny_model(tiny_model_dir, tmp_path, which):
    """The seed's flags, with sizes shrunk (one worker per model), model paths replaced, GPU-only vLLM/sleep
    flags dropped and a prompt dataset added (the seed has none)."""
    rm = _tiny_reward_model(tiny_model_dir, tmp_path / "rm")
    paths = {"--pretrain": str(tiny_model_dir), "--reward_pretrain": str(rm), "--save_path": str(tmp_path / "out")}
    cmd, argv, i = _seed_commands()[which], [], 0
    while i < len(cmd):
        flag = cmd[i]
        if flag in DROP:
            i += 1 + DROP[flag]
            continue
        takes_value = i + 1 < len(cmd) and not cmd[i + 1].startswith("--")
        argv.append(flag)
        if takes_value:
            argv.append(paths.get(flag) or SHRINK.get(flag) or cmd[i + 1])
            i += 2
        else:
            i += 1
    argv += ["--prompt_data", "builtin:arithmetic?n=8", "--input_key", "prompt", "--label_key", "answer",
             "--apply_chat_template", "--ckpt_path", str(tmp_path / "ckpt"), "--train.max_steps", "1",
             "--n_samples_per_prompt", "2"]
    assert rl_main(argv) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("kind, expected", [("tis", ("token", "clip", "ratio")), ("icepop", ("token", "mask", "ratio")),
                                            ("seq-mask-tis", ("seq", "mask", "ratio"))])
def test_openrlhf_0_10_is_correction_names_are_aliases(kind, expected):
    notes = []
    cfg = parse_rl_args(BASE + ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", kind,
                                "--algo.advantage.is_correction_threshold", "0.8", "2.0"], warn=notes.append)
    adv = cfg.algo.advantage
    assert (adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating) == expected
    assert adv.is_correction_threshold == (0.8, 2.0)
    assert notes and "0.10 names" in notes[0]


def test_is_correction_type_alone_or_unknown():
    assert parse_rl_args(BASE + ["--algo.advantage.is_correction_type", "icepop"]).algo.advantage.is_correction_level == "off"
    assert parse_rl_args(BASE + ["--algo.advantage.is_correction_enable"]).algo.advantage.is_correction_mode == "clip"
    with pytest.raises(ConfigError, match=r"is_correction_type must be one of tis, icepop, seq-mask-tis \(got tv\)"):
        parse_rl_args(BASE + ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "tv"])
